//! `zero doctor`: what a bug report needs about this build and machine,
//! as DeepSpeed's `ds_report` or PyTorch's `collect_env` print it.
//!
//! [`report`] gathers zero's version and features, the OS and kernel, the
//! CPU (model, cores, the SIMD paths of the CPU AdamW), locked-memory
//! limits and huge pages, the NVIDIA driver and GPUs, the CUDA driver API,
//! NVRTC, cuBLAS and NCCL (the file zero opens and where it found it, or
//! why none, and other copies on the machine), MPI, and the environment
//! variables that change where libraries come from. Every probe that fails
//! is a line that says what failed; none panics, also with broken or
//! partial libraries where zero looks (`zero_core::cuda::libs` opens and
//! checks them).
//!
//! ```
//! let text = zero::doctor::report().to_string();
//! assert!(text.contains("zero version"));
//! ```

use std::fmt;

use zero_core::optim::Isa;
use zero_offload::host::MemLockStatus;

/// One `key: value` line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// What the line is about.
    pub key: String,
    /// What was found, or what failed.
    pub value: String,
}

/// A titled group of lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// The section's title.
    pub title: &'static str,
    /// Its lines.
    pub lines: Vec<Line>,
}

/// The whole report; its `Display` is what `zero doctor` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The sections, in print order.
    pub sections: Vec<Section>,
}

impl Report {
    /// The value of the first line with this key, in any section.
    pub fn value(&self, key: &str) -> Option<&str> {
        self.sections
            .iter()
            .flat_map(|s| &s.lines)
            .find(|l| l.key == key)
            .map(|l| l.value.as_str())
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .sections
            .iter()
            .flat_map(|s| &s.lines)
            .map(|l| l.key.chars().count())
            .max()
            .unwrap_or(0);
        for (i, s) in self.sections.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            writeln!(f, "{}", s.title)?;
            for l in &s.lines {
                let mut value = l.value.lines();
                let first = value.next().unwrap_or("");
                writeln!(
                    f,
                    "  {:width$}  {first}",
                    format!("{}:", l.key),
                    width = width + 1
                )?;
                for more in value {
                    writeln!(f, "  {:width$}  {more}", "", width = width + 1)?;
                }
            }
        }
        Ok(())
    }
}

/// Lines under construction.
#[derive(Default)]
struct Lines(Vec<Line>);

impl Lines {
    fn add(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.0.push(Line {
            key: key.into(),
            value: value.into(),
        });
    }
}

/// Runs one section's probes; a panic in one (none is expected) becomes a
/// line saying so instead of ending the report.
fn section(title: &'static str, probe: fn(&mut Lines)) -> Section {
    let mut lines = Lines::default();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| probe(&mut lines)));
    if let Err(payload) = result {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        lines.add("error", format!("this section's probe panicked: {msg}"));
    }
    Section {
        title,
        lines: lines.0,
    }
}

/// Gathers the report. Never panics; every failed probe is a line.
pub fn report() -> Report {
    Report {
        sections: vec![
            section("zero", zero_lines),
            section("System", system_lines),
            section("CPU", cpu_lines),
            section("Memory", memory_lines),
            section("NVIDIA / CUDA", cuda_lines),
            section("MPI", mpi_lines),
            section("Environment", env_lines),
        ],
    }
}

fn zero_lines(out: &mut Lines) {
    out.add("zero version", env!("CARGO_PKG_VERSION"));
    let features: Vec<&str> = [
        ("mpi", cfg!(feature = "mpi")),
        ("cuda", cfg!(feature = "cuda")),
        ("testing", cfg!(feature = "testing")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    out.add(
        "features",
        if features.is_empty() {
            "none (threads backend only)".to_string()
        } else {
            features.join(", ")
        },
    );
    out.add(
        "target",
        format!(
            "{}-{}{}",
            std::env::consts::ARCH,
            std::env::consts::OS,
            if cfg!(debug_assertions) {
                " (debug assertions on)"
            } else {
                ""
            }
        ),
    );
}

/// A field of an os-release style or /proc file: `KEY=value` or `key : value`.
fn field<'a>(text: &'a str, key: &str, sep: char) -> Option<&'a str> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(sep)?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

fn read(path: &str) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))
}

fn system_lines(out: &mut Lines) {
    let os = read("/etc/os-release").and_then(|t| {
        field(&t, "PRETTY_NAME", '=')
            .map(str::to_string)
            .ok_or_else(|| "/etc/os-release has no PRETTY_NAME".to_string())
    });
    out.add("os", os.unwrap_or_else(|e| format!("unknown ({e})")));
    // SAFETY: utsname is plain data; all-zero is a valid value for uname
    // to overwrite.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uname fills the struct we own with NUL-terminated strings.
    let kernel = if unsafe { libc::uname(&mut u) } == 0 {
        let s = |f: &[libc::c_char]| {
            let bytes: Vec<u8> = f.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        };
        format!(
            "{} {} {} ({})",
            s(&u.sysname),
            s(&u.release),
            s(&u.machine),
            s(&u.version)
        )
    } else {
        format!(
            "unknown (uname failed: {})",
            std::io::Error::last_os_error()
        )
    };
    out.add("kernel", kernel);
}

fn cpu_lines(out: &mut Lines) {
    let model = read("/proc/cpuinfo").and_then(|t| {
        field(&t, "model name", ':')
            .or_else(|| field(&t, "Model", ':'))
            .map(str::to_string)
            .ok_or_else(|| "/proc/cpuinfo names no model".to_string())
    });
    out.add("cpu", model.unwrap_or_else(|e| format!("unknown ({e})")));
    // SAFETY: sysconf only reads a system value.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let usable = std::thread::available_parallelism()
        .map(|n| n.to_string())
        .unwrap_or_else(|e| format!("unknown ({e})"));
    out.add(
        "cores",
        format!(
            "{} online, {usable} usable by this process (affinity, cgroup)",
            if online > 0 {
                online.to_string()
            } else {
                "unknown".into()
            }
        ),
    );
    let available: Vec<&str> = Isa::available().into_iter().map(Isa::name).collect();
    out.add(
        "cpu adamw simd",
        format!(
            "{} available; uses {}",
            available.join(", "),
            Isa::best().name()
        ),
    );
}

fn bytes(n: u64) -> String {
    crate::estimate::format_bytes(n)
}

fn memory_lines(out: &mut Lines) {
    match crate::host::meminfo() {
        Ok(t) => {
            let kib = |k: &str| crate::host::meminfo_field(&t, k);
            match kib("MemTotal") {
                Some(total) => out.add(
                    "ram",
                    format!(
                        "{} total, {} available",
                        bytes(total * 1024),
                        kib("MemAvailable").map_or("unknown".into(), |a| bytes(a * 1024))
                    ),
                ),
                None => out.add("ram", "unknown (/proc/meminfo has no MemTotal)"),
            }
            match (
                kib("HugePages_Total"),
                kib("HugePages_Free"),
                kib("Hugepagesize"),
            ) {
                (Some(total), Some(free), Some(size)) => out.add(
                    "hugepages",
                    format!(
                        "{total} reserved, {free} free, {} each (HugePages_Total; zero's host \
                         buffers use transparent huge pages, not these)",
                        bytes(size * 1024)
                    ),
                ),
                _ => out.add("hugepages", "unknown (no HugePages_* in /proc/meminfo)"),
            }
        }
        Err(e) => out.add("ram", format!("unknown ({e})")),
    }
    let thp = "/sys/kernel/mm/transparent_hugepage/enabled";
    out.add(
        "transparent hugepages",
        match read(thp) {
            Ok(t) => {
                let mode = t
                    .split_whitespace()
                    .find(|w| w.starts_with('['))
                    .map(|w| w.trim_matches(['[', ']']).to_string());
                match mode.as_deref() {
                    Some("always") => "always (host buffers get huge pages)".into(),
                    Some("madvise") => {
                        "madvise (host buffers get huge pages where zero asks for them)".into()
                    }
                    Some("never") => {
                        "never (host buffers use 4 KiB pages: first-touch and copies are \
                         slower)"
                            .into()
                    }
                    _ => format!("unrecognised: {}", t.trim()),
                }
            }
            Err(e) => format!("unknown ({e})"),
        },
    );
    let status = MemLockStatus::current();
    let mut hard = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut hard) };
    let hard = if rc != 0 {
        "hard limit unknown".to_string()
    } else if hard.rlim_max == libc::RLIM_INFINITY {
        "hard limit unlimited".to_string()
    } else {
        format!("hard limit {}", bytes(hard.rlim_max))
    };
    let soft = status.limit.map_or("unlimited".to_string(), bytes);
    let meaning = if status.cap_ipc_lock {
        "CAP_IPC_LOCK is held, so the limit does not apply".to_string()
    } else {
        match status.limit {
            None => "pin_memory: true can lock host buffers of any size".to_string(),
            Some(l) => format!(
                "pin_memory: true can lock at most {} of CPU-offload buffers with mlock \
                 (raise with `ulimit -l unlimited` or `docker run --ulimit memlock=-1`); \
                 CUDA driver-pinned buffers are not bounded by it",
                bytes(l.saturating_sub(status.locked))
            ),
        }
    };
    out.add(
        "memlock limit",
        format!(
            "{soft} ({hard}; {} locked now)\n{meaning}",
            bytes(status.locked)
        ),
    );
}

/// The NVIDIA kernel module's version, from `/proc/driver/nvidia/version`.
fn nvidia_driver() -> Result<String, String> {
    let path = "/proc/driver/nvidia/version";
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("not loaded (no NVIDIA kernel module: {path}: {e})"))?;
    let line = text.lines().next().unwrap_or("");
    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul ..."
    let version = line
        .split_whitespace()
        .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'));
    Ok(version.map_or_else(|| line.trim().to_string(), str::to_string))
}

fn cuda_lines(out: &mut Lines) {
    out.add("nvidia driver", nvidia_driver().unwrap_or_else(|e| e));
    #[cfg(not(feature = "cuda"))]
    out.add(
        "cuda",
        "support not compiled in (build zero with `--features cuda`); libraries not probed",
    );
    #[cfg(feature = "cuda")]
    cuda::lines(out);
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{bytes, Lines};
    use zero_core::cuda::libs::{require, survey, Lib, LibError, Version};

    pub(super) fn lines(out: &mut Lines) {
        let mut versions: Vec<(Lib, Version)> = Vec::new();
        for lib in Lib::ALL {
            let s = survey(lib);
            // The file this build opens (also when it is unusable), so
            // that the copies listed after it are the others.
            let loaded_path = match &s.loads {
                Ok(found) => {
                    versions.push((lib, found.version));
                    // Which file zero opened and where it found it.
                    let by_path = found
                        .path
                        .as_ref()
                        .is_some_and(|p| p.as_path() == std::path::Path::new(&found.opened_as));
                    let how = if by_path {
                        found.place.to_string()
                    } else {
                        format!("{}, opened as {}", found.place, found.opened_as)
                    };
                    out.add(lib.name(), format!("{found} ({how})"));
                    found.path.clone()
                }
                Err(e) => {
                    out.add(lib.name(), format!("error: {e}"));
                    match e {
                        LibError::Unusable { path, .. } => path.clone(),
                        LibError::TooOld(found) => found.path.clone(),
                        LibError::Missing { .. } => None,
                    }
                }
            };
            // Every other copy in the usual places, with its version or
            // why it cannot be used.
            let others: Vec<String> = s
                .copies
                .iter()
                .filter(|c| {
                    loaded_path
                        .as_ref()
                        .is_none_or(|p| std::fs::canonicalize(&c.path).map_or(true, |c| &c != p))
                })
                .map(|c| match &c.found {
                    Ok(v) => format!("{} ({lib} {v})", c.path.display()),
                    Err(e) => format!("{} (unusable: {e})", c.path.display()),
                })
                .collect();
            if !others.is_empty() {
                out.add(format!("{} copies", lib.name()), others.join("\n"));
            }
        }
        let version = |lib| versions.iter().find(|(l, _)| *l == lib).map(|(_, v)| *v);
        if let (Some(driver), Some(nvrtc)) = (version(Lib::Driver), version(Lib::Nvrtc)) {
            if !driver.at_least(&nvrtc) {
                out.add(
                    "warning",
                    format!(
                        "NVRTC {nvrtc} is newer than the driver's CUDA {driver}: the kernels it \
                         compiles will not load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION); use NVRTC \
                         {}.{} or older, or a newer driver",
                        driver.major, driver.minor
                    ),
                );
            }
        }
        out.add("gpus", gpus());
    }

    /// The GPUs the driver sees, one per line, or why none could be listed.
    fn gpus() -> String {
        use cudarc::driver::result::{self, device};
        use cudarc::driver::sys::CUdevice_attribute as A;
        if let Err(e) = require(Lib::Driver) {
            return format!("not listed: {}", short(&e.to_string()));
        }
        if let Err(e) = result::init() {
            return format!("cuInit failed: {e}");
        }
        let count = match device::get_count() {
            Ok(n) => n,
            Err(e) => return format!("cuDeviceGetCount failed: {e}"),
        };
        if count == 0 {
            return "none (the driver sees no GPU)".into();
        }
        let mut lines = Vec::new();
        for i in 0..count {
            let line = (|| -> Result<String, cudarc::driver::DriverError> {
                let dev = device::get(i)?;
                let name = device::get_name(dev)?;
                // SAFETY: `dev` is a device handle from cuDeviceGet after cuInit.
                let mem = unsafe { device::total_mem(dev) }?;
                // SAFETY: as above; the attributes are plain integers.
                let (major, minor) = unsafe {
                    (
                        device::get_attribute(
                            dev,
                            A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                        )?,
                        device::get_attribute(
                            dev,
                            A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                        )?,
                    )
                };
                Ok(format!(
                    "{i}: {name}, {} memory, compute capability {major}.{minor}",
                    bytes(mem as u64)
                ))
            })();
            lines.push(line.unwrap_or_else(|e| format!("{i}: cannot query: {e}")));
        }
        lines.join("\n")
    }

    /// The first clause of a long library error (its full text is on the
    /// library's own line).
    fn short(msg: &str) -> &str {
        msg.split(':').next().unwrap_or(msg)
    }
}

fn mpi_lines(out: &mut Lines) {
    #[cfg(feature = "mpi")]
    {
        let v = zero_comm::mpi_library_version();
        let v = v.trim();
        out.add(
            "mpi library",
            if v.is_empty() {
                "linked, but MPI_Get_library_version reported an error".to_string()
            } else {
                v.to_string()
            },
        );
    }
    #[cfg(not(feature = "mpi"))]
    out.add(
        "mpi",
        "support not compiled in (the `mpi` feature is off): threads backend only",
    );
}

fn env_lines(out: &mut Lines) {
    let mut vars: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .filter(|(k, _)| {
            [
                "LD_LIBRARY_PATH",
                "LD_PRELOAD",
                "CUDA_HOME",
                "CUDA_PATH",
                "CUDA_VISIBLE_DEVICES",
                "VIRTUAL_ENV",
                "CONDA_PREFIX",
            ]
            .contains(&k.as_str())
                || k.starts_with("ZERO_")
                || k.starts_with("NCCL_")
        })
        .collect();
    vars.sort();
    if vars.is_empty() {
        out.add(
            "variables",
            "none of LD_LIBRARY_PATH, CUDA_*, NCCL_*, ZERO_* set",
        );
    }
    for (k, v) in vars {
        out.add(k, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_and_layout() {
        let os = "NAME=\"Debian\"\nPRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\n";
        assert_eq!(
            field(os, "PRETTY_NAME", '='),
            Some("Debian GNU/Linux 12 (bookworm)")
        );
        let cpu = "processor\t: 0\nmodel name\t: AMD EPYC 9654\n";
        assert_eq!(field(cpu, "model name", ':'), Some("AMD EPYC 9654"));
        assert_eq!(field(cpu, "flags", ':'), None);
        let r = Report {
            sections: vec![Section {
                title: "T",
                lines: vec![
                    Line {
                        key: "a".into(),
                        value: "1\n2".into(),
                    },
                    Line {
                        key: "long key".into(),
                        value: "3".into(),
                    },
                ],
            }],
        };
        assert_eq!(
            r.to_string(),
            "T\n  a:         1\n             2\n  long key:  3\n"
        );
        assert_eq!(r.value("long key"), Some("3"));
    }

    #[test]
    fn a_panicking_probe_is_a_line() {
        let s = section("S", |_| panic!("boom"));
        assert_eq!(s.lines.len(), 1);
        assert_eq!(s.lines[0].value, "this section's probe panicked: boom");
    }
}
