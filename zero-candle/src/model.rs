//! A candle model as zero's units: its definition ([`CandleModel`]), the
//! recording `VarBuilder` backend that learns each unit's tensors, and the
//! mapping of candle's init hints to zero's deterministic initialisers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Module, Shape, Tensor};
use candle_nn::init::{FanInOut, NormalOrUniform};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{VarBuilder, VarMap};
use zero::core::partition::{TensorSpec, UnitSpec};
use zero::{EngineBackend, EngineBuilder, EngineComm, Init, UnitId};

use crate::{candle_err, Error, Result};

/// Builds one unit's module from a `VarBuilder` already prefixed with the
/// unit's name.
type BuildFn = dyn Fn(VarBuilder<'_>) -> candle_core::Result<Box<dyn Module>> + Send + Sync;

/// Selects the frozen tensors by full name.
type FrozenFn = dyn Fn(&str) -> bool + Send + Sync;

/// One unit of a [`CandleModel`]: a name prefix and the module it builds.
pub(crate) struct UnitDef {
    pub(crate) name: String,
    pub(crate) build: Box<BuildFn>,
}

/// A candle model as a chain of units: each unit is one module built
/// from a `VarBuilder` under its own name prefix (a transformer block
/// `blocks.3`, the embedding, the head), whose output is the next unit's
/// input. Every parameter the module asks its `VarBuilder` for belongs to
/// the unit; zero gathers, reduces and updates it as one flat buffer.
///
/// ```ignore
/// let mut model = CandleModel::new();
/// model.unit("embed", |vb| candle_nn::embedding(vocab, dim, vb));
/// for i in 0..layers {
///     model.unit(format!("blocks.{i}"), move |vb| Block::new(dim, vb));
/// }
/// model.unit("head", |vb| candle_nn::linear(dim, vocab, vb));
/// ```
#[derive(Default)]
pub struct CandleModel {
    pub(crate) units: Vec<UnitDef>,
    frozen: Option<Box<FrozenFn>>,
    values: HashMap<String, Tensor>,
}

impl CandleModel {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a unit named `name` (also the prefix of its tensors'
    /// names: `build` receives `vb.pp(name)`), whose module `build`
    /// makes. Units run in the order they are added.
    pub fn unit<M: Module + 'static>(
        &mut self,
        name: impl Into<String>,
        build: impl Fn(VarBuilder<'_>) -> candle_core::Result<M> + Send + Sync + 'static,
    ) -> &mut Self {
        self.units.push(UnitDef {
            name: name.into(),
            build: Box::new(move |vb| Ok(Box::new(build(vb)?) as Box<dyn Module>)),
        });
        self
    }

    /// Freezes the tensors whose full name (`blocks.0.attn.q.weight`)
    /// `frozen` selects: registered with [`TensorSpec::frozen`], they get
    /// no gradient and the optimizer never writes them (give them values
    /// with [`CandleModel::values_from`]).
    pub fn freeze(&mut self, frozen: impl Fn(&str) -> bool + Send + Sync + 'static) -> &mut Self {
        self.frozen = Some(Box::new(frozen));
        self
    }

    /// Initial values from a candle `VarMap` (weights loaded with
    /// `VarMap::load`, or a model trained with candle alone): every
    /// tensor the map holds is registered as [`Init::Values`]; the others
    /// keep their init hints. A tensor whose shape differs from the
    /// module's is an error at registration, naming it.
    pub fn values_from(&mut self, vars: &VarMap) -> &mut Self {
        let data = vars.data().lock().expect("the VarMap's lock");
        for (name, var) in data.iter() {
            self.values
                .insert(name.clone(), var.as_detached_tensor().clone());
        }
        self
    }

    /// The units' names, in order.
    pub fn unit_names(&self) -> Vec<&str> {
        self.units.iter().map(|u| u.name.as_str()).collect()
    }

    /// The whole model as candle modules built from `vb` (a `VarMap`'s,
    /// for training or running it with candle alone): the same modules
    /// zero trains, in the same order.
    pub fn build(&self, vb: &VarBuilder<'_>) -> candle_core::Result<Chain> {
        let mut modules = Vec::with_capacity(self.units.len());
        for u in &self.units {
            modules.push((u.build)(vb.pp(&u.name))?);
        }
        Ok(Chain { modules })
    }

    /// Registers one engine unit per model unit with `builder`: each
    /// module is built once against a recording `VarBuilder` (no tensor
    /// memory is allocated: it hands out broadcast zeros) to learn its
    /// tensors, their shapes and init hints. Candle's hints become zero's
    /// deterministic initialisers (so every rank starts from the same
    /// model, whatever its RNG): `Const` as `Zeros`/`Ones`/`Constant`,
    /// `Randn` with mean 0 as `Normal`, a symmetric `Uniform` as
    /// `Uniform`, `Kaiming` as `Normal`/`Uniform` with candle's standard
    /// deviation (gain / √fan). Other hints are an error naming the
    /// tensor, as are a tensor asked for by two units and a unit without
    /// tensors.
    pub fn register<C: EngineComm<B>, B: EngineBackend>(
        &self,
        builder: &mut EngineBuilder<C, B>,
    ) -> Result<Registered> {
        let mut units = Vec::with_capacity(self.units.len());
        for r in self.record()? {
            let specs = r
                .tensors
                .iter()
                .map(|t| {
                    if t.trainable {
                        TensorSpec::new(t.name.clone(), &t.shape)
                    } else {
                        TensorSpec::frozen(t.name.clone(), &t.shape)
                    }
                })
                .collect();
            let id = builder.register(UnitSpec::new(r.name.clone(), specs), r.inits)?;
            units.push(RegisteredUnit {
                id,
                name: r.name,
                tensors: r.tensors,
            });
        }
        Ok(Registered { units })
    }

    /// The model as the estimator's (`zero::estimate::Model`), for
    /// `zero::estimate::estimate` (what `zero estimate` computes).
    pub fn estimate_model(&self) -> Result<zero::estimate::Model> {
        let units = self
            .record()?
            .into_iter()
            .map(|r| {
                let specs = r
                    .tensors
                    .iter()
                    .map(|t| {
                        if t.trainable {
                            TensorSpec::new(t.name.clone(), &t.shape)
                        } else {
                            TensorSpec::frozen(t.name.clone(), &t.shape)
                        }
                    })
                    .collect();
                UnitSpec::new(r.name, specs)
            })
            .collect();
        Ok(zero::estimate::Model::from_units(units)?)
    }

    /// The largest unit's parameters (elements).
    pub fn largest_unit(&self) -> Result<usize> {
        Ok(self.record()?.iter().map(|u| u.numel()).max().unwrap_or(0))
    }

    /// Sizes the config's buckets and stage-3 knobs for this model, as the
    /// README's "Use it from candle" advises for small models: DeepSpeed's
    /// defaults (reduce and all-gather buckets of 5e8 elements, stage-3
    /// prefetch of 5e7, max live 1e9, reuse distance 1e9) are sized for
    /// billion-parameter models, and with them a model of a few million
    /// parameters stays gathered whole at stage 3 and reduces in one
    /// bucket at the end of backward. This sets, with `u` the largest
    /// unit: `reduce_bucket_size`, `allgather_bucket_size`,
    /// `stage3_prefetch_bucket_size` and `stage3_max_reuse_distance` to
    /// `u` (a bucket holds one unit's gradient, stage 3 prefetches one
    /// unit and keeps a released one only when it comes back within about
    /// one unit), `stage3_max_live_parameters` to `2u`,
    /// `stage3_param_persistence_threshold` to at most `u / 2` (units under
    /// it stay gathered: the small ones, not the blocks), and
    /// `overlap_comm` on at stages 2 and 3 (otherwise each `grad_ready`
    /// waits for its bucket's reduction). Call it on the config before
    /// `Engine::builder`; every rank must.
    pub fn size_config(&self, cfg: &mut zero::core::config::ResolvedConfig) -> Result<()> {
        let u = self.largest_unit()?.max(1);
        let z = &mut cfg.zero;
        z.reduce_bucket_size = u;
        z.allgather_bucket_size = u;
        z.prefetch_bucket_size = u;
        z.max_reuse_distance = u;
        z.max_live_parameters = 2 * u;
        z.param_persistence_threshold = z.param_persistence_threshold.min(u / 2);
        if z.stage >= 2 {
            z.overlap_comm = true;
        }
        Ok(())
    }

    /// Each unit's tensors and initialisers, learnt by building its module
    /// against the recording backend.
    fn record(&self) -> Result<Vec<RecordedUnit>> {
        let mut out = Vec::with_capacity(self.units.len());
        let mut owner: HashMap<String, String> = HashMap::new();
        for u in &self.units {
            let rec = Recorder::default();
            let vb = VarBuilder::from_backend(Box::new(rec.clone()), DType::F32, Device::Cpu);
            (u.build)(vb.pp(&u.name))
                .map_err(|e| candle_err(format!("building unit `{}` to register it", u.name), e))?;
            let seen = std::mem::take(&mut *rec.seen.lock().expect("the recorder's lock"));
            if seen.is_empty() {
                return Err(Error::Model(format!(
                    "unit `{}` asked its VarBuilder for no tensor: it has no parameters to train",
                    u.name
                )));
            }
            let prefix = format!("{}.", u.name);
            let mut inits = Vec::new();
            let mut tensors = Vec::new();
            for r in seen {
                if let Some(other) = owner.insert(r.name.clone(), u.name.clone()) {
                    return Err(Error::Model(format!(
                        "tensor `{}` is asked for by units `{other}` and `{}`: a tensor \
                         (tied weights) must belong to one unit",
                        r.name, u.name
                    )));
                }
                let local = r.name.strip_prefix(&prefix).unwrap_or(&r.name).to_string();
                let dims = r.shape.dims().to_vec();
                let trainable = !self.frozen.as_ref().is_some_and(|f| f(&r.name));
                let init = match self.values.get(&r.name) {
                    Some(t) => {
                        if t.dims() != dims.as_slice() {
                            return Err(Error::Model(format!(
                                "tensor `{}`: the VarMap's value has shape {:?}, the module's is \
                                 {dims:?}",
                                r.name,
                                t.dims()
                            )));
                        }
                        let v = t
                            .flatten_all()
                            .and_then(|t| t.to_dtype(DType::F32))
                            .and_then(|t| t.to_vec1::<f32>())
                            .map_err(|e| {
                                candle_err(format!("reading `{}` from the VarMap", r.name), e)
                            })?;
                        Init::Values(v.into())
                    }
                    None => map_init(&r.name, &r.shape, r.hint)?,
                };
                inits.push(init);
                tensors.push(TensorDef {
                    name: local,
                    full_name: r.name,
                    shape: dims,
                    trainable,
                });
            }
            out.push(RecordedUnit {
                name: u.name.clone(),
                tensors,
                inits,
            });
        }
        Ok(out)
    }
}

/// One unit as recorded: its tensors and their initialisers.
struct RecordedUnit {
    name: String,
    tensors: Vec<TensorDef>,
    inits: Vec<Init>,
}

impl RecordedUnit {
    fn numel(&self) -> usize {
        self.tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum()
    }
}

/// Candle's init hint as zero's initialiser, or an error naming the tensor.
pub fn map_init(name: &str, shape: &Shape, hint: candle_nn::Init) -> Result<Init> {
    use candle_nn::Init as H;
    let unsupported = |why: &str| {
        Err(Error::Model(format!(
            "tensor `{name}`: init hint {hint:?} {why}; give its values with \
             CandleModel::values_from"
        )))
    };
    Ok(match hint {
        H::Const(0.0) => Init::Zeros,
        H::Const(1.0) => Init::Ones,
        H::Const(c) => Init::Constant(c as f32),
        H::Randn { mean: 0.0, stdev } => Init::normal(stdev as f32),
        H::Randn { .. } => return unsupported("has a non-zero mean, which zero's Normal lacks"),
        H::Uniform { lo, up } if lo == -up => Init::Uniform { bound: up as f32 },
        H::Uniform { .. } => {
            return unsupported("is not symmetric around 0, which zero's Uniform needs")
        }
        H::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let fan: FanInOut = fan;
            let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
            match dist {
                NormalOrUniform::Normal => Init::normal(std as f32),
                NormalOrUniform::Uniform => Init::Uniform {
                    bound: (3f64.sqrt() * std) as f32,
                },
            }
        }
    })
}

/// One tensor of a registered unit.
#[derive(Debug, Clone)]
pub struct TensorDef {
    /// Its name within the unit (zero's tensor name).
    pub name: String,
    /// Its full candle name (`unit.tensor`).
    pub full_name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Whether it trains (not frozen).
    pub trainable: bool,
}

/// One registered unit: its engine id and tensors.
#[derive(Debug, Clone)]
pub struct RegisteredUnit {
    /// The engine's id.
    pub id: UnitId,
    /// The unit's name.
    pub name: String,
    /// Its tensors, in registration order.
    pub tensors: Vec<TensorDef>,
}

impl RegisteredUnit {
    /// Whether any of its tensors trains.
    pub fn trainable(&self) -> bool {
        self.tensors.iter().any(|t| t.trainable)
    }

    /// The number of parameters.
    pub fn numel(&self) -> usize {
        self.tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum()
    }
}

/// What [`CandleModel::register`] registered: one unit per model unit,
/// in order.
#[derive(Debug, Clone)]
pub struct Registered {
    /// The units.
    pub units: Vec<RegisteredUnit>,
}

/// The model's modules in order: `forward` runs them one after another.
pub struct Chain {
    modules: Vec<Box<dyn Module>>,
}

impl Module for Chain {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = xs.clone();
        for m in &self.modules {
            x = m.forward(&x)?;
        }
        Ok(x)
    }
}

/// One tensor a module asked for during registration.
struct Recorded {
    name: String,
    shape: Shape,
    hint: candle_nn::Init,
}

/// The recording `VarBuilder` backend of [`CandleModel::register`].
#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Recorded>>>,
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut seen = self.seen.lock().expect("the recorder's lock");
        match seen.iter().find(|r| r.name == name) {
            Some(r) if r.shape != s => candle_core::bail!(
                "tensor `{name}` asked for twice with shapes {:?} and {:?}",
                r.shape,
                s
            ),
            Some(_) => {}
            None => seen.push(Recorded {
                name: name.to_string(),
                shape: s.clone(),
                hint: h,
            }),
        }
        // No memory: one zero broadcast to the shape.
        Tensor::zeros((), dtype, dev)?.broadcast_as(s)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!(
            "tensor `{name}` is asked for without a shape (VarBuilder::get_unchecked): zero \
             registers tensors by shape; use get / get_with_hints"
        )
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}
