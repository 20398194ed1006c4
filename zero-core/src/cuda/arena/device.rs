//! The arena on a GPU: one allocation, carved into typed buffers.

use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};

use super::{arena_error, out_of_device_memory, ArenaPlan, DEVICE_ALIGN};
use crate::cuda::stream::{cuda_error, Streams, UseGuard};
use crate::memory::{Allocation, Category, MemoryTracker, Tier};
use crate::{DType, Element, Result};

/// One slot's state: who holds it, and the reuse guard of its memory while
/// nobody does.
struct SlotState {
    /// Index (in the plan's buffers) of the buffer that is taken, if any.
    holder: Option<usize>,
    /// `Some` exactly while `holder` is `None`: a taken buffer carries it.
    guard: Option<UseGuard>,
}

/// What the arena and its buffers share; freed when the last of them goes.
struct Shared {
    plan: ArenaPlan,
    base: sys::CUdeviceptr,
    /// The stream the memory was allocated on and is freed on.
    stream: Arc<CudaStream>,
    tracker: MemoryTracker,
    slots: Mutex<Vec<SlotState>>,
    /// The one allocation. Declared last: it is freed after `Drop::drop`
    /// has ordered the free after every buffer's last use.
    memory: CudaSlice<u8>,
}

impl Shared {
    fn slots(&self) -> MutexGuard<'_, Vec<SlotState>> {
        // The slot table is updated in single assignments: usable after a
        // panic elsewhere poisoned the mutex.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Every buffer is gone (each holds an Arc), so every guard is back.
        // The free below is ordered on `stream`; make it wait for the last
        // use of every slot on the other streams. Failures are stored in the
        // context (cudarc's record_err).
        let slots = self.slots.get_mut().unwrap_or_else(PoisonError::into_inner);
        for guard in slots.iter().filter_map(|s| s.guard.as_ref()) {
            guard.order_before_in_drop(&self.stream);
        }
    }
}

/// The device memory of one rank: one allocation of an [`ArenaPlan`]'s
/// total, made at start-up, from which the planned buffers are taken.
///
/// [`take`](Self::take) hands out the buffer of a name as a typed
/// [`DeviceBuffer`]; dropping the buffer gives its slot back. Buffers that
/// share a slot cannot be taken at the same time (the second `take` is an
/// error that names the holder), so no two live buffers alias. Nothing is
/// allocated after [`new`](Self::new): taking and returning buffers only
/// updates a table.
///
/// Cheap to clone; the memory is freed when the arena and all its buffers
/// are gone, in stream order after their last uses.
#[derive(Clone)]
pub struct DeviceArena {
    shared: Arc<Shared>,
}

impl fmt::Debug for DeviceArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceArena")
            .field("rank", &self.shared.plan.rank())
            .field("bytes", &self.size_in_bytes())
            .field("buffers", &self.shared.plan.buffers().len())
            .finish()
    }
}

impl DeviceArena {
    /// Allocates `plan`'s total on the compute stream of `streams`, zeroed.
    /// Taken buffers are accounted in `tracker` (tier `Device`).
    ///
    /// First checks the plan against the device's free memory
    /// (`cuMemGetInfo`), so a plan that does not fit fails with an error
    /// naming the rank, the largest buffers and the bytes missing rather
    /// than a bare out-of-memory; the allocation's own failure is reported
    /// the same way. A plan of 0 bytes allocates [`DEVICE_ALIGN`] bytes.
    pub fn new(streams: &Streams, plan: ArenaPlan, tracker: &MemoryTracker) -> Result<Self> {
        streams.check_err()?;
        let stream = streams.compute().clone();
        let ctx = stream.context().clone();
        let rank = plan.rank();
        let (free, _) = ctx.mem_get_info().map_err(cuda_error("cuMemGetInfo"))?;
        plan.check_capacity(free as u64)?;
        let bytes = plan.total_bytes().max(DEVICE_ALIGN);
        let len = usize::try_from(bytes)
            .map_err(|_| arena_error(rank, format!("{bytes} bytes do not fit in usize")))?;
        let memory = stream.alloc_zeros::<u8>(len).map_err(|e| {
            if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                out_of_device_memory(
                    rank,
                    bytes,
                    free as u64,
                    format!(
                        "the device arena of rank {rank}: cuMemAlloc of {} failed although \
                         cuMemGetInfo reported {} free (another process allocated meanwhile, \
                         or the free memory is fragmented). Largest: {}",
                        super::human(bytes),
                        super::human(free as u64),
                        plan.largest_slots()
                    ),
                )
            } else {
                cuda_error("cuMemAlloc (device arena)")(e)
            }
        })?;
        let base = {
            let (ptr, _record) = memory.device_ptr(&stream);
            ptr
        };
        // Every slot starts "used by the zeroing on `stream`": its first
        // use on another stream waits for the memset.
        let mut slots = Vec::with_capacity(plan.slots().len());
        for _ in plan.slots() {
            let mut guard = UseGuard::new(&ctx, false)?;
            guard.after(&stream)?;
            slots.push(SlotState {
                holder: None,
                guard: Some(guard),
            });
        }
        Ok(Self {
            shared: Arc::new(Shared {
                plan,
                base,
                stream,
                tracker: tracker.clone(),
                slots: Mutex::new(slots),
                memory,
            }),
        })
    }

    /// The plan the arena was carved by.
    pub fn plan(&self) -> &ArenaPlan {
        &self.shared.plan
    }

    /// The rank the arena belongs to.
    pub fn rank(&self) -> usize {
        self.shared.plan.rank()
    }

    /// Bytes of the device allocation.
    pub fn size_in_bytes(&self) -> u64 {
        self.shared.memory.num_bytes() as u64
    }

    /// Whether the buffer called `name` is taken now (`None`: no such
    /// buffer).
    pub fn is_taken(&self, name: &str) -> Option<bool> {
        let i = self.shared.plan.position(name)?;
        let slot = self.shared.plan.buffers()[i].slot;
        Some(self.shared.slots()[slot].holder == Some(i))
    }

    /// Takes the buffer called `name` as elements of `T`, until the
    /// returned [`DeviceBuffer`] is dropped. Its bytes (its slot's extent)
    /// are accounted under (`Device`, its category) meanwhile.
    ///
    /// Errors: no such buffer; its size is not a whole number of `T` or its
    /// offset not aligned for `T`; it, or another buffer of its slot, is
    /// taken already; an error stored by an earlier `Drop`.
    pub fn take<T: Element>(&self, name: &str) -> Result<DeviceBuffer<T>> {
        let shared = &self.shared;
        shared.stream.context().check_err().map_err(cuda_error(
            "an earlier asynchronous operation (reported late)",
        ))?;
        let rank = shared.plan.rank();
        let i = shared
            .plan
            .position(name)
            .ok_or_else(|| arena_error(rank, format!("no buffer `{name}` in the plan")))?;
        let planned = &shared.plan.buffers()[i];
        let size = std::mem::size_of::<T>() as u64;
        if !planned.bytes.is_multiple_of(size) {
            return Err(arena_error(
                rank,
                format!(
                    "buffer `{name}` has {} bytes, not a whole number of {:?} elements \
                     ({size} bytes each)",
                    planned.bytes,
                    T::DTYPE
                ),
            ));
        }
        let ptr = shared.base + planned.offset;
        if !ptr.is_multiple_of(std::mem::align_of::<T>() as u64) {
            return Err(arena_error(
                rank,
                format!(
                    "buffer `{name}` lies at offset {} (alignment {}), not aligned for {:?}",
                    planned.offset,
                    planned.align,
                    T::DTYPE
                ),
            ));
        }
        let guard = {
            let mut slots = shared.slots();
            let slot = &mut slots[planned.slot];
            if let Some(h) = slot.holder {
                let holder = &shared.plan.buffers()[h].name;
                let msg = if h == i {
                    format!("buffer `{name}` is taken already; drop it first")
                } else {
                    let slot_name = shared.plan.slots()[planned.slot]
                        .shared
                        .as_deref()
                        .unwrap_or_default();
                    format!(
                        "buffer `{name}` shares slot `{slot_name}` with `{holder}`, which is \
                         taken; drop `{holder}` first"
                    )
                };
                return Err(arena_error(rank, msg));
            }
            let guard = slot.guard.take().ok_or_else(|| {
                arena_error(
                    rank,
                    format!("slot of buffer `{name}` lost its guard after a panic"),
                )
            })?;
            slot.holder = Some(i);
            guard
        };
        let extent = shared.plan.slots()[planned.slot].extent;
        let len = (planned.bytes / size) as usize;
        Ok(DeviceBuffer {
            shared: shared.clone(),
            index: i,
            ptr,
            len,
            cap: len,
            guard: ManuallyDrop::new(guard),
            _account: shared
                .tracker
                .allocate(Tier::Device, planned.category, extent),
            _marker: PhantomData,
        })
    }
}

/// A typed buffer carved from a [`DeviceArena`]: `len` elements of `T` at
/// its planned offset. Dropping it gives its slot back to the arena.
///
/// It carries the event of its last use (see [`stream`](crate::cuda::stream)):
/// the copies of [`Streams`] and [`use_on`](Self::use_on) make each new use
/// wait for the previous one when that ran on another stream. The device
/// pointer is only reachable through a [`DeviceUse`], so work cannot bypass
/// the guard by accident.
pub struct DeviceBuffer<T: Element> {
    shared: Arc<Shared>,
    /// Index in the plan's buffers.
    index: usize,
    ptr: sys::CUdeviceptr,
    len: usize,
    cap: usize,
    /// Taken from the slot; given back by `Drop` (the only place it is
    /// taken out of the `ManuallyDrop`).
    guard: ManuallyDrop<UseGuard>,
    _account: Allocation,
    _marker: PhantomData<T>,
}

impl<T: Element> DeviceBuffer<T> {
    /// The buffer's name in the plan.
    pub fn name(&self) -> &str {
        &self.shared.plan.buffers()[self.index].name
    }

    /// What the bytes are for.
    pub fn category(&self) -> Category {
        self.shared.plan.buffers()[self.index].category
    }

    /// Offset of the buffer from the start of its arena, in bytes.
    pub fn offset(&self) -> u64 {
        self.shared.plan.buffers()[self.index].offset
    }

    /// The length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The planned length in elements.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Changes the length to `len <= capacity()`, keeping the memory, so
    /// one buffer serves transfers of different sizes (a last, short tile).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.cap {
            return Err(arena_error(
                self.shared.plan.rank(),
                format!(
                    "buffer `{}`: length {len} exceeds the capacity {}",
                    self.name(),
                    self.cap
                ),
            ));
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

    /// Starts a use of the buffer by work enqueued on `stream` (a kernel,
    /// a collective): `stream` first waits for the last use if that was on
    /// another stream. Enqueue the work with [`DeviceUse::device_ptr`], then
    /// [`finish`](DeviceUse::finish) (or drop) the use to record it.
    pub fn use_on<'a>(&'a mut self, stream: &'a Arc<CudaStream>) -> Result<DeviceUse<'a, T>> {
        stream.context().check_err().map_err(cuda_error(
            "an earlier asynchronous operation (reported late)",
        ))?;
        self.guard.before(stream)?;
        Ok(DeviceUse {
            buffer: self,
            stream,
            recorded: false,
        })
    }

    /// Blocks the host until the last use of the buffer has completed.
    pub fn wait_idle(&mut self) -> Result<()> {
        self.guard.host_wait()
    }

    /// Whether the last use has completed, without blocking.
    pub fn is_idle(&self) -> Result<bool> {
        self.guard.is_complete()
    }

    /// The device address of the first element (for the copies of
    /// [`Streams`], which guard the use themselves).
    pub(crate) fn device_ptr_raw(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The reuse guard.
    pub(crate) fn guard(&self) -> &UseGuard {
        &self.guard
    }

    /// The reuse guard, to record a use.
    pub(crate) fn guard_mut(&mut self) -> &mut UseGuard {
        &mut self.guard
    }
}

impl<T: Element> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: drop runs once and `guard` is not used after this line.
        let guard = unsafe { ManuallyDrop::take(&mut self.guard) };
        let slot = self.shared.plan.buffers()[self.index].slot;
        let mut slots = self.shared.slots();
        if let Some(state) = slots.get_mut(slot) {
            state.holder = None;
            state.guard = Some(guard);
        }
        // `_account` drops after this body: the tracker forgets the bytes.
    }
}

impl<T: Element> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("name", &self.name())
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("offset", &self.offset())
            .field("guard", &*self.guard)
            .finish()
    }
}

/// A use of a [`DeviceBuffer`] by work on one stream
/// ([`DeviceBuffer::use_on`]). The stream already waits for the buffer's
/// previous use; the use is recorded (the buffer's event re-recorded on the
/// stream) by [`finish`](Self::finish) or, storing any error in the
/// context, on drop.
#[must_use = "enqueue work with device_ptr(), then finish() the use"]
pub struct DeviceUse<'a, T: Element> {
    buffer: &'a mut DeviceBuffer<T>,
    stream: &'a Arc<CudaStream>,
    recorded: bool,
}

impl<T: Element> DeviceUse<'_, T> {
    /// The device address of the first element, valid for
    /// [`len`](Self::len) elements of `T` in work enqueued on
    /// [`stream`](Self::stream) before the use is finished.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.buffer.ptr
    }

    /// The length in elements.
    pub fn len(&self) -> usize {
        self.buffer.len
    }

    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.buffer.len == 0
    }

    /// The stream the work runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }

    /// Records the use after the work enqueued so far on the stream.
    pub fn finish(mut self) -> Result<()> {
        self.recorded = true;
        self.buffer.guard.after(self.stream)
    }
}

impl<T: Element> Drop for DeviceUse<'_, T> {
    fn drop(&mut self) {
        if !self.recorded {
            self.buffer.guard.after_in_drop(self.stream);
        }
    }
}

impl<T: Element> fmt::Debug for DeviceUse<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceUse")
            .field("buffer", &self.buffer.name())
            .field("len", &self.buffer.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static_assertions::assert_impl_all!(DeviceArena: Send, Sync, Clone);
    static_assertions::assert_impl_all!(DeviceBuffer<f32>: Send, Sync);
    static_assertions::assert_impl_all!(DeviceBuffer<half::bf16>: Send, Sync);
    static_assertions::assert_not_impl_any!(DeviceBuffer<f32>: Clone);
}
