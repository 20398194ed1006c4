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

/// Bytes that one call writes above which stores bypass the caches
/// (non-temporal stores). Large collectives write far more than the caches
/// hold, so ordinary stores only evict useful lines and make the memory
/// controller interleave write-backs with reads; below this size the result
/// is likely to be read again soon and stays cached.
pub(crate) const STREAM_MIN_BYTES: usize = 4 << 20;

/// Copies `n` bytes with non-temporal stores where the platform has them
/// (x86-64: SSE2, always present), ordinary stores elsewhere. Does not
/// fence: callers that stream call [`stream_fence`] once at the end.
///
/// # Safety
/// `src` valid for reading and `dst` for writing `n` bytes; no overlap.
#[inline]
unsafe fn stream_bytes(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let head = dst.align_offset(16).min(n);
        let body = (n - head) / 16;
        // SAFETY: all offsets stay below n (caller: both ranges valid and
        // disjoint); the streamed stores go to 16-byte aligned addresses
        // (dst + head is aligned) as _mm_stream_si128 requires, loads are
        // unaligned. SSE2 is part of the x86-64 baseline.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (s, d) = (src.add(head), dst.add(head));
            for i in 0..body {
                let v = _mm_loadu_si128(s.add(16 * i).cast::<__m128i>());
                _mm_stream_si128(d.add(16 * i).cast::<__m128i>(), v);
            }
            let done = head + 16 * body;
            std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n - done);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: forwarded from the caller.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    };
}

/// Orders earlier non-temporal stores before every later store (they are
/// weakly ordered on x86-64), so a peer that sees a later flag sees the data.
#[inline]
fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions; SSE is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
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
    // Stream only into destinations that are not also sources: an in-place
    // destination was just read, its lines are in cache, and writing them
    // back normally is cheaper than streaming over them.
    let fresh = |d: *mut T| !srcs.iter().any(|&s| std::ptr::eq(s, d));
    let stream = len * std::mem::size_of::<T>() * dsts.iter().filter(|&&d| fresh(d)).count()
        >= STREAM_MIN_BYTES;
    let mut acc = [0f32; TILE];
    let mut narrow = [T::zeroed(); TILE];
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
        if stream {
            for (o, a) in narrow.iter_mut().zip(acc.iter()) {
                *o = T::from_f32(*a);
            }
        }
        for &dst in dsts {
            if stream && fresh(dst) {
                // SAFETY: dst + start is valid for n elements, only this
                // thread writes it; `narrow` is a distinct local array.
                unsafe {
                    stream_bytes(
                        narrow.as_ptr().cast(),
                        dst.add(start).cast(),
                        n * std::mem::size_of::<T>(),
                    )
                };
                continue;
            }
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
    if stream {
        stream_fence();
    }
}

/// In-place all-reduce of `bufs[p][..len]` over p, writing the result into
/// every buffer: the same arithmetic as [`reduce_into`] (f32 accumulation in
/// rank order, one rounding), fused into one loop per element. When every
/// destination is also a source this does 2 memory operations per element
/// and rank instead of 4–5, which matters when the data is in cache.
///
/// # Safety
/// Every pointer valid for reads and writes of `len` elements, pairwise
/// disjoint, and touched by no other thread during the call.
pub(crate) unsafe fn reduce_in_place<T: Element>(bufs: &[*mut T], len: usize, op: ReduceOp) {
    macro_rules! fused {
        ($n:literal) => {{
            let b: [&mut [T]; $n] = std::array::from_fn(|p| {
                // SAFETY: forwarded from the caller: the n buffers are
                // distinct, valid for len elements and exclusive to us.
                unsafe { std::slice::from_raw_parts_mut(bufs[p], len) }
            });
            match op {
                ReduceOp::Sum => fused::<T, $n, 1>(b),
                ReduceOp::Avg => fused::<T, $n, 2>(b),
                ReduceOp::Max => fused::<T, $n, 3>(b),
            }
        }};
    }
    match bufs.len() {
        0 => {}
        1 => {
            // One rank: sum and max are the identity, avg divides by 1.
            // SAFETY: forwarded.
            unsafe { reduce_into(&[bufs[0].cast_const()], bufs, len, op) }
        }
        2 => fused!(2),
        3 => fused!(3),
        4 => fused!(4),
        5 => fused!(5),
        6 => fused!(6),
        7 => fused!(7),
        8 => fused!(8),
        _ => {
            let srcs: Vec<*const T> = bufs.iter().map(|&b| b.cast_const()).collect();
            // SAFETY: forwarded; in place is allowed by reduce_into.
            unsafe { reduce_into(&srcs, bufs, len, op) }
        }
    }
}

/// The fused loop, monomorphized per rank count and operator (`OP` is
/// [`ReduceOp::code`]) so the compiler vectorizes it.
#[inline(always)]
fn fused<T: Element, const N: usize, const OP: u8>(mut b: [&mut [T]; N]) {
    let op = match OP {
        1 => ReduceOp::Sum,
        2 => ReduceOp::Avg,
        _ => ReduceOp::Max,
    };
    let len = b[0].len();
    for x in b.iter() {
        assert_eq!(x.len(), len);
    }
    for i in 0..len {
        let mut acc = b[0][i].to_f32();
        for x in b.iter().skip(1) {
            acc = op.combine(acc, x[i].to_f32());
        }
        let v = T::from_f32(op.finish(acc, N));
        for x in b.iter_mut() {
            x[i] = v;
        }
    }
}

/// Copies `src[..len]` into every destination, reading the source once:
/// tile by tile, each tile is loaded from memory once and stored to every
/// destination while it is in cache. A destination equal to `src` is
/// skipped. Streams (non-temporal stores) when the bytes written reach
/// [`STREAM_MIN_BYTES`].
///
/// # Safety
/// `src` valid for reads and every destination for writes of `len`
/// elements; destinations do not overlap each other or `src` (unless equal
/// to it), and nobody else writes any of them during the call.
pub(crate) unsafe fn copy_to_all<T: Copy>(src: *const T, dsts: &[*mut T], len: usize) {
    let others = dsts.iter().filter(|&&d| !std::ptr::eq(d, src)).count();
    let bytes = len * std::mem::size_of::<T>();
    if bytes * others < STREAM_MIN_BYTES {
        for &d in dsts {
            // SAFETY: forwarded; copy skips d == src.
            unsafe { copy(src, d, len) };
        }
        return;
    }
    // 64 KiB tiles: stay in L2 between the stores to each destination.
    let tile = (64 << 10) / std::mem::size_of::<T>();
    let mut start = 0;
    while start < len {
        let n = tile.min(len - start);
        for &d in dsts {
            if !std::ptr::eq(d, src) {
                // SAFETY: start + n <= len; ranges valid and disjoint (caller).
                unsafe {
                    stream_bytes(
                        src.add(start).cast(),
                        d.add(start).cast(),
                        n * std::mem::size_of::<T>(),
                    )
                };
            }
        }
        start += n;
    }
    stream_fence();
}

/// Copies `len` elements; the ranges must not overlap unless equal.
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `len` elements, not
/// written by anyone else during the call.
pub(crate) unsafe fn copy<T: Copy>(src: *const T, dst: *mut T, len: usize) {
    if len == 0 || std::ptr::eq(src, dst) {
        return;
    }
    let bytes = len * std::mem::size_of::<T>();
    if bytes >= STREAM_MIN_BYTES {
        // SAFETY: caller guarantees validity; distinct ranges do not overlap.
        unsafe { stream_bytes(src.cast(), dst.cast(), bytes) };
        stream_fence();
    } else {
        // SAFETY: caller guarantees validity; distinct ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    }
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
    fn fused_in_place_matches_reference_for_every_rank_count() {
        for n in 1..=10usize {
            let inputs: Vec<Vec<bf16>> = (0..n)
                .map(|p| {
                    (0..3001)
                        .map(|i| bf16::from_f32(((i * 7 + p * 13) % 101) as f32 * 0.173 - 8.0))
                        .collect()
                })
                .collect();
            let refs: Vec<&[bf16]> = inputs.iter().map(|v| &v[..]).collect();
            for op in ReduceOp::ALL {
                let want = reference_reduce(&refs, op);
                let mut bufs = inputs.clone();
                let ptrs: Vec<*mut bf16> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
                // SAFETY: n distinct vectors of 3001 elements, used only here.
                unsafe { reduce_in_place(&ptrs, 3001, op) };
                for b in &bufs {
                    assert_eq!(b, &want, "n={n} {op}");
                }
            }
        }
    }

    #[test]
    fn streaming_paths_handle_misaligned_heads_and_tails() {
        // Large enough to take the non-temporal path, destinations offset by
        // 1..7 elements so neither end is 16-byte aligned.
        let n = STREAM_MIN_BYTES / 2 + 37;
        let src: Vec<bf16> = (0..n + 8)
            .map(|i| bf16::from_f32((i % 977) as f32))
            .collect();
        for shift in 1..8 {
            let mut dst = vec![bf16::ZERO; n + 16];
            // SAFETY: both vectors hold more than shift + n elements.
            unsafe { copy(src.as_ptr().add(shift), dst.as_mut_ptr().add(shift), n) };
            assert_eq!(&dst[shift..shift + n], &src[shift..shift + n]);
            assert!(dst[..shift]
                .iter()
                .chain(&dst[shift + n..])
                .all(|x| *x == bf16::ZERO));

            let other: Vec<bf16> = src.iter().map(|x| -*x).collect();
            let mut out = vec![bf16::ZERO; n + 16];
            // Out of place: the destination is not a source, so it streams.
            // SAFETY: all ranges in bounds and distinct.
            unsafe {
                reduce_into(
                    &[src.as_ptr().add(shift), other.as_ptr().add(shift)],
                    &[out.as_mut_ptr().add(shift)],
                    n,
                    ReduceOp::Max,
                )
            };
            let want = reference_reduce(
                &[&src[shift..shift + n], &other[shift..shift + n]],
                ReduceOp::Max,
            );
            assert_eq!(&out[shift..shift + n], &want[..]);
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
