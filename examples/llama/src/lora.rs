//! LoRA adapters in PEFT's form: the math, the initialisation, the names
//! and the files, so that an adapter trained here loads in PEFT and one
//! from PEFT loads here.
//!
//! A target linear layer `y = x Wᵀ` (`W` `[out, in]`, frozen) gains two
//! trainable matrices, `A` `[r, in]` and `B` `[out, r]`:
//!
//! ```text
//!   y = x Wᵀ + s · (drop(x) Aᵀ) Bᵀ        s = alpha / r   (alpha / √r with rsLoRA)
//!
//!   x ──┬──[ W ]──────────────────────────────(+)── y
//!       └──[drop]──[ A: in→r ]──[ B: r→out ]──[×s]─┘
//! ```
//!
//! PEFT's defaults, kept here: `A` ~ U(−1/√in, 1/√in) (PyTorch's
//! `kaiming_uniform_(a=√5)` of an `[r, in]` weight) and `B = 0`, so a
//! fresh adapter leaves the model's output unchanged; dropout only on the
//! adapter's input, inverted (kept elements scaled by `1/(1−p)`), only in
//! training. The backward pass is exact (no approximation of the product).
//!
//! Files (PEFT's layout): `adapter_config.json` ([`LoraConfig::peft_config`])
//! and `adapter_model.safetensors` with tensors named
//! `base_model.model.{module}.lora_A.weight` / `.lora_B.weight`, where
//! `{module}` is the Hugging Face module path, e.g.
//! `model.layers.0.self_attn.q_proj` ([`peft_name`]). Merging ([`merge`])
//! folds an adapter into its base weight: `W' = W + s · B A`.

use std::borrow::Cow;

use crate::ops::{matmul, Mm};
use crate::XorShift;

/// The module names LoRA may target, PEFT's names for a Llama/Qwen2 block
/// (zero's [`LORA_TARGETS`](zero::estimate::LORA_TARGETS), in its order),
/// with their Hugging Face parents: the first four are the attention's,
/// the rest the MLP's.
pub const TARGETS: [(&str, &str); 7] = {
    let m = zero::estimate::LORA_TARGETS;
    let (attn, mlp) = ("self_attn", "mlp");
    [
        (m[0], attn),
        (m[1], attn),
        (m[2], attn),
        (m[3], attn),
        (m[4], mlp),
        (m[5], mlp),
        (m[6], mlp),
    ]
};

/// The hyper-parameters of the adapters (PEFT's `LoraConfig` fields).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` of every adapter.
    pub r: usize,
    /// `lora_alpha`: the scale is `alpha / r` (or `alpha / √r`).
    pub alpha: f32,
    /// `lora_dropout`: the probability of dropping an input element.
    pub dropout: f32,
    /// `target_modules`: names from [`TARGETS`], in [`TARGETS`] order.
    pub targets: Vec<String>,
    /// `use_rslora`: scale by `alpha / √r` (rank-stabilised LoRA).
    pub use_rslora: bool,
}

impl LoraConfig {
    /// Checked hyper-parameters: `r > 0`, a finite `alpha`, `0 ≤ dropout <
    /// 1`, and target modules that are all in [`TARGETS`] (an unknown name
    /// is an error naming it and the known ones; none given is an error).
    pub fn new(r: usize, alpha: f32, dropout: f32, targets: &[&str]) -> Result<Self, String> {
        if r == 0 {
            return Err("lora: the rank r must be positive".into());
        }
        if !alpha.is_finite() {
            return Err(format!("lora: lora_alpha must be finite, got {alpha}"));
        }
        if !(0.0..1.0).contains(&dropout) {
            return Err(format!(
                "lora: lora_dropout must be in [0, 1), got {dropout}"
            ));
        }
        if targets.is_empty() {
            return Err("lora: no target modules given".into());
        }
        let known: Vec<&str> = TARGETS.iter().map(|t| t.0).collect();
        if let Some(bad) = targets.iter().find(|t| !known.contains(t)) {
            return Err(format!(
                "lora: target module {bad:?} matches no module of a Llama/Qwen2 block (known: {})",
                known.join(", ")
            ));
        }
        Ok(LoraConfig {
            r,
            alpha,
            dropout,
            targets: known
                .iter()
                .filter(|k| targets.contains(k))
                .map(|k| k.to_string())
                .collect(),
            use_rslora: false,
        })
    }

    /// The factor `s` of the adapter's product.
    pub fn scale(&self) -> f32 {
        if self.use_rslora {
            self.alpha / (self.r as f32).sqrt()
        } else {
            self.alpha / self.r as f32
        }
    }

    /// Whether `module` (e.g. `"q_proj"`) is a target.
    pub fn targets(&self, module: &str) -> bool {
        self.targets.iter().any(|t| t == module)
    }

    /// Trainable elements of the adapters of one block whose target
    /// modules have the given `(in, out)` shapes (`shape(module)`).
    pub fn block_params(&self, shape: impl Fn(&str) -> (usize, usize)) -> usize {
        self.targets
            .iter()
            .map(|t| {
                let (d_in, d_out) = shape(t);
                self.r * (d_in + d_out)
            })
            .sum()
    }

    /// PEFT's `adapter_config.json` for these adapters on the model at
    /// `base_model` (a path or hub name; may be empty).
    pub fn peft_config(&self, base_model: &str) -> serde_json::Value {
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.r,
            "lora_alpha": shortest(self.alpha),
            "lora_dropout": shortest(self.dropout),
            "target_modules": self.targets,
            "use_rslora": self.use_rslora,
            "bias": "none",
            "fan_in_fan_out": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "use_dora": false,
        })
    }

    /// Reads PEFT's `adapter_config.json`: the fields this crate supports,
    /// and an error naming any field set to something it does not (DoRA,
    /// per-module ranks or alphas, biases, `fan_in_fan_out`, modules to
    /// save, layer subsets, another `peft_type`).
    pub fn from_peft_config(v: &serde_json::Value) -> Result<Self, String> {
        let field = |k: &str| v.get(k).filter(|x| !x.is_null());
        let unsupported = |k: &str, why: &str| {
            Err(format!(
                "adapter_config.json: {k} = {} is not supported ({why})",
                field(k).map_or("?".into(), |x| x.to_string())
            ))
        };
        if field("peft_type").and_then(|x| x.as_str()) != Some("LORA") {
            return unsupported("peft_type", "only LORA");
        }
        if field("use_dora").and_then(|x| x.as_bool()) == Some(true) {
            return unsupported("use_dora", "DoRA adapters");
        }
        if field("fan_in_fan_out").and_then(|x| x.as_bool()) == Some(true) {
            return unsupported("fan_in_fan_out", "Conv1D-style weights");
        }
        if field("bias")
            .and_then(|x| x.as_str())
            .is_some_and(|b| b != "none")
        {
            return unsupported("bias", "only \"none\"");
        }
        for k in ["rank_pattern", "alpha_pattern"] {
            if field(k)
                .and_then(|x| x.as_object())
                .is_some_and(|m| !m.is_empty())
            {
                return unsupported(k, "one rank and alpha for every module");
            }
        }
        for k in ["modules_to_save", "layers_to_transform"] {
            if field(k).is_some() {
                return unsupported(k, "adapters on every layer's target modules only");
            }
        }
        let r = field("r")
            .and_then(|x| x.as_u64())
            .ok_or("adapter_config.json: r is missing or not a positive integer")?;
        let alpha = field("lora_alpha")
            .and_then(|x| x.as_f64())
            .ok_or("adapter_config.json: lora_alpha is missing or not a number")?;
        let dropout = field("lora_dropout")
            .and_then(|x| x.as_f64())
            .unwrap_or(0.0);
        let targets: Vec<String> = match field("target_modules") {
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|t| {
                    t.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| format!("adapter_config.json: target_modules entry {t} is not a string"))
                })
                .collect::<Result<_, _>>()?,
            Some(serde_json::Value::String(s)) => {
                return Err(format!(
                    "adapter_config.json: target_modules = {s:?} (a regular expression) is not supported; list the modules"
                ))
            }
            _ => return Err("adapter_config.json: target_modules is missing".into()),
        };
        let names: Vec<&str> = targets.iter().map(String::as_str).collect();
        let mut cfg = LoraConfig::new(r as usize, alpha as f32, dropout as f32, &names)?;
        cfg.use_rslora = field("use_rslora")
            .and_then(|x| x.as_bool())
            .unwrap_or(false);
        Ok(cfg)
    }
}

/// `x` as the f64 of its shortest decimal form (0.1, not 0.10000000149).
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// PEFT's name of an adapter matrix in `adapter_model.safetensors`:
/// `base_model.model.model.layers.{layer}.{parent}.{module}.lora_{A|B}.weight`.
/// `None` for a module not in [`TARGETS`].
pub fn peft_name(layer: usize, module: &str, b: bool) -> Option<String> {
    let parent = TARGETS.iter().find(|t| t.0 == module)?.1;
    let ab = if b { "B" } else { "A" };
    Some(format!(
        "base_model.model.model.layers.{layer}.{parent}.{module}.lora_{ab}.weight"
    ))
}

/// PEFT's initial `A` (`[r, d_in]`): uniform in `±1/√d_in` (PyTorch's
/// `kaiming_uniform_` with `a = √5`), drawn from `rng`. `B` starts at zero.
pub fn init_a(rng: &mut XorShift, r: usize, d_in: usize) -> Vec<f32> {
    let bound = 1.0 / (d_in as f32).sqrt();
    (0..r * d_in)
        .map(|_| (2.0 * rng.uniform() - 1.0) * bound)
        .collect()
}

/// An inverted-dropout mask of `n` elements: `0` with probability `p`,
/// else `1/(1−p)`, from `seed` (the same seed gives the same mask on every
/// rank, stage and run). `None` when `p = 0` (nothing dropped).
pub fn dropout_mask(n: usize, p: f32, seed: u64) -> Option<Vec<f32>> {
    let bits = dropout_bits(n, p, seed)?;
    let keep = dropout_keep(p);
    Some(
        (0..n)
            .map(|i| if kept(&bits, i) { keep } else { 0.0 })
            .collect(),
    )
}

/// The factor of a kept element of an inverted-dropout mask: `1/(1−p)`.
pub fn dropout_keep(p: f32) -> f32 {
    1.0 / (1.0 - p)
}

/// [`dropout_mask`] as a bit mask, 1 bit per element: bit `i % 32` of
/// word `i / 32` is set when element `i` is kept (the same draws, so
/// the same mask). `None` when `p = 0`. What the device trainer keeps
/// between forward and backward (a 32nd of the f32 mask).
pub fn dropout_bits(n: usize, p: f32, seed: u64) -> Option<Vec<u32>> {
    if p == 0.0 {
        return None;
    }
    let mut rng = XorShift::new(seed);
    let mut bits = vec![0u32; n.div_ceil(32)];
    for i in 0..n {
        if rng.uniform() >= p {
            bits[i / 32] |= 1 << (i % 32);
        }
    }
    Some(bits)
}

/// Whether element `i` of bit mask `bits` ([`dropout_bits`]) is kept.
pub fn kept(bits: &[u32], i: usize) -> bool {
    bits[i / 32] >> (i % 32) & 1 == 1
}

/// `x ⊙ mask`, or `x` itself without a mask.
fn dropped<'a>(x: &'a [f32], mask: Option<&[f32]>) -> Cow<'a, [f32]> {
    match mask {
        Some(m) => Cow::Owned(x.iter().zip(m).map(|(v, k)| v * k).collect()),
        None => Cow::Borrowed(x),
    }
}

/// What the backward pass of one adapter needs from its forward pass.
#[derive(Clone, Debug)]
pub struct LoraCache {
    /// `drop(x) Aᵀ`, `[rows, r]`.
    pub xa: Vec<f32>,
    /// The dropout mask applied to `x` (`None`: no dropout).
    pub mask: Option<Vec<f32>>,
}

/// Shapes of one adapted layer: `rows` inputs of `d_in`, outputs of
/// `d_out`, rank `r`, scale `s`.
#[derive(Clone, Copy, Debug)]
pub struct LoraDims {
    /// Rows of `x` (`batch · seq`).
    pub rows: usize,
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
    /// The adapter's rank.
    pub r: usize,
    /// The scale `s` of the product.
    pub scale: f32,
}

/// Adds the adapter's output to `y` (`[rows, d_out]`, the base layer's
/// output): `y += s · (drop(x) Aᵀ) Bᵀ`, with `mask` the dropout mask of
/// `x` (training) or `None`.
pub fn forward(
    x: &[f32],
    a: &[f32],
    b: &[f32],
    y: &mut [f32],
    mask: Option<Vec<f32>>,
    d: LoraDims,
    threads: usize,
) -> LoraCache {
    let LoraDims {
        rows,
        d_in,
        d_out,
        r,
        scale,
    } = d;
    let xin = dropped(x, mask.as_deref());
    let mut xa = vec![0.0; rows * r];
    matmul(
        &mut xa,
        &xin,
        a,
        Mm::new(rows, r, d_in).tb().threads(threads),
    );
    matmul(
        y,
        &xa,
        b,
        Mm::new(rows, d_out, r)
            .tb()
            .acc()
            .alpha(scale)
            .threads(threads),
    );
    LoraCache { xa, mask }
}

/// Backward of [`forward`]: accumulates `da` (`[r, d_in]`), `db`
/// (`[d_out, r]`) and `dx` (`[rows, d_in]`, the adapter's share of the
/// input gradient) from `dy` (`[rows, d_out]`).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dy: &[f32],
    x: &[f32],
    a: &[f32],
    b: &[f32],
    cache: &LoraCache,
    da: &mut [f32],
    db: &mut [f32],
    dx: &mut [f32],
    d: LoraDims,
    threads: usize,
) {
    let LoraDims {
        rows,
        d_in,
        d_out,
        r,
        scale,
    } = d;
    // d(xa) = s · dy B            [rows, r]
    let mut dxa = vec![0.0; rows * r];
    matmul(
        &mut dxa,
        dy,
        b,
        Mm::new(rows, r, d_out).alpha(scale).threads(threads),
    );
    // dB += s · dyᵀ xa            [d_out, r]
    matmul(
        db,
        dy,
        &cache.xa,
        Mm::new(d_out, r, rows)
            .ta()
            .acc()
            .alpha(scale)
            .threads(threads),
    );
    // dA += d(xa)ᵀ drop(x)        [r, d_in]
    let xin = dropped(x, cache.mask.as_deref());
    matmul(
        da,
        &dxa,
        &xin,
        Mm::new(r, d_in, rows).ta().acc().threads(threads),
    );
    // dx += (d(xa) A) ⊙ mask      [rows, d_in]
    match &cache.mask {
        None => matmul(dx, &dxa, a, Mm::new(rows, d_in, r).acc().threads(threads)),
        Some(m) => {
            let mut dxin = vec![0.0; rows * d_in];
            matmul(&mut dxin, &dxa, a, Mm::new(rows, d_in, r).threads(threads));
            for ((o, g), k) in dx.iter_mut().zip(&dxin).zip(m) {
                *o += g * k;
            }
        }
    }
}

/// Folds an adapter into its base weight: `w += s · B A` (`w` `[d_out,
/// d_in]`), PEFT's `merge_and_unload`.
pub fn merge(w: &mut [f32], a: &[f32], b: &[f32], d_in: usize, d_out: usize, r: usize, scale: f32) {
    matmul(w, b, a, Mm::new(d_out, d_in, r).acc().alpha(scale));
}

/// `(d_in, d_out)` of target `module` in a block of `cfg`; `None` for a
/// module not in [`TARGETS`].
pub fn module_dims(cfg: &crate::Config, module: &str) -> Option<(usize, usize)> {
    cfg.llama_dims().projection_dims(module)
}

/// The adapter tensors of layer `layer`: for each target in [`TARGETS`]
/// order, `A` (`[r, d_in]`) then `B` (`[d_out, r]`), with PEFT's names
/// ([`peft_name`]). Their kind is [`crate::Kind::Linear`] (the values come
/// from [`init_adapters`], not from the kind).
pub fn lora_tensors(
    cfg: &crate::Config,
    lora: &LoraConfig,
    layer: usize,
) -> Vec<crate::TensorInfo> {
    let mut v = Vec::with_capacity(2 * lora.targets.len());
    for (m, _) in TARGETS.iter().filter(|t| lora.targets(t.0)) {
        let (d_in, d_out) = module_dims(cfg, m).expect("TARGETS have dims");
        for (b, shape) in [(false, vec![lora.r, d_in]), (true, vec![d_out, lora.r])] {
            v.push(crate::TensorInfo {
                name: peft_name(layer, m, b).expect("a TARGETS module"),
                shape,
                kind: crate::Kind::Linear,
            });
        }
    }
    v
}

/// PEFT's initial adapters of layer `layer`, in [`lora_tensors`] order:
/// each `A` from [`init_a`] with a generator seeded from `(seed, layer,
/// module)` (so a layer's adapters do not depend on the others), each `B`
/// zero.
pub fn init_adapters(
    cfg: &crate::Config,
    lora: &LoraConfig,
    layer: usize,
    seed: u64,
) -> Vec<Vec<f32>> {
    let mut v = Vec::with_capacity(2 * lora.targets.len());
    for (i, (m, _)) in TARGETS.iter().enumerate() {
        if !lora.targets(m) {
            continue;
        }
        let (d_in, d_out) = module_dims(cfg, m).expect("TARGETS have dims");
        let mut rng = XorShift::new(mix(&[seed, 0x4c6f_5241, layer as u64, i as u64]));
        v.push(init_a(&mut rng, lora.r, d_in));
        v.push(vec![0.0; d_out * lora.r]);
    }
    v
}

/// A 64-bit hash of `parts` (splitmix64 steps): the seeds of the
/// initialisation and of the dropout masks.
pub fn mix(parts: &[u64]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64;
    for &p in parts {
        h = (h ^ p).wrapping_add(0x9E37_79B9_7F4A_7C15);
        h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 31;
    }
    h
}

/// The dropout key of layer `layer` in one micro-batch: a hash of the
/// run's `seed`, the optimizer step, the micro-batch within the step, the
/// rank whose samples it is, and the layer. [`crate::Block`] mixes in the
/// module, so every (step, micro-batch, rank, layer, module) has its own
/// mask, whatever the stage, the offload mode or activation checkpointing.
pub fn dropout_key(seed: u64, step: u64, micro: u64, rank: usize, layer: usize) -> u64 {
    mix(&[seed, step, micro, rank as u64, layer as u64])
}

/// PEFT's adapter config file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// Every layer's adapter tensors of `cfg`, layer after layer
/// ([`lora_tensors`] order).
pub fn all_lora_tensors(cfg: &crate::Config, lora: &LoraConfig) -> Vec<crate::TensorInfo> {
    (0..cfg.n_layers)
        .flat_map(|l| lora_tensors(cfg, lora, l))
        .collect()
}

/// Writes `adapters` ([`all_lora_tensors`] order) into directory `dir` in
/// PEFT's layout: [`ADAPTER_CONFIG`] and [`ADAPTER_WEIGHTS`] (F32, PEFT's
/// tensor names), so `PeftModel.from_pretrained(base, dir)` loads them.
/// Returns the names of the files written.
pub fn save_adapter(
    dir: &std::path::Path,
    cfg: &crate::Config,
    lora: &LoraConfig,
    adapters: &[Vec<f32>],
    base_model: &str,
) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: cannot create: {e}", dir.display()))?;
    let infos = all_lora_tensors(cfg, lora);
    if infos.len() != adapters.len() {
        return Err(format!(
            "{}: {} adapter tensors given, {} expected",
            dir.display(),
            adapters.len(),
            infos.len()
        ));
    }
    crate::weights::save_named(
        &dir.join(ADAPTER_WEIGHTS),
        &infos,
        adapters,
        crate::weights::Dtype::F32,
    )?;
    let text = serde_json::to_string_pretty(&lora.peft_config(base_model))
        .expect("JSON of strings and numbers");
    crate::weights::write_atomic(&dir.join(ADAPTER_CONFIG), text.as_bytes())?;
    Ok(vec![ADAPTER_CONFIG.into(), ADAPTER_WEIGHTS.into()])
}

/// Reads a PEFT adapter directory for a model of `cfg`: its
/// [`ADAPTER_CONFIG`] ([`LoraConfig::from_peft_config`]) and every adapter
/// tensor of [`ADAPTER_WEIGHTS`] ([`all_lora_tensors`] order, any float
/// dtype, read as f32). Errors name the file, the tensor and the shapes: a
/// missing or unreadable file, a missing tensor, a wrong shape, or a
/// tensor the model has no place for (another layer count, a module that
/// is not a target).
pub fn load_adapter(
    dir: &std::path::Path,
    cfg: &crate::Config,
) -> Result<(LoraConfig, Vec<Vec<f32>>), String> {
    let cpath = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&cpath)
        .map_err(|e| format!("{}: cannot read: {e}", cpath.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", cpath.display()))?;
    let lora = LoraConfig::from_peft_config(&v).map_err(|e| format!("{}: {e}", cpath.display()))?;
    let wpath = dir.join(ADAPTER_WEIGHTS);
    let mut f = crate::weights::SafetensorsFile::open(&wpath)?;
    let infos = all_lora_tensors(cfg, &lora);
    // PEFT may name the adapter ("default") in the key; this crate's
    // names are the saved form without it.
    if let Some(extra) = f
        .names()
        .into_iter()
        .find(|n| !infos.iter().any(|t| &t.name == n))
    {
        return Err(format!(
            "{}: tensor `{extra}` is not an adapter of this model ({} layers, targets {})",
            wpath.display(),
            cfg.n_layers,
            lora.targets.join(", ")
        ));
    }
    let values = infos
        .iter()
        .map(|t| f.read(&t.name, &t.shape))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((lora, values))
}
