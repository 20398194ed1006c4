//! The optimizer step with `swap_gradients`: the optimizer state in nvme
//! tiles and the accumulated gradients in their own swap file, unit by
//! unit.

use zero_core::optim::AdamWStep;
use zero_core::Element;

use super::{commit_all, StepIo, TierStep};
use crate::engine::backend::{EngineBackend, EngineComm};
use crate::Result;

/// `swap_gradients`: AdamW unit by unit over the swapped gradients (see
/// `Offload::step_streamed`); each unit's updated parameters go to the
/// device tier or, with parameter offload, straight to their home:
///
/// ```text
///  grad swap: read(u+1) ‖ state: read tiles(u) ‖ adamw(u) ‖ write tiles(u-1)
///  then:      unit u's parameters → its home (write_with, flushed at the end)
/// ```
///
/// Every rank learns whether every rank's step worked: an error anywhere
/// fails the engine with the state and the parameters lost (some units
/// were written, others not: resume from a checkpoint).
pub(in crate::engine) struct StreamedStep;

impl<B: EngineBackend> TierStep<B> for StreamedStep {
    fn run<C: EngineComm<B>, G: Element, P: Element>(
        &mut self,
        eng: &mut StepIo<'_, C, B>,
        k: &[AdamWStep],
    ) -> Result<()> {
        let StepIo {
            units,
            cx,
            opt,
            reducer,
            poff,
            ..
        } = eng;
        let backend = &cx.backend;
        let mut views = Vec::new();
        if poff.is_none() {
            for u in units.iter_mut() {
                views.push(
                    u.params_mut()
                        .host_typed_mut::<P>(backend)?
                        .expect("the parameter dtype"),
                );
            }
        }
        let mut params: Vec<&mut [P]> = views.iter_mut().map(|v| &mut v[..]).collect();
        let gs = reducer.grad_swap_mut().expect("swap_gradients");
        let mut emit = |i: usize, staged: &[P]| -> Result<()> {
            match poff.as_mut() {
                Some(po) => po.write_with::<P>(i, |home| {
                    home.copy_from_slice(staged);
                    Ok(())
                }),
                None => Ok(()),
            }
        };
        let r = opt.step_streamed::<G, P>(k, gs, &mut params, &mut emit);
        drop(params);
        let r = r.and(commit_all(backend, views));
        let flushed = match poff.as_mut() {
            Some(po) => po.flush(),
            None => Ok(()),
        };
        let r = r.and(flushed);
        let number = eng.number;
        eng.health.params_verdict(&eng.cx.comm, r, |bad, why| {
            format!(
                "the offloaded optimizer step of rank {bad} failed in step {number} ({why}); with \
                 swap_gradients the units are updated one after another, so the optimizer state \
                 and the parameters are lost: resume from the last checkpoint"
            )
        })
    }
}
