//! The CUDA backend: [`Backend`] over cudarc, on one GPU.
//!
//! - **Buffers** are device memory from the driver's stream-ordered
//!   allocator (`cuMemAllocAsync`), one allocation per buffer, zeroed.
//!   `Backend::alloc` sizes buffers one at a time, at any point, and drops
//!   free them, which a [`DeviceArena`](crate::cuda::arena::DeviceArena)
//!   (one allocation carved by a plan made before anything is allocated)
//!   cannot offer; the arena's buffers also order themselves through a
//!   per-buffer reuse guard, which is the implicit synchronisation this
//!   backend must not have. The allocator's pool keeps freed memory for
//!   reuse (its release threshold is raised to the maximum), and
//!   [`CudaBackend::reserve`] fills it up front with one allocation: the
//!   engine reserves its memory plan there before it allocates anything,
//!   so its buffers are carved from that one allocation and a step asks
//!   the driver for nothing ([`CudaBackend::pool_reserved`] shows it).
//! - **Streams**: the four of [`Streams`], plus one internal stream that
//!   allocates, frees and reads [`CudaScalars`] back, so that none of those
//!   ever orders the caller's streams.
//! - **No implicit synchronisation.** A buffer is a device pointer and a
//!   length, with no event of its own: cudarc's per-slice event tracking is
//!   not involved (kernels get the pointers through views whose
//!   `SyncOnDrop` does nothing), so an operation runs after exactly what
//!   its stream was ordered after by the caller's
//!   [`wait`](Backend::wait)s. The only waits the backend makes are for
//!   memory's own lifetime: `alloc` returns after the zeroing completed, a
//!   dropped device buffer is freed on the internal stream after the work
//!   enqueued so far on all four streams, and a dropped host buffer blocks
//!   until that work is done (pinned memory must not be freed under a
//!   copy). `alloc` waits on the internal stream only, which may include
//!   the work earlier frees wait for: allocate at start-up, not in a step
//!   (`sum_squares` allocates its scratch and results in its stream's
//!   order, without waiting).
//! - **Host buffers** are page-locked (`cuMemHostAlloc`), the endpoints of
//!   asynchronous copies; [`read_host`](Backend::read_host) and
//!   [`write_host`](Backend::write_host) give the memory itself.
//! - **Primitives**: copies by range are `cuMemcpy*Async` on the given
//!   stream; `fill` is `cuMemsetD32Async`/`cuMemsetD16Async` (the bits of
//!   the value); `cast`, `pack` and `unpack` are the NVRTC kernels of
//!   `convert.cu` (up to [`PIECES_MAX`] ranges per launch; a cast within
//!   one dtype is a copy); `sum_squares` and `adamw` are the kernels of
//!   [`GpuAdamW`] (the per-chunk sums and their in-order total, the same
//!   bits as [`optim::sum_squares`](crate::optim::sum_squares); the fused
//!   step, the same bits as [`CpuAdamW`](crate::optim::CpuAdamW)).
//!
//! Errors never panic: a missing driver library or GPU is
//! [`Error::NoDevice`], a missing NVRTC an [`Error::Cuda`] naming the
//! library and how to install it; every argument is checked before
//! anything is enqueued, as [`Backend`] requires. Errors of work already
//! enqueued, and of frees in `Drop`, are reported by the next call.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, DevicePtr,
    DevicePtrMut, DeviceRepr, DeviceSlice, DriverError, LaunchConfig, PinnedHostSlice,
    PushKernelArg, SyncOnDrop,
};

mod host;

pub use host::{CudaHostMut, CudaLoan};

use super::checks::{bounds, disjoint, item_error, range_len};
use super::events::{EventPool, Pooled};
use super::{AdamWPart, Backend, BufferHandle, BufferId, PackPiece, Stream, UnpackPiece};
use crate::cuda::kernels::{
    convert_entry_point, load_module, norm_scratch_len, source, target_arch, GpuAdamW,
    CONVERT_BLOCK, CONVERT_ENTRY_POINTS, PIECES_MAX,
};
use crate::cuda::stream::{cuda_error, pinned_zeros, Streams};
use crate::optim::AdamWStep;
use crate::{CudaDevice, Device, Element, Error, Result};

/// Buffer ids, unique in the process (as the CPU backend's).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> BufferId {
    BufferId(NEXT_ID.fetch_add(1, Ordering::Relaxed))
}

/// What the backend and everything it hands out share.
struct Inner {
    device: CudaDevice,
    streams: Streams,
    /// Allocations, frees and scalar reads; never one of the four.
    service: Arc<CudaStream>,
    /// One per stream, recorded before a free so that the service stream
    /// waits for the work enqueued so far (a wait captures the event as it
    /// is then: re-recording is safe, also from several threads).
    free_after: [CudaEvent; 4],
    /// The events `record` hands out, reused once their work is done and
    /// no handle refers to them.
    events: Arc<EventPool<CudaEvent>>,
    adam: GpuAdamW,
    convert: Convert,
    /// The pinned buffers host views are copied through, made at the
    /// first large view (see `host.rs`).
    staging: std::sync::Mutex<Option<host::HostStaging>>,
}

impl Inner {
    fn ctx(&self) -> &Arc<CudaContext> {
        self.device.context()
    }

    fn stream(&self, s: Stream) -> &Arc<CudaStream> {
        self.streams.get(s)
    }

    /// Reports an error a `Drop` stored since the last call and makes the
    /// context current for raw driver calls.
    fn begin(&self) -> Result<()> {
        self.ctx().check_err().map_err(cuda_error(
            "an earlier asynchronous operation (reported late)",
        ))?;
        self.ctx()
            .bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))
    }

    /// Frees device memory `ptr` on the service stream after the work
    /// enqueued so far on every stream; failures are stored in the context.
    fn free(&self, ptr: sys::CUdeviceptr) {
        let ctx = self.ctx();
        ctx.record_err(ctx.bind_to_thread());
        for s in Stream::ALL {
            let ev = &self.free_after[s.index()];
            ctx.record_err(ev.record(self.stream(s)));
            ctx.record_err(self.service.wait(ev));
        }
        // SAFETY: `ptr` came from cuMemAllocAsync of this context and is
        // freed once (by the one owner being dropped); the service stream
        // waits for everything enqueued on the four streams, so no
        // operation enqueued before the drop can use the memory after the
        // free, and none can be enqueued after it (the owner is gone).
        ctx.record_err(unsafe { result::free_async(ptr, self.service.cu_stream()) });
    }

    /// Blocks until the work enqueued so far on every stream is done
    /// (before pinned memory is freed); failures are stored in the context.
    fn host_wait_all_in_drop(&self) {
        let ctx = self.ctx();
        for s in Stream::ALL {
            ctx.record_err(self.stream(s).synchronize());
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every buffer, host buffer, event and result set is gone (each
        // holds an Arc). Wait for the work still queued (frees included)
        // before the kernels' modules are unloaded; failures can only be
        // stored in the context.
        let ctx = self.ctx();
        ctx.record_err(ctx.bind_to_thread());
        for s in Stream::ALL {
            ctx.record_err(self.stream(s).synchronize());
        }
        ctx.record_err(self.service.synchronize());
    }
}

/// The conversion kernels of `convert.cu`, loaded into the device.
struct Convert {
    _module: Arc<CudaModule>,
    functions: Vec<CudaFunction>,
    max_blocks: u32,
}

/// `ZeroPiece` of `zero_convert.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct KernelPiece {
    src: u64,
    dst: u64,
    start: u64,
    len: u64,
}

/// `ZeroPieces` of `zero_convert.cuh`: passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct KernelPieces {
    count: u64,
    total: u64,
    piece: [KernelPiece; PIECES_MAX],
}

// SAFETY: #[repr(C)], only u64 fields and no padding: the layout of
// `struct ZeroPieces` in zero_convert.cuh, which the kernels take by value.
unsafe impl DeviceRepr for KernelPieces {}

/// A range of device memory as cudarc's kernel-argument traits want it,
/// without any event: the caller's stream order is the only order. `A`
/// says what the range may be used for: [`ReadWrite`] ([`View`], made by
/// [`CudaBackend::raw_view`]) or [`ReadOnly`] ([`ReadView`], made by
/// [`CudaBackend::read_view`]), for libraries that take cudarc's traits
/// (NCCL in `zero-comm`).
pub struct DeviceView<'a, T, A> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _marker: PhantomData<(T, A)>,
}

/// A [`DeviceView`] that kernels may write (cudarc's `DevicePtrMut`).
pub struct ReadWrite;

/// A [`DeviceView`] that kernels only read.
pub struct ReadOnly;

/// A range of device memory to read and write ([`DeviceView`]).
pub type View<'a, T> = DeviceView<'a, T, ReadWrite>;

/// A range of device memory to read, the read-only counterpart of
/// [`View`] ([`DeviceView`]).
pub type ReadView<'a, T> = DeviceView<'a, T, ReadOnly>;

impl<'a, T, A> DeviceView<'a, T, A> {
    fn new(ptr: sys::CUdeviceptr, len: usize, stream: &'a Arc<CudaStream>) -> Self {
        Self {
            ptr,
            len,
            stream,
            _marker: PhantomData,
        }
    }
}

impl<T, A> DeviceSlice<T> for DeviceView<'_, T, A> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T, A> DevicePtr<T> for DeviceView<'_, T, A> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for View<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// The [`Backend`] on one CUDA GPU; see the [module](self) docs. Cloning
/// shares it (streams, kernels).
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.inner.device)
            .field("arch", &self.inner.adam.arch())
            .finish()
    }
}

/// A device buffer of the [`CudaBackend`]: `len` elements of `T` in one
/// stream-ordered allocation. Dropping it frees the memory after the work
/// enqueued so far on every stream (without blocking).
pub struct CudaBuffer<T: Element> {
    ptr: sys::CUdeviceptr,
    len: usize,
    id: BufferId,
    label: Arc<str>,
    owner: Arc<Inner>,
    _marker: PhantomData<T>,
}

impl<T: Element> BufferHandle<T> for CudaBuffer<T> {
    fn id(&self) -> BufferId {
        self.id
    }
    fn len(&self) -> usize {
        self.len
    }
    fn label(&self) -> &str {
        &self.label
    }
}

impl<T: Element> fmt::Debug for CudaBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("label", &self.label)
            .field("id", &self.id)
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .finish()
    }
}

impl<T: Element> CudaBuffer<T> {
    /// The device address of element `at` (in bounds: checked by callers).
    fn addr(&self, at: usize) -> sys::CUdeviceptr {
        self.ptr + (at * size_of::<T>()) as u64
    }

    fn view<'a>(&self, at: usize, len: usize, stream: &'a Arc<CudaStream>) -> View<'a, T> {
        View::new(self.addr(at), len, stream)
    }
}

impl<T: Element> Drop for CudaBuffer<T> {
    fn drop(&mut self) {
        self.owner.free(self.ptr);
    }
}

/// Page-locked host memory of the [`CudaBackend`], the endpoint of
/// asynchronous copies. Dropping it blocks until the work enqueued so far
/// on every stream is done, so the memory is never freed under a copy.
pub struct CudaHostBuffer<T: Element> {
    ptr: NonNull<T>,
    len: usize,
    id: BufferId,
    label: Arc<str>,
    owner: Arc<Inner>,
    /// The driver allocation, freed after `Drop::drop` waited.
    _memory: PinnedHostSlice<u8>,
}

// SAFETY: the buffer owns its pinned memory exclusively (like a Vec<T>);
// T: Send + Sync by Element, and the cudarc parts are Send + Sync.
unsafe impl<T: Element> Send for CudaHostBuffer<T> {}
// SAFETY: `&self` reaches the elements only through `read_host` (shared
// reads); writes need `&mut self`.
unsafe impl<T: Element> Sync for CudaHostBuffer<T> {}

impl<T: Element> BufferHandle<T> for CudaHostBuffer<T> {
    fn id(&self) -> BufferId {
        self.id
    }
    fn len(&self) -> usize {
        self.len
    }
    fn label(&self) -> &str {
        &self.label
    }
}

impl<T: Element> fmt::Debug for CudaHostBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaHostBuffer")
            .field("label", &self.label)
            .field("id", &self.id)
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .finish()
    }
}

impl<T: Element> Drop for CudaHostBuffer<T> {
    fn drop(&mut self) {
        self.owner.host_wait_all_in_drop();
    }
}

/// A point in one stream's work ([`Backend::record`]): a driver event from
/// the backend's pool (`src/backend/events.rs`), back there when the last
/// clone drops.
#[derive(Clone)]
pub struct CudaBackendEvent {
    event: Arc<Pooled<CudaEvent>>,
    stream: Stream,
    owner: Arc<Inner>,
}

impl CudaBackendEvent {
    /// The stream it was recorded on.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// The driver event, for waits that poll it (e.g. NCCL's bounded wait,
    /// which aborts the communicator instead of blocking forever).
    pub fn cuda_event(&self) -> &CudaEvent {
        self.event.get()
    }
}

impl fmt::Debug for CudaBackendEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackendEvent")
            .field("stream", &self.stream)
            .finish()
    }
}

/// The per-part results of a [`sum_squares`](Backend::sum_squares), in
/// device memory until [`read_scalars`](Backend::read_scalars).
pub struct CudaScalars {
    ptr: sys::CUdeviceptr,
    len: usize,
    owner: Arc<Inner>,
}

impl fmt::Debug for CudaScalars {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaScalars")
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for CudaScalars {
    fn drop(&mut self) {
        self.owner.free(self.ptr);
    }
}

/// The direction of a copy between host and device memory.
#[derive(Debug, Clone, Copy)]
enum HostCopy {
    ToDevice,
    ToHost,
}

/// Blocks of [`CONVERT_BLOCK`] threads for `total` elements.
fn convert_blocks(total: u64, max_blocks: u32) -> u32 {
    total
        .div_ceil(u64::from(CONVERT_BLOCK))
        .min(u64::from(max_blocks))
        .max(1) as u32
}

impl CudaBackend {
    /// The backend on GPU `ordinal`: opens the device, creates the streams
    /// and compiles (once per process) and loads the kernels.
    ///
    /// Errors: [`Error::NoDevice`] without a driver library or GPU;
    /// [`Error::Cuda`] naming NVRTC when it cannot be loaded or fails;
    /// [`Error::Unsupported`] for a GPU without stream-ordered allocation.
    pub fn new(ordinal: usize) -> Result<Self> {
        match Device::cuda(ordinal)? {
            Device::Cuda(dev) => Self::on(&dev),
            Device::Cpu => Err(Error::NoDevice {
                kind: "cuda",
                ordinal,
                reason: "the device opened is not a CUDA device".into(),
            }),
        }
    }

    /// The backend on an opened device.
    pub fn on(device: &CudaDevice) -> Result<Self> {
        let ctx = device.context().clone();
        if !ctx.has_async_alloc() {
            return Err(Error::Unsupported(format!(
                "CUDA device {} has no stream-ordered allocator (memory pools, \
                 cuMemAllocAsync), which the CUDA backend allocates with",
                ctx.ordinal()
            )));
        }
        ctx.bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))?;
        keep_pool(&ctx)?;
        let streams = Streams::new(device)?;
        let service = ctx
            .new_stream()
            .map_err(cuda_error("cuStreamCreate (service)"))?;
        let event = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(cuda_error("cuEventCreate (free)"))
        };
        let free_after = [event()?, event()?, event()?, event()?];
        let adam = GpuAdamW::new(device)?;
        let convert = Convert::load(&ctx)?;
        Ok(Self {
            inner: Arc::new(Inner {
                device: device.clone(),
                streams,
                service,
                free_after,
                events: Arc::default(),
                adam,
                convert,
                staging: std::sync::Mutex::new(None),
            }),
        })
    }

    /// Driver events created by `record` so far (every other record reused
    /// a pooled one whose work was done).
    #[doc(hidden)]
    pub fn events_created(&self) -> u64 {
        self.inner.events.created()
    }

    /// The device's streams (for code that launches its own kernels on
    /// them, e.g. collectives): work enqueued there is ordered with the
    /// backend's by the same events.
    pub fn streams(&self) -> &Streams {
        &self.inner.streams
    }

    /// The architecture the kernels were compiled for (`sm_90`, ...).
    pub fn arch(&self) -> &str {
        self.inner.adam.arch()
    }

    /// `buf[range]` as a cudarc device slice on `stream`, with no event
    /// of its own: whatever the caller enqueues through it is ordered only
    /// by `stream`'s place in the backend's order (waits and records), as
    /// every operation of this backend is. For a library call that takes
    /// cudarc's traits, enqueued on `stream` (NCCL's collectives on the
    /// communication stream). Errors: another backend's buffer, a range
    /// outside it.
    pub fn raw_view<'a, T: Element>(
        &'a self,
        stream: Stream,
        buf: &'a mut CudaBuffer<T>,
        range: Range<usize>,
    ) -> Result<View<'a, T>> {
        const OP: &str = "raw_view";
        self.own(buf, OP)?;
        let len = range_len(OP, &range)?;
        bounds(OP, &buf.label, buf.id, buf.len, range.start, len)?;
        Ok(buf.view(range.start, len, self.inner.stream(stream)))
    }

    /// `buf[range]` to read, as [`raw_view`](CudaBackend::raw_view) gives
    /// it to write: a cudarc device slice on `stream` with no event of its
    /// own, for a library call or kernel enqueued on `stream` that only
    /// reads it. Errors: another backend's buffer, a range outside it.
    pub fn read_view<'a, T: Element>(
        &'a self,
        stream: Stream,
        buf: &'a CudaBuffer<T>,
        range: Range<usize>,
    ) -> Result<ReadView<'a, T>> {
        const OP: &str = "read_view";
        self.own(buf, OP)?;
        let len = range_len(OP, &range)?;
        bounds(OP, &buf.label, buf.id, buf.len, range.start, len)?;
        Ok(ReadView::new(
            buf.addr(range.start),
            len,
            self.inner.stream(stream),
        ))
    }

    /// The CUDA stream behind `stream`.
    pub fn cuda_stream(&self, stream: Stream) -> &Arc<CudaStream> {
        self.inner.stream(stream)
    }

    fn own<T: Element>(&self, buf: &CudaBuffer<T>, op: &'static str) -> Result<()> {
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

    fn own_host<T: Element>(&self, buf: &CudaHostBuffer<T>, op: &'static str) -> Result<()> {
        if Arc::ptr_eq(&buf.owner, &self.inner) {
            Ok(())
        } else {
            Err(Error::Backend {
                op,
                msg: format!(
                    "host buffer {:?} ({}) belongs to another backend",
                    buf.label, buf.id
                ),
            })
        }
    }

    fn own_event(&self, ev: &CudaBackendEvent, op: &'static str) -> Result<()> {
        if Arc::ptr_eq(&ev.owner, &self.inner) {
            Ok(())
        } else {
            Err(Error::Backend {
                op,
                msg: format!("event on stream {} belongs to another backend", ev.stream),
            })
        }
    }

    /// Zeroed device memory of `bytes` bytes (at least one): ready for any
    /// stream when this returns, or with `on` allocated and zeroed in that
    /// stream's order without blocking the host; with `on` and not `zero`,
    /// allocated only (its contents unspecified).
    fn alloc_device(
        &self,
        bytes: usize,
        what: &str,
        on: Option<Stream>,
        zero: bool,
    ) -> Result<sys::CUdeviceptr> {
        let inner = &*self.inner;
        inner.begin()?;
        let bytes = bytes.max(1);
        let stream = match on {
            Some(s) => inner.stream(s).cu_stream(),
            None => inner.service.cu_stream(),
        };
        let failed = |call: &str, e: DriverError| Error::Backend {
            op: if on.is_some() { "alloc_on" } else { "alloc" },
            msg: format!(
                "{call} of {bytes} bytes for {what} on cuda:{} failed: {e}",
                inner.device.ordinal()
            ),
        };
        // SAFETY: a stream of the current context; the memory is zeroed on
        // the same stream. Without `on` the host waits for both below, so
        // every stream may use it once this returns; with `on`, work
        // enqueued on that stream later sees zeros, and other streams wait
        // for an event of it (the contract of `alloc_on`).
        let ptr = unsafe { result::malloc_async(stream, bytes) }
            .map_err(|e| failed("cuMemAllocAsync", e))?;
        if !zero && on.is_some() {
            return Ok(ptr);
        }
        // SAFETY: [ptr, ptr + bytes) was just allocated.
        let zeroed =
            unsafe { result::memset_d8_async(ptr, 0, bytes, stream) }.and_then(|()| match on {
                Some(_) => Ok(()),
                None => inner.service.synchronize(),
            });
        if let Err(e) = zeroed {
            inner.free(ptr);
            return Err(failed("zeroing", e));
        }
        Ok(ptr)
    }

    /// A buffer of `len` elements, zeroed unless `on` and not `zero`: see
    /// [`alloc_device`](Self::alloc_device).
    fn buffer<T: Element>(
        &self,
        op: &'static str,
        len: usize,
        label: &str,
        on: Option<Stream>,
        zero: bool,
    ) -> Result<CudaBuffer<T>> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| Error::InvalidSize {
                op,
                msg: format!(
                    "{len} elements of {} for buffer {label:?} overflow",
                    T::DTYPE
                ),
            })?;
        let ptr = self.alloc_device(bytes, &format!("buffer {label:?}"), on, zero)?;
        Ok(CudaBuffer {
            ptr,
            len,
            id: next_id(),
            label: Arc::from(label),
            owner: self.inner.clone(),
            _marker: PhantomData,
        })
    }

    /// Launches the conversion kernel `S -> D` over `pieces` (`(src address,
    /// dst address, len)`, none empty), [`PIECES_MAX`] per launch.
    ///
    /// # Safety
    /// Every range must lie in live device memory of this context, the
    /// source ranges hold `S`, the destination ranges `D` and do not
    /// overlap each other nor any source range.
    unsafe fn launch_convert<S: Element, D: Element>(
        &self,
        stream: Stream,
        pieces: &[(sys::CUdeviceptr, sys::CUdeviceptr, usize)],
        accumulate: bool,
    ) -> Result<()> {
        let inner = &*self.inner;
        let (index, _) = convert_entry_point(S::DTYPE, D::DTYPE);
        let f = &inner.convert.functions[index];
        let s = inner.stream(stream);
        let acc = u32::from(accumulate);
        for chunk in pieces.chunks(PIECES_MAX) {
            let mut desc = KernelPieces {
                count: 0,
                total: 0,
                piece: [KernelPiece::default(); PIECES_MAX],
            };
            for &(src, dst, len) in chunk.iter().filter(|p| p.2 > 0) {
                desc.piece[desc.count as usize] = KernelPiece {
                    src,
                    dst,
                    start: desc.total,
                    len: len as u64,
                };
                desc.count += 1;
                desc.total += len as u64;
            }
            if desc.total == 0 {
                continue;
            }
            let cfg = LaunchConfig {
                grid_dim: (convert_blocks(desc.total, inner.convert.max_blocks), 1, 1),
                block_dim: (CONVERT_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut args = s.launch_builder(f);
            args.arg(&desc).arg(&acc);
            // SAFETY: convert_<S>_<D>(ZeroPieces ps, u32 accumulate): the
            // descriptor by value (copied by the driver at launch) and the
            // flag; the kernel is chosen by S and D; the ranges are valid
            // as the caller guarantees.
            unsafe { args.launch(cfg) }.map_err(cuda_error("cuLaunchKernel (convert)"))?;
        }
        Ok(())
    }

    /// The shared body of `copy_h2d` and `copy_d2h`: `len` elements
    /// between `host[host_at..]` and `dev[dev_at..]`, in direction `dir`.
    #[allow(clippy::too_many_arguments)]
    fn host_copy<T: Element>(
        &self,
        dir: HostCopy,
        stream: Stream,
        host: &CudaHostBuffer<T>,
        host_at: usize,
        dev: &CudaBuffer<T>,
        dev_at: usize,
        len: usize,
    ) -> Result<()> {
        let op = match dir {
            HostCopy::ToDevice => "copy_h2d",
            HostCopy::ToHost => "copy_d2h",
        };
        self.own_host(host, op)?;
        self.own(dev, op)?;
        bounds(op, &host.label, host.id, host.len, host_at, len)?;
        bounds(op, &dev.label, dev.id, dev.len, dev_at, len)?;
        self.inner.begin()?;
        if len == 0 {
            return Ok(());
        }
        let s = self.inner.stream(stream).cu_stream();
        let bytes = len * size_of::<T>();
        // SAFETY: `host_at + len` is in bounds (checked above).
        let h = unsafe { host.ptr.as_ptr().add(host_at) }.cast::<c_void>();
        // SAFETY: both ranges are in bounds (checked above) of live memory
        // (pinned host memory, device memory of this context); the caller
        // borrows the destination exclusively and orders every other
        // access to both ranges (the trait's contract), and a host
        // buffer's drop waits for the streams before its memory is freed.
        let done = unsafe {
            match dir {
                HostCopy::ToDevice => sys::cuMemcpyHtoDAsync_v2(dev.addr(dev_at), h, bytes, s),
                HostCopy::ToHost => sys::cuMemcpyDtoHAsync_v2(h, dev.addr(dev_at), bytes, s),
            }
        };
        done.result().map_err(cuda_error(match dir {
            HostCopy::ToDevice => "cuMemcpyHtoDAsync",
            HostCopy::ToHost => "cuMemcpyDtoHAsync",
        }))
    }

    /// The shared body of `copy_d2d` and `cast`.
    #[allow(clippy::too_many_arguments)]
    fn cast_op<S: Element, D: Element>(
        &self,
        op: &'static str,
        stream: Stream,
        src: &CudaBuffer<S>,
        src_at: usize,
        dst: &mut CudaBuffer<D>,
        dst_at: usize,
        len: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.own(src, op)?;
        self.own(dst, op)?;
        bounds(op, &src.label, src.id, src.len, src_at, len)?;
        bounds(op, &dst.label, dst.id, dst.len, dst_at, len)?;
        self.inner.begin()?;
        if len == 0 {
            return Ok(());
        }
        if S::DTYPE == D::DTYPE && !accumulate {
            // SAFETY: both ranges are in bounds (checked above) of live
            // allocations of this context, in two distinct buffers (one
            // borrowed shared, one exclusively).
            return unsafe {
                result::memcpy_dtod_async(
                    dst.addr(dst_at),
                    src.addr(src_at),
                    len * size_of::<S>(),
                    self.inner.stream(stream).cu_stream(),
                )
            }
            .map_err(cuda_error("cuMemcpyDtoDAsync"));
        }
        // SAFETY: as above; S and D are the buffers' element types.
        unsafe {
            self.launch_convert::<S, D>(
                stream,
                &[(src.addr(src_at), dst.addr(dst_at), len)],
                accumulate,
            )
        }
    }
}

impl CudaBackend {
    /// Reserves `bytes` of device memory in the pool every buffer comes
    /// from: one allocation of that size, freed at once. The pool keeps
    /// what it holds (its release threshold is the maximum), so later
    /// allocations, up to that many bytes at a time, are carved from the
    /// reserved memory without asking the driver for more (RAPIDS RMM
    /// primes its stream-ordered pool the same way). The engine reserves
    /// its memory plan this way before it allocates anything. Returns when
    /// the memory is reserved; an error naming the bytes and the driver's
    /// answer when the device cannot give them.
    pub fn reserve(&self, bytes: u64) -> Result<()> {
        let inner = &*self.inner;
        inner.begin()?;
        if bytes == 0 {
            return Ok(());
        }
        let failed = |call: &str, e: DriverError| Error::Backend {
            op: "reserve",
            msg: format!(
                "{call} of {bytes} bytes on cuda:{} failed: {e}",
                inner.device.ordinal()
            ),
        };
        let len = usize::try_from(bytes).map_err(|_| Error::InvalidSize {
            op: "reserve",
            msg: format!("{bytes} bytes do not fit in an address"),
        })?;
        let stream = inner.service.cu_stream();
        // SAFETY: a stream of the current context; the memory is freed on
        // the same stream right after, and nothing else ever sees it.
        let ptr = unsafe { result::malloc_async(stream, len) }
            .map_err(|e| failed("cuMemAllocAsync", e))?;
        // SAFETY: `ptr` came from cuMemAllocAsync above and is freed once.
        unsafe { result::free_async(ptr, stream) }.map_err(|e| failed("cuMemFreeAsync", e))?;
        inner
            .service
            .synchronize()
            .map_err(|e| failed("synchronising the reservation", e))
    }

    /// The device memory the buffers' pool holds from the driver now, in
    /// use or kept for reuse (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`): it
    /// grows only when an allocation finds no room in what the pool holds,
    /// so a step that leaves it unchanged asked the driver for nothing.
    pub fn pool_reserved(&self) -> Result<u64> {
        self.inner.begin()?;
        let pool = default_pool(self.inner.ctx())?;
        let mut bytes: u64 = 0;
        // SAFETY: the reserved-memory attribute is a cuuint64_t; `bytes`
        // lives across the call.
        unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&mut bytes as *mut u64).cast::<c_void>(),
            )
        }
        .result()
        .map_err(cuda_error("cuMemPoolGetAttribute (reserved memory)"))?;
        Ok(bytes)
    }
}

/// The device's default memory pool, which `cuMemAllocAsync` draws from.
fn default_pool(ctx: &CudaContext) -> Result<sys::CUmemoryPool> {
    let mut pool = std::mem::MaybeUninit::uninit();
    // SAFETY: the context is current (bound by the caller); `pool` is a
    // valid out pointer.
    unsafe { sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device()) }
        .result()
        .map_err(cuda_error("cuDeviceGetDefaultMemPool"))?;
    // SAFETY: cuDeviceGetDefaultMemPool succeeded.
    Ok(unsafe { pool.assume_init() })
}

/// Raises the release threshold of the device's default memory pool to
/// the maximum, so that freed buffers stay in the pool for the next
/// allocation instead of going back to the driver at every synchronisation.
fn keep_pool(ctx: &CudaContext) -> Result<()> {
    let pool = default_pool(ctx)?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the release threshold is a cuuint64_t attribute; `threshold`
    // lives across the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast::<c_void>(),
        )
    }
    .result()
    .map_err(cuda_error("cuMemPoolSetAttribute (release threshold)"))
}

impl Convert {
    fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let arch = target_arch(ctx)?;
        let src = source("convert.cu").ok_or_else(|| {
            Error::Unsupported("kernel source `convert.cu` is not registered".into())
        })?;
        let module = load_module(ctx, src, &arch)?;
        let functions = CONVERT_ENTRY_POINTS
            .iter()
            .map(|name| {
                module
                    .load_function(name)
                    .map_err(cuda_error("cuModuleGetFunction (convert.cu)"))
            })
            .collect::<Result<Vec<_>>>()?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_error("cuDeviceGetAttribute"))?
            .max(1) as u32;
        Ok(Self {
            _module: module,
            functions,
            // Enough blocks to fill every SM (2048 threads each); the
            // grid-stride loop does the rest.
            max_blocks: sms * (2048 / CONVERT_BLOCK),
        })
    }
}

impl Backend for CudaBackend {
    type Buffer<T: Element> = CudaBuffer<T>;
    type HostBuffer<T: Element> = CudaHostBuffer<T>;
    type Event = CudaBackendEvent;
    type Scalars = CudaScalars;

    fn device(&self) -> Device {
        Device::Cuda(self.inner.device.clone())
    }

    fn alloc<T: Element>(&self, len: usize, label: &str) -> Result<CudaBuffer<T>> {
        self.buffer("alloc", len, label, None, true)
    }

    fn alloc_on<T: Element>(
        &self,
        stream: Stream,
        len: usize,
        label: &str,
    ) -> Result<CudaBuffer<T>> {
        self.buffer("alloc_on", len, label, Some(stream), true)
    }

    /// `cuMemAllocAsync` on `stream` without the memset.
    fn alloc_scratch_on<T: Element>(
        &self,
        stream: Stream,
        len: usize,
        label: &str,
    ) -> Result<CudaBuffer<T>> {
        self.buffer("alloc_scratch_on", len, label, Some(stream), false)
    }

    fn release_on<T: Element>(&self, stream: Stream, buf: CudaBuffer<T>) {
        if !Arc::ptr_eq(&buf.owner, &self.inner) {
            // Another backend's buffer: its own drop frees it safely.
            drop(buf);
            return;
        }
        let buf = std::mem::ManuallyDrop::new(buf);
        let ctx = self.inner.ctx();
        ctx.record_err(ctx.bind_to_thread());
        // SAFETY: `ptr` came from cuMemAllocAsync of this context and is
        // freed once (`buf` is not dropped); the caller ordered every other
        // stream's use of it before this point of `stream` (the contract of
        // `release_on`), and nothing can be enqueued after (`buf` is gone).
        ctx.record_err(unsafe {
            result::free_async(buf.ptr, self.inner.stream(stream).cu_stream())
        });
        // SAFETY: the fields are read once; `buf` is never used again.
        unsafe {
            drop(std::ptr::read(&buf.label));
            drop(std::ptr::read(&buf.owner));
        }
    }

    fn owns_host<T: Element>(&self, buf: &CudaHostBuffer<T>) -> bool {
        Arc::ptr_eq(&buf.owner, &self.inner)
    }

    fn alloc_host<T: Element>(&self, len: usize, label: &str) -> Result<CudaHostBuffer<T>> {
        self.inner.begin()?;
        let (memory, ptr) = pinned_zeros::<T>(self.inner.ctx(), len).map_err(|e| match e {
            Error::PinMemory { needed, msg } => Error::PinMemory {
                needed,
                msg: format!("host buffer {label:?}: {msg}"),
            },
            other => other,
        })?;
        Ok(CudaHostBuffer {
            ptr,
            len,
            id: next_id(),
            label: Arc::from(label),
            owner: self.inner.clone(),
            _memory: memory,
        })
    }

    fn record(&self, stream: Stream) -> Result<CudaBackendEvent> {
        self.inner.begin()?;
        let on = self.inner.stream(stream);
        // A pooled event whose work is done (no handle refers to it any
        // more), recorded again; else a new one.
        let event = match self.inner.events.take(CudaEvent::is_complete) {
            Some(e) => {
                e.record(on).map_err(cuda_error("cuEventRecord"))?;
                e
            }
            None => {
                self.inner.events.created_one();
                on.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(cuda_error("cuEventRecord"))?
            }
        };
        Ok(CudaBackendEvent {
            event: Arc::new(Pooled::new(event, self.inner.events.clone())),
            stream,
            owner: self.inner.clone(),
        })
    }

    fn wait(&self, stream: Stream, event: &CudaBackendEvent) -> Result<()> {
        self.own_event(event, "wait")?;
        self.inner.begin()?;
        if event.stream == stream {
            return Ok(());
        }
        self.inner
            .stream(stream)
            .wait(event.event.get())
            .map_err(cuda_error("cuStreamWaitEvent"))
    }

    fn sync(&self, event: &CudaBackendEvent) -> Result<()> {
        self.own_event(event, "sync")?;
        self.inner.begin()?;
        event
            .event
            .get()
            .synchronize()
            .map_err(cuda_error("cuEventSynchronize"))
    }

    fn sync_all(&self) -> Result<()> {
        self.inner.begin()?;
        for s in Stream::ALL {
            self.inner
                .stream(s)
                .synchronize()
                .map_err(cuda_error("cuStreamSynchronize"))?;
        }
        Ok(())
    }

    fn read_host<'a, T: Element>(
        &self,
        buf: &'a CudaHostBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a [T]> {
        const OP: &str = "read_host";
        self.own_host(buf, OP)?;
        let len = range_len(OP, &range)?;
        bounds(OP, &buf.label, buf.id, buf.len, range.start, len)?;
        // SAFETY: the range is in bounds of the buffer's live, initialised
        // (zeroed at creation) pinned memory; the caller synced every
        // conflicting copy (the trait's contract), and writes from the host
        // need `&mut` the buffer.
        Ok(unsafe { std::slice::from_raw_parts(buf.ptr.as_ptr().add(range.start), len) })
    }

    fn write_host<'a, T: Element>(
        &self,
        buf: &'a mut CudaHostBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a mut [T]> {
        const OP: &str = "write_host";
        self.own_host(buf, OP)?;
        let len = range_len(OP, &range)?;
        bounds(OP, &buf.label, buf.id, buf.len, range.start, len)?;
        // SAFETY: as in read_host, and `&mut` the buffer makes the host
        // access exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(buf.ptr.as_ptr().add(range.start), len) })
    }

    fn copy_h2d<T: Element>(
        &self,
        stream: Stream,
        src: &CudaHostBuffer<T>,
        src_at: usize,
        dst: &mut CudaBuffer<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.host_copy(HostCopy::ToDevice, stream, src, src_at, dst, dst_at, len)
    }

    fn copy_d2h<T: Element>(
        &self,
        stream: Stream,
        src: &CudaBuffer<T>,
        src_at: usize,
        dst: &mut CudaHostBuffer<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.host_copy(HostCopy::ToHost, stream, dst, dst_at, src, src_at, len)
    }

    fn copy_d2d<T: Element>(
        &self,
        stream: Stream,
        src: &CudaBuffer<T>,
        src_at: usize,
        dst: &mut CudaBuffer<T>,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.cast_op("copy_d2d", stream, src, src_at, dst, dst_at, len, false)
    }

    fn copy_within<T: Element>(
        &self,
        stream: Stream,
        buf: &mut CudaBuffer<T>,
        src: Range<usize>,
        dst_at: usize,
    ) -> Result<()> {
        const OP: &str = "copy_within";
        self.own(buf, OP)?;
        let len = range_len(OP, &src)?;
        disjoint(OP, &buf.label, buf.id, &src, dst_at, len)?;
        bounds(OP, &buf.label, buf.id, buf.len, src.start, len)?;
        bounds(OP, &buf.label, buf.id, buf.len, dst_at, len)?;
        self.inner.begin()?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: two disjoint in-bounds ranges (checked above) of one live
        // allocation of this context.
        unsafe {
            result::memcpy_dtod_async(
                buf.addr(dst_at),
                buf.addr(src.start),
                len * size_of::<T>(),
                self.inner.stream(stream).cu_stream(),
            )
        }
        .map_err(cuda_error("cuMemcpyDtoDAsync (copy_within)"))
    }

    fn cast<S: Element, D: Element>(
        &self,
        stream: Stream,
        src: &CudaBuffer<S>,
        src_at: usize,
        dst: &mut CudaBuffer<D>,
        dst_at: usize,
        len: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.cast_op("cast", stream, src, src_at, dst, dst_at, len, accumulate)
    }

    fn fill<T: Element>(
        &self,
        stream: Stream,
        buf: &mut CudaBuffer<T>,
        range: Range<usize>,
        value: T,
    ) -> Result<()> {
        const OP: &str = "fill";
        self.own(buf, OP)?;
        let len = range_len(OP, &range)?;
        bounds(OP, &buf.label, buf.id, buf.len, range.start, len)?;
        self.inner.begin()?;
        if len == 0 {
            return Ok(());
        }
        let s = self.inner.stream(stream).cu_stream();
        let at = buf.addr(range.start);
        let bytes = bytemuck::bytes_of(&value);
        // SAFETY: `len` elements from `at` are in bounds (checked above) of
        // a live allocation of this context; element addresses are aligned
        // to the element size, as the memsets of that width require.
        let set = unsafe {
            match bytes.len() {
                4 => sys::cuMemsetD32Async(at, bytemuck::pod_read_unaligned(bytes), len, s),
                2 => sys::cuMemsetD16Async(at, bytemuck::pod_read_unaligned(bytes), len, s),
                n => {
                    return Err(Error::Unsupported(format!(
                        "fill of {n}-byte elements ({})",
                        T::DTYPE
                    )))
                }
            }
        };
        set.result().map_err(cuda_error("cuMemsetAsync (fill)"))
    }

    fn sum_squares<G: Element>(
        &self,
        stream: Stream,
        parts: &[(&CudaBuffer<G>, Range<usize>)],
    ) -> Result<CudaScalars> {
        const OP: &str = "sum_squares";
        let mut lens = Vec::with_capacity(parts.len());
        for (i, (b, r)) in parts.iter().enumerate() {
            let checked = (|| -> Result<usize> {
                self.own(b, OP)?;
                let n = range_len(OP, r)?;
                bounds(OP, &b.label, b.id, b.len, r.start, n)?;
                Ok(n)
            })();
            lens.push(checked.map_err(|e| item_error(e, "part", i))?);
        }
        let inner = &*self.inner;
        inner.begin()?;
        let s = inner.stream(stream);
        // The results, allocated in the stream's order (no host wait in a
        // step); every part's value is written by its last launch, so
        // nothing needs zeroing. Freed as any buffer is, when dropped.
        // SAFETY: a stream of the current context.
        let out =
            unsafe { result::malloc_async(s.cu_stream(), (parts.len() * size_of::<f64>()).max(1)) }
                .map_err(cuda_error("cuMemAllocAsync (sum_squares results)"))?;
        let scalars = CudaScalars {
            ptr: out,
            len: parts.len(),
            owner: self.inner.clone(),
        };
        // One scratch for every part's chunk sums, allocated and freed in
        // the stream's order.
        let offsets: Vec<usize> = lens
            .iter()
            .scan(0, |acc, &n| {
                let at = *acc;
                *acc += norm_scratch_len(n);
                Some(at)
            })
            .collect();
        let scratch_len = offsets
            .last()
            .zip(lens.last())
            .map_or(0, |(&at, &n)| at + norm_scratch_len(n))
            .max(1);
        // SAFETY: a stream of the current context; the memory is used only
        // by the launches below on the same stream and freed after them in
        // its order.
        let scratch =
            unsafe { result::malloc_async(s.cu_stream(), scratch_len * size_of::<f64>()) }
                .map_err(cuda_error("cuMemAllocAsync (sum_squares scratch)"))?;
        let launched = (|| -> Result<()> {
            for (i, ((b, r), &n)) in parts.iter().zip(&lens).enumerate() {
                let x = b.view(r.start, n, s);
                let mut sums = View::<f64> {
                    ptr: scratch + (offsets[i] * size_of::<f64>()) as u64,
                    len: norm_scratch_len(n),
                    stream: s,
                    _marker: PhantomData,
                };
                let mut res = View::<f64> {
                    ptr: out + (i * size_of::<f64>()) as u64,
                    len: 1,
                    stream: s,
                    _marker: PhantomData,
                };
                inner.adam.sum_squares_into(s, &x, &mut sums, &mut res)?;
            }
            Ok(())
        })();
        // SAFETY: `scratch` came from cuMemAllocAsync above; it is freed
        // once, after the launches in the stream's order.
        let freed = unsafe { result::free_async(scratch, s.cu_stream()) }
            .map_err(cuda_error("cuMemFreeAsync (sum_squares scratch)"));
        launched.and(freed)?;
        Ok(scalars)
    }

    fn read_scalars(&self, scalars: &CudaScalars) -> Result<Vec<f64>> {
        if !Arc::ptr_eq(&scalars.owner, &self.inner) {
            return Err(Error::Backend {
                op: "read_scalars",
                msg: "the scalars belong to another backend".into(),
            });
        }
        let inner = &*self.inner;
        inner.begin()?;
        let mut host = vec![0.0f64; scalars.len];
        if scalars.len > 0 {
            // SAFETY: the results hold `len` f64 in live device memory of
            // this context; `host` has room for them and lives until the
            // synchronisation below. The producing stream was synced by the
            // caller (the trait's contract), so the values are complete.
            unsafe { result::memcpy_dtoh_async(&mut host, scalars.ptr, inner.service.cu_stream()) }
                .map_err(cuda_error("cuMemcpyDtoHAsync (read_scalars)"))?;
            inner
                .service
                .synchronize()
                .map_err(cuda_error("cuStreamSynchronize (read_scalars)"))?;
        }
        Ok(host)
    }

    fn adamw<G: Element, P: Element>(
        &self,
        stream: Stream,
        k: &AdamWStep,
        parts: Vec<AdamWPart<'_, Self, G, P>>,
    ) -> Result<()> {
        const OP: &str = "adamw";
        let mut lens = Vec::with_capacity(parts.len());
        for (i, p) in parts.iter().enumerate() {
            let checked = (|| -> Result<usize> {
                let n = range_len(OP, &p.state)?;
                let at = p.state.start;
                for b in [&*p.master, &*p.m, &*p.v] {
                    self.own(b, OP)?;
                    bounds(OP, &b.label, b.id, b.len, at, n)?;
                }
                self.own(p.grad, OP)?;
                bounds(OP, &p.grad.label, p.grad.id, p.grad.len, p.grad_at, n)?;
                if let Some((b, low_at)) = &p.low {
                    self.own(b, OP)?;
                    bounds(OP, &b.label, b.id, b.len, *low_at, n)?;
                }
                Ok(n)
            })();
            lens.push(checked.map_err(|e| item_error(e, "part", i))?);
        }
        self.inner.begin()?;
        let s = self.inner.stream(stream);
        for (p, &n) in parts.iter().zip(&lens) {
            if n == 0 {
                continue;
            }
            let at = p.state.start;
            let mut master = p.master.view(at, n, s);
            let mut m = p.m.view(at, n, s);
            let mut v = p.v.view(at, n, s);
            let grad = p.grad.view(p.grad_at, n, s);
            let mut low = p.low.as_ref().map(|(b, low_at)| b.view(*low_at, n, s));
            self.inner
                .adam
                .step(s, k, &mut master, &grad, &mut m, &mut v, low.as_mut())?;
        }
        Ok(())
    }

    fn pack<S: Element, D: Element>(
        &self,
        stream: Stream,
        pieces: &[PackPiece<'_, Self, S>],
        dst: &mut CudaBuffer<D>,
    ) -> Result<()> {
        const OP: &str = "pack";
        self.own(dst, OP)?;
        let mut ranges = Vec::with_capacity(pieces.len());
        for (i, p) in pieces.iter().enumerate() {
            let checked = (|| -> Result<()> {
                self.own(p.src, OP)?;
                bounds(OP, &p.src.label, p.src.id, p.src.len, p.src_at, p.len)?;
                bounds(OP, &dst.label, dst.id, dst.len, p.dst_at, p.len)
            })();
            checked.map_err(|e| item_error(e, "piece", i))?;
            ranges.push((p.src.addr(p.src_at), dst.addr(p.dst_at), p.len));
        }
        self.inner.begin()?;
        // SAFETY: every range is in bounds (checked above) of live buffers
        // of this context holding S (sources) and D (the bucket, borrowed
        // exclusively, so no source); the bucket ranges do not overlap (the
        // trait's contract).
        unsafe { self.launch_convert::<S, D>(stream, &ranges, false) }
    }

    fn unpack<S: Element, D: Element>(
        &self,
        stream: Stream,
        src: &CudaBuffer<S>,
        pieces: &mut [UnpackPiece<'_, Self, D>],
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "unpack";
        self.own(src, OP)?;
        let mut ranges = Vec::with_capacity(pieces.len());
        for (i, p) in pieces.iter().enumerate() {
            let checked = (|| -> Result<()> {
                self.own(p.dst, OP)?;
                bounds(OP, &src.label, src.id, src.len, p.src_at, p.len)?;
                bounds(OP, &p.dst.label, p.dst.id, p.dst.len, p.dst_at, p.len)
            })();
            checked.map_err(|e| item_error(e, "piece", i))?;
            ranges.push((src.addr(p.src_at), p.dst.addr(p.dst_at), p.len));
        }
        self.inner.begin()?;
        // SAFETY: every range is in bounds (checked above) of live buffers
        // of this context; each destination is a distinct buffer borrowed
        // exclusively (so neither another destination nor the bucket).
        unsafe { self.launch_convert::<S, D>(stream, &ranges, accumulate) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static_assertions::assert_impl_all!(CudaBackend: Send, Sync, Clone);
    static_assertions::assert_impl_all!(CudaBuffer<f32>: Send, Sync);
    static_assertions::assert_impl_all!(CudaHostBuffer<half::bf16>: Send, Sync);
    static_assertions::assert_impl_all!(CudaBackendEvent: Send, Sync, Clone);
    static_assertions::assert_impl_all!(CudaScalars: Send, Sync);

    #[test]
    fn pieces_are_the_kernels_layout() {
        // 16 bytes of header, then 32 per piece, under the 4 KiB of kernel
        // parameters every driver accepts.
        assert_eq!(size_of::<KernelPiece>(), 32);
        assert_eq!(size_of::<KernelPieces>(), 16 + 32 * PIECES_MAX);
        assert!(size_of::<KernelPieces>() + 4 <= 4096);
    }

    #[test]
    fn blocks_cover_the_elements_up_to_the_limit() {
        assert_eq!(convert_blocks(1, 100), 1);
        assert_eq!(convert_blocks(256, 100), 1);
        assert_eq!(convert_blocks(257, 100), 2);
        assert_eq!(convert_blocks(1 << 40, 100), 100);
    }

    #[test]
    fn argument_errors_name_the_buffer_and_the_part() {
        let e = bounds("cast", "grads", BufferId(7), 10, 8, 3).unwrap_err();
        assert_eq!(
            e.to_string(),
            Error::InvalidSize {
                op: "cast",
                msg: "elements [8..8+3) outside buffer \"grads\" (#7) of 10 elements".into()
            }
            .to_string()
        );
        assert!(bounds("cast", "g", BufferId(1), 10, usize::MAX, 2).is_err());
        assert!(bounds("cast", "g", BufferId(1), 10, 7, 3).is_ok());
        let e = item_error(e, "piece", 4);
        assert!(e.to_string().contains("piece 4: elements [8..8+3)"), "{e}");
        let (start, end) = (5, 3);
        assert!(range_len("fill", &(start..end)).is_err());
    }
}
