//! The offloaded optimizer on a device backend: its gradients and updated
//! parameters go through pinned host buffers on the copy streams.
//!
//! On the CPU backend the offloaded AdamW reads the gradient homes and
//! writes the parameters in place (host views are the memory). On a GPU
//! the homes and parameters are device memory, so the step stages them:
//!
//! ```text
//!   compute ──[norm: sum_squares]──●e
//!                                    ╲ wait(d2h, e)
//!   d2h     ──────────────────────────◆──[copy homes → pinned grads]──●down
//!                                                                       ╲ sync
//!   host    ─────────────────────────────────────────────────────────────◆──[CPU AdamW
//!           tile by tile: pinned grads → pinned params]
//!   h2d     ──────────────────────────────────────────────────────────────────[copy each
//!           unit's updated range → device params]──●up ─▶ wait(compute, up), wait(comm, up)
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
use super::reducer::GradReducer;
use crate::{Error, Result};

/// Pinned host copies of every unit's gradient home and parameters.
pub(crate) struct OffloadStage<B: HostAccess> {
    grads: Vec<DynHost<B>>,
    params: Vec<DynHost<B>>,
    _allocs: Vec<Allocation>,
}

/// Every unit's staged gradients (read) and parameters (written).
pub(crate) type HostViews<'a, G, P> = (Vec<&'a [G]>, Vec<&'a mut [P]>);

fn dtype_error(op: &'static str, expected: DType, got: DType) -> Error {
    Error::from(zero_core::Error::DTypeMismatch { op, expected, got })
}

impl<B: HostAccess> OffloadStage<B> {
    /// Host buffers the size of each unit's gradient home
    /// (`homes`: dtype and length) and parameter buffer (`params`).
    pub(crate) fn new(
        backend: &B,
        tracker: &MemoryTracker,
        homes: &[(DType, usize)],
        params: &[(DType, usize)],
    ) -> Result<Self> {
        let mut allocs = Vec::new();
        let mut grads = Vec::with_capacity(homes.len());
        for (i, &(dtype, len)) in homes.iter().enumerate() {
            let g = DynHost::alloc(backend, dtype, len, &format!("staged grads {i}"))?;
            allocs.push(tracker.allocate(Tier::Host, Category::Grads, g.bytes()));
            grads.push(g);
        }
        let mut staged = Vec::with_capacity(params.len());
        for (i, &(dtype, len)) in params.iter().enumerate() {
            let p = DynHost::alloc(backend, dtype, len, &format!("staged params {i}"))?;
            allocs.push(tracker.allocate(Tier::Host, Category::Params, p.bytes()));
            staged.push(p);
        }
        Ok(OffloadStage {
            grads,
            params: staged,
            _allocs: allocs,
        })
    }

    /// Copies every unit's gradient home down on the device-to-host
    /// stream, after the compute stream's work so far (the last unpack
    /// into the homes, the norm), and waits for the copies.
    pub(crate) fn grads_down<G: Element>(
        &mut self,
        backend: &B,
        reducer: &GradReducer<B>,
    ) -> Result<()> {
        let ready = backend.record(Stream::Compute)?;
        backend.wait(Stream::DeviceToHost, &ready)?;
        for (i, g) in self.grads.iter_mut().enumerate() {
            let home = reducer.home_buf::<G>(i)?;
            let n = g.len();
            let g = g
                .typed_mut::<G>()
                .ok_or_else(|| dtype_error("OffloadStage::grads_down", DType::F32, G::DTYPE))?;
            backend.copy_d2h(Stream::DeviceToHost, home, 0, g, 0, n)?;
        }
        backend.sync(&backend.record(Stream::DeviceToHost)?)?;
        Ok(())
    }

    /// The staged gradients of every unit, for the host AdamW (after
    /// [`OffloadStage::grads_down`]), and the staged parameters it writes.
    pub(crate) fn host_views<'a, G: Element, P: Element>(
        &'a mut self,
        backend: &'a B,
    ) -> Result<HostViews<'a, G, P>> {
        let grads = self
            .grads
            .iter()
            .map(|g| {
                let t = g
                    .typed::<G>()
                    .ok_or_else(|| dtype_error("OffloadStage::host_views", DType::F32, G::DTYPE))?;
                Ok(backend.read_host(t, 0..g.len())?)
            })
            .collect::<Result<Vec<_>>>()?;
        let params = self
            .params
            .iter_mut()
            .map(|p| {
                let n = p.len();
                let t = p
                    .typed_mut::<P>()
                    .ok_or_else(|| dtype_error("OffloadStage::host_views", DType::F32, P::DTYPE))?;
                Ok(backend.write_host(t, 0..n)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((grads, params))
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
