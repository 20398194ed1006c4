//! The fast CPU AdamW and norm kernels (`zero_core::optim::CpuAdamW`)
//! against the reference, element by element, on every instruction set this
//! CPU has: every gradient / moment / copy type, odd lengths, misaligned
//! starts, several threads and tile sizes, special values; the bf16 and f16
//! conversions on a dense sample of all f32 bit patterns; the norm pass.

use zero_core::optim::{
    adamw_reference, sum_squares, AdamWParams, AdamWSlices, AdamWStep, CpuAdamW, Isa, NORM_CHUNK,
};
use zero_core::{bf16, f16, Element, Error};

use zero_testkit::rng::Rng;

trait Wide {
    fn wide(&mut self) -> f32;
}

impl Wide for Rng {
    /// Values over many binades, with a sprinkling of zeros, subnormals and
    /// values near the f16 range's ends.
    fn wide(&mut self) -> f32 {
        match self.next_u64() % 64 {
            0 => 0.0,
            1 => -0.0,
            2 => f32::from_bits((self.next_u64() as u32) & 0x007F_FFFF),
            3 => 65504.0 * (1.0 + self.unit() * 1e-3),
            4 => 6.0e-8 * self.unit(),
            _ => {
                let e = (self.next_u64() % 41) as i32 - 20;
                self.unit() * 2f32.powi(e)
            }
        }
    }
}

/// Every instruction set to check, and always the scalar path.
fn isas() -> Vec<Isa> {
    let a = Isa::available();
    assert!(a.contains(&Isa::Scalar));
    eprintln!("instruction sets checked here: {a:?}");
    a
}

/// Engines to check for `isa`: one thread with big tiles, and three threads
/// with tiles of 64 elements (many tiles, every tile boundary exercised).
fn engines(isa: Isa) -> Vec<CpuAdamW> {
    let base = CpuAdamW::new().with_isa(isa).expect("available");
    vec![
        base.clone().with_threads(1),
        base.clone().with_threads(3).with_tile(64),
        base.with_threads(2)
            .with_tile(100)
            .with_streaming_stores(false),
    ]
}

/// Same bits, or both NaN (NaN payloads are not specified by IEEE and differ
/// between a software `fmaf` and hardware FMA).
fn same<T: Element>(a: T, b: T) -> bool {
    let (x, y) = (a.to_f32(), b.to_f32());
    bytemuck::bytes_of(&a) == bytemuck::bytes_of(&b) || (x.is_nan() && y.is_nan())
}

fn check_same<T: Element>(what: &str, got: &[T], want: &[T], ctx: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            same(*a, *b),
            "{ctx}: {what}[{i}] = {a:?} ({:?}), reference {b:?} ({:?})",
            bytemuck::bytes_of(a),
            bytemuck::bytes_of(b)
        );
    }
}

struct State<G, M, P> {
    master: Vec<f32>,
    grad: Vec<G>,
    m: Vec<M>,
    v: Vec<M>,
    low: Vec<P>,
}

impl<G: Element, M: Element, P: Element> State<G, M, P> {
    fn random(rng: &mut Rng, n: usize, special: bool) -> Self {
        let mut grad: Vec<G> = (0..n).map(|_| G::from_f32(rng.wide() * 4.0)).collect();
        if special && n > 8 {
            grad[1] = G::from_f32(f32::NAN);
            grad[n / 2] = G::from_f32(f32::INFINITY);
            grad[n - 2] = G::from_f32(f32::NEG_INFINITY);
        }
        State {
            master: (0..n).map(|_| rng.wide()).collect(),
            grad,
            m: (0..n).map(|_| M::from_f32(rng.wide() * 0.1)).collect(),
            v: (0..n)
                .map(|_| M::from_f32(rng.wide().abs() * 0.01))
                .collect(),
            low: vec![P::from_f32(-7.0); n],
        }
    }
}

fn clone_state<G: Element, M: Element, P: Element>(s: &State<G, M, P>) -> State<G, M, P> {
    State {
        master: s.master.clone(),
        grad: s.grad.clone(),
        m: s.m.clone(),
        v: s.v.clone(),
        low: s.low.clone(),
    }
}

/// One type combination: for every length and offset, every engine against
/// the reference, with and without the low-precision copy.
fn check_types<G: Element, M: Element, P: Element>(isa: Isa) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (isa as u64));
    let params = AdamWParams {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let lens = [
        1usize, 7, 8, 15, 16, 17, 31, 33, 63, 129, 1000, 4099, 70_001,
    ];
    for (case, &n) in lens.iter().enumerate() {
        // Start 0..3 elements into the buffers so that the SIMD heads and
        // the streaming-store alignment are exercised.
        let off = case % 4;
        let total = n + off;
        let step = 1 + (case as u64 % 5) * 1000;
        let k = AdamWStep::new(&params, 1e-3, step, 0.37 / (1.0 + case as f32));
        let base = State::<G, M, P>::random(&mut rng, total, case % 3 == 1);
        let mut want = clone_state(&base);
        adamw_reference(
            &k,
            &mut want.master[off..],
            &want.grad[off..],
            &mut want.m[off..],
            &mut want.v[off..],
            Some(&mut want.low[off..]),
        )
        .unwrap();
        for (e, eng) in engines(isa).into_iter().enumerate() {
            let ctx = format!(
                "{isa} engine {e} G={} M={} P={} n={n} off={off}",
                G::DTYPE,
                M::DTYPE,
                P::DTYPE
            );
            let mut got = clone_state(&base);
            let with_low = e != 1;
            eng.step(
                &k,
                &mut got.master[off..],
                &got.grad[off..],
                &mut got.m[off..],
                &mut got.v[off..],
                if with_low {
                    Some(&mut got.low[off..])
                } else {
                    None
                },
            )
            .unwrap();
            check_same("master", &got.master, &want.master, &ctx);
            check_same("m", &got.m, &want.m, &ctx);
            check_same("v", &got.v, &want.v, &ctx);
            if with_low {
                check_same("low", &got.low, &want.low, &ctx);
            } else {
                check_same("low (untouched)", &got.low, &base.low, &ctx);
            }
        }
    }
}

#[test]
fn every_path_matches_the_reference_bit_for_bit() {
    for isa in isas() {
        check_types::<f32, f32, bf16>(isa);
        check_types::<f32, f32, f16>(isa);
        check_types::<f32, f32, f32>(isa);
        check_types::<bf16, f32, bf16>(isa);
        check_types::<f16, f32, f16>(isa);
        check_types::<f32, bf16, bf16>(isa);
        check_types::<bf16, bf16, bf16>(isa);
        check_types::<f16, bf16, f32>(isa);
    }
}

#[test]
fn step_many_is_the_reference_on_each_part() {
    let mut rng = Rng(42);
    let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 3, 0.5);
    let lens = [5usize, 64, 1, 300, 0, 77];
    for isa in isas() {
        let states: Vec<State<bf16, f32, bf16>> = lens
            .iter()
            .map(|&n| State::random(&mut rng, n, false))
            .collect();
        let mut got: Vec<_> = states.iter().map(clone_state).collect();
        let mut want: Vec<_> = states.iter().map(clone_state).collect();
        for w in want.iter_mut() {
            adamw_reference(
                &k,
                &mut w.master,
                &w.grad,
                &mut w.m,
                &mut w.v,
                Some(&mut w.low),
            )
            .unwrap();
        }
        let eng = CpuAdamW::new()
            .with_isa(isa)
            .unwrap()
            .with_threads(4)
            .with_tile(64);
        let parts = got
            .iter_mut()
            .map(|s| AdamWSlices {
                master: &mut s.master,
                grad: &s.grad,
                m: &mut s.m,
                v: &mut s.v,
                low: Some(&mut s.low),
            })
            .collect();
        eng.step_many(&k, parts).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let ctx = format!("{isa} part {i}");
            check_same("master", &g.master, &w.master, &ctx);
            check_same("m", &g.m, &w.m, &ctx);
            check_same("v", &g.v, &w.v, &ctx);
            check_same("low", &g.low, &w.low, &ctx);
        }
    }
}

#[test]
fn a_length_mismatch_is_an_error_and_changes_nothing() {
    let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 1, 1.0);
    let eng = CpuAdamW::new();
    let mut a = vec![1.0f32; 100];
    let g = vec![0.5f32; 100];
    let (mut m, mut v) = (vec![0f32; 100], vec![0f32; 100]);
    let mut b = [1.0f32; 10];
    let gb = [0.5f32; 10];
    let (mut mb, mut vb) = (vec![0f32; 10], vec![0f32; 9]);
    let parts = vec![
        AdamWSlices {
            master: &mut a[..],
            grad: &g[..],
            m: &mut m[..],
            v: &mut v[..],
            low: None::<&mut [bf16]>,
        },
        AdamWSlices {
            master: &mut b[..],
            grad: &gb[..],
            m: &mut mb[..],
            v: &mut vb[..],
            low: None,
        },
    ];
    let err = eng.step_many(&k, parts).unwrap_err();
    match &err {
        Error::InvalidSize { op, msg } => {
            assert_eq!(*op, "adamw");
            assert!(msg.contains("part 1") && msg.contains("v 9"), "{msg}");
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(a.iter().all(|&x| x == 1.0), "part 0 was updated");
    let mut low = vec![bf16::ZERO; 99];
    let err = eng
        .step(&k, &mut a, &g, &mut m, &mut v, Some(&mut low))
        .unwrap_err();
    assert!(err.to_string().contains("low 99"), "{err}");
}

#[test]
fn an_unavailable_instruction_set_is_refused_by_name() {
    let missing = Isa::ALL.into_iter().find(|i| !i.is_available());
    // Every CPU lacks either NEON (x86) or AVX2 (aarch64).
    let isa = missing.expect("some instruction set is unavailable on any CPU");
    let err = CpuAdamW::new().with_isa(isa).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(isa.name()) && msg.contains("scalar"), "{msg}");
    assert_eq!("avx2".parse::<Isa>(), Ok(Isa::Avx2));
    assert!("sse9".parse::<Isa>().unwrap_err().contains("sse9"));
}

/// Every 16-bit pattern widened, and a dense sample of f32 patterns (with
/// every rounding-boundary neighbourhood of bf16 and f16) narrowed, through
/// the kernels' loads and stores: `p + g` with `p = 0` widens `g`; with
/// `g = 0` it stores `p` narrowed into the copy and into bf16 moments.
#[test]
fn conversions_match_half_on_every_path() {
    // Widening: every bf16 and f16 pattern as a gradient.
    fn widen<G: Element>(isa: Isa, all: Vec<G>) {
        let n = all.len();
        let eng = CpuAdamW::new().with_isa(isa).unwrap().with_threads(2);
        let mut p = vec![0f32; n];
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        eng.traffic_many(vec![AdamWSlices {
            master: &mut p[..],
            grad: &all[..],
            m: &mut m[..],
            v: &mut v[..],
            low: None::<&mut [f32]>,
        }])
        .unwrap();
        for (i, g) in all.iter().enumerate() {
            let want = 0.0 + g.to_f32();
            assert!(
                p[i].to_bits() == want.to_bits() || (p[i].is_nan() && want.is_nan()),
                "{isa}: {:?} widened to {} (bits {:#x})",
                g,
                p[i],
                p[i].to_bits()
            );
        }
    }
    // Narrowing: x + 0 is x for every x but -0 (→ +0) and NaN (quieted).
    fn narrow<P: Element>(isa: Isa, xs: &[f32]) {
        let n = xs.len();
        let eng = CpuAdamW::new().with_isa(isa).unwrap().with_threads(2);
        let mut p = xs.to_vec();
        let g = vec![0f32; n];
        let (mut m, mut v) = (
            xs.iter().map(|&x| P::from_f32(x)).collect::<Vec<_>>(),
            vec![P::from_f32(0.0); n],
        );
        let mut low = vec![P::from_f32(0.0); n];
        eng.traffic_many(vec![AdamWSlices {
            master: &mut p[..],
            grad: &g[..],
            m: &mut m[..],
            v: &mut v[..],
            low: Some(&mut low[..]),
        }])
        .unwrap();
        for (i, &x) in xs.iter().enumerate() {
            let want = P::from_f32(x + 0.0);
            assert!(
                same(low[i], want),
                "{isa}: {x:e} ({:#010x}) narrowed to {:?}, half gives {want:?}",
                x.to_bits(),
                low[i]
            );
        }
    }
    let mut xs: Vec<f32> = (0..(1u64 << 32))
        .step_by(4099)
        .map(|b| f32::from_bits(b as u32))
        .collect();
    // Around every bf16 rounding point of a few binades and every f16
    // subnormal/normal boundary.
    for hi in (0u32..0x1_0000).step_by(97) {
        for lo in [0x7FFFu32, 0x8000, 0x8001, 0xFFFF, 0] {
            xs.push(f32::from_bits((hi << 16) | lo));
        }
    }
    for h in 0u16..=u16::MAX {
        let x = f16::from_bits(h).to_f32();
        xs.push(x);
        xs.push(f32::from_bits(x.to_bits().wrapping_add(1)));
        xs.push(f32::from_bits(x.to_bits().wrapping_sub(1)));
        xs.push(f32::from_bits(x.to_bits() + 0x1000)); // a half-ulp of f16
    }
    xs.extend([
        f32::MAX,
        f32::MIN,
        65519.0,
        65520.0,
        65536.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]);
    for isa in isas() {
        widen(isa, (0..=u16::MAX).map(bf16::from_bits).collect());
        widen(isa, (0..=u16::MAX).map(f16::from_bits).collect());
        narrow::<bf16>(isa, &xs);
        narrow::<f16>(isa, &xs);
    }
}

#[test]
fn the_norm_pass_matches_the_reference_bit_for_bit() {
    fn check<G: Element>(isa: Isa, rng: &mut Rng) {
        let lens = [
            0usize,
            1,
            15,
            16,
            17,
            100,
            NORM_CHUNK - 1,
            NORM_CHUNK,
            NORM_CHUNK + 17,
            3 * NORM_CHUNK + 5,
        ];
        let data: Vec<Vec<G>> = lens
            .iter()
            .map(|&n| (0..n).map(|_| G::from_f32(rng.wide() * 1e3)).collect())
            .collect();
        for eng in engines(isa) {
            for (x, n) in data.iter().zip(lens) {
                for off in [0usize, 3] {
                    let s = &x[off.min(n)..];
                    let (got, want) = (eng.sum_squares(s), sum_squares(s));
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{isa} G={} n={n} off={off}: {got} vs {want}",
                        G::DTYPE
                    );
                }
            }
            let slices: Vec<&[G]> = data.iter().map(|v| &v[..]).collect();
            let many = eng.sum_squares_many(&slices);
            for (s, got) in slices.iter().zip(many) {
                assert_eq!(got.to_bits(), sum_squares(s).to_bits(), "{isa} many");
            }
            // Overflow detection: any NaN or infinity makes the sum non-finite.
            let mut bad = data[8].clone();
            bad[NORM_CHUNK + 3] = G::from_f32(f32::INFINITY);
            assert_eq!(eng.sum_squares(&bad), f64::INFINITY);
            bad[5] = G::from_f32(f32::NAN);
            assert!(eng.sum_squares(&bad).is_nan());
        }
    }
    let mut rng = Rng(7);
    for isa in isas() {
        check::<f32>(isa, &mut rng);
        check::<bf16>(isa, &mut rng);
        check::<f16>(isa, &mut rng);
    }
}
