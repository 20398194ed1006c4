//! The collectives of [`NcclComm`] on device buffers, each a batch of one
//! (see [`NcclBatch`]); [`NcclComm::group`] batches several.
//!
//! Buffers are anything cudarc can hand to a stream: a `CudaSlice<T>`, a
//! `CudaView`/`CudaViewMut` into one (a bucket inside an arena), for T in
//! f32, bf16 and f16. They must live on the communicator's GPU; the
//! lengths are checked before anything is enqueued (see `check.rs`).
//! Every rank must call the same collectives, with the same lengths, in
//! the same order.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use zero_core::Element;

use super::{NcclBatch, NcclComm, NcclWork};
use crate::{ReduceOp, Result};

impl NcclComm {
    /// An empty batch: record collectives on it, then
    /// [`NcclBatch::launch`] them in one NCCL group.
    pub fn batch(&self) -> NcclBatch<'_> {
        NcclBatch::new(self)
    }

    /// Records the collectives that `f` adds to the batch and launches
    /// them in one `ncclGroupStart`/`ncclGroupEnd`: one launch and one
    /// event for several gradient buckets.
    ///
    /// ```no_run
    /// # fn f(comm: &zero_comm::NcclComm,
    /// #      b0: &cudarc::driver::CudaSlice<f32>, s0: &mut cudarc::driver::CudaSlice<f32>,
    /// #      b1: &cudarc::driver::CudaSlice<f32>, s1: &mut cudarc::driver::CudaSlice<f32>)
    /// #      -> zero_comm::Result<()> {
    /// use zero_comm::ReduceOp;
    /// let work = comm.group(|g| {
    ///     g.reduce_scatter(b0, s0, ReduceOp::Avg);
    ///     g.reduce_scatter(b1, s1, ReduceOp::Avg);
    /// })?;
    /// // ... backward goes on ...
    /// work.wait()?;
    /// # Ok(()) }
    /// ```
    pub fn group<'a>(&'a self, f: impl FnOnce(&mut NcclBatch<'a>)) -> Result<NcclWork<'a>> {
        let mut batch = NcclBatch::new(self);
        f(&mut batch);
        batch.launch()
    }

    /// All-reduce in place: afterwards every rank's `buf` holds `op` of
    /// all ranks' `buf`.
    ///
    /// ```text
    ///  rank 0: [a0 a1 a2]             rank 0: [a0+b0 a1+b1 a2+b2]
    ///  rank 1: [b0 b1 b2]   ──sum──▶  rank 1: [a0+b0 a1+b1 a2+b2]
    /// ```
    pub fn all_reduce<'a, T: Element, B: DevicePtrMut<T>>(
        &'a self,
        buf: &'a mut B,
        op: ReduceOp,
    ) -> Result<NcclWork<'a>> {
        let mut b = self.batch();
        b.all_reduce(buf, op);
        b.launch()
    }

    /// All-reduce from `send` into `recv` (same length); `send` is only
    /// read.
    pub fn all_reduce_into<'a, T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
    ) -> Result<NcclWork<'a>> {
        let mut b = self.batch();
        b.all_reduce_into(send, recv, op);
        b.launch()
    }

    /// Reduce-scatter: `send` holds `world_size × n` elements on every
    /// rank; rank r receives in `recv` (`n` elements) the reduction of
    /// every rank's part r.
    ///
    /// ```text
    ///  rank 0 send: [a0 | a1]             rank 0 recv: [a0+b0]
    ///  rank 1 send: [b0 | b1]   ──sum──▶  rank 1 recv: [a1+b1]
    /// ```
    pub fn reduce_scatter<'a, T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
    ) -> Result<NcclWork<'a>> {
        let mut b = self.batch();
        b.reduce_scatter(send, recv, op);
        b.launch()
    }

    /// Reduce-scatter in place: `buf` holds `world_size × n` elements;
    /// rank r's result lands in its own part, `buf[r·n .. (r+1)·n]`; NCCL
    /// only reads the other parts, which keep their values.
    ///
    /// ```text
    ///  rank 0: [a0 | a1]             rank 0: [a0+b0 |  a1  ]
    ///  rank 1: [b0 | b1]   ──sum──▶  rank 1: [  b0  | a1+b1]
    /// ```
    pub fn reduce_scatter_in_place<'a, T: Element, B: DevicePtrMut<T>>(
        &'a self,
        buf: &'a mut B,
        op: ReduceOp,
    ) -> Result<NcclWork<'a>> {
        let mut b = self.batch();
        b.reduce_scatter_in_place(buf, op);
        b.launch()
    }

    /// All-gather: every rank's `send` (`n` elements) lands, in rank order,
    /// in every rank's `recv` (`world_size × n`).
    ///
    /// ```text
    ///  rank 0 send: [a]             every recv: [a | b]
    ///  rank 1 send: [b]   ──────▶
    /// ```
    pub fn all_gather<'a, T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &'a self,
        send: &'a S,
        recv: &'a mut R,
    ) -> Result<NcclWork<'a>> {
        let mut b = self.batch();
        b.all_gather(send, recv);
        b.launch()
    }

    /// All-gather in place: `buf` holds `world_size × n` elements and rank
    /// r's own part is already at `buf[r·n .. (r+1)·n]`; afterwards every
    /// part is everywhere (stage 3 gathers a unit's parameters this way).
    ///
    /// ```text
    ///  rank 0: [a | ?]             rank 0: [a | b]
    ///  rank 1: [? | b]   ──────▶   rank 1: [a | b]
    /// ```
    pub fn all_gather_in_place<'a, T: Element, B: DevicePtrMut<T>>(
        &'a self,
        buf: &'a mut B,
    ) -> Result<NcclWork<'a>> {
        let mut b = self.batch();
        b.all_gather_in_place(buf);
        b.launch()
    }
}
