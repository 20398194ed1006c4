//! What the tests of CUDA sources share, for zero-core's kernels and the
//! Llama model's:
//!
//! - [`host_driver`]: builds a kernel header's host check driver with the
//!   host C++ compiler (the header's math compiled as plain C++), and
//!   [`run_driver`] feeds it;
//! - [`nvrtc_or_skip`] and [`compile_clean`]: NVRTC is there (or a visible
//!   skip, or a failure with the install instructions when
//!   `ZERO_REQUIRE_NVRTC=1`), and a source compiles with no warning to a
//!   CUBIN with exactly its listed entry points; [`cuda_device_or_skip`]:
//!   GPU 0 for the tests that need one, or a visible skip. These exist in
//!   every build (as zero-core's NVRTC and device calls do); without
//!   zero-core's `cuda` feature there is no NVRTC and no CUDA device, so
//!   only the tests built with it call them.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use zero_core::cuda::kernels::{
    compile, nvrtc_available, nvrtc_library, CompiledSource, KernelSource,
};
use zero_core::{CudaDevice, Device};

/// Flags the kernels' contract is checked under: no contraction of `a*b+c`
/// and no value-changing optimizations, warnings as errors.
pub const CXX_FLAGS: &[&str] = &[
    "-O2",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-std=c++17",
    "-Wall",
    "-Wextra",
    "-Werror",
];

/// Builds `source` (a host check driver) with `$CXX` or `c++`, with
/// `includes` on the include path, into `dir/host_check`; `None` when there
/// is no C++ compiler (after a visible skip line naming `test`), a panic
/// when `CI` is set then, or when the build fails.
///
/// The executable is built under a name of this process and renamed into
/// place: a concurrent test process never runs a half-written driver, and
/// runs do not pile up executables.
pub fn host_driver(test: &str, source: &Path, includes: &[&Path], dir: &Path) -> Option<PathBuf> {
    let cxx = std::env::var("CXX")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "c++".to_string());
    // `CXX` may carry a launcher or flags ("ccache g++").
    let mut words = cxx.split_whitespace();
    let program = words.next().unwrap_or("c++").to_string();
    let pre: Vec<String> = words.map(str::to_string).collect();
    let found = Command::new(&program)
        .args(&pre)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "no C++ compiler `{cxx}` found (set CXX); CI needs the host check of {}",
            source.display()
        );
        // Straight to stderr: libtest hides `eprintln!` output of passing
        // tests.
        let _ = writeln!(
            std::io::stderr(),
            "{test}: skipped: no C++ compiler `{cxx}` found (set CXX)"
        );
        return None;
    }
    std::fs::create_dir_all(dir).expect("create the driver's directory");
    let exe = dir.join("host_check");
    let tmp = dir.join(format!("host_check.{}.tmp", std::process::id()));
    let mut cmd = Command::new(&program);
    cmd.args(&pre).args(CXX_FLAGS);
    for inc in includes {
        cmd.arg("-I").arg(inc);
    }
    let out = cmd
        .arg(source)
        .arg("-o")
        .arg(&tmp)
        .output()
        .expect("run the C++ compiler");
    assert!(
        out.status.success(),
        "compiling {} with `{cxx} {}` failed:\n{}",
        source.display(),
        CXX_FLAGS.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(&tmp, &exe).expect("move the driver into place");
    Some(exe)
}

/// Runs the driver `exe` with `args`, feeding it `input` on stdin (from
/// another thread, so a large input and output cannot deadlock); returns
/// its stdout, or panics with its stderr when it fails.
pub fn run_driver(exe: &Path, args: &[&str], input: Vec<u8>) -> Vec<u8> {
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the host driver");
    let mut stdin = child.stdin.take().expect("piped stdin");
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().expect("wait for the host driver");
    let wrote = writer.join().expect("writer thread");
    assert!(
        out.status.success(),
        "host_check {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    wrote.expect("write the driver's input");
    out.stdout
}

/// CUDA device 0, or `None` after a visible `{test}: skipped: ...` line
/// (straight to stderr: libtest hides `eprintln!` of passing tests).
pub fn cuda_device_or_skip(test: &str) -> Option<CudaDevice> {
    match Device::cuda(0) {
        Ok(Device::Cuda(d)) => Some(d),
        Ok(Device::Cpu) => unreachable!("Device::cuda gives a CUDA device"),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "{test}: skipped: no CUDA device ({e})");
            None
        }
    }
}

/// Whether NVRTC is there; otherwise a visible skip, or a failure with
/// the install instructions when `ZERO_REQUIRE_NVRTC=1`. With
/// `ZERO_NVRTC_VERSION=13.0` (say), the NVRTC zero opened must be that
/// version: how `scripts/test-cuda.sh` proves which NVRTC compiled the
/// kernels. The file zero opened is printed once.
pub fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc_available() {
        let (version, what) = nvrtc_library().expect("NVRTC is available");
        if let Ok(want) = std::env::var("ZERO_NVRTC_VERSION") {
            assert_eq!(
                format!("{}.{}", version.major, version.minor),
                want,
                "{test}: ZERO_NVRTC_VERSION={want}, but zero opened {what}"
            );
        }
        static SHOWN: std::sync::Once = std::sync::Once::new();
        SHOWN.call_once(|| {
            let _ = writeln!(std::io::stderr(), "{test}: compiling with {what}");
        });
        return true;
    }
    assert!(
        std::env::var("ZERO_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
        "ZERO_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded: install it with \
         `pip install nvidia-cuda-nvrtc` (CUDA 13) or `nvidia-cuda-nvrtc-cu12` (CUDA 12) \
         (scripts/test-cuda.sh installs both) and put its folder on LD_LIBRARY_PATH, or \
         install the CUDA toolkit"
    );
    // Straight to stderr: libtest hides `eprintln!` output of passing
    // tests.
    let _ = writeln!(
        std::io::stderr(),
        "{test}: skipped: libnvrtc.so.13/.12 not found (install it, or put its folder on \
         LD_LIBRARY_PATH)"
    );
    false
}

/// Compiles `src` for `arch`; panics on an error, on any warning in the
/// log, and, for a real architecture (`sm_XY`), on a missing CUBIN or a
/// PTX whose `.entry` kernels are not exactly `src.entry_points`.
pub fn compile_clean(src: &KernelSource, arch: &str) -> CompiledSource {
    let c = compile(src, arch).unwrap_or_else(|e| panic!("{} for {arch}: {e}", src.name));
    assert!(
        !c.log.to_ascii_lowercase().contains("warning"),
        "{} for {arch} compiled with warnings:\n{}",
        src.name,
        c.log
    );
    if arch.starts_with("sm_") {
        let cubin = c.cubin.as_deref().unwrap_or_default();
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "{} for {arch}: no CUBIN",
            src.name
        );
        let entries = c.ptx.matches(".entry ").count();
        assert_eq!(
            entries,
            src.entry_points.len(),
            "{} for {arch}: {entries} kernels in the PTX, {} listed",
            src.name,
            src.entry_points.len()
        );
        for e in src.entry_points {
            assert!(
                c.ptx.contains(&format!(".entry {e}(")),
                "{} for {arch}: entry point `{e}` missing from the PTX",
                src.name
            );
        }
    }
    c
}
