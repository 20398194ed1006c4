//! `offload_optimizer.swap_gradients` (ZeRO-Infinity's gradient swap): the
//! accumulated gradient shard goes to a swap file unit by unit as buckets
//! are reduced, and the nvme step streams unit by unit. Bit-exact
//! equivalence with the run without offload (stages 1–3, world sizes 1–3,
//! gradient accumulation, every schedule, with parameter offload, fp32 and
//! fp16, the hazard checker on); host memory that does not grow with the
//! model; faults: a failed gradient write fails the step with nothing
//! updated (zero_grad, then training goes on exactly), a failed optimizer
//! write loses the state but not the last checkpoint (exact resume).

use std::path::{Path, PathBuf};

use serde_json::Value;

use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::backend::CpuMode;
use zero::core::bf16;
use zero::core::config::{AutoValues, DeepSpeedConfig, OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::{Category, Tier};
use zero::offload::FaultPlan;
use zero::{Engine, UnitState};
use zero_testkit::mlp::{batch, Mlp};
use zero_testkit::runs::*;
use zero_testkit::temp::TempDir;

/// `config` with the optimizer state on nvme under `dir`, gradients
/// swapped, tiles of `sub_group` elements, `buffers` buffers, small aio
/// blocks.
fn swap_config(
    world: usize,
    stage: u8,
    ga: usize,
    precision: Precision,
    (sub_group, buffers): (usize, usize),
    dir: &Path,
) -> ResolvedConfig {
    let mut c = config(world, stage, ga, precision);
    c.zero.sub_group_size = sub_group;
    c.zero.offload_optimizer.device = OffloadDevice::Nvme;
    c.zero.offload_optimizer.buffer_count = buffers;
    c.zero.offload_optimizer.nvme_path = Some(dir.to_path_buf());
    c.zero.offload_optimizer.swap_gradients = true;
    c.zero.aio.block_size = 4096;
    c
}

/// `c` with stage-3 parameter offload to `device` (nvme under `dir`).
fn with_param_offload(mut c: ResolvedConfig, device: OffloadDevice, dir: &Path) -> ResolvedConfig {
    c.zero.offload_param.device = device;
    if device == OffloadDevice::Nvme {
        c.zero.offload_param.nvme_path = Some(dir.to_path_buf());
        c.zero.offload_param.buffer_count = 3;
        // No host cache of parameter shards (DeepSpeed's default caches
        // up to 1e9 elements).
        c.zero.offload_param.max_in_cpu = 0;
    }
    c
}

fn assert_no_files_left(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "swap files left behind: {left:?}");
}

/// Stages 1–3, world sizes 1–3, one or two/three micro-batches per step
/// with clipping: with the gradients swapped, the parameters, master, m
/// and v, the norms and the losses are those of the run without offload,
/// bit for bit, whatever the tile size (tiles now end at unit ends), the
/// buffers and the schedule; with stage-3 parameter offload (cpu, nvme)
/// too; and on the hazard-checked backend.
#[test]
fn gradient_swap_is_bit_identical() {
    let dir = TempDir::new("gswap-exact");
    let steps = 4;
    // (sub_group_size, buffer_count, (pipeline_read, pipeline_write))
    let variants = [
        (256, 4, (true, true)),
        (97, 2, (false, false)),
        (1 << 20, 3, (true, false)),
        (64, 3, (false, true)),
    ];
    for world in 1..=3 {
        for stage in 1..=3u8 {
            for ga in [1, 2 + (stage as usize % 2)] {
                let base = train(world, &config(world, stage, ga, Precision::Bf16), steps, MB);
                for (sg, buffers, (read, write)) in variants {
                    let mut c = swap_config(world, stage, ga, Precision::Bf16, (sg, buffers), &dir);
                    c.zero.offload_optimizer.pipeline_read = read;
                    c.zero.offload_optimizer.pipeline_write = write;
                    let t = train(world, &c, steps, MB);
                    let what = format!(
                        "world {world} stage {stage} ga {ga}: swap_gradients sub_group {sg} \
                         buffers {buffers} pipeline ({read}, {write}) vs no offload"
                    );
                    assert_same_run(&base, &t, &what);
                    assert!(t.stats.param_swap_reads == 0, "{what}");
                }
                if stage == 3 {
                    for device in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
                        let c = swap_config(world, stage, ga, Precision::Bf16, (97, 3), &dir);
                        let c = with_param_offload(c, device, &dir);
                        let t = train(world, &c, steps, MB);
                        let what = format!(
                            "world {world} stage 3 ga {ga}: swap_gradients + offload_param \
                             {device:?} vs no offload"
                        );
                        assert_same_run(&base, &t, &what);
                    }
                }
            }
        }
    }
    // fp32, and fp16 with skipped steps (overflow), on 2 ranks.
    for precision in [Precision::Fp32, Precision::Fp16] {
        for stage in [1u8, 3] {
            let base = train(2, &config(2, stage, 2, precision), 6, MB);
            let c = swap_config(2, stage, 2, precision, (200, 3), &dir);
            let t = train(2, &c, 6, MB);
            assert_same_run(
                &base,
                &t,
                &format!("{precision:?} stage {stage}: swap vs none"),
            );
        }
    }
    // Gradients accumulated (and swapped) in bf16: 2 bytes per element on
    // disk, the same bits as without offload in that dtype.
    for stage in [1u8, 3] {
        let mut base_cfg = config(2, stage, 2, Precision::Bf16);
        base_cfg.grad_accum_dtype = zero::core::DType::BF16;
        let base = train(2, &base_cfg, 4, MB);
        let mut c = swap_config(2, stage, 2, Precision::Bf16, (97, 3), &dir);
        c.grad_accum_dtype = zero::core::DType::BF16;
        let t = train(2, &c, 4, MB);
        assert_same_run(&base, &t, &format!("stage {stage} bf16 accumulation"));
    }
    // overlap_comm flipped (off at stage 3, on at stage 2: reductions
    // while backward goes on, with the stored gradients read ahead).
    for stage in [2u8, 3] {
        let mut base_cfg = config(2, stage, 3, Precision::Bf16);
        base_cfg.zero.overlap_comm = stage == 2;
        let base = train(2, &base_cfg, 3, MB);
        let mut c = swap_config(2, stage, 3, Precision::Bf16, (97, 4), &dir);
        c.zero.overlap_comm = stage == 2;
        let t = train(2, &c, 3, MB);
        assert_same_run(&base, &t, &format!("stage {stage} overlap_comm flipped"));
    }
    // The hazard checker follows the window, the unpacks and the norm
    // terms on the communication stream.
    for stage in [2u8, 3] {
        let base = train(2, &config(2, stage, 2, Precision::Bf16), 3, MB);
        let c = swap_config(2, stage, 2, Precision::Bf16, (97, 3), &dir);
        let t = train_device(TestDevice::Cpu(CpuMode::Checked), 2, &c, 3, MB);
        assert_same_run(&base, &t, &format!("stage {stage} checked: swap vs none"));
    }
    assert_no_files_left(&dir);
}

/// Host and nvme bytes of gradients and transfer buffers on rank 0 of 2,
/// stage 3 with both offloads on nvme, for an MLP with `dims`: at build
/// and after two steps (the peak of the whole run).
fn host_bytes(dims: &[usize], swap: bool, dir: &Path) -> (u64, u64, u64, u64) {
    let out = ThreadGroup::run(2, |comm| {
        let rank = comm.rank();
        let mut c = swap_config(2, 3, 2, Precision::Bf16, (64, 3), dir);
        c.zero.offload_optimizer.swap_gradients = swap;
        let c = with_param_offload(c, OffloadDevice::Nvme, dir);
        let mut b = Engine::builder(c, comm).seed(5);
        let model = Mlp::register(&mut b, dims).unwrap();
        let mut e = b.build().unwrap();
        for s in 0..2 {
            for m in 0..2 {
                let (x, y) = batch((((s * 2 + m) * 2 + rank) * MB) as u64, MB, dims[0]);
                model
                    .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                    .unwrap();
                e.step().unwrap();
            }
        }
        let t = e.tracker();
        (
            t.tier_peak(Tier::Host),
            t.current(Tier::Host, Category::Grads),
            t.current(Tier::Nvme, Category::Grads),
            e.plan().padded_numel() as u64,
        )
    })
    .unwrap();
    out[0]
}

/// With the gradients swapped, the host tier holds one unit's gradient
/// window instead of the rank's whole gradient shard, and its peak does
/// not grow with the number of layers (without the swap it does); the
/// shard is in the nvme tier.
#[test]
fn swapped_gradients_bound_host_memory() {
    let dir = TempDir::new("gswap-bound");
    let shallow: &[usize] = &[6, 48, 48, 1];
    let deep: &[usize] = &[6, 48, 48, 48, 48, 48, 48, 48, 48, 1];
    let (peak_s, grads_s, nvme_s, psi_s) = host_bytes(shallow, true, &dir);
    let (peak_d, grads_d, nvme_d, psi_d) = host_bytes(deep, true, &dir);
    // The window: the largest unit's fp32 shard (48·48 + 48 weights and
    // biases over 2 ranks, padded), the same for both depths.
    assert_eq!(grads_s, grads_d, "the gradient window does not grow");
    assert!(
        grads_d * 4 < psi_d * 2,
        "window {grads_d} vs shard of {psi_d}"
    );
    // The nvme tier holds each rank's fp32 shard (and the file's blocks).
    assert!(
        nvme_d >= psi_d / 2 * 4 && nvme_d > nvme_s,
        "{nvme_s} {nvme_d}"
    );
    assert_eq!(
        peak_s, peak_d,
        "host peak: {peak_s} (shallow) vs {peak_d} (deep)"
    );
    // Without the swap the host gradient shard grows with the model.
    let (peak_ns, grads_ns, _, _) = host_bytes(shallow, false, &dir);
    let (peak_nd, grads_nd, _, _) = host_bytes(deep, false, &dir);
    assert_eq!(grads_ns, psi_s / 2 * 4);
    assert_eq!(grads_nd, psi_d / 2 * 4);
    assert!(peak_nd > peak_ns);
    assert!(peak_d < peak_nd, "swap {peak_d} vs no swap {peak_nd}");
    assert_no_files_left(&dir);
}

/// What one rank saw in a run with a failing gradient write.
struct GradFault {
    error: String,
    path: PathBuf,
    /// Steps that failed.
    failures: usize,
    states: Vec<UnitState>,
}

/// 2 ranks, stage `stage`, 2 micro-batches per step, 4 steps; rank 0's
/// gradient swap file fails its block write `k`. A failed step is
/// followed by `zero_grad` and the same micro-batches again.
fn grad_fault_run(stage: u8, fault: FaultPlan, dir: &Path) -> Vec<GradFault> {
    let world = 2;
    ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let c = swap_config(world, stage, 2, Precision::Bf16, (97, 3), dir);
        let mut b = Engine::builder(c, comm).seed(5);
        if rank == 0 {
            b = b.grad_swap_faults(fault.clone());
        }
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        let path = e.grad_swap_path().unwrap().to_path_buf();
        let (mut error, mut failures) = (String::new(), 0);
        let mut s = 0;
        while s < 4 {
            let mut failed = false;
            for m in 0..2 {
                let (x, y) = batch((((s * 2 + m) * world + rank) * MB) as u64, MB, DIMS[0]);
                model
                    .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                    .unwrap();
                if let Err(err) = e.step() {
                    error = err.to_string();
                    failed = true;
                    break;
                }
            }
            if failed {
                failures += 1;
                assert!(failures < 3, "rank {rank}: the step keeps failing: {error}");
                e.zero_grad().unwrap();
                continue;
            }
            s += 1;
        }
        let states = e
            .unit_ids()
            .into_iter()
            .map(|u| e.unit_state(u).unwrap())
            .collect();
        GradFault {
            error,
            path,
            failures,
            states,
        }
    })
    .unwrap()
}

/// A gradient write that fails (ENOSPC in the first or the second
/// micro-batch of a step, or from there on for three writes) fails the
/// step on every rank before anything is updated: rank 0's error names
/// its gradient swap file, the other rank's names rank 0. After
/// `zero_grad` the same micro-batches train on, and the run ends with the
/// state of the run without offload, bit for bit.
#[test]
fn a_failed_gradient_write_fails_the_step_and_loses_nothing() {
    let dir = TempDir::new("gswap-grad-fault");
    for stage in [1u8, 2, 3] {
        let reference = train(2, &config(2, stage, 2, Precision::Bf16), 4, MB).states;
        // 3 units of one block each per micro-batch: write 7 is in the
        // second step's second micro-batch, write 12 in the third step's
        // first.
        let faults = [
            FaultPlan::enospc_at(7),
            FaultPlan::enospc_at(12),
            FaultPlan {
                fail_write_count: 3,
                ..FaultPlan::enospc_at(13)
            },
        ];
        for fault in faults {
            let what = format!("stage {stage} {fault:?}");
            let ranks = grad_fault_run(stage, fault, &dir);
            for (r, d) in ranks.iter().enumerate() {
                let what = format!("{what} rank {r}");
                assert!(d.failures >= 1, "{what}: no step failed");
                if r == 0 {
                    let path = d.path.display().to_string();
                    assert!(d.error.contains(&path), "{what}: `{}`", d.error);
                    assert!(d.error.contains("No space left"), "{what}: `{}`", d.error);
                } else {
                    assert!(
                        d.error.contains("gradient swap file of rank 0"),
                        "{what}: `{}`",
                        d.error
                    );
                    assert!(d.error.contains("zero_grad"), "{what}: `{}`", d.error);
                }
                assert_bits_eq(&reference, &d.states, &what);
            }
            assert_eq!(ranks[0].failures, ranks[1].failures);
        }
    }
    assert_no_files_left(&dir);
}

/// What one rank saw in a run whose optimizer swap write fails.
struct OptFault {
    error: String,
    completed: usize,
    gather_error: String,
    step_error: String,
}

/// 2 ranks, stage 3, both offloads on nvme, gradients swapped; a
/// checkpoint after step 2 (under `ckpt`); rank 0's optimizer swap file
/// fails from write `k` on (its build writes each tile once).
fn opt_fault_run(fault: FaultPlan, dir: &Path, ckpt: &Path) -> Vec<OptFault> {
    let world = 2;
    ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let c = swap_config(world, 3, 2, Precision::Bf16, (97, 3), dir);
        let c = with_param_offload(c, OffloadDevice::Nvme, dir);
        let mut b = Engine::builder(c, comm).seed(5);
        if rank == 0 {
            b = b.swap_faults(fault.clone());
        }
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        let (mut error, mut completed) = (String::new(), 0);
        'steps: for s in 0..4 {
            for m in 0..2 {
                let (x, y) = batch((((s * 2 + m) * world + rank) * MB) as u64, MB, DIMS[0]);
                model
                    .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                    .unwrap();
                match e.step() {
                    Ok(o) => completed += usize::from(o.boundary),
                    Err(err) => {
                        error = err.to_string();
                        break 'steps;
                    }
                }
            }
            if s == 1 {
                e.save_checkpoint(ckpt, Value::Null).unwrap();
            }
        }
        let gather_error = match e.gather(e.unit_ids()[0]) {
            Ok(_) => String::new(),
            Err(err) => err.to_string(),
        };
        let step_error = match e.step() {
            Ok(_) => String::new(),
            Err(err) => err.to_string(),
        };
        OptFault {
            error,
            completed,
            gather_error,
            step_error,
        }
    })
    .unwrap()
}

/// With the gradients swapped the step streams unit by unit, so a failed
/// optimizer swap write (ENOSPC in step 3) loses the state: the step
/// fails on every rank (rank 0's error names its file, the other's names
/// rank 0), later steps and gathers refuse, and the checkpoint of step 2
/// resumes bit-identically to the run without offload.
#[test]
fn a_failed_optimizer_write_with_swapped_gradients_keeps_the_checkpoint() {
    let dir = TempDir::new("gswap-opt-fault");
    let ckpt = TempDir::new("gswap-opt-fault-ckpt");
    let reference = train(2, &config(2, 3, 2, Precision::Bf16), 4, MB).states;
    // The build writes one block per tile of 97 elements (rank 0 holds
    // about 600 elements: 7–8 tiles), each step as many again: write 30
    // is in the fourth step at the latest, after the checkpoint.
    let ranks = opt_fault_run(FaultPlan::disk_full_from(30), &dir, &ckpt);
    for (r, d) in ranks.iter().enumerate() {
        let what = format!("rank {r}");
        assert!(
            (2..4).contains(&d.completed),
            "{what}: {} steps",
            d.completed
        );
        if r == 0 {
            assert!(d.error.contains("optimizer"), "{what}: `{}`", d.error);
            assert!(d.error.contains("No space left"), "{what}: `{}`", d.error);
        } else {
            assert!(d.error.contains("rank 0"), "{what}: `{}`", d.error);
            assert!(d.error.contains("checkpoint"), "{what}: `{}`", d.error);
        }
        assert!(
            d.gather_error.contains("swap"),
            "{what}: `{}`",
            d.gather_error
        );
        assert!(d.step_error.contains("swap"), "{what}: `{}`", d.step_error);
    }
    // Resume from the checkpoint (no offload now) and train steps 3 and 4.
    let world = 2;
    let resumed = ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(config(world, 3, 2, Precision::Bf16), comm).seed(5);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let (mut e, _) = Engine::load_checkpoint(b, &ckpt).unwrap();
        for s in 2..4 {
            for m in 0..2 {
                let (x, y) = batch((((s * 2 + m) * world + rank) * MB) as u64, MB, DIMS[0]);
                model
                    .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                    .unwrap();
                e.step().unwrap();
            }
        }
        e.unit_ids()
            .into_iter()
            .map(|u| e.unit_state(u).unwrap())
            .collect::<Vec<_>>()
    })
    .unwrap();
    assert_bits_eq(&reference, &resumed[0], "resumed from the checkpoint");
    assert_no_files_left(&dir);
}

/// `swap_gradients` without nvme optimizer offload, or at stage 0, is an
/// error naming the key.
#[test]
fn swap_gradients_needs_nvme_optimizer_offload() {
    let dir = TempDir::new("gswap-keys");
    let build = |c: ResolvedConfig| {
        ThreadGroup::run(1, |comm: ThreadComm| {
            let mut b = Engine::builder(c.clone(), comm);
            Mlp::register(&mut b, DIMS).unwrap();
            b.build().map(|_| ()).unwrap_err().to_string()
        })
        .unwrap()
        .remove(0)
    };
    let mut c = swap_config(1, 2, 1, Precision::Bf16, (256, 3), &dir);
    c.zero.offload_optimizer.device = OffloadDevice::Cpu;
    let e = build(c);
    assert!(e.contains("offload_optimizer.swap_gradients"), "`{e}`");
    let mut c = config(1, 0, 1, Precision::Bf16);
    c.zero.offload_optimizer.swap_gradients = true;
    let e = build(c);
    assert!(e.contains("offload_optimizer.swap_gradients"), "`{e}`");
    // From JSON: the key is checked there too.
    let json = r#"{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2,
        "offload_optimizer": {"device": "cpu", "swap_gradients": true}}}"#;
    let auto = AutoValues {
        world_size: 1,
        ..AutoValues::default()
    };
    let e = DeepSpeedConfig::from_json_str(json)
        .and_then(|(c, _)| c.resolve(&auto))
        .unwrap_err()
        .to_string();
    assert!(e.contains("offload_optimizer.swap_gradients"), "`{e}`");
}

/// `EngineStats` counts each swap file's traffic: with 2 micro-batches
/// per step on one rank at stage 2, every unit's fp32 gradient is written
/// once per micro-batch and read twice per step (to add the second
/// micro-batch, and in the step); the optimizer file's `[master | m | v]`
/// is read and written once per step; `reset_stats` starts the counts
/// over.
#[test]
fn engine_stats_count_the_swap_traffic() {
    let dir = TempDir::new("gswap-stats");
    let (psi, per_step) = ThreadGroup::run(1, |comm| {
        let c = swap_config(1, 2, 2, Precision::Bf16, (1 << 20, 3), &dir);
        let mut b = Engine::builder(c, comm).seed(5);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        let mut per_step = Vec::new();
        for s in 0..2 {
            e.reset_stats();
            for m in 0..2 {
                let (x, y) = batch(((s * 2 + m) * MB) as u64, MB, DIMS[0]);
                model
                    .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                    .unwrap();
                e.step().unwrap();
            }
            let st = e.stats();
            per_step.push((st.grad_swap, st.optimizer_swap, st.param_swap));
        }
        (e.plan().padded_numel() as u64, per_step)
    })
    .unwrap()
    .remove(0);
    for (g, o, p) in per_step {
        assert_eq!(g.write_bytes, 2 * 4 * psi, "{g:?}");
        assert_eq!(g.read_bytes, 2 * 4 * psi, "{g:?}");
        assert_eq!(o.read_bytes, 12 * psi, "{o:?}");
        assert_eq!(o.write_bytes, 12 * psi, "{o:?}");
        assert!(g.write_wait + o.read_wait > std::time::Duration::ZERO);
        assert_eq!(p, zero::SwapTraffic::default());
    }
    assert_no_files_left(&dir);
}

/// A corrupted block of the gradient swap file (between the two
/// micro-batches of step 2, on rank 0) is caught by its checksum when the
/// second micro-batch reads the gradient back: the step fails on every
/// rank with nothing updated (rank 0's error names the file and the
/// checksum, the other rank's names rank 0), and after `zero_grad` the
/// run goes on to the state of the run without offload, bit for bit.
#[test]
fn a_corrupted_gradient_block_fails_the_step_and_loses_nothing() {
    use std::os::unix::fs::FileExt;
    let dir = TempDir::new("gswap-grad-corrupt");
    let world = 2;
    let reference = train(world, &config(world, 2, 2, Precision::Bf16), 3, MB).states;
    let out = ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let c = swap_config(world, 2, 2, Precision::Bf16, (97, 3), &dir);
        let mut b = Engine::builder(c, comm).seed(5);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        let path = e.grad_swap_path().unwrap().to_path_buf();
        let mut errors = Vec::new();
        let mut s = 0;
        let mut corrupted = false;
        while s < 3 {
            let mut failed = false;
            for m in 0..2 {
                if s == 1 && m == 1 && rank == 0 && !corrupted {
                    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                    let len = std::fs::metadata(&path).unwrap().len();
                    // Every block of the file after the header.
                    for at in (4096..len).step_by(4096) {
                        f.write_all_at(&[0xab; 16], at + 8).unwrap();
                    }
                    corrupted = true;
                }
                let (x, y) = batch((((s * 2 + m) * world + rank) * MB) as u64, MB, DIMS[0]);
                model
                    .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                    .unwrap();
                if let Err(err) = e.step() {
                    errors.push(err.to_string());
                    failed = true;
                    break;
                }
            }
            if failed {
                assert!(
                    errors.len() < 2,
                    "rank {rank}: the step keeps failing: {errors:?}"
                );
                e.zero_grad().unwrap();
                continue;
            }
            s += 1;
        }
        let states: Vec<UnitState> = e
            .unit_ids()
            .into_iter()
            .map(|u| e.unit_state(u).unwrap())
            .collect();
        (path, errors, states)
    })
    .unwrap();
    for (r, (path, errors, states)) in out.iter().enumerate() {
        assert_eq!(errors.len(), 1, "rank {r}: {errors:?}");
        if r == 0 {
            let p = path.display().to_string();
            assert!(errors[0].contains(&p), "rank 0: `{}`", errors[0]);
            assert!(errors[0].contains("checksum"), "rank 0: `{}`", errors[0]);
        } else {
            assert!(
                errors[0].contains("gradient swap file of rank 0"),
                "`{}`",
                errors[0]
            );
        }
        assert_bits_eq(&reference, states, &format!("rank {r}"));
    }
    assert_no_files_left(&dir);
}

/// A checkpoint saved with the gradients swapped loads into an engine
/// with the gradients swapped (and parameters on nvme) and without
/// offload; both continue bit-identically to the run without offload.
#[test]
fn checkpoints_round_trip_with_swapped_gradients() {
    let dir = TempDir::new("gswap-ckpt");
    let ckpt = TempDir::new("gswap-ckpt-root");
    let world = 2;
    let reference = train(world, &config(world, 3, 2, Precision::Bf16), 4, MB).states;
    let swapped = with_param_offload(
        swap_config(world, 3, 2, Precision::Bf16, (97, 3), &dir),
        OffloadDevice::Nvme,
        &dir,
    );
    let run = |c: &ResolvedConfig, from: Option<&Path>, steps: std::ops::Range<usize>| {
        ThreadGroup::run(world, |comm| {
            let rank = comm.rank();
            let mut b = Engine::builder(c.clone(), comm).seed(5);
            let model = Mlp::register(&mut b, DIMS).unwrap();
            let mut e = match from {
                Some(p) => Engine::load_checkpoint(b, p).unwrap().0,
                None => b.build().unwrap(),
            };
            for s in steps.clone() {
                for m in 0..2 {
                    let (x, y) = batch((((s * 2 + m) * world + rank) * MB) as u64, MB, DIMS[0]);
                    model
                        .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                        .unwrap();
                    e.step().unwrap();
                }
            }
            if from.is_none() {
                e.save_checkpoint(&ckpt, Value::Null).unwrap();
            }
            e.unit_ids()
                .into_iter()
                .map(|u| e.unit_state(u).unwrap())
                .collect::<Vec<UnitState>>()
        })
        .unwrap()
        .remove(0)
    };
    run(&swapped, None, 0..2);
    for (what, c) in [
        ("swapped", swapped.clone()),
        ("no offload", config(world, 3, 2, Precision::Bf16)),
    ] {
        let got = run(&c, Some(&ckpt), 2..4);
        assert_bits_eq(&reference, &got, &format!("resumed into {what}"));
    }
    assert_no_files_left(&dir);
}
