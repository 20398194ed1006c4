//! ZeRO-Offload of the optimizer state (`offload_optimizer.device` cpu and
//! nvme) and stage-3 parameter offload (`offload_param.device` cpu and
//! nvme) on the threads backend: bit-exact equivalence with the run
//! without offload (with every `pipeline_read` / `pipeline_write`
//! schedule), where the memory tracker puts each buffer, and swap file
//! faults at engine level (each an error naming the file; parameters of
//! the last good step still readable; after a failed write, the whole
//! state after the step readable and saved to a checkpoint elsewhere).

use std::path::{Path, PathBuf};

use serde_json::Value;

use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::{Category, Tier};
use zero::core::partition::{TensorSpec, UnitSpec};
use zero::core::{bf16, f16, DType};
use zero::offload::FaultPlan;
use zero::{Engine, Init};
use zero_testkit::mlp::{batch, Mlp};
use zero_testkit::runs::*;
use zero_testkit::temp::TempDir;

/// `config` with optimizer offload on `device`, small tiles cutting across
/// units, small aio blocks and `buffers` nvme staging buffers.
#[allow(clippy::too_many_arguments)]
fn offload_config(
    world: usize,
    stage: u8,
    ga: usize,
    precision: Precision,
    device: OffloadDevice,
    sub_group: usize,
    buffers: usize,
    dir: &Path,
) -> ResolvedConfig {
    let mut c = config(world, stage, ga, precision);
    c.zero.sub_group_size = sub_group;
    c.zero.offload_optimizer.device = device;
    c.zero.offload_optimizer.buffer_count = buffers;
    if device == OffloadDevice::Nvme {
        c.zero.offload_optimizer.nvme_path = Some(dir.to_path_buf());
    }
    c.zero.aio.block_size = 4096;
    c
}

// Stages 1–3 × optimizer offload {cpu, nvme} (and, at stage 3, parameter
// offload {cpu, nvme}, and swapped gradients), world sizes 1–4, on every
// backend present: bit-identical to the CPU backend's run without any
// offload. On the checked CPU backend the hazard checker proves the order
// of every offload path; on a GPU (feature `cuda`) it is the engine's
// equivalence on the device.
zero_testkit::test_device!(offload_is_bit_identical_on_every_device, |device| {
    let dir = TempDir::new(&format!("offload-device-{device:?}"));
    let steps = 4;
    use OffloadDevice::{Cpu, Nvme};
    for world in 1..=4 {
        for stage in 1..=3u8 {
            let base = train(world, &config(world, stage, 2, Precision::Bf16), steps, MB);
            let mut variants = vec![(Cpu, None, false), (Nvme, None, false)];
            if stage == 3 {
                variants.extend([(Cpu, Some(Cpu), false), (Nvme, Some(Nvme), true)]);
            }
            for (opt, param, swap) in variants {
                let mut c = offload_config(world, stage, 2, Precision::Bf16, opt, 97, 3, &dir);
                if let Some(param) = param {
                    c.zero = param_config(world, 2, param, opt, &dir).zero;
                    c.zero.prefetch_bucket_size = 0;
                }
                c.zero.offload_optimizer.swap_gradients = swap;
                let t = train_device(device, world, &c, steps, MB);
                let what = format!(
                    "{device:?} world {world} stage {stage}: offload_optimizer {opt:?} \
                     offload_param {param:?} swap_gradients {swap} vs none"
                );
                assert_same_run(&base, &t, &what);
            }
        }
    }
});

/// The offloaded optimizer as it runs on a GPU (gradient homes copied down
/// into host buffers on the device-to-host stream, the host AdamW on
/// those, the updated parameters copied up on the host-to-device stream),
/// forced on the CPU backend: on the checked and the chaos backends (the
/// hazard checker proves every copy's order; chaos runs the streams on
/// threads) it ends bit-identical to the run without offload, for every
/// stage, world sizes 1–3, cpu and nvme, and the staging buffers are in
/// the host tier.
/// Trains `steps` steps on `world` thread ranks on a CPU backend in
/// `mode`, the offload staged as on a device; rank 0's view.
fn staged_run<T: zero::core::Element>(
    world: usize,
    mode: zero::core::backend::CpuMode,
    c: &ResolvedConfig,
    steps: usize,
) -> Trained {
    ThreadGroup::run(world, |comm| {
        train_setup::<T, _>(TestDevice::Cpu(mode), comm, c, steps, MB, |b| {
            b.stage_offload_for_tests()
        })
    })
    .expect("ranks ran")
    .into_iter()
    .next()
    .expect("rank 0")
    .unwrap_or_else(|e| panic!("staged on {mode:?}: {e}"))
}

#[test]
fn the_staged_offload_of_a_device_is_ordered_and_bit_identical() {
    use zero::core::backend::{CpuBackend, CpuMode};
    let dir = TempDir::new("offload-staged");
    let steps = 4;
    for world in 1..=3 {
        for stage in 0..=3u8 {
            let ga = 2;
            let base = train(world, &config(world, stage, ga, Precision::Bf16), steps, MB);
            for device in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
                for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 3 }] {
                    let mut c =
                        offload_config(world, stage, ga, Precision::Bf16, device, 97, 3, &dir);
                    c.zero.offload_optimizer.pipeline_read = true;
                    c.zero.offload_optimizer.pipeline_write = true;
                    let t = staged_run::<bf16>(world, mode, &c, steps);
                    let what = format!(
                        "world {world} stage {stage}: staged offload {device:?} on {mode:?} vs none"
                    );
                    assert_same_run(&base, &t, &what);
                }
            }
        }
    }
    // Parameter offload (cpu, nvme) with any optimizer offload: the
    // shards go up to the gathered buffers through host buffers on the
    // host-to-device stream; without optimizer offload AdamW writes two
    // device slots whose shards go down to the homes on the
    // device-to-host stream.
    for world in 1..=3 {
        let base = train(world, &config(world, 3, 2, Precision::Bf16), steps, MB);
        for param in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
            for opt in [OffloadDevice::None, OffloadDevice::Cpu, OffloadDevice::Nvme] {
                for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 5 }] {
                    let c = param_config(world, 2, param, opt, &dir);
                    let t = staged_run::<bf16>(world, mode, &c, steps);
                    let what = format!(
                        "world {world}: staged offload_param {param:?} offload_optimizer {opt:?} \
                         on {mode:?} vs none"
                    );
                    assert_same_run(&base, &t, &what);
                }
            }
        }
    }
    // swap_gradients: the gradient window goes to and from its swap file
    // through a host buffer, copied on the communication stream.
    for world in 1..=3 {
        for stage in [1u8, 3] {
            let base = train(world, &config(world, stage, 2, Precision::Bf16), steps, MB);
            for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 6 }] {
                let mut c = offload_config(
                    world,
                    stage,
                    2,
                    Precision::Bf16,
                    OffloadDevice::Nvme,
                    97,
                    3,
                    &dir,
                );
                if stage == 3 {
                    c.zero =
                        param_config(world, 2, OffloadDevice::Nvme, OffloadDevice::Nvme, &dir).zero;
                }
                c.zero.offload_optimizer.swap_gradients = true;
                let t = staged_run::<bf16>(world, mode, &c, steps);
                let what =
                    format!("world {world} stage {stage}: staged swap_gradients on {mode:?}");
                assert_same_run(&base, &t, &what);
            }
        }
    }
    // fp16 with skipped steps (nothing is stepped, the homes are written
    // again), gradient accumulation 3, stages 1 and 3.
    for stage in [1u8, 3] {
        let base = train(2, &config(2, stage, 3, Precision::Fp16), 6, MB);
        for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 4 }] {
            let c = offload_config(
                2,
                stage,
                3,
                Precision::Fp16,
                OffloadDevice::Cpu,
                97,
                3,
                &dir,
            );
            let t = staged_run::<f16>(2, mode, &c, 6);
            assert!(t.outcomes.iter().any(|o| o.skipped), "fp16 skips steps");
            assert_same_run(
                &base,
                &t,
                &format!("fp16 stage {stage}: staged offload on {mode:?}"),
            );
        }
    }
    // The staging is there, in the host tier: a copy of the gradient
    // homes and of the parameters.
    let c = offload_config(2, 2, 1, Precision::Bf16, OffloadDevice::Cpu, 97, 3, &dir);
    let host = |staged: bool| {
        ThreadGroup::run(2, |comm| -> zero::Result<(u64, u64)> {
            let mut b =
                Engine::builder(c.clone(), comm).backend(CpuBackend::new(CpuMode::Checked)?);
            if staged {
                b = b.stage_offload_for_tests();
            }
            Mlp::register(&mut b, DIMS)?;
            let e = b.build()?;
            let t = e.tracker();
            Ok((
                t.current(Tier::Host, Category::Grads),
                t.current(Tier::Host, Category::Params),
            ))
        })
        .expect("ranks ran")
        .remove(0)
        .expect("built")
    };
    let (plain, staged) = (host(false), host(true));
    assert_eq!(plain.1, 0);
    assert_eq!(
        staged.0,
        2 * plain.0,
        "a pinned copy of every gradient home"
    );
    assert!(staged.1 > 0, "pinned parameters");
}

/// Every stage (0 included), world sizes 1–3, gradient accumulation 2 or 3
/// with clipping: cpu and nvme optimizer offload end with the parameters,
/// master, m and v of the run without offload, bit for bit, whatever the
/// tile size (tiles cut across units), the number of nvme buffers and the
/// nvme schedule (`pipeline_read`, `pipeline_write`: all four).
#[test]
fn optimizer_offload_is_bit_identical() {
    let dir = TempDir::new("offload-exact");
    let steps = 5;
    // (device, sub_group_size, buffer_count, (pipeline_read, pipeline_write))
    let off = (false, false);
    let variants = [
        (OffloadDevice::Cpu, 256, 4, off),
        (OffloadDevice::Cpu, 97, 4, off),
        (OffloadDevice::Cpu, 1 << 20, 4, off),
        (OffloadDevice::Nvme, 256, 4, off),
        (OffloadDevice::Nvme, 97, 1, off),
        (OffloadDevice::Nvme, 300, 2, off),
        (OffloadDevice::Nvme, 97, 4, (true, true)),
        (OffloadDevice::Nvme, 97, 2, (true, true)),
        (OffloadDevice::Nvme, 256, 3, (true, false)),
        (OffloadDevice::Nvme, 97, 3, (false, true)),
    ];
    for world in 1..=3 {
        for stage in 0..=3u8 {
            let ga = 2 + (stage as usize % 2);
            let base = train(world, &config(world, stage, ga, Precision::Bf16), steps, MB);
            assert_eq!(base.outcomes.len(), steps);
            for (device, sg, buffers, (read, write)) in variants {
                let mut c =
                    offload_config(world, stage, ga, Precision::Bf16, device, sg, buffers, &dir);
                c.zero.offload_optimizer.pipeline_read = read;
                c.zero.offload_optimizer.pipeline_write = write;
                let t = train(world, &c, steps, MB);
                let what = format!(
                    "world {world} stage {stage} ga {ga}: offload {device:?} sub_group {sg} \
                     buffers {buffers} pipeline_read {read} pipeline_write {write} vs none"
                );
                assert_same_run(&base, &t, &what);
            }
        }
    }
    // fp32, and fp16 with skipped steps (overflow), on 2 ranks.
    for precision in [Precision::Fp32, Precision::Fp16] {
        for stage in [1u8, 3] {
            let base = train(2, &config(2, stage, 2, precision), 6, MB);
            for device in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
                let mut c = offload_config(2, stage, 2, precision, device, 200, 3, &dir);
                c.zero.offload_optimizer.pipeline_read = true;
                c.zero.offload_optimizer.pipeline_write = true;
                let t = train(2, &c, 6, MB);
                let what = format!("{precision:?} stage {stage}: offload {device:?} vs none");
                assert_same_run(&base, &t, &what);
            }
        }
    }
    // The swap files are gone with their engines.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "swap files left behind: {left:?}");
}

/// Bytes per tier and category on rank 0, at build and after two steps.
struct Tiers {
    /// Padded parameters of the model.
    psi: u64,
    /// Elements of rank 0's optimizer state.
    state: u64,
    device_model_states: u64,
    at_build: Vec<(Tier, Category, u64)>,
    after_steps: Vec<(Tier, Category, u64)>,
}

fn tiers(world: usize, stage: u8, device: OffloadDevice, dir: &Path) -> Tiers {
    let out = ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let mut c = offload_config(world, stage, 1, Precision::Bf16, device, 256, 4, dir);
        c.grad_accum_dtype = DType::BF16;
        let mut b = Engine::builder(c, comm);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        let psi = e.plan().padded_numel() as u64;
        let state = if stage == 0 { psi } else { psi / world as u64 };
        let snap = |e: &Engine<ThreadComm>| {
            let mut v = Vec::new();
            for tier in [Tier::Device, Tier::Host, Tier::Nvme] {
                for cat in [Category::Master, Category::Moments, Category::Grads] {
                    v.push((tier, cat, e.tracker().current(tier, cat)));
                }
            }
            v
        };
        let at_build = snap(&e);
        let device_model_states = e.tracker().model_states(Tier::Device);
        for s in 0..2 {
            let (x, y) = batch(((s * world + rank) * MB) as u64, MB, DIMS[0]);
            model
                .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                .unwrap();
            e.step().unwrap();
        }
        Tiers {
            psi,
            state,
            device_model_states,
            at_build,
            after_steps: snap(&e),
        }
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

fn get(v: &[(Tier, Category, u64)], tier: Tier, cat: Category) -> u64 {
    v.iter()
        .find(|(t, c, _)| *t == tier && *c == cat)
        .map_or(0, |x| x.2)
}

/// With optimizer offload the device tier holds no fp32 master, m or v (at
/// build and between steps) and no gradient shard; they are in the host
/// tier (cpu) or the nvme tier (nvme), 4 and 8 bytes per element of the
/// rank's state, and the bf16 gradient shard is in the host tier.
#[test]
fn optimizer_state_is_not_on_the_device() {
    let dir = TempDir::new("offload-tiers");
    for world in [1, 2] {
        for stage in 0..=3u8 {
            for device in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
                let t = tiers(world, stage, device, &dir);
                let what = format!("world {world} stage {stage} {device:?}");
                let (home, other) = if device == OffloadDevice::Cpu {
                    (Tier::Host, Tier::Nvme)
                } else {
                    (Tier::Nvme, Tier::Host)
                };
                for snap in [&t.at_build, &t.after_steps] {
                    assert_eq!(get(snap, Tier::Device, Category::Master), 0, "{what}");
                    assert_eq!(get(snap, Tier::Device, Category::Moments), 0, "{what}");
                    assert_eq!(get(snap, home, Category::Master), 4 * t.state, "{what}");
                    assert_eq!(get(snap, home, Category::Moments), 8 * t.state, "{what}");
                    assert_eq!(get(snap, other, Category::Master), 0, "{what}");
                    assert_eq!(get(snap, other, Category::Moments), 0, "{what}");
                    // The bf16 gradient shard feeding AdamW.
                    assert_eq!(
                        get(snap, Tier::Host, Category::Grads),
                        2 * t.state,
                        "{what}"
                    );
                }
                // Device model states: bf16 params (full, or the shard in
                // stage 3) and, in stages 0/1, the full bf16 gradient the
                // trainer writes.
                let (psi, n) = (t.psi, world as u64);
                let want = match stage {
                    0 | 1 => 4 * psi,
                    2 => 2 * psi,
                    _ => 2 * psi / n,
                };
                assert_eq!(t.device_model_states, want, "{what}");
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Swap-file faults

#[derive(Debug, Clone, Copy, PartialEq)]
enum Damage {
    Truncate,
    Corrupt,
    Delete,
    ForeignHeader,
}

/// What one rank saw in a damaged run.
struct Damaged {
    error: String,
    completed: usize,
    path: Option<PathBuf>,
    params: Vec<Vec<u16>>,
    unit_state_error: String,
    step_error: String,
}

/// Parameters (bf16 bits) of every unit, read with gather/params.
fn read_params(e: &mut Engine<ThreadComm>) -> Vec<Vec<u16>> {
    let mut out = Vec::new();
    for u in e.unit_ids() {
        let p = e.gather(u).unwrap();
        out.push(
            p.params::<bf16>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        );
    }
    out
}

const GA: usize = 2;

/// Trains up to 6 steps on 2 ranks with nvme offload; before step 3,
/// rank 0's swap file is damaged.
fn damaged_run(stage: u8, damage: Damage, dir: &Path) -> Vec<Damaged> {
    let world = 2;
    ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let c = offload_config(
            world,
            stage,
            GA,
            Precision::Bf16,
            OffloadDevice::Nvme,
            256,
            3,
            dir,
        );
        let mut b = Engine::builder(c, comm).seed(5);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        let path = e.optimizer_swap_path().map(Path::to_path_buf);
        let mut error = String::new();
        let mut completed = 0;
        'steps: for s in 0..6 {
            if s == 2 && rank == 0 {
                let p = path.as_ref().unwrap();
                let open = || std::fs::OpenOptions::new().write(true).open(p).unwrap();
                match damage {
                    Damage::Truncate => open().set_len(4096).unwrap(),
                    Damage::Corrupt => {
                        use std::os::unix::fs::FileExt;
                        let len = std::fs::metadata(p).unwrap().len();
                        open().write_all_at(&[0xab; 64], len - 4096 + 8).unwrap();
                    }
                    Damage::Delete => std::fs::remove_file(p).unwrap(),
                    Damage::ForeignHeader => {
                        use std::os::unix::fs::FileExt;
                        open().write_all_at(b"NOTZERO!", 0).unwrap();
                    }
                }
            }
            for m in 0..GA {
                let first = (((s * GA + m) * world + rank) * MB) as u64;
                let (x, y) = batch(first, MB, DIMS[0]);
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
        }
        let unit_state_error = match e.unit_state(e.unit_ids()[0]) {
            Ok(_) => String::new(),
            Err(err) => err.to_string(),
        };
        let step_error = match e.step() {
            Ok(_) => String::new(),
            Err(err) => err.to_string(),
        };
        Damaged {
            error,
            completed,
            path,
            params: read_params(&mut e),
            unit_state_error,
            step_error,
        }
    })
    .unwrap()
}

/// Parameters after `steps` steps without offload.
fn reference_params(stage: u8, steps: usize) -> Vec<Vec<Vec<u16>>> {
    let world = 2;
    ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let c = config(world, stage, GA, Precision::Bf16);
        let mut b = Engine::builder(c, comm).seed(5);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        for s in 0..steps {
            for m in 0..GA {
                let first = (((s * GA + m) * world + rank) * MB) as u64;
                let (x, y) = batch(first, MB, DIMS[0]);
                model
                    .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                    .unwrap();
                e.step().unwrap();
            }
        }
        read_params(&mut e)
    })
    .unwrap()
}

/// A truncated, corrupted, deleted or foreign swap file: the step fails on
/// every rank with an error (rank 0's names its file), nothing panics,
/// later steps and `unit_state` refuse with a message about the swap-file
/// error (the optimizer state is lost), and the parameters of the last
/// completed step stay readable on every rank. (A failed write loses
/// nothing: `a_failed_swap_write_keeps_the_state_after_the_step`.)
#[test]
fn swap_faults_are_errors_naming_the_file() {
    let dir = TempDir::new("offload-faults");
    for stage in [1u8, 2, 3] {
        for damage in [
            Damage::Truncate,
            Damage::Corrupt,
            Damage::Delete,
            Damage::ForeignHeader,
        ] {
            let what = format!("stage {stage} {damage:?}");
            let ranks = damaged_run(stage, damage, &dir);
            let r0 = &ranks[0];
            let path = r0.path.as_ref().unwrap().display().to_string();
            assert!(r0.error.contains(&path), "{what}: `{}`", r0.error);
            let words = match damage {
                Damage::Truncate => "truncated",
                Damage::Corrupt => "checksum",
                Damage::Delete => "deleted",
                Damage::ForeignHeader => "header",
            };
            assert!(r0.error.contains(words), "{what}: `{}`", r0.error);
            // Rank 1 names rank 0 and carries its error (the file).
            assert!(
                ranks[1].error.contains("swap file of rank 0") && ranks[1].error.contains(&path),
                "{what}: `{}`",
                ranks[1].error
            );
            let completed = r0.completed;
            assert_eq!(completed, 2, "{what}");
            let reference = reference_params(stage, completed);
            for (r, d) in ranks.iter().enumerate() {
                assert_eq!(d.completed, completed, "{what} rank {r}");
                assert!(
                    d.unit_state_error.contains("swap-file error"),
                    "{what} rank {r}: `{}`",
                    d.unit_state_error
                );
                assert!(
                    d.step_error.contains("swap-file error"),
                    "{what} rank {r}: `{}`",
                    d.step_error
                );
                assert_eq!(d.params, reference[r], "{what} rank {r}: parameters");
            }
        }
    }
}

// ---------------------------------------------------------------------------
// A failed swap write keeps the state

/// Where swap writes of rank 0's second step fail (one block per tile:
/// tiles of 97 elements, 4096-byte aio blocks).
#[derive(Debug, Clone, Copy, PartialEq)]
enum WriteFail {
    /// The step's first tile.
    First,
    /// A tile in the middle.
    Middle,
    /// The step's last tile.
    Last,
    /// Every write from the step's first tile on (a full disk).
    DiskFull,
    /// The middle tile on rank 0 and the last on rank 1.
    BothRanks,
}

const FAIL_TILE: usize = 97;

/// Elements of each rank's optimizer state (its units' state ranges,
/// padding included) on 2 ranks.
fn state_elems(stage: u8) -> Vec<usize> {
    ThreadGroup::run(2, |comm| {
        let mut b = Engine::builder(config(2, stage, GA, Precision::Bf16), comm);
        Mlp::register(&mut b, DIMS).unwrap();
        let e = b.build().unwrap();
        e.plan()
            .units()
            .iter()
            .map(|u| {
                if stage == 0 {
                    u.padded_numel
                } else {
                    u.shard_len
                }
            })
            .sum()
    })
    .unwrap()
}

/// What one rank saw when writes of its second step failed.
struct Rescued {
    error: String,
    completed: usize,
    path: PathBuf,
    states: Vec<zero::UnitState>,
    params: Vec<Vec<u16>>,
    host_master: u64,
    step_error: String,
    grad_error: String,
    saved: PathBuf,
}

/// 2 ranks, nvme optimizer offload with schedule (`read`, `write`), one
/// block per tile and `aio.queue_depth` 1 (block writes happen in
/// submission order, so the faults hit the tiles planned): writes of the
/// second step fail as `fail` says. Each rank then reads the whole state
/// with `unit_state`, tries to go on, and saves a checkpoint under `ckpt`.
fn write_fault_run(
    stage: u8,
    fail: WriteFail,
    (read, write): (bool, bool),
    dir: &Path,
    ckpt: &Path,
) -> Vec<Rescued> {
    let world = 2;
    let elems = state_elems(stage);
    ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let tiles = elems[rank].div_ceil(FAIL_TILE) as u64;
        // The build writes every tile once, step 1 once more: the second
        // step's tile t is block write 2·tiles + t.
        let at = |t: u64| 2 * tiles + t;
        let faults = match (fail, rank) {
            (WriteFail::First, 0) => Some(FaultPlan::enospc_at(at(0))),
            (WriteFail::Middle | WriteFail::BothRanks, 0) => {
                Some(FaultPlan::enospc_at(at(tiles / 2)))
            }
            (WriteFail::Last, 0) | (WriteFail::BothRanks, 1) => {
                Some(FaultPlan::enospc_at(at(tiles - 1)))
            }
            (WriteFail::DiskFull, 0) => Some(FaultPlan::disk_full_from(at(0))),
            _ => None,
        };
        let mut c = offload_config(
            world,
            stage,
            GA,
            Precision::Bf16,
            OffloadDevice::Nvme,
            FAIL_TILE,
            4,
            dir,
        );
        c.zero.aio.queue_depth = 1;
        c.zero.offload_optimizer.pipeline_read = read;
        c.zero.offload_optimizer.pipeline_write = write;
        let mut b = Engine::builder(c, comm).seed(5);
        if let Some(f) = faults {
            b = b.swap_faults(f);
        }
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        let path = e.optimizer_swap_path().unwrap().to_path_buf();
        let mut error = String::new();
        let mut completed = 0;
        'steps: for s in 0..4 {
            for m in 0..GA {
                let first = (((s * GA + m) * world + rank) * MB) as u64;
                let (x, y) = batch(first, MB, DIMS[0]);
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
        }
        let states = e
            .unit_ids()
            .into_iter()
            .map(|u| {
                e.unit_state(u)
                    .unwrap_or_else(|err| panic!("rank {rank}: {err}"))
            })
            .collect();
        let host_master = e.tracker().current(Tier::Host, Category::Master);
        let step_error = e.step().map(|_| ()).unwrap_err().to_string();
        let u = e.unit_ids()[0];
        let grad_error = e
            .grad_buffer::<bf16>(u)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        let saved = e
            .save_checkpoint(ckpt, Value::Null)
            .unwrap_or_else(|err| panic!("rank {rank}: save_checkpoint: {err}"));
        Rescued {
            error,
            completed,
            path,
            states,
            params: read_params(&mut e),
            host_master,
            step_error,
            grad_error,
            saved,
        }
    })
    .unwrap()
}

/// Loads the checkpoint at `path` into 2 ranks without offload: the
/// state there, and the state after one more step (the third).
fn resume(stage: u8, path: &Path) -> (Vec<zero::UnitState>, Vec<zero::UnitState>) {
    let world = 2;
    let out = ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let mut b = Engine::builder(config(world, stage, GA, Precision::Bf16), comm).seed(5);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let (mut e, _) = Engine::load_checkpoint(b, path).unwrap();
        let read = |e: &mut Engine<ThreadComm>| -> Vec<zero::UnitState> {
            e.unit_ids()
                .into_iter()
                .map(|u| e.unit_state(u).unwrap())
                .collect()
        };
        let loaded = read(&mut e);
        let s = 2;
        for m in 0..GA {
            let first = (((s * GA + m) * world + rank) * MB) as u64;
            let (x, y) = batch(first, MB, DIMS[0]);
            model
                .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                .unwrap();
            e.step().unwrap();
        }
        (loaded, read(&mut e))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// A swap write that fails in the second step (ENOSPC injected at the
/// step's first, a middle or the last tile, every write of the step, or
/// on both ranks; every `pipeline_read` / `pipeline_write` schedule) loses
/// nothing: the step fails on every rank with an error (naming the file
/// and what was kept on the rank whose write failed, that rank on the
/// other), but it completed: `unit_state` of every unit on every rank is,
/// bit for bit, the state without offload after 2 steps (parameters
/// included: they match the master kept), the kept tiles are host-tier
/// master and moments, steps and the gradient calls are refused, and a
/// checkpoint saved to another directory holds that state and resumes
/// bit-identically.
#[test]
fn a_failed_swap_write_keeps_the_state_after_the_step() {
    let dir = TempDir::new("offload-write-fault");
    let ckpt = TempDir::new("offload-write-fault-ckpt");
    let cases = [
        (WriteFail::First, (true, true)),
        (WriteFail::Middle, (false, false)),
        (WriteFail::Last, (true, true)),
        (WriteFail::DiskFull, (true, false)),
        (WriteFail::BothRanks, (false, true)),
    ];
    for stage in 0..=3u8 {
        let elems = state_elems(stage);
        let reference = train(2, &config(2, stage, GA, Precision::Bf16), 2, MB).states;
        let reference3 = train(2, &config(2, stage, GA, Precision::Bf16), 3, MB).states;
        for (fail, schedule) in cases {
            let what = format!("stage {stage} {fail:?} pipeline (read, write) {schedule:?}");
            let root = ckpt.join(format!("stage{stage}-{fail:?}"));
            let ranks = write_fault_run(stage, fail, schedule, &dir, &root);
            for (r, d) in ranks.iter().enumerate() {
                let what = format!("{what} rank {r}");
                assert_eq!(d.completed, 1, "{what}: `{}`", d.error);
                let failed_here = r == 0 || fail == WriteFail::BothRanks;
                if failed_here {
                    let path = d.path.display().to_string();
                    assert!(d.error.contains(&path), "{what}: `{}`", d.error);
                    assert!(d.error.contains("No space left"), "{what}: `{}`", d.error);
                    assert!(
                        d.error.contains("kept in host memory"),
                        "{what}: `{}`",
                        d.error
                    );
                } else {
                    assert!(
                        d.error.contains("swap file of rank 0"),
                        "{what}: `{}`",
                        d.error
                    );
                }
                assert_bits_eq(&reference, &d.states, &format!("{what}: unit_state"));
                // gather/params give the same parameters.
                for (u, p) in d.params.iter().enumerate() {
                    let want: Vec<u16> = reference[u]
                        .params
                        .iter()
                        .map(|&x| bf16::from_f32(x).to_bits())
                        .collect();
                    assert_eq!(p, &want, "{what}: unit {u} params");
                }
                // The kept tiles are host-tier state.
                let kept = match (fail, r) {
                    (_, 1) if fail != WriteFail::BothRanks => 0,
                    (WriteFail::DiskFull, _) => elems[r],
                    (WriteFail::Last, _) | (WriteFail::BothRanks, 1) => {
                        elems[r] - (elems[r].div_ceil(FAIL_TILE) - 1) * FAIL_TILE
                    }
                    _ => FAIL_TILE,
                };
                assert_eq!(d.host_master, 4 * kept as u64, "{what}: host master bytes");
                for msg in [&d.step_error, &d.grad_error] {
                    assert!(msg.contains("swap-file error"), "{what}: `{msg}`");
                    assert!(msg.contains("save_checkpoint"), "{what}: `{msg}`");
                }
                assert_eq!(d.saved, ranks[0].saved, "{what}");
            }
            let (loaded, next) = resume(stage, &ranks[0].saved);
            assert_bits_eq(&reference, &loaded, &format!("{what}: checkpoint"));
            assert_bits_eq(&reference3, &next, &format!("{what}: resumed step 3"));
        }
    }
    let left: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "swap files left behind: {left:?}");
}

/// Settings the engine cannot run are errors naming the key.
#[test]
fn unsupported_offload_settings_name_the_key() {
    // Swap files would go below the temp dir, which the refused builds
    // must not create.
    let tmp = TempDir::new("offload-keys");
    let dir = tmp.join("swap");
    let build = |c: ResolvedConfig| {
        ThreadGroup::run(1, |comm| {
            let mut b = Engine::builder(c.clone(), comm);
            Mlp::register(&mut b, DIMS).unwrap();
            b.build().map(|_| ()).unwrap_err().to_string()
        })
        .unwrap()
        .remove(0)
    };
    let mut c = offload_config(1, 2, 1, Precision::Bf16, OffloadDevice::Nvme, 256, 4, &dir);
    c.zero.offload_optimizer.nvme_path = None;
    let m = build(c);
    assert!(
        m.contains("zero_optimization.offload_optimizer.nvme_path"),
        "{m}"
    );
    let mut c = offload_config(1, 3, 1, Precision::Bf16, OffloadDevice::Cpu, 256, 4, &dir);
    c.zero.offload_optimizer.ratio = 0.5;
    let m = build(c);
    assert!(
        m.contains("zero_optimization.offload_optimizer.ratio"),
        "{m}"
    );
    // Parameter offload needs stage 3.
    for (stage, device) in [
        (0u8, OffloadDevice::Cpu),
        (1, OffloadDevice::Nvme),
        (2, OffloadDevice::Cpu),
        (2, OffloadDevice::Nvme),
    ] {
        let mut c = config(1, stage, 1, Precision::Bf16);
        c.zero.offload_param.device = device;
        c.zero.offload_param.nvme_path = Some(dir.to_path_buf());
        let m = build(c);
        assert!(m.contains("zero_optimization.offload_param.device"), "{m}");
    }
    // nvme parameter offload needs nvme_path.
    let mut c = param_config(1, 1, OffloadDevice::Nvme, OffloadDevice::None, &dir);
    c.zero.offload_param.nvme_path = None;
    let m = build(c);
    assert!(
        m.contains("zero_optimization.offload_param.nvme_path"),
        "{m}"
    );
    // The staging buffers must hold the largest unit shard (1024 elements
    // and more on one rank).
    let mut c = param_config(1, 1, OffloadDevice::Nvme, OffloadDevice::None, &dir);
    c.zero.offload_param.buffer_size = 999;
    let m = build(c);
    assert!(
        m.contains("zero_optimization.offload_param.buffer_size"),
        "{m}"
    );
    // Swap files larger than the disk: refused before anything is
    // allocated or written (a unit of 2^38 elements: 3 TiB of optimizer
    // state), naming the path and both figures.
    ThreadGroup::run(1, |comm| {
        let mut c = offload_config(1, 2, 1, Precision::Bf16, OffloadDevice::Nvme, 256, 4, &dir);
        c.zero.sub_group_size = 1 << 30;
        let mut b = Engine::builder(c, comm);
        b.register(
            UnitSpec::new("huge", vec![TensorSpec::new("w", &[1 << 38])]),
            vec![Init::Zeros],
        )
        .unwrap();
        let m = b.build().map(|_| ()).unwrap_err().to_string();
        let path = dir.display().to_string();
        for part in [
            path.as_str(),
            "not enough free disk space",
            "of optimizer swap files (",
            "× 1 rank(s) here)",
            "bytes are free",
        ] {
            assert!(m.contains(part), "{part}: {m}");
        }
        assert!(!dir.exists(), "nothing was created under {}", dir.display());
    })
    .unwrap();
    // A swap file that cannot be created (nvme_path is a file).
    let file = tmp.join("file");
    std::fs::write(&file, b"x").unwrap();
    let mut c = offload_config(1, 2, 1, Precision::Bf16, OffloadDevice::Nvme, 256, 4, &dir);
    c.zero.offload_optimizer.nvme_path = Some(file.clone());
    let m = build(c);
    assert!(m.contains(&file.display().to_string()), "{m}");
}

// ---------------------------------------------------------------------------
// Stage-3 parameter offload

/// Stage 3, GA 2, clipping on, with the parameter shards offloaded to
/// `param` and the optimizer state to `opt`; a small prefetch window (300
/// elements: small units are gathered ahead, the 1024-element one only
/// read ahead from the swap file) and small nvme staging buffers (the largest unit shard, padded, on one rank is
/// 1024 elements; 4 buffers: 3 reads run ahead).
fn param_config(
    world: usize,
    ga: usize,
    param: OffloadDevice,
    opt: OffloadDevice,
    dir: &Path,
) -> ResolvedConfig {
    let mut c = offload_config(world, 3, ga, Precision::Bf16, opt, 97, 3, dir);
    c.zero.prefetch_bucket_size = 300;
    let p = &mut c.zero.offload_param;
    p.device = param;
    p.buffer_count = 4;
    p.buffer_size = 1024;
    // nvme: no host cache of shards, every gather reads the swap file;
    // cpu: no part (as in DeepSpeed), though smaller than the shards.
    p.max_in_cpu = 0;
    if param == OffloadDevice::Nvme {
        p.nvme_path = Some(dir.join("params"));
    }
    c
}

/// Stage 3 × offload_param {cpu, nvme} × offload_optimizer {none, cpu,
/// nvme}, world sizes 1–3, GA 2, clipping: the same parameters, master, m,
/// v, losses and outcomes as the run without any offload, bit for bit;
/// with and without persistent units.
#[test]
fn param_offload_is_bit_identical() {
    let dir = TempDir::new("offload-param-exact");
    let steps = 5;
    for world in 1..=3 {
        for persistence in [0usize, 200] {
            let mut base_cfg = config(world, 3, 2, Precision::Bf16);
            base_cfg.zero.prefetch_bucket_size = 300;
            base_cfg.zero.param_persistence_threshold = persistence;
            let base = train(world, &base_cfg, steps, MB);
            assert_eq!(base.outcomes.len(), steps);
            for param in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
                for opt in [OffloadDevice::None, OffloadDevice::Cpu, OffloadDevice::Nvme] {
                    let mut c = param_config(world, 2, param, opt, &dir);
                    c.zero.param_persistence_threshold = persistence;
                    let t = train(world, &c, steps, MB);
                    let what = format!(
                        "world {world} persistence {persistence}: offload_param {param:?} \
                         offload_optimizer {opt:?} vs none"
                    );
                    assert_same_run(&base, &t, &what);
                }
            }
        }
    }
    // fp32, and fp16 with skipped steps (overflow: nothing is written
    // back), on 2 ranks.
    for precision in [Precision::Fp32, Precision::Fp16] {
        let mut base_cfg = config(2, 3, 2, precision);
        base_cfg.zero.prefetch_bucket_size = 300;
        let base = train(2, &base_cfg, 6, MB);
        for (param, opt) in [
            (OffloadDevice::Cpu, OffloadDevice::None),
            (OffloadDevice::Nvme, OffloadDevice::Cpu),
            (OffloadDevice::Nvme, OffloadDevice::Nvme),
        ] {
            let mut c = config(2, 3, 2, precision);
            c.zero = param_config(2, 2, param, opt, &dir).zero;
            let t = train(2, &c, 6, MB);
            let what = format!("{precision:?}: offload_param {param:?} offload_optimizer {opt:?}");
            assert_same_run(&base, &t, &what);
        }
    }
    let left: Vec<_> = std::fs::read_dir(dir.join("params"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "param swap files left behind: {left:?}");
}

/// With parameter offload the device tier holds no parameter shard (at
/// build and between steps; gathered units are GatheredParams and are
/// freed at the end of each micro-batch): the bf16 shards are in the host
/// tier (cpu) or the nvme tier (nvme), 2 bytes per element of the rank's
/// shards.
#[test]
fn param_offload_keeps_no_params_on_the_device() {
    let dir = TempDir::new("offload-param-tiers");
    for world in [1, 2] {
        for param in [OffloadDevice::Cpu, OffloadDevice::Nvme] {
            for opt in [OffloadDevice::None, OffloadDevice::Nvme] {
                let out = ThreadGroup::run(world, |comm| {
                    let rank = comm.rank();
                    let c = param_config(world, 1, param, opt, &dir);
                    let mut b = Engine::builder(c, comm);
                    let model = Mlp::register(&mut b, DIMS).unwrap();
                    let mut e = b.build().unwrap();
                    let psi = e.plan().padded_numel() as u64;
                    let snap = |e: &Engine<ThreadComm>| {
                        [Tier::Device, Tier::Host, Tier::Nvme]
                            .map(|t| e.tracker().current(t, Category::Params))
                    };
                    let mut snaps = vec![snap(&e)];
                    for s in 0..2 {
                        let (x, y) = batch(((s * world + rank) * MB) as u64, MB, DIMS[0]);
                        model
                            .train_micro_batch::<bf16, _, _>(&mut e, &x, &y)
                            .unwrap();
                        e.step().unwrap();
                        snaps.push(snap(&e));
                    }
                    let ahead = e.stats().param_reads_ahead;
                    (psi, snaps, ahead, e.param_swap_path().is_some())
                })
                .unwrap();
                for (psi, snaps, ahead, has_file) in out {
                    let what = format!("world {world} param {param:?} opt {opt:?}");
                    let shard = 2 * psi / world as u64;
                    assert_eq!(has_file, param == OffloadDevice::Nvme, "{what}");
                    // nvme: the second micro-batch follows the recorded
                    // order, so shard reads run ahead of the gathers.
                    assert_eq!(ahead > 0, param == OffloadDevice::Nvme, "{what}: {ahead}");
                    for [device, host, nvme] in snaps {
                        assert_eq!(device, 0, "{what}: params on the device tier");
                        let (want_host, want_nvme) = if param == OffloadDevice::Cpu {
                            (shard, 0)
                        } else {
                            (0, shard)
                        };
                        assert_eq!(host, want_host, "{what}");
                        assert_eq!(nvme, want_nvme, "{what}");
                    }
                }
            }
        }
    }
}

/// The shard length of every unit on one rank, and the host-tier
/// parameter bytes of an engine built with nvme parameter offload and
/// `max_in_cpu` elements of cache.
fn cache_layout(world: usize, max_in_cpu: usize, dir: &Path) -> (Vec<usize>, u64) {
    let out = ThreadGroup::run(world, |comm| {
        let mut c = param_config(world, 2, OffloadDevice::Nvme, OffloadDevice::None, dir);
        c.zero.offload_param.max_in_cpu = max_in_cpu;
        let mut b = Engine::builder(c, comm);
        Mlp::register(&mut b, DIMS).unwrap();
        let e = b.build().unwrap();
        let lens: Vec<usize> = e.plan().units().iter().map(|u| u.shard_len).collect();
        (lens, e.tracker().current(Tier::Host, Category::Params))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// nvme parameter offload with a host cache of `max_in_cpu` elements: no
/// cache (0), part of the rank's shard, all of it, and DeepSpeed's default
/// (1e9): bit-identical to the run without offload, with or without
/// optimizer offload. The cache is in the host tier and saves reads: with
/// the whole shard cached nothing is read from the swap file at all
/// (every gather is a cache hit).
#[test]
fn param_cache_is_bit_identical_and_saves_swap_reads() {
    let dir = TempDir::new("offload-param-cache");
    let steps = 4;
    for world in [1, 2] {
        let (lens, none_host) = cache_layout(world, 0, &dir);
        assert_eq!(none_host, 0, "world {world}: no cache, no host params");
        let total: usize = lens.iter().sum();
        let (_, whole_host) = cache_layout(world, total, &dir);
        assert!(
            whole_host >= 2 * total as u64 && whole_host < 2 * total as u64 + 4096 * 4,
            "world {world}: cache of {total} bf16 elements holds {whole_host} host bytes"
        );
        // Part of it: the first unit's shard (plus a little), not the
        // largest one.
        let part = lens[0] + 1;
        assert!(part < total, "{lens:?}");
        let mut base_cfg = config(world, 3, 2, Precision::Bf16);
        base_cfg.zero.prefetch_bucket_size = 300;
        let base = train(world, &base_cfg, steps, MB);
        for opt in [OffloadDevice::None, OffloadDevice::Cpu, OffloadDevice::Nvme] {
            let mut reads = Vec::new();
            for max_in_cpu in [0, part, total, 1_000_000_000] {
                let mut c = param_config(world, 2, OffloadDevice::Nvme, opt, &dir);
                c.zero.offload_param.max_in_cpu = max_in_cpu;
                let t = train(world, &c, steps, MB);
                let what = format!("world {world} opt {opt:?} max_in_cpu {max_in_cpu}");
                assert_same_run(&base, &t, &what);
                let st = &t.stats;
                if max_in_cpu == 0 {
                    assert_eq!(st.param_cache_hits, 0, "{what}");
                } else {
                    assert!(st.param_cache_hits > 0, "{what}: {st:?}");
                }
                reads.push(st.param_swap_reads);
            }
            let what = format!("world {world} opt {opt:?}: swap reads {reads:?}");
            assert!(reads[0] > reads[1], "{what}");
            assert!(reads[1] > 0, "{what}");
            assert_eq!(reads[2], 0, "{what}");
            assert_eq!(reads[3], 0, "{what}");
        }
    }
    let left: Vec<_> = std::fs::read_dir(dir.join("params"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "param swap files left behind: {left:?}");
}

/// How a parameter swap file is damaged before step 3 (or, for a write
/// fault, during step 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ParamDamage {
    Truncate,
    Delete,
    /// One byte of the last unit's data block flipped.
    Corrupt,
    /// ENOSPC injected into a block write of the second step's write-back.
    WriteFault,
}

/// What one rank saw when its parameter swap file was damaged.
struct ParamDamaged {
    error: String,
    completed: usize,
    path: PathBuf,
    gather_error: String,
    step_error: String,
}

/// 2 ranks, nvme parameter offload (optimizer state `opt`), no host
/// cache: rank 0's parameter swap file is damaged before step 3, or one
/// of its block writes fails in step 2.
fn param_damaged_run(opt: OffloadDevice, damage: ParamDamage, dir: &Path) -> Vec<ParamDamaged> {
    let world = 2;
    ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let c = param_config(world, GA, OffloadDevice::Nvme, opt, dir);
        let units = DIMS.len() as u64 - 1;
        let mut b = Engine::builder(c, comm).seed(5);
        if damage == ParamDamage::WriteFault && rank == 0 {
            // Each unit shard is one block: the build writes each once,
            // step 1 each once; fail the second unit of step 2.
            b = b.param_swap_faults(FaultPlan::enospc_at(2 * units + 1));
        }
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        let path = e.param_swap_path().unwrap().to_path_buf();
        let mut error = String::new();
        let mut completed = 0;
        'steps: for s in 0..6 {
            if s == 2 && rank == 0 {
                let open = || std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                match damage {
                    ParamDamage::Delete => std::fs::remove_file(&path).unwrap(),
                    ParamDamage::Truncate => open().set_len(4096).unwrap(),
                    ParamDamage::Corrupt => {
                        use std::os::unix::fs::FileExt;
                        let at = std::fs::metadata(&path).unwrap().len() - 4096 + 8;
                        let f = std::fs::OpenOptions::new()
                            .read(true)
                            .write(true)
                            .open(&path)
                            .unwrap();
                        let mut byte = [0u8];
                        f.read_exact_at(&mut byte, at).unwrap();
                        f.write_all_at(&[byte[0] ^ 0x10], at).unwrap();
                    }
                    ParamDamage::WriteFault => {}
                }
            }
            for m in 0..GA {
                let first = (((s * GA + m) * world + rank) * MB) as u64;
                let (x, y) = batch(first, MB, DIMS[0]);
                // The micro-batch runs (a failed read feeds zeros, so that
                // no rank leaves the collectives); step reports it.
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
        }
        let u = e.unit_ids()[0];
        let gather_error = match e.gather(u) {
            Ok(_) => String::new(),
            Err(err) => err.to_string(),
        };
        let step_error = match e.step() {
            Ok(_) => String::new(),
            Err(err) => err.to_string(),
        };
        ParamDamaged {
            error,
            completed,
            path,
            gather_error,
            step_error,
        }
    })
    .unwrap()
}

/// A truncated, deleted or corrupted parameter swap file, or a failed
/// write-back (ENOSPC injected with `param_swap_faults`): the step fails
/// on every rank (rank 0's error names its file, rank 1's names rank 0),
/// nothing panics or hangs, and later gathers and steps refuse with a
/// message about the swap-file error (the shards lived only in the
/// files).
#[test]
fn param_swap_faults_are_errors_naming_the_file() {
    let dir = TempDir::new("offload-param-faults");
    for opt in [OffloadDevice::None, OffloadDevice::Cpu, OffloadDevice::Nvme] {
        for damage in [
            ParamDamage::Truncate,
            ParamDamage::Delete,
            ParamDamage::Corrupt,
            ParamDamage::WriteFault,
        ] {
            let what = format!("opt {opt:?} {damage:?}");
            let ranks = param_damaged_run(opt, damage, &dir);
            let r0 = &ranks[0];
            let path = r0.path.display().to_string();
            assert!(r0.error.contains(&path), "{what}: `{}`", r0.error);
            let words = match damage {
                ParamDamage::Delete => "deleted",
                ParamDamage::Truncate => "truncated",
                ParamDamage::Corrupt => "checksum",
                ParamDamage::WriteFault => "No space left",
            };
            assert!(r0.error.contains(words), "{what}: `{}`", r0.error);
            // Rank 1 names rank 0 and carries its error (the file).
            assert!(
                ranks[1].error.contains("parameter swap file of rank 0")
                    && ranks[1].error.contains(&path),
                "{what}: `{}`",
                ranks[1].error
            );
            let want_completed = if damage == ParamDamage::WriteFault {
                1
            } else {
                2
            };
            for (r, d) in ranks.iter().enumerate() {
                assert_eq!(d.completed, want_completed, "{what} rank {r}");
                assert!(
                    d.gather_error.contains("parameters are lost"),
                    "{what} rank {r}: `{}`",
                    d.gather_error
                );
                assert!(
                    d.step_error.contains("swap-file error"),
                    "{what} rank {r}: `{}`",
                    d.step_error
                );
            }
        }
    }
}

/// cpu parameter offload with an nvme optimizer whose swap file breaks:
/// the parameter shards are written home only after every rank's
/// optimizer step succeeded, so the parameters of the last completed step
/// stay readable with gather/params.
#[test]
fn cpu_param_offload_keeps_params_after_an_optimizer_swap_fault() {
    let dir = TempDir::new("offload-param-opt-fault");
    let world = 2;
    let ranks = ThreadGroup::run(world, |comm| {
        let rank = comm.rank();
        let c = param_config(world, GA, OffloadDevice::Cpu, OffloadDevice::Nvme, &dir);
        let mut b = Engine::builder(c, comm).seed(5);
        let model = Mlp::register(&mut b, DIMS).unwrap();
        let mut e = b.build().unwrap();
        let path = e.optimizer_swap_path().unwrap().to_path_buf();
        let mut completed = 0;
        let mut error = String::new();
        'steps: for s in 0..6 {
            if s == 2 && rank == 0 {
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                f.set_len(4096).unwrap();
            }
            for m in 0..GA {
                let first = (((s * GA + m) * world + rank) * MB) as u64;
                let (x, y) = batch(first, MB, DIMS[0]);
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
        }
        (completed, error, path, read_params(&mut e))
    })
    .unwrap();
    let reference = reference_params(3, 2);
    for (r, (completed, error, path, params)) in ranks.into_iter().enumerate() {
        assert_eq!(completed, 2, "rank {r}");
        if r == 0 {
            assert!(error.contains(&path.display().to_string()), "`{error}`");
        } else {
            assert!(error.contains("swap file of rank 0"), "`{error}`");
        }
        assert_eq!(params, reference[r], "rank {r}: parameters");
    }
}
