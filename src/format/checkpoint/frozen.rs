//! The checkpoint's frozen tensors ([`FROZEN_FILE`](super::FROZEN_FILE)): a safetensors file
//! of every unit's frozen tensors alone, read back unit by unit.

use std::fs;
use std::path::Path;

use zero_core::partition::{PartitionPlan, UnitLayout, UnitSpec};
use zero_core::DType;

use super::super::bytes_as_f32;
use super::super::safetensors::tensor_names;
use super::ModelFileEntry;
use crate::Result;

/// The layouts of every unit's frozen tensors alone (units without any
/// left out), in order: the contents of [`FROZEN_FILE`](super::FROZEN_FILE).
pub(crate) fn frozen_layouts(plan: &PartitionPlan) -> Result<Vec<UnitLayout>> {
    let specs: Vec<UnitSpec> = plan
        .units()
        .iter()
        .filter(|l| l.frozen_numel > 0)
        .map(|l| {
            let mut spec = l.spec();
            spec.tensors.retain(|t| !t.trainable);
            spec
        })
        .collect();
    Ok(PartitionPlan::new(&specs, 1)?.units().to_vec())
}

/// The frozen tensors of a checkpoint (`entry` in `dir`, saved with
/// `plan`), unit by unit: `each(unit, values)` gets each unit's frozen
/// real elements in layout order, for the units that have frozen tensors.
/// The file is never in memory as a whole: its length and CRC32 are
/// checked reading it in chunks, then each tensor's bytes are read on
/// their own (host memory: the largest unit's frozen values). The error
/// names the file and the tensor.
pub(crate) fn read_frozen_file(
    dir: &Path,
    entry: &ModelFileEntry,
    plan: &PartitionPlan,
    mut each: impl FnMut(usize, &[f32]) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    use std::os::unix::fs::FileExt;
    let path = dir.join(&entry.name);
    let bad = |what: String| format!("{}: {what}", path.display());
    let file = fs::File::open(&path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let len = file
        .metadata()
        .map_err(|e| bad(format!("cannot read: {e}")))?
        .len();
    // The whole file's CRC32, a chunk at a time.
    let mut crc = crc32fast::Hasher::new();
    let mut chunk = vec![0u8; (len.min(4 << 20)) as usize];
    let mut at = 0u64;
    while at < len {
        let k = (len - at).min(chunk.len() as u64) as usize;
        file.read_exact_at(&mut chunk[..k], at)
            .map_err(|e| bad(format!("cannot read at byte {at}: {e}")))?;
        crc.update(&chunk[..k]);
        at += k as u64;
    }
    drop(chunk);
    let crc = crc.finalize();
    if len != entry.bytes || crc != entry.crc32 {
        return Err(bad(format!(
            "{len} bytes with CRC32 {crc:08x}, but the manifest says {} bytes with CRC32 {:08x} \
             (a truncated or damaged file)",
            entry.bytes, entry.crc32
        )));
    }
    let not_st = |what: String| bad(format!("not a safetensors file: {what}"));
    let mut n = [0u8; 8];
    file.read_exact_at(&mut n, 0)
        .map_err(|e| not_st(format!("no header length ({e})")))?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) {
        return Err(not_st(format!(
            "a header of {n} bytes in a file of {len} bytes"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8)
        .map_err(|e| not_st(format!("the header: {e}")))?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| not_st(format!("the header: {e}")))?;
    drop(header);
    let data_start = 8 + n;
    let layouts = frozen_layouts(plan).map_err(|e| bad(e.to_string()))?;
    let mut names = tensor_names(&layouts).map_err(bad)?.into_iter();
    let mut values = Vec::new();
    let mut bytes = Vec::new();
    for (u, l) in plan.units().iter().enumerate() {
        if l.frozen_numel == 0 {
            continue;
        }
        values.clear();
        for t in l.tensors.iter().filter(|t| !t.trainable) {
            let name = names.next().unwrap_or_default();
            let info = meta.info(&name).ok_or_else(|| {
                bad(format!(
                    "no tensor `{name}` (unit `{}`, tensor `{}`)",
                    l.name, t.name
                ))
            })?;
            if info.shape != t.shape {
                return Err(bad(format!(
                    "tensor `{name}` has shape {:?}, the model's `{}` of unit `{}` {:?}",
                    info.shape, t.name, l.name, t.shape
                )));
            }
            let size = match info.dtype {
                safetensors::Dtype::F32 => 4,
                safetensors::Dtype::BF16 | safetensors::Dtype::F16 => 2,
                other => {
                    return Err(bad(format!(
                        "tensor `{name}` is {other:?}; F32, BF16 or F16 expected"
                    )))
                }
            };
            let (b, e) = info.data_offsets;
            if e.checked_sub(b) != Some(t.numel * size) || data_start + e as u64 > len {
                return Err(bad(format!(
                    "tensor `{name}` has data offsets {b}..{e}: {} elements of {size} bytes \
                     in a file of {len} bytes expected",
                    t.numel
                )));
            }
            bytes.resize(e - b, 0);
            file.read_exact_at(&mut bytes, data_start + b as u64)
                .map_err(|err| bad(format!("tensor `{name}`: cannot read: {err}")))?;
            let dtype = match info.dtype {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                _ => DType::F16,
            };
            values.extend(bytes_as_f32(dtype, &bytes));
        }
        each(u, &values)?;
    }
    Ok(())
}
