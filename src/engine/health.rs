//! The engine's health: one state instead of loose failure flags.
//!
//! ```text
//!   Ok ──swap write failed, every rank kept its tiles──▶ Rescued
//!   Ok | Rescued ──optimizer swap file lost──────────────▶ StateLost
//!   any ──parameter swap file failed─────────────────────▶ ParamsLost
//!   any ──a collective failed────────────────────────────▶ CommFailed
//! ```
//!
//! What each state still allows:
//!
//! | state | train (step, gradients) | read state (unit_state, save, export) | gather |
//! |---|---|---|---|
//! | `Ok` | yes | yes | yes |
//! | `Rescued` | no | yes | yes |
//! | `StateLost` | no | no | yes |
//! | `ParamsLost` | no | no | no |
//! | `CommFailed` | no | no | no |
//!
//! A failed collective may still hold the engine's buffers, so after it
//! every call fails, whatever else happened before.
//!
//! # Swap-file errors, as the trainer sees them
//!
//! The optimizer swap file (`offload_optimizer.device = "nvme"`):
//!
//! A swap-file error (truncated, corrupted, deleted or foreign file, a
//! failed write) fails the step on every rank: the rank whose file failed
//! reports the file, the others name that rank. From then on
//! `Engine::step` and the gradient calls return an error saying so,
//! while `Engine::gather` and reading the parameters of its
//! `UnitGuard` keep working. What the state is then depends on the error:
//!
//! - A failed *write* (disk full, an I/O error) loses nothing: the tiles
//!   whose write failed are kept in host memory and the step completes
//!   on every rank (parameters, step count, parameter all-gather), then
//!   returns the error. The state after that step stays readable in full:
//!   `Engine::unit_state`, `Engine::save_checkpoint` (to another
//!   disk) and `Engine::export_safetensors` work, and a run resumed from
//!   that checkpoint continues bit-identically.
//! - Any other error (a failed read; the file truncated, corrupted,
//!   deleted or foreign) loses the optimizer state: no rank's parameters
//!   change in that step (updated parameters are committed only once every
//!   rank's tiles were read, updated and written, or kept), gather/params
//!   give the parameters of the last completed step, and
//!   `Engine::unit_state` and the checkpoint calls return an error.
//!
//! The parameter swap file (`offload_param.device = "nvme"`):
//!
//! A parameter swap-file error (a failed read in a micro-batch, a
//! truncated or deleted file, a failed write-back) fails the next
//! `Engine::step` on every rank (the rank whose file failed names it);
//! the micro-batch that saw a failed read ran on zeros for that shard and
//! nothing of it is applied. The shards live only in the files, so from
//! then on `Engine::gather` refuses as well ("the parameters are lost").
//! With `offload_param` `"cpu"` and an optimizer swap-file error, the
//! shards are written home only after every rank's optimizer step
//! succeeded: the parameters of the last completed step stay readable.

use zero_comm::agree::first_failure;
use zero_comm::Communicator;

use crate::{Error, Result};

/// The calls that only read the state: allowed after a rescued swap write
/// failure.
const READS_AFTER_RESCUE: &[&str] = &["unit_state", "save_checkpoint", "export_safetensors"];

/// The health of one engine.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) enum Health {
    /// Everything works.
    #[default]
    Ok,
    /// A write to the optimizer swap file failed, and every rank kept what
    /// it could not write in host memory: the step completed and the state
    /// after it is complete and readable, but training stops.
    Rescued {
        /// The first error.
        why: String,
    },
    /// The optimizer swap file failed otherwise: the optimizer state is
    /// lost; the parameters of the last completed step stay readable.
    StateLost {
        /// The first error.
        why: String,
    },
    /// The parameter swap file failed: the parameters live only there, so
    /// they are lost too and `gather` refuses.
    ParamsLost {
        /// The first error.
        why: String,
    },
    /// A collective failed: its buffers may still be held, so every call
    /// fails.
    CommFailed {
        /// The communication error.
        why: String,
    },
}

impl Health {
    /// Whether the engine may start a call at all (`Err`: the text of the
    /// refusal).
    pub(crate) fn check_comm(&self) -> std::result::Result<(), String> {
        match self {
            Health::CommFailed { why } => Err(format!(
                "the engine cannot continue after a communication error: {why}"
            )),
            _ => Ok(()),
        }
    }

    /// Whether `call` may run after a swap-file error (`Err`: the text of
    /// the refusal). `steps` is the number of the last completed step.
    pub(crate) fn check_swap(&self, call: &str, steps: u64) -> std::result::Result<(), String> {
        match self {
            Health::Ok | Health::CommFailed { .. } => Ok(()),
            Health::Rescued { .. } if READS_AFTER_RESCUE.contains(&call) => Ok(()),
            Health::Rescued { why } => Err(format!(
                "{call}: the engine cannot train after a swap-file error; the state after step \
                 {steps} is complete (what the swap file could not take is kept in host memory): \
                 save it with save_checkpoint to another disk and resume from there: {why}"
            )),
            Health::StateLost { why } | Health::ParamsLost { why } => Err(format!(
                "{call}: the engine cannot continue after a swap-file error (the optimizer state \
                 is lost; the parameters of step {steps} stay readable with gather/params): {why}"
            )),
        }
    }

    /// The error text of a parameter swap-file failure, if the parameters
    /// are lost.
    pub(crate) fn params_lost(&self) -> Option<&str> {
        match self {
            Health::ParamsLost { why } => Some(why),
            _ => None,
        }
    }

    /// Whether unit `name` may be gathered (`Err`: the refusal): not once
    /// the parameters are lost.
    pub(crate) fn check_gather(&self, name: &str) -> std::result::Result<(), String> {
        match self.params_lost() {
            Some(first) => Err(format!(
                "gather(`{name}`): the parameters are lost with the parameter swap file \
                 (offload_param.device \"nvme\"): {first}"
            )),
            None => Ok(()),
        }
    }

    /// After a call that may run collectives returned `r`: a
    /// communication error fails the engine, and so does an access of the
    /// gradient path not ordered after the one before it (an ordering bug,
    /// caught by a checked backend: a bucket may be lost with its
    /// collective, and the peers failed).
    pub(crate) fn after<R>(&mut self, r: &Result<R>) {
        match r {
            Err(Error::Comm(e)) => self.comm_failed(e.to_string()),
            Err(Error::Core(e @ zero_core::Error::Hazard(_))) => self.comm_failed(e.to_string()),
            _ => {}
        }
    }

    /// A communication error: every later call fails.
    pub(crate) fn comm_failed(&mut self, why: String) {
        *self = Health::CommFailed { why };
    }

    /// A failed swap write that every rank rescued.
    pub(crate) fn rescued(&mut self, why: String) {
        if matches!(self, Health::Ok | Health::Rescued { .. }) {
            *self = Health::Rescued { why };
        }
    }

    /// The optimizer state is lost (unless something worse happened
    /// already, whose text is then replaced by this newer one).
    pub(crate) fn state_lost(&mut self, why: String) {
        *self = match self {
            Health::ParamsLost { .. } => Health::ParamsLost { why },
            Health::CommFailed { .. } => return,
            _ => Health::StateLost { why },
        };
    }

    /// The parameters are lost with their swap file.
    pub(crate) fn params_lost_now(&mut self, why: String) {
        if !matches!(self, Health::CommFailed { .. }) {
            *self = Health::ParamsLost { why };
        }
    }
}

/// The verdicts on swap files: every rank learns whether every rank's
/// file worked (a collective), and the health follows.
impl Health {
    /// Every rank learns whether every rank's `r` (a step's or a
    /// micro-batch's use of the parameter swap file) worked. On an error
    /// anywhere the parameters are lost: this rank's own error, or one
    /// saying `lost(bad, why)` of the first rank that failed.
    pub(crate) fn params_verdict<C: Communicator>(
        &mut self,
        comm: &C,
        r: Result<()>,
        lost: impl FnOnce(usize, String) -> String,
    ) -> Result<()> {
        let failed = first_failure(comm, r.as_ref().err())?;
        if let Err(e) = r {
            self.params_lost_now(e.to_string());
            return Err(e);
        }
        if let Some((bad, why)) = failed {
            let what = lost(bad, why);
            self.params_lost_now(what.clone());
            return Err(Error::Usage {
                rank: comm.rank(),
                what,
            });
        }
        Ok(())
    }

    /// Outside the step (reading the state): every rank learns whether
    /// every rank could read its `what` swap file (`local`: this rank's
    /// error); on an error the optimizer state is lost (also after a
    /// rescued write failure). This rank's own error is left to its caller.
    pub(crate) fn read_verdict<C: Communicator>(
        &mut self,
        comm: &C,
        local: Option<&Error>,
        what: &str,
    ) -> Result<()> {
        let failed = first_failure(comm, local)?;
        if let Some(e) = local {
            self.state_lost(e.to_string());
            return Ok(());
        }
        if let Some((bad, why)) = failed {
            let what = format!("the {what} swap file of rank {bad} could not be read: {why}");
            self.state_lost(what.clone());
            return Err(Error::Usage {
                rank: comm.rank(),
                what,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_each_state_allows() {
        let why = || "disk gone".to_string();
        let ok = Health::Ok;
        assert!(ok.check_comm().is_ok() && ok.check_swap("step", 3).is_ok());
        assert_eq!(ok.params_lost(), None);

        let mut h = Health::Ok;
        h.rescued(why());
        assert!(h.check_swap("save_checkpoint", 3).is_ok());
        assert!(h.check_swap("unit_state", 3).is_ok());
        let e = h.check_swap("step", 3).unwrap_err();
        assert!(
            e.contains("cannot train") && e.contains("after step 3") && e.contains("disk gone")
        );

        h.state_lost("read failed".into());
        assert!(h.check_swap("save_checkpoint", 3).is_err());
        assert_eq!(h.params_lost(), None);
        // A rescue never hides a loss.
        h.rescued(why());
        assert!(matches!(h, Health::StateLost { .. }));

        h.params_lost_now("param file gone".into());
        assert_eq!(h.params_lost(), Some("param file gone"));
        h.state_lost("later".into());
        assert_eq!(h.params_lost(), Some("later"));
        assert!(h.check_comm().is_ok());

        h.comm_failed("timeout".into());
        assert!(h.check_comm().unwrap_err().contains("timeout"));
        h.params_lost_now("x".into());
        h.state_lost("y".into());
        assert!(matches!(h, Health::CommFailed { .. }));
    }
}
