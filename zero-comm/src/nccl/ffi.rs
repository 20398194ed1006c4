//! NCCL as the backend calls it: loading without panics, the version, the
//! non-blocking config, type and operator mapping, and results turned into
//! [`NcclError`]s.
//!
//! The library is the one `zero_core::cuda::libs` opens (`libnccl.so.2` or
//! `libnccl.so`, from `LD_LIBRARY_PATH`, the system loader, PyTorch's
//! `nvidia/nccl/lib` wheel folder, `$CUDA_HOME` or `/usr/local/cuda*`);
//! its functions are called through [`api`], a table filled from that file
//! when it is loaded, so that a missing one is an error naming it. cudarc's
//! `nccl::sys` supplies the types only: its loader opens `libnccl.so` (and
//! CUDA 12's names) but never NCCL's own `libnccl.so.2`.
//!
//! cudarc's safe `nccl::Comm` is not used: it initializes in blocking mode
//! (a missing rank hangs `ncclCommInitRank` forever) and panics in `Drop`
//! when `ncclCommAbort` fails.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use cudarc::nccl::sys::{
    self, cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
    ncclUniqueId,
};
use zero_core::cuda::libs::{LibError, Library};
use zero_core::cuda::version::NCCL_MIN_VERSION;
use zero_core::DType;

use super::check::{version_string, version_supported};
use super::{NcclError, NcclFailure};
use crate::ReduceOp;

/// Declares the NCCL functions the backend calls: the table's fields, the
/// list of symbols checked when it is filled, and in [`api`] one function
/// per entry, named and typed as NCCL's.
macro_rules! nccl_functions {
    ($( fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty, else $none:expr; )*) => {
        /// The NCCL functions the backend calls, from the loaded library.
        #[allow(non_snake_case)]
        struct Api {
            $( $name: unsafe extern "C" fn($($ty),*) -> $ret, )*
        }

        /// Every function of [`Api`], checked together so that the error
        /// names all that are missing.
        const SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        /// The table, from `lib` (every symbol checked first).
        fn fill(lib: &Library) -> Result<Api, LibError> {
            lib.check_symbols(SYMBOLS)?;
            // SAFETY: each field's type is the C declaration of its
            // function in nccl.h (the declarations cudarc's bindings
            // `nccl-02030` are generated from; unchanged since 2.14).
            unsafe { Ok(Api { $( $name: lib.get(stringify!($name))?, )* }) }
        }

        /// NCCL's functions, called through the table filled from the
        /// library zero opened. Only reached after [`library`] succeeded
        /// (every path checks it first); before that, each returns an
        /// error result (or null) instead of calling anything.
        // ncclGetVersion is called through the table while it is loaded,
        // so its wrapper is unused.
        #[allow(non_snake_case, dead_code)]
        pub(crate) mod api {
            use super::*;
            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                ///
                /// # Safety
                /// NCCL's contract for this function (see nccl.h).
                pub(crate) unsafe fn $name($($arg: $ty),*) -> $ret {
                    match super::table() {
                        // SAFETY: the caller keeps NCCL's contract.
                        Some(t) => unsafe { (t.$name)($($arg),*) },
                        None => $none,
                    }
                }
            )*
        }
    };
}

const NOT_LOADED: ncclResult_t = ncclResult_t::ncclInvalidUsage;

nccl_functions! {
    fn ncclGetVersion(version: *mut c_int) -> ncclResult_t, else NOT_LOADED;
    fn ncclGetUniqueId(id: *mut ncclUniqueId) -> ncclResult_t, else NOT_LOADED;
    fn ncclGetErrorString(result: ncclResult_t) -> *const c_char, else std::ptr::null();
    fn ncclGetLastError(comm: ncclComm_t) -> *const c_char, else std::ptr::null();
    fn ncclCommInitRankConfig(
        comm: *mut ncclComm_t,
        nranks: c_int,
        id: ncclUniqueId,
        rank: c_int,
        config: *mut ncclConfig_t
    ) -> ncclResult_t, else NOT_LOADED;
    fn ncclCommGetAsyncError(comm: ncclComm_t, state: *mut ncclResult_t) -> ncclResult_t,
        else NOT_LOADED;
    fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t, else NOT_LOADED;
    fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t, else NOT_LOADED;
    fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t, else NOT_LOADED;
    fn ncclGroupStart() -> ncclResult_t, else NOT_LOADED;
    fn ncclGroupEnd() -> ncclResult_t, else NOT_LOADED;
    fn ncclAllReduce(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t, else NOT_LOADED;
    fn ncclReduceScatter(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t, else NOT_LOADED;
    fn ncclAllGather(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t, else NOT_LOADED;
}

/// The `ncclConfig_t` layout of cudarc's bindings (`nccl-02030`): NCCL
/// copies `min(size, its own size)` bytes and ignores fields newer than
/// `version`, so one layout serves every NCCL from 2.14 on.
const CONFIG_VERSION: u32 = 23_000;
const CONFIG_MAGIC: u32 = 0xcafe_beef;
const UNDEF_INT: i32 = i32::MIN;

/// The loaded library's table and version code, once per process.
static LOADED: OnceLock<Result<(Api, i32), NcclFailure>> = OnceLock::new();

/// The table, once the library loaded and checked.
fn table() -> Option<&'static Api> {
    LOADED.get()?.as_ref().ok().map(|(api, _)| api)
}

/// Loads NCCL (once) and checks its version and symbols; its version code.
pub(crate) fn library() -> Result<i32, NcclError> {
    LOADED
        .get_or_init(load)
        .as_ref()
        .map(|(_, v)| *v)
        .map_err(|failure| NcclError {
            rank: None,
            op: "load",
            failure: failure.clone(),
        })
}

/// The version of the NCCL library that this process loads, as NCCL's
/// code `major × 10000 + minor × 100 + patch` (2.21.5 is 22105).
///
/// Errors when NCCL cannot be loaded or is older than 2.14 (the first with
/// non-blocking communicators); never panics.
pub fn version() -> crate::Result<i32> {
    library().map_err(Into::into)
}

/// The file zero opened for NCCL and where it was found, for messages
/// (`NCCL 2.28.5 at /x/nvidia/nccl/lib/libnccl.so.2 (from a PyTorch wheel
/// folder)`); `None` when it is not loaded.
pub fn opened() -> Option<String> {
    library().ok()?;
    let found = zero_core::cuda::libs::require(zero_core::cuda::libs::Lib::Nccl).ok()?;
    Some(format!("{found} ({})", found.place))
}

fn load() -> Result<(Api, i32), NcclFailure> {
    use zero_core::cuda::libs::{load, Lib};
    let lib = match load(Lib::Nccl) {
        Ok(lib) => lib,
        Err(LibError::Missing {
            tried,
            broken,
            elsewhere,
            ..
        }) if broken.is_empty() && elsewhere.is_empty() => {
            return Err(NcclFailure::Missing { tried })
        }
        Err(e) => return Err(NcclFailure::Unsupported { msg: e.to_string() }),
    };
    let api = fill(lib).map_err(|e| NcclFailure::Unsupported {
        msg: format!("{e} (NCCL {NCCL_MIN_VERSION} or later is needed)"),
    })?;
    let mut v: c_int = 0;
    // SAFETY: ncclGetVersion writes one int through a valid pointer.
    let r = unsafe { (api.ncclGetVersion)(&mut v) };
    if r != ncclResult_t::ncclSuccess {
        // SAFETY: both symbols are in the table; NCCL returns static or
        // thread-local NUL-terminated strings (or null), read at once.
        let detail = unsafe { c_str((api.ncclGetErrorString)(r)) };
        return Err(NcclFailure::Call {
            call: "ncclGetVersion",
            code: format!("{r:?}"),
            detail,
        });
    }
    if !version_supported(v) {
        return Err(NcclFailure::Unsupported {
            msg: format!(
                "NCCL {} ({}) is too old: the backend needs {} or later (non-blocking \
                 communicators)",
                version_string(v),
                lib.found().path.as_ref().map_or_else(
                    || lib.found().opened_as.clone(),
                    |p| p.display().to_string()
                ),
                NCCL_MIN_VERSION
            ),
        });
    }
    Ok((api, v))
}

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub(crate) const ID_BYTES: usize = 128;

/// A new unique id (`ncclGetUniqueId`), as its bytes.
pub(crate) fn unique_id() -> Result<[u8; ID_BYTES], NcclError> {
    library()?;
    let mut id = MaybeUninit::<sys::ncclUniqueId>::uninit();
    // SAFETY: the library and symbol are present (library()); NCCL writes
    // the 128 bytes of the id through the valid pointer.
    let r = unsafe { api::ncclGetUniqueId(id.as_mut_ptr()) };
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(NcclError {
            rank: None,
            op: "unique_id",
            failure: call_failure("ncclGetUniqueId", r, std::ptr::null_mut()),
        });
    }
    // SAFETY: ncclGetUniqueId succeeded, so the id is initialized.
    let id = unsafe { id.assume_init() };
    Ok(id.internal.map(|c| c as u8))
}

/// An id's bytes as NCCL takes them.
pub(crate) fn sys_id(bytes: &[u8; ID_BYTES]) -> sys::ncclUniqueId {
    sys::ncclUniqueId {
        internal: bytes.map(|b| b as std::ffi::c_char),
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every call on the
/// communicator returns at once (`ncclInProgress` while work continues in
/// NCCL's threads), so each wait is ours and bounded.
pub(crate) fn nonblocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

/// NCCL's element type.
pub(crate) fn data_type(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
    }
}

/// NCCL's operator (see the module doc for how Avg and Max differ from
/// the host backends).
pub(crate) fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// What a failed call means: NCCL's string for the code and its last
/// error message (per thread, so read right after the call).
pub(crate) fn call_failure(
    call: &'static str,
    r: sys::ncclResult_t,
    comm: sys::ncclComm_t,
) -> NcclFailure {
    // SAFETY: only reached after library() succeeded (or from load() after
    // the symbol check), so both symbols are present; NCCL returns static
    // or thread-local NUL-terminated strings (or null), read at once.
    let (what, last) = unsafe {
        (
            c_str(api::ncclGetErrorString(r)),
            c_str(api::ncclGetLastError(comm)),
        )
    };
    let detail = match (what.is_empty(), last.is_empty()) {
        (false, false) => format!("{what}; last error: {last}"),
        (false, true) => what,
        (true, _) => last,
    };
    NcclFailure::Call {
        call,
        code: format!("{r:?}"),
        detail,
    }
}

/// # Safety
/// `p` is null or points to a NUL-terminated string valid for the call.
unsafe fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated (caller).
    unsafe { CStr::from_ptr(p) }
        .to_string_lossy()
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_the_initializer_with_blocking_off() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafe_beef, 23_000, 0));
        assert_eq!(c.minCTAs, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn types_and_operators_map_to_nccl() {
        assert_eq!(data_type(DType::BF16), sys::ncclDataType_t::ncclBfloat16);
        assert_eq!(data_type(DType::F16), sys::ncclDataType_t::ncclFloat16);
        assert_eq!(data_type(DType::F32), sys::ncclDataType_t::ncclFloat32);
        assert_eq!(red_op(ReduceOp::Avg), sys::ncclRedOp_t::ncclAvg);
        assert_eq!(red_op(ReduceOp::Sum), sys::ncclRedOp_t::ncclSum);
        assert_eq!(red_op(ReduceOp::Max), sys::ncclRedOp_t::ncclMax);
    }

    #[test]
    fn ids_convert_both_ways() {
        let bytes: [u8; 128] = std::array::from_fn(|i| (255 - i) as u8);
        let s = sys_id(&bytes);
        assert_eq!(s.internal.map(|c| c as u8), bytes);
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        // This machine may or may not have NCCL; either way no panic.
        match library() {
            Ok(v) => assert!(version_supported(v)),
            Err(e) => {
                assert_eq!((e.rank, e.op), (None, "load"));
                let msg = e.to_string();
                assert!(msg.contains("libnccl") || msg.contains("NCCL"), "{msg}");
            }
        }
    }
}
