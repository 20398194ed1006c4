//! The device trainer's memory plan ([`workspace_bytes`]) against what it
//! allocates, measured on the CPU backend under the hazard checker at a
//! reduced width: the planned buffers are exactly the trainer's peak of
//! live buffers ([`DeviceModel::workspace_peak`]), with and without
//! activation checkpointing, tied embeddings and q/k/v biases, f32 and
//! bf16, a full fine-tune and LoRA (every target or some, with and
//! without dropout); with LoRA's dropout the planned pinned host slots
//! are exactly what the engine's tracker counts for them.

use zero::comm::{ThreadComm, ThreadGroup};
use zero::core::backend::{CpuBackend, CpuMode};
use zero::core::config::{Precision, ResolvedConfig};
use zero::core::memory::{Category, Tier};
use zero::core::{bf16, Element};
use zero::{Engine, Tracer};
use zero_llama::device::{mask_words, workspace_bytes, DeviceModel, Workspace, MASK_SLOTS};
use zero_llama::lora::{LoraConfig, TARGETS};
use zero_llama::train::{LoraSetup, SftModel};
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

/// What a run measured: the trainer's peak of live buffers and the
/// engine's host communication buffers (the pinned mask slots).
struct Measured {
    peak: u64,
    host_comm: u64,
}

/// Two micro-batches of `batch` x `seq` random tokens, every one a
/// target, on the checked CPU backend at stage 3, a full fine-tune or
/// with adapters `lora`; what they measured and the plan.
fn measure<T: Element>(
    cfg: Config,
    lora: Option<&LoraConfig>,
    checkpointing: bool,
    batch: usize,
    seq: usize,
) -> (Measured, Workspace) {
    let precision = if T::DTYPE == zero::core::DType::BF16 {
        Precision::Bf16
    } else {
        Precision::Fp32
    };
    let setup = lora.map(|l| LoraSetup {
        cfg: l.clone(),
        seed: 5,
        adapters: None,
    });
    let out = ThreadGroup::run(1, move |comm: ThreadComm| -> zero::Result<Measured> {
        let mut c = ResolvedConfig::simple(3, 1, batch);
        c.precision = precision;
        let mut b = Engine::builder(c, comm).seed(1);
        let model = SftModel::register_lora(&mut b, cfg, None, setup.clone(), 1, checkpointing)?;
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
        let report = e.memory_report();
        let host_comm = report
            .get(Tier::Host, Category::CommBuffers)
            .map_or(0, |x| x.peak);
        Ok(Measured { peak, host_comm })
    })
    .expect("the rank ran");
    let measured = out
        .into_iter()
        .next()
        .expect("one rank")
        .expect("training ran");
    let plan = workspace_bytes(&cfg, lora, batch, seq, checkpointing, size_of::<T>());
    (measured, plan)
}

#[test]
fn the_planned_workspace_is_the_device_trainers_peak() {
    for (tied, bias) in [(false, false), (true, true)] {
        for checkpointing in [false, true] {
            let cfg = config(tied, bias);
            let what = format!("tied {tied}, bias {bias}, checkpointing {checkpointing}");
            let (m32, p32) = measure::<f32>(cfg, None, checkpointing, 2, 12);
            assert_eq!(m32.peak, p32.buffers, "f32, {what}");
            let (m16, p16) = measure::<bf16>(cfg, None, checkpointing, 3, 7);
            assert_eq!(m16.peak, p16.buffers, "bf16, {what}");
            assert!(p16.ops > 0 && p16.total() > p16.buffers, "{what}");
            assert_eq!((p16.host_pinned, m16.host_comm), (0, 0), "{what}");
        }
    }
}

#[test]
fn checkpointing_plans_less_and_the_score_matrices_dominate_at_long_sequences() {
    let cfg = Config {
        max_seq: 2048,
        ..config(false, false)
    };
    let full = workspace_bytes(&cfg, None, 4, 2048, false, 2);
    let ckpt = workspace_bytes(&cfg, None, 4, 2048, true, 2);
    assert!(ckpt.buffers < full.buffers);
    // Without checkpointing every block keeps its probabilities
    // [batch, heads, seq, seq].
    let probs = 4 * 4 * 2048 * 2048 * 2u64;
    assert!(full.buffers > cfg.n_layers as u64 * probs);
}

/// Adapters of rank 4 on `targets` with `dropout`.
fn lora(targets: &[&str], dropout: f32) -> LoraConfig {
    LoraConfig::new(4, 8.0, dropout, targets).unwrap()
}

/// With LoRA the planned buffers are the trainer's peak to the byte (its
/// adapters' products, dropped inputs, backward temporaries and dropout
/// masks; no base gradients), with and without activation checkpointing
/// and dropout, every target or some, tied embeddings and q/k/v biases,
/// f32 and bf16; the pinned mask slots are what the engine's tracker
/// counts; and leaving out the adapters' terms (the plan of a model
/// without them) or the masks' (the plan without dropout) misses the
/// peak.
#[test]
fn the_planned_lora_workspace_is_the_device_trainers_peak() {
    let all = TARGETS.map(|t| t.0);
    let some = ["q_proj", "v_proj", "o_proj", "down_proj"];
    for (tied, bias) in [(false, false), (true, true)] {
        let cfg = config(tied, bias);
        for (targets, dropout) in [(&all[..], 0.1), (&all[..], 0.0), (&some[..], 0.1)] {
            let lc = lora(targets, dropout);
            for checkpointing in [false, true] {
                let what = format!(
                    "tied {tied}, bias {bias}, {} targets, dropout {dropout}, \
                     checkpointing {checkpointing}",
                    targets.len()
                );
                let (m32, p32) = measure::<f32>(cfg, Some(&lc), checkpointing, 2, 12);
                assert_eq!(m32.peak, p32.buffers, "f32, {what}");
                let (m16, p16) = measure::<bf16>(cfg, Some(&lc), checkpointing, 3, 7);
                assert_eq!(m16.peak, p16.buffers, "bf16, {what}");
                // The slots: one block's masks each.
                let words = mask_words(&cfg, &lc, 3 * 7) as u64;
                assert_eq!(p16.host_pinned, MASK_SLOTS as u64 * 4 * words, "{what}");
                assert_eq!(m16.host_comm, p16.host_pinned, "bf16, {what}");
                assert_eq!(words > 0, dropout > 0.0, "{what}");
                // The LoRA terms matter: without them (or without the
                // masks) the plan is not the measured peak.
                let plain = workspace_bytes(&cfg, None, 2, 12, checkpointing, 4);
                assert_ne!(plain.buffers, m32.peak, "f32, {what}");
                if dropout > 0.0 {
                    let no_masks = lora(targets, 0.0);
                    let p = workspace_bytes(&cfg, Some(&no_masks), 2, 12, checkpointing, 4);
                    assert!(p.buffers < m32.peak, "f32, {what}");
                }
            }
        }
    }
}
