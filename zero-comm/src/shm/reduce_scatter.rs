//! Reduce-scatter: each rank pulls and reduces its own part.
//!
//! Rank r owns `counts[r]` elements at offset `o_r` of the input. It reads
//! that range from every rank's input and writes the reduction to its own
//! output only:
//!
//! ```text
//!  input    rank 0 [ a0 | a1 | a2 ]   rank 1 [ b0 | b1 | b2 ]   rank 2 [ c0 | c1 | c2 ]
//!  output   rank 0 [ a0+b0+c0 ]       rank 1 [ a1+b1+c1 ]       rank 2 [ a2+b2+c2 ]
//! ```
//!
//! In place, the output is the rank's own part of its input: no other rank
//! reads that range, so writing it is safe.

use zero_core::Element;

use super::Ctx;
use crate::counts::offsets;
use crate::reduce::reduce_into;

/// # Safety
/// See `ShmGroup::run`; sends hold `sum(counts)` elements, this rank's recv
/// holds `counts[rank]`.
pub(crate) unsafe fn run<T: Element>(ctx: &Ctx<'_>) {
    let n = ctx.peers.len();
    let off = offsets(ctx.counts)[ctx.rank];
    let count = ctx.counts[ctx.rank];
    if count == 0 {
        return;
    }
    // SAFETY: off + count <= sum(counts) = every send's length; recv holds
    // count elements and only this rank writes it.
    unsafe {
        let srcs: Vec<*const T> = (0..n).map(|p| ctx.send::<T>(p).add(off)).collect();
        let dst = [ctx.recv::<T>(ctx.rank)];
        reduce_into(
            &srcs,
            &dst,
            count,
            ctx.desc.reduce.expect("reduce_scatter has an op"),
        );
    }
}
