//! LoRA on the device trainer on the CUDA backend, against the same
//! trainer on the checked CPU backend (which `tests/device_lora.rs` shows
//! gives the CPU trainer's bits):
//!
//! - the dropout op ([`LlamaDevice::dropout`], written and accumulated,
//!   from a word offset of the mask) bit for bit, f32 and bf16 (one f32
//!   product and sum per element, rounded once);
//! - the tiny model with adapters of rank 4 on the seven projections,
//!   dropout 0.1, trained for three steps at stage 0, stage 3 (frozen base
//!   sharded) and stage 3 with the optimizer, the parameters and the
//!   frozen base offloaded, on 2 ranks sharing the GPU (device collectives
//!   staged through host memory), f32 and bf16 parameters: the losses
//!   within `1e-4` (f32) and `2e-2` (bf16) relative, the bounds of
//!   `tests/device_cuda.rs`, and the trained adapters within `1e-3` (f32)
//!   of their largest element.
//!
//! Without a GPU every test passes without running.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use zero::comm::{HostStaged, Paired, ThreadComm, ThreadGroup};
use zero::core::backend::{CpuBackend, CpuMode, CudaBackend};
use zero::core::config::{FrozenParams, OffloadDevice, Precision, ResolvedConfig};
use zero::core::{bf16, Element};
use zero::{EngineBuilder, EngineComm};
use zero_llama as llama;
use zero_testkit::backend::{download, upload};
use zero_testkit::runs::cuda_backend;

use llama::device::{dst, src, src_at, DeviceModel, LlamaDevice};
use llama::lora::{self, LoraConfig};
use llama::train::{LoraSetup, SftModel};

#[path = "common/device.rs"]
mod common;
use common::{engine_config, model_config, train, SEED};

/// The dropout op on `dev`: `out = drop(x)` then `out += drop(y)`, both
/// from word 1 of the mask.
fn dropout_on<B: LlamaDevice, T: Element>(dev: &B, x: &[f32], y: &[f32]) -> Vec<f32> {
    let n = x.len();
    let ops = dev.llama_ops(&model_config(false), 1).unwrap();
    let bits = lora::dropout_bits(n + 32, 0.3, 9).unwrap();
    // The words as f32 bit patterns, as the trainer keeps them.
    let words: Vec<f32> = bits.iter().map(|&w| f32::from_bits(w)).collect();
    let mask = upload(dev, &words, "mask").unwrap();
    let xs: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let ys: Vec<T> = y.iter().map(|&v| T::from_f32(v)).collect();
    let (xb, yb) = (
        upload(dev, &xs, "x").unwrap(),
        upload(dev, &ys, "y").unwrap(),
    );
    let mut out = dev.alloc::<T>(n, "out").unwrap();
    let keep = lora::dropout_keep(0.3);
    dev.dropout(
        &ops,
        src(&xb),
        src_at(&mask, 1),
        keep,
        dst(&mut out),
        n,
        false,
    )
    .unwrap();
    dev.dropout(
        &ops,
        src(&yb),
        src_at(&mask, 1),
        keep,
        dst(&mut out),
        n,
        true,
    )
    .unwrap();
    download(dev, &out)
        .unwrap()
        .iter()
        .map(|v| v.to_f32())
        .collect()
}

#[test]
fn the_dropout_op_is_the_cpu_backends_bit_for_bit() {
    let Some(gpu) = cuda_backend() else {
        return;
    };
    let mut rng = llama::XorShift::new(3);
    let n = 1000;
    let x: Vec<f32> = (0..n).map(|_| rng.uniform() - 0.5).collect();
    let y: Vec<f32> = (0..n).map(|_| rng.uniform() - 0.5).collect();
    let cpu = CpuBackend::new(CpuMode::Checked).unwrap();
    let want = dropout_on::<_, f32>(&cpu, &x, &y);
    assert_eq!(want, dropout_on::<_, f32>(&gpu, &x, &y), "f32");
    assert!(want.iter().filter(|&&v| v == 0.0).count() > n / 20);
    assert_eq!(
        dropout_on::<_, bf16>(&cpu, &x, &y),
        dropout_on::<_, bf16>(&gpu, &x, &y),
        "bf16"
    );
}

const STEPS: usize = 3;

fn lora_setup() -> LoraSetup {
    LoraSetup {
        cfg: LoraConfig::new(4, 8.0, 0.1, &lora::TARGETS.map(|t| t.0)).unwrap(),
        seed: SEED,
        adapters: None,
    }
}

/// Trains on the built engine: this rank's losses and adapters.
fn train_built<T: Element, B: LlamaDevice, C: EngineComm<B>>(
    b: EngineBuilder<C, B>,
    model: SftModel,
) -> zero::Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let mut e = b.build()?;
    let dm = DeviceModel::new(model, e.device_backend(), 1)?;
    let losses = train::<T, _, _, _>(&mut e, &dm, STEPS)?;
    Ok((losses, dm.model.snapshot_adapters(&mut e)?))
}

fn train_rank<T: Element>(
    comm: ThreadComm,
    cfg: ResolvedConfig,
    on_gpu: bool,
) -> zero::Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let mut b = zero::Engine::builder(cfg, comm).seed(SEED);
    let model = SftModel::register_lora(
        &mut b,
        model_config(false),
        None,
        Some(lora_setup()),
        1,
        false,
    )?;
    if on_gpu {
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

#[test]
fn lora_training_on_the_gpu_matches_the_cpu_backend() {
    if cuda_backend().is_none() {
        return;
    }
    let world = 2;
    for (p, rtol) in [(Precision::Fp32, 1e-4f32), (Precision::Bf16, 2e-2)] {
        for (what, stage, offload, frozen) in [
            ("stage 0", 0u8, OffloadDevice::None, FrozenParams::Auto),
            ("stage 3 shard", 3, OffloadDevice::None, FrozenParams::Shard),
            (
                "stage 3 offload",
                3,
                OffloadDevice::Cpu,
                FrozenParams::Offload,
            ),
        ] {
            let mut cfg = engine_config(world, stage, 1, p);
            cfg.zero.offload_optimizer.device = offload;
            cfg.zero.offload_param.device = offload;
            cfg.zero.frozen_params = frozen;
            let run = |on_gpu: bool| {
                ThreadGroup::run(world, |comm: ThreadComm| match p {
                    Precision::Bf16 => train_rank::<bf16>(comm, cfg.clone(), on_gpu),
                    _ => train_rank::<f32>(comm, cfg.clone(), on_gpu),
                })
                .expect("ranks ran")
                .into_iter()
                .map(|x| x.unwrap_or_else(|e| panic!("gpu {on_gpu} {p:?} {what}: {e}")))
                .collect::<Vec<_>>()
            };
            let (want, got) = (run(false), run(true));
            for (r, ((gl, ga), (wl, wa))) in got.iter().zip(&want).enumerate() {
                for (k, (a, b)) in gl.iter().zip(wl).enumerate() {
                    assert!(
                        a.is_finite() && (a - b).abs() <= rtol * b.abs(),
                        "{p:?} {what} rank {r} step {k}: GPU loss {a} vs CPU backend {b}"
                    );
                }
                if p == Precision::Fp32 {
                    for (k, (a, b)) in ga.iter().zip(wa).enumerate() {
                        let top = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                        let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                        assert!(
                            worst <= 1e-3 * top,
                            "{what} rank {r} adapter {k}: {worst} off (largest {top})"
                        );
                    }
                }
            }
            eprintln!("{p:?} {what}: GPU {:?} CPU {:?}", got[0].0, want[0].0);
        }
    }
}
