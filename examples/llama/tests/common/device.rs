//! What the device trainer's tests share (`tests/device.rs`,
//! `tests/device_cuda.rs`): the tiny model on the addition task, the
//! engine config, and a training loop over any [`Trainer`].

use zero::core::config::{Precision, ResolvedConfig};
use zero::core::optim::LrSchedule;
use zero::core::Element;
use zero::engine::{EngineBackend, EngineComm};
use zero::{Engine, Tracer};
use zero_llama::data::{self, Sample};
use zero_llama::device::Trainer;
use zero_llama::Config;

/// Samples per rank per micro-batch.
pub const MB: usize = 2;
/// Seed of the data and the initialisation.
pub const SEED: u64 = 7;

/// The addition task's training samples.
pub fn train_set() -> Vec<Sample> {
    data::addition_task(SEED).train
}

/// A tiny model (grouped-query attention) with room for every sample; the
/// batches' right padding is its padding token (transformers'
/// `padding_idx`), so the trainers' embedding gradients skip those rows.
pub fn model_config(tied: bool) -> Config {
    Config {
        vocab: data::VOCAB,
        dim: 32,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        hidden: 48,
        max_seq: data::max_len(&train_set()),
        tie_embeddings: tied,
        pad_id: Some(data::PAD),
        ..Config::tiny()
    }
}

/// `world` ranks at `stage`, `ga` micro-batches per step, small buckets so
/// reductions and gathers come in several pieces.
pub fn engine_config(world: usize, stage: u8, ga: usize, precision: Precision) -> ResolvedConfig {
    let mut c = ResolvedConfig::simple(stage, world, MB);
    c.gradient_accumulation_steps = ga;
    c.train_batch_size = MB * ga * world;
    c.precision = precision;
    c.optimizer.lr = 1e-3;
    c.optimizer.weight_decay = 0.01;
    c.scheduler = LrSchedule::Constant { lr: 1e-3 };
    c.gradient_clipping = 1.0;
    c.zero.reduce_bucket_size = 5000;
    c.zero.allgather_bucket_size = 6000;
    c.zero.param_persistence_threshold = 0;
    c
}

/// `micros` micro-batches of this rank's samples in a fixed order, each
/// followed by `Engine::step`; the losses.
pub fn train<T: Element, C: EngineComm<B>, B: EngineBackend, M: Trainer<C, B>>(
    e: &mut Engine<C, B>,
    m: &M,
    micros: usize,
) -> zero::Result<Vec<f32>> {
    let (rank, world) = (e.rank(), e.world_size());
    let train = train_set();
    let seq = data::max_len(&train);
    let order = data::epoch_order(train.len(), 0, SEED);
    let tracer = Tracer::disabled();
    let mut losses = Vec::new();
    for k in 0..micros {
        let first = (k * world + rank) * MB;
        let samples: Vec<&Sample> = (first..first + MB)
            .map(|i| &train[order[i % order.len()]])
            .collect();
        let (tokens, targets) = data::make_batch(&samples, seq).expect("samples fit");
        let st = m.train_micro_batch::<T>(e, &tokens, &targets, MB, seq, &tracer)?;
        assert!(st.target_tokens > 0 && st.activation_bytes > 0);
        losses.push(st.loss);
        e.step()?;
    }
    Ok(losses)
}
