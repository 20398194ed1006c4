//! What `llama_sft --export` writes: the model as it is, in the dtype
//! chosen for each tensor, never rounded values under a wider dtype's
//! label.
//!
//! # Values
//!
//! [`SftModel::export_tensors`](crate::train::SftModel::export_tensors):
//! every trainable tensor's fp32 master (not a bf16 run's working copy),
//! every frozen tensor (LoRA's base) as its checkpoint holds it, LoRA's
//! adapters folded in for `--merge-lora`.
//!
//! # Dtypes
//!
//! [`choose`] picks, in this order:
//!
//! 1. `--export-dtype`, for every tensor;
//! 2. the checkpoint's own dtype, tensor by tensor (`--model-dir`'s
//!    weights, `--init-from`'s file): a checkpoint of mixed dtypes is
//!    written back mixed, each tensor as it was, and `config.json` names
//!    `float32` for it ([`TensorDtypes::config_dtype`]);
//! 3. F32, the master as it is, for a model that did not come from a
//!    checkpoint (a built-in preset's random initialisation).
//!
//! A narrower dtype is reached by rounding to nearest even (`half`); a
//! wider one holds the values exactly. So with no step taken, the
//! default gives back an F32, BF16 or F16 checkpoint bit for bit: the
//! master holds its values exactly and they are written in their own
//! dtype.

use std::path::Path;

use super::hf::{self, ExportSource};
use super::weights::{self, Dtype, FetchPart, TensorDtypes};
use super::Config;

/// Why an export's tensors take the dtypes they take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// `--export-dtype`.
    Asked,
    /// The checkpoint the model started from, tensor by tensor.
    Checkpoint,
    /// No checkpoint: the fp32 master as it is.
    Master,
}

/// The dtypes of an export ([`choose`]) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportDtypes {
    /// One for all, or one per tensor of [`crate::tensors`].
    pub dtypes: TensorDtypes,
    /// Where they came from.
    pub why: Why,
}

/// The dtypes of an export: `asked` (`--export-dtype`) for every tensor;
/// else `checkpoint`'s (the dtypes of the tensors the model was read
/// from, [`TensorDtypes::of_files`]); else F32. See the module's doc.
pub fn choose(asked: Option<Dtype>, checkpoint: Option<TensorDtypes>) -> ExportDtypes {
    match (asked, checkpoint) {
        (Some(d), _) => ExportDtypes {
            dtypes: TensorDtypes::All(d),
            why: Why::Asked,
        },
        (None, Some(c)) => ExportDtypes {
            dtypes: c.simplified(),
            why: Why::Checkpoint,
        },
        (None, None) => ExportDtypes {
            dtypes: TensorDtypes::All(Dtype::F32),
            why: Why::Master,
        },
    }
}

impl ExportDtypes {
    /// The line printed at export, for a model of `n` tensors: how many
    /// are written in each dtype and why, e.g. `export: 272 tensors as F32
    /// (the checkpoint's dtype)`.
    pub fn describe(&self, n: usize) -> String {
        let counts = self.dtypes.counts(n);
        let groups: Vec<String> = counts
            .iter()
            .map(|(d, k)| {
                let name = format!("{:?}", d.st());
                format!("{k} tensor{} as {name}", if *k == 1 { "" } else { "s" })
            })
            .collect();
        let why = match (self.why, counts.len()) {
            (Why::Asked, _) => "--export-dtype".to_string(),
            (Why::Checkpoint, 1) => "the checkpoint's dtype".to_string(),
            (Why::Checkpoint, _) => format!(
                "each the checkpoint's own dtype; config.json names {}",
                self.dtypes.config_dtype().torch_name()
            ),
            (Why::Master, _) => "the fp32 master; no checkpoint to take a dtype from".to_string(),
        };
        format!("export: {} ({why})", groups.join(", "))
    }
}

/// Where an export goes and what it copies.
pub struct Target<'a> {
    /// A path ending in `.safetensors` gets the weights alone
    /// ([`weights::save_from`]); any other is a Hugging Face directory
    /// ([`hf::export_from`]).
    pub path: &'a Path,
    /// The directory the model came from (config, tokenizer), if any.
    pub source: Option<ExportSource<'a>>,
    /// BOS and EOS for a config made from the [`Config`] (no source).
    pub bos_eos: (Option<u32>, Option<u32>),
}

impl Target<'_> {
    /// Whether the target is a lone `.safetensors` file.
    pub fn is_file(&self) -> bool {
        self.path.extension().is_some_and(|e| e == "safetensors")
    }
}

/// Writes model `cfg` to `target` as `dtypes` says, its values streamed
/// from `fetch` one part at a time (over an engine: a closure calling
/// [`SftModel::export_tensors`](crate::train::SftModel::export_tensors)).
/// Only `write` (one rank) writes; the others fetch the same parts in the
/// same order and write nothing. Returns the names of the files written
/// (the path itself for a file; none where `write` is false).
pub fn write(
    target: Target<'_>,
    cfg: &Config,
    dtypes: &ExportDtypes,
    fetch: &mut FetchPart<'_>,
    write: bool,
) -> Result<Vec<String>, String> {
    let d = dtypes.dtypes.clone();
    if target.is_file() {
        weights::save_from(target.path, cfg, d, fetch, write)?;
        return Ok(if write {
            vec![target.path.display().to_string()]
        } else {
            Vec::new()
        });
    }
    let out = hf::Export {
        dtypes: d,
        source: target.source,
        bos_eos: target.bos_eos,
        max_shard_bytes: hf::DEFAULT_SHARD_BYTES,
    };
    hf::export_from(target.path, cfg, fetch, out, write)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_choice_and_its_line() {
        let asked = choose(Some(Dtype::Bf16), Some(TensorDtypes::All(Dtype::F32)));
        assert_eq!(asked.dtypes, TensorDtypes::All(Dtype::Bf16));
        assert_eq!(
            asked.describe(3),
            "export: 3 tensors as BF16 (--export-dtype)"
        );
        let ck = choose(None, Some(TensorDtypes::Each(vec![Dtype::F16; 4])));
        assert_eq!(ck.dtypes, TensorDtypes::All(Dtype::F16), "simplified");
        assert_eq!(
            ck.describe(4),
            "export: 4 tensors as F16 (the checkpoint's dtype)"
        );
        let mixed = choose(
            None,
            Some(TensorDtypes::Each(vec![
                Dtype::Bf16,
                Dtype::F32,
                Dtype::Bf16,
            ])),
        );
        assert_eq!(mixed.dtypes.config_dtype(), Dtype::F32);
        assert_eq!(
            mixed.describe(3),
            "export: 2 tensors as BF16, 1 tensor as F32 (each the checkpoint's own dtype; \
             config.json names float32)"
        );
        let master = choose(None, None);
        assert_eq!(master.dtypes, TensorDtypes::All(Dtype::F32));
        assert!(master
            .describe(1)
            .contains("1 tensor as F32 (the fp32 master"));
    }
}
