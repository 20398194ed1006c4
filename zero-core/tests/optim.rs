//! Tests of the reference optimizer math in `zero_core::optim`: AdamW golden
//! values and slice/element agreement, the fixed-order gradient norm, the
//! DeepSpeed learning-rate schedules and the dynamic loss scaler.

use zero_core::optim::{
    adamw_element, adamw_reference, clip_coefficient, sum_squares, AdamWParams, AdamWStep,
    LossScaleConfig, LossScaler, LrSchedule, WarmupType, NORM_CHUNK, NORM_LANES,
};
use zero_core::{bf16, f16, Element, Error};

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

use zero_testkit::rng::Rng;

/// Values spread over many binades, so that summation order matters.
trait Wide {
    fn wide(&mut self) -> f32;
}

impl Wide for Rng {
    fn wide(&mut self) -> f32 {
        let e = (self.next_u64() % 17) as i32 - 8;
        self.unit() * 2f32.powi(e)
    }
}

fn vec_of<T: Element>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::from_f32(rng.wide())).collect()
}

/// Error of `a` against the f64 truth `b`, in f32 ulps of `scale` (at least
/// `|b|`): a result that cancels (`m = 0.9 * -0.14 + 0.15`) is judged at the
/// magnitude of its terms, not of its small result.
fn ulps_at(a: f32, b: f64, scale: f64) -> f64 {
    let s = (scale.abs().max(b.abs())) as f32;
    let ulp = f32::from_bits(s.to_bits() + 1) - s;
    ((a as f64) - b).abs() / ulp as f64
}

fn close_rel(a: f64, b: f64, rel: f64) -> bool {
    a == b || (a - b).abs() <= rel * a.abs().max(b.abs())
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

#[test]
fn torch_default_params() {
    let p = AdamWParams::torch_default();
    assert_eq!(
        p,
        AdamWParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01
        }
    );
}

#[test]
fn step_constants_are_f64_rounded_once() {
    let p = AdamWParams::torch_default();
    let lr = 3e-4;
    for step in [1u64, 2, 3, 10, 1000] {
        let k = AdamWStep::new(&p, lr, step, 0.25);
        let bias1 = 1.0 - 0.9f64.powi(step as i32);
        let bias2 = 1.0 - 0.999f64.powi(step as i32);
        assert_eq!(k.grad_scale, 0.25);
        assert_eq!(k.beta1, 0.9f32);
        assert_eq!(k.beta2, 0.999f32);
        assert_eq!(k.one_minus_beta1, (1.0 - 0.9f64) as f32);
        assert_eq!(k.one_minus_beta2, (1.0 - 0.999f64) as f32);
        assert_eq!(k.eps, 1e-8f32);
        assert_eq!(k.step_size, (lr / bias1) as f32);
        assert_eq!(k.inv_sqrt_bias2, (1.0 / bias2.sqrt()) as f32);
        assert_eq!(k.decay, (1.0 - lr * 0.01) as f32);
    }
}

/// Three AdamW steps on five elements against f64 truth.
///
/// The expected values are torch.optim.AdamW's math evaluated in f64 by this
/// Python script (python3, no packages):
///
/// ```python
/// lr, b1, b2, eps, wd, gs = 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.5
/// p = [0.5, -1.25, 3.0, 0.0078125, -0.0625]
/// grads = [
///     [0.25, -2.0, 0.0, 1.5, -0.001953125],
///     [-0.5, -1.0, 4.0, 1.5, 0.0],
///     [0.125, 3.0, -8.0, -0.75, 0.03125],
/// ]
/// m = [0.0] * len(p); v = [0.0] * len(p)
/// for t, g in enumerate(grads, start=1):
///     bc1 = 1 - b1 ** t; bc2 = 1 - b2 ** t
///     for i in range(len(p)):
///         gi = g[i] * gs
///         p[i] *= 1 - lr * wd
///         m[i] = b1 * m[i] + (1 - b1) * gi
///         v[i] = b2 * v[i] + (1 - b2) * gi * gi
///         p[i] -= (lr / bc1) * m[i] / ((v[i] ** 0.5) / bc2 ** 0.5 + eps)
///     print("step", t)
///     print("p", [repr(x) for x in p]); print("m", [repr(x) for x in m])
///     print("v", [repr(x) for x in v])
/// ```
///
/// The f32 reference differs from it only by rounding (constants rounded to
/// f32, f32 arithmetic), so each value must be within 2 f32 ulps of the truth,
/// ulps taken at the larger of the value and its value one step earlier.
#[test]
fn adamw_golden_three_steps() {
    let params = AdamWParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let grads: [[f32; 5]; 3] = [
        [0.25, -2.0, 0.0, 1.5, -0.001953125],
        [-0.5, -1.0, 4.0, 1.5, 0.0],
        [0.125, 3.0, -8.0, -0.75, 0.03125],
    ];
    #[rustfmt::skip]
    let expected: [[[f64; 5]; 3]; 3] = [
        [
            [0.49895000008, -1.24887500001, 2.9997, 0.006811718763333334, -0.06149376023989515],
            [0.012499999999999997, -0.09999999999999998, 0.0, 0.07499999999999998, -9.765624999999998e-05],
            [1.5625000000000014e-05, 0.0010000000000000009, 0.0, 0.0005625000000000005, 9.536743164062508e-10],
        ],
        [
            [0.49926620858850707, -1.2478179328829806, 2.9986558931816933, 0.005811037604790341, -0.06081756231550205],
            [-0.013749999999999997, -0.13999999999999996, 0.19999999999999996, 0.14249999999999996, -8.789062499999998e-05],
            [7.810937500000007e-05, 0.0012490000000000012, 0.0040000000000000036, 0.0011244375000000009, 9.527206420898447e-10],
        ],
        [
            [0.49935297262243217, -1.2477751278867841, 2.9986703137606523, 0.005294803103184864, -0.06141677484506544],
            [-0.0061249999999999985, 0.023999999999999994, -0.21999999999999995, 0.09074999999999998, 0.0014833984374999997],
            [8.193751562500007e-05, 0.003497751000000003, 0.019996000000000017, 0.001263938062500001, 2.45092392921448e-07],
        ],
    ];
    let mut p = vec![0.5f32, -1.25, 3.0, 0.0078125, -0.0625];
    let mut m = vec![0.0f32; 5];
    let mut v = vec![0.0f32; 5];
    let mut prev: [[f64; 5]; 3] = [[0.5, -1.25, 3.0, 0.0078125, -0.0625], [0.0; 5], [0.0; 5]];
    for (t, g) in grads.iter().enumerate() {
        let k = AdamWStep::new(&params, params.lr, t as u64 + 1, 0.5);
        adamw_reference::<f32, f32, f32>(&k, &mut p, g, &mut m, &mut v, None).unwrap();
        for (q, (name, got)) in [("p", &p), ("m", &m), ("v", &v)].into_iter().enumerate() {
            let want = &expected[t][q];
            for i in 0..5 {
                let e = ulps_at(got[i], want[i], prev[q][i]);
                assert!(
                    e <= 2.0,
                    "step {} {name}[{i}]: got {} want {} ({e} ulps)",
                    t + 1,
                    got[i],
                    want[i]
                );
            }
        }
        prev = expected[t];
    }
}

/// The same three steps, bit for bit, against an independent emulation of
/// the documented f32 definition in exact rational arithmetic (python3, no
/// packages), which printed the expected bit patterns:
///
/// ```python
/// # Bit-exact f32 emulation of zero's documented AdamW reference, in exact
/// # rational arithmetic (fractions), rounding to f32 (nearest, ties to even)
/// # exactly where the definition rounds. beta^t follows compiler-rt's powi
/// # (binary exponentiation in f64), as f64::powi does.
/// from fractions import Fraction as F
/// import math, struct
/// def r32(x):
///     x = F(x)
///     if x == 0: return 0.0
///     s = -1 if x < 0 else 1; a = abs(x)
///     e = math.floor(math.log2(a))
///     while F(2) ** e > a: e -= 1
///     while F(2) ** (e + 1) <= a: e += 1
///     q = F(2) ** (max(e, -126) - 23)
///     n = a / q; fl = math.floor(n); rem = n - fl
///     if rem > F(1, 2) or (rem == F(1, 2) and fl % 2 == 1): fl += 1
///     return s * float(fl * q)
/// def powi(a, b):
///     r = 1.0
///     while True:
///         if b & 1: r *= a
///         b >>= 1
///         if b == 0: return r
///         a *= a
/// def fma(a, b, c): return r32(F(a) * F(b) + F(c))
/// def mul(a, b): return r32(F(a) * F(b))
/// def sqrt32(x): return r32(F(math.sqrt(x)))  # f64 sqrt then f32: innocuous double rounding
/// lr, b1, b2, eps, wd, gs = 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.5
/// p = [0.5, -1.25, 3.0, 0.0078125, -0.0625]
/// grads = [
///     [0.25, -2.0, 0.0, 1.5, -0.001953125],
///     [-0.5, -1.0, 4.0, 1.5, 0.0],
///     [0.125, 3.0, -8.0, -0.75, 0.03125],
/// ]
/// m = [0.0] * 5; v = [0.0] * 5
/// B1, B2, OB1, OB2, EPS = r32(b1), r32(b2), r32(1.0 - b1), r32(1.0 - b2), r32(eps)
/// DECAY = r32(1.0 - lr * wd)
/// hexs = lambda xs: "[" + ", ".join("0x%08x" % struct.unpack("<I", struct.pack("<f", x))[0] for x in xs) + "]"
/// for t, g in enumerate(grads, start=1):
///     SS = r32(lr / (1.0 - powi(b1, t))); ISB2 = r32(1.0 / math.sqrt(1.0 - powi(b2, t)))
///     for i in range(5):
///         gi = mul(g[i], gs)
///         m[i] = fma(B1, m[i], mul(OB1, gi))
///         v[i] = fma(B2, v[i], mul(mul(OB2, gi), gi))
///         d = fma(sqrt32(v[i]), ISB2, EPS)
///         p[i] = fma(-SS, r32(F(m[i]) / F(d)), mul(p[i], DECAY))
///     print("step", t); print(" p", hexs(p)); print(" m", hexs(m)); print(" v", hexs(v))
/// ```
#[test]
#[rustfmt::skip]
fn adamw_golden_three_steps_bit_exact() {
    let params = AdamWParams { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
    let grads: [[f32; 5]; 3] = [
        [0.25, -2.0, 0.0, 1.5, -0.001953125],
        [-0.5, -1.0, 4.0, 1.5, 0.0],
        [0.125, 3.0, -8.0, -0.75, 0.03125],
    ];
    let expected: [[[u32; 5]; 3]; 3] = [
        [
            [0x3eff7660, 0xbf9fdb22, 0x403ffb16, 0x3bdf34d6, 0xbd7be0e1],
            [0x3c4ccccd, 0xbdcccccd, 0x00000000, 0x3d99999a, 0xb8cccccd],
            [0x3783126f, 0x3a83126f, 0x00000000, 0x3a1374bc, 0x3083126f],
        ],
        [
            [0x3eff9fd2, 0xbf9fb87e, 0x403fe9fb, 0x3bbe6a83, 0xbd791bd5],
            [0xbc6147af, 0xbe0f5c29, 0x3e4ccccd, 0x3e11eb85, 0xb8b851eb],
            [0x38a3cea7, 0x3aa3b57d, 0x3b83126f, 0x3a9361dc, 0x3082f0e1],
        ],
        [
            [0x3effab31, 0xbf9fb717, 0x403fea37, 0x3bad8006, 0xbd7b9026],
            [0xbbc8b43a, 0x3cc49bab, 0xbe6147af, 0x3db9db22, 0x3ac26e98],
            [0x38abd5df, 0x3b653a86, 0x3ca3cea7, 0x3aa5aab9, 0x3483953e],
        ],
    ];
    let mut p = vec![0.5f32, -1.25, 3.0, 0.0078125, -0.0625];
    let mut m = vec![0.0f32; 5];
    let mut v = vec![0.0f32; 5];
    for (t, g) in grads.iter().enumerate() {
        let k = AdamWStep::new(&params, params.lr, t as u64 + 1, 0.5);
        adamw_reference::<f32, f32, f32>(&k, &mut p, g, &mut m, &mut v, None).unwrap();
        for (q, got) in [&p, &m, &v].into_iter().enumerate() {
            let bits: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
            assert_eq!(bits, expected[t][q], "step {} {}", t + 1, ["p", "m", "v"][q]);
        }
    }
}

/// The slice reference equals a loop of `adamw_element` with the documented
/// conversions, bit for bit, for every element-type combination.
fn check_reference_matches_element<G: Element, M: Element, P: Element>(seed: u64) {
    let params = AdamWParams {
        lr: 2e-3,
        beta1: 0.85,
        beta2: 0.995,
        eps: 1e-6,
        weight_decay: 0.05,
    };
    let mut rng = Rng(seed);
    for n in [1usize, 7, 33, 1001] {
        let mut master: Vec<f32> = (0..n).map(|_| rng.wide()).collect();
        let mut m: Vec<M> = vec![M::from_f32(0.0); n];
        let mut v: Vec<M> = vec![M::from_f32(0.0); n];
        let mut low: Vec<P> = vec![P::from_f32(0.0); n];
        let mut e_master = master.clone();
        let mut e_m = m.clone();
        let mut e_v = v.clone();
        for step in 1..=3u64 {
            let grad: Vec<G> = vec_of(&mut rng, n);
            let k = AdamWStep::new(&params, params.lr, step, 0.75);
            adamw_reference(&k, &mut master, &grad, &mut m, &mut v, Some(&mut low[..])).unwrap();
            for i in 0..n {
                let (p1, m1, v1) = adamw_element(
                    &k,
                    e_master[i],
                    grad[i].to_f32(),
                    e_m[i].to_f32(),
                    e_v[i].to_f32(),
                );
                e_master[i] = p1;
                e_m[i] = M::from_f32(m1);
                e_v[i] = M::from_f32(v1);
                let ctx = || {
                    format!(
                        "G={:?} M={:?} P={:?} n={n} step={step} i={i}",
                        G::DTYPE,
                        M::DTYPE,
                        P::DTYPE
                    )
                };
                assert_eq!(master[i].to_bits(), p1.to_bits(), "{}", ctx());
                assert_eq!(m[i], e_m[i], "{}", ctx());
                assert_eq!(v[i], e_v[i], "{}", ctx());
                assert_eq!(low[i], P::from_f32(p1), "{}", ctx());
            }
        }
        // Without a low-precision copy the master and moments are the same.
        let grad: Vec<G> = vec_of(&mut rng, n);
        let k = AdamWStep::new(&params, params.lr, 4, 1.0);
        let (mut a, mut am, mut av) = (master.clone(), m.clone(), v.clone());
        adamw_reference::<G, M, P>(&k, &mut a, &grad, &mut am, &mut av, None).unwrap();
        adamw_reference(&k, &mut master, &grad, &mut m, &mut v, Some(&mut low[..])).unwrap();
        assert_eq!(a, master);
        assert_eq!(am, m);
        assert_eq!(av, v);
    }
}

macro_rules! all_combinations {
    ($($g:ty),*) => {{
        let mut seed = 1u64;
        $(
            all_combinations!(@m $g, seed; f32, bf16, f16);
        )*
        let _ = seed;
    }};
    (@m $g:ty, $seed:ident; $($m:ty),*) => {
        $(
            all_combinations!(@p $g, $m, $seed; f32, bf16, f16);
        )*
    };
    (@p $g:ty, $m:ty, $seed:ident; $($p:ty),*) => {
        $(
            $seed += 1;
            check_reference_matches_element::<$g, $m, $p>($seed);
        )*
    };
}

#[test]
fn reference_equals_element_loop_for_all_types() {
    all_combinations!(f32, bf16, f16);
}

#[test]
fn length_mismatch_is_an_error_and_changes_nothing() {
    let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 1, 1.0);
    let mut master = vec![1.0f32; 5];
    let mut m = vec![0.0f32; 5];
    let mut v = vec![0.0f32; 5];
    let mut low = vec![bf16::ZERO; 5];
    let grad = vec![1.0f32; 5];
    let short = vec![1.0f32; 4];

    let cases: Vec<(&str, Result<(), Error>)> = vec![
        (
            "grad 4",
            adamw_reference::<f32, f32, f32>(&k, &mut master, &short, &mut m, &mut v, None),
        ),
        (
            "m 4",
            adamw_reference::<f32, f32, f32>(&k, &mut master, &grad, &mut m[..4], &mut v, None),
        ),
        (
            "v 4",
            adamw_reference::<f32, f32, f32>(&k, &mut master, &grad, &mut m, &mut v[..4], None),
        ),
        (
            "low 4",
            adamw_reference(&k, &mut master, &grad, &mut m, &mut v, Some(&mut low[..4])),
        ),
        (
            "grad 4",
            adamw_reference::<f32, f32, f32>(&k, &mut master[..5], &short, &mut m, &mut v, None),
        ),
    ];
    for (needle, r) in cases {
        match r {
            Err(Error::InvalidSize { op, msg }) => {
                assert_eq!(op, "adamw");
                assert!(msg.contains("master 5"), "{msg}");
                assert!(msg.contains(needle), "{msg} should contain {needle}");
            }
            other => panic!("expected InvalidSize, got {other:?}"),
        }
    }
    assert_eq!(master, vec![1.0f32; 5]);
    assert_eq!(m, vec![0.0f32; 5]);
    assert_eq!(v, vec![0.0f32; 5]);
    assert_eq!(low, vec![bf16::ZERO; 5]);
}

#[test]
fn empty_slices_are_fine() {
    let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 1, 1.0);
    adamw_reference::<bf16, f32, bf16>(&k, &mut [], &[], &mut [], &mut [], Some(&mut [])).unwrap();
}

#[test]
fn weight_decay_is_decoupled() {
    // A zero gradient with zero moments leaves only the decay: p' = p * decay.
    let params = AdamWParams {
        weight_decay: 0.1,
        ..AdamWParams::torch_default()
    };
    for step in [1u64, 5, 100] {
        let k = AdamWStep::new(&params, 0.01, step, 1.0);
        assert_eq!(k.decay, (1.0 - 0.01 * 0.1) as f32);
        let mut master = vec![1.0f32, -3.5, 0.125, 1e-20, 0.0];
        let before = master.clone();
        let mut m = vec![0.0f32; 5];
        let mut v = vec![0.0f32; 5];
        adamw_reference::<f32, f32, f32>(&k, &mut master, &[0.0; 5], &mut m, &mut v, None).unwrap();
        for (a, b) in master.iter().zip(&before) {
            assert_eq!(a.to_bits(), (b * k.decay).to_bits());
        }
        assert_eq!(m, vec![0.0; 5]);
        assert_eq!(v, vec![0.0; 5]);
    }
    // The decay does not scale with the gradient: with wd = 0 nothing decays.
    let k = AdamWStep::new(
        &AdamWParams {
            weight_decay: 0.0,
            ..params
        },
        0.01,
        1,
        1.0,
    );
    assert_eq!(k.decay, 1.0);
    assert_eq!(adamw_element(&k, 2.0, 0.0, 0.0, 0.0), (2.0, 0.0, 0.0));
}

#[test]
fn first_step_moves_by_lr_times_sign() {
    // With bias correction, step 1 has m_hat = g and v_hat = g^2, so the
    // update is lr * g / (|g| + eps) = lr * sign(g) for |g| >> eps,
    // whatever the gradient's magnitude and the gradient scale.
    let params = AdamWParams {
        weight_decay: 0.0,
        ..AdamWParams::torch_default()
    };
    let lr = 1e-2;
    for grad_scale in [1.0f32, 1.0 / 256.0] {
        let k = AdamWStep::new(&params, lr, 1, grad_scale);
        for g in [1e-2f32, -0.5, 7.0, -3e3, 65504.0] {
            let (p1, _, _) = adamw_element(&k, 1.0, g, 0.0, 0.0);
            let delta = f64::from(p1) - 1.0;
            let want = -lr * f64::from(g.signum());
            // Off by the relative weight of eps, plus f32 rounding near 1.0.
            let tol = lr * (1e-8 / f64::from((g * grad_scale).abs()) + 1e-4);
            assert!(
                (delta - want).abs() <= tol,
                "g={g} scale={grad_scale}: moved {delta}, want {want}"
            );
        }
    }
}

#[test]
fn grad_scale_multiplies_the_raw_gradient() {
    let params = AdamWParams::torch_default();
    let k = AdamWStep::new(&params, 1e-3, 3, 0.125);
    let k1 = AdamWStep {
        grad_scale: 1.0,
        ..k
    };
    // Scaling by a power of two is exact, so these agree bit for bit.
    assert_eq!(
        adamw_element(&k, 0.3, 8.0, 0.01, 0.02),
        adamw_element(&k1, 0.3, 1.0, 0.01, 0.02)
    );
}

// ---------------------------------------------------------------------------
// Gradient norm
// ---------------------------------------------------------------------------

/// The documented order, written independently: per chunk, each lane is a
/// strided fold; the lanes meet in a recursive halving tree.
fn expected_sum_squares<G: Element>(x: &[G]) -> f64 {
    fn tree(v: &[f64]) -> f64 {
        if v.len() == 1 {
            v[0]
        } else {
            let (a, b) = v.split_at(v.len() / 2);
            tree(a) + tree(b)
        }
    }
    let mut total = 0.0f64;
    let mut start = 0;
    while start < x.len() {
        let end = (start + NORM_CHUNK).min(x.len());
        let chunk = &x[start..end];
        let lanes: Vec<f64> = (0..NORM_LANES)
            .map(|j| {
                chunk
                    .iter()
                    .skip(j)
                    .step_by(NORM_LANES)
                    .fold(0.0f64, |acc, e| {
                        let y = e.to_f32() as f64;
                        acc + y * y
                    })
            })
            .collect();
        total += tree(&lanes);
        start = end;
    }
    total
}

const NORM_LENGTHS: [usize; 9] = [0, 1, 15, 16, 17, 65535, 65536, 65537, 200003];

fn check_sum_squares<G: Element>(seed: u64) {
    let mut rng = Rng(seed);
    for n in NORM_LENGTHS {
        let x: Vec<G> = vec_of(&mut rng, n);
        let got = sum_squares(&x);
        let want = expected_sum_squares(&x);
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "{:?} n={n}: {got} vs {want}",
            G::DTYPE
        );
        // And it is a sum of squares, up to f64 rounding.
        let naive: f64 = x.iter().map(|e| (e.to_f32() as f64).powi(2)).sum();
        assert!(
            close_rel(got, naive, 1e-12),
            "n={n}: {got} vs naive {naive}"
        );
    }
}

#[test]
fn sum_squares_follows_the_documented_order() {
    check_sum_squares::<f32>(11);
    check_sum_squares::<bf16>(12);
    check_sum_squares::<f16>(13);
    assert_eq!(sum_squares::<f32>(&[]).to_bits(), 0.0f64.to_bits());
}

#[test]
fn sum_squares_order_is_observable() {
    // A case where the lane order gives a different f64 than a plain
    // left-to-right sum, so the test above does pin the order down.
    let mut rng = Rng(99);
    let x: Vec<f32> = (0..200003).map(|_| rng.wide()).collect();
    let sequential = x.iter().fold(0.0f64, |a, e| a + (*e as f64) * (*e as f64));
    assert_ne!(sum_squares(&x).to_bits(), sequential.to_bits());
}

#[test]
fn sum_squares_propagates_nan_and_inf() {
    let mut rng = Rng(5);
    let base: Vec<f32> = (0..200003).map(|_| rng.unit()).collect();
    for at in [0usize, 17, 65536, 200002] {
        let mut x = base.clone();
        x[at] = f32::NAN;
        assert!(sum_squares(&x).is_nan(), "NaN at {at}");
        x[at] = f32::INFINITY;
        assert_eq!(sum_squares(&x), f64::INFINITY, "inf at {at}");
        x[at] = f32::NEG_INFINITY;
        let next = (at + 1) % x.len();
        x[next] = f32::INFINITY;
        assert_eq!(sum_squares(&x), f64::INFINITY, "-inf and inf near {at}");
    }
    let mut h: Vec<f16> = vec![f16::ONE; 100];
    h[50] = f16::INFINITY;
    assert!(!sum_squares(&h).is_finite());
    let mut b: Vec<bf16> = vec![bf16::ONE; 100];
    b[99] = bf16::NAN;
    assert!(sum_squares(&b).is_nan());
    // Large finite f32 values do not overflow in f64.
    assert!(sum_squares(&[f32::MAX; 1000]).is_finite());
}

#[test]
fn clip_coefficient_matches_deepspeed() {
    // Clipping off.
    assert_eq!(clip_coefficient(123.0, 0.0), 1.0);
    assert_eq!(clip_coefficient(123.0, -1.0), 1.0);
    // Under the limit: no clipping.
    assert_eq!(clip_coefficient(0.99, 1.0), 1.0);
    assert_eq!(clip_coefficient(0.0, 1.0), 1.0);
    // Over the limit: max_norm / (norm + 1e-6).
    assert_eq!(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
    assert_eq!(clip_coefficient(10.0, 2.5), 2.5 / (10.0 + 1e-6));
    // Exactly at the limit the 1e-6 makes it (just) below 1.
    assert!(clip_coefficient(1.0, 1.0) < 1.0);
    // Non-finite norms leave the gradients alone (the step is skipped).
    assert_eq!(clip_coefficient(f64::INFINITY, 1.0), 1.0);
    assert_eq!(clip_coefficient(f64::NAN, 1.0), 1.0);
}

// ---------------------------------------------------------------------------
// Learning-rate schedules
// ---------------------------------------------------------------------------

// Golden values: DeepSpeed's deepspeed/runtime/lr_schedules.py formulas for
// `last_batch_iteration` = it, evaluated by this Python script (python3):
//
// ```python
// import math
// def warm(kind, it, w):
//     return (1.0 / math.log(w)) * math.log(it + 1) if kind == "log" else it / w
// def warmup_lr(mn, mx, ws, kind, it):
//     w = max(2, ws)
//     g = warm(kind, it, w) if it < w else 1.0
//     return mn + (mx - mn) * g
// def warmup_decay(mn, mx, ws, total, kind, it):
//     w = max(2, ws)
//     g = warm(kind, it, w) if it < w else max(0.0, float(total - it) / float(max(1.0, total - w)))
//     return mn + (mx - mn) * g
// def cosine(base, total, wmr, ws, cmr, kind, it):
//     w = max(2, ws)
//     if it < w:
//         r = wmr + warm(kind, it, w) * (1. - wmr)
//     else:
//         prog = min(1.0, (it - w + 1) / max(1, total - w))
//         r = max(0.0, cmr + (1. - cmr) * ((1 + math.cos(math.pi * prog)) / 2))
//     return base * r
// def show(name, f, steps):
//     print(name, ", ".join(f"({s}, {f(s)!r})" for s in steps))
// show("wlr_log", lambda s: warmup_lr(1e-5, 1e-3, 100, "log", s), [0, 1, 2, 10, 50, 99, 100, 101, 1000])
// show("wlr_lin0", lambda s: warmup_lr(0.0, 3e-4, 0, "linear", s), [0, 1, 2, 3])
// show("wlr_lin", lambda s: warmup_lr(2e-5, 6e-4, 7, "linear", s), [0, 1, 3, 6, 7, 8])
// show("wd_log", lambda s: warmup_decay(0.0, 3e-4, 10, 100, "log", s), [0, 5, 9, 10, 11, 50, 99, 100, 101, 500])
// show("wd_lin", lambda s: warmup_decay(1e-5, 1e-3, 10, 100, "linear", s), [0, 5, 9, 10, 11, 50, 99, 100, 101])
// show("wd_short", lambda s: warmup_decay(1e-5, 1e-3, 10, 5, "linear", s), [9, 10, 11])
// show("cos_log", lambda s: cosine(2e-4, 1000, 0.1, 100, 1e-4, "log", s), [0, 1, 50, 99, 100, 101, 550, 998, 999, 1000, 1001, 5000])
// show("cos_lin", lambda s: cosine(1e-3, 20, 0.0, 4, 0.01, "linear", s), [0, 1, 3, 4, 5, 12, 19, 20, 21])
// show("cos_short", lambda s: cosine(1e-3, 50, 0.0, 100, 0.05, "log", s), [99, 100, 101])
// show("cos_w1", lambda s: cosine(1e-3, 10, 0.2, 1, 0.0, "linear", s), [0, 1, 2, 5, 10])
// ```
//
// The operation order is DeepSpeed's, so the values agree to the last bit
// except where libm's `ln`/`cos` differ between platforms; the tolerance is a
// few f64 ulps.

fn check_schedule(name: &str, s: LrSchedule, table: &[(u64, f64)]) {
    for &(step, want) in table {
        let got = s.lr_at(step);
        assert!(
            close_rel(got, want, 4.0 * f64::EPSILON),
            "{name} step {step}: got {got:e}, want {want:e}"
        );
    }
}

fn warmup_lr(min_lr: f64, max_lr: f64, warmup_steps: u64, warmup_type: WarmupType) -> LrSchedule {
    LrSchedule::WarmupLr {
        min_lr,
        max_lr,
        warmup_steps,
        warmup_type,
    }
}

fn warmup_decay(
    min_lr: f64,
    max_lr: f64,
    warmup_steps: u64,
    total_steps: u64,
    warmup_type: WarmupType,
) -> LrSchedule {
    LrSchedule::WarmupDecayLr {
        min_lr,
        max_lr,
        warmup_steps,
        total_steps,
        warmup_type,
    }
}

fn cosine(
    base_lr: f64,
    total_steps: u64,
    warmup_min_ratio: f64,
    warmup_steps: u64,
    cos_min_ratio: f64,
    warmup_type: WarmupType,
) -> LrSchedule {
    LrSchedule::WarmupCosineLr {
        base_lr,
        total_steps,
        warmup_min_ratio,
        warmup_steps,
        cos_min_ratio,
        warmup_type,
    }
}

use WarmupType::{Linear, Log};

#[test]
fn constant_schedule() {
    let s = LrSchedule::Constant { lr: 3e-4 };
    for step in [0, 1, 1000, u64::MAX] {
        assert_eq!(s.lr_at(step), 3e-4);
    }
}

#[test]
#[rustfmt::skip]
fn warmup_lr_golden() {
    check_schedule("wlr_log", warmup_lr(1e-5, 1e-3, 100, Log), &[
        (0, 1e-05), (1, 0.00015900984785367068), (2, 0.00024617502108623286), (10, 0.0005254893791533213),
        (50, 0.0008552472371684784), (99, 0.0009999999999999998), (100, 0.001), (101, 0.001), (1000, 0.001),
    ]);
    check_schedule("wlr_lin0", warmup_lr(0.0, 3e-4, 0, Linear), &[
        (0, 0.0), (1, 0.00015), (2, 0.0003), (3, 0.0003),
    ]);
    check_schedule("wlr_lin", warmup_lr(2e-5, 6e-4, 7, Linear), &[
        (0, 2e-05), (1, 0.00010285714285714283), (3, 0.0002685714285714285), (6, 0.0005171428571428571),
        (7, 0.0006), (8, 0.0006),
    ]);
}

#[test]
#[rustfmt::skip]
fn warmup_decay_lr_golden() {
    check_schedule("wd_log", warmup_decay(0.0, 3e-4, 10, 100, Log), &[
        (0, 0.0), (5, 0.00023344537511509303), (9, 0.0002999999999999999), (10, 0.0003),
        (11, 0.00029666666666666665), (50, 0.00016666666666666666), (99, 3.3333333333333333e-06),
        (100, 0.0), (101, 0.0), (500, 0.0),
    ]);
    check_schedule("wd_lin", warmup_decay(1e-5, 1e-3, 10, 100, Linear), &[
        (0, 1e-05), (5, 0.000505), (9, 0.000901), (10, 0.001), (11, 0.000989),
        (50, 0.0005600000000000001), (99, 2.1000000000000002e-05), (100, 1e-05), (101, 1e-05),
    ]);
    // total_steps < warmup_steps: after warm-up, straight to min_lr.
    check_schedule("wd_short", warmup_decay(1e-5, 1e-3, 10, 5, Linear), &[
        (9, 0.000901), (10, 1e-05), (11, 1e-05),
    ]);
}

#[test]
#[rustfmt::skip]
fn warmup_cosine_lr_golden() {
    check_schedule("cos_log", cosine(2e-4, 1000, 0.1, 100, 1e-4, Log), &[
        (0, 2e-05), (1, 4.7092699609758305e-05), (50, 0.00017368131584881425), (99, 0.00019999999999999998),
        (100, 0.00019999939082670248), (101, 0.00019999756331423243), (550, 9.966096976499182e-05),
        (998, 2.0609173297538615e-08), (999, 2e-08), (1000, 2e-08), (1001, 2e-08), (5000, 2e-08),
    ]);
    check_schedule("cos_lin", cosine(1e-3, 20, 0.0, 4, 0.01, Linear), &[
        (0, 0.0), (1, 0.00025), (3, 0.00075), (4, 0.000990488713799599), (5, 0.000962320368593087),
        (12, 0.00040843029060201656), (19, 1e-05), (20, 1e-05), (21, 1e-05),
    ]);
    // total_steps <= warmup_steps: after warm-up, straight to the floor.
    check_schedule("cos_short", cosine(1e-3, 50, 0.0, 100, 0.05, Log), &[
        (99, 0.0009999999999999998), (100, 5e-05), (101, 5e-05),
    ]);
    // warmup_steps 1 behaves as 2.
    check_schedule("cos_w1", cosine(1e-3, 10, 0.2, 1, 0.0, Linear), &[
        (0, 0.0002), (1, 0.0006000000000000001), (2, 0.0009619397662556434), (5, 0.0005), (10, 0.0),
    ]);
}

#[test]
fn warmup_steps_zero_and_one_act_as_two() {
    for t in [Log, Linear] {
        for step in 0..6 {
            let two = warmup_lr(1e-5, 1e-3, 2, t).lr_at(step);
            assert_eq!(warmup_lr(1e-5, 1e-3, 0, t).lr_at(step), two);
            assert_eq!(warmup_lr(1e-5, 1e-3, 1, t).lr_at(step), two);
            let two = warmup_decay(1e-5, 1e-3, 2, 10, t).lr_at(step);
            assert_eq!(warmup_decay(1e-5, 1e-3, 1, 10, t).lr_at(step), two);
            let two = cosine(1e-3, 10, 0.1, 2, 0.01, t).lr_at(step);
            assert_eq!(cosine(1e-3, 10, 0.1, 0, 0.01, t).lr_at(step), two);
        }
    }
}

#[test]
fn warmup_is_monotonic_and_starts_at_the_minimum() {
    for t in [Log, Linear] {
        let schedules = [
            (warmup_lr(1e-5, 1e-3, 500, t), 1e-5),
            (warmup_decay(0.0, 3e-4, 500, 2000, t), 0.0),
            (cosine(1e-3, 2000, 0.05, 500, 1e-3, t), 1e-3 * 0.05),
        ];
        for (s, first) in schedules {
            assert_eq!(s.lr_at(0), first, "{s:?}");
            let mut prev = s.lr_at(0);
            // Warm-up covers steps 0..w; step w is the first after it.
            for step in 1..500 {
                let lr = s.lr_at(step);
                assert!(
                    lr >= prev,
                    "{s:?}: lr fell from {prev} to {lr} at step {step}"
                );
                prev = lr;
            }
            // The last warm-up step is at the peak (log: ln(w)/ln(w), up to
            // rounding) or (w-1)/w of the way there (linear).
            let (peak, floor) = match s {
                LrSchedule::WarmupCosineLr { base_lr, .. } => (base_lr, 0.05 * base_lr),
                _ => (s.lr_at(500), first),
            };
            let want = match t {
                Log => peak,
                Linear => floor + (peak - floor) * 499.0 / 500.0,
            };
            assert!(close_rel(prev, want, 1e-12), "{s:?}: {prev} vs {want}");
            assert!(prev <= peak * (1.0 + 1e-15));
        }
    }
}

#[test]
fn value_at_total_steps_and_beyond() {
    let d = warmup_decay(1e-5, 1e-3, 100, 1000, Log);
    assert_eq!(d.lr_at(1000), 1e-5);
    assert_eq!(d.lr_at(5000), 1e-5);
    assert!(d.lr_at(999) > 1e-5);
    // Decay is monotonic after warm-up.
    let mut prev = d.lr_at(100);
    assert_eq!(prev, 1e-3);
    for step in 101..=1100 {
        let lr = d.lr_at(step);
        assert!(lr <= prev);
        prev = lr;
    }
    let c = cosine(1e-3, 1000, 0.0, 100, 0.01, Linear);
    assert_eq!(c.lr_at(1000), 1e-3 * 0.01);
    assert_eq!(c.lr_at(u64::MAX), 1e-3 * 0.01);
    let mut prev = c.lr_at(100);
    for step in 101..=1100 {
        let lr = c.lr_at(step);
        assert!(lr <= prev);
        prev = lr;
    }
}

// ---------------------------------------------------------------------------
// Loss scaler
// ---------------------------------------------------------------------------

fn dynamic(
    power: u32,
    window: u64,
    hysteresis: u32,
    consecutive: bool,
    min_scale: f32,
) -> LossScaleConfig {
    LossScaleConfig::Dynamic {
        initial_scale_power: power,
        window,
        hysteresis,
        consecutive_hysteresis: consecutive,
        min_scale,
    }
}

/// Drives `scaler` through `(overflow, scale after, hysteresis after)` rows.
fn run_script(scaler: &mut LossScaler, script: &[(bool, f32, u32)]) {
    for (it, &(overflow, scale, hysteresis)) in script.iter().enumerate() {
        assert_eq!(scaler.iteration(), it as u64);
        assert_eq!(scaler.update(overflow), overflow, "iteration {it}");
        assert_eq!(
            (scaler.scale(), scaler.hysteresis()),
            (scale, hysteresis),
            "after iteration {it}"
        );
    }
}

/// DeepSpeed's `DynamicLossScaler.update_scale`, worked by hand for window 3,
/// hysteresis 2, no consecutive hysteresis, `min_scale` 1, initial 2^4.
///
/// On overflow at iteration `it`: halve (floored at `min_scale`) if the
/// remaining hysteresis is 1, else use up one unit; `last_overflow = it`.
/// On a good step: `stable = it - last_overflow - 1` (last_overflow starts at
/// -1); double and refill hysteresis when `stable > 0` and `stable % 3 == 0`.
#[test]
#[rustfmt::skip]
fn dynamic_scaler_script() {
    let o = true; // overflow
    let g = false; // good step
    let script = [
        // it  event   scale  hyst   why
        /*  0 */ (g, 16.0, 2), // stable 0
        /*  1 */ (g, 16.0, 2), // stable 1
        /*  2 */ (g, 16.0, 2), // stable 2
        /*  3 */ (g, 32.0, 2), // stable 3: first window since start -> double
        /*  4 */ (o, 32.0, 1), // hysteresis 2 absorbs the first overflow
        /*  5 */ (o, 16.0, 1), // hysteresis 1: halve; hysteresis is not refilled
        /*  6 */ (g, 16.0, 1), // stable 0
        /*  7 */ (g, 16.0, 1), // stable 1
        /*  8 */ (g, 16.0, 1), // stable 2
        /*  9 */ (g, 32.0, 2), // stable 3 -> double, refill hysteresis
        /* 10 */ (o, 32.0, 1), // absorbed
        /* 11 */ (g, 32.0, 1), // stable 0; no refill without consecutive_hysteresis
        /* 12 */ (o, 16.0, 1), // halve
        /* 13 */ (o,  8.0, 1),
        /* 14 */ (o,  4.0, 1),
        /* 15 */ (o,  2.0, 1),
        /* 16 */ (o,  1.0, 1), // reaches min_scale
        /* 17 */ (o,  1.0, 1), // floor: max(0.5, 1)
        /* 18 */ (g,  1.0, 1), // stable 0
        /* 19 */ (g,  1.0, 1), // stable 1
        /* 20 */ (g,  1.0, 1), // stable 2
        /* 21 */ (g,  2.0, 2), // stable 3 -> double
        /* 22 */ (g,  2.0, 2), // stable 4
        /* 23 */ (g,  2.0, 2), // stable 5
        /* 24 */ (g,  4.0, 2), // stable 6 -> double again
    ];
    let mut s = LossScaler::new(dynamic(4, 3, 2, false, 1.0));
    assert_eq!(s.scale(), 16.0);
    assert_eq!(s.hysteresis(), 2);
    assert_eq!(s.last_overflow_iteration(), None);
    run_script(&mut s, &script);
    assert_eq!(s.last_overflow_iteration(), Some(17));
    assert_eq!(s.iteration(), 25);
}

/// With `consecutive_hysteresis`, every good step refills the hysteresis, so
/// with hysteresis 2 only two overflows in a row halve the scale.
#[test]
#[rustfmt::skip]
fn consecutive_hysteresis_script() {
    let (o, g) = (true, false);
    let script = [
        /* 0 */ (o, 1024.0, 1),
        /* 1 */ (g, 1024.0, 2), // refilled by a good step
        /* 2 */ (o, 1024.0, 1), // absorbed again
        /* 3 */ (o,  512.0, 1), // second in a row: halve
        /* 4 */ (g,  512.0, 2),
        /* 5 */ (o,  512.0, 1),
        /* 6 */ (g,  512.0, 2),
    ];
    let mut s = LossScaler::new(dynamic(10, 100, 2, true, 1.0));
    run_script(&mut s, &script);
}

/// Doubling is counted from the last overflow (window 2, hysteresis 1).
#[test]
#[rustfmt::skip]
fn window_doubling_counts_from_the_last_overflow() {
    let (o, g) = (true, false);
    let script = [
        /* 0 */ (g,  8.0, 1), // stable 0
        /* 1 */ (g,  8.0, 1), // stable 1
        /* 2 */ (g, 16.0, 1), // stable 2 -> double
        /* 3 */ (g, 16.0, 1), // stable 3
        /* 4 */ (g, 32.0, 1), // stable 4 -> double
        /* 5 */ (o, 16.0, 1), // hysteresis 1: halve at once
        /* 6 */ (g, 16.0, 1), // stable 0
        /* 7 */ (g, 16.0, 1), // stable 1
        /* 8 */ (g, 32.0, 1), // stable 2 -> double
    ];
    let mut s = LossScaler::new(dynamic(3, 2, 1, false, 1.0));
    run_script(&mut s, &script);
}

#[test]
fn min_scale_floor() {
    let mut s = LossScaler::new(dynamic(2, 1000, 1, false, 0.25));
    let expected = [2.0f32, 1.0, 0.5, 0.25, 0.25, 0.25];
    for want in expected {
        assert!(s.update(true));
        assert_eq!(s.scale(), want);
    }
    // A floor that is not a power of two is reached exactly, too.
    let mut s = LossScaler::new(dynamic(3, 1000, 1, false, 3.0));
    s.update(true);
    assert_eq!(s.scale(), 4.0);
    s.update(true);
    assert_eq!(s.scale(), 3.0);
    s.update(true);
    assert_eq!(s.scale(), 3.0);
}

#[test]
fn static_scaler_never_changes() {
    let mut s = LossScaler::new(LossScaleConfig::Static { scale: 128.0 });
    for i in 0..50u64 {
        let overflow = i % 3 == 0;
        assert_eq!(s.update(overflow), overflow);
        assert_eq!(s.scale(), 128.0);
    }
    assert_eq!(s.iteration(), 50);
}

#[test]
fn default_like_dynamic_scaler_starts_at_two_to_the_power() {
    let s = LossScaler::new(dynamic(16, 1000, 2, false, 1.0));
    assert_eq!(s.scale(), 65536.0);
    assert_eq!(s.config(), &dynamic(16, 1000, 2, false, 1.0));
}

#[test]
fn loss_scaler_serde_round_trip_resumes_identically() {
    let mut a = LossScaler::new(dynamic(8, 4, 2, false, 1.0));
    let events = [
        false, true, false, false, true, true, false, false, false, false, false, true,
    ];
    for &e in &events[..6] {
        a.update(e);
    }
    let json = serde_json::to_string(&a).unwrap();
    let mut b: LossScaler = serde_json::from_str(&json).unwrap();
    assert_eq!(a, b);
    for &e in &events[6..] {
        assert_eq!(a.update(e), b.update(e));
        assert_eq!(a, b);
    }
    let s = LossScaler::new(LossScaleConfig::Static { scale: 4.0 });
    let back: LossScaler = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
    assert_eq!(back, s);
}
