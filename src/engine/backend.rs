//! What the engine needs of its backend and its communicator, beyond the
//! backend's primitives: [`EngineBackend`] (host access to the buffers,
//! and the backend the engine makes for itself) and [`EngineComm`] (host
//! and device collectives).

use zero_comm::{Communicator, DeviceCollectives};
use zero_core::backend::{Backend, CpuBackend, CpuMode, HostAccess};
use zero_core::optim::CpuAdamW;

use crate::Result;

/// The communicator of an engine on backend `B`: host collectives (to
/// agree, to exchange flags and norms) and device collectives on `B`'s
/// buffers (every [`Communicator`] has them on the CPU backend).
pub trait EngineComm<B: Backend>: Communicator + DeviceCollectives<B> {}

impl<B: Backend, C: Communicator + DeviceCollectives<B>> EngineComm<B> for C {}

#[cfg(feature = "cuda")]
impl EngineBackend for zero_core::backend::CudaBackend {
    /// The engine does not choose a GPU for a rank: its caller does.
    fn for_engine(_threads: usize) -> Result<Self> {
        Err(crate::Error::Unsupported {
            what: "an engine on CUDA needs its GPU: EngineBuilder::backend(CudaBackend::new(ordinal)?)"
                .into(),
        })
    }

    fn host_adamw(&self, threads: usize) -> CpuAdamW {
        CpuAdamW::new().with_threads(threads)
    }

    fn device_free(&self) -> Result<Option<u64>> {
        Ok(Some(self.memory_info()?.0))
    }

    fn device_used(&self) -> Result<Option<u64>> {
        let (free, total) = self.memory_info()?;
        Ok(Some(total.saturating_sub(free)))
    }

    fn reserve_device(&self, bytes: u64) -> Result<()> {
        Ok(self.reserve(bytes)?)
    }

    fn device_id(&self) -> Result<Option<[u64; 2]>> {
        let u = self.device_uuid()?;
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        Ok(Some([word(&u[..8]), word(&u[8..])]))
    }

    fn device_pool(&self) -> Result<Option<u64>> {
        Ok(Some(self.pool_reserved()?))
    }
}

/// A backend the engine runs on: host access to its buffers
/// ([`HostAccess`]), and the backend the engine makes for itself when
/// [`EngineBuilder::backend`](super::EngineBuilder::backend) gave none.
pub trait EngineBackend: HostAccess {
    /// The backend of an engine built without [`EngineBuilder::backend`](super::EngineBuilder::backend),
    /// whose optimizer kernels use `threads` host threads.
    fn for_engine(threads: usize) -> Result<Self>;

    /// The host AdamW of the offloaded optimizer (`offload_optimizer`),
    /// with `threads` threads unless the backend has its own.
    fn host_adamw(&self, threads: usize) -> CpuAdamW;

    /// The device memory free now, in bytes, where the device tier is a
    /// device of its own (`None` on the CPU backend, whose device tier is
    /// host memory): `build` checks its memory plan against it before it
    /// allocates anything.
    fn device_free(&self) -> Result<Option<u64>>;

    /// The device memory in use now, in bytes, by every process on the
    /// device, as its driver reports it (`None` on the CPU backend): what
    /// a report shows next to the memory tracker's figures.
    fn device_used(&self) -> Result<Option<u64>>;

    /// Reserves `bytes` of device memory for the buffers allocated after
    /// it, where the device tier is a device of its own (see
    /// [`device_free`](Self::device_free)): `build` reserves its memory
    /// plan before it allocates anything, so that no allocation of the
    /// plan asks the driver for memory later, in a step. Nothing to do on
    /// the CPU backend.
    fn reserve_device(&self, bytes: u64) -> Result<()>;

    /// An identity of the device, the same for every rank on it on any
    /// host and different for any other device (a GPU's UUID; `None` on
    /// the CPU backend): `build` counts the ranks that share the device
    /// and checks each rank's plan against its share of the free memory.
    fn device_id(&self) -> Result<Option<[u64; 2]>>;

    /// The device memory the backend's buffer pool holds from the driver
    /// now, in use or kept for reuse (`None` on the CPU backend): it grows
    /// only when an allocation does not fit in what is held.
    fn device_pool(&self) -> Result<Option<u64>>;
}

impl EngineBackend for CpuBackend {
    /// An inline CPU backend (it checks nothing and costs nothing).
    fn for_engine(threads: usize) -> Result<Self> {
        Ok(CpuBackend::with_adamw(
            CpuMode::Inline,
            CpuAdamW::new().with_threads(threads),
        )?)
    }

    /// The backend's own kernels: the device tier is host memory.
    fn host_adamw(&self, _threads: usize) -> CpuAdamW {
        self.adamw_kernels().clone()
    }

    fn device_free(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    fn device_used(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    fn reserve_device(&self, _bytes: u64) -> Result<()> {
        Ok(())
    }

    fn device_id(&self) -> Result<Option<[u64; 2]>> {
        Ok(None)
    }

    fn device_pool(&self) -> Result<Option<u64>> {
        Ok(None)
    }
}
