//! [`NcclWork`]: the handle of collectives enqueued on the GPU.
//!
//! ```text
//!  launch ─▶ [NCCL kernels] ─▶ event        wait(): look at the event and at
//!            on the comm stream   │          ncclCommGetAsyncError until done,
//!                                 ▼          at most the timeout; then abort
//!                      NcclWork { event } ──▶ Ok / Timeout / NcclError
//! ```

use std::marker::PhantomData;

use cudarc::driver::{CudaEvent, CudaStream};

use super::NcclComm;
use crate::Result;

/// Collectives enqueued on a communication stream, in flight until
/// [`NcclWork::wait`].
///
/// It borrows the communicator and the buffers (`'a`) until it is finished,
/// so neither can be reused or freed while NCCL writes them. Device-side
/// order needs no host wait: cudarc's stream tracking makes later users of
/// the buffers, on any stream, wait for the collectives; the host waits
/// only to see errors, through `wait`.
///
/// Dropping it without waiting waits all the same (bounded by the
/// communicator's timeout; on expiry the communicator is aborted), and an
/// error is not lost: it fails the communicator, so the next collective
/// reports [`Error::Poisoned`](crate::Error::Poisoned).
#[must_use = "collectives run in the background: wait() on the handle to see errors"]
pub struct NcclWork<'a> {
    comm: &'a NcclComm,
    /// Recorded after the collectives; `None` once finished.
    event: Option<CudaEvent>,
    op: &'static str,
    seq: u64,
    ops: usize,
    _buffers: PhantomData<&'a mut [u8]>,
}

impl<'a> NcclWork<'a> {
    pub(crate) fn new(
        comm: &'a NcclComm,
        event: CudaEvent,
        op: &'static str,
        seq: u64,
        ops: usize,
    ) -> Self {
        NcclWork {
            comm,
            event: Some(event),
            op,
            seq,
            ops,
            _buffers: PhantomData,
        }
    }

    /// The collective's name (`"all_reduce"`, ...; `"group"` for a batch of
    /// several).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The sequence number of its first collective (1 is the
    /// communicator's first).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// How many collectives it covers.
    pub fn len(&self) -> usize {
        self.ops
    }

    /// Whether it covers none (an empty batch).
    pub fn is_empty(&self) -> bool {
        self.ops == 0
    }

    /// Whether the GPU has finished it (never blocks; an error or an abort
    /// also counts as finished, and [`NcclWork::wait`] reports it).
    pub fn is_completed(&self) -> bool {
        self.event
            .as_ref()
            .is_none_or(|e| e.try_is_complete().unwrap_or(true))
    }

    /// Makes `stream` wait, on the GPU, for these collectives (e.g. a
    /// compute stream that reads a buffer through a raw pointer, outside
    /// cudarc's tracking). The handle must still be waited for.
    pub fn stream_wait(&self, stream: &CudaStream) -> Result<()> {
        match &self.event {
            Some(e) => stream
                .wait(e)
                .map_err(|err| self.comm.cuda_error(self.op, "cuStreamWaitEvent", err)),
            None => Ok(()),
        }
    }

    /// Lets the collectives run on without a handle: the buffers' borrow
    /// ends, and nothing here waits or looks for errors any more. For
    /// device collectives whose order and completion the caller tracks
    /// through the stream's events, with a bounded wait
    /// ([`NcclComm::wait_event`]) where the host must see the end.
    pub(crate) fn detach(mut self) {
        self.event = None;
    }

    /// Waits until the GPU has finished the collectives.
    ///
    /// Bounded by the communicator's timeout: when they do not finish in
    /// time (a rank did not call them, or called others), the communicator
    /// is aborted and this returns [`Error::Timeout`](crate::Error::Timeout);
    /// an asynchronous NCCL error gives an [`NcclError`](super::NcclError).
    pub fn wait(mut self) -> Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> Result<()> {
        match self.event.take() {
            Some(event) => self.comm.wait_event(None, &event, self.op, self.seq),
            None => Ok(()),
        }
    }
}

impl Drop for NcclWork<'_> {
    fn drop(&mut self) {
        // Bounded; an error has already failed the communicator, which
        // reports it from the next call.
        let _ = self.finish();
    }
}

impl std::fmt::Debug for NcclWork<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclWork")
            .field("op", &self.op)
            .field("seq", &self.seq)
            .field("ops", &self.ops)
            .finish()
    }
}
