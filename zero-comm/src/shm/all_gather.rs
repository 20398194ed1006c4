//! All-gather: each rank pushes its part into every rank's output.
//!
//! ```text
//!  input    rank 0 [ a ]          rank 1 [ b ]          rank 2 [ c ]
//!  output   rank 0 [ a | b | c ]  rank 1 [ a | b | c ]  rank 2 [ a | b | c ]
//!           (rank 0 writes every `a`, rank 1 every `b`, rank 2 every `c`)
//! ```
//!
//! Rank r reads its own input once and stores it at offset `o_r` of every
//! rank's output, tile by tile while the tile is in cache. Reads total S
//! and writes N·S over all ranks (S: the output size), where pulling (each
//! rank copying every part into its own output) reads N·S: a quarter less
//! memory traffic for 2 ranks, which is what bounds large all-gathers. The
//! ranges written are disjoint: only rank r writes region r of any output.
//! In place, a rank's input is region r of its own output, so that store is
//! skipped.

use super::Ctx;
use crate::counts::offsets;
use crate::reduce::copy_to_all;

/// Moves elements of any type (a float dtype, or bytes): it only copies.
///
/// # Safety
/// See `ShmGroup::run`; send p holds `counts[p]` elements, every recv
/// holds `sum(counts)`.
pub(crate) unsafe fn run<T: Copy>(ctx: &Ctx<'_>) {
    let off = offsets(ctx.counts)[ctx.rank];
    let count = ctx.counts[ctx.rank];
    if count == 0 {
        return;
    }
    // SAFETY: every recv holds sum(counts) >= off + count elements; region
    // `rank` of every output is written by this rank only, and this rank's
    // input is only read. In place, the input is region `rank` of this
    // rank's own output, which copy_to_all skips.
    unsafe {
        let dsts: Vec<*mut T> = (0..ctx.peers.len())
            .map(|p| ctx.recv::<T>(p).add(off))
            .collect();
        copy_to_all(ctx.send::<T>(ctx.rank), &dsts, count);
    }
}
