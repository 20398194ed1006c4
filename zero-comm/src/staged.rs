//! Device collectives through host memory: [`HostStaged`] runs any host
//! [`Communicator`] (threads, MPI) on the buffers of any [`Backend`].
//!
//! This is how several ranks share one GPU: NCCL refuses two ranks of a
//! communicator on the same device before 2.30 (see [`crate::nccl`]), and
//! the GPU machines this project is tested on have one. Each collective
//! copies its input from the device into a pinned staging buffer, runs the
//! host collective on it, and copies its output back:
//!
//! ```text
//!   comm ──◆after──[d2h input]──●staged                      ┌──[h2d output]──●done
//!                                 ╲ sync (caller's thread)   │
//!   host                           └─[host collective on the staging buffer]
//!                                       (progress thread)     wait()
//! ```
//!
//! A world of one rank stages nothing: its collectives' results are their
//! inputs, so they only order the communication stream (no copy, no host
//! wait). Otherwise only what the collective reads goes down and only what
//! it writes comes back: all-reduce moves `buf[..len]` both ways; reduce-scatter moves the
//! whole input down and this rank's part back; all-gather moves this rank's
//! part down and the other ranks' parts back. The device buffer's other
//! elements are never touched.
//!
//! Every device step is an ordinary backend operation on the communication
//! stream, so the CPU backend's hazard checker sees this path exactly as a
//! GPU runs it (`tests/device_collectives.rs` runs the same checks on it as
//! on the direct CPU path). Costs, against NCCL on its own GPUs: the input
//! copy is waited for on the calling thread before the host collective
//! starts (so the host does not run ahead of the device by more than one
//! collective), and every collective crosses PCIe twice. Staging buffers
//! are pinned host memory from [`Backend::alloc_host`], kept and reused:
//! after the first step no collective allocates.

use std::any::Any;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use zero_core::backend::{Backend, BufferHandle, Stream};
use zero_core::{Element, HostBuffer};

use crate::counts::offsets;
use crate::device::{refuse, DeviceWork};
use crate::{Communicator, DeviceCollectives, Error, ReduceOp, Result, Work};

/// A host [`Communicator`] whose collectives run on a backend's device
/// buffers through pinned host staging buffers (see the [module
/// docs](self)).
pub struct HostStaged<C> {
    comm: C,
    pool: Arc<Mutex<Pool>>,
}

/// Idle staging buffers (each a boxed `B::HostBuffer<T>`, told apart by
/// downcasting) with their lengths, and the bytes of all of them, idle or
/// leased.
#[derive(Default)]
struct Pool {
    idle: Vec<(usize, Box<dyn Any + Send + Sync>)>,
    bytes: usize,
}

/// A staging buffer taken from the pool; dropping it puts it back (also
/// when a collective's handle is dropped unwaited, or on an error path).
struct Lease<H: Send + Sync + 'static> {
    stage: ManuallyDrop<H>,
    len: usize,
    pool: Arc<Mutex<Pool>>,
}

impl<H: Send + Sync + 'static> Drop for Lease<H> {
    fn drop(&mut self) {
        // SAFETY: `stage` is taken once, here, and never used again.
        let stage = unsafe { ManuallyDrop::take(&mut self.stage) };
        // A poisoned pool drops the buffer (a panic elsewhere already
        // failed this communicator's user).
        if let Ok(mut pool) = self.pool.lock() {
            pool.idle.push((self.len, Box::new(stage)));
        }
    }
}

impl<C: Communicator> HostStaged<C> {
    /// Device collectives of `comm`'s ranks through host memory.
    pub fn new(comm: C) -> Self {
        HostStaged {
            comm,
            pool: Arc::default(),
        }
    }

    /// The host communicator.
    pub fn comm(&self) -> &C {
        &self.comm
    }

    /// Bytes of pinned host memory held for staging (idle or in use): the
    /// largest set of collectives in flight at once, each of its size.
    pub fn staging_bytes(&self) -> usize {
        self.pool.lock().map_or(0, |p| p.bytes)
    }

    /// Moves `ranges` of `buf` through a staging buffer of `total` elements
    /// and runs `start` on it: see the module docs for the order.
    #[allow(clippy::too_many_arguments)]
    fn staged<B: Backend + Clone, T: Element>(
        &self,
        backend: &B,
        op: &'static str,
        buf: B::Buffer<T>,
        total: usize,
        down: &[Range<usize>],
        up: &[Range<usize>],
        after: &B::Event,
        start: impl FnOnce(HostBuffer<T>) -> Work<HostBuffer<T>>,
    ) -> DeviceWork<B, T> {
        if total > buf.len() {
            let msg = format!(
                "buffer {:?} ({}) has {} elements, the collective needs {total}",
                buf.label(),
                buf.id(),
                buf.len()
            );
            return self.refuse(op, msg);
        }
        if self.comm.world_size() == 1 {
            return self.alone(backend, op, buf, after);
        }
        let down: Vec<_> = down.iter().filter(|r| !r.is_empty()).cloned().collect();
        let up: Vec<_> = up.iter().filter(|r| !r.is_empty()).cloned().collect();
        let host = match self.stage_down(backend, op, &buf, total, &down, after) {
            Ok(host) => host,
            Err(e) => return refuse(&self.comm, op, e),
        };
        let backend = backend.clone();
        let work = start(host).map(move |host| -> Result<(B::Buffer<T>, B::Event)> {
            let mut buf = buf;
            // Back to the pool when dropped below: later copies into it are
            // on the same stream, after these.
            let lease = take_lease::<B, T>(host)?;
            for r in &up {
                backend.copy_h2d(
                    Stream::Comm,
                    &*lease.stage,
                    r.start,
                    &mut buf,
                    r.start,
                    r.len(),
                )?;
            }
            let done = backend.record(Stream::Comm)?;
            Ok((buf, done))
        });
        DeviceWork::host(op, work)
    }

    /// A collective of one rank: its result is its input (the sum, mean or
    /// maximum of one value; an all-gather with no other part), so nothing
    /// is staged, copied or waited for on the host. The communication
    /// stream waits for `after`, and the buffer's next users for an event
    /// recorded there after it, as for a staged collective.
    fn alone<B: Backend, T: Element>(
        &self,
        backend: &B,
        op: &'static str,
        buf: B::Buffer<T>,
        after: &B::Event,
    ) -> DeviceWork<B, T> {
        let done = backend
            .wait(Stream::Comm, after)
            .and_then(|()| backend.record(Stream::Comm));
        match done {
            Ok(done) => DeviceWork::ready(op, buf, done),
            Err(e) => refuse(&self.comm, op, e.into()),
        }
    }

    /// The communication stream waits for `after` and copies `down` of
    /// `buf` into a staging buffer; the host waits for the copy. Returns
    /// the staging buffer as a host buffer of `total` elements that owns it.
    fn stage_down<B: Backend, T: Element>(
        &self,
        backend: &B,
        op: &'static str,
        buf: &B::Buffer<T>,
        total: usize,
        down: &[Range<usize>],
        after: &B::Event,
    ) -> Result<HostBuffer<T>> {
        let mut lease = self.lease::<B, T>(backend, op, total)?;
        backend.wait(Stream::Comm, after)?;
        for r in down {
            backend.copy_d2h(
                Stream::Comm,
                buf,
                r.start,
                &mut *lease.stage,
                r.start,
                r.len(),
            )?;
        }
        let staged = backend.record(Stream::Comm)?;
        backend.sync(&staged)?;
        let view = backend.write_host(&mut *lease.stage, 0..total)?;
        let ptr = NonNull::new(view.as_mut_ptr()).unwrap_or(NonNull::dangling());
        // SAFETY: `ptr` is `total` elements of the staging buffer's host
        // memory, aligned for T (a slice of it); that memory stays where it
        // is while the handle lives, wherever the handle moves (the
        // `Backend::HostBuffer` contract), and the handle is the owner, so
        // it lives as long as the host buffer. The copies into it finished
        // (synced above) and nothing else is enqueued on it until the owner
        // is taken back after the collective.
        Ok(unsafe { HostBuffer::from_external(ptr, total, Box::new(lease)) })
    }

    /// An idle staging buffer of `B`'s host buffers of `T` with at least
    /// `len` elements (the smallest such), or a new one.
    fn lease<B: Backend, T: Element>(
        &self,
        backend: &B,
        op: &str,
        len: usize,
    ) -> Result<Lease<B::HostBuffer<T>>> {
        let mut pool = self
            .pool
            .lock()
            .map_err(|_| poisoned(self.comm.rank(), op))?;
        let lease = |stage, len| Lease {
            stage: ManuallyDrop::new(stage),
            len,
            pool: Arc::clone(&self.pool),
        };
        // Only this backend's buffers: one communicator may serve several.
        let fit = pool
            .idle
            .iter()
            .enumerate()
            .filter(|(_, (n, b))| {
                *n >= len
                    && b.downcast_ref::<B::HostBuffer<T>>()
                        .is_some_and(|b| backend.owns_host(b))
            })
            .min_by_key(|(_, (n, _))| *n)
            .map(|(i, _)| i);
        if let Some(i) = fit {
            let (n, b) = pool.idle.swap_remove(i);
            if let Ok(b) = b.downcast::<B::HostBuffer<T>>() {
                return Ok(lease(*b, n));
            }
        }
        let label = format!("{op} staging ({len} x {:?})", T::DTYPE);
        let stage = backend.alloc_host::<T>(len, &label)?;
        pool.bytes += len * std::mem::size_of::<T>();
        Ok(lease(stage, len))
    }

    fn refuse<B: Backend, T: Element>(&self, op: &'static str, msg: String) -> DeviceWork<B, T> {
        let e = Error::InvalidArgument {
            rank: self.comm.rank(),
            op,
            msg,
        };
        refuse(&self.comm, op, e)
    }

    /// `counts` as the in-place collectives need them, or why not.
    fn check_counts(&self, counts: &[usize]) -> std::result::Result<(usize, Range<usize>), String> {
        let world = self.comm.world_size();
        if counts.len() != world {
            return Err(format!(
                "{} counts given for a world of {world} ranks",
                counts.len()
            ));
        }
        let rank = self.comm.rank();
        let at = offsets(counts)[rank];
        Ok((counts.iter().sum(), at..at + counts[rank]))
    }
}

/// The lease of the staging buffer that a host buffer made by `stage_down`
/// owns.
fn take_lease<B: Backend, T: Element>(host: HostBuffer<T>) -> Result<Lease<B::HostBuffer<T>>> {
    host.into_external_owner()
        .ok()
        .and_then(|owner| {
            let owner: Box<dyn Any> = owner;
            owner.downcast::<Lease<B::HostBuffer<T>>>().ok()
        })
        .map(|b| *b)
        .ok_or_else(|| {
            Error::Core(zero_core::Error::Unsupported(
                "a staged collective got back a host buffer that is not its staging buffer".into(),
            ))
        })
}

fn poisoned(rank: usize, op: &str) -> Error {
    Error::Core(zero_core::Error::Unsupported(format!(
        "rank {rank}: {op}: the staging pool was poisoned by a panic on another thread"
    )))
}

impl<B: Backend + Clone, C: Communicator> DeviceCollectives<B> for HostStaged<C> {
    fn device_alloc<T: Element>(
        &self,
        backend: &B,
        len: usize,
        label: &str,
    ) -> Result<B::Buffer<T>> {
        Ok(backend.alloc(len, label)?)
    }

    fn device_all_reduce<T: Element>(
        &self,
        backend: &B,
        buf: B::Buffer<T>,
        len: usize,
        op: ReduceOp,
        after: &B::Event,
    ) -> DeviceWork<B, T> {
        let all = 0..len;
        let all = std::slice::from_ref(&all);
        self.staged(backend, "all_reduce", buf, len, all, all, after, |host| {
            self.comm.all_reduce(host, op)
        })
    }

    fn device_reduce_scatter<T: Element>(
        &self,
        backend: &B,
        buf: B::Buffer<T>,
        counts: &[usize],
        op: ReduceOp,
        after: &B::Event,
    ) -> DeviceWork<B, T> {
        const OP: &str = "reduce_scatter";
        let (total, own) = match self.check_counts(counts) {
            Ok(c) => c,
            Err(msg) => return self.refuse(OP, msg),
        };
        self.staged(
            backend,
            OP,
            buf,
            total,
            std::slice::from_ref(&(0..total)),
            std::slice::from_ref(&own),
            after,
            |host| self.comm.reduce_scatter_in_place(host, counts, op),
        )
    }

    fn device_all_gather<T: Element>(
        &self,
        backend: &B,
        buf: B::Buffer<T>,
        counts: &[usize],
        after: &B::Event,
    ) -> DeviceWork<B, T> {
        const OP: &str = "all_gather";
        let (total, own) = match self.check_counts(counts) {
            Ok(c) => c,
            Err(msg) => return self.refuse(OP, msg),
        };
        let others = [0..own.start, own.end..total];
        self.staged(
            backend,
            OP,
            buf,
            total,
            std::slice::from_ref(&own),
            &others,
            after,
            |host| self.comm.all_gather_in_place(host, counts),
        )
    }
}
