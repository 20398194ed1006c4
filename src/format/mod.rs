//! On-disk formats, apart from the engine: the sharded zero checkpoint
//! ([`checkpoint`]) and the safetensors weights file ([`safetensors`]).
//!
//! Nothing here knows of the engine, its units, offload tiers or
//! communicators: the formats take and return plain data (the
//! [`PartitionPlan`](zero_core::partition::PartitionPlan) and its unit
//! layouts, `f32` slices, paths, the manifest). The engine's save, load
//! and export (`src/engine/checkpoint.rs`, `src/engine/export.rs`) walk
//! its state and call them; `export_checkpoint` converts a checkpoint
//! directory into safetensors with them and no engine at all.

use std::path::Path;

use zero_core::{bf16, f16, DType, Element};

use crate::Error;

pub(crate) mod checkpoint;
mod page_cache;
pub(crate) mod safetensors;

/// The error of a checkpoint or export file: `path` and what is wrong.
fn ck(path: &Path, what: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// Maps an I/O error of `op` on `path` to [`ck`]: `"{op}: {error}"`.
fn io<'p>(path: &'p Path, op: &str) -> impl FnOnce(std::io::Error) -> Error + 'p {
    let op = op.to_string();
    move |e| ck(path, format!("{op}: {e}"))
}

/// fsyncs the directory `dir` (after a file in it was created or
/// renamed).
fn sync_dir(dir: &Path) -> crate::Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir, "fsync of the directory"))
}

/// A fresh directory under the system's temporary directory, removed on
/// drop.
#[cfg(test)]
pub(crate) struct TestDir(pub(crate) std::path::PathBuf);

#[cfg(test)]
impl TestDir {
    pub(crate) fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("zero-format-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        Self(d)
    }
}

#[cfg(test)]
impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Bytes of `T` values (any alignment) as f32.
fn bytes_to_f32<T: Element>(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(|c| bytemuck::pod_read_unaligned::<T>(c).to_f32())
        .collect()
}

/// Bytes of `dtype` values (any alignment) as f32.
pub(crate) fn bytes_as_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes_to_f32::<f32>(bytes),
        DType::BF16 => bytes_to_f32::<bf16>(bytes),
        DType::F16 => bytes_to_f32::<f16>(bytes),
    }
}
