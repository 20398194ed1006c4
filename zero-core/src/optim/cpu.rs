//! The fast CPU AdamW and gradient-norm pass: explicit SIMD chosen at run
//! time, several threads over tiles, bit-identical to the reference.
//!
//! [`CpuAdamW`] runs, in one pass over memory, the gradient unscale and clip
//! factor (folded into [`AdamWStep::grad_scale`]), the AdamW update with bias
//! correction and decoupled weight decay, and the write of the low-precision
//! copy of the updated parameter. Gradients may be f32, bf16 or f16; moments
//! f32 (the default) or bf16 (DeepSpeed's `bf16_optimizer_states`); the copy
//! f32, bf16 or f16, or none.
//!
//! # Dispatch
//!
//! [`Isa::best`] picks, at run time, the widest instruction set the CPU has:
//! AVX-512F, AVX2 with FMA and F16C, NEON on aarch64, or the scalar loop. No
//! `-C target-cpu` is needed: each path is compiled with `#[target_feature]`
//! and only called after the CPU was checked. Every path computes exactly the
//! operations of [`adamw_element`] in the same order (the same fused
//! multiply-adds, IEEE `sqrt` and division, which are correctly rounded in
//! every SIMD instruction set), converts bf16 like `half` (round to nearest
//! even, NaN kept quiet with its top payload bits) and f16 with the hardware
//! conversion (round to nearest even), so results are the same bits on every
//! path; `zero-core/tests/cpu_adam.rs` checks that element by element.
//!
//! # Threads and tiles
//!
//! The elements are cut into tiles of [`CpuAdamW::tile`] elements (default
//! [`DEFAULT_TILE`]: with four f32 streams in and four out, a tile's working
//! set stays within a core's L2) and [`CpuAdamW::threads`] threads (default:
//! the machine's cores) take tiles from a shared counter, so a core slowed by
//! other work takes fewer tiles. One call is one parallel region, also over
//! many slices ([`CpuAdamW::step_many`]): no barrier per tensor. Small calls
//! use fewer threads (at least [`MIN_ELEMS_PER_THREAD`] elements each), since
//! starting a thread costs about as much as updating 30 000 elements.
//!
//! # Inside a tile (x86)
//!
//! Blocks of 512 elements: first the update of master and moments (two
//! groups of lanes per iteration), then the low-precision copy from the
//! block's fresh master, still in L1. Narrowing right after the division
//! kept the vector scheduler full of operations waiting on the long
//! `sqrt`/`div` chains; on the development machine (Zen 3, AVX2) the
//! separate loop raised the fp32-state + bf16-copy step from 86–94% to
//! 92–98% of its roofline (a plain single pass over the same arrays;
//! `benches/cpu_adam.rs`).
//!
//! # Streaming stores
//!
//! The low-precision copy is written and not read again by the step, so on
//! x86 it is written with non-temporal stores by default (no read of the
//! destination line before the write, and it does not evict the state being
//! streamed); [`CpuAdamW::with_streaming_stores`] turns that off. The
//! benchmark measures both; on the development machine streaming was the
//! faster in most paired runs, by up to 10%. Master and moments are read
//! before they are written, so their lines are already in cache and are
//! stored normally. The NEON path has no streaming stores.
//!
//! # The norm pass
//!
//! [`CpuAdamW::sum_squares`] is [`sum_squares`] (same chunks, same 16 f64
//! lanes, same tree, same chunk order) with SIMD within a chunk and chunks
//! spread over the threads; the chunk sums are then added in chunk order.
//!
//! [`adamw_element`]: super::adamw_element
//! [`sum_squares`]: super::sum_squares

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{
    adamw_element, check_adamw_lengths, combine_lanes, sum_squares_chunk, AdamWStep, NORM_CHUNK,
    NORM_LANES,
};
use crate::{Element, Error, Result};

/// Default elements per tile: 32 Ki elements, i.e. 128 KiB per f32 stream.
pub const DEFAULT_TILE: usize = 1 << 15;

/// A call uses at most one thread per this many elements.
pub const MIN_ELEMS_PER_THREAD: usize = 1 << 16;

/// An instruction set the CPU kernels can run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust, one element at a time: runs everywhere.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C (8 f32 lanes).
    Avx2,
    /// x86-64 AVX-512F (16 f32 lanes).
    Avx512,
    /// aarch64 Advanced SIMD (4 f32 lanes).
    Neon,
}

impl Isa {
    /// Every instruction set, widest first per architecture.
    pub const ALL: [Isa; 4] = [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Scalar];

    /// The name used in messages and benchmarks (`"avx512"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// Whether this CPU can run the instruction set (checked at run time).
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f") && Isa::Avx2.is_available()
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The instruction sets this CPU can run, widest first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// The widest available instruction set.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .find(|i| i.is_available())
            .unwrap_or(Isa::Scalar)
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Isa {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Isa::ALL.into_iter().find(|i| i.name() == s).ok_or_else(|| {
            format!("unknown instruction set `{s}` (expected avx512, avx2, neon or scalar)")
        })
    }
}

/// One contiguous part of the optimizer state for [`CpuAdamW::step_many`]:
/// the same arguments as [`CpuAdamW::step`].
pub struct AdamWSlices<'a, G, M, P> {
    /// fp32 master parameters, updated in place.
    pub master: &'a mut [f32],
    /// Gradients (f32, bf16 or f16).
    pub grad: &'a [G],
    /// First moments, updated in place.
    pub m: &'a mut [M],
    /// Second moments, updated in place.
    pub v: &'a mut [M],
    /// If given, receives the low-precision copy of the updated parameters.
    pub low: Option<&'a mut [P]>,
}

/// The fused, multi-threaded CPU AdamW and gradient-norm kernels.
///
/// ```
/// use zero_core::bf16;
/// use zero_core::optim::{adamw_reference, AdamWParams, AdamWStep, CpuAdamW};
///
/// let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 1, 0.5);
/// let n = 1000;
/// let grad: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
/// let (mut p, mut m, mut v) = (vec![0.25f32; n], vec![0f32; n], vec![0f32; n]);
/// let mut low = vec![bf16::ZERO; n];
/// CpuAdamW::new().step(&k, &mut p, &grad, &mut m, &mut v, Some(&mut low))?;
///
/// // The same bits as the reference.
/// let (mut p2, mut m2, mut v2) = (vec![0.25f32; n], vec![0f32; n], vec![0f32; n]);
/// adamw_reference(&k, &mut p2, &grad, &mut m2, &mut v2, None::<&mut [bf16]>)?;
/// assert!(p.iter().zip(&p2).all(|(a, b)| a.to_bits() == b.to_bits()));
/// assert_eq!(low[7], bf16::from_f32(p[7]));
/// # Ok::<(), zero_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuAdamW {
    isa: Isa,
    threads: usize,
    tile: usize,
    stream: bool,
}

impl Default for CpuAdamW {
    fn default() -> Self {
        CpuAdamW::new()
    }
}

/// The machine's cores (1 if unknown).
pub(crate) fn machine_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl CpuAdamW {
    /// The widest available instruction set, one thread per core, tiles of
    /// [`DEFAULT_TILE`] elements, streaming stores on.
    pub fn new() -> Self {
        CpuAdamW {
            isa: Isa::best(),
            threads: machine_cores(),
            tile: DEFAULT_TILE,
            stream: true,
        }
    }

    /// Runs with `isa`; an error if this CPU cannot.
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        if !isa.is_available() {
            return Err(Error::Unsupported(format!(
                "instruction set {isa} is not available on this CPU (available: {})",
                Isa::available()
                    .iter()
                    .map(|i| i.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        self.isa = isa;
        Ok(self)
    }

    /// Uses up to `threads` threads (0 counts as 1), the calling one included.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// Cuts the work into tiles of `elems` elements, rounded up to a
    /// multiple of 64 (at least 64).
    pub fn with_tile(mut self, elems: usize) -> Self {
        self.tile = elems.max(1).div_ceil(64) * 64;
        self
    }

    /// Writes the low-precision copy with non-temporal stores (x86 only;
    /// other paths ignore it). Default: on.
    pub fn with_streaming_stores(mut self, on: bool) -> Self {
        self.stream = on;
        self
    }

    /// The instruction set in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The most threads a call uses.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Elements per tile.
    pub fn tile(&self) -> usize {
        self.tile
    }

    /// Whether the low-precision copy is written with streaming stores.
    pub fn streaming_stores(&self) -> bool {
        self.stream
    }

    /// One AdamW update of every element: exactly
    /// [`adamw_reference`](super::adamw_reference) (same bits, same length
    /// check and error, nothing changed on error), faster.
    pub fn step<G: Element, M: Element, P: Element>(
        &self,
        k: &AdamWStep,
        master: &mut [f32],
        grad: &[G],
        m: &mut [M],
        v: &mut [M],
        low: Option<&mut [P]>,
    ) -> Result<()> {
        self.step_many(
            k,
            vec![AdamWSlices {
                master,
                grad,
                m,
                v,
                low,
            }],
        )
    }

    /// [`CpuAdamW::step`] on several parts in one parallel region. Every
    /// part's lengths are checked before anything is written: a mismatch is
    /// [`Error::InvalidSize`] naming the part and changes nothing.
    pub fn step_many<G: Element, M: Element, P: Element>(
        &self,
        k: &AdamWStep,
        parts: Vec<AdamWSlices<'_, G, M, P>>,
    ) -> Result<()> {
        self.run_parts::<G, M, P, false>(k, parts)
    }

    /// The roofline of [`CpuAdamW::step_many`]: the same arrays read and
    /// written in the same tiles by the same threads with the same stores,
    /// but trivial arithmetic (`p += g; m += g; v += g; low = p`, with `g`
    /// unscaled). For benchmarks: the fraction of its speed that the real
    /// update reaches says how close to memory speed that is.
    pub fn traffic_many<G: Element, M: Element, P: Element>(
        &self,
        parts: Vec<AdamWSlices<'_, G, M, P>>,
    ) -> Result<()> {
        let k = AdamWStep::new(&super::AdamWParams::torch_default(), 0.0, 1, 1.0);
        self.run_parts::<G, M, P, true>(&k, parts)
    }

    fn run_parts<G: Element, M: Element, P: Element, const TRAFFIC: bool>(
        &self,
        k: &AdamWStep,
        parts: Vec<AdamWSlices<'_, G, M, P>>,
    ) -> Result<()> {
        check_element::<G>()?;
        check_element::<M>()?;
        check_element::<P>()?;
        for (i, p) in parts.iter().enumerate() {
            check_adamw_lengths(
                &format!("part {i}: "),
                p.master.len(),
                p.grad.len(),
                p.m.len(),
                p.v.len(),
                p.low.as_ref().map(|l| l.len()),
            )?;
        }
        // All parts have a copy or none do (mixed calls split in two).
        let (with_low, without): (Vec<_>, Vec<_>) =
            parts.into_iter().partition(|p| p.low.is_some());
        let mut tiles = Vec::new();
        for p in with_low.into_iter().chain(without) {
            let n = p.master.len();
            let raw = RawTile {
                master: p.master.as_mut_ptr(),
                grad: p.grad.as_ptr(),
                m: p.m.as_mut_ptr(),
                v: p.v.as_mut_ptr(),
                low: p.low.map_or(std::ptr::null_mut(), |l| l.as_mut_ptr()),
                n,
            };
            let mut at = 0;
            while at < n {
                let len = self.tile.min(n - at);
                // SAFETY: `at + len <= n`, and every slice of the part has
                // `n` elements (checked above).
                tiles.push(unsafe { raw.sub(at, len) });
                at += len;
            }
        }
        let total: usize = tiles.iter().map(|t| t.n).sum();
        let stream = self.stream;
        let isa = self.isa;
        parallel_map(self.workers(total), &tiles, |t| {
            // SAFETY: the tiles are disjoint ranges of slices borrowed
            // mutably for this call, each taken by exactly one thread, and
            // every thread ends before this function returns; `isa` was
            // checked to be available when it was set.
            unsafe {
                if t.low.is_null() {
                    run_tile::<G, M, P, false, TRAFFIC>(isa, k, *t, stream)
                } else {
                    run_tile::<G, M, P, true, TRAFFIC>(isa, k, *t, stream)
                }
            }
        });
        Ok(())
    }

    /// [`sum_squares`](super::sum_squares) of `x`: the same bits, with SIMD
    /// and threads.
    pub fn sum_squares<G: Element>(&self, x: &[G]) -> f64 {
        self.sum_squares_many(&[x])[0]
    }

    /// [`CpuAdamW::sum_squares`] of each slice, in one parallel region.
    pub fn sum_squares_many<G: Element>(&self, xs: &[&[G]]) -> Vec<f64> {
        if check_element::<G>().is_err() {
            return xs.iter().map(|x| super::sum_squares(x)).collect();
        }
        let mut chunks = Vec::new();
        for (s, x) in xs.iter().enumerate() {
            for c in x.chunks(NORM_CHUNK) {
                chunks.push((
                    s,
                    RawChunk {
                        ptr: c.as_ptr(),
                        n: c.len(),
                    },
                ));
            }
        }
        let total: usize = xs.iter().map(|x| x.len()).sum();
        let isa = self.isa;
        let sums = parallel_map(self.workers(total), &chunks, |(_, c)| {
            // SAFETY: `c` is a chunk of a slice borrowed for this call.
            unsafe { chunk_sum_squares(isa, *c) }
        });
        let mut out = vec![0.0f64; xs.len()];
        for ((s, _), v) in chunks.iter().zip(sums) {
            out[*s] += v;
        }
        out
    }

    fn workers(&self, total: usize) -> usize {
        self.threads
            .min(total.div_ceil(MIN_ELEMS_PER_THREAD))
            .max(1)
    }
}

/// Refuses an [`Element`] whose size is not its dtype's: the kernels read
/// memory by `DTYPE`.
fn check_element<T: Element>() -> Result<()> {
    if std::mem::size_of::<T>() != T::DTYPE.size_in_bytes() {
        return Err(Error::Unsupported(format!(
            "element type of {} bytes tagged {}",
            std::mem::size_of::<T>(),
            T::DTYPE
        )));
    }
    Ok(())
}

/// A tile: `n` elements of each array (`low` null when there is no copy).
pub(super) struct RawTile<G, M, P> {
    pub master: *mut f32,
    pub grad: *const G,
    pub m: *mut M,
    pub v: *mut M,
    pub low: *mut P,
    pub n: usize,
}

impl<G, M, P> Clone for RawTile<G, M, P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<G, M, P> Copy for RawTile<G, M, P> {}

// SAFETY: a RawTile is a set of disjoint ranges handed to exactly one thread
// at a time (see `run_parts`); the element types are Send + Sync.
unsafe impl<G: Element, M: Element, P: Element> Send for RawTile<G, M, P> {}
// SAFETY: as above; shared references only copy the pointers.
unsafe impl<G: Element, M: Element, P: Element> Sync for RawTile<G, M, P> {}

impl<G, M, P> RawTile<G, M, P> {
    /// Elements `at..at + len`.
    ///
    /// # Safety
    /// `at + len` must not exceed `self.n`.
    unsafe fn sub(self, at: usize, len: usize) -> Self {
        // SAFETY: in bounds by the caller's contract.
        unsafe {
            RawTile {
                master: self.master.add(at),
                grad: self.grad.add(at),
                m: self.m.add(at),
                v: self.v.add(at),
                low: if self.low.is_null() {
                    self.low
                } else {
                    self.low.add(at)
                },
                n: len,
            }
        }
    }
}

/// A chunk of a gradient for the norm pass.
#[derive(Clone, Copy)]
pub(super) struct RawChunk<G> {
    pub ptr: *const G,
    pub n: usize,
}

// SAFETY: only read, from slices of Sync elements borrowed for the call.
unsafe impl<G: Element> Send for RawChunk<G> {}
// SAFETY: as above.
unsafe impl<G: Element> Sync for RawChunk<G> {}

/// Runs one tile on `isa`.
///
/// # Safety
/// The tile's pointers must be valid for `n` elements, not aliased by any
/// other running tile; `isa` must be available.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn run_tile<G: Element, M: Element, P: Element, const LOW: bool, const TRAFFIC: bool>(
    isa: Isa,
    k: &AdamWStep,
    t: RawTile<G, M, P>,
    stream: bool,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::x86::adamw_avx2::<G, M, P, LOW, TRAFFIC>(k, t, stream),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => super::x86::adamw_avx512::<G, M, P, LOW, TRAFFIC>(k, t, stream),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => super::neon::adamw_neon::<G, M, P, LOW, TRAFFIC>(k, t),
            _ => adamw_scalar::<G, M, P, LOW, TRAFFIC>(k, t, 0, t.n),
        }
    }
}

/// Sum of squares of one chunk on `isa`, in [`sum_squares_chunk`]'s order.
///
/// # Safety
/// `c` must point to `c.n` readable elements; `isa` must be available.
unsafe fn chunk_sum_squares<G: Element>(isa: Isa, c: RawChunk<G>) -> f64 {
    // SAFETY: forwarded from the caller.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::x86::sum_squares_avx2(c),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => super::x86::sum_squares_avx512(c),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => super::neon::sum_squares_neon(c),
            _ => sum_squares_chunk(std::slice::from_raw_parts(c.ptr, c.n)),
        }
    }
}

/// Finishes a chunk whose first `done` elements (a multiple of
/// [`NORM_LANES`]) are summed in `lanes`: the rest go to their lanes one by
/// one, then the tree.
///
/// # Safety
/// `c` must point to `c.n` readable elements.
pub(super) unsafe fn finish_chunk<G: Element>(
    mut lanes: [f64; NORM_LANES],
    c: RawChunk<G>,
    done: usize,
) -> f64 {
    for i in done..c.n {
        // SAFETY: i < c.n.
        let y = f64::from(unsafe { *c.ptr.add(i) }.to_f32());
        lanes[i % NORM_LANES] += y * y;
    }
    combine_lanes(lanes)
}

/// The scalar path over elements `lo..hi` of a tile; the SIMD paths use it
/// for their heads and tails.
///
/// # Safety
/// As [`run_tile`], with `hi <= t.n`.
#[inline]
pub(super) unsafe fn adamw_scalar<
    G: Element,
    M: Element,
    P: Element,
    const LOW: bool,
    const TRAFFIC: bool,
>(
    k: &AdamWStep,
    t: RawTile<G, M, P>,
    lo: usize,
    hi: usize,
) {
    for i in lo..hi {
        // SAFETY: i < t.n, and the tile's ranges are this thread's alone.
        unsafe {
            let p = *t.master.add(i);
            let g = (*t.grad.add(i)).to_f32();
            let m = (*t.m.add(i)).to_f32();
            let v = (*t.v.add(i)).to_f32();
            let (p1, m1, v1) = if TRAFFIC {
                (p + g, m + g, v + g)
            } else {
                adamw_element(k, p, g, m, v)
            };
            *t.master.add(i) = p1;
            *t.m.add(i) = M::from_f32(m1);
            *t.v.add(i) = M::from_f32(v1);
            if LOW {
                *t.low.add(i) = P::from_f32(p1);
            }
        }
    }
}

/// Runs `f` on every item with up to `workers` threads (the caller's
/// included), items taken in order from a shared counter; returns the
/// results in item order. A thread that cannot be started leaves its share
/// to the others.
fn parallel_map<T: Sync, R: Send>(
    workers: usize,
    items: &[T],
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let workers = workers.min(items.len()).max(1);
    if workers == 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let work = || {
        let mut out = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { break };
            out.push((i, f(item)));
        }
        out
    };
    let mut done: Vec<(usize, R)> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..workers)
            .filter_map(|_| std::thread::Builder::new().spawn_scoped(s, work).ok())
            .collect();
        let mut all = work();
        for h in handles {
            // A worker's panic would be a bug in a kernel; re-raise it here.
            match h.join() {
                Ok(part) => all.extend(part),
                Err(e) => std::panic::resume_unwind(e),
            }
        }
        all
    });
    done.sort_unstable_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}
