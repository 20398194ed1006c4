//! Pinned host memory that the CUDA driver knows: [`CudaPinRegistrar`]
//! registers a [`HostPool`](crate::HostPool)'s locked buffers with
//! `cuMemHostRegister`, so that asynchronous copies between them and a
//! GPU run at full PCIe speed without a staging copy by the driver
//! (DeepSpeed's `pin_memory`, PyTorch's `pin_memory()`).
//!
//! ```text
//!   HostPool (pin_memory: true, registrar: CudaPinRegistrar)
//!     mmap ─ prefault ─ mlock ─ cuMemHostRegister(PORTABLE) ──▶ buffers
//!     ... cuMemcpyHtoDAsync / DtoHAsync on the backend's copy streams ...
//!     cuMemHostUnregister ─ munlock ─ munmap   (when the pool is gone)
//! ```
//!
//! The registrar is made from an open [`CudaDevice`],
//! so the driver library is loaded and checked before any call here (no
//! cudarc panic on a missing library). Registration is `PORTABLE`: every
//! context in the process sees the memory as pinned.

use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use zero_core::{CudaDevice, Error, Result};

use crate::host::PinRegistrar;

/// Registers pool buffers with the CUDA driver (see the module docs).
pub struct CudaPinRegistrar {
    ctx: Arc<CudaContext>,
    /// Failures of `cuMemHostUnregister`, which cannot be reported from
    /// `Drop`: read them with [`CudaPinRegistrar::failures`].
    failures: Mutex<Vec<String>>,
}

impl CudaPinRegistrar {
    /// A registrar for `device`'s context.
    pub fn new(device: &CudaDevice) -> Arc<Self> {
        Arc::new(CudaPinRegistrar {
            ctx: Arc::clone(device.context()),
            failures: Mutex::new(Vec::new()),
        })
    }

    /// Unregistrations that failed so far (each names the range and the
    /// driver's error).
    pub fn failures(&self) -> Vec<String> {
        self.failures
            .lock()
            .map_or_else(|e| e.into_inner().clone(), |f| f.clone())
    }
}

impl fmt::Debug for CudaPinRegistrar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaPinRegistrar")
            .field("ordinal", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

impl PinRegistrar for CudaPinRegistrar {
    fn register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let fail = |call: &str, e: String| Error::PinMemory {
            needed: len as u64,
            msg: format!(
                "{call} of {len} bytes at {ptr:p} on cuda:{}: {e}",
                self.ctx.ordinal()
            ),
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| fail("cuCtxSetCurrent", e.to_string()))?;
        // SAFETY: the pool hands a page-aligned range valid for `len` bytes
        // until `unregister` (the PinRegistrar contract); the driver only
        // records it. The driver library is loaded (the context exists).
        let r =
            unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
        r.result()
            .map_err(|e| fail("cuMemHostRegister", e.to_string()))
    }

    fn unregister(&self, ptr: *mut u8, len: usize) {
        let r = self
            .ctx
            .bind_to_thread()
            .map_err(|e| e.to_string())
            .and_then(|()| {
                // SAFETY: `ptr` is a range `register` accepted and the pool has
                // not unmapped it yet.
                unsafe { sys::cuMemHostUnregister(ptr.cast()) }
                    .result()
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = r {
            let msg = format!("cuMemHostUnregister of {len} bytes at {ptr:p}: {e}");
            match self.failures.lock() {
                Ok(mut f) => f.push(msg),
                Err(p) => p.into_inner().push(msg),
            }
        }
    }
}
