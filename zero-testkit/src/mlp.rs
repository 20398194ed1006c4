//! A small multi-layer perceptron driven through the engine API: the model
//! of the engine's tests and of `examples/mlp_regression.rs`.
//!
//! Each layer is one unit with tensors `weight` `[out, in]` and `bias`
//! `[out]`; hidden layers use tanh. The loss is the mean squared error of
//! the micro-batch. Compute is f32 whatever the parameter dtype `T`:
//! parameters are read as `T` and converted, gradients are written as `T`.
//! It runs on any backend: it reads the gathered parameters through host
//! views and writes its gradients with `GradBuffer::write_host`.

use zero::core::partition::{TensorSpec, UnitSpec};
use zero::core::Element;
use zero::{Engine, EngineBackend, EngineBuilder, EngineComm, Init, Result, UnitGuard, UnitId};

/// Layer sizes and the registered units.
pub struct Mlp {
    /// `dims[0]` inputs, `dims[last]` outputs.
    pub dims: Vec<usize>,
    /// One unit per layer.
    pub units: Vec<UnitId>,
}

impl Mlp {
    /// Registers one unit per layer (`layer0`, `layer1`, …).
    pub fn register<C: EngineComm<B>, B: EngineBackend>(
        b: &mut EngineBuilder<C, B>,
        dims: &[usize],
    ) -> Result<Self> {
        let mut units = Vec::new();
        for l in 0..dims.len() - 1 {
            let (i, o) = (dims[l], dims[l + 1]);
            let spec = UnitSpec::new(
                format!("layer{l}"),
                vec![
                    TensorSpec::new("weight", &[o, i]),
                    TensorSpec::new("bias", &[o]),
                ],
            );
            let std = 1.0 / (i as f32).sqrt();
            units.push(b.register(spec, vec![Init::normal(std), Init::Constant(0.01)])?);
        }
        Ok(Self {
            dims: dims.to_vec(),
            units,
        })
    }

    /// Forward pass of one layer's parameters on `n` inputs.
    fn layer(&self, l: usize, w: &[f32], b: &[f32], a: &[f32], n: usize) -> Vec<f32> {
        let (i, o) = (self.dims[l], self.dims[l + 1]);
        let last = l + 2 == self.dims.len();
        let mut z = vec![0f32; n * o];
        for s in 0..n {
            for r in 0..o {
                let mut acc = b[r];
                for c in 0..i {
                    acc += w[r * i + c] * a[s * i + c];
                }
                z[s * o + r] = if last { acc } else { acc.tanh() };
            }
        }
        z
    }

    fn read<T: Element, B: EngineBackend>(p: &UnitGuard<B>, name: &str) -> Result<Vec<f32>> {
        let t = p.layout().tensor(name).expect("an MLP tensor").clone();
        let all = p.host_params::<T>()?;
        Ok(all[t.offset..t.offset + t.numel]
            .iter()
            .map(|x| x.to_f32())
            .collect())
    }

    /// Predictions for `x` (`n × dims[0]`).
    pub fn predict<T: Element, C: EngineComm<B>, B: EngineBackend>(
        &self,
        e: &mut Engine<C, B>,
        x: &[f32],
    ) -> Result<Vec<f32>> {
        let n = x.len() / self.dims[0];
        let mut a = x.to_vec();
        for (l, &u) in self.units.iter().enumerate() {
            let p = e.gather(u)?;
            let w = Self::read::<T, B>(&p, "weight")?;
            let b = Self::read::<T, B>(&p, "bias")?;
            drop(p);
            a = self.layer(l, &w, &b, &a, n);
        }
        Ok(a)
    }

    /// One micro-batch: forward, loss, backward, `grad_ready` per unit (in
    /// reverse order). Gradients are of `loss * loss_scale`. Returns the
    /// micro-batch loss. Call [`Engine::step`] afterwards.
    pub fn train_micro_batch<T: Element, C: EngineComm<B>, B: EngineBackend>(
        &self,
        e: &mut Engine<C, B>,
        x: &[f32],
        y: &[f32],
    ) -> Result<f32> {
        let n = y.len();
        let out = *self.dims.last().expect("dims");
        let mut acts = vec![x.to_vec()];
        for (l, &u) in self.units.iter().enumerate() {
            let p = e.gather(u)?;
            let w = Self::read::<T, B>(&p, "weight")?;
            let b = Self::read::<T, B>(&p, "bias")?;
            drop(p);
            let next = self.layer(l, &w, &b, acts.last().expect("input"), n);
            acts.push(next);
        }
        let pred = acts.last().expect("output");
        let mut loss = 0f32;
        let scale = e.loss_scale();
        // d(mean over samples and outputs of (p - y)^2) / dp
        let denom = (n * out) as f32;
        let mut delta: Vec<f32> = pred
            .iter()
            .zip(y)
            .map(|(p, t)| {
                loss += (p - t) * (p - t);
                2.0 * (p - t) / denom * scale
            })
            .collect();
        loss /= denom;
        for l in (0..self.units.len()).rev() {
            let u = self.units[l];
            let (i, o) = (self.dims[l], self.dims[l + 1]);
            let p = e.gather(u)?;
            let w = Self::read::<T, B>(&p, "weight")?;
            let layout = p.layout().clone();
            let mut g = e.grad_buffer::<T>(u)?;
            drop(p);
            let a = &acts[l];
            let wo = layout.tensor("weight").expect("weight").offset;
            let bo = layout.tensor("bias").expect("bias").offset;
            let mut gw = vec![0f32; o * i];
            let mut gb = vec![0f32; o];
            for s in 0..n {
                for r in 0..o {
                    let d = delta[s * o + r];
                    gb[r] += d;
                    for c in 0..i {
                        gw[r * i + c] += d * a[s * i + c];
                    }
                }
            }
            g.write_host(|g| {
                for (k, v) in gw.iter().enumerate() {
                    g[wo + k] = T::from_f32(*v);
                }
                for (k, v) in gb.iter().enumerate() {
                    g[bo + k] = T::from_f32(*v);
                }
            })?;
            if l > 0 {
                // Through the weights, then tanh' = 1 - a^2.
                let mut prev = vec![0f32; n * i];
                for s in 0..n {
                    for c in 0..i {
                        let mut acc = 0f32;
                        for r in 0..o {
                            acc += w[r * i + c] * delta[s * o + r];
                        }
                        let act = a[s * i + c];
                        prev[s * i + c] = acc * (1.0 - act * act);
                    }
                }
                delta = prev;
            }
            e.grad_ready(u, g)?;
        }
        Ok(loss)
    }
}

/// The synthetic regression task: inputs uniform in [-1, 1), target
/// `sin(2 x0) + x1 x2 - 0.5 x3` (zero-padded if fewer inputs). Sample `k` of
/// the stream is the same whoever draws it.
pub fn sample(k: u64, inputs: usize) -> (Vec<f32>, f32) {
    let mut s = k.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1234_5678;
    let x: Vec<f32> = (0..inputs)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    let g = |i: usize| x.get(i).copied().unwrap_or(0.0);
    let y = (2.0 * g(0)).sin() + g(1) * g(2) - 0.5 * g(3);
    (x, y)
}

/// Samples `first..first + n` as a batch `(x, y)`.
pub fn batch(first: u64, n: usize, inputs: usize) -> (Vec<f32>, Vec<f32>) {
    let mut xs = Vec::with_capacity(n * inputs);
    let mut ys = Vec::with_capacity(n);
    for k in 0..n as u64 {
        let (x, y) = sample(first + k, inputs);
        xs.extend(x);
        ys.push(y);
    }
    (xs, ys)
}
