//! [`HostAccess`] for the CUDA backend: host views are copies.
//!
//! A host view of device elements is a synchronous copy into pageable host
//! memory (`cuMemcpyDtoH`), and a mutable view goes back with
//! `cuMemcpyHtoD` on [`commit`](HostAccess::commit). Like every host
//! access these are valid only after the caller synced the work that
//! touches the elements (the trait's contract): the copies themselves
//! order nothing. They serve what is off the hot path of a step on the
//! GPU: filling parameters at build, checkpoints, export and
//! `unit_state`. A buffer lent to the trainer is the device buffer itself:
//! the trainer's kernels write it on the compute stream, and the event of
//! [`give_back`](HostAccess::give_back) is recorded there.

use std::ops::{Deref, DerefMut, Range};

use cudarc::driver::result;

use super::super::checks::{bounds, range_len};
use super::super::{AccessKind, Backend, BufferHandle, BufferId, HostAccess, Stream};
use super::{CudaBackend, CudaBackendEvent, CudaBuffer};
use crate::cuda::stream::cuda_error;
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

impl CudaBackend {
    /// Elements `range` of `buf`, copied to the host (synchronously).
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
        if len > 0 {
            // SAFETY: `range` is in bounds (checked above) of a live
            // allocation of this context; `data` holds `len` elements; the
            // caller synced every access to the range (the trait's
            // contract).
            unsafe { result::memcpy_dtoh_sync(&mut data, buf.addr(range.start)) }
                .map_err(cuda_error("cuMemcpyDtoH"))?;
        }
        Ok(data)
    }

    /// `data` into `buf[at..]` (synchronously).
    fn upload<T: Element>(&self, buf: &mut CudaBuffer<T>, at: usize, data: &[T]) -> Result<()> {
        bounds("commit", &buf.label, buf.id, buf.len, at, data.len())?;
        self.inner.begin()?;
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: the range is in bounds (checked above) of a live
        // allocation of this context, borrowed exclusively; the caller
        // synced every access to it (the trait's contract).
        unsafe { result::memcpy_htod_sync(buf.addr(at), data) }.map_err(cuda_error("cuMemcpyHtoD"))
    }
}

impl CudaBackend {
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
