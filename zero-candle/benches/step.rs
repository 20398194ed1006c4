//! The zero-candle training step against plain candle, same model, batch
//! and process: a small candle-nn transformer (`zero_candle::tiny`) on one
//! rank, fp32. Plain candle is `candle_nn::AdamW` over a `VarMap`
//! (`backward_step` on the loss), started from zero's initial parameters;
//! zero-candle is `Trainer::train_micro_batch` + `Trainer::step` at stage
//! 0 (whole graph, the target: ≤ 1.15× plain candle) and, for reference,
//! at stage 3 with per-unit recompute (one more forward pass per step).
//! Steps alternate between the setups, the order rotating each round (A B
//! C, B C A, C A B, …), so that the machine's drift hits all alike; the
//! figure is the median step (and, for a busy machine, the fastest).
//!
//! ```text
//! cargo bench -p zero-candle --bench step
//! cargo bench -p zero-candle --bench step -- --steps 40 --layers 6 --dim 256
//! ```
//!
//! Allocator: the system's (glibc malloc, default settings); candle's
//! matrix products run on its rayon pool (all cores), zero's optimizer on
//! its own threads (the engine's default).

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Module};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use zero::comm::{CommOptions, ThreadGroup};
use zero::core::config::ResolvedConfig;
use zero::core::optim::LrSchedule;
use zero::Engine;
use zero_candle::tiny::{self, TinyConfig};
use zero_candle::{Backward, Trainer};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}: `{v}` is not a count"))
        })
        .unwrap_or(default)
}

/// (median, minimum) in seconds.
fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    (v[v.len() / 2].as_secs_f64(), v[0].as_secs_f64())
}

fn config(stage: u8, micro: usize) -> ResolvedConfig {
    let mut c = ResolvedConfig::simple(stage, 1, micro);
    c.optimizer.lr = 1e-3;
    c.optimizer.weight_decay = 0.01;
    c.scheduler = LrSchedule::Constant { lr: 1e-3 };
    c.gradient_clipping = 0.0; // candle's AdamW does not clip
    c
}

fn main() {
    let steps = arg("--steps", 30);
    let micro = arg("--micro", 16);
    let seq = arg("--seq", 64);
    let shape = TinyConfig {
        vocab: 64,
        dim: arg("--dim", 128),
        heads: 4,
        hidden: 4 * arg("--dim", 128),
        layers: arg("--layers", 4),
    };
    println!(
        "step: tiny transformer, {} parameters ({} blocks of dim {}), {micro} sequences of {seq} \
         tokens per step, one rank, fp32; {steps} timed steps per setup after 3 warm-up steps, \
         alternated",
        shape.numel(),
        shape.layers,
        shape.dim
    );
    let out = {
        let one = || {
            ThreadGroup::comms(1, &CommOptions::default())
                .unwrap()
                .remove(0)
        };
        let (comm, comm2) = (one(), one());
        let model = shape.model();
        let mut b = Engine::builder(config(0, micro), comm).seed(1);
        let reg = model.register(&mut b).unwrap();
        let mut z0 = Trainer::<f32, _>::new(b.build().unwrap(), model, reg)
            .unwrap()
            .with_backward(Backward::WholeGraph);
        let model = shape.model();
        let mut b = Engine::builder(config(3, micro), comm2).seed(1);
        let reg = model.register(&mut b).unwrap();
        let mut z3 = Trainer::<f32, _>::new(b.build().unwrap(), model, reg)
            .unwrap()
            .with_backward(Backward::Recompute);

        let vars = VarMap::new();
        z0.write_vars(&vars).unwrap();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let plain = shape.model().build(&vb).unwrap();
        let p = config(0, micro).optimizer;
        let mut opt = candle_nn::AdamW::new(
            vars.all_vars(),
            candle_nn::ParamsAdamW {
                lr: p.lr,
                beta1: p.beta1,
                beta2: p.beta2,
                eps: p.eps,
                weight_decay: p.weight_decay,
            },
        )
        .unwrap();

        let mut times = [Vec::new(), Vec::new(), Vec::new()];
        let mut losses = [0f32; 3];
        for step in 0..steps + 3 {
            let (x, y) = tiny::batch((step * micro) as u64, micro, seq, shape.vocab).unwrap();
            // The order rotates each round (A B C, B C A, C A B): none
            // always runs right after another.
            for k in 0..3 {
                let s = (step + k) % 3;
                let t = Instant::now();
                losses[s] = match s {
                    0 => {
                        let l = tiny::loss(&plain.forward(&x).unwrap(), &y).unwrap();
                        opt.backward_step(&l).unwrap();
                        l.to_scalar::<f32>().unwrap()
                    }
                    1 => {
                        let l = z0
                            .train_micro_batch(&x, |logits| tiny::loss(logits, &y))
                            .unwrap();
                        z0.step().unwrap();
                        l
                    }
                    _ => {
                        let l = z3
                            .train_micro_batch(&x, |logits| tiny::loss(logits, &y))
                            .unwrap();
                        z3.step().unwrap();
                        l
                    }
                };
                if step >= 3 {
                    times[s].push(t.elapsed());
                }
            }
        }
        (times, losses)
    };
    let (times, losses) = out;
    let [plain, z0, z3] = times.map(stats);
    println!(
        "| setup | median step s | × plain candle | fastest step s | × plain candle | last loss |"
    );
    println!("|---|---|---|---|---|---|");
    let row = |name: &str, (m, f): (f64, f64), loss: f32| {
        println!(
            "| {name} | {m:.4} | {:.2} | {f:.4} | {:.2} | {loss:.4} |",
            m / plain.0,
            f / plain.1
        )
    };
    row("plain candle (candle_nn::AdamW)", plain, losses[0]);
    row("zero-candle, stage 0, whole graph", z0, losses[1]);
    row("zero-candle, stage 3, recompute", z3, losses[2]);
    let ratio = z0.0 / plain.0;
    println!(
        "stage 0 median step / plain candle median step = {ratio:.3} (target ≤ 1.15): {}; \
         fastest steps: {:.3}",
        if ratio <= 1.15 { "ok" } else { "MISS" },
        z0.1 / plain.1
    );
}
