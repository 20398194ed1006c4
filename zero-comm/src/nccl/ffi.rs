//! NCCL as the backend calls it, on top of cudarc's `nccl::sys` layer:
//! loading without panics, the version, the non-blocking config, type and
//! operator mapping, and results turned into [`NcclError`]s.
//!
//! cudarc's safe `nccl::Comm` is not used: it initializes in blocking mode
//! (a missing rank hangs `ncclCommInitRank` forever) and panics in `Drop`
//! when `ncclCommAbort` fails.

use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use cudarc::nccl::sys;
use zero_core::cuda::version::NCCL_MIN_VERSION;
use zero_core::DType;

use super::check::{version_string, version_supported};
use super::{NcclError, NcclFailure};
use crate::ReduceOp;

/// Every NCCL function the backend calls. cudarc resolves a symbol on its
/// first call and panics when it is missing, so all are looked up once,
/// up front.
const SYMBOLS: [&str; 14] = [
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclCommInitRankConfig",
    "ncclCommGetAsyncError",
    "ncclCommAbort",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclAllReduce",
    "ncclReduceScatter",
    "ncclAllGather",
];

/// The `ncclConfig_t` layout of cudarc's bindings (`nccl-02030`): NCCL
/// copies `min(size, its own size)` bytes and ignores fields newer than
/// `version`, so one layout serves every NCCL from 2.14 on.
const CONFIG_VERSION: u32 = 23_000;
const CONFIG_MAGIC: u32 = 0xcafe_beef;
const UNDEF_INT: i32 = i32::MIN;

static LOADED: OnceLock<Result<i32, NcclFailure>> = OnceLock::new();

/// Loads NCCL (once) and checks its version and symbols; its version code.
pub(crate) fn library() -> Result<i32, NcclError> {
    LOADED
        .get_or_init(load)
        .clone()
        .map_err(|failure| NcclError {
            rank: None,
            op: "load",
            failure,
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

fn load() -> Result<i32, NcclFailure> {
    // cudarc's search, run first (the same names in the same order), so
    // that culib() below finds a library instead of panicking; a copy in
    // the usual places that cudarc does not open is named in the error.
    use zero_core::cuda::libs::{require, Lib, LibError};
    match require(Lib::Nccl) {
        Ok(_) => {}
        Err(LibError::Missing {
            tried,
            broken,
            elsewhere,
            ..
        }) if broken.is_empty() && elsewhere.is_empty() => {
            return Err(NcclFailure::Missing { tried })
        }
        Err(e) => return Err(NcclFailure::Unsupported { msg: e.to_string() }),
    }
    // SAFETY: require() just opened the library under the first of the
    // names culib() tries that opens, so culib() loads it instead of
    // panicking.
    let lib = unsafe { sys::culib() };
    let missing: Vec<&str> = SYMBOLS
        .iter()
        .copied()
        // SAFETY: looking a symbol up calls nothing; the returned pointer
        // is only tested for presence, never used.
        .filter(|name| unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(NcclFailure::Unsupported {
            msg: format!(
                "the NCCL library lacks {}: NCCL {} or later is needed",
                missing.join(", "),
                NCCL_MIN_VERSION
            ),
        });
    }
    let mut v: std::ffi::c_int = 0;
    // SAFETY: ncclGetVersion is present (checked above) and writes one int
    // through a valid pointer.
    let r = unsafe { sys::ncclGetVersion(&mut v) };
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(call_failure("ncclGetVersion", r, std::ptr::null_mut()));
    }
    if !version_supported(v) {
        return Err(NcclFailure::Unsupported {
            msg: format!(
                "NCCL {} is too old: the backend needs {} or later (non-blocking \
                 communicators)",
                version_string(v),
                NCCL_MIN_VERSION
            ),
        });
    }
    Ok(v)
}

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub(crate) const ID_BYTES: usize = 128;

/// A new unique id (`ncclGetUniqueId`), as its bytes.
pub(crate) fn unique_id() -> Result<[u8; ID_BYTES], NcclError> {
    library()?;
    let mut id = MaybeUninit::<sys::ncclUniqueId>::uninit();
    // SAFETY: the library and symbol are present (library()); NCCL writes
    // the 128 bytes of the id through the valid pointer.
    let r = unsafe { sys::ncclGetUniqueId(id.as_mut_ptr()) };
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
            c_str(sys::ncclGetErrorString(r)),
            c_str(sys::ncclGetLastError(comm)),
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
unsafe fn c_str(p: *const std::ffi::c_char) -> String {
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
