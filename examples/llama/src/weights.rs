//! Loading HF-Llama weights from safetensors (`--init-from`), and saving them.
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
//! Not supported: tied embeddings (a file without `lm_head.weight`), biases,
//! sharded checkpoints (`model-0000x-of-0000y.safetensors` plus an index).
//!
//! # Reading
//!
//! Memory is bounded by the model, not by the file: only the header is
//! parsed up front (8-byte little-endian length, then JSON, validated by the
//! `safetensors` crate's [`Metadata`]), then each needed tensor's byte range
//! is read with seek + `read_exact` and converted to f32 (F32, BF16 and F16
//! are accepted). `SafeTensors::read_metadata` is not used because it insists
//! on a buffer holding the whole file. Tensors the model does not use (e.g.
//! `model.layers.0.self_attn.rotary_emb.inv_freq` in older exports) are
//! skipped and reported by [`load_with_report`].
//!
//! # Writing
//!
//! [`save`] writes the same names with `__metadata__ = {"format": "pt"}`
//! (what `transformers` expects), as F32 or BF16, atomically: into
//! `PATH.tmp`, fsync, rename.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use safetensors::tensor::Metadata;
use safetensors::View;

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
}

impl Dtype {
    fn st(self) -> safetensors::Dtype {
        match self {
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::Bf16 => safetensors::Dtype::BF16,
        }
    }
}

/// [`load_with_report`] without the list of ignored tensors.
pub fn load(path: &Path, cfg: &Config) -> Result<Vec<Vec<f32>>, String> {
    load_with_report(path, cfg).map(|(params, _)| params)
}

/// Reads every tensor of [`tensors`]`(cfg)`, in that order, as
/// f32 from the safetensors file at `path`. Also returns the names of the
/// tensors in the file that the model does not use, sorted.
///
/// Errors name the file and what is wrong with it: unreadable, not a
/// safetensors file, a tensor missing, a shape that does not match `cfg`, an
/// unsupported dtype, or data cut short.
pub fn load_with_report(path: &Path, cfg: &Config) -> Result<(Vec<Vec<f32>>, Vec<String>), String> {
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

    let wanted = tensors(cfg);
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|t| meta.info(&t.name).is_none())
        .map(|t| t.name.as_str())
        .collect();
    if let Some(first) = missing.first() {
        let more = match missing.len() {
            1 => String::new(),
            n => format!(" (and {} more)", n - 1),
        };
        return Err(fail(format!(
            "tensor `{first}` not found{more}{}",
            missing_hint(first, &meta, cfg)
        )));
    }

    let mut params = Vec::with_capacity(wanted.len());
    for t in &wanted {
        let info = meta.info(&t.name).expect("checked above");
        if info.shape != t.shape {
            return Err(fail(format!(
                "tensor `{}` has shape {:?}, but the config expects {:?}{}",
                t.name,
                info.shape,
                t.shape,
                shape_hint(&t.name, &info.shape, &t.shape)
            )));
        }
        let (start, end) = info.data_offsets;
        file.seek(SeekFrom::Start(data_start + start as u64))
            .map_err(|e| fail(format!("cannot seek to tensor `{}`: {e}", t.name)))?;
        let read_err = |e: std::io::Error| fail(format!("cannot read tensor `{}`: {e}", t.name));
        let n = t.numel();
        let values = match info.dtype {
            safetensors::Dtype::F32 => {
                let mut v = vec![0f32; n];
                file.read_exact(bytemuck::cast_slice_mut(&mut v))
                    .map_err(read_err)?;
                for x in &mut v {
                    *x = f32::from_bits(u32::from_le(x.to_bits()));
                }
                v
            }
            dt @ (safetensors::Dtype::BF16 | safetensors::Dtype::F16) => {
                let mut raw = vec![0u16; n];
                file.read_exact(bytemuck::cast_slice_mut(&mut raw))
                    .map_err(read_err)?;
                let bits = raw.iter().map(|&b| u16::from_le(b));
                if dt == safetensors::Dtype::BF16 {
                    bits.map(|b| half::bf16::from_bits(b).to_f32()).collect()
                } else {
                    bits.map(|b| half::f16::from_bits(b).to_f32()).collect()
                }
            }
            other => {
                return Err(fail(format!(
                    "tensor `{}` has dtype {other:?}; only F32, BF16 and F16 are supported",
                    t.name
                )))
            }
        };
        debug_assert_eq!(end - start, n * info.dtype.bitsize() / 8);
        params.push(values);
    }

    let used: HashSet<&str> = wanted.iter().map(|t| t.name.as_str()).collect();
    let mut ignored: Vec<String> = meta
        .offset_keys()
        .into_iter()
        .filter(|k| !used.contains(k.as_str()))
        .collect();
    ignored.sort();
    Ok((params, ignored))
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
                (tie_word_embeddings = true), which is not supported"
            .into();
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

/// One tensor for `serialize_to_file`, converted lazily so that at most one
/// BF16 copy exists at a time.
struct Out<'a> {
    data: &'a [f32],
    shape: &'a [usize],
    dtype: Dtype,
}

impl View for Out<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype.st()
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match self.dtype {
            Dtype::F32 if cfg!(target_endian = "little") => {
                Cow::Borrowed(bytemuck::cast_slice(self.data))
            }
            Dtype::F32 => Cow::Owned(self.data.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Dtype::Bf16 => Cow::Owned(
                self.data
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
            ),
        }
    }
    fn data_len(&self) -> usize {
        self.data.len() * self.dtype.st().bitsize() / 8
    }
}

/// Writes `params` (in [`tensors`]`(cfg)` order) to `path`
/// under their HF-Llama names, as `dtype`, with `__metadata__` `{"format":
/// "pt"}`. Atomic: the file is written to `PATH.tmp`, fsynced, then renamed
/// over `path`.
pub fn save<P: AsRef<[f32]>>(
    path: &Path,
    cfg: &Config,
    params: &[P],
    dtype: Dtype,
) -> Result<(), String> {
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
    let views = infos.iter().zip(params).map(|(t, p)| {
        let out = Out {
            data: p.as_ref(),
            shape: &t.shape,
            dtype,
        };
        (t.name.as_str(), out)
    });
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);

    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let written = safetensors::serialize_to_file(views, Some(meta), &tmp)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            // `serialize_to_file` flushes but does not sync; fsync of any
            // descriptor of the file covers its data.
            File::open(&tmp)
                .and_then(|f| f.sync_all())
                .map_err(|e| format!("fsync: {e}"))
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(format!("cannot write {}: {e}", tmp.display())));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        fail(format!("cannot rename {} into place: {e}", tmp.display()))
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
