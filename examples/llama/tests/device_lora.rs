//! LoRA on the device trainer ([`DeviceModel`]) on the CPU backend under
//! the hazard checker, against the CPU trainer
//! ([`SftModel::train_micro_batch`]) with the same adapters:
//!
//! - with f32 parameters it gives the CPU trainer's losses, parameters
//!   (the frozen base untouched), adapters' master weights and moments bit
//!   for bit, at stages 0–3 × optimizer offload none/cpu/nvme, stage-3
//!   parameter offload cpu/nvme and every `frozen_params` policy
//!   (`resident`, `shard`, `offload`), on 1 and 2 ranks, with dropout
//!   (the same masks, kept as bit masks), rsLoRA, Qwen2's biases, tied
//!   embeddings, activation checkpointing and adapters loaded in, in
//!   Checked and Chaos mode;
//! - the adapters it trains go out in PEFT's layout and merge as the CPU
//!   trainer's do;
//! - leaving out any of the engine's waits it relies on
//!   ([`SkipWait`]), or the wait before a dropout mask's pinned slot is
//!   rewritten, is a hazard the checker reports, at every stage.

use zero::comm::{ThreadComm, ThreadGroup};
use zero::core::backend::{CpuBackend, CpuMode};
use zero::core::config::{FrozenParams, OffloadDevice, Precision, ResolvedConfig};
use zero::core::Element;
use zero::engine::{EngineBackend, EngineComm, SkipWait};
use zero::{Engine, Error, UnitState};
use zero_llama as llama;
use zero_testkit::backend::assert_same_bits;
use zero_testkit::temp::TempDir;

use llama::device::DeviceModel;
use llama::lora::{self, LoraConfig};
use llama::train::{LoraSetup, Part, SftModel};
use llama::Config;

#[path = "common/device.rs"]
mod common;
use common::{engine_config, model_config, train, SEED};

/// Which trainer runs, on which backend.
#[derive(Clone, Copy, Debug)]
enum Trainer {
    /// [`SftModel::train_micro_batch`] on the inline CPU backend.
    Cpu,
    /// [`DeviceModel::train_micro_batch`] on the CPU backend in this
    /// mode; `staged`: offloaded state moves through host buffers on the
    /// copy streams as on a GPU (`EngineBuilder::stage_offload_for_tests`),
    /// else the host writes it in place (the CPU backend's own path).
    Device(CpuMode, bool),
}

/// One setup of the comparison.
#[derive(Clone, Copy, Debug)]
struct Run {
    world: usize,
    stage: u8,
    opt: OffloadDevice,
    param: OffloadDevice,
    frozen: FrozenParams,
    tied: bool,
    bias: bool,
    checkpointing: bool,
    dropout: f32,
    rslora: bool,
    /// Every target, or four of the seven.
    all_targets: bool,
    /// Adapters loaded in (`--adapter`, B not zero) instead of PEFT's
    /// initialisation.
    loaded: bool,
}

const BASE: Run = Run {
    world: 2,
    stage: 0,
    opt: OffloadDevice::None,
    param: OffloadDevice::None,
    frozen: FrozenParams::Auto,
    tied: false,
    bias: false,
    checkpointing: false,
    dropout: 0.1,
    rslora: false,
    all_targets: true,
    loaded: false,
};

struct RankRun {
    losses: Vec<f32>,
    states: Vec<UnitState>,
    /// [`SftModel::snapshot_adapters`].
    adapters: Vec<Vec<f32>>,
    /// [`SftModel::part_tensors`] of the first block (adapters merged).
    merged: Vec<Vec<f32>>,
}

fn model_of(r: &Run) -> Config {
    Config {
        qkv_bias: r.bias,
        ..model_config(r.tied)
    }
}

fn lora_setup(r: &Run) -> LoraSetup {
    let targets: &[&str] = if r.all_targets {
        &lora::TARGETS.map(|t| t.0)
    } else {
        &["q_proj", "v_proj", "o_proj", "down_proj"]
    };
    let mut cfg = LoraConfig::new(4, 8.0, r.dropout, targets).unwrap();
    cfg.use_rslora = r.rslora;
    let adapters = r.loaded.then(|| {
        let model = model_of(r);
        let mut rng = llama::XorShift::new(11);
        lora::all_lora_tensors(&model, &cfg)
            .iter()
            .map(|t| {
                (0..t.numel())
                    .map(|_| 0.05 * (2.0 * rng.uniform() - 1.0))
                    .collect()
            })
            .collect()
    });
    LoraSetup {
        cfg,
        seed: SEED,
        adapters,
    }
}

fn config(r: &Run, dir: &TempDir) -> ResolvedConfig {
    let mut c = engine_config(r.world, r.stage, 1, Precision::Fp32);
    c.zero.offload_optimizer.device = r.opt;
    if r.opt == OffloadDevice::Nvme {
        c.zero.offload_optimizer.nvme_path = Some(dir.0.join("optimizer"));
    }
    c.zero.offload_param.device = r.param;
    if r.param == OffloadDevice::Nvme {
        c.zero.offload_param.max_in_cpu = 0;
        c.zero.offload_param.nvme_path = Some(dir.0.join("params"));
    }
    c.zero.frozen_params = r.frozen;
    c
}

/// Every unit's state.
fn states<C: EngineComm<B>, B: EngineBackend>(
    e: &mut Engine<C, B>,
) -> zero::Result<Vec<UnitState>> {
    e.unit_ids().into_iter().map(|u| e.unit_state(u)).collect()
}

fn finish<C: EngineComm<B>, B: EngineBackend>(
    e: &mut Engine<C, B>,
    model: &SftModel,
    losses: Vec<f32>,
) -> zero::Result<RankRun> {
    Ok(RankRun {
        losses,
        states: states(e)?,
        adapters: model.snapshot_adapters(e)?,
        merged: model.part_tensors(e, Part::Layer(0))?,
    })
}

fn train_rank<T: Element>(
    comm: ThreadComm,
    r: Run,
    t: Trainer,
    cfg: &ResolvedConfig,
    skip: Option<SkipWait>,
    skip_mask_wait: bool,
) -> zero::Result<RankRun> {
    let mut b = Engine::builder(cfg.clone(), comm).seed(SEED);
    if let Some(s) = skip {
        b = b.skip_wait_for_tests(s);
    }
    let model = SftModel::register_lora(
        &mut b,
        model_of(&r),
        None,
        Some(lora_setup(&r)),
        1,
        r.checkpointing,
    )?;
    let micros = 3;
    match t {
        Trainer::Cpu => {
            let mut e = b.build()?;
            let losses = train::<T, _, _, _>(&mut e, &model, micros)?;
            finish(&mut e, &model, losses)
        }
        Trainer::Device(mode, staged) => {
            if staged {
                b = b.stage_offload_for_tests();
            }
            let mut e = b.backend(CpuBackend::new(mode)?).build()?;
            let mut dm = DeviceModel::new(model, e.device_backend(), 1)?;
            if skip_mask_wait {
                dm.skip_mask_wait_for_tests();
            }
            let losses = train::<T, _, _, _>(&mut e, &dm, micros)?;
            finish(&mut e, &dm.model, losses)
        }
    }
}

fn run_with(r: Run, t: Trainer, skip: Option<SkipWait>) -> Vec<zero::Result<RankRun>> {
    run_skipping(r, t, skip, false)
}

/// [`run_with`], and with `skip_mask_wait` the dropout masks' pinned
/// slots rewritten without waiting for their copies
/// ([`DeviceModel::skip_mask_wait_for_tests`]).
fn run_skipping(
    r: Run,
    t: Trainer,
    skip: Option<SkipWait>,
    skip_mask_wait: bool,
) -> Vec<zero::Result<RankRun>> {
    let dir = TempDir::new("device-lora");
    let cfg = config(&r, &dir);
    ThreadGroup::run(r.world, |comm: ThreadComm| {
        train_rank::<f32>(comm, r, t, &cfg, skip, skip_mask_wait)
    })
    .expect("ranks ran")
}

fn run(r: Run, t: Trainer) -> Vec<RankRun> {
    run_with(r, t, None)
        .into_iter()
        .map(|x| x.unwrap_or_else(|e| panic!("{r:?} {t:?} failed: {e}")))
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
        for (k, (s, t)) in x.adapters.iter().zip(&y.adapters).enumerate() {
            assert_same_bits(s, t, &format!("{what}: rank {r} adapter {k}"));
        }
        for (k, (s, t)) in x.merged.iter().zip(&y.merged).enumerate() {
            assert_same_bits(s, t, &format!("{what}: rank {r} merged tensor {k}"));
        }
    }
}

/// Every setup of the comparison: stages 0–3 × optimizer offload
/// none/cpu/nvme, stage-3 parameter offload cpu/nvme and the frozen
/// policies, and the model's variants.
fn setups() -> Vec<Run> {
    let mut v = Vec::new();
    for stage in 0..=3u8 {
        for opt in [OffloadDevice::None, OffloadDevice::Cpu, OffloadDevice::Nvme] {
            v.push(Run { stage, opt, ..BASE });
        }
    }
    for param in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
        v.push(Run {
            stage: 3,
            opt: OffloadDevice::Cpu,
            param,
            ..BASE
        });
    }
    for frozen in [FrozenParams::Resident, FrozenParams::Shard] {
        v.push(Run {
            stage: 3,
            frozen,
            ..BASE
        });
    }
    v.push(Run {
        stage: 3,
        opt: OffloadDevice::Cpu,
        param: OffloadDevice::Cpu,
        frozen: FrozenParams::Offload,
        ..BASE
    });
    // The model's variants.
    v.push(Run {
        world: 1,
        stage: 3,
        tied: true,
        bias: true,
        checkpointing: true,
        ..BASE
    });
    v.push(Run {
        stage: 2,
        rslora: true,
        all_targets: false,
        loaded: true,
        ..BASE
    });
    v.push(Run {
        stage: 3,
        dropout: 0.0,
        checkpointing: true,
        loaded: true,
        ..BASE
    });
    v
}

#[test]
fn device_lora_is_the_cpu_trainers_bit_for_bit() {
    for r in setups() {
        let want = run(r, Trainer::Cpu);
        for dev in [
            Trainer::Device(CpuMode::Checked, true),
            Trainer::Device(CpuMode::Chaos { seed: 3 }, true),
            Trainer::Device(CpuMode::Checked, false),
        ] {
            let got = run(r, dev);
            assert_same(&want, &got, &format!("{r:?} {dev:?}"));
        }
    }
}

/// The device run's adapters go out in PEFT's layout and come back in as
/// they went out (what `--export-adapter` and `--adapter` do).
#[test]
fn device_adapters_go_out_in_pefts_layout() {
    let r = Run { stage: 3, ..BASE };
    let got = run(r, Trainer::Device(CpuMode::Checked, true));
    let dir = TempDir::new("device-lora-adapter");
    let setup = lora_setup(&r);
    let model = model_of(&r);
    lora::save_adapter(&dir.0, &model, &setup.cfg, &got[0].adapters, "").unwrap();
    let (cfg, back) = lora::load_adapter(&dir.0, &model).unwrap();
    assert_eq!(cfg, setup.cfg);
    for (k, (a, b)) in got[0].adapters.iter().zip(&back).enumerate() {
        assert_same_bits(a, b, &format!("adapter {k}"));
    }
    // Trained: B moved off its zero start.
    assert!(got[0].adapters[1].iter().any(|&x| x != 0.0));
}

/// Leaving out a wait of the engine's that the device trainer's LoRA run
/// relies on (the packing of a bucket before its reduction, the last
/// unpack before the optimizer reads the homes, the copy of a shard or
/// AdamW before a parameter all-gather) is a hazard the checker names,
/// at every stage that has the wait, in Checked mode and under Chaos.
#[test]
fn a_removed_wait_is_a_hazard_under_device_lora() {
    for stage in 0..=3u8 {
        for skip in [
            SkipWait::PackBeforeReduce,
            SkipWait::HomesBeforeOptimizer,
            SkipWait::ParamsBeforeGather,
        ] {
            if skip == SkipWait::ParamsBeforeGather && stage == 0 {
                continue; // stage 0 gathers no parameters
            }
            for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 5 }] {
                let r = Run { stage, ..BASE };
                assert_hazards(
                    run_with(r, Trainer::Device(mode, true), Some(skip)),
                    &format!("stage {stage} {skip:?} {mode:?}"),
                );
            }
        }
    }
}

/// The dropout masks go up through pinned host slots, each rewritten
/// only after the copy out of it finished: leaving out that wait
/// ([`DeviceModel::skip_mask_wait_for_tests`]) is a hazard the checker
/// names (the slot), in Checked mode and under Chaos, at stages 0 and 3.
/// With activation checkpointing: the tiny model's two blocks take one
/// slot each in forward, and their recomputations in backward take them
/// again while the forward's copies may be queued (the same runs with
/// the wait are the CPU trainer's bit for bit, above).
#[test]
fn rewriting_a_mask_slot_before_its_copy_is_a_hazard() {
    for (stage, checkpointing) in [(0, true), (3, true)] {
        for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 5 }] {
            let r = Run {
                stage,
                checkpointing,
                ..BASE
            };
            let what = format!("stage {stage} checkpointing {checkpointing} {mode:?}");
            let got = run_skipping(r, Trainer::Device(mode, true), None, true);
            for (rank, got) in got.iter().enumerate() {
                if let Err(e) = got {
                    let msg = e.to_string();
                    assert!(
                        msg.contains("lora dropout masks (pinned)"),
                        "{what} rank {rank}: not the slot's hazard: {msg}"
                    );
                }
            }
            assert_hazards(got, &what);
        }
    }
}

/// Every rank of a run with a wait left out stopped at a hazard.
fn assert_hazards(got: Vec<zero::Result<RankRun>>, what: &str) {
    for (rank, got) in got.into_iter().enumerate() {
        match got {
            Ok(_) => panic!("{what} rank {rank}: trained without a hazard"),
            Err(Error::Core(zero::core::Error::Hazard(_))) => {}
            Err(e) => panic!("{what} rank {rank}: not a hazard: {e}"),
        }
    }
}

/// Stage 3 with the frozen base gathered apart (`frozen_params` `shard`
/// and `offload`): the device trainer reads it where its all-gather
/// landed, so leaving out the compute stream's wait for that gather
/// ([`SkipWait::FrozenBeforeRead`]) is a hazard the checker names, in
/// Checked mode and under Chaos, with and without parameter offload.
#[test]
fn reading_the_frozen_base_before_its_gather_is_a_hazard() {
    let skip = Some(SkipWait::FrozenBeforeRead);
    for (frozen, param) in [
        (FrozenParams::Shard, OffloadDevice::None),
        (FrozenParams::Shard, OffloadDevice::Cpu),
        (FrozenParams::Offload, OffloadDevice::Cpu),
    ] {
        for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 5 }] {
            let r = Run {
                stage: 3,
                frozen,
                param,
                ..BASE
            };
            assert_hazards(
                run_with(r, Trainer::Device(mode, true), skip),
                &format!("{frozen:?} param {param:?} {mode:?}"),
            );
        }
    }
}
