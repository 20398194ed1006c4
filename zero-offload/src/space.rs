//! Free disk space, checked before any work: the swap files a setup will
//! create under each `nvme_path` against the space free on that path's
//! filesystem, so that a run too large for its disk fails at start-up with
//! an error naming the path and both figures, not hours later (or after
//! minutes of writing initial state).
//!
//! Needs on the same filesystem add up (two `nvme_path`s on one disk, or
//! several ranks of one machine writing under the same path).

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Bytes that files under `path` will take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskNeed {
    /// Where the files go (need not exist yet).
    pub path: PathBuf,
    /// Their bytes.
    pub bytes: u64,
    /// What they are (e.g. `"optimizer swap files of 2 ranks"`).
    pub what: String,
}

/// A filesystem's identity and its bytes free to an unprivileged user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreeSpace {
    /// The filesystem's device (`st_dev`).
    pub device: u64,
    /// Bytes available (`f_bavail × f_frsize`).
    pub available: u64,
}

/// The filesystem holding `path` (its nearest existing ancestor: the
/// directory may be created later) and the bytes free there.
///
/// # Errors
/// No ancestor can be examined, or `statvfs` fails: an error naming the
/// path.
pub fn free_space(path: &Path) -> Result<FreeSpace> {
    let mut at = path;
    let meta = loop {
        match std::fs::metadata(at) {
            Ok(m) => break m,
            Err(e) => match at.parent() {
                Some(p) if !p.as_os_str().is_empty() => at = p,
                _ if path.is_relative() => at = Path::new("."),
                _ => return Err(io_err(path, format!("cannot examine the path: {e}"))),
            },
        }
    };
    let c = std::ffi::CString::new(at.as_os_str().as_bytes())
        .map_err(|_| io_err(path, "the path contains a NUL byte"))?;
    // SAFETY: `c` is a NUL-terminated path; `st` is a plain C struct that
    // statvfs fills (all-zero is a valid value of it).
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the pointers are valid for the call.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(io_err(
            path,
            format!("cannot read the free space of {}: {e}", at.display()),
        ));
    }
    // (fsblkcnt_t and c_ulong are narrower than u64 on some targets.)
    #[allow(clippy::useless_conversion)]
    Ok(FreeSpace {
        device: meta.dev(),
        available: u64::from(st.f_bavail).saturating_mul(u64::from(st.f_frsize)),
    })
}

/// Checks that every filesystem has room for what `needs` will write on
/// it (needs on the same filesystem add up).
///
/// # Errors
/// The first filesystem short of space: an error naming its path(s), the
/// bytes needed (and what for) and the bytes free; or why the free space
/// could not be read.
pub fn check_free_space(needs: &[DiskNeed]) -> Result<()> {
    check_with(needs, free_space)
}

/// [`check_free_space`] with `free` as the source of free space.
fn check_with(needs: &[DiskNeed], free: impl Fn(&Path) -> Result<FreeSpace>) -> Result<()> {
    // (filesystem, its free bytes, the needs on it), in the order met.
    let mut groups: Vec<(FreeSpace, Vec<&DiskNeed>)> = Vec::new();
    for n in needs.iter().filter(|n| n.bytes > 0) {
        let fs = free(&n.path)?;
        match groups.iter_mut().find(|(g, _)| g.device == fs.device) {
            Some((_, list)) => list.push(n),
            None => groups.push((fs, vec![n])),
        }
    }
    for (fs, list) in groups {
        let total: u64 = list.iter().map(|n| n.bytes).sum();
        if total > fs.available {
            let parts: Vec<String> = list
                .iter()
                .map(|n| format!("{} bytes of {} under {}", n.bytes, n.what, n.path.display()))
                .collect();
            let dirs: Vec<&Path> = list.iter().map(|n| n.path.as_path()).collect();
            return Err(io_err(
                &list[0].path,
                format!(
                    "not enough free disk space: {total} bytes are needed ({}), {} bytes are \
                     free on that filesystem ({} bytes short); free space there or point \
                     nvme_path at a larger disk{}",
                    parts.join("; "),
                    fs.available,
                    total - fs.available,
                    leftover_note(&dirs)
                ),
            ));
        }
    }
    Ok(())
}

/// The swap files (`zero-swap-*.swp`) directly under `dirs` that no
/// process of this user holds open (a run killed before it could remove
/// them), with their sizes, in name order.
pub fn leftover_swap_files(dirs: &[&Path]) -> Vec<(PathBuf, u64)> {
    let mut found = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if !(name.starts_with("zero-swap-") && name.ends_with(".swp")) {
                continue;
            }
            let (Ok(meta), Ok(path)) = (e.metadata(), e.path().canonicalize()) else {
                continue;
            };
            if meta.is_file() && !found.iter().any(|(p, _)| p == &path) {
                found.push((path, meta.len()));
            }
        }
    }
    if found.is_empty() {
        return found;
    }
    let open = open_files();
    found.retain(|(p, _)| !open.contains(p));
    found.sort();
    found
}

/// Every file some process of this user holds open (`/proc/<pid>/fd`;
/// the processes whose descriptors cannot be read are skipped).
fn open_files() -> Vec<PathBuf> {
    let mut open = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return open;
    };
    for p in procs.flatten() {
        if !p
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                open.push(target);
            }
        }
    }
    open
}

/// The note of a disk-space error about swap files left under `dirs`.
fn leftover_note(dirs: &[&Path]) -> String {
    let left = leftover_swap_files(dirs);
    if left.is_empty() {
        return String::new();
    }
    let bytes: u64 = left.iter().map(|(_, b)| b).sum();
    let names: Vec<String> = left.iter().map(|(p, _)| p.display().to_string()).collect();
    format!(
        "; {} swap file(s) of {bytes} bytes there are open in no process (left by a run that \
         was killed?) and could be removed: {}",
        left.len(),
        names.join(", ")
    )
}

fn io_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn need(path: &str, bytes: u64, what: &str) -> DiskNeed {
        DiskNeed {
            path: PathBuf::from(path),
            bytes,
            what: what.into(),
        }
    }

    /// Two filesystems: /a and /a/sub on device 1 (100 bytes free), /b on
    /// device 2 (50 free).
    fn fake(path: &Path) -> Result<FreeSpace> {
        Ok(if path.starts_with("/b") {
            FreeSpace {
                device: 2,
                available: 50,
            }
        } else {
            FreeSpace {
                device: 1,
                available: 100,
            }
        })
    }

    #[test]
    fn needs_on_one_filesystem_add_up() {
        let ok = [need("/a", 60, "x"), need("/b", 50, "y")];
        check_with(&ok, fake).unwrap();
        let short = [need("/a", 60, "optimizer"), need("/a/sub", 41, "params")];
        let e = check_with(&short, fake).unwrap_err().to_string();
        for part in [
            "/a",
            "101 bytes are needed",
            "60 bytes of optimizer under /a",
            "41 bytes of params under /a/sub",
            "100 bytes are free",
            "1 bytes short",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
        let e = check_with(&[need("/b", 51, "y")], fake)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("/b: not enough free disk space"), "{e}");
    }

    /// A disk-space error lists the swap files under the path that no
    /// process holds open, not one this process has open, nor other files.
    #[test]
    fn the_error_names_swap_files_left_by_a_killed_run() {
        let dir = std::env::temp_dir().join(format!("zero-space-left-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let dead = dir.join("zero-swap-optimizer-rank0-0123456789abcdef.swp");
        std::fs::write(&dead, vec![0u8; 5000]).unwrap();
        let live = dir.join("zero-swap-params-rank0-fedcba9876543210.swp");
        std::fs::write(&live, vec![0u8; 100]).unwrap();
        let _held = std::fs::File::open(&live).unwrap();
        std::fs::write(dir.join("zero-swap-notes.txt"), b"x").unwrap();
        let left = leftover_swap_files(&[&dir]);
        assert_eq!(left, vec![(dead.canonicalize().unwrap(), 5000)]);
        let e = check_free_space(&[DiskNeed {
            path: dir.clone(),
            bytes: u64::MAX / 2,
            what: "swap files".into(),
        }])
        .unwrap_err()
        .to_string();
        assert!(e.contains("1 swap file(s) of 5000 bytes"), "{e}");
        assert!(e.contains("0123456789abcdef"), "{e}");
        assert!(!e.contains("fedcba9876543210"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_directory_is_measured_at_its_ancestor() {
        let dir = std::env::temp_dir().join("zero-space-test/not/yet/made");
        let fs = free_space(&dir).unwrap();
        let tmp = free_space(&std::env::temp_dir()).unwrap();
        assert_eq!(fs.device, tmp.device);
        assert!(fs.available > 0);
        // More than any disk: refused, naming the path.
        let e = check_free_space(&[DiskNeed {
            path: dir.clone(),
            bytes: u64::MAX / 2,
            what: "swap files".into(),
        }])
        .unwrap_err()
        .to_string();
        assert!(e.contains(&dir.display().to_string()), "{e}");
        assert!(e.contains("not enough free disk space"), "{e}");
    }
}
