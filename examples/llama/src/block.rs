//! One transformer block: RMSNorm → attention → residual → RMSNorm → SwiGLU
//! → residual.

use super::ops::*;
use super::Config;

/// Parameters of one block as plain slices, HF shapes:
/// `wq` `[n_heads*hd, dim]`, `wk`/`wv` `[n_kv_heads*hd, dim]`, `wo`
/// `[dim, n_heads*hd]`, `gate`/`up` `[hidden, dim]`, `down` `[dim, hidden]`,
/// norms `[dim]`.
#[derive(Clone, Copy)]
pub struct BlockParams<'a> {
    /// `self_attn.q_proj`.
    pub wq: &'a [f32],
    /// `self_attn.k_proj`.
    pub wk: &'a [f32],
    /// `self_attn.v_proj`.
    pub wv: &'a [f32],
    /// `self_attn.o_proj`.
    pub wo: &'a [f32],
    /// `mlp.gate_proj`.
    pub gate: &'a [f32],
    /// `mlp.up_proj`.
    pub up: &'a [f32],
    /// `mlp.down_proj`.
    pub down: &'a [f32],
    /// `input_layernorm`.
    pub attn_norm: &'a [f32],
    /// `post_attention_layernorm`.
    pub mlp_norm: &'a [f32],
    /// `self_attn.q_proj.bias` (Qwen2), `[n_heads*hd]`.
    pub bq: Option<&'a [f32]>,
    /// `self_attn.k_proj.bias`, `[n_kv_heads*hd]`.
    pub bk: Option<&'a [f32]>,
    /// `self_attn.v_proj.bias`, `[n_kv_heads*hd]`.
    pub bv: Option<&'a [f32]>,
}

impl<'a> BlockParams<'a> {
    /// From slices in [`super::block_tensors`] order (q, k, v, o, gate, up,
    /// down, input_layernorm, post_attention_layernorm, then the q, k and v
    /// biases when there are 12).
    pub fn from_slices(p: &[&'a [f32]]) -> Self {
        assert!(
            p.len() == 9 || p.len() == 12,
            "a block has 9 tensors, or 12 with q/k/v biases, not {}",
            p.len()
        );
        let bias = |i: usize| p.get(i).copied();
        BlockParams {
            wq: p[0],
            wk: p[1],
            wv: p[2],
            wo: p[3],
            gate: p[4],
            up: p[5],
            down: p[6],
            attn_norm: p[7],
            mlp_norm: p[8],
            bq: bias(9),
            bk: bias(10),
            bv: bias(11),
        }
    }
}

/// Parameter gradients of one block, same order as [`BlockParams`].
pub struct BlockGrads {
    /// Gradient of `self_attn.q_proj`.
    pub wq: Vec<f32>,
    /// Gradient of `self_attn.k_proj`.
    pub wk: Vec<f32>,
    /// Gradient of `self_attn.v_proj`.
    pub wv: Vec<f32>,
    /// Gradient of `self_attn.o_proj`.
    pub wo: Vec<f32>,
    /// Gradient of `mlp.gate_proj`.
    pub gate: Vec<f32>,
    /// Gradient of `mlp.up_proj`.
    pub up: Vec<f32>,
    /// Gradient of `mlp.down_proj`.
    pub down: Vec<f32>,
    /// Gradient of `input_layernorm`.
    pub attn_norm: Vec<f32>,
    /// Gradient of `post_attention_layernorm`.
    pub mlp_norm: Vec<f32>,
    /// Gradients of the q, k and v biases, when the block has them.
    pub qkv_bias: Option<[Vec<f32>; 3]>,
}

impl BlockGrads {
    /// In [`super::block_tensors`] order.
    pub fn into_vec(self) -> Vec<Vec<f32>> {
        let mut v = vec![
            self.wq,
            self.wk,
            self.wv,
            self.wo,
            self.gate,
            self.up,
            self.down,
            self.attn_norm,
            self.mlp_norm,
        ];
        v.extend(self.qkv_bias.into_iter().flatten());
        v
    }
}

/// Activations saved by [`Block::forward`] for the backward pass.
pub struct BlockCache {
    /// Sequences in the batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The block input `[rows, dim]`.
    pub x: Vec<f32>,
    /// The attention norm's output.
    pub xn1: Vec<f32>,
    /// The attention norm's `1 / rms` per row.
    pub inv1: Vec<f32>,
    /// Queries after RoPE `[rows, n_heads * head_dim]`.
    pub q: Vec<f32>,
    /// Keys after RoPE `[rows, n_kv_heads * head_dim]`.
    pub k: Vec<f32>,
    /// Values `[rows, n_kv_heads * head_dim]`.
    pub v: Vec<f32>,
    /// Attention probabilities (causal softmax) per head.
    pub probs: Vec<f32>,
    /// Attention output before `o_proj`.
    pub attn: Vec<f32>,
    /// The residual stream after attention: `x + o_proj(attn)`.
    pub h: Vec<f32>,
    /// The MLP norm's output.
    pub xn2: Vec<f32>,
    /// The MLP norm's `1 / rms` per row.
    pub inv2: Vec<f32>,
    /// The SwiGLU's activations.
    pub mlp: SwigluCache,
    /// The block output.
    pub y: Vec<f32>,
}

/// Block hyper-parameters plus the rotary tables; stateless otherwise.
pub struct Block {
    /// Hyper-parameters.
    pub cfg: Config,
    /// The rotary tables.
    pub rope: Rope,
    /// Threads of the GEMMs.
    pub threads: usize,
}

impl Block {
    /// A block of `cfg`, GEMMs on `threads` threads.
    pub fn new(cfg: Config, threads: usize) -> Self {
        let rope = Rope::new(cfg.head_dim(), cfg.max_seq, cfg.rope_theta);
        Block { cfg, rope, threads }
    }

    fn shape(&self, batch: usize, seq: usize) -> AttnShape {
        AttnShape {
            batch,
            seq,
            n_heads: self.cfg.n_heads,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim(),
        }
    }

    /// `x` is `[batch * seq, dim]`; the output is `cache.y`.
    pub fn forward(&self, p: &BlockParams, x: &[f32], batch: usize, seq: usize) -> BlockCache {
        let c = &self.cfg;
        let (dim, rows, th) = (c.dim, batch * seq, self.threads);
        assert_eq!(x.len(), rows * dim);
        let (qd, kd) = (c.n_heads * c.head_dim(), c.n_kv_heads * c.head_dim());
        let (xn1, inv1) = rmsnorm_forward(x, p.attn_norm, c.norm_eps);
        let mut q = linear_forward(&xn1, p.wq, rows, dim, qd, th);
        let mut k = linear_forward(&xn1, p.wk, rows, dim, kd, th);
        let mut v = linear_forward(&xn1, p.wv, rows, dim, kd, th);
        for (y, b) in [(&mut q, p.bq), (&mut k, p.bk), (&mut v, p.bv)] {
            if let Some(b) = b {
                add_bias(y, b);
            }
        }
        self.rope.forward(&mut q, seq, c.n_heads);
        self.rope.forward(&mut k, seq, c.n_kv_heads);
        let (attn, probs) = attention_forward(&q, &k, &v, self.shape(batch, seq), th);
        let mut h = x.to_vec();
        matmul(
            &mut h,
            &attn,
            p.wo,
            Mm::new(rows, dim, qd).tb().acc().threads(th),
        );
        let (xn2, inv2) = rmsnorm_forward(&h, p.mlp_norm, c.norm_eps);
        let (m, mlp) = swiglu_forward(&xn2, p.gate, p.up, p.down, dim, c.hidden, th);
        let y: Vec<f32> = h.iter().zip(&m).map(|(a, b)| a + b).collect();
        BlockCache {
            batch,
            seq,
            x: x.to_vec(),
            xn1,
            inv1,
            q,
            k,
            v,
            probs,
            attn,
            h,
            xn2,
            inv2,
            mlp,
            y,
        }
    }

    /// Returns `dx` and the parameter gradients for the output gradient `dy`.
    pub fn backward(
        &self,
        p: &BlockParams,
        cache: &BlockCache,
        dy: &[f32],
    ) -> (Vec<f32>, BlockGrads) {
        let c = &self.cfg;
        let (dim, th) = (c.dim, self.threads);
        let rows = cache.batch * cache.seq;
        let (qd, kd) = (c.n_heads * c.head_dim(), c.n_kv_heads * c.head_dim());
        let mut attn_norm = vec![0.0; dim];
        let mut mlp_norm = vec![0.0; dim];
        // MLP branch.
        let mut dxn2 = vec![0.0; rows * dim];
        let sg = swiglu_backward(
            dy,
            &cache.xn2,
            &cache.mlp,
            p.gate,
            p.up,
            p.down,
            &mut dxn2,
            (dim, c.hidden),
            th,
        );
        let mut dh = dy.to_vec();
        rmsnorm_backward(
            &dxn2,
            &cache.h,
            p.mlp_norm,
            &cache.inv2,
            &mut dh,
            &mut mlp_norm,
        );
        // Attention branch.
        let mut wo = vec![0.0; p.wo.len()];
        let mut dattn = vec![0.0; rows * qd];
        linear_backward(
            &dh,
            &cache.attn,
            p.wo,
            &mut wo,
            &mut dattn,
            (rows, qd, dim),
            th,
        );
        let (mut dq, mut dk, dv) = attention_backward(
            &dattn,
            &cache.q,
            &cache.k,
            &cache.v,
            &cache.probs,
            self.shape(cache.batch, cache.seq),
            th,
        );
        self.rope.backward(&mut dq, cache.seq, c.n_heads);
        self.rope.backward(&mut dk, cache.seq, c.n_kv_heads);
        // The biases' gradients: column sums of the projections' output
        // gradients (before RoPE, where the bias is added).
        let qkv_bias = p.bq.map(|_| {
            let mut g = [vec![0.0; qd], vec![0.0; kd], vec![0.0; kd]];
            for (gb, d) in g.iter_mut().zip([&dq, &dk, &dv]) {
                bias_backward(d, gb);
            }
            g
        });
        let mut dxn1 = vec![0.0; rows * dim];
        let mut wq = vec![0.0; p.wq.len()];
        let mut wk = vec![0.0; p.wk.len()];
        let mut wv = vec![0.0; p.wv.len()];
        linear_backward(
            &dq,
            &cache.xn1,
            p.wq,
            &mut wq,
            &mut dxn1,
            (rows, dim, qd),
            th,
        );
        linear_backward(
            &dk,
            &cache.xn1,
            p.wk,
            &mut wk,
            &mut dxn1,
            (rows, dim, kd),
            th,
        );
        linear_backward(
            &dv,
            &cache.xn1,
            p.wv,
            &mut wv,
            &mut dxn1,
            (rows, dim, kd),
            th,
        );
        let mut dx = dh;
        rmsnorm_backward(
            &dxn1,
            &cache.x,
            p.attn_norm,
            &cache.inv1,
            &mut dx,
            &mut attn_norm,
        );
        let grads = BlockGrads {
            wq,
            wk,
            wv,
            wo,
            gate: sg.w1,
            up: sg.w3,
            down: sg.w2,
            attn_norm,
            mlp_norm,
            qkv_bias,
        };
        (dx, grads)
    }
}
