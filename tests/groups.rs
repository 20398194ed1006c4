//! Parameter groups: a learning-rate scale and a weight decay per group of
//! tensors (`EngineBuilder::param_group`).
//!
//! - a group is its own config: every tensor in a group with weight decay
//!   w and learning-rate scale s trains bit for bit as a run whose config
//!   has w and the learning rate times s;
//! - groups split units (a layer's `bias` in one group, its `weight` in
//!   another) and give the same bits at every stage and offload mode;
//! - a learning rate of 0 leaves a group's tensors exactly as they were;
//! - ranks that add different groups fail together, naming the cause.

use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::bf16;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::optim::LrSchedule;
use zero::{is_bias_norm_or_embedding, EngineBuilder, Error, ParamGroup};
use zero_testkit::runs::*;
use zero_testkit::temp::TempDir;

const STEPS: usize = 3;

fn run(
    world: usize,
    cfg: &ResolvedConfig,
    setup: fn(EngineBuilder<ThreadComm>) -> EngineBuilder<ThreadComm>,
) -> Trained {
    let mut all = ThreadGroup::run(world, |comm| match cfg.precision {
        Precision::Bf16 => {
            train_setup::<bf16, _>(TestDevice::default(), comm, cfg, STEPS, MB, setup)
        }
        _ => train_setup::<f32, _>(TestDevice::default(), comm, cfg, STEPS, MB, setup),
    })
    .expect("ranks ran")
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("training failed: {e}")))
    .collect::<Vec<_>>();
    all.swap_remove(0)
}

/// Biases without decay, layer 1 at half the learning rate with its own
/// decay.
fn two_groups(b: EngineBuilder<ThreadComm>) -> EngineBuilder<ThreadComm> {
    b.no_decay_on_biases_norms_and_embeddings().param_group(
        ParamGroup {
            name: "layer1".into(),
            lr_scale: 0.5,
            weight_decay: Some(0.3),
        },
        |unit, _| unit == "layer1",
    )
}

#[test]
fn a_group_is_its_own_config() {
    let world = 2;
    for stage in [0u8, 3] {
        let mut base = config(world, stage, 1, Precision::Fp32);
        base.optimizer.weight_decay = 0.25;
        // Every tensor in one group: weight decay 0.25, half the rate.
        let grouped = run(world, &config(world, stage, 1, Precision::Fp32), |b| {
            b.param_group(
                ParamGroup {
                    name: "all".into(),
                    lr_scale: 0.5,
                    weight_decay: Some(0.25),
                },
                |_, _| true,
            )
        });
        base.optimizer.lr = 5e-3;
        base.scheduler = LrSchedule::Constant { lr: 5e-3 };
        let plain = run(world, &base, |b| b);
        assert_bits_eq(&plain.states, &grouped.states, &format!("stage {stage}"));
    }
}

#[test]
fn groups_split_units_and_are_bit_identical_across_stages_and_offload() {
    let world = 2;
    let dir = TempDir::new("groups-test");
    let base = run(world, &config(world, 0, 2, Precision::Bf16), two_groups);
    // The groups changed the result (else this test could not fail).
    let ungrouped = run(world, &config(world, 0, 2, Precision::Bf16), |b| b);
    assert_ne!(bits(&base.states[1]), bits(&ungrouped.states[1]));
    for stage in 0..=3u8 {
        for offload in [OffloadDevice::None, OffloadDevice::Cpu, OffloadDevice::Nvme] {
            let mut c = config(world, stage, 2, Precision::Bf16);
            c.zero.offload_optimizer.device = offload;
            // Tiles cut across units and tensors.
            c.zero.sub_group_size = 97;
            if offload == OffloadDevice::Nvme {
                c.zero.offload_optimizer.nvme_path = Some(dir.to_path_buf());
                c.zero.aio.block_size = 4096;
            }
            let t = run(world, &c, two_groups);
            assert_same_run(&base, &t, &format!("stage {stage} offload {offload:?}"));
        }
    }
    let mut c = config(world, 3, 2, Precision::Bf16);
    c.zero.offload_param.device = OffloadDevice::Cpu;
    let t = run(world, &c, two_groups);
    assert_same_run(&base, &t, "stage 3 offload_param cpu");
}

#[test]
fn a_group_at_learning_rate_zero_is_left_as_it_was() {
    let world = 2;
    let cfg = config(world, 2, 1, Precision::Fp32);
    let frozen_biases = |b: EngineBuilder<ThreadComm>| {
        b.param_group(
            ParamGroup {
                name: "frozen".into(),
                lr_scale: 0.0,
                weight_decay: None,
            },
            |_, tensor| tensor == "bias",
        )
    };
    // The initial state (no step), and a run without groups.
    let start = {
        let mut all = ThreadGroup::run(world, |comm| {
            train_setup::<f32, _>(TestDevice::default(), comm, &cfg, 0, MB, |b| b)
        })
        .expect("ranks ran");
        all.swap_remove(0).expect("built")
    };
    let before = run(world, &cfg, |b| b);
    let after = run(world, &cfg, frozen_biases);
    for (u, (s0, s1)) in start.states.iter().zip(&after.states).enumerate() {
        // Each layer is `weight` then `bias` (DIMS[u + 1] outputs).
        let n_bias = DIMS[u + 1];
        let n = s0.params.len();
        assert_eq!(
            s0.params[n - n_bias..],
            s1.params[n - n_bias..],
            "layer{u} bias"
        );
        assert_ne!(
            s0.params[..n - n_bias],
            s1.params[..n - n_bias],
            "layer{u} weight"
        );
        assert_ne!(s1.params, before.states[u].params, "layer{u}");
    }
}

#[test]
fn ranks_with_different_groups_fail_together() {
    let cfg = config(2, 1, 1, Precision::Fp32);
    let out = ThreadGroup::run(2, |comm| {
        let rank = comm.rank();
        train_setup::<f32, _>(TestDevice::default(), comm, &cfg, 1, MB, |b| {
            if rank == 1 {
                b.no_decay_on_biases_norms_and_embeddings()
            } else {
                b
            }
        })
        .map(|_| ())
    })
    .expect("ranks ran");
    for (rank, r) in out.into_iter().enumerate() {
        let e = r.expect_err("different groups must fail");
        assert!(matches!(e, Error::Disagreement { .. }), "rank {rank}: {e}");
        assert!(
            e.to_string().contains("parameter groups"),
            "rank {rank}: {e}"
        );
    }
    assert!(is_bias_norm_or_embedding("layer0", "bias"));
    assert!(is_bias_norm_or_embedding("model.norm", "weight"));
    assert!(is_bias_norm_or_embedding("model.embed_tokens", "weight"));
    assert!(!is_bias_norm_or_embedding(
        "model.layers.0.mlp",
        "up_proj.weight"
    ));
}
