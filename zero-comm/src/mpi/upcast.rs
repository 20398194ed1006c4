//! f32 accumulation for reductions that cross nodes.
//!
//! MPI reduces f32 (`MPI_FLOAT`); bf16 and f16 are widened on the way in
//! and rounded once on the way out, so every reduction accumulates in f32
//! as [`crate::reference_reduce`] does, and Avg divides the f32 sum by the
//! world size before the single rounding. Max uses [`nan_max`], an MPI
//! operation with the same semantics as [`ReduceOp::Max`] (NaN wins, ties
//! keep the lower rank's value), declared non-commutative so that MPI
//! applies it in rank order.

use std::ffi::{c_int, c_void};

use zero_core::Element;

use crate::reduce::TILE;
use crate::ReduceOp;

/// Widens `n` elements at `src` into `dst[..n]`.
///
/// # Safety
/// `src` valid for reading `n` elements, not written meanwhile.
pub(crate) unsafe fn widen<T: Element>(src: *const T, dst: &mut [f32]) {
    // SAFETY: valid for dst.len() elements (caller).
    let x = unsafe { std::slice::from_raw_parts(src, dst.len()) };
    for (d, v) in dst.iter_mut().zip(x) {
        *d = v.to_f32();
    }
}

/// `acc[i] = x_0[i] ∘ x_1[i] ∘ ...` over `srcs` in order, in f32, without
/// the final Avg division (so partial results can be combined further).
///
/// # Safety
/// Every source valid for reading `acc.len()` elements, not written meanwhile.
pub(crate) unsafe fn reduce_partial<T: Element>(srcs: &[*const T], acc: &mut [f32], op: ReduceOp) {
    let len = acc.len();
    let mut start = 0;
    while start < len {
        let n = TILE.min(len - start);
        let a = &mut acc[start..start + n];
        for (p, &src) in srcs.iter().enumerate() {
            // SAFETY: src valid for len elements (caller).
            let x = unsafe { std::slice::from_raw_parts(src.add(start), n) };
            if p == 0 {
                for (d, v) in a.iter_mut().zip(x) {
                    *d = v.to_f32();
                }
            } else {
                for (d, v) in a.iter_mut().zip(x) {
                    *d = op.combine(*d, v.to_f32());
                }
            }
        }
        start += n;
    }
}

/// Finishes `acc` (Avg: divides by `world`), rounds once to `T` and writes
/// the result to every destination.
///
/// # Safety
/// Every destination valid for writing `acc.len()` elements, accessed by
/// nobody else meanwhile.
pub(crate) unsafe fn finish_into<T: Element>(
    acc: &[f32],
    op: ReduceOp,
    world: usize,
    dsts: &[*mut T],
) {
    let mut start = 0;
    let mut out = [T::from_f32(0.0); TILE];
    while start < acc.len() {
        let n = TILE.min(acc.len() - start);
        for (o, a) in out[..n].iter_mut().zip(&acc[start..start + n]) {
            *o = T::from_f32(op.finish(*a, world));
        }
        for &d in dsts {
            // SAFETY: d valid for acc.len() elements (caller); `out` is a
            // local array, so the ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), d.add(start), n) };
        }
        start += n;
    }
}

/// The MPI user function of NaN-propagating max on `MPI_FLOAT`:
/// `inout[i] = combine(in[i], inout[i])`, where `in` holds the lower ranks.
///
/// # Safety
/// Called by MPI with `len` valid floats at both pointers.
pub(crate) unsafe extern "C" fn nan_max(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _dt: *mut ::mpi::ffi::MPI_Datatype,
) {
    // SAFETY: MPI passes a valid length and two distinct arrays of that many
    // elements of the op's datatype, which is always MPI_FLOAT here.
    unsafe {
        let n = usize::try_from(*len).unwrap_or(0);
        let a = std::slice::from_raw_parts(invec.cast::<f32>(), n);
        let b = std::slice::from_raw_parts_mut(inoutvec.cast::<f32>(), n);
        for (y, &x) in b.iter_mut().zip(a) {
            *y = ReduceOp::Max.combine(x, *y);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference_reduce;
    use half::bf16;

    #[test]
    fn partial_then_finish_matches_reference() {
        let a: Vec<bf16> = (0..5000).map(|i| bf16::from_f32(i as f32 * 0.37)).collect();
        let b: Vec<bf16> = (0..5000)
            .map(|i| bf16::from_f32(1.0 / (1.0 + i as f32)))
            .collect();
        for op in ReduceOp::ALL {
            let want = reference_reduce(&[&a, &b], op);
            let mut acc = vec![0f32; a.len()];
            let mut out = vec![bf16::ZERO; a.len()];
            // SAFETY: the vectors live for the calls and are only used here.
            unsafe {
                reduce_partial(&[a.as_ptr(), b.as_ptr()], &mut acc, op);
                finish_into(&acc, op, 2, &[out.as_mut_ptr()]);
            }
            assert_eq!(out, want, "{op}");
        }
    }

    #[test]
    fn nan_max_keeps_rank_order_semantics() {
        let mut lo = [1.0f32, f32::NAN, 3.0, 0.0];
        let mut hi = [2.0f32, 5.0, f32::NAN, -0.0];
        let mut n: c_int = 4;
        // SAFETY: both arrays hold n floats.
        unsafe {
            nan_max(
                lo.as_mut_ptr().cast(),
                hi.as_mut_ptr().cast(),
                &mut n,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(hi[0], 2.0);
        assert!(hi[1].is_nan() && hi[2].is_nan());
        // A tie keeps the lower rank's value, as the reference does.
        assert!(hi[3] == 0.0 && hi[3].is_sign_positive());
        let _ = &mut lo;
    }
}
