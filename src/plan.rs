//! The sizes of the memory plan that the engine allocates and the
//! estimator ([`crate::estimate`]) counts: pure functions of the resolved
//! configuration and the partition plan, computed by both from this one
//! module (a pure plan executed twice), so the two cannot drift apart.
//!
//! ```text
//!   plan::{bucket_plan, grad_home_bytes, grad_swap_buffers, optimizer_tiles, upload_ring}
//!        ▲                                   ▲
//!   engine (reducer, grad_swap, offload)     estimate
//! ```

use std::ops::Range;

use zero_core::config::ResolvedConfig;
use zero_core::partition::PartitionPlan;

/// Whether gradient reductions overlap the backward pass: stage 0 always
/// (as DDP), stages 2–3 with `overlap_comm`; stage 1 reduces after it.
pub(crate) fn overlaps(cfg: &ResolvedConfig) -> bool {
    match cfg.zero.stage {
        0 => true,
        1 => false,
        _ => cfg.zero.overlap_comm,
    }
}

/// The gradient buckets of the memory plan (the engine allocates them, the
/// estimator counts them): their capacity in elements — as large as
/// `reduce_bucket_size` but no larger than the model, and at least the
/// largest unit — and how many: two when reductions overlap the backward
/// pass, else one.
pub(crate) fn bucket_plan(cfg: &ResolvedConfig, plan: &PartitionPlan) -> (usize, usize) {
    let largest = plan
        .units()
        .iter()
        .map(|u| u.padded_numel)
        .max()
        .unwrap_or(0);
    let cap = cfg
        .zero
        .reduce_bucket_size
        .min(plan.padded_numel())
        .max(largest);
    (cap, if overlaps(cfg) { 2 } else { 1 })
}

/// Per unit: the bytes of its gradient home (the rank's shard in the
/// accumulation dtype; 0 for a unit with only frozen tensors).
pub(crate) fn grad_home_bytes(cfg: &ResolvedConfig, plan: &PartitionPlan) -> Vec<usize> {
    let size = cfg.grad_accum_dtype.size_in_bytes();
    plan.units()
        .iter()
        .map(|l| {
            if l.is_trainable() {
                l.shard_len * size
            } else {
                0
            }
        })
        .collect()
}

/// The host buffers of the gradient swap: how many, and their size (the
/// memory plan's figure, also the estimator's).
pub(crate) fn grad_swap_buffers(cfg: &ResolvedConfig, largest_home_bytes: usize) -> (usize, usize) {
    (
        cfg.zero.offload_optimizer.buffer_count.max(2),
        largest_home_bytes.max(1),
    )
}

/// Stage 3 on a device backend: the host buffers that shards kept in host
/// memory go up through to their gathers — how many, and their length in
/// elements: the largest shard that goes up, the trainable shards with
/// `offload_param` (`param_offloading`) and the frozen shards with
/// `frozen_params` `offload` (`frozen_offloaded`); a frozen segment kept
/// resident or sharded on the device never goes up, so it does not size
/// them. `None` when nothing goes up.
pub(crate) fn upload_ring(
    cfg: &ResolvedConfig,
    plan: &PartitionPlan,
    param_offloading: bool,
    frozen_offloaded: bool,
) -> Option<(usize, usize)> {
    if !(param_offloading || frozen_offloaded) {
        return None;
    }
    let len = plan
        .units()
        .iter()
        .map(|u| {
            let trainable = if param_offloading { u.shard_len } else { 0 };
            let frozen = if frozen_offloaded {
                u.frozen_shard_len()
            } else {
                0
            };
            trainable.max(frozen)
        })
        .max()
        .unwrap_or(0)
        .max(1);
    Some((cfg.zero.offload_param.buffer_count.max(2), len))
}

/// The tiles over the flat state of units with `state_lens` elements:
/// `sub_group_size` elements each (the last one shorter), across unit
/// boundaries, or with `swap_gradients` ending at each unit's end.
pub(crate) fn optimizer_tiles(cfg: &ResolvedConfig, state_lens: &[usize]) -> Vec<Range<usize>> {
    let sg = cfg.zero.sub_group_size.max(1);
    let total: usize = state_lens.iter().sum();
    let mut ends = Vec::new();
    if cfg.zero.offload_optimizer.swap_gradients {
        let mut at = 0;
        for &n in state_lens {
            at += n;
            ends.push(at);
        }
    }
    ends.push(total);
    let mut tiles = Vec::new();
    let (mut a, mut e) = (0, 0);
    while a < total {
        while ends[e] <= a {
            e += 1;
        }
        let b = (a + sg).min(ends[e]);
        tiles.push(a..b);
        a = b;
    }
    tiles
}
