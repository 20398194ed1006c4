//! Frozen tensors (`TensorSpec::frozen`, `requires_grad = false`).
//!
//! The model: a frozen-only unit `base` (`w`), a unit `mix` that mixes
//! frozen (`f1`, `f2`) and trainable (`a`, `b`) tensors in the order
//! `f1, a, f2, b`, and a trainable unit `head` (`h`). For an input x of 8
//! features, `z_k = x_k w_k f1_k` and the prediction is
//! `Σ_k (a_k + h_k) z_k + b + f2_0 + f2_1 x_0 + f2_2 x_1`, with a squared
//! loss. The frozen values are exact in bf16, so every precision starts
//! from the same frozen weights.
//!
//! - frozen tensors are bit-identical after the steps, at every stage,
//!   offload mode (none, cpu, nvme; `offload_param` at stage 3) and world
//!   size, and every stage and offload mode gives the stage-0 bits;
//! - the trainable tensors train bit for bit as in the same model with the
//!   frozen tensors in a unit of their own, and as in a model without them
//!   (the trainer holding the frozen values as constants);
//! - the gradient norm covers the trainable gradients only;
//! - the memory report holds no gradient, master or moment bytes for the
//!   frozen tensors (exact byte counts);
//! - stage 3 all-gathers only the trainable segments;
//! - a unit with only frozen tensors has no gradient buffer, and ranks
//!   that disagree on what is frozen fail together.

use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::backend::CpuMode;
use zero::core::bf16;
use zero::core::config::{FrozenParams, OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::{Category, Tier};
use zero::core::partition::{TensorSpec, UnitSpec};
use zero::core::Element;
use zero::engine::SkipWait;
use zero::{Engine, EngineStats, Error, Init, StepOutcome, UnitId, UnitState};
use zero_testkit::runs::{assert_bits_eq, bits, config, TestDevice, MB};
use zero_testkit::temp::TempDir;

const STEPS: usize = 4;
const K: usize = 8;

/// Where the frozen tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// `f1, a, f2, b` in one unit, `w` in a frozen-only unit.
    Mixed,
    /// `a, b` in `mix`, `f1, f2` in `mixf`, `w` in `base`.
    Separate,
    /// No frozen tensor in the engine: the trainer holds them.
    Absent,
}

fn w() -> Vec<f32> {
    (0..K).map(|k| 1.0 - k as f32 / 32.0).collect()
}
fn f1() -> Vec<f32> {
    (0..K).map(|k| 0.5 + k as f32 / 16.0).collect()
}
fn f2() -> Vec<f32> {
    vec![0.25, -0.5, 1.0]
}

/// `a` and `h`: explicit values, the same wherever the tensor is.
fn start(n: usize, s: f32) -> Vec<f32> {
    (0..n).map(|k| s * ((k as f32 + 1.0) * 1.3).sin()).collect()
}

fn values(v: Vec<f32>) -> Init {
    Init::Values(v.into())
}

struct Ids {
    base: Option<UnitId>,
    mix: UnitId,
    mixf: Option<UnitId>,
    head: UnitId,
}

fn register<C: Communicator>(
    b: &mut zero::EngineBuilder<C>,
    shape: Shape,
    frozen_b: bool,
) -> zero::Result<Ids> {
    register_frozen(b, shape, frozen_b, values)
}

/// [`register`] with the frozen tensors' values through `frozen` (zeros:
/// a load must bring them).
fn register_frozen<C: Communicator>(
    b: &mut zero::EngineBuilder<C>,
    shape: Shape,
    frozen_b: bool,
    frozen: fn(Vec<f32>) -> Init,
) -> zero::Result<Ids> {
    let base = match shape {
        Shape::Absent => None,
        _ => Some(b.register(
            UnitSpec::new("base", vec![TensorSpec::frozen("w", &[K])]),
            vec![frozen(w())],
        )?),
    };
    let b_spec = if frozen_b {
        TensorSpec::frozen("b", &[1])
    } else {
        TensorSpec::new("b", &[1])
    };
    let (mix, mixf) = match shape {
        Shape::Mixed => (
            b.register(
                UnitSpec::new(
                    "mix",
                    vec![
                        TensorSpec::frozen("f1", &[K]),
                        TensorSpec::new("a", &[K]),
                        TensorSpec::frozen("f2", &[3]),
                        b_spec,
                    ],
                ),
                vec![
                    frozen(f1()),
                    values(start(K, 0.3)),
                    frozen(f2()),
                    Init::Zeros,
                ],
            )?,
            None,
        ),
        _ => {
            let mix = b.register(
                UnitSpec::new("mix", vec![TensorSpec::new("a", &[K]), b_spec]),
                vec![values(start(K, 0.3)), Init::Zeros],
            )?;
            let mixf = match shape {
                Shape::Separate => Some(b.register(
                    UnitSpec::new(
                        "mixf",
                        vec![
                            TensorSpec::frozen("f1", &[K]),
                            TensorSpec::frozen("f2", &[3]),
                        ],
                    ),
                    vec![frozen(f1()), frozen(f2())],
                )?),
                _ => None,
            };
            (mix, mixf)
        }
    };
    let head = b.register(
        UnitSpec::new("head", vec![TensorSpec::new("h", &[K])]),
        vec![values(start(K, 0.2))],
    )?;
    Ok(Ids {
        base,
        mix,
        mixf,
        head,
    })
}

/// Tensor `t` of a gathered unit, as f32.
fn tensor<T: Element>(g: &zero::UnitGuard, t: &str) -> zero::Result<Vec<f32>> {
    Ok(g.param::<T>(t)?.iter().map(|x| x.to_f32()).collect())
}

/// One rank's view of a run.
struct Run {
    /// Every unit's final state by name.
    states: Vec<(String, UnitState)>,
    outcomes: Vec<StepOutcome>,
    losses: Vec<f32>,
    stats: EngineStats,
    /// Device bytes of grads, master, moments and params after build.
    bytes: [u64; 4],
    /// The peak bytes of gathered parameters (device) over the run.
    gathered_peak: u64,
    /// The squared gradients the trainer wrote in the first micro-batch
    /// (this rank, unscaled).
    first_grads: Vec<f32>,
}

fn train<T: Element>(
    comm: ThreadComm,
    cfg: &ResolvedConfig,
    shape: Shape,
    steps: usize,
) -> zero::Result<Run> {
    train_on::<T>(TestDevice::default(), comm, cfg, shape, steps)
}

/// [`train`] on `device` (the hazard checker with `CpuMode::Checked`).
fn train_on<T: Element>(
    device: TestDevice,
    comm: ThreadComm,
    cfg: &ResolvedConfig,
    shape: Shape,
    steps: usize,
) -> zero::Result<Run> {
    let mut b = device.builder(cfg.clone(), comm)?.seed(3);
    let ids = register(&mut b, shape, false)?;
    let mut e = b.build()?;
    let t = e.tracker();
    let bytes = [
        t.current(Tier::Device, Category::Grads) + t.current(Tier::Host, Category::Grads),
        t.current(Tier::Device, Category::Master),
        t.current(Tier::Device, Category::Moments),
        t.current(Tier::Device, Category::Params),
    ];
    let mut r = steps_of::<T>(&mut e, &ids, shape, 0..steps)?;
    r.bytes = bytes;
    Ok(r)
}

/// Steps `steps` of the run on `e` (the samples depend on the step
/// index only); then every unit's state.
fn steps_of<T: Element>(
    e: &mut Engine<ThreadComm>,
    ids: &Ids,
    shape: Shape,
    steps: std::ops::Range<usize>,
) -> zero::Result<Run> {
    let (world, rank) = (e.world_size(), e.rank());
    let ga = e.config().gradient_accumulation_steps;
    let (mut outcomes, mut losses, mut first_grads) = (Vec::new(), Vec::new(), Vec::new());
    for s in steps {
        for m in 0..ga {
            let first = ((s * ga + m) * world + rank) * MB;
            let gm = e.gather(ids.mix)?;
            let gh = e.gather(ids.head)?;
            let (wv, f1v, f2v) = match shape {
                Shape::Absent => (w(), f1(), f2()),
                Shape::Mixed => {
                    let gb = e.gather(ids.base.expect("base"))?;
                    (
                        tensor::<T>(&gb, "w")?,
                        tensor::<T>(&gm, "f1")?,
                        tensor::<T>(&gm, "f2")?,
                    )
                }
                Shape::Separate => {
                    let gb = e.gather(ids.base.expect("base"))?;
                    let gf = e.gather(ids.mixf.expect("mixf"))?;
                    (
                        tensor::<T>(&gb, "w")?,
                        tensor::<T>(&gf, "f1")?,
                        tensor::<T>(&gf, "f2")?,
                    )
                }
            };
            let (a, bias, h) = (
                tensor::<T>(&gm, "a")?,
                tensor::<T>(&gm, "b")?,
                tensor::<T>(&gh, "h")?,
            );
            let mut ga_ = [0f32; K];
            let mut gb_ = 0f32;
            let mut loss = 0f32;
            let n = MB as f32;
            let scale = e.loss_scale();
            for i in 0..MB {
                let j = (first + i) as f32;
                let x: Vec<f32> = (0..K)
                    .map(|k| ((j + 1.0) * 0.37 + k as f32 * 0.71).sin())
                    .collect();
                let y = (j * 0.13).cos();
                let z: Vec<f32> = (0..K).map(|k| x[k] * wv[k] * f1v[k]).collect();
                let mut pred = bias[0] + f2v[0] + f2v[1] * x[0] + f2v[2] * x[1];
                for k in 0..K {
                    pred += (a[k] + h[k]) * z[k];
                }
                let d = pred - y;
                loss += d * d / n;
                let g = 2.0 * d / n * scale;
                for k in 0..K {
                    ga_[k] += g * z[k];
                }
                gb_ += g;
            }
            drop((gm, gh));
            let mut gmix = e.grad_buffer::<T>(ids.mix)?;
            for (g, v) in gmix.tensor_mut("a")?.iter_mut().zip(ga_) {
                *g = T::from_f32(v);
            }
            gmix.tensor_mut("b")?[0] = T::from_f32(gb_);
            e.grad_ready(ids.mix, gmix)?;
            let mut ghead = e.grad_buffer::<T>(ids.head)?;
            for k in 0..K {
                ghead[k] = T::from_f32(ga_[k]);
            }
            e.grad_ready(ids.head, ghead)?;
            if s == 0 && m == 0 {
                first_grads = ga_
                    .iter()
                    .chain(ga_.iter())
                    .chain([gb_].iter())
                    .copied()
                    .collect();
            }
            losses.push(loss);
            let o = e.step()?;
            if o.boundary {
                outcomes.push(o);
            }
        }
    }
    let stats = e.stats().clone();
    let mut states = Vec::new();
    for u in e.unit_ids() {
        let name = e.layout(u)?.name.clone();
        states.push((name, e.unit_state(u)?));
    }
    Ok(Run {
        states,
        outcomes,
        losses,
        stats,
        bytes: [0; 4],
        gathered_peak: e.tracker().peak(Tier::Device, Category::GatheredParams),
        first_grads,
    })
}

fn run(world: usize, cfg: &ResolvedConfig, shape: Shape) -> Run {
    let mut all = ThreadGroup::run(world, |comm| match cfg.precision {
        Precision::Bf16 => train::<bf16>(comm, cfg, shape, STEPS),
        Precision::Fp16 => train::<zero::core::f16>(comm, cfg, shape, STEPS),
        Precision::Fp32 => train::<f32>(comm, cfg, shape, STEPS),
    })
    .expect("ranks ran")
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("training failed: {e}")))
    .collect::<Vec<_>>();
    all.swap_remove(0)
}

fn state<'a>(r: &'a Run, unit: &str) -> &'a UnitState {
    &r.states.iter().find(|(n, _)| n == unit).expect("unit").1
}

/// `mix`'s trainable part (`a`, `b`) and `head`, with their optimizer
/// state: the params' first 9 elements (the trainable segment comes
/// first), master, m, v.
fn trainable(r: &Run) -> Vec<UnitState> {
    let mut mix = state(r, "mix").clone();
    mix.params.truncate(K + 1);
    vec![mix, state(r, "head").clone()]
}

/// The frozen tensors are their initial values, bit for bit.
fn assert_frozen_unchanged(r: &Run, what: &str) {
    let base = state(r, "base");
    assert_eq!(base.params, w(), "{what}: base.w");
    assert!(
        base.master.is_empty() && base.m.is_empty() && base.v.is_empty(),
        "{what}"
    );
    let mix = state(r, "mix");
    let want: Vec<f32> = f1().into_iter().chain(f2()).collect();
    assert_eq!(mix.params[K + 1..], want[..], "{what}: mix.f1, mix.f2");
    assert_eq!(mix.master.len(), K + 1, "{what}: master of a, b only");
}

fn cfg_for(world: usize, stage: u8, precision: Precision) -> ResolvedConfig {
    let mut c = config(world, stage, 2, precision);
    c.gradient_clipping = 0.0;
    c
}

#[test]
fn frozen_tensors_stay_and_every_stage_and_offload_gives_the_same_bits() {
    let dir = TempDir::new("frozen-test");
    for world in [1usize, 2] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let base = run(world, &cfg_for(world, 0, precision), Shape::Mixed);
            assert_frozen_unchanged(&base, "stage 0");
            // Training changed the trainable tensors (else nothing here
            // could fail).
            let start = ThreadGroup::run(world, |comm| {
                train::<f32>(comm, &cfg_for(world, 0, Precision::Fp32), Shape::Mixed, 0)
            })
            .expect("ranks ran")
            .swap_remove(0)
            .expect("built");
            assert_ne!(bits(&start.states[1].1)[1], bits(state(&base, "mix"))[1]);
            let mut setups: Vec<(String, ResolvedConfig)> = Vec::new();
            for stage in 0..=3u8 {
                for offload in [OffloadDevice::None, OffloadDevice::Cpu, OffloadDevice::Nvme] {
                    let mut c = cfg_for(world, stage, precision);
                    c.zero.offload_optimizer.device = offload;
                    c.zero.sub_group_size = 5;
                    if offload == OffloadDevice::Nvme {
                        c.zero.offload_optimizer.nvme_path = Some(dir.to_path_buf());
                        c.zero.aio.block_size = 4096;
                    }
                    setups.push((format!("stage {stage} offload {offload:?}"), c));
                }
            }
            for param in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
                let mut c = cfg_for(world, 3, precision);
                c.zero.offload_param.device = param;
                if param == OffloadDevice::Nvme {
                    c.zero.offload_param.nvme_path = Some(dir.to_path_buf());
                    c.zero.aio.block_size = 4096;
                }
                setups.push((format!("stage 3 offload_param {param:?}"), c));
            }
            for (what, c) in setups {
                let what = format!("{world} rank(s) {precision:?} {what}");
                let t = run(world, &c, Shape::Mixed);
                assert_frozen_unchanged(&t, &what);
                let names: Vec<_> = t.states.iter().map(|(n, _)| n.clone()).collect();
                assert_eq!(names, ["base", "mix", "head"]);
                assert_bits_eq(
                    &base.states.iter().map(|s| s.1.clone()).collect::<Vec<_>>(),
                    &t.states.iter().map(|s| s.1.clone()).collect::<Vec<_>>(),
                    &what,
                );
                assert_eq!(
                    format!("{:?}", base.outcomes),
                    format!("{:?}", t.outcomes),
                    "{what}"
                );
                assert_eq!(base.losses, t.losses, "{what}");
            }
        }
    }
}

#[test]
fn trainable_tensors_train_as_without_the_frozen_ones() {
    let world = 2;
    for (stage, precision) in [
        (0u8, Precision::Bf16),
        (2, Precision::Bf16),
        (3, Precision::Bf16),
        // Dynamic loss scaling: the first steps overflow and are skipped.
        (3, Precision::Fp16),
    ] {
        let c = cfg_for(world, stage, precision);
        let mixed = run(world, &c, Shape::Mixed);
        let separate = run(world, &c, Shape::Separate);
        let absent = run(world, &c, Shape::Absent);
        let what = format!("stage {stage} {precision:?}");
        assert_frozen_unchanged(&mixed, &what);
        if precision == Precision::Fp16 {
            assert!(
                mixed.outcomes.iter().any(|o| o.skipped),
                "{what}: a skipped step"
            );
        }
        assert_bits_eq(
            &trainable(&mixed),
            &trainable(&separate),
            &format!("{what}: mixed vs separate"),
        );
        assert_bits_eq(
            &trainable(&mixed),
            &trainable(&absent),
            &format!("{what}: mixed vs absent"),
        );
        assert_eq!(mixed.losses, absent.losses, "{what}");
        assert_eq!(
            format!("{:?}", mixed.outcomes),
            format!("{:?}", absent.outcomes),
            "{what}"
        );
    }
}

#[test]
fn the_gradient_norm_covers_the_trainable_gradients_only() {
    // One rank, one micro-batch, fp32: the norm of the first step is the
    // norm of what the trainer wrote.
    let mut c = config(1, 0, 1, Precision::Fp32);
    c.gradient_clipping = 0.0;
    let r = ThreadGroup::run(1, |comm| train::<f32>(comm, &c, Shape::Mixed, 1))
        .expect("ranks ran")
        .swap_remove(0)
        .expect("trained");
    let want = r
        .first_grads
        .iter()
        .map(|&g| f64::from(g) * f64::from(g))
        .sum::<f64>()
        .sqrt();
    let got = r.outcomes[0].grad_norm.expect("a norm");
    assert!(
        (got - want).abs() <= 1e-5 * want,
        "norm {got}, trainable gradients {want}"
    );
}

#[test]
fn the_memory_report_has_no_gradient_or_optimizer_bytes_for_frozen_tensors() {
    let world = 2;
    for stage in 0..=3u8 {
        let c = cfg_for(world, stage, Precision::Fp32);
        let mixed = run(world, &c, Shape::Mixed);
        let absent = run(world, &c, Shape::Absent);
        // Trainable: `mix` 9 elements and `head` 8, each one segment of 64
        // elements (2 ranks × 32); frozen: `base` 8 and `mix` 11 elements,
        // one segment of 64 each.
        let state_elems: u64 = if stage == 0 { 2 * 64 } else { 2 * 32 };
        let what = format!("stage {stage}");
        assert_eq!(mixed.bytes[1], 4 * state_elems, "{what}: master");
        assert_eq!(mixed.bytes[2], 8 * state_elems, "{what}: moments");
        assert_eq!(mixed.bytes[0], absent.bytes[0], "{what}: gradients");
        // Parameters: the trainable part as without frozen tensors, plus
        // the two frozen segments in full on every rank (stage 3 keeps
        // them resident).
        assert_eq!(
            mixed.bytes[3],
            absent.bytes[3] + 2 * 64 * 4,
            "{what}: params"
        );
        let own = if stage == 3 { 2 * 32 } else { 2 * 64 };
        assert_eq!(
            absent.bytes[3],
            own * 4,
            "{what}: params without frozen tensors"
        );
    }
}

#[test]
fn stage_3_all_gathers_only_the_trainable_segments() {
    let world = 2;
    let c = cfg_for(world, 3, Precision::Bf16);
    let mixed = run(world, &c, Shape::Mixed);
    let absent = run(world, &c, Shape::Absent);
    assert!(absent.stats.gather_bytes > 0);
    assert_eq!(mixed.stats.gather_bytes, absent.stats.gather_bytes);
    assert_eq!(mixed.stats.frozen_gather_bytes, 0);
    // A resident unit is gathered into its own buffer, which holds the
    // frozen segment once: no gathered copy of the frozen weights.
    assert!(absent.gathered_peak > 0);
    assert_eq!(mixed.gathered_peak, absent.gathered_peak);
    // Sharded frozen segments are gathered (into buffers of their own).
    let shard = run(
        world,
        &stage3(FrozenParams::Shard, OffloadDevice::None),
        Shape::Mixed,
    );
    assert!(shard.gathered_peak > absent.gathered_peak);
}

#[test]
fn a_unit_with_only_frozen_tensors_has_no_gradient() {
    let out = ThreadGroup::run(2, |comm| -> zero::Result<String> {
        let mut b = Engine::builder(cfg_for(2, 2, Precision::Fp32), comm);
        let ids = register(&mut b, Shape::Mixed, false)?;
        let mut e = b.build()?;
        let e1 = match e.grad_buffer::<f32>(ids.base.expect("base")) {
            Err(e) => e.to_string(),
            Ok(_) => String::from("no error"),
        };
        Ok(e1)
    })
    .expect("ranks ran");
    for r in out {
        let msg = r.expect("built");
        assert!(
            msg.contains("grad_buffer(`base`)") && msg.contains("only frozen tensors"),
            "{msg}"
        );
    }
}

/// `GradBuffer`'s per-tensor views: a trainable tensor's gradient at its
/// layout offset (in the mixed unit `f1, a, f2, b`, where `a` and `b` lie
/// elsewhere than in registration order), and a frozen or unknown tensor
/// an error naming it and the unit, not an index out of bounds.
#[test]
fn grad_buffer_views_tensors_by_name_and_refuses_frozen_ones() {
    let out = ThreadGroup::run(2, |comm| -> zero::Result<()> {
        let mut b = Engine::builder(cfg_for(2, 3, Precision::Fp32), comm);
        let ids = register(&mut b, Shape::Mixed, false)?;
        let mut e = b.build()?;
        let layout = e.layout(ids.mix)?.clone();
        let mut g = e.grad_buffer::<f32>(ids.mix)?;
        assert_eq!(g.layout(), &layout);
        let a: Vec<f32> = (0..K).map(|k| k as f32 + 1.0).collect();
        g.tensor_mut("a")?.copy_from_slice(&a);
        g.write_tensor_host("b", |b| b[0] = -2.0)?;
        let (ra, rb) = (layout.tensor("a").unwrap(), layout.tensor("b").unwrap());
        assert_eq!(&g[ra.range()], &a[..]);
        assert_eq!(g[rb.offset], -2.0);
        assert_eq!(g.tensor("a")?, &a[..]);
        assert_eq!(g.tensor_range("b")?, rb.range());
        let written = g.iter().filter(|v| **v != 0.0).count();
        assert_eq!(written, K + 1, "only `a` and `b` were written");
        for frozen in ["f1", "f2"] {
            let f = layout.tensor(frozen).unwrap();
            assert!(f.range().end > g.len(), "`{frozen}` lies past the buffer");
            for err in [
                g.tensor_mut(frozen).map(|_| ()).unwrap_err(),
                g.write_tensor_host(frozen, |_| ()).unwrap_err(),
            ] {
                let m = err.to_string();
                assert!(
                    m.contains(&format!("tensor `{frozen}` of unit `mix`")) && m.contains("frozen"),
                    "{m}"
                );
            }
        }
        let m = g.tensor("nope").map(|_| ()).unwrap_err().to_string();
        assert!(
            m.contains("tensor `nope` of unit `mix`") && m.contains("its tensors: a, b, f1, f2"),
            "{m}"
        );
        e.grad_ready(ids.mix, g)
    })
    .expect("ranks ran");
    for r in out {
        r.expect("rank");
    }
}

#[test]
fn ranks_that_freeze_different_tensors_fail_together() {
    let out = ThreadGroup::run(2, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(cfg_for(2, 3, Precision::Fp32), comm);
        register(&mut b, Shape::Mixed, rank == 1)?;
        b.build().map(|_| ())
    })
    .expect("ranks ran");
    for (rank, r) in out.into_iter().enumerate() {
        let e = r.expect_err("different frozen sets must fail");
        assert!(matches!(e, Error::Disagreement { .. }), "rank {rank}: {e}");
        assert!(
            e.to_string().contains("unit #1") && e.to_string().contains("frozen"),
            "rank {rank}: {e}"
        );
    }
}

#[test]
fn checkpoints_hold_the_trainable_state_and_resume_bit_identically() {
    let world = 2;
    let root = TempDir::new("frozen-ckpt");
    for (stage, offload) in [
        (0u8, OffloadDevice::None),
        (2, OffloadDevice::Cpu),
        (3, OffloadDevice::None),
        (3, OffloadDevice::Cpu),
    ] {
        let mut c = cfg_for(world, stage, Precision::Bf16);
        c.zero.offload_optimizer.device = offload;
        let whole = run(world, &c, Shape::Mixed);
        let dir = root.join(format!("s{stage}-{offload:?}"));
        // Two steps and a save …
        let saved = ThreadGroup::run(world, |comm| -> zero::Result<std::path::PathBuf> {
            let mut b = Engine::builder(c.clone(), comm).seed(3);
            let ids = register(&mut b, Shape::Mixed, false)?;
            let mut e = b.build()?;
            steps_of::<bf16>(&mut e, &ids, Shape::Mixed, 0..STEPS / 2)?;
            e.save_checkpoint(&dir, serde_json::json!({}))
        })
        .expect("ranks ran")
        .swap_remove(0)
        .unwrap_or_else(|e| panic!("stage {stage} {offload:?}: {e}"));
        // … then a new engine (the same registration, frozen values
        // included) loads and runs the other two.
        let resumed = ThreadGroup::run(world, |comm| -> zero::Result<Run> {
            let mut b = Engine::builder(c.clone(), comm).seed(3);
            let ids = register(&mut b, Shape::Mixed, false)?;
            let (mut e, _) = Engine::load_checkpoint(b, &saved)?;
            steps_of::<bf16>(&mut e, &ids, Shape::Mixed, STEPS / 2..STEPS)
        })
        .expect("ranks ran")
        .swap_remove(0)
        .unwrap_or_else(|e| panic!("stage {stage} {offload:?}: {e}"));
        let what = format!("stage {stage} offload {offload:?}");
        assert_frozen_unchanged(&resumed, &what);
        assert_bits_eq(
            &whole.states.iter().map(|s| s.1.clone()).collect::<Vec<_>>(),
            &resumed
                .states
                .iter()
                .map(|s| s.1.clone())
                .collect::<Vec<_>>(),
            &what,
        );
        let half = whole.losses.len() / 2;
        assert_eq!(whole.losses[half..], resumed.losses[..], "{what}");
        // The rank files hold the trainable state only: master, m and v
        // of `a`, `b` and `h`, each rank its real range (fp32).
        let step_dir = std::fs::read_dir(&dir)
            .unwrap()
            .map(|d| d.unwrap().path())
            .find(|p| p.is_dir())
            .expect("a step directory");
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(step_dir.join("manifest.json")).unwrap())
                .unwrap();
        let numel: Vec<u64> = manifest["units"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u["numel"].as_u64().unwrap())
            .collect();
        assert_eq!(numel, [0, K as u64 + 1, K as u64], "{what}");
    }
}

#[test]
fn a_checkpoint_with_another_frozen_set_is_refused_naming_the_tensor() {
    let world = 2;
    let c = cfg_for(world, 1, Precision::Fp32);
    let dir = TempDir::new("frozen-ckpt-set");
    let saved = ThreadGroup::run(world, |comm| -> zero::Result<std::path::PathBuf> {
        let mut b = Engine::builder(c.clone(), comm).seed(3);
        let ids = register(&mut b, Shape::Mixed, false)?;
        let mut e = b.build()?;
        steps_of::<f32>(&mut e, &ids, Shape::Mixed, 0..1)?;
        e.save_checkpoint(&dir, serde_json::json!({}))
    })
    .expect("ranks ran")
    .swap_remove(0)
    .expect("saved");
    let out = ThreadGroup::run(world, |comm| -> zero::Result<String> {
        // `b` frozen now.
        let mut b = Engine::builder(c.clone(), comm).seed(3);
        register(&mut b, Shape::Mixed, true)?;
        Ok(match Engine::load_checkpoint(b, &saved) {
            Ok(_) => "loaded".into(),
            Err(e) => e.to_string(),
        })
    })
    .expect("ranks ran");
    for r in out {
        let msg = r.expect("saved");
        assert!(
            msg.contains(
                "unit `mix`: tensor `b` is frozen in the model but trainable in the checkpoint"
            ),
            "{msg}"
        );
    }
}

/// A stage-3 config with `frozen_params` `policy`.
fn stage3(policy: FrozenParams, param: OffloadDevice) -> ResolvedConfig {
    let mut c = cfg_for(2, 3, Precision::Bf16);
    c.zero.frozen_params = policy;
    c.zero.offload_param.device = param;
    c
}

#[test]
fn every_frozen_params_policy_gives_the_same_bits() {
    let world = 2;
    let base = run(world, &cfg_for(world, 0, Precision::Bf16), Shape::Mixed);
    let all = |r: &Run| r.states.iter().map(|s| s.1.clone()).collect::<Vec<_>>();
    let mut gathered = Vec::new();
    for (policy, param) in [
        (FrozenParams::Resident, OffloadDevice::None),
        (FrozenParams::Shard, OffloadDevice::None),
        (FrozenParams::Auto, OffloadDevice::None),
        (FrozenParams::Resident, OffloadDevice::Cpu),
        (FrozenParams::Shard, OffloadDevice::Cpu),
        (FrozenParams::Offload, OffloadDevice::Cpu),
    ] {
        let what = format!("frozen_params {policy} offload_param {param}");
        let t = run(world, &stage3(policy, param), Shape::Mixed);
        assert_frozen_unchanged(&t, &what);
        assert_bits_eq(&all(&base), &all(&t), &what);
        assert_eq!(base.losses, t.losses, "{what}");
        println!(
            "{what}: gather_bytes {} frozen_gather_bytes {} gather_copy_bytes {}",
            t.stats.gather_bytes, t.stats.frozen_gather_bytes, t.stats.gather_copy_bytes
        );
        gathered.push((
            what,
            t.stats.gather_bytes,
            t.stats.frozen_gather_bytes,
            t.stats.gather_copy_bytes,
        ));
    }
    // Resident frozen segments are never all-gathered; sharded ones are,
    // with every gather of their unit, and that is all the difference.
    let (resident, shard) = (&gathered[0], &gathered[1]);
    assert_eq!(resident.2, 0, "{}", resident.0);
    assert!(shard.2 > 0, "{}", shard.0);
    assert_eq!(shard.1 - shard.2, resident.1, "{}", shard.0);
    // The gathered frozen segment is read where it landed: the device
    // copies nothing but each rank's shard into its slot, so sharding
    // adds one frozen shard per frozen gather (a ring all-gather sends
    // world - 1 of them) and no copy of the gathered segment.
    assert!(resident.3 > 0, "{}", resident.0);
    assert_eq!(
        shard.3 - resident.3,
        shard.2 / (world as u64 - 1),
        "{}",
        shard.0
    );
    // The default here is resident (a tiny model fits).
    assert_eq!(gathered[2].1, resident.1);
    assert_eq!(gathered[5].2, shard.2, "offload gathers as shard");
}

#[test]
fn the_frozen_params_policy_decides_where_frozen_bytes_live() {
    // Per rank: the two frozen segments are 64 elements each (fp32 here,
    // bf16 in `stage3`), 32 per shard.
    let bytes = |policy: FrozenParams, param: OffloadDevice| {
        let mut c = stage3(policy, param);
        c.precision = Precision::Fp32;
        ThreadGroup::run(2, |comm| -> zero::Result<(u64, u64, FrozenParams)> {
            let mut b = Engine::builder(c.clone(), comm);
            register(&mut b, Shape::Mixed, false)?;
            let e = b.build()?;
            let t = e.tracker();
            Ok((
                t.current(Tier::Device, Category::Params),
                t.current(Tier::Host, Category::Params),
                e.frozen_params(),
            ))
        })
        .expect("ranks ran")
        .swap_remove(0)
        .expect("built")
    };
    // The trainable shards: 32 elements of `mix` and of `head`.
    let own = 2 * 32 * 4;
    assert_eq!(
        bytes(FrozenParams::Resident, OffloadDevice::None),
        (own + 2 * 64 * 4, 0, FrozenParams::Resident)
    );
    assert_eq!(
        bytes(FrozenParams::Shard, OffloadDevice::None),
        (own + 2 * 32 * 4, 0, FrozenParams::Shard)
    );
    // With offload_param the trainable shards live on the host too.
    assert_eq!(
        bytes(FrozenParams::Offload, OffloadDevice::Cpu),
        (0, own + 2 * 32 * 4, FrozenParams::Offload)
    );
    assert_eq!(
        bytes(FrozenParams::Resident, OffloadDevice::Cpu),
        (2 * 64 * 4, own, FrozenParams::Resident)
    );
}

#[test]
fn auto_keeps_frozen_weights_resident_when_they_fit_the_device_budget() {
    let policy = |budget: u64, param: OffloadDevice| {
        let c = stage3(FrozenParams::Auto, param);
        ThreadGroup::run(2, |comm| -> zero::Result<FrozenParams> {
            let mut b = Engine::builder(c.clone(), comm).device_budget(budget);
            register(&mut b, Shape::Mixed, false)?;
            Ok(b.build()?.frozen_params())
        })
        .expect("ranks ran")
        .into_iter()
        .map(|r| r.expect("built"))
        .collect::<Vec<_>>()
    };
    assert_eq!(
        policy(1 << 30, OffloadDevice::None),
        [FrozenParams::Resident; 2]
    );
    assert_eq!(policy(1024, OffloadDevice::None), [FrozenParams::Shard; 2]);
    assert_eq!(policy(1024, OffloadDevice::Cpu), [FrozenParams::Offload; 2]);
}

#[test]
fn frozen_params_values_are_checked_naming_the_key() {
    use zero::core::config::{AutoValues, DeepSpeedConfig};
    let resolve = |v: &str| {
        let json = format!(
            r#"{{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": 3, "frozen_params": {v}}}}}"#
        );
        let (doc, warnings) = DeepSpeedConfig::from_json_str(&json).map_err(|e| e.to_string())?;
        assert!(warnings.is_empty(), "{warnings:?}");
        doc.resolve(&AutoValues {
            world_size: 1,
            ..AutoValues::default()
        })
        .map_err(|e| e.to_string())
    };
    assert_eq!(
        resolve(r#""shard""#).unwrap().zero.frozen_params,
        FrozenParams::Shard
    );
    assert_eq!(
        resolve(r#""resident""#).unwrap().zero.frozen_params,
        FrozenParams::Resident
    );
    let e = resolve(r#""sometimes""#).unwrap_err();
    assert!(
        e.contains("zero_optimization.frozen_params") && e.contains("sometimes"),
        "{e}"
    );
    let e = resolve("3").unwrap_err();
    assert!(e.contains("frozen_params"), "{e}");
    assert_eq!(
        ResolvedConfig::simple(3, 1, 1).zero.frozen_params,
        FrozenParams::Auto,
        "the default"
    );
    // "offload" needs offload_param on the host.
    let out = ThreadGroup::run(2, |comm| {
        let mut b = Engine::builder(stage3(FrozenParams::Offload, OffloadDevice::None), comm);
        register(&mut b, Shape::Mixed, false)?;
        b.build().map(|_| ())
    })
    .expect("ranks ran");
    for r in out {
        let e = r.expect_err("offload without offload_param").to_string();
        assert!(
            e.contains("zero_optimization.frozen_params") && e.contains("offload_param.device"),
            "{e}"
        );
    }
}

#[test]
fn the_hazard_checker_finds_every_frozen_copy_ordered() {
    // Stage 3 moves frozen segments on the streams (resident copies,
    // shard all-gathers, host shards): the checked backend proves each
    // access ordered and gives the same bits.
    let world = 2;
    let all = |r: &Run| r.states.iter().map(|s| s.1.clone()).collect::<Vec<_>>();
    let mut setups: Vec<(String, ResolvedConfig)> = [
        (FrozenParams::Resident, OffloadDevice::None),
        (FrozenParams::Shard, OffloadDevice::None),
        (FrozenParams::Offload, OffloadDevice::Cpu),
    ]
    .into_iter()
    .map(|(policy, param)| {
        let what = format!("frozen_params {policy} offload_param {param}");
        (what, stage3(policy, param))
    })
    .collect();
    for stage in [0u8, 2] {
        setups.push((
            format!("stage {stage}"),
            cfg_for(world, stage, Precision::Bf16),
        ));
    }
    for (what, c) in setups {
        let inline = run(world, &c, Shape::Mixed);
        let checked = ThreadGroup::run(world, |comm| {
            train_on::<bf16>(
                TestDevice::Cpu(CpuMode::Checked),
                comm,
                &c,
                Shape::Mixed,
                STEPS,
            )
        })
        .expect("ranks ran")
        .swap_remove(0)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_bits_eq(&all(&inline), &all(&checked), &what);
    }
}

#[test]
fn reading_a_frozen_segment_before_its_gather_is_a_hazard() {
    // With `shard` and `offload` the trainer reads the gathered frozen
    // segment where its all-gather landed (host views here): without the
    // wait for that gather the checked backend refuses the read.
    let world = 2;
    for (policy, param) in [
        (FrozenParams::Shard, OffloadDevice::None),
        (FrozenParams::Offload, OffloadDevice::Cpu),
    ] {
        let c = stage3(policy, param);
        let got = ThreadGroup::run(world, |comm| -> zero::Result<Run> {
            let mut b = TestDevice::Cpu(CpuMode::Checked)
                .builder(c.clone(), comm)?
                .seed(3)
                .skip_wait_for_tests(SkipWait::FrozenBeforeRead);
            let ids = register(&mut b, Shape::Mixed, false)?;
            let mut e = b.build()?;
            steps_of::<bf16>(&mut e, &ids, Shape::Mixed, 0..1)
        })
        .expect("ranks ran");
        // A rank whose peer stopped at the hazard first may fail in a
        // collective instead; none trains through.
        let what = format!("frozen_params {policy} offload_param {param}");
        let mut hazards = 0;
        for (rank, r) in got.into_iter().enumerate() {
            match r {
                Ok(_) => panic!("{what} rank {rank}: trained without a hazard"),
                Err(Error::Core(zero::core::Error::Hazard(h))) => {
                    assert!(
                        h.buffer.starts_with("frozen gathered"),
                        "{what}: {}",
                        h.buffer
                    );
                    hazards += 1;
                }
                Err(Error::Comm(e)) => eprintln!("{what} rank {rank}: {e}"),
                Err(e) => panic!("{what} rank {rank}: not a hazard: {e}"),
            }
        }
        assert!(hazards > 0, "{what}: no rank saw the hazard");
    }
}

#[test]
fn the_estimate_counts_the_engines_model_states_for_every_policy() {
    use zero::estimate::{estimate, Model, Workload};
    for stage in 0..=3u8 {
        let policies: &[(FrozenParams, OffloadDevice)] = if stage == 3 {
            &[
                (FrozenParams::Resident, OffloadDevice::None),
                (FrozenParams::Shard, OffloadDevice::None),
                (FrozenParams::Offload, OffloadDevice::Cpu),
                (FrozenParams::Resident, OffloadDevice::Cpu),
            ]
        } else {
            &[(FrozenParams::Auto, OffloadDevice::None)]
        };
        for &(policy, param) in policies {
            let mut c = cfg_for(2, stage, Precision::Bf16);
            c.zero.frozen_params = policy;
            c.zero.offload_param.device = param;
            let what = format!("stage {stage} frozen_params {policy} offload_param {param}");
            let (specs, built) = ThreadGroup::run(2, |comm| -> zero::Result<_> {
                let mut b = Engine::builder(c.clone(), comm);
                register(&mut b, Shape::Mixed, false)?;
                let e = b.build()?;
                let specs: Vec<UnitSpec> = e
                    .unit_ids()
                    .into_iter()
                    .map(|u| e.layout(u).expect("a unit").spec())
                    .collect();
                let t = e.tracker();
                let by = |tier| {
                    [
                        Category::Params,
                        Category::Grads,
                        Category::Master,
                        Category::Moments,
                    ]
                    .map(|cat| t.current(tier, cat))
                };
                Ok((specs, [by(Tier::Device), by(Tier::Host)]))
            })
            .expect("ranks ran")
            .swap_remove(0)
            .expect("built");
            let e = estimate(&Model::from_units(specs).unwrap(), &c, &Workload::default())
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let report = e.report();
            for (k, tier) in [Tier::Device, Tier::Host].into_iter().enumerate() {
                for (j, cat) in [
                    Category::Params,
                    Category::Grads,
                    Category::Master,
                    Category::Moments,
                ]
                .into_iter()
                .enumerate()
                {
                    // At build: the first allocation of each category is
                    // all of it (stages 2–3 add gradient buffers in
                    // backward, which the estimate's peak includes).
                    let est = report.get(tier, cat).map_or(0, |r| r.peak);
                    if cat == Category::Grads && stage >= 2 {
                        assert!(est >= built[k][j], "{what}: {tier:?} {cat:?}");
                    } else {
                        assert_eq!(est, built[k][j], "{what}: {tier:?} {cat:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn checkpoints_can_hold_the_frozen_tensors_too() {
    let world = 2;
    let root = TempDir::new("frozen-ckpt-all");
    let zeros: fn(Vec<f32>) -> Init = |_| Init::Zeros;
    let mut setups = vec![("stage 0".to_string(), cfg_for(world, 0, Precision::Bf16))];
    for (policy, param) in [
        (FrozenParams::Resident, OffloadDevice::None),
        (FrozenParams::Shard, OffloadDevice::None),
        (FrozenParams::Offload, OffloadDevice::Cpu),
    ] {
        setups.push((format!("stage 3 {policy}"), stage3(policy, param)));
    }
    for (what, c) in setups {
        let whole = run(world, &c, Shape::Mixed);
        let dir = root.join(what.replace(' ', "-"));
        let saved = ThreadGroup::run(world, |comm| -> zero::Result<std::path::PathBuf> {
            let mut b = Engine::builder(c.clone(), comm)
                .seed(3)
                .checkpoint_frozen(true);
            let ids = register(&mut b, Shape::Mixed, false)?;
            let mut e = b.build()?;
            steps_of::<bf16>(&mut e, &ids, Shape::Mixed, 0..STEPS / 2)?;
            e.save_checkpoint(&dir, serde_json::json!({}))
        })
        .expect("ranks ran")
        .swap_remove(0)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(saved.join("frozen.safetensors").exists(), "{what}");
        // Registered with zeros for the frozen tensors: the checkpoint
        // brings them back.
        let resume = |dir: &std::path::Path| {
            ThreadGroup::run(world, |comm| -> zero::Result<Run> {
                let mut b = Engine::builder(c.clone(), comm).seed(3);
                let ids = register_frozen(&mut b, Shape::Mixed, false, zeros)?;
                let (mut e, _) = Engine::load_checkpoint(b, dir)?;
                steps_of::<bf16>(&mut e, &ids, Shape::Mixed, STEPS / 2..STEPS)
            })
            .expect("ranks ran")
            .swap_remove(0)
        };
        let resumed = resume(&saved).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_frozen_unchanged(&resumed, &what);
        assert_bits_eq(
            &whole.states.iter().map(|s| s.1.clone()).collect::<Vec<_>>(),
            &resumed
                .states
                .iter()
                .map(|s| s.1.clone())
                .collect::<Vec<_>>(),
            &what,
        );
        // A damaged file is refused, naming it.
        let f = saved.join("frozen.safetensors");
        let mut bytes = std::fs::read(&f).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 1;
        std::fs::write(&f, bytes).unwrap();
        let e = resume(&saved)
            .err()
            .expect("a damaged frozen file")
            .to_string();
        assert!(
            e.contains("frozen.safetensors") && e.contains("CRC32"),
            "{what}: {e}"
        );
    }
}

#[test]
fn a_checkpoint_with_frozen_tensors_reshards_on_load() {
    let root = TempDir::new("frozen-reshard");
    let all = |r: &Run| r.states.iter().map(|s| s.1.clone()).collect::<Vec<_>>();
    for include in [false, true] {
        let dir = root.join(format!("include-{include}"));
        let c = stage3(FrozenParams::Shard, OffloadDevice::None);
        let (saved, at_save) = ThreadGroup::run(2, |comm| -> zero::Result<_> {
            let mut b = Engine::builder(c.clone(), comm)
                .seed(3)
                .checkpoint_frozen(include);
            let ids = register(&mut b, Shape::Mixed, false)?;
            let mut e = b.build()?;
            let r = steps_of::<bf16>(&mut e, &ids, Shape::Mixed, 0..STEPS / 2)?;
            Ok((e.save_checkpoint(&dir, serde_json::json!({}))?, r))
        })
        .expect("ranks ran")
        .swap_remove(0)
        .expect("saved");
        // One rank, stage 0: the same state.
        let loaded = ThreadGroup::run(1, |comm| -> zero::Result<Run> {
            let c1 = cfg_for(1, 0, Precision::Bf16);
            let mut b = Engine::builder(c1, comm).seed(3);
            let ids = register(&mut b, Shape::Mixed, false)?;
            let (mut e, _) = Engine::load_checkpoint(b, &saved)?;
            steps_of::<bf16>(&mut e, &ids, Shape::Mixed, 0..0)
        })
        .expect("ranks ran")
        .swap_remove(0)
        .expect("loaded");
        let what = format!("frozen tensors in the checkpoint: {include}");
        assert_frozen_unchanged(&loaded, &what);
        assert_bits_eq(&all(&at_save), &all(&loaded), &what);
    }
}

#[test]
fn offline_export_needs_the_frozen_tensors_in_the_checkpoint() {
    use zero::engine::{export_checkpoint, ExportDtype};
    let world = 2;
    let root = TempDir::new("frozen-export");
    for include in [false, true] {
        let dir = root.join(format!("include-{include}"));
        std::fs::create_dir_all(&dir).unwrap();
        let live = dir.join("live.safetensors");
        let c = stage3(FrozenParams::Shard, OffloadDevice::None);
        let saved = ThreadGroup::run(world, |comm| -> zero::Result<std::path::PathBuf> {
            let mut b = Engine::builder(c.clone(), comm)
                .seed(3)
                .checkpoint_frozen(include);
            let ids = register(&mut b, Shape::Mixed, false)?;
            let mut e = b.build()?;
            steps_of::<bf16>(&mut e, &ids, Shape::Mixed, 0..1)?;
            e.export_safetensors(&live, ExportDtype::F32)?;
            e.save_checkpoint(&dir, serde_json::json!({}))
        })
        .expect("ranks ran")
        .swap_remove(0)
        .expect("saved");
        let out = dir.join("offline.safetensors");
        match export_checkpoint(&saved, &out, ExportDtype::F32) {
            Ok(_) => {
                assert!(include);
                // The same bytes as the engine's export, frozen tensors
                // included.
                assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&live).unwrap());
            }
            Err(e) => {
                assert!(!include, "{e}");
                let e = e.to_string();
                assert!(e.contains("tensor `w` of unit `base` is frozen"), "{e}");
            }
        }
    }
}
