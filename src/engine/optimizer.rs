//! The optimizer shard: this rank's fp32 master weights and AdamW moments
//! (the whole model at stage 0, the rank's shard of every unit beyond),
//! where they live (device tier, or the offload tiers of
//! [`Offload`](super::offload::Offload)), and the kernels that update them
//! (the gradient norm's sum of squares and the fused AdamW: the device
//! backend's primitives, enqueued on the compute stream; with optimizer
//! offload [`CpuAdamW`] on the host tiles).
//!
//! ```text
//!  compute ─[sum_squares(homes)]─●─ host: sync, read ─ exchange ─ clip
//!  compute ─[adamw(master, m, v, homes → params)]─●updated
//! ```
//!
//! The reducer's `finish` made the compute stream wait for the last
//! unpack into the homes; the norm's sync orders the host after it too
//! (the offload tiers read the homes there). The engine orders what reads
//! the updated parameters after `updated` (the parameter all-gathers of
//! stages 1–2 start after it; then the host syncs it).
//!
//! Element ranges, per unit (`abs` is the rank's real elements of the
//! unit, padding excluded):
//!
//! ```text
//!  unit (padded):   [ shard 0 | shard 1 | ... ]      stage 0: state covers all of it
//!  state  (master, m, v): abs relative to the state's start
//!  grad   (the reducer's home): the state range if the home is the
//!          accumulation buffer (shard), else abs (the full P buffer)
//!  params (what AdamW writes in P): the state range at stage 3 (own
//!          shard), else abs (the full unit)
//! ```

use std::ops::Range;

use zero_core::backend::{AdamWPart, BufferHandle, HostAccess, Stream};
use zero_core::optim::{AdamWSlices, AdamWStep, CpuAdamW};
use zero_core::partition::UnitLayout;
use zero_core::Element;

use super::devbuf::DevBuf;
use super::grad_swap::GradSwap;
use super::groups::{carve, relative, GroupMap, GroupedStep};
use super::offload::{Emit, Offload};
use super::reducer::GradReducer;
use crate::{Error, Result};

/// The fp32 optimizer state of one unit on the device tier (empty with
/// optimizer offload).
pub(crate) struct Moments<B: HostAccess> {
    /// fp32 master weights.
    pub(crate) master: B::Buffer<f32>,
    /// AdamW first moment.
    pub(crate) m: B::Buffer<f32>,
    /// AdamW second moment.
    pub(crate) v: B::Buffer<f32>,
}

/// Host views of a unit's master, m and v to write
/// ([`Moments::host_mut`]); [`MomentsMut::commit`] writes them back.
pub(crate) type MomentsMut<'a, B> = (
    <B as HostAccess>::HostMut<'a, f32>,
    <B as HostAccess>::HostMut<'a, f32>,
    <B as HostAccess>::HostMut<'a, f32>,
);

/// Host views of a unit's master, m and v to read ([`Moments::host`]).
pub(crate) type MomentsRef<'a, B> = (
    <B as HostAccess>::HostRef<'a, f32>,
    <B as HostAccess>::HostRef<'a, f32>,
    <B as HostAccess>::HostRef<'a, f32>,
);

impl<B: HostAccess> Moments<B> {
    /// Master, m and v for the host to read (checked: after a sync).
    pub(crate) fn host<'a>(&'a self, backend: &'a B) -> Result<MomentsRef<'a, B>> {
        let all = |b: &'a B::Buffer<f32>| backend.host_ref(b, 0..b.len());
        Ok((all(&self.master)?, all(&self.m)?, all(&self.v)?))
    }

    /// Master, m and v for the host to write (checked: after a sync);
    /// [`commit_moments`] writes them back.
    pub(crate) fn host_mut<'a>(&'a mut self, backend: &'a B) -> Result<MomentsMut<'a, B>> {
        let Moments { master, m, v } = self;
        let (nm, n) = (master.len(), m.len());
        Ok((
            backend.host_mut(master, 0..nm)?,
            backend.host_mut(m, 0..n)?,
            backend.host_mut(v, 0..n)?,
        ))
    }
}

/// Writes back the views of [`Moments::host_mut`].
pub(crate) fn commit_moments<B: HostAccess>(backend: &B, views: MomentsMut<'_, B>) -> Result<()> {
    let (master, m, v) = views;
    backend.commit(master)?;
    backend.commit(m)?;
    backend.commit(v)?;
    Ok(())
}

/// The element ranges AdamW touches for one unit (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct StepRanges {
    /// In the unit's master, m and v.
    pub(crate) state: Range<usize>,
    /// In the unit's gradient home.
    pub(crate) grad: Range<usize>,
    /// In the unit's parameters (full unit, or the rank's shard at stage 3).
    pub(crate) params: Range<usize>,
    /// In the gradient home, for the norm: the rank's shard of the unit at
    /// every stage (so that every stage adds the same terms).
    pub(crate) norm: Range<usize>,
}

/// This rank's optimizer state and kernels.
pub(crate) struct OptimizerShard<B: HostAccess> {
    state: Vec<Moments<B>>,
    ranges: Vec<StepRanges>,
    /// The parameter groups, and per unit its first element of the
    /// state (unit coordinates).
    groups: GroupMap,
    bases: Vec<usize>,
    adam: CpuAdamW,
    offload: Option<Offload>,
}

impl<B: HostAccess> OptimizerShard<B> {
    /// The shard over `state` (one entry per unit) for `stage` on `rank`;
    /// `has_acc(i)`: unit `i`'s gradient home is a separate accumulation
    /// buffer (see [`GradReducer::has_acc`]).
    pub(crate) fn new(
        stage: u8,
        rank: usize,
        layouts: &[UnitLayout],
        state: Vec<Moments<B>>,
        has_acc: impl Fn(usize) -> bool,
        (adam, offload, groups): (CpuAdamW, Option<Offload>, GroupMap),
    ) -> Self {
        let bases = layouts
            .iter()
            .map(|l| if stage == 0 { 0 } else { rank * l.shard_len })
            .collect();
        let ranges = layouts
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let own = l.real_range(rank);
                let abs = if stage == 0 { 0..l.numel } else { own.clone() };
                let base = if stage == 0 { 0 } else { rank * l.shard_len };
                let state = relative(abs.clone(), base);
                let acc = has_acc(i);
                StepRanges {
                    grad: if acc { state.clone() } else { abs.clone() },
                    params: if stage == 3 { state.clone() } else { abs },
                    norm: if acc && stage > 0 {
                        relative(own, rank * l.shard_len)
                    } else {
                        own
                    },
                    state,
                }
            })
            .collect();
        OptimizerShard {
            state,
            ranges,
            groups,
            bases,
            adam,
            offload,
        }
    }

    /// Unit `i`'s device-tier state (empty buffers with optimizer offload).
    pub(crate) fn moments(&self, i: usize) -> &Moments<B> {
        &self.state[i]
    }

    /// Unit `i`'s device-tier state, to fill (checkpoint load).
    pub(crate) fn moments_mut(&mut self, i: usize) -> &mut Moments<B> {
        &mut self.state[i]
    }

    /// The offloaded state, with optimizer offload.
    pub(crate) fn offload(&self) -> Option<&Offload> {
        self.offload.as_ref()
    }

    /// The offloaded state, with optimizer offload.
    pub(crate) fn offload_mut(&mut self) -> Option<&mut Offload> {
        self.offload.as_mut()
    }

    /// This rank's part of the squared gradient norm: its shard of every
    /// unit, in unit order, in one pass on the compute stream (the host
    /// syncs it to read the terms); the terms summed in unit order.
    pub(crate) fn local_sum_squares<G: Element>(
        &self,
        backend: &B,
        grads: &GradReducer<B>,
    ) -> Result<f64> {
        let parts = self
            .ranges
            .iter()
            .enumerate()
            .map(|(i, r)| Ok((grads.home_buf::<G>(i)?, r.norm.clone())))
            .collect::<Result<Vec<_>>>()?;
        let sums = backend.sum_squares(Stream::Compute, &parts)?;
        backend.sync(&backend.record(Stream::Compute)?)?;
        let sums = backend.read_scalars(&sums)?;
        Ok(sums.iter().fold(0f64, |a, s| a + s))
    }

    /// AdamW on the units `units` in one fused call on the compute stream,
    /// writing each unit's updated parameters into its buffer `low(i)` (its
    /// full parameters, or the shard, in P). Whatever reads the
    /// parameters afterwards must be ordered after it.
    pub(crate) fn step_units<'p, G: Element, P: Element>(
        &mut self,
        backend: &B,
        ks: &[AdamWStep],
        grads: &GradReducer<B>,
        units: impl Iterator<Item = (usize, &'p mut DevBuf<B>)>,
    ) -> Result<()> {
        let mut units: Vec<(usize, &mut DevBuf<B>)> = units.collect();
        let runs = self.runs(ks, units.iter().map(|(i, _)| *i));
        // One fused call per group and round: the j-th run of the group in
        // every unit (a unit's buffers in one call at most once). Without
        // groups: one call over every unit.
        for (g, k) in ks.iter().enumerate() {
            for j in 0.. {
                let mut parts = Vec::new();
                let mut state: Vec<Option<&mut Moments<B>>> =
                    self.state.iter_mut().map(Some).collect();
                for ((i, low), runs) in units.iter_mut().zip(&runs) {
                    let Some(&(_, off, n)) = runs.iter().filter(|r| r.0 == g).nth(j) else {
                        continue;
                    };
                    let r = &self.ranges[*i];
                    let s = state[*i].take().expect("each unit once");
                    let dtype = low.dtype();
                    let low = low.typed_mut::<P>().ok_or_else(|| {
                        Error::from(zero_core::Error::DTypeMismatch {
                            op: "OptimizerShard::step_units",
                            expected: dtype,
                            got: P::DTYPE,
                        })
                    })?;
                    parts.push(AdamWPart::<B, G, P> {
                        master: &mut s.master,
                        m: &mut s.m,
                        v: &mut s.v,
                        state: r.state.start + off..r.state.start + off + n,
                        grad: grads.home_buf::<G>(*i)?,
                        grad_at: r.grad.start + off,
                        low: Some((low, r.params.start + off)),
                    });
                }
                if parts.is_empty() {
                    break;
                }
                backend.adamw(Stream::Compute, k, parts)?;
            }
        }
        Ok(())
    }

    /// The elements of unit `i`'s parameters (its full parameters, or
    /// the shard) that AdamW writes.
    pub(crate) fn params_range(&self, i: usize) -> Range<usize> {
        self.ranges[i].params.clone()
    }

    /// Per unit of `units`, the runs of its state elements by group.
    fn runs(
        &self,
        ks: &[AdamWStep],
        units: impl Iterator<Item = usize>,
    ) -> Vec<Vec<(usize, usize, usize)>> {
        let gs = self.grouped(ks);
        units
            .map(|i| gs.split(i, self.ranges[i].state.clone()))
            .collect()
    }

    /// The step of every group with constants `ks`.
    fn grouped<'a>(&'a self, ks: &'a [AdamWStep]) -> GroupedStep<'a> {
        GroupedStep {
            ks,
            map: &self.groups,
            bases: &self.bases,
        }
    }

    /// The constants of update `step` for every group (see
    /// [`GroupMap::steps`]).
    pub(crate) fn steps(
        &self,
        opt: &zero_core::optim::AdamWParams,
        lr: f64,
        step: u64,
        grad_scale: f32,
    ) -> Vec<AdamWStep> {
        self.groups.steps(opt, lr, step, grad_scale)
    }

    /// AdamW on the units `units` from the host, writing each unit's
    /// updated parameters into the host slice `low(i)`: parameter offload,
    /// whose shards live in host memory or are staged there for the swap
    /// file. The state and gradients are read through checked host views,
    /// valid after the norm's sync of the compute stream.
    pub(crate) fn step_units_host<'p, G: Element, P: Element>(
        &mut self,
        backend: &B,
        ks: &[AdamWStep],
        grads: &GradReducer<B>,
        units: impl Iterator<Item = (usize, &'p mut [P])>,
    ) -> Result<()> {
        let units: Vec<(usize, &mut [P])> = units.collect();
        let runs = self.runs(ks, units.iter().map(|(i, _)| *i));
        let mut state: Vec<Option<&mut Moments<B>>> = self.state.iter_mut().map(Some).collect();
        let mut views = Vec::with_capacity(units.len());
        let mut homes = Vec::with_capacity(units.len());
        for (i, _) in &units {
            let s = state[*i].take().expect("each unit once");
            views.push(s.host_mut(backend)?);
            homes.push(grads.home_slice::<G>(*i)?);
        }
        // Every run's slices are disjoint: one parallel region per group.
        let mut parts: Vec<Vec<AdamWSlices<'_, G, f32, P>>> =
            ks.iter().map(|_| Vec::new()).collect();
        for ((((i, low), runs), (master, m, v)), home) in units
            .into_iter()
            .zip(&runs)
            .zip(views.iter_mut())
            .zip(&homes)
        {
            let r = &self.ranges[i];
            let grad = &home[r.grad.clone()];
            let (mut master, mut m, mut v) = (
                &mut master[r.state.clone()],
                &mut m[r.state.clone()],
                &mut v[r.state.clone()],
            );
            let mut low = &mut low[r.params.clone()];
            let mut at = 0;
            for &(g, off, n) in runs {
                let skip = off - at;
                parts[g].push(AdamWSlices {
                    master: carve(&mut master, skip, n),
                    grad: &grad[off..off + n],
                    m: carve(&mut m, skip, n),
                    v: carve(&mut v, skip, n),
                    low: Some(carve(&mut low, skip, n)),
                });
                at = off + n;
            }
        }
        for (k, parts) in ks.iter().zip(parts) {
            if !parts.is_empty() {
                self.adam.step_many(k, parts)?;
            }
        }
        views
            .into_iter()
            .try_for_each(|v| commit_moments(backend, v))
    }

    /// With `swap_gradients`: AdamW on the offloaded state unit by unit
    /// over the swapped gradients (see [`Offload::step_streamed`]).
    pub(crate) fn step_streamed<G: Element, P: Element>(
        &mut self,
        ks: &[AdamWStep],
        grads: &mut GradSwap,
        params: &mut [&mut [P]],
        emit: &mut Emit<'_, P>,
    ) -> Result<()> {
        let gs = GroupedStep {
            ks,
            map: &self.groups,
            bases: &self.bases,
        };
        let off = self.offload.as_mut().expect("optimizer offload");
        off.step_streamed::<G, P>(&self.adam, &gs, grads, params, emit)
    }

    /// With optimizer offload: AdamW on the offloaded state, tile by tile
    /// (see [`Offload::step`]), reading each unit's gradient home `homes`
    /// (host memory) and writing `params` (empty with parameter offload:
    /// the updated parameters stay staged).
    pub(crate) fn step_offloaded<G: Element, P: Element>(
        &mut self,
        ks: &[AdamWStep],
        homes: &[&[G]],
        params: &mut [&mut [P]],
    ) -> Result<()> {
        let gs = GroupedStep {
            ks,
            map: &self.groups,
            bases: &self.bases,
        };
        let off = self.offload.as_mut().expect("optimizer offload");
        off.step(&self.adam, &gs, homes, params)
    }
}
