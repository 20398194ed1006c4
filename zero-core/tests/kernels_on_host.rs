//! The CUDA kernels' math, checked on the host: `zero-core/kernels/
//! zero_math.cuh` (the AdamW element, the bf16/f16 conversions, the
//! kernels' per-thread bodies) is compiled with the host C++ compiler into
//! `kernels/host_check.cpp`, and its results are compared bit for bit with
//! the Rust reference: `adamw_reference` for every gradient / moment / copy
//! type the kernels support, `half`'s conversions for every bf16/f16 bit
//! pattern and a dense sample of f32 patterns, `sum_squares` and
//! `sum_squares_chunk` with the GPU's thread layout emulated; the
//! conversion kernels' body (`zero_convert.cuh`: cast, accumulate, pack and
//! unpack over many ranges) against [`zero_core::convert`] for every pair
//! of element types.
//!
//! The driver runs each AdamW kernel as an emulated grid (several thread
//! counts, arrays aligned and misaligned so that the vectorized and the
//! scalar paths both run). NaN results only need to be NaN on both sides
//! (IEEE leaves payloads open; a GPU gives the canonical NaN).
//!
//! The compiler is `$CXX` or `c++`. Without one the tests print a skip line,
//! or fail when `CI` is set.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use zero_core::cuda::kernels::PIECES_MAX;
use zero_core::optim::{
    adamw_reference, sum_squares, sum_squares_chunk, AdamWParams, AdamWStep, NORM_CHUNK,
};
use zero_core::{bf16, convert, f16, DType, Element};

use kernel_checks::run_driver as run;
use zero_testkit::kernel_checks;
use zero_testkit::rng::Rng;

fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

/// The host driver, built once per test process; `None` when there is no
/// C++ compiler (and `CI` is not set).
fn driver() -> Option<&'static Path> {
    static DRIVER: OnceLock<Option<PathBuf>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            kernel_checks::host_driver(
                "kernels_on_host",
                &kernels_dir().join("host_check.cpp"),
                &[&kernels_dir()],
                &Path::new(env!("CARGO_TARGET_TMPDIR")).join("zero_kernels_on_host"),
            )
        })
        .as_deref()
}

/// Takes values from the driver's output.
struct Output {
    data: Vec<u8>,
    pos: usize,
}

impl Output {
    fn bytes(&mut self, n: usize) -> &[u8] {
        assert!(self.pos + n <= self.data.len(), "driver output too short");
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        s
    }
    fn elems<T: bytemuck::Pod>(&mut self, n: usize) -> Vec<T> {
        let b = self.bytes(n * std::mem::size_of::<T>());
        b.chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect()
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes(8).try_into().unwrap())
    }
    fn f64(&mut self) -> f64 {
        f64::from_le_bytes(self.bytes(8).try_into().unwrap())
    }
    fn finish(&self) {
        assert_eq!(self.pos, self.data.len(), "driver wrote more than expected");
    }
}

/// Same bits, or both NaN.
fn same<T: Element>(a: T, b: T) -> bool {
    bytemuck::bytes_of(&a) == bytemuck::bytes_of(&b) || (a.to_f32().is_nan() && b.to_f32().is_nan())
}

fn same_f64(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

// ---------------------------------------------------------------------------
// Conversions
// ---------------------------------------------------------------------------

#[test]
fn decoders_match_half_for_every_bit_pattern() {
    let Some(exe) = driver() else { return };
    let all: Vec<u16> = (0..=u16::MAX).collect();
    type Decode = fn(u16) -> u32;
    let cases: [(&str, Decode); 2] = [
        ("bf16", |h| bf16::from_bits(h).to_f32().to_bits()),
        ("f16", |h| f16::from_bits(h).to_f32().to_bits()),
    ];
    for (name, reference) in cases {
        let out = run(exe, &["decode", name], bytemuck::cast_slice(&all).to_vec());
        let mut out = Output { data: out, pos: 0 };
        let got: Vec<u32> = out.elems(all.len());
        out.finish();
        for (&h, &g) in all.iter().zip(&got) {
            assert_eq!(
                g,
                reference(h),
                "{name} {h:#06x} decodes to {g:#010x}, half gives {:#010x}",
                reference(h)
            );
        }
    }
}

/// f32 bit patterns: a stride through all 2^32, every rounding boundary of
/// bf16 for every upper half, every f16 rounding boundary around the f16
/// range (normal and subnormal), random patterns and the special values.
fn f32_patterns() -> Vec<u32> {
    let mut v: Vec<u32> = (0..=u32::MAX).step_by(1021).collect();
    for hi in 0..=0xFFFFu32 {
        for lo in [
            0x0000, 0x0001, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF,
        ] {
            v.push(hi << 16 | lo);
        }
    }
    let mut rng = Rng(0x5EED_F16B_F16A_0001);
    // f32 exponents 98..=145 cover f16's flush to zero, its subnormals,
    // its normals and its overflow.
    for sign in [0u32, 1] {
        for exp in 98u32..=145 {
            for top in 0..1024u32 {
                let r = rng.next_u64() as u32;
                for low in [0u32, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, r & 0x1FFF] {
                    v.push(sign << 31 | exp << 23 | top << 13 | low);
                }
                // In the subnormal range the rounding bit is higher up.
                v.push(sign << 31 | exp << 23 | (r & 0x7F_FFFF));
            }
        }
    }
    v.extend((0..1_000_000).map(|_| rng.next_u64() as u32));
    v.extend([
        0x0000_0000,
        0x8000_0000,
        0x0000_0001,
        0x007F_FFFF,
        0x0080_0000,
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001,
        0x7FA0_0000,
        0x7FC0_0000,
        0x7FC0_0001,
        0x7FFF_FFFF,
        0xFFFF_FFFF,
        0xFF80_0001,
        0x7F80_1FFF,
        0x7F80_2000,
        0x477F_E000,
        0x477F_EFFF,
        0x477F_F000,
        0x3380_0000,
        0x3300_0000,
        0x3300_0001,
    ]);
    v
}

#[test]
fn encoders_match_half_on_a_dense_sample_of_f32() {
    let Some(exe) = driver() else { return };
    let xs = f32_patterns();
    type Encode = fn(f32) -> u16;
    let cases: [(&str, Encode); 2] = [
        ("bf16", |x| bf16::from_f32(x).to_bits()),
        ("f16", |x| f16::from_f32(x).to_bits()),
    ];
    for (name, reference) in cases {
        let out = run(exe, &["encode", name], bytemuck::cast_slice(&xs).to_vec());
        let mut out = Output { data: out, pos: 0 };
        let got: Vec<u16> = out.elems(xs.len());
        out.finish();
        let mut bad = 0usize;
        for (&x, &g) in xs.iter().zip(&got) {
            let want = reference(f32::from_bits(x));
            if g != want {
                if bad < 10 {
                    eprintln!("{name}: f32 {x:#010x} encodes to {g:#06x}, half gives {want:#06x}");
                }
                bad += 1;
            }
        }
        assert_eq!(bad, 0, "{name}: {bad} of {} patterns differ", xs.len());
    }
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

/// A value for the optimizer state: many binades, with zeros, subnormals,
/// infinities, NaN and huge values sprinkled in when `special`.
fn value(rng: &mut Rng, special: bool) -> f32 {
    let r = rng.next_u64() % 100;
    if special {
        match r {
            0 => return f32::NAN,
            1 => return f32::INFINITY,
            2 => return f32::NEG_INFINITY,
            3 => return 3.0e38 * rng.unit(),
            4 => return 1.0e30 * rng.unit(),
            _ => {}
        }
    }
    match r {
        5 => 0.0,
        6 => -0.0,
        7 => f32::from_bits((rng.next_u64() as u32) & 0x807F_FFFF),
        8 => 65504.0 * (1.0 + rng.unit() * 1e-3),
        9 => 6.0e-8 * rng.unit(),
        10 => 1.0e-39 * rng.unit(),
        _ => {
            let e = (rng.next_u64() % 61) as i32 - 40;
            rng.unit() * 2f32.powi(e)
        }
    }
}

/// The step constants of record `i`: plain ones, zero eps, no decay,
/// late steps, tiny and huge gradient scales.
fn step_consts(i: usize) -> AdamWStep {
    let params = AdamWParams {
        lr: [1e-3, 3e-4, 1.0][i % 3],
        beta1: [0.9, 0.8][i % 2],
        beta2: [0.999, 0.95, 0.9999][i % 3],
        eps: [1e-8, 0.0, 1e-30, 1e-6][i % 4],
        weight_decay: [0.01, 0.0, 0.1][(i / 3) % 3],
    };
    let step = [1u64, 2, 10, 1000, 1 << 40][i % 5];
    let grad_scale = [1.0f32, 0.37, 1.0 / 65536.0, 1.0e10, 3.0e-39][(i / 2) % 5];
    AdamWStep::new(&params, params.lr, step, grad_scale)
}

fn consts_bytes(k: &AdamWStep) -> Vec<u8> {
    [
        k.grad_scale,
        k.beta1,
        k.beta2,
        k.one_minus_beta1,
        k.one_minus_beta2,
        k.eps,
        k.step_size,
        k.inv_sqrt_bias2,
        k.decay,
    ]
    .iter()
    .flat_map(|f| f.to_le_bytes())
    .collect()
}

struct Record<G, M, P> {
    threads: u32,
    offsets: [u32; 5],
    k: AdamWStep,
    master: Vec<f32>,
    grad: Vec<G>,
    m: Vec<M>,
    v: Vec<M>,
    low: Vec<P>,
}

/// Element offsets of master, grad, m, v, low from a 64-byte boundary, and
/// thread counts of the emulated grid.
const LAYOUTS: [(u32, [u32; 5]); 7] = [
    (1, [0, 0, 0, 0, 0]),
    (3, [0, 0, 0, 0, 0]),
    (768, [0, 0, 0, 0, 0]),
    (5, [1, 1, 1, 1, 1]),
    (7, [0, 1, 0, 0, 0]),
    (2, [0, 0, 0, 0, 2]),
    (4, [4, 4, 4, 4, 4]),
];

const LENGTHS: [usize; 19] = [
    0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 127, 129, 1000, 4099,
];

/// Every record for one type combination against `adamw_reference`.
fn check_adamw<G: Element, M: Element, P: Element>(exe: &Path, has_low: bool) {
    let combo = format!(
        "G={} M={} P={}",
        G::DTYPE,
        M::DTYPE,
        if has_low { P::DTYPE.as_str() } else { "none" }
    );
    let mut rng = Rng(0xADA3_0000_0000_0001
        ^ (G::DTYPE.code() as u64) << 8
        ^ (M::DTYPE.code() as u64) << 16
        ^ (P::DTYPE.code() as u64 + has_low as u64 * 8) << 24);
    let mut records = Vec::new();
    let mut cases: Vec<(usize, (u32, [u32; 5]))> = LENGTHS
        .iter()
        .flat_map(|&n| LAYOUTS.iter().map(move |&l| (n, l)))
        .collect();
    cases.push((70_001, (1024, [0; 5])));
    cases.push((70_001, (999, [3, 2, 1, 0, 3])));
    for (i, &(n, (threads, offsets))) in cases.iter().enumerate() {
        let special = i % 2 == 1;
        let mut grad_scale = 4.0;
        if i % 5 == 0 {
            grad_scale = 1e4; // huge gradients: g*g overflows
        }
        records.push(Record::<G, M, P> {
            threads,
            offsets,
            k: step_consts(i),
            master: (0..n).map(|_| value(&mut rng, special)).collect(),
            grad: (0..n)
                .map(|_| G::from_f32(value(&mut rng, special) * grad_scale))
                .collect(),
            m: (0..n)
                .map(|_| M::from_f32(value(&mut rng, special) * 0.1))
                .collect(),
            v: (0..n)
                .map(|_| {
                    let x = value(&mut rng, special);
                    // A few negative second moments (invalid state, but
                    // the reference defines the result: NaN).
                    M::from_f32(if rng.next_u64().is_multiple_of(50) {
                        x
                    } else {
                        x.abs() * 0.01
                    })
                })
                .collect(),
            low: vec![P::from_f32(-7.0); if has_low { n } else { 0 }],
        });
    }

    let mut input = Vec::new();
    for r in &records {
        input.extend(r.threads.to_le_bytes());
        for o in r.offsets {
            input.extend(o.to_le_bytes());
        }
        input.extend(consts_bytes(&r.k));
        input.extend((r.master.len() as u64).to_le_bytes());
        input.extend_from_slice(bytemuck::cast_slice(&r.master));
        input.extend_from_slice(bytemuck::cast_slice(&r.grad));
        input.extend_from_slice(bytemuck::cast_slice(&r.m));
        input.extend_from_slice(bytemuck::cast_slice(&r.v));
        input.extend_from_slice(bytemuck::cast_slice(&r.low));
    }
    let p_name = if has_low { P::DTYPE.as_str() } else { "none" };
    let args = ["adamw", G::DTYPE.as_str(), M::DTYPE.as_str(), p_name];
    let mut out = Output {
        data: run(exe, &args, input),
        pos: 0,
    };

    for (ri, r) in records.iter().enumerate() {
        let n = r.master.len();
        let (mut master, mut m, mut v, mut low) =
            (r.master.clone(), r.m.clone(), r.v.clone(), r.low.clone());
        adamw_reference(
            &r.k,
            &mut master,
            &r.grad,
            &mut m,
            &mut v,
            has_low.then_some(&mut low[..]),
        )
        .unwrap();
        let got_master: Vec<f32> = out.elems(n);
        let got_m: Vec<M> = out.elems(n);
        let got_v: Vec<M> = out.elems(n);
        let got_low: Vec<P> = out.elems(low.len());
        let ctx = |what: &str, i: usize| {
            format!(
                "{combo} record {ri} (n={n}, threads={}, offsets={:?}, {:?}): {what}[{i}] \
                 differs; inputs p={:?} g={:?} m={:?} v={:?}",
                r.threads, r.offsets, r.k, r.master[i], r.grad[i], r.m[i], r.v[i]
            )
        };
        for i in 0..n {
            assert!(
                same(got_master[i], master[i]),
                "{}: {:?} vs reference {:?}",
                ctx("master", i),
                got_master[i],
                master[i]
            );
            assert!(
                same(got_m[i], m[i]),
                "{}: {:?} vs {:?}",
                ctx("m", i),
                got_m[i],
                m[i]
            );
            assert!(
                same(got_v[i], v[i]),
                "{}: {:?} vs {:?}",
                ctx("v", i),
                got_v[i],
                v[i]
            );
        }
        for i in 0..low.len() {
            assert!(
                same(got_low[i], low[i]),
                "{}: {:?} vs {:?}",
                ctx("low", i),
                got_low[i],
                low[i]
            );
        }
    }
    out.finish();
}

fn check_moments<G: Element, M: Element>(exe: &Path) {
    check_adamw::<G, M, f32>(exe, false);
    check_adamw::<G, M, f32>(exe, true);
    check_adamw::<G, M, bf16>(exe, true);
    check_adamw::<G, M, f16>(exe, true);
}

#[test]
fn adamw_f32_grads_match_the_reference() {
    let Some(exe) = driver() else { return };
    check_moments::<f32, f32>(exe);
    check_moments::<f32, bf16>(exe);
}

#[test]
fn adamw_bf16_grads_match_the_reference() {
    let Some(exe) = driver() else { return };
    check_moments::<bf16, f32>(exe);
    check_moments::<bf16, bf16>(exe);
}

#[test]
fn adamw_f16_grads_match_the_reference() {
    let Some(exe) = driver() else { return };
    check_moments::<f16, f32>(exe);
    check_moments::<f16, bf16>(exe);
}

// ---------------------------------------------------------------------------
// Sum of squares
// ---------------------------------------------------------------------------

fn check_sumsq<G: Element>(exe: &Path) {
    let mut rng = Rng(0x50F5_0000_0000_0007 ^ G::DTYPE.code() as u64);
    let c = NORM_CHUNK;
    let lens = [
        0,
        1,
        15,
        16,
        17,
        63,
        64,
        65,
        127,
        128,
        129,
        1000,
        // Around the kernel's 8192-element shared-memory tiles.
        8191,
        8192,
        8193,
        3 * 8192 + 17,
        c - 1,
        c,
        c + 1,
        2 * c + 16 * 8 * 3 + 5,
        3 * c - 1,
    ];
    let mut records: Vec<(u32, Vec<G>)> = Vec::new();
    for (i, &n) in lens.iter().enumerate() {
        for offset in [0u32, 1, 4] {
            let special = (i + offset as usize) % 3 == 2;
            let mut x: Vec<G> = (0..n)
                .map(|_| G::from_f32(value(&mut rng, false) * 8.0))
                .collect();
            if special && n > 20 {
                // One record each: NaN; an infinity; f32 values whose squares
                // overflow f32 (not f64); subnormals.
                match i % 4 {
                    0 => x[n / 3] = G::from_f32(f32::NAN),
                    1 => x[n - 1] = G::from_f32(f32::INFINITY),
                    2 => {
                        for e in x.iter_mut().step_by(7) {
                            *e = G::from_f32(3.0e38);
                        }
                    }
                    _ => {
                        for e in x.iter_mut().step_by(3) {
                            *e = G::from_f32(f32::from_bits(rng.next_u64() as u32 & 0x7F_FFFF));
                        }
                    }
                }
            }
            records.push((offset, x));
        }
    }
    let mut input = Vec::new();
    for (offset, x) in &records {
        input.extend(offset.to_le_bytes());
        input.extend((x.len() as u64).to_le_bytes());
        input.extend_from_slice(bytemuck::cast_slice(x));
    }
    let mut out = Output {
        data: run(exe, &["sumsq", G::DTYPE.as_str()], input),
        pos: 0,
    };
    for (offset, x) in &records {
        let n = x.len();
        let nchunks = out.u64() as usize;
        assert_eq!(nchunks, n.div_ceil(c), "n={n}");
        for (ci, chunk) in x.chunks(c).enumerate() {
            let got = out.f64();
            let want = sum_squares_chunk(chunk);
            assert!(
                same_f64(got, want),
                "{} n={n} offset={offset}: chunk {ci} sum {got:e} ({:#x}), reference {want:e} ({:#x})",
                G::DTYPE,
                got.to_bits(),
                want.to_bits()
            );
        }
        let got = out.f64();
        let want = sum_squares(x);
        assert!(
            same_f64(got, want),
            "{} n={n} offset={offset}: total {got:e} ({:#x}), reference {want:e} ({:#x})",
            G::DTYPE,
            got.to_bits(),
            want.to_bits()
        );
    }
    out.finish();
}

#[test]
fn sum_squares_matches_the_reference_order() {
    let Some(exe) = driver() else { return };
    check_sumsq::<f32>(exe);
    check_sumsq::<bf16>(exe);
    check_sumsq::<f16>(exe);
    assert_eq!(
        DType::ALL.len(),
        3,
        "a new dtype needs a sum-of-squares check"
    );
}

// ---------------------------------------------------------------------------
// Conversion over many ranges (convert.cu)
// ---------------------------------------------------------------------------

/// An element of `T` from random bits: every pattern, NaNs with payloads
/// (quiet and signalling) and subnormals included.
fn random_bits<T: Element>(rng: &mut Rng) -> T {
    let bits = rng.next_u64();
    let bytes = bits.to_le_bytes();
    bytemuck::pod_read_unaligned(&bytes[..std::mem::size_of::<T>()])
}

/// An element of `T`: mostly ordinary values, some special, some raw bits.
fn element<T: Element>(rng: &mut Rng) -> T {
    if rng.next_u64().is_multiple_of(4) {
        random_bits(rng)
    } else {
        T::from_f32(value(rng, true))
    }
}

/// One launch: `(src_at, dst_at, len)` pieces over `src` into `dst`.
struct PiecesCase<S, D> {
    threads: u32,
    accumulate: bool,
    pieces: Vec<(usize, usize, usize)>,
    src: Vec<S>,
    dst: Vec<D>,
}

/// `count` pieces of 1 to `max_len` elements with disjoint destination
/// ranges in increasing order (random gaps), sources anywhere (they may
/// overlap: reads only).
fn pieces_case<S: Element, D: Element>(
    rng: &mut Rng,
    count: usize,
    max_len: usize,
    threads: u32,
    accumulate: bool,
) -> PiecesCase<S, D> {
    let src_len = max_len * 3 + 5;
    let src: Vec<S> = (0..src_len).map(|_| element(rng)).collect();
    let mut pieces = Vec::with_capacity(count);
    let mut at = (rng.next_u64() % 4) as usize;
    for _ in 0..count {
        let len = 1 + (rng.next_u64() as usize) % max_len;
        let src_at = (rng.next_u64() as usize) % (src_len - len + 1);
        pieces.push((src_at, at, len));
        at += len + (rng.next_u64() % 3) as usize;
    }
    let dst: Vec<D> = (0..at + 2).map(|_| element(rng)).collect();
    PiecesCase {
        threads,
        accumulate,
        pieces,
        src,
        dst,
    }
}

fn check_pieces<S: Element, D: Element>(exe: &Path) {
    let mut rng = Rng(0xC0_4E27 ^ (S::DTYPE.code() as u64) << 8 ^ D::DTYPE.code() as u64);
    let mut cases: Vec<PiecesCase<S, D>> = Vec::new();
    for accumulate in [false, true] {
        for (count, max_len) in [(1, 1), (1, 700), (3, 40), (17, 9), (PIECES_MAX, 64)] {
            for threads in [1, 7, 256] {
                cases.push(pieces_case(&mut rng, count, max_len, threads, accumulate));
            }
        }
    }
    let mut input = Vec::new();
    for c in &cases {
        input.extend(c.threads.to_le_bytes());
        input.extend(u32::from(c.accumulate).to_le_bytes());
        input.extend((c.pieces.len() as u64).to_le_bytes());
        for &(s, d, n) in &c.pieces {
            for x in [s, d, n] {
                input.extend((x as u64).to_le_bytes());
            }
        }
        input.extend((c.src.len() as u64).to_le_bytes());
        input.extend_from_slice(bytemuck::cast_slice(&c.src));
        input.extend((c.dst.len() as u64).to_le_bytes());
        input.extend_from_slice(bytemuck::cast_slice(&c.dst));
    }
    let mut out = Output {
        data: run(
            exe,
            &["pieces", S::DTYPE.as_str(), D::DTYPE.as_str()],
            input,
        ),
        pos: 0,
    };
    // Without accumulation one type is a copy of the bits, NaN payloads
    // included; through f32 or with an addition a NaN only has to be NaN.
    let bit_copy = S::DTYPE == D::DTYPE;
    for c in &cases {
        let got: Vec<D> = out.elems(c.dst.len());
        let mut want = c.dst.clone();
        for &(s, d, n) in &c.pieces {
            convert(&c.src[s..s + n], &mut want[d..d + n], c.accumulate);
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let ok = if bit_copy && !c.accumulate {
                bytemuck::bytes_of(g) == bytemuck::bytes_of(w)
            } else {
                same(*g, *w)
            };
            assert!(
                ok,
                "{} -> {} accumulate={} pieces={} threads={}: element {i} is {g:?}, \
                 convert gives {w:?}",
                S::DTYPE,
                D::DTYPE,
                c.accumulate,
                c.pieces.len(),
                c.threads
            );
        }
    }
    out.finish();
}

#[test]
fn conversions_over_many_ranges_match_convert() {
    let Some(exe) = driver() else { return };
    check_pieces::<f32, f32>(exe);
    check_pieces::<f32, bf16>(exe);
    check_pieces::<f32, f16>(exe);
    check_pieces::<bf16, f32>(exe);
    check_pieces::<bf16, bf16>(exe);
    check_pieces::<bf16, f16>(exe);
    check_pieces::<f16, f32>(exe);
    check_pieces::<f16, bf16>(exe);
    check_pieces::<f16, f16>(exe);
    assert_eq!(DType::ALL.len(), 3, "a new dtype needs a conversion check");
}
