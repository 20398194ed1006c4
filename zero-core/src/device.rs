//! Devices: `Cpu` always, `Cuda` in every build (real with the `cuda` feature).

use crate::{Error, Result};

/// Where tensors live and kernels run.
///
/// Both variants exist in every build, so code that matches on devices
/// compiles everywhere; without the `cuda` feature a `CudaDevice` cannot be
/// created ([`Device::cuda`] returns [`Error::NotCompiledWith`]).
#[derive(Clone, Debug)]
pub enum Device {
    /// Host memory and CPU kernels.
    Cpu,
    /// An NVIDIA GPU through cudarc.
    Cuda(CudaDevice),
}

impl Device {
    /// Opens CUDA device `ordinal`.
    ///
    /// Errors: [`Error::NotCompiledWith`] without the `cuda` feature;
    /// [`Error::NoDevice`] when no driver library can be loaded or the
    /// ordinal does not exist. Never panics.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        CudaDevice::new(ordinal).map(Device::Cuda)
    }

    /// CUDA device `ordinal` when one can be opened, otherwise `Cpu`.
    pub fn cuda_if_available(ordinal: usize) -> Device {
        Device::cuda(ordinal).unwrap_or(Device::Cpu)
    }

    /// Whether this is the CPU.
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(d) => write!(f, "cuda:{}", d.ordinal()),
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use std::sync::Arc;

    /// A CUDA device: a cudarc context on one GPU.
    #[derive(Clone)]
    pub struct CudaDevice {
        ctx: Arc<cudarc::driver::CudaContext>,
        ordinal: usize,
    }

    impl CudaDevice {
        /// Opens GPU `ordinal`; a clear error when no driver or GPU is found.
        pub fn new(ordinal: usize) -> Result<Self> {
            crate::cuda::libs::require(crate::cuda::libs::Lib::Driver).map_err(|e| {
                Error::NoDevice {
                    kind: "cuda",
                    ordinal,
                    reason: e.to_string(),
                }
            })?;
            let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| Error::NoDevice {
                kind: "cuda",
                ordinal,
                reason: e.to_string(),
            })?;
            Ok(Self { ctx, ordinal })
        }

        /// The GPU ordinal.
        pub fn ordinal(&self) -> usize {
            self.ordinal
        }

        /// The cudarc context, for code that launches work on this device.
        pub fn context(&self) -> &Arc<cudarc::driver::CudaContext> {
            &self.ctx
        }
    }

    impl std::fmt::Debug for CudaDevice {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("CudaDevice")
                .field("ordinal", &self.ordinal)
                .finish()
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    /// A CUDA device. This build has no CUDA backend: [`CudaDevice::new`]
    /// always returns [`Error::NotCompiledWith`]`("cuda")`.
    #[derive(Clone, Debug)]
    pub struct CudaDevice {
        ordinal: usize,
    }

    impl CudaDevice {
        /// Always [`Error::NotCompiledWith`]`("cuda")` in this build.
        pub fn new(_ordinal: usize) -> Result<Self> {
            Err(Error::NotCompiledWith("cuda"))
        }

        /// The GPU ordinal.
        pub fn ordinal(&self) -> usize {
            self.ordinal
        }
    }
}

pub use imp::CudaDevice;

#[cfg(test)]
mod tests {
    use super::*;

    static_assertions::assert_impl_all!(Device: Send, Sync, Clone);

    #[test]
    fn cuda_without_gpu_is_an_error_not_a_panic() {
        // On machines without a GPU (CI, developers) this must be an error;
        // with the cuda feature and a GPU it succeeds.
        let built_with_cuda = cfg!(feature = "cuda");
        match Device::cuda(0) {
            Ok(d) => assert!(d.is_cuda()),
            Err(Error::NotCompiledWith("cuda")) => assert!(!built_with_cuda),
            Err(Error::NoDevice {
                kind,
                ordinal,
                reason,
            }) => {
                assert!(built_with_cuda);
                assert_eq!((kind, ordinal), ("cuda", 0));
                assert!(!reason.is_empty());
            }
            Err(e) => panic!("unexpected error {e}"),
        }
        assert!(Device::cuda_if_available(0).is_cpu() || built_with_cuda);
        assert_eq!(Device::Cpu.to_string(), "cpu");
    }

    #[test]
    fn error_message_names_the_feature() {
        let msg = Error::NotCompiledWith("cuda").to_string();
        assert!(msg.contains("--features cuda"), "{msg}");
    }
}
