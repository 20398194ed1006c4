//! Stage 3 with per-unit recompute keeps the candle side to one unit: the
//! process's peak RSS growth over training is within 10% of
//! `zero::estimate` (what `zero estimate` computes: every rank's device and
//! host tiers; the CPU backend's device memory is host memory) plus one
//! unit's candle working set per rank, on a model whose states are
//! several times one unit. Its own test binary: the figure is the
//! process's.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use zero::comm::{Communicator, ThreadGroup};
use zero::core::config::{Precision, ResolvedConfig};
use zero::core::memory::Tier;
use zero::core::optim::LrSchedule;
use zero::estimate::{estimate, Workload};
use zero::Engine;
use zero_candle::tiny::{self, Block, TinyConfig};
use zero_candle::{Backward, Trainer};

const SHAPE: TinyConfig = TinyConfig {
    vocab: 64,
    dim: 192,
    heads: 4,
    hidden: 768,
    layers: 16,
};
const SEQ: usize = 16;
const MICRO: usize = 4;
const RANKS: usize = 2;

/// A field of `/proc/self/status` in bytes (`VmHWM`, `VmRSS`).
fn status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

/// Resets `VmHWM` to the current RSS; returns the RSS.
fn reset_peak() -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").expect("/proc/self/clear_refs");
    status("VmRSS")
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// One block's forward and backward in candle alone, as the recompute
/// runs it: the peak RSS it adds.
fn one_unit_working_set() -> u64 {
    let base = reset_peak();
    {
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let block = Block::new(SHAPE, vb).unwrap();
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (MICRO, SEQ, SHAPE.dim), &Device::Cpu).unwrap(),
        )
        .unwrap();
        let g = Tensor::randn(0f32, 1.0, (MICRO, SEQ, SHAPE.dim), &Device::Cpu).unwrap();
        let y = block.forward(x.as_tensor()).unwrap();
        let grads = (y * g).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(grads.get(x.as_tensor()).is_some());
    }
    status("VmHWM") - base
}

#[test]
fn stage_3_recompute_peak_rss_is_the_estimate_plus_one_unit() {
    // Buffers over 64 KiB come from mmap and go back to the system when
    // freed (glibc's default threshold moves up to 32 MiB as buffers are
    // freed, and the freed memory then stays in its arenas): the RSS
    // follows what is allocated.
    assert_eq!(
        // SAFETY: mallopt only changes the allocator's parameters.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 10) },
        1
    );
    // Twice: the first also starts candle's thread pool (for the matrix
    // products), which the training below finds started.
    one_unit_working_set();
    let unit = one_unit_working_set();

    let mut cfg = ResolvedConfig::simple(3, RANKS, MICRO);
    cfg.precision = Precision::Bf16;
    cfg.optimizer.lr = 1e-3;
    cfg.scheduler = LrSchedule::Constant { lr: 1e-3 };
    let model = SHAPE.model();
    model.size_config(&mut cfg).unwrap();
    let est = estimate(&model.estimate_model().unwrap(), &cfg, &Workload::default()).unwrap();
    let per_rank = est.tier_peak(Tier::Device) + est.tier_peak(Tier::Host);
    let planned = RANKS as u64 * per_rank;
    assert!(
        per_rank > 4 * unit,
        "the model's states ({:.1} MiB per rank) must be several times one unit ({:.1} MiB)",
        mib(per_rank),
        mib(unit)
    );

    let (grown, losses) = train(&cfg, Backward::Recompute);
    let bound = planned + planned / 10 + RANKS as u64 * unit;
    println!(
        "peak RSS growth {:.1} MiB; zero::estimate {:.1} MiB ({} ranks × {:.1}) + one unit's \
         candle working set {:.1} MiB per rank; bound (+10%) {:.1} MiB; losses {losses:?}",
        mib(grown),
        mib(planned),
        RANKS,
        mib(per_rank),
        mib(unit),
        mib(bound)
    );
    assert!(losses.iter().flatten().all(|l| l.is_finite()));
    assert!(
        grown <= bound,
        "peak RSS grew by {:.1} MiB, over the bound {:.1} MiB",
        mib(grown),
        mib(bound)
    );
    // The bound tells the two modes apart: with the whole graph, candle
    // holds every parameter and gradient in f32 (8 bytes per parameter
    // per rank) on top of the engine's states.
    let (whole, _) = train(&cfg, Backward::WholeGraph);
    println!("whole graph: peak RSS growth {:.1} MiB", mib(whole));
    assert!(
        whole > bound,
        "the whole-graph run ({:.1} MiB) should not fit the recompute's bound ({:.1} MiB)",
        mib(whole),
        mib(bound)
    );
}

/// Trains 3 steps on `RANKS` thread ranks: the peak RSS growth and the
/// losses.
fn train(cfg: &ResolvedConfig, backward: Backward) -> (u64, Vec<Vec<f32>>) {
    let base = reset_peak();
    let losses = ThreadGroup::run(RANKS, |comm| {
        let rank = comm.rank();
        let model = SHAPE.model();
        let mut b = Engine::builder(cfg.clone(), comm).seed(3);
        let reg = model.register(&mut b).unwrap();
        let mut t = Trainer::<zero::core::bf16, _>::new(b.build().unwrap(), model, reg)
            .unwrap()
            .with_backward(backward);
        let mut l = Vec::new();
        for step in 0..3 {
            let first = ((step * RANKS + rank) * MICRO) as u64;
            let (x, y) = tiny::batch(first, MICRO, SEQ, SHAPE.vocab).unwrap();
            l.push(t.train_micro_batch(&x, |o| tiny::loss(o, &y)).unwrap());
            t.step().unwrap();
        }
        l
    })
    .unwrap();
    (status("VmHWM") - base, losses)
}
