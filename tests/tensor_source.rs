//! `Init::Source`: values read on demand, range by range, from a
//! [`TensorSource`] (pretrained weights streamed from a file). The engine
//! built from sources holds the state of the one built from `Init::Values`
//! of the same values, bit for bit, at every stage and with every offload
//! (after the build and after training steps); it asks a source only for
//! the ranges this rank stores (never the whole model), and a source's
//! error comes back from `build` on every rank.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use zero::comm::ThreadGroup;
use zero::core::bf16;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::partition::{TensorSpec, UnitSpec};
use zero::{Engine, Init, TensorSource, UnitState};
use zero_testkit::mlp::{batch, Mlp};
use zero_testkit::runs::{assert_bits_eq, config, DIMS};
use zero_testkit::temp::TempDir;

/// Values in memory, served range by range; counts the reads and the
/// largest range asked for; with `fail`, every read fails with an error
/// naming a file and the tensor.
#[derive(Debug)]
struct VecSource {
    values: Vec<f32>,
    name: String,
    fail: bool,
    reads: AtomicUsize,
    largest: AtomicUsize,
}

impl VecSource {
    fn new(name: String, values: Vec<f32>, fail: bool) -> Arc<VecSource> {
        Arc::new(VecSource {
            values,
            name,
            fail,
            reads: AtomicUsize::new(0),
            largest: AtomicUsize::new(0),
        })
    }
}

impl TensorSource for VecSource {
    fn numel(&self) -> usize {
        self.values.len()
    }

    fn read(&self, range: Range<usize>, out: &mut [f32]) -> zero::Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.largest.fetch_max(range.len(), Ordering::Relaxed);
        if self.fail {
            return Err(zero::Error::Core(zero::core::Error::Io {
                path: PathBuf::from("weights.safetensors"),
                msg: format!("tensor `{}`: cannot read (injected)", self.name),
            }));
        }
        out.copy_from_slice(&self.values[range]);
        Ok(())
    }
}

/// Distinct values for tensor `t` of layer `l`, none of them what a
/// default initialiser would give.
fn values(l: usize, t: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((l * 7 + t * 3 + i) % 23) as f32 * 0.037 - 0.4 + i as f32 * 1e-4)
        .collect()
}

/// How the tests register the MLP's values.
#[derive(Clone, Copy, PartialEq)]
enum How {
    Values,
    Source,
    /// Sources that fail on this rank.
    FailOn(usize),
}

/// Registers the MLP of [`DIMS`] with [`values`], as `how` says; the
/// sources, to inspect after the build.
fn register<C: zero::comm::Communicator>(
    b: &mut zero::EngineBuilder<C>,
    how: How,
    rank: usize,
) -> (Mlp, Vec<Arc<VecSource>>) {
    let mut units = Vec::new();
    let mut sources = Vec::new();
    for l in 0..DIMS.len() - 1 {
        let (i, o) = (DIMS[l], DIMS[l + 1]);
        let spec = UnitSpec::new(
            format!("layer{l}"),
            vec![
                TensorSpec::new("weight", &[o, i]),
                TensorSpec::new("bias", &[o]),
            ],
        );
        let inits = [o * i, o]
            .iter()
            .enumerate()
            .map(|(t, &n)| match how {
                How::Values => Init::Values(values(l, t, n).into()),
                How::Source | How::FailOn(_) => {
                    let fail = how == How::FailOn(rank);
                    let s = VecSource::new(format!("layer{l}.{t}"), values(l, t, n), fail);
                    sources.push(s.clone());
                    Init::Source(s)
                }
            })
            .collect();
        units.push(b.register(spec, inits).unwrap());
    }
    let mlp = Mlp {
        dims: DIMS.to_vec(),
        units,
    };
    (mlp, sources)
}

/// Rank 0's unit states after the build and after `steps` steps, with the
/// values registered as `how` says; and the largest range any source was
/// asked for (0 with values).
fn run(world: usize, cfg: &ResolvedConfig, how: How, steps: usize) -> (Vec<Vec<UnitState>>, usize) {
    let out = ThreadGroup::run(world, |comm| {
        let rank = zero::comm::Communicator::rank(&comm);
        let mut b = Engine::builder(cfg.clone(), comm).seed(9);
        let (model, sources) = register(&mut b, how, rank);
        let mut e = b.build()?;
        let largest = sources
            .iter()
            .map(|s| s.largest.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0);
        if how == How::Source {
            assert!(
                sources.iter().any(|s| s.reads.load(Ordering::Relaxed) > 0),
                "rank {rank}: the build read no source"
            );
        }
        let states = |e: &mut Engine<_>| -> zero::Result<Vec<UnitState>> {
            e.unit_ids().into_iter().map(|u| e.unit_state(u)).collect()
        };
        let built = states(&mut e)?;
        for s in 0..steps {
            let (x, y) = batch(((s * world + rank) * 4) as u64, 4, DIMS[0]);
            model.train_micro_batch::<bf16, _, _>(&mut e, &x, &y)?;
            e.step()?;
        }
        Ok::<_, zero::Error>((vec![built, states(&mut e)?], largest))
    })
    .unwrap();
    let mut all: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    let largest = all.iter().map(|r| r.1).max().unwrap_or(0);
    (all.swap_remove(0).0, largest)
}

/// `config` for `world` ranks at `stage` in bf16 with the optimizer state
/// on `opt` and (stage 3) the parameters on `param`, swap files under
/// `dir`.
fn cfg(
    world: usize,
    stage: u8,
    opt: OffloadDevice,
    param: OffloadDevice,
    dir: &Path,
) -> ResolvedConfig {
    let mut c = config(world, stage, 1, Precision::Bf16);
    c.zero.sub_group_size = 97;
    c.zero.aio.block_size = 4096;
    c.zero.offload_optimizer.device = opt;
    if opt == OffloadDevice::Nvme {
        c.zero.offload_optimizer.nvme_path = Some(dir.join("opt"));
    }
    let p = &mut c.zero.offload_param;
    p.device = param;
    p.buffer_count = 4;
    p.buffer_size = 1024;
    p.max_in_cpu = 0;
    if param == OffloadDevice::Nvme {
        p.nvme_path = Some(dir.join("params"));
    }
    c
}

/// Stages 0–3, no offload, cpu and nvme optimizer offload, and at stage 3
/// nvme parameter offload (with the optimizer state on nvme too, and
/// gradients swapped: ZeRO-Infinity), on 2 ranks: the same state after the
/// build and after 3 steps as with `Init::Values`, bit for bit; no source
/// was asked for more than a layer's weight (stage 3, where the
/// parameters are sharded too: this rank's half of it, plus padding).
#[test]
fn sources_give_the_state_of_values_at_every_stage_and_offload() {
    let dir = TempDir::new("source-exact");
    let world = 2;
    let none = OffloadDevice::None;
    let mut variants = Vec::new();
    for stage in 0..=3u8 {
        for opt in [none, OffloadDevice::Cpu, OffloadDevice::Nvme] {
            variants.push((stage, opt, none, false));
        }
    }
    variants.push((3, OffloadDevice::Nvme, OffloadDevice::Nvme, false));
    variants.push((3, OffloadDevice::Nvme, OffloadDevice::Nvme, true));
    variants.push((3, OffloadDevice::Cpu, OffloadDevice::Cpu, false));
    let largest_tensor = (1..DIMS.len())
        .map(|l| DIMS[l] * DIMS[l - 1])
        .max()
        .unwrap();
    for (stage, opt, param, swap_grads) in variants {
        let what = format!(
            "stage {stage}, offload_optimizer {opt}, offload_param {param}, swap_gradients {swap_grads}"
        );
        let mut c = cfg(world, stage, opt, param, &dir);
        c.zero.offload_optimizer.swap_gradients = swap_grads;
        let (want, _) = run(world, &c, How::Values, 3);
        let (got, largest) = run(world, &c, How::Source, 3);
        assert_bits_eq(&want[0], &got[0], &format!("{what}: after the build"));
        assert_bits_eq(&want[1], &got[1], &format!("{what}: after 3 steps"));
        // Not the model's values at once: at most one tensor, and with
        // sharded parameters this rank's half of it.
        let bound = if stage == 3 {
            largest_tensor.div_ceil(world) + 64
        } else {
            largest_tensor
        };
        assert!(
            largest > 0 && largest <= bound,
            "{what}: a source was asked for {largest} elements at once (bound {bound})"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A source that fails on rank 1 only: `build` fails on both ranks (none
/// hangs), rank 1 with the source's own error naming the file and the
/// tensor, rank 0 with one naming rank 1 and that error; with and without
/// offload (the tiles of the optimizer's swap file, the parameter shards).
#[test]
fn a_failing_source_fails_the_build_on_every_rank() {
    let dir = TempDir::new("source-fail");
    let none = OffloadDevice::None;
    for (stage, opt, param) in [
        (0, none, none),
        (2, OffloadDevice::Cpu, none),
        (3, none, none),
        (3, OffloadDevice::Nvme, none),
        (3, OffloadDevice::Nvme, OffloadDevice::Nvme),
    ] {
        let c = cfg(2, stage, opt, param, &dir);
        let out = ThreadGroup::run(2, |comm| {
            let rank = zero::comm::Communicator::rank(&comm);
            let mut b = Engine::builder(c.clone(), comm);
            register(&mut b, How::FailOn(1), rank);
            b.build().map(|_| ()).map_err(|e| e.to_string())
        })
        .unwrap();
        let what = format!("stage {stage}, offload_optimizer {opt}, offload_param {param}");
        let e1 = out[1].clone().expect_err(&what);
        assert!(
            e1.contains("weights.safetensors") && e1.contains("tensor `layer0.0`"),
            "{what}: rank 1: {e1}"
        );
        let e0 = out[0].clone().expect_err(&what);
        assert!(
            e0.contains("rank 1") && e0.contains("tensor `layer0.0`: cannot read (injected)"),
            "{what}: rank 0: {e0}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `register` checks a source's length against the tensor's.
#[test]
fn a_source_of_the_wrong_length_is_refused_at_register() {
    ThreadGroup::run(1, |comm| {
        let mut b = Engine::builder(config(1, 3, 1, Precision::Fp32), comm);
        let s = VecSource::new("w".into(), vec![0.5; 11], false);
        let err = b
            .register(
                UnitSpec::new("u", vec![TensorSpec::new("w", &[3, 4])]),
                vec![Init::Source(s)],
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`w` has 12 elements but its Init::Source has 11"),
            "{err}"
        );
    })
    .unwrap();
}

/// The values are the ones given: f32 state from a source equals them.
#[test]
fn an_fp32_build_holds_the_source_values() {
    let out = ThreadGroup::run(1, |comm| {
        let mut b = Engine::builder(config(1, 2, 1, Precision::Fp32), comm);
        let (model, _) = register(&mut b, How::Source, 0);
        let mut e = b.build().unwrap();
        let s = e.unit_state(model.units[1]).unwrap();
        (s.params, s.master)
    })
    .unwrap();
    let (i, o) = (DIMS[1], DIMS[2]);
    let mut want = values(1, 0, o * i);
    want.extend(values(1, 1, o));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&out[0].0), bits(&want));
    assert_eq!(bits(&out[0].1), bits(&want));
}
