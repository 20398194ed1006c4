//! A small decoder-only transformer built from `candle_nn` layers, and a
//! synthetic next-token task: the model of this crate's examples, tests and
//! benchmark (not a model to train for real, but every layer is
//! candle-nn's: embedding, linear, RMS norm, causal self-attention, MLP).

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};

use crate::CandleModel;

/// The transformer's sizes.
#[derive(Debug, Clone, Copy)]
pub struct TinyConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub dim: usize,
    /// Attention heads (`dim` must be a multiple).
    pub heads: usize,
    /// MLP hidden width.
    pub hidden: usize,
    /// Transformer blocks.
    pub layers: usize,
}

impl TinyConfig {
    /// The parameters of one block.
    pub fn block_numel(&self) -> usize {
        4 * self.dim * self.dim + 2 * self.dim * self.hidden + 2 * self.dim
    }

    /// The model's parameters.
    pub fn numel(&self) -> usize {
        self.vocab * self.dim + self.layers * self.block_numel() + self.dim + self.dim * self.vocab
    }

    /// The model as units: `embed`, `blocks.0` … `blocks.{layers-1}`, `head`.
    pub fn model(self) -> CandleModel {
        let mut m = CandleModel::new();
        m.unit("embed", move |vb| {
            candle_nn::embedding(self.vocab, self.dim, vb).map(Embed)
        });
        for i in 0..self.layers {
            m.unit(format!("blocks.{i}"), move |vb| Block::new(self, vb));
        }
        m.unit("head", move |vb| Head::new(self, vb));
        m
    }
}

/// Token embedding: `(batch, seq)` u32 ids to `(batch, seq, dim)`.
pub struct Embed(Embedding);

impl Module for Embed {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.0.forward(ids)
    }
}

/// RMS norm through candle's differentiable path (`forward_diff`: the fused
/// kernel of `RmsNorm::forward` has no backward).
fn rms_norm(dim: usize, vb: VarBuilder<'_>) -> Result<LayerNorm> {
    candle_nn::layer_norm(
        dim,
        candle_nn::LayerNormConfig {
            eps: 1e-5,
            remove_mean: false,
            affine: false,
        },
        vb,
    )
}

/// A pre-norm block: causal self-attention and a GELU MLP, each with a
/// residual connection.
pub struct Block {
    heads: usize,
    attn_norm: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    mlp_norm: LayerNorm,
    up: Linear,
    down: Linear,
}

impl Block {
    /// The block's layers from `vb` (`attn_norm`, `attn.{q,k,v,o}`,
    /// `mlp_norm`, `mlp.{up,down}`).
    pub fn new(c: TinyConfig, vb: VarBuilder<'_>) -> Result<Self> {
        let lin = |i, o, name: &str| candle_nn::linear_no_bias(i, o, vb.pp(name));
        Ok(Self {
            heads: c.heads,
            attn_norm: rms_norm(c.dim, vb.pp("attn_norm"))?,
            q: lin(c.dim, c.dim, "attn.q")?,
            k: lin(c.dim, c.dim, "attn.k")?,
            v: lin(c.dim, c.dim, "attn.v")?,
            o: lin(c.dim, c.dim, "attn.o")?,
            mlp_norm: rms_norm(c.dim, vb.pp("mlp_norm"))?,
            up: lin(c.dim, c.hidden, "mlp.up")?,
            down: lin(c.hidden, c.dim, "mlp.down")?,
        })
    }

    fn attention(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let hd = d / self.heads;
        let split = |y: Tensor| {
            y.reshape((b, t, self.heads, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(self.q.forward(x)?)?;
        let k = split(self.k.forward(x)?)?;
        let v = split(self.v.forward(x)?)?;
        let scores = (q.matmul(&k.t()?.contiguous()?)? * (1.0 / (hd as f64).sqrt()))?;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), x.device())?;
        let p = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)?;
        let y = p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
        self.o.forward(&y)
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + self.attention(&self.attn_norm.forward(x)?)?)?;
        let h = self.up.forward(&self.mlp_norm.forward(&x)?)?.gelu()?;
        x + self.down.forward(&h)?
    }
}

/// The final norm and the output projection: `(batch, seq, vocab)` logits.
pub struct Head {
    norm: LayerNorm,
    out: Linear,
}

impl Head {
    /// `norm`, `out` from `vb`.
    pub fn new(c: TinyConfig, vb: VarBuilder<'_>) -> Result<Self> {
        Ok(Self {
            norm: rms_norm(c.dim, vb.pp("norm"))?,
            out: candle_nn::linear_no_bias(c.dim, c.vocab, vb.pp("out"))?,
        })
    }
}

impl Module for Head {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.out.forward(&self.norm.forward(x)?)
    }
}

/// The mean cross-entropy of `logits` `(batch, seq, vocab)` against
/// `targets` `(batch, seq)`.
pub fn loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &targets.flatten_all()?)
}

/// Sequence `k` of the task: two tokens drawn from `k`, then each token the
/// sum of the two before it modulo `vocab`; returns `seq + 1` tokens.
pub fn sequence(k: u64, seq: usize, vocab: usize) -> Vec<u32> {
    let mut z = k.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^= z >> 27;
    let v = vocab as u64;
    let mut s = vec![(z % v) as u32, ((z >> 32) % v) as u32];
    while s.len() < seq + 1 {
        let n = s.len();
        s.push(((s[n - 1] as u64 + s[n - 2] as u64) % v) as u32);
    }
    s.truncate(seq + 1);
    s
}

/// Sequences `first..first + n` as `(inputs, targets)`, each `(n, seq)`
/// u32 tensors (targets are the inputs shifted by one).
pub fn batch(first: u64, n: usize, seq: usize, vocab: usize) -> Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(n * seq);
    let mut y = Vec::with_capacity(n * seq);
    for k in 0..n as u64 {
        let s = sequence(first + k, seq, vocab);
        x.extend_from_slice(&s[..seq]);
        y.extend_from_slice(&s[1..]);
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(x, (n, seq), &dev)?,
        Tensor::from_vec(y, (n, seq), &dev)?.to_dtype(DType::U32)?,
    ))
}
