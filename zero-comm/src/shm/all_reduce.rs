//! All-reduce in one pass over memory, in place.
//!
//! The buffer is cut into N chunks (cache-line aligned). Rank r reduces
//! chunk r straight from every rank's buffer and writes the result back into
//! every rank's buffer, so each rank reads L and writes L elements, the
//! traffic of one memcpy, with no staging copy:
//!
//! ```text
//!            chunk 0        chunk 1
//!  rank 0  [ a0 | a1 ]      rank 0 computes s0 = a0+b0 → writes s0 into both
//!  rank 1  [ b0 | b1 ]      rank 1 computes s1 = a1+b1 → writes s1 into both
//!  after   [ s0 | s1 ] on every rank
//! ```
//!
//! Chunks are disjoint, so no two ranks touch the same element; the sum
//! runs in rank order, so the result does not depend on who computes it.

use zero_core::Element;

use super::Ctx;
use crate::reduce::{reduce_in_place, reduce_into};

/// The range of chunk `r` of `len` elements over `n` ranks, aligned to
/// 64 bytes so that ranks never share a cache line.
pub(crate) fn chunk<T>(len: usize, n: usize, r: usize) -> std::ops::Range<usize> {
    let per_line = (64 / std::mem::size_of::<T>()).max(1);
    let per = len.div_ceil(n).div_ceil(per_line) * per_line;
    let lo = (r * per).min(len);
    lo..((r + 1) * per).min(len)
}

/// # Safety
/// See `ShmGroup::run`; every rank's `send == recv` holds `desc.len` elements.
pub(crate) unsafe fn run<T: Element>(ctx: &Ctx<'_>) {
    let n = ctx.peers.len();
    let range = chunk::<T>(ctx.desc.len, n, ctx.rank);
    if range.is_empty() {
        return;
    }
    // SAFETY: each peer's buffer holds desc.len elements and range lies
    // within it; only this rank touches chunk `rank` of any buffer.
    unsafe {
        let srcs: Vec<*const T> = (0..n).map(|p| ctx.send::<T>(p).add(range.start)).collect();
        let dsts: Vec<*mut T> = (0..n).map(|p| ctx.recv::<T>(p).add(range.start)).collect();
        let op = ctx.desc.reduce.expect("all_reduce has an op");
        if srcs.iter().zip(&dsts).all(|(&s, &d)| std::ptr::eq(s, d)) {
            // In place on every rank (the public API): the fused kernel.
            reduce_in_place(&dsts, range.len(), op);
        } else {
            reduce_into(&srcs, &dsts, range.len(), op);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::chunk;

    #[test]
    fn chunks_tile_the_buffer_aligned() {
        for len in [0usize, 1, 15, 16, 17, 1000, 4097] {
            for n in 1..=9 {
                let mut next = 0;
                for r in 0..n {
                    let c = chunk::<f32>(len, n, r);
                    assert_eq!(c.start, next);
                    assert!(c.start.is_multiple_of(16) || c.start == len);
                    next = c.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
