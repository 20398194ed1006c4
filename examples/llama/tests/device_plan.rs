//! The device trainer's memory plan ([`workspace_bytes`]) against what it
//! allocates, measured on the CPU backend under the hazard checker at a
//! reduced width: the planned buffers are exactly the trainer's peak of
//! live buffers ([`DeviceModel::workspace_peak`]), with and without
//! activation checkpointing, tied embeddings and q/k/v biases, f32 and
//! bf16; and the engine's reserved plan grows by the bytes given to
//! [`zero::EngineBuilder::device_workspace`].

use zero::comm::{ThreadComm, ThreadGroup};
use zero::core::backend::{CpuBackend, CpuMode};
use zero::core::config::{Precision, ResolvedConfig};
use zero::core::{bf16, Element};
use zero::{Engine, Tracer};
use zero_llama::device::{workspace_bytes, DeviceModel, Workspace};
use zero_llama::train::SftModel;
use zero_llama::{Config, XorShift};

/// A model of the same structure as the ~1B Llama at a reduced width.
fn config(tied: bool, bias: bool) -> Config {
    Config {
        vocab: 96,
        dim: 32,
        n_layers: 3,
        n_heads: 4,
        n_kv_heads: 2,
        hidden: 56,
        max_seq: 12,
        tie_embeddings: tied,
        qkv_bias: bias,
        ..Config::tiny()
    }
}

/// One micro-batch of `batch` x `seq` random tokens, every one a target,
/// on the checked CPU backend at stage 3; the measured peak and the plan.
fn measure<T: Element>(
    cfg: Config,
    checkpointing: bool,
    batch: usize,
    seq: usize,
) -> (u64, Workspace) {
    let precision = if T::DTYPE == zero::core::DType::BF16 {
        Precision::Bf16
    } else {
        Precision::Fp32
    };
    let out = ThreadGroup::run(1, move |comm: ThreadComm| -> zero::Result<u64> {
        let mut c = ResolvedConfig::simple(3, 1, batch);
        c.precision = precision;
        let mut b = Engine::builder(c, comm).seed(1);
        let model = SftModel::register(&mut b, cfg, None, 1, checkpointing)?;
        let mut e = b.backend(CpuBackend::new(CpuMode::Checked)?).build()?;
        let dm = DeviceModel::new(model, e.device_backend(), 1)?;
        let mut rng = XorShift::new(3);
        let rows = batch * seq;
        let mut peak = 0;
        // Two micro-batches: the second allocates as the first did.
        for _ in 0..2 {
            let tokens: Vec<u32> = (0..rows).map(|_| rng.below(cfg.vocab) as u32).collect();
            let targets: Vec<i32> = (0..rows).map(|_| rng.below(cfg.vocab) as i32).collect();
            dm.train_micro_batch::<T, _>(
                &mut e,
                &tokens,
                &targets,
                batch,
                seq,
                &Tracer::disabled(),
            )?;
            e.step()?;
            assert!(
                peak == 0 || peak == dm.workspace_peak(),
                "the peak changed between micro-batches"
            );
            peak = dm.workspace_peak();
        }
        Ok(peak)
    })
    .expect("the rank ran");
    let measured = out
        .into_iter()
        .next()
        .expect("one rank")
        .expect("training ran");
    let plan = workspace_bytes(&cfg, batch, seq, checkpointing, size_of::<T>());
    (measured, plan)
}

#[test]
fn the_planned_workspace_is_the_device_trainers_peak() {
    for (tied, bias) in [(false, false), (true, true)] {
        for checkpointing in [false, true] {
            let cfg = config(tied, bias);
            let what = format!("tied {tied}, bias {bias}, checkpointing {checkpointing}");
            let (m32, p32) = measure::<f32>(cfg, checkpointing, 2, 12);
            assert_eq!(m32, p32.buffers, "f32, {what}");
            let (m16, p16) = measure::<bf16>(cfg, checkpointing, 3, 7);
            assert_eq!(m16, p16.buffers, "bf16, {what}");
            assert!(p16.ops > 0 && p16.total() > p16.buffers, "{what}");
        }
    }
}

#[test]
fn checkpointing_plans_less_and_the_score_matrices_dominate_at_long_sequences() {
    let cfg = Config {
        max_seq: 2048,
        ..config(false, false)
    };
    let full = workspace_bytes(&cfg, 4, 2048, false, 2);
    let ckpt = workspace_bytes(&cfg, 4, 2048, true, 2);
    assert!(ckpt.buffers < full.buffers);
    // Without checkpointing every block keeps its probabilities
    // [batch, heads, seq, seq].
    let probs = 4 * 4 * 2048 * 2048 * 2u64;
    assert!(full.buffers > cfg.n_layers as u64 * probs);
}
