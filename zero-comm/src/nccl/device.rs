//! [`DeviceCollectives`] over the CUDA backend: NCCL on the backend's own
//! communication stream, ordered by its events and nothing else.
//!
//! ```text
//!   comm ──◆after──[ncclAllReduce / ReduceScatter / AllGather on buf[..n]]──●done
//!                      in place, one NCCL call (DeviceWork::ready)
//!   host: device_sync(done) polls the event and NCCL's async error, bounded
//!         by the timeout (a peer that never calls it aborts the communicator)
//! ```
//!
//! The communicator must run on the backend's communication stream
//! ([`NcclComm::for_backend`]); a collective on a buffer is then ordered
//! exactly as the backend's own operations are, with no cudarc event
//! tracking ([`CudaBackend::raw_view`]) and no host wait: the handle is
//! ready at once, and the host sees a failure in [`NcclComm::sync_event`]
//! (or from the next collective). NCCL moves equal parts per rank: a
//! reduce-scatter or all-gather whose counts differ between ranks is an
//! error naming the counts (the engine's shards are padded to equal
//! lengths). Gradient buckets are f32 (see the [module docs](super) on
//! precision).

use std::sync::Arc;

use zero_core::backend::CudaView;
use zero_core::backend::{
    Backend, BufferHandle, CudaBackend, CudaBackendEvent, CudaBuffer, Stream,
};
use zero_core::Element;

use super::batch::NcclBatch;
use super::comm::NcclComm;
use crate::device::DeviceWork;
use crate::{CommOptions, Communicator, DeviceCollectives, Error, ReduceOp, Result};

/// The in-place collective a device collective runs.
#[derive(Clone, Copy)]
enum Coll {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
}

impl Coll {
    fn record<'a, T: Element>(self, batch: &mut NcclBatch<'a>, view: &'a mut CudaView<'_, T>) {
        match self {
            Coll::AllReduce(op) => batch.all_reduce(view, op),
            Coll::ReduceScatter(op) => batch.reduce_scatter_in_place(view, op),
            Coll::AllGather => batch.all_gather_in_place(view),
        };
    }
}

impl NcclComm {
    /// [`NcclComm::from_communicator`] on `backend`'s GPU and communication
    /// stream: the communicator whose [`DeviceCollectives`] run on
    /// `backend`'s buffers.
    pub fn for_backend<C: Communicator>(
        host: &C,
        backend: &CudaBackend,
        opts: &CommOptions,
    ) -> Result<NcclComm> {
        let stream = Arc::clone(backend.cuda_stream(Stream::Comm));
        NcclComm::from_communicator(host, backend.streams().device(), stream, opts)
    }

    /// An error unless this communicator enqueues on `backend`'s
    /// communication stream.
    fn check_backend(&self, op: &'static str, backend: &CudaBackend) -> Result<()> {
        if Arc::ptr_eq(&self.stream, backend.cuda_stream(Stream::Comm)) {
            Ok(())
        } else {
            Err(Error::InvalidArgument {
                rank: self.rank(),
                op,
                msg: "this NCCL communicator enqueues on another stream than the backend's \
                      communication stream, so the backend's events would not order its \
                      collectives; create it with NcclComm::for_backend"
                    .into(),
            })
        }
    }

    /// The length of an in-place reduce-scatter or all-gather with
    /// `counts`, or why NCCL cannot run it.
    fn equal_counts(&self, op: &'static str, counts: &[usize]) -> Result<usize> {
        let world = self.world_size();
        let invalid = |msg: String| Error::InvalidArgument {
            rank: self.rank(),
            op,
            msg,
        };
        if counts.len() != world {
            return Err(invalid(format!(
                "{} counts given for a world of {world} ranks",
                counts.len()
            )));
        }
        if counts.iter().any(|&c| c != counts[0]) {
            return Err(invalid(format!(
                "NCCL moves equal parts per rank; the counts {counts:?} differ (pad the shards to one length)"
            )));
        }
        Ok(counts[0] * world)
    }

    /// Enqueues `coll` on `buf[..len]` after `after`, on the backend's
    /// communication stream, and hands the buffer back at once with the
    /// event after the collective. Any error fails the communicator (its
    /// peers then fail in their waits instead of hanging).
    fn device_launch<T: Element>(
        &self,
        backend: &CudaBackend,
        op: &'static str,
        mut buf: CudaBuffer<T>,
        len: usize,
        after: &CudaBackendEvent,
        coll: Coll,
    ) -> DeviceWork<CudaBackend, T> {
        let launched = (|| -> Result<CudaBackendEvent> {
            self.check_backend(op, backend)?;
            if len > buf.len() {
                return Err(Error::InvalidArgument {
                    rank: self.rank(),
                    op,
                    msg: format!(
                        "buffer {:?} ({}) has {} elements, the collective needs {len}",
                        buf.label(),
                        buf.id(),
                        buf.len()
                    ),
                });
            }
            backend.wait(Stream::Comm, after)?;
            {
                let mut view = backend.raw_view(Stream::Comm, &mut buf, 0..len)?;
                let mut batch = self.batch();
                coll.record(&mut batch, &mut view);
                batch.launch()?.detach();
            }
            Ok(backend.record(Stream::Comm)?)
        })();
        match launched {
            Ok(done) => DeviceWork::ready(op, buf, done),
            Err(e) => {
                let mut st = self.lock();
                self.fail_locked(&mut st, &e.to_string());
                DeviceWork::refused(op, e)
            }
        }
    }

    /// Waits for `event` (recorded on any of `backend`'s streams after
    /// collectives of this communicator), polling it and NCCL's
    /// asynchronous error: bounded by the communicator's timeout, after
    /// which the communicator is aborted and this returns
    /// [`Error::Timeout`](crate::Error::Timeout).
    pub fn sync_event(&self, event: &CudaBackendEvent) -> Result<()> {
        let seq = self.next_seq(0).saturating_sub(1);
        self.wait_event(None, event.cuda_event(), "device_sync", seq)
    }
}

impl DeviceCollectives<CudaBackend> for NcclComm {
    fn device_alloc<T: Element>(
        &self,
        backend: &CudaBackend,
        len: usize,
        label: &str,
    ) -> Result<CudaBuffer<T>> {
        self.check_backend("device_alloc", backend)?;
        Ok(backend.alloc(len, label)?)
    }

    fn device_all_reduce<T: Element>(
        &self,
        backend: &CudaBackend,
        buf: CudaBuffer<T>,
        len: usize,
        op: ReduceOp,
        after: &CudaBackendEvent,
    ) -> DeviceWork<CudaBackend, T> {
        self.device_launch(backend, "all_reduce", buf, len, after, Coll::AllReduce(op))
    }

    fn device_reduce_scatter<T: Element>(
        &self,
        backend: &CudaBackend,
        buf: CudaBuffer<T>,
        counts: &[usize],
        op: ReduceOp,
        after: &CudaBackendEvent,
    ) -> DeviceWork<CudaBackend, T> {
        const OP: &str = "reduce_scatter";
        match self.equal_counts(OP, counts) {
            Ok(total) => {
                self.device_launch(backend, OP, buf, total, after, Coll::ReduceScatter(op))
            }
            Err(e) => {
                self.fail_locked(&mut self.lock(), &e.to_string());
                DeviceWork::refused(OP, e)
            }
        }
    }

    fn device_all_gather<T: Element>(
        &self,
        backend: &CudaBackend,
        buf: CudaBuffer<T>,
        counts: &[usize],
        after: &CudaBackendEvent,
    ) -> DeviceWork<CudaBackend, T> {
        const OP: &str = "all_gather";
        match self.equal_counts(OP, counts) {
            Ok(total) => self.device_launch(backend, OP, buf, total, after, Coll::AllGather),
            Err(e) => {
                self.fail_locked(&mut self.lock(), &e.to_string());
                DeviceWork::refused(OP, e)
            }
        }
    }

    fn device_sync(&self, _backend: &CudaBackend, event: &CudaBackendEvent) -> Result<()> {
        self.sync_event(event)
    }
}
