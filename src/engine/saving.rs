//! What an engine's checkpoints record and keep besides the state
//! ([`SaveHow`]): fixed at build ([`EngineBuilder`](super::EngineBuilder)'s
//! `seed`, `keep_last_checkpoints`, `checkpoint_frozen` and the config's
//! `stage3_gather_16bit_weights_on_model_save`), read by every
//! [`Engine::save_checkpoint`](super::Engine::save_checkpoint)
//! (`checkpoint.rs`).

use serde_json::Value;

use super::ctx::Ctx;
use super::progress::Progress;
use crate::format::checkpoint::SavedRun;

/// How `checkpoint::save` saves, besides the state, fixed at build.
#[derive(Debug, Clone, Copy)]
pub(super) struct SaveHow {
    /// `stage3_gather_16bit_weights_on_model_save`: the consolidated
    /// weights too.
    pub(super) model: bool,
    /// `EngineBuilder::checkpoint_frozen`: the frozen tensors too.
    pub(super) frozen: bool,
    /// Checkpoints kept (0: all).
    pub(super) keep_last: usize,
    /// The seed of the initialisers (recorded in the manifest).
    pub(super) seed: u64,
}

impl SaveHow {
    /// What a checkpoint records of the run at `progress` on `cx`: the
    /// config, the world size, stage and parameter dtype, the seed, the
    /// step counts and the loss scaler, and the trainer's `client_state`;
    /// `Err` (why) where the config cannot be written as JSON.
    pub(super) fn run<C, B>(
        &self,
        progress: &Progress,
        cx: &Ctx<C, B>,
        client_state: Value,
    ) -> Result<SavedRun, String> {
        let config = serde_json::to_value(&cx.cfg).map_err(|e| {
            format!("save_checkpoint: the resolved config cannot be written as JSON ({e})")
        })?;
        Ok(SavedRun {
            world_size: cx.world,
            stage: cx.stage,
            param_dtype: cx.pdt,
            steps: progress.steps(),
            global_steps: progress.global_steps(),
            loss_scaler: progress.scaler().cloned(),
            seed: self.seed,
            config,
            client_state,
        })
    }
}
