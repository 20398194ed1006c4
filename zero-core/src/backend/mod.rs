//! The device backend seam: typed buffers, four streams, events and about a
//! dozen primitives, each enqueued on a stream.
//!
//! The engine makes every ordering decision (which stream an operation runs
//! on, which event a stream waits for before it touches a buffer); a
//! [`Backend`] makes none. It does not synchronise implicitly: an operation
//! enqueued on one stream may run concurrently with everything on the other
//! streams unless the caller made that stream [`wait`](Backend::wait) for an
//! [`Event`](Backend::Event) recorded after the work it depends on, and the
//! host may only read what a stream wrote after [`sync`](Backend::sync)ing an
//! event recorded after the write. This is the CUDA model (streams, events,
//! asynchronous copies and kernels) and the CUDA backend implements this
//! trait over cudarc; the CPU backend ([`CpuBackend`]) implements it over
//! host memory.
//!
//! ```text
//!   compute ──[pack grads → bucket]──●e1
//!                                     ╲  wait(comm, e1)
//!   comm    ───────────────────────────◆──[all_reduce bucket]──●e2
//!                                                               ╲ wait(compute, e2)
//!   compute ─────────────[backward …]────────────────────────────◆──[unpack]──[adamw]──●e3
//!                                                                                      ╲ sync(e3)
//!   host    ───────────────────────────────────────────────────────────────────────────◆ read
//! ```
//!
//! # Checking the order on the CPU
//!
//! [`CpuBackend`] has three modes ([`CpuMode`]). `Inline`, the production
//! mode, runs every operation at once on the calling thread and checks
//! nothing. `Checked` runs the same way but first checks each access with a
//! hazard checker on vector clocks: every primitive declares the element
//! ranges it reads and writes; an access that is not ordered after a
//! conflicting earlier one (overlapping ranges, at least one write) is
//! refused with [`Error::Hazard`](crate::Error::Hazard), naming the buffer,
//! both operations and both streams. Ordering is decided by the events the
//! caller recorded and waited for, not by timing, so a missing wait fails on
//! every run. `Chaos` adds real concurrency: one worker thread per stream
//! with random delays, real events, and freed buffers poisoned.
//!
//! The rules the checker enforces, for a new access `b` on agent `X` (a
//! stream, or the host) and an earlier access `a` on agent `Y` to an
//! overlapping range, one of them a write:
//!
//! - `a` is ordered before `b` when `X == Y` (program order), or when `X`'s
//!   vector clock has `Y`'s entry at or past `a`'s tick;
//! - enqueuing on stream `s` ticks `s`'s entry and joins the host's clock
//!   (what the host did before enqueuing is ordered before the operation);
//!   [`record`](Backend::record) captures `s`'s clock in the event,
//!   [`wait`](Backend::wait) joins it into another stream's clock,
//!   [`sync`](Backend::sync) into the host's;
//! - host accesses ([`read_host`](Backend::read_host),
//!   [`write_host`](Backend::write_host), [`CpuBackend::host_slice`],
//!   [`read_scalars`](Backend::read_scalars), dropping a buffer) are
//!   accesses of the host agent.
//!
//! # Buffers of runtime-chosen dtype
//!
//! Buffers are typed (`B::Buffer<f32>`, `B::Buffer<bf16>`, ...). Code whose
//! dtype is chosen at run time keeps an enum over the typed buffers and
//! matches, as for [`HostBuffer`](crate::HostBuffer)s; every primitive is
//! generic over the element types it takes.

use std::fmt;
use std::ops::Range;

use crate::optim::AdamWStep;
use crate::{DType, Device, Element, Result};

mod checks;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod events;
mod hazard;
mod host;

pub use cpu::{
    CpuBackend, CpuBuffer, CpuEvent, CpuMode, CpuScalars, In, LaunchArgs, Loan, Out, Running,
    POISON,
};
#[cfg(feature = "cuda")]
pub use cuda::{
    CudaBackend, CudaBackendEvent, CudaBuffer, CudaHostBuffer, CudaHostMut, CudaLoan, CudaScalars,
    ReadView as CudaReadView, View as CudaView,
};
pub use host::HostAccess;

/// A stream of one rank's device: compute, communication, host-to-device
/// and device-to-host copies (the same kinds as the CUDA streams of
/// [`crate::cuda::stream`]).
pub use crate::cuda::stream::StreamKind as Stream;

/// The identity of a buffer within its backend, kept while the buffer is
/// lent to a host collective and given back (`#7` in messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u64);

impl fmt::Display for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Where an access is issued: one of the four streams, or the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Agent {
    /// An operation enqueued on a stream.
    Stream(Stream),
    /// The host thread reading or writing memory directly.
    Host,
}

impl Agent {
    /// The number of agents: four streams and the host.
    pub const COUNT: usize = 5;

    /// Position in a vector clock: the stream's index, 4 for the host.
    pub const fn index(self) -> usize {
        match self {
            Agent::Stream(s) => s.index(),
            Agent::Host => 4,
        }
    }

    /// What an access on this agent lacked when it was not ordered after
    /// another: a stream lacks a `wait`, the host a `sync`.
    pub const fn unordered(self) -> &'static str {
        match self {
            Agent::Stream(_) => "not waited for",
            Agent::Host => "not synced",
        }
    }
}

impl fmt::Display for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Agent::Stream(s) => f.write_str(s.as_str()),
            Agent::Host => f.write_str("host"),
        }
    }
}

/// Whether an operation reads or writes a range (read and write counts as
/// write: it conflicts with everything a write conflicts with).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessKind {
    /// The range is only read.
    Read,
    /// The range is written (and possibly read).
    Write,
}

impl fmt::Display for AccessKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AccessKind::Read => "reads",
            AccessKind::Write => "writes",
        })
    }
}

/// An access that is not ordered after a conflicting earlier one: what
/// [`Error::Hazard`](crate::Error::Hazard) carries. Its `Display` reads
///
/// ```text
/// hazard on buffer "bucket 0" (#7) [0..4096): pack on compute writes
/// while all_reduce on comm (not waited for) reads [0..8192)
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hazard {
    /// The buffer's label.
    pub buffer: String,
    /// The buffer's id.
    pub id: BufferId,
    /// The elements the refused operation accesses.
    pub range: Range<usize>,
    /// The refused operation (e.g. `"pack"`, `"read_host"`).
    pub op: &'static str,
    /// Where it was issued: a stream, or the host.
    pub agent: Agent,
    /// Whether it reads or writes `range`.
    pub access: AccessKind,
    /// The earlier operation it conflicts with.
    pub other_op: &'static str,
    /// Where that one was issued.
    pub other_agent: Agent,
    /// Whether that one reads or writes `other_range`.
    pub other_access: AccessKind,
    /// The elements the earlier operation accesses.
    pub other_range: Range<usize>,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "hazard on buffer {:?} ({}) [{}..{}): {} on {} {} while {} on {} ({}) {} [{}..{})",
            self.buffer,
            self.id,
            self.range.start,
            self.range.end,
            self.op,
            self.agent,
            self.access,
            self.other_op,
            self.other_agent,
            self.agent.unordered(),
            self.other_access,
            self.other_range.start,
            self.other_range.end
        )
    }
}

/// What every buffer handle of a backend tells about itself.
///
/// A handle owns its memory; moving it never moves the data.
pub trait BufferHandle<T: Element>: Send + Sync {
    /// The buffer's id within its backend.
    fn id(&self) -> BufferId;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether it holds no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The label given at allocation (used in messages).
    fn label(&self) -> &str;
    /// The element type.
    fn dtype(&self) -> DType {
        T::DTYPE
    }
}

/// One source of a bucket [`pack`](Backend::pack):
/// `dst[dst_at..dst_at + len] = D(src[src_at..src_at + len])`.
pub struct PackPiece<'a, B: Backend + ?Sized, S: Element> {
    /// The buffer read.
    pub src: &'a B::Buffer<S>,
    /// First element read.
    pub src_at: usize,
    /// First element written in the bucket.
    pub dst_at: usize,
    /// Number of elements.
    pub len: usize,
}

/// One destination of a bucket [`unpack`](Backend::unpack):
/// `dst[dst_at..dst_at + len] = D(src[src_at..src_at + len])` (or `+=`).
pub struct UnpackPiece<'a, B: Backend + ?Sized, D: Element> {
    /// The buffer written.
    pub dst: &'a mut B::Buffer<D>,
    /// First element written.
    pub dst_at: usize,
    /// First element read from the bucket.
    pub src_at: usize,
    /// Number of elements.
    pub len: usize,
}

/// One contiguous part of the optimizer state for [`adamw`](Backend::adamw)
/// (the device form of [`AdamWSlices`](crate::optim::AdamWSlices)).
///
/// The fp32 master and both moments are updated over `state`; the gradient
/// is read from `grad_at` and the low-precision copy written from its offset,
/// each over `state.len()` elements.
pub struct AdamWPart<'a, B: Backend + ?Sized, G: Element, P: Element> {
    /// fp32 master parameters, updated in place.
    pub master: &'a mut B::Buffer<f32>,
    /// First moments, updated in place.
    pub m: &'a mut B::Buffer<f32>,
    /// Second moments, updated in place.
    pub v: &'a mut B::Buffer<f32>,
    /// The elements of `master`, `m` and `v` updated.
    pub state: Range<usize>,
    /// The gradients (f32, bf16 or f16).
    pub grad: &'a B::Buffer<G>,
    /// First gradient element.
    pub grad_at: usize,
    /// If given, receives `P(master')` from the offset given.
    pub low: Option<(&'a mut B::Buffer<P>, usize)>,
}

/// A device: typed buffers, four ordered streams, events and the
/// primitives of the engine, each enqueued on a stream.
///
/// Every primitive returns as soon as its work is enqueued; it runs after
/// everything enqueued on the same stream before it, and after the events
/// that stream was made to wait for. Nothing synchronises implicitly. Every
/// argument is checked before anything is enqueued: a range outside a
/// buffer is [`Error::InvalidSize`](crate::Error::InvalidSize) and changes
/// nothing. A backend may report an error of earlier, already enqueued work
/// (or of a buffer dropped while still in use) from any later call.
///
/// Element types are [`Element`]s (f32, bf16, f16); conversions go through
/// f32 exactly as [`Element::to_f32`]/[`Element::from_f32`] do.
pub trait Backend: Send + Sync + 'static {
    /// A typed buffer in device memory (host memory for the CPU backend).
    /// An owned handle; moving it never moves the data.
    type Buffer<T: Element>: BufferHandle<T> + fmt::Debug;
    /// Host memory that asynchronous copies read and write (pinned on
    /// CUDA; the same type as `Buffer` on the CPU). An owned handle; moving
    /// it never moves the data, so a slice of it from
    /// [`write_host`](Backend::write_host) stays where it is while the
    /// handle lives.
    type HostBuffer<T: Element>: BufferHandle<T> + fmt::Debug;
    /// A point in one stream's work. Cheap to clone.
    type Event: Clone + Send + Sync + fmt::Debug;
    /// The per-part f64 results of [`sum_squares`](Backend::sum_squares),
    /// readable with [`read_scalars`](Backend::read_scalars) after a sync.
    type Scalars: Send + Sync + fmt::Debug;

    /// The device this backend runs on.
    fn device(&self) -> Device;

    /// A zeroed buffer of `len` elements; `label` names it in messages.
    fn alloc<T: Element>(&self, len: usize, label: &str) -> Result<Self::Buffer<T>>;

    /// A zeroed buffer of `len` elements for `stream`'s work: allocated and
    /// zeroed in `stream`'s order, without blocking the host (CUDA:
    /// `cuMemAllocAsync` and a memset on that stream). `stream` may use it
    /// at once; another stream only after waiting for an event recorded on
    /// `stream` after this call. The default is [`alloc`](Backend::alloc),
    /// which every stream may use at once.
    fn alloc_on<T: Element>(
        &self,
        stream: Stream,
        len: usize,
        label: &str,
    ) -> Result<Self::Buffer<T>> {
        let _ = stream;
        self.alloc(len, label)
    }

    /// A buffer of `len` elements for `stream`'s work, as
    /// [`alloc_on`](Backend::alloc_on) but with contents unspecified until
    /// written: for a buffer that is overwritten whole before it is read
    /// (CUDA: no memset). The default is `alloc_on` (zeroed).
    fn alloc_scratch_on<T: Element>(
        &self,
        stream: Stream,
        len: usize,
        label: &str,
    ) -> Result<Self::Buffer<T>> {
        self.alloc_on(stream, len, label)
    }

    /// Frees `buf` in `stream`'s order, without blocking: after the work
    /// enqueued on `stream` so far, and nothing else (CUDA:
    /// `cuMemFreeAsync` on that stream). Every access of another stream
    /// must be ordered before this point of `stream` (the checked CPU
    /// backend treats the release as a write of all of `buf` on `stream`
    /// and reports a hazard, from its next call, when one is not). The
    /// default drops `buf`.
    fn release_on<T: Element>(&self, stream: Stream, buf: Self::Buffer<T>) {
        let _ = stream;
        drop(buf);
    }

    /// A zeroed host buffer of `len` elements for asynchronous copies.
    fn alloc_host<T: Element>(&self, len: usize, label: &str) -> Result<Self::HostBuffer<T>>;

    /// Whether `buf` was allocated by this backend (another backend's
    /// buffer, even of the same type, is refused by every operation).
    fn owns_host<T: Element>(&self, buf: &Self::HostBuffer<T>) -> bool;

    /// An event at the current end of `stream`'s work.
    fn record(&self, stream: Stream) -> Result<Self::Event>;

    /// Makes `stream` wait for `event` before its next operations; the host
    /// does not wait.
    fn wait(&self, stream: Stream, event: &Self::Event) -> Result<()>;

    /// Blocks the host until `event`'s work is done.
    fn sync(&self, event: &Self::Event) -> Result<()>;

    /// Blocks the host until every stream's work is done.
    fn sync_all(&self) -> Result<()>;

    /// Elements `range` of a host buffer, for the host to read. Only valid
    /// after every conflicting access enqueued earlier was synced.
    fn read_host<'a, T: Element>(
        &self,
        buf: &'a Self::HostBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a [T]>;

    /// Elements `range` of a host buffer, for the host to write. Only valid
    /// after every access enqueued earlier was synced.
    fn write_host<'a, T: Element>(
        &self,
        buf: &'a mut Self::HostBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a mut [T]>;

    /// Copies `len` elements from host buffer `src[src_at..]` to
    /// `dst[dst_at..]`.
    #[allow(clippy::too_many_arguments)]
    fn copy_h2d<T: Element>(
        &self,
        stream: Stream,
        src: &Self::HostBuffer<T>,
        src_at: usize,
        dst: &mut Self::Buffer<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<()>;

    /// Copies `len` elements from `src[src_at..]` to host buffer
    /// `dst[dst_at..]`.
    #[allow(clippy::too_many_arguments)]
    fn copy_d2h<T: Element>(
        &self,
        stream: Stream,
        src: &Self::Buffer<T>,
        src_at: usize,
        dst: &mut Self::HostBuffer<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<()>;

    /// Copies `len` elements from `src[src_at..]` to `dst[dst_at..]` (two
    /// device buffers; within one buffer use
    /// [`copy_within`](Backend::copy_within)).
    #[allow(clippy::too_many_arguments)]
    fn copy_d2d<T: Element>(
        &self,
        stream: Stream,
        src: &Self::Buffer<T>,
        src_at: usize,
        dst: &mut Self::Buffer<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<()>;

    /// Copies elements `src` of `buf` to `buf[dst_at..]`; the two ranges
    /// must not overlap ([`Error::InvalidSize`](crate::Error::InvalidSize)
    /// otherwise).
    fn copy_within<T: Element>(
        &self,
        stream: Stream,
        buf: &mut Self::Buffer<T>,
        src: Range<usize>,
        dst_at: usize,
    ) -> Result<()>;

    /// `dst[dst_at + i] = D(f32(src[src_at + i]))` for `i < len`, or with
    /// `accumulate` `D(f32(dst) + f32(src))`. The same dtype without
    /// `accumulate` is a plain copy.
    #[allow(clippy::too_many_arguments)]
    fn cast<S: Element, D: Element>(
        &self,
        stream: Stream,
        src: &Self::Buffer<S>,
        src_at: usize,
        dst: &mut Self::Buffer<D>,
        dst_at: usize,
        len: usize,
        accumulate: bool,
    ) -> Result<()>;

    /// Sets elements `range` of `buf` to `value`.
    fn fill<T: Element>(
        &self,
        stream: Stream,
        buf: &mut Self::Buffer<T>,
        range: Range<usize>,
        value: T,
    ) -> Result<()>;

    /// The sum of squares of each part, in f64, exactly
    /// [`optim::sum_squares`](crate::optim::sum_squares) of the part's
    /// elements (same chunks, lanes and order), in one pass.
    fn sum_squares<G: Element>(
        &self,
        stream: Stream,
        parts: &[(&Self::Buffer<G>, Range<usize>)],
    ) -> Result<Self::Scalars>;

    /// The values of a [`sum_squares`](Backend::sum_squares), one per part;
    /// a host read, valid after the producing stream was synced.
    fn read_scalars(&self, scalars: &Self::Scalars) -> Result<Vec<f64>>;

    /// One fused AdamW update of every part
    /// ([`adamw_element`](crate::optim::adamw_element) on every element,
    /// the same bits as [`CpuAdamW::step_many`](crate::optim::CpuAdamW::step_many)).
    fn adamw<G: Element, P: Element>(
        &self,
        stream: Stream,
        k: &AdamWStep,
        parts: Vec<AdamWPart<'_, Self, G, P>>,
    ) -> Result<()>;

    /// Packs many ranges into one bucket, converting:
    /// `dst[p.dst_at..][..p.len] = D(p.src[p.src_at..][..p.len])` for every
    /// piece. Destination ranges must not overlap.
    fn pack<S: Element, D: Element>(
        &self,
        stream: Stream,
        pieces: &[PackPiece<'_, Self, S>],
        dst: &mut Self::Buffer<D>,
    ) -> Result<()>;

    /// Unpacks one bucket into many buffers, converting:
    /// `p.dst[p.dst_at..][..p.len] = D(src[p.src_at..][..p.len])`, or with
    /// `accumulate` `D(f32(dst) + f32(src))`, for every piece.
    fn unpack<S: Element, D: Element>(
        &self,
        stream: Stream,
        src: &Self::Buffer<S>,
        pieces: &mut [UnpackPiece<'_, Self, D>],
        accumulate: bool,
    ) -> Result<()>;
}
