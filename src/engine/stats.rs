//! The engine's time and traffic counters.

use std::time::Duration;

pub use crate::trace::SwapTraffic;

/// Time and traffic counters, for benchmarks and logs. Times are wall
/// time this rank spent in each phase; bytes are what this rank sent, as a
/// ring algorithm moves them ((N-1)/N of the buffer per reduce-scatter or
/// all-gather, twice that per all-reduce).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Waiting for, and storing, gradient reductions.
    pub reduce_time: Duration,
    /// Norm, clipping and AdamW.
    pub optimizer_time: Duration,
    /// Parameter all-gathers (stages 1–2 after the step; stage 3 gathers
    /// the trainer waited for).
    pub gather_time: Duration,
    /// Bytes sent for gradient reductions.
    pub reduce_bytes: u64,
    /// Bytes sent for parameter all-gathers.
    pub gather_bytes: u64,
    /// Of `gather_bytes`: the all-gathers of frozen segments (stage 3
    /// with `frozen_params` `"shard"` or `"offload"`; 0 when they are
    /// resident).
    pub frozen_gather_bytes: u64,
    /// Stage 3: bytes copied on the device into the buffers parameters
    /// are gathered in (this rank's shards into their slots, trainable
    /// and frozen). A gathered frozen segment is read where its
    /// all-gather landed, so it adds nothing here.
    pub gather_copy_bytes: u64,
    /// Bytes this rank read from a checkpoint's rank files in
    /// [`Engine::load_checkpoint`](super::Engine::load_checkpoint): whole CRC blocks, those that hold the
    /// elements the rank needs, each read once without offload (with
    /// offload a block two ranges share may be read again, and with both
    /// optimizer and parameter offload the master twice).
    pub checkpoint_read_bytes: u64,
    /// Stage 3: most elements ever gathered at once (in use, kept for
    /// reuse, prefetched or persistent).
    pub peak_live_elems: usize,
    /// Stage 3: all-gathers issued ahead of use.
    pub prefetches: u64,
    /// Stage 3: gathers that found their unit already resident or in flight.
    pub prefetch_hits: u64,
    /// Stage 3 with `offload_param.device = "nvme"`: gathers whose shard
    /// read from the swap file was issued ahead of them.
    pub param_reads_ahead: u64,
    /// Stage 3 with `offload_param.device = "nvme"`: shard reads from the
    /// parameter swap file (a gather whose shard was not in the host cache
    /// of `offload_param.max_in_cpu` elements).
    pub param_swap_reads: u64,
    /// Stage 3 with `offload_param.device = "nvme"`: gathers whose shard
    /// came from the host cache (`offload_param.max_in_cpu`), with no swap
    /// read.
    pub param_cache_hits: u64,
    /// Stage 3: micro-batches whose gather order differed from the recorded
    /// one (or ended early), so that their order was recorded instead.
    pub gather_order_changes: u64,
    /// `offload_optimizer.device = "nvme"`: the optimizer swap file's
    /// traffic (refreshed at the end of every `step()` call).
    pub optimizer_swap: SwapTraffic,
    /// `offload_param.device = "nvme"`: the parameter swap file's traffic.
    pub param_swap: SwapTraffic,
    /// `offload_optimizer.swap_gradients`: the gradient swap file's
    /// traffic.
    pub grad_swap: SwapTraffic,
}
