//! Names in a checkpoint root: the rank files, and which directory a path
//! given by the user names (a checkpoint, or a root's newest). Nothing
//! here reads a manifest, so the manifest and the root's publishing both
//! build on it.

use std::fs;
use std::path::{Path, PathBuf};

use super::super::{ck, io};
use super::MANIFEST_FILE;
use crate::Result;

/// The name of saving rank `r`'s file.
pub(crate) fn rank_file(r: usize) -> String {
    format!("rank{r:05}.bin")
}

/// The checkpoint directory `path` names: itself if it holds a manifest;
/// for a root, the directory its `latest` file names, or, without
/// `latest` (a save killed between renaming its directory into place and
/// writing `latest`: the first save, or `latest` deleted), its newest
/// `step*` directory, which is complete (only finished checkpoints are
/// renamed into place).
pub(crate) fn checkpoint_dir(path: &Path) -> Result<PathBuf> {
    if path.join(MANIFEST_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join("latest");
    if !latest.is_file() {
        return newest_step_dir(path).ok_or_else(|| {
            ck(
                path,
                "neither a checkpoint directory (no manifest.json) nor a checkpoint root (no \
                 `latest` file, no step* directory)",
            )
        });
    }
    let name = fs::read_to_string(&latest).map_err(io(&latest, "read"))?;
    let name = name.trim();
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(ck(
            &latest,
            format!("does not name a checkpoint directory: `{name}`"),
        ));
    }
    let dir = path.join(name);
    if !dir.join(MANIFEST_FILE).is_file() {
        return Err(ck(
            &dir.join(MANIFEST_FILE),
            format!("missing (named by {})", latest.display()),
        ));
    }
    Ok(dir)
}

/// The `step*` directory of `root` with the highest step that has a
/// manifest.
fn newest_step_dir(root: &Path) -> Option<PathBuf> {
    fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step: u64 = name.strip_prefix("step")?.parse().ok()?;
            e.path()
                .join(MANIFEST_FILE)
                .is_file()
                .then_some((step, e.path()))
        })
        .max_by_key(|(step, _)| *step)
        .map(|(_, p)| p)
}
