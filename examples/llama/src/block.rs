//! One transformer block: RMSNorm → attention → residual → RMSNorm → SwiGLU
//! → residual.

use super::lora::{self, LoraCache, LoraConfig, LoraDims, TARGETS};
use super::ops::*;
use super::Config;

/// The LoRA adapters of one block: `(A, B)` per module of [`TARGETS`]
/// (`None` where the module is not a target), PEFT's shapes (`A` `[r,
/// d_in]`, `B` `[d_out, r]`). With adapters the block's base weights are
/// frozen: [`Block::backward`] computes no gradient for them, only the
/// input gradient through them and the adapters' gradients.
#[derive(Clone, Copy)]
pub struct BlockLora<'a> {
    /// Rank, scale, dropout and targets.
    pub cfg: &'a LoraConfig,
    /// `(A, B)` per module of [`TARGETS`].
    pub ab: [Option<(&'a [f32], &'a [f32])>; 7],
    /// The dropout key of this block in this micro-batch
    /// ([`lora::dropout_key`]); `None`: no dropout (evaluation).
    pub dropout_key: Option<u64>,
}

impl<'a> BlockLora<'a> {
    /// From slices in [`lora::lora_tensors`] order (`A`, `B` per target).
    pub fn from_slices(cfg: &'a LoraConfig, p: &[&'a [f32]], dropout_key: Option<u64>) -> Self {
        assert_eq!(
            p.len(),
            2 * cfg.targets.len(),
            "an A and a B per target module"
        );
        let mut ab = [None; 7];
        let mut it = p.chunks_exact(2);
        for (slot, (m, _)) in ab.iter_mut().zip(TARGETS) {
            if cfg.targets(m) {
                let pair = it.next().expect("an A and a B per target module");
                *slot = Some((pair[0], pair[1]));
            }
        }
        BlockLora {
            cfg,
            ab,
            dropout_key,
        }
    }
}

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
    /// LoRA adapters; with them the base weights above are frozen.
    pub lora: Option<BlockLora<'a>>,
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
            lora: None,
        }
    }

    /// The same parameters with adapters `lora`.
    pub fn with_lora(self, lora: BlockLora<'a>) -> Self {
        BlockParams {
            lora: Some(lora),
            ..self
        }
    }
}

/// Parameter gradients of one block, same order as [`BlockParams`]. With
/// LoRA the base weights are frozen: their fields are empty and
/// `qkv_bias` is `None`; the gradients are in `lora`.
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
    /// `(dA, dB)` per module of [`TARGETS`] that has an adapter.
    pub lora: [Option<(Vec<f32>, Vec<f32>)>; 7],
}

impl BlockGrads {
    /// Elements held, every gradient together (base weights, biases and
    /// adapters).
    pub fn numel(&self) -> usize {
        let base = [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.gate,
            &self.up,
            &self.down,
            &self.attn_norm,
            &self.mlp_norm,
        ];
        let bias = self.qkv_bias.iter().flatten();
        let lora = self.lora.iter().flatten().flat_map(|(a, b)| [a, b]);
        base.into_iter().chain(bias).chain(lora).map(Vec::len).sum()
    }

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

    /// The adapters' gradients in [`lora::lora_tensors`] order (`dA`, `dB`
    /// per target module).
    pub fn lora_vec(self) -> Vec<Vec<f32>> {
        self.lora
            .into_iter()
            .flatten()
            .flat_map(|(a, b)| [a, b])
            .collect()
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
    /// The adapters' saved state per module of [`TARGETS`].
    pub lora: [Option<LoraCache>; 7],
}

impl BlockCache {
    /// Bytes of the saved activations.
    pub fn bytes(&self) -> u64 {
        let n = self.x.len()
            + self.xn1.len()
            + self.inv1.len()
            + self.q.len()
            + self.k.len()
            + self.v.len()
            + self.probs.len()
            + self.attn.len()
            + self.h.len()
            + self.xn2.len()
            + self.inv2.len()
            + self.mlp.h1.len()
            + self.mlp.h3.len()
            + self.mlp.a.len()
            + self.y.len()
            + self
                .lora
                .iter()
                .flatten()
                .map(|c| c.xa.len() + c.mask.as_ref().map_or(0, Vec::len))
                .sum::<usize>();
        4 * n as u64
    }
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
        let mut lc: [Option<LoraCache>; 7] = Default::default();
        self.adapt(p, 0, &xn1, &mut q, &mut lc);
        self.adapt(p, 1, &xn1, &mut k, &mut lc);
        self.adapt(p, 2, &xn1, &mut v, &mut lc);
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
        self.adapt(p, 3, &attn, &mut h, &mut lc);
        let (xn2, inv2) = rmsnorm_forward(&h, p.mlp_norm, c.norm_eps);
        let (m, mlp) = if p.lora.is_some() {
            // swiglu_forward's steps, with the adapters after each projection.
            let mut h1 = linear_forward(&xn2, p.gate, rows, dim, c.hidden, th);
            self.adapt(p, 4, &xn2, &mut h1, &mut lc);
            let mut h3 = linear_forward(&xn2, p.up, rows, dim, c.hidden, th);
            self.adapt(p, 5, &xn2, &mut h3, &mut lc);
            let a = swiglu_act(&h1, &h3);
            let mut m = linear_forward(&a, p.down, rows, c.hidden, dim, th);
            self.adapt(p, 6, &a, &mut m, &mut lc);
            (m, SwigluCache { h1, h3, a })
        } else {
            swiglu_forward(&xn2, p.gate, p.up, p.down, dim, c.hidden, th)
        };
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
            lora: lc,
        }
    }

    /// The dims of module `i` of [`TARGETS`] for `rows` inputs.
    fn lora_dims(&self, l: &BlockLora, i: usize, rows: usize) -> LoraDims {
        let (d_in, d_out) = lora::module_dims(&self.cfg, TARGETS[i].0).expect("a TARGETS module");
        LoraDims {
            rows,
            d_in,
            d_out,
            r: l.cfg.r,
            scale: l.cfg.scale(),
        }
    }

    /// Adds module `i`'s adapter output (if it has one) to `y`, its base
    /// output for input `x`, and keeps what its backward needs in `lc`.
    fn adapt(
        &self,
        p: &BlockParams,
        i: usize,
        x: &[f32],
        y: &mut [f32],
        lc: &mut [Option<LoraCache>; 7],
    ) {
        let Some(l) = &p.lora else { return };
        let Some((a, b)) = l.ab[i] else { return };
        let d_in = lora::module_dims(&self.cfg, TARGETS[i].0)
            .expect("a TARGETS module")
            .0;
        let d = self.lora_dims(l, i, x.len() / d_in);
        let mask = l
            .dropout_key
            .and_then(|k| lora::dropout_mask(x.len(), l.cfg.dropout, lora::mix(&[k, i as u64])));
        lc[i] = Some(lora::forward(x, a, b, y, mask, d, self.threads));
    }

    /// Backward of a frozen linear layer `i` of [`TARGETS`] with its
    /// adapter: `dx += dy W` (no gradient for `W`), plus the adapter's
    /// share of `dx` and its `(dA, dB)`.
    #[allow(clippy::too_many_arguments)]
    fn frozen_linear_backward(
        &self,
        l: &BlockLora,
        cache: &BlockCache,
        i: usize,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        dx: &mut [f32],
        grads: &mut [Option<(Vec<f32>, Vec<f32>)>; 7],
    ) {
        let (d_in, d_out) = lora::module_dims(&self.cfg, TARGETS[i].0).expect("a TARGETS module");
        let rows = x.len() / d_in;
        matmul(
            dx,
            dy,
            w,
            Mm::new(rows, d_in, d_out).acc().threads(self.threads),
        );
        if let (Some((a, b)), Some(c)) = (l.ab[i], &cache.lora[i]) {
            let mut da = vec![0.0; a.len()];
            let mut db = vec![0.0; b.len()];
            let d = self.lora_dims(l, i, rows);
            lora::backward(dy, x, a, b, c, &mut da, &mut db, dx, d, self.threads);
            grads[i] = Some((da, db));
        }
    }

    /// [`Block::backward`] with adapters: the base weights are frozen, so
    /// only the input gradient flows through them.
    fn backward_lora(
        &self,
        p: &BlockParams,
        l: &BlockLora,
        cache: &BlockCache,
        dy: &[f32],
    ) -> (Vec<f32>, BlockGrads) {
        let c = &self.cfg;
        let (dim, hidden) = (c.dim, c.hidden);
        let rows = cache.batch * cache.seq;
        let qd = c.n_heads * c.head_dim();
        let mut lg: [Option<(Vec<f32>, Vec<f32>)>; 7] = Default::default();
        let mut scratch = vec![0.0; dim];
        // MLP branch (swiglu_backward's steps, no weight gradients).
        let mut da = vec![0.0; rows * hidden];
        self.frozen_linear_backward(l, cache, 6, dy, &cache.mlp.a, p.down, &mut da, &mut lg);
        let mut dh1 = vec![0.0; rows * hidden];
        let mut dh3 = vec![0.0; rows * hidden];
        swiglu_act_backward(&da, &cache.mlp.h1, &cache.mlp.h3, &mut dh1, &mut dh3);
        drop(da);
        let mut dxn2 = vec![0.0; rows * dim];
        self.frozen_linear_backward(l, cache, 4, &dh1, &cache.xn2, p.gate, &mut dxn2, &mut lg);
        self.frozen_linear_backward(l, cache, 5, &dh3, &cache.xn2, p.up, &mut dxn2, &mut lg);
        let mut dh = dy.to_vec();
        rmsnorm_backward(
            &dxn2,
            &cache.h,
            p.mlp_norm,
            &cache.inv2,
            &mut dh,
            &mut scratch,
        );
        // Attention branch.
        let mut dattn = vec![0.0; rows * qd];
        self.frozen_linear_backward(l, cache, 3, &dh, &cache.attn, p.wo, &mut dattn, &mut lg);
        let (mut dq, mut dk, dv) = attention_backward(
            &dattn,
            &cache.q,
            &cache.k,
            &cache.v,
            &cache.probs,
            self.shape(cache.batch, cache.seq),
            self.threads,
        );
        self.rope.backward(&mut dq, cache.seq, c.n_heads);
        self.rope.backward(&mut dk, cache.seq, c.n_kv_heads);
        let mut dxn1 = vec![0.0; rows * dim];
        self.frozen_linear_backward(l, cache, 0, &dq, &cache.xn1, p.wq, &mut dxn1, &mut lg);
        self.frozen_linear_backward(l, cache, 1, &dk, &cache.xn1, p.wk, &mut dxn1, &mut lg);
        self.frozen_linear_backward(l, cache, 2, &dv, &cache.xn1, p.wv, &mut dxn1, &mut lg);
        let mut dx = dh;
        rmsnorm_backward(
            &dxn1,
            &cache.x,
            p.attn_norm,
            &cache.inv1,
            &mut dx,
            &mut scratch,
        );
        let grads = BlockGrads {
            wq: Vec::new(),
            wk: Vec::new(),
            wv: Vec::new(),
            wo: Vec::new(),
            gate: Vec::new(),
            up: Vec::new(),
            down: Vec::new(),
            attn_norm: Vec::new(),
            mlp_norm: Vec::new(),
            qkv_bias: None,
            lora: lg,
        };
        (dx, grads)
    }

    /// Returns `dx` and the parameter gradients for the output gradient
    /// `dy`; with adapters, the adapters' gradients only (the base weights
    /// are frozen and their gradients are not computed).
    pub fn backward(
        &self,
        p: &BlockParams,
        cache: &BlockCache,
        dy: &[f32],
    ) -> (Vec<f32>, BlockGrads) {
        if let Some(l) = &p.lora {
            return self.backward_lora(p, l, cache, dy);
        }
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
            lora: Default::default(),
        };
        (dx, grads)
    }
}
