//! [`HostAccess`] for the CUDA backend: host views are copies.
//!
//! A host view of device elements is a copy into host memory, and a
//! mutable view goes back on [`commit`](HostAccess::commit); both return
//! when the copy is done. Up to [`STAGED_MIN`] bytes that is one
//! synchronous `cuMemcpyDtoH` / `cuMemcpyHtoD`; a larger view goes through
//! two pinned staging buffers of [`STAGE_BYTES`] that the backend makes at
//! its first large view: while the DMA engine copies one piece between the
//! device and one buffer on the internal stream (at pinned-memory speed),
//! the host copies the piece before it between the other buffer and the
//! view. Like every host
//! access these are valid only after the caller synced the work that
//! touches the elements (the trait's contract): the copies themselves
//! order nothing. They serve what is off the hot path of a step on the
//! GPU: filling parameters at build, checkpoints, export and
//! `unit_state`. A buffer lent to the trainer is the device buffer itself:
//! the trainer's kernels write it on the compute stream, and the event of
//! [`give_back`](HostAccess::give_back) is recorded there.

use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::sync::{Arc, MutexGuard, PoisonError};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, PinnedHostSlice};

use super::super::checks::{bounds, range_len};
use super::super::{AccessKind, Backend, BufferHandle, BufferId, HostAccess, Stream};
use super::{CudaBackend, CudaBackendEvent, CudaBuffer};
use crate::cuda::stream::{cuda_error, pinned_zeros};
use crate::{Element, Error, HostBuffer, Result};

/// A mutable host view of a [`CudaBuffer`]'s elements: a copy, written
/// back by [`HostAccess::commit`].
pub struct CudaHostMut<'a, T: Element> {
    buf: &'a mut CudaBuffer<T>,
    at: usize,
    data: Vec<T>,
}

impl<T: Element> Deref for CudaHostMut<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T: Element> DerefMut for CudaHostMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}

/// The record of a [`CudaBuffer`] lent to the trainer: its id, checked
/// when it comes back.
#[derive(Debug)]
pub struct CudaLoan {
    id: BufferId,
}

/// Host views of more bytes than this go through the staging buffers.
pub(crate) const STAGED_MIN: usize = 1 << 20;

/// The length of each of the two staging buffers.
pub(crate) const STAGE_BYTES: usize = 8 << 20;

/// The two pinned buffers host views are copied through, each with the
/// event of the last copy into or out of it on the internal stream.
pub(crate) struct HostStaging {
    /// The driver allocations, freed when the backend is dropped (after
    /// its streams are synchronised; every copy is waited for before the
    /// view that made it returns anyway).
    _memory: [PinnedHostSlice<u8>; 2],
    bufs: [NonNull<u8>; 2],
    done: [CudaEvent; 2],
}

// SAFETY: the staging owns its pinned memory; it is reached only under
// the backend's mutex, one view at a time.
unsafe impl Send for HostStaging {}

impl HostStaging {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        // Pinned f32 memory (an Element), used as bytes.
        let words = STAGE_BYTES / size_of::<f32>();
        let (m0, p0) = pinned_zeros::<f32>(ctx, words)?;
        let (m1, p1) = pinned_zeros::<f32>(ctx, words)?;
        let event = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(cuda_error("cuEventCreate (host staging)"))
        };
        Ok(HostStaging {
            _memory: [m0, m1],
            bufs: [p0.cast::<u8>(), p1.cast::<u8>()],
            done: [event()?, event()?],
        })
    }

    /// Staging buffer `k`'s first `len` bytes.
    fn buf(&mut self, k: usize, len: usize) -> &mut [u8] {
        debug_assert!(len <= STAGE_BYTES);
        // SAFETY: the buffer holds STAGE_BYTES bytes, owned by `self`,
        // borrowed exclusively here; no copy is in flight on it (the
        // callers wait for its event before they touch it).
        unsafe { std::slice::from_raw_parts_mut(self.bufs[k].as_ptr(), len) }
    }
}

/// Piece `k` of `len` bytes cut in [`STAGE_BYTES`].
fn piece(k: usize, len: usize) -> Range<usize> {
    k * STAGE_BYTES..((k + 1) * STAGE_BYTES).min(len)
}

impl CudaBackend {
    /// The staging buffers, made at the first call.
    fn staging(&self) -> Result<MutexGuard<'_, Option<HostStaging>>> {
        let mut g = self
            .inner
            .staging
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if g.is_none() {
            *g = Some(HostStaging::new(self.inner.ctx())?);
        }
        Ok(g)
    }

    /// Copies device bytes at `src` into `dst` through the staging
    /// buffers: piece k+1 goes down into one buffer while the host copies
    /// piece k out of the other.
    fn download_staged(&self, src: sys::CUdeviceptr, dst: &mut [u8]) -> Result<()> {
        let mut guard = self.staging()?;
        let st = guard.as_mut().ok_or_else(|| Error::Backend {
            op: "host_ref",
            msg: "the host staging buffers are missing".into(),
        })?;
        let service = &self.inner.service;
        let len = dst.len();
        let pieces = len.div_ceil(STAGE_BYTES);
        let enqueue = |st: &mut HostStaging, k: usize| -> Result<()> {
            let r = piece(k, len);
            // SAFETY: `src + r` lies in the caller's checked range of a
            // live allocation; the staging buffer is not in use (its last
            // copy was waited for: piece k-2, before piece k-1 was
            // enqueued) and outlives the copy, which is waited for below.
            unsafe {
                result::memcpy_dtoh_async(
                    st.buf(k % 2, r.len()),
                    src + r.start as u64,
                    service.cu_stream(),
                )
            }
            .map_err(cuda_error("cuMemcpyDtoHAsync (host staging)"))?;
            st.done[k % 2]
                .record(service)
                .map_err(cuda_error("cuEventRecord (host staging)"))
        };
        enqueue(st, 0)?;
        for k in 0..pieces {
            if k + 1 < pieces {
                enqueue(st, k + 1)?;
            }
            st.done[k % 2]
                .synchronize()
                .map_err(cuda_error("cuEventSynchronize (host staging)"))?;
            let r = piece(k, len);
            dst[r.clone()].copy_from_slice(st.buf(k % 2, r.len()));
        }
        Ok(())
    }

    /// Copies `src` into device bytes at `dst` through the staging
    /// buffers: the host fills one buffer while the other goes up; returns
    /// when every piece is on the device.
    fn upload_staged(&self, src: &[u8], dst: sys::CUdeviceptr) -> Result<()> {
        let mut guard = self.staging()?;
        let st = guard.as_mut().ok_or_else(|| Error::Backend {
            op: "commit",
            msg: "the host staging buffers are missing".into(),
        })?;
        // A view that failed half-way may have left a copy in flight.
        for done in &st.done {
            done.synchronize()
                .map_err(cuda_error("cuEventSynchronize (host staging)"))?;
        }
        let service = &self.inner.service;
        let len = src.len();
        for k in 0..len.div_ceil(STAGE_BYTES) {
            let r = piece(k, len);
            if k >= 2 {
                // Piece k-2 has left this buffer.
                st.done[k % 2]
                    .synchronize()
                    .map_err(cuda_error("cuEventSynchronize (host staging)"))?;
            }
            st.buf(k % 2, r.len()).copy_from_slice(&src[r.clone()]);
            let staged = st.buf(k % 2, r.len());
            // SAFETY: `dst + r` lies in the caller's checked range of a
            // live allocation, borrowed exclusively; the staging buffer
            // stays untouched until the copy's event is waited for (here
            // two pieces on, or by the synchronisation below).
            unsafe { result::memcpy_htod_async(dst + r.start as u64, staged, service.cu_stream()) }
                .map_err(cuda_error("cuMemcpyHtoDAsync (host staging)"))?;
            st.done[k % 2]
                .record(service)
                .map_err(cuda_error("cuEventRecord (host staging)"))?;
        }
        service
            .synchronize()
            .map_err(cuda_error("cuStreamSynchronize (host staging)"))
    }

    /// Elements `range` of `buf`, copied to the host; returns when the
    /// copy is done.
    fn download<T: Element>(
        &self,
        op: &'static str,
        buf: &CudaBuffer<T>,
        range: Range<usize>,
    ) -> Result<Vec<T>> {
        self.own(buf, op)?;
        let len = range_len(op, &range)?;
        bounds(op, &buf.label, buf.id, buf.len, range.start, len)?;
        self.inner.begin()?;
        let mut data = vec![T::from_f32(0.0); len];
        if len * size_of::<T>() > STAGED_MIN {
            self.download_staged(buf.addr(range.start), bytemuck::cast_slice_mut(&mut data))?;
        } else if len > 0 {
            // SAFETY: `range` is in bounds (checked above) of a live
            // allocation of this context; `data` holds `len` elements; the
            // caller synced every access to the range (the trait's
            // contract).
            unsafe { result::memcpy_dtoh_sync(&mut data, buf.addr(range.start)) }
                .map_err(cuda_error("cuMemcpyDtoH"))?;
        }
        Ok(data)
    }

    /// `data` into `buf[at..]`; returns when the copy is done.
    fn upload<T: Element>(&self, buf: &mut CudaBuffer<T>, at: usize, data: &[T]) -> Result<()> {
        bounds("commit", &buf.label, buf.id, buf.len, at, data.len())?;
        self.inner.begin()?;
        if data.is_empty() {
            return Ok(());
        }
        if std::mem::size_of_val(data) > STAGED_MIN {
            return self.upload_staged(bytemuck::cast_slice(data), buf.addr(at));
        }
        // SAFETY: the range is in bounds (checked above) of a live
        // allocation of this context, borrowed exclusively; the caller
        // synced every access to it (the trait's contract).
        unsafe { result::memcpy_htod_sync(buf.addr(at), data) }.map_err(cuda_error("cuMemcpyHtoD"))
    }
}

impl CudaBackend {
    /// The GPU's UUID (`cuDeviceGetUuid`): the same for every backend on
    /// that GPU, in every process, and different for any other GPU.
    pub fn device_uuid(&self) -> Result<[u8; 16]> {
        self.inner.begin()?;
        let uuid = self
            .inner
            .ctx()
            .uuid()
            .map_err(cuda_error("cuDeviceGetUuid"))?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// The device's free and total memory in bytes (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        self.inner.begin()?;
        let (free, total) = result::mem_get_info().map_err(cuda_error("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    }
}

impl HostAccess for CudaBackend {
    type HostRef<'a, T: Element> = Vec<T>;
    type HostMut<'a, T: Element> = CudaHostMut<'a, T>;
    type Lent<T: Element> = CudaBuffer<T>;
    type Loan<T: Element> = CudaLoan;

    fn host_ref<'a, T: Element>(
        &'a self,
        buf: &'a CudaBuffer<T>,
        range: Range<usize>,
    ) -> Result<Vec<T>> {
        self.download("host_ref", buf, range)
    }

    fn host_mut<'a, T: Element>(
        &'a self,
        buf: &'a mut CudaBuffer<T>,
        range: Range<usize>,
    ) -> Result<CudaHostMut<'a, T>> {
        let at = range.start;
        let data = self.download("host_mut", buf, range)?;
        Ok(CudaHostMut { buf, at, data })
    }

    fn commit<T: Element>(&self, view: CudaHostMut<'_, T>) -> Result<()> {
        self.own(view.buf, "commit")?;
        self.upload(view.buf, view.at, &view.data)
    }

    fn adopt<T: Element>(&self, mem: HostBuffer<T>, label: &str) -> Result<CudaBuffer<T>> {
        let mut buf = self.alloc::<T>(mem.len(), label)?;
        self.upload(&mut buf, 0, &mem)?;
        Ok(buf)
    }

    fn prefault<T: Element>(&self, buf: &mut CudaBuffer<T>) -> Result<()> {
        // Device memory is resident once allocated.
        self.own(buf, "prefault")
    }

    fn lend<T: Element>(
        &self,
        _stream: Stream,
        op: &'static str,
        buf: CudaBuffer<T>,
        accesses: &[(Range<usize>, AccessKind)],
    ) -> Result<(CudaLoan, CudaBuffer<T>)> {
        self.own(&buf, op)?;
        for (r, _) in accesses {
            bounds(op, &buf.label, buf.id, buf.len, r.start, range_len(op, r)?)?;
        }
        Ok((CudaLoan { id: buf.id() }, buf))
    }

    fn lent_mut<T: Element, R>(
        &self,
        lent: &mut CudaBuffer<T>,
        f: impl FnOnce(&mut [T]) -> R,
    ) -> Result<R> {
        // It was lent as an operation of the compute stream (after its
        // zeroing there): the host copy comes after that.
        self.sync(&self.record(Stream::Compute)?)?;
        let n = lent.len();
        let mut view = self.host_mut(lent, 0..n)?;
        let r = f(&mut view);
        self.commit(view)?;
        Ok(r)
    }

    fn give_back<T: Element>(
        &self,
        loan: CudaLoan,
        lent: CudaBuffer<T>,
    ) -> Result<(CudaBuffer<T>, CudaBackendEvent)> {
        self.own(&lent, "give_back")?;
        if lent.id() != loan.id {
            return Err(Error::Backend {
                op: "give_back",
                msg: format!(
                    "buffer {:?} ({}) came back for the loan of buffer {}",
                    lent.label(),
                    lent.id(),
                    loan.id
                ),
            });
        }
        // The trainer's kernels wrote it on the compute stream.
        let event = self.record(Stream::Compute)?;
        Ok((lent, event))
    }
}
