//! Initialisation streams offloaded state to its tier: with the optimizer
//! state and the parameters offloaded to nvme, `build` writes the fp32
//! master tile by tile and each parameter shard on its own straight into
//! the swap files, so the whole model is never in host memory. The
//! process's peak RSS (`VmHWM`) grows by no more than what the memory
//! tracker plans for the built engine, plus slack for the allocator and
//! one unit's values that is far below the model's master and
//! parameters.
//!
//! Its own test binary: `VmHWM` is the peak of the whole process.

use zero::comm::ThreadGroup;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::Tier;
use zero::core::partition::{TensorSpec, UnitSpec};
use zero::core::DType;
use zero::{Engine, Init};

/// Units of `ELEMS` elements each.
const UNITS: usize = 16;
const ELEMS: usize = 2 << 20;
const MB: u64 = 1 << 20;

/// The process's peak resident set (`VmHWM`), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/self/status");
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in kB");
    kb * 1024
}

#[test]
fn offloaded_state_is_written_without_the_model_in_memory() {
    let dir = std::env::temp_dir().join(format!("zero-streaming-init-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = ResolvedConfig::simple(3, 1, 1);
    cfg.precision = Precision::Bf16;
    // Gradients accumulated in bf16 and small buckets: the planned host
    // and device memory is then well under the model's master and
    // parameters, so the bound below tells.
    cfg.grad_accum_dtype = DType::BF16;
    let z = &mut cfg.zero;
    z.reduce_bucket_size = 1 << 20;
    z.prefetch_bucket_size = 1 << 20;
    z.sub_group_size = 1 << 20;
    z.offload_optimizer.device = OffloadDevice::Nvme;
    z.offload_optimizer.nvme_path = Some(dir.join("opt"));
    z.offload_optimizer.buffer_count = 2;
    z.offload_param.device = OffloadDevice::Nvme;
    z.offload_param.nvme_path = Some(dir.join("params"));
    z.offload_param.buffer_count = 2;
    z.offload_param.buffer_size = ELEMS;
    z.offload_param.max_in_cpu = 0;
    z.aio.block_size = 1 << 20;
    let before = peak_rss();
    let planned = ThreadGroup::run(1, |comm| {
        let mut b = Engine::builder(cfg.clone(), comm);
        for u in 0..UNITS {
            b.register(
                UnitSpec::new(format!("u{u}"), vec![TensorSpec::new("w", &[ELEMS])]),
                vec![Init::normal(0.02)],
            )
            .unwrap();
        }
        let e = b.build().unwrap();
        let r = e.memory_report();
        let peak = |t| r.tier(t).map_or(0, |t| t.peak);
        peak(Tier::Device) + peak(Tier::Host)
    })
    .unwrap()
    .remove(0);
    let grown = peak_rss().saturating_sub(before);
    // The fp32 master and the bf16 parameters of the model: what a build
    // holding them all at once would add.
    let model = (UNITS * ELEMS * 6) as u64;
    // The tracker's plan, 10% more, and 32 MiB for the allocator, the
    // thread and one unit's values.
    let bound = planned + planned / 10 + 32 * MB;
    println!(
        "peak RSS grew by {} MiB; planned host + device {} MiB; model master + params {} MiB",
        grown / MB,
        planned / MB,
        model / MB
    );
    assert!(
        grown <= bound,
        "peak RSS grew by {} MiB, over the plan ({} MiB) + 10% + 32 MiB",
        grown / MB,
        planned / MB
    );
    // It tells: a build that held the model's master and parameters at
    // once on top of its plan would pass the bound.
    assert!(
        planned + model > bound,
        "slack {} MiB vs model {} MiB",
        (bound - planned) / MB,
        model / MB
    );
    let _ = std::fs::remove_dir_all(&dir);
}
