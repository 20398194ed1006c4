//! Finding and opening the CUDA libraries (driver, NVRTC, cuBLAS, NCCL)
//! as they are installed, CUDA 12 or 13, without panics.
//!
//! cudarc (built with `dynamic-loading`) opens each library on first use by
//! trying a fixed list of bare file names with `dlopen` and panics when none
//! opens. The names come from [`cudarc::get_lib_name_candidates`]: for this
//! build (cudarc's `cuda-12080`) `libnvrtc.so`, `libnvrtc64*.so` variants,
//! `libnvrtc.so.12`, `.11`, `.10`, `.9` and `.1`. CUDA 13's libraries
//! (`libnvrtc.so.13`, `libcublas.so.13`, as in PyTorch's `nvidia/cu13/lib`
//! wheels) and NCCL's own `libnccl.so.2` are never among them, and a bare
//! name is looked up only on the loader's path, which is fixed when the
//! process starts. So zero opens NVRTC, cuBLAS and NCCL itself ([`load`]):
//! it finds the file ([`candidates`]: already loaded, `LD_LIBRARY_PATH`,
//! the system loader, PyTorch's wheel folders, `$CUDA_HOME`,
//! `/usr/local/cuda*`), opens it by path, checks its version, and calls it
//! through function tables of its own (`kernels`, [`cublas`](super::cublas),
//! zero-comm's NCCL layer) that are filled from the opened library, so a
//! missing symbol is an error, never a panic. cudarc's types and enums are
//! still used; its loaders for these three libraries are never called.
//!
//! The driver (`libcuda.so.1`, installed with the NVIDIA driver and among
//! cudarc's names) stays with cudarc: [`require`] runs cudarc's search
//! first and returns a [`LibError`] instead of cudarc's panic.
//!
//! [`survey`] reports everything found, for `zero doctor`.

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CStr, CString, OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use super::version::{Version, NCCL_MIN_VERSION};

/// A CUDA library that zero loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lib {
    /// The CUDA driver API (`libcuda.so.1`, installed with the NVIDIA driver).
    Driver,
    /// The runtime compiler that builds zero's kernels (`libnvrtc`).
    Nvrtc,
    /// cuBLAS (`libcublas`), for GEMMs.
    Cublas,
    /// NCCL (`libnccl`), for collectives on device buffers.
    Nccl,
}

impl Lib {
    /// Every library, in the order a report lists them.
    pub const ALL: [Lib; 4] = [Lib::Driver, Lib::Nvrtc, Lib::Cublas, Lib::Nccl];

    /// The library's name in messages.
    pub const fn name(self) -> &'static str {
        match self {
            Lib::Driver => "CUDA driver",
            Lib::Nvrtc => "NVRTC",
            Lib::Cublas => "cuBLAS",
            Lib::Nccl => "NCCL",
        }
    }

    /// The stems cudarc builds file names from (`lib{stem}.so...`).
    const fn stems(self) -> &'static [&'static str] {
        match self {
            Lib::Driver => &["cuda", "nvcuda"],
            Lib::Nvrtc => &["nvrtc"],
            Lib::Cublas => &["cublas"],
            Lib::Nccl => &["nccl"],
        }
    }

    /// The oldest version zero works with: cudarc's bindings are CUDA
    /// 12.x's (the driver API and libraries of CUDA 12.0 or later); NCCL
    /// 2.14 is the first with non-blocking communicators.
    pub const fn min_version(self) -> Version {
        match self {
            Lib::Driver | Lib::Nvrtc | Lib::Cublas => Version::new(12, 0),
            Lib::Nccl => NCCL_MIN_VERSION,
        }
    }

    /// The symbols checked when the library is found: the version query
    /// and what zero calls first. The function tables built on
    /// [`Library::get`] check the rest when they are filled.
    pub const fn symbols(self) -> &'static [&'static str] {
        match self {
            Lib::Driver => &[
                "cuDriverGetVersion",
                "cuInit",
                "cuDeviceGetCount",
                "cuDeviceGet",
                "cuDeviceGetName",
                "cuDeviceTotalMem_v2",
                "cuDeviceGetAttribute",
                "cuDevicePrimaryCtxRetain",
            ],
            Lib::Nvrtc => &[
                "nvrtcVersion",
                "nvrtcCreateProgram",
                "nvrtcCompileProgram",
                "nvrtcGetPTXSize",
                "nvrtcGetPTX",
                "nvrtcGetProgramLogSize",
                "nvrtcGetProgramLog",
                "nvrtcDestroyProgram",
            ],
            Lib::Cublas => &["cublasGetProperty", "cublasCreate_v2", "cublasDestroy_v2"],
            Lib::Nccl => &["ncclGetVersion"],
        }
    }

    /// The file names cudarc tries, in its order (duplicates removed). Only
    /// the driver is opened this way.
    pub fn cudarc_names(self) -> Vec<String> {
        let mut seen = HashSet::new();
        self.stems()
            .iter()
            .flat_map(|stem| cudarc::get_lib_name_candidates(stem))
            .filter(|n| seen.insert(n.clone()))
            .collect()
    }

    /// The names the library is installed under by CUDA 12 and 13
    /// toolkits, drivers and PyTorch's wheels (the driver's `libcuda.so.1`,
    /// `libnvrtc.so.13` and `.12`, `libcublas.so.13` and `.12`, NCCL's
    /// `libnccl.so.2`), then the unversioned development link: the names
    /// zero opens NVRTC, cuBLAS and NCCL by, newest first.
    pub fn installed_names(self) -> Vec<String> {
        let versions: &[&str] = match self {
            Lib::Driver => &["1"],
            Lib::Nvrtc | Lib::Cublas => &["13", "12"],
            Lib::Nccl => &["2"],
        };
        let stem = self.stems()[0];
        versions
            .iter()
            .map(|v| format!("lib{stem}.so.{v}"))
            .chain([format!("lib{stem}.so")])
            .collect()
    }

    /// Every name [`search_dirs`] are searched for in a survey: the
    /// installed names, then cudarc's others (older CUDA's, so that a copy
    /// too old to use is still reported).
    pub fn candidate_names(self) -> Vec<String> {
        let mut seen = HashSet::new();
        self.installed_names()
            .into_iter()
            .chain(self.cudarc_names())
            .filter(|n| seen.insert(n.clone()))
            .collect()
    }

    /// The unversioned development name (`libnvrtc.so`), the first name
    /// cudarc tries.
    pub fn link_name(self) -> String {
        format!("lib{}.so", self.stems()[0])
    }

    /// How to install the library, for messages.
    const fn install_hint(self) -> &'static str {
        match self {
            Lib::Driver => "install the NVIDIA driver",
            Lib::Nvrtc => {
                "install it with `pip install nvidia-cuda-nvrtc` (CUDA 13) or \
                 `pip install nvidia-cuda-nvrtc-cu12` (CUDA 12), or install the CUDA toolkit"
            }
            Lib::Cublas => {
                "install it with `pip install nvidia-cublas` (CUDA 13) or \
                 `pip install nvidia-cublas-cu12` (CUDA 12), or install the CUDA toolkit"
            }
            Lib::Nccl => {
                "install it with `pip install nvidia-nccl-cu13` or `pip install \
                 nvidia-nccl-cu12`, or your distribution's libnccl2 package"
            }
        }
    }
}

impl fmt::Display for Lib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a library was found, in the order zero searches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Place {
    /// Already mapped into the process under one of the installed names
    /// (loaded by another library, e.g. PyTorch's, before zero looked).
    Loaded,
    /// A directory on `LD_LIBRARY_PATH`, searched in order, each for the
    /// names newest first.
    LdLibraryPath,
    /// The system loader's search by bare name: the `ld.so` cache and the
    /// default directories (`/usr/lib`, ...).
    Loader,
    /// A folder of PyTorch's NVIDIA wheels: `site-packages/nvidia/*/lib`
    /// (and `torch/lib`) of the active virtualenv or conda environment,
    /// the user's, pyenv's and the system's Python.
    Wheel,
    /// `$CUDA_HOME` (or `$CUDA_PATH`, `$CUDA_ROOT`): `lib64`, `lib`,
    /// `targets/<arch>-linux/lib`.
    CudaHome,
    /// `/usr/local/cuda`, then the versioned toolkits under `/usr/local`,
    /// newest first.
    Toolkit,
    /// cudarc's own search by name (the driver).
    Cudarc,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Place::Loaded => "already loaded in the process",
            Place::LdLibraryPath => "from LD_LIBRARY_PATH",
            Place::Loader => "by the system loader",
            Place::Wheel => "from a PyTorch wheel folder",
            Place::CudaHome => "from CUDA_HOME",
            Place::Toolkit => "from a CUDA toolkit under /usr/local",
            Place::Cudarc => "by cudarc's search",
        })
    }
}

/// A library that opened and answered its version query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Which library.
    pub lib: Lib,
    /// The name or path it was opened by.
    pub opened_as: String,
    /// Where the search found it.
    pub place: Place,
    /// The file the loader mapped, where it can tell.
    pub path: Option<PathBuf>,
    /// Its version (for the driver: the CUDA version it supports).
    pub version: Version,
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.lib, self.version)?;
        match &self.path {
            Some(p) => write!(f, " at {}", p.display()),
            None => write!(f, " (opened as {})", self.opened_as),
        }
    }
}

/// A file that exists under a candidate name but did not load or lacks
/// what zero needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unusable {
    /// The name or path that was tried.
    pub name: String,
    /// The loader's message, or the missing symbols.
    pub reason: String,
}

/// Why a CUDA library cannot be used. Every message names the library and
/// the version zero needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LibError {
    /// No file of the library was found.
    Missing {
        /// The library.
        lib: Lib,
        /// The names looked for, in order.
        tried: Vec<String>,
        /// Names that exist on the loader path but failed to open.
        broken: Vec<Unusable>,
        /// Copies found in [`search_dirs`] under names or in directories
        /// this build does not open.
        elsewhere: Vec<PathBuf>,
    },
    /// The first copy found does not load, lacks symbols zero calls, or its
    /// version query failed.
    Unusable {
        /// The library.
        lib: Lib,
        /// What was opened and what is wrong with it.
        what: Unusable,
        /// The file, where the loader can tell.
        path: Option<PathBuf>,
    },
    /// The library loaded but is older than zero needs.
    TooOld(Found),
}

impl LibError {
    /// The library concerned.
    pub fn lib(&self) -> Lib {
        match self {
            LibError::Missing { lib, .. } | LibError::Unusable { lib, .. } => *lib,
            LibError::TooOld(found) => found.lib,
        }
    }
}

/// The places [`candidates`] searches, for messages.
const SEARCHED: &str = "already loaded, on LD_LIBRARY_PATH, through the system loader, in \
     PyTorch's site-packages/nvidia/*/lib wheel folders, in $CUDA_HOME and /usr/local/cuda*";

impl fmt::Display for LibError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lib = self.lib();
        let needed = lib.min_version();
        match self {
            LibError::Missing {
                tried,
                broken,
                elsewhere,
                ..
            } => {
                if lib == Lib::Driver {
                    write!(
                        f,
                        "{lib} ({needed} or later) could not be loaded: it is opened as one of \
                         {} on the loader's path (LD_LIBRARY_PATH, the ld.so cache, /usr/lib)",
                        summarize(tried)
                    )?;
                } else {
                    write!(
                        f,
                        "{lib} ({needed} or later) was not found: zero looks for {} {SEARCHED}",
                        tried.join(", ")
                    )?;
                }
                for b in broken {
                    write!(f, "; {} exists but does not load: {}", b.name, b.reason)?;
                }
                for p in elsewhere {
                    let dir = p.parent().unwrap_or(Path::new("/")).display();
                    if lib == Lib::Driver {
                        write!(
                            f,
                            "; found {}, in a directory the loader does not search: add {dir} \
                             to LD_LIBRARY_PATH",
                            p.display()
                        )?;
                    } else if file_name(p).is_some_and(|n| tried.contains(&n)) {
                        write!(
                            f,
                            "; found {}, in a directory zero does not search: add {dir} to \
                             LD_LIBRARY_PATH",
                            p.display()
                        )?;
                    } else {
                        write!(
                            f,
                            "; found {}, under a name zero does not open (not CUDA 12's or \
                             13's)",
                            p.display()
                        )?;
                    }
                }
                write!(f, "; {}", lib.install_hint())
            }
            LibError::Unusable { what, path, .. } => {
                write!(f, "{lib} ({needed} or later) is unusable: {}", what.name)?;
                if let Some(p) = path
                    .as_ref()
                    .filter(|p| p.as_path() != Path::new(&what.name))
                {
                    write!(f, " ({})", p.display())?;
                }
                write!(
                    f,
                    " is the first copy zero finds, and {}; remove it or put a working {lib} \
                     before it ({SEARCHED}, in this order)",
                    what.reason
                )
            }
            LibError::TooOld(found) => {
                write!(f, "{found} is too old: zero needs {lib} {needed} or later")
            }
        }
    }
}

impl std::error::Error for LibError {}

/// cudarc's names for messages: the Linux names in full, the Windows-style
/// `lib{stem}64*` variants counted.
fn summarize(names: &[String]) -> String {
    let (variants, plain): (Vec<&String>, Vec<&String>) =
        names.iter().partition(|n| n.contains("64"));
    let mut s = plain
        .iter()
        .map(|n| n.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    if !variants.is_empty() {
        s.push_str(&format!(" (and {} `lib*64*.so` variants)", variants.len()));
    }
    s
}

impl From<LibError> for crate::Error {
    fn from(e: LibError) -> Self {
        crate::Error::Cuda(Box::new(e))
    }
}

/// A library opened with `dlopen`; never closed (CUDA libraries do not
/// unload cleanly, and function pointers into it live in static tables).
struct Handle(*mut c_void);

// SAFETY: a dlopen handle is a process-wide token that the loader
// serializes itself; dlsym may be called with it from any thread.
unsafe impl Send for Handle {}
// SAFETY: as above; a Handle has no interior state of its own.
unsafe impl Sync for Handle {}

/// Opens `name` (a bare name searched on the loader's path, or a path) as
/// libloading does for cudarc (`RTLD_LAZY | RTLD_LOCAL`).
fn open(name: &str) -> Result<Handle, String> {
    open_with(name, libc::RTLD_LAZY | libc::RTLD_LOCAL)
}

/// The library already mapped into the process under `name` (its soname or
/// the name it was opened by), without loading anything.
fn open_loaded(name: &str) -> Option<Handle> {
    open_with(name, libc::RTLD_LAZY | libc::RTLD_LOCAL | libc::RTLD_NOLOAD).ok()
}

fn open_with(name: &str, flags: c_int) -> Result<Handle, String> {
    let c = CString::new(name).map_err(|_| format!("{name}: the name contains a NUL byte"))?;
    // SAFETY: dlopen takes a NUL-terminated name; running the library's
    // initializers is what loading it means.
    let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
    if h.is_null() {
        Err(dl_error())
    } else {
        Ok(Handle(h))
    }
}

/// The loader's last error message (`dlerror`, per thread).
fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until
    // the next dl* call on this thread; it is copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown loader error".into()
    } else {
        // SAFETY: non-null and NUL-terminated (above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Whether a `dlopen` message means that no file of that name was found
/// (as opposed to a file that exists and failed to load).
fn is_absent(msg: &str) -> bool {
    msg.contains("No such file or directory")
}

impl Handle {
    fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: self.0 is a live handle from dlopen; dlsym only looks
        // the name up.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    /// The file the loader mapped for this library (`dlinfo`'s link map).
    #[cfg(target_env = "gnu")]
    fn path(&self) -> Option<PathBuf> {
        use std::os::unix::ffi::OsStrExt;
        /// The leading fields of glibc's `struct link_map`.
        #[repr(C)]
        struct LinkMap {
            _l_addr: usize,
            l_name: *const c_char,
        }
        let mut map: *const LinkMap = std::ptr::null();
        // SAFETY: self.0 is a live dlopen handle; RTLD_DI_LINKMAP stores a
        // pointer to the loader's link_map for it into `map`.
        let rc = unsafe {
            libc::dlinfo(
                self.0,
                libc::RTLD_DI_LINKMAP,
                (&raw mut map).cast::<c_void>(),
            )
        };
        if rc != 0 || map.is_null() {
            return None;
        }
        // SAFETY: `map` points to the loader's link_map, which starts with
        // these two fields and lives as long as the (never closed) handle.
        let name = unsafe { (*map).l_name };
        if name.is_null() {
            return None;
        }
        // SAFETY: l_name is a NUL-terminated string owned by the loader.
        let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
        if bytes.is_empty() {
            return None;
        }
        let path = PathBuf::from(OsStr::from_bytes(bytes));
        Some(std::fs::canonicalize(&path).unwrap_or(path))
    }

    /// The file the loader mapped: not asked outside glibc.
    #[cfg(not(target_env = "gnu"))]
    fn path(&self) -> Option<PathBuf> {
        None
    }

    /// Checks the symbols `lib` needs and asks its version.
    fn identify(&self, lib: Lib, opened_as: &str, place: Place) -> Result<Found, Unusable> {
        let missing: Vec<&str> = lib
            .symbols()
            .iter()
            .copied()
            .filter(|s| self.symbol(s).is_none())
            .collect();
        let unusable = |reason: String| Unusable {
            name: opened_as.to_string(),
            reason,
        };
        if !missing.is_empty() {
            return Err(unusable(format!(
                "it lacks {} (not {lib}, or older than {})",
                missing.join(", "),
                lib.min_version()
            )));
        }
        let sym = lib.symbols()[0];
        let f = self
            .symbol(sym)
            .ok_or_else(|| unusable(format!("it lacks {sym}")))?;
        // The symbol is the library's version query; each is called through
        // its C signature and writes plain integers through pointers to
        // locals. None needs initialization (cuDriverGetVersion may be
        // called before cuInit).
        type IntOut = unsafe extern "C" fn(*mut c_int) -> c_int;
        type TwoIntsOut = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
        type Property = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
        let version = match lib {
            Lib::Driver | Lib::Nccl => {
                // SAFETY: cuDriverGetVersion and ncclGetVersion are
                // `int f(int *)` (CUresult and ncclResult_t are C enums).
                let f: IntOut = unsafe { std::mem::transmute::<*mut c_void, IntOut>(f) };
                let mut v: c_int = 0;
                // SAFETY: `v` is a valid out pointer for the call.
                match unsafe { f(&mut v) } {
                    0 if lib == Lib::Driver => Version::from_cuda_code(v.max(0) as u32),
                    0 => Version::from_nccl_code(v.max(0) as u32),
                    rc => return Err(unusable(format!("{sym} returned {rc}"))),
                }
            }
            Lib::Nvrtc => {
                // SAFETY: nvrtcVersion is `nvrtcResult f(int *major, int *minor)`.
                let f: TwoIntsOut = unsafe { std::mem::transmute::<*mut c_void, TwoIntsOut>(f) };
                let (mut major, mut minor): (c_int, c_int) = (0, 0);
                // SAFETY: both are valid out pointers for the call.
                match unsafe { f(&mut major, &mut minor) } {
                    0 => Version::new(major.max(0) as u32, minor.max(0) as u32),
                    rc => return Err(unusable(format!("{sym} returned {rc}"))),
                }
            }
            Lib::Cublas => {
                // SAFETY: cublasGetProperty is
                // `cublasStatus_t f(libraryPropertyType, int *value)`.
                let f: Property = unsafe { std::mem::transmute::<*mut c_void, Property>(f) };
                // libraryPropertyType: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL.
                let mut parts = [0 as c_int; 3];
                for (i, part) in parts.iter_mut().enumerate() {
                    // SAFETY: a valid property and a valid out pointer.
                    let rc = unsafe { f(i as c_int, part) };
                    if rc != 0 {
                        return Err(unusable(format!("{sym} returned {rc}")));
                    }
                }
                Version {
                    major: parts[0].max(0) as u32,
                    minor: parts[1].max(0) as u32,
                    patch: Some(parts[2].max(0) as u32),
                }
            }
        };
        Ok(Found {
            lib,
            opened_as: opened_as.to_string(),
            place,
            path: self.path(),
            version,
        })
    }
}

/// A CUDA library zero opened, with what it is and where it was found;
/// open for the rest of the process.
pub struct Library {
    found: Found,
    handle: Handle,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library")
            .field("found", &self.found)
            .finish_non_exhaustive()
    }
}

impl Library {
    /// What was opened: the library, its file, version and place.
    pub fn found(&self) -> &Found {
        &self.found
    }

    /// Checks that the library exports every one of `names`; the error
    /// names all that are missing and the file.
    pub fn check_symbols(&self, names: &[&str]) -> Result<(), LibError> {
        let missing: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| self.handle.symbol(n).is_none())
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(self.lacks(&missing))
        }
    }

    fn lacks(&self, missing: &[&str]) -> LibError {
        let lib = self.found.lib;
        LibError::Unusable {
            lib,
            what: Unusable {
                name: self.found.opened_as.clone(),
                reason: format!(
                    "it lacks {} ({lib} {} does not have what zero calls)",
                    missing.join(", "),
                    self.found.version
                ),
            },
            path: self.found.path.clone(),
        }
    }

    /// The function `name` of the library, as a function pointer of type
    /// `F`; an error naming it when the library does not export it.
    ///
    /// # Safety
    /// `F` must be an `unsafe extern "C" fn` type whose parameters and
    /// result match the C declaration of `name` in the library's header.
    pub unsafe fn get<F: Copy>(&self, name: &str) -> Result<F, LibError> {
        const {
            assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>());
        }
        let p = self
            .handle
            .symbol(name)
            .ok_or_else(|| self.lacks(&[name]))?;
        // SAFETY: `F` is a function pointer type of the symbol's signature
        // (the caller's promise) and has a pointer's size (checked above);
        // `p` is the symbol's non-null address in a library never closed.
        Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
    }
}

/// One name or file that the search tries, and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// A bare name ([`Place::Loaded`], [`Place::Loader`]) or a path.
    pub name: String,
    /// Where it comes from.
    pub place: Place,
}

/// What zero tries, in order, to open `lib` (NVRTC, cuBLAS, NCCL): its
/// [installed names](Lib::installed_names) already loaded in the process,
/// then the files under those names in each `LD_LIBRARY_PATH` directory,
/// then the names through the system loader (its cache and default
/// directories), then the files in PyTorch's wheel folders, `$CUDA_HOME`
/// and `/usr/local/cuda*` ([`Place`]). Files are listed only where they
/// exist. The first candidate that exists is the one zero uses.
pub fn candidates(lib: Lib) -> Vec<Candidate> {
    candidates_in(lib, &|k| std::env::var_os(k), Path::new("/"))
}

/// [`candidates`] with the environment from `env` and the file system
/// under `root`, for tests.
pub fn candidates_in(
    lib: Lib,
    env: &dyn Fn(&str) -> Option<OsString>,
    root: &Path,
) -> Vec<Candidate> {
    let names = lib.installed_names();
    let bare = |place: Place| {
        names.iter().map(move |n| Candidate {
            name: n.clone(),
            place,
        })
    };
    let files = |place: Place, dir: &Path| -> Vec<Candidate> {
        names
            .iter()
            .map(|n| dir.join(n))
            .filter(|p| p.is_file())
            .map(|p| Candidate {
                name: p.display().to_string(),
                place,
            })
            .collect()
    };
    let dirs = place_dirs_in(env, root);
    let mut out: Vec<Candidate> = bare(Place::Loaded).collect();
    for (place, dir) in dirs.iter().filter(|(p, _)| *p == Place::LdLibraryPath) {
        out.extend(files(*place, dir));
    }
    out.extend(bare(Place::Loader));
    for (place, dir) in &dirs {
        if matches!(place, Place::Wheel | Place::CudaHome | Place::Toolkit) {
            out.extend(files(*place, dir));
        }
    }
    out
}

/// Opens the first of `candidates` that exists (a name already loaded, a
/// name the loader finds, or a file) and identifies it. That copy is
/// zero's choice: when it does not load, lacks a symbol of
/// [`Lib::symbols`] or is older than [`Lib::min_version`], the error names
/// it rather than trying the next (a broken or old copy ahead of a good
/// one is something to fix, not to work around silently).
pub fn open_first(lib: Lib, candidates: &[Candidate]) -> Result<Library, LibError> {
    for c in candidates {
        let unusable = |reason: String, path: Option<PathBuf>| LibError::Unusable {
            lib,
            what: Unusable {
                name: c.name.clone(),
                reason,
            },
            path,
        };
        let handle = match c.place {
            Place::Loaded => match open_loaded(&c.name) {
                Some(h) => h,
                None => continue,
            },
            Place::Loader | Place::Cudarc => match open(&c.name) {
                Ok(h) => h,
                Err(msg) if is_absent(&msg) => continue,
                Err(msg) => return Err(unusable(format!("it does not load: {msg}"), None)),
            },
            _ => {
                let path = PathBuf::from(&c.name);
                open_companions(lib, &path).map_err(|r| unusable(r, Some(path.clone())))?;
                open(&c.name).map_err(|msg| {
                    unusable(format!("it does not load: {msg}"), Some(path.clone()))
                })?
            }
        };
        let found = handle
            .identify(lib, &c.name, c.place)
            .map_err(|what| LibError::Unusable {
                lib,
                path: handle.path(),
                what,
            })?;
        if !found.version.at_least(&lib.min_version()) {
            return Err(LibError::TooOld(found));
        }
        return Ok(Library { found, handle });
    }
    let tried: HashSet<&str> = candidates.iter().map(|c| c.name.as_str()).collect();
    Err(LibError::Missing {
        lib,
        tried: lib.installed_names(),
        broken: Vec::new(),
        elsewhere: installed_copies(lib, &search_dirs())
            .into_iter()
            .filter(|p| !tried.contains(p.display().to_string().as_str()))
            .collect(),
    })
}

/// Opens, by path, the libraries that `lib` at `path` needs from its own
/// folder and that the loader would otherwise look for on its own path:
/// cuBLAS's `libcublasLt` of the same version, so that a cuBLAS found
/// outside the loader's path does not pick up another `libcublasLt` (or
/// none). The loader then reuses it for cuBLAS's dependency of that name.
fn open_companions(lib: Lib, path: &Path) -> Result<(), String> {
    if lib != Lib::Cublas {
        return Ok(());
    }
    let (Some(dir), Some(name)) = (path.parent(), file_name(path)) else {
        return Ok(());
    };
    let Some(suffix) = name.strip_prefix("libcublas") else {
        return Ok(());
    };
    let lt = dir.join(format!("libcublasLt{suffix}"));
    if !lt.is_file() {
        return Ok(());
    }
    open(&lt.display().to_string())
        .map(|_| ())
        .map_err(|msg| format!("its companion {} does not load: {msg}", lt.display()))
}

/// What cudarc's search finds: the first of its names that opens,
/// identified, or the names that exist but failed to open.
fn cudarc_search(lib: Lib) -> Result<Library, LibError> {
    let tried = lib.cudarc_names();
    let mut broken = Vec::new();
    for name in &tried {
        match open(name) {
            Ok(handle) => {
                let found = handle.identify(lib, name, Place::Cudarc).map_err(|what| {
                    LibError::Unusable {
                        lib,
                        path: handle.path(),
                        what,
                    }
                })?;
                if !found.version.at_least(&lib.min_version()) {
                    return Err(LibError::TooOld(found));
                }
                return Ok(Library { found, handle });
            }
            Err(msg) if is_absent(&msg) => {}
            Err(reason) => broken.push(Unusable {
                name: name.clone(),
                reason,
            }),
        }
    }
    // Files under cudarc's names in directories the loader searches were
    // tried above (and are in `broken` when they exist): not news.
    let searched = loader_dirs(&|k| std::env::var_os(k));
    let elsewhere = installed_copies(lib, &search_dirs())
        .into_iter()
        .filter(|p| {
            let tried_here = file_name(p).is_some_and(|n| tried.contains(&n))
                && p.parent()
                    .is_some_and(|d| searched.iter().any(|s| same_dir(s, d)));
            !tried_here
        })
        .collect();
    Err(LibError::Missing {
        lib,
        tried,
        broken,
        elsewhere,
    })
}

/// Opens `lib`, once per process: NVRTC, cuBLAS and NCCL from the first
/// of their [`candidates`] ([`open_first`]), the driver as cudarc does
/// (the first of its names that opens). The library is checked: it has the
/// symbols of [`Lib::symbols`] and is at least [`Lib::min_version`].
pub fn load(lib: Lib) -> Result<&'static Library, LibError> {
    static CACHE: [OnceLock<Result<Library, LibError>>; 4] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    let slot = match lib {
        Lib::Driver => &CACHE[0],
        Lib::Nvrtc => &CACHE[1],
        Lib::Cublas => &CACHE[2],
        Lib::Nccl => &CACHE[3],
    };
    slot.get_or_init(|| match lib {
        Lib::Driver => cudarc_search(lib),
        _ => open_first(lib, &candidates(lib)),
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// What [`load`] opens for `lib`: the file, its version and where it was
/// found, or why it cannot be used. Call before the first call into the
/// library (for the driver: before the first cudarc call).
pub fn require(lib: Lib) -> Result<Found, LibError> {
    load(lib).map(|l| l.found.clone())
}

/// A path's file name as a string.
fn file_name(p: &Path) -> Option<String> {
    p.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// Whether two paths name the same directory.
fn same_dir(a: &Path, b: &Path) -> bool {
    a == b
        || matches!(
            (std::fs::canonicalize(a), std::fs::canonicalize(b)),
            (Ok(x), Ok(y)) if x == y
        )
}

/// The directories `dlopen` searches for a bare name besides the `ld.so`
/// cache: `LD_LIBRARY_PATH`, then the defaults.
fn loader_dirs(env: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let arch = std::env::consts::ARCH;
    let mut dirs: Vec<PathBuf> = env("LD_LIBRARY_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(
        [
            format!("/lib/{arch}-linux-gnu"),
            format!("/usr/lib/{arch}-linux-gnu"),
            "/lib64".into(),
            "/usr/lib64".into(),
            "/lib".into(),
            "/usr/lib".into(),
        ]
        .map(PathBuf::from),
    );
    dirs
}

/// Directories where CUDA libraries are commonly installed, that exist on
/// this machine, in [`candidates`]' order: `LD_LIBRARY_PATH`, the `nvidia/*/lib`
/// and `torch/lib` folders of Python environments (the active virtualenv
/// or conda environment, the user's, pyenv's and the system's),
/// `$CUDA_HOME` (and `CUDA_PATH`, `CUDA_ROOT`), `/usr/local/cuda*`, then
/// the system library directories.
pub fn search_dirs() -> Vec<PathBuf> {
    search_dirs_in(&|k| std::env::var_os(k), Path::new("/"))
}

/// [`search_dirs`] with the environment from `env` and the file system
/// under `root`, for tests.
pub fn search_dirs_in(env: &dyn Fn(&str) -> Option<OsString>, root: &Path) -> Vec<PathBuf> {
    place_dirs_in(env, root)
        .into_iter()
        .map(|(_, d)| d)
        .collect()
}

/// [`search_dirs_in`] with the [`Place`] of each directory (the system
/// library directories, which the loader searches by itself, as
/// [`Place::Loader`]).
fn place_dirs_in(env: &dyn Fn(&str) -> Option<OsString>, root: &Path) -> Vec<(Place, PathBuf)> {
    let at = |p: &str| root.join(p.trim_start_matches('/'));
    let var = |k: &str| env(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let arch = std::env::consts::ARCH;
    let target_dirs = |base: &Path| -> Vec<PathBuf> {
        let mut v = vec![base.join("lib64"), base.join("lib")];
        v.push(base.join(format!("targets/{arch}-linux/lib")));
        if arch == "aarch64" {
            v.push(base.join("targets/sbsa-linux/lib"));
        }
        v
    };
    let mut dirs: Vec<(Place, PathBuf)> = Vec::new();
    if let Some(p) = env("LD_LIBRARY_PATH") {
        dirs.extend(
            std::env::split_paths(&p)
                .filter(|d| !d.as_os_str().is_empty())
                .map(|d| (Place::LdLibraryPath, d)),
        );
    }
    // Python environments: site-packages folders.
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for k in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = var(k) {
            prefixes.push(p);
        }
    }
    if let Some(home) = var("HOME") {
        prefixes.push(home.join(".local"));
        let pyenv = var("PYENV_ROOT").unwrap_or_else(|| home.join(".pyenv"));
        prefixes.extend(children(&pyenv.join("versions"), ""));
    }
    prefixes.extend([at("/opt/conda"), at("/usr/local"), at("/usr")]);
    let mut site_packages: Vec<PathBuf> = Vec::new();
    for prefix in &prefixes {
        for py in children(&prefix.join("lib"), "python3") {
            site_packages.push(py.join("site-packages"));
            site_packages.push(py.join("dist-packages"));
        }
    }
    site_packages.push(at("/usr/lib/python3/dist-packages"));
    for sp in &site_packages {
        dirs.extend(
            children(&sp.join("nvidia"), "")
                .into_iter()
                .map(|d| (Place::Wheel, d.join("lib"))),
        );
        dirs.push((Place::Wheel, sp.join("torch/lib")));
    }
    if let Some(conda) = var("CONDA_PREFIX") {
        dirs.push((Place::Wheel, conda.join("lib")));
    }
    for k in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(base) = var(k) {
            dirs.extend(target_dirs(&base).into_iter().map(|d| (Place::CudaHome, d)));
        }
    }
    // /usr/local/cuda first (the link to the default toolkit), then the
    // versioned toolkits, newest first.
    let mut toolkits = children(&at("/usr/local"), "cuda-");
    toolkits.reverse();
    for t in [at("/usr/local/cuda")].into_iter().chain(toolkits) {
        dirs.extend(target_dirs(&t).into_iter().map(|d| (Place::Toolkit, d)));
    }
    for d in [
        format!("/usr/lib/{arch}-linux-gnu"),
        format!("/lib/{arch}-linux-gnu"),
        "/usr/lib64".into(),
        "/usr/lib".into(),
        "/usr/lib/wsl/lib".into(),
    ] {
        dirs.push((Place::Loader, at(&d)));
    }
    let mut seen = HashSet::new();
    dirs.into_iter()
        .filter(|(_, d)| d.is_dir())
        .filter(|(_, d)| seen.insert(std::fs::canonicalize(d).unwrap_or_else(|_| d.clone())))
        .collect()
}

/// The subdirectories of `dir` whose names start with `prefix`, sorted by
/// name (none when `dir` cannot be read).
fn children(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

/// The files in `dirs` named like `lib` ([`Lib::candidate_names`]), one
/// path per distinct file, in directory then name order.
pub fn installed_copies(lib: Lib, dirs: &[PathBuf]) -> Vec<PathBuf> {
    let names = lib.candidate_names();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for d in dirs {
        for n in &names {
            let p = d.join(n);
            if p.exists() && seen.insert(std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone())) {
                out.push(p);
            }
        }
    }
    out
}

/// One file found by [`survey`]: what it is, or why it cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibCopy {
    /// The file.
    pub path: PathBuf,
    /// Its version, or why it did not load or identify.
    pub found: Result<Version, String>,
}

/// Everything known about one library on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survey {
    /// What this build loads ([`require`]'s answer).
    pub loads: Result<Found, LibError>,
    /// Every copy in [`search_dirs`], opened by path. Opening loads
    /// several versions into the process, which is fine for a report and
    /// why [`require`] does not do it.
    pub copies: Vec<LibCopy>,
}

/// Surveys `lib`: what this build loads, and every copy in the usual
/// places with its version.
pub fn survey(lib: Lib) -> Survey {
    let loads = require(lib);
    let copies = installed_copies(lib, &search_dirs())
        .into_iter()
        .map(|path| {
            let shown = path.display().to_string();
            let found = match open(&shown) {
                Ok(h) => h
                    .identify(lib, &shown, Place::Wheel)
                    .map(|f| f.version)
                    .map_err(|u| u.reason),
                Err(msg) => Err(msg),
            };
            LibCopy { path, found }
        })
        .collect();
    Survey { loads, copies }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn names_cover_cuda_12_and_13() {
        let nvrtc = Lib::Nvrtc.candidate_names();
        for n in ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"] {
            assert!(nvrtc.contains(&n.to_string()), "{n}: {nvrtc:?}");
        }
        let cublas = Lib::Cublas.candidate_names();
        for n in ["libcublas.so.12", "libcublas.so.13", "libcublas.so"] {
            assert!(cublas.contains(&n.to_string()), "{n}: {cublas:?}");
        }
        assert!(Lib::Nccl.candidate_names().contains(&"libnccl.so.2".into()));
        assert!(Lib::Driver
            .candidate_names()
            .contains(&"libcuda.so.1".into()));
        // The installed names come first, the newest CUDA first.
        assert_eq!(Lib::Nvrtc.candidate_names()[0], "libnvrtc.so.13");
        for lib in Lib::ALL {
            let names = lib.candidate_names();
            let distinct: HashSet<&String> = names.iter().collect();
            assert_eq!(distinct.len(), names.len(), "{lib}: {names:?}");
        }
    }

    #[test]
    fn cudarc_names_are_cudarcs_in_its_order() {
        let names = Lib::Nvrtc.cudarc_names();
        assert_eq!(names[0], "libnvrtc.so");
        assert!(names.contains(&"libnvrtc.so.12".into()), "{names:?}");
        // This build's cudarc (cuda-12080) does not open CUDA 13's or
        // NCCL's own soname: why zero opens those libraries itself.
        assert!(!names.contains(&"libnvrtc.so.13".into()), "{names:?}");
        assert!(!Lib::Nccl.cudarc_names().contains(&"libnccl.so.2".into()));
        let driver = Lib::Driver.cudarc_names();
        assert!(driver.contains(&"libcuda.so.1".into()));
        assert!(driver.contains(&"libnvcuda.so".into()));
        assert_eq!(Lib::Cublas.link_name(), "libcublas.so");
    }

    #[test]
    fn versions() {
        assert_eq!(Version::from_cuda_code(12080).to_string(), "12.8");
        assert_eq!(Version::from_cuda_code(13000).to_string(), "13.0");
        assert_eq!(Version::from_nccl_code(22805).to_string(), "2.28.5");
        assert_eq!(Version::from_nccl_code(21400).to_string(), "2.14.0");
        assert_eq!(Version::from_nccl_code(2804).to_string(), "2.8.4");
        assert!(Version::from_nccl_code(22805).at_least(&Lib::Nccl.min_version()));
        assert!(!Version::from_nccl_code(21305).at_least(&Lib::Nccl.min_version()));
        assert!(Version::new(13, 0).at_least(&Lib::Nvrtc.min_version()));
        assert!(!Version::new(11, 8).at_least(&Lib::Nvrtc.min_version()));
    }

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"").unwrap();
    }

    #[test]
    fn search_dirs_cover_the_usual_places() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let ld = r.join("ld");
        let home = r.join("home");
        let venv = r.join("venv");
        let files = [
            ld.join("libnvrtc.so.12"),
            r.join("usr/local/cuda-12.8/lib64/libnvrtc.so.12"),
            r.join("usr/local/cuda-13.0/targets").join(format!(
                "{}-linux/lib/libnvrtc.so.13",
                std::env::consts::ARCH
            )),
            venv.join("lib/python3.12/site-packages/nvidia/cu13/lib/libcublas.so.13"),
            venv.join("lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"),
            home.join(".local/lib/python3.11/site-packages/nvidia/cublas/lib/libcublas.so.12"),
        ];
        for f in &files {
            touch(f);
        }
        let env = |k: &str| -> Option<OsString> {
            match k {
                "LD_LIBRARY_PATH" => Some(format!("{}::/nonexistent", ld.display()).into()),
                "HOME" => Some(home.clone().into()),
                "VIRTUAL_ENV" => Some(venv.clone().into()),
                _ => None,
            }
        };
        let dirs = search_dirs_in(&env, r);
        let pos = |f: &Path| {
            dirs.iter()
                .position(|d| d == f.parent().unwrap())
                .unwrap_or_else(|| panic!("{} not in {dirs:?}", f.display()))
        };
        let order: Vec<usize> = files.iter().map(|f| pos(f)).collect();
        // LD_LIBRARY_PATH first, the virtualenv before the user's
        // site-packages, the wheels before the toolkits, the newest toolkit
        // before the older one.
        assert_eq!(order[0], 0);
        assert!(order[2] < order[1], "{dirs:?}");
        assert!(order[3] < order[5] && order[4] < order[5], "{dirs:?}");
        assert!(order[5] < order[2], "{dirs:?}");
        assert!(dirs.iter().all(|d| d.is_dir()));

        let nvrtc = installed_copies(Lib::Nvrtc, &dirs);
        assert_eq!(
            nvrtc,
            vec![files[0].clone(), files[2].clone(), files[1].clone()]
        );
        let cublas = installed_copies(Lib::Cublas, &dirs);
        assert_eq!(cublas, vec![files[3].clone(), files[5].clone()]);
        assert_eq!(installed_copies(Lib::Nccl, &dirs), vec![files[4].clone()]);
    }

    #[test]
    fn errors_name_the_library_the_version_needed_and_the_file() {
        let missing = LibError::Missing {
            lib: Lib::Nvrtc,
            tried: Lib::Nvrtc.installed_names(),
            broken: vec![],
            elsewhere: vec![
                "/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.11.2".into(),
                "/usr/lib/wsl/lib/libnvrtc.so.12".into(),
            ],
        };
        let msg = missing.to_string();
        assert!(
            msg.starts_with(
                "NVRTC (12.0 or later) was not found: zero looks for libnvrtc.so.13, \
                 libnvrtc.so.12, libnvrtc.so already loaded, on LD_LIBRARY_PATH, through the \
                 system loader, in PyTorch's site-packages/nvidia/*/lib wheel folders, in \
                 $CUDA_HOME and /usr/local/cuda*"
            ),
            "{msg}"
        );
        assert!(
            msg.contains("found /x/nvidia/cuda_nvrtc/lib/libnvrtc.so.11.2, under a name zero"),
            "{msg}"
        );
        assert!(
            msg.contains(
                "found /usr/lib/wsl/lib/libnvrtc.so.12, in a directory zero does not search: \
                 add /usr/lib/wsl/lib to LD_LIBRARY_PATH"
            ),
            "{msg}"
        );
        assert!(
            msg.ends_with(
                "`pip install nvidia-cuda-nvrtc` (CUDA 13) or `pip install \
             nvidia-cuda-nvrtc-cu12` (CUDA 12), or install the CUDA toolkit"
            ),
            "{msg}"
        );
        assert!(!msg.contains("ln -s"), "{msg}");

        let driver = LibError::Missing {
            lib: Lib::Driver,
            tried: Lib::Driver.cudarc_names(),
            broken: vec![Unusable {
                name: "libcuda.so.1".into(),
                reason: "file too short".into(),
            }],
            elsewhere: vec!["/usr/lib/wsl/lib/libcuda.so.1".into()],
        }
        .to_string();
        assert!(
            driver.starts_with("CUDA driver (12.0 or later) could not be loaded"),
            "{driver}"
        );
        assert!(
            driver.contains("libcuda.so.1 exists but does not load: file too short"),
            "{driver}"
        );
        assert!(
            driver.contains(
                "found /usr/lib/wsl/lib/libcuda.so.1, in a directory the loader does not \
                 search: add /usr/lib/wsl/lib to LD_LIBRARY_PATH"
            ),
            "{driver}"
        );
        assert_eq!(
            summarize(&Lib::Nvrtc.cudarc_names()),
            "libnvrtc.so, libnvrtc.so.12, libnvrtc.so.11, libnvrtc.so.10, libnvrtc.so.9, \
             libnvrtc.so.1 (and 9 `lib*64*.so` variants)"
        );

        let unusable = LibError::Unusable {
            lib: Lib::Cublas,
            what: Unusable {
                name: "/w/nvidia/cu13/lib/libcublas.so.13".into(),
                reason: "it lacks cublasGemmEx".into(),
            },
            path: Some("/w/nvidia/cu13/lib/libcublas.so.13".into()),
        }
        .to_string();
        assert_eq!(
            unusable,
            format!(
                "cuBLAS (12.0 or later) is unusable: /w/nvidia/cu13/lib/libcublas.so.13 is the \
                 first copy zero finds, and it lacks cublasGemmEx; remove it or put a working \
                 cuBLAS before it ({SEARCHED}, in this order)"
            )
        );

        let old = LibError::TooOld(Found {
            lib: Lib::Nccl,
            opened_as: "libnccl.so".into(),
            place: Place::Loader,
            path: Some("/usr/lib/libnccl.so.2".into()),
            version: Version::from_nccl_code(21305),
        });
        assert_eq!(
            old.to_string(),
            "NCCL 2.13.5 at /usr/lib/libnccl.so.2 is too old: zero needs NCCL 2.14.0 or later"
        );
        let err: crate::Error = old.into();
        assert!(err.to_string().contains("NCCL 2.14.0 or later"), "{err}");
    }

    /// A folder laid out like PyTorch's CUDA 13 wheels in a virtualenv
    /// under `root`: `site-packages/nvidia/{cu13,nccl}/lib`.
    fn cu13_wheels(root: &Path) -> (PathBuf, PathBuf, PathBuf) {
        let sp = root.join("venv/lib/python3.12/site-packages/nvidia");
        let (cu13, nccl) = (sp.join("cu13/lib"), sp.join("nccl/lib"));
        std::fs::create_dir_all(&cu13).unwrap();
        std::fs::create_dir_all(&nccl).unwrap();
        (root.join("venv"), cu13, nccl)
    }

    /// The candidates that are files (what a test's layout decides; the
    /// process's loaded libraries and the loader's cache are this
    /// machine's).
    fn files_only(c: Vec<Candidate>) -> Vec<Candidate> {
        c.into_iter()
            .filter(|c| !matches!(c.place, Place::Loaded | Place::Loader))
            .collect()
    }

    #[test]
    fn candidates_follow_the_search_order_on_a_cu13_wheel_layout() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let (venv, cu13, nccl) = cu13_wheels(r);
        let ld = r.join("ld");
        let home = r.join("cuda-home");
        let toolkit = r.join("usr/local/cuda-13.0/lib64");
        for f in [
            cu13.join("libnvrtc.so.13"),
            cu13.join("libcublas.so.13"),
            cu13.join("libcublasLt.so.13"),
            nccl.join("libnccl.so.2"),
            ld.join("libnvrtc.so.12"),
            ld.join("libnvrtc.so"),
            home.join("lib64/libnvrtc.so.13"),
            toolkit.join("libnvrtc.so.13"),
            toolkit.join("libnvrtc.so.11.2"),
        ] {
            touch(&f);
        }
        let env = |k: &str| -> Option<OsString> {
            match k {
                "LD_LIBRARY_PATH" => Some(ld.clone().into()),
                "VIRTUAL_ENV" => Some(venv.clone().into()),
                "CUDA_HOME" => Some(home.clone().into()),
                _ => None,
            }
        };
        let nvrtc = candidates_in(Lib::Nvrtc, &env, r);
        let (bare, rest) = nvrtc.split_at(3);
        assert!(bare.iter().all(|c| c.place == Place::Loaded), "{nvrtc:?}");
        assert_eq!(bare[0].name, "libnvrtc.so.13");
        let shown: Vec<(Place, String)> = rest
            .iter()
            .map(|c| (c.place, c.name.replace(&r.display().to_string(), "")))
            .collect();
        let p = |place, name: &str| (place, name.to_string());
        assert_eq!(
            shown,
            vec![
                // Within a directory the newest name first; the
                // unversioned link last.
                p(Place::LdLibraryPath, "/ld/libnvrtc.so.12"),
                p(Place::LdLibraryPath, "/ld/libnvrtc.so"),
                p(Place::Loader, "libnvrtc.so.13"),
                p(Place::Loader, "libnvrtc.so.12"),
                p(Place::Loader, "libnvrtc.so"),
                p(
                    Place::Wheel,
                    "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libnvrtc.so.13"
                ),
                p(Place::CudaHome, "/cuda-home/lib64/libnvrtc.so.13"),
                p(Place::Toolkit, "/usr/local/cuda-13.0/lib64/libnvrtc.so.13"),
            ]
        );
        let first = |lib| files_only(candidates_in(lib, &env, r)).remove(0);
        assert_eq!(
            first(Lib::Cublas),
            Candidate {
                name: cu13.join("libcublas.so.13").display().to_string(),
                place: Place::Wheel
            }
        );
        assert_eq!(
            first(Lib::Nccl),
            Candidate {
                name: nccl.join("libnccl.so.2").display().to_string(),
                place: Place::Wheel
            }
        );
    }

    #[test]
    fn the_first_copy_found_is_used_or_named_in_the_error() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let (venv, cu13, nccl) = cu13_wheels(r);
        // cuBLAS: garbage; its companion libcublasLt first (also garbage).
        std::fs::write(cu13.join("libcublas.so.13"), b"not an ELF file").unwrap();
        std::fs::write(cu13.join("libcublasLt.so.13"), b"not an ELF file").unwrap();
        // NCCL: a real library of the wrong kind.
        std::fs::copy(some_shared_library(), nccl.join("libnccl.so.2")).unwrap();
        let env =
            |k: &str| -> Option<OsString> { (k == "VIRTUAL_ENV").then(|| venv.clone().into()) };
        let open = |lib| open_first(lib, &files_only(candidates_in(lib, &env, r)));

        let cublas = open(Lib::Cublas).unwrap_err().to_string();
        let lt = cu13.join("libcublasLt.so.13").display().to_string();
        assert!(
            cublas.starts_with(&format!(
                "cuBLAS (12.0 or later) is unusable: {}/libcublas.so.13 is the first copy \
                 zero finds, and its companion {lt} does not load: ",
                cu13.display()
            )),
            "{cublas}"
        );
        std::fs::remove_file(cu13.join("libcublasLt.so.13")).unwrap();
        let cublas = open(Lib::Cublas).unwrap_err().to_string();
        assert!(
            cublas.contains("libcublas.so.13 is the first copy"),
            "{cublas}"
        );
        assert!(cublas.contains("it does not load: "), "{cublas}");

        let nccl_err = open(Lib::Nccl).unwrap_err();
        let msg = nccl_err.to_string();
        assert!(matches!(nccl_err, LibError::Unusable { .. }), "{msg}");
        assert!(
            msg.contains("libnccl.so.2 is the first copy zero finds"),
            "{msg}"
        );
        assert!(msg.contains("lacks ncclGetVersion"), "{msg}");

        // Nothing in the layout: Missing, with the names looked for.
        let none = open_first(Lib::Nvrtc, &files_only(candidates_in(Lib::Nvrtc, &env, r)));
        match none.unwrap_err() {
            LibError::Missing { lib, tried, .. } => {
                assert_eq!(lib, Lib::Nvrtc);
                assert_eq!(tried, Lib::Nvrtc.installed_names());
            }
            e => panic!("{e}"),
        }
    }

    /// A real shared library of this machine that is not a CUDA library.
    fn some_shared_library() -> PathBuf {
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
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("no libz.so.1 or libm.so.6 in the usual directories")
    }

    /// The first NVRTC file this machine's search finds (without loading
    /// it), or `None` (a skip, or a failure with `ZERO_REQUIRE_NVRTC=1`).
    fn nvrtc_file(test: &str) -> Option<PathBuf> {
        let file = candidates(Lib::Nvrtc)
            .into_iter()
            .find(|c| !matches!(c.place, Place::Loaded | Place::Loader))
            .map(|c| PathBuf::from(c.name));
        if file.is_none() {
            assert!(
                std::env::var_os("ZERO_REQUIRE_NVRTC").is_none(),
                "{test}: ZERO_REQUIRE_NVRTC is set but no libnvrtc.so.13/.12 file was found"
            );
            eprintln!("{test}: skipped: no libnvrtc.so.13/.12 file found");
        }
        file
    }

    #[test]
    fn a_real_nvrtc_in_a_wheel_layout_is_opened_from_there() {
        let test = "a_real_nvrtc_in_a_wheel_layout_is_opened_from_there";
        let Some(real) = nvrtc_file(test) else {
            return;
        };
        let root = tempfile::tempdir().unwrap();
        let (venv, cu13, _) = cu13_wheels(root.path());
        // The wheel's file names, copied (not linked: the loader would
        // reuse an already loaded file of the same inode), with NVRTC's
        // builtins beside it as in the wheel.
        let name = file_name(&real).unwrap();
        // CUDA 12's wheel (nvidia-cuda-nvrtc-cu12) has its own folder.
        let wheel = if name.ends_with(".so.12") {
            venv.join("lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib")
        } else {
            cu13
        };
        std::fs::create_dir_all(&wheel).unwrap();
        std::fs::copy(&real, wheel.join(&name)).unwrap();
        for e in std::fs::read_dir(real.parent().unwrap()).unwrap() {
            let e = e.unwrap();
            if e.file_name()
                .to_string_lossy()
                .starts_with("libnvrtc-builtins.so")
            {
                std::fs::copy(e.path(), wheel.join(e.file_name())).unwrap();
            }
        }
        let env =
            |k: &str| -> Option<OsString> { (k == "VIRTUAL_ENV").then(|| venv.clone().into()) };
        let cands = files_only(candidates_in(Lib::Nvrtc, &env, root.path()));
        let lib = open_first(Lib::Nvrtc, &cands).unwrap_or_else(|e| panic!("{e}"));
        let found = lib.found();
        assert_eq!(found.place, Place::Wheel);
        assert_eq!(found.path.as_deref(), Some(wheel.join(&name).as_path()));
        assert!(found.version.major >= 12, "{found}");
        assert!(
            name.ends_with(&format!(".so.{}", found.version.major)),
            "{found}"
        );
        lib.check_symbols(&["nvrtcCompileProgram", "nvrtcGetCUBIN"])
            .unwrap();
        let lacks = lib.check_symbols(&["nvrtcNoSuchFunction"]).unwrap_err();
        assert!(
            lacks.to_string().contains("lacks nvrtcNoSuchFunction"),
            "{lacks}"
        );
        eprintln!("{test}: opened {found} ({})", found.place);
    }

    #[test]
    fn a_garbage_file_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("libcublas.so.13");
        std::fs::write(&p, b"not an ELF file").unwrap();
        let msg = match open(&p.display().to_string()) {
            Ok(_) => panic!("garbage opened"),
            Err(m) => m,
        };
        assert!(!is_absent(&msg), "{msg}");
        assert!(is_absent(
            &open("libzero-no-such-library.so.7").err().unwrap()
        ));
        let copies = installed_copies(Lib::Cublas, &[dir.path().to_path_buf()]);
        assert_eq!(copies, vec![p]);
    }
}
