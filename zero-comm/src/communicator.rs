//! The `Communicator` trait: asynchronous collectives on host buffers.

use std::any::Any;

use zero_core::{Element, HostBuffer};

use crate::counts::{counts_hash, offsets};
use crate::op::{Elem, OpDesc, OpKind};
use crate::shm::Bufs;
use crate::work::Work;
use crate::{Error, ReduceOp, Result};

/// A collective, type-erased, as backends receive it. Opaque to users.
pub struct RawOp {
    pub(crate) desc: OpDesc,
    pub(crate) counts: Vec<usize>,
    pub(crate) bufs: Bufs,
    /// The buffers, owned by the operation until it completes.
    pub(crate) keep: Vec<Box<dyn Any + Send>>,
    /// An argument error found before submission; the backend reports it
    /// in sequence (and fails the communicator, as any collective error).
    pub(crate) error: Option<Error>,
}

// SAFETY: the raw pointers in `bufs` point into the buffers in `keep`, which
// the operation owns and which are Send.
unsafe impl Send for RawOp {}

impl RawOp {
    /// A barrier that carries `keep` (e.g. a job for the progress thread)
    /// or, with `error`, reports an argument error in sequence.
    pub(crate) fn barrier(keep: Vec<Box<dyn Any + Send>>, error: Option<Error>) -> Self {
        RawOp {
            desc: desc::<f32>(OpKind::Barrier, None, 0, &[]),
            counts: Vec::new(),
            bufs: Bufs {
                send: std::ptr::null(),
                recv: std::ptr::null_mut(),
            },
            keep,
            error,
        }
    }

    /// Elements of this rank's input and output.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn elems(&self, rank: usize) -> (usize, usize) {
        let d = &self.desc;
        match d.kind {
            OpKind::AllReduce | OpKind::Broadcast => (d.len, d.len),
            OpKind::Barrier => (0, 0),
            OpKind::ReduceScatter => (d.len, self.counts[rank]),
            OpKind::AllGather => (self.counts[rank], d.len),
        }
    }
}

/// The typed output of a completed raw operation.
fn take<T: Element>(v: &mut [Box<dyn Any + Send>], i: usize) -> HostBuffer<T> {
    take_as::<HostBuffer<T>>(v, i)
}

/// Buffer `i` of a completed raw operation, as the type it was given as.
fn take_as<B: 'static>(v: &mut [Box<dyn Any + Send>], i: usize) -> B {
    *std::mem::replace(&mut v[i], Box::new(()))
        .downcast::<B>()
        .expect("collective returns the buffers it was given")
}

fn desc<T: Element>(
    kind: OpKind,
    reduce: Option<ReduceOp>,
    len: usize,
    counts: &[usize],
) -> OpDesc {
    desc_of(Elem::Num(T::DTYPE), kind, reduce, len, counts)
}

fn desc_of(
    elem: Elem,
    kind: OpKind,
    reduce: Option<ReduceOp>,
    len: usize,
    counts: &[usize],
) -> OpDesc {
    OpDesc {
        kind,
        reduce,
        elem,
        len,
        counts_hash: if counts.is_empty() {
            0
        } else {
            counts_hash(counts)
        },
        root: 0,
    }
}

/// Collective communication among the ranks of a data-parallel group.
///
/// Every collective is asynchronous: it takes its buffers by value, returns
/// at once with a [`Work`] handle, runs on the backend's progress thread in
/// the order the collectives were issued, and gives the buffers back from
/// [`Work::wait`]. All ranks must issue the same collectives in the same
/// order; a rank that does not gets [`Error::Mismatch`], [`Error::Timeout`]
/// or [`Error::PeerFailed`] instead of a hang. After any error the
/// communicator is failed: later collectives return [`Error::Poisoned`].
///
/// Reductions of bf16 and f16 accumulate in f32 in rank order (see
/// [`crate::reference_reduce`]), so results are bit-identical across
/// backends and runs. Buffers from [`Communicator::alloc`] are registered
/// with the backend (for MPI: in the node's shared window), which saves a
/// copy; any [`HostBuffer`] works.
///
/// ```
/// use zero_comm::{Communicator, ReduceOp, ThreadGroup};
/// use zero_core::HostBuffer;
///
/// let sums = ThreadGroup::run(2, |comm| {
///     let buf = HostBuffer::from_slice(&[comm.rank() as f32 + 1.0; 4]).unwrap();
///     comm.all_reduce(buf, ReduceOp::Sum).wait().unwrap().to_vec()
/// })
/// .unwrap();
/// assert_eq!(sums, vec![vec![3.0; 4]; 2]);
/// ```
pub trait Communicator: Send + Sync {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// The backend's name (`"threads"`, `"mpi"`).
    fn backend(&self) -> &'static str;

    /// How many ranks of this group run on this machine, this one included
    /// (they share its cores: compute threads per rank default to cores ÷
    /// this). Default: 1.
    fn ranks_on_host(&self) -> usize {
        1
    }

    /// A zeroed buffer registered with the backend (for MPI: inside the
    /// node's shared-memory window, so collectives on it copy nothing).
    fn alloc<T: Element>(&self, len: usize) -> Result<HostBuffer<T>> {
        Ok(HostBuffer::zeros(len)?)
    }

    /// Queues a type-erased collective. Backends implement this; users call
    /// the typed methods.
    #[doc(hidden)]
    fn submit(&self, op: RawOp) -> Work<Vec<Box<dyn Any + Send>>>;

    /// Reduces `buf` over all ranks, in place: afterwards every rank holds
    /// `op` of all ranks' inputs.
    fn all_reduce<T: Element>(&self, mut buf: HostBuffer<T>, op: ReduceOp) -> Work<HostBuffer<T>> {
        let ptr = buf.as_mut_ptr().cast::<u8>();
        let raw = RawOp {
            desc: desc::<T>(OpKind::AllReduce, Some(op), buf.len(), &[]),
            counts: Vec::new(),
            bufs: Bufs {
                send: ptr,
                recv: ptr,
            },
            keep: vec![Box::new(buf)],
            error: None,
        };
        self.submit(raw).map(|mut v| take::<T>(&mut v, 0))
    }

    /// Reduces `send` (which holds `sum(counts)` elements on every rank) and
    /// scatters it: rank r receives the reduction of elements
    /// `offset(r)..offset(r) + counts[r]` into `recv` (`counts[r]` long).
    /// Returns `(send, recv)`.
    fn reduce_scatter<T: Element>(
        &self,
        send: HostBuffer<T>,
        mut recv: HostBuffer<T>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<(HostBuffer<T>, HostBuffer<T>)> {
        let (rank, world) = (self.rank(), self.world_size());
        let total: usize = counts.iter().sum();
        let error = check_counts(rank, world, "reduce_scatter", counts).or_else(|| {
            if send.len() != total {
                Some(format!(
                    "input has {} elements but counts sum to {total}",
                    send.len()
                ))
            } else if recv.len() != counts[rank] {
                Some(format!(
                    "output has {} elements but counts[{rank}] is {}",
                    recv.len(),
                    counts[rank]
                ))
            } else {
                None
            }
        });
        let bufs = Bufs {
            send: send.as_ptr().cast(),
            recv: recv.as_mut_ptr().cast(),
        };
        let raw = RawOp {
            desc: desc::<T>(OpKind::ReduceScatter, Some(op), total, counts),
            counts: counts.to_vec(),
            bufs,
            keep: vec![Box::new(send), Box::new(recv)],
            error: invalid(rank, "reduce_scatter", error),
        };
        self.submit(raw)
            .map(|mut v| (take::<T>(&mut v, 0), take::<T>(&mut v, 1)))
    }

    /// Reduce-scatter in place: `buf` holds `sum(counts)` elements; rank r's
    /// result lands in `buf[offset(r)..offset(r) + counts[r]]`, the rest of
    /// `buf` is left as it was.
    fn reduce_scatter_in_place<T: Element>(
        &self,
        mut buf: HostBuffer<T>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<HostBuffer<T>> {
        let (rank, world) = (self.rank(), self.world_size());
        let total: usize = counts.iter().sum();
        let error = check_counts(rank, world, "reduce_scatter_in_place", counts).or_else(|| {
            (buf.len() != total).then(|| {
                format!(
                    "buffer has {} elements but counts sum to {total}",
                    buf.len()
                )
            })
        });
        let ptr = buf.as_mut_ptr();
        let own = if error.is_none() {
            // SAFETY: offset(rank) + counts[rank] <= total == buf.len().
            unsafe { ptr.add(offsets(counts)[rank]) }
        } else {
            ptr
        };
        let raw = RawOp {
            desc: desc::<T>(OpKind::ReduceScatter, Some(op), total, counts),
            counts: counts.to_vec(),
            bufs: Bufs {
                send: ptr.cast(),
                recv: own.cast(),
            },
            keep: vec![Box::new(buf)],
            error: invalid(rank, "reduce_scatter_in_place", error),
        };
        self.submit(raw).map(|mut v| take::<T>(&mut v, 0))
    }

    /// Gathers every rank's `send` (`counts[r]` elements on rank r) into
    /// `recv` (`sum(counts)` elements) on every rank, in rank order.
    /// Returns `(send, recv)`.
    fn all_gather<T: Element>(
        &self,
        send: HostBuffer<T>,
        mut recv: HostBuffer<T>,
        counts: &[usize],
    ) -> Work<(HostBuffer<T>, HostBuffer<T>)> {
        let (rank, world) = (self.rank(), self.world_size());
        let total: usize = counts.iter().sum();
        let error = check_counts(rank, world, "all_gather", counts).or_else(|| {
            if send.len() != counts[rank] {
                Some(format!(
                    "input has {} elements but counts[{rank}] is {}",
                    send.len(),
                    counts[rank]
                ))
            } else if recv.len() != total {
                Some(format!(
                    "output has {} elements but counts sum to {total}",
                    recv.len()
                ))
            } else {
                None
            }
        });
        let bufs = Bufs {
            send: send.as_ptr().cast(),
            recv: recv.as_mut_ptr().cast(),
        };
        let raw = RawOp {
            desc: desc::<T>(OpKind::AllGather, None, total, counts),
            counts: counts.to_vec(),
            bufs,
            keep: vec![Box::new(send), Box::new(recv)],
            error: invalid(rank, "all_gather", error),
        };
        self.submit(raw)
            .map(|mut v| (take::<T>(&mut v, 0), take::<T>(&mut v, 1)))
    }

    /// [`Communicator::all_gather`] of raw bytes: every rank's `send`
    /// (`counts[r]` bytes on rank r) lands in `recv` (`sum(counts)` bytes)
    /// on every rank, in rank order, byte for byte. Returns `(send, recv)`.
    ///
    /// The bytes are copied, never interpreted or reduced (for small
    /// agreements among ranks; see [`crate::agree`]). Validated like every
    /// collective: ranks that pass different `counts` get
    /// [`Error::Mismatch`], as do ranks where a peer calls another
    /// collective at this point.
    ///
    /// ```
    /// use zero_comm::{Communicator, ThreadGroup};
    ///
    /// let got = ThreadGroup::run(2, |comm| {
    ///     let counts = [1, 2];
    ///     let send = vec![comm.rank() as u8 + 7; counts[comm.rank()]];
    ///     let (_, recv) = comm.all_gather_bytes(send, vec![0; 3], &counts).wait().unwrap();
    ///     recv
    /// })
    /// .unwrap();
    /// assert_eq!(got, vec![vec![7, 8, 8]; 2]);
    /// ```
    fn all_gather_bytes(
        &self,
        send: Vec<u8>,
        mut recv: Vec<u8>,
        counts: &[usize],
    ) -> Work<(Vec<u8>, Vec<u8>)> {
        let (rank, world) = (self.rank(), self.world_size());
        let total: usize = counts.iter().sum();
        let error = check_counts(rank, world, "all_gather_bytes", counts).or_else(|| {
            if send.len() != counts[rank] {
                Some(format!(
                    "input has {} bytes but counts[{rank}] is {}",
                    send.len(),
                    counts[rank]
                ))
            } else if recv.len() != total {
                Some(format!(
                    "output has {} bytes but counts sum to {total}",
                    recv.len()
                ))
            } else {
                None
            }
        });
        let bufs = Bufs {
            send: send.as_ptr(),
            recv: recv.as_mut_ptr(),
        };
        let raw = RawOp {
            desc: desc_of(Elem::Byte, OpKind::AllGather, None, total, counts),
            counts: counts.to_vec(),
            bufs,
            keep: vec![Box::new(send), Box::new(recv)],
            error: invalid(rank, "all_gather_bytes", error),
        };
        self.submit(raw)
            .map(|mut v| (take_as::<Vec<u8>>(&mut v, 0), take_as::<Vec<u8>>(&mut v, 1)))
    }

    /// All-gather in place: `buf` holds `sum(counts)` elements and rank r's
    /// part is already at `buf[offset(r)..offset(r) + counts[r]]`; afterwards
    /// every part is everywhere.
    fn all_gather_in_place<T: Element>(
        &self,
        mut buf: HostBuffer<T>,
        counts: &[usize],
    ) -> Work<HostBuffer<T>> {
        let (rank, world) = (self.rank(), self.world_size());
        let total: usize = counts.iter().sum();
        let error = check_counts(rank, world, "all_gather_in_place", counts).or_else(|| {
            (buf.len() != total).then(|| {
                format!(
                    "buffer has {} elements but counts sum to {total}",
                    buf.len()
                )
            })
        });
        let ptr = buf.as_mut_ptr();
        let own = if error.is_none() {
            // SAFETY: offset(rank) + counts[rank] <= total == buf.len().
            unsafe { ptr.add(offsets(counts)[rank]) }
        } else {
            ptr
        };
        let raw = RawOp {
            desc: desc::<T>(OpKind::AllGather, None, total, counts),
            counts: counts.to_vec(),
            bufs: Bufs {
                send: own.cast(),
                recv: ptr.cast(),
            },
            keep: vec![Box::new(buf)],
            error: invalid(rank, "all_gather_in_place", error),
        };
        self.submit(raw).map(|mut v| take::<T>(&mut v, 0))
    }

    /// Copies `root`'s `buf` into every other rank's `buf` (same length).
    fn broadcast<T: Element>(&self, mut buf: HostBuffer<T>, root: usize) -> Work<HostBuffer<T>> {
        let (rank, world) = (self.rank(), self.world_size());
        let error = (root >= world).then(|| format!("root {root} is not a rank of {world}"));
        let ptr = buf.as_mut_ptr().cast::<u8>();
        let mut d = desc::<T>(OpKind::Broadcast, None, buf.len(), &[]);
        d.root = root.min(world.saturating_sub(1));
        let raw = RawOp {
            desc: d,
            counts: Vec::new(),
            bufs: Bufs {
                send: ptr,
                recv: ptr,
            },
            keep: vec![Box::new(buf)],
            error: invalid(rank, "broadcast", error),
        };
        self.submit(raw).map(|mut v| take::<T>(&mut v, 0))
    }

    /// Completes when every rank has reached it.
    fn barrier(&self) -> Work<()> {
        self.submit(RawOp::barrier(Vec::new(), None)).map(|_| ())
    }
}

fn check_counts(rank: usize, world: usize, _op: &str, counts: &[usize]) -> Option<String> {
    (counts.len() != world).then(|| {
        format!(
            "counts has {} entries but there are {world} ranks (this is rank {rank})",
            counts.len()
        )
    })
}

fn invalid(rank: usize, op: &'static str, msg: Option<String>) -> Option<Error> {
    msg.map(|msg| Error::InvalidArgument { rank, op, msg })
}
