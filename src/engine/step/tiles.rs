//! The optimizer step with the fp32 master, `m` and `v` offloaded
//! (`offload_optimizer` cpu or nvme, without `swap_gradients`): AdamW
//! tile by tile on the host (see `src/engine/offload.rs`).

use zero_comm::agree::{exchange_u64, first_failure};
use zero_core::backend::HostAccess;
use zero_core::optim::AdamWStep;
use zero_core::Element;

use super::{commit_all, StepIo, TierStep};
use crate::engine::backend::{EngineBackend, EngineComm};
use crate::engine::staging::OffloadStage;
use crate::{Error, Result};

/// AdamW on the offloaded optimizer state, tile by tile (see
/// `src/engine/offload.rs` for the tiles and their pipeline), over host
/// views of the gradient homes and the parameters (on a device backend
/// pinned copies, [`OffloadStage`], which this step owns):
///
/// ```text
///  cpu:   adamw(tile 0) adamw(tile 1) …                 (host state)
///  nvme:  read(t+1..t+buffer_count) ‖ adamw(t) ‖ write(t-1…)
///  then:  params up to the device (staged) ‖ write-back to the
///         parameter offload's homes (with offload_param)
/// ```
///
/// With nvme, every rank learns whether every rank's swap file worked
/// before any parameter changes: on an error anywhere that lost a rank's
/// state, no rank's parameters change, and the engine is failed. If every
/// error was a failed write whose tiles the rank kept in host memory
/// (`Offload::rescued`), every rank commits the step (its parameters
/// match the state kept) and `step()` returns the error once the step is
/// finished; the state stays readable.
pub(in crate::engine) struct TilesStep<B: HostAccess> {
    /// On a device backend: the pinned copies of the gradient homes and
    /// of the parameters that the host AdamW reads and writes.
    pub(super) stage: Option<OffloadStage<B>>,
}

impl<B: EngineBackend> TierStep<B> for TilesStep<B> {
    fn run<C: EngineComm<B>, G: Element, P: Element>(
        &mut self,
        eng: &mut StepIo<'_, C, B>,
        k: &[AdamWStep],
    ) -> Result<()> {
        // With parameter offload the shards are not here: the updated
        // parameters stay in the staging buffer and are written back to
        // their home below.
        let param_home = eng.poff.is_some();
        // The gradients and the parameters the host AdamW reads and writes:
        // pinned copies on a device backend (staged), else host views of
        // the homes and of the units' parameters (the memory itself on the
        // CPU backend).
        let mut grad_views = Vec::new();
        let mut views = Vec::new();
        let (homes, mut params): (Vec<&[G]>, Vec<&mut [P]>) = match self.stage.as_mut() {
            Some(stage) => (
                eng.reducer.staged_homes::<G>()?,
                stage.params_mut::<P>(&eng.cx.backend)?,
            ),
            None => {
                for i in 0..eng.units.len() {
                    grad_views.push(eng.reducer.home_slice::<G>(i)?);
                }
                if !param_home {
                    for u in eng.units.iter_mut() {
                        views.push(
                            u.params_mut()
                                .host_typed_mut::<P>(&eng.cx.backend)?
                                .expect("the parameter dtype"),
                        );
                    }
                }
                (
                    grad_views.iter().map(|v| &v[..]).collect(),
                    views.iter_mut().map(|v| &mut v[..]).collect(),
                )
            }
        };
        let r = eng.opt.step_offloaded::<G, P>(k, &homes, &mut params);
        let Some(off) = eng.opt.offload_mut() else {
            return Ok(());
        };
        if !off.is_nvme() {
            drop((homes, params));
            drop(grad_views);
            commit_all(&eng.cx.backend, views)?;
            self.params_up::<C, P>(eng)?;
            r?;
            return param_write_back::<B, C, P>(eng);
        }
        // 0: done; 1: a failed write, the tiles kept (the step completed);
        // 2: the state is lost.
        let word = match &r {
            Ok(()) => 0,
            Err(_) if off.rescued() => 1,
            Err(_) => 2,
        };
        let verdict = exchange_u64(&eng.cx.comm, &[word])?;
        let rank = eng.cx.comm.rank();
        let usage = |what: String| Error::Usage { rank, what };
        if verdict.iter().any(|w| w[0] == 2) {
            let lost = first_failure(&eng.cx.comm, r.as_ref().err().filter(|_| word == 2))?;
            let (lost, why) = lost.expect("a rank lost its state");
            let msg = format!(
                "the optimizer swap file of rank {lost} failed in step {} ({why}); no rank's \
                 parameters changed",
                eng.number
            );
            let e = match r {
                Err(e) if word == 2 => e,
                Err(e) => usage(format!("{e}; but {msg}, and the state is lost")),
                Ok(()) => usage(msg),
            };
            eng.health.state_lost(e.to_string());
            return Err(e);
        }
        if verdict.iter().any(|w| w[0] == 1) {
            let failed = first_failure(&eng.cx.comm, r.as_ref().err())?;
            let (bad, why) = failed.expect("a rank's write failed");
            let e = match r {
                Err(e) => e,
                Ok(()) => usage(format!(
                    "a write to the optimizer swap file of rank {bad} failed in step {} ({why}); \
                     the step completed and rank {bad} keeps the state it could not write in \
                     host memory",
                    eng.number
                )),
            };
            eng.health.rescued(e.to_string());
            eng.rescued = Some(e);
        }
        let committed = off.commit(&mut params);
        drop((homes, params));
        drop(grad_views);
        commit_all(&eng.cx.backend, views)?;
        self.params_up::<C, P>(eng)?;
        committed?;
        param_write_back::<B, C, P>(eng)
    }
}

impl<B: EngineBackend> TilesStep<B> {
    /// With the offloaded optimizer staged: the updated range of every
    /// unit's parameters up to the device (see `src/engine/staging.rs`).
    fn params_up<C: EngineComm<B>, P: Element>(&self, eng: &mut StepIo<'_, C, B>) -> Result<()> {
        let StepIo { units, cx, opt, .. } = eng;
        let (Some(stage), Some(off)) = (self.stage.as_ref(), opt.offload()) else {
            return Ok(());
        };
        let dsts = units
            .iter_mut()
            .enumerate()
            .map(|(i, u)| (u.params_mut(), off.param_range(i)));
        stage.params_up::<P>(&cx.backend, dsts)
    }
}

/// Writes the updated shards from the optimizer offload's staging
/// buffer to their home (parameter offload with optimizer offload).
fn param_write_back<B: EngineBackend, C: EngineComm<B>, P: Element>(
    eng: &mut StepIo<'_, C, B>,
) -> Result<()> {
    let (Some(off), Some(po)) = (eng.opt.offload(), eng.poff.as_deref_mut()) else {
        return Ok(());
    };
    let mut r = Ok(());
    for i in 0..eng.units.len() {
        let src = match off.staged::<P>(i) {
            Ok(s) => s,
            Err(e) => {
                r = Err(e);
                break;
            }
        };
        r = po.write_with::<P>(i, |home| {
            home.copy_from_slice(src);
            Ok(())
        });
        if r.is_err() {
            break;
        }
    }
    let flushed = po.flush();
    eng.param_write_verdict(r.and(flushed))
}
