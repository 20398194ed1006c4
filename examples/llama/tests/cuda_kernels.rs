//! The Llama example's GPU kernels on a GPU: each against the CPU op of
//! `zero_llama::ops` on random inputs, f32 and bf16 activations, and
//! finite-difference gradient checks in f32 of every backward kernel
//! against its forward kernel.
//!
//! Tolerances: bf16 outputs within one bf16 ulp of the CPU's f32 result
//! rounded to bf16 (`2^-7·|want|`), f32 outputs within `1e-5·|want|`
//! (the summation order differs, and the GPU's expf/logf are within 2 ulp
//! of glibc's), both plus `1e-5·max|want|` for values that cancel to near
//! zero. Finite differences: central, step 1e-2 (the loss in f64 from f32
//! outputs), within 2% of the larger of the two plus 1e-3 of the largest
//! gradient: the truncation error of the step is O(h^2·f''') ~ 1e-4 and
//! the f32 rounding of the outputs ~ 1e-7/h relative.
//!
//! Without a GPU (`Device::cuda(0)` fails) every test prints a skip line.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use llama::cuda::{
    rmsnorm_scratch_len, EmbeddingGradPlan, GpuEmbeddingPlan, GpuRope, LlamaKernels,
};
use llama::ops::{self, Rope};
use llama::XorShift;
use zero::core::bf16;
use zero_llama as llama;
use zero_testkit::llama_kernel_cases::{
    check, identity_attention, randn, round, Act, BigVocabCase, SwigluCase,
};

struct Gpu {
    k: LlamaKernels,
    stream: Arc<CudaStream>,
}

/// The kernels on GPU 0, or a visible skip.
fn gpu(test: &str) -> Option<Gpu> {
    let dev = zero_testkit::kernel_checks::cuda_device_or_skip(test)?;
    if !zero_testkit::kernel_checks::nvrtc_or_skip(test) {
        return None;
    }
    let k = LlamaKernels::new(&dev).unwrap_or_else(|e| panic!("loading the Llama kernels: {e}"));
    let stream = dev.context().default_stream();
    Some(Gpu { k, stream })
}

/// An activation type the GPU kernels take.
trait GpuAct: Act + DeviceRepr {}
impl<T: Act + DeviceRepr> GpuAct for T {}

impl Gpu {
    fn up<E: GpuAct>(&self, v: &[f32]) -> CudaSlice<E> {
        let v: Vec<E> = v.iter().map(|&x| E::from_f32(x)).collect();
        self.stream.clone_htod(&v).unwrap()
    }
    fn raw<T: DeviceRepr>(&self, v: &[T]) -> CudaSlice<T> {
        self.stream.clone_htod(v).unwrap()
    }
    fn down<E: GpuAct>(&self, s: &CudaSlice<E>) -> Vec<f32> {
        let v = self.stream.clone_dtoh(s).unwrap();
        self.stream.synchronize().unwrap();
        v.into_iter().map(E::to_f32).collect()
    }
}

/// Central differences of `loss` at `x` against `grad` for up to 24
/// indices (all of `candidates`' if fewer).
fn fd_check(
    what: &str,
    x: &[f32],
    grad: &[f32],
    candidates: &[usize],
    loss: impl Fn(&[f32]) -> f64,
) {
    let h = 1e-2f32;
    let gmax = grad.iter().fold(0.0f32, |m, g| m.max(g.abs())) as f64;
    let step = candidates.len().div_ceil(24).max(1);
    for &i in candidates.iter().step_by(step) {
        let mut xp = x.to_vec();
        xp[i] += h;
        let mut xm = x.to_vec();
        xm[i] -= h;
        let num = (loss(&xp) - loss(&xm)) / (f64::from(xp[i]) - f64::from(xm[i]));
        let ana = f64::from(grad[i]);
        let tol = 2e-2 * num.abs().max(ana.abs()) + 1e-3 * gmax;
        assert!(
            (num - ana).abs() <= tol,
            "{what}: d/dx[{i}]: finite difference {num:e}, kernel {ana:e}"
        );
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum()
}

// ---------------------------------------------------------------------------

fn rmsnorm_vs_cpu<E: GpuAct>(g: &Gpu, rows: usize, d: usize, seed: u64) {
    let mut rng = XorShift::new(seed);
    let x = round::<E>(&randn(&mut rng, rows * d, 1.5));
    let w = round::<E>(&randn(&mut rng, d, 1.0));
    let (y, inv) = ops::rmsnorm_forward(&x, &w, 1e-5);
    let (gx, gw) = (g.up::<E>(&x), g.up::<E>(&w));
    let mut gy = g.up::<E>(&vec![0.0; rows * d]);
    let mut ginv = g.raw(&vec![0.0f32; rows]);
    g.k.rmsnorm_forward(&g.stream, &gx, &gw, &mut gy, &mut ginv, 1e-5)
        .unwrap();
    check::<E>("rmsnorm y", &g.down(&gy), &y);
    check::<f32>("rmsnorm inv", &g.down(&ginv), &inv);

    let dy = round::<E>(&randn(&mut rng, rows * d, 1.0));
    let dx0 = round::<E>(&randn(&mut rng, rows * d, 1.0));
    let dw0 = randn(&mut rng, d, 1.0);
    let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
    ops::rmsnorm_backward(&dy, &x, &w, &inv, &mut dx, &mut dw);
    let ginv = g.raw(&inv);
    let mut gdx = g.up::<E>(&dx0);
    let mut gdw = g.raw(&dw0);
    let mut scratch = g.raw(&vec![0.0f32; rmsnorm_scratch_len(rows, d)]);
    g.k.rmsnorm_backward(
        &g.stream,
        &g.up::<E>(&dy),
        &gx,
        &gw,
        &ginv,
        &mut gdx,
        &mut gdw,
        &mut scratch,
        true,
    )
    .unwrap();
    check::<E>("rmsnorm dx", &g.down(&gdx), &dx);
    check::<f32>("rmsnorm dw", &g.down(&gdw), &dw);
}

#[test]
fn rmsnorm_kernels() {
    let Some(g) = gpu("rmsnorm_kernels") else {
        return;
    };
    for (rows, d, seed) in [(3, 7, 1), (300, 64, 2), (33, 4096, 3)] {
        rmsnorm_vs_cpu::<f32>(&g, rows, d, seed);
        rmsnorm_vs_cpu::<bf16>(&g, rows, d, seed);
    }
    // Finite differences of L = sum(c * y) w.r.t. x and w.
    let (rows, d) = (5, 40);
    let mut rng = XorShift::new(4);
    let x = randn(&mut rng, rows * d, 1.0);
    let w = randn(&mut rng, d, 1.0);
    let c = randn(&mut rng, rows * d, 1.0);
    let fwd = |x: &[f32], w: &[f32]| {
        let mut y = g.up::<f32>(&vec![0.0; rows * d]);
        let mut inv = g.raw(&vec![0.0f32; rows]);
        g.k.rmsnorm_forward(&g.stream, &g.raw(x), &g.raw(w), &mut y, &mut inv, 1e-5)
            .unwrap();
        (g.down(&y), inv)
    };
    let (_, inv) = fwd(&x, &w);
    let mut dx = g.raw(&vec![0.0f32; rows * d]);
    let mut dw = g.raw(&vec![0.0f32; d]);
    let mut scratch = g.raw(&vec![0.0f32; rmsnorm_scratch_len(rows, d)]);
    g.k.rmsnorm_backward(
        &g.stream,
        &g.raw(&c),
        &g.raw(&x),
        &g.raw(&w),
        &inv,
        &mut dx,
        &mut dw,
        &mut scratch,
        false,
    )
    .unwrap();
    let all: Vec<usize> = (0..rows * d).collect();
    fd_check("rmsnorm dx", &x, &g.down(&dx), &all, |x| {
        dot(&fwd(x, &w).0, &c)
    });
    fd_check("rmsnorm dw", &w, &g.down(&dw), &all[..d], |w| {
        dot(&fwd(&x, w).0, &c)
    });
}

/// The CPU's causal softmax of `scores` [mats, t, t] through attention with
/// K = V = identity (head_dim = t): probabilities of `scale * q`.
fn cpu_softmax(scores: &[f32], mats: usize, t: usize) -> Vec<f32> {
    let scale = 1.0 / (t as f32).sqrt();
    let mut q = vec![0.0f32; t * mats * t];
    for h in 0..mats {
        for i in 0..t {
            for j in 0..t {
                q[i * mats * t + h * t + j] = scores[(h * t + i) * t + j] / scale;
            }
        }
    }
    let (s, eye) = identity_attention(mats, t);
    ops::attention_forward(&q, &eye, &eye, s, 1).1
}

fn softmax_vs_cpu<E: GpuAct>(g: &Gpu, mats: usize, t: usize, seed: u64) {
    let mut rng = XorShift::new(seed);
    // t = 16, 64: scale = 1/4, 1/8, so scores / scale * scale is exact.
    let scores = round::<E>(&randn(&mut rng, mats * t * t, 3.0));
    let want = cpu_softmax(&scores, mats, t);
    let mut p = g.up::<E>(&vec![0.0; scores.len()]);
    g.k.softmax_causal_forward(&g.stream, &g.up::<E>(&scores), &mut p, t)
        .unwrap();
    check::<E>("softmax p", &g.down(&p), &want);

    // Backward against the CPU formula: ds = p * (dp - rowsum(p * dp)) * scale.
    let p = round::<E>(&want);
    let dp = round::<E>(&randn(&mut rng, mats * t * t, 1.0));
    let scale = 0.3f32;
    let mut ds = vec![0.0f32; p.len()];
    for r in 0..mats * t {
        let i = r % t;
        let (pr, dr) = (&p[r * t..(r + 1) * t], &dp[r * t..(r + 1) * t]);
        let dot: f32 = pr[..=i].iter().zip(&dr[..=i]).map(|(a, b)| a * b).sum();
        for j in 0..=i {
            ds[r * t + j] = pr[j] * (dr[j] - dot) * scale;
        }
    }
    let mut gds = g.up::<E>(&vec![1.0; p.len()]);
    g.k.softmax_causal_backward(
        &g.stream,
        &g.up::<E>(&p),
        &g.up::<E>(&dp),
        &mut gds,
        t,
        scale,
    )
    .unwrap();
    check::<E>("softmax ds", &g.down(&gds), &ds);
}

#[test]
fn causal_softmax_kernels() {
    let Some(g) = gpu("causal_softmax_kernels") else {
        return;
    };
    for (mats, t, seed) in [(3, 16, 11), (4, 64, 12)] {
        softmax_vs_cpu::<f32>(&g, mats, t, seed);
        softmax_vs_cpu::<bf16>(&g, mats, t, seed);
    }
    // Finite differences of L = sum(c * softmax(s)) w.r.t. the lower
    // triangle of s.
    let (mats, t) = (2, 37);
    let mut rng = XorShift::new(13);
    let s = randn(&mut rng, mats * t * t, 2.0);
    let c = randn(&mut rng, mats * t * t, 1.0);
    let fwd = |s: &[f32]| {
        let mut p = g.raw(&vec![0.0f32; s.len()]);
        g.k.softmax_causal_forward(&g.stream, &g.raw(s), &mut p, t)
            .unwrap();
        g.down(&p)
    };
    let p = g.raw(&fwd(&s));
    let mut ds = g.raw(&vec![0.0f32; s.len()]);
    g.k.softmax_causal_backward(&g.stream, &p, &g.raw(&c), &mut ds, t, 1.0)
        .unwrap();
    let lower: Vec<usize> = (0..s.len()).filter(|&e| e % t <= (e / t) % t).collect();
    fd_check("softmax ds", &s, &g.down(&ds), &lower, |s| dot(&fwd(s), &c));
}

fn ce_run<E: GpuAct>(g: &Gpu, logits: &[f32], targets: &[i32]) -> (f32, Vec<f32>) {
    let rows = targets.len();
    let count = targets.iter().filter(|&&t| t >= 0).count();
    let mut dl = g.up::<E>(&vec![0.0; logits.len()]);
    let mut losses = g.raw(&vec![0.0f32; rows]);
    let mut loss = g.raw(&[0.0f32]);
    g.k.cross_entropy(
        &g.stream,
        &g.up::<E>(logits),
        &g.raw(targets),
        count,
        &mut dl,
        &mut losses,
        &mut loss,
    )
    .unwrap();
    (g.down(&loss)[0], g.down(&dl))
}

#[test]
fn cross_entropy_kernels() {
    let Some(g) = gpu("cross_entropy_kernels") else {
        return;
    };
    for (rows, vocab, seed) in [(4, 10, 21), (64, 32000, 22)] {
        let mut rng = XorShift::new(seed);
        let logits = round::<bf16>(&randn(&mut rng, rows * vocab, 4.0));
        let targets: Vec<i32> = (0..rows)
            .map(|r| {
                if r % 3 == 1 {
                    ops::IGNORE_INDEX
                } else {
                    rng.below(vocab) as i32
                }
            })
            .collect();
        let (loss, grad) = ops::cross_entropy(&logits, &targets, vocab);
        let (l32, g32) = ce_run::<f32>(&g, &logits, &targets);
        check::<f32>("ce loss", &[l32], &[loss]);
        check::<f32>("ce dlogits", &g32, &grad);
        let (l16, g16) = ce_run::<bf16>(&g, &logits, &targets);
        check::<f32>("ce loss (bf16 logits)", &[l16], &[loss]);
        check::<bf16>("ce dlogits", &g16, &grad);
    }
    // Qwen2's vocabulary against f64: the lanes' sums are f64.
    let case = BigVocabCase::new(25);
    let (l32, g32) = ce_run::<f32>(&g, &case.logits, &case.targets);
    case.check("ce at 151936 (GPU)", l32, Some(&g32));
    let (l16, _) = ce_run::<bf16>(&g, &case.logits, &case.targets);
    case.check("ce at 151936 (GPU, bf16 logits)", l16, None);
    // Finite differences of the mean loss w.r.t. the logits.
    let (rows, vocab) = (6, 50);
    let mut rng = XorShift::new(23);
    let logits = randn(&mut rng, rows * vocab, 2.0);
    let targets: Vec<i32> = (0..rows)
        .map(|r| {
            if r == 2 {
                -100
            } else {
                rng.below(vocab) as i32
            }
        })
        .collect();
    let (_, grad) = ce_run::<f32>(&g, &logits, &targets);
    let all: Vec<usize> = (0..logits.len()).collect();
    // Include every target logit, where the gradient is largest.
    let mut idx: Vec<usize> = targets
        .iter()
        .enumerate()
        .filter(|(_, &t)| t >= 0)
        .map(|(r, &t)| r * vocab + t as usize)
        .collect();
    idx.extend(all.iter().step_by(13));
    fd_check("ce dlogits", &logits, &grad, &idx, |l| {
        f64::from(ce_run::<f32>(&g, l, &targets).0)
    });
}

fn swiglu_fwd<E: GpuAct>(g: &Gpu, h1: &[f32], h3: &[f32]) -> Vec<f32> {
    let mut a = g.up::<E>(&vec![0.0; h1.len()]);
    g.k.swiglu_forward(&g.stream, &g.up::<E>(h1), &g.up::<E>(h3), &mut a)
        .unwrap();
    g.down(&a)
}

fn swiglu_bwd<E: GpuAct>(g: &Gpu, da: &[f32], h1: &[f32], h3: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut d1 = g.up::<E>(&vec![0.0; h1.len()]);
    let mut d3 = g.up::<E>(&vec![0.0; h1.len()]);
    g.k.swiglu_backward(
        &g.stream,
        &g.up::<E>(da),
        &g.up::<E>(h1),
        &g.up::<E>(h3),
        &mut d1,
        &mut d3,
    )
    .unwrap();
    (g.down(&d1), g.down(&d3))
}

fn swiglu_vs_cpu<E: GpuAct>(g: &Gpu, rows: usize, hidden: usize, seed: u64) {
    let c = SwigluCase::new::<E>(rows, hidden, seed);
    check::<E>("swiglu a", &swiglu_fwd::<E>(g, &c.h1, &c.h3), &c.a);
    let (g1, g3) = swiglu_bwd::<E>(g, &c.da, &c.h1, &c.h3);
    check::<E>("swiglu dh1", &g1, &c.dh1);
    check::<E>("swiglu dh3", &g3, &c.dh3);
}

#[test]
fn swiglu_kernels() {
    let Some(g) = gpu("swiglu_kernels") else {
        return;
    };
    swiglu_vs_cpu::<f32>(&g, 7, 45, 41);
    swiglu_vs_cpu::<bf16>(&g, 64, 1376, 42);
    let mut rng = XorShift::new(43);
    let n = 300;
    let (h1, h3, c) = (
        randn(&mut rng, n, 2.0),
        randn(&mut rng, n, 2.0),
        randn(&mut rng, n, 1.0),
    );
    let (d1, d3) = swiglu_bwd::<f32>(&g, &c, &h1, &h3);
    let all: Vec<usize> = (0..n).collect();
    fd_check("swiglu dh1", &h1, &d1, &all, |h1| {
        dot(&swiglu_fwd::<f32>(&g, h1, &h3), &c)
    });
    fd_check("swiglu dh3", &h3, &d3, &all, |h3| {
        dot(&swiglu_fwd::<f32>(&g, &h1, h3), &c)
    });
}

fn rope_run<E: GpuAct>(
    g: &Gpu,
    t: &GpuRope,
    x: &[f32],
    seq: usize,
    heads: usize,
    inv: bool,
) -> Vec<f32> {
    let mut gx = g.up::<E>(x);
    g.k.rope(&g.stream, t, &mut gx, seq, heads, inv).unwrap();
    g.down(&gx)
}

#[test]
fn rope_kernels() {
    let Some(g) = gpu("rope_kernels") else {
        return;
    };
    let (batch, seq, heads, hd) = (2, 33, 3, 64);
    let rope = Rope::new(hd, 40, 10000.0);
    let tables = GpuRope::new(&g.stream, &rope).unwrap();
    let mut rng = XorShift::new(51);
    let x = round::<bf16>(&randn(&mut rng, batch * seq * heads * hd, 1.0));
    for inv in [false, true] {
        let mut want = x.clone();
        if inv {
            rope.backward(&mut want, seq, heads);
        } else {
            rope.forward(&mut want, seq, heads);
        }
        check::<f32>(
            "rope",
            &rope_run::<f32>(&g, &tables, &x, seq, heads, inv),
            &want,
        );
        check::<bf16>(
            "rope",
            &rope_run::<bf16>(&g, &tables, &x, seq, heads, inv),
            &want,
        );
    }
    // Finite differences of L = sum(c * rope(x)): the gradient is the
    // inverse rotation of c.
    let c = randn(&mut rng, x.len(), 1.0);
    let grad = rope_run::<f32>(&g, &tables, &c, seq, heads, true);
    let all: Vec<usize> = (0..x.len()).collect();
    fd_check("rope dx", &x, &grad, &all, |x| {
        dot(&rope_run::<f32>(&g, &tables, x, seq, heads, false), &c)
    });
}

#[test]
fn embedding_kernels() {
    let Some(g) = gpu("embedding_kernels") else {
        return;
    };
    let (rows, dim, vocab) = (300, 48, 40);
    let mut rng = XorShift::new(61);
    let tokens: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
    let table = round::<bf16>(&randn(&mut rng, vocab * dim, 1.0));
    let dout = round::<bf16>(&randn(&mut rng, rows * dim, 1.0));
    let dtable0 = randn(&mut rng, vocab * dim, 1.0);
    let plan = EmbeddingGradPlan::new(&tokens, vocab, None).unwrap();
    let gplan = GpuEmbeddingPlan::new(&g.stream, &plan, vocab).unwrap();
    let gtok = g.raw(&tokens);
    let fwd = |table: &[f32]| {
        let mut out = g.raw(&vec![0.0f32; rows * dim]);
        g.k.embedding_forward(&g.stream, &g.raw(table), &gtok, &mut out, dim)
            .unwrap();
        g.down(&out)
    };
    fn bwd<E: GpuAct>(
        g: &Gpu,
        dout: &[f32],
        plan: &GpuEmbeddingPlan,
        dt0: &[f32],
        dim: usize,
    ) -> Vec<f32> {
        let mut dt = g.raw(dt0);
        g.k.embedding_backward(&g.stream, &g.up::<E>(dout), plan, &mut dt, dim)
            .unwrap();
        g.down(&dt)
    }
    // Gathers and in-order sums: bit for bit.
    let want = ops::embedding_forward(&table, &tokens, dim);
    assert_eq!(fwd(&table), want);
    let mut out = g.up::<bf16>(&vec![0.0; rows * dim]);
    g.k.embedding_forward(&g.stream, &g.up::<bf16>(&table), &gtok, &mut out, dim)
        .unwrap();
    assert_eq!(g.down(&out), want);
    let mut want = dtable0.clone();
    ops::embedding_backward(&dout, &tokens, dim, &mut want, None);
    assert_eq!(bwd::<f32>(&g, &dout, &gplan, &dtable0, dim), want);
    assert_eq!(bwd::<bf16>(&g, &dout, &gplan, &dtable0, dim), want);
    // With the first row's token as padding (transformers' padding_idx).
    let pad = Some(tokens[0]);
    let pplan = EmbeddingGradPlan::new(&tokens, vocab, pad).unwrap();
    let pplan = GpuEmbeddingPlan::new(&g.stream, &pplan, vocab).unwrap();
    let mut want = dtable0.clone();
    ops::embedding_backward(&dout, &tokens, dim, &mut want, pad);
    assert_eq!(bwd::<f32>(&g, &dout, &pplan, &dtable0, dim), want);
    // Finite differences of L = sum(c * embed(table)).
    let c = randn(&mut rng, rows * dim, 1.0);
    let grad = bwd::<f32>(&g, &c, &gplan, &vec![0.0; vocab * dim], dim);
    let all: Vec<usize> = (0..vocab * dim).collect();
    fd_check("embedding dtable", &table, &grad, &all, |t| {
        dot(&fwd(t), &c)
    });
}

#[test]
fn launchers_reject_bad_lengths() {
    let Some(g) = gpu("launchers_reject_bad_lengths") else {
        return;
    };
    let x = g.raw(&[0.0f32; 10]);
    let w = g.raw(&[1.0f32; 4]);
    let mut y = g.raw(&[0.0f32; 10]);
    let mut inv = g.raw(&[0.0f32; 2]);
    let e =
        g.k.rmsnorm_forward(&g.stream, &x, &w, &mut y, &mut inv, 1e-5)
            .unwrap_err();
    assert!(e.to_string().contains("llama_rmsnorm_forward"), "{e}");
    let mut a = g.raw(&[0.0f32; 9]);
    let e = g.k.swiglu_forward(&g.stream, &x, &x, &mut a).unwrap_err();
    assert!(e.to_string().contains("llama_swiglu_forward"), "{e}");
}
