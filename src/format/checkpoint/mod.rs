//! The zero checkpoint format (version 1): a directory of per-rank state
//! files, a manifest, and a root that names the newest one.
//!
//! # Layout
//!
//! A checkpoint is `root/step{global_steps:08}/` (optimizer-step
//! boundaries, skipped fp16 steps included, as DeepSpeed's
//! `global_step{N}` tags):
//!
//! ```text
//!  manifest.json    format, version, world size, stage, dtype, steps
//!                   (applied and global), loss scaler, seed, resolved
//!                   config, units (names, tensors, numel, shard_len),
//!                   per-file bytes and CRC32 per block, client_state
//!  rank00000.bin    header: "ZEROCKPT", u32 LE version, u32 LE rank
//!  rank00001.bin    then per unit u, over E_r(u) = shard_range(r) ∩ 0..numel:
//!  …                  master[E_r(u)] | m[E_r(u)] | v[E_r(u)]   (f32 LE)
//!  model.safetensors  only with stage3_gather_16bit_weights_on_model_save:
//!                     the consolidated weights in the parameter dtype
//!                     (listed in the manifest's optional `model`; see
//!                     `src/format/safetensors.rs`)
//! ```
//!
//! `shard_range(r)` is that of the saving world's
//! [`PartitionPlan`] (rebuilt on load from the manifest's units and world
//! size with [`PartitionPlan::new`], [`saved_plan`]), so the files of the
//! saving world hold every real element exactly once. Parameters are not
//! stored: the engine's parameter in the training dtype is always the cast
//! master. A rank file's CRC32s cover blocks of [`BLOCK`] bytes (1 MiB,
//! the header included, the last block short); the manifest lists them per
//! file ([`FileEntry`]).
//!
//! # Atomicity
//!
//! ```text
//!  prepare   mkdir root/.tmp-stepN-<id>
//!            (the rank files and model.safetensors are written there,
//!             each fsynced)
//!  publish   manifest.json + fsync, fsync dir, rename → root/stepN,
//!            fsync root, latest.tmp + fsync → rename latest, fsync root,
//!            prune keep_last
//! ```
//!
//! A crash at any point leaves the previous checkpoint (and `latest`)
//! intact or the new one complete; `.tmp-*` directories are ignored when a
//! root is opened ([`checkpoint_dir`](names::checkpoint_dir)), and a root whose `latest` is
//! missing opens its newest `step*` directory (only complete checkpoints
//! are renamed into place).
//!
//! # Reading
//!
//! [`Reader`] reads element ranges of any unit's master, m or v from the
//! saved files: only the byte ranges that hold them, whole CRC blocks,
//! each verified against the manifest (a corrupted block is named by file
//! and block). Whole blocks go straight into the destination, a few at a
//! time, the ends of each range through a window of a few blocks that
//! stays cached, so two consecutive ranges that share a block read it
//! once.
//!
//! # Page cache
//!
//! Rank files stream through the page cache once: the writer writes behind
//! (starts each write's writeback, waits for and drops what lies a few
//! megabytes back, drops the rest after the fsync), the reader drops what
//! it has read when asked ([`Reader::drop_behind`]). The files do not
//! crowd the trainer's memory out of the cache, and the stream reuses the
//! same few pages instead of taking fresh ones, which can be slow (see
//! `src/format/page_cache.rs`: 4–5× on the development VM).

use std::path::{Path, PathBuf};

use zero_core::partition::PartitionPlan;

use crate::Result;

mod frozen;
mod manifest;
mod names;
mod rank_file;
mod reader;
mod root;
mod writer;

pub(crate) use frozen::{frozen_layouts, read_frozen_file};
pub(crate) use manifest::{
    check_units, read_manifest, saved_plan, FileEntry, Manifest, ModelFileEntry, SavedRun,
};
pub(crate) use names::rank_file;
pub(crate) use rank_file::{check_files, StateArray};
pub(crate) use reader::Reader;
pub(crate) use root::{prepare, publish, step_dir_name, tmp_dir};
pub(crate) use writer::RankFileWriter;

/// The `format` of a checkpoint manifest.
pub const CHECKPOINT_FORMAT: &str = "zero-checkpoint";
/// The manifest and rank-file version this build writes and reads.
pub const CHECKPOINT_VERSION: u32 = 1;

/// The manifest's file name in a checkpoint directory.
pub(crate) const MANIFEST_FILE: &str = "manifest.json";
/// The file name of the consolidated weights inside a checkpoint directory.
pub(crate) const MODEL_FILE: &str = "model.safetensors";
/// The file name of the frozen tensors inside a checkpoint directory
/// (`EngineBuilder::checkpoint_frozen`).
pub(crate) const FROZEN_FILE: &str = "frozen.safetensors";
/// Bytes per CRC32 block of a rank file.
pub(crate) const BLOCK: usize = 1 << 20;

/// Opens the checkpoint `path` names (a directory, or a root whose
/// `latest` names one) for reading without an engine: its directory,
/// manifest and saving plan, every rank file checked as on load.
pub(crate) fn open_saved(path: &Path) -> Result<(PathBuf, Manifest, PartitionPlan)> {
    let (dir, m) = read_manifest(path)?;
    let plan = saved_plan(&dir.join(MANIFEST_FILE), &m)?;
    check_files(&dir, &m, &plan)?;
    Ok((dir, m, plan))
}

/// Test data shared by the format's tests: a plan whose rank files span
/// several blocks, and the files written with it.
#[cfg(test)]
mod fixture {
    use std::path::Path;

    use zero_core::partition::{PartitionPlan, TensorSpec, UnitSpec};

    use super::RankFileWriter;

    /// Units of 2.5 MB, 12 bytes and 1.8 MB per rank at two ranks: files
    /// of several blocks, write buffers and write-behind windows, and a
    /// unit whose rank-1 shard is only padding.
    pub(super) fn plan() -> PartitionPlan {
        let specs = [
            UnitSpec::new(
                "a",
                vec![
                    TensorSpec::new("a.w", &[700, 600]),
                    TensorSpec::new("a.b", &[7]),
                ],
            ),
            UnitSpec::new("b", vec![TensorSpec::new("b", &[1])]),
            UnitSpec::new("c", vec![TensorSpec::new("c", &[300, 1001])]),
        ];
        PartitionPlan::new(&specs, 2).expect("plan")
    }

    /// Element `i` of array `kind` (0 master, 1 m, 2 v) of unit `u`:
    /// distinct everywhere.
    pub(super) fn value(u: usize, kind: usize, i: usize) -> f32 {
        (u * 1_000_000 + i) as f32 * [1.0, -0.5, 0.25][kind]
    }

    /// Writes rank `rank`'s file of [`plan`] at `path`, `pieces`
    /// elements per [`RankFileWriter::write_state`] (`None`: each unit
    /// whole): its length and CRCs.
    pub(super) fn write_rank(path: &Path, rank: usize, pieces: Option<usize>) -> (u64, Vec<u32>) {
        let plan = plan();
        let mut w = RankFileWriter::create(path, plan.units(), rank).expect("create");
        for (u, l) in plan.units().iter().enumerate() {
            // The whole shard range, padding included, as an engine holds
            // it: the writer keeps the real part.
            let r = l.shard_range(rank);
            let arrays: Vec<Vec<f32>> = (0..3)
                .map(|k| r.clone().map(|i| value(u, k, i)).collect())
                .collect();
            let step = pieces.unwrap_or(r.len()).max(1);
            let mut at = 0;
            while at < r.len() {
                let s = at..(at + step).min(r.len());
                let [m0, m1, m2] = [0, 1, 2].map(|k| &arrays[k][s.clone()]);
                w.write_state(u, r.start + at, m0, m1, m2).expect("write");
                at = s.end;
            }
        }
        w.finish().expect("finish")
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use zero_core::DType;

    use super::fixture::{plan, value, write_rank};
    use super::*;
    use crate::format::TestDir;

    /// Saves [`plan`]'s state (rank 1's file written in pieces) under
    /// `root` as step 4, as a save does; the published directory.
    fn save(root: &Path) -> PathBuf {
        let plan = plan();
        let name = step_dir_name(4);
        let dest = root.join(&name);
        let id = prepare(root, &dest, &name).expect("prepare");
        let tmp = tmp_dir(root, &name, id);
        let files = (0..2)
            .map(|r| {
                let pieces = (r == 1).then_some(4099);
                let (bytes, crcs) = write_rank(&tmp.join(rank_file(r)), r, pieces);
                FileEntry::rank(r, bytes, crcs)
            })
            .collect();
        let run = SavedRun {
            world_size: 2,
            stage: 3,
            param_dtype: DType::BF16,
            steps: 4,
            global_steps: 4,
            loss_scaler: None,
            seed: 1,
            config: serde_json::Value::Null,
            client_state: serde_json::json!({ "data_position": 4 }),
        };
        let manifest = Manifest::new(run, plan.units(), files, None);
        publish(root, &tmp, &dest, &name, &manifest, 0).expect("publish");
        dest
    }

    /// What was written is read back exactly, from any element range of
    /// any array, across the two files, directly or piece by piece; read
    /// file by file, every block is read once.
    #[test]
    fn rank_files_round_trip() {
        let d = TestDir::new("ckpt-round-trip");
        let dest = save(&d.0);
        let (dir, m, saved) = open_saved(&d.0).expect("open");
        assert_eq!(dir, dest);
        assert_eq!(m.client_state, serde_json::json!({ "data_position": 4 }));
        assert_eq!(saved.units(), plan().units());
        let mut reader = Reader::new(&dir, &m, &saved);
        let kinds = [StateArray::Master, StateArray::M, StateArray::V];
        for (u, l) in saved.units().iter().enumerate() {
            for (k, &kind) in kinds.iter().enumerate() {
                let mut out = vec![0f32; l.numel];
                reader.read_into(u, kind, 0..l.numel, &mut out).unwrap();
                let want: Vec<f32> = (0..l.numel).map(|i| value(u, k, i)).collect();
                assert!(out == want, "unit {u} array {k}");
            }
        }
        // Every block at least once; reading the files one after the
        // other, each front to back, reads every block exactly once.
        let total: u64 = m.files.iter().map(|f| f.bytes).sum();
        assert!(reader.bytes_read() > total);
        let mut seq = Reader::new(&dir, &m, &saved);
        for s in 0..2 {
            for (u, l) in saved.units().iter().enumerate() {
                let r = l.real_range(s);
                for (k, &kind) in kinds.iter().enumerate() {
                    let mut out = vec![0f32; r.len()];
                    seq.read_into(u, kind, r.clone(), &mut out).unwrap();
                    assert!(out.iter().zip(r.clone()).all(|(&x, i)| x == value(u, k, i)));
                }
            }
        }
        assert_eq!(seq.bytes_read(), total);
        // Unit a's m across the two files' boundary, piece by piece.
        let a = &saved.units()[0];
        let mid = a.real_range(1).start;
        let range = mid - 100_000..mid + 33_333;
        let mut scratch = vec![0f32; 1000];
        let mut next = range.start;
        reader
            .for_each(0, StateArray::M, range.clone(), &mut scratch, |i, x| {
                assert_eq!(i, next);
                assert!(x.len() <= 1000);
                for (k, &got) in x.iter().enumerate() {
                    assert_eq!(got, value(0, 1, i + k));
                }
                next += x.len();
            })
            .unwrap();
        assert_eq!(next, range.end);
    }

    /// A corrupted block is found when read, named by file, block and
    /// bytes; the blocks before it read fine.
    #[test]
    fn a_corrupted_block_is_named_by_file_and_block() {
        let d = TestDir::new("ckpt-corrupt");
        let dest = save(&d.0);
        let path = dest.join("rank00001.bin");
        let mut bytes = fs::read(&path).unwrap();
        bytes[BLOCK + BLOCK / 2] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        let (dir, m, saved) = open_saved(&d.0).expect("the lengths and headers are intact");
        let mut reader = Reader::new(&dir, &m, &saved);
        // Rank 1's file: the header, unit a's master (to byte 0.84 MB),
        // its m (to 1.68 MB, over the corrupted byte at 1.5 MB), its v.
        let ra = saved.units()[0].real_range(1);
        let mut out = vec![0f32; 10];
        reader
            .read_into(0, StateArray::Master, ra.start..ra.start + 10, &mut out)
            .expect("block 0 is intact");
        let mut out = vec![0f32; ra.len()];
        let e = reader
            .read_into(0, StateArray::M, ra, &mut out)
            .unwrap_err()
            .to_string();
        let want = format!(
            "checkpoint {}: block 1 (bytes {}..{}) is corrupted: CRC32 0x",
            path.display(),
            BLOCK,
            2 * BLOCK
        );
        assert!(e.starts_with(&want), "{e}");
        assert!(e.contains(&format!("the manifest says {:#010x}", m.files[1].crc32[1])));
    }

    /// A rank file that does not match the manifest is refused before
    /// anything is read, naming the file.
    #[test]
    fn rank_files_are_checked_against_the_manifest() {
        let d = TestDir::new("ckpt-check-files");
        let dest = save(&d.0);
        let (dir, m, saved) = open_saved(&dest).unwrap();
        let path = dest.join("rank00000.bin");
        let good = fs::read(&path).unwrap();
        let cases: [(Vec<u8>, &str); 4] = [
            (good[..good.len() - 1].to_vec(), "truncated: "),
            ([&good[..], b"x"].concat(), "too long: "),
            ([b"NOTZEROC", &good[8..]].concat(), "bad magic"),
            (
                [&good[..12], &1u32.to_le_bytes(), &good[16..]].concat(),
                "holds rank 1, expected rank 0",
            ),
        ];
        for (bytes, want) in cases {
            fs::write(&path, bytes).unwrap();
            let e = check_files(&dir, &m, &saved).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("checkpoint {}: ", path.display())),
                "{e}"
            );
            assert!(e.contains(want), "`{want}` not in {e}");
        }
        fs::remove_file(&path).unwrap();
        let e = check_files(&dir, &m, &saved).unwrap_err().to_string();
        assert!(
            e.contains("missing rank file (rank 0 of the 2 saving ranks)"),
            "{e}"
        );
        let mut short = m.clone();
        short.files.pop();
        let e = check_files(&dir, &short, &saved).unwrap_err().to_string();
        assert!(
            e.contains("manifest.json: lists 1 rank files for world_size 2"),
            "{e}"
        );
    }
}
