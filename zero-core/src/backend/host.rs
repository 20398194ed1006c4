//! The host's access to a backend's buffers: what a training engine needs
//! beyond the stream primitives of [`Backend`].
//!
//! The engine reads and writes device buffers from the host in a few
//! places that are not on the hot path of a step on the device: filling
//! parameters at build, reading them for a checkpoint, an export or the
//! engine's `unit_state`, the offloaded optimizer on the CPU backend (the
//! CPU AdamW reads the gradient shard and writes the parameters in
//! place), and lending a gradient buffer to the trainer. [`HostAccess`] names those operations so that
//! the engine is written once for every backend:
//!
//! - [`host_ref`](HostAccess::host_ref) / [`host_mut`](HostAccess::host_mut)
//!   are views of device elements. On the CPU backend they are the
//!   memory itself (a checked host access, no copy); a device backend
//!   copies the elements into host memory and, for a mutable view, back
//!   on [`commit`](HostAccess::commit). A mutable view must be committed:
//!   one dropped without it changes nothing on a device backend (and the
//!   memory in place on the CPU backend), which is what an error path
//!   that gives up on the write wants.
//! - [`lend`](HostAccess::lend) / [`give_back`](HostAccess::give_back)
//!   hand a buffer to the trainer as one operation on a stream and take it
//!   back under the same id: host memory on the CPU backend (the trainer
//!   writes a slice), the device buffer itself on a GPU (the trainer's
//!   kernels write it on the compute stream).

use std::ops::{Deref, DerefMut, Range};

use super::{AccessKind, Backend, CpuBackend, CpuBuffer, CpuEvent, Loan, Stream};
use crate::{Element, HostBuffer, Result};

/// The host's access to a backend's buffers (see the module docs).
pub trait HostAccess: Backend + Clone {
    /// A host view of device elements to read.
    type HostRef<'a, T: Element>: Deref<Target = [T]>
    where
        Self: 'a;
    /// A host view of device elements to write; see
    /// [`commit`](HostAccess::commit).
    type HostMut<'a, T: Element>: DerefMut<Target = [T]>
    where
        Self: 'a;
    /// What the trainer holds while a buffer is lent to it.
    type Lent<T: Element>: Send + 'static;
    /// The backend's record of a lent buffer, to take it back.
    type Loan<T: Element>: Send + 'static;

    /// Elements `range` of `buf` for the host to read: valid after every
    /// conflicting access enqueued earlier was synced.
    fn host_ref<'a, T: Element>(
        &'a self,
        buf: &'a Self::Buffer<T>,
        range: Range<usize>,
    ) -> Result<Self::HostRef<'a, T>>;

    /// Elements `range` of `buf` for the host to write (and read): valid
    /// after every access enqueued earlier was synced; the writes reach
    /// the buffer by [`commit`](HostAccess::commit).
    fn host_mut<'a, T: Element>(
        &'a self,
        buf: &'a mut Self::Buffer<T>,
        range: Range<usize>,
    ) -> Result<Self::HostMut<'a, T>>;

    /// Writes a mutable view back to its buffer (nothing to do where the
    /// view is the buffer's memory).
    fn commit<T: Element>(&self, view: Self::HostMut<'_, T>) -> Result<()>;

    /// A buffer holding the contents of host memory `mem` (the memory
    /// itself on the CPU backend; a device backend copies it and frees
    /// it).
    fn adopt<T: Element>(&self, mem: HostBuffer<T>, label: &str) -> Result<Self::Buffer<T>>;

    /// Makes every page of `buf` resident where that is the host's work
    /// (a host write of all of it on the CPU backend; device memory is
    /// resident when allocated).
    fn prefault<T: Element>(&self, buf: &mut Self::Buffer<T>) -> Result<()>;

    /// Lends `buf` to the trainer as operation `op` on `stream`, which
    /// makes `accesses` (element ranges of `buf`): what the trainer holds,
    /// and the loan to take it back with.
    fn lend<T: Element>(
        &self,
        stream: Stream,
        op: &'static str,
        buf: Self::Buffer<T>,
        accesses: &[(Range<usize>, AccessKind)],
    ) -> Result<(Self::Loan<T>, Self::Lent<T>)>;

    /// Runs `f` on the elements of a lent buffer for the host to write
    /// (a trainer that computes its gradient on the host): the memory
    /// itself on the CPU backend; on a device backend a copy written back
    /// afterwards, taken once the compute stream (on which the buffer was
    /// lent) is synced.
    fn lent_mut<T: Element, R>(
        &self,
        lent: &mut Self::Lent<T>,
        f: impl FnOnce(&mut [T]) -> R,
    ) -> Result<R>;

    /// Takes a lent buffer back: the buffer, same id and label, and the
    /// event after which its contents are what the trainer left.
    fn give_back<T: Element>(
        &self,
        loan: Self::Loan<T>,
        lent: Self::Lent<T>,
    ) -> Result<(Self::Buffer<T>, Self::Event)>;
}

impl HostAccess for CpuBackend {
    type HostRef<'a, T: Element> = &'a [T];
    type HostMut<'a, T: Element> = &'a mut [T];
    type Lent<T: Element> = HostBuffer<T>;
    type Loan<T: Element> = Loan<T>;

    fn host_ref<'a, T: Element>(
        &'a self,
        buf: &'a CpuBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a [T]> {
        self.host_slice(buf, range)
    }

    fn host_mut<'a, T: Element>(
        &'a self,
        buf: &'a mut CpuBuffer<T>,
        range: Range<usize>,
    ) -> Result<&'a mut [T]> {
        self.host_slice_mut(buf, range)
    }

    fn commit<T: Element>(&self, _view: &mut [T]) -> Result<()> {
        Ok(())
    }

    fn adopt<T: Element>(&self, mem: HostBuffer<T>, label: &str) -> Result<CpuBuffer<T>> {
        self.wrap(mem, label)
    }

    fn prefault<T: Element>(&self, buf: &mut CpuBuffer<T>) -> Result<()> {
        CpuBackend::prefault(self, buf)
    }

    fn lend<T: Element>(
        &self,
        stream: Stream,
        op: &'static str,
        buf: CpuBuffer<T>,
        accesses: &[(Range<usize>, AccessKind)],
    ) -> Result<(Loan<T>, HostBuffer<T>)> {
        CpuBackend::lend(self, stream, op, buf, accesses)
    }

    fn lent_mut<T: Element, R>(
        &self,
        lent: &mut HostBuffer<T>,
        f: impl FnOnce(&mut [T]) -> R,
    ) -> Result<R> {
        Ok(f(lent))
    }

    fn give_back<T: Element>(
        &self,
        loan: Loan<T>,
        lent: HostBuffer<T>,
    ) -> Result<(CpuBuffer<T>, CpuEvent)> {
        CpuBackend::give_back(self, loan, lent)
    }
}
