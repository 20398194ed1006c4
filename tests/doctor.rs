//! `zero doctor` as a user runs it: the binary in a subprocess, so that
//! the loader sees the `LD_LIBRARY_PATH` a test sets.

use std::path::Path;
use std::process::{Command, Output};

fn doctor(ld_library_path: Option<&Path>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zero"));
    cmd.arg("doctor");
    if let Some(dir) = ld_library_path {
        cmd.env("LD_LIBRARY_PATH", dir);
    }
    cmd.output().expect("run zero doctor")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The value after `key:` on its line, or a failure that shows the report.
fn line<'a>(report: &'a str, key: &str) -> &'a str {
    report
        .lines()
        .find_map(|l| l.trim_start().strip_prefix(&format!("{key}:")))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no `{key}:` line in\n{report}"))
}

#[test]
fn doctor_reports_this_machine() {
    let out = doctor(None);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{:?}\n{stdout}\n{stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(line(&stdout, "zero version"), env!("CARGO_PKG_VERSION"));
    let features = line(&stdout, "features");
    assert_eq!(
        features.contains("cuda"),
        cfg!(feature = "cuda"),
        "{features}"
    );
    assert_eq!(
        features.contains("mpi"),
        cfg!(feature = "mpi"),
        "{features}"
    );
    assert!(line(&stdout, "kernel").starts_with("Linux "), "{stdout}");
    assert!(line(&stdout, "cores").contains("online"), "{stdout}");
    let simd = line(&stdout, "cpu adamw simd");
    assert!(simd.contains("scalar") && simd.contains("uses "), "{simd}");
    let memlock = line(&stdout, "memlock limit");
    assert!(
        memlock.starts_with("unlimited") || memlock.contains("iB") || memlock.contains(" B"),
        "{memlock}"
    );
    assert!(
        stdout.contains("pin_memory") || stdout.contains("CAP_IPC_LOCK"),
        "{stdout}"
    );
    for key in ["transparent hugepages", "hugepages", "ram", "nvidia driver"] {
        line(&stdout, key);
    }
    if cfg!(feature = "cuda") {
        for key in ["CUDA driver", "NVRTC", "cuBLAS", "NCCL", "gpus"] {
            let v = line(&stdout, key);
            assert!(!v.is_empty(), "{key}: {stdout}");
        }
    } else {
        assert!(
            line(&stdout, "cuda").starts_with("support not compiled in"),
            "{stdout}"
        );
    }
    if cfg!(feature = "mpi") {
        line(&stdout, "mpi library");
    } else {
        assert!(
            line(&stdout, "mpi").starts_with("support not compiled in"),
            "{stdout}"
        );
    }
}

#[test]
fn doctor_rejects_arguments() {
    let out = Command::new(env!("CARGO_BIN_EXE_zero"))
        .args(["doctor", "--bogus"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let (_, stderr) = text(&out);
    assert!(stderr.contains("unexpected argument `--bogus`"), "{stderr}");
}

/// A real shared library of this machine that is not a CUDA library (it
/// loads, but lacks every CUDA symbol).
#[cfg(feature = "cuda")]
fn some_shared_library() -> std::path::PathBuf {
    let arch = std::env::consts::ARCH;
    [
        format!("/lib/{arch}-linux-gnu/libz.so.1"),
        format!("/usr/lib/{arch}-linux-gnu/libz.so.1"),
        format!("/lib/{arch}-linux-gnu/libm.so.6"),
        format!("/usr/lib/{arch}-linux-gnu/libm.so.6"),
        "/lib64/libm.so.6".into(),
        "/usr/lib64/libm.so.6".into(),
    ]
    .into_iter()
    .map(std::path::PathBuf::from)
    .find(|p| p.exists())
    .expect("no libz.so.1 or libm.so.6 in the usual directories")
}

#[cfg(feature = "cuda")]
#[test]
fn broken_libraries_first_on_the_path_are_error_lines() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // An empty driver, a garbage NVRTC, and a real library of the wrong
    // kind under the first name cudarc tries for cuBLAS.
    std::fs::write(d.join("libcuda.so.1"), b"").unwrap();
    std::fs::write(d.join("libnvrtc.so.12"), b"garbage, not an ELF file").unwrap();
    std::fs::copy(some_shared_library(), d.join("libcublas.so")).unwrap();
    let out = doctor(Some(d));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{:?}\n{stdout}\n{stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let shown = d.display().to_string();

    let driver = line(&stdout, "CUDA driver");
    assert!(
        driver.starts_with("error: CUDA driver (12.0 or later)"),
        "{driver}"
    );
    let nvrtc = line(&stdout, "NVRTC");
    assert!(nvrtc.starts_with("error: NVRTC (12.0 or later)"), "{nvrtc}");
    // The broken files are named with the loader's reason, on the
    // library's line or among the copies found elsewhere.
    for (lib, file) in [("CUDA driver", "libcuda.so.1"), ("NVRTC", "libnvrtc.so.12")] {
        let path = format!("{shown}/{file}");
        let mentioned = stdout
            .lines()
            .filter(|l| l.contains(&path))
            .any(|l| l.contains("does not load") || l.contains("unusable"));
        assert!(
            mentioned,
            "{lib}: {path} not reported as broken in\n{stdout}"
        );
    }
    let cublas = line(&stdout, "cuBLAS");
    assert!(
        cublas.starts_with("error: cuBLAS (12.0 or later) is unusable: libcublas.so"),
        "{cublas}"
    );
    assert!(cublas.contains("lacks cublasGetProperty"), "{cublas}");
    assert!(cublas.contains(&shown), "{cublas}");
    line(&stdout, "gpus");
}
