//! The CPU backend: device memory is host memory, streams are ordered
//! queues, and in tests a hazard checker proves every access ordered.
//!
//! # Modes
//!
//! - [`CpuMode::Inline`] (production, the default): every operation runs at
//!   once on the calling thread, in call order, so every stream is trivially
//!   ordered after everything called before; events are empty values. No
//!   checker and no bookkeeping: an operation costs one branch over calling
//!   its loop directly.
//! - [`CpuMode::Checked`]: the same execution, but every access is first
//!   checked against the vector clocks of the streams and the host (see
//!   [`crate::backend`]); an access not ordered after a conflicting one is
//!   refused with [`Error::Hazard`], before anything runs. Because ordering
//!   is decided by the events the caller waited for, never by timing, a
//!   missing wait fails on every run.
//! - [`CpuMode::Chaos`]: the checker, plus real concurrency. Each stream is
//!   a worker thread running its queue in order, each operation after a
//!   random delay drawn from the seed; events are real (a stream waits for
//!   another's progress, `sync` blocks the host). A dropped buffer's memory
//!   is poisoned (every byte `0xFF`, a NaN in every dtype) once every queue
//!   has passed the drop, and kept for a while before it is reused. A
//!   correctly ordered program gives the same numbers as in `Inline`.
//!
//! # Memory shared with host code
//!
//! A [`CpuBuffer`] wraps a [`HostBuffer`]. Host collectives take
//! `HostBuffer`s by value: [`CpuBackend::lend`] hands the memory out as one
//! operation on a stream (checked like any other) and
//! [`CpuBackend::give_back`] takes it back under the same id, so the
//! checker keeps following the buffer. [`CpuBackend::alloc_with`] lets a
//! communicator's allocator (MPI's shared windows) provide the memory, and
//! [`CpuBackend::host_slice`]/[`host_slice_mut`](CpuBackend::host_slice_mut)
//! give CPU trainer code checked slices of device buffers.
//!
//! One host thread drives a backend at a time (clones share it): the
//! checker has one host agent.

use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::checks::{self, disjoint, item_error, range_len};
use super::events::{EventPool, Pooled};
use super::hazard::{Checker, Clock, Decl};
use super::{
    AccessKind, AdamWPart, Backend, BufferHandle, BufferId, PackPiece, Stream, UnpackPiece,
};
use crate::optim::{AdamWSlices, AdamWStep, CpuAdamW};
use crate::{Device, Element, Error, HostBuffer, Result};

mod chaos;
mod kernels;
mod launch;

use chaos::Workers;
use kernels::{store, Raw};

pub use chaos::POISON;
pub use launch::{In, LaunchArgs, Out, Running};

/// How a [`CpuBackend`] runs and checks its operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuMode {
    /// Production: operations run at once on the calling thread; nothing is
    /// checked or recorded.
    #[default]
    Inline,
    /// Tests: operations run at once, after the hazard checker accepted
    /// every access they declare.
    Checked,
    /// Tests: the checker, plus one worker thread per stream with random
    /// delays drawn from `seed`, real events, and freed memory poisoned.
    Chaos {
        /// Seeds the delays.
        seed: u64,
    },
}

/// Buffer ids are unique across backends, so a buffer of another backend
/// is never mistaken for one of this.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_BACKEND: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Inner {
    mode: CpuMode,
    /// Checked or Chaos.
    checked: bool,
    instance: u64,
    adam: CpuAdamW,
    checker: Mutex<Checker>,
    /// The first error that could not be returned where it happened (a
    /// drop, an operation on a worker); the next fallible call returns it.
    stored: Arc<Mutex<Option<Error>>>,
    workers: Option<Workers>,
    /// The free events of the checked modes.
    events: Arc<EventPool<Slot>>,
}

impl Inner {
    fn store_error(&self, e: Error) {
        lock(&self.stored).get_or_insert(e);
    }

    fn take_stored(&self) -> Result<()> {
        match lock(&self.stored).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Releases the memory of buffer `id`: checked as a host write of all
    /// of it when `check` (a conflict is stored), then freed at once, or in
    /// Chaos mode once every queue passed this point.
    fn release<T: Element>(&self, id: BufferId, mut mem: HostBuffer<T>, check: bool) {
        let mut checker = lock(&self.checker);
        if check {
            let decl = Decl {
                id,
                range: 0..mem.len(),
                kind: AccessKind::Write,
            };
            if let Err(e) = checker.host("drop", &[decl]) {
                self.store_error(e);
            }
        }
        checker.forget(id);
        if let Some(w) = &self.workers {
            let (ptr, bytes) = (
                mem.as_mut_ptr().cast::<u8>(),
                mem.capacity() * size_of::<T>(),
            );
            w.bury(id, Box::new(mem), ptr, bytes);
        }
    }

    /// Blocks until every queued operation that may touch `id` has run
    /// (Chaos mode).
    fn quiesce(&self, id: BufferId) {
        if let Some(w) = &self.workers {
            let pending = lock(&self.checker).pending(id);
            w.wait_all(pending);
        }
    }
}

/// The CPU implementation of [`Backend`]; see the [module](self) docs for
/// the modes. Cloning shares the backend (its streams, checker and buffers'
/// bookkeeping).
///
/// ```
/// use zero_core::backend::{Backend, CpuBackend, CpuMode, Stream};
///
/// let dev = CpuBackend::new(CpuMode::Checked)?;
/// let mut a = dev.alloc::<f32>(4, "a")?;
/// let mut b = dev.alloc::<f32>(4, "b")?;
/// dev.fill(Stream::HostToDevice, &mut a, 0..4, 2.0)?;
/// let uploaded = dev.record(Stream::HostToDevice)?;
/// // Without this wait the copy below is refused with Error::Hazard.
/// dev.wait(Stream::Compute, &uploaded)?;
/// dev.copy_d2d(Stream::Compute, &a, 0, &mut b, 0, 4)?;
/// let done = dev.record(Stream::Compute)?;
/// dev.sync(&done)?;
/// assert_eq!(dev.host_slice(&b, 0..4)?, &[2.0; 4]);
/// # Ok::<(), zero_core::Error>(())
/// ```
#[derive(Clone)]
pub struct CpuBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("mode", &self.inner.mode)
            .finish()
    }
}

/// A buffer of the CPU backend: a [`HostBuffer`] with an id and a label.
///
/// Its memory is reached only through the backend (primitives, checked host
/// slices, [`CpuBackend::lend`]), so the checked modes see every access.
/// Dropping it is a host write of all of it: in the checked modes a drop
/// while an unsynced operation still uses it stores [`Error::Hazard`] for
/// the backend's next call, and in Chaos mode the memory is only freed (and
/// poisoned) once every queue has passed the drop.
pub struct CpuBuffer<T: Element> {
    mem: ManuallyDrop<HostBuffer<T>>,
    id: BufferId,
    label: Arc<str>,
    owner: Arc<Inner>,
}

impl<T: Element> BufferHandle<T> for CpuBuffer<T> {
    fn id(&self) -> BufferId {
        self.id
    }
    fn len(&self) -> usize {
        self.mem.len()
    }
    fn label(&self) -> &str {
        &self.label
    }
}

impl<T: Element> std::fmt::Debug for CpuBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBuffer")
            .field("id", &self.id)
            .field("label", &self.label)
            .field("dtype", &T::DTYPE)
            .field("len", &self.mem.len())
            .finish()
    }
}

impl<T: Element> CpuBuffer<T> {
    /// Elements `at..at + len` for reading, after the bounds check.
    fn raw(&self, op: &'static str, at: usize, len: usize) -> Result<Raw<T>> {
        bounds(op, self, at, len)?;
        // SAFETY: `at + len <= self.len()` (checked above).
        Ok(unsafe { Raw::new(self.mem.as_ptr().cast_mut(), at, len) })
    }

    /// Elements `at..at + len` for writing, after the bounds check.
    fn raw_mut(&mut self, op: &'static str, at: usize, len: usize) -> Result<Raw<T>> {
        bounds(op, self, at, len)?;
        // SAFETY: `at + len <= self.len()` (checked above).
        Ok(unsafe { Raw::new(self.mem.as_mut_ptr(), at, len) })
    }

    fn decl(&self, at: usize, len: usize, kind: AccessKind) -> Decl {
        Decl {
            id: self.id,
            range: at..at + len,
            kind,
        }
    }

    /// Takes the memory out without running `Drop`.
    fn into_parts(self) -> (HostBuffer<T>, BufferId, Arc<str>, Arc<Inner>) {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never used or dropped again; each field is read
        // exactly once.
        unsafe {
            (
                ManuallyDrop::take(&mut me.mem),
                me.id,
                std::ptr::read(&me.label),
                std::ptr::read(&me.owner),
            )
        }
    }
}

impl<T: Element> Drop for CpuBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: `mem` is not used after this.
        let mem = unsafe { ManuallyDrop::take(&mut self.mem) };
        if self.owner.checked {
            self.owner.release(self.id, mem, true);
        }
    }
}

fn bounds<T: Element>(op: &'static str, b: &CpuBuffer<T>, at: usize, len: usize) -> Result<()> {
    checks::bounds(op, &b.label, b.id, b.mem.len(), at, len)
}

/// A point in one stream's work (see [`Backend::record`]). In `Inline`
/// mode it carries nothing that is ever waited for; in `Checked` and
/// `Chaos` modes its point lives in an event of the backend's pool, as a
/// device backend's does (`src/backend/events.rs`): a reuse of a pooled
/// event that one of its handles still needed would show as an unordered
/// access (`Checked`) or wrong data (`Chaos`).
#[derive(Clone)]
pub struct CpuEvent {
    backend: u64,
    stream: Stream,
    /// The pooled event that holds its point; `None` in `Inline` mode.
    point: Option<Arc<Pooled<Slot>>>,
}

/// A checked-mode event, as a device's: recording it again (from the
/// pool) changes what every handle to it refers to.
type Slot = Arc<Mutex<Point>>;

/// What a checked event records: the stream, the checker's clock and, in
/// Chaos mode, the items queued on the stream then.
#[derive(Debug, Clone, Copy)]
struct Point {
    stream: Stream,
    clock: Clock,
    seq: u64,
}

impl CpuEvent {
    /// The stream it was recorded on.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// The recorded point (checked modes).
    fn point(&self) -> Option<Point> {
        self.point.as_deref().map(|p| *lock(p.get()))
    }
}

impl fmt::Debug for CpuEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuEvent")
            .field("stream", &self.stream)
            .field("point", &self.point())
            .finish()
    }
}

/// The results of [`Backend::sum_squares`]: one f64 per part, readable with
/// [`Backend::read_scalars`] after the stream was synced.
pub struct CpuScalars {
    values: Arc<Mutex<Vec<f64>>>,
    id: BufferId,
    owner: Arc<Inner>,
}

impl Drop for CpuScalars {
    fn drop(&mut self) {
        if self.owner.checked {
            // The values live as long as any operation that writes them
            // (it holds `values`): nothing to defer.
            lock(&self.owner.checker).forget(self.id);
        }
    }
}

impl std::fmt::Debug for CpuScalars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuScalars").field("id", &self.id).finish()
    }
}

/// A buffer lent to host code (a host collective) by [`CpuBackend::lend`];
/// [`CpuBackend::give_back`] returns the memory under the same id.
///
/// Dropping a loan without giving the memory back (the collective failed
/// and kept it) ends the buffer.
#[must_use = "give the memory back with CpuBackend::give_back"]
pub struct Loan<T: Element> {
    id: BufferId,
    label: Arc<str>,
    len: usize,
    event: CpuEvent,
    owner: Arc<Inner>,
    _elem: PhantomData<fn() -> T>,
}

impl<T: Element> Loan<T> {
    /// The id of the lent buffer.
    pub fn id(&self) -> BufferId {
        self.id
    }

    /// The label of the lent buffer.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The number of elements lent (what must come back).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no elements were lent.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The event recorded right after the lending operation on its stream:
    /// what later work must wait for (or the host sync) before it touches
    /// the buffer again.
    pub fn event(&self) -> &CpuEvent {
        &self.event
    }
}

impl<T: Element> Drop for Loan<T> {
    fn drop(&mut self) {
        if self.owner.checked {
            lock(&self.owner.checker).forget(self.id);
        }
    }
}

impl<T: Element> std::fmt::Debug for Loan<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loan")
            .field("id", &self.id)
            .field("label", &self.label)
            .finish()
    }
}

impl CpuBackend {
    /// A backend in `mode`, with the default [`CpuAdamW`] (widest SIMD, one
    /// thread per core).
    pub fn new(mode: CpuMode) -> Result<Self> {
        Self::with_adamw(mode, CpuAdamW::new())
    }

    /// A backend in `mode` whose `adamw` and `sum_squares` run on `adam`
    /// (its instruction set, threads and tiles).
    pub fn with_adamw(mode: CpuMode, adam: CpuAdamW) -> Result<Self> {
        let stored = Arc::new(Mutex::new(None));
        let workers = match mode {
            CpuMode::Chaos { seed } => Some(Workers::start(seed, stored.clone())?),
            CpuMode::Inline | CpuMode::Checked => None,
        };
        Ok(CpuBackend {
            inner: Arc::new(Inner {
                mode,
                checked: mode != CpuMode::Inline,
                instance: NEXT_BACKEND.fetch_add(1, Ordering::Relaxed),
                adam,
                checker: Mutex::new(Checker::new()),
                stored,
                workers,
                events: Arc::default(),
            }),
        })
    }

    /// The mode.
    pub fn mode(&self) -> CpuMode {
        self.inner.mode
    }

    /// The AdamW and norm kernels.
    pub fn adamw_kernels(&self) -> &CpuAdamW {
        &self.inner.adam
    }

    /// A buffer over memory that `alloc` provides for `len` elements (e.g.
    /// `|n| comm.alloc(n)`: a communicator's registered memory, MPI's
    /// shared window). The memory must hold `len` elements (zeroed, if the
    /// buffer is to start at zero).
    pub fn alloc_with<T: Element, E: From<Error>>(
        &self,
        len: usize,
        label: &str,
        alloc: impl FnOnce(usize) -> std::result::Result<HostBuffer<T>, E>,
    ) -> std::result::Result<CpuBuffer<T>, E> {
        let mem = alloc(len)?;
        if mem.len() != len {
            return Err(Error::InvalidSize {
                op: "alloc_with",
                msg: format!("asked for {len} elements for {label:?}, got {}", mem.len()),
            }
            .into());
        }
        Ok(self.wrap(mem, label)?)
    }

    /// A buffer over `mem`, keeping its contents.
    pub fn wrap<T: Element>(&self, mem: HostBuffer<T>, label: &str) -> Result<CpuBuffer<T>> {
        if self.inner.checked {
            self.inner.take_stored()?;
        }
        let id = BufferId(NEXT_ID.fetch_add(1, Ordering::Relaxed));
        let label: Arc<str> = Arc::from(label);
        if self.inner.checked {
            lock(&self.inner.checker).register(id, label.clone(), mem.len());
        }
        Ok(CpuBuffer {
            mem: ManuallyDrop::new(mem),
            id,
            label,
            owner: self.inner.clone(),
        })
    }

    /// Ends `buf` and returns its memory: a host write of all of it, so
    /// every earlier access must have been synced ([`Error::Hazard`]
    /// otherwise; the buffer is then released as by a drop).
    pub fn into_host<T: Element>(&self, buf: CpuBuffer<T>) -> Result<HostBuffer<T>> {
        self.own(&buf, "into_host")?;
        let (mem, id, _, owner) = buf.into_parts();
        if !owner.checked {
            return Ok(mem);
        }
        let decl = Decl {
            id,
            range: 0..mem.len(),
            kind: AccessKind::Write,
        };
        let checked = owner
            .take_stored()
            .and_then(|()| lock(&owner.checker).host("into_host", &[decl]));
        if let Err(e) = checked {
            owner.release(id, mem, false);
            return Err(e);
        }
        owner.quiesce(id);
        lock(&owner.checker).forget(id);
        Ok(mem)
    }

    /// Lends the memory of `buf` to host code that runs as operation `op`
    /// on `stream` (a host collective), with the accesses `accesses`
    /// declares (element ranges of `buf`).
    ///
    /// The operation is checked like any other: make `stream` wait for the
    /// event after which the memory is ready first. In Chaos mode this
    /// blocks until the queued work that touches the buffer has run, since
    /// the memory leaves the backend. The loan's [`event`](Loan::event) is
    /// recorded after the operation: later work on other streams must wait
    /// for it, as for any operation, once the memory is back.
    ///
    /// On an error the buffer is released (as by a drop, without a second
    /// check) and the error returned.
    pub fn lend<T: Element>(
        &self,
        stream: Stream,
        op: &'static str,
        buf: CpuBuffer<T>,
        accesses: &[(Range<usize>, AccessKind)],
    ) -> Result<(Loan<T>, HostBuffer<T>)> {
        self.own(&buf, op)?;
        let (mem, id, label, owner) = buf.into_parts();
        let len = mem.len();
        if !owner.checked {
            let event = self.trivial_event(stream);
            let loan = Loan {
                id,
                label,
                len,
                event,
                owner,
                _elem: PhantomData,
            };
            return Ok((loan, mem));
        }
        let enqueued = owner.take_stored().and_then(|()| {
            let decls: Vec<Decl> = accesses
                .iter()
                .map(|(r, kind)| Decl {
                    id,
                    range: r.clone(),
                    kind: *kind,
                })
                .collect();
            let mut checker = lock(&owner.checker);
            let seq = owner.workers.as_ref().map_or(0, |w| w.pushed(stream));
            checker.enqueue(stream, op, &decls, seq)?;
            Ok(self.event_locked(&checker, stream))
        });
        match enqueued {
            Ok(event) => {
                owner.quiesce(id);
                let loan = Loan {
                    id,
                    label,
                    len,
                    event,
                    owner,
                    _elem: PhantomData,
                };
                Ok((loan, mem))
            }
            Err(e) => {
                owner.release(id, mem, false);
                Err(e)
            }
        }
    }

    /// Takes lent memory back: the buffer of `loan`, same id and label, and
    /// the event after which its contents are what the lending operation
    /// left. `mem` must hold at least the lent number of elements (its
    /// length is restored to that).
    pub fn give_back<T: Element>(
        &self,
        loan: Loan<T>,
        mut mem: HostBuffer<T>,
    ) -> Result<(CpuBuffer<T>, CpuEvent)> {
        if !Arc::ptr_eq(&loan.owner, &self.inner) {
            return Err(Error::Backend {
                op: "give_back",
                msg: format!("loan of buffer {} belongs to another backend", loan.id),
            });
        }
        mem.set_len(loan.len).map_err(|_| Error::InvalidSize {
            op: "give_back",
            msg: format!(
                "buffer {:?} ({}) was lent with {} elements, {} came back",
                loan.label,
                loan.id,
                loan.len,
                mem.capacity()
            ),
        })?;
        let loan = ManuallyDrop::new(loan);
        // SAFETY: `loan` is never used or dropped again; each field is read
        // once.
        let (id, label, event, owner) = unsafe {
            (
                loan.id,
                std::ptr::read(&loan.label),
                std::ptr::read(&loan.event),
                std::ptr::read(&loan.owner),
            )
        };
        let buf = CpuBuffer {
            mem: ManuallyDrop::new(mem),
            id,
            label,
            owner,
        };
        Ok((buf, event))
    }

    /// Elements `range` of `buf` for CPU code to read: a host read, valid
    /// only after every conflicting earlier access was synced.
    pub fn host_slice<'a, T: Element>(
        &self,
        buf: &'a CpuBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a [T]> {
        self.host_access("host_slice", buf, &range, AccessKind::Read)?;
        Ok(&buf.mem[range])
    }

    /// Elements `range` of `buf` for CPU code to write: a host write, valid
    /// only after every earlier access was synced.
    pub fn host_slice_mut<'a, T: Element>(
        &self,
        buf: &'a mut CpuBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a mut [T]> {
        self.host_access("host_slice_mut", buf, &range, AccessKind::Write)?;
        Ok(&mut buf.mem[range])
    }

    /// Makes every page of `buf` resident ([`HostBuffer::prefault`]): a
    /// host write of all of it.
    pub fn prefault<T: Element>(&self, buf: &mut CpuBuffer<T>) -> Result<()> {
        let all = 0..buf.mem.len();
        self.host_access("prefault", buf, &all, AccessKind::Write)?;
        buf.mem.prefault();
        Ok(())
    }

    /// Test hook (Chaos mode): the bytes of freed buffer `id` once its
    /// memory was poisoned, while it is kept in quarantine; `None` before
    /// that, after it was reused, and in the other modes.
    pub fn quarantined(&self, id: BufferId) -> Option<Vec<u8>> {
        self.inner.workers.as_ref()?.quarantine().bytes(id)
    }

    fn own<T: Element>(&self, buf: &CpuBuffer<T>, op: &'static str) -> Result<()> {
        if Arc::ptr_eq(&buf.owner, &self.inner) {
            Ok(())
        } else {
            Err(Error::Backend {
                op,
                msg: format!(
                    "buffer {:?} ({}) belongs to another backend",
                    buf.label, buf.id
                ),
            })
        }
    }

    fn own_event(&self, ev: &CpuEvent, op: &'static str) -> Result<()> {
        if ev.backend == self.inner.instance {
            Ok(())
        } else {
            Err(Error::Backend {
                op,
                msg: format!("event on stream {} belongs to another backend", ev.stream),
            })
        }
    }

    fn host_access<T: Element>(
        &self,
        op: &'static str,
        buf: &CpuBuffer<T>,
        range: &Range<usize>,
        kind: AccessKind,
    ) -> Result<()> {
        let len = range_len(op, range)?;
        bounds(op, buf, range.start, len)?;
        if self.inner.checked {
            self.own(buf, op)?;
            self.inner.take_stored()?;
            lock(&self.inner.checker).host(op, &[buf.decl(range.start, len, kind)])?;
        }
        Ok(())
    }

    fn trivial_event(&self, stream: Stream) -> CpuEvent {
        CpuEvent {
            backend: self.inner.instance,
            stream,
            point: None,
        }
    }

    /// A checked event on `stream`: a pooled one whose work is done (Chaos:
    /// its stream's worker got past it), recorded again, or a new one.
    fn event_locked(&self, checker: &Checker, stream: Stream) -> CpuEvent {
        let workers = self.inner.workers.as_ref();
        let point = Point {
            stream,
            clock: checker.record(stream),
            seq: workers.map_or(0, |w| w.pushed(stream)),
        };
        let done = |p: &Point| workers.is_none_or(|w| w.completed(p.stream) >= p.seq);
        let slot = match self.inner.events.take(|e| done(&lock(e))) {
            Some(e) => {
                *lock(&e) = point;
                e
            }
            None => {
                self.inner.events.created_one();
                Arc::new(Mutex::new(point))
            }
        };
        CpuEvent {
            backend: self.inner.instance,
            stream,
            point: Some(Arc::new(Pooled::new(slot, self.inner.events.clone()))),
        }
    }

    /// Events created so far in `Checked` and `Chaos` modes (every other
    /// record reused a pooled one).
    #[doc(hidden)]
    pub fn events_created(&self) -> u64 {
        self.inner.events.created()
    }

    /// Runs `job` as operation `op` on `stream`: at once in `Inline`; after
    /// the checker accepted `decls` in `Checked`; queued on the stream's
    /// worker in `Chaos`.
    ///
    /// `job` may only dereference the [`Raw`] ranges that `decls` declares
    /// (with the declared access), and only ranges of buffers the caller
    /// borrows for this call.
    fn submit<F>(
        &self,
        stream: Stream,
        op: &'static str,
        decls: impl FnOnce() -> Vec<Decl>,
        job: F,
    ) -> Result<()>
    where
        F: FnOnce() -> Result<()> + Send + 'static,
    {
        let inner = &*self.inner;
        if !inner.checked {
            return job();
        }
        inner.take_stored()?;
        let decls = decls();
        let mut checker = lock(&inner.checker);
        match &inner.workers {
            None => {
                checker.enqueue(stream, op, &decls, 0)?;
                // Run under the lock: the checker's single host agent
                // stands for one thread driving the backend.
                job()
            }
            Some(w) => {
                checker.enqueue(stream, op, &decls, w.next_seq(stream))?;
                // SAFETY (of the job's raw ranges, which it dereferences on
                // the worker later): the checker accepted every declared
                // access, so each is ordered after every conflicting access
                // enqueued earlier (and the worker honours that order
                // through its queue and its waits), and every later
                // conflicting access must be ordered after this one (or is
                // refused before it is queued). The memory outlives the
                // job: a dropped buffer is freed only after every queue ran
                // past the drop, and lent or unwrapped memory leaves only
                // after the jobs that touch it ran (`quiesce`).
                w.run(stream, Box::new(job));
                Ok(())
            }
        }
    }
}

impl Backend for CpuBackend {
    type Buffer<T: Element> = CpuBuffer<T>;
    type HostBuffer<T: Element> = CpuBuffer<T>;
    type Event = CpuEvent;
    type Scalars = CpuScalars;

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn alloc<T: Element>(&self, len: usize, label: &str) -> Result<CpuBuffer<T>> {
        self.wrap(HostBuffer::zeros(len)?, label)
    }

    fn owns_host<T: Element>(&self, buf: &CpuBuffer<T>) -> bool {
        Arc::ptr_eq(&buf.owner, &self.inner)
    }

    fn alloc_on<T: Element>(
        &self,
        stream: Stream,
        len: usize,
        label: &str,
    ) -> Result<CpuBuffer<T>> {
        let mut buf = self.alloc(len, label)?;
        if self.inner.checked {
            // The memory is zero already; the fill stands for the zeroing a
            // GPU does on `stream`, which other streams must wait for.
            self.fill(stream, &mut buf, 0..len, T::from_f32(0.0))?;
        }
        Ok(buf)
    }

    /// Checked (and chaos) mode fills the buffer with NaN on `stream`: a
    /// read of what was not written shows, and the fill stands for the
    /// GPU's allocation on `stream`, which other streams must wait for.
    fn alloc_scratch_on<T: Element>(
        &self,
        stream: Stream,
        len: usize,
        label: &str,
    ) -> Result<CpuBuffer<T>> {
        let mut buf = self.alloc(len, label)?;
        if self.inner.checked {
            self.fill(stream, &mut buf, 0..len, T::from_f32(f32::NAN))?;
        }
        Ok(buf)
    }

    fn release_on<T: Element>(&self, stream: Stream, buf: CpuBuffer<T>) {
        if !buf.owner.checked {
            // Inline: everything enqueued already ran.
            drop(buf);
            return;
        }
        let (mem, id, _, owner) = buf.into_parts();
        let decl = Decl {
            id,
            range: 0..mem.len(),
            kind: AccessKind::Write,
        };
        {
            let mut checker = lock(&owner.checker);
            let seq = owner.workers.as_ref().map_or(0, |w| w.pushed(stream));
            if let Err(e) = checker.enqueue(stream, "release_on", &[decl], seq) {
                owner.store_error(e);
            }
        }
        // The memory is freed once every queue ran past this point (at
        // once in Checked mode, where everything enqueued already ran).
        owner.release(id, mem, false);
    }

    fn alloc_host<T: Element>(&self, len: usize, label: &str) -> Result<CpuBuffer<T>> {
        self.alloc(len, label)
    }

    fn record(&self, stream: Stream) -> Result<CpuEvent> {
        if !self.inner.checked {
            return Ok(self.trivial_event(stream));
        }
        self.inner.take_stored()?;
        let checker = lock(&self.inner.checker);
        Ok(self.event_locked(&checker, stream))
    }

    fn wait(&self, stream: Stream, event: &CpuEvent) -> Result<()> {
        if !self.inner.checked {
            return Ok(());
        }
        self.own_event(event, "wait")?;
        self.inner.take_stored()?;
        let Some(p) = event.point() else {
            return Ok(());
        };
        let mut checker = lock(&self.inner.checker);
        checker.wait(stream, &p.clock);
        if let Some(w) = &self.inner.workers {
            if p.stream != stream {
                w.wait(stream, p.stream, p.seq);
            }
        }
        Ok(())
    }

    fn sync(&self, event: &CpuEvent) -> Result<()> {
        if !self.inner.checked {
            return Ok(());
        }
        self.own_event(event, "sync")?;
        let Some(p) = event.point() else {
            return Ok(());
        };
        if let Some(w) = &self.inner.workers {
            w.wait_until(p.stream, p.seq);
        }
        self.inner.take_stored()?;
        lock(&self.inner.checker).sync(&p.clock);
        Ok(())
    }

    fn sync_all(&self) -> Result<()> {
        if !self.inner.checked {
            return Ok(());
        }
        if let Some(w) = &self.inner.workers {
            let seqs = Stream::ALL.map(|s| w.pushed(s));
            w.wait_all(seqs);
        }
        self.inner.take_stored()?;
        lock(&self.inner.checker).sync_all();
        Ok(())
    }

    fn read_host<'a, T: Element>(
        &self,
        buf: &'a CpuBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a [T]> {
        self.host_access("read_host", buf, &range, AccessKind::Read)?;
        Ok(&buf.mem[range])
    }

    fn write_host<'a, T: Element>(
        &self,
        buf: &'a mut CpuBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a mut [T]> {
        self.host_access("write_host", buf, &range, AccessKind::Write)?;
        Ok(&mut buf.mem[range])
    }

    fn copy_h2d<T: Element>(
        &self,
        stream: Stream,
        src: &CpuBuffer<T>,
        src_at: usize,
        dst: &mut CpuBuffer<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.cast_op("copy_h2d", stream, src, src_at, dst, dst_at, len, false)
    }

    fn copy_d2h<T: Element>(
        &self,
        stream: Stream,
        src: &CpuBuffer<T>,
        src_at: usize,
        dst: &mut CpuBuffer<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.cast_op("copy_d2h", stream, src, src_at, dst, dst_at, len, false)
    }

    fn copy_d2d<T: Element>(
        &self,
        stream: Stream,
        src: &CpuBuffer<T>,
        src_at: usize,
        dst: &mut CpuBuffer<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.cast_op("copy_d2d", stream, src, src_at, dst, dst_at, len, false)
    }

    fn copy_within<T: Element>(
        &self,
        stream: Stream,
        buf: &mut CpuBuffer<T>,
        src: Range<usize>,
        dst_at: usize,
    ) -> Result<()> {
        const OP: &str = "copy_within";
        let len = range_len(OP, &src)?;
        disjoint(OP, &buf.label, buf.id, &src, dst_at, len)?;
        let s = buf.raw(OP, src.start, len)?;
        let d = buf.raw_mut(OP, dst_at, len)?;
        let decls = || {
            vec![
                buf.decl(src.start, len, AccessKind::Read),
                buf.decl(dst_at, len, AccessKind::Write),
            ]
        };
        self.submit(stream, OP, decls, move || {
            // SAFETY: two disjoint ranges (checked above) of `buf`, read and
            // written as declared (see `submit`).
            unsafe { store(s.slice(), d.slice_mut(), false) };
            Ok(())
        })
    }

    fn cast<S: Element, D: Element>(
        &self,
        stream: Stream,
        src: &CpuBuffer<S>,
        src_at: usize,
        dst: &mut CpuBuffer<D>,
        dst_at: usize,
        len: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.cast_op("cast", stream, src, src_at, dst, dst_at, len, accumulate)
    }

    fn fill<T: Element>(
        &self,
        stream: Stream,
        buf: &mut CpuBuffer<T>,
        range: Range<usize>,
        value: T,
    ) -> Result<()> {
        const OP: &str = "fill";
        let len = range_len(OP, &range)?;
        let d = buf.raw_mut(OP, range.start, len)?;
        let decls = || vec![buf.decl(range.start, len, AccessKind::Write)];
        self.submit(stream, OP, decls, move || {
            // SAFETY: the declared write range (see `submit`).
            unsafe { d.slice_mut() }.fill(value);
            Ok(())
        })
    }

    fn sum_squares<G: Element>(
        &self,
        stream: Stream,
        parts: &[(&CpuBuffer<G>, Range<usize>)],
    ) -> Result<CpuScalars> {
        const OP: &str = "sum_squares";
        let mut raws = Vec::with_capacity(parts.len());
        for (b, r) in parts {
            if self.inner.checked {
                self.own(b, OP)?;
            }
            raws.push(b.raw(OP, r.start, range_len(OP, r)?)?);
        }
        let id = BufferId(NEXT_ID.fetch_add(1, Ordering::Relaxed));
        let values = Arc::new(Mutex::new(vec![0.0f64; parts.len()]));
        let scalars = CpuScalars {
            values: values.clone(),
            id,
            owner: self.inner.clone(),
        };
        if self.inner.checked {
            lock(&self.inner.checker).register(id, Arc::from(OP), parts.len());
        }
        let adam = self.inner.adam.clone();
        let decls = || {
            let mut d: Vec<Decl> = parts
                .iter()
                .map(|(b, r)| b.decl(r.start, r.end - r.start, AccessKind::Read))
                .collect();
            d.push(Decl {
                id,
                range: 0..parts.len(),
                kind: AccessKind::Write,
            });
            d
        };
        self.submit(stream, OP, decls, move || {
            // SAFETY: the declared read ranges (see `submit`).
            let slices: Vec<&[G]> = raws.iter().map(|r| unsafe { r.slice() }).collect();
            *lock(&values) = adam.sum_squares_many(&slices);
            Ok(())
        })?;
        Ok(scalars)
    }

    fn read_scalars(&self, scalars: &CpuScalars) -> Result<Vec<f64>> {
        if self.inner.checked {
            if !Arc::ptr_eq(&scalars.owner, &self.inner) {
                return Err(Error::Backend {
                    op: "read_scalars",
                    msg: "the scalars belong to another backend".into(),
                });
            }
            self.inner.take_stored()?;
            let n = lock(&scalars.values).len();
            let decl = Decl {
                id: scalars.id,
                range: 0..n,
                kind: AccessKind::Read,
            };
            lock(&self.inner.checker).host("read_scalars", &[decl])?;
        }
        Ok(lock(&scalars.values).clone())
    }

    fn adamw<G: Element, P: Element>(
        &self,
        stream: Stream,
        k: &AdamWStep,
        parts: Vec<AdamWPart<'_, Self, G, P>>,
    ) -> Result<()> {
        const OP: &str = "adamw";
        struct RawPart<G, P> {
            master: Raw<f32>,
            m: Raw<f32>,
            v: Raw<f32>,
            grad: Raw<G>,
            low: Option<Raw<P>>,
        }
        let mut raws = Vec::with_capacity(parts.len());
        let mut decls = Vec::new();
        for (i, mut p) in parts.into_iter().enumerate() {
            let n = range_len(OP, &p.state).map_err(|e| item_error(e, "part", i))?;
            let at = p.state.start;
            let checked = self.inner.checked;
            let part = (|| -> Result<RawPart<G, P>> {
                if checked {
                    self.own(p.master, OP)?;
                    self.own(p.m, OP)?;
                    self.own(p.v, OP)?;
                    self.own(p.grad, OP)?;
                }
                let low = match p.low.as_mut() {
                    Some((b, low_at)) => {
                        if checked {
                            self.own(b, OP)?;
                        }
                        Some(b.raw_mut(OP, *low_at, n)?)
                    }
                    None => None,
                };
                Ok(RawPart {
                    master: p.master.raw_mut(OP, at, n)?,
                    m: p.m.raw_mut(OP, at, n)?,
                    v: p.v.raw_mut(OP, at, n)?,
                    grad: p.grad.raw(OP, p.grad_at, n)?,
                    low,
                })
            })()
            .map_err(|e| item_error(e, "part", i))?;
            if checked {
                decls.push(p.master.decl(at, n, AccessKind::Write));
                decls.push(p.m.decl(at, n, AccessKind::Write));
                decls.push(p.v.decl(at, n, AccessKind::Write));
                decls.push(p.grad.decl(p.grad_at, n, AccessKind::Read));
                if let Some((b, low_at)) = &p.low {
                    decls.push(b.decl(*low_at, n, AccessKind::Write));
                }
            }
            raws.push(part);
        }
        let adam = self.inner.adam.clone();
        let k = *k;
        self.submit(
            stream,
            OP,
            move || decls,
            move || {
                // SAFETY: the declared ranges: master, m, v and the copy
                // written, the gradient read (see `submit`); the checker
                // refused any overlap between them within the operation.
                let slices = raws
                    .into_iter()
                    .map(|p| unsafe {
                        AdamWSlices {
                            master: p.master.slice_mut(),
                            grad: p.grad.slice(),
                            m: p.m.slice_mut(),
                            v: p.v.slice_mut(),
                            low: p.low.map(|l| l.slice_mut()),
                        }
                    })
                    .collect();
                adam.step_many(&k, slices)
            },
        )
    }

    fn pack<S: Element, D: Element>(
        &self,
        stream: Stream,
        pieces: &[PackPiece<'_, Self, S>],
        dst: &mut CpuBuffer<D>,
    ) -> Result<()> {
        const OP: &str = "pack";
        if !self.inner.checked {
            // Production: the loops on slices, no job to build.
            for p in pieces {
                bounds(OP, p.src, p.src_at, p.len)?;
                bounds(OP, dst, p.dst_at, p.len)?;
            }
            for p in pieces {
                let s = &p.src.mem[p.src_at..p.src_at + p.len];
                store(s, &mut dst.mem[p.dst_at..p.dst_at + p.len], false);
            }
            return Ok(());
        }
        self.own(dst, OP)?;
        let mut raws = Vec::with_capacity(pieces.len());
        for p in pieces {
            self.own(p.src, OP)?;
            raws.push((
                p.src.raw(OP, p.src_at, p.len)?,
                dst.raw_mut(OP, p.dst_at, p.len)?,
            ));
        }
        let decls = || {
            let mut d = Vec::with_capacity(pieces.len() * 2);
            for p in pieces {
                d.push(p.src.decl(p.src_at, p.len, AccessKind::Read));
                d.push(dst.decl(p.dst_at, p.len, AccessKind::Write));
            }
            d
        };
        self.submit(stream, OP, decls, move || {
            for (s, d) in raws {
                // SAFETY: the declared ranges: each source read, each
                // bucket range written; the checker refused overlapping
                // bucket ranges (see `submit`).
                unsafe { store(s.slice(), d.slice_mut(), false) };
            }
            Ok(())
        })
    }

    fn unpack<S: Element, D: Element>(
        &self,
        stream: Stream,
        src: &CpuBuffer<S>,
        pieces: &mut [UnpackPiece<'_, Self, D>],
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "unpack";
        if !self.inner.checked {
            // Production: the loops on slices, no job to build.
            for p in pieces.iter() {
                bounds(OP, src, p.src_at, p.len)?;
                bounds(OP, p.dst, p.dst_at, p.len)?;
            }
            for p in pieces.iter_mut() {
                let s = &src.mem[p.src_at..p.src_at + p.len];
                store(s, &mut p.dst.mem[p.dst_at..p.dst_at + p.len], accumulate);
            }
            return Ok(());
        }
        self.own(src, OP)?;
        let mut raws = Vec::with_capacity(pieces.len());
        for p in pieces.iter_mut() {
            self.own(p.dst, OP)?;
            raws.push((
                src.raw(OP, p.src_at, p.len)?,
                p.dst.raw_mut(OP, p.dst_at, p.len)?,
            ));
        }
        let decls = || {
            let mut d = Vec::with_capacity(pieces.len() * 2);
            for p in pieces.iter() {
                d.push(src.decl(p.src_at, p.len, AccessKind::Read));
                d.push(p.dst.decl(p.dst_at, p.len, AccessKind::Write));
            }
            d
        };
        self.submit(stream, OP, decls, move || {
            for (s, d) in raws {
                // SAFETY: the declared ranges: bucket ranges read, each
                // destination (a distinct buffer, borrowed mutably) written
                // (see `submit`).
                unsafe { store(s.slice(), d.slice_mut(), accumulate) };
            }
            Ok(())
        })
    }
}

impl CpuBackend {
    /// The shared body of the copies and `cast`.
    #[allow(clippy::too_many_arguments)]
    fn cast_op<S: Element, D: Element>(
        &self,
        op: &'static str,
        stream: Stream,
        src: &CpuBuffer<S>,
        src_at: usize,
        dst: &mut CpuBuffer<D>,
        dst_at: usize,
        len: usize,
        accumulate: bool,
    ) -> Result<()> {
        let s = src.raw(op, src_at, len)?;
        let d = dst.raw_mut(op, dst_at, len)?;
        if self.inner.checked {
            self.own(src, op)?;
            self.own(dst, op)?;
        }
        let decls = || {
            vec![
                src.decl(src_at, len, AccessKind::Read),
                dst.decl(dst_at, len, AccessKind::Write),
            ]
        };
        self.submit(stream, op, decls, move || {
            // SAFETY: the declared ranges of two distinct buffers (one
            // borrowed shared, one exclusively), read and written as
            // declared (see `submit`).
            unsafe { store(s.slice(), d.slice_mut(), accumulate) };
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static_assertions::assert_impl_all!(CpuBackend: Send, Sync, Clone);
    static_assertions::assert_impl_all!(CpuBuffer<f32>: Send, Sync);
    static_assertions::assert_impl_all!(CpuEvent: Send, Sync, Clone);
    static_assertions::assert_impl_all!(CpuScalars: Send, Sync);
    static_assertions::assert_impl_all!(Loan<half::bf16>: Send, Sync);
}
