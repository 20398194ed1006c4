//! cuBLAS as zero calls it: the few functions it uses, taken from the
//! library that [`libs::load`](super::libs::load) opened (`libcublas.so.13`
//! or `.12`, wherever it is installed), not from cudarc's loader, which
//! opens only CUDA 12's names on the loader's path. cudarc's types are used
//! for the arguments, and [`CublasError`] for failed calls.

use std::ffi::{c_int, c_longlong, c_void};
use std::sync::OnceLock;

pub use cudarc::cublas::result::CublasError;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasOperation_t, cublasStatus_t,
    cudaDataType, cudaStream_t,
};
use cudarc::driver::CudaStream;

use super::libs::{load, Lib, LibError};
use crate::{Error, Result};

type Create = unsafe extern "C" fn(*mut cublasHandle_t) -> cublasStatus_t;
type Destroy = unsafe extern "C" fn(cublasHandle_t) -> cublasStatus_t;
type SetStream = unsafe extern "C" fn(cublasHandle_t, cudaStream_t) -> cublasStatus_t;
type GemmEx = unsafe extern "C" fn(
    cublasHandle_t,
    cublasOperation_t,
    cublasOperation_t,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    cudaDataType,
    c_int,
    *const c_void,
    cudaDataType,
    c_int,
    *const c_void,
    *mut c_void,
    cudaDataType,
    c_int,
    cublasComputeType_t,
    cublasGemmAlgo_t,
) -> cublasStatus_t;
type GemmStridedBatchedEx = unsafe extern "C" fn(
    cublasHandle_t,
    cublasOperation_t,
    cublasOperation_t,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    cudaDataType,
    c_int,
    c_longlong,
    *const c_void,
    cudaDataType,
    c_int,
    c_longlong,
    *const c_void,
    *mut c_void,
    cudaDataType,
    c_int,
    c_longlong,
    c_int,
    cublasComputeType_t,
    cublasGemmAlgo_t,
) -> cublasStatus_t;

/// Every cuBLAS function zero calls (all checked when the table is filled).
const SYMBOLS: [&str; 5] = [
    "cublasCreate_v2",
    "cublasDestroy_v2",
    "cublasSetStream_v2",
    "cublasGemmEx",
    "cublasGemmStridedBatchedEx",
];

/// The cuBLAS functions zero calls, from the opened library.
struct Api {
    create: Create,
    destroy: Destroy,
    set_stream: SetStream,
    gemm_ex: GemmEx,
    gemm_strided_batched_ex: GemmStridedBatchedEx,
}

/// The table, filled once per process; an error naming the library's file
/// and the missing functions when it cannot be.
fn api() -> std::result::Result<&'static Api, LibError> {
    static API: OnceLock<std::result::Result<Api, LibError>> = OnceLock::new();
    API.get_or_init(|| {
        let lib = load(Lib::Cublas)?;
        lib.check_symbols(&SYMBOLS)?;
        // SAFETY: each type above is the C declaration of its function in
        // cublas_api.h (CUDA 12 and 13 declare them alike).
        unsafe {
            Ok(Api {
                create: lib.get("cublasCreate_v2")?,
                destroy: lib.get("cublasDestroy_v2")?,
                set_stream: lib.get("cublasSetStream_v2")?,
                gemm_ex: lib.get("cublasGemmEx")?,
                gemm_strided_batched_ex: lib.get("cublasGemmStridedBatchedEx")?,
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn blas_err(call: &'static str, e: CublasError) -> Error {
    Error::Cuda(format!("cuBLAS {call}: {e}").into())
}

/// A cuBLAS handle that enqueues its work on one stream; destroyed on drop.
#[derive(Debug)]
pub struct BlasHandle {
    raw: cublasHandle_t,
}

// SAFETY: a cuBLAS handle may be used from any thread, one call at a time
// (cuBLAS's thread-safety rule); `&mut`/ownership or the owner's lock
// orders the calls.
unsafe impl Send for BlasHandle {}

impl BlasHandle {
    /// Creates a handle in `stream`'s context that enqueues on `stream`.
    ///
    /// Errors: [`Error::Cuda`] with a [`LibError`] when cuBLAS cannot be
    /// loaded (naming the file or what was looked for), or the failed
    /// call's status.
    pub fn new(stream: &CudaStream) -> Result<Self> {
        let api = api()?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::Cuda(Box::new(e)))?;
        let mut raw: cublasHandle_t = std::ptr::null_mut();
        // SAFETY: the context is current on this thread; `raw` is a valid
        // out pointer.
        unsafe { (api.create)(&mut raw) }
            .result()
            .map_err(|e| blas_err("cublasCreate", e))?;
        let handle = BlasHandle { raw };
        // SAFETY: `raw` is a live handle; the stream outlives the calls
        // made through this handle (its owner keeps both).
        unsafe { (api.set_stream)(handle.raw, stream.cu_stream() as cudaStream_t) }
            .result()
            .map_err(|e| blas_err("cublasSetStream", e))?;
        Ok(handle)
    }

    /// The raw handle, for calls this module does not wrap.
    pub fn raw(&self) -> cublasHandle_t {
        self.raw
    }

    /// `cublasGemmEx` on this handle's stream.
    ///
    /// # Safety
    /// As cuBLAS's: the pointers are device memory (alpha and beta host
    /// memory, the default pointer mode) of the given types, holding the
    /// matrices these dimensions and leading dimensions describe, and stay
    /// valid until the stream has run the call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_ex(
        &self,
        transa: cublasOperation_t,
        transb: cublasOperation_t,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: *const c_void,
        a: *const c_void,
        a_type: cudaDataType,
        lda: c_int,
        b: *const c_void,
        b_type: cudaDataType,
        ldb: c_int,
        beta: *const c_void,
        c: *mut c_void,
        c_type: cudaDataType,
        ldc: c_int,
        compute: cublasComputeType_t,
        algo: cublasGemmAlgo_t,
    ) -> std::result::Result<(), CublasError> {
        let api = api().map_err(|_| CublasError(cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED))?;
        // SAFETY: the handle is live; the rest is the caller's promise.
        unsafe {
            (api.gemm_ex)(
                self.raw, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c,
                c_type, ldc, compute, algo,
            )
        }
        .result()
    }

    /// `cublasGemmStridedBatchedEx` on this handle's stream.
    ///
    /// # Safety
    /// As [`gemm_ex`](Self::gemm_ex), for `count` products whose operands
    /// lie `stride_*` elements apart.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_strided_batched_ex(
        &self,
        transa: cublasOperation_t,
        transb: cublasOperation_t,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: *const c_void,
        a: *const c_void,
        a_type: cudaDataType,
        lda: c_int,
        stride_a: c_longlong,
        b: *const c_void,
        b_type: cudaDataType,
        ldb: c_int,
        stride_b: c_longlong,
        beta: *const c_void,
        c: *mut c_void,
        c_type: cudaDataType,
        ldc: c_int,
        stride_c: c_longlong,
        count: c_int,
        compute: cublasComputeType_t,
        algo: cublasGemmAlgo_t,
    ) -> std::result::Result<(), CublasError> {
        let api = api().map_err(|_| CublasError(cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED))?;
        // SAFETY: the handle is live; the rest is the caller's promise.
        unsafe {
            (api.gemm_strided_batched_ex)(
                self.raw, transa, transb, m, n, k, alpha, a, a_type, lda, stride_a, b, b_type, ldb,
                stride_b, beta, c, c_type, ldc, stride_c, count, compute, algo,
            )
        }
        .result()
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // A handle exists only after api() succeeded, so this is Ok.
        if let Ok(api) = api() {
            // SAFETY: `raw` is a live handle, destroyed only here. A
            // failure cannot be reported from drop; it leaks at worst.
            let _ = unsafe { (api.destroy)(self.raw) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        // With or without cuBLAS on this machine: an answer, no panic.
        match api() {
            Ok(_) => {}
            Err(e) => assert_eq!(e.lib(), Lib::Cublas, "{e}"),
        }
    }
}
