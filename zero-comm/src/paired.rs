//! A host communicator paired with device collectives from another object:
//! what an engine on a GPU talks through.
//!
//! An engine needs two kinds of collectives: host ones (to agree on a
//! setup, to exchange flags, norms and failures) and device ones on its
//! backend's buffers (gradient reductions, parameter all-gathers). On the
//! CPU backend every [`Communicator`] has both. On a GPU the device
//! collectives come from elsewhere: [`NcclComm`](crate::NcclComm) (one GPU
//! per rank) or [`HostStaged`](crate::HostStaged) (several ranks sharing a
//! GPU, through pinned host memory). [`Paired`] puts the two together: a
//! [`Communicator`] through `host`, and the device collectives of `device`
//! on the CUDA backend.
//!
//! ```
//! use std::sync::Arc;
//! use zero_comm::{Communicator, HostStaged, Paired, ThreadGroup};
//!
//! let ranks = ThreadGroup::run(2, |comm| {
//!     // One host communicator, shared by the pair and the staging.
//!     let comm = Arc::new(comm);
//!     let both = Paired::new(comm.clone(), HostStaged::new(comm));
//!     (both.rank(), both.world_size())
//! })
//! .unwrap();
//! assert_eq!(ranks, vec![(0, 2), (1, 2)]);
//! ```

use std::any::Any;
use std::sync::Arc;

use zero_core::{Element, HostBuffer};

use crate::{Communicator, RawOp, Result, Work};

/// Host collectives through `host`, device collectives through `device`
/// (see the [module docs](self)). Both must span the same ranks in the
/// same order: build `device` from the same group as `host` (a
/// [`HostStaged`](crate::HostStaged) over a clone of the shared `host`, or
/// an [`NcclComm`](crate::NcclComm) bootstrapped over it).
#[derive(Debug)]
pub struct Paired<C, D> {
    host: C,
    device: D,
}

impl<C: Communicator, D> Paired<C, D> {
    /// Pairs `host` with `device`.
    pub fn new(host: C, device: D) -> Self {
        Paired { host, device }
    }

    /// The host communicator.
    pub fn host(&self) -> &C {
        &self.host
    }

    /// What the device collectives run on.
    pub fn device(&self) -> &D {
        &self.device
    }
}

impl<C: Communicator, D: Send + Sync> Communicator for Paired<C, D> {
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn world_size(&self) -> usize {
        self.host.world_size()
    }
    fn backend(&self) -> &'static str {
        self.host.backend()
    }
    fn ranks_on_host(&self) -> usize {
        self.host.ranks_on_host()
    }
    fn alloc<T: Element>(&self, len: usize) -> Result<HostBuffer<T>> {
        self.host.alloc(len)
    }
    fn submit(&self, op: RawOp) -> Work<Vec<Box<dyn Any + Send>>> {
        self.host.submit(op)
    }
}

/// A shared communicator is the communicator (one rank's collectives are
/// issued from one thread, in order, whichever handle issues them).
impl<C: Communicator> Communicator for Arc<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn backend(&self) -> &'static str {
        (**self).backend()
    }
    fn ranks_on_host(&self) -> usize {
        (**self).ranks_on_host()
    }
    fn alloc<T: Element>(&self, len: usize) -> Result<HostBuffer<T>> {
        (**self).alloc(len)
    }
    fn submit(&self, op: RawOp) -> Work<Vec<Box<dyn Any + Send>>> {
        (**self).submit(op)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use zero_core::backend::{CudaBackend, CudaBackendEvent, CudaBuffer};
    use zero_core::Element;

    use super::Paired;
    use crate::{Communicator, DeviceCollectives, DeviceWork, ReduceOp, Result};

    /// The device collectives of `device` (the CPU backend's come with
    /// every [`Communicator`], `host` included).
    impl<C: Communicator, D: DeviceCollectives<CudaBackend>> DeviceCollectives<CudaBackend>
        for Paired<C, D>
    {
        fn device_alloc<T: Element>(
            &self,
            backend: &CudaBackend,
            len: usize,
            label: &str,
        ) -> Result<CudaBuffer<T>> {
            self.device.device_alloc(backend, len, label)
        }

        fn device_all_reduce<T: Element>(
            &self,
            backend: &CudaBackend,
            buf: CudaBuffer<T>,
            len: usize,
            op: ReduceOp,
            after: &CudaBackendEvent,
        ) -> DeviceWork<CudaBackend, T> {
            self.device.device_all_reduce(backend, buf, len, op, after)
        }

        fn device_reduce_scatter<T: Element>(
            &self,
            backend: &CudaBackend,
            buf: CudaBuffer<T>,
            counts: &[usize],
            op: ReduceOp,
            after: &CudaBackendEvent,
        ) -> DeviceWork<CudaBackend, T> {
            self.device
                .device_reduce_scatter(backend, buf, counts, op, after)
        }

        fn device_all_gather<T: Element>(
            &self,
            backend: &CudaBackend,
            buf: CudaBuffer<T>,
            counts: &[usize],
            after: &CudaBackendEvent,
        ) -> DeviceWork<CudaBackend, T> {
            self.device.device_all_gather(backend, buf, counts, after)
        }

        fn device_sync(&self, backend: &CudaBackend, event: &CudaBackendEvent) -> Result<()> {
            self.device.device_sync(backend, event)
        }
    }
}
