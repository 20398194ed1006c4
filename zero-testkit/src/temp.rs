//! A fresh directory under the system's temp dir, removed on drop: what
//! the file-writing tests (exports, checkpoints, streamed weights) write
//! into.

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A directory `zero-<tag>-<pid>-<n>` under the temp dir, created empty
/// (a leftover of the same name is removed first) and removed with all
/// it holds when dropped. The path is the public field.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates the directory; `tag` names the test (unique per process
    /// through a counter, so tests running in parallel never share one).
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("zero-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)
            .unwrap_or_else(|e| panic!("creating the test directory {}: {e}", p.display()));
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The directory's path, so that a `TempDir` goes where a `&Path` does.
impl Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}
