//! `config.json` of a Hugging Face `LlamaForCausalLM` or `Qwen2ForCausalLM`:
//! read into a [`Config`], every key the model depends on checked, and
//! written back for an export.
//!
//! | key | use |
//! |---|---|
//! | `model_type` | `llama` or `qwen2` (Qwen2: q/k/v biases) |
//! | `hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `vocab_size` | the dims |
//! | `num_key_value_heads` | grouped-query attention (default: `num_attention_heads`) |
//! | `max_position_embeddings` | the longest sequence |
//! | `rope_theta`, `rms_norm_eps` | RoPE base (default 10000) and RMSNorm epsilon (default 1e-6, transformers') |
//! | `rope_parameters` (transformers 5) | `rope_type` must be `default`; its `rope_theta` is the base |
//! | `tie_word_embeddings` | the LM head is the embedding (default false) |
//! | `pad_token_id` | the padding token, `Config::pad_id`: as transformers' `padding_idx`, its embedding row gets no gradient from its lookups (absent or null: none; must be below `vocab_size`) |
//! | `attention_bias` (llama) | must be false: it also puts a bias on `o_proj` |
//! | `mlp_bias` (llama) | must be false |
//! | `head_dim` | if present, must be `hidden_size / num_attention_heads` |
//! | `hidden_act` | must be `silu` |
//! | `rope_scaling` | must be absent or null |
//! | `use_sliding_window` (qwen2) | must be false |
//! | `layer_types` | every entry `full_attention` |
//! | `torch_dtype` / `dtype` | the export's default dtype |
//!
//! Every error names the file and the key.

use std::path::Path;

use serde_json::{Map, Value};

use super::super::weights::Dtype;
use super::super::Config;

/// The architectures this crate implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelType {
    /// `LlamaForCausalLM` (`model_type` `llama`).
    Llama,
    /// `Qwen2ForCausalLM` (`model_type` `qwen2`): q/k/v biases.
    Qwen2,
}

impl ModelType {
    /// `model_type` of `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            ModelType::Llama => "llama",
            ModelType::Qwen2 => "qwen2",
        }
    }

    /// The `architectures` entry.
    pub fn architecture(self) -> &'static str {
        match self {
            ModelType::Llama => "LlamaForCausalLM",
            ModelType::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

/// A parsed `config.json`.
#[derive(Clone, Debug)]
pub struct HfConfig {
    /// The architecture.
    pub model_type: ModelType,
    /// The model's hyper-parameters; `max_seq` is `max_position_embeddings`
    /// (a trainer lowers it to what it needs: it sizes the RoPE tables).
    pub config: Config,
    /// `torch_dtype` (or `dtype`), when it names F32, BF16 or F16.
    pub dtype: Option<Dtype>,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (a number or a list).
    pub eos_token_ids: Vec<u32>,
    /// The file as it was, for an export.
    pub raw: Value,
}

/// Reads and checks `path` (a `config.json`).
pub fn read(path: &Path) -> Result<HfConfig, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    parse(&text, path)
}

/// Parses `text`, the contents of `path`.
pub fn parse(text: &str, path: &Path) -> Result<HfConfig, String> {
    let file = path.display();
    let raw: Value =
        serde_json::from_str(text).map_err(|e| format!("{file}: not valid JSON: {e}"))?;
    let obj = raw
        .as_object()
        .ok_or_else(|| format!("{file}: expected a JSON object"))?;
    let bad = |key: &str, msg: String| format!("{file}: `{key}`: {msg}");
    let model_type = match obj.get("model_type").and_then(Value::as_str) {
        Some("llama") => ModelType::Llama,
        Some("qwen2") => ModelType::Qwen2,
        Some(other) => {
            return Err(bad(
                "model_type",
                format!("`{other}` is not supported (llama or qwen2)"),
            ))
        }
        None => return Err(bad("model_type", "missing (llama or qwen2)".into())),
    };
    let uint = |key: &str| -> Result<Option<usize>, String> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| Some(n as usize))
                .ok_or_else(|| bad(key, format!("{v} is not a whole number above 0"))),
        }
    };
    let need = |key: &str| uint(key)?.ok_or_else(|| bad(key, "missing".into()));
    let float = |key: &str, default: f64| -> Result<f64, String> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| bad(key, format!("{v} is not a number above 0"))),
        }
    };
    let flag = |key: &str| -> Result<bool, String> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(bad(key, format!("{v} is not true or false"))),
        }
    };
    let dim = need("hidden_size")?;
    let n_heads = need("num_attention_heads")?;
    let n_kv_heads = uint("num_key_value_heads")?.unwrap_or(n_heads);
    let max_seq = need("max_position_embeddings")?;
    if let Some(act) = obj.get("hidden_act") {
        if act.as_str() != Some("silu") {
            return Err(bad(
                "hidden_act",
                format!("{act} is not supported (silu only)"),
            ));
        }
    }
    if let Some(s) = obj.get("rope_scaling").filter(|v| !v.is_null()) {
        return Err(bad(
            "rope_scaling",
            format!("{s}: RoPE scaling is not supported (only plain RoPE with rope_theta)"),
        ));
    }
    // transformers 5 writes RoPE as `rope_parameters: {rope_type, rope_theta}`.
    let mut rope_theta = float("rope_theta", 10000.0)?;
    if let Some(rp) = obj.get("rope_parameters").filter(|v| !v.is_null()) {
        let kind = rp.get("rope_type").and_then(Value::as_str);
        if kind != Some("default") {
            return Err(bad(
                "rope_parameters",
                format!("{rp}: only rope_type \"default\" (plain RoPE) is supported"),
            ));
        }
        if let Some(t) = rp.get("rope_theta") {
            rope_theta = t
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| {
                    bad(
                        "rope_parameters.rope_theta",
                        format!("{t} is not a number above 0"),
                    )
                })?;
        }
    }
    if let Some(types) = obj.get("layer_types").and_then(Value::as_array) {
        if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
            return Err(bad(
                "layer_types",
                format!("{t}: only full_attention layers are supported"),
            ));
        }
    }
    if !dim.is_multiple_of(n_heads) {
        return Err(bad(
            "num_attention_heads",
            format!("{n_heads} does not divide hidden_size {dim}"),
        ));
    }
    if let Some(hd) = uint("head_dim")? {
        if hd != dim / n_heads {
            return Err(bad(
                "head_dim",
                format!(
                    "{hd} differs from hidden_size / num_attention_heads = {}; \
                     a separate head width is not supported",
                    dim / n_heads
                ),
            ));
        }
    }
    if !n_heads.is_multiple_of(n_kv_heads) {
        return Err(bad(
            "num_key_value_heads",
            format!("{n_kv_heads} does not divide num_attention_heads {n_heads}"),
        ));
    }
    if !(dim / n_heads).is_multiple_of(2) {
        return Err(bad(
            "num_attention_heads",
            format!(
                "the head width {} is odd; RoPE needs it even",
                dim / n_heads
            ),
        ));
    }
    let qkv_bias = match model_type {
        ModelType::Qwen2 => {
            if flag("use_sliding_window")? {
                return Err(bad(
                    "use_sliding_window",
                    "true: sliding-window attention is not supported".into(),
                ));
            }
            true
        }
        ModelType::Llama => {
            if flag("attention_bias")? {
                return Err(bad(
                    "attention_bias",
                    "true (biases on q, k, v and o_proj) is not supported".into(),
                ));
            }
            if flag("mlp_bias")? {
                return Err(bad("mlp_bias", "true is not supported".into()));
            }
            false
        }
    };
    let vocab = need("vocab_size")?;
    let pad_id = match obj.get("pad_token_id") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|&p| (p as usize) < vocab)
                .map(|p| p as u32)
                .ok_or_else(|| {
                    bad(
                        "pad_token_id",
                        format!("{v} is not a token id below vocab_size {vocab}"),
                    )
                })?,
        ),
    };
    let config = Config {
        vocab,
        dim,
        n_layers: need("num_hidden_layers")?,
        n_heads,
        n_kv_heads,
        hidden: need("intermediate_size")?,
        max_seq,
        norm_eps: float("rms_norm_eps", 1e-6)? as f32,
        rope_theta,
        qkv_bias,
        tie_embeddings: flag("tie_word_embeddings")?,
        pad_id,
    };
    let dtype = obj
        .get("torch_dtype")
        .or_else(|| obj.get("dtype"))
        .and_then(Value::as_str)
        .and_then(|s| match s {
            "float32" => Some(Dtype::F32),
            "bfloat16" => Some(Dtype::Bf16),
            "float16" => Some(Dtype::F16),
            _ => None,
        });
    let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    let bos_token_id = obj.get("bos_token_id").and_then(id);
    let eos_token_ids = match obj.get("eos_token_id") {
        Some(Value::Array(a)) => a.iter().filter_map(id).collect(),
        Some(v) => id(v).into_iter().collect(),
        None => Vec::new(),
    };
    Ok(HfConfig {
        model_type,
        config,
        dtype,
        bos_token_id,
        eos_token_ids,
        raw,
    })
}

/// A `config.json` for `cfg` as `transformers` writes it: `qwen2` when the
/// model has q/k/v biases, else `llama`; `max_position_embeddings` is
/// `cfg.max_seq`.
pub fn to_json(cfg: &Config, dtype: Dtype, bos: Option<u32>, eos: Option<u32>) -> Value {
    let model_type = if cfg.qkv_bias {
        ModelType::Qwen2
    } else {
        ModelType::Llama
    };
    let mut m = Map::new();
    m.insert(
        "architectures".into(),
        vec![model_type.architecture()].into(),
    );
    m.insert("model_type".into(), model_type.name().into());
    m.insert("hidden_size".into(), cfg.dim.into());
    m.insert("intermediate_size".into(), cfg.hidden.into());
    m.insert("num_hidden_layers".into(), cfg.n_layers.into());
    m.insert("num_attention_heads".into(), cfg.n_heads.into());
    m.insert("num_key_value_heads".into(), cfg.n_kv_heads.into());
    m.insert("head_dim".into(), cfg.head_dim().into());
    m.insert("vocab_size".into(), cfg.vocab.into());
    m.insert("max_position_embeddings".into(), cfg.max_seq.into());
    m.insert("rope_theta".into(), cfg.rope_theta.into());
    // The f32's shortest decimal (1e-6, not 9.99999997e-7).
    let eps: f64 = cfg.norm_eps.to_string().parse().unwrap_or(1e-6);
    m.insert("rms_norm_eps".into(), eps.into());
    m.insert("tie_word_embeddings".into(), cfg.tie_embeddings.into());
    m.insert("hidden_act".into(), "silu".into());
    m.insert("rope_scaling".into(), Value::Null);
    m.insert("initializer_range".into(), 0.02.into());
    m.insert("use_cache".into(), true.into());
    m.insert("torch_dtype".into(), dtype.torch_name().into());
    if model_type == ModelType::Llama {
        m.insert("attention_bias".into(), false.into());
        m.insert("mlp_bias".into(), false.into());
    } else {
        m.insert("use_sliding_window".into(), false.into());
    }
    if let Some(b) = bos {
        m.insert("bos_token_id".into(), b.into());
    }
    if let Some(e) = eos {
        m.insert("eos_token_id".into(), e.into());
    }
    if let Some(p) = cfg.pad_id {
        m.insert("pad_token_id".into(), p.into());
    }
    Value::Object(m)
}
