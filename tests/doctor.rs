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
        cublas.starts_with(&format!(
            "error: cuBLAS (12.0 or later) is unusable: {shown}/libcublas.so is the first copy \
             zero finds, and it lacks cublasGetProperty"
        )),
        "{cublas}"
    );
    line(&stdout, "gpus");
}

/// `zero doctor` in an environment that shows zero only `root`'s
/// virtualenv (no LD_LIBRARY_PATH, HOME, conda, pyenv or CUDA_HOME).
#[cfg(feature = "cuda")]
fn doctor_in_venv(root: &Path, venv: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zero"))
        .arg("doctor")
        .env("VIRTUAL_ENV", venv)
        .env("HOME", root.join("home"))
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("PYENV_ROOT")
        .env_remove("CONDA_PREFIX")
        .env_remove("CUDA_HOME")
        .env_remove("CUDA_PATH")
        .env_remove("CUDA_ROOT")
        .output()
        .expect("run zero doctor")
}

/// The first NVRTC file zero's search finds on this machine (not loaded).
#[cfg(feature = "cuda")]
fn an_nvrtc_file() -> Option<std::path::PathBuf> {
    use zero::core::cuda::libs::{candidates, Lib, Place};
    candidates(Lib::Nvrtc)
        .into_iter()
        .find(|c| !matches!(c.place, Place::Loaded | Place::Loader))
        .map(|c| c.name.into())
}

/// `dst` as the same file as `src`: a hard link (not a name link: the
/// loader reports the path it opened), or a copy across file systems.
#[cfg(feature = "cuda")]
fn same_file(src: &Path, dst: &Path) {
    if std::fs::hard_link(src, dst).is_err() {
        std::fs::copy(src, dst).unwrap();
    }
}

#[cfg(feature = "cuda")]
#[test]
fn doctor_names_each_library_it_opens_in_a_cu13_wheel_layout() {
    // PyTorch's CUDA 13 wheels as pip lays them out, without links:
    // site-packages/nvidia/cu13/lib/{libnvrtc.so.13, libcublas.so.13,
    // libcublasLt.so.13} and nvidia/nccl/lib/libnccl.so.2. cuBLAS and NCCL
    // are stubs (doctor names the file it would open, and why it cannot);
    // NVRTC is this machine's real one where there is one (the NVRTC 12
    // wheel's folder for a CUDA 12 one), so that it is opened and
    // identified from there.
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let venv = r.join("venv");
    let nvidia = venv.join("lib/python3.12/site-packages/nvidia");
    let (cu13, nccl) = (nvidia.join("cu13/lib"), nvidia.join("nccl/lib"));
    std::fs::create_dir_all(&cu13).unwrap();
    std::fs::create_dir_all(&nccl).unwrap();
    for f in [
        cu13.join("libcublas.so.13"),
        cu13.join("libcublasLt.so.13"),
        nccl.join("libnccl.so.2"),
    ] {
        std::fs::write(f, b"a stub, not a library").unwrap();
    }
    let real = an_nvrtc_file();
    let nvrtc = match &real {
        Some(src) => {
            let name = src.file_name().unwrap();
            let dir = if name.to_string_lossy().ends_with(".so.12") {
                nvidia.join("cuda_nvrtc/lib")
            } else {
                cu13.clone()
            };
            std::fs::create_dir_all(&dir).unwrap();
            same_file(src, &dir.join(name));
            for e in std::fs::read_dir(src.parent().unwrap()).unwrap() {
                let e = e.unwrap();
                if e.file_name()
                    .to_string_lossy()
                    .starts_with("libnvrtc-builtins.so")
                {
                    same_file(&e.path(), &dir.join(e.file_name()));
                }
            }
            dir.join(name)
        }
        None => {
            assert!(
                std::env::var_os("ZERO_REQUIRE_NVRTC").is_none(),
                "ZERO_REQUIRE_NVRTC is set but no libnvrtc.so.13/.12 file was found"
            );
            let stub = cu13.join("libnvrtc.so.13");
            std::fs::write(&stub, b"a stub, not a library").unwrap();
            stub
        }
    };
    let out = doctor_in_venv(r, &venv);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{:?}\n{stdout}\n{stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let shown_root = r.display().to_string();
    let line_of = |lib: &str| {
        let l = line(&stdout, lib);
        // The system loader comes before the wheels: a machine whose
        // ld.so cache has the library reports that copy instead.
        let elsewhere = !l.contains(&shown_root);
        if elsewhere {
            eprintln!("{lib}: the system loader's copy is first on this machine: {l}");
        }
        (!elsewhere).then_some(l)
    };
    if let Some(l) = line_of("NVRTC") {
        let shown = nvrtc.display();
        if real.is_some() {
            assert!(l.starts_with("NVRTC 1"), "{l}");
            assert!(
                l.ends_with(&format!(" at {shown} (from a PyTorch wheel folder)")),
                "{l}"
            );
        } else {
            assert!(
                l.starts_with(&format!(
                    "error: NVRTC (12.0 or later) is unusable: {shown} is the first copy zero \
                     finds, and it does not load"
                )),
                "{l}"
            );
        }
    }
    if let Some(l) = line_of("cuBLAS") {
        assert!(
            l.starts_with(&format!(
                "error: cuBLAS (12.0 or later) is unusable: {}/libcublas.so.13 is the first copy \
                 zero finds, and its companion {}/libcublasLt.so.13 does not load",
                cu13.display(),
                cu13.display()
            )),
            "{l}"
        );
    }
    if let Some(l) = line_of("NCCL") {
        assert!(
            l.starts_with(&format!(
                "error: NCCL (2.14.0 or later) is unusable: {}/libnccl.so.2 is the first copy \
                 zero finds, and it does not load",
                nccl.display()
            )),
            "{l}"
        );
    }
}
