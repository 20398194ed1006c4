//! The Llama example's GPU kernels, checked on the host: the per-lane and
//! per-element bodies of `cuda/llama_math.cuh` are compiled
//! with the host C++ compiler into `cuda/host_check.cpp`,
//! which emulates each launch (row kernels: phase 1 for the 32 lanes of a
//! row, the butterfly the device runs with shuffles, phase 3 for the 32
//! lanes; elementwise and column kernels: every thread index), and the
//! results are compared with the CPU ops of `zero_llama::ops`.
//!
//! Tolerances. The reductions add in another order than the CPU (32
//! strided lanes and a butterfly against one running sum; the RMSNorm
//! weight gradient in chunks of 256 rows), so f32 results are not
//! bit-identical: reordering a sum of n terms moves it by at most about
//! n·u·Σ|terms| (u = 2^-24), ~1e-6 of the row's scale for the sizes here
//! (n ≤ 1000). f32 outputs must agree within `1e-5·|want| + 1e-5·scale`
//! (scale = the largest |want| of the output), a margin of ~10x over the
//! errors seen. bf16 outputs are compared with the CPU's f32 result
//! rounded to bf16: an f32-level difference can move a value across a
//! rounding boundary, so they may differ by one bf16 ulp (≤ 2^-7·|want|),
//! plus the same 1e-5·scale for values that cancel to near zero. Ops with no
//! reduction and no transcendental (embedding forward and backward, RoPE)
//! run the CPU's operations in the CPU's order and must match bit for bit.
//!
//! The compiler is `$CXX` or `c++`. Without one the tests print a skip line,
//! or fail when `CI` is set.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use llama::cuda::EmbeddingGradPlan;
use llama::ops::{self, Rope};
use llama::XorShift;
use zero::core::{bf16, Element};
use zero_llama as llama;
use zero_testkit::llama_kernel_cases::{
    check, check_exact, identity_attention, narrow, randn, round, Act, BigVocabCase, SwigluCase,
    BIG_VOCAB,
};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The host driver, built once per test process; `None` when there is no
/// C++ compiler (and `CI` is not set).
fn driver() -> Option<&'static Path> {
    static DRIVER: OnceLock<Option<PathBuf>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let cuda = root().join("cuda");
            zero_testkit::kernel_checks::host_driver(
                "llama_kernels_on_host",
                &cuda.join("host_check.cpp"),
                &[&root().join("../../zero-core/kernels"), &cuda],
                &Path::new(env!("CARGO_TARGET_TMPDIR")).join("llama_kernels_on_host"),
            )
        })
        .as_deref()
}

/// Runs `host_check op E` on `input`; returns its stdout.
fn run<E: Act>(exe: &Path, op: &str, input: Rec) -> Out {
    Out(
        zero_testkit::kernel_checks::run_driver(exe, &[op, E::NAME], input.0),
        0,
    )
}

/// A driver input record.
#[derive(Default)]
struct Rec(Vec<u8>);

impl Rec {
    fn u64(mut self, v: usize) -> Self {
        self.0.extend_from_slice(&(v as u64).to_le_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn f32(mut self, v: f32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn arr<T: bytemuck::Pod>(mut self, v: &[T]) -> Self {
        self.0.extend_from_slice(bytemuck::cast_slice(v));
        self
    }
}

/// The driver's output.
struct Out(Vec<u8>, usize);

impl Out {
    fn take<T: bytemuck::Pod>(&mut self, n: usize) -> Vec<T> {
        let bytes = n * std::mem::size_of::<T>();
        assert!(self.1 + bytes <= self.0.len(), "driver output too short");
        let v = self.0[self.1..self.1 + bytes]
            .chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect();
        self.1 += bytes;
        v
    }
    fn elems<E: Element>(&mut self, n: usize) -> Vec<f32> {
        self.take::<E>(n).into_iter().map(E::to_f32).collect()
    }
    fn finish(self) {
        assert_eq!(self.1, self.0.len(), "driver wrote more than expected");
    }
}

// ---------------------------------------------------------------------------

fn rmsnorm<E: Act>(exe: &Path, rows: usize, d: usize, seed: u64) {
    let mut rng = XorShift::new(seed);
    let x = round::<E>(&randn(&mut rng, rows * d, 1.5));
    let w = round::<E>(&randn(&mut rng, d, 1.0));
    let eps = 1e-5;
    let (y, inv) = ops::rmsnorm_forward(&x, &w, eps);
    let input = Rec::default()
        .u64(rows)
        .u64(d)
        .f32(eps)
        .arr(&narrow::<E>(&x))
        .arr(&narrow::<E>(&w));
    let mut out = run::<E>(exe, "rmsnorm_fwd", input);
    check::<E>("rmsnorm_fwd y", &out.elems::<E>(rows * d), &y);
    // inv is f32 in both cases.
    check::<f32>("rmsnorm_fwd inv", &out.take::<f32>(rows), &inv);
    out.finish();

    for accumulate in [false, true] {
        let dy = round::<E>(&randn(&mut rng, rows * d, 1.0));
        let dx0 = if accumulate {
            round::<E>(&randn(&mut rng, rows * d, 1.0))
        } else {
            vec![0.0; rows * d]
        };
        let dw0 = randn(&mut rng, d, 1.0);
        let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
        ops::rmsnorm_backward(&dy, &x, &w, &inv, &mut dx, &mut dw);
        // Not accumulating, the kernel overwrites whatever dx held.
        let dx_in = if accumulate {
            dx0.clone()
        } else {
            randn(&mut rng, rows * d, 1.0)
        };
        let input = Rec::default()
            .u64(rows)
            .u64(d)
            .u32(u32::from(accumulate))
            .arr(&narrow::<E>(&dy))
            .arr(&narrow::<E>(&x))
            .arr(&narrow::<E>(&w))
            .arr(&inv)
            .arr(&narrow::<E>(&dx_in))
            .arr(&dw0);
        let mut out = run::<E>(exe, "rmsnorm_bwd", input);
        check::<E>("rmsnorm_bwd dx", &out.elems::<E>(rows * d), &dx);
        check::<f32>("rmsnorm_bwd dw", &out.take::<f32>(d), &dw);
        out.finish();
    }
}

#[test]
fn rmsnorm_matches_the_cpu() {
    let Some(exe) = driver() else { return };
    // Widths below, at and above the lane count; > 256 rows for several
    // weight-gradient chunks.
    for (rows, d, seed) in [(3, 7, 1), (5, 32, 2), (300, 64, 3), (9, 1000, 4)] {
        rmsnorm::<f32>(exe, rows, d, seed);
        rmsnorm::<bf16>(exe, rows, d, seed);
    }
}

/// Scores for `mats` heads of `[t, t]` from the CPU attention with K = V =
/// identity (head_dim = t): the probabilities are the softmax of
/// `scale * q`, and dQ is dS.
fn softmax<E: Act>(exe: &Path, mats: usize, t: usize, seed: u64) {
    let mut rng = XorShift::new(seed);
    let (s, eye) = identity_attention(mats, t);
    let scale = 1.0 / (t as f32).sqrt();
    let q = round::<E>(&randn(&mut rng, t * mats * t, 3.0));
    let (_, probs) = ops::attention_forward(&q, &eye, &eye, s, 1);
    // The kernel's input: the scores [mats, t, t] = scale * q, per head.
    let mut scores = vec![0.0f32; mats * t * t];
    for h in 0..mats {
        for i in 0..t {
            for j in 0..t {
                scores[(h * t + i) * t + j] = scale * q[i * mats * t + h * t + j];
            }
        }
    }
    if E::NAME == "bf16" {
        assert_eq!(scores, round::<E>(&scores), "scores must be exact in bf16");
    }
    let input = Rec::default().u64(mats).u64(t).arr(&narrow::<E>(&scores));
    let mut out = run::<E>(exe, "softmax_fwd", input);
    check::<E>("softmax_fwd", &out.elems::<E>(mats * t * t), &probs);
    out.finish();

    let p = round::<E>(&probs);
    let dout = round::<E>(&randn(&mut rng, t * mats * t, 1.0));
    let (dq, _, _) = ops::attention_backward(&dout, &q, &eye, &eye, &p, s, 1);
    let mut dp = vec![0.0f32; mats * t * t];
    let mut ds = vec![0.0f32; mats * t * t];
    for h in 0..mats {
        for i in 0..t {
            for j in 0..t {
                dp[(h * t + i) * t + j] = dout[i * mats * t + h * t + j];
                ds[(h * t + i) * t + j] = dq[i * mats * t + h * t + j];
            }
        }
    }
    let input = Rec::default()
        .u64(mats)
        .u64(t)
        .f32(scale)
        .arr(&narrow::<E>(&p))
        .arr(&narrow::<E>(&dp));
    let mut out = run::<E>(exe, "softmax_bwd", input);
    check::<E>("softmax_bwd", &out.elems::<E>(mats * t * t), &ds);
    out.finish();
}

#[test]
fn causal_softmax_matches_the_cpu() {
    let Some(exe) = driver() else { return };
    // 1/sqrt(t) is a power of two for t = 16, 64: bf16 scores stay exact.
    for (mats, t, seed) in [(3, 16, 11), (2, 64, 12)] {
        softmax::<f32>(exe, mats, t, seed);
        softmax::<bf16>(exe, mats, t, seed);
    }
    softmax::<f32>(exe, 2, 37, 13);
}

fn cross_entropy<E: Act>(exe: &Path, rows: usize, vocab: usize, ignore: bool, seed: u64) {
    let mut rng = XorShift::new(seed);
    let logits = round::<E>(&randn(&mut rng, rows * vocab, 4.0));
    let targets: Vec<i32> = (0..rows)
        .map(|r| {
            if ignore && r % 3 == 1 {
                ops::IGNORE_INDEX
            } else {
                rng.below(vocab) as i32
            }
        })
        .collect();
    let count = targets.iter().filter(|&&t| t >= 0).count();
    let (loss, grad) = ops::cross_entropy(&logits, &targets, vocab);
    let inv = if count == 0 { 0.0 } else { 1.0 / count as f32 };
    let input = Rec::default()
        .u64(rows)
        .u64(vocab)
        .u64(count)
        .f32(inv)
        .arr(&targets)
        .arr(&narrow::<E>(&logits));
    let mut out = run::<E>(exe, "cross_entropy", input);
    check::<E>(
        "cross_entropy dlogits",
        &out.elems::<E>(rows * vocab),
        &grad,
    );
    let losses = out.take::<f32>(rows);
    for (r, &t) in targets.iter().enumerate() {
        if t < 0 {
            assert_eq!(losses[r].to_bits(), 0, "ignored row {r} has a loss");
        }
    }
    check::<f32>("cross_entropy loss", &out.take::<f32>(1), &[loss]);
    out.finish();
}

#[test]
fn cross_entropy_matches_the_cpu() {
    let Some(exe) = driver() else { return };
    for (rows, vocab, ignore, seed) in
        [(4, 10, false, 21), (40, 256, true, 22), (3, 1000, true, 23)]
    {
        cross_entropy::<f32>(exe, rows, vocab, ignore, seed);
        cross_entropy::<bf16>(exe, rows, vocab, ignore, seed);
    }
    // Every row ignored: loss 0, zero gradient, as the CPU.
    let input = Rec::default()
        .u64(2)
        .u64(5)
        .u64(0)
        .f32(0.0)
        .arr(&[-100i32, -1])
        .arr(&[1.0f32; 10]);
    let mut out = run::<f32>(exe, "cross_entropy", input);
    assert_eq!(out.take::<f32>(10), vec![0.0; 10]);
    assert_eq!(out.take::<f32>(3), vec![0.0; 3]);
    out.finish();
}

/// The kernel at Qwen2's vocabulary against f64 ([`BigVocabCase`]): the
/// loss within 2 ulps, f32 gradients within 4e-6 relative (bf16 ones
/// within a bf16 ulp of the CPU's). Each lane adds 4748 exponentials: with
/// f32 lane sums the adversarial row's loss and gradients were off by
/// ~1.4e-4 relative.
fn cross_entropy_big_vocab<E: Act>(exe: &Path, case: &BigVocabCase) {
    let rows = case.targets.len();
    let input = Rec::default()
        .u64(rows)
        .u64(BIG_VOCAB)
        .u64(rows)
        .f32(1.0 / rows as f32)
        .arr(&case.targets)
        .arr(&narrow::<E>(&case.logits));
    let mut out = run::<E>(exe, "cross_entropy", input);
    let grad = out.elems::<E>(rows * BIG_VOCAB);
    out.take::<f32>(rows);
    let loss = out.take::<f32>(1)[0];
    out.finish();
    if E::NAME == "f32" {
        case.check("cross_entropy (host kernel)", loss, Some(&grad));
    } else {
        case.check("cross_entropy (host kernel, bf16)", loss, None);
        let (_, want) = ops::cross_entropy(&case.logits, &case.targets, BIG_VOCAB);
        check::<E>("cross_entropy dlogits (151936)", &grad, &want);
    }
}

#[test]
fn cross_entropy_at_a_151936_vocabulary_matches_f64() {
    let Some(exe) = driver() else { return };
    let case = BigVocabCase::new(24);
    cross_entropy_big_vocab::<f32>(exe, &case);
    cross_entropy_big_vocab::<bf16>(exe, &case);
}

fn embedding<E: Act>(exe: &Path, rows: usize, dim: usize, vocab: usize, seed: u64) {
    embedding_with_pad::<E>(exe, rows, dim, vocab, None, seed);
    // The first row's token as the padding token: its rows are left out.
    let first = XorShift::new(seed).below(vocab) as u32;
    embedding_with_pad::<E>(exe, rows, dim, vocab, Some(first), seed);
}

fn embedding_with_pad<E: Act>(
    exe: &Path,
    rows: usize,
    dim: usize,
    vocab: usize,
    pad: Option<u32>,
    seed: u64,
) {
    let mut rng = XorShift::new(seed);
    let table = round::<E>(&randn(&mut rng, vocab * dim, 1.0));
    // Few distinct tokens, so that rows share table rows.
    let tokens: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
    let want = ops::embedding_forward(&table, &tokens, dim);
    let input = Rec::default()
        .u64(rows)
        .u64(dim)
        .u64(vocab)
        .arr(&tokens)
        .arr(&narrow::<E>(&table));
    let mut out = run::<E>(exe, "embedding_fwd", input);
    check_exact("embedding_fwd", &out.elems::<E>(rows * dim), &want);
    out.finish();

    let dout = round::<E>(&randn(&mut rng, rows * dim, 1.0));
    let dtable0 = randn(&mut rng, vocab * dim, 1.0);
    let mut want = dtable0.clone();
    ops::embedding_backward(&dout, &tokens, dim, &mut want, pad);
    let plan = EmbeddingGradPlan::new(&tokens, vocab, pad).unwrap();
    let input = Rec::default()
        .u64(rows)
        .u64(dim)
        .u64(vocab)
        .u64(plan.segments())
        .u64(plan.order.len())
        .arr(&plan.order)
        .arr(&plan.seg_start)
        .arr(&plan.seg_token)
        .arr(&narrow::<E>(&dout))
        .arr(&dtable0);
    let mut out = run::<E>(exe, "embedding_bwd", input);
    check_exact("embedding_bwd", &out.take::<f32>(vocab * dim), &want);
    out.finish();
}

#[test]
fn embedding_matches_the_cpu_bit_for_bit() {
    let Some(exe) = driver() else { return };
    for (rows, dim, vocab, seed) in [(1, 3, 2, 31), (50, 8, 5, 32), (64, 33, 100, 33)] {
        embedding::<f32>(exe, rows, dim, vocab, seed);
        embedding::<bf16>(exe, rows, dim, vocab, seed);
    }
    // A token outside the vocabulary reads as NaN on the GPU; the plan
    // rejects it on the host.
    let input = Rec::default()
        .u64(1)
        .u64(2)
        .u64(1)
        .arr(&[1u32])
        .arr(&[1.0f32, 2.0]);
    let mut out = run::<f32>(exe, "embedding_fwd", input);
    assert!(out.take::<f32>(2).iter().all(|x| x.is_nan()));
    out.finish();
    assert!(EmbeddingGradPlan::new(&[0, 3], 3, None).is_err());
}

#[test]
fn embedding_plan_groups_rows_by_token_in_row_order() {
    let plan = EmbeddingGradPlan::new(&[4, 1, 4, 0, 1, 4], 5, None).unwrap();
    assert_eq!(plan.order, vec![3, 1, 4, 0, 2, 5]);
    assert_eq!(plan.seg_start, vec![0, 1, 3, 6]);
    assert_eq!(plan.seg_token, vec![0, 1, 4]);
    // Padding token 1: its rows (1 and 4) are not in the plan.
    let plan = EmbeddingGradPlan::new(&[4, 1, 4, 0, 1, 4], 5, Some(1)).unwrap();
    assert_eq!((plan.rows, plan.order.clone()), (6, vec![3, 0, 2, 5]));
    assert_eq!(plan.seg_start, vec![0, 1, 4]);
    assert_eq!(plan.seg_token, vec![0, 4]);
    let empty = EmbeddingGradPlan::new(&[], 5, None).unwrap();
    assert_eq!((empty.segments(), empty.seg_start), (0, vec![0]));
}

/// The kernels on [`SwigluCase`].
fn swiglu<E: Act>(exe: &Path, rows: usize, hidden: usize, seed: u64) {
    let c = SwigluCase::new::<E>(rows, hidden, seed);
    let input = Rec::default()
        .u64(rows * hidden)
        .arr(&narrow::<E>(&c.h1))
        .arr(&narrow::<E>(&c.h3));
    let mut out = run::<E>(exe, "swiglu_fwd", input);
    check::<E>("swiglu_fwd", &out.elems::<E>(rows * hidden), &c.a);
    out.finish();

    let input = Rec::default()
        .u64(rows * hidden)
        .arr(&narrow::<E>(&c.da))
        .arr(&narrow::<E>(&c.h1))
        .arr(&narrow::<E>(&c.h3));
    let mut out = run::<E>(exe, "swiglu_bwd", input);
    check::<E>("swiglu_bwd dh1", &out.elems::<E>(rows * hidden), &c.dh1);
    check::<E>("swiglu_bwd dh3", &out.elems::<E>(rows * hidden), &c.dh3);
    out.finish();
}

#[test]
fn swiglu_matches_the_cpu() {
    let Some(exe) = driver() else { return };
    for (rows, hidden, seed) in [(1, 1, 41), (7, 45, 42)] {
        swiglu::<f32>(exe, rows, hidden, seed);
        swiglu::<bf16>(exe, rows, hidden, seed);
    }
}

fn rope<E: Act>(exe: &Path, batch: usize, seq: usize, heads: usize, hd: usize, seed: u64) {
    let mut rng = XorShift::new(seed);
    let max_seq = seq + 3;
    let r = Rope::new(hd, max_seq, 10000.0);
    let rows = batch * seq;
    let x = round::<E>(&randn(&mut rng, rows * heads * hd, 1.0));
    for inverse in [false, true] {
        let mut want = x.clone();
        if inverse {
            r.backward(&mut want, seq, heads);
        } else {
            r.forward(&mut want, seq, heads);
        }
        let input = Rec::default()
            .u64(rows)
            .u64(seq)
            .u64(heads)
            .u64(r.half)
            .u64(max_seq)
            .u32(u32::from(inverse))
            .arr(&r.cos)
            .arr(&r.sin)
            .arr(&narrow::<E>(&x));
        let mut out = run::<E>(exe, "rope", input);
        // Same operations in the same order: exact, then rounded to E.
        check_exact("rope", &out.elems::<E>(x.len()), &round::<E>(&want));
        out.finish();
    }
}

#[test]
fn rope_matches_the_cpu_bit_for_bit() {
    let Some(exe) = driver() else { return };
    for (batch, seq, heads, hd, seed) in [(1, 1, 1, 2, 51), (2, 9, 3, 16, 52)] {
        rope::<f32>(exe, batch, seq, heads, hd, seed);
        rope::<bf16>(exe, batch, seq, heads, hd, seed);
    }
}
