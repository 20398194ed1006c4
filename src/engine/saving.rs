//! What an engine's checkpoints record and keep besides the state
//! ([`SaveHow`]): fixed at build ([`EngineBuilder`](super::EngineBuilder)'s
//! `seed`, `keep_last_checkpoints`, `checkpoint_frozen` and the config's
//! `stage3_gather_16bit_weights_on_model_save`), read by every
//! [`Engine::save_checkpoint`](super::Engine::save_checkpoint)
//! (`checkpoint.rs`).

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
