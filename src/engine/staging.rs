//! The offloaded optimizer on a device backend: its gradients and updated
//! parameters go through pinned host buffers on the copy streams
//! ([`OffloadStage`]); and with parameter offload alone, the updated
//! shards of the device AdamW go down to their homes through two slots
//! ([`ParamStepStage`]).
//!
//! On the CPU backend the offloaded AdamW reads the gradient homes and
//! writes the parameters in place (host views are the memory). On a GPU
//! the homes and parameters are device memory, so they are staged. In the
//! last micro-batch of a step each bucket's units go down as soon as their
//! reduced gradient is in their homes (`GradReducer::stage_homes`), while
//! the backward pass goes on; the step waits for the last copy, runs the
//! host AdamW, and sends each unit's updated range up:
//!
//! ```text
//!   comm    ──[reduce bucket k]──[unpack into homes]──●u_k
//!                                                       ╲ wait(d2h, u_k)
//!   d2h     ─────────────────────────────────────────────◆──[homes of bucket k → pinned]──●c
//!                                                                                          ╲ sync (step)
//!   host    ────────────────────────────────────────────────────────────────────────────────◆──[CPU AdamW
//!           tile by tile: pinned grads → pinned params]
//!   h2d     ──[each unit's updated range → device params]──●up ─▶ wait(compute, up), wait(comm, up)
//! ```
//!
//! Every copy is a backend operation ordered by events, so the CPU
//! backend's hazard checker proves the order when a test forces this path
//! there (`EngineBuilder::stage_offload_for_tests`); the buffers are
//! allocated once, when the engine is built, and accounted in the host
//! tier (pinned on a GPU).

use zero_core::backend::{HostAccess, Stream};
use zero_core::memory::{Allocation, Category, MemoryTracker, Tier};
use zero_core::{DType, Element};

use super::devbuf::{DevBuf, DynHost};
use crate::{Error, Result};

fn dtype_error(op: &'static str, expected: DType, got: DType) -> Error {
    Error::from(zero_core::Error::DTypeMismatch { op, expected, got })
}

/// Pinned host copies of every unit's parameters (the gradient homes'
/// copies are the reducer's: `GradReducer::stage_homes`).
pub(crate) struct OffloadStage<B: HostAccess> {
    params: Vec<DynHost<B>>,
    _allocs: Vec<Allocation>,
}

impl<B: HostAccess> OffloadStage<B> {
    /// Host buffers the size of each unit's parameter buffer (`params`:
    /// dtype and length).
    pub(crate) fn new(
        backend: &B,
        tracker: &MemoryTracker,
        params: &[(DType, usize)],
    ) -> Result<Self> {
        let mut allocs = Vec::new();
        let mut staged = Vec::with_capacity(params.len());
        for (i, &(dtype, len)) in params.iter().enumerate() {
            let p = DynHost::alloc(backend, dtype, len, &format!("staged params {i}"))?;
            allocs.push(tracker.allocate(Tier::Host, Category::Params, p.bytes()));
            staged.push(p);
        }
        Ok(OffloadStage {
            params: staged,
            _allocs: allocs,
        })
    }

    /// The staged parameters of every unit, for the host AdamW to write.
    pub(crate) fn params_mut<P: Element>(&mut self, backend: &B) -> Result<Vec<&mut [P]>> {
        self.params
            .iter_mut()
            .map(|p| {
                let (n, dtype) = (p.len(), p.dtype());
                let t = p
                    .typed_mut::<P>()
                    .ok_or_else(|| dtype_error("OffloadStage::params_mut", dtype, P::DTYPE))?;
                Ok(backend.write_host(t, 0..n)?)
            })
            .collect()
    }

    /// Copies the updated range `ranges[i]` of every unit's staged
    /// parameters up into `units[i]` on the host-to-device stream, and
    /// makes the compute and communication streams wait for the copies
    /// (the next gathers and all-gathers read them).
    pub(crate) fn params_up<'u, P: Element>(
        &self,
        backend: &B,
        units: impl Iterator<Item = (&'u mut DevBuf<B>, std::ops::Range<usize>)>,
    ) -> Result<()>
    where
        B: 'u,
    {
        for (staged, (dst, r)) in self.params.iter().zip(units) {
            let dtype = dst.dtype();
            let src = staged
                .typed::<P>()
                .ok_or_else(|| dtype_error("OffloadStage::params_up", dtype, P::DTYPE))?;
            let dst = dst
                .typed_mut::<P>()
                .ok_or_else(|| dtype_error("OffloadStage::params_up", dtype, P::DTYPE))?;
            backend.copy_h2d(Stream::HostToDevice, src, r.start, dst, r.start, r.len())?;
        }
        let up = backend.record(Stream::HostToDevice)?;
        backend.wait(Stream::Compute, &up)?;
        backend.wait(Stream::Comm, &up)?;
        Ok(())
    }
}

/// Parameter offload with the optimizer state on a device: AdamW runs on
/// the device into one of two device buffers of the largest shard, the
/// updated shard goes down on the device-to-host stream into the slot's
/// host buffer (pinned on a GPU), and the host copies it into the shard's
/// home while the next unit's AdamW runs into the other slot:
///
/// ```text
///   compute ──[AdamW u0 → low0]──●──[AdamW u1 → low1]──●──(sync c0)──[AdamW u2 → low0]──
///                                 ╲ wait                ╲ wait
///   d2h     ─────────────────────◆──[low0 → host0]──●c0──◆──[low1 → host1]──●c1──
///   host    ──────────────────────────────────────────────(sync c0)──[host0 → home u0]──
/// ```
///
/// Built only on a device backend (or forced in tests,
/// `EngineBuilder::stage_offload_for_tests`); the buffers are allocated
/// once, when the engine is built, and accounted in the device and host
/// tiers.
pub(crate) struct ParamStepStage<B: HostAccess> {
    low: [DevBuf<B>; 2],
    host: [DynHost<B>; 2],
    /// The copy down out of each slot, until the host has waited for it.
    copied: [Option<B::Event>; 2],
    _allocs: Vec<Allocation>,
}

impl<B: HostAccess> ParamStepStage<B> {
    /// Two slots of `len` elements of the parameter dtype `pdt` (the
    /// largest shard).
    pub(crate) fn new<C: zero_comm::DeviceCollectives<B>>(
        backend: &B,
        comm: &C,
        tracker: &MemoryTracker,
        pdt: DType,
        len: usize,
    ) -> Result<Self> {
        let len = len.max(1);
        let mut allocs = Vec::new();
        let mut slot = |k: usize| -> Result<(DevBuf<B>, DynHost<B>)> {
            let low = DevBuf::alloc(backend, comm, pdt, len, &format!("parameter step {k}"))?;
            allocs.push(tracker.allocate(Tier::Device, Category::Params, low.bytes()));
            let host = DynHost::alloc(backend, pdt, len, &format!("parameter step {k} (host)"))?;
            allocs.push(tracker.allocate(Tier::Host, Category::CommBuffers, host.bytes()));
            Ok((low, host))
        };
        let (l0, h0) = slot(0)?;
        let (l1, h1) = slot(1)?;
        Ok(ParamStepStage {
            low: [l0, l1],
            host: [h0, h1],
            copied: [None, None],
            _allocs: allocs,
        })
    }

    /// Slot `k`'s device buffer, for AdamW to write (on the compute
    /// stream, after [`take`](Self::take) of the slot's last unit).
    pub(crate) fn low(&mut self, k: usize) -> &mut DevBuf<B> {
        &mut self.low[k]
    }

    /// Sends elements `range` of slot `k` down into its host buffer on the
    /// device-to-host stream, after the compute stream's work so far (the
    /// AdamW that wrote them).
    pub(crate) fn send_down<P: Element>(
        &mut self,
        backend: &B,
        k: usize,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let done = backend.record(Stream::Compute)?;
        backend.wait(Stream::DeviceToHost, &done)?;
        let dtype = self.low[k].dtype();
        let src = self.low[k]
            .typed::<P>()
            .ok_or_else(|| dtype_error("ParamStepStage::send_down", dtype, P::DTYPE))?;
        let dst = self.host[k]
            .typed_mut::<P>()
            .ok_or_else(|| dtype_error("ParamStepStage::send_down", dtype, P::DTYPE))?;
        backend.copy_d2h(
            Stream::DeviceToHost,
            src,
            range.start,
            dst,
            range.start,
            range.len(),
        )?;
        self.copied[k] = Some(backend.record(Stream::DeviceToHost)?);
        Ok(())
    }

    /// Waits for slot `k`'s copy down and hands elements `range` of its
    /// host buffer to `home` (which writes them into the shard's home).
    pub(crate) fn take<P: Element>(
        &mut self,
        backend: &B,
        k: usize,
        range: std::ops::Range<usize>,
        home: impl FnOnce(&[P]) -> Result<()>,
    ) -> Result<()> {
        if let Some(copied) = self.copied[k].take() {
            backend.sync(&copied)?;
        }
        let dtype = self.host[k].dtype();
        let src = self.host[k]
            .typed::<P>()
            .ok_or_else(|| dtype_error("ParamStepStage::take", dtype, P::DTYPE))?;
        home(backend.read_host(src, range)?)
    }
}
