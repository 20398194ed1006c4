//! All-gather: each rank pulls every part into its own output.
//!
//! ```text
//!  input    rank 0 [ a ]        rank 1 [ b ]        rank 2 [ c ]
//!  output   rank 0 [ a | b | c ]  rank 1 [ a | b | c ]  rank 2 [ a | b | c ]
//! ```
//!
//! Rank r copies part p from rank p's input into its own output at offset
//! `o_p`. In place, a rank's input is its own part of its output, so that
//! copy is skipped and only the other parts move.

use zero_core::Element;

use super::Ctx;
use crate::counts::offsets;
use crate::reduce::copy;

/// # Safety
/// See `ShmGroup::run`; send p holds `counts[p]` elements, this rank's
/// recv holds `sum(counts)`.
pub(crate) unsafe fn run<T: Element>(ctx: &Ctx<'_>) {
    let offs = offsets(ctx.counts);
    let dst = ctx.recv::<T>(ctx.rank);
    for (p, (&off, &count)) in offs.iter().zip(ctx.counts).enumerate() {
        // SAFETY: send p holds counts[p] elements; the destination range
        // lies in this rank's recv, which only this rank writes. In place,
        // the source of p == rank is that same range, and copy skips it.
        unsafe { copy(ctx.send::<T>(p), dst.add(off), count) };
    }
}
