//! What [`Engine::stats`](super::Engine::stats) shows: the counters, with
//! the traffic of the swap files counted from the last reset.

use super::backend::EngineBackend;
use super::grad_swap::GradSwap;
use super::offload::Offload;
use super::optimizer::OptimizerShard;
use super::param_offload::ParamOffload;
use super::reducer::GradReducer;
use super::stats::{EngineStats, SwapTraffic};

/// Where the swap files are: the optimizer's (in its offload), the
/// parameters' and the gradients' (in the reducer), each where the config
/// has one.
pub(super) type SwapFiles<'a, B> = (
    &'a OptimizerShard<B>,
    Option<&'a ParamOffload>,
    &'a GradReducer<B>,
);

/// The traffic of the optimizer, parameter and gradient swap files since
/// the build (zero where there is none).
fn traffic<B: EngineBackend>((opt, poff, reducer): SwapFiles<'_, B>) -> [SwapTraffic; 3] {
    [
        opt.offload().map(Offload::traffic).unwrap_or_default(),
        poff.map(ParamOffload::traffic).unwrap_or_default(),
        reducer
            .grad_swap()
            .map(GradSwap::traffic)
            .unwrap_or_default(),
    ]
}

/// The counters [`Engine::stats`](super::Engine::stats) shows: the swap
/// files' traffic counted from the last reset.
#[derive(Default)]
pub(super) struct Meter {
    /// The counters (the swap traffic as of the last [`Meter::refresh`]).
    pub(super) stats: EngineStats,
    /// The swap traffic of the optimizer, parameter and gradient files at
    /// the last reset.
    base: [SwapTraffic; 3],
}

impl Meter {
    /// Brings the swap counters up to the `files`' traffic now.
    pub(super) fn refresh<B: EngineBackend>(&mut self, files: SwapFiles<'_, B>) {
        let ([o, p, g], [bo, bp, bg]) = (traffic(files), self.base);
        self.stats.optimizer_swap = o - bo;
        self.stats.param_swap = p - bp;
        self.stats.grad_swap = g - bg;
    }

    /// Starts counting again at the `files`' traffic now, with `live`
    /// elements gathered (the live-parameter peak so far).
    pub(super) fn reset<B: EngineBackend>(&mut self, files: SwapFiles<'_, B>, live: usize) {
        self.base = traffic(files);
        self.stats = EngineStats::default();
        self.stats.peak_live_elems = live;
    }
}
