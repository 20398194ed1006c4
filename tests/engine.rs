//! The engine across stages on the threads backend: bit-exact equivalence
//! of all stages at each world size, agreement with a single-rank run on the
//! full batch, the memory formulas of ZeRO, stage-3 prefetch limits, and
//! misuse errors.

use zero::comm::{Communicator, ThreadGroup};
use zero::core::backend::{CpuBackend, CpuMode};
use zero::core::config::{Precision, ResolvedConfig};
use zero::core::memory::{Category, Tier};
use zero::core::partition::{TensorSpec, UnitSpec};
use zero::core::{bf16, DType};
use zero::engine::SkipWait;
use zero::{Engine, Error, Init, UnitState};
use zero_testkit::mlp::{batch, Mlp};
use zero_testkit::runs::*;

// Stages 0–3 end bit-identical at each world size 1–4, for gradient
// accumulation 1 and 3, in fp32, bf16 and fp16 (with overflow skips), on
// every backend present (the checked CPU backend proves the gradient
// path's order on every configuration), and the same on every backend.
zero_testkit::test_device!(all_stages_are_bit_identical, |device| {
    let steps = 6;
    for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        for ga in [1, 3] {
            for world in 1..=4 {
                let train = |w, c: &ResolvedConfig, s, mb| train_device(device, w, c, s, mb);
                let base = train(world, &config(world, 0, ga, precision), steps, MB);
                let inline = train_device(
                    TestDevice::default(),
                    world,
                    &config(world, 0, ga, precision),
                    steps,
                    MB,
                );
                assert_same_run(&inline, &base, &format!("{device:?} vs inline"));
                assert_eq!(base.outcomes.len(), steps);
                if precision == Precision::Fp16 {
                    let skipped = base.outcomes.iter().filter(|o| o.skipped).count();
                    assert!(
                        (1..steps - 2).contains(&skipped),
                        "fp16: {skipped} of {steps} steps skipped"
                    );
                }
                for stage in 1..=3u8 {
                    let t = train(world, &config(world, stage, ga, precision), steps, MB);
                    let what = format!("{precision:?} ga {ga} world {world}: stage 0 vs {stage}");
                    assert_same_run(&base, &t, &what);
                }
            }
        }
    }
});

/// Stage 3's prefetch, persistence, reuse and live-parameter settings (and
/// overlap off, and bf16 accumulation) change when collectives run, never
/// the result.
#[test]
fn stage3_settings_do_not_change_results() {
    let world = 3;
    let base = train(world, &config(world, 0, 2, Precision::Bf16), 5, MB);
    type Tweak = Box<dyn Fn(&mut ResolvedConfig)>;
    let variants: Vec<(&str, Tweak)> = vec![
        ("no prefetch", Box::new(|c| c.zero.prefetch_bucket_size = 0)),
        (
            "all persistent",
            Box::new(|c| c.zero.param_persistence_threshold = 1 << 30),
        ),
        (
            "some persistent",
            Box::new(|c| c.zero.param_persistence_threshold = 100),
        ),
        (
            "tight live cap",
            Box::new(|c| c.zero.max_live_parameters = 2000),
        ),
        ("no reuse", Box::new(|c| c.zero.max_reuse_distance = 0)),
        ("overlap off", Box::new(|c| c.zero.overlap_comm = false)),
        (
            "one big bucket",
            Box::new(|c| c.zero.reduce_bucket_size = 1 << 30),
        ),
    ];
    for (name, f) in &variants {
        let mut c = config(world, 3, 2, Precision::Bf16);
        f(&mut c);
        let t = train(world, &c, 5, MB);
        assert_bits_eq(&base.states, &t.states, name);
    }
}

/// `overlap_comm` at stages 1 and 2: the all-gather of the updated
/// parameters starts in `step` and each unit's part is waited for in the
/// next `gather` (bucketed by `allgather_bucket_size`: one unit at a time,
/// a few, or all at once). The results equal stage 0's bit for bit, also
/// with gradient accumulation, fp16 loss scaling (skipped steps start no
/// gathers) and full-state reads (`unit_state`) between steps.
#[test]
fn stages_1_2_overlap_comm_does_not_change_results() {
    let world = 2;
    for (precision, ga) in [
        (Precision::Bf16, 1),
        (Precision::Bf16, 2),
        (Precision::Fp16, 1),
    ] {
        let steps = if precision == Precision::Fp16 { 12 } else { 5 };
        let base = train(world, &config(world, 0, ga, precision), steps, MB);
        for stage in [1u8, 2] {
            for ag in [1usize, 900, 1 << 30] {
                let mut c = config(world, stage, ga, precision);
                c.zero.overlap_comm = true;
                c.zero.allgather_bucket_size = ag;
                let t = train(world, &c, steps, MB);
                let what = format!(
                    "{precision:?} ga {ga}: stage 0 vs {stage} with overlap_comm, \
                     allgather_bucket_size {ag}"
                );
                assert_same_run(&base, &t, &what);
            }
        }
    }
    // Reading the full state between steps (an evaluation) finishes the
    // pending all-gathers first: the same states and predictions as stage 0.
    let run = |stage: u8| {
        ThreadGroup::run(world, |comm| {
            let rank = comm.rank();
            let mut c = config(world, stage, 1, Precision::Bf16);
            c.zero.overlap_comm = true;
            let mut b = Engine::builder(c, comm).seed(3);
            let model = Mlp::register(&mut b, DIMS).unwrap();
            let mut e = b.build().unwrap();
            let mut seen = Vec::new();
            for s in 0..4 {
                let (x, y) = batch(((s * world + rank) * MB) as u64, MB, DIMS[0]);
                model
                    .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                    .unwrap();
                e.step().unwrap();
                let first = e.unit_ids()[0];
                seen.push(e.unit_state(first).unwrap());
                seen.push(UnitState {
                    params: model.predict::<bf16, _, _>(&mut e, &x).unwrap(),
                    master: Vec::new(),
                    m: Vec::new(),
                    v: Vec::new(),
                });
            }
            seen
        })
        .unwrap()
    };
    let base = run(0);
    for stage in [1u8, 2] {
        let t = run(stage);
        for r in 0..world {
            assert_bits_eq(
                &base[r],
                &t[r],
                &format!("stage {stage}: reads between steps"),
            );
        }
    }
}

/// A later step gathers in another order than the first (an evaluation
/// pass before each training micro-batch): stage 3 warns, naming the unit,
/// stops prefetching for that micro-batch, and the results stay those of
/// stage 0 making the same calls.
#[test]
fn stage3_gather_order_change_is_safe() {
    let world = 2;
    let run = |stage: u8| {
        ThreadGroup::run(world, |comm| {
            let rank = comm.rank();
            let mut b = Engine::builder(config(world, stage, 1, Precision::Bf16), comm).seed(3);
            let model = Mlp::register(&mut b, DIMS).unwrap();
            let mut e = b.build().unwrap();
            let mut preds = Vec::new();
            for s in 0..4 {
                let (x, y) = batch(((s * world + rank) * MB) as u64, MB, DIMS[0]);
                if s > 0 {
                    preds.extend(model.predict::<bf16, _, _>(&mut e, &x).unwrap());
                }
                model
                    .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                    .unwrap();
                e.step().unwrap();
            }
            let states: Vec<UnitState> = e
                .unit_ids()
                .into_iter()
                .map(|u| e.unit_state(u).unwrap())
                .collect();
            (states, preds, e.warnings().to_vec())
        })
        .unwrap()
    };
    let base = run(0);
    let s3 = run(3);
    for r in 0..world {
        assert_bits_eq(&base[r].0, &s3[r].0, "stage 0 vs 3 with an order change");
        assert_eq!(base[r].1, s3[r].1);
        assert!(base[r].2.is_empty());
        let w = s3[r].2.join("\n");
        assert!(
            w.contains("gather(`layer0`)") && w.contains("expected `layer2`"),
            "{w}"
        );
    }
}

/// N ranks on micro-batches of `MB` equal one rank on the full batch
/// (`N·MB` samples) up to fp32 rounding. The two sum the same gradient
/// terms in different orders (per-rank means, then the rank sum, against
/// one mean), so gradients differ by a few ulps; AdamW divides by
/// sqrt(v), which keeps relative errors at that size, so after 6 steps of
/// lr 1e-2 the fp32 master weights (|w| < 1) agree to 2e-6 absolute, about
/// 16 ulps (measured: 6e-8 on 2 ranks, 1.2e-7 on 4).
#[test]
fn matches_a_single_rank_on_the_full_batch() {
    for world in [2, 4] {
        for stage in [0u8, 2, 3] {
            let t = train(world, &config(world, stage, 1, Precision::Fp32), 6, MB);
            let one = train(1, &config(1, stage, 1, Precision::Fp32), 6, MB * world);
            let mut worst = 0f32;
            for (a, b) in t.states.iter().zip(&one.states) {
                for (x, y) in a.master.iter().zip(&b.master) {
                    worst = worst.max((x - y).abs());
                }
            }
            assert!(worst < 2e-6, "world {world} stage {stage}: max |Δ| {worst}");
            // And training works: the loss went down.
            assert!(one.losses.last() < one.losses.first());
        }
    }
}

fn padded_model_states(world: usize, stage: u8) -> (u64, u64) {
    let out = ThreadGroup::run(world, |comm| {
        let mut c = config(world, stage, 1, Precision::Bf16);
        c.grad_accum_dtype = DType::BF16;
        let mut b = Engine::builder(c, comm);
        Mlp::register(&mut b, DIMS).unwrap();
        let e = b.build().unwrap();
        let psi = e.plan().padded_numel() as u64;
        (psi, e.tracker().model_states(Tier::Device))
    })
    .unwrap();
    out[0]
}

/// Model-state bytes per rank are ZeRO's: 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N
/// (bf16 params and gradients, fp32 master, m, v; Ψ counted with the
/// partition padding).
#[test]
fn model_states_follow_the_zero_formulas() {
    for world in [1, 2, 4] {
        for stage in 0..=3u8 {
            let (psi, got) = padded_model_states(world, stage);
            let n = world as u64;
            let want = match stage {
                0 => 16 * psi,
                1 => 4 * psi + 12 * psi / n,
                2 => 2 * psi + 14 * psi / n,
                _ => 16 * psi / n,
            };
            assert_eq!(got, want, "world {world} stage {stage}");
        }
    }
}

/// With gradient accumulation or fp32 accumulation, stages 0 and 1 keep an
/// accumulation buffer too, and 2/3 keep their shard in fp32.
#[test]
fn fp32_accumulation_memory() {
    let world = 2;
    let out = ThreadGroup::run(world, |comm| {
        let c = config(world, 2, 1, Precision::Bf16); // grad_accum_dtype f32
        let mut b = Engine::builder(c, comm);
        Mlp::register(&mut b, DIMS).unwrap();
        let e = b.build().unwrap();
        let psi = e.plan().padded_numel() as u64;
        (
            psi,
            e.tracker().current(Tier::Device, Category::Grads),
            e.tracker().model_states(Tier::Device),
        )
    })
    .unwrap();
    let (psi, grads, states) = out[0];
    assert_eq!(grads, 4 * psi / 2);
    assert_eq!(states, 2 * psi + 16 * psi / 2);
}

/// Stage 3 never holds more gathered elements than
/// `stage3_max_live_parameters`, and prefetches when allowed.
#[test]
fn stage3_respects_the_live_parameter_cap() {
    let world = 2;
    let out = ThreadGroup::run(world, |comm| {
        let mut c = config(world, 3, 1, Precision::Bf16);
        // Layer sizes (padded): 192, 1024, 64 elements; room for two.
        c.zero.max_live_parameters = 1300;
        c.zero.prefetch_bucket_size = 1 << 20;
        let mut b = Engine::builder(c, comm);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        for s in 0..4 {
            let (x, y) = batch((s * world) as u64 * 8, MB, DIMS[0]);
            model
                .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                .unwrap();
            e.step().unwrap();
        }
        e.stats().clone()
    })
    .unwrap();
    for s in out {
        assert!(s.peak_live_elems <= 1300, "peak {}", s.peak_live_elems);
        assert!(s.prefetches > 0, "no prefetch happened: {s:?}");
        assert!(s.prefetch_hits > 0, "no prefetch was used: {s:?}");
    }
}

// ---------------------------------------------------------------------------
// Misuse

fn misuse(
    world: usize,
    f: impl Fn(&mut Engine<zero::comm::ThreadComm>, &Mlp) -> Error + Sync,
) -> Vec<String> {
    ThreadGroup::run(world, |comm| {
        let c = config(world, 3, 1, Precision::Fp32);
        let mut b = Engine::builder(c, comm);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        f(&mut e, &model).to_string()
    })
    .unwrap()
}

#[test]
fn grad_buffer_after_grad_ready_is_an_error() {
    // grad_ready consumes the buffer, so a second grad_ready for the same
    // micro-batch cannot be written; asking for the buffer again is refused.
    let msgs = misuse(2, |e, m| {
        let u = m.units[0];
        let g = e.grad_buffer::<f32>(u).unwrap();
        e.grad_ready(u, g).unwrap();
        e.grad_buffer::<f32>(u).unwrap_err()
    });
    for m in msgs {
        assert!(m.contains("grad_ready was already called"), "{m}");
    }
}

#[test]
fn grad_ready_with_another_units_buffer_is_an_error() {
    let msgs = misuse(1, |e, m| {
        let (a, b) = (m.units[0], m.units[1]);
        let g = e.grad_buffer::<f32>(b).unwrap();
        e.grad_ready(a, g).unwrap_err()
    });
    assert!(
        msgs[0].contains("grad_ready(`layer0`): the buffer is unit `layer1`'s"),
        "{}",
        msgs[0]
    );
}

#[test]
fn grad_ready_with_another_engines_buffer_is_an_error() {
    let msgs = misuse(1, |e, m| {
        // Unit #0 of another engine, of another size.
        let foreign = ThreadGroup::run(1, |comm| {
            let mut b = Engine::builder(config(1, 3, 1, Precision::Fp32), comm);
            let x = b
                .register(
                    UnitSpec::new("x", vec![TensorSpec::new("w", &[3])]),
                    vec![Init::Zeros],
                )
                .unwrap();
            let mut other = b.build().unwrap();
            other.grad_buffer::<f32>(x).unwrap()
        })
        .unwrap()
        .pop()
        .unwrap();
        e.grad_ready(m.units[0], foreign).unwrap_err()
    });
    assert!(
        msgs[0].contains("grad_ready(`layer0`): expected the 192-element f32 buffer")
            && msgs[0].contains("got 32 elements"),
        "{}",
        msgs[0]
    );
}

#[test]
fn unknown_unit_is_an_error() {
    let msgs = misuse(1, |e, _| {
        // A unit of another engine.
        let other = ThreadGroup::run(1, |comm| {
            let mut b = Engine::builder(config(1, 3, 1, Precision::Fp32), comm);
            b.register(
                UnitSpec::new("x", vec![TensorSpec::new("w", &[3])]),
                vec![Init::Zeros],
            )
            .unwrap()
        })
        .unwrap()[0];
        e.gather(other).unwrap_err()
    });
    assert!(msgs[0].contains("gather: unknown unit"), "{}", msgs[0]);
}

#[test]
fn step_with_a_gathered_unit_or_an_outstanding_gradient_is_an_error() {
    let msgs = misuse(2, |e, m| {
        let p = e.gather(m.units[1]).unwrap();
        let err = e.step().unwrap_err();
        drop(p);
        assert!(
            err.to_string().contains("unit `layer1` is still gathered"),
            "{err}"
        );
        let _g = e.grad_buffer::<f32>(m.units[2]).unwrap();
        e.step().unwrap_err()
    });
    for m in msgs {
        assert!(
            m.contains("gradient buffer of unit `layer2` is still out"),
            "{m}"
        );
    }
}

#[test]
fn params_in_the_wrong_dtype_or_tensor_are_errors() {
    let msgs = misuse(2, |e, m| {
        let p = e.gather(m.units[0]).unwrap();
        let err = p.param::<f32>("gamma").unwrap_err();
        assert!(
            err.to_string()
                .contains("param(`layer0`, `gamma`): no such tensor"),
            "{err}"
        );
        p.params::<bf16>().unwrap_err()
    });
    for m in msgs {
        assert!(m.contains("dtype mismatch"), "{m}");
    }
}

/// A guard releases its unit when it drops, wherever that happens: the
/// trainer may hold several units at once, keep one while it writes the
/// unit's gradient, and the guards outliving the engine is harmless.
#[test]
fn unit_guards_release_on_drop() {
    for stage in 0..=3u8 {
        let out = ThreadGroup::run(2, |comm| {
            let mut b = Engine::builder(config(2, stage, 1, Precision::Fp32), comm).seed(5);
            let model = Mlp::register(&mut b, DIMS).unwrap();
            let mut e = b.build().unwrap();
            let (a, c) = (model.units[0], model.units[2]);
            let pa = e.gather(a).unwrap();
            let pc = e.gather(c).unwrap();
            let again = e.gather(a).unwrap();
            assert_eq!(pa.params::<f32>().unwrap(), again.params::<f32>().unwrap());
            drop((pa, again));
            // Parameters readable while the gradient is written.
            let mut g = e.grad_buffer::<f32>(c).unwrap();
            let w = pc.param::<f32>("weight").unwrap();
            g[..w.len()].copy_from_slice(w);
            let err = e.step().unwrap_err().to_string();
            assert!(err.contains("unit `layer2` is still gathered"), "{err}");
            e.grad_ready(c, g).unwrap();
            let err = e.step().unwrap_err().to_string();
            assert!(err.contains("unit `layer2` is still gathered"), "{err}");
            let kept = e.gather(model.units[1]).unwrap();
            drop(pc);
            drop(e);
            // The engine is gone; the guard's parameters are still valid.
            kept.params::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<u32>>()
        })
        .unwrap();
        assert_eq!(out[0], out[1], "stage {stage}");
    }
}

/// Evaluation mode: forward passes in any order neither warn nor change
/// the stage-3 gather order or the training results; training calls are
/// refused until train().
#[test]
fn evaluation_mode_leaves_training_alone() {
    let world = 2;
    let cfg = config(world, 3, 1, Precision::Fp32);
    let base = train(world, &cfg, 4, MB);
    let out = ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(cfg.clone(), comm).seed(5);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        for s in 0..4 {
            let first = ((s * world + rank) * MB) as u64;
            let (x, y) = batch(first, MB, DIMS[0]);
            model
                .train_micro_batch::<f32, _, _>(&mut e, &x, &y)
                .unwrap();
            e.step().unwrap();
            e.eval().unwrap();
            assert!(!e.is_training());
            // Evaluate back to front: another order than training's.
            for &u in model.units.iter().rev() {
                drop(e.gather(u).unwrap());
            }
            model.predict::<f32, _, _>(&mut e, &x).unwrap();
            let err = e
                .grad_buffer::<f32>(model.units[0])
                .unwrap_err()
                .to_string();
            assert!(err.contains("evaluation mode"), "{err}");
            assert!(e
                .step()
                .unwrap_err()
                .to_string()
                .contains("evaluation mode"));
            let p = e.gather(model.units[0]).unwrap();
            let err = e.train().unwrap_err().to_string();
            assert!(err.contains("unit `layer0` is still gathered"), "{err}");
            drop(p);
            e.train().unwrap();
        }
        assert!(e.warnings().is_empty(), "{:?}", e.warnings());
        assert_eq!(e.stats().gather_order_changes, 0);
        e.unit_ids()
            .into_iter()
            .map(|u| e.unit_state(u).unwrap())
            .collect::<Vec<_>>()
    })
    .unwrap();
    assert_bits_eq(&base.states, &out[0], "with evaluations between steps");
}

#[test]
fn units_registered_on_some_ranks_only_are_an_error() {
    let out = ThreadGroup::run(3, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(config(3, 2, 1, Precision::Fp32), comm);
        Mlp::register(&mut b, DIMS).unwrap();
        if rank == 1 {
            b.register(
                UnitSpec::new("extra", vec![TensorSpec::new("w", &[5])]),
                vec![Init::Zeros],
            )
            .unwrap();
        }
        b.build().map(|_| ()).unwrap_err().to_string()
    })
    .unwrap();
    for m in &out {
        assert!(m.contains("unit #3"), "{m}");
        assert!(m.contains("rank 1"), "{m}");
    }
    let out = ThreadGroup::run(2, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(config(2, 1, 1, Precision::Fp32), comm);
        let dims: &[usize] = if rank == 0 { &[6, 24, 1] } else { &[6, 25, 1] };
        Mlp::register(&mut b, dims).unwrap();
        b.build().map(|_| ()).unwrap_err().to_string()
    })
    .unwrap();
    for m in &out {
        assert!(m.contains("unit #0") && m.contains("`layer0`"), "{m}");
    }
}

#[test]
fn bad_registration_and_config_are_errors() {
    ThreadGroup::run(2, |comm| {
        let mut b = Engine::builder(config(3, 2, 1, Precision::Fp32), comm);
        let err = b
            .register(
                UnitSpec::new("a", vec![TensorSpec::new("w", &[2, 2])]),
                vec![Init::Zeros, Init::Ones],
            )
            .unwrap_err();
        assert!(
            err.to_string().contains("2 initialisers for 1 tensors"),
            "{err}"
        );
        b.register(
            UnitSpec::new("a", vec![TensorSpec::new("w", &[4])]),
            vec![Init::Zeros],
        )
        .unwrap();
        let err = b
            .register(
                UnitSpec::new("a", vec![TensorSpec::new("w", &[4])]),
                vec![Init::Zeros],
            )
            .unwrap_err();
        assert!(err.to_string().contains("already registered"), "{err}");
        let err = b.build().map(|_| ()).unwrap_err();
        assert!(err.to_string().contains("world_size 3"), "{err}");
    })
    .unwrap();
}

/// Ranks must start from the same model: `Init::Values` that differ
/// between ranks (a per-thread RNG), or different initialisers, are refused
/// at `build` on every rank with the same error naming the first tensor
/// that differs and the ranks; equal values build.
#[test]
fn ranks_with_different_initial_values_refuse_to_train() {
    let build = |inits: fn(usize) -> Vec<Init>| {
        ThreadGroup::run(3, move |comm| {
            let cfg = config(3, 0, 1, Precision::Fp32);
            let rank = comm.rank();
            let mut b = Engine::builder(cfg, comm);
            b.register(
                UnitSpec::new("first", vec![TensorSpec::new("w", &[4])]),
                vec![Init::Values(vec![1.0; 4].into())],
            )
            .unwrap();
            b.register(
                UnitSpec::new(
                    "second",
                    vec![TensorSpec::new("a", &[4]), TensorSpec::new("b", &[3])],
                ),
                inits(rank),
            )
            .unwrap();
            b.build().map(|_| ()).map_err(|e| e.to_string())
        })
        .unwrap()
    };
    // Rank 2 draws other values for `b`.
    let out = build(|rank| {
        let b: Vec<f32> = (0..3).map(|k| (k * (1 + rank / 2)) as f32).collect();
        vec![Init::normal(0.1), Init::Values(b.into())]
    });
    for (r, res) in out.into_iter().enumerate() {
        let e = res.unwrap_err();
        assert!(
            e.starts_with(&format!(
                "rank {r}: the ranks disagree: the initial values of tensor \
                                    `b` of unit `second` differ: rank 0 and rank 2"
            )) && e.contains("Init::Values"),
            "{e}"
        );
    }
    // Another initialiser on rank 1.
    let out = build(|rank| vec![Init::normal(0.1 + rank as f32), Init::Zeros]);
    for res in out {
        let e = res.unwrap_err();
        assert!(
            e.contains("tensor `a` of unit `second` differ: rank 0 and rank 1"),
            "{e}"
        );
    }
    // The same values everywhere build.
    for res in build(|_| vec![Init::normal(0.1), Init::Values(vec![0.5; 3].into())]) {
        res.unwrap();
    }
}

/// The config's warnings (from its JSON, here an unknown key kept by
/// `"strict": false` and a DeepSpeed key zero does not use) reach the
/// engine's log, each once, on every rank.
#[test]
fn config_warnings_reach_the_engine_log_once() {
    use zero::core::config::{AutoValues, DeepSpeedConfig};
    let json = r#"{ "strict": false, "train_micro_batch_size_per_gpu": 4,
                    "zero_optimization": { "stage": 2, "stage3_prefetch_bucket_sise": 1,
                                           "zero_quantized_weights": false } }"#;
    let (doc, warnings) = DeepSpeedConfig::from_json_str(json).unwrap();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    let auto = AutoValues {
        world_size: 2,
        ..AutoValues::default()
    };
    let cfg = doc.resolve(&auto).unwrap();
    let logs = ThreadGroup::run(2, |comm| {
        let mut b = Engine::builder(cfg.clone(), comm);
        Mlp::register(&mut b, DIMS).unwrap();
        b.build().unwrap().warnings().to_vec()
    })
    .unwrap();
    for log in logs {
        for w in &warnings {
            let n = log.iter().filter(|l| **l == format!("config: {w}")).count();
            assert_eq!(n, 1, "`{w}` in {log:?}");
        }
    }
}

// ---------------------------------------------------------------------------
// Error paths of a micro-batch

/// Trains `steps` steps on 2 ranks; with `fail_at = Some(s)`, step `s` is
/// preceded by a micro-batch that fails half way through its backward
/// pass: the last layer's gradient is handed back (at stages 0, 2 and 3
/// its bucket may be reducing already), the next layer's buffer is dropped
/// on the way out (the trainer's `?`), `step()` refuses it naming the
/// units without a gradient, and `zero_grad()` starts over. Returns rank
/// 0's final states.
fn train_with_failed_micro_batch(
    stage: u8,
    fail_at: Option<usize>,
    mode: CpuMode,
) -> Vec<UnitState> {
    let world = 2;
    let cfg = config(world, stage, 1, Precision::Fp32);
    ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(cfg.clone(), comm)
            .seed(5)
            .backend(CpuBackend::new(mode).unwrap());
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        for s in 0..4 {
            if fail_at == Some(s) {
                let n = model.units.len();
                let (last, prev) = (model.units[n - 1], model.units[n - 2]);
                let g = e.grad_buffer::<f32>(last).unwrap();
                e.grad_ready(last, g).unwrap();
                let dropped = e.grad_buffer::<f32>(prev).unwrap();
                drop(dropped);
                let err = e.step().unwrap_err().to_string();
                assert!(
                    err.contains("no gradient for unit `layer0`")
                        && err.contains("layer0, layer1")
                        && err.contains("zero_grad"),
                    "{err}"
                );
                // The dropped buffer came home: it can be lent again, and
                // then step() refuses it as still out.
                let again = e.grad_buffer::<f32>(prev).unwrap();
                let err = e.step().unwrap_err().to_string();
                assert!(
                    err.contains("gradient buffer of unit `layer1` is still out"),
                    "{err}"
                );
                drop(again);
                e.zero_grad().unwrap();
            }
            let first = ((s * world + rank) * MB) as u64;
            let (x, y) = batch(first, MB, DIMS[0]);
            model
                .train_micro_batch::<f32, _, _>(&mut e, &x, &y)
                .unwrap();
            e.step().unwrap();
        }
        e.unit_ids()
            .into_iter()
            .map(|u| e.unit_state(u).unwrap())
            .collect::<Vec<_>>()
    })
    .unwrap()
    .swap_remove(0)
}

/// A gradient buffer dropped on an error path does not wedge the engine:
/// step() names the units without a gradient, zero_grad() drops the
/// micro-batch (waiting for the reductions already in flight), and the
/// run then continues exactly as one that never had the failed
/// micro-batch. On a checked backend too: the reducer's abort and zeroing
/// paths order (and sync) everything they touch.
#[test]
fn a_dropped_gradient_buffer_is_recovered_by_zero_grad() {
    for stage in 0..=3u8 {
        let clean = train_with_failed_micro_batch(stage, None, CpuMode::Inline);
        for mode in [
            CpuMode::Inline,
            CpuMode::Checked,
            CpuMode::Chaos { seed: 1 },
        ] {
            for fail_at in [0, 2] {
                let t = train_with_failed_micro_batch(stage, Some(fail_at), mode);
                assert_bits_eq(
                    &clean,
                    &t,
                    &format!("stage {stage} {mode:?}, failure before step {fail_at}"),
                );
            }
        }
    }
}

/// Trains 3 steps on 2 ranks; with `fail`, the micro-batch of step 1 is
/// first tried and fails after the last layer's `grad_ready` (the trainer's
/// `?` leaves the backward pass), and the trainer simply runs the
/// micro-batch again: that retry fails naming `zero_grad()` (the unit's
/// gradient is already in), `zero_grad()` drops the failed micro-batch and
/// the retry then trains. Returns rank 0's final states.
fn train_with_retried_micro_batch(stage: u8, fail: bool) -> Vec<UnitState> {
    let world = 2;
    let cfg = config(world, stage, 1, Precision::Fp32);
    ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(cfg.clone(), comm).seed(5);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        for s in 0..3 {
            let first = ((s * world + rank) * MB) as u64;
            let (x, y) = batch(first, MB, DIMS[0]);
            if fail && s == 1 {
                let last = *model.units.last().unwrap();
                let g = e.grad_buffer::<f32>(last).unwrap();
                e.grad_ready(last, g).unwrap();
                let err = model
                    .train_micro_batch::<f32, _, _>(&mut e, &x, &y)
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.contains("grad_ready was already called for this unit")
                        && err.contains("call zero_grad() on every rank"),
                    "{err}"
                );
                e.zero_grad().unwrap();
            }
            model
                .train_micro_batch::<f32, _, _>(&mut e, &x, &y)
                .unwrap();
            e.step().unwrap();
        }
        e.unit_ids()
            .into_iter()
            .map(|u| e.unit_state(u).unwrap())
            .collect::<Vec<_>>()
    })
    .unwrap()
    .swap_remove(0)
}

/// A micro-batch that fails after some units handed their gradients back
/// leaves the engine waiting for the rest: the next micro-batch's first
/// gradient call names `zero_grad()` as the way out, and after it the run
/// goes on bit for bit as one that never failed, at every stage.
#[test]
fn a_micro_batch_failed_after_grad_ready_recovers_with_zero_grad() {
    for stage in 0..=3u8 {
        let clean = train_with_retried_micro_batch(stage, false);
        let recovered = train_with_retried_micro_batch(stage, true);
        assert_bits_eq(&clean, &recovered, &format!("stage {stage}"));
    }
}

/// A rank that fails a micro-batch, drops it with `zero_grad()` and goes
/// on alone pairs its next micro-batch's reductions with the other ranks'
/// current one: the next optimizer step is refused on every rank with the
/// same error naming that rank and both micro-batch counts (the update is
/// not applied, so the parameters stay those of the step before), and so
/// is every later one. At every stage.
#[test]
fn a_rank_that_goes_on_alone_after_a_failure_is_refused_on_every_rank() {
    for stage in 0..=3u8 {
        let world = 2;
        let cfg = config(world, stage, 1, Precision::Fp32);
        let out = ThreadGroup::run(world, |comm| {
            let rank = comm.rank();
            let mut b = Engine::builder(cfg.clone(), comm).seed(5);
            let model = Mlp::register(&mut b, DIMS).unwrap();
            let mut e = b.build().unwrap();
            let mut errors = Vec::new();
            let mut before = Vec::new();
            for s in 0..4 {
                if rank == 1 && s == 1 {
                    // Its micro-batch fails before any collective (a
                    // stage-3 gather would meet rank 0's reduction and fail
                    // as a mismatched collective); it drops the micro-batch
                    // and goes on with the next one.
                    e.zero_grad().unwrap();
                }
                if s == 1 {
                    before = e
                        .unit_ids()
                        .into_iter()
                        .map(|u| e.unit_params(u).unwrap())
                        .collect();
                }
                let first = ((s * world + rank) * MB) as u64;
                let (x, y) = batch(first, MB, DIMS[0]);
                model
                    .train_micro_batch::<f32, _, _>(&mut e, &x, &y)
                    .unwrap();
                match e.step() {
                    Ok(_) => assert_eq!(s, 0, "stage {stage}: step {s} was taken"),
                    Err(err) => errors.push(err.to_string()),
                }
            }
            let after: Vec<Vec<f32>> = e
                .unit_ids()
                .into_iter()
                .map(|u| e.unit_params(u).unwrap())
                .collect();
            assert_eq!(
                before, after,
                "stage {stage}: a refused step changed parameters"
            );
            (errors, e.steps())
        })
        .unwrap();
        for (r, (errors, steps)) in out.into_iter().enumerate() {
            assert_eq!(steps, 1, "stage {stage} rank {r}");
            assert_eq!(errors.len(), 3, "stage {stage} rank {r}: {errors:?}");
            for (k, err) in errors.iter().enumerate() {
                let (theirs, ours) = (3 + k, 2 + k);
                assert!(
                    err.starts_with(&format!(
                        "rank {r}: the ranks disagree: step 2: rank 1 is at micro-batch {theirs} \
                         and rank 0 at micro-batch {ours}"
                    )) && err.contains("zero_grad() on every rank"),
                    "stage {stage} rank {r}: {err}"
                );
            }
        }
    }
}

/// A unit whose gradient never came back is an error at step(), not a
/// silent zero; zero_grad() with a buffer still out is refused too.
#[test]
fn a_missing_gradient_is_an_error() {
    let msgs = misuse(2, |e, m| {
        let u = m.units[0];
        let g = e.grad_buffer::<f32>(u).unwrap();
        let err = e.zero_grad().unwrap_err().to_string();
        assert!(
            err.contains("zero_grad() while the gradient buffer of unit `layer0`"),
            "{err}"
        );
        e.grad_ready(u, g).unwrap();
        e.step().unwrap_err()
    });
    for m in msgs {
        assert!(
            m.contains("no gradient for unit `layer1`") && m.contains("2 of 3 units"),
            "{m}"
        );
    }
}

/// Trains `steps` steps on `world` thread ranks, each rank on its own CPU
/// backend in `mode`, optionally with one wait of the gradient path left
/// out; every rank's final state, or its first error.
fn train_on_backend(
    world: usize,
    cfg: &ResolvedConfig,
    steps: usize,
    mode: CpuMode,
    skip: Option<SkipWait>,
) -> Vec<zero::Result<Vec<UnitState>>> {
    fn run<T: zero::core::Element>(
        comm: zero::comm::ThreadComm,
        cfg: &ResolvedConfig,
        steps: usize,
        mode: CpuMode,
        skip: Option<SkipWait>,
    ) -> zero::Result<Vec<UnitState>> {
        let (world, rank) = (comm.world_size(), comm.rank());
        let ga = cfg.gradient_accumulation_steps;
        let mut b = Engine::builder(cfg.clone(), comm)
            .seed(5)
            .backend(CpuBackend::new(mode)?);
        if let Some(s) = skip {
            b = b.skip_wait_for_tests(s);
        }
        let model = Mlp::register(&mut b, DIMS)?;
        let mut e = b.build()?;
        for s in 0..steps {
            for m in 0..ga {
                let first = (((s * ga + m) * world + rank) * MB) as u64;
                let (x, y) = batch(first, MB, DIMS[0]);
                model.train_micro_batch::<T, _, _>(&mut e, &x, &y)?;
                e.step()?;
            }
        }
        e.unit_ids().into_iter().map(|u| e.unit_state(u)).collect()
    }
    ThreadGroup::run(world, |comm| match cfg.precision {
        Precision::Fp32 => run::<f32>(comm, cfg, steps, mode, skip),
        Precision::Bf16 => run::<bf16>(comm, cfg, steps, mode, skip),
        Precision::Fp16 => run::<zero::core::f16>(comm, cfg, steps, mode, skip),
    })
    .expect("ranks ran")
}

fn checked_modes() -> Vec<CpuMode> {
    let mut modes = vec![CpuMode::Checked];
    modes.extend((1..=3).map(|seed| CpuMode::Chaos { seed }));
    modes
}

/// The gradient path runs over the engine's device backend: on a checked
/// CPU backend (the hazard checker on every access, and in Chaos mode real
/// stream threads with random delays) training at stages 0–3 is bit for
/// bit the inline run (fp32 with the persistent buffer as the home, bf16
/// with gradient accumulation into a separate home, and with the
/// optimizer offloaded to the CPU, whose AdamW reads the homes tile by
/// tile; and 3 ranks with buckets whose rank sections are moved down
/// over themselves before the reduce-scatter).
#[test]
fn the_gradient_path_is_ordered_on_a_checked_backend() {
    for (world, precision, ga, offload, bucket) in [
        (2, Precision::Fp32, 1, false, None),
        (2, Precision::Bf16, 2, false, None),
        (2, Precision::Bf16, 2, true, None),
        (3, Precision::Bf16, 1, false, Some(1200)),
    ] {
        for stage in 0..=3u8 {
            let mut cfg = config(world, stage, ga, precision);
            if let Some(b) = bucket {
                cfg.zero.reduce_bucket_size = b;
            }
            if offload {
                cfg.zero.offload_optimizer.device = zero::core::config::OffloadDevice::Cpu;
                cfg.zero.sub_group_size = 256;
            }
            let base = train_on_backend(world, &cfg, 3, CpuMode::Inline, None);
            let base = base[0].as_ref().expect("inline run");
            for mode in checked_modes() {
                for (rank, r) in train_on_backend(world, &cfg, 3, mode, None)
                    .into_iter()
                    .enumerate()
                {
                    let what = format!(
                        "world {world} {precision:?} ga {ga} offload {offload} bucket {bucket:?} \
                         stage {stage} {mode:?} rank {rank}"
                    );
                    let states = r.unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_bits_eq(base, &states, &what);
                }
            }
        }
    }
}

/// The checker is proven on the engine: with one wait of the gradient
/// path removed (the communication stream's wait for the packing of a
/// bucket, or the host's sync of the last unpack before the optimizer
/// reads the homes; `EngineBuilder::skip_wait_for_tests`) every run at
/// every stage fails with `Error::Hazard`
/// naming the buffer, both operations and both streams — in Checked mode
/// and on every Chaos seed, whatever the timing.
#[test]
fn a_removed_wait_of_the_gradient_path_is_a_hazard_on_every_run() {
    use zero::core::backend::{Agent, Stream};
    let world = 2;
    for stage in 0..=3u8 {
        let cfg = config(world, stage, 1, Precision::Fp32);
        for skip in [
            SkipWait::PackBeforeReduce,
            SkipWait::HomesBeforeOptimizer,
            SkipWait::ParamsBeforeGather,
        ] {
            if skip == SkipWait::ParamsBeforeGather && stage == 0 {
                continue; // stage 0 gathers no parameters
            }
            for mode in checked_modes() {
                for (rank, r) in train_on_backend(world, &cfg, 2, mode, Some(skip))
                    .into_iter()
                    .enumerate()
                {
                    let what = format!("stage {stage} {skip:?} {mode:?} rank {rank}");
                    let e = match r {
                        Ok(_) => panic!("{what}: trained without a hazard"),
                        Err(e) => e,
                    };
                    let msg = e.to_string();
                    let Error::Core(zero::core::Error::Hazard(h)) = &e else {
                        panic!("{what}: not a hazard: {msg}");
                    };
                    let agents = [h.agent.to_string(), h.other_agent.to_string()];
                    for part in [&h.buffer, h.op, h.other_op, &agents[0], &agents[1]] {
                        assert!(msg.contains(part), "{what}: {msg}");
                    }
                    match skip {
                        SkipWait::PackBeforeReduce => {
                            assert!(h.buffer.starts_with("bucket "), "{what}: {msg}");
                            assert!(
                                ["all_reduce", "reduce_scatter"].contains(&h.op),
                                "{what}: {msg}"
                            );
                            assert_eq!(h.agent, Agent::Stream(Stream::Comm), "{what}: {msg}");
                            assert!(
                                ["pack", "copy_within"].contains(&h.other_op),
                                "{what}: {msg}"
                            );
                            assert_eq!(h.other_agent, Agent::Stream(Stream::Compute), "{what}");
                        }
                        SkipWait::HomesBeforeOptimizer => {
                            assert!(
                                h.buffer.starts_with("grad") && h.buffer.contains("`layer"),
                                "{what}: {msg}"
                            );
                            // The norm's kernel reads the shard of the
                            // home that the unpack of its bucket wrote.
                            assert_eq!(
                                (h.op, h.agent),
                                ("sum_squares", Agent::Stream(Stream::Compute)),
                                "{what}: {msg}"
                            );
                            assert_eq!(
                                (h.other_op, h.other_agent),
                                ("unpack", Agent::Stream(Stream::Comm)),
                                "{what}: {msg}"
                            );
                        }
                        SkipWait::ParamsBeforeGather => {
                            // Stage 3: the shard copied into the gathered
                            // buffer; stages 1–2: the parameters AdamW
                            // wrote.
                            let (buffer, writer) = if stage == 3 {
                                ("gathered `layer", "cast")
                            } else {
                                ("params `layer", "adamw")
                            };
                            assert!(h.buffer.starts_with(buffer), "{what}: {msg}");
                            assert_eq!(
                                (h.op, h.agent),
                                ("all_gather", Agent::Stream(Stream::Comm)),
                                "{what}: {msg}"
                            );
                            assert_eq!(
                                (h.other_op, h.other_agent),
                                (writer, Agent::Stream(Stream::Compute)),
                                "{what}: {msg}"
                            );
                        }
                        // (Not in this list: no frozen tensors here; see
                        // tests/frozen.rs.)
                        SkipWait::FrozenBeforeRead => unreachable!("not run"),
                    }
                }
            }
        }
    }
}

/// The optimizer runs on the backend's kernels: threads for the default
/// backend and a backend of one's own together are refused, not one of
/// them dropped.
#[test]
fn optimizer_threads_with_a_backend_is_refused() {
    let e = ThreadGroup::run(1, |comm| {
        let mut b = Engine::builder(config(1, 0, 1, Precision::Fp32), comm)
            .optimizer_threads(1)
            .backend(CpuBackend::new(CpuMode::Inline).unwrap());
        Mlp::register(&mut b, DIMS).unwrap();
        b.build().map(|_| ()).unwrap_err().to_string()
    })
    .unwrap()
    .remove(0);
    assert!(
        e.contains("optimizer_threads") && e.contains("CpuBackend::with_adamw"),
        "{e}"
    );
}
