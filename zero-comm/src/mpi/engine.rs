//! One rank's collective engine, run by its progress thread: chooses the
//! path of every collective and runs it.
//!
//! ```text
//!  collective #seq
//!    │
//!    ▼
//!  round 0 (shm, the collective's own descriptor): entry; descriptors
//!    │   compared within the node (Mismatch); with several nodes and
//!    │   `validate`, then all-gathered over MPI (Mismatch on every rank)
//!    ├─ one node, or all_reduce over nodes with equal rank counts:
//!    │     every rank sees whether all ranks' buffers are in their pools;
//!    │       yes → the algorithm runs in round 0, on the buffers themselves
//!    │             (zero-copy; all_reduce over nodes: hier.rs)
//!    │       no  → staged.rs: further rounds through the bounce regions
//!    └─ otherwise (several nodes): round 0 only checks; net.rs then runs
//!          MPI's own collective (barrier: round 0, then MPI_Ibarrier)
//! ```
//!
//! Every shared-memory round has its own sequence number in the node's
//! [`ShmGroup`]; errors are renumbered to the collective's sequence number
//! before they reach the caller.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use zero_core::{bf16, f16, DType};

use super::hier;
use super::net::Net;
use super::runtime::Comm;
use super::staged;
use super::window::Node;
use crate::communicator::RawOp;
use crate::op::{Elem, OpDesc, OpKind};
use crate::shm::{dispatch_dtype, Bufs, Ctx, ShmGroup};
use crate::{Error, Result};

/// Evaluates `$body` with the type alias `$t` naming the float type of the
/// element type `$elem`, for the reductions. Bytes are only all-gathered
/// (`Communicator::all_gather_bytes` is the one maker of byte collectives),
/// so no reduction meets them.
macro_rules! with_num {
    ($elem:expr, $t:ident => $body:expr) => {
        match $elem {
            Elem::Num(DType::F32) => {
                type $t = f32;
                $body
            }
            Elem::Num(DType::BF16) => {
                type $t = bf16;
                $body
            }
            Elem::Num(DType::F16) => {
                type $t = f16;
                $body
            }
            Elem::Byte => unreachable!("only all_gather_bytes makes byte collectives"),
        }
    };
}

/// A closure that runs on the progress thread with the engine (the native
/// MPI baselines); travels in a `RawOp` of kind barrier.
pub(crate) struct NativeJob(pub(crate) Mutex<Option<NativeFn>>);

/// The body of a [`NativeJob`].
pub(crate) type NativeFn = Box<dyn FnOnce(&Engine) -> Result<()> + Send>;

/// One rank's engine (see the module doc).
pub(crate) struct Engine {
    pub(crate) node: Arc<Node>,
    pub(crate) group: Arc<ShmGroup>,
    /// This backend's duplicate of `MPI_COMM_WORLD`.
    pub(crate) world: Arc<Comm>,
    /// Set when the world spans several nodes.
    pub(crate) net: Option<Net>,
    pub(crate) validate: bool,
    /// The sequence number of the collective running now (for notices).
    pub(crate) current: Arc<AtomicU64>,
    /// The last collective whose MPI traffic this rank finished although it
    /// failed: a mismatch found by the cross-node descriptor check, after
    /// that check's all-gather completed. A failure notice then dooms only
    /// later collectives, so the other nodes finish the check and report
    /// the mismatch themselves instead of a failed peer.
    pub(crate) finished: Arc<AtomicU64>,
    shm_seq: u64,
}

impl Engine {
    pub(crate) fn new(
        node: Arc<Node>,
        group: Arc<ShmGroup>,
        world: Arc<Comm>,
        net: Option<Net>,
        validate: bool,
        current: Arc<AtomicU64>,
        finished: Arc<AtomicU64>,
    ) -> Self {
        Self {
            node,
            group,
            world,
            net,
            validate,
            current,
            finished,
            shm_seq: 0,
        }
    }

    pub(crate) fn local_rank(&self) -> usize {
        self.group.rank()
    }

    pub(crate) fn local_size(&self) -> usize {
        self.group.size()
    }

    pub(crate) fn bounce_ptr(&self) -> *mut u8 {
        self.node.bounce_ptr()
    }

    pub(crate) fn bounce_bytes(&self) -> usize {
        self.node.bounce_bytes()
    }

    /// Runs collective `seq` (the executor's runner).
    pub(crate) fn run(&mut self, seq: u64, op: &RawOp) -> Result<()> {
        self.current.store(seq, Ordering::Relaxed);
        if op.desc.kind == OpKind::Barrier {
            if let Some(job) = op
                .keep
                .first()
                .and_then(|k| (**k).downcast_ref::<NativeJob>())
            {
                let f = job.0.lock().unwrap_or_else(|e| e.into_inner()).take();
                return f.map_or(Ok(()), |f| f(self));
            }
        }
        let r = match op.desc.elem {
            Elem::Byte => self.collective::<u8>(seq, op),
            num => with_num!(num, T => self.collective::<T>(seq, op)),
        };
        r.map_err(|e| renumber(e, seq))
    }

    /// Runs `op`, whose elements are `T` (data movement only needs their
    /// size; reductions dispatch on the descriptor's element type).
    fn collective<T: Copy>(&mut self, seq: u64, op: &RawOp) -> Result<()> {
        let desc = op.desc;
        // Across nodes with `validate`, the first round's body (after the
        // descriptors matched within the node) all-gathers them over MPI.
        let validate = self.validate && self.net.is_some();
        let checked = Cell::new(false);
        let cross_mismatch = Cell::new(false);
        let check = |net: Option<&mut Net>| match net {
            Some(net) if validate => {
                checked.set(true);
                let r = net.validate(seq, &desc);
                cross_mismatch.set(matches!(r, Err(Error::Mismatch { .. })));
                r
            }
            _ => Ok(()),
        };
        let r = self.paths::<T>(seq, op, &check);
        let r = match r {
            // The descriptors differed within this node, so round 0 ended
            // before its body; the other nodes are comparing descriptors over
            // MPI in theirs. Take part, so that every rank reports what every
            // rank called.
            Err(Error::Mismatch { .. }) if validate && !checked.get() => {
                let net = self.net.as_mut().expect("validate implies several nodes");
                let v = net.validate(seq, &desc);
                cross_mismatch.set(matches!(v, Ok(()) | Err(Error::Mismatch { .. })));
                v.and(r)
            }
            r => r,
        };
        if cross_mismatch.get() && matches!(r, Err(Error::Mismatch { .. })) {
            // The descriptor all-gather completed: it is all the MPI traffic
            // a mismatched collective has.
            self.finished.store(seq, Ordering::Relaxed);
        }
        r
    }

    fn paths<T: Copy>(
        &mut self,
        seq: u64,
        op: &RawOp,
        check: &dyn Fn(Option<&mut Net>) -> Result<()>,
    ) -> Result<()> {
        let desc = op.desc;
        let size = std::mem::size_of::<T>();
        let (n_in, n_out) = op.elems(self.world.rank());
        // Empty buffers are published as the pool's base: registered,
        // never dereferenced.
        let norm = |p: *mut u8, elems: usize| {
            if elems == 0 {
                self.node.bounce_ptr()
            } else {
                p
            }
        };
        let send = norm(op.bufs.send.cast_mut(), n_in).cast_const();
        let recv = norm(op.bufs.recv, n_out);
        let bufs = Bufs { send, recv };
        let hier = self.net.as_ref().map(|n| n.hierarchical());
        match (desc.kind, hier) {
            (OpKind::Barrier, _) => {
                self.round(&desc, &[], bufs, |_, net| check(net))?;
                if let Some(net) = &mut self.net {
                    net.barrier(seq, &desc)?;
                }
                Ok(())
            }
            (_, None) | (OpKind::AllReduce, Some(true)) => {
                let mine = self.node.registered(send, n_in * size)
                    && self.node.registered(recv, n_out * size);
                let world = self.world.size();
                let mut direct = false;
                self.round(&desc, &op.counts, bufs, |ctx, mut net| {
                    check(net.as_deref_mut())?;
                    direct = mine
                        && (0..ctx.peers.len()).all(|p| {
                            p == ctx.rank
                                || !(ctx.peers[p].send.is_null() || ctx.peers[p].recv.is_null())
                        });
                    if let Some(net) = net.as_deref_mut() {
                        // Hierarchical: the nodes must agree too, since the
                        // staged rounds cut the MPI traffic differently.
                        direct = net.agree(seq, &desc, direct)?;
                    }
                    if direct {
                        // SAFETY: every rank's buffers are in the pool and
                        // valid for the agreed sizes (run_with's contract).
                        unsafe { algorithm(ctx, net, seq, world) }
                    } else {
                        Ok(())
                    }
                })?;
                if direct {
                    return Ok(());
                }
                // SAFETY: the op owns its buffers until it completes, valid
                // for the sizes its descriptor implies.
                unsafe { staged::run::<T>(self, seq, &desc, &op.counts, send.cast(), recv.cast()) }
            }
            (kind, Some(_)) => {
                // Checks the descriptors within the node, then MPI.
                self.round(&desc, &op.counts, bufs, |_, net| check(net))?;
                let net = self.net.as_mut().expect("several nodes");
                let reduce = desc.reduce.unwrap_or(crate::ReduceOp::Sum);
                // SAFETY: the op owns its buffers until it completes; they
                // are valid for the sizes its descriptor implies.
                unsafe {
                    match kind {
                        OpKind::AllReduce => with_num!(desc.elem, F => {
                            net.all_reduce::<F>(seq, &desc, recv.cast(), desc.len, reduce)
                        }),
                        OpKind::ReduceScatter => with_num!(desc.elem, F => {
                            net.reduce_scatter::<F>(
                                seq,
                                &desc,
                                send.cast(),
                                recv.cast(),
                                &op.counts,
                                reduce,
                            )
                        }),
                        OpKind::AllGather => {
                            net.all_gather::<T>(seq, &desc, send.cast(), recv.cast(), &op.counts)
                        }
                        OpKind::Broadcast => {
                            net.broadcast(seq, &desc, recv, desc.len * size, desc.root)
                        }
                        OpKind::Barrier => unreachable!("handled above"),
                    }
                }
            }
        }
    }

    /// One shared-memory round that runs the algorithm `desc` names
    /// (staged rounds: all buffers are bounce regions).
    pub(crate) fn round_algorithm(
        &mut self,
        seq: u64,
        desc: &OpDesc,
        counts: &[usize],
        bufs: Bufs,
    ) -> Result<()> {
        let world = self.world.size();
        // SAFETY: staged.rs publishes bounce regions sized for `desc`.
        self.round(desc, counts, bufs, |ctx, net| unsafe {
            algorithm(ctx, net, seq, world)
        })
    }

    /// One shared-memory round with `body` as its data movement.
    fn round(
        &mut self,
        desc: &OpDesc,
        counts: &[usize],
        bufs: Bufs,
        body: impl FnOnce(&Ctx<'_>, Option<&mut Net>) -> Result<()>,
    ) -> Result<()> {
        self.shm_seq += 1;
        let net = &mut self.net;
        // SAFETY: the caller's buffers are valid for `desc` until the round
        // ends (the op owns them; bounce regions belong to this rank), and
        // every body writes only its own rank's share.
        unsafe {
            self.group
                .run_with(self.shm_seq, desc, counts, bufs, |ctx| {
                    body(ctx, net.as_mut())
                })
        }
    }
}

/// The data movement of `ctx.desc` within a round.
///
/// # Safety
/// As `ShmGroup::run_with`'s body.
unsafe fn algorithm(ctx: &Ctx<'_>, net: Option<&mut Net>, seq: u64, world: usize) -> Result<()> {
    match net {
        Some(net) if ctx.desc.kind == OpKind::AllReduce => with_num!(ctx.desc.elem, T => {
            // SAFETY: forwarded.
            unsafe { hier::all_reduce::<T>(ctx, net, seq, world) }
        }),
        _ => {
            // SAFETY: forwarded.
            unsafe { dispatch_dtype(ctx) };
            Ok(())
        }
    }
}

/// Errors from shared-memory rounds carry the round's number; callers see
/// the collective's.
fn renumber(e: Error, seq: u64) -> Error {
    match e {
        Error::Timeout {
            rank,
            op,
            phase,
            waited,
            arrived,
            missing,
            ..
        } => Error::Timeout {
            rank,
            op,
            seq,
            phase,
            waited,
            arrived,
            missing,
        },
        Error::Mismatch { rank, detail, .. } => Error::Mismatch { rank, seq, detail },
        Error::PeerFailed {
            rank,
            op,
            peer,
            reason,
            ..
        } => Error::PeerFailed {
            rank,
            op,
            seq,
            peer,
            reason,
        },
        other => other,
    }
}
