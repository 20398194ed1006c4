//! The optimizer step with the optimizer state on the device tier and the
//! parameter shards offloaded (`offload_param` without
//! `offload_optimizer`): AdamW writes the updated shards to their home.

use zero_core::optim::AdamWStep;
use zero_core::Element;

use super::{StepIo, TierStep};
use crate::engine::backend::{EngineBackend, EngineComm};
use crate::engine::staging::ParamStepStage;
use crate::Result;

/// AdamW on the host (the CPU backend), the shards' home written
/// directly: with `cpu` AdamW writes the parameters straight into their
/// host buffers (one parallel region, as without offload); with `nvme`
/// unit by unit into a staging buffer that is then written to the unit's
/// swap region (AdamW is elementwise, so the bits are the same):
///
/// ```text
///  cpu:  adamw(all units) → host homes
///  nvme: adamw(u0) → write(u0) adamw(u1) → write(u1) …   (the writes
///        queue on the swap file's I/O; flushed at the end)
/// ```
pub(in crate::engine) struct ParamHostStep;

impl<B: EngineBackend> TierStep<B> for ParamHostStep {
    fn run<C: EngineComm<B>, G: Element, P: Element>(
        &mut self,
        io: &mut StepIo<'_, C, B>,
        k: &[AdamWStep],
    ) -> Result<()> {
        let StepIo {
            poff,
            opt,
            reducer,
            cx,
            ..
        } = io;
        let backend = &cx.backend;
        let Some(po) = poff.as_deref_mut() else {
            return Ok(());
        };
        if let Some(homes) = po.host_shards::<P>()? {
            return opt.step_units_host::<G, P>(backend, k, reducer, homes.into_iter().enumerate());
        }
        let mut r = Ok(());
        for i in 0..io.units.len() {
            r = po.write_with::<P>(i, |home| {
                opt.step_units_host::<G, P>(backend, k, reducer, std::iter::once((i, home)))
            });
            if r.is_err() {
                break;
            }
        }
        let flushed = po.flush();
        io.param_write_verdict(r.and(flushed))
    }
}

/// [`ParamHostStep`] on a device (see [`ParamStepStage`], which this step
/// owns): unit by unit, AdamW on the device into one of two slots, the
/// updated shard down into the slot's host buffer, and into its home once
/// the slot is needed again (or at the end), so that the host's copy of
/// one unit overlaps the next unit's AdamW:
///
/// ```text
///  compute: adamw(u0)→slot0 adamw(u1)→slot1 adamw(u2)→slot0 …
///  copy:         down(slot0)      down(slot1)      down(slot0)
///  host:                     home(u0)         home(u1)   … home(last two)
/// ```
pub(in crate::engine) struct ParamDeviceStep<B: zero_core::backend::HostAccess> {
    /// The two device slots and their host copies.
    pub(super) stage: ParamStepStage<B>,
}

impl<B: EngineBackend> TierStep<B> for ParamDeviceStep<B> {
    fn run<C: EngineComm<B>, G: Element, P: Element>(
        &mut self,
        io: &mut StepIo<'_, C, B>,
        k: &[AdamWStep],
    ) -> Result<()> {
        let StepIo {
            poff,
            opt,
            reducer,
            cx,
            ..
        } = io;
        let backend = &cx.backend;
        let st = &mut self.stage;
        let Some(po) = poff.as_deref_mut() else {
            return Ok(());
        };
        let n = io.units.len();
        let ranges: Vec<_> = (0..n).map(|i| opt.params_range(i)).collect();
        // Unit `j`'s updated elements, from slot `b` into its home.
        let mut home = |st: &mut ParamStepStage<B>, b: usize, j: usize| -> Result<()> {
            let r = ranges[j].clone();
            st.take::<P>(backend, b, r.clone(), |data| {
                po.write_with::<P>(j, |home| {
                    home[r].copy_from_slice(data);
                    Ok(())
                })
            })
        };
        let mut waiting: [Option<usize>; 2] = [None, None];
        let mut r = Ok(());
        for (i, range) in ranges.iter().enumerate() {
            let b = i % 2;
            if let Some(j) = waiting[b].take() {
                r = home(st, b, j);
                if r.is_err() {
                    break;
                }
            }
            r = opt
                .step_units::<G, P>(backend, k, reducer, std::iter::once((i, st.low(b))))
                .and_then(|()| st.send_down::<P>(backend, b, range.clone()));
            if r.is_err() {
                break;
            }
            waiting[b] = Some(i);
        }
        // The last two units, in order.
        for i in n.saturating_sub(2)..n {
            if r.is_err() {
                break;
            }
            if let Some(j) = waiting[i % 2].take() {
                r = home(st, i % 2, j);
            }
        }
        let flushed = po.flush();
        io.param_write_verdict(r.and(flushed))
    }
}
