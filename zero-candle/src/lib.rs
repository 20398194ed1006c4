//! Train [candle](https://crates.io/crates/candle-core) models under zero's
//! ZeRO stages 0–3, with optimizer and parameter offload.
//!
//! A model is a chain of units ([`CandleModel`]): each unit is a candle
//! module (built with `candle_nn` layers from a `VarBuilder`) under its own
//! name prefix, one engine unit each. [`CandleModel::register`] learns the
//! units' tensors from a recording `VarBuilder` and registers them with
//! zero's deterministic initialisers; a [`Trainer`] then runs each
//! micro-batch: it gathers each unit's parameters, builds its module
//! from them, runs candle's forward and backward, and hands each unit's
//! gradient to the engine as soon as it is known; `step` runs the
//! optimizer (on the engine's fp32 master, wherever the config puts it).
//! The parameters live in the engine: [`Trainer::write_vars`] writes the
//! current ones into a candle `VarMap`.
//!
//! ```ignore
//! let mut model = CandleModel::new();
//! model.unit("embed", move |vb| candle_nn::embedding(vocab, dim, vb));
//! for i in 0..layers {
//!     model.unit(format!("blocks.{i}"), move |vb| Block::new(dim, vb));
//! }
//! model.unit("head", move |vb| candle_nn::linear(dim, vocab, vb));
//! let mut builder = Engine::builder(cfg, comm).seed(1);
//! let registered = model.register(&mut builder)?;
//! let mut t = Trainer::<f32, _>::new(builder.build()?, model, registered)?;
//! for (x, y) in batches {
//!     let loss = t.train_micro_batch(&x, |logits| cross_entropy(logits, &y))?;
//!     t.step()?;
//! }
//! ```
//!
//! Stage 3 keeps its memory on the candle side only with
//! [`Backward::Recompute`] (its default): candle keeps a graph's
//! parameters, activations and gradients until `backward()` returns, so
//! the recompute runs one unit's graph at a time.

mod model;
pub mod tiny;
mod trainer;

pub use model::{map_init, CandleModel, Chain, Registered, RegisteredUnit, TensorDef};
pub use trainer::{Backward, Trainer};

/// A zero-candle error: the engine's, candle's with what was being done,
/// or a model definition zero cannot train.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine's error.
    #[error(transparent)]
    Zero(#[from] zero::Error),
    /// Candle's error, with what zero-candle was doing.
    #[error("{what}: {source}")]
    Candle {
        /// What was being done (names the unit or tensor).
        what: String,
        /// Candle's error (boxed: it is large).
        source: Box<candle_core::Error>,
    },
    /// The model cannot be trained as defined (names the unit or tensor).
    #[error("{0}")]
    Model(String),
}

impl From<zero::core::Error> for Error {
    fn from(e: zero::core::Error) -> Self {
        Error::Zero(e.into())
    }
}

/// This crate's result.
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn candle_err(what: String, source: candle_core::Error) -> Error {
    Error::Candle {
        what,
        source: Box::new(source),
    }
}
