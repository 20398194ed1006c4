//! The optimizer step with the fp32 master, `m`, `v` and the parameters on
//! the device tier.

use zero_core::optim::AdamWStep;
use zero_core::Element;

use super::TierStep;
use crate::engine::{Engine, EngineBackend, EngineComm};
use crate::Result;

/// AdamW on the device, in one parallel region over every unit; with
/// `overlap_comm` (stages 1–3) unit by unit, so that the parameter
/// all-gathers start while AdamW runs on the next units:
///
/// ```text
///  compute: adamw(u0) adamw(u1) adamw(u2) …
///  comm:              gather(u0) gather(u1) …   stages 1–2: every unit,
///                                               bucketed (allgather_bucket_size)
///  stage 3:           prefetch of the recorded order's head, once AdamW
///                     wrote it
/// ```
///
/// AdamW is elementwise: unit by unit gives the same bits as one call.
pub(in crate::engine) struct DeviceStep;

impl<B: EngineBackend> TierStep<B> for DeviceStep {
    fn run<C: EngineComm<B>, G: Element, P: Element>(
        &mut self,
        eng: &mut Engine<C, B>,
        k: &[AdamWStep],
    ) -> Result<()> {
        if !eng.cfg.zero.overlap_comm || eng.stage == 0 {
            let params = eng
                .units
                .iter_mut()
                .enumerate()
                .map(|(i, u)| (i, u.params_mut()));
            return eng
                .opt
                .step_units::<G, P>(&eng.backend, k, &eng.reducer, params);
        }
        // overlap_comm: unit by unit, so that the all-gathers of updated
        // parameters start while AdamW runs on the next units — every
        // unit's at stages 1–2, the head of the recorded order (what the
        // next forward gathers first) at stage 3. AdamW is elementwise: the
        // same bits as one call over all units.
        let head = eng.s3.head();
        for i in 0..eng.units.len() {
            let low = eng.units[i].params_mut();
            eng.opt
                .step_units::<G, P>(&eng.backend, k, &eng.reducer, std::iter::once((i, low)))?;
            if eng.stage < 3 {
                if eng.units[i].queue_gather() {
                    eng.param_gather_queue.push_back(i);
                }
                eng.advance_param_gathers(None)?;
            } else if head == Some(i + 1) {
                let (s3, io) = eng.s3_parts();
                s3.prefetch_next(io)?;
            }
        }
        Ok(())
    }
}
