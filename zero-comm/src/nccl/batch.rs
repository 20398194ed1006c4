//! [`NcclBatch`]: collectives recorded and checked first, then launched
//! together inside one `ncclGroupStart`/`ncclGroupEnd`.
//!
//! ```text
//!  record (no GPU work):  op 1 ─ check ─┐   op 2 ─ check ─┐   ...
//!                         pointers + stream-order guards   ▼
//!  launch:  lock ─ [validate] ─ ncclGroupStart ─ op 1, op 2, ... ─ ncclGroupEnd
//!           ─ poll until enqueued ─ record event ─ unlock ─ guards record the
//!           buffers' read/write events (later users wait for NCCL)  ─▶ NcclWork
//! ```
//!
//! A group lets NCCL fuse the launches of many bucket collectives (one
//! kernel launch for the group instead of one per bucket) and gives the
//! batch a single completion event. If any recorded op has bad arguments,
//! nothing is enqueued at all.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::sys;
use zero_core::Element;

use super::check::{plan, Coll, Operand, Plan, Site};
use super::comm::{call_failure_of, NcclComm};
use super::enqueue::{enqueue, grouped, Launch};
use super::validate;
use super::work::NcclWork;
use crate::{Error, ReduceOp, Result};

/// Collectives recorded on one [`NcclComm`], launched together by
/// [`NcclBatch::launch`] in one NCCL group (see [`NcclComm::group`]).
///
/// Recording checks the arguments and enqueues nothing; the buffers stay
/// borrowed until the returned [`NcclWork`] is finished.
#[must_use = "a batch enqueues nothing until launch()"]
pub struct NcclBatch<'a> {
    comm: &'a NcclComm,
    ops: Vec<Launch>,
    /// cudarc's stream-order guards of the buffers: dropped after the
    /// launch, they record the buffers' read/write events on the
    /// communication stream, behind NCCL's kernels.
    guards: Vec<SyncOnDrop<'a>>,
    /// The first argument error.
    error: Option<Error>,
}

fn operand<T: Element, B: DeviceSlice<T> + ?Sized>(b: &B) -> Operand {
    Operand {
        dtype: T::DTYPE,
        len: b.len(),
        ordinal: b.stream().context().ordinal(),
    }
}

impl<'a> NcclBatch<'a> {
    pub(crate) fn new(comm: &'a NcclComm) -> Self {
        NcclBatch {
            comm,
            ops: Vec::new(),
            guards: Vec::new(),
            error: None,
        }
    }

    /// Number of collectives recorded.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether none is recorded.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Records [`NcclComm::all_reduce`].
    pub fn all_reduce<T: Element, B: DevicePtrMut<T>>(
        &mut self,
        buf: &'a mut B,
        op: ReduceOp,
    ) -> &mut Self {
        let p = self.check("all_reduce", Coll::AllReduce, operand(buf), None);
        self.push_in_place("all_reduce", Some(op), p, buf)
    }

    /// Records [`NcclComm::all_reduce_into`].
    pub fn all_reduce_into<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
    ) -> &mut Self {
        let name = "all_reduce_into";
        let p = self.check(name, Coll::AllReduce, operand(send), Some(operand(recv)));
        self.push(name, Some(op), p, send, recv)
    }

    /// Records [`NcclComm::reduce_scatter`].
    pub fn reduce_scatter<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
    ) -> &mut Self {
        let name = "reduce_scatter";
        let p = self.check(
            name,
            Coll::ReduceScatter,
            operand(send),
            Some(operand(recv)),
        );
        self.push(name, Some(op), p, send, recv)
    }

    /// Records [`NcclComm::reduce_scatter_in_place`].
    pub fn reduce_scatter_in_place<T: Element, B: DevicePtrMut<T>>(
        &mut self,
        buf: &'a mut B,
        op: ReduceOp,
    ) -> &mut Self {
        let name = "reduce_scatter_in_place";
        let p = self.check(name, Coll::ReduceScatter, operand(buf), None);
        self.push_in_place(name, Some(op), p, buf)
    }

    /// Records [`NcclComm::all_gather`].
    pub fn all_gather<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        send: &'a S,
        recv: &'a mut R,
    ) -> &mut Self {
        let name = "all_gather";
        let p = self.check(name, Coll::AllGather, operand(send), Some(operand(recv)));
        self.push(name, None, p, send, recv)
    }

    /// Records [`NcclComm::all_gather_in_place`].
    pub fn all_gather_in_place<T: Element, B: DevicePtrMut<T>>(
        &mut self,
        buf: &'a mut B,
    ) -> &mut Self {
        let name = "all_gather_in_place";
        let p = self.check(name, Coll::AllGather, operand(buf), None);
        self.push_in_place(name, None, p, buf)
    }

    fn check(
        &self,
        name: &'static str,
        coll: Coll,
        send: Operand,
        recv: Option<Operand>,
    ) -> Result<Plan> {
        let site = Site {
            rank: self.comm.rank(),
            world: self.comm.world_size(),
            ordinal: self.comm.ordinal(),
        };
        plan(coll, name, site, send, recv)
    }

    fn stream(&self) -> &'a CudaStream {
        let comm: &'a NcclComm = self.comm;
        &comm.stream
    }

    fn push_in_place<T, B: DevicePtrMut<T>>(
        &mut self,
        name: &'static str,
        reduce: Option<ReduceOp>,
        plan: Result<Plan>,
        buf: &'a mut B,
    ) -> &mut Self {
        match plan {
            Err(e) => {
                self.error.get_or_insert(e);
            }
            Ok(plan) => {
                let (ptr, guard) = buf.device_ptr_mut(self.stream());
                self.record::<T>(name, reduce, plan, ptr, ptr);
                self.guards.push(guard);
            }
        }
        self
    }

    fn push<T, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        name: &'static str,
        reduce: Option<ReduceOp>,
        plan: Result<Plan>,
        send: &'a S,
        recv: &'a mut R,
    ) -> &mut Self {
        match plan {
            Err(e) => {
                self.error.get_or_insert(e);
            }
            Ok(plan) => {
                let stream = self.stream();
                let (s, gs) = send.device_ptr(stream);
                let (r, gr) = recv.device_ptr_mut(stream);
                self.record::<T>(name, reduce, plan, s, r);
                self.guards.extend([gs, gr]);
            }
        }
        self
    }

    fn record<T>(
        &mut self,
        name: &'static str,
        reduce: Option<ReduceOp>,
        plan: Plan,
        send: u64,
        recv: u64,
    ) {
        let size = std::mem::size_of::<T>() as u64;
        self.ops.push(Launch {
            name,
            plan,
            reduce,
            send: send + plan.send_offset as u64 * size,
            recv: recv + plan.recv_offset as u64 * size,
        });
    }

    /// Enqueues every recorded collective on the communication stream in
    /// one NCCL group and returns the handle that waits for them.
    ///
    /// Errors, all before anything runs on the GPU: the first argument
    /// error of a recorded collective; [`Error::Poisoned`] when the
    /// communicator failed earlier; [`Error::Mismatch`] with
    /// [`CommOptions::validate`](crate::CommOptions::validate). An NCCL
    /// error or an enqueue that does not finish within the timeout aborts
    /// the communicator. Any error fails the communicator (its peers, which
    /// may have launched, time out).
    pub fn launch(self) -> Result<NcclWork<'a>> {
        let NcclBatch {
            comm,
            ops,
            guards,
            error,
        } = self;
        let name = match ops.len() {
            1 => ops[0].name,
            _ => "group",
        };
        let seq = comm.next_seq(ops.len().max(1));
        let mut st = comm.lock();
        comm.check_poisoned(&st, name, seq)?;
        if let Some(e) = error {
            comm.fail_locked(&mut st, &e.to_string());
            return Err(e);
        }
        if let Err(e) = comm.bind(name) {
            comm.fail_locked(&mut st, &e.to_string());
            return Err(e);
        }
        if comm.opts.validate {
            validate::exchange(comm, &mut st, &ops, name, seq)?;
        }
        // Empty buffers are skipped on every rank alike.
        let live: Vec<&Launch> = ops.iter().filter(|l| l.plan.count > 0).collect();
        if !live.is_empty() {
            let raw = st.raw;
            let stream = comm.stream.cu_stream() as sys::cudaStream_t;
            let r = grouped(|| {
                live.iter().try_for_each(|l| {
                    // SAFETY: `raw` is live (not poisoned, under the lock);
                    // the addresses point into buffers borrowed for 'a by
                    // this batch, on this GPU, and the plan checked that
                    // they hold the counts NCCL reads and writes; `stream`
                    // is the communication stream of this device.
                    unsafe { enqueue(l, raw, stream) }
                })
            });
            if let Err((call, r)) = r {
                let e = comm.nccl_error(name, call_failure_of(&st, call, r));
                comm.fail_locked(&mut st, &e.to_string());
                return Err(e.into());
            }
            comm.wait_enqueued_locked(&mut st, name, seq)?;
        }
        let event = match comm.stream.record_event(None) {
            Ok(ev) => ev,
            Err(e) => {
                let e = comm.cuda_error(name, "cuEventRecord", e);
                comm.fail_locked(&mut st, &e.to_string());
                return Err(e);
            }
        };
        drop(st);
        // Now that NCCL's kernels are on the stream: later users of the
        // buffers (on any stream) wait for them.
        drop(guards);
        Ok(NcclWork::new(comm, event, name, seq, ops.len()))
    }
}

impl std::fmt::Debug for NcclBatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBatch")
            .field("rank", &self.comm.rank())
            .field("ops", &self.ops.iter().map(|l| l.name).collect::<Vec<_>>())
            .field("error", &self.error)
            .finish()
    }
}
