//! The checkpoint root: its `step*` directories, the `latest` file that
//! names the newest, and the atomic publish of a new checkpoint
//! ([`prepare`], then [`publish`]) with the pruning of old ones.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::super::{ck, io, sync_dir};
#[cfg(test)]
use super::names::checkpoint_dir;
use super::{Manifest, MANIFEST_FILE};
use crate::Result;

/// The directory name of the checkpoint at `global_steps`.
pub(crate) fn step_dir_name(global_steps: u64) -> String {
    format!("step{global_steps:08}")
}

/// The temporary directory under `root` in which the checkpoint `name` is
/// written before [`publish`] renames it; `id` is [`prepare`]'s.
pub(crate) fn tmp_dir(root: &Path, name: &str, id: u64) -> PathBuf {
    root.join(format!(".tmp-{name}-{id:016x}"))
}

/// Makes sure `root` exists and `dest` (`root/name`) does not, then makes
/// the temporary directory ([`tmp_dir`]) and returns its id. A `dest`
/// that `latest` names is refused; one it does not name (left by a save
/// interrupted after its rename) is replaced.
pub(crate) fn prepare(root: &Path, dest: &Path, name: &str) -> Result<u64> {
    fs::create_dir_all(root).map_err(io(root, "create the checkpoint root"))?;
    if dest.exists() {
        let latest = fs::read_to_string(root.join("latest")).unwrap_or_default();
        if latest.trim() == name {
            return Err(ck(
                dest,
                "already exists and `latest` names it (this step was saved before); not \
                 overwriting it",
            ));
        }
        // Left by a save that was interrupted after its rename but before
        // `latest` named it; a run resumed from `latest` saves this step
        // again, so the new save replaces it.
        fs::remove_dir_all(dest).map_err(io(dest, "replace (an interrupted save's copy)"))?;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let id = nanos ^ (u64::from(std::process::id()) << 32);
    let tmp = tmp_dir(root, name, id);
    fs::create_dir(&tmp).map_err(io(&tmp, "create"))?;
    Ok(id)
}

/// After every file of the checkpoint is written into `tmp` and fsynced:
/// the manifest, the rename of `tmp` to `dest` (`root/name`), `latest`,
/// and the pruning of all but the newest `keep_last` checkpoints (0: keep
/// all); returns the pruning's warnings.
pub(crate) fn publish(
    root: &Path,
    tmp: &Path,
    dest: &Path,
    name: &str,
    manifest: &Manifest,
    keep_last: usize,
) -> Result<Vec<String>> {
    let mpath = tmp.join(MANIFEST_FILE);
    let text = serde_json::to_string_pretty(manifest)
        .map_err(|e| ck(&mpath, format!("serialize: {e}")))?;
    let mut f = File::create(&mpath).map_err(io(&mpath, "create"))?;
    f.write_all(text.as_bytes()).map_err(io(&mpath, "write"))?;
    f.sync_all().map_err(io(&mpath, "fsync"))?;
    drop(f);
    sync_dir(tmp)?;
    if dest.exists() {
        return Err(ck(
            dest,
            "already exists (this step was saved before); not overwriting it",
        ));
    }
    fs::rename(tmp, dest).map_err(io(dest, "rename into place"))?;
    sync_dir(root)?;
    let ltmp = root.join("latest.tmp");
    let latest = root.join("latest");
    let mut f = File::create(&ltmp).map_err(io(&ltmp, "create"))?;
    f.write_all(name.as_bytes()).map_err(io(&ltmp, "write"))?;
    f.sync_all().map_err(io(&ltmp, "fsync"))?;
    drop(f);
    fs::rename(&ltmp, &latest).map_err(io(&latest, "rename into place"))?;
    sync_dir(root)?;
    Ok(if keep_last > 0 {
        prune(root, name, keep_last)
    } else {
        Vec::new()
    })
}

/// Deletes the oldest `step*` directories under `root` beyond the newest
/// `keep` (`newest`, the one just published and named by `latest`, is
/// always kept, even if older ones have higher step numbers); what could
/// not be deleted, as warnings.
fn prune(root: &Path, newest: &str, keep: usize) -> Vec<String> {
    let Ok(entries) = fs::read_dir(root) else {
        return vec![format!(
            "checkpoint {}: cannot list it to delete old checkpoints",
            root.display()
        )];
    };
    let mut steps: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n.len() > 4 && n.starts_with("step") && n[4..].bytes().all(|b| b.is_ascii_digit())
        })
        .filter(|n| n != newest)
        .collect();
    steps.sort_by_key(|n| n[4..].parse::<u64>().unwrap_or(0));
    let extra = steps.len().saturating_sub(keep.saturating_sub(1));
    steps[..extra]
        .iter()
        .filter_map(|n| {
            fs::remove_dir_all(root.join(n)).err().map(|e| {
                format!(
                    "checkpoint {}: cannot delete it (keep_last {keep}): {e}",
                    root.join(n).display()
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use zero_core::DType;

    use super::super::super::TestDir;
    use super::super::SavedRun;
    use super::*;

    fn manifest(global_steps: u64) -> Manifest {
        let run = SavedRun {
            world_size: 1,
            stage: 0,
            param_dtype: DType::F32,
            steps: global_steps,
            global_steps,
            loss_scaler: None,
            seed: 0,
            config: serde_json::Value::Null,
            client_state: serde_json::json!({ "step": global_steps }),
        };
        Manifest::new(run, &[], Vec::new(), None)
    }

    /// Saves step `n` under `root` as a save does (a file written into
    /// the temporary directory, then published); the published directory.
    fn save(root: &Path, n: u64, keep_last: usize) -> Result<(PathBuf, Vec<String>)> {
        let name = step_dir_name(n);
        let dest = root.join(&name);
        let id = prepare(root, &dest, &name)?;
        let tmp = tmp_dir(root, &name, id);
        assert!(tmp.is_dir());
        fs::write(tmp.join("rank00000.bin"), n.to_le_bytes()).unwrap();
        let warnings = publish(root, &tmp, &dest, &name, &manifest(n), keep_last)?;
        assert!(!tmp.exists());
        Ok((dest, warnings))
    }

    fn steps_in(root: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    /// Each publish renames the directory into place with its manifest,
    /// points `latest` at it and keeps the newest `keep_last`: the one
    /// just published even when an older one has a higher step.
    #[test]
    fn publish_renames_points_latest_and_prunes() {
        let d = TestDir::new("root-publish");
        let root = d.0.join("ckpt");
        for n in 1..=4 {
            let (dest, warnings) = save(&root, n, 2).unwrap();
            assert!(warnings.is_empty(), "{warnings:?}");
            assert_eq!(dest, root.join(format!("step{n:08}")));
            assert_eq!(
                fs::read_to_string(root.join("latest")).unwrap(),
                step_dir_name(n)
            );
            assert_eq!(checkpoint_dir(&root).unwrap(), dest);
            assert!(dest.join(MANIFEST_FILE).is_file());
        }
        assert_eq!(steps_in(&root), ["latest", "step00000003", "step00000004"]);
        // A run resumed from step 1's checkpoint (copied back) saves step
        // 2: it is the newest now, whatever the step numbers.
        save(&root, 2, 2).unwrap();
        assert_eq!(steps_in(&root), ["latest", "step00000002", "step00000004"]);
        assert_eq!(checkpoint_dir(&root).unwrap(), root.join("step00000002"));
        // keep_last 0 keeps everything.
        save(&root, 9, 0).unwrap();
        assert_eq!(steps_in(&root).len(), 4);
    }

    /// A step that `latest` names is never overwritten; one it does not
    /// name (renamed into place, then the save was killed) is replaced.
    #[test]
    fn prepare_refuses_the_latest_and_replaces_an_orphan() {
        let d = TestDir::new("root-prepare");
        let root = d.0.clone();
        let (dest, _) = save(&root, 5, 0).unwrap();
        let e = save(&root, 5, 0).unwrap_err().to_string();
        assert!(e.contains("already exists and `latest` names it"), "{e}");
        assert_eq!(
            fs::read(dest.join("rank00000.bin")).unwrap(),
            5u64.to_le_bytes()
        );
        fs::remove_file(root.join("latest")).unwrap();
        fs::write(dest.join("stale"), b"x").unwrap();
        save(&root, 5, 0).unwrap();
        assert!(!dest.join("stale").exists());
        assert!(dest.join(MANIFEST_FILE).is_file());
    }

    /// Opening a root: a checkpoint directory itself; `latest`; without
    /// `latest` the newest step directory with a manifest (a crashed
    /// save's `.tmp-*` and a `step*` without manifest are ignored);
    /// errors naming the root or `latest`.
    #[test]
    fn opening_a_root() {
        let d = TestDir::new("root-open");
        let root = d.0.clone();
        let e = checkpoint_dir(&root).unwrap_err().to_string();
        assert!(e.contains("neither a checkpoint directory"), "{e}");
        save(&root, 3, 0).unwrap();
        save(&root, 7, 0).unwrap();
        let crashed = tmp_dir(&root, "step00000009", 1);
        fs::create_dir(&crashed).unwrap();
        fs::write(crashed.join(MANIFEST_FILE), "{}").unwrap();
        fs::create_dir(root.join("step00000008")).unwrap();
        let seven = root.join("step00000007");
        assert_eq!(checkpoint_dir(&seven).unwrap(), seven);
        assert_eq!(checkpoint_dir(&root).unwrap(), seven);
        fs::remove_file(root.join("latest")).unwrap();
        assert_eq!(checkpoint_dir(&root).unwrap(), seven);
        for bad in ["", "../elsewhere", ".tmp-step00000009-0000000000000001"] {
            fs::write(root.join("latest"), bad).unwrap();
            let e = checkpoint_dir(&root).unwrap_err().to_string();
            assert!(
                e.contains("latest: does not name a checkpoint directory"),
                "{e}"
            );
        }
        fs::write(root.join("latest"), "step00000008").unwrap();
        let e = checkpoint_dir(&root).unwrap_err().to_string();
        assert!(
            e.contains("step00000008/manifest.json: missing (named by"),
            "{e}"
        );
    }
}
