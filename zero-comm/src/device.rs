//! Device collectives: all-reduce, reduce-scatter and all-gather on a
//! backend's buffers, ordered by its events.
//!
//! A device collective takes an owned device buffer, starts on the
//! communication stream after an event (the work that produced the data),
//! and hands back the buffer with the event after which its result may be
//! used. It makes no other ordering decision: every stream that touches the
//! buffer afterwards must wait for that event, as for any operation.
//!
//! ```text
//!   compute ──[pack bucket]──●after
//!                             ╲
//!   comm    ───────────────────◆──[all_reduce bucket[..len]]──●done
//!                                                               ╲
//!   compute ─────────────[backward …]────────────────────────────◆──[unpack]
//! ```
//!
//! [`DeviceCollectives`] is implemented for every host [`Communicator`]
//! (threads, MPI) over the CPU backend: the buffer's memory is lent to the
//! communicator ([`CpuBackend::lend`]) as one operation on the communication
//! stream, checked by the hazard checker like any other, and given back
//! under the same id when the host collective completes. Buffers allocated
//! with [`DeviceCollectives::device_alloc`] come from
//! [`Communicator::alloc`] (MPI's shared window), so the collective copies
//! nothing. The NCCL communicator implements it over the CUDA backend,
//! where a collective completes on the stream and [`DeviceWork::ready`]
//! hands the buffer back at once.
//!
//! The methods are named `device_*` so that they never clash with the
//! host collectives of [`Communicator`] when both traits are in scope.

use std::ops::Range;

use zero_core::backend::{
    AccessKind, Backend, BufferHandle, CpuBackend, CpuBuffer, CpuEvent, Stream,
};
use zero_core::{Element, HostBuffer};

use crate::communicator::RawOp;
use crate::counts::offsets;
use crate::{Communicator, Error, OpTiming, ReduceOp, Result, Work};

/// A device collective in flight: [`wait`](DeviceWork::wait) gives back the
/// buffer and the event after which its result may be used.
///
/// On the CPU backend the host collective runs on the communicator's
/// progress thread and `wait` blocks until it finished; on a device whose
/// collectives run on a stream it is ready at once. Either way the buffer's
/// next users must wait for the returned event. Dropping the handle without
/// waiting blocks until the collective ended (as [`Work`] does) and then
/// drops the buffer.
#[must_use = "a device collective runs in the background: wait() on its handle to get the buffer and its completion event back"]
pub struct DeviceWork<B: Backend, T: Element> {
    op: &'static str,
    state: State<B, T>,
}

/// What a completed collective gives back: the buffer and the event after
/// which its result may be used.
type Done<B, T> = (<B as Backend>::Buffer<T>, <B as Backend>::Event);

enum State<B: Backend, T: Element> {
    Ready(B::Buffer<T>, B::Event),
    Host(Work<Result<Done<B, T>>>),
    /// Refused before it started; the notice tells the peers (so that they
    /// fail instead of waiting for this rank).
    Failed(Error, Option<Work<()>>),
}

impl<B: Backend, T: Element> DeviceWork<B, T> {
    /// A collective that completes on the device: `buf` may be used by
    /// work that waits for `done`.
    pub fn ready(op: &'static str, buf: B::Buffer<T>, done: B::Event) -> Self {
        DeviceWork {
            op,
            state: State::Ready(buf, done),
        }
    }

    /// A collective whose host part runs as `work`, which gives back the
    /// buffer and its completion event (or why not) when waited on.
    pub(crate) fn host(op: &'static str, work: Work<Result<Done<B, T>>>) -> Self {
        DeviceWork {
            op,
            state: State::Host(work),
        }
    }

    /// A collective refused before it started whose peers learn of it
    /// otherwise (a device communicator that failed itself).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn refused(op: &'static str, e: Error) -> Self {
        DeviceWork {
            op,
            state: State::Failed(e, None),
        }
    }

    /// The collective's name, e.g. `"all_reduce"`.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Whether the collective was refused before it started (bad
    /// arguments, a hazard on the buffer): [`wait`](DeviceWork::wait)
    /// then returns why, once the peers were told. A caller that reports
    /// the refusal at once gets this error rather than a later
    /// collective's "the communicator failed earlier".
    pub fn is_refused(&self) -> bool {
        matches!(self.state, State::Failed(..))
    }

    /// Whether [`wait`](DeviceWork::wait) would return without blocking.
    pub fn is_completed(&self) -> bool {
        match &self.state {
            State::Ready(..) => true,
            State::Host(w) => w.is_completed(),
            State::Failed(_, notice) => notice.as_ref().is_none_or(|n| n.is_completed()),
        }
    }

    /// Waits for the host side of the collective (nothing to wait for on a
    /// device) and returns the buffer and the event after which its result
    /// may be used. Errors: the collective's (timeouts, peers that failed,
    /// mismatched arguments), or why it was refused before it started (e.g.
    /// [`zero_core::Error::Hazard`] when the buffer was not ready after the
    /// given event).
    pub fn wait(self) -> Result<(B::Buffer<T>, B::Event)> {
        self.wait_timed().map(|(r, _)| r)
    }

    /// Like [`wait`](DeviceWork::wait), and also says when the host
    /// collective ran on the progress thread (`None` on a device, or if it
    /// never started).
    pub fn wait_timed(self) -> Result<(Done<B, T>, Option<OpTiming>)> {
        match self.state {
            State::Ready(buf, done) => Ok(((buf, done), None)),
            State::Host(work) => {
                let (r, timing) = work.wait_timed()?;
                Ok((r?, timing))
            }
            State::Failed(e, notice) => {
                if let Some(n) = notice {
                    // It reports the same failure to the peers; its own
                    // error says nothing new here.
                    let _ = n.wait();
                }
                Err(e)
            }
        }
    }
}

impl<B: Backend, T: Element> std::fmt::Debug for DeviceWork<B, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceWork").field("op", &self.op).finish()
    }
}

/// Collectives on device buffers of backend `B`, each starting on the
/// communication stream after an event and completing with one.
///
/// All ranks must issue the same collectives in the same order, as with
/// [`Communicator`]. A collective refused on one rank (bad arguments, a
/// hazard) fails the communicator, so its peers get an error instead of
/// waiting.
pub trait DeviceCollectives<B: Backend> {
    /// A zeroed device buffer of `len` elements that this communicator's
    /// collectives serve best (for MPI over the CPU backend: inside the
    /// node's shared window).
    fn device_alloc<T: Element>(
        &self,
        backend: &B,
        len: usize,
        label: &str,
    ) -> Result<B::Buffer<T>>;

    /// Reduces `buf[..len]` over all ranks, in place, on the communication
    /// stream after `after`.
    fn device_all_reduce<T: Element>(
        &self,
        backend: &B,
        buf: B::Buffer<T>,
        len: usize,
        op: ReduceOp,
        after: &B::Event,
    ) -> DeviceWork<B, T>;

    /// Reduce-scatter in place on `buf[..sum(counts)]`: rank r's reduced
    /// part lands at `offset(r)..offset(r) + counts[r]`; the other parts are
    /// left as they were. After `after`, on the communication stream.
    fn device_reduce_scatter<T: Element>(
        &self,
        backend: &B,
        buf: B::Buffer<T>,
        counts: &[usize],
        op: ReduceOp,
        after: &B::Event,
    ) -> DeviceWork<B, T>;

    /// All-gather in place on `buf[..sum(counts)]`: rank r's part, already
    /// at `offset(r)..offset(r) + counts[r]`, reaches every rank. After
    /// `after`, on the communication stream.
    fn device_all_gather<T: Element>(
        &self,
        backend: &B,
        buf: B::Buffer<T>,
        counts: &[usize],
        after: &B::Event,
    ) -> DeviceWork<B, T>;

    /// Blocks the host until `event` completed, where the work before it
    /// may include this communicator's collectives: bounded by the
    /// communicator's timeout where collectives complete on the device (a
    /// peer that never joins fails this wait, and the communicator, instead
    /// of hanging it), the backend's own [`sync`](Backend::sync) otherwise
    /// (host collectives completed before their handles gave the buffers
    /// back).
    fn device_sync(&self, backend: &B, event: &B::Event) -> Result<()> {
        Ok(backend.sync(event)?)
    }
}

impl<C: Communicator> DeviceCollectives<CpuBackend> for C {
    fn device_alloc<T: Element>(
        &self,
        backend: &CpuBackend,
        len: usize,
        label: &str,
    ) -> Result<CpuBuffer<T>> {
        backend.alloc_with(len, label, |n| self.alloc(n))
    }

    fn device_all_reduce<T: Element>(
        &self,
        backend: &CpuBackend,
        buf: CpuBuffer<T>,
        len: usize,
        op: ReduceOp,
        after: &CpuEvent,
    ) -> DeviceWork<CpuBackend, T> {
        let accesses = vec![(0..len.min(buf.len()), AccessKind::Write)];
        on_host(
            self,
            backend,
            "all_reduce",
            buf,
            len,
            accesses,
            after,
            |host| self.all_reduce(host, op),
        )
    }

    fn device_reduce_scatter<T: Element>(
        &self,
        backend: &CpuBackend,
        buf: CpuBuffer<T>,
        counts: &[usize],
        op: ReduceOp,
        after: &CpuEvent,
    ) -> DeviceWork<CpuBackend, T> {
        let (total, accesses) = in_place_accesses(self, &buf, counts, AccessKind::Read);
        on_host(
            self,
            backend,
            "reduce_scatter",
            buf,
            total,
            accesses,
            after,
            |host| self.reduce_scatter_in_place(host, counts, op),
        )
    }

    fn device_all_gather<T: Element>(
        &self,
        backend: &CpuBackend,
        buf: CpuBuffer<T>,
        counts: &[usize],
        after: &CpuEvent,
    ) -> DeviceWork<CpuBackend, T> {
        let (total, accesses) = in_place_accesses(self, &buf, counts, AccessKind::Write);
        on_host(
            self,
            backend,
            "all_gather",
            buf,
            total,
            accesses,
            after,
            |host| self.all_gather_in_place(host, counts),
        )
    }
}

/// The length and the declared accesses of an in-place reduce-scatter or
/// all-gather: this rank's part is written (reduce-scatter) or read
/// (all-gather), the rest of `..sum(counts)` is accessed as `others`. With
/// counts that do not fit, the whole buffer is declared written and the
/// communicator reports the arguments in sequence.
fn in_place_accesses<C: Communicator, T: Element>(
    comm: &C,
    buf: &CpuBuffer<T>,
    counts: &[usize],
    others: AccessKind,
) -> (usize, Vec<(Range<usize>, AccessKind)>) {
    let total: usize = counts.iter().sum();
    let rank = comm.rank();
    if counts.len() != comm.world_size() || total > buf.len() {
        return (total, vec![(0..buf.len(), AccessKind::Write)]);
    }
    let own = match others {
        AccessKind::Read => AccessKind::Write,
        AccessKind::Write => AccessKind::Read,
    };
    let at = offsets(counts)[rank];
    let end = at + counts[rank];
    let accesses = [(0..at, others), (at..end, own), (end..total, others)]
        .into_iter()
        .filter(|(r, _)| !r.is_empty())
        .collect();
    (total, accesses)
}

/// Runs a host collective on the memory of `buf[..len]`: `comm`'s
/// communication stream waits for `after`, the memory is lent as operation
/// `op` with `accesses`, `start` issues the collective on it, and the
/// handle gives the buffer back when the collective completes.
#[allow(clippy::too_many_arguments)]
fn on_host<C: Communicator, T: Element>(
    comm: &C,
    backend: &CpuBackend,
    op: &'static str,
    buf: CpuBuffer<T>,
    len: usize,
    accesses: Vec<(Range<usize>, AccessKind)>,
    after: &CpuEvent,
    start: impl FnOnce(HostBuffer<T>) -> Work<HostBuffer<T>>,
) -> DeviceWork<CpuBackend, T> {
    let lent = backend
        .wait(Stream::Comm, after)
        .and_then(|()| backend.lend(Stream::Comm, op, buf, &accesses));
    let (loan, mut host) = match lent {
        Ok(lent) => lent,
        Err(e) => return refuse(comm, op, e.into()),
    };
    // A prefix of the buffer takes part (a bucket not filled to capacity).
    if host.set_len(len).is_err() {
        let msg = format!(
            "buffer {:?} ({}) has {} elements, the collective needs {len}",
            loan.label(),
            loan.id(),
            loan.len()
        );
        drop((loan, host));
        return refuse(
            comm,
            op,
            Error::InvalidArgument {
                rank: comm.rank(),
                op,
                msg,
            },
        );
    }
    let backend = backend.clone();
    let work = start(host).map(move |host| Ok(backend.give_back(loan, host)?));
    DeviceWork::host(op, work)
}

/// A collective refused before it started: the error for this rank, and an
/// error in the communicator's sequence for the peers (which would
/// otherwise wait for this rank until their timeout).
pub(crate) fn refuse<C: Communicator, B: Backend, T: Element>(
    comm: &C,
    op: &'static str,
    e: Error,
) -> DeviceWork<B, T> {
    let notice = comm.submit(RawOp::barrier(
        Vec::new(),
        Some(Error::InvalidArgument {
            rank: comm.rank(),
            op,
            msg: e.to_string(),
        }),
    ));
    DeviceWork {
        op,
        state: State::Failed(e, Some(notice.map(|_| ()))),
    }
}
