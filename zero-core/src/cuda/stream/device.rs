//! The CUDA side of [`super`]: streams, hand-offs, fences, the per-buffer
//! reuse guard, pinned host buffers and the copies between them and arena
//! buffers.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaStream, DriverError, PinnedHostSlice,
};

use super::{LastUse, StreamKind};
use crate::cuda::arena::DeviceBuffer;
use crate::memory::{Allocation, Category, MemoryTracker, Tier};
use crate::{CudaDevice, DType, Element, Error, Result};

/// A failed driver call and what it was for.
#[derive(Debug)]
struct DriverCall {
    op: &'static str,
    source: DriverError,
}

impl fmt::Display for DriverCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.op, self.source)
    }
}

impl std::error::Error for DriverCall {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Maps a driver error to [`Error::Cuda`], naming the operation `op`.
pub(crate) fn cuda_error(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |source| Error::Cuda(Box::new(DriverCall { op, source }))
}

/// Returns an error stored by a `Drop` (here or in cudarc) since the last
/// check, and makes the context current on this thread for raw driver
/// calls.
fn begin(ctx: &CudaContext) -> Result<()> {
    ctx.check_err().map_err(cuda_error(
        "an earlier asynchronous operation (reported late)",
    ))?;
    ctx.bind_to_thread().map_err(cuda_error("cuCtxSetCurrent"))
}

/// The event of a buffer's last use and the stream it was recorded on: the
/// reuse guard of device and pinned buffers (see [`LastUse`] for the rule).
pub(crate) struct UseGuard {
    event: CudaEvent,
    last: LastUse<Arc<CudaStream>>,
}

impl fmt::Debug for UseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let last = self.last.stream().map(|s| s.cu_stream());
        f.debug_struct("UseGuard").field("last", &last).finish()
    }
}

impl UseGuard {
    /// A guard with no pending use. `host_waits`: the host will wait on it
    /// (pinned buffers), so the event blocks the thread instead of spinning;
    /// otherwise it records no timing, which makes stream waits cheaper.
    pub(crate) fn new(ctx: &Arc<CudaContext>, host_waits: bool) -> Result<Self> {
        let flags = if host_waits {
            sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let event = ctx
            .new_event(Some(flags))
            .map_err(cuda_error("cuEventCreate"))?;
        Ok(Self {
            event,
            last: LastUse::Idle,
        })
    }

    /// Makes `stream` wait for the last use, if that was on another stream.
    pub(crate) fn before(&self, stream: &Arc<CudaStream>) -> Result<()> {
        if self.last.must_wait(stream) {
            stream
                .wait(&self.event)
                .map_err(cuda_error("cuStreamWaitEvent (buffer reuse)"))?;
        }
        Ok(())
    }

    /// Records a use just enqueued on `stream`.
    pub(crate) fn after(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        match self.event.record(stream) {
            Ok(()) => {
                self.last.used_on(stream.clone());
                Ok(())
            }
            Err(e) => {
                // The event does not cover this use, so no later use could
                // wait for it: wait on the host instead (the stream already
                // waited for every earlier use).
                if stream.synchronize().is_ok() {
                    self.last.host_waited();
                }
                Err(cuda_error("cuEventRecord (buffer use)")(e))
            }
        }
    }

    /// [`after`](Self::after) where no error can be returned (`Drop`): a
    /// failure is stored in the context and reported by the next call.
    pub(crate) fn after_in_drop(&mut self, stream: &Arc<CudaStream>) {
        if let Err(e) = self.event.record(stream) {
            let ctx = stream.context();
            ctx.record_err::<()>(Err(e));
            let synced = stream.synchronize();
            if synced.is_ok() {
                self.last.host_waited();
            }
            ctx.record_err(synced);
        } else {
            self.last.used_on(stream.clone());
        }
    }

    /// Blocks the host until the last use has completed.
    pub(crate) fn host_wait(&mut self) -> Result<()> {
        if self.last.must_host_wait() {
            self.event
                .synchronize()
                .map_err(cuda_error("cuEventSynchronize (buffer reuse)"))?;
            self.last.host_waited();
        }
        Ok(())
    }

    /// [`host_wait`](Self::host_wait) for `Drop`: a failure is stored in the
    /// context.
    pub(crate) fn host_wait_in_drop(&mut self) {
        if self.last.must_host_wait() {
            let waited = self.event.synchronize();
            if waited.is_ok() {
                self.last.host_waited();
            }
            self.event.context().record_err(waited);
        }
    }

    /// Makes `stream` wait for the last use, for `Drop`: e.g. before memory
    /// is freed in `stream`'s order. A failure is stored in the context.
    pub(crate) fn order_before_in_drop(&self, stream: &Arc<CudaStream>) {
        if self.last.must_wait(stream) {
            stream.context().record_err(stream.wait(&self.event));
        }
    }

    /// Whether the last use has completed, without blocking.
    pub(crate) fn is_complete(&self) -> Result<bool> {
        if !self.last.must_host_wait() {
            return Ok(true);
        }
        self.event
            .try_is_complete()
            .map_err(cuda_error("cuEventQuery"))
    }
}

/// The four streams of one rank (see [`StreamKind`]) and the events that
/// hand work between them.
///
/// Every stream is a non-blocking cudarc stream of the rank's context, so
/// none of them synchronizes with the legacy default stream.
pub struct Streams {
    device: CudaDevice,
    streams: [Arc<CudaStream>; 4],
    /// One per source stream, re-recorded by each hand-off from it. A
    /// stream's wait captures the event as it is when the wait is enqueued,
    /// so a later record only ever covers more work: reuse is safe, also
    /// from several threads.
    handoff: [CudaEvent; 4],
}

impl fmt::Debug for Streams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Streams")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl Streams {
    /// Creates the compute, communication and copy streams on `device`.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let ctx = device.context();
        let stream = || ctx.new_stream().map_err(cuda_error("cuStreamCreate"));
        let streams = [stream()?, stream()?, stream()?, stream()?];
        let event = || {
            ctx.new_event(None)
                .map_err(cuda_error("cuEventCreate (hand-off)"))
        };
        let handoff = [event()?, event()?, event()?, event()?];
        Ok(Self {
            device: device.clone(),
            streams,
            handoff,
        })
    }

    /// The device the streams belong to.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.device.context()
    }

    /// The stream of `kind`.
    pub fn get(&self, kind: StreamKind) -> &Arc<CudaStream> {
        &self.streams[kind.index()]
    }

    /// The compute stream.
    pub fn compute(&self) -> &Arc<CudaStream> {
        self.get(StreamKind::Compute)
    }

    /// The communication stream.
    pub fn comm(&self) -> &Arc<CudaStream> {
        self.get(StreamKind::Comm)
    }

    /// The host-to-device copy stream.
    pub fn h2d(&self) -> &Arc<CudaStream> {
        self.get(StreamKind::HostToDevice)
    }

    /// The device-to-host copy stream.
    pub fn d2h(&self) -> &Arc<CudaStream> {
        self.get(StreamKind::DeviceToHost)
    }

    /// Returns an error that a `Drop` stored since the last check (a failed
    /// event record or free), as cudarc's `check_err` does.
    pub fn check_err(&self) -> Result<()> {
        begin(self.context())
    }

    /// Makes `to` wait for all work enqueued on `from` so far: an event
    /// recorded on `from` and waited for by `to`. The host does not block.
    /// Handing a stream off to itself does nothing.
    pub fn hand_off(&self, from: StreamKind, to: StreamKind) -> Result<()> {
        if from == to {
            return Ok(());
        }
        begin(self.context())?;
        let event = &self.handoff[from.index()];
        event
            .record(self.get(from))
            .map_err(cuda_error("cuEventRecord (hand-off)"))?;
        self.get(to)
            .wait(event)
            .map_err(cuda_error("cuStreamWaitEvent (hand-off)"))
    }

    /// A fence after all work enqueued on `kind` so far, for the host to
    /// wait for (one event, created here).
    pub fn fence(&self, kind: StreamKind) -> Result<Fence> {
        begin(self.context())?;
        let event = self
            .get(kind)
            .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(cuda_error("cuEventRecord (fence)"))?;
        Ok(Fence { event, kind })
    }

    /// Copies `src` (pinned) into `dst` on the host-to-device stream,
    /// asynchronously. The copy waits for the last uses of both buffers;
    /// later uses wait for the copy. Lengths must be equal.
    pub fn copy_h2d<'a, T: Element>(
        &self,
        src: &mut PinnedHostBuffer<T>,
        dst: &'a mut DeviceBuffer<T>,
    ) -> Result<Transfer<'a>> {
        same_len("Streams::copy_h2d", src.len(), dst)?;
        let stream = self.h2d();
        begin(self.context())?;
        let bytes = dst.size_in_bytes();
        src.guard.before(stream)?;
        dst.guard().before(stream)?;
        if bytes > 0 {
            // SAFETY: dst's device range [ptr, ptr + bytes) lies in the
            // arena allocation, which the buffer keeps alive; src's pinned
            // range holds `bytes` bytes and lives until its guard's event
            // has completed (its Drop waits for it). `stream` now waits for
            // the last uses of both ranges, and both guards record this copy
            // below, so nothing touches either range until the copy is done.
            // Raw pointers, not slices: no host reference to memory in
            // flight is made.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst.device_ptr_raw(),
                    src.ptr.as_ptr().cast::<c_void>().cast_const(),
                    bytes,
                    stream.cu_stream(),
                )
            }
            .result()
            .map_err(cuda_error("cuMemcpyHtoDAsync"))?;
        }
        src.guard.after(stream)?;
        dst.guard_mut().after(stream)?;
        Ok(Transfer {
            guard: dst.guard_mut(),
            kind: StreamKind::HostToDevice,
        })
    }

    /// Copies `src` into `dst` (pinned) on the device-to-host stream,
    /// asynchronously. Read `dst` through
    /// [`PinnedHostBuffer::as_slice`], which waits for the copy.
    pub fn copy_d2h<'a, T: Element>(
        &self,
        src: &mut DeviceBuffer<T>,
        dst: &'a mut PinnedHostBuffer<T>,
    ) -> Result<Transfer<'a>> {
        same_len("Streams::copy_d2h", dst.len(), src)?;
        let stream = self.d2h();
        begin(self.context())?;
        let bytes = src.size_in_bytes();
        src.guard().before(stream)?;
        dst.guard.before(stream)?;
        if bytes > 0 {
            // SAFETY: as in copy_h2d, with the direction reversed: both
            // ranges are valid for `bytes` bytes and alive, `stream` waits
            // for their last uses and both guards record this copy, so the
            // host cannot read dst (as_slice waits) nor anything write src
            // before the copy completes.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.ptr.as_ptr().cast::<c_void>(),
                    src.device_ptr_raw(),
                    bytes,
                    stream.cu_stream(),
                )
            }
            .result()
            .map_err(cuda_error("cuMemcpyDtoHAsync"))?;
        }
        src.guard_mut().after(stream)?;
        dst.guard.after(stream)?;
        Ok(Transfer {
            guard: &mut dst.guard,
            kind: StreamKind::DeviceToHost,
        })
    }

    /// Copies `src` into `dst`, both on the device, on stream `on`,
    /// asynchronously.
    pub fn copy_d2d<'a, T: Element>(
        &self,
        on: StreamKind,
        src: &mut DeviceBuffer<T>,
        dst: &'a mut DeviceBuffer<T>,
    ) -> Result<Transfer<'a>> {
        same_len("Streams::copy_d2d", src.len(), dst)?;
        let stream = self.get(on);
        begin(self.context())?;
        let bytes = src.size_in_bytes();
        src.guard().before(stream)?;
        dst.guard().before(stream)?;
        if bytes > 0 {
            // SAFETY: both device ranges are valid for `bytes` bytes in
            // arena allocations kept alive by the buffers; they do not
            // overlap (two buffers of one slot cannot be taken at once, and
            // slots are disjoint); `stream` waits for both last uses and
            // both guards record the copy.
            unsafe {
                result::memcpy_dtod_async(
                    dst.device_ptr_raw(),
                    src.device_ptr_raw(),
                    bytes,
                    stream.cu_stream(),
                )
            }
            .map_err(cuda_error("cuMemcpyDtoDAsync"))?;
        }
        src.guard_mut().after(stream)?;
        dst.guard_mut().after(stream)?;
        Ok(Transfer {
            guard: dst.guard_mut(),
            kind: on,
        })
    }

    /// Copies pageable host memory `src` into `dst` on the host-to-device
    /// stream and returns when the copy has completed (the driver stages
    /// pageable memory, so this is the slow path that pinned buffers avoid).
    pub fn upload<T: Element>(&self, src: &[T], dst: &mut DeviceBuffer<T>) -> Result<()> {
        same_len("Streams::upload", src.len(), dst)?;
        let stream = self.h2d();
        begin(self.context())?;
        dst.guard().before(stream)?;
        if !src.is_empty() {
            // SAFETY: dst's range is valid for size_of_val(src) bytes (equal
            // lengths) and alive; `stream` waits for its last use. `src` is
            // borrowed until this function returns, and it returns only
            // after the copy has completed (host_wait below).
            unsafe { result::memcpy_htod_async(dst.device_ptr_raw(), src, stream.cu_stream()) }
                .map_err(cuda_error("cuMemcpyHtoDAsync (pageable)"))?;
        }
        dst.guard_mut().after(stream)?;
        dst.guard_mut().host_wait()
    }

    /// Copies `src` into pageable host memory `dst` on the device-to-host
    /// stream and returns when the copy has completed.
    pub fn download<T: Element>(&self, src: &mut DeviceBuffer<T>, dst: &mut [T]) -> Result<()> {
        same_len("Streams::download", dst.len(), src)?;
        let stream = self.d2h();
        begin(self.context())?;
        src.guard().before(stream)?;
        if !dst.is_empty() {
            // SAFETY: src's range is valid for size_of_val(dst) bytes and
            // alive; `stream` waits for its last write. `dst` is borrowed
            // mutably until this function returns, after the copy has
            // completed (host_wait below).
            unsafe { result::memcpy_dtoh_async(dst, src.device_ptr_raw(), stream.cu_stream()) }
                .map_err(cuda_error("cuMemcpyDtoHAsync (pageable)"))?;
        }
        src.guard_mut().after(stream)?;
        src.guard_mut().host_wait()
    }
}

/// `Ok` if a host side of `host_len` elements matches device buffer `dev`.
fn same_len<T: Element>(op: &'static str, host_len: usize, dev: &DeviceBuffer<T>) -> Result<()> {
    if host_len == dev.len() {
        return Ok(());
    }
    Err(Error::InvalidSize {
        op,
        msg: format!(
            "the host side has {host_len} elements, device buffer `{}` has {}",
            dev.name(),
            dev.len()
        ),
    })
}

/// An asynchronous copy in flight. Waiting is optional: dropping the
/// handle leaves the copy running, and the buffers' guards still order
/// every later use after it, so no work is lost or raced.
#[must_use = "wait() for the copy, or drop the Transfer to let the buffers' guards order later uses"]
#[derive(Debug)]
pub struct Transfer<'a> {
    guard: &'a mut UseGuard,
    kind: StreamKind,
}

impl Transfer<'_> {
    /// Blocks the host until the copy (and the destination's earlier uses)
    /// has completed.
    pub fn wait(self) -> Result<()> {
        self.guard.host_wait()
    }

    /// Whether the copy has completed, without blocking.
    pub fn is_complete(&self) -> Result<bool> {
        self.guard.is_complete()
    }

    /// The stream the copy runs on.
    pub fn stream_kind(&self) -> StreamKind {
        self.kind
    }
}

/// A point in one stream's work, for the host to wait for
/// ([`Streams::fence`]).
#[must_use = "a Fence does nothing unless waited for"]
#[derive(Debug)]
pub struct Fence {
    event: CudaEvent,
    kind: StreamKind,
}

impl Fence {
    /// Blocks the host (yielding the CPU) until the work before the fence
    /// has completed.
    pub fn wait(self) -> Result<()> {
        self.event
            .synchronize()
            .map_err(cuda_error("cuEventSynchronize (fence)"))
    }

    /// Whether the work before the fence has completed, without blocking.
    pub fn is_complete(&self) -> Result<bool> {
        self.event
            .try_is_complete()
            .map_err(cuda_error("cuEventQuery (fence)"))
    }

    /// The stream the fence is on.
    pub fn stream_kind(&self) -> StreamKind {
        self.kind
    }
}

/// Page-locked memory for `len` zeroed elements of `T` from the driver
/// (`cuMemHostAlloc`, flags 0: cached, readable by the CPU at full speed),
/// and its first element. The memory is freed when the slice is dropped.
///
/// Errors: [`Error::PinMemory`] when the driver refuses (not enough host
/// memory, or the cgroup's memory limit), [`Error::OutOfHostMemory`] for a
/// size that overflows.
pub(crate) fn pinned_zeros<T: Element>(
    ctx: &Arc<CudaContext>,
    len: usize,
) -> Result<(PinnedHostSlice<u8>, NonNull<T>)> {
    let bytes = len
        .checked_mul(std::mem::size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(Error::OutOfHostMemory { bytes: usize::MAX })?;
    // The driver refuses 0 bytes; one byte keeps a real allocation.
    let alloc = bytes.max(1);
    // SAFETY: the memory is unset; it is zeroed below before any reference
    // to it is made.
    let memory =
        unsafe { ctx.alloc_pinned_with_flags::<u8>(alloc, 0) }.map_err(|e| Error::PinMemory {
            needed: bytes as u64,
            msg: format!(
                "cuMemHostAlloc failed: {e}. Driver-pinned memory counts against host \
                 RAM and the container's memory limit (not `ulimit -l`): free host \
                 memory, raise the memory limit, or pin less (smaller buckets or tiles)"
            ),
        })?;
    // The allocation's own event was never recorded: this does not block.
    let raw = memory
        .as_ptr()
        .map_err(cuda_error("cuEventSynchronize (pinned)"))?
        .cast_mut();
    let ptr = NonNull::new(raw.cast::<T>())
        .filter(|p| p.as_ptr().is_aligned())
        .ok_or_else(|| Error::PinMemory {
            needed: bytes as u64,
            msg: "cuMemHostAlloc returned a null or misaligned pointer".into(),
        })?;
    // SAFETY: [raw, raw + alloc) is the allocation just made, owned by
    // `memory` and referenced by nothing else.
    unsafe { std::ptr::write_bytes(raw, 0, alloc) };
    Ok((memory, ptr))
}

/// Page-locked host memory for `len` elements of `T`, the endpoint of
/// asynchronous copies ([`Streams::copy_h2d`], [`Streams::copy_d2h`]).
///
/// Allocated by the driver (`cuMemHostAlloc`, flags 0: cached, readable by
/// the CPU at full speed, unlike write-combined memory) and zeroed. The
/// host reaches the elements only through [`as_slice`](Self::as_slice) and
/// [`as_mut_slice`](Self::as_mut_slice), which first wait for the last copy
/// that used the buffer; dropping the buffer waits too, so the memory is
/// never freed under a copy.
pub struct PinnedHostBuffer<T: Element> {
    ptr: NonNull<T>,
    len: usize,
    cap: usize,
    guard: UseGuard,
    /// The driver allocation; dropped (freed) after `Drop::drop` waited
    /// for the last use.
    memory: PinnedHostSlice<u8>,
    _marker: PhantomData<T>,
}

// SAFETY: the buffer owns its pinned memory exclusively (like a Vec<T>);
// T: Send + Sync by Element, and the cudarc parts (PinnedHostSlice,
// CudaEvent, Arc<CudaStream>) are Send + Sync.
unsafe impl<T: Element> Send for PinnedHostBuffer<T> {}
// SAFETY: `&self` gives no access to the elements (as_slice takes &mut
// self), only lengths and completion queries, which are thread-safe.
unsafe impl<T: Element> Sync for PinnedHostBuffer<T> {}

impl<T: Element> PinnedHostBuffer<T> {
    /// `len` zeros in page-locked memory of `device`'s context.
    ///
    /// Errors: [`Error::PinMemory`] when the driver refuses (not enough
    /// host memory, or the cgroup's memory limit), [`Error::OutOfHostMemory`]
    /// for a size that overflows.
    pub fn zeros(device: &CudaDevice, len: usize) -> Result<Self> {
        let (memory, ptr) = pinned_zeros::<T>(device.context(), len)?;
        Ok(Self {
            ptr,
            len,
            cap: len,
            guard: UseGuard::new(device.context(), true)?,
            memory,
            _marker: PhantomData,
        })
    }

    /// A pinned copy of `data`.
    pub fn from_slice(device: &CudaDevice, data: &[T]) -> Result<Self> {
        let mut buf = Self::zeros(device, data.len())?;
        buf.as_mut_slice()?.copy_from_slice(data);
        Ok(buf)
    }

    /// The elements, after the last copy that used the buffer has
    /// completed.
    pub fn as_slice(&mut self) -> Result<&[T]> {
        self.guard.host_wait()?;
        // SAFETY: ptr is valid for cap >= len initialized (zeroed at
        // creation) elements owned by self; no copy is in flight (waited
        // above), and none can start while the borrow of self lives.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// The elements for writing, after the last copy that used the buffer
    /// has completed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.guard.host_wait()?;
        // SAFETY: as in as_slice, and &mut self makes the access exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    /// Whether the last copy that used the buffer has completed, without
    /// blocking.
    pub fn is_ready(&self) -> Result<bool> {
        self.guard.is_complete()
    }

    /// The length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements the memory holds (the length it was created with).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Changes the length to `len <= capacity()`, keeping the memory and
    /// its contents, so one buffer serves copies of different sizes.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.cap {
            return Err(Error::InvalidSize {
                op: "PinnedHostBuffer::set_len",
                msg: format!("length {len} exceeds the capacity {}", self.cap),
            });
        }
        self.len = len;
        Ok(())
    }

    /// The size of the current length in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        T::DTYPE
    }

    /// Accounts the buffer's pinned bytes under (`Host`, `category`) in
    /// `tracker` for as long as the returned [`Allocation`] lives.
    pub fn account(&self, tracker: &MemoryTracker, category: Category) -> Allocation {
        tracker.allocate(Tier::Host, category, self.memory.num_bytes() as u64)
    }
}

impl<T: Element> Drop for PinnedHostBuffer<T> {
    fn drop(&mut self) {
        // Wait for the last copy before `memory` is freed (after this body).
        self.guard.host_wait_in_drop();
    }
}

impl<T: Element> fmt::Debug for PinnedHostBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedHostBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static_assertions::assert_impl_all!(Streams: Send, Sync);
    static_assertions::assert_impl_all!(Fence: Send, Sync);
    static_assertions::assert_impl_all!(PinnedHostBuffer<f32>: Send, Sync);
    static_assertions::assert_impl_all!(Transfer<'static>: Send, Sync);

    #[test]
    fn driver_errors_keep_the_operation_and_source() {
        // Only the structure: formatting a DriverError asks the driver for
        // its message, which needs libcuda.
        let e = cuda_error("cuMemcpyHtoDAsync")(DriverError(
            sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
        ));
        let Error::Cuda(inner) = e else {
            panic!("not Error::Cuda")
        };
        let call = inner.downcast_ref::<DriverCall>().expect("a DriverCall");
        assert_eq!(call.op, "cuMemcpyHtoDAsync");
        assert_eq!(call.source.0, sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE);
        assert!(std::error::Error::source(inner.as_ref()).is_some());
    }
}
