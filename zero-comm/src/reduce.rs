//! Reduction operators and the element kernels that apply them.
//!
//! Every reduction accumulates in f32 in rank order 0, 1, ..., N-1:
//! `acc = x0; acc = op(acc, x1); ...`, and for [`ReduceOp::Avg`] divides the
//! sum by N at the end, then rounds once to the element type. Results are
//! therefore bit-identical to [`reference_reduce`], whatever the backend, the
//! thread timing or the chunking.

use zero_core::Element;

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Sum divided by the number of ranks.
    Avg,
    /// Maximum; NaN wins (a NaN anywhere gives NaN, so overflow checks see it).
    Max,
}

impl ReduceOp {
    /// All operators.
    pub const ALL: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

    /// Name for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Max => 3,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| o.code() == c)
    }

    #[inline(always)]
    pub(crate) fn combine(self, acc: f32, x: f32) -> f32 {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => acc + x,
            ReduceOp::Max => {
                if x > acc || x.is_nan() {
                    x
                } else {
                    acc
                }
            }
        }
    }

    #[inline(always)]
    pub(crate) fn finish(self, acc: f32, world: usize) -> f32 {
        match self {
            ReduceOp::Avg => acc / world as f32,
            _ => acc,
        }
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The sequential reference: reduces `inputs[0][i], inputs[1][i], ...` in
/// rank order with f32 accumulation. Tests compare every backend with it.
pub fn reference_reduce<T: Element>(inputs: &[&[T]], op: ReduceOp) -> Vec<T> {
    let n = inputs.first().map_or(0, |x| x.len());
    (0..n)
        .map(|i| {
            let mut acc = inputs[0][i].to_f32();
            for x in &inputs[1..] {
                acc = op.combine(acc, x[i].to_f32());
            }
            T::from_f32(op.finish(acc, inputs.len()))
        })
        .collect()
}

/// Elements per tile: the f32 accumulator (8 KiB) stays in L1 while the
/// ranks' inputs stream through.
pub(crate) const TILE: usize = 2048;

/// Reduces `srcs[p][..len]` over p into every `dsts[q][..len]`.
///
/// # Safety
/// Every pointer must be valid for `len` elements; no other thread may
/// write the source ranges or touch the destination ranges during the call.
/// A destination may equal a source (in-place): each tile is read
/// completely before it is written.
pub(crate) unsafe fn reduce_into<T: Element>(
    srcs: &[*const T],
    dsts: &[*mut T],
    len: usize,
    op: ReduceOp,
) {
    let world = srcs.len();
    let mut acc = [0f32; TILE];
    let mut start = 0;
    while start < len {
        let n = TILE.min(len - start);
        let acc = &mut acc[..n];
        for (p, &src) in srcs.iter().enumerate() {
            // SAFETY: src is valid for len elements (caller), and no one
            // writes this range while we read it.
            let x = unsafe { std::slice::from_raw_parts(src.add(start), n) };
            if p == 0 {
                for (a, v) in acc.iter_mut().zip(x) {
                    *a = v.to_f32();
                }
            } else {
                for (a, v) in acc.iter_mut().zip(x) {
                    *a = op.combine(*a, v.to_f32());
                }
            }
        }
        if op == ReduceOp::Avg {
            for a in acc.iter_mut() {
                *a = op.finish(*a, world);
            }
        }
        for &dst in dsts {
            // SAFETY: dst is valid for len elements and this thread is its
            // only accessor for the call (caller). The source slices above
            // are no longer used for this tile.
            let y = unsafe { std::slice::from_raw_parts_mut(dst.add(start), n) };
            for (o, a) in y.iter_mut().zip(acc.iter()) {
                *o = T::from_f32(*a);
            }
        }
        start += n;
    }
}

/// Copies `len` elements; the ranges must not overlap unless equal.
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `len` elements, not
/// written by anyone else during the call.
pub(crate) unsafe fn copy<T: Element>(src: *const T, dst: *mut T, len: usize) {
    if len == 0 || std::ptr::eq(src, dst) {
        return;
    }
    // SAFETY: caller guarantees validity; distinct ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn kernel_matches_reference_in_place_and_out_of_place() {
        let a: Vec<bf16> = (0..5000).map(|i| bf16::from_f32(i as f32 * 0.37)).collect();
        let b: Vec<bf16> = (0..5000)
            .map(|i| bf16::from_f32(1.0 / (1.0 + i as f32)))
            .collect();
        for op in ReduceOp::ALL {
            let want = reference_reduce(&[&a, &b], op);
            let (mut x, mut y) = (a.clone(), b.clone());
            // SAFETY: both vectors live for the call and are only used here.
            unsafe {
                reduce_into(
                    &[x.as_ptr(), y.as_ptr()],
                    &[x.as_mut_ptr(), y.as_mut_ptr()],
                    x.len(),
                    op,
                )
            };
            assert_eq!(x, want, "{op}");
            assert_eq!(y, want, "{op}");
        }
    }

    #[test]
    fn max_propagates_nan() {
        let a = [1.0f32, f32::NAN];
        let b = [f32::NAN, 2.0];
        let m = reference_reduce(&[&a[..], &b[..]], ReduceOp::Max);
        assert!(m[0].is_nan() && m[1].is_nan());
    }
}
