//! The device trainer ([`DeviceModel`]) on the CUDA backend, against the
//! same trainer on the checked CPU backend (whose ops are
//! [`zero_llama::ops`], and which `tests/device.rs` shows gives the CPU
//! trainer's bits):
//!
//! - every op of [`LlamaDevice`] on random inputs, f32 and bf16: the GEMMs
//!   (transposed operands, padded row strides, alpha, accumulation,
//!   batches with a shared operand, operands at offsets in larger
//!   buffers, whose other elements must stay as they were), the embedding,
//!   RMSNorm (written and accumulated), RoPE, the causal softmax, SwiGLU,
//!   the q/k/v biases and the cross-entropy (with ignored rows), each
//!   forward and backward;
//!   the gradient copy into a lent buffer bit for bit;
//! - the tiny model of `tests/device.rs` trained for three steps at
//!   stages 0 and 3 on 1 and 2 ranks (ranks as threads on one GPU, device
//!   collectives staged through host memory), f32 and bf16 parameters:
//!   the losses;
//! - the errors: operands outside their buffers, f16, targets outside the
//!   vocabulary, a sequence longer than the RoPE tables, ops made for
//!   another backend.
//!
//! Tolerances. Per op, as `tests/cuda_kernels.rs` (zero-testkit's
//! `llama_kernel_cases::check`): f32 outputs within `1e-5·|want|`, bf16
//! outputs within one bf16 ulp (`2^-7·|want|`), both plus
//! `1e-5·max|want|` for values that cancel to near zero: the GPU sums in
//! another order (cuBLAS's blocking, the kernels' warp reductions) and
//! its expf/logf are within 2 ulp of glibc's, each one f32 rounding per
//! term (about 1e-6 of the terms' sum for these sizes), which moves a bf16
//! result by at most one ulp. Training: losses within `1e-4` (f32) and
//! `2e-2` (bf16) relative: the per-op differences compound over the
//! layers and three AdamW steps (f32: orders of magnitude below 1e-4;
//! bf16 activations: about three significant digits per op, the bound
//! `tests/device.rs` uses between bf16 and f32 activations).
//!
//! Without a GPU every test prints `cuda: skipped: no GPU (...)` and
//! passes.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use zero::comm::{Communicator, HostStaged, Paired, ThreadComm, ThreadGroup};
use zero::core::backend::{Backend, CpuBackend, CpuMode, CudaBackend, CudaBuffer};
use zero::core::config::Precision;
use zero::core::{bf16, f16, Element};
use zero::{EngineBuilder, EngineComm};
use zero_llama as llama;
use zero_testkit::backend::{download, upload};
use zero_testkit::llama_kernel_cases::{check, randn, Act};
use zero_testkit::runs::cuda_backend;

use llama::device::{dst_at, src, src_at, Batch, DeviceModel, LlamaDevice};
use llama::ops::Mm;
use llama::train::SftModel;
use llama::{Config, XorShift};

#[path = "common/device.rs"]
mod common;
use common::{engine_config, train, SEED};

/// The model of `tests/device.rs`.
fn model_config() -> Config {
    common::model_config(false)
}

// ------------------------------------------------------------------ ops

/// An output of [`all_ops`]: its name, values, and whether it is f32
/// whatever the parameters' type (else the parameters' type).
struct Output {
    what: String,
    values: Vec<f32>,
    f32_out: bool,
}

/// Sizes of the op cases: 2 sequences of 5, the model's widths.
const BATCH: usize = 2;
const SEQ: usize = 5;

/// Random inputs uploaded to a backend.
struct Gen<'a, B> {
    dev: &'a B,
    rng: XorShift,
}

impl<B: Backend> Gen<'_, B> {
    /// Uploads `v` (narrowed to `T`) with `pad` random elements before and
    /// after, so that an op reads or writes it from element `pad` of a
    /// larger buffer.
    fn values<T: Element>(
        &mut self,
        v: &[f32],
        pad: usize,
        label: &str,
    ) -> zero::Result<B::Buffer<T>> {
        let mut all = randn(&mut self.rng, pad, 1.0);
        all.extend_from_slice(v);
        all.extend(randn(&mut self.rng, pad, 1.0));
        let all: Vec<T> = all.iter().map(|&x| T::from_f32(x)).collect();
        Ok(upload(self.dev, &all, label)?)
    }

    /// `n` normal draws times `scale`, as [`Gen::values`].
    fn randn<T: Element>(
        &mut self,
        n: usize,
        scale: f32,
        pad: usize,
        label: &str,
    ) -> zero::Result<B::Buffer<T>> {
        let v = randn(&mut self.rng, n, scale);
        self.values(&v, pad, label)
    }
}

fn f32s<T: Element>(v: Vec<T>) -> Vec<f32> {
    v.into_iter().map(T::to_f32).collect()
}

/// Every op of [`LlamaDevice`] on `dev` for inputs drawn from `seed`
/// (the same on every backend), each output whole (padding included).
fn all_ops<B: LlamaDevice, T: Element>(dev: &B, seed: u64) -> zero::Result<Vec<Output>> {
    let cfg = model_config();
    let ops = dev.llama_ops(&cfg, 1)?;
    let mut g = Gen {
        dev,
        rng: XorShift::new(seed),
    };
    let mut outs = Vec::new();
    let mut keep = |what: &str, values: Vec<f32>, f32_out: bool| {
        outs.push(Output {
            what: what.to_string(),
            values,
            f32_out,
        })
    };
    let (rows, dim, hid) = (BATCH * SEQ, cfg.dim, cfg.hidden);
    let hd = cfg.head_dim();
    let (heads, kv) = (cfg.n_heads, cfg.n_kv_heads);
    let (qd, kd, t) = (heads * hd, kv * hd, SEQ);
    let mats = heads * t * t;

    // GEMMs: (name, shape, batch, elements of a, b, out).
    let gemms = [
        ("linear", Mm::new(rows, hid, dim).tb(), Batch::ONE),
        (
            "weight grad, alpha, accumulate",
            Mm::new(dim, hid, rows).ta().alpha(0.5).acc(),
            Batch::ONE,
        ),
        (
            "padded strides, both transposed",
            Mm::new(6, 7, 9).ta().tb().ld(8, 11, 10),
            Batch::ONE,
        ),
        (
            "scores Q Kᵀ",
            Mm::new(t, t, hd).tb().ld(qd, kd, t).alpha(0.35),
            Batch {
                count: BATCH,
                a: t * qd,
                b: t * kd,
                out: mats,
            },
        ),
        (
            "dV += Pᵀ dO",
            Mm::new(t, hd, t).ta().ld(t, qd, kd).acc(),
            Batch {
                count: BATCH,
                a: mats,
                b: t * qd,
                out: t * kd,
            },
        ),
        (
            "shared weight",
            Mm::new(4, 5, 3).tb().acc(),
            Batch {
                count: 3,
                a: 12,
                b: 0,
                out: 20,
            },
        ),
    ];
    for (i, (name, mm, batch)) in gemms.into_iter().enumerate() {
        let ext = |rows: usize, cols: usize, ld: usize, stride: usize| {
            (batch.count - 1) * stride + (rows - 1) * ld + cols
        };
        let (ra, ca) = if mm.ta { (mm.k, mm.m) } else { (mm.m, mm.k) };
        let (rb, cb) = if mm.tb { (mm.n, mm.k) } else { (mm.k, mm.n) };
        let na = ext(ra, ca, mm.lda, batch.a);
        let nb = ext(rb, cb, mm.ldb, batch.b);
        let nc = ext(mm.m, mm.n, mm.ldc, batch.out);
        let (pa, pb, pc) = (i + 1, 2 * i + 3, 3 + i);
        let a = g.randn::<T>(na, 1.0, pa, "a")?;
        let b = g.randn::<T>(nb, 1.0, pb, "b")?;
        let mut c = g.randn::<T>(nc, 1.0, pc, "c")?;
        dev.gemm(
            &ops,
            dst_at(&mut c, pc),
            src_at(&a, pa),
            src_at(&b, pb),
            mm,
            batch,
        )?;
        keep(&format!("gemm {name}"), f32s(download(dev, &c)?), false);
    }

    // Embedding: rows of repeated tokens, forward and backward.
    let vocab = cfg.vocab;
    let tokens: Vec<u32> = (0..rows)
        .map(|r| {
            if r % 3 == 0 {
                7
            } else {
                g.rng.below(vocab) as u32
            }
        })
        .collect();
    let table = g.randn::<T>(vocab * dim, 1.0, 0, "table")?;
    let ids = dev.upload_ids(&ops, &tokens)?;
    let mut emb = g.values::<T>(&vec![0.0; rows * dim], 2, "emb")?;
    dev.embedding_forward(&ops, src(&table), &ids, dst_at(&mut emb, 2), dim)?;
    keep("embedding forward", f32s(download(dev, &emb)?), false);
    let dout = g.randn::<T>(rows * dim, 1.0, 1, "dout")?;
    let mut dtable = g.randn::<f32>(vocab * dim, 1.0, 0, "dt")?;
    // The first row's token as padding: its table row gets nothing.
    let plan = dev.embed_plan(&ops, &tokens, vocab, Some(tokens[0]))?;
    dev.embedding_backward(&ops, src_at(&dout, 1), &plan, dst_at(&mut dtable, 0), dim)?;
    keep("embedding backward", download(dev, &dtable)?, true);

    // RMSNorm.
    let x = g.randn::<T>(rows * dim, 2.0, 3, "x")?;
    let w: Vec<f32> = (0..dim).map(|_| 1.0 + 0.3 * g.rng.normal()).collect();
    let w = g.values::<T>(&w, 4, "w")?;
    let mut y = g.values::<T>(&vec![0.0; rows * dim], 1, "y")?;
    let mut inv = g.values::<f32>(&vec![0.0; rows], 2, "inv")?;
    dev.rmsnorm_forward(
        &ops,
        src_at(&x, 3),
        src_at(&w, 4),
        dst_at(&mut y, 1),
        dst_at(&mut inv, 2),
        rows,
        dim,
        1e-5,
    )?;
    keep("rmsnorm forward y", f32s(download(dev, &y)?), false);
    keep("rmsnorm forward inv", download(dev, &inv)?, true);
    for accumulate in [false, true] {
        let dy = g.randn::<T>(rows * dim, 1.0, 2, "dy")?;
        let mut dx = g.randn::<T>(rows * dim, 1.0, 5, "dx")?;
        let mut dw = g.randn::<f32>(dim, 1.0, 1, "dw")?;
        dev.rmsnorm_backward(
            &ops,
            src_at(&dy, 2),
            src_at(&x, 3),
            src_at(&w, 4),
            src_at(&inv, 2),
            dst_at(&mut dx, 5),
            dst_at(&mut dw, 1),
            rows,
            dim,
            accumulate,
        )?;
        keep(
            &format!("rmsnorm backward dx (accumulate {accumulate})"),
            f32s(download(dev, &dx)?),
            false,
        );
        keep(
            &format!("rmsnorm backward dw (accumulate {accumulate})"),
            download(dev, &dw)?,
            true,
        );
    }

    // RoPE, forward and inverse, on query and key widths.
    for (h, inverse) in [(heads, false), (kv, false), (heads, true)] {
        let mut q = g.randn::<T>(rows * h * hd, 1.0, 3, "q")?;
        dev.rope(&ops, dst_at(&mut q, 3), rows, SEQ, h, inverse)?;
        keep(
            &format!("rope {h} heads (inverse {inverse})"),
            f32s(download(dev, &q)?),
            false,
        );
    }

    // Causal softmax over every head of every sequence.
    let nm = BATCH * heads;
    let s = g.randn::<T>(nm * t * t, 2.0, 1, "s")?;
    let mut p = g.values::<T>(&vec![0.0; nm * t * t], 2, "p")?;
    dev.softmax_forward(&ops, src_at(&s, 1), dst_at(&mut p, 2), nm, t)?;
    keep("softmax forward", f32s(download(dev, &p)?), false);
    let dp = g.randn::<T>(nm * t * t, 1.0, 3, "dp")?;
    let mut ds = g.randn::<T>(nm * t * t, 1.0, 1, "ds")?;
    dev.softmax_backward(
        &ops,
        src_at(&p, 2),
        src_at(&dp, 3),
        dst_at(&mut ds, 1),
        nm,
        t,
        0.35,
    )?;
    keep("softmax backward", f32s(download(dev, &ds)?), false);

    // SwiGLU.
    let n = rows * hid;
    let h1 = g.randn::<T>(n, 2.0, 1, "h1")?;
    let h3 = g.randn::<T>(n, 1.0, 2, "h3")?;
    let mut act = g.values::<T>(&vec![0.0; n], 3, "a")?;
    dev.swiglu_forward(&ops, src_at(&h1, 1), src_at(&h3, 2), dst_at(&mut act, 3), n)?;
    keep("swiglu forward", f32s(download(dev, &act)?), false);
    let da = g.randn::<T>(n, 1.0, 2, "da")?;
    let mut dh1 = g.values::<T>(&vec![0.0; n], 1, "dh1")?;
    let mut dh3 = g.values::<T>(&vec![0.0; n], 4, "dh3")?;
    dev.swiglu_backward(
        &ops,
        src_at(&da, 2),
        src_at(&h1, 1),
        src_at(&h3, 2),
        dst_at(&mut dh1, 1),
        dst_at(&mut dh3, 4),
        n,
    )?;
    keep("swiglu backward dh1", f32s(download(dev, &dh1)?), false);
    keep("swiglu backward dh3", f32s(download(dev, &dh3)?), false);

    // Biases: added to rows, and their gradients (column sums).
    let mut yb = g.randn::<T>(rows * qd, 1.0, 3, "yb")?;
    let bias = g.randn::<T>(qd, 1.0, 1, "bias")?;
    dev.add_bias(&ops, dst_at(&mut yb, 3), src_at(&bias, 1), rows, qd)?;
    keep("bias added", f32s(download(dev, &yb)?), false);
    let dyb = g.randn::<T>(rows * qd, 1.0, 2, "dyb")?;
    let mut db = g.randn::<T>(qd, 1.0, 2, "db")?;
    dev.bias_grad(&ops, src_at(&dyb, 2), dst_at(&mut db, 2), rows, qd)?;
    keep("bias gradient", f32s(download(dev, &db)?), false);

    // Cross-entropy, two rows ignored.
    let targets: Vec<i32> = (0..rows)
        .map(|r| {
            if r == 1 || r == 6 {
                -100
            } else {
                g.rng.below(vocab) as i32
            }
        })
        .collect();
    let tg = dev.upload_targets(&ops, &targets)?;
    let logits = g.randn::<T>(rows * vocab, 3.0, 2, "lg")?;
    let mut dl = g.randn::<T>(rows * vocab, 1.0, 1, "dl")?;
    let mut loss = g.values::<f32>(&[0.0], 3, "loss")?;
    dev.cross_entropy(
        &ops,
        src_at(&logits, 2),
        &tg,
        dst_at(&mut dl, 1),
        dst_at(&mut loss, 3),
        vocab,
    )?;
    keep("cross-entropy dlogits", f32s(download(dev, &dl)?), false);
    keep("cross-entropy loss", download(dev, &loss)?, true);
    Ok(outs)
}

/// [`all_ops`] on the GPU against the checked CPU backend.
fn ops_match<T: Act>(gpu: &CudaBackend) {
    let cpu = CpuBackend::new(CpuMode::Checked).unwrap();
    for seed in [1, 2] {
        let want = all_ops::<CpuBackend, T>(&cpu, seed).unwrap();
        let got = all_ops::<CudaBackend, T>(gpu, seed).unwrap_or_else(|e| panic!("GPU ops: {e}"));
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.what, w.what);
            let what = format!("{} (seed {seed})", g.what);
            if g.f32_out {
                check::<f32>(&what, &g.values, &w.values);
            } else {
                check::<T>(&what, &g.values, &w.values);
            }
        }
    }
}

/// The op cases themselves, on the CPU backend with and without the
/// hazard checker (so that a failure on the GPU is the GPU's): the same
/// bits.
#[test]
fn the_op_cases_run_on_the_cpu_backend() {
    for mode in [CpuMode::Inline, CpuMode::Chaos { seed: 5 }] {
        let checked = CpuBackend::new(CpuMode::Checked).unwrap();
        let other = CpuBackend::new(mode).unwrap();
        let want = all_ops::<CpuBackend, bf16>(&checked, 1).unwrap();
        let got = all_ops::<CpuBackend, bf16>(&other, 1).unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&g.values), bits(&w.values), "{} {mode:?}", g.what);
        }
    }
}

#[test]
fn every_op_matches_the_cpu_backend_f32() {
    if let Some(gpu) = cuda_backend() {
        ops_match::<f32>(&gpu);
    }
}

#[test]
fn every_op_matches_the_cpu_backend_bf16() {
    if let Some(gpu) = cuda_backend() {
        ops_match::<bf16>(&gpu);
    }
}

#[test]
fn gradients_are_copied_into_the_lent_buffer() {
    let Some(gpu) = cuda_backend() else {
        return;
    };
    let ops = gpu.llama_ops(&model_config(), 1).unwrap();
    let mut rng = XorShift::new(3);
    let g: Vec<f32> = randn(&mut rng, 100, 1.0);
    let src = upload(&gpu, &g, "grad").unwrap();
    let mut lent: CudaBuffer<f32> = upload(&gpu, &[5.0f32; 120], "lent").unwrap();
    gpu.write_grad(&ops, &src, &mut lent, 90).unwrap();
    let got = download(&gpu, &lent).unwrap();
    let mut want = g[..90].to_vec();
    want.extend([5.0; 30]);
    assert_eq!(
        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    let mut short: CudaBuffer<f32> = gpu.alloc(50, "short").unwrap();
    let e = gpu
        .write_grad(&ops, &src, &mut short, 90)
        .unwrap_err()
        .to_string();
    assert!(e.contains("lent buffer of 50"), "{e}");
    let e = gpu
        .write_grad(&ops, &src, &mut lent, 101)
        .unwrap_err()
        .to_string();
    assert!(e.contains("gradient") && e.contains("\"grad\""), "{e}");
}

#[test]
fn bad_arguments_are_errors_naming_them() {
    let Some(gpu) = cuda_backend() else {
        return;
    };
    let cfg = model_config();
    let ops = gpu.llama_ops(&cfg, 1).unwrap();
    let a: CudaBuffer<f32> = gpu.alloc(12, "a").unwrap();
    let b: CudaBuffer<f32> = gpu.alloc(15, "b").unwrap();
    let mut c: CudaBuffer<f32> = gpu.alloc(20, "c").unwrap();
    let mm = Mm::new(4, 5, 3).tb();
    gpu.gemm(&ops, dst_at(&mut c, 0), src(&a), src(&b), mm, Batch::ONE)
        .unwrap();
    let e = gpu
        .gemm(
            &ops,
            dst_at(&mut c, 0),
            src_at(&a, 1),
            src(&b),
            mm,
            Batch::ONE,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("llama_gemm") && e.contains("operand a") && e.contains("\"a\""),
        "{e}"
    );
    let e = gpu
        .gemm(&ops, dst_at(&mut c, 1), src(&a), src(&b), mm, Batch::ONE)
        .unwrap_err()
        .to_string();
    assert!(e.contains("operand out"), "{e}");
    let overlapping = Batch {
        count: 2,
        a: 0,
        b: 0,
        out: 10,
    };
    let mut c2: CudaBuffer<f32> = gpu.alloc(40, "c2").unwrap();
    let e = gpu
        .gemm(&ops, dst_at(&mut c2, 0), src(&a), src(&b), mm, overlapping)
        .unwrap_err()
        .to_string();
    assert!(e.contains("overlap"), "{e}");
    // f16 parameters: not what the model runs on the GPU.
    let ha: CudaBuffer<f16> = gpu.alloc(12, "ha").unwrap();
    let hb: CudaBuffer<f16> = gpu.alloc(15, "hb").unwrap();
    let mut hc: CudaBuffer<f16> = gpu.alloc(20, "hc").unwrap();
    let e = gpu
        .gemm(&ops, dst_at(&mut hc, 0), src(&ha), src(&hb), mm, Batch::ONE)
        .unwrap_err()
        .to_string();
    assert!(e.contains("f16") && e.contains("llama_gemm"), "{e}");
    // Targets outside the vocabulary, found on the host.
    let tg = gpu.upload_targets(&ops, &[1, 2, cfg.vocab as i32]).unwrap();
    let logits: CudaBuffer<f32> = gpu.alloc(3 * cfg.vocab, "logits").unwrap();
    let mut dl: CudaBuffer<f32> = gpu.alloc(3 * cfg.vocab, "dl").unwrap();
    let mut loss: CudaBuffer<f32> = gpu.alloc(1, "loss").unwrap();
    let e = gpu
        .cross_entropy(
            &ops,
            src(&logits),
            &tg,
            dst_at(&mut dl, 0),
            dst_at(&mut loss, 0),
            cfg.vocab,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("target 261 at row 2"), "{e}");
    // Tokens outside the vocabulary.
    let e = gpu
        .embed_plan(&ops, &[3, cfg.vocab as u32], cfg.vocab, None)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("token 261 at row 1"), "{e}");
    // A sequence longer than the RoPE tables.
    let mut q: CudaBuffer<f32> = gpu.alloc(4 * cfg.dim * 100, "q").unwrap();
    let e = gpu
        .rope(
            &ops,
            dst_at(&mut q, 0),
            4,
            cfg.max_seq + 1,
            cfg.n_heads,
            false,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("seq"), "{e}");
    // The ops of another backend (its cuBLAS handle is on another stream).
    let other = CudaBackend::new(0).unwrap();
    let oa: CudaBuffer<f32> = other.alloc(12, "oa").unwrap();
    let ob: CudaBuffer<f32> = other.alloc(15, "ob").unwrap();
    let mut oc: CudaBuffer<f32> = other.alloc(20, "oc").unwrap();
    let e = other
        .gemm(&ops, dst_at(&mut oc, 0), src(&oa), src(&ob), mm, Batch::ONE)
        .unwrap_err()
        .to_string();
    assert!(e.contains("another CUDA backend"), "{e}");
    gpu.sync_all().unwrap();
}

// ------------------------------------------------------------- training

const STEPS: usize = 3;

/// Trains on the built engine; this rank's losses.
fn train_built<T: Element, B: LlamaDevice, C: EngineComm<B>>(
    b: EngineBuilder<C, B>,
    model: SftModel,
) -> zero::Result<Vec<f32>> {
    let mut e = b.build()?;
    let dm = DeviceModel::new(model, e.device_backend(), 1)?;
    train::<T, _, _, _>(&mut e, &dm, STEPS)
}

fn train_rank<T: Element>(
    comm: ThreadComm,
    stage: u8,
    p: Precision,
    on_gpu: bool,
) -> zero::Result<Vec<f32>> {
    let world = comm.world_size();
    let mut b = zero::Engine::builder(engine_config(world, stage, 1, p), comm).seed(SEED);
    let model = SftModel::register(&mut b, model_config(), None, 1, false)?;
    if on_gpu {
        // As zero-testkit's TestDevice::with_builder: one GPU, the ranks'
        // device collectives staged through host memory.
        let b = b
            .map_comm(|c| {
                let c = Arc::new(c);
                Paired::new(c.clone(), HostStaged::new(c))
            })
            .backend(CudaBackend::new(0)?);
        train_built::<T, _, _>(b, model)
    } else {
        let b = b.backend(CpuBackend::new(CpuMode::Checked)?);
        train_built::<T, _, _>(b, model)
    }
}

fn losses(world: usize, stage: u8, p: Precision, on_gpu: bool) -> Vec<Vec<f32>> {
    ThreadGroup::run(world, |comm: ThreadComm| match p {
        Precision::Bf16 => train_rank::<bf16>(comm, stage, p, on_gpu),
        _ => train_rank::<f32>(comm, stage, p, on_gpu),
    })
    .expect("ranks ran")
    .into_iter()
    .map(|x| x.unwrap_or_else(|e| panic!("gpu {on_gpu} {p:?} stage {stage}: {e}")))
    .collect()
}

#[test]
fn training_on_the_gpu_matches_the_cpu_backend() {
    if cuda_backend().is_none() {
        return;
    }
    for (p, rtol) in [(Precision::Fp32, 1e-4f32), (Precision::Bf16, 2e-2)] {
        for world in [1, 2] {
            for stage in [0u8, 3] {
                let want = losses(world, stage, p, false);
                let got = losses(world, stage, p, true);
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.len(), STEPS);
                    for (k, (a, b)) in g.iter().zip(w).enumerate() {
                        assert!(
                            a.is_finite() && (a - b).abs() <= rtol * b.abs(),
                            "{p:?} world {world} stage {stage} rank {r} step {k}: \
                             GPU loss {a} vs CPU backend {b} (rtol {rtol})"
                        );
                    }
                }
                eprintln!("{p:?} world {world} stage {stage}: GPU {got:?} CPU {want:?}");
            }
        }
    }
}
