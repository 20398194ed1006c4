//! Loading HF-Llama / Qwen2 weights from safetensors (`--init-from`, and
//! the files of a Hugging Face directory, [`super::hf`]), and saving them.
//!
//! # Mapping
//!
//! There is none to do: [`tensors`] already names every
//! parameter as HF-Transformers' `LlamaForCausalLM` state dict does
//! (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`,
//! …, `model.norm.weight`, `lm_head.weight`), with the same row-major
//! `[out_features, in_features]` shapes. [`load`] looks each one up by name
//! and returns them in [`tensors`] order.
//!
//! The q/k projections need no permutation either. HF checkpoints store them
//! in the "rotate-half" RoPE layout (element `i` of a head pairs with element
//! `i + head_dim / 2`; Meta's original checkpoints interleave pairs and
//! `convert_llama_weights_to_hf.py` permutes them into this layout), and
//! [`ops::Rope`](super::ops::Rope) uses the same convention.
//!
//! The config decides the list: q/k/v biases (`Config::qkv_bias`) and no
//! `lm_head.weight` when the embeddings are tied. Sharded checkpoints
//! (`model-0000x-of-0000y.safetensors` plus an index) are read and written
//! by [`super::hf`] through [`SafetensorsFile`] and [`save_sharded`].
//!
//! # Reading
//!
//! Only the header is parsed up front (8-byte little-endian length, then
//! JSON, validated by the `safetensors` crate's [`Metadata`]), and every
//! check (missing tensors, shapes, dtypes, tensors the model does not use)
//! is done from it without reading any data. [`open`] stops there: it
//! returns one [`TensorFile`] per tensor, which reads any element range of
//! its tensor on demand (positioned reads of that range's bytes, converted
//! to f32: F32, BF16 and F16 are accepted) and is the engine's
//! [`zero::TensorSource`], so the engine's build streams the weights from
//! the file shard by shard and the model is never in memory. [`load`]
//! reads every tensor whole. `SafeTensors::read_metadata` is not used
//! because it insists on a buffer holding the whole file. A tensor the
//! model does not use is an error of [`open`] and [`load`] that names it,
//! except derived buffers (`model.layers.0.self_attn.rotary_emb.inv_freq`
//! in older exports); [`load_with_report`] returns such tensors instead.
//!
//! # Writing
//!
//! [`save`] writes the same names with `__metadata__ = {"format": "pt"}`
//! (what `transformers` expects), as F32, BF16 or F16, atomically: into
//! `PATH.tmp`, fsync, rename. [`save_sharded`] splits the tensors over
//! `model-0000k-of-0000n.safetensors` files with
//! `model.safetensors.index.json`, as `transformers` does. The files are
//! written by zero's streaming writer (`zero::engine::SafetensorsWriter`,
//! the one of `Engine::export_safetensors`), tensors in name order: byte
//! for byte what `safetensors::serialize_to_file` (and
//! `safetensors.torch.save_file`) write. [`save_from`] and
//! [`save_sharded_from`] take the values one [`Part`] at a time from a
//! [`FetchPart`] (an engine's units, `SftModel::part_tensors`) and write
//! each as it comes: host memory holds one unit, not the model.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::tensor::Metadata;
use zero::engine::{ExportDtype, SafetensorsWriter};

use super::train::Part;
use super::{tensors, Config};

/// The safetensors crate's limit on the JSON header (100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// Element type of the tensors written by [`save`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dtype {
    /// 32-bit float: bit-exact round trip.
    #[default]
    F32,
    /// bfloat16, rounded to nearest even: half the size, what HF ships.
    Bf16,
    /// IEEE half precision, rounded to nearest even.
    F16,
}

impl Dtype {
    /// The safetensors dtype.
    pub fn st(self) -> safetensors::Dtype {
        match self {
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::Bf16 => safetensors::Dtype::BF16,
            Dtype::F16 => safetensors::Dtype::F16,
        }
    }

    /// The dtype of a safetensors tensor, if it is one of ours.
    pub fn from_st(d: safetensors::Dtype) -> Option<Self> {
        match d {
            safetensors::Dtype::F32 => Some(Dtype::F32),
            safetensors::Dtype::BF16 => Some(Dtype::Bf16),
            safetensors::Dtype::F16 => Some(Dtype::F16),
            _ => None,
        }
    }

    /// The name `transformers` gives it in `config.json` (`torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::Bf16 => "bfloat16",
            Dtype::F16 => "float16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// zero's export dtype of the same name (its writer's).
    pub fn export(self) -> ExportDtype {
        match self {
            Dtype::F32 => ExportDtype::F32,
            Dtype::Bf16 => ExportDtype::Bf16,
            Dtype::F16 => ExportDtype::F16,
        }
    }
}

impl Dtype {
    /// The `safetensors` crate's order of dtypes in a file: the widest
    /// first (F32, BF16, F16), then by name ([`file_order`]).
    fn file_rank(self) -> u8 {
        match self {
            Dtype::F32 => 0,
            Dtype::Bf16 => 1,
            Dtype::F16 => 2,
        }
    }
}

/// The dtype each tensor of a written model takes: one for all, or one
/// per tensor of [`tensors`]`(cfg)`, in that order (a checkpoint whose
/// tensors differ in dtype, written back as it was).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorDtypes {
    /// Every tensor in this dtype.
    All(Dtype),
    /// Tensor `i` of [`tensors`]`(cfg)` in element `i`.
    Each(Vec<Dtype>),
}

impl From<Dtype> for TensorDtypes {
    fn from(d: Dtype) -> Self {
        TensorDtypes::All(d)
    }
}

impl TensorDtypes {
    /// The dtypes of the tensors of `files` (in [`tensors`] order): one
    /// for all when they agree.
    pub fn of_files(files: &[TensorFile]) -> Self {
        Self::Each(files.iter().map(TensorFile::dtype).collect()).simplified()
    }

    /// [`TensorDtypes::All`] when every tensor has the same dtype.
    pub fn simplified(self) -> Self {
        match &self {
            TensorDtypes::Each(v) if !v.is_empty() && v.iter().all(|&d| d == v[0]) => {
                TensorDtypes::All(v[0])
            }
            _ => self,
        }
    }

    /// The dtype of tensor `i`.
    pub fn of(&self, i: usize) -> Dtype {
        match self {
            TensorDtypes::All(d) => *d,
            TensorDtypes::Each(v) => v[i],
        }
    }

    /// What `config.json`'s `torch_dtype` names: the one dtype, or F32
    /// for a mix (the narrowest dtype that holds every tensor exactly:
    /// BF16 and F16 do not hold each other, F32 holds both).
    pub fn config_dtype(&self) -> Dtype {
        match self.clone().simplified() {
            TensorDtypes::All(d) => d,
            TensorDtypes::Each(_) => Dtype::F32,
        }
    }

    /// How many of `n` tensors take each dtype, the most common first.
    pub fn counts(&self, n: usize) -> Vec<(Dtype, usize)> {
        let mut out: Vec<(Dtype, usize)> = Vec::new();
        for i in 0..n {
            let d = self.of(i);
            match out.iter_mut().find(|(e, _)| *e == d) {
                Some((_, c)) => *c += 1,
                None => out.push((d, 1)),
            }
        }
        out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.file_rank().cmp(&b.0.file_rank())));
        out
    }

    /// An error naming `path` unless there is one dtype per tensor of `cfg`.
    fn check(&self, path: &Path, cfg: &Config) -> Result<(), String> {
        match self {
            TensorDtypes::Each(v) if v.len() != tensors(cfg).len() => Err(format!(
                "{}: {} dtypes given for the {} tensors of the model",
                path.display(),
                v.len(),
                tensors(cfg).len()
            )),
            _ => Ok(()),
        }
    }
}

/// [`load_with_report`], with a tensor the model does not use an error
/// (naming it), except for derived buffers such as
/// `rotary_emb.inv_freq` ([`is_derived_buffer`]).
pub fn load(path: &Path, cfg: &Config) -> Result<Vec<Vec<f32>>, String> {
    open(path, cfg)?.iter().map(TensorFile::read_all).collect()
}

/// [`load`] without reading the data: every tensor of
/// [`tensors`]`(cfg)`, in that order, checked from the header (missing,
/// shape, dtype; a tensor the model does not use is an error), to be read
/// on demand.
pub fn open(path: &Path, cfg: &Config) -> Result<Vec<TensorFile>, String> {
    let (files, ignored) = open_with_report(path, cfg)?;
    let unused: Vec<&String> = ignored.iter().filter(|n| !is_derived_buffer(n)).collect();
    if let Some(first) = unused.first() {
        return Err(format!(
            "{}: tensor `{first}` is not used by the model{}{}",
            path.display(),
            more(unused.len()),
            unused_hint(first, cfg)
        ));
    }
    Ok(files)
}

/// Whether `name` is a buffer that the model computes itself and a
/// checkpoint may carry anyway (older exports hold RoPE's `inv_freq`).
pub fn is_derived_buffer(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

/// ` (and N more)` for a list of `n` problems, or nothing for one.
pub(crate) fn more(n: usize) -> String {
    match n {
        0 | 1 => String::new(),
        n => format!(" (and {} more)", n - 1),
    }
}

/// Why an unused tensor might be there, as a suffix for the error.
pub(crate) fn unused_hint(name: &str, cfg: &Config) -> String {
    if name == "lm_head.weight" && cfg.tie_embeddings {
        "; the config ties the LM head to the embeddings (tie_word_embeddings = true)".into()
    } else if name.ends_with("_proj.bias") {
        "; the config has no such bias (attention_bias / mlp_bias, or a Qwen2 model as llama?)"
            .into()
    } else if name.starts_with("model.layers.") {
        format!("; the config has {} layers", cfg.n_layers)
    } else {
        String::new()
    }
}

/// One safetensors file open for reading: its header parsed and checked
/// against the file's length, tensors read one at a time.
pub struct SafetensorsFile {
    path: PathBuf,
    file: Arc<File>,
    data_start: u64,
    meta: Metadata,
}

impl SafetensorsFile {
    /// Opens `path` and reads its header. Errors name the file: unreadable,
    /// not a safetensors file, truncated, or with bytes after the data.
    pub fn open(path: &Path) -> Result<Self, String> {
        let fail = |msg: String| format!("{}: {msg}", path.display());
        let mut file = File::open(path).map_err(|e| fail(format!("cannot open: {e}")))?;
        let file_len = file
            .metadata()
            .map_err(|e| fail(format!("cannot stat: {e}")))?
            .len();
        let (data_start, meta) = read_header(&mut file, file_len).map_err(|e| {
            fail(format!(
                "not a safetensors file ({e}; {file_len} bytes on disk)"
            ))
        })?;
        let data_len = meta.data_len() as u64;
        if data_start + data_len > file_len {
            return Err(fail(format!(
                "truncated: the header declares {data_len} bytes of tensor data, \
                 but only {} follow it",
                file_len - data_start
            )));
        }
        if data_start + data_len < file_len {
            return Err(fail(format!(
                "corrupt: {} bytes after the end of the tensor data",
                file_len - data_start - data_len
            )));
        }
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            file: Arc::new(file),
            data_start,
            meta,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header.
    pub fn metadata(&self) -> &Metadata {
        &self.meta
    }

    /// The names of the file's tensors, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v = self.meta.offset_keys();
        v.sort();
        v
    }

    /// The dtype of tensor `name`, if the file has it.
    pub fn dtype(&self, name: &str) -> Option<safetensors::Dtype> {
        self.meta.info(name).map(|i| i.dtype)
    }

    /// Reads tensor `name`, which must have shape `shape`, converted to f32
    /// (F32, BF16 or F16). Errors name the file and the tensor.
    pub fn read(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, String> {
        self.tensor(name, shape)?.read_all()
    }

    /// Tensor `name`, which must have shape `shape` and dtype F32, BF16 or
    /// F16, to be read on demand ([`TensorFile`]): checked from the header,
    /// no data read. Errors name the file and the tensor.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<TensorFile, String> {
        let path = self.path.display();
        let info = self
            .meta
            .info(name)
            .ok_or_else(|| format!("{path}: tensor `{name}` not found"))?;
        if info.shape != shape {
            return Err(format!(
                "{path}: tensor `{name}` has shape {:?}, but the config expects {shape:?}{}",
                info.shape,
                shape_hint(name, &info.shape, shape)
            ));
        }
        let dtype = Dtype::from_st(info.dtype).ok_or_else(|| {
            format!(
                "{path}: tensor `{name}` has dtype {:?}; only F32, BF16 and F16 are supported",
                info.dtype
            )
        })?;
        let (start, end) = info.data_offsets;
        let numel: usize = shape.iter().product();
        if end - start != numel * dtype.size() {
            return Err(format!(
                "{path}: tensor `{name}` takes {} bytes, its shape {shape:?} as {:?} needs {}",
                end - start,
                info.dtype,
                numel * dtype.size()
            ));
        }
        Ok(TensorFile {
            path: self.path.clone(),
            file: self.file.clone(),
            name: name.to_string(),
            dtype,
            at: self.data_start + start as u64,
            numel,
        })
    }

    /// The raw little-endian bytes of tensor `name` as stored.
    pub fn raw_bytes(&mut self, name: &str) -> Result<Vec<u8>, String> {
        let path = self.path.display();
        let info = self
            .meta
            .info(name)
            .ok_or_else(|| format!("{path}: tensor `{name}` not found"))?;
        let (start, end) = info.data_offsets;
        let mut v = vec![0u8; end - start];
        self.file
            .read_exact_at(&mut v, self.data_start + start as u64)
            .map_err(|e| format!("{path}: cannot read tensor `{name}`: {e}"))?;
        Ok(v)
    }
}

/// Elements converted per read of a BF16 or F16 tensor (a 1 MiB buffer).
const CHUNK: usize = 1 << 19;

/// One tensor of a safetensors file ([`SafetensorsFile::tensor`]), read
/// on demand: any element range of it with a positioned read of that
/// range's bytes (the open file is shared), converted to f32. The page
/// cache holds what was read, not the process: reading a model larger
/// than memory this way keeps the resident set at the ranges in flight.
/// It is the engine's [`zero::TensorSource`]: `Init::Source` of it
/// streams the tensor into the engine's shards and swap files.
#[derive(Clone, Debug)]
pub struct TensorFile {
    path: PathBuf,
    file: Arc<File>,
    name: String,
    dtype: Dtype,
    /// Where its first byte is in the file.
    at: u64,
    numel: usize,
}

impl TensorFile {
    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor's name in the file.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The dtype it is stored in.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Where its bytes are in the file.
    pub fn bytes(&self) -> Range<u64> {
        self.at..self.at + (self.numel * self.dtype.size()) as u64
    }

    /// The whole tensor as f32. Errors name the file and the tensor.
    pub fn read_all(&self) -> Result<Vec<f32>, String> {
        let mut v = vec![0f32; self.numel];
        self.read_range(0..self.numel, &mut v)
            .map_err(|e| format!("{}: {e}", self.path.display()))?;
        Ok(v)
    }

    /// Elements `range` into `out` (as long as `range`) as f32; an error
    /// names the tensor and the elements (not the file: the callers add
    /// it).
    fn read_range(&self, range: Range<usize>, out: &mut [f32]) -> Result<(), String> {
        let name = &self.name;
        if range.end > self.numel || range.start > range.end || out.len() != range.len() {
            return Err(format!(
                "tensor `{name}`: elements {range:?} into {} values asked of its {}",
                out.len(),
                self.numel
            ));
        }
        let size = self.dtype.size();
        let at = |i: usize| self.at + (i * size) as u64;
        let read_err = |r: &Range<usize>, e: std::io::Error| {
            format!(
                "tensor `{name}`: cannot read elements {r:?} (bytes {}..{}): {e}",
                at(r.start),
                at(r.end)
            )
        };
        match self.dtype {
            Dtype::F32 => {
                self.file
                    .read_exact_at(bytemuck::cast_slice_mut(out), at(range.start))
                    .map_err(|e| read_err(&range, e))?;
                for x in out.iter_mut() {
                    *x = f32::from_bits(u32::from_le(x.to_bits()));
                }
            }
            Dtype::Bf16 | Dtype::F16 => {
                let mut raw = vec![0u16; range.len().min(CHUNK)];
                let mut i = range.start;
                for out in out.chunks_mut(CHUNK) {
                    let raw = &mut raw[..out.len()];
                    let r = i..i + out.len();
                    self.file
                        .read_exact_at(bytemuck::cast_slice_mut(raw), at(r.start))
                        .map_err(|e| read_err(&r, e))?;
                    let bits = raw.iter().map(|&b| u16::from_le(b));
                    if self.dtype == Dtype::Bf16 {
                        for (o, b) in out.iter_mut().zip(bits) {
                            *o = half::bf16::from_bits(b).to_f32();
                        }
                    } else {
                        for (o, b) in out.iter_mut().zip(bits) {
                            *o = half::f16::from_bits(b).to_f32();
                        }
                    }
                    i = r.end;
                }
            }
        }
        Ok(())
    }
}

impl zero::TensorSource for TensorFile {
    fn numel(&self) -> usize {
        self.numel
    }

    fn read(&self, range: Range<usize>, out: &mut [f32]) -> zero::Result<()> {
        self.read_range(range, out).map_err(|msg| {
            zero::Error::Core(zero::core::Error::Io {
                path: self.path.clone(),
                msg,
            })
        })
    }
}

/// Reads every tensor of [`tensors`]`(cfg)`, in that order, as
/// f32 from the safetensors file at `path`. Also returns the names of the
/// tensors in the file that the model does not use, sorted.
///
/// Errors name the file and what is wrong with it: unreadable, not a
/// safetensors file, a tensor missing, a shape that does not match `cfg`, an
/// unsupported dtype, or data cut short.
pub fn load_with_report(path: &Path, cfg: &Config) -> Result<(Vec<Vec<f32>>, Vec<String>), String> {
    let (files, ignored) = open_with_report(path, cfg)?;
    let params = files
        .iter()
        .map(TensorFile::read_all)
        .collect::<Result<_, _>>()?;
    Ok((params, ignored))
}

/// [`load_with_report`] without reading the data: the tensors to read on
/// demand ([`TensorFile`]), checked from the header.
pub fn open_with_report(
    path: &Path,
    cfg: &Config,
) -> Result<(Vec<TensorFile>, Vec<String>), String> {
    let f = SafetensorsFile::open(path)?;
    let wanted = tensors(cfg);
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|t| f.meta.info(&t.name).is_none())
        .map(|t| t.name.as_str())
        .collect();
    if let Some(first) = missing.first() {
        return Err(format!(
            "{}: tensor `{first}` not found{}{}",
            path.display(),
            more(missing.len()),
            missing_hint(first, &f.meta, cfg)
        ));
    }
    let files = wanted
        .iter()
        .map(|t| f.tensor(&t.name, &t.shape))
        .collect::<Result<Vec<_>, _>>()?;
    let used: HashSet<&str> = wanted.iter().map(|t| t.name.as_str()).collect();
    let ignored: Vec<String> = f
        .names()
        .into_iter()
        .filter(|k| !used.contains(k.as_str()))
        .collect();
    Ok((files, ignored))
}

/// Reads and validates the header; returns the file offset of the tensor
/// data and the parsed metadata.
fn read_header(file: &mut File, file_len: u64) -> Result<(u64, Metadata), String> {
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|e| format!("cannot read the 8-byte header length: {e}"))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(format!("header length {n} is impossible"));
    }
    if 8 + n > file_len {
        return Err(format!(
            "the {n}-byte header runs past the end of the file: truncated?"
        ));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(|e| format!("cannot read the header: {e}"))?;
    let text = std::str::from_utf8(&header).map_err(|e| format!("header is not UTF-8: {e}"))?;
    let meta: Metadata = serde_json::from_str(text).map_err(|e| format!("bad header JSON: {e}"))?;
    Ok((8 + n, meta))
}

/// Why `name` might be missing, as a suffix for the error.
fn missing_hint(name: &str, meta: &Metadata, cfg: &Config) -> String {
    if name == "lm_head.weight" && meta.info("model.embed_tokens.weight").is_some() {
        return "; the model probably ties lm_head to the embeddings \
                (tie_word_embeddings = true in its config.json)"
            .into();
    }
    if name.ends_with("_proj.bias") {
        return "; the config has q/k/v biases (Qwen2), the file does not".into();
    }
    if name.starts_with("model.layers.") {
        let layers = meta
            .offset_keys()
            .iter()
            .filter_map(|k| {
                k.strip_prefix("model.layers.")?
                    .split('.')
                    .next()?
                    .parse()
                    .ok()
            })
            .map(|i: usize| i + 1)
            .max()
            .unwrap_or(0);
        if layers != cfg.n_layers {
            return format!(
                "; the file has {layers} layers, the config n_layers = {}",
                cfg.n_layers
            );
        }
    }
    String::new()
}

/// Which config dimension a shape mismatch points at, as a suffix.
fn shape_hint(name: &str, file: &[usize], want: &[usize]) -> String {
    let leaf = name.rsplit('.').nth(1).unwrap_or(name);
    let dims: &[&str] = match leaf {
        "embed_tokens" | "lm_head" => &["vocab", "dim"],
        "q_proj" if name.ends_with(".bias") => &["n_heads * head_dim"],
        "k_proj" | "v_proj" if name.ends_with(".bias") => &["n_kv_heads * head_dim"],
        "q_proj" => &["n_heads * head_dim", "dim"],
        "k_proj" | "v_proj" => &["n_kv_heads * head_dim", "dim"],
        "o_proj" => &["dim", "n_heads * head_dim"],
        "gate_proj" | "up_proj" => &["hidden", "dim"],
        "down_proj" => &["dim", "hidden"],
        _ => &["dim"],
    };
    if file.len() != want.len() {
        return format!(" (rank {} instead of {})", file.len(), want.len());
    }
    let diffs: Vec<String> = dims
        .iter()
        .zip(file.iter().zip(want))
        .filter(|(_, (f, w))| f != w)
        .map(|(d, (f, w))| format!("{d}: file {f}, config {w}"))
        .collect();
    format!(" ({})", diffs.join("; "))
}

/// Writes `params` (in [`tensors`]`(cfg)` order) to `path`
/// under their HF-Llama names, as `dtype`, with `__metadata__` `{"format":
/// "pt"}`. Atomic: the file is written to `PATH.tmp`, fsynced, then renamed
/// over `path`. [`save_from`] with the values in memory.
pub fn save<P: AsRef<[f32]>>(
    path: &Path,
    cfg: &Config,
    params: &[P],
    dtype: Dtype,
) -> Result<(), String> {
    checked_infos(path, cfg, params)?;
    save_from(path, cfg, dtype, &mut in_memory(cfg, params), true)
}

/// Where a streamed export ([`save_from`], [`save_sharded_from`],
/// [`super::hf::export_from`]) gets the model: the tensors of one
/// [`Part`] at a time, those of [`Part::range`] in [`tensors`] order
/// (`SftModel::part_tensors` over an engine; [`in_memory`]). An error
/// ends the export.
pub type FetchPart<'a> = dyn FnMut(Part) -> Result<Vec<Vec<f32>>, String> + 'a;

/// A [`FetchPart`] of values in memory (in [`tensors`]`(cfg)` order):
/// each part's tensors copied when asked.
pub fn in_memory<'a, P: AsRef<[f32]>>(
    cfg: &'a Config,
    params: &'a [P],
) -> impl FnMut(Part) -> Result<Vec<Vec<f32>>, String> + 'a {
    move |part| {
        Ok(params[part.range(cfg)]
            .iter()
            .map(|p| p.as_ref().to_vec())
            .collect())
    }
}

/// [`save`], streamed: the values come from `fetch` one [`Part`] at a
/// time and go straight to the file, so memory holds one part and its
/// cast bytes, not the model. The file is the same, byte for byte.
/// `dtypes`: one [`Dtype`] for all, or one per tensor
/// ([`TensorDtypes`]); each value is rounded to nearest even into its
/// tensor's dtype.
///
/// With `write` false nothing is written: the parts are fetched all the
/// same, in the same order. That is what the ranks of an engine that do
/// not write call, so that the collectives of their fetches
/// (`SftModel::part_tensors`) match those of the rank that writes. A
/// failed write does not stop the fetches either: the error (naming the
/// file) comes back once every part was fetched.
pub fn save_from(
    path: &Path,
    cfg: &Config,
    dtypes: impl Into<TensorDtypes>,
    fetch: &mut FetchPart<'_>,
    write: bool,
) -> Result<(), String> {
    let dtypes = dtypes.into();
    dtypes.check(path, cfg)?;
    let all: Vec<usize> = (0..tensors(cfg).len()).collect();
    stream_files(cfg, &[(path.to_path_buf(), all)], &dtypes, fetch, write)
}

/// Writes tensors `infos` (names and shapes) with values `params` to
/// `path` as `dtype`, atomically, as [`save`] does.
pub fn save_named<P: AsRef<[f32]>>(
    path: &Path,
    infos: &[super::TensorInfo],
    params: &[P],
    dtype: Dtype,
) -> Result<(), String> {
    assert_eq!(infos.len(), params.len(), "one value vector per tensor");
    for (t, p) in infos.iter().zip(params) {
        if p.as_ref().len() != t.numel() {
            return Err(format!(
                "{}: tensor `{}` has {} values, its shape {:?} needs {}",
                path.display(),
                t.name,
                p.as_ref().len(),
                t.shape,
                t.numel()
            ));
        }
    }
    let dtypes = TensorDtypes::All(dtype);
    let order = file_order(infos, (0..infos.len()).collect(), &dtypes);
    let mut w = create(path, infos, &order, &dtypes)?;
    for &i in &order {
        w.write(params[i].as_ref()).map_err(st_err)?;
    }
    w.finish().map_err(st_err)?;
    Ok(())
}

/// The file names and the index of [`save_sharded`].
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Writes `params` (in [`tensors`]`(cfg)` order) into directory `dir` as
/// `transformers` does: one `model.safetensors` when the tensors take at
/// most `max_shard_bytes` as `dtype`, else `model-0000k-of-0000n.safetensors`
/// files of at most that size each (a bigger tensor gets a file of its
/// own), in tensor order, and `model.safetensors.index.json` with
/// `metadata.total_size` and the `weight_map`. Each file is atomic
/// ([`save`]); returns the names of the files written.
/// [`save_sharded_from`] with the values in memory.
pub fn save_sharded<P: AsRef<[f32]>>(
    dir: &Path,
    cfg: &Config,
    params: &[P],
    dtype: Dtype,
    max_shard_bytes: u64,
) -> Result<Vec<String>, String> {
    checked_infos(dir, cfg, params)?;
    save_sharded_from(
        dir,
        cfg,
        dtype,
        max_shard_bytes,
        &mut in_memory(cfg, params),
        true,
    )
}

/// [`save_sharded`], streamed as [`save_from`] is (`write` false: fetch
/// only, and return no names), with one dtype or one per tensor
/// ([`TensorDtypes`]). A part whose tensors fall in two files is fetched
/// once for each.
pub fn save_sharded_from(
    dir: &Path,
    cfg: &Config,
    dtypes: impl Into<TensorDtypes>,
    max_shard_bytes: u64,
    fetch: &mut FetchPart<'_>,
    write: bool,
) -> Result<Vec<String>, String> {
    let dtypes = dtypes.into();
    dtypes.check(dir, cfg)?;
    let infos = tensors(cfg);
    let bytes = |i: usize| (infos[i].numel() * dtypes.of(i).size()) as u64;
    let total: u64 = (0..infos.len()).map(bytes).sum();
    if total <= max_shard_bytes {
        let name = "model.safetensors".to_string();
        let all: Vec<usize> = (0..infos.len()).collect();
        stream_files(cfg, &[(dir.join(&name), all)], &dtypes, fetch, write)?;
        return Ok(if write { vec![name] } else { Vec::new() });
    }
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for i in 0..infos.len() {
        let last = shards.last_mut().expect("one shard at least");
        if !last.is_empty() && size + bytes(i) > max_shard_bytes {
            shards.push(vec![i]);
            size = bytes(i);
        } else {
            last.push(i);
            size += bytes(i);
        }
    }
    let n = shards.len();
    let names: Vec<String> = (1..=n)
        .map(|k| format!("model-{k:05}-of-{n:05}.safetensors"))
        .collect();
    let mut weight_map = serde_json::Map::new();
    for (name, shard) in names.iter().zip(&shards) {
        for &i in shard {
            weight_map.insert(infos[i].name.clone(), name.clone().into());
        }
    }
    let files: Vec<(PathBuf, Vec<usize>)> = names
        .iter()
        .map(|name| dir.join(name))
        .zip(shards)
        .collect();
    stream_files(cfg, &files, &dtypes, fetch, write)?;
    if !write {
        return Ok(Vec::new());
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let text = serde_json::to_string_pretty(&index).expect("JSON of strings and numbers");
    write_atomic(&dir.join(INDEX_FILE), text.as_bytes())?;
    let mut names = names;
    names.push(INDEX_FILE.to_string());
    Ok(names)
}

/// The tensor list of `cfg` after checking that `params` fits it.
pub(crate) fn checked_infos<P: AsRef<[f32]>>(
    path: &Path,
    cfg: &Config,
    params: &[P],
) -> Result<Vec<super::TensorInfo>, String> {
    let fail = |msg: String| format!("{}: {msg}", path.display());
    let infos = tensors(cfg);
    if params.len() != infos.len() {
        return Err(fail(format!(
            "{} parameter tensors given, the config has {}",
            params.len(),
            infos.len()
        )));
    }
    for (t, p) in infos.iter().zip(params) {
        if p.as_ref().len() != t.numel() {
            return Err(fail(format!(
                "tensor `{}` has {} values, its shape {:?} needs {}",
                t.name,
                p.as_ref().len(),
                t.shape,
                t.numel()
            )));
        }
    }
    Ok(infos)
}

/// Tensors `which` of `infos` in the order a safetensors file holds them
/// as `dtypes`: by dtype, the widest first, then by name (the `safetensors`
/// crate's and `safetensors.torch.save_file`'s order; by name alone for
/// tensors of one dtype), so that the files are what they were when
/// `safetensors::serialize_to_file` wrote them.
fn file_order(
    infos: &[super::TensorInfo],
    mut which: Vec<usize>,
    dtypes: &TensorDtypes,
) -> Vec<usize> {
    which.sort_by(|&a, &b| {
        (dtypes.of(a).file_rank(), &infos[a].name).cmp(&(dtypes.of(b).file_rank(), &infos[b].name))
    });
    which
}

/// The error of the library's writer: its path and what went wrong.
fn st_err(e: zero::Error) -> String {
    match e {
        zero::Error::Checkpoint { path, what } => format!("{}: {what}", path.display()),
        e => e.to_string(),
    }
}

/// Creates the file `path` of tensors `order` of `infos` (in that order),
/// each in its dtype of `dtypes`: zero's streaming writer
/// ([`SafetensorsWriter`]), header written.
fn create(
    path: &Path,
    infos: &[super::TensorInfo],
    order: &[usize],
    dtypes: &TensorDtypes,
) -> Result<SafetensorsWriter, String> {
    let named: Vec<(&str, &[usize], ExportDtype)> = order
        .iter()
        .map(|&i| {
            (
                infos[i].name.as_str(),
                &infos[i].shape[..],
                dtypes.of(i).export(),
            )
        })
        .collect();
    SafetensorsWriter::create_typed(path, &named).map_err(st_err)
}

/// Writes each file of `files` (its path and its tensors, positions in
/// [`tensors`]`(cfg)`), one after the other, with the values of `fetch`
/// (see [`save_from`]). Each file holds its tensors in [`file_order`],
/// which mixes the parts (`lm_head.weight` first, `model.norm.weight`
/// last, layer 10 after layer 1): a part is fetched when the file reaches
/// its first tensor there, and its other tensors in that file wait,
/// as they are, until the file reaches them; those of other files are
/// dropped. Memory: one part, what waits of earlier parts (the final
/// norm), and the cast bytes of one tensor.
fn stream_files(
    cfg: &Config,
    files: &[(PathBuf, Vec<usize>)],
    dtypes: &TensorDtypes,
    fetch: &mut FetchPart<'_>,
    write: bool,
) -> Result<(), String> {
    let infos = tensors(cfg);
    // The first failed write; the fetches go on after it.
    let mut failed: Option<String> = None;
    for (path, which) in files {
        let order = file_order(&infos, which.clone(), dtypes);
        let mut out = None;
        if write && failed.is_none() {
            match create(path, &infos, &order, dtypes) {
                Ok(w) => out = Some(w),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        let mut waiting: HashMap<usize, Vec<f32>> = HashMap::new();
        for &i in &order {
            let values = match waiting.remove(&i) {
                Some(v) => v,
                None => {
                    let part = Part::of(cfg, i);
                    let range = part.range(cfg);
                    let got = fetch(part)?;
                    if got.len() != range.len() {
                        return Err(format!(
                            "{}: {part:?} came with {} tensors, not {}",
                            path.display(),
                            got.len(),
                            range.len()
                        ));
                    }
                    let mut mine = Vec::new();
                    for (j, v) in range.zip(got) {
                        if v.len() != infos[j].numel() {
                            return Err(format!(
                                "{}: tensor `{}` came with {} values, its shape {:?} needs {}",
                                path.display(),
                                infos[j].name,
                                v.len(),
                                infos[j].shape,
                                infos[j].numel()
                            ));
                        }
                        if j == i {
                            mine = v;
                        } else if which.contains(&j) {
                            waiting.insert(j, v);
                        }
                    }
                    mine
                }
            };
            if let Some(w) = out.as_mut() {
                if let Err(e) = w.write(&values) {
                    failed.get_or_insert(st_err(e));
                    out = None;
                }
            }
        }
        if let Some(w) = out {
            if let Err(e) = w.finish() {
                failed.get_or_insert(st_err(e));
            }
        }
    }
    failed.map_or(Ok(()), Err)
}

/// `PATH.tmp`.
fn tmp_path(path: &Path) -> PathBuf {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    PathBuf::from(tmp)
}

/// Writes `bytes` to `path` atomically: `PATH.tmp`, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let tmp = tmp_path(path);
    let written = File::create(&tmp).and_then(|mut f| {
        std::io::Write::write_all(&mut f, bytes)?;
        f.sync_all()
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("{}: cannot write: {e}", tmp.display()));
    }
    rename_into_place(&tmp, path)
}

/// Renames `tmp` over `path` and syncs the directory (best effort).
fn rename_into_place(tmp: &Path, path: &Path) -> Result<(), String> {
    std::fs::rename(tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(tmp);
        format!(
            "{}: cannot rename {} into place: {e}",
            path.display(),
            tmp.display()
        )
    })?;
    // Make the rename itself durable (best effort: not every platform lets a
    // directory be opened).
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One dtype per tensor or one for all; F32 names a mix in
    /// `config.json`; the file order is the `safetensors` crate's (F32,
    /// BF16, F16, each by name).
    #[test]
    fn tensor_dtypes_count_name_and_order() {
        let each = TensorDtypes::Each(vec![Dtype::Bf16, Dtype::F16, Dtype::F32, Dtype::Bf16]);
        assert_eq!(each.of(1), Dtype::F16);
        assert_eq!(each.config_dtype(), Dtype::F32);
        assert_eq!(
            each.counts(4),
            [(Dtype::Bf16, 2), (Dtype::F32, 1), (Dtype::F16, 1)]
        );
        let same = TensorDtypes::Each(vec![Dtype::F16; 3]).simplified();
        assert_eq!(same, TensorDtypes::All(Dtype::F16));
        assert_eq!(same.config_dtype(), Dtype::F16);
        let info = |n: &str| super::super::TensorInfo {
            name: n.into(),
            shape: vec![1],
            kind: super::super::Kind::Norm,
        };
        let infos = [info("d"), info("c"), info("b"), info("a")];
        assert_eq!(file_order(&infos, vec![0, 1, 2, 3], &each), [2, 3, 0, 1]);
        assert_eq!(
            file_order(&infos, vec![0, 1, 2, 3], &TensorDtypes::All(Dtype::Bf16)),
            [3, 2, 1, 0]
        );
        let cfg = Config::tiny();
        let e = each.check(Path::new("x"), &cfg).unwrap_err();
        assert!(e.contains("4 dtypes given for the"), "{e}");
    }
}
