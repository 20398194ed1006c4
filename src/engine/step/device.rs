//! The optimizer step with the fp32 master, `m`, `v` and the parameters on
//! the device tier.

use zero_core::optim::AdamWStep;
use zero_core::Element;

use super::{StepIo, TierStep};
use crate::engine::backend::{EngineBackend, EngineComm};
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
        io: &mut StepIo<'_, C, B>,
        k: &[AdamWStep],
    ) -> Result<()> {
        if !io.cx.cfg.zero.overlap_comm || io.cx.stage == 0 {
            let params = io
                .units
                .iter_mut()
                .enumerate()
                .map(|(i, u)| (i, u.params_mut()));
            return io
                .opt
                .step_units::<G, P>(&io.cx.backend, k, io.reducer, params);
        }
        // overlap_comm: unit by unit, so that the all-gathers of updated
        // parameters start while AdamW runs on the next units — every
        // unit's at stages 1–2, the head of the recorded order (what the
        // next forward gathers first) at stage 3. AdamW is elementwise: the
        // same bits as one call over all units.
        let head = io.s3.head();
        for i in 0..io.units.len() {
            let low = io.units[i].params_mut();
            io.opt
                .step_units::<G, P>(&io.cx.backend, k, io.reducer, std::iter::once((i, low)))?;
            if io.cx.stage < 3 {
                io.gather_updated(i)?;
            } else if head == Some(i + 1) {
                io.prefetch_next()?;
            }
        }
        Ok(())
    }
}
