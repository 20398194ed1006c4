//! The GPU AdamW and sum of squares (`zero_core::cuda::kernels::GpuAdamW`)
//! against the CPU reference, element by element, on a real GPU: every
//! gradient / moment / copy type, odd lengths, views at odd element offsets
//! (the scalar path) and aligned ones (the vectorized path), special values,
//! two steps in a row; the sum of squares and its per-chunk sums; length and
//! type errors.
//!
//! Without a GPU every test prints a skip line and passes. With a GPU but
//! without libnvrtc they skip too, unless `ZERO_REQUIRE_NVRTC=1`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use zero_core::cuda::kernels::{norm_scratch_len, GpuAdamW};
use zero_core::optim::{
    adamw_reference, sum_squares, sum_squares_chunk, AdamWParams, AdamWStep, NORM_CHUNK,
};
use zero_core::{bf16, f16, Element, Error};

use zero_testkit::kernel_checks;
use zero_testkit::rng::Rng;

struct Gpu {
    adam: GpuAdamW,
    stream: Arc<CudaStream>,
}

/// The GPU and its kernels, or a visible skip.
fn gpu(test: &str) -> Option<Gpu> {
    let dev = kernel_checks::cuda_device_or_skip(test)?;
    if !kernel_checks::nvrtc_or_skip(test) {
        return None;
    }
    let adam = GpuAdamW::new(&dev).expect("compile and load the kernels");
    eprintln!("{test}: kernels compiled for {}", adam.arch());
    let stream = dev.context().new_stream().expect("create a stream");
    Some(Gpu { adam, stream })
}

/// Element types that can live in device memory.
trait Dev: Element + DeviceRepr {}
impl<T: Element + DeviceRepr> Dev for T {}

/// Same bits, or both NaN (the GPU's NaN is the canonical one).
fn same<T: Element>(a: T, b: T) -> bool {
    bytemuck::bytes_of(&a) == bytemuck::bytes_of(&b) || (a.to_f32().is_nan() && b.to_f32().is_nan())
}

fn check_same<T: Element>(what: &str, got: &[T], want: &[T], ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: {what} length");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(same(*a, *b), "{ctx}: {what}[{i}] = {a:?}, reference {b:?}");
    }
}

/// Many binades; zeros, subnormals, infinities, NaN and huge values when
/// `special`.
fn value(rng: &mut Rng, special: bool) -> f32 {
    let r = rng.next_u64() % 100;
    match r {
        0 if special => f32::NAN,
        1 if special => f32::INFINITY,
        2 if special => f32::NEG_INFINITY,
        3 if special => 1.0e30 * rng.unit(),
        5 => 0.0,
        6 => -0.0,
        7 => f32::from_bits((rng.next_u64() as u32) & 0x807F_FFFF),
        8 => 65504.0 * (1.0 + rng.unit() * 1e-3),
        9 => 6.0e-8 * rng.unit(),
        _ => rng.unit() * 2f32.powi((rng.next_u64() % 61) as i32 - 40),
    }
}

const LENGTHS: [usize; 12] = [1, 3, 4, 5, 7, 16, 17, 33, 129, 1000, 4099, 70_001];

fn check_step<G: Dev, M: Dev, P: Dev>(g: &Gpu, has_low: bool) {
    let stream = &g.stream;
    let mut rng = Rng(0xC0DA_0000_0000_0001
        ^ (G::DTYPE.code() as u64) << 8
        ^ (M::DTYPE.code() as u64) << 16
        ^ (P::DTYPE.code() as u64 + has_low as u64 * 8) << 24);
    let params = AdamWParams {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let lens = LENGTHS.iter().copied().chain([5_000_003]);
    for (case, n) in lens.enumerate() {
        // Offsets 0 and 4 keep every view aligned (vectorized path); 1..3
        // misalign them (scalar path).
        let off = [0, 1, 2, 3, 4][case % 5];
        let total = n + off;
        let special = case % 2 == 1;
        let ctx = format!(
            "G={} M={} P={} n={n} off={off}",
            G::DTYPE,
            M::DTYPE,
            if has_low { P::DTYPE.as_str() } else { "none" }
        );
        let mut master: Vec<f32> = (0..total).map(|_| value(&mut rng, special)).collect();
        let grad: Vec<G> = (0..total)
            .map(|_| G::from_f32(value(&mut rng, special) * 4.0))
            .collect();
        let mut m: Vec<M> = (0..total)
            .map(|_| M::from_f32(value(&mut rng, special) * 0.1))
            .collect();
        let mut v: Vec<M> = (0..total)
            .map(|_| M::from_f32(value(&mut rng, special).abs() * 0.01))
            .collect();
        let mut low: Vec<P> = vec![P::from_f32(-7.0); total];

        let mut d_master = stream.clone_htod(&master).unwrap();
        let d_grad = stream.clone_htod(&grad).unwrap();
        let mut d_m = stream.clone_htod(&m).unwrap();
        let mut d_v = stream.clone_htod(&v).unwrap();
        let mut d_low = stream.clone_htod(&low).unwrap();

        for step in 1..=2u64 {
            let k = AdamWStep::new(&params, 1e-3, step, 0.37);
            adamw_reference(
                &k,
                &mut master[off..],
                &grad[off..],
                &mut m[off..],
                &mut v[off..],
                has_low.then_some(&mut low[off..]),
            )
            .unwrap();
            let mut vm = d_master.slice_mut(off..);
            let vg = d_grad.slice(off..);
            let mut vmm = d_m.slice_mut(off..);
            let mut vv = d_v.slice_mut(off..);
            let mut vl = d_low.slice_mut(off..);
            let r = if has_low {
                g.adam
                    .step(stream, &k, &mut vm, &vg, &mut vmm, &mut vv, Some(&mut vl))
            } else {
                g.adam.step(
                    stream,
                    &k,
                    &mut vm,
                    &vg,
                    &mut vmm,
                    &mut vv,
                    None::<&mut CudaSlice<P>>,
                )
            };
            r.unwrap_or_else(|e| panic!("{ctx}: {e}"));
        }
        stream.synchronize().unwrap();
        // The whole buffers: the elements before `off` must be untouched.
        check_same(
            "master",
            &stream.clone_dtoh(&d_master).unwrap(),
            &master,
            &ctx,
        );
        check_same("m", &stream.clone_dtoh(&d_m).unwrap(), &m, &ctx);
        check_same("v", &stream.clone_dtoh(&d_v).unwrap(), &v, &ctx);
        check_same("low", &stream.clone_dtoh(&d_low).unwrap(), &low, &ctx);
    }
}

fn check_moments<G: Dev, M: Dev>(g: &Gpu) {
    check_step::<G, M, f32>(g, false);
    check_step::<G, M, f32>(g, true);
    check_step::<G, M, bf16>(g, true);
    check_step::<G, M, f16>(g, true);
}

#[test]
fn adamw_every_type_combination_matches_the_reference() {
    let Some(g) = gpu("adamw_every_type_combination_matches_the_reference") else {
        return;
    };
    check_moments::<f32, f32>(&g);
    check_moments::<f32, bf16>(&g);
    check_moments::<bf16, f32>(&g);
    check_moments::<bf16, bf16>(&g);
    check_moments::<f16, f32>(&g);
    check_moments::<f16, bf16>(&g);
}

#[test]
fn adamw_rejects_bad_lengths_and_types_like_the_reference() {
    let Some(g) = gpu("adamw_rejects_bad_lengths_and_types_like_the_reference") else {
        return;
    };
    let s = &g.stream;
    let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 1, 1.0);
    let mut master = s.alloc_zeros::<f32>(10).unwrap();
    let grad = s.alloc_zeros::<bf16>(9).unwrap();
    let mut m = s.alloc_zeros::<f32>(10).unwrap();
    let mut v = s.alloc_zeros::<f32>(10).unwrap();
    let mut low = s.alloc_zeros::<bf16>(11).unwrap();
    let err = g
        .adam
        .step(s, &k, &mut master, &grad, &mut m, &mut v, Some(&mut low))
        .unwrap_err();
    let want = adamw_reference(
        &k,
        &mut [0f32; 10],
        &[bf16::ZERO; 9],
        &mut [0f32; 10],
        &mut [0f32; 10],
        Some(&mut [bf16::ZERO; 11][..]),
    )
    .unwrap_err();
    assert!(
        matches!(err, Error::InvalidSize { op: "adamw", .. }),
        "{err}"
    );
    assert_eq!(err.to_string(), want.to_string());

    let grad = s.alloc_zeros::<f32>(10).unwrap();
    let mut m16 = s.alloc_zeros::<f16>(10).unwrap();
    let mut v16 = s.alloc_zeros::<f16>(10).unwrap();
    let err = g
        .adam
        .step(
            s,
            &k,
            &mut master,
            &grad,
            &mut m16,
            &mut v16,
            None::<&mut CudaSlice<f32>>,
        )
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported(_)), "{err}");

    // Empty buffers are a no-op.
    let mut e = s.alloc_zeros::<f32>(0).unwrap();
    let eg = s.alloc_zeros::<f32>(0).unwrap();
    let (mut em, mut ev) = (
        s.alloc_zeros::<f32>(0).unwrap(),
        s.alloc_zeros::<f32>(0).unwrap(),
    );
    g.adam
        .step(
            s,
            &k,
            &mut e,
            &eg,
            &mut em,
            &mut ev,
            None::<&mut CudaSlice<f32>>,
        )
        .unwrap();
}

fn check_sum_squares<G: Dev>(g: &Gpu) {
    let s = &g.stream;
    let mut rng = Rng(0x5050_0000_0000_0003 ^ G::DTYPE.code() as u64);
    let c = NORM_CHUNK;
    let lens = [
        0,
        1,
        17,
        1000,
        8193,
        3 * 8192 + 17,
        c - 1,
        c,
        c + 1,
        3 * c + 999,
        10_000_019,
    ];
    for (case, &n) in lens.iter().enumerate() {
        for off in [0usize, 1, 3, 4] {
            let mut x: Vec<G> = (0..n + off)
                .map(|_| G::from_f32(value(&mut rng, false) * 8.0))
                .collect();
            if n > 100 && (case + off) % 3 == 0 {
                x[off + n / 2] = G::from_f32(if off % 2 == 0 {
                    f32::NAN
                } else {
                    f32::INFINITY
                });
            }
            let ctx = format!("{} n={n} off={off}", G::DTYPE);
            let d = s.clone_htod(&x).unwrap();
            let view = d.slice(off..);
            let got = g.adam.sum_squares(s, &view).unwrap();
            let want = sum_squares(&x[off..]);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{ctx}: {got:e} vs reference {want:e}"
            );

            let nchunks = norm_scratch_len(n);
            let mut sums = s.alloc_zeros::<f64>(nchunks.max(1)).unwrap();
            let mut out = s.alloc_zeros::<f64>(1).unwrap();
            g.adam
                .sum_squares_into(s, &view, &mut sums, &mut out)
                .unwrap();
            let sums = s.clone_dtoh(&sums).unwrap();
            for (ci, chunk) in x[off..].chunks(c).enumerate() {
                let want = sum_squares_chunk(chunk);
                let got = sums[ci];
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{ctx}: chunk {ci}: {got:e} vs reference {want:e}"
                );
            }
            let out = s.clone_dtoh(&out).unwrap()[0];
            assert!(out.to_bits() == got.to_bits() || (out.is_nan() && got.is_nan()));
        }
    }
}

#[test]
fn sum_squares_matches_the_cpu_bit_for_bit() {
    let Some(g) = gpu("sum_squares_matches_the_cpu_bit_for_bit") else {
        return;
    };
    check_sum_squares::<f32>(&g);
    check_sum_squares::<bf16>(&g);
    check_sum_squares::<f16>(&g);

    // Too little scratch is an error, not an out-of-bounds write.
    let s = &g.stream;
    let x = s.alloc_zeros::<f32>(NORM_CHUNK + 1).unwrap();
    let mut sums = s.alloc_zeros::<f64>(1).unwrap();
    let mut out = s.alloc_zeros::<f64>(1).unwrap();
    let err = g
        .adam
        .sum_squares_into(s, &x, &mut sums, &mut out)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidSize {
                op: "sum_squares",
                ..
            }
        ),
        "{err}"
    );
}
