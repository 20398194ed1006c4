//! The device trainer ([`DeviceModel`]) on the CPU backend under the hazard
//! checker, against the CPU trainer ([`SftModel::train_micro_batch`]):
//!
//! - with f32 parameters it gives the CPU trainer's losses, parameters,
//!   master weights and moments bit for bit, at stages 0–3 on 1–2 ranks,
//!   with tied embeddings, Qwen2's q/k/v biases, activation checkpointing
//!   and gradient accumulation, in Checked and Chaos mode (so every op of the
//!   composition the GPU runs is ordered with the engine's gathers and
//!   reductions, and each tensor's gradient lands where the CPU trainer
//!   puts it);
//! - with bf16 parameters (bf16 activations, as on the GPU) it is
//!   bit-identical across stages and its losses stay within bf16 rounding
//!   of the CPU trainer's f32 activations.
//!
//! LoRA on the device trainer: `tests/device_lora.rs`.

use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::backend::{CpuBackend, CpuMode};
use zero::core::config::Precision;
use zero::core::{bf16, Element};
use zero::engine::{EngineBackend, EngineComm};
use zero::{Engine, UnitState};
use zero_llama as llama;
use zero_testkit::backend::assert_same_bits;

use llama::device::DeviceModel;
use llama::train::SftModel;
use llama::Config;

#[path = "common/device.rs"]
mod common;
use common::{engine_config, model_config, train, MB, SEED};

/// Which trainer runs, on which backend.
#[derive(Clone, Copy, Debug)]
enum Trainer {
    /// [`SftModel::train_micro_batch`] on the inline CPU backend.
    Cpu,
    /// [`DeviceModel::train_micro_batch`] on the CPU backend in this mode.
    Device(CpuMode),
}

#[derive(Clone, Copy)]
struct Run {
    world: usize,
    stage: u8,
    ga: usize,
    steps: usize,
    tied: bool,
    /// Qwen2's q/k/v biases.
    bias: bool,
    checkpointing: bool,
}

struct RankRun {
    losses: Vec<f32>,
    states: Vec<UnitState>,
}

/// Every unit's state.
fn states<C: EngineComm<B>, B: EngineBackend>(
    e: &mut Engine<C, B>,
) -> zero::Result<Vec<UnitState>> {
    e.unit_ids().into_iter().map(|u| e.unit_state(u)).collect()
}

fn train_rank<T: Element>(
    comm: ThreadComm,
    r: Run,
    p: Precision,
    t: Trainer,
) -> zero::Result<RankRun> {
    let cfg = engine_config(comm.world_size(), r.stage, r.ga, p);
    let mut b = Engine::builder(cfg, comm).seed(SEED);
    let model_cfg = Config {
        qkv_bias: r.bias,
        ..model_config(r.tied)
    };
    let model = SftModel::register(&mut b, model_cfg, None, 1, r.checkpointing)?;
    let micros = r.steps * r.ga;
    let (losses, states) = match t {
        Trainer::Cpu => {
            let mut e = b.build()?;
            (
                train::<T, _, _, _>(&mut e, &model, micros)?,
                states(&mut e)?,
            )
        }
        Trainer::Device(mode) => {
            let mut e = b.backend(CpuBackend::new(mode)?).build()?;
            let dm = DeviceModel::new(model, e.device_backend(), 1)?;
            (train::<T, _, _, _>(&mut e, &dm, micros)?, states(&mut e)?)
        }
    };
    Ok(RankRun { losses, states })
}

fn run(r: Run, p: Precision, t: Trainer) -> Vec<RankRun> {
    ThreadGroup::run(r.world, |comm: ThreadComm| match p {
        Precision::Bf16 => train_rank::<bf16>(comm, r, p, t),
        _ => train_rank::<f32>(comm, r, p, t),
    })
    .expect("ranks ran")
    .into_iter()
    .map(|x| x.unwrap_or_else(|e| panic!("{t:?} failed: {e}")))
    .collect()
}

fn assert_same(a: &[RankRun], b: &[RankRun], what: &str) {
    for (r, (x, y)) in a.iter().zip(b).enumerate() {
        assert_same_bits(&x.losses, &y.losses, &format!("{what}: rank {r} losses"));
        for (u, (p, q)) in x.states.iter().zip(&y.states).enumerate() {
            for (f, s, t) in [
                ("params", &p.params, &q.params),
                ("master", &p.master, &q.master),
                ("m", &p.m, &q.m),
                ("v", &p.v, &q.v),
            ] {
                assert_same_bits(s, t, &format!("{what}: rank {r} unit {u} {f}"));
            }
        }
    }
}

#[test]
fn the_device_trainer_is_the_cpu_trainer_bit_for_bit() {
    let base = Run {
        world: 2,
        stage: 0,
        ga: 1,
        steps: 2,
        tied: false,
        bias: false,
        checkpointing: false,
    };
    let cases = [
        base,
        Run { stage: 3, ..base },
        Run {
            stage: 2,
            ga: 2,
            ..base
        },
        Run {
            world: 1,
            stage: 1,
            tied: true,
            ..base
        },
        Run {
            stage: 3,
            tied: true,
            checkpointing: true,
            ..base
        },
        // Qwen2's shape: q/k/v biases and tied embeddings.
        Run {
            stage: 3,
            tied: true,
            bias: true,
            ..base
        },
        Run {
            world: 1,
            stage: 0,
            bias: true,
            checkpointing: true,
            ..base
        },
    ];
    for r in cases {
        let want = run(r, Precision::Fp32, Trainer::Cpu);
        for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 3 }] {
            let what = format!(
                "world {} stage {} ga {} tied {} bias {} checkpointing {} {mode:?}",
                r.world, r.stage, r.ga, r.tied, r.bias, r.checkpointing
            );
            let got = run(r, Precision::Fp32, Trainer::Device(mode));
            assert_same(&want, &got, &what);
        }
    }
}

#[test]
fn bf16_activations_are_exact_across_stages_and_near_the_cpu_trainer() {
    let base = Run {
        world: 2,
        stage: 0,
        ga: 1,
        steps: 3,
        tied: false,
        bias: false,
        checkpointing: false,
    };
    let dev = Trainer::Device(CpuMode::Checked);
    let stage0 = run(base, Precision::Bf16, dev);
    for stage in 1..=3u8 {
        let got = run(Run { stage, ..base }, Precision::Bf16, dev);
        assert_same(&stage0, &got, &format!("bf16 stage {stage} vs stage 0"));
    }
    let cpu = run(base, Precision::Bf16, Trainer::Cpu);
    for (x, y) in cpu.iter().zip(&stage0) {
        for (a, b) in x.losses.iter().zip(&y.losses) {
            // bf16 activations: about 3 significant digits per op.
            assert!(
                (a - b).abs() <= 0.02 * a.abs(),
                "loss {b} vs the CPU trainer's {a}"
            );
        }
    }
}

/// A micro-batch whose every target is ignored (a prompt-only batch) gives
/// a loss of 0 and the CPU trainer's step, on one rank and two.
#[test]
fn a_batch_without_loss_rows_is_the_cpu_trainers() {
    fn rank<T: Element>(comm: ThreadComm, device: bool) -> zero::Result<(f32, Vec<UnitState>)> {
        let cfg = engine_config(comm.world_size(), 3, 1, Precision::Fp32);
        let mut b = Engine::builder(cfg, comm).seed(SEED);
        let model = SftModel::register(&mut b, model_config(false), None, 1, false)?;
        let seq = 8;
        let tokens: Vec<u32> = (0..(MB * seq) as u32).map(|t| t % 50).collect();
        let targets = vec![-100i32; MB * seq];
        let tracer = zero::Tracer::disabled();
        let (loss, states) = if device {
            let mut e = b.backend(CpuBackend::new(CpuMode::Checked)?).build()?;
            let dm = DeviceModel::new(model, e.device_backend(), 1)?;
            let st = dm.train_micro_batch::<T, _>(&mut e, &tokens, &targets, MB, seq, &tracer)?;
            e.step()?;
            (st.loss, states(&mut e)?)
        } else {
            let mut e = b.build()?;
            let st =
                model.train_micro_batch::<T, _>(&mut e, &tokens, &targets, MB, seq, &tracer)?;
            e.step()?;
            (st.loss, states(&mut e)?)
        };
        Ok((loss, states))
    }
    for world in [1, 2] {
        let run = |device: bool| {
            ThreadGroup::run(world, move |c: ThreadComm| rank::<f32>(c, device))
                .expect("ranks ran")
                .into_iter()
                .map(|r| r.expect("trained"))
                .collect::<Vec<_>>()
        };
        let (want, got) = (run(false), run(true));
        for ((wl, ws), (gl, gs)) in want.iter().zip(&got) {
            assert_eq!((*wl, *gl), (0.0, 0.0));
            for (p, q) in ws.iter().zip(gs) {
                assert_same_bits(&p.params, &q.params, &format!("world {world} params"));
                assert_same_bits(&p.m, &q.m, &format!("world {world} m"));
            }
        }
    }
}
