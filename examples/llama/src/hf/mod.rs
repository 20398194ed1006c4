//! Hugging Face model directories in and out: `config.json`
//! ([`config`]), the weights (`model.safetensors`, or
//! `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`;
//! F32, BF16 or F16) and the tokenizer ([`tokenizer`]).
//!
//! # In
//!
//! [`HfDir::open`] reads the config and the weights' headers, and checks
//! before training starts: a missing tensor, a tensor of the wrong shape or
//! dtype, a tensor the model does not use (a derived `rotary_emb.inv_freq`
//! aside), an index naming a missing file or a tensor its file lacks, a
//! shard tensor the index does not list. Each error names the file and the
//! tensor, shape or key. It reads no weight: each is a
//! [`weights::TensorFile`], read range by range when the engine's build
//! asks (`Init::Source`), so a model larger than memory streams from its
//! files. [`HfModel::open`] reads every weight into memory as well.
//!
//! # Out
//!
//! [`export`] writes a directory that `transformers` loads as it is:
//! `config.json` (the source's, with `dtype` / `torch_dtype` set to the
//! written dtype, or one made from the [`Config`]; tensors of several
//! dtypes, as a checkpoint of mixed dtypes is written back, are named
//! `float32`, the narrowest dtype that holds them all:
//! [`TensorDtypes::config_dtype`]), `generation_config.json` (the
//! source's, or BOS/EOS), the weights ([`weights::save_sharded`]) and the
//! source's tokenizer files.

pub mod config;
pub mod tokenizer;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::weights::{self, Dtype, SafetensorsFile, TensorDtypes, TensorFile, INDEX_FILE};
use super::{tensors, Config};
pub use config::{HfConfig, ModelType};
pub use tokenizer::HfTokenizer;

/// The single-file weights' name.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// A model read from a Hugging Face directory.
pub struct HfModel {
    /// The directory.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub hf: HfConfig,
    /// Every tensor of [`tensors`]`(&hf.config)`, in that order, as f32.
    pub params: Vec<Vec<f32>>,
    /// The dtype the weights are stored in (of the embedding).
    pub dtype: Dtype,
}

impl HfModel {
    /// Reads `dir/config.json` and the weights, checked as the module's
    /// doc says.
    pub fn open(dir: &Path) -> Result<Self, String> {
        let HfDir {
            dir,
            hf,
            weights,
            dtype,
        } = HfDir::open(dir)?;
        let params = read_all(&weights)?;
        Ok(HfModel {
            dir,
            hf,
            params,
            dtype,
        })
    }
}

/// A model of a Hugging Face directory, its weights checked but not read.
pub struct HfDir {
    /// The directory.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub hf: HfConfig,
    /// Every tensor of [`tensors`]`(&hf.config)`, in that order, to read
    /// on demand.
    pub weights: Vec<TensorFile>,
    /// The dtype the weights are stored in (of the embedding).
    pub dtype: Dtype,
}

impl HfDir {
    /// Reads `dir/config.json` and the weights' headers, checked as the
    /// module's doc says.
    pub fn open(dir: &Path) -> Result<Self, String> {
        if !dir.is_dir() {
            return Err(format!("{}: not a directory", dir.display()));
        }
        let hf = config::read(&dir.join("config.json"))?;
        let (weights, dtype) = weight_files(dir, &hf.config)?;
        Ok(HfDir {
            dir: dir.to_path_buf(),
            hf,
            weights,
            dtype,
        })
    }
}

/// Every tensor of `files` read whole.
fn read_all(files: &[TensorFile]) -> Result<Vec<Vec<f32>>, String> {
    files.iter().map(TensorFile::read_all).collect()
}

/// Reads the weights of directory `dir` for `cfg`: every tensor of
/// [`tensors`]`(cfg)` in that order, as f32, and the stored dtype.
pub fn load_weights(dir: &Path, cfg: &Config) -> Result<(Vec<Vec<f32>>, Dtype), String> {
    let (files, dtype) = weight_files(dir, cfg)?;
    Ok((read_all(&files)?, dtype))
}

/// [`load_weights`] without reading the data: the tensors to read on
/// demand, checked from the headers, and the stored dtype.
pub fn weight_files(dir: &Path, cfg: &Config) -> Result<(Vec<TensorFile>, Dtype), String> {
    let index_path = dir.join(INDEX_FILE);
    let single = dir.join(WEIGHTS_FILE);
    // Tensor name -> file name, and every file open.
    let (map, files): (BTreeMap<String, String>, HashMap<String, SafetensorsFile>) =
        if index_path.is_file() {
            read_index(&index_path, dir)?
        } else if single.is_file() {
            let f = SafetensorsFile::open(&single)?;
            let map = f
                .names()
                .into_iter()
                .map(|n| (n, WEIGHTS_FILE.to_string()))
                .collect();
            (map, HashMap::from([(WEIGHTS_FILE.to_string(), f)]))
        } else {
            return Err(format!(
                "{}: no {WEIGHTS_FILE} and no {INDEX_FILE}",
                dir.display()
            ));
        };
    let wanted = tensors(cfg);
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|t| !map.contains_key(&t.name))
        .map(|t| t.name.as_str())
        .collect();
    let where_ = if index_path.is_file() {
        index_path.display().to_string()
    } else {
        single.display().to_string()
    };
    if let Some(first) = missing.first() {
        let hint = if *first == "lm_head.weight" {
            "; if the model ties the LM head to the embeddings, its config.json \
             needs tie_word_embeddings = true"
        } else if first.ends_with("_proj.bias") {
            "; model_type qwen2 has q/k/v biases"
        } else {
            ""
        };
        return Err(format!(
            "{where_}: tensor `{first}` not found{}{hint}",
            weights::more(missing.len())
        ));
    }
    let used: BTreeSet<&str> = wanted.iter().map(|t| t.name.as_str()).collect();
    let unused: Vec<&String> = map
        .keys()
        .filter(|k| !used.contains(k.as_str()) && !weights::is_derived_buffer(k))
        .collect();
    if let Some(first) = unused.first() {
        return Err(format!(
            "{}: tensor `{first}` is not used by the model{}{}",
            dir.join(&map[*first]).display(),
            weights::more(unused.len()),
            weights::unused_hint(first, cfg)
        ));
    }
    let dtype_of = |f: &SafetensorsFile, name: &str| -> Result<Dtype, String> {
        let d = f.dtype(name).expect("listed");
        Dtype::from_st(d).ok_or_else(|| {
            format!(
                "{}: tensor `{name}` has dtype {d:?}; only F32, BF16 and F16 are supported",
                f.path().display()
            )
        })
    };
    let first = &wanted[0].name;
    let dtype = dtype_of(&files[&map[first]], first)?;
    let mut params = Vec::with_capacity(wanted.len());
    for t in &wanted {
        let f = &files[&map[&t.name]];
        dtype_of(f, &t.name)?;
        params.push(f.tensor(&t.name, &t.shape)?);
    }
    Ok((params, dtype))
}

/// Reads a `model.safetensors.index.json` and opens every file it names;
/// checks that each listed tensor is in its file and that each file holds
/// only listed tensors.
#[allow(clippy::type_complexity)]
fn read_index(
    path: &Path,
    dir: &Path,
) -> Result<(BTreeMap<String, String>, HashMap<String, SafetensorsFile>), String> {
    let p = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{p}: cannot read: {e}"))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{p}: not valid JSON: {e}"))?;
    let wm = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| format!("{p}: `weight_map`: missing or not an object"))?;
    let mut map = BTreeMap::new();
    for (name, file) in wm {
        let file = file
            .as_str()
            .ok_or_else(|| format!("{p}: `weight_map.{name}`: {file} is not a file name"))?;
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(format!(
                "{p}: `weight_map.{name}`: {file:?} is not a file of the directory"
            ));
        }
        map.insert(name.clone(), file.to_string());
    }
    let mut files = HashMap::new();
    for file in map.values().collect::<BTreeSet<_>>() {
        let fp = dir.join(file);
        if !fp.is_file() {
            let names: Vec<&String> = map.iter().filter(|e| e.1 == file).map(|e| e.0).collect();
            return Err(format!(
                "{p}: names {file} (for `{}`{}), which is missing from {}",
                names[0],
                weights::more(names.len()),
                dir.display()
            ));
        }
        let f = SafetensorsFile::open(&fp)?;
        for n in f.names() {
            if map.get(&n) != Some(file) {
                return Err(format!(
                    "{}: tensor `{n}` is not listed for this file in {p}",
                    fp.display()
                ));
            }
        }
        files.insert(file.clone(), f);
    }
    for (name, file) in &map {
        if files[file].dtype(name).is_none() {
            return Err(format!(
                "{p}: lists tensor `{name}` in {file}, which does not have it"
            ));
        }
    }
    Ok((map, files))
}

/// What an export copies from the directory the model came from.
pub struct ExportSource<'a> {
    /// The source directory (its tokenizer files and
    /// `generation_config.json` are copied).
    pub dir: &'a Path,
    /// Its config (written back with `torch_dtype` set).
    pub hf: &'a HfConfig,
}

/// The default shard size of [`export`]: 5 GB, `transformers`' default
/// `max_shard_size`.
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// Writes `params` (in [`tensors`]`(cfg)` order) as a Hugging Face
/// directory `dir` (created if needed): see the module's doc. `bos`/`eos`
/// go into a made config when there is no source. Returns the names of the
/// files written, sorted. [`export_from`] with the values in memory.
pub fn export<P: AsRef<[f32]>>(
    dir: &Path,
    cfg: &Config,
    params: &[P],
    dtype: Dtype,
    source: Option<ExportSource<'_>>,
    bos_eos: (Option<u32>, Option<u32>),
    max_shard_bytes: u64,
) -> Result<Vec<String>, String> {
    weights::checked_infos(dir, cfg, params)?;
    let out = Export {
        dtypes: dtype.into(),
        source,
        bos_eos,
        max_shard_bytes,
    };
    export_from(dir, cfg, &mut weights::in_memory(cfg, params), out, true)
}

/// How [`export_from`] writes a directory.
pub struct Export<'a> {
    /// The weights' dtypes, one for all or one per tensor
    /// (`config.json`'s `dtype` / `torch_dtype`:
    /// [`TensorDtypes::config_dtype`]).
    pub dtypes: TensorDtypes,
    /// The directory the model came from, if any.
    pub source: Option<ExportSource<'a>>,
    /// BOS and EOS for a made config (no source).
    pub bos_eos: (Option<u32>, Option<u32>),
    /// The largest weights file ([`DEFAULT_SHARD_BYTES`]).
    pub max_shard_bytes: u64,
}

/// [`export`], the weights streamed: they come from `fetch` one part at a
/// time and go straight to their file ([`weights::save_sharded_from`]),
/// so host memory holds one unit of the model, not the model. With
/// `write` false (the ranks of an engine that do not write) the parts are
/// fetched in the same order and nothing is written; it returns no names.
pub fn export_from(
    dir: &Path,
    cfg: &Config,
    fetch: &mut weights::FetchPart<'_>,
    out: Export<'_>,
    write: bool,
) -> Result<Vec<String>, String> {
    let Export {
        dtypes,
        source,
        bos_eos,
        max_shard_bytes,
    } = out;
    if !write {
        return weights::save_sharded_from(dir, cfg, dtypes, max_shard_bytes, fetch, false);
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: cannot create: {e}", dir.display()))?;
    let dtype = dtypes.config_dtype();
    let mut written = weights::save_sharded_from(dir, cfg, dtypes, max_shard_bytes, fetch, true)?;
    let json = |v: &Value| serde_json::to_string_pretty(v).expect("JSON value") + "\n";
    let config = match &source {
        Some(s) => {
            let mut raw = s.hf.raw.clone();
            if let Some(o) = raw.as_object_mut() {
                set_dtype(o, dtype);
            }
            raw
        }
        None => config::to_json(cfg, dtype, bos_eos.0, bos_eos.1),
    };
    weights::write_atomic(&dir.join("config.json"), json(&config).as_bytes())?;
    written.push("config.json".into());
    let gen_src = source
        .as_ref()
        .map(|s| s.dir.join("generation_config.json"));
    match gen_src.filter(|p| p.is_file()) {
        Some(p) => copy(&p, &dir.join("generation_config.json"))?,
        None => {
            let mut g = serde_json::Map::new();
            let (bos, eos) = match &source {
                Some(s) => (s.hf.bos_token_id, s.hf.eos_token_ids.first().copied()),
                None => bos_eos,
            };
            if let Some(b) = bos {
                g.insert("bos_token_id".into(), b.into());
            }
            if let Some(e) = eos {
                g.insert("eos_token_id".into(), e.into());
            }
            weights::write_atomic(
                &dir.join("generation_config.json"),
                json(&Value::Object(g)).as_bytes(),
            )?;
        }
    }
    written.push("generation_config.json".into());
    if let Some(s) = &source {
        for name in tokenizer::TOKENIZER_FILES {
            let from = s.dir.join(name);
            if from.is_file() {
                copy(&from, &dir.join(name))?;
                written.push((*name).to_string());
            }
        }
    }
    written.sort();
    Ok(written)
}

/// Names `dtype` in a `config.json` object: transformers 5 writes
/// `dtype`, 4 `torch_dtype`; each key present is set, and `torch_dtype`
/// is added when neither is.
pub fn set_dtype(config: &mut serde_json::Map<String, Value>, dtype: Dtype) {
    let mut set = false;
    for key in ["dtype", "torch_dtype"] {
        if let Some(v) = config.get_mut(key) {
            *v = dtype.torch_name().into();
            set = true;
        }
    }
    if !set {
        config.insert("torch_dtype".into(), dtype.torch_name().into());
    }
}

/// Copies `from` to `to` atomically.
fn copy(from: &Path, to: &Path) -> Result<(), String> {
    let bytes = std::fs::read(from).map_err(|e| format!("{}: cannot read: {e}", from.display()))?;
    weights::write_atomic(to, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each of `dtype` / `torch_dtype` present is set; `torch_dtype` is
    /// added when neither is.
    #[test]
    fn set_dtype_names_the_written_dtype_under_every_key() {
        let obj = |v: Value| v.as_object().unwrap().clone();
        let mut both = obj(serde_json::json!({"dtype": "float32", "torch_dtype": "float32"}));
        set_dtype(&mut both, Dtype::Bf16);
        assert_eq!(
            Value::Object(both),
            serde_json::json!({"dtype": "bfloat16", "torch_dtype": "bfloat16"})
        );
        let mut old = obj(serde_json::json!({"torch_dtype": "bfloat16", "x": 1}));
        set_dtype(&mut old, Dtype::F32);
        assert_eq!(
            Value::Object(old),
            serde_json::json!({"torch_dtype": "float32", "x": 1})
        );
        let mut new = obj(serde_json::json!({"dtype": "bfloat16"}));
        set_dtype(&mut new, Dtype::F16);
        assert_eq!(Value::Object(new), serde_json::json!({"dtype": "float16"}));
        let mut none = obj(serde_json::json!({}));
        set_dtype(&mut none, Dtype::F32);
        assert_eq!(
            Value::Object(none),
            serde_json::json!({"torch_dtype": "float32"})
        );
    }
}
