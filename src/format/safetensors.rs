//! The safetensors file: its header (tensor names, dtypes, shapes and
//! offsets, computed from the unit layouts) and a writer that streams the
//! values unit by unit.
//!
//! # File
//!
//! ```text
//!  u64 LE n | header: n bytes of JSON, padded with spaces to n % 8 == 0 | data
//!  {"__metadata__": {"format": "pt"},
//!   "<tensor>": {"dtype": "F32"|"BF16"|"F16", "shape": [..], "data_offsets": [b, e]},
//!   …}                                      (units in order, their tensors in order)
//! ```
//!
//! Tensors are packed contiguously in a unit's flat buffer, so the data
//! section is the concatenation of every unit's real elements, cast: the
//! header is computed up front from the shapes and the values are streamed
//! unit by unit ([`SafetensorsWriter::write`]). The file is written to
//! `PATH.tmp`, fsynced and renamed over `PATH`; a failed write leaves no
//! file behind.
//!
//! # Values and names
//!
//! The values are given as f32: `F32` is written exactly, `BF16`/`F16`
//! rounded to nearest even (`half`). Tensor names are the registered
//! tensor names when they are unique across the model (the Llama
//! example's HF names); otherwise every tensor is named `<unit>.<tensor>`
//! (the MLP's `layer0.weight`, …).

use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use zero_core::partition::UnitLayout;
use zero_core::{bf16, f16, DType};

use super::{ck as err, sync_dir};
use crate::Result;

/// The write buffer of the safetensors file.
const WRITE_BUF: usize = 4 << 20;

/// The element type of an exported safetensors file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum ExportDtype {
    /// 32-bit float: the fp32 master, bit for bit.
    #[default]
    F32,
    /// bfloat16, rounded to nearest even: the parameters of a bf16 run.
    Bf16,
    /// IEEE half, rounded to nearest even: the parameters of an fp16 run.
    F16,
}

impl ExportDtype {
    /// The export dtype holding parameters of dtype `dt`.
    pub fn of(dt: DType) -> Self {
        match dt {
            DType::F32 => Self::F32,
            DType::BF16 => Self::Bf16,
            DType::F16 => Self::F16,
        }
    }

    /// The dtype's name in a safetensors header (`F32`, `BF16`, `F16`).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::Bf16 => "BF16",
            Self::F16 => "F16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }

    /// Appends `values` cast to this dtype, little endian, to `out`.
    fn encode(self, values: &[f32], out: &mut Vec<u8>) {
        out.reserve(values.len() * self.size());
        match self {
            Self::F32 => {
                for x in values {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            Self::Bf16 => {
                for &x in values {
                    out.extend_from_slice(&bf16::from_f32(x).to_le_bytes());
                }
            }
            Self::F16 => {
                for &x in values {
                    out.extend_from_slice(&f16::from_f32(x).to_le_bytes());
                }
            }
        }
    }
}

impl std::str::FromStr for ExportDtype {
    type Err = String;

    /// `fp32`/`f32`, `bf16`, `fp16`/`f16` (any case).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "fp16" | "f16" | "float16" => Ok(Self::F16),
            _ => Err(format!("unknown dtype `{s}` (expected fp32, bf16 or fp16)")),
        }
    }
}

/// The exported name of every tensor, units in order (see the module
/// documentation): the registered names if unique, else `<unit>.<tensor>`.
pub(crate) fn tensor_names(units: &[UnitLayout]) -> std::result::Result<Vec<String>, String> {
    let plain: Vec<String> = units
        .iter()
        .flat_map(|u| u.tensors.iter().map(|t| t.name.clone()))
        .collect();
    let unique = |names: &[String]| -> std::result::Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        for n in names {
            if n == "__metadata__" {
                return Err("a tensor is named `__metadata__`, reserved by safetensors".into());
            }
            if !seen.insert(n.as_str()) {
                return Err(format!("two tensors would both be named `{n}`"));
            }
        }
        Ok(())
    };
    if unique(&plain).is_ok() {
        return Ok(plain);
    }
    let qualified: Vec<String> = units
        .iter()
        .flat_map(|u| u.tensors.iter().map(|t| format!("{}.{}", u.name, t.name)))
        .collect();
    unique(&qualified)?;
    Ok(qualified)
}

/// The safetensors header of the units `units` (length prefix and
/// padding included) and the length of the data section.
fn header(units: &[UnitLayout], dtype: ExportDtype) -> std::result::Result<(Vec<u8>, u64), String> {
    let names = tensor_names(units)?;
    let shapes = units
        .iter()
        .flat_map(|u| u.tensors.iter().map(|t| &t.shape[..]));
    header_of(
        names
            .iter()
            .map(String::as_str)
            .zip(shapes)
            .map(|(n, s)| (n, s, dtype)),
    )
}

/// The safetensors header of `tensors` (names, shapes and dtypes, in file
/// order), and the length of the data section. With the tensors sorted
/// as the `safetensors` crate's `serialize` sorts them (by dtype, widest
/// first, then by name) it is, byte for byte, the header that function
/// writes for them with `{"format": "pt"}`.
fn header_of<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a [usize], ExportDtype)>,
) -> std::result::Result<(Vec<u8>, u64), String> {
    let mut json = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut at = 0u64;
    let mut seen = std::collections::HashSet::new();
    for (name, shape, dtype) in tensors {
        if name == "__metadata__" {
            return Err("a tensor is named `__metadata__`, reserved by safetensors".into());
        }
        if !seen.insert(name) {
            return Err(format!("two tensors are named `{name}`"));
        }
        let numel: usize = shape.iter().product();
        let end = at + (numel * dtype.size()) as u64;
        let key = serde_json::to_string(name).map_err(|e| e.to_string())?;
        let shape: Vec<String> = shape.iter().map(usize::to_string).collect();
        write!(
            json,
            r#",{key}:{{"dtype":"{}","shape":[{}],"data_offsets":[{at},{end}]}}"#,
            dtype.safetensors_name(),
            shape.join(",")
        )
        .expect("writing to a String");
        at = end;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    Ok((out, at))
}

/// Streams one safetensors file: the header first (computed from the
/// names and shapes, before any value), then every tensor's values in
/// file order ([`SafetensorsWriter::write`], in pieces of any size);
/// [`finish`] checks that every value came, fsyncs and renames `PATH.tmp`
/// over `PATH`. Dropped unfinished, it removes `PATH.tmp`. Memory: the
/// write buffer and the cast bytes of the largest piece given.
///
/// [`finish`]: SafetensorsWriter::finish
pub struct SafetensorsWriter {
    out: Option<BufWriter<File>>,
    path: PathBuf,
    tmp: PathBuf,
    /// The dtype of each run of values, in file order, and its length
    /// in elements: one run per tensor (or one for a whole file of one
    /// dtype).
    runs: Vec<(ExportDtype, u64)>,
    /// The run the next value belongs to, and how many of its values
    /// came already.
    run: (usize, u64),
    hasher: crc32fast::Hasher,
    bytes: Vec<u8>,
    written: u64,
    total: u64,
}

impl SafetensorsWriter {
    /// Creates `PATH.tmp` for the units `units` (in order) as `dtype`, and
    /// writes the header.
    pub(crate) fn create(path: &Path, units: &[UnitLayout], dtype: ExportDtype) -> Result<Self> {
        let head = header(units, dtype).map_err(|e| err(path, e))?;
        let numel = head.1 / dtype.size() as u64;
        Self::start(path, head, vec![(dtype, numel)])
    }

    /// Creates `PATH.tmp` for the tensors `tensors` (names and shapes, in
    /// the order their values will come) as `dtype`, and writes the
    /// header, with `__metadata__` `{"format": "pt"}`. Given the tensors
    /// sorted by name, the file is byte for byte what the `safetensors`
    /// crate's `serialize_to_file` writes for them. Errors name `path`: a
    /// tensor named twice or `__metadata__`, a file that cannot be
    /// created.
    pub fn create_tensors(
        path: &Path,
        tensors: &[(&str, &[usize])],
        dtype: ExportDtype,
    ) -> Result<Self> {
        let typed: Vec<(&str, &[usize], ExportDtype)> =
            tensors.iter().map(|&(n, s)| (n, s, dtype)).collect();
        Self::create_typed(path, &typed)
    }

    /// [`SafetensorsWriter::create_tensors`] with a dtype per tensor
    /// (names, shapes and dtypes, in the order their values will come):
    /// each tensor's values are cast to its own dtype as they come
    /// ([`SafetensorsWriter::write`] splits pieces at tensor boundaries).
    /// Given the tensors in the `safetensors` crate's order (by dtype,
    /// F32 before BF16 before F16, then by name) the file is byte for
    /// byte what its `serialize_to_file` writes for them.
    pub fn create_typed(path: &Path, tensors: &[(&str, &[usize], ExportDtype)]) -> Result<Self> {
        let head = header_of(tensors.iter().copied()).map_err(|e| err(path, e))?;
        let runs = tensors
            .iter()
            .map(|(_, shape, d)| (*d, shape.iter().product::<usize>() as u64))
            .collect();
        Self::start(path, head, runs)
    }

    /// Creates `PATH.tmp` and writes the header `head` of a data section
    /// of `data` bytes, whose values come in `runs`.
    fn start(
        path: &Path,
        (head, data): (Vec<u8>, u64),
        runs: Vec<(ExportDtype, u64)>,
    ) -> Result<Self> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| err(path, format!("cannot create {}: {e}", tmp.display())))?;
        let mut w = Self {
            out: Some(BufWriter::with_capacity(WRITE_BUF, file)),
            path: path.to_path_buf(),
            tmp,
            runs,
            run: (0, 0),
            hasher: crc32fast::Hasher::new(),
            bytes: Vec::new(),
            written: 0,
            total: head.len() as u64 + data,
        };
        w.put(&head)?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        let out = self.out.as_mut().expect("open until finish");
        out.write_all(bytes)
            .map_err(|e| err(&self.path, format!("write of {}: {e}", self.tmp.display())))?;
        self.hasher.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Appends the next `values` (in file order: units and their tensors,
    /// or the order given to [`SafetensorsWriter::create_tensors`]), cast.
    /// Errors name the file: more values than the header declares, a
    /// failed write.
    pub fn write(&mut self, values: &[f32]) -> Result<()> {
        let mut bytes = std::mem::take(&mut self.bytes);
        bytes.clear();
        let mut rest = values;
        while !rest.is_empty() {
            // Past the last run the values are too many: cast them as the
            // last dtype, and the length check below says so.
            let (dtype, len) = match self.runs.get(self.run.0) {
                Some(&r) => r,
                None => (self.runs.last().map_or(ExportDtype::F32, |r| r.0), u64::MAX),
            };
            let n = (len - self.run.1).min(rest.len() as u64) as usize;
            dtype.encode(&rest[..n], &mut bytes);
            rest = &rest[n..];
            self.run.1 += n as u64;
            if self.run.1 == len {
                self.run = (self.run.0 + 1, 0);
            }
        }
        if self.written + bytes.len() as u64 > self.total {
            return Err(err(
                &self.path,
                format!(
                    "more values than the header declares ({} bytes)",
                    self.total
                ),
            ));
        }
        let r = self.put(&bytes);
        self.bytes = bytes;
        r
    }

    /// Flushes, fsyncs and renames the file into place: its length and
    /// CRC32. Errors name the file: fewer values than the header declares,
    /// a failed write, fsync or rename.
    pub fn finish(mut self) -> Result<(u64, u32)> {
        if self.written != self.total {
            return Err(err(
                &self.path,
                format!("{} of the {} bytes were written", self.written, self.total),
            ));
        }
        let out = self.out.take().expect("open until finish");
        let tmp = self.tmp.clone();
        let file = out.into_inner().map_err(|e| {
            err(
                &self.path,
                format!("write of {}: {}", tmp.display(), e.error()),
            )
        })?;
        file.sync_all()
            .map_err(|e| err(&self.path, format!("fsync of {}: {e}", tmp.display())))?;
        drop(file);
        fs::rename(&tmp, &self.path).map_err(|e| {
            err(
                &self.path,
                format!("rename of {} into place: {e}", tmp.display()),
            )
        })?;
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            sync_dir(dir)?;
        }
        let crc = std::mem::replace(&mut self.hasher, crc32fast::Hasher::new()).finalize();
        Ok((self.written, crc))
    }
}

impl Drop for SafetensorsWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zero_core::partition::{PartitionPlan, TensorSpec, UnitSpec};

    /// A unit's name and its tensors' names and shapes.
    type Unit<'a> = (&'a str, &'a [(&'a str, &'a [usize])]);

    fn plan(units: &[Unit<'_>]) -> PartitionPlan {
        let specs: Vec<UnitSpec> = units
            .iter()
            .map(|(u, ts)| {
                UnitSpec::new(*u, ts.iter().map(|(n, s)| TensorSpec::new(*n, s)).collect())
            })
            .collect();
        PartitionPlan::new(&specs, 2).expect("plan")
    }

    #[test]
    fn names_are_kept_when_unique_else_qualified() {
        let hf = plan(&[
            (
                "model.embed_tokens",
                &[("model.embed_tokens.weight", &[4, 2])],
            ),
            (
                "lm_head",
                &[("model.norm.weight", &[2]), ("lm_head.weight", &[4, 2])],
            ),
        ]);
        assert_eq!(
            tensor_names(hf.units()).unwrap(),
            [
                "model.embed_tokens.weight",
                "model.norm.weight",
                "lm_head.weight"
            ]
        );
        let mlp = plan(&[
            ("layer0", &[("weight", &[3, 2]), ("bias", &[3])]),
            ("layer1", &[("weight", &[1, 3]), ("bias", &[1])]),
        ]);
        assert_eq!(
            tensor_names(mlp.units()).unwrap(),
            [
                "layer0.weight",
                "layer0.bias",
                "layer1.weight",
                "layer1.bias"
            ]
        );
        // `a` + `b.c` and `a.b` + `c` collide even when qualified.
        let clash = plan(&[
            ("a", &[("b.c", &[1]), ("x", &[1])]),
            ("a.b", &[("c", &[1]), ("x", &[1])]),
        ]);
        let e = tensor_names(clash.units()).unwrap_err();
        assert!(e.contains("`a.b.c`"), "{e}");
    }

    /// The header parses with the `safetensors` crate, is padded to 8
    /// bytes, and its offsets tile the data section in unit order.
    #[test]
    fn header_parses_and_tiles_the_data() {
        let p = plan(&[
            ("u0", &[("w", &[3, 5]), ("s", &[])]),
            ("u1", &[("empty", &[0, 4]), ("b", &[7])]),
        ]);
        for dtype in [ExportDtype::F32, ExportDtype::Bf16, ExportDtype::F16] {
            let (head, data) = header(p.units(), dtype).unwrap();
            let n = u64::from_le_bytes(head[..8].try_into().unwrap());
            assert_eq!(n as usize, head.len() - 8);
            assert_eq!(n % 8, 0);
            let numel = 15 + 1 + 7;
            assert_eq!(data, (numel * dtype.size()) as u64);
            let mut file = head.clone();
            file.resize(head.len() + data as usize, 0);
            let st = safetensors::SafeTensors::deserialize(&file).expect("valid file");
            assert_eq!(st.names().len(), 4);
            let s = st.tensor("s").unwrap();
            assert_eq!(s.shape(), &[] as &[usize]);
            assert_eq!(s.dtype().to_string(), dtype.safetensors_name());
            let (_, meta) = safetensors::SafeTensors::read_metadata(&file).unwrap();
            let order: Vec<usize> = ["w", "s", "empty", "b"]
                .iter()
                .map(|n| meta.info(n).unwrap().data_offsets.0)
                .collect();
            assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
        }
    }

    #[test]
    fn encode_rounds_to_nearest_even() {
        let x = [
            1.0f32,
            -2.5,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
        ];
        let mut out = Vec::new();
        ExportDtype::Bf16.encode(&x, &mut out);
        let got: Vec<u16> = out
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        // Ties go to the even mantissa: 0x3f80_8000 → 0x3f80, 0x3f81_8000 → 0x3f82.
        assert_eq!(got, [0x3f80, 0xc020, 0x3f80, 0x3f82]);
        assert_eq!("BF16".parse::<ExportDtype>(), Ok(ExportDtype::Bf16));
        assert_eq!("fp32".parse::<ExportDtype>(), Ok(ExportDtype::F32));
        assert!("int8".parse::<ExportDtype>().is_err());
    }

    /// Given tensors sorted by name, the writer's file is byte for byte
    /// what the `safetensors` crate's `serialize` writes (the order,
    /// header and padding of `safetensors.torch.save_file`), in every
    /// dtype; a tensor named twice or `__metadata__` is an error naming
    /// the file.
    #[test]
    fn named_tensors_match_the_safetensors_crate() {
        let d = crate::format::TestDir::new("safetensors-named");
        // Unsorted here; sorted below as the crate sorts them.
        let tensors: [(&str, &[usize]); 4] = [
            ("model.layers.10.w", &[3, 2]),
            ("lm_head.weight", &[5]),
            ("model.layers.1.w\u{e9}", &[2, 1, 2]),
            ("scalar", &[]),
        ];
        let mut sorted = tensors.to_vec();
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        let values: Vec<Vec<f32>> = sorted
            .iter()
            .enumerate()
            .map(|(t, (_, s))| {
                (0..s.iter().product::<usize>())
                    .map(|i| (i as f32 - 2.0) * 0.37 + t as f32 * 1e-3)
                    .collect()
            })
            .collect();
        for dtype in [ExportDtype::F32, ExportDtype::Bf16, ExportDtype::F16] {
            let path = d.0.join("named.safetensors");
            let mut w = SafetensorsWriter::create_tensors(&path, &sorted, dtype).unwrap();
            for v in &values {
                w.write(v).unwrap();
            }
            w.finish().unwrap();
            let st = match dtype {
                ExportDtype::F32 => safetensors::Dtype::F32,
                ExportDtype::Bf16 => safetensors::Dtype::BF16,
                ExportDtype::F16 => safetensors::Dtype::F16,
            };
            let bytes: Vec<Vec<u8>> = values
                .iter()
                .map(|v| {
                    let mut b = Vec::new();
                    dtype.encode(v, &mut b);
                    b
                })
                .collect();
            // Given in the unsorted order: the crate sorts them.
            let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
                .iter()
                .map(|(n, s)| {
                    let k = sorted.iter().position(|(m, _)| m == n).unwrap();
                    let view = safetensors::tensor::TensorView::new(st, s.to_vec(), &bytes[k]);
                    (*n, view.unwrap())
                })
                .collect();
            let meta = std::collections::HashMap::from([("format".into(), "pt".into())]);
            let want = safetensors::serialize(views, Some(meta)).unwrap();
            assert_eq!(fs::read(&path).unwrap(), want, "{dtype:?}");
        }
        let twice: [(&str, &[usize]); 2] = [("a", &[1]), ("a", &[2])];
        let e = SafetensorsWriter::create_tensors(
            &d.0.join("twice.safetensors"),
            &twice,
            ExportDtype::F32,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("twice.safetensors: two tensors are named `a`"),
            "{e}"
        );
        assert!(!d.0.join("twice.safetensors.tmp").exists());
    }

    /// With a dtype per tensor, given in the crate's order (F32, then
    /// BF16, then F16, each by name), the file is byte for byte what the
    /// `safetensors` crate's `serialize` writes, even when the values come
    /// in pieces that straddle tensors (one write of everything here).
    #[test]
    fn mixed_dtypes_match_the_safetensors_crate() {
        let d = crate::format::TestDir::new("safetensors-mixed");
        let tensors: [(&str, &[usize], ExportDtype); 5] = [
            ("b.norm", &[3], ExportDtype::F32),
            ("z.weight", &[2, 2], ExportDtype::F32),
            ("a.weight", &[2, 3], ExportDtype::Bf16),
            ("empty", &[0], ExportDtype::Bf16),
            ("c.weight", &[5], ExportDtype::F16),
        ];
        let values: Vec<Vec<f32>> = tensors
            .iter()
            .enumerate()
            .map(|(t, (_, s, _))| {
                (0..s.iter().product::<usize>())
                    .map(|i| (i as f32 + 0.3) * 1.000_123 - t as f32 * 0.71)
                    .collect()
            })
            .collect();
        let path = d.0.join("mixed.safetensors");
        let mut w = SafetensorsWriter::create_typed(&path, &tensors).unwrap();
        w.write(&values.concat()).unwrap();
        w.finish().unwrap();
        let st = |d: ExportDtype| match d {
            ExportDtype::F32 => safetensors::Dtype::F32,
            ExportDtype::Bf16 => safetensors::Dtype::BF16,
            ExportDtype::F16 => safetensors::Dtype::F16,
        };
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .zip(&values)
            .map(|((_, _, d), v)| {
                let mut b = Vec::new();
                d.encode(v, &mut b);
                b
            })
            .collect();
        // Given in reverse: the crate sorts them.
        let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .rev()
            .map(|((n, s, d), b)| {
                let view = safetensors::tensor::TensorView::new(st(*d), s.to_vec(), b);
                (*n, view.unwrap())
            })
            .collect();
        let meta = std::collections::HashMap::from([("format".into(), "pt".into())]);
        let want = safetensors::serialize(views, Some(meta)).unwrap();
        assert_eq!(fs::read(&path).unwrap(), want);
        // One value too many is an error naming the file.
        let mut w = SafetensorsWriter::create_typed(&path, &tensors).unwrap();
        let e = w.write(&[values.concat(), vec![1.0]].concat()).unwrap_err();
        assert!(e.to_string().contains("more values than the header"), "{e}");
    }

    /// The writer's file parses back with the `safetensors` crate, its
    /// values cast; its length and CRC32 are the file's; a write of more
    /// values than the header declares, or a finish before all came, fails
    /// naming the file and leaves nothing behind.
    #[test]
    fn writer_streams_the_values_and_cleans_up() {
        let d = crate::format::TestDir::new("safetensors-writer");
        let p = plan(&[("u0", &[("w", &[2, 3])]), ("u1", &[("b", &[2])])]);
        let values: Vec<f32> = (0..8).map(|i| i as f32 * 0.5 - 1.0).collect();
        let path = d.0.join("model.safetensors");
        let mut w = SafetensorsWriter::create(&path, p.units(), ExportDtype::F32).unwrap();
        w.write(&values[..6]).unwrap();
        w.write(&values[6..]).unwrap();
        let (len, crc) = w.finish().unwrap();
        let file = fs::read(&path).unwrap();
        assert_eq!((len, crc), (file.len() as u64, crc32fast::hash(&file)));
        assert!(!d.0.join("model.safetensors.tmp").exists());
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        let b = st.tensor("b").unwrap();
        let got: Vec<f32> = b
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, values[6..]);

        let out = d.0.join("short.safetensors");
        let mut w = SafetensorsWriter::create(&out, p.units(), ExportDtype::Bf16).unwrap();
        let e = w.write(&[0.0; 9]).unwrap_err().to_string();
        assert!(
            e.contains("short.safetensors: more values than the header declares"),
            "{e}"
        );
        w.write(&values[..5]).unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(
            e.contains("of the") && e.contains("bytes were written"),
            "{e}"
        );
        assert!(!out.exists());
        assert!(!d.0.join("short.safetensors.tmp").exists());
    }
}
