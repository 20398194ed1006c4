//! A Llama-style decoder on the CPU, f32 compute, hand-written forward and
//! backward: the model crate of `examples/llama_sft.rs` (not published).
//!
//! Parameters are plain `&[f32]` slices, one per tensor, in the order of
//! [`tensors`] (HF-Llama names and shapes). All GEMMs go through
//! [`ops::matmul`] (the `gemm` crate). [`data`] is the addition task,
//! [`train`] the engine glue, [`lora`] PEFT-style adapters, [`weights`]
//! Hugging Face safetensors in and out, [`export`] what an export writes
//! (the fp32 master in the checkpoint's dtype), [`hf`] Hugging Face model
//! directories (config, sharded weights, tokenizer and chat template) in
//! and out, [`shapes`] published shapes with random weights, [`cuda`] the
//! GPU kernels of the non-GEMM ops (launchers with the `cuda` feature).

pub mod block;
pub mod chat;
pub mod cuda;
pub mod data;
pub mod device;
pub mod eval;
pub mod export;
pub mod hf;
pub mod lora;
pub mod ops;
pub mod recipe;
pub mod sampling;
pub mod shapes;
pub mod train;
pub mod weights;

pub use block::{Block, BlockCache, BlockLora, BlockParams};

/// Model hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    /// Vocabulary size (rows of the embedding and the LM head).
    pub vocab: usize,
    /// Model width (hidden size).
    pub dim: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// SwiGLU inner width.
    pub hidden: usize,
    /// The longest sequence (positions of the RoPE tables).
    pub max_seq: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// RoPE base frequency (`rope_theta`).
    pub rope_theta: f64,
    /// Biases on the q, k and v projections (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// The LM head is the embedding table (`tie_word_embeddings`): the
    /// model has no `lm_head.weight`, and the embedding's gradient sums both
    /// uses.
    pub tie_embeddings: bool,
    /// The padding token (`pad_token_id` of a Hugging Face `config.json`;
    /// `None` for the built-in presets): as transformers' `nn.Embedding(...,
    /// padding_idx)`, its embedding row gets no gradient from the input
    /// lookups of that token. With tied embeddings the LM head's gradient
    /// of that row still counts (as in transformers).
    pub pad_id: Option<u32>,
}

impl Config {
    /// Tests and smoke runs: ~0.1 M parameters.
    pub fn tiny() -> Self {
        Config {
            vocab: 256,
            dim: 64,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            hidden: 172,
            max_seq: 128,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            qkv_bias: false,
            tie_embeddings: false,
            pad_id: None,
        }
    }

    /// A small but real model: ~ 48 M parameters with a 32k vocabulary.
    pub fn small() -> Self {
        Config {
            vocab: 32000,
            dim: 512,
            n_layers: 8,
            n_heads: 8,
            n_kv_heads: 4,
            hidden: 1376,
            max_seq: 1024,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            qkv_bias: false,
            tie_embeddings: false,
            pad_id: None,
        }
    }

    /// Width of one attention head: `dim / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// Tensors per transformer block: 9, or 12 with q/k/v biases.
    pub fn block_len(&self) -> usize {
        if self.qkv_bias {
            12
        } else {
            9
        }
    }

    /// The positions of layer `l`'s tensors in [`tensors`].
    pub fn layer_range(&self, l: usize) -> std::ops::Range<usize> {
        let n = self.block_len();
        1 + n * l..1 + n * (l + 1)
    }

    /// The position of `model.norm.weight` in [`tensors`].
    pub fn norm_index(&self) -> usize {
        1 + self.block_len() * self.n_layers
    }

    /// The position of the LM head's weight in [`tensors`]: the embedding
    /// (0) when tied, else `lm_head.weight`, the last tensor.
    pub fn head_index(&self) -> usize {
        if self.tie_embeddings {
            0
        } else {
            self.norm_index() + 1
        }
    }

    /// The dimensions as `zero::estimate` takes them: its `Model::llama`
    /// has the units [`train::SftModel`] registers for a model without
    /// q/k/v biases and with its own LM head (neither is in the dims).
    pub fn llama_dims(&self) -> zero::estimate::LlamaDims {
        zero::estimate::LlamaDims {
            vocab: self.vocab,
            hidden: self.dim,
            intermediate: self.hidden,
            layers: self.n_layers,
            heads: self.n_heads,
            kv_heads: self.n_kv_heads,
        }
    }

    /// Number of tensors of the model.
    pub fn tensor_count(&self) -> usize {
        self.norm_index() + 1 + usize::from(!self.tie_embeddings)
    }

    /// Panics on inconsistent sizes.
    pub fn validate(&self) {
        assert!(
            self.n_heads > 0 && self.dim.is_multiple_of(self.n_heads),
            "n_heads must divide dim"
        );
        assert!(
            self.n_kv_heads > 0 && self.n_heads.is_multiple_of(self.n_kv_heads),
            "n_kv_heads must divide n_heads"
        );
        assert!(
            self.head_dim().is_multiple_of(2),
            "head_dim must be even for RoPE"
        );
    }
}

/// What a tensor is, for initialization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A token embedding: normal(0, 0.02).
    Embedding,
    /// A projection matrix: normal(0, 0.02).
    Linear,
    /// An RMSNorm weight: ones.
    Norm,
    /// A projection bias: zeros.
    Bias,
}

/// One named parameter tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Row-major shape, Hugging Face's.
    pub shape: Vec<usize>,
    /// What it is, for initialization.
    pub kind: Kind,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The tensors of layer `i`, in [`BlockParams::from_slices`] order: the 9
/// weights, then the q, k and v biases when `cfg.qkv_bias`.
pub fn block_tensors(cfg: &Config, i: usize) -> Vec<TensorInfo> {
    let hd = cfg.head_dim();
    let (d, qd, kd, h) = (cfg.dim, cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.hidden);
    let t = |n: &str, shape: Vec<usize>, kind| TensorInfo {
        name: format!("model.layers.{i}.{n}"),
        shape,
        kind,
    };
    let mut v = vec![
        t("self_attn.q_proj.weight", vec![qd, d], Kind::Linear),
        t("self_attn.k_proj.weight", vec![kd, d], Kind::Linear),
        t("self_attn.v_proj.weight", vec![kd, d], Kind::Linear),
        t("self_attn.o_proj.weight", vec![d, qd], Kind::Linear),
        t("mlp.gate_proj.weight", vec![h, d], Kind::Linear),
        t("mlp.up_proj.weight", vec![h, d], Kind::Linear),
        t("mlp.down_proj.weight", vec![d, h], Kind::Linear),
        t("input_layernorm.weight", vec![d], Kind::Norm),
        t("post_attention_layernorm.weight", vec![d], Kind::Norm),
    ];
    if cfg.qkv_bias {
        v.extend([
            t("self_attn.q_proj.bias", vec![qd], Kind::Bias),
            t("self_attn.k_proj.bias", vec![kd], Kind::Bias),
            t("self_attn.v_proj.bias", vec![kd], Kind::Bias),
        ]);
    }
    v
}

/// Every tensor of the model: `model.embed_tokens.weight`, the layers in
/// order, `model.norm.weight`, and `lm_head.weight` unless the embeddings
/// are tied.
pub fn tensors(cfg: &Config) -> Vec<TensorInfo> {
    let mut v = vec![TensorInfo {
        name: "model.embed_tokens.weight".into(),
        shape: vec![cfg.vocab, cfg.dim],
        kind: Kind::Embedding,
    }];
    for i in 0..cfg.n_layers {
        v.extend(block_tensors(cfg, i));
    }
    v.push(TensorInfo {
        name: "model.norm.weight".into(),
        shape: vec![cfg.dim],
        kind: Kind::Norm,
    });
    if !cfg.tie_embeddings {
        v.push(TensorInfo {
            name: "lm_head.weight".into(),
            shape: vec![cfg.vocab, cfg.dim],
            kind: Kind::Linear,
        });
    }
    v
}

/// Total parameter count.
pub fn param_count(cfg: &Config) -> usize {
    tensors(cfg).iter().map(TensorInfo::numel).sum()
}

/// A tiny deterministic xorshift64* generator (no `rand` dependency).
pub struct XorShift(pub u64);

impl XorShift {
    /// A generator seeded from `seed` (any value, zero included).
    pub fn new(seed: u64) -> Self {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Approximately standard normal (sum of 4 uniforms, rescaled).
    pub fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform()).sum();
        (s - 2.0) * 3.0f32.sqrt()
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Initial values for every tensor: normal(0, 0.02) matrices, unit norms,
/// zero biases.
pub fn init_params(cfg: &Config, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = XorShift::new(seed);
    tensors(cfg)
        .iter()
        .map(|t| match t.kind {
            Kind::Norm => vec![1.0; t.numel()],
            Kind::Bias => vec![0.0; t.numel()],
            _ => (0..t.numel()).map(|_| 0.02 * rng.normal()).collect(),
        })
        .collect()
}

/// Saved activations of a whole-model forward pass.
pub struct ModelCache {
    /// Sequences in the batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The input tokens `[batch * seq]`.
    pub tokens: Vec<u32>,
    /// Every block's saved activations, in layer order.
    pub blocks: Vec<BlockCache>,
    /// Input of the final norm.
    pub hf: Vec<f32>,
    /// The final norm's `1 / rms` per row.
    pub inv: Vec<f32>,
    /// Output of the final norm (input of the LM head).
    pub xn: Vec<f32>,
    /// Gradient of the mean loss with respect to the logits.
    pub dlogits: Vec<f32>,
}

/// Embedding → blocks → final RMSNorm → LM head → cross-entropy.
pub struct Model {
    /// Hyper-parameters.
    pub cfg: Config,
    /// The block (shared by every layer: parameters are passed in).
    pub block: Block,
    /// Threads of the GEMMs.
    pub threads: usize,
    /// LoRA adapters on every block ([`Model::with_lora`]): the base is
    /// frozen.
    pub lora: Option<lora::LoraConfig>,
    /// The seed of the adapters' dropout masks (layer `l` uses
    /// [`lora::dropout_key`]`(seed, 0, 0, 0, l)`); `None`: no dropout.
    pub dropout_seed: Option<u64>,
}

impl Model {
    /// The model of `cfg` (panics on inconsistent sizes), GEMMs on `threads` threads.
    pub fn new(cfg: Config, threads: usize) -> Self {
        cfg.validate();
        Model {
            cfg,
            block: Block::new(cfg, threads),
            threads,
            lora: None,
            dropout_seed: None,
        }
    }

    /// The model of `cfg` with the adapters of `lora` on every block: the
    /// parameters are the base's ([`tensors`] order) followed by each
    /// layer's adapters ([`lora::lora_tensors`] order), and only the
    /// adapters get gradients.
    pub fn with_lora(cfg: Config, lora: lora::LoraConfig, threads: usize) -> Self {
        Model {
            lora: Some(lora),
            ..Model::new(cfg, threads)
        }
    }

    /// The number of parameter tensors [`Model::forward`] takes.
    pub fn param_tensors(&self) -> usize {
        self.cfg.tensor_count()
            + self
                .lora
                .as_ref()
                .map_or(0, |l| 2 * l.targets.len() * self.cfg.n_layers)
    }

    /// Block `l`'s parameters: the base's, with the adapters when LoRA.
    fn block_params<'a>(&'a self, params: &[&'a [f32]], l: usize) -> BlockParams<'a> {
        let p = BlockParams::from_slices(&params[self.cfg.layer_range(l)]);
        match &self.lora {
            None => p,
            Some(lc) => {
                let per = 2 * lc.targets.len();
                let at = self.cfg.tensor_count() + l * per;
                let key = self.dropout_seed.map(|s| lora::dropout_key(s, 0, 0, 0, l));
                p.with_lora(BlockLora::from_slices(lc, &params[at..at + per], key))
            }
        }
    }

    /// `params` in [`tensors`] order (then the adapters with LoRA);
    /// `tokens`, `targets` `[batch * seq]` (targets < 0 are ignored).
    /// Returns the mean loss and the cache.
    pub fn forward(
        &self,
        params: &[&[f32]],
        tokens: &[u32],
        targets: &[i32],
        batch: usize,
        seq: usize,
    ) -> (f32, ModelCache) {
        let c = &self.cfg;
        assert_eq!(params.len(), self.param_tensors());
        assert_eq!(tokens.len(), batch * seq);
        let mut x = ops::embedding_forward(params[0], tokens, c.dim);
        let mut blocks = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let p = self.block_params(params, l);
            let cache = self.block.forward(&p, &x, batch, seq);
            x = cache.y.clone();
            blocks.push(cache);
        }
        let (xn, inv) = ops::rmsnorm_forward(&x, params[c.norm_index()], c.norm_eps);
        let logits = ops::linear_forward(
            &xn,
            params[c.head_index()],
            batch * seq,
            c.dim,
            c.vocab,
            self.threads,
        );
        let (loss, dlogits) = ops::cross_entropy(&logits, targets, c.vocab);
        let cache = ModelCache {
            batch,
            seq,
            tokens: tokens.to_vec(),
            blocks,
            hf: x,
            inv,
            xn,
            dlogits,
        };
        (loss, cache)
    }

    /// Gradients of the mean loss for every tensor, in [`tensors`] order.
    /// With tied embeddings the embedding's gradient is the sum of its
    /// lookup's and the LM head's. With LoRA the base is frozen: its
    /// gradients are empty (not computed) and the adapters' follow.
    pub fn backward(&self, params: &[&[f32]], cache: &ModelCache) -> Vec<Vec<f32>> {
        if self.lora.is_some() {
            return self.backward_lora(params, cache);
        }
        let c = &self.cfg;
        let n = params.len();
        let (norm, head) = (c.norm_index(), c.head_index());
        let rows = cache.batch * cache.seq;
        let mut grads: Vec<Vec<f32>> = vec![Vec::new(); n];
        let mut dhead = vec![0.0; params[head].len()];
        let mut dxn = vec![0.0; rows * c.dim];
        ops::linear_backward(
            &cache.dlogits,
            &cache.xn,
            params[head],
            &mut dhead,
            &mut dxn,
            (rows, c.dim, c.vocab),
            self.threads,
        );
        let mut dnorm = vec![0.0; c.dim];
        let mut dx = vec![0.0; rows * c.dim];
        ops::rmsnorm_backward(
            &dxn,
            &cache.hf,
            params[norm],
            &cache.inv,
            &mut dx,
            &mut dnorm,
        );
        grads[norm] = dnorm;
        for l in (0..c.n_layers).rev() {
            let range = c.layer_range(l);
            let p = BlockParams::from_slices(&params[range.clone()]);
            let (d, g) = self.block.backward(&p, &cache.blocks[l], &dx);
            dx = d;
            for (slot, t) in grads[range].iter_mut().zip(g.into_vec()) {
                *slot = t;
            }
        }
        let mut demb = if c.tie_embeddings {
            dhead
        } else {
            grads[head] = dhead;
            vec![0.0; params[0].len()]
        };
        ops::embedding_backward(&dx, &cache.tokens, c.dim, &mut demb, c.pad_id);
        grads[0] = demb;
        grads
    }

    /// [`Model::backward`] with LoRA: only the input gradients flow
    /// through the frozen base.
    fn backward_lora(&self, params: &[&[f32]], cache: &ModelCache) -> Vec<Vec<f32>> {
        let c = &self.cfg;
        let rows = cache.batch * cache.seq;
        let mut grads: Vec<Vec<f32>> = vec![Vec::new(); params.len()];
        let mut dxn = vec![0.0; rows * c.dim];
        ops::matmul(
            &mut dxn,
            &cache.dlogits,
            params[c.head_index()],
            ops::Mm::new(rows, c.dim, c.vocab).threads(self.threads),
        );
        let mut scratch = vec![0.0; c.dim];
        let mut dx = vec![0.0; rows * c.dim];
        ops::rmsnorm_backward(
            &dxn,
            &cache.hf,
            params[c.norm_index()],
            &cache.inv,
            &mut dx,
            &mut scratch,
        );
        let per = self.param_tensors() - c.tensor_count();
        let per = per / c.n_layers.max(1);
        for l in (0..c.n_layers).rev() {
            let p = self.block_params(params, l);
            let (d, g) = self.block.backward(&p, &cache.blocks[l], &dx);
            dx = d;
            let at = c.tensor_count() + l * per;
            for (slot, t) in grads[at..at + per].iter_mut().zip(g.lora_vec()) {
                *slot = t;
            }
        }
        grads
    }
}
