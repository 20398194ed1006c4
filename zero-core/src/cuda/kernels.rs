//! The CUDA C++ sources of the library, their compilation with NVRTC, and
//! the fused GPU AdamW and gradient norm built on them.
//!
//! # Sources
//!
//! Every `.cu` file of `zero-core/kernels/` is listed in [`SOURCES`] with its
//! entry points; headers they include (`#include "name"`) are listed in
//! [`HEADERS`] and handed to NVRTC by name, so no file is read at run time
//! and no CUDA toolkit headers are needed (the NVRTC wheel on PyPI has
//! none). A new source is one more [`KernelSource`] entry.
//!
//! The per-element math lives in `zero_math.cuh`, written so that it also
//! compiles as plain host C++: `zero-core/tests/kernels_on_host.rs` builds it
//! with the host compiler and checks it bit for bit against
//! [`adamw_reference`](crate::optim::adamw_reference), `half`'s conversions
//! and [`sum_squares`](crate::optim::sum_squares), on machines without a GPU.
//! `zero-core/tests/nvrtc.rs` compiles every source with NVRTC.
//!
//! # Compilation
//!
//! [`compile`] (with the `cuda` feature) runs NVRTC with the library's fixed
//! [`COMPILE_OPTIONS`] plus the target architecture and returns the PTX and
//! the full NVRTC log, also on success. The options pin everything that
//! could change a result: no FMA contraction, IEEE division and square root,
//! no flush of denormals (the kernels use explicit `_rn` intrinsics as
//! well, so the math does not depend on them).
//!
//! # GPU AdamW
//!
//! `GpuAdamW` (with the `cuda` feature) loads the compiled kernels into a
//! device and launches the fused step and the sum of squares on a stream,
//! bit-identical to the CPU reference (NaN payloads aside: a GPU produces
//! the canonical NaN).

use crate::DType;

/// A header that sources include by name (`#include "zero_math.cuh"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelHeader {
    /// The include name.
    pub name: &'static str,
    /// The header text.
    pub source: &'static str,
}

/// One CUDA C++ source of the library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// The file name under `zero-core/kernels/`, used in messages.
    pub name: &'static str,
    /// The source text.
    pub source: &'static str,
    /// Headers of this source's own that it includes by name, passed to
    /// NVRTC with the library's [`HEADERS`] (which every source may
    /// include); empty for the library's sources.
    pub headers: &'static [KernelHeader],
    /// The `extern "C"` kernels the source defines.
    pub entry_points: &'static [&'static str],
}

/// Every header the sources may include; all are passed to every NVRTC
/// compilation.
pub const HEADERS: &[KernelHeader] = &[
    KernelHeader {
        name: "zero_math.cuh",
        source: include_str!("../../kernels/zero_math.cuh"),
    },
    KernelHeader {
        name: "zero_convert.cuh",
        source: include_str!("../../kernels/zero_convert.cuh"),
    },
];

/// The fused AdamW kernels, `adamw_g{grad}_m{moments}_p{copy}`, in the
/// order of [`adamw_entry_point`]'s index: grad f32, bf16, f16; moments f32,
/// bf16; copy none, f32, bf16, f16.
pub const ADAMW_ENTRY_POINTS: &[&str] = &[
    "adamw_gf32_mf32_pnone",
    "adamw_gf32_mf32_pf32",
    "adamw_gf32_mf32_pbf16",
    "adamw_gf32_mf32_pf16",
    "adamw_gf32_mbf16_pnone",
    "adamw_gf32_mbf16_pf32",
    "adamw_gf32_mbf16_pbf16",
    "adamw_gf32_mbf16_pf16",
    "adamw_gbf16_mf32_pnone",
    "adamw_gbf16_mf32_pf32",
    "adamw_gbf16_mf32_pbf16",
    "adamw_gbf16_mf32_pf16",
    "adamw_gbf16_mbf16_pnone",
    "adamw_gbf16_mbf16_pf32",
    "adamw_gbf16_mbf16_pbf16",
    "adamw_gbf16_mbf16_pf16",
    "adamw_gf16_mf32_pnone",
    "adamw_gf16_mf32_pf32",
    "adamw_gf16_mf32_pbf16",
    "adamw_gf16_mf32_pf16",
    "adamw_gf16_mbf16_pnone",
    "adamw_gf16_mbf16_pf32",
    "adamw_gf16_mbf16_pbf16",
    "adamw_gf16_mbf16_pf16",
];

/// The sum-of-squares kernels: per-chunk sums for f32, bf16 and f16 input,
/// then the in-order sum of the chunk sums.
pub const NORM_ENTRY_POINTS: &[&str] = &[
    "sumsq_chunks_f32",
    "sumsq_chunks_bf16",
    "sumsq_chunks_f16",
    "sumsq_finish",
];

/// The conversion kernels, `convert_{src}_{dst}`, in the order of
/// [`convert_entry_point`]'s index: source f32, bf16, f16, each to f32,
/// bf16, f16.
pub const CONVERT_ENTRY_POINTS: &[&str] = &[
    "convert_f32_f32",
    "convert_f32_bf16",
    "convert_f32_f16",
    "convert_bf16_f32",
    "convert_bf16_bf16",
    "convert_bf16_f16",
    "convert_f16_f32",
    "convert_f16_bf16",
    "convert_f16_f16",
];

/// Every CUDA source of the library.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "adamw.cu",
        source: include_str!("../../kernels/adamw.cu"),
        headers: &[],
        entry_points: ADAMW_ENTRY_POINTS,
    },
    KernelSource {
        name: "norm.cu",
        source: include_str!("../../kernels/norm.cu"),
        headers: &[],
        entry_points: NORM_ENTRY_POINTS,
    },
    KernelSource {
        name: "convert.cu",
        source: include_str!("../../kernels/convert.cu"),
        headers: &[],
        entry_points: CONVERT_ENTRY_POINTS,
    },
];

/// NVRTC options of every compilation, before `--gpu-architecture=<arch>`.
///
/// `--fmad=false` stops the compiler from contracting `a * b + c` into an
/// FMA; the others ask for IEEE division and square root and keep
/// denormals. The kernels' math is written with `_rn` intrinsics, so these
/// are a second guard, not the only one.
pub const COMPILE_OPTIONS: &[&str] = &[
    "--std=c++17",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

/// Threads per block of the AdamW kernels (`ZERO_ADAMW_BLOCK`).
pub const ADAMW_BLOCK: u32 = 256;

/// Threads per block of the sum-of-squares kernels (`ZERO_NORM_BLOCK`):
/// one block per chunk of [`NORM_CHUNK`](crate::optim::NORM_CHUNK) at a
/// time.
pub const NORM_BLOCK: u32 = 256;

/// Threads per block of the conversion kernels (`ZERO_CONVERT_BLOCK`).
pub const CONVERT_BLOCK: u32 = 256;

/// Element ranges one conversion launch takes (`ZERO_PIECES_MAX`): the
/// ranges are a kernel parameter, which stays under 4 KiB.
pub const PIECES_MAX: usize = 96;

/// The source named `name` (e.g. `"adamw.cu"`).
pub fn source(name: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.name == name)
}

/// The AdamW kernel for gradients `grad`, moments `moments` and an optional
/// low-precision copy `copy`, as `(index into ADAMW_ENTRY_POINTS, name)`.
///
/// `None` for f16 moments: the kernels keep moments in f32 or bf16.
pub fn adamw_entry_point(
    grad: DType,
    moments: DType,
    copy: Option<DType>,
) -> Option<(usize, &'static str)> {
    let g = match grad {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    };
    let m = match moments {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => return None,
    };
    let p = match copy {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::BF16) => 2,
        Some(DType::F16) => 3,
    };
    let index = g * 8 + m * 4 + p;
    Some((index, ADAMW_ENTRY_POINTS[index]))
}

/// The conversion kernel from `src` to `dst` elements, as `(index into
/// CONVERT_ENTRY_POINTS, name)`.
pub fn convert_entry_point(src: DType, dst: DType) -> (usize, &'static str) {
    let index = |d: DType| match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    };
    let i = index(src) * 3 + index(dst);
    (i, CONVERT_ENTRY_POINTS[i])
}

/// The sum-of-squares kernel for elements of `dtype`.
pub fn sumsq_entry_point(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => NORM_ENTRY_POINTS[0],
        DType::BF16 => NORM_ENTRY_POINTS[1],
        DType::F16 => NORM_ENTRY_POINTS[2],
    }
}

/// Install hint for a missing NVRTC library.
const NVRTC_HINT: &str = "install it with `pip install nvidia-cuda-nvrtc` (CUDA 13) or \
     `pip install nvidia-cuda-nvrtc-cu12` (CUDA 12), or install the CUDA toolkit";

/// Why a kernel source could not be compiled; carried by
/// [`Error::Cuda`](crate::Error::Cuda).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelError {
    /// The NVRTC library (`libnvrtc.so.13`/`.12`) cannot be loaded.
    NvrtcNotFound,
    /// NVRTC failed on a source.
    Compile {
        /// The source's name (e.g. `"adamw.cu"`).
        source_name: &'static str,
        /// The target architecture asked for.
        arch: String,
        /// The NVRTC status of the call that failed.
        status: String,
        /// NVRTC's full log.
        log: String,
    },
    /// The arguments cannot be given to NVRTC (an architecture that is not
    /// of the form `sm_90`/`compute_90`, a NUL byte in a source).
    InvalidInput {
        /// The source's name.
        source_name: &'static str,
        /// What is wrong.
        msg: String,
    },
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelError::NvrtcNotFound => {
                write!(
                    f,
                    "the NVRTC library (libnvrtc.so.13 or .12) was not found: {NVRTC_HINT}"
                )
            }
            KernelError::Compile {
                source_name,
                arch,
                status,
                log,
            } => write!(
                f,
                "NVRTC failed on kernel source `{source_name}` for {arch} ({status}); log:\n{log}"
            ),
            KernelError::InvalidInput { source_name, msg } => {
                write!(f, "cannot compile kernel source `{source_name}`: {msg}")
            }
        }
    }
}

impl std::error::Error for KernelError {}

/// A source compiled by NVRTC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledSource {
    /// The source's name.
    pub name: &'static str,
    /// The architecture it was compiled for (`sm_90`, `compute_90`).
    pub arch: String,
    /// The PTX text.
    pub ptx: String,
    /// The device code (CUBIN) when `arch` names a real GPU (`sm_90`);
    /// `None` for a virtual one (`compute_90`), whose PTX the driver
    /// compiles when it loads it.
    pub cubin: Option<Vec<u8>>,
    /// NVRTC's log (empty for a clean compilation; warnings show up here).
    pub log: String,
}

/// Checks an architecture name: `sm_XY` or `compute_XY`, with an optional
/// letter suffix (`sm_90a`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn check_arch(source_name: &'static str, arch: &str) -> Result<(), KernelError> {
    let digits = arch
        .strip_prefix("sm_")
        .or_else(|| arch.strip_prefix("compute_"));
    let ok = digits.is_some_and(|d| {
        let num = d.trim_end_matches(|c: char| c.is_ascii_lowercase());
        !num.is_empty() && num.len() <= 4 && num.bytes().all(|b| b.is_ascii_digit())
    });
    if ok {
        Ok(())
    } else {
        Err(KernelError::InvalidInput {
            source_name,
            msg: format!("architecture `{arch}` is not of the form sm_90 or compute_90"),
        })
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::{CompiledSource, KernelSource};
    use crate::{Error, Result};

    /// Whether NVRTC can be loaded: never in a build without `cuda`.
    pub fn nvrtc_available() -> bool {
        false
    }

    /// The NVRTC zero uses: none in a build without `cuda`.
    pub fn nvrtc_library() -> Option<(crate::cuda::version::Version, String)> {
        None
    }

    /// [`Error::NotCompiledWith`]`("cuda")` in this build.
    pub fn compile(_source: &KernelSource, _arch: &str) -> Result<CompiledSource> {
        Err(Error::NotCompiledWith("cuda"))
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::collections::HashMap;
    use std::ffi::{c_char, c_int, CString};
    use std::sync::{Arc, Mutex, OnceLock};

    use cudarc::driver::{
        sys::CUdevice_attribute, CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr,
        DevicePtrMut, DeviceRepr, DriverError, LaunchConfig, PushKernelArg,
    };
    use cudarc::nvrtc::{result::NvrtcError, sys as nvrtc_sys, Ptx};

    use super::{
        adamw_entry_point, check_arch, source, sumsq_entry_point, CompiledSource, KernelError,
        KernelSource, ADAMW_BLOCK, ADAMW_ENTRY_POINTS, COMPILE_OPTIONS, HEADERS, NORM_BLOCK,
    };
    use crate::optim::{check_adamw_lengths, AdamWStep, NORM_CHUNK};
    use crate::{CudaDevice, DType, Element, Error, Result};

    /// Whether the NVRTC library can be loaded and used: found by
    /// [`libs::load`](crate::cuda::libs::load) (`libnvrtc.so.13` or `.12`,
    /// wherever it is installed) with every function zero calls.
    pub fn nvrtc_available() -> bool {
        nvrtc().is_ok()
    }

    /// The NVRTC zero uses, when it can: its version, and the file and
    /// where it was found (`NVRTC 13.0 at /x/libnvrtc.so.13 (from
    /// LD_LIBRARY_PATH)`).
    pub fn nvrtc_library() -> Option<(crate::cuda::version::Version, String)> {
        nvrtc().ok()?;
        let found = crate::cuda::libs::require(crate::cuda::libs::Lib::Nvrtc).ok()?;
        Some((found.version, format!("{found} ({})", found.place)))
    }

    type Status = nvrtc_sys::nvrtcResult;
    type Prog = nvrtc_sys::nvrtcProgram;

    /// The NVRTC functions zero calls, from the library `libs` opened (not
    /// through cudarc's loader, which opens only CUDA 12's names).
    struct Nvrtc {
        create_program: unsafe extern "C" fn(
            *mut Prog,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> Status,
        compile_program: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Status,
        destroy_program: unsafe extern "C" fn(*mut Prog) -> Status,
        get_ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
        get_ptx: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
        get_cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
        get_cubin: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
        get_program_log_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
        get_program_log: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
        get_num_supported_archs: unsafe extern "C" fn(*mut c_int) -> Status,
        get_supported_archs: unsafe extern "C" fn(*mut c_int) -> Status,
    }

    /// Every function of [`Nvrtc`], checked together so that the error
    /// names all that are missing.
    const NVRTC_SYMBOLS: [&str; 11] = [
        "nvrtcCreateProgram",
        "nvrtcCompileProgram",
        "nvrtcDestroyProgram",
        "nvrtcGetPTXSize",
        "nvrtcGetPTX",
        "nvrtcGetCUBINSize",
        "nvrtcGetCUBIN",
        "nvrtcGetProgramLogSize",
        "nvrtcGetProgramLog",
        "nvrtcGetNumSupportedArchs",
        "nvrtcGetSupportedArchs",
    ];

    /// The NVRTC table, filled once per process.
    fn nvrtc() -> Result<&'static Nvrtc> {
        use crate::cuda::libs::{load, Lib, LibError};
        static API: OnceLock<std::result::Result<Nvrtc, LibError>> = OnceLock::new();
        API.get_or_init(|| {
            let lib = load(Lib::Nvrtc)?;
            lib.check_symbols(&NVRTC_SYMBOLS)?;
            // SAFETY: each field's type is the C declaration of its
            // function in nvrtc.h (CUDA 12 and 13 declare them alike).
            unsafe {
                Ok(Nvrtc {
                    create_program: lib.get("nvrtcCreateProgram")?,
                    compile_program: lib.get("nvrtcCompileProgram")?,
                    destroy_program: lib.get("nvrtcDestroyProgram")?,
                    get_ptx_size: lib.get("nvrtcGetPTXSize")?,
                    get_ptx: lib.get("nvrtcGetPTX")?,
                    get_cubin_size: lib.get("nvrtcGetCUBINSize")?,
                    get_cubin: lib.get("nvrtcGetCUBIN")?,
                    get_program_log_size: lib.get("nvrtcGetProgramLogSize")?,
                    get_program_log: lib.get("nvrtcGetProgramLog")?,
                    get_num_supported_archs: lib.get("nvrtcGetNumSupportedArchs")?,
                    get_supported_archs: lib.get("nvrtcGetSupportedArchs")?,
                })
            }
        })
        .as_ref()
        .map_err(|e| e.clone().into())
    }

    /// A buffer NVRTC fills after reporting its size (log, PTX, CUBIN).
    ///
    /// # Safety
    /// `prog` is a live program for which both calls are valid now.
    unsafe fn fetch(
        prog: Prog,
        size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
        get: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    ) -> std::result::Result<Vec<c_char>, NvrtcError> {
        let mut n = 0usize;
        // SAFETY: `prog` is live (caller); `n` is a valid out pointer.
        unsafe { size(prog, &mut n) }.result()?;
        let mut buf = vec![0 as c_char; n];
        // SAFETY: `buf` has the `n` bytes NVRTC writes.
        unsafe { get(prog, buf.as_mut_ptr()) }.result()?;
        Ok(buf)
    }

    fn kernel_err(e: KernelError) -> Error {
        Error::Cuda(Box::new(e))
    }

    fn driver_err(e: DriverError) -> Error {
        Error::Cuda(Box::new(e))
    }

    /// C strings of bytes from the sources, or an error naming the source.
    fn c_string(source_name: &'static str, what: &str, text: &str) -> Result<CString> {
        CString::new(text).map_err(|_| {
            kernel_err(KernelError::InvalidInput {
                source_name,
                msg: format!("{what} contains a NUL byte"),
            })
        })
    }

    /// NVRTC's text output (log or PTX) without its terminating NUL.
    fn nvrtc_text(bytes: Vec<c_char>) -> String {
        let bytes: Vec<u8> = bytes
            .into_iter()
            .map(|b| b as u8)
            .take_while(|&b| b != 0)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// An NVRTC program, destroyed on drop.
    struct Program(Prog, &'static Nvrtc);

    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: self.0 was created by nvrtcCreateProgram and is
            // destroyed only here. A failure cannot be reported from drop;
            // it leaks the program at worst.
            let _ = unsafe { (self.1.destroy_program)(&mut self.0) };
        }
    }

    /// Compiles `source` for `arch` (`sm_90`, `compute_90`, ...) with
    /// [`COMPILE_OPTIONS`], passing every [`HEADERS`] entry and the
    /// source's own `headers` by name.
    ///
    /// Returns the PTX and NVRTC's full log (also on success: warnings are
    /// in it). Errors ([`Error::Cuda`] carrying a [`KernelError`]):
    /// a [`LibError`](crate::cuda::libs::LibError) naming the version needed
    /// when the library cannot be loaded or used, `Compile` with
    /// the source's name and the log when NVRTC fails, `InvalidInput` for a
    /// malformed architecture. Never panics.
    pub fn compile(source: &KernelSource, arch: &str) -> Result<CompiledSource> {
        let api = nvrtc()?;
        let name = source.name;
        check_arch(name, arch).map_err(kernel_err)?;
        let src = c_string(name, "the source", source.source)?;
        let c_name = c_string(name, "the source name", name)?;
        let headers = HEADERS.iter().chain(source.headers);
        let mut header_texts = Vec::with_capacity(HEADERS.len() + source.headers.len());
        let mut header_names = Vec::with_capacity(HEADERS.len() + source.headers.len());
        for h in headers {
            header_texts.push(c_string(name, h.name, h.source)?);
            header_names.push(c_string(name, "a header name", h.name)?);
        }
        let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
        let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
        let failed = |status: NvrtcError, log: String| {
            kernel_err(KernelError::Compile {
                source_name: name,
                arch: arch.to_string(),
                status: format!("{:?}", status.0),
                log,
            })
        };

        let mut raw = std::mem::MaybeUninit::uninit();
        // SAFETY: the library is loaded (checked above); every pointer is
        // to a NUL-terminated string that outlives the call (the CStrings
        // above live until the end of this function, and NVRTC copies the
        // texts it keeps); the two arrays hold one entry per header each.
        unsafe {
            (api.create_program)(
                raw.as_mut_ptr(),
                src.as_ptr(),
                c_name.as_ptr(),
                text_ptrs.len() as c_int,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        }
        .result()
        .map_err(|e| failed(e, String::new()))?;
        // SAFETY: nvrtcCreateProgram succeeded, so `raw` is initialized.
        let prog = Program(unsafe { raw.assume_init() }, api);

        let mut options: Vec<CString> = Vec::with_capacity(COMPILE_OPTIONS.len() + 1);
        for o in COMPILE_OPTIONS
            .iter()
            .map(|o| o.to_string())
            .chain([format!("--gpu-architecture={arch}")])
        {
            options.push(c_string(name, "an option", &o)?);
        }
        let option_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();
        // SAFETY: prog.0 is a live program (destroyed only by Program's
        // drop); the option pointers are NUL-terminated strings that
        // outlive the call, as many as passed.
        let compiled = unsafe {
            (api.compile_program)(prog.0, option_ptrs.len() as c_int, option_ptrs.as_ptr())
        }
        .result();
        // SAFETY: prog.0 is a live program; the log exists after a
        // compilation whether or not it succeeded.
        let log = unsafe { fetch(prog.0, api.get_program_log_size, api.get_program_log) }
            .map(nvrtc_text)
            .unwrap_or_default();
        compiled.map_err(|e| failed(e, log.clone()))?;
        // SAFETY: prog.0 is a live program that compiled successfully.
        let ptx = unsafe { fetch(prog.0, api.get_ptx_size, api.get_ptx) }
            .map_err(|e| failed(e, log.clone()))?;
        let cubin = if arch.starts_with("sm_") {
            // SAFETY: prog.0 is a live program compiled for a real
            // architecture, which has a CUBIN.
            let cubin = unsafe { fetch(prog.0, api.get_cubin_size, api.get_cubin) }
                .map_err(|e| failed(e, log.clone()))?;
            Some(cubin.into_iter().map(|b| b as u8).collect())
        } else {
            None
        };
        Ok(CompiledSource {
            name,
            arch: arch.to_string(),
            ptx: nvrtc_text(ptx),
            cubin,
            log,
        })
    }

    /// The architectures this NVRTC can compile for, as `major * 10 + minor`.
    fn supported_archs() -> Result<Vec<i32>> {
        let api = nvrtc()?;
        let mut count: c_int = 0;
        // SAFETY: the library is loaded; `count` is a valid out pointer.
        unsafe { (api.get_num_supported_archs)(&mut count) }
            .result()
            .map_err(|e| Error::Cuda(Box::new(e)))?;
        let mut archs = vec![0 as c_int; count.max(0) as usize];
        // SAFETY: `archs` has room for the `count` entries NVRTC writes.
        unsafe { (api.get_supported_archs)(archs.as_mut_ptr()) }
            .result()
            .map_err(|e| Error::Cuda(Box::new(e)))?;
        Ok(archs)
    }

    /// `compile`, once per (source, architecture) and process.
    fn compile_cached(source: &'static KernelSource, arch: &str) -> Result<Arc<CompiledSource>> {
        type Key = (&'static str, usize, String);
        static CACHE: OnceLock<Mutex<HashMap<Key, Arc<CompiledSource>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        let key = (
            source.name,
            source.source.as_ptr() as usize,
            arch.to_string(),
        );
        // A panic while the lock was held cannot leave a half-written
        // entry (insertion is one call), so a poisoned lock is still usable.
        let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = map.get(&key) {
            return Ok(c.clone());
        }
        let compiled = Arc::new(compile(source, arch)?);
        map.insert(key, compiled.clone());
        Ok(compiled)
    }

    /// The architecture to compile for on the GPU of `ctx`: its own
    /// (`sm_XY`, loaded as device code) when this NVRTC knows it, else the
    /// newest virtual architecture NVRTC knows below it (`compute_XY`: PTX
    /// that the driver compiles at load time, which needs a driver at least
    /// as new as NVRTC). Errors: [`Error::Cuda`] when NVRTC is missing or
    /// the driver call fails, [`Error::Unsupported`] for a GPU older than
    /// every architecture NVRTC supports.
    pub fn target_arch(ctx: &CudaContext) -> Result<String> {
        let (major, minor) = ctx.compute_capability().map_err(driver_err)?;
        let want = major * 10 + minor;
        let archs = supported_archs()?;
        let target = archs
            .iter()
            .copied()
            .filter(|&a| a <= want)
            .max()
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "GPU compute capability {major}.{minor} is older than every \
                     architecture this NVRTC supports ({archs:?})"
                ))
            })?;
        Ok(if target == want {
            format!("sm_{target}")
        } else {
            format!("compute_{target}")
        })
    }

    /// Compiles `source` for `arch` (once per process, see
    /// [`compile`]) and loads it into `ctx`: the CUBIN for a real
    /// architecture, the PTX for a virtual one. Errors: as [`compile`], or
    /// the driver's error when loading fails.
    pub fn load_module(
        ctx: &Arc<CudaContext>,
        source: &'static KernelSource,
        arch: &str,
    ) -> Result<Arc<CudaModule>> {
        let compiled = compile_cached(source, arch)?;
        let image = match &compiled.cubin {
            Some(cubin) => Ptx::from_binary(cubin.clone()),
            None => Ptx::from_src(compiled.ptx.clone()),
        };
        ctx.load_module(image).map_err(driver_err)
    }

    /// The step constants as the kernels take them (`ZeroAdamWConsts`).
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    struct KernelConsts {
        grad_scale: f32,
        beta1: f32,
        beta2: f32,
        one_minus_beta1: f32,
        one_minus_beta2: f32,
        eps: f32,
        step_size: f32,
        inv_sqrt_bias2: f32,
        decay: f32,
    }

    // SAFETY: KernelConsts is #[repr(C)], nine f32 and no padding, the same
    // layout as `struct ZeroAdamWConsts` in zero_math.cuh, which the kernels
    // take by value.
    unsafe impl DeviceRepr for KernelConsts {}

    impl From<&AdamWStep> for KernelConsts {
        fn from(k: &AdamWStep) -> Self {
            KernelConsts {
                grad_scale: k.grad_scale,
                beta1: k.beta1,
                beta2: k.beta2,
                one_minus_beta1: k.one_minus_beta1,
                one_minus_beta2: k.one_minus_beta2,
                eps: k.eps,
                step_size: k.step_size,
                inv_sqrt_bias2: k.inv_sqrt_bias2,
                decay: k.decay,
            }
        }
    }

    /// The fused AdamW step and the gradient sum of squares on one GPU,
    /// bit-identical to [`adamw_reference`](crate::optim::adamw_reference)
    /// and [`sum_squares`](crate::optim::sum_squares).
    ///
    /// [`GpuAdamW::new`] compiles the kernels with NVRTC (once per
    /// architecture and process) and loads them into the device; the
    /// launches then run on the caller's stream and return without
    /// waiting, except [`GpuAdamW::sum_squares`], which returns the value.
    ///
    /// Gradients may be f32, bf16 or f16, moments f32 or bf16, the
    /// low-precision copy of the updated parameters f32, bf16, f16 or
    /// none. Results equal the reference's bits for every element, except
    /// that a NaN result may carry another NaN payload.
    ///
    /// ```no_run
    /// use zero_core::cuda::kernels::GpuAdamW;
    /// use zero_core::optim::{AdamWParams, AdamWStep};
    /// use zero_core::{bf16, Device};
    ///
    /// let Device::Cuda(dev) = Device::cuda(0)? else { unreachable!() };
    /// let adam = GpuAdamW::new(&dev)?;
    /// let stream = dev.context().default_stream();
    /// let n = 1000;
    /// let mut master = stream.clone_htod(&vec![0.5f32; n]).unwrap();
    /// let grad = stream.clone_htod(&vec![bf16::from_f32(0.1); n]).unwrap();
    /// let mut m = stream.alloc_zeros::<f32>(n).unwrap();
    /// let mut v = stream.alloc_zeros::<f32>(n).unwrap();
    /// let mut low = stream.alloc_zeros::<bf16>(n).unwrap();
    ///
    /// let norm = adam.sum_squares(&stream, &grad)?.sqrt();
    /// let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 1, 1.0);
    /// adam.step(&stream, &k, &mut master, &grad, &mut m, &mut v, Some(&mut low))?;
    /// # let _ = norm;
    /// # Ok::<(), zero_core::Error>(())
    /// ```
    #[derive(Debug)]
    pub struct GpuAdamW {
        ctx: Arc<CudaContext>,
        arch: String,
        _modules: [Arc<CudaModule>; 2],
        adamw: Vec<CudaFunction>,
        sumsq_chunks: [CudaFunction; 3],
        sumsq_finish: CudaFunction,
        max_adamw_blocks: u32,
        max_norm_blocks: u32,
    }

    impl GpuAdamW {
        /// Compiles (or takes from the cache) and loads the kernels for
        /// `device`.
        ///
        /// When this NVRTC supports the device's compute capability, the
        /// kernels are compiled to device code for it (`sm_XY`), which
        /// loads with any driver of the same CUDA major version. A device
        /// newer than NVRTC gets PTX for the newest architecture NVRTC
        /// knows (`compute_XY`), which the driver compiles at load time
        /// (that needs a driver at least as new as NVRTC). Errors:
        /// [`Error::Cuda`] with a [`KernelError`] when NVRTC is missing or
        /// fails, or with the driver's error when loading fails.
        pub fn new(device: &CudaDevice) -> Result<Self> {
            let ctx = device.context().clone();
            let arch = target_arch(&ctx)?;
            let load = |name: &str| -> Result<Arc<CudaModule>> {
                let src = source(name).ok_or_else(|| {
                    Error::Unsupported(format!("kernel source `{name}` is not registered"))
                })?;
                load_module(&ctx, src, &arch)
            };
            let adamw_module = load("adamw.cu")?;
            let norm_module = load("norm.cu")?;
            let adamw = ADAMW_ENTRY_POINTS
                .iter()
                .map(|name| adamw_module.load_function(name).map_err(driver_err))
                .collect::<Result<Vec<_>>>()?;
            let norm = |d: DType| {
                norm_module
                    .load_function(sumsq_entry_point(d))
                    .map_err(driver_err)
            };
            let sumsq_chunks = [norm(DType::F32)?, norm(DType::BF16)?, norm(DType::F16)?];
            let sumsq_finish = norm_module
                .load_function("sumsq_finish")
                .map_err(driver_err)?;
            let sms = ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(driver_err)?
                .max(1) as u32;
            Ok(GpuAdamW {
                ctx,
                arch,
                _modules: [adamw_module, norm_module],
                adamw,
                sumsq_chunks,
                sumsq_finish,
                // Enough blocks to fill every SM (2048 threads each on the
                // GPUs this targets); grid-stride loops do the rest. The
                // norm kernel's blocks also hold 32 KiB of shared memory
                // each, so at most 6 fit next to each other on one SM.
                max_adamw_blocks: sms * (2048 / ADAMW_BLOCK),
                max_norm_blocks: sms * 6,
            })
        }

        /// The architecture the kernels were compiled for (`sm_90`, or
        /// `compute_XY` for a device newer than NVRTC).
        pub fn arch(&self) -> &str {
            &self.arch
        }

        /// A stream of another device cannot run these kernels.
        fn check_stream(&self, stream: &CudaStream) -> Result<()> {
            if **stream.context() == *self.ctx {
                Ok(())
            } else {
                Err(Error::Unsupported(format!(
                    "a stream of CUDA device {} used with the kernels of device {}",
                    stream.context().ordinal(),
                    self.ctx.ordinal()
                )))
            }
        }

        /// One fused AdamW step on `stream`, as
        /// [`adamw_reference`](crate::optim::adamw_reference):
        /// `master` (fp32) and the moments `m`, `v` updated in place from
        /// `grad`; `low`, if given, receives the updated parameters
        /// narrowed to `P`.
        ///
        /// Asynchronous: returns once the kernel is queued. Any
        /// `CudaSlice`, `CudaView` or `CudaViewMut` works; pass `None` as
        /// e.g. `None::<&mut CudaSlice<bf16>>`. Views at any element
        /// offset are accepted (16-byte aligned ones take the vectorized
        /// path).
        ///
        /// Errors: [`Error::InvalidSize`] (op `"adamw"`) when the lengths
        /// differ, as the reference; [`Error::Unsupported`] for f16
        /// moments or a stream of another device; [`Error::Cuda`] when the
        /// launch fails. Nothing is launched on error.
        #[allow(clippy::too_many_arguments)]
        pub fn step<G: Element, M: Element, P: Element>(
            &self,
            stream: &CudaStream,
            k: &AdamWStep,
            master: &mut impl DevicePtrMut<f32>,
            grad: &impl DevicePtr<G>,
            m: &mut impl DevicePtrMut<M>,
            v: &mut impl DevicePtrMut<M>,
            low: Option<&mut impl DevicePtrMut<P>>,
        ) -> Result<()> {
            let n = master.len();
            let low_len = low.as_ref().map(|l| l.len());
            check_adamw_lengths("", n, grad.len(), m.len(), v.len(), low_len)?;
            let copy = low.as_ref().map(|_| P::DTYPE);
            let (index, _) = adamw_entry_point(G::DTYPE, M::DTYPE, copy).ok_or_else(|| {
                Error::Unsupported(format!(
                    "GPU AdamW keeps moments in f32 or bf16, not {}",
                    M::DTYPE
                ))
            })?;
            self.check_stream(stream)?;
            if n == 0 {
                return Ok(());
            }
            let groups = n.div_ceil(4) as u64;
            let blocks = groups
                .div_ceil(u64::from(ADAMW_BLOCK))
                .min(u64::from(self.max_adamw_blocks))
                .max(1) as u32;
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (ADAMW_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let consts = KernelConsts::from(k);
            let n64 = n as u64;
            let (p_master, _sync_master) = master.device_ptr_mut(stream);
            let (p_grad, _sync_grad) = grad.device_ptr(stream);
            let (p_m, _sync_m) = m.device_ptr_mut(stream);
            let (p_v, _sync_v) = v.device_ptr_mut(stream);
            let mut low = low;
            let low_ptr = low.as_mut().map(|l| l.device_ptr_mut(stream));
            let mut args = stream.launch_builder(&self.adamw[index]);
            args.arg(&consts)
                .arg(&p_master)
                .arg(&p_grad)
                .arg(&p_m)
                .arg(&p_v);
            if let Some((p_low, _)) = &low_ptr {
                args.arg(p_low);
            }
            args.arg(&n64);
            // SAFETY: the arguments match the kernel's parameters in order
            // and type (ZeroAdamWConsts by value; device pointers to f32,
            // G, M, M and, unless the kernel is `pnone`, P, the kernel
            // chosen by the same dtypes; n as u64). Every pointer refers to
            // at least n elements (lengths checked above) on this stream's
            // device (checked above); the guards (`_sync_*`, `low_ptr`)
            // live past the launch, so cudarc records the accesses.
            unsafe { args.launch(cfg) }.map_err(driver_err)?;
            Ok(())
        }

        /// Queues the sum of squares of `x` on `stream`, in
        /// [`sum_squares`](crate::optim::sum_squares)'s order, and writes it
        /// to `out[0]`. Asynchronous; no allocation.
        ///
        /// `chunk_sums` is scratch of at least [`norm_scratch_len`]`(x.len())`
        /// elements; it receives the per-chunk sums
        /// ([`sum_squares_chunk`](crate::optim::sum_squares_chunk) of each
        /// chunk). Errors: [`Error::InvalidSize`] (op `"sum_squares"`) for
        /// a short `chunk_sums` or an empty `out`; [`Error::Unsupported`]
        /// for a stream of another device; [`Error::Cuda`] when a launch
        /// fails.
        pub fn sum_squares_into<G: Element>(
            &self,
            stream: &CudaStream,
            x: &impl DevicePtr<G>,
            chunk_sums: &mut impl DevicePtrMut<f64>,
            out: &mut impl DevicePtrMut<f64>,
        ) -> Result<()> {
            let n = x.len();
            let nchunks = norm_scratch_len(n);
            if chunk_sums.len() < nchunks || out.is_empty() {
                return Err(Error::InvalidSize {
                    op: "sum_squares",
                    msg: format!(
                        "{n} elements need {nchunks} chunk sums and 1 output, got scratch {} \
                         and output {}",
                        chunk_sums.len(),
                        out.len()
                    ),
                });
            }
            self.check_stream(stream)?;
            let n64 = n as u64;
            let nchunks64 = nchunks as u64;
            let (p_sums, _sync_sums) = chunk_sums.device_ptr_mut(stream);
            if n > 0 {
                let blocks = nchunks64.min(u64::from(self.max_norm_blocks)).max(1) as u32;
                let cfg = LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (NORM_BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                };
                let f = match G::DTYPE {
                    DType::F32 => &self.sumsq_chunks[0],
                    DType::BF16 => &self.sumsq_chunks[1],
                    DType::F16 => &self.sumsq_chunks[2],
                };
                let (p_x, _sync_x) = x.device_ptr(stream);
                let mut args = stream.launch_builder(f);
                args.arg(&p_x).arg(&n64).arg(&p_sums);
                // SAFETY: sumsq_chunks_<G>(const G* x, u64 n, double*
                // chunk_sums): x holds n elements of G::DTYPE (the kernel
                // is chosen by it), chunk_sums at least ceil(n / 65536)
                // f64 (checked above), both on this stream's device; the
                // guards live past the launch.
                unsafe { args.launch(cfg) }.map_err(driver_err)?;
            }
            let (p_out, _sync_out) = out.device_ptr_mut(stream);
            let mut args = stream.launch_builder(&self.sumsq_finish);
            args.arg(&p_sums).arg(&nchunks64).arg(&p_out);
            let one = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: sumsq_finish(const double* sums, u64 nchunks, double*
            // out): sums holds nchunks f64 written by the launch above on
            // the same stream (or none when nchunks is 0), out at least one
            // f64 (checked above); the guards live past the launch.
            unsafe { args.launch(one) }.map_err(driver_err)?;
            Ok(())
        }

        /// The sum of squares of `x`, identical to
        /// [`sum_squares`](crate::optim::sum_squares) of the same elements.
        ///
        /// Allocates its scratch and waits for the result; in a training
        /// step use [`GpuAdamW::sum_squares_into`] with preallocated
        /// buffers. Errors as [`GpuAdamW::sum_squares_into`].
        pub fn sum_squares<G: Element>(
            &self,
            stream: &Arc<CudaStream>,
            x: &impl DevicePtr<G>,
        ) -> Result<f64> {
            self.check_stream(stream)?;
            let mut sums = stream
                .alloc_zeros::<f64>(norm_scratch_len(x.len()).max(1))
                .map_err(driver_err)?;
            let mut out = stream.alloc_zeros::<f64>(1).map_err(driver_err)?;
            self.sum_squares_into(stream, x, &mut sums, &mut out)?;
            let host = stream.clone_dtoh(&out).map_err(driver_err)?;
            stream.synchronize().map_err(driver_err)?;
            Ok(host.first().copied().unwrap_or(0.0))
        }
    }

    /// The scratch length [`GpuAdamW::sum_squares_into`] needs for `n`
    /// elements: one f64 per chunk of [`NORM_CHUNK`].
    pub fn norm_scratch_len(n: usize) -> usize {
        n.div_ceil(NORM_CHUNK)
    }
}

pub use imp::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_entry_points_follow_the_naming_scheme() {
        let names = |d: Option<DType>| d.map_or("none", DType::as_str);
        let mut seen = Vec::new();
        for g in DType::ALL {
            for m in [DType::F32, DType::BF16] {
                for p in [None, Some(DType::F32), Some(DType::BF16), Some(DType::F16)] {
                    let (i, name) = adamw_entry_point(g, m, p).unwrap();
                    assert_eq!(name, format!("adamw_g{g}_m{m}_p{}", names(p)));
                    seen.push(i);
                }
            }
            assert_eq!(adamw_entry_point(g, DType::F16, None), None);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..ADAMW_ENTRY_POINTS.len()).collect::<Vec<_>>());
    }

    #[test]
    fn every_entry_point_is_defined_in_its_source() {
        for s in SOURCES {
            for e in s.entry_points {
                assert!(
                    s.source.contains(&format!("({e},")) || s.source.contains(&format!(" {e}(")),
                    "{} does not define {e}",
                    s.name
                );
            }
        }
        for d in DType::ALL {
            assert!(NORM_ENTRY_POINTS.contains(&sumsq_entry_point(d)));
        }
    }

    #[test]
    fn block_sizes_match_the_header() {
        let h = HEADERS[0].source;
        assert!(h.contains(&format!("#define ZERO_ADAMW_BLOCK {ADAMW_BLOCK}\n")));
        assert!(h.contains(&format!("#define ZERO_NORM_BLOCK {NORM_BLOCK}\n")));
        assert!(h.contains(&format!(
            "#define ZERO_NORM_CHUNK {}ull\n",
            crate::optim::NORM_CHUNK
        )));
        assert!(h.contains(&format!(
            "#define ZERO_NORM_LANES {}ull\n",
            crate::optim::NORM_LANES
        )));
    }

    #[test]
    fn convert_entry_points_follow_the_naming_scheme() {
        let mut seen = Vec::new();
        for s in DType::ALL {
            for d in DType::ALL {
                let (i, name) = convert_entry_point(s, d);
                assert_eq!(name, format!("convert_{s}_{d}"));
                seen.push(i);
            }
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..CONVERT_ENTRY_POINTS.len()).collect::<Vec<_>>());
        let h = HEADERS[1].source;
        assert!(h.contains(&format!("#define ZERO_CONVERT_BLOCK {CONVERT_BLOCK}\n")));
        assert!(h.contains(&format!("#define ZERO_PIECES_MAX {PIECES_MAX}\n")));
    }

    #[test]
    fn architecture_names_are_checked() {
        for ok in ["sm_80", "sm_90", "compute_90", "sm_90a", "compute_120"] {
            assert!(check_arch("x.cu", ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "sm_",
            "90",
            "sm_9 0",
            "--fmad=true",
            "sm_90\0",
            "compute_abc",
        ] {
            let e = check_arch("x.cu", bad).unwrap_err();
            assert!(e.to_string().contains("x.cu"), "{e}");
        }
        assert!(KernelError::NvrtcNotFound
            .to_string()
            .contains("pip install nvidia-cuda-nvrtc-cu12"));
    }
}
