//! Collectives over memory that all ranks of a node can read: the threads
//! of one process, or the processes of one node through an MPI-3 shared
//! window.
//!
//! Every rank has a `ControlSlot` (one cache line pair) in memory visible to
//! all. A collective with sequence number `s` runs in two phases:
//!
//! ```text
//!  rank r                                   every peer p
//!  ──────                                   ────────────
//!  write descriptor + buffer addresses
//!  arrived[r] = s  ───────────────────────▶ waits until arrived[*] >= s ("entry")
//!  wait until arrived[*] >= s
//!  compare descriptors (mismatch → error on every rank, nothing moved)
//!  move data: read peers' buffers directly, write own share (algorithm files)
//!  done[r] = s     ───────────────────────▶ waits until done[*] >= s ("exit")
//!  wait until done[*] >= s
//!  return the buffers to the caller
//! ```
//!
//! Each wait has a deadline (timeout error naming the collective, its
//! sequence number and which ranks arrived) and watches the peers' state
//! word, so a peer that failed or left turns into an error at once. The exit
//! phase also guarantees that no rank reuses a buffer or descriptor another
//! rank may still read.

mod all_gather;
mod all_reduce;
#[cfg(feature = "mpi")]
pub(crate) use all_reduce::chunk;
mod broadcast;
mod reduce_scatter;

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zero_core::{bf16, f16, DType, Element};

use crate::op::{Elem, OpDesc, OpKind};
use crate::{Error, Result};

// State words: 0 means the slot has not been initialised yet.
/// The rank is part of the group.
pub(crate) const STATE_ALIVE: u64 = 1;
/// The rank dropped its communicator.
pub(crate) const STATE_LEFT: u64 = 2;
/// The rank hit an error or panicked; its communicator is unusable.
pub(crate) const STATE_FAILED: u64 = 3;

/// Per-rank control words, shared by all ranks of a group. All-zero bytes
/// are a valid (unset) slot, so a freshly mapped shared window can hold them.
#[repr(C, align(128))]
#[derive(Default)]
pub(crate) struct ControlSlot {
    arrived: AtomicU64,
    done: AtomicU64,
    state: AtomicU64,
    pid: AtomicU64,
    desc: [AtomicU64; 3],
    send: AtomicU64,
    recv: AtomicU64,
}

impl ControlSlot {
    /// The process id its rank stored when it joined (0 before that).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn pid(&self) -> u64 {
        self.pid.load(Ordering::Relaxed)
    }

    fn desc_words(&self) -> [u64; 3] {
        [0, 1, 2].map(|i| self.desc[i].load(Ordering::Relaxed))
    }
}

/// How a group's ranks see each other's memory.
pub(crate) trait ShmMemory: Send + Sync {
    /// Encodes a pointer of this rank's so that peers can [`resolve`] it.
    ///
    /// [`resolve`]: ShmMemory::resolve
    fn publish(&self, ptr: *const u8) -> u64;
    /// The address, in this process, of what `local_rank` published.
    fn resolve(&self, local_rank: usize, word: u64) -> *mut u8;
    /// Why `local_rank` is known to be dead (its process exited), if it is.
    fn peer_dead(&self, _local_rank: usize) -> Option<String> {
        None
    }
}

/// Same address space: a pointer is its own encoding.
pub(crate) struct SameProcess;

impl ShmMemory for SameProcess {
    fn publish(&self, ptr: *const u8) -> u64 {
        ptr as u64
    }
    fn resolve(&self, _local_rank: usize, word: u64) -> *mut u8 {
        word as *mut u8
    }
}

/// One rank's view of a shared-memory group.
pub(crate) struct ShmGroup {
    slots: *const ControlSlot,
    size: usize,
    rank: usize,
    /// The rank number to print for each local rank (its global rank).
    labels: Vec<usize>,
    mem: Arc<dyn ShmMemory>,
    timeout: Duration,
    /// Keeps the memory behind `slots` alive.
    _keep: Arc<dyn Any + Send + Sync>,
}

// SAFETY: the slots are atomics designed for concurrent access from every
// rank; the pointer stays valid while `_keep` lives.
unsafe impl Send for ShmGroup {}
// SAFETY: as above; all shared state is atomic.
unsafe impl Sync for ShmGroup {}

/// Type-erased pointers to one rank's buffers for a collective.
#[derive(Clone, Copy)]
pub(crate) struct Bufs {
    pub send: *const u8,
    pub recv: *mut u8,
}

impl ShmGroup {
    /// # Safety
    /// `slots` must point to `size` initialised (possibly all-zero)
    /// `ControlSlot`s that stay valid while `keep` lives and are shared by the
    /// group's ranks, each rank using its own index.
    pub(crate) unsafe fn new(
        slots: *const ControlSlot,
        size: usize,
        rank: usize,
        labels: Vec<usize>,
        mem: Arc<dyn ShmMemory>,
        timeout: Duration,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        assert!(rank < size && labels.len() == size);
        Self {
            slots,
            size,
            rank,
            labels,
            mem,
            timeout,
            _keep: keep,
        }
    }

    fn slot(&self, r: usize) -> &ControlSlot {
        debug_assert!(r < self.size);
        // SAFETY: r < size and the slots live as long as self (constructor).
        unsafe { &*self.slots.add(r) }
    }

    /// Marks this rank alive (resets its counters: call once at start-up,
    /// before any peer can wait on it).
    pub(crate) fn join(&self) {
        let s = self.slot(self.rank);
        s.arrived.store(0, Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        s.pid
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        s.state.store(STATE_ALIVE, Ordering::Release);
    }

    /// Marks this rank as gone (`STATE_LEFT` or `STATE_FAILED`).
    pub(crate) fn set_state(&self, state: u64) {
        self.slot(self.rank).state.store(state, Ordering::Release);
    }

    /// Number of ranks in the group.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// This rank's index in the group.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Runs collective `seq` with this rank's buffers (see the module doc).
    ///
    /// # Safety
    /// `bufs` must be valid for the sizes `desc`/`counts` imply (send for
    /// reading, recv for writing) until this returns, and may be read or
    /// written by peers meanwhile; the caller must not touch them.
    pub(crate) unsafe fn run(
        &self,
        seq: u64,
        desc: &OpDesc,
        counts: &[usize],
        bufs: Bufs,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller; `dispatch` is the algorithm
        // that `desc` names, which stays within the published buffers.
        unsafe {
            self.run_with(seq, desc, counts, bufs, |ctx| {
                dispatch_dtype(ctx);
                Ok(())
            })
        }
    }

    /// [`ShmGroup::run`] with another data movement: `body` runs between the
    /// entry and exit phases, with every rank's resolved buffers, instead of
    /// the algorithm `desc` names. If it fails, this rank does not finish
    /// the exit phase (its peers see it fail through its state word).
    ///
    /// # Safety
    /// As for [`ShmGroup::run`]; in addition `body` must only touch ranges
    /// of the peers' buffers that no other rank's `body` touches.
    pub(crate) unsafe fn run_with(
        &self,
        seq: u64,
        desc: &OpDesc,
        counts: &[usize],
        bufs: Bufs,
        body: impl FnOnce(&Ctx<'_>) -> Result<()>,
    ) -> Result<()> {
        let me = self.slot(self.rank);
        for (w, v) in me.desc.iter().zip(desc.words()) {
            w.store(v, Ordering::Relaxed);
        }
        me.send
            .store(self.mem.publish(bufs.send), Ordering::Relaxed);
        me.recv
            .store(self.mem.publish(bufs.recv), Ordering::Relaxed);
        me.arrived.store(seq, Ordering::Release);

        self.wait_all(seq, desc, "entry", |s| &s.arrived)?;
        self.validate(seq, desc)?;

        let peers: Vec<Bufs> = (0..self.size)
            .map(|p| {
                if p == self.rank {
                    bufs
                } else {
                    let s = self.slot(p);
                    Bufs {
                        send: self.mem.resolve(p, s.send.load(Ordering::Relaxed)),
                        recv: self.mem.resolve(p, s.recv.load(Ordering::Relaxed)),
                    }
                }
            })
            .collect();
        let ctx = Ctx {
            rank: self.rank,
            peers: &peers,
            counts,
            desc,
        };
        // Every rank published buffers valid for the agreed sizes
        // (descriptors matched) and keeps them alive until the exit phase;
        // the body writes only ranges no other rank reads or writes.
        body(&ctx)?;

        me.done.store(seq, Ordering::Release);
        self.wait_all(seq, desc, "exit", |s| &s.done)
    }

    fn validate(&self, seq: u64, desc: &OpDesc) -> Result<()> {
        let mine = desc.words();
        let differs = (0..self.size).any(|p| self.slot(p).desc_words() != mine);
        if !differs {
            return Ok(());
        }
        let detail = (0..self.size)
            .map(|p| {
                format!(
                    "rank {} called {}",
                    self.labels[p],
                    OpDesc::describe_words(self.slot(p).desc_words())
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        Err(Error::Mismatch {
            rank: self.labels[self.rank],
            seq,
            detail,
        })
    }

    fn wait_all(
        &self,
        seq: u64,
        desc: &OpDesc,
        phase: &'static str,
        counter: impl Fn(&ControlSlot) -> &AtomicU64,
    ) -> Result<()> {
        let start = Instant::now();
        let mut next = 0;
        let mut polls: u32 = 0;
        loop {
            while next < self.size {
                let s = self.slot(next);
                if counter(s).load(Ordering::Acquire) >= seq {
                    next += 1;
                    continue;
                }
                let state = s.state.load(Ordering::Acquire);
                // The peer may have passed this point and then left between
                // the two loads: it bumps its counter before it changes its
                // state, so a second look at the counter, after the state,
                // tells a peer that left after this phase from one that left
                // before it.
                if (state == STATE_FAILED || state == STATE_LEFT)
                    && counter(s).load(Ordering::Acquire) < seq
                {
                    return Err(Error::PeerFailed {
                        rank: self.labels[self.rank],
                        op: desc.name(),
                        seq,
                        peer: self.labels[next],
                        reason: if state == STATE_FAILED {
                            "failed (it reported an error or panicked)".into()
                        } else {
                            "has left the group (its communicator was dropped)".into()
                        },
                    });
                }
                break;
            }
            if next == self.size {
                return Ok(());
            }
            polls = polls.wrapping_add(1);
            let waited = start.elapsed();
            if polls.is_multiple_of(32) {
                if let Some(reason) = self.mem.peer_dead(next) {
                    return Err(Error::PeerFailed {
                        rank: self.labels[self.rank],
                        op: desc.name(),
                        seq,
                        peer: self.labels[next],
                        reason,
                    });
                }
                if waited >= self.timeout {
                    let (arrived, missing): (Vec<usize>, Vec<usize>) = (0..self.size)
                        .partition(|&p| counter(self.slot(p)).load(Ordering::Acquire) >= seq);
                    return Err(Error::Timeout {
                        rank: self.labels[self.rank],
                        op: desc.name(),
                        seq,
                        phase,
                        waited,
                        arrived: arrived.into_iter().map(|p| self.labels[p]).collect(),
                        missing: missing.into_iter().map(|p| self.labels[p]).collect(),
                    });
                }
            }
            backoff(waited);
        }
    }
}

/// Spin briefly, then yield, then sleep: short waits stay fast, long waits
/// (a peer still computing) leave the core to it.
fn backoff(waited: Duration) {
    if waited < Duration::from_micros(20) {
        std::hint::spin_loop();
    } else if waited < Duration::from_millis(2) {
        std::thread::yield_now();
    } else {
        std::thread::sleep((waited / 50).min(Duration::from_millis(1)));
    }
}

/// What an algorithm needs: every rank's buffers and the agreed sizes.
pub(crate) struct Ctx<'a> {
    pub rank: usize,
    pub peers: &'a [Bufs],
    pub counts: &'a [usize],
    pub desc: &'a OpDesc,
}

impl Ctx<'_> {
    /// Rank `p`'s input, as `T`.
    pub(crate) fn send<T>(&self, p: usize) -> *const T {
        self.peers[p].send.cast()
    }
    /// Rank `p`'s output, as `T`.
    pub(crate) fn recv<T>(&self, p: usize) -> *mut T {
        self.peers[p].recv.cast()
    }
}

/// Runs the algorithm `ctx.desc` names, for its element type.
///
/// # Safety
/// See [`ShmGroup::run`].
pub(crate) unsafe fn dispatch_dtype(ctx: &Ctx<'_>) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match ctx.desc.elem {
            Elem::Num(DType::F32) => dispatch::<f32>(ctx),
            Elem::Num(DType::BF16) => dispatch::<bf16>(ctx),
            Elem::Num(DType::F16) => dispatch::<f16>(ctx),
            Elem::Byte => match ctx.desc.kind {
                OpKind::AllGather => all_gather::run::<u8>(ctx),
                OpKind::Barrier => {}
                kind => unreachable!(
                    "{} of bytes: only all_gather_bytes makes byte collectives",
                    kind.name()
                ),
            },
        }
    }
}

/// # Safety
/// See [`ShmGroup::run`].
unsafe fn dispatch<T: Element>(ctx: &Ctx<'_>) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match ctx.desc.kind {
            OpKind::AllReduce => all_reduce::run::<T>(ctx),
            OpKind::ReduceScatter => reduce_scatter::run::<T>(ctx),
            OpKind::AllGather => all_gather::run::<T>(ctx),
            OpKind::Broadcast => broadcast::run::<T>(ctx),
            OpKind::Barrier => {}
        }
    }
}
