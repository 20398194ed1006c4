//! Collectives between nodes through MPI's own (non-blocking) collectives.
//!
//! Used when the world spans several nodes: for reduce-scatter, all-gather,
//! broadcast and barrier always, and for all-reduce where the hierarchical
//! path ([`super::hier`]) does not apply (nodes with different numbers of
//! ranks). Every call is non-blocking (`MPI_I*`) and completed by a test
//! loop bounded by [`CommOptions::timeout`](crate::CommOptions), which also
//! watches for failure notices from other nodes (below), so that nothing
//! waits forever.
//!
//! Data crosses MPI as f32 (reductions: widened, see [`super::upcast`]) or
//! as bytes (gathers, broadcast), in chunks of at most [`NET_CHUNK`]
//! elements through private scratch memory, so counts fit MPI's `int` and
//! scratch stays bounded:
//!
//! ```text
//!  reduce_scatter, round k (P = NET_CHUNK / world elements per rank):
//!   input   [ part 0 ............ | part 1 ............ | ... ]
//!             └ k·P ─┬─ P ┘          └ k·P ─┬─ P ┘
//!   scratch [ piece 0 | piece 1 | ... ]  --MPI_Ireduce_scatter-->  [ my piece ]
//!                                                  --> output[k·P .. (k+1)·P]
//! ```
//!
//! Failure notices: a rank whose communicator fails (or is dropped) sends
//! `[rank, state, seq]` to every rank on other nodes; each rank keeps a
//! receive posted and checks it while it waits in MPI. A notice for
//! collective `seq` fails the collectives numbered `seq` and later at once
//! (with [`Error::PeerFailed`]) instead of after the timeout; earlier ones
//! still complete, since the peer took part in them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zero_core::Element;

use super::raw::{self, MPI_Request};
use super::runtime::{Comm, Retired, Runtime, UserOp};
use super::upcast::{finish_into, nan_max, widen};
use crate::counts::{offsets, round_pieces};
use crate::op::OpDesc;
use crate::shm::STATE_FAILED;
use crate::{Error, ReduceOp, Result};

/// Elements per MPI call (and per scratch array): 4 MiB of f32.
pub(crate) const NET_CHUNK: usize = 1 << 20;

const NOTICE_TAG: i32 = 0x2e60;

const PHASE: &str =
    "MPI between nodes; MPI cannot tell which peers are missing, so all others are listed";

/// Failure notices between nodes (see the module doc).
pub(crate) struct Notices {
    comm: Comm,
    req: MPI_Request,
    buf: Box<[u64; 3]>,
    got: Vec<[u64; 3]>,
    /// World ranks on other nodes.
    remote: Vec<usize>,
    me: usize,
    announced: bool,
}

// SAFETY: the request handle is only used under the Mutex that holds
// Notices, through Runtime::call; the receive buffer is heap memory owned
// here.
unsafe impl Send for Notices {}

impl Notices {
    /// Posts the receive on a duplicate of `world` (collective over it).
    pub(crate) fn new(world: &Comm, remote: Vec<usize>) -> Result<Self> {
        let comm = world.dup()?;
        let mut n = Notices {
            comm,
            req: raw::request_null(),
            buf: Box::new([0; 3]),
            got: Vec::new(),
            remote,
            me: world.rank(),
            announced: false,
        };
        n.post()?;
        Ok(n)
    }

    fn post(&mut self) -> Result<()> {
        let (buf, comm) = (self.buf.as_mut_ptr(), self.comm.raw());
        // SAFETY: `buf` (3 u64, heap) lives until the request completes or
        // is cancelled in Drop; `comm` is live.
        self.req = self
            .comm
            .runtime()
            .call(|| unsafe { raw::irecv_any_u64(buf, 3, NOTICE_TAG, comm) })?;
        Ok(())
    }

    /// Receives what has arrived.
    fn poll(&mut self) -> Result<()> {
        loop {
            let req = &mut self.req;
            // SAFETY: `req` is the live receive posted by `post`.
            let done = self.comm.runtime().call(|| unsafe { raw::test(req) })?;
            if !done {
                return Ok(());
            }
            self.got.push(*self.buf);
            self.post()?;
        }
    }

    /// The first notice that dooms collective `seq`: (peer, state).
    fn fatal_for(&self, seq: u64) -> Option<(usize, u64)> {
        self.got
            .iter()
            .find(|n| n[2] <= seq)
            .map(|n| (n[0] as usize, n[1]))
    }

    /// Tells every rank on another node that this one failed or left
    /// (`state`) at collective `seq`. Once.
    pub(crate) fn announce(&mut self, state: u64, seq: u64) {
        if self.announced {
            return;
        }
        self.announced = true;
        let msg: Box<[u64; 3]> = Box::new([self.me as u64, state, seq]);
        let rt = self.comm.runtime().clone();
        for &r in &self.remote {
            let (p, comm) = (msg.as_ptr(), self.comm.raw());
            // SAFETY: `msg` is kept until MPI is finalised (retired below);
            // the request is freed at once and completes in the background.
            let _ = rt.call(|| unsafe {
                let mut req = raw::isend_u64(p, 3, r as i32, NOTICE_TAG, comm)?;
                raw::request_free(&mut req)
            });
        }
        rt.retire(rt.next_id(), Retired::Memory(msg));
    }
}

impl Drop for Notices {
    fn drop(&mut self) {
        let req = &mut self.req;
        if *req != raw::request_null() {
            // SAFETY: `req` is the live receive into `buf`, which outlives
            // this call; cancelling a receive completes locally.
            let _ = self
                .comm
                .runtime()
                .call(|| unsafe { raw::cancel_and_wait(req) });
        }
    }
}

/// The inter-node half of one rank's engine.
pub(crate) struct Net {
    rt: Arc<Runtime>,
    pub(crate) world: Arc<Comm>,
    /// Ranks with this rank's local index on every node (hierarchical
    /// all-reduce), and their world ranks.
    cross: Option<(Comm, Vec<usize>)>,
    max_op: UserOp,
    notices: Arc<Mutex<Notices>>,
    timeout: Duration,
    a: Vec<f32>,
    b: Vec<f32>,
    bytes: Vec<u8>,
}

impl Net {
    /// Set-up (collective over `world` and `cross`).
    pub(crate) fn new(
        world: Arc<Comm>,
        cross: Option<Comm>,
        notices: Arc<Mutex<Notices>>,
        timeout: Duration,
    ) -> Result<Net> {
        let rt = world.runtime().clone();
        let cross = match cross {
            Some(c) => {
                let members = c
                    .all_gather_i64(world.rank() as i64)?
                    .into_iter()
                    .map(|r| r as usize)
                    .collect();
                Some((c, members))
            }
            None => None,
        };
        // SAFETY: nan_max handles MPI_FLOAT, the only type it is used with.
        let max_op = unsafe { UserOp::create(&rt, Some(nan_max), false)? };
        Ok(Net {
            rt,
            world,
            cross,
            max_op,
            notices,
            timeout,
            a: Vec::new(),
            b: Vec::new(),
            bytes: Vec::new(),
        })
    }

    /// Whether all-reduce runs hierarchically.
    pub(crate) fn hierarchical(&self) -> bool {
        self.cross.is_some()
    }

    fn mpi_op(&self, op: ReduceOp) -> raw::MPI_Op {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => raw::op_sum(),
            ReduceOp::Max => self.max_op.raw(),
        }
    }

    /// Scratch of at least `n` f32 in `a` and `b`, `bytes` bytes.
    fn scratch(&mut self, n: usize, bytes: usize) {
        if self.a.len() < n {
            self.a = vec![0.0; n];
            self.b = vec![0.0; n];
        }
        if self.bytes.len() < bytes {
            self.bytes = vec![0; bytes];
        }
    }

    /// After a failed wait MPI may still write the scratch: leak it.
    fn lose_scratch(&mut self) {
        std::mem::forget(std::mem::take(&mut self.a));
        std::mem::forget(std::mem::take(&mut self.b));
        std::mem::forget(std::mem::take(&mut self.bytes));
    }

    /// Completes `req` (see the module doc); `members` are the world ranks
    /// of the communicator it runs on.
    fn wait(
        &mut self,
        mut req: MPI_Request,
        seq: u64,
        desc: &OpDesc,
        members: &[usize],
    ) -> Result<()> {
        let start = Instant::now();
        let me = self.world.rank();
        let mut polls: u32 = 0;
        loop {
            let r = &mut req;
            // SAFETY: `req` is a live request from a raw call.
            if self.rt.call(|| unsafe { raw::test(r) })? {
                return Ok(());
            }
            polls = polls.wrapping_add(1);
            let waited = start.elapsed();
            if polls.is_multiple_of(16) {
                let fatal = {
                    let mut n = self.notices.lock().unwrap_or_else(|e| e.into_inner());
                    n.poll()?;
                    n.fatal_for(seq)
                };
                if let Some((peer, state)) = fatal {
                    self.lose_scratch();
                    return Err(Error::PeerFailed {
                        rank: me,
                        op: desc.name(),
                        seq,
                        peer,
                        reason: if state == STATE_FAILED {
                            "failed on another node (it reported an error or panicked)".into()
                        } else {
                            "has left the group on another node (its communicator was dropped)"
                                .into()
                        },
                    });
                }
                if waited >= self.timeout {
                    self.lose_scratch();
                    return Err(Error::Timeout {
                        rank: me,
                        op: desc.name(),
                        seq,
                        phase: PHASE,
                        waited,
                        arrived: vec![me],
                        missing: members.iter().copied().filter(|&r| r != me).collect(),
                    });
                }
            }
            backoff(waited);
        }
    }

    fn world_members(&self) -> Vec<usize> {
        (0..self.world.size()).collect()
    }

    /// Checks that every rank called the same collective (`validate`).
    pub(crate) fn validate(&mut self, seq: u64, desc: &OpDesc) -> Result<()> {
        let n = self.world.size();
        let mine = desc.words();
        let mut all = vec![0u64; 3 * n];
        let (p, comm) = (all.as_mut_ptr(), self.world.raw());
        // SAFETY: `mine` (3 words) and `all` (3 per rank) outlive the wait
        // below; on a failed wait `all` is leaked.
        let req = self
            .rt
            .call(|| unsafe { raw::iallgather_u64(mine.as_ptr(), 3, p, comm) })?;
        let members = self.world_members();
        if let Err(e) = self.wait(req, seq, desc, &members) {
            std::mem::forget(all);
            return Err(e);
        }
        let words: Vec<[u64; 3]> = all.chunks(3).map(|c| [c[0], c[1], c[2]]).collect();
        if words.iter().all(|w| *w == mine) {
            return Ok(());
        }
        let detail = words
            .iter()
            .enumerate()
            .map(|(r, w)| format!("rank {r} called {}", OpDesc::describe_words(*w)))
            .collect::<Vec<_>>()
            .join("; ");
        Err(Error::Mismatch {
            rank: self.world.rank(),
            seq,
            detail,
        })
    }

    /// Barrier over the world.
    pub(crate) fn barrier(&mut self, seq: u64, desc: &OpDesc) -> Result<()> {
        let comm = self.world.raw();
        // SAFETY: `comm` is live.
        let req = self.rt.call(|| unsafe { raw::ibarrier(comm) })?;
        let members = self.world_members();
        self.wait(req, seq, desc, &members)
    }

    /// All-reduce of f32 partial results among the ranks with this local
    /// index on every node (hierarchical all-reduce): `part` in, result
    /// (not finished) in the returned slice.
    pub(crate) fn cross_all_reduce(
        &mut self,
        seq: u64,
        desc: &OpDesc,
        op: ReduceOp,
        fill: impl FnOnce(&mut [f32]),
        m: usize,
    ) -> Result<&[f32]> {
        self.scratch(m, 0);
        fill(&mut self.a[..m]);
        let (comm, members) = match &self.cross {
            Some((c, mem)) => (c.raw(), mem.clone()),
            None => unreachable!("cross_all_reduce is only used when hierarchical"),
        };
        let (a, b, mop) = (self.a.as_ptr(), self.b.as_mut_ptr(), self.mpi_op(op));
        // SAFETY: a and b hold >= m f32 and are not touched until the wait
        // ends (or are leaked if it fails).
        let req = self
            .rt
            .call(|| unsafe { raw::iallreduce_f32(a, b, m, mop, comm) })?;
        self.wait(req, seq, desc, &members)?;
        Ok(&self.b[..m])
    }

    /// Whether `flag` holds on every node: a logical AND among the ranks
    /// with this local index (hierarchical all-reduce; every rank of a node
    /// passes the same flag, so all ranks get the same answer).
    pub(crate) fn agree(&mut self, seq: u64, desc: &OpDesc, flag: bool) -> Result<bool> {
        let out = self.cross_all_reduce(
            seq,
            desc,
            ReduceOp::Max,
            |part| part[0] = if flag { 0.0 } else { 1.0 },
            1,
        )?;
        Ok(out[0] == 0.0)
    }

    /// Flat all-reduce over the world of `len` elements at `buf`.
    ///
    /// # Safety
    /// `buf` valid for `len` elements and not accessed by anyone else.
    pub(crate) unsafe fn all_reduce<T: Element>(
        &mut self,
        seq: u64,
        desc: &OpDesc,
        buf: *mut T,
        len: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let world = self.world.size();
        let members = self.world_members();
        let mut s = 0;
        while s < len {
            let m = NET_CHUNK.min(len - s);
            self.scratch(m, 0);
            // SAFETY: buf valid for len elements (caller); s + m <= len.
            unsafe { widen(buf.add(s), &mut self.a[..m]) };
            let (a, b, mop, comm) = (
                self.a.as_ptr(),
                self.b.as_mut_ptr(),
                self.mpi_op(op),
                self.world.raw(),
            );
            // SAFETY: scratch holds >= m f32 and is leaked if the wait fails.
            let req = self
                .rt
                .call(|| unsafe { raw::iallreduce_f32(a, b, m, mop, comm) })?;
            self.wait(req, seq, desc, &members)?;
            // SAFETY: as above; scratch and buf do not overlap.
            unsafe { finish_into(&self.b[..m], op, world, &[buf.add(s)]) };
            s += m;
        }
        Ok(())
    }

    /// Reduce-scatter over the world (see the module doc).
    ///
    /// # Safety
    /// `send` valid for `sum(counts)` elements, `recv` for `counts[rank]`
    /// (they may overlap only as in `reduce_scatter_in_place`); nobody else
    /// accesses them.
    pub(crate) unsafe fn reduce_scatter<T: Element>(
        &mut self,
        seq: u64,
        desc: &OpDesc,
        send: *const T,
        recv: *mut T,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let (me, world) = (self.world.rank(), self.world.size());
        let offs = offsets(counts);
        let per = (NET_CHUNK / world).max(1);
        let members = self.world_members();
        for (k, piece) in round_pieces(counts, per).enumerate() {
            let total: usize = piece.iter().sum();
            self.scratch(total.max(1), 0);
            let mut at = 0;
            for p in 0..world {
                // SAFETY: offs[p] + k*per + piece[p] <= offs[p] + counts[p]
                // <= sum(counts); the scratch holds `total` elements.
                unsafe { widen(send.add(offs[p] + k * per), &mut self.a[at..at + piece[p]]) };
                at += piece[p];
            }
            let icounts = piece
                .iter()
                .map(|&c| raw::count(c, "MPI_Ireduce_scatter"))
                .collect::<Result<Vec<_>>>()?;
            let (a, b, mop, comm) = (
                self.a.as_ptr(),
                self.b.as_mut_ptr(),
                self.mpi_op(op),
                self.world.raw(),
            );
            // SAFETY: scratch holds `total` (send) and >= piece[me] (recv)
            // f32; `icounts` lives until the wait below ends, or is leaked.
            let req = self
                .rt
                .call(|| unsafe { raw::ireduce_scatter_f32(a, b, &icounts, mop, comm) })?;
            if let Err(e) = self.wait(req, seq, desc, &members) {
                std::mem::forget(icounts);
                return Err(e);
            }
            // SAFETY: recv holds counts[me] >= k*per + piece[me] elements;
            // later rounds read `send` only outside [offs[me] + k*per, +per).
            unsafe { finish_into(&self.b[..piece[me]], op, world, &[recv.add(k * per)]) };
        }
        Ok(())
    }

    /// All-gather over the world (chunked like reduce-scatter).
    ///
    /// # Safety
    /// `send` valid for `counts[rank]` elements, `recv` for `sum(counts)`
    /// (in place: `send == recv + offset(rank)`); nobody else accesses them.
    pub(crate) unsafe fn all_gather<T: Copy>(
        &mut self,
        seq: u64,
        desc: &OpDesc,
        send: *const T,
        recv: *mut T,
        counts: &[usize],
    ) -> Result<()> {
        let (me, world) = (self.world.rank(), self.world.size());
        let size = std::mem::size_of::<T>();
        let offs = offsets(counts);
        let per = (NET_CHUNK / world).max(1);
        let members = self.world_members();
        for (k, piece) in round_pieces(counts, per).enumerate() {
            let total: usize = piece.iter().sum();
            self.scratch(0, total * size);
            let bcounts = piece
                .iter()
                .map(|&c| raw::count(c * size, "MPI_Iallgatherv"))
                .collect::<Result<Vec<_>>>()?;
            let displs = offsets(&piece)
                .into_iter()
                .map(|d| raw::count(d * size, "MPI_Iallgatherv"))
                .collect::<Result<Vec<_>>>()?;
            // SAFETY: k*per + piece[me] <= counts[me]: within send.
            let src = unsafe { send.add(k * per) }.cast::<u8>();
            let (dst, comm) = (self.bytes.as_mut_ptr(), self.world.raw());
            let scount = bcounts[me];
            // SAFETY: `src` valid for scount bytes and not written during the
            // call (in place, it is only written by the unpacking below);
            // scratch holds total*size bytes; the count arrays live until the
            // wait ends, or are leaked.
            let req = self.rt.call(|| unsafe {
                raw::iallgatherv_u8(src, scount, dst, &bcounts, &displs, comm)
            })?;
            if let Err(e) = self.wait(req, seq, desc, &members) {
                std::mem::forget((bcounts, displs));
                return Err(e);
            }
            let mut at = 0;
            for p in 0..world {
                // SAFETY: offs[p] + k*per + piece[p] <= sum(counts): within
                // recv; the scratch and recv do not overlap. In place, the
                // piece of p == me is the data it already holds.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.bytes.as_ptr().add(at * size),
                        recv.add(offs[p] + k * per).cast::<u8>(),
                        piece[p] * size,
                    )
                };
                at += piece[p];
            }
        }
        Ok(())
    }

    /// Broadcast of `bytes` bytes at `buf` from world rank `root`.
    ///
    /// # Safety
    /// `buf` valid for `bytes` bytes and not accessed by anyone else.
    pub(crate) unsafe fn broadcast(
        &mut self,
        seq: u64,
        desc: &OpDesc,
        buf: *mut u8,
        bytes: usize,
        root: usize,
    ) -> Result<()> {
        let members = self.world_members();
        let step = NET_CHUNK * 4;
        let mut s = 0;
        while s < bytes {
            let m = step.min(bytes - s);
            let n = raw::count(m, "MPI_Ibcast")?;
            let comm = self.world.raw();
            // SAFETY: buf valid for `bytes` (caller); the user's buffer is
            // leaked by the executor if the wait fails.
            let req = self
                .rt
                .call(|| unsafe { raw::ibcast_u8(buf.add(s), n, root as i32, comm) })?;
            self.wait(req, seq, desc, &members)?;
            s += m;
        }
        Ok(())
    }
}

/// Spin briefly, then yield, then sleep a little: MPI only progresses while
/// it is called, so the loop keeps testing, but leaves the core to a
/// computing thread when the wait is long.
fn backoff(waited: Duration) {
    if waited < Duration::from_micros(50) {
        std::hint::spin_loop();
    } else if waited < Duration::from_millis(20) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(100));
    }
}
