//! The training loop's calls: a micro-batch through candle's forward and
//! backward with zero's gathers and gradient hand-off, the optimizer step,
//! evaluation and the write-back of the parameters into a `VarMap`.

use std::collections::HashMap;
use std::marker::PhantomData;

use candle_core::{DType, Device, Module, Storage, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use zero::core::Element;
use zero::{Engine, EngineBackend, EngineComm, StepOutcome, UnitGuard};

use crate::model::{CandleModel, Registered, RegisteredUnit};
use crate::{candle_err, Error, Result};

/// A unit's module and its trainable tensors' `Var`s (with their index in
/// the unit).
type BuiltUnit = (Box<dyn Module>, Vec<(usize, Tensor)>);

/// How a micro-batch's backward pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backward {
    /// One candle graph for the whole model: every unit's parameters (as
    /// candle `Var`s), activations and gradients live until `backward()`
    /// ends, then each unit's gradient goes to zero. The fastest; the
    /// candle side holds the whole model, so stage 3 saves memory in the
    /// engine only.
    WholeGraph,
    /// Per-unit recompute (activation checkpointing at unit boundaries):
    /// the forward pass keeps each unit's input only; backward gathers one
    /// unit at a time, reruns its forward with a graph, back-propagates
    /// the output's gradient through it, and hands its gradient to zero
    /// before the next unit. The candle side holds one unit's parameters,
    /// graph and gradients at a time: what stage 3 needs to keep its
    /// memory. One more forward pass per micro-batch.
    Recompute,
}

impl Backward {
    /// The default for a stage: [`Backward::Recompute`] at stage 3,
    /// [`Backward::WholeGraph`] below it.
    pub fn for_stage(stage: u8) -> Self {
        if stage == 3 {
            Backward::Recompute
        } else {
            Backward::WholeGraph
        }
    }
}

/// A candle model trained by a zero [`Engine`]: the engine owns the
/// parameters, gradients' reduction and optimizer state; each micro-batch
/// builds the units' candle modules from the gathered parameters.
///
/// `T` is the engine's parameter dtype (`f32`, `bf16`, `f16`); candle
/// computes in f32 whatever `T` is (parameters are widened when a unit's
/// tensors are built, gradients narrowed when they are written).
///
/// Copies per micro-batch, the fewest the two APIs allow: each unit's
/// parameters once from the gathered buffer into candle tensors (candle's
/// CPU tensors own their `Vec`, zero owns its gathered buffer, so one copy
/// is needed, and it is the f32 widening), each gradient once from
/// candle's gradient tensor (read in place through its storage) into the
/// engine's gradient buffer (scaled by the loss scale and narrowed to `T`
/// on the way). With [`Backward::Recompute`], each unit's parameters are
/// copied twice (forward, then the recompute) and each boundary
/// activation once more (into a `Var`, to get its gradient).
pub struct Trainer<T: Element, C: EngineComm<B>, B: EngineBackend = zero::core::backend::CpuBackend>
{
    engine: Engine<C, B>,
    model: CandleModel,
    registered: Registered,
    backward: Backward,
    _t: PhantomData<T>,
}

/// Widens a unit's gathered parameters into candle tensors by full name
/// (trainable ones as `Var`s when `vars`).
fn unit_tensors<T: Element, B: EngineBackend>(
    unit: &RegisteredUnit,
    guard: &UnitGuard<B>,
    vars: bool,
    into: &mut HashMap<String, Tensor>,
    grads: &mut Vec<(usize, Tensor)>,
) -> Result<()> {
    let layout = guard.layout();
    for (k, t) in unit.tensors.iter().enumerate() {
        if layout.tensor(&t.name).is_none() {
            return Err(Error::Model(format!(
                "unit `{}`: the engine's layout has no tensor `{}`",
                unit.name, t.name
            )));
        }
        // Wherever it lies (a frozen segment may be gathered apart).
        let data: Vec<f32> = guard
            .host_tensor::<T>(&t.name)?
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let tensor = if vars && t.trainable {
            let v = Var::from_vec(data, t.shape.as_slice(), &Device::Cpu)
                .map_err(|e| candle_err(format!("building `{}`", t.full_name), e))?;
            let v = v.into_inner();
            grads.push((k, v.clone()));
            v
        } else {
            Tensor::from_vec(data, t.shape.as_slice(), &Device::Cpu)
                .map_err(|e| candle_err(format!("building `{}`", t.full_name), e))?
        };
        into.insert(t.full_name.clone(), tensor);
    }
    Ok(())
}

/// Calls `f` on `t`'s elements as one f32 slice, read in place when `t` is
/// a contiguous f32 CPU tensor (a gradient always is, in practice).
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    if t.dtype() == DType::F32 {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(f(&cpu.as_slice::<f32>()?[a..b]));
        }
    }
    let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(f(&v))
}

impl<T: Element, C: EngineComm<B>, B: EngineBackend> Trainer<T, C, B> {
    /// Wraps an engine built with `registered` (from `model.register`).
    /// The backward mode is [`Backward::for_stage`] of the engine's stage.
    /// An error when `T` is not the engine's parameter dtype, or a unit
    /// is not the engine's.
    pub fn new(engine: Engine<C, B>, model: CandleModel, registered: Registered) -> Result<Self> {
        if engine.param_dtype() != T::DTYPE {
            return Err(Error::Model(format!(
                "the trainer's dtype is {:?}, the engine's parameters are {:?} (the config's \
                 precision)",
                T::DTYPE,
                engine.param_dtype()
            )));
        }
        if registered.units.len() != model.units.len() {
            return Err(Error::Model(format!(
                "the model has {} units, the registration {}",
                model.units.len(),
                registered.units.len()
            )));
        }
        for u in &registered.units {
            if engine.unit_id(&u.name) != Some(u.id) {
                return Err(Error::Model(format!(
                    "unit `{}` is not registered with this engine",
                    u.name
                )));
            }
        }
        let backward = Backward::for_stage(engine.config().zero.stage);
        Ok(Self {
            engine,
            model,
            registered,
            backward,
            _t: PhantomData,
        })
    }

    /// Chooses the backward mode (every rank must choose the same).
    pub fn with_backward(mut self, backward: Backward) -> Self {
        self.backward = backward;
        self
    }

    /// The backward mode.
    pub fn backward_mode(&self) -> Backward {
        self.backward
    }

    /// The engine (memory report, stats, checkpoints, …).
    pub fn engine(&self) -> &Engine<C, B> {
        &self.engine
    }

    /// The engine, mutably.
    pub fn engine_mut(&mut self) -> &mut Engine<C, B> {
        &mut self.engine
    }

    /// The registered units.
    pub fn registered(&self) -> &Registered {
        &self.registered
    }

    /// Gathers unit `u` and builds its module (`vars`: trainable tensors
    /// as `Var`s, returned with their index in the unit).
    fn build_unit(&mut self, u: usize, vars: bool) -> Result<BuiltUnit> {
        let unit = &self.registered.units[u];
        let guard = self.engine.gather(unit.id)?;
        let mut tensors = HashMap::with_capacity(unit.tensors.len());
        let mut grads = Vec::new();
        unit_tensors::<T, B>(unit, &guard, vars, &mut tensors, &mut grads)?;
        drop(guard);
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        let def = &self.model.units[u];
        let module = (def.build)(vb.pp(&def.name))
            .map_err(|e| candle_err(format!("building unit `{}`", def.name), e))?;
        Ok((module, grads))
    }

    /// Writes unit `u`'s gradients from `store` into its gradient buffer
    /// (times the loss scale) and hands it to the engine. A trainable
    /// tensor the loss does not depend on gets a zero gradient.
    fn hand_gradient(
        &mut self,
        u: usize,
        vars: &[(usize, Tensor)],
        store: &candle_core::backprop::GradStore,
    ) -> Result<()> {
        let unit = &self.registered.units[u];
        if !unit.trainable() {
            return Ok(());
        }
        let scale = self.engine.loss_scale();
        let mut buf = self.engine.grad_buffer::<T>(unit.id)?;
        for (k, var) in vars {
            let t = &unit.tensors[*k];
            let Some(g) = store.get(var) else { continue };
            with_f32(g, |g| {
                buf.write_tensor_host(&t.name, |dst| {
                    for (d, s) in dst.iter_mut().zip(g) {
                        *d = T::from_f32(s * scale);
                    }
                })
            })
            .map_err(|e| candle_err(format!("reading the gradient of `{}`", t.full_name), e))??;
        }
        self.engine.grad_ready(unit.id, buf)?;
        Ok(())
    }

    /// One micro-batch: the forward pass from `input` through every unit,
    /// `loss` of the last unit's output (a scalar f32 tensor: the
    /// micro-batch's mean loss, as the engine averages over ranks and
    /// micro-batches), backward, and each unit's gradient handed to the
    /// engine as soon as it is known. Returns the loss. Call
    /// [`Trainer::step`] after each micro-batch.
    ///
    /// A failure part way leaves some units' gradients handed over: call
    /// `engine_mut().zero_grad()` on every rank before going on (the
    /// engine's next gradient call says so too).
    pub fn train_micro_batch(
        &mut self,
        input: &Tensor,
        loss: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<f32> {
        match self.backward {
            Backward::WholeGraph => self.whole_graph(input, &loss),
            Backward::Recompute => self.recompute(input, &loss),
        }
    }

    fn scalar(loss: &Tensor) -> Result<f32> {
        loss.to_dtype(DType::F32)
            .and_then(|l| l.to_scalar::<f32>())
            .map_err(|e| candle_err("the loss (a scalar tensor)".into(), e))
    }

    fn whole_graph(
        &mut self,
        input: &Tensor,
        loss: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<f32> {
        let n = self.registered.units.len();
        let mut vars = Vec::with_capacity(n);
        let mut x = input.clone();
        for u in 0..n {
            let (module, v) = self.build_unit(u, true)?;
            x = module.forward(&x).map_err(|e| self.forward_err(u, e))?;
            vars.push(v);
        }
        let l = loss(&x).map_err(|e| candle_err("the loss function".into(), e))?;
        let value = Self::scalar(&l)?;
        let store = l
            .backward()
            .map_err(|e| candle_err("candle's backward pass".into(), e))?;
        drop(x);
        drop(l);
        for u in (0..n).rev() {
            self.hand_gradient(u, &vars[u], &store)?;
        }
        Ok(value)
    }

    fn recompute(
        &mut self,
        input: &Tensor,
        loss: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<f32> {
        let n = self.registered.units.len();
        // Forward without a graph: the input of every unit but the first
        // is kept (the last unit runs in backward first).
        let mut inputs = Vec::with_capacity(n);
        inputs.push(input.detach());
        for u in 0..n - 1 {
            let (module, _) = self.build_unit(u, false)?;
            let y = module
                .forward(&inputs[u])
                .map_err(|e| self.forward_err(u, e))?;
            inputs.push(y.detach());
        }
        let mut value = 0.0;
        // The gradient of the loss with respect to the next unit's input.
        let mut out_grad: Option<Tensor> = None;
        for u in (0..n).rev() {
            let (module, vars) = self.build_unit(u, true)?;
            let x = inputs.pop().expect("one input per unit");
            // Its gradient is wanted when a unit before needs it.
            if u > 0 && !x.dtype().is_float() {
                return Err(Error::Model(format!(
                    "unit `{}` gets a {:?} input from unit `{}`: with per-unit recompute, every \
                     unit but the first takes a float tensor (the gradient flows back through it)",
                    self.registered.units[u].name,
                    x.dtype(),
                    self.registered.units[u - 1].name
                )));
            }
            let x = if u > 0 {
                Var::from_tensor(&x)
                    .map_err(|e| {
                        candle_err(
                            format!("unit `{}`'s input", self.registered.units[u].name),
                            e,
                        )
                    })?
                    .into_inner()
            } else {
                x
            };
            let y = module.forward(&x).map_err(|e| self.forward_err(u, e))?;
            let objective = match out_grad.take() {
                None => {
                    let l = loss(&y).map_err(|e| candle_err("the loss function".into(), e))?;
                    value = Self::scalar(&l)?;
                    l
                }
                // d(sum(y ⊙ g))/dy = g: the backward pass from a given
                // output gradient, which candle has no call for.
                Some(g) => (y * g)
                    .and_then(|p| p.sum_all())
                    .map_err(|e| candle_err("the output gradient's product".into(), e))?,
            };
            let store = objective.backward().map_err(|e| {
                candle_err(
                    format!("unit `{}`'s backward pass", self.registered.units[u].name),
                    e,
                )
            })?;
            if u > 0 {
                // Detached: a gradient computed from Vars carries its graph,
                // which the next unit's backward would walk again.
                let g = store.get(&x).ok_or_else(|| {
                    Error::Model(format!(
                        "unit `{}`'s output does not depend on its input",
                        self.registered.units[u].name
                    ))
                })?;
                out_grad = Some(g.detach());
            }
            self.hand_gradient(u, &vars, &store)?;
        }
        Ok(value)
    }

    fn forward_err(&self, u: usize, e: candle_core::Error) -> Error {
        candle_err(
            format!("unit `{}`'s forward pass", self.registered.units[u].name),
            e,
        )
    }

    /// Ends the micro-batch: every `gradient_accumulation_steps` calls,
    /// the optimizer step (gradient norm, clipping, AdamW).
    pub fn step(&mut self) -> Result<StepOutcome> {
        Ok(self.engine.step()?)
    }

    /// The model's output for `input` without gradients (the engine in
    /// evaluation mode for the pass: stage 3's gathers are not recorded
    /// into its prefetch order).
    pub fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        self.in_eval(|t| t.forward_eval(input))
    }

    /// Runs `f` with the engine in evaluation mode, then back in the mode
    /// it was in.
    fn in_eval<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        let training = self.engine.is_training();
        if training {
            self.engine.eval()?;
        }
        let out = f(self);
        if training {
            self.engine.train()?;
        }
        out
    }

    fn forward_eval(&mut self, input: &Tensor) -> Result<Tensor> {
        let mut x = input.detach();
        for u in 0..self.registered.units.len() {
            let (module, _) = self.build_unit(u, false)?;
            x = module.forward(&x).map_err(|e| self.forward_err(u, e))?;
        }
        Ok(x)
    }

    /// Writes the current parameters into `vars` by full name (f32; a
    /// missing variable is created, an existing one of another shape is
    /// an error naming it): the trained model for candle alone
    /// (`VarMap::save` writes safetensors). A collective at stage 3 (every
    /// rank calls it). Between micro-batches only.
    pub fn write_vars(&mut self, vars: &VarMap) -> Result<()> {
        // Evaluation mode: these gathers stay out of stage 3's prefetch order.
        self.in_eval(|t| t.write_vars_eval(vars))
    }

    fn write_vars_eval(&mut self, vars: &VarMap) -> Result<()> {
        for u in 0..self.registered.units.len() {
            let unit = &self.registered.units[u];
            let guard = self.engine.gather(unit.id)?;
            let mut tensors = HashMap::new();
            unit_tensors::<T, B>(unit, &guard, false, &mut tensors, &mut Vec::new())?;
            drop(guard);
            let mut data = vars.data().lock().expect("the VarMap's lock");
            for (name, t) in tensors {
                match data.get(&name) {
                    Some(v) => v
                        .set(&t)
                        .map_err(|e| candle_err(format!("writing `{name}` into the VarMap"), e))?,
                    None => {
                        let v = Var::from_tensor(&t)
                            .map_err(|e| candle_err(format!("creating `{name}`"), e))?;
                        data.insert(name, v);
                    }
                }
            }
        }
        Ok(())
    }

    /// The engine, for what the trainer does not wrap.
    pub fn into_engine(self) -> Engine<C, B> {
        self.engine
    }
}
