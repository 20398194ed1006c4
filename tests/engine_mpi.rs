//! The engine under `mpirun` with the MPI backend (`harness = false`,
//! feature `mpi`): the stage equivalence of `tests/engine.rs` across
//! processes, and agreement with the threads backend.
//!
//! Run directly (`cargo test --test engine_mpi`), this binary is the
//! *driver*: it trains every case on the threads backend first (the
//! reference, every rank's view), writes the results to a file, then starts
//! itself under `mpirun` for each [`Run`]:
//!
//! - `-n 2` on one node: stages 0–3 x gradient accumulation 1 and 3 x fp32,
//!   bf16 and fp16 (dynamic loss scale from 2^17, so the first steps
//!   overflow and are skipped). Within a node the MPI backend reduces in
//!   shared memory with the threads backend's algorithms (f32 accumulation
//!   in rank order), so every check is bit for bit: parameters, fp32
//!   master, m and v (`Engine::unit_state`), step outcomes and losses, of
//!   stages 1–3 against stage 0 and of every case against the threads
//!   backend at world size 2. Plus optimizer offload groups (cpu and nvme
//!   in bf16 with accumulation 3, nvme in fp16 with overflow skips), tiles
//!   of 256 elements, checked the same way. Plus stage-3 parameter offload
//!   groups (`offload_param` cpu, and nvme with `max_in_cpu` 0, 200 and
//!   the default 1e9, each with cpu optimizer offload), checked bit for bit
//!   against the threads backend and against stage 0. Plus exact resume
//!   (stage 1, stage 3, and stage 3 with nvme optimizer offload and
//!   accumulation 3): 3 steps, `save_checkpoint` (each rank writes its
//!   shard into a directory shared by the ranks), the engine and its
//!   communicator dropped, `load_checkpoint` into a fresh engine on a fresh
//!   communicator, 3 more steps; bit for bit the uninterrupted 6-step run
//!   (on MPI, and on the threads backend).
//! - `-n 4` with `ZERO_MPI_SIMULATE_NODES=2` (two pseudo-nodes of two
//!   ranks): fp32, gradient accumulation 3, stages 0–3. Between the nodes
//!   partial sums meet in MPI's own collectives, whose order of summation is
//!   not rank order, so results are compared within [`NODES_TOL`].
//!
//! Each run has a wall-clock limit, so a hang fails the test; a missing
//! `mpirun` is a failure, not a skip. Started by `mpirun` (as a *worker*),
//! every rank trains each case on a fresh [`MpiComm`], checks that all
//! ranks hold rank 0's state, prints one line per check and, last,
//! `engine_mpi: N passed, M failed (rank R)`; the driver adds them up and
//! ends with `engine_mpi: N passed, M failed`. Started by hand
//! (`scripts/mpirun.sh -n 2 target/debug/deps/engine_mpi-<hash>`), a worker
//! picks the run by its number of ranks and computes its own references.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use zero::comm::{launch, launched_by_mpi, Comm, CommOptions, Communicator, MpiComm, ThreadGroup};
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::optim::LossScaleConfig;
use zero::core::{bf16, f16, HostBuffer};

use zero_testkit::mlp::{batch, Mlp};
use zero_testkit::runs::{train_with, Trained, DIMS, MB};

const STEPS: usize = 6;

/// Largest |Δ| allowed between fp32 master weights (and parameters) of the
/// simulated two-node run and of another stage or the threads backend.
///
/// Between the pseudo-nodes gradients are summed by MPI: stage 0's
/// all-reduce is hierarchical (each node's two ranks in shared memory, then
/// the node partials in MPI), stages 1–3 reduce-scatter with MPI's
/// `MPI_Ireduce_scatter` over all four ranks. So the ranks' terms are added
/// as `(g0 + g1) + (g2 + g3)` or in whatever order MPI's algorithm picks,
/// not the threads backend's `((g0 + g1) + g2) + g3`: gradients differ by an
/// ulp or two. AdamW divides by sqrt(v), which keeps relative errors at that
/// size, so after 6 steps of lr 1e-2 the master weights (|w| < 1) move apart
/// by about 1e-7 (`tests/engine.rs` measures 1.2e-7 for a larger change of
/// summation order); 1e-5 leaves two orders of magnitude. Measured with Open
/// MPI 4.1.4: 6e-8 against the threads backend, 0 between stages (its
/// reduce-scatter gives the hierarchical all-reduce's sums here). The measured
/// maxima are printed as a note.
const NODES_TOL: f32 = 1e-5;

/// Relative tolerance on gradient norms and losses in the simulated
/// two-node run (they follow from gradients and weights that differ by a
/// few ulps).
const NODES_REL_TOL: f64 = 1e-4;

const RUN_ENV: &str = "ZERO_ENGINE_MPI_RUN";
const REF_ENV: &str = "ZERO_ENGINE_MPI_REF";
/// The directory the ranks save checkpoints into (the driver's, removed by
/// it at the end).
const CKPT_ENV: &str = "ZERO_ENGINE_MPI_CKPT";

fn main() {
    let code = if launched_by_mpi() {
        worker()
    } else {
        driver()
    };
    std::process::exit(code);
}

// ───────────────────────────── cases ─────────────────────────────

/// One mpirun: its ranks, environment and cases.
struct Run {
    name: &'static str,
    ranks: usize,
    env: &'static [(&'static str, &'static str)],
    precisions: &'static [Precision],
    gas: &'static [usize],
    /// Extra groups with optimizer offload: (precision, ga, device).
    offloads: &'static [(Precision, usize, OffloadDevice)],
    /// Extra groups with stage-3 parameter offload and cpu optimizer
    /// offload: (precision, ga, `offload_param.device`,
    /// `offload_param.max_in_cpu`). Each group is stage 0 with cpu
    /// optimizer offload, then stage 3 with the parameters offloaded.
    param_offloads: &'static [(Precision, usize, OffloadDevice, usize)],
    /// Exact-resume cases: (precision, ga, stage, optimizer offload).
    /// Each must also be a case of the groups above (its uninterrupted
    /// run is the reference).
    resumes: &'static [(Precision, usize, u8, OffloadDevice)],
    /// `None`: bit-identical; `Some(tol)`: master weights within `tol`.
    tol: Option<f32>,
    limit: Duration,
}

/// DeepSpeed's default `offload_param.max_in_cpu` (1e9 elements).
const DEFAULT_MAX_IN_CPU: usize = 1_000_000_000;

const RUNS: &[Run] = &[
    Run {
        name: "one-node",
        ranks: 2,
        env: &[("ZERO_MPI_SHM_POOL", "64M")],
        precisions: &[Precision::Fp32, Precision::Bf16, Precision::Fp16],
        gas: &[1, 3],
        offloads: &[
            (Precision::Bf16, 3, OffloadDevice::Cpu),
            (Precision::Bf16, 3, OffloadDevice::Nvme),
            (Precision::Fp16, 1, OffloadDevice::Nvme),
        ],
        param_offloads: &[
            (Precision::Bf16, 3, OffloadDevice::Cpu, DEFAULT_MAX_IN_CPU),
            // No host cache: every gather reads the swap file.
            (Precision::Bf16, 3, OffloadDevice::Nvme, 0),
            // A cache of part of the shard (LRU).
            (Precision::Bf16, 3, OffloadDevice::Nvme, 200),
            // DeepSpeed's default: the whole shard cached.
            (Precision::Fp16, 1, OffloadDevice::Nvme, DEFAULT_MAX_IN_CPU),
        ],
        resumes: &[
            (Precision::Bf16, 1, 1, OffloadDevice::None),
            (Precision::Bf16, 1, 3, OffloadDevice::None),
            (Precision::Bf16, 3, 3, OffloadDevice::Nvme),
        ],
        tol: None,
        limit: Duration::from_secs(60),
    },
    Run {
        name: "two-pseudo-nodes",
        ranks: 4,
        env: &[
            ("ZERO_MPI_SIMULATE_NODES", "2"),
            ("ZERO_MPI_SHM_POOL", "64M"),
        ],
        precisions: &[Precision::Fp32],
        gas: &[3],
        offloads: &[],
        param_offloads: &[],
        resumes: &[],
        tol: Some(NODES_TOL),
        limit: Duration::from_secs(60),
    },
];

#[derive(Clone, Copy, Debug)]
struct Case {
    precision: Precision,
    ga: usize,
    stage: u8,
    offload: OffloadDevice,
    /// `offload_param.device` (stage 3 only).
    param: OffloadDevice,
    /// `offload_param.max_in_cpu`.
    max_in_cpu: usize,
}

impl Case {
    fn new(precision: Precision, ga: usize, stage: u8, offload: OffloadDevice) -> Case {
        Case {
            precision,
            ga,
            stage,
            offload,
            param: OffloadDevice::None,
            max_in_cpu: DEFAULT_MAX_IN_CPU,
        }
    }

    fn key(&self, world: usize) -> String {
        let offload = match self.offload {
            OffloadDevice::None => String::new(),
            d => format!(" offload {d:?}"),
        };
        let param = match self.param {
            OffloadDevice::None => String::new(),
            d => format!(" offload_param {d:?} max_in_cpu {}", self.max_in_cpu),
        };
        format!(
            "world {world} {:?} ga {} stage {}{offload}{param}",
            self.precision, self.ga, self.stage
        )
    }
}

impl Run {
    /// Cases grouped by (precision, ga), stages 0–3 within each group;
    /// then the parameter-offload groups (stage 0, then stage 3 with the
    /// parameters offloaded). The first case of a group is its baseline.
    fn groups(&self) -> Vec<Vec<Case>> {
        let mut out = Vec::new();
        for &precision in self.precisions {
            for &ga in self.gas {
                out.push(
                    (0..4)
                        .map(|stage| Case::new(precision, ga, stage, OffloadDevice::None))
                        .collect(),
                );
            }
        }
        for &(precision, ga, offload) in self.offloads {
            out.push(
                (0..4)
                    .map(|stage| Case::new(precision, ga, stage, offload))
                    .collect(),
            );
        }
        for &(precision, ga, param, max_in_cpu) in self.param_offloads {
            let base = Case::new(precision, ga, 0, OffloadDevice::Cpu);
            out.push(vec![
                base,
                Case {
                    stage: 3,
                    param,
                    max_in_cpu,
                    ..base
                },
            ]);
        }
        out
    }
}

fn config(world: usize, case: Case) -> ResolvedConfig {
    let Case {
        precision,
        ga,
        stage,
        offload,
        param,
        max_in_cpu,
    } = case;
    let mut c = ResolvedConfig::simple(stage, world, MB);
    c.gradient_accumulation_steps = ga;
    c.train_batch_size = MB * ga * world;
    c.precision = precision;
    c.optimizer.lr = 1e-2;
    c.scheduler = zero::core::optim::LrSchedule::Constant { lr: 1e-2 };
    c.gradient_clipping = 1.0;
    // Small buckets: several per step, so bucketing is exercised.
    c.zero.reduce_bucket_size = 700;
    c.zero.allgather_bucket_size = 900;
    c.zero.prefetch_bucket_size = 1500;
    c.zero.param_persistence_threshold = 0;
    if offload != OffloadDevice::None {
        // Optimizer offload: tiles that cut across units, small aio blocks.
        c.zero.offload_optimizer.device = offload;
        c.zero.offload_optimizer.nvme_path =
            Some(std::env::temp_dir().join("zero-engine-mpi-swap"));
        c.zero.sub_group_size = 256;
        c.zero.aio.block_size = 4096;
    }
    if param != OffloadDevice::None {
        // Stage-3 parameter offload: the shards in host memory or in a
        // swap file (with a host cache of max_in_cpu elements), small
        // staging buffers so that reads run ahead of the gathers.
        let p = &mut c.zero.offload_param;
        p.device = param;
        p.max_in_cpu = max_in_cpu;
        p.buffer_count = 4;
        p.buffer_size = 1024;
        if param == OffloadDevice::Nvme {
            p.nvme_path = Some(std::env::temp_dir().join("zero-engine-mpi-param-swap"));
        }
    }
    if precision == Precision::Fp16 {
        // 2^17 overflows f16 gradients at first: the run skips steps and
        // lowers the scale, then trains.
        c.loss_scale = Some(LossScaleConfig::Dynamic {
            initial_scale_power: 17,
            window: 3,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_scale: 1.0,
        });
    }
    c
}

// ───────────────────────────── training ─────────────────────────────

fn train<C: Communicator>(comm: C, case: Case) -> zero::Result<Record> {
    let cfg = config(comm.world_size(), case);
    let t = match case.precision {
        Precision::Fp32 => train_with::<f32, _>(comm, &cfg, STEPS, MB),
        Precision::Bf16 => train_with::<bf16, _>(comm, &cfg, STEPS, MB),
        Precision::Fp16 => train_with::<f16, _>(comm, &cfg, STEPS, MB),
    }?;
    Ok(Record::from(&t))
}

/// Trains `steps` steps from step `from` of the data stream on an engine
/// that is fresh or loaded from `load`, then saves into `save`; checks
/// that the loaded client state holds the data position `from`.
fn train_segment<T: zero::core::Element, C: Communicator>(
    comm: C,
    cfg: &ResolvedConfig,
    load: Option<&Path>,
    from: usize,
    steps: usize,
    save: Option<&Path>,
) -> Result<Trained, String> {
    let (world, rank) = (comm.world_size(), comm.rank());
    let ga = cfg.gradient_accumulation_steps;
    let mut b = zero::Engine::builder(cfg.clone(), comm).seed(5);
    let model = Mlp::register(&mut b, DIMS).map_err(|e| e.to_string())?;
    let mut e = match load {
        Some(path) => {
            let (e, client) = zero::Engine::load_checkpoint(b, path)
                .map_err(|e| format!("load_checkpoint: {e}"))?;
            if client["data_position"] != from {
                return Err(format!(
                    "client state {client}, expected data_position {from}"
                ));
            }
            e
        }
        None => b.build().map_err(|e| e.to_string())?,
    };
    let (mut outcomes, mut losses) = (Vec::new(), Vec::new());
    for s in from..from + steps {
        for m in 0..ga {
            // As `zero_testkit::runs::train_with`: rank r's micro-batch m of step s.
            let first = (((s * ga + m) * world + rank) * MB) as u64;
            let (x, y) = batch(first, MB, DIMS[0]);
            let loss = model
                .train_micro_batch::<T, C, _>(&mut e, &x, &y)
                .map_err(|e| format!("training: {e}"))?;
            losses.push(loss);
            let o = e.step().map_err(|e| format!("step: {e}"))?;
            if o.boundary {
                outcomes.push(o);
            }
        }
    }
    let states = e
        .unit_ids()
        .into_iter()
        .map(|u| e.unit_state(u))
        .collect::<zero::Result<Vec<_>>>()
        .map_err(|e| e.to_string())?;
    if let Some(root) = save {
        let dir = e
            .save_checkpoint(root, serde_json::json!({ "data_position": from + steps }))
            .map_err(|e| format!("save_checkpoint: {e}"))?;
        let want = root.join(format!("step{:08}", from + steps));
        if dir != want {
            return Err(format!(
                "saved {}, expected {}",
                dir.display(),
                want.display()
            ));
        }
    }
    Ok(Trained {
        states,
        outcomes,
        losses,
        stats: e.stats().clone(),
    })
}

/// `case` for `STEPS / 2` steps on a fresh communicator, saved into
/// `root`; the engine and communicator dropped; a fresh communicator and
/// engine loaded from `root` train the other steps. The record of the
/// whole run (outcomes and losses of both halves, the final states).
fn train_resumed(opts: &CommOptions, case: Case, root: &Path) -> Result<Record, String> {
    let k = STEPS / 2;
    let half = |load: Option<&Path>, from: usize, steps: usize, save: Option<&Path>| {
        let comm = MpiComm::init(opts).map_err(|e| format!("MpiComm::init: {e}"))?;
        let cfg = config(comm.world_size(), case);
        match case.precision {
            Precision::Fp32 => train_segment::<f32, _>(comm, &cfg, load, from, steps, save),
            Precision::Bf16 => train_segment::<bf16, _>(comm, &cfg, load, from, steps, save),
            Precision::Fp16 => train_segment::<f16, _>(comm, &cfg, load, from, steps, save),
        }
    };
    let first = half(None, 0, k, Some(root)).map_err(|e| format!("first {k} steps: {e}"))?;
    let rest = half(Some(root), k, STEPS - k, None)
        .map_err(|e| format!("after the resume at step {k}: {e}"))?;
    let mut outcomes = first.outcomes;
    outcomes.extend(rest.outcomes);
    let mut losses = first.losses;
    losses.extend(rest.losses);
    Ok(Record::from(&Trained {
        outcomes,
        losses,
        ..rest
    }))
}

// ───────────────────────── records and comparisons ─────────────────────────

/// A step outcome as bit patterns (NaN norms of skipped steps survive the
/// reference file).
#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
struct Outcome {
    skipped: bool,
    grad_norm: Option<u64>,
    lr: u64,
    loss_scale: u32,
    steps: u64,
}

impl Outcome {
    fn norm(&self) -> Option<f64> {
        self.grad_norm.map(f64::from_bits)
    }

    /// Equal bit for bit, except that any NaN norm equals any other.
    fn same(&self, o: &Outcome) -> bool {
        let norms = match (self.norm(), o.norm()) {
            (Some(a), Some(b)) => a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            (a, b) => a.is_none() && b.is_none(),
        };
        norms && self.same_but_norm(o)
    }

    fn same_but_norm(&self, o: &Outcome) -> bool {
        self.skipped == o.skipped
            && self.lr == o.lr
            && self.loss_scale == o.loss_scale
            && self.steps == o.steps
    }
}

const ARRAYS: [&str; 4] = ["params", "master", "m", "v"];

/// What one rank saw, as bit patterns: per unit params, master, m, v.
#[derive(Serialize, Deserialize, Clone, Debug)]
struct Record {
    states: Vec<[Vec<u32>; 4]>,
    outcomes: Vec<Outcome>,
    losses: Vec<u32>,
}

impl From<&Trained> for Record {
    fn from(t: &Trained) -> Self {
        let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        Record {
            states: t
                .states
                .iter()
                .map(|s| [b(&s.params), b(&s.master), b(&s.m), b(&s.v)])
                .collect(),
            outcomes: t
                .outcomes
                .iter()
                .map(|o| Outcome {
                    skipped: o.skipped,
                    grad_norm: o.grad_norm.map(f64::to_bits),
                    lr: o.lr.to_bits(),
                    loss_scale: o.loss_scale.to_bits(),
                    steps: o.steps,
                })
                .collect(),
            losses: b(&t.losses),
        }
    }
}

impl Record {
    fn master(&self) -> Vec<f32> {
        self.states
            .iter()
            .flat_map(|s| s[1].iter().map(|&x| f32::from_bits(x)))
            .collect()
    }
}

/// Bit-for-bit equality; the first difference otherwise.
fn bit_identical(a: &Record, b: &Record) -> Result<(), String> {
    if a.states.len() != b.states.len() {
        return Err(format!("{} units vs {}", a.states.len(), b.states.len()));
    }
    for (u, (x, y)) in a.states.iter().zip(&b.states).enumerate() {
        for (k, (p, q)) in x.iter().zip(y).enumerate() {
            if p.len() != q.len() {
                return Err(format!(
                    "unit {u} {}: {} elements vs {}",
                    ARRAYS[k],
                    p.len(),
                    q.len()
                ));
            }
            if let Some(i) = p.iter().zip(q).position(|(s, t)| s != t) {
                return Err(format!(
                    "unit {u} {} element {i}: {:e} vs {:e}",
                    ARRAYS[k],
                    f32::from_bits(p[i]),
                    f32::from_bits(q[i])
                ));
            }
        }
    }
    let outcomes_same = a.outcomes.len() == b.outcomes.len()
        && a.outcomes.iter().zip(&b.outcomes).all(|(x, y)| x.same(y));
    if !outcomes_same {
        return Err(format!(
            "step outcomes differ: {:?} vs {:?}",
            a.outcomes, b.outcomes
        ));
    }
    if let Some(i) =
        (0..a.losses.len().max(b.losses.len())).find(|&i| a.losses.get(i) != b.losses.get(i))
    {
        let l = |r: &Record| r.losses.get(i).map(|&x| f32::from_bits(x));
        return Err(format!("loss {i}: {:?} vs {:?}", l(a), l(b)));
    }
    Ok(())
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.abs().max(b.abs()).max(1e-30)
}

/// Master weights and parameters within `tol`, outcomes equal but for the
/// gradient norm (within [`NODES_REL_TOL`]), losses within
/// [`NODES_REL_TOL`]. Returns the largest master |Δ|.
fn within(a: &Record, b: &Record, tol: f32) -> Result<f32, String> {
    let flat = |r: &Record, k: usize| -> Vec<f32> {
        r.states
            .iter()
            .flat_map(|s| s[k].iter().map(|&x| f32::from_bits(x)))
            .collect()
    };
    let mut worst_master = 0f32;
    for k in [0, 1] {
        let (p, q) = (flat(a, k), flat(b, k));
        if p.len() != q.len() {
            return Err(format!(
                "{}: {} elements vs {}",
                ARRAYS[k],
                p.len(),
                q.len()
            ));
        }
        let mut worst = (0f32, 0usize);
        for (i, (x, y)) in p.iter().zip(&q).enumerate() {
            let d = (x - y).abs();
            // A NaN, once seen, is kept and fails below.
            if d.is_nan() || d > worst.0 {
                worst = (d, i);
            }
        }
        if worst.0.is_nan() || worst.0 > tol {
            return Err(format!(
                "{} element {}: {:e} vs {:e}, |Δ| {:e} > {tol:e}",
                ARRAYS[k], worst.1, p[worst.1], q[worst.1], worst.0
            ));
        }
        if k == 1 {
            worst_master = worst.0;
        }
    }
    let outcomes_close = a.outcomes.len() == b.outcomes.len()
        && a.outcomes.iter().zip(&b.outcomes).all(|(x, y)| {
            x.same_but_norm(y)
                && match (x.norm(), y.norm()) {
                    (Some(p), Some(q)) => (p.is_nan() && q.is_nan()) || rel(p, q) <= NODES_REL_TOL,
                    (p, q) => p.is_none() && q.is_none(),
                }
        });
    if !outcomes_close {
        return Err(format!(
            "step outcomes differ: {:?} vs {:?}",
            a.outcomes, b.outcomes
        ));
    }
    if a.losses.len() != b.losses.len() {
        return Err(format!("{} losses vs {}", a.losses.len(), b.losses.len()));
    }
    for (i, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
        let (x, y) = (f32::from_bits(*x) as f64, f32::from_bits(*y) as f64);
        if rel(x, y).is_nan() || rel(x, y) > NODES_REL_TOL {
            return Err(format!("loss {i}: {x:e} vs {y:e}"));
        }
    }
    Ok(worst_master)
}

// ───────────────────────────── driver ─────────────────────────────

/// Threads-backend results: case key → every rank's record.
type References = BTreeMap<String, Vec<Record>>;

fn references<'a>(runs: impl IntoIterator<Item = &'a Run>) -> Result<References, String> {
    let mut refs = References::new();
    for run in runs {
        for case in run.groups().into_iter().flatten() {
            let out = ThreadGroup::run(run.ranks, |comm| train(comm, case))
                .map_err(|e| format!("{}: {e}", case.key(run.ranks)))?;
            let recs = out
                .into_iter()
                .collect::<zero::Result<Vec<_>>>()
                .map_err(|e| format!("{}: {e}", case.key(run.ranks)))?;
            refs.insert(case.key(run.ranks), recs);
        }
    }
    Ok(refs)
}

fn find_mpirun() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("mpirun"))
        .find(|p| p.is_file())
}

fn driver() -> i32 {
    let started = Instant::now();
    let (mut passed, mut failed) = (0usize, 0usize);
    let finish = |passed: usize, failed: usize| {
        println!("(total {:.1?})", started.elapsed());
        println!("engine_mpi: {passed} passed, {failed} failed");
        i32::from(failed > 0)
    };

    let t = Instant::now();
    let refs = match references(RUNS) {
        Ok(r) => r,
        Err(e) => {
            println!("FAIL driver: threads-backend reference: {e}");
            return finish(passed, failed + 1);
        }
    };
    passed += 1;
    println!(
        "ok   threads-backend references: {} cases in {:.1?}",
        refs.len(),
        t.elapsed()
    );
    let ref_path =
        std::env::temp_dir().join(format!("zero-engine-mpi-ref-{}.json", std::process::id()));
    let written = serde_json::to_vec(&refs)
        .map_err(|e| e.to_string())
        .and_then(|b| std::fs::write(&ref_path, b).map_err(|e| e.to_string()));
    if let Err(e) = written {
        println!("FAIL driver: writing {}: {e}", ref_path.display());
        return finish(passed, failed + 1);
    }

    let Some(mpirun) = find_mpirun() else {
        println!("FAIL driver: `mpirun` not found in PATH; this test needs Open MPI or MPICH");
        let _ = std::fs::remove_file(&ref_path);
        return finish(passed, failed + 1);
    };
    let exe = std::env::current_exe().expect("the test binary's path");
    let ckpt = std::env::temp_dir().join(format!("zero-engine-mpi-ckpt-{}", std::process::id()));
    for run in RUNS {
        let t = Instant::now();
        let (p, f, notes) = run_mpirun(&mpirun, &exe, &ref_path, &ckpt, run);
        passed += p;
        failed += f;
        println!(
            "{} run `{}` (-n {}): {p} passed, {f} failed in {:.1?}",
            if f == 0 { "ok  " } else { "FAIL" },
            run.name,
            run.ranks,
            t.elapsed()
        );
        for n in notes {
            println!("    {n}");
        }
    }
    let _ = std::fs::remove_file(&ref_path);
    let _ = std::fs::remove_dir_all(&ckpt);
    finish(passed, failed)
}

/// Runs one mpirun; returns (passed, failed, lines worth showing).
fn run_mpirun(
    mpirun: &Path,
    exe: &Path,
    refs: &Path,
    ckpt: &Path,
    run: &Run,
) -> (usize, usize, Vec<String>) {
    let mut cmd = Command::new(mpirun);
    cmd.args(["-n", &run.ranks.to_string()])
        .args(["--oversubscribe", "--allow-run-as-root"])
        .arg(exe)
        .env(RUN_ENV, run.name)
        .env(REF_ENV, refs)
        .env(CKPT_ENV, ckpt)
        .env_remove("ZERO_MPI_SIMULATE_NODES")
        .env_remove("ZERO_MPI_SHM_POOL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in run.env {
        cmd.env(k, v);
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return (0, 1, vec![format!("FAIL cannot start mpirun: {e}")]),
    };
    let out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        BufReader::new(out)
            .lines()
            .map_while(|l| l.ok())
            .collect::<Vec<_>>()
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + run.limit;
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                timed_out = true;
                // SIGTERM lets mpirun take its ranks down; then SIGKILL.
                let _ = Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .status();
                let grace = Instant::now() + Duration::from_secs(5);
                while Instant::now() < grace {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = child.kill();
                break child.wait().ok();
            }
            Err(_) => break None,
        }
    };
    let lines = reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();

    let (mut passed, mut failed) = (0usize, 0usize);
    let mut notes = Vec::new();
    let mut reported = Vec::new();
    for l in &lines {
        // "engine_mpi: P passed, F failed (rank R)"
        if let Some(rest) = l.strip_prefix("engine_mpi: ") {
            let w: Vec<&str> = rest
                .split(|c: char| c.is_whitespace() || c == ',' || c == '(' || c == ')')
                .filter(|s| !s.is_empty())
                .collect();
            if let [p, "passed", f, "failed", "rank", r] = w[..] {
                reported.push(r.parse::<usize>().unwrap_or(usize::MAX));
                passed += p.parse::<usize>().unwrap_or(0);
                failed += f.parse::<usize>().unwrap_or(1);
            } else {
                failed += 1;
                notes.push(format!("FAIL unreadable summary: {l}"));
            }
        } else if l.starts_with("FAIL") || l.starts_with("note") {
            notes.push(l.clone());
        }
    }
    reported.sort_unstable();
    if reported != (0..run.ranks).collect::<Vec<_>>() {
        failed += 1;
        notes.push(format!(
            "FAIL ranks that reported: {reported:?}, expected 0..{}",
            run.ranks
        ));
    }
    if timed_out {
        failed += 1;
        notes.push(format!("FAIL mpirun did not finish within {:?}", run.limit));
    } else if !status.is_some_and(|s| s.success()) {
        failed += 1;
        notes.push(format!("FAIL mpirun exited with {status:?}"));
    }
    if failed > 0 {
        let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
        for l in tail.into_iter().rev() {
            notes.push(format!("stderr: {l}"));
        }
    }
    (passed, failed, notes)
}

// ───────────────────────────── worker ─────────────────────────────

/// Checks of one rank.
struct Report {
    rank: usize,
    passed: usize,
    failed: usize,
    lines: String,
}

impl Report {
    fn new(rank: usize) -> Self {
        Self {
            rank,
            passed: 0,
            failed: 0,
            lines: String::new(),
        }
    }

    fn result(&mut self, name: &str, r: Result<(), String>) {
        match r {
            Ok(()) => {
                self.passed += 1;
                self.lines
                    .push_str(&format!("ok   rank {}: {name}\n", self.rank));
            }
            Err(d) => {
                self.failed += 1;
                self.lines
                    .push_str(&format!("FAIL rank {}: {name}: {d}\n", self.rank));
            }
        }
    }

    fn note(&mut self, msg: &str) {
        self.lines
            .push_str(&format!("note rank {}: {msg}\n", self.rank));
    }

    fn finish(self) -> i32 {
        print!("{}", self.lines);
        println!(
            "engine_mpi: {} passed, {} failed (rank {})",
            self.passed, self.failed, self.rank
        );
        let _ = std::io::stdout().flush();
        i32::from(self.failed > 0)
    }
}

fn worker() -> i32 {
    let rank_env = std::env::var("OMPI_COMM_WORLD_RANK")
        .or_else(|_| std::env::var("PMI_RANK"))
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(999);
    // Started by hand (`scripts/mpirun.sh -n 2 target/debug/deps/engine_mpi-*`),
    // without the driver's variables: the run is chosen by the number of
    // ranks and this process computes its own references.
    let set_up = || -> Result<(&'static Run, References), String> {
        let run = match std::env::var(RUN_ENV) {
            Ok(name) => RUNS.iter().find(|r| r.name == name),
            Err(_) => {
                let ranks = std::env::var("OMPI_COMM_WORLD_SIZE")
                    .or_else(|_| std::env::var("PMI_SIZE"))
                    .ok()
                    .and_then(|v| v.parse::<usize>().ok());
                RUNS.iter().find(|r| Some(r.ranks) == ranks)
            }
        };
        let run = run.ok_or_else(|| {
            let names: Vec<_> = RUNS.iter().map(|r| (r.name, r.ranks)).collect();
            format!("no run for {RUN_ENV} / the number of ranks; runs (name, ranks): {names:?}")
        })?;
        let refs = match std::env::var(REF_ENV) {
            Ok(path) => {
                let bytes = std::fs::read(&path).map_err(|e| format!("reading {path}: {e}"))?;
                serde_json::from_slice(&bytes).map_err(|e| format!("parsing {path}: {e}"))?
            }
            Err(_) => references([run])?,
        };
        Ok((run, refs))
    };
    let (run, refs) = match set_up() {
        Ok(x) => x,
        Err(e) => {
            let mut rep = Report::new(rank_env);
            rep.result("set-up", Err(e));
            return rep.finish();
        }
    };
    // Long enough for an oversubscribed rank on a loaded machine; short
    // enough that a hang ends well within the driver's limit.
    let opts = CommOptions {
        timeout: Duration::from_secs(30),
        validate: true,
    };
    let r = launch(1, &opts, |comm| {
        let mut rep = Report::new(comm.rank());
        let t = Instant::now();
        checks(&comm, run, &refs, &opts, &mut rep);
        if comm.rank() == 0 {
            rep.note(&format!("run `{}` took {:.1?}", run.name, t.elapsed()));
        }
        rep
    });
    match r {
        Ok(mut v) => v.pop().map_or(1, Report::finish),
        Err(e) => {
            let mut rep = Report::new(rank_env);
            rep.result("MPI set-up or a panic", Err(e.to_string()));
            rep.finish()
        }
    }
}

fn checks(comm: &Comm, run: &Run, refs: &References, opts: &CommOptions, rep: &mut Report) {
    let (rank, world) = (comm.rank(), comm.world_size());
    rep.result(
        "backend and world size",
        if comm.backend() == "mpi" && world == run.ranks {
            Ok(())
        } else {
            Err(format!("backend {} world {world}", comm.backend()))
        },
    );
    // Largest master |Δ| in the runs with a tolerance: [vs threads, vs stage 0].
    let mut worst = [0f32; 2];
    // The MPI records of the uninterrupted runs, for the resume checks.
    let mut uninterrupted: BTreeMap<String, Record> = BTreeMap::new();
    for group in run.groups() {
        let mut trained: Vec<Option<Record>> = Vec::new();
        for &case in &group {
            let key = case.key(world);
            // Every engine gets a communicator of its own, as in a real job;
            // `comm` keeps MPI initialised in between.
            let rec = MpiComm::init(opts)
                .map_err(|e| format!("MpiComm::init: {e}"))
                .and_then(|c| train(c, case).map_err(|e| format!("training: {e}")))
                .and_then(|r| {
                    if r.outcomes.len() == STEPS {
                        Ok(r)
                    } else {
                        Err(format!("{} optimizer steps, not {STEPS}", r.outcomes.len()))
                    }
                });
            let rec = match rec {
                Ok(r) => {
                    rep.result(&format!("{key}: trains"), Ok(()));
                    r
                }
                Err(e) => {
                    rep.result(&format!("{key}: trains"), Err(e));
                    trained.push(None);
                    continue;
                }
            };

            // Against the threads backend, same world size, same rank.
            let name = format!("{key}: MPI vs threads backend");
            match refs.get(&key).and_then(|v| v.get(rank)) {
                None => rep.result(&name, Err("no reference".into())),
                Some(t) => match run.tol {
                    None => rep.result(&name, bit_identical(&rec, t)),
                    Some(tol) => {
                        let r = within(&rec, t, tol);
                        if let Ok(w) = r {
                            worst[0] = worst[0].max(w);
                        }
                        rep.result(&format!("{name} (master |Δ| <= {tol:e})"), r.map(|_| ()));
                    }
                },
            }

            // Every rank holds the same state: rank 0's master, broadcast.
            rep.result(
                &format!("{key}: all ranks hold rank 0's master weights"),
                same_as_rank0(comm, &rec.master()),
            );

            if case.stage == 0 && case.precision == Precision::Fp16 {
                let skipped = rec.outcomes.iter().filter(|o| o.skipped).count();
                rep.result(
                    &format!("{key}: fp16 skips some steps, then trains"),
                    if (1..STEPS - 2).contains(&skipped) {
                        Ok(())
                    } else {
                        Err(format!("{skipped} of {STEPS} steps skipped"))
                    },
                );
            }
            uninterrupted.insert(key, rec.clone());
            trained.push(Some(rec));
        }

        // Stages 1–3 against stage 0.
        let Some(base) = &trained[0] else { continue };
        for (case, t) in group.iter().zip(&trained).skip(1) {
            let Some(t) = t else { continue };
            let name = format!("{}: stage 0 vs stage {}", case.key(world), case.stage);
            match run.tol {
                None => rep.result(&format!("{name}, bit for bit"), bit_identical(base, t)),
                Some(tol) => {
                    let r = within(base, t, tol);
                    if let Ok(w) = r {
                        worst[1] = worst[1].max(w);
                    }
                    rep.result(&format!("{name} (master |Δ| <= {tol:e})"), r.map(|_| ()));
                }
            }
        }
    }
    resume_checks(comm, run, refs, opts, &uninterrupted, rep);
    if run.tol.is_some() && rank == 0 {
        rep.note(&format!(
            "largest master |Δ|: {:e} against the threads backend, {:e} between stages",
            worst[0], worst[1]
        ));
    }
}

/// Exact resume: for each of `run.resumes`, [`train_resumed`] into a
/// checkpoint directory of the case under [`CKPT_ENV`] (or, started by
/// hand, under the temporary directory, named after mpirun's pid), bit for
/// bit against the uninterrupted run on MPI and on the threads backend.
fn resume_checks(
    comm: &Comm,
    run: &Run,
    refs: &References,
    opts: &CommOptions,
    uninterrupted: &BTreeMap<String, Record>,
    rep: &mut Report,
) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dir = std::env::var_os(CKPT_ENV).map_or_else(
        || {
            std::env::temp_dir().join(format!(
                "zero-engine-mpi-ckpt-ppid-{}",
                std::os::unix::process::parent_id()
            ))
        },
        PathBuf::from,
    );
    for &(precision, ga, stage, offload) in run.resumes {
        let case = Case::new(precision, ga, stage, offload);
        let key = case.key(world);
        let root = dir.join(format!("{}-{key}", run.name).replace(' ', "-"));
        if rank == 0 {
            // A stale directory of an earlier run by hand; the other ranks
            // touch it only inside save_checkpoint, after rank 0 has made it.
            let _ = std::fs::remove_dir_all(&root);
        }
        let k = STEPS / 2;
        let resumed = train_resumed(opts, case, &root);
        if rank == 0 {
            // Every rank is done with it: loading ends in an exchange.
            let _ = std::fs::remove_dir_all(&root);
        }
        let rec = match resumed {
            Ok(r) => {
                rep.result(&format!("{key}: {k} steps, save, load, {k} steps"), Ok(()));
                r
            }
            Err(e) => {
                rep.result(&format!("{key}: {k} steps, save, load, {k} steps"), Err(e));
                continue;
            }
        };
        let name = format!("{key}: resumed at step {k} vs uninterrupted");
        rep.result(
            &format!("{name} on MPI, bit for bit"),
            match uninterrupted.get(&key) {
                None => Err("no uninterrupted MPI run (not a case of the groups)".into()),
                Some(u) => bit_identical(u, &rec),
            },
        );
        rep.result(
            &format!("{name} on the threads backend, bit for bit"),
            match refs.get(&key).and_then(|v| v.get(rank)) {
                None => Err("no reference".into()),
                Some(t) => bit_identical(t, &rec),
            },
        );
        rep.result(
            &format!("{key}: resumed, all ranks hold rank 0's master weights"),
            same_as_rank0(comm, &rec.master()),
        );
    }
    if rank == 0 && std::env::var_os(CKPT_ENV).is_none() {
        let _ = std::fs::remove_dir(&dir);
    }
}

/// Whether `mine` equals rank 0's `mine` bit for bit (broadcast from 0).
fn same_as_rank0(comm: &Comm, mine: &[f32]) -> Result<(), String> {
    let mut buf = HostBuffer::<f32>::zeros(mine.len()).map_err(|e| e.to_string())?;
    if comm.rank() == 0 {
        buf.copy_from_slice(mine);
    }
    let got = comm
        .broadcast(buf, 0)
        .wait()
        .map_err(|e| format!("broadcast: {e}"))?;
    match got
        .iter()
        .zip(mine)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        None if got.len() == mine.len() => Ok(()),
        None => Err(format!("{} elements vs {}", got.len(), mine.len())),
        Some(i) => Err(format!(
            "element {i}: rank 0 {:e}, here {:e}",
            got[i], mine[i]
        )),
    }
}
