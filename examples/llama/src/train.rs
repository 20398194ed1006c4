//! The Llama model driven through the engine: one unit per block, one for
//! the embedding and one for the head (final norm and LM head), so stage 3
//! gathers and releases block by block and gradients are reduced per block
//! while backward goes on.
//!
//! Units and their tensors (HF-Llama names, so an export needs no mapping):
//!
//! | unit | tensors |
//! |---|---|
//! | `model.embed_tokens` | `model.embed_tokens.weight` |
//! | `model.layers.{i}` | the 9 tensors of [`super::block_tensors`] |
//! | `lm_head` | `model.norm.weight`, `lm_head.weight` (only the norm when tied) |
//!
//! With tied embeddings (`Config::tie_embeddings`) the LM head reads the
//! embedding unit, gathered a second time for the head, and the embedding's
//! gradient is the head's plus the lookup's, handed to the engine once.
//!
//! Compute is f32 whatever the parameter dtype `T` (bf16 parameters, fp32
//! accumulation): a unit's parameters are converted once per gather, its
//! gradients are written back as `T`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use zero::comm::Communicator;
use zero::core::memory::{Category, Tier};
use zero::core::partition::{TensorSpec, UnitSpec};
use zero::core::Element;
use zero::trace::Tracer;
use zero::{Engine, EngineBuilder, Init, Result, UnitGuard, UnitId};

use super::ops;
use super::{block_tensors, tensors, Block, BlockCache, BlockParams, Config, Kind, TensorInfo};

/// The registered model.
pub struct SftModel {
    /// Hyper-parameters.
    pub cfg: Config,
    /// The block kernels (stateless but for the RoPE tables).
    pub block: Block,
    /// `model.embed_tokens`.
    pub embed: UnitId,
    /// `model.layers.{i}`.
    pub layers: Vec<UnitId>,
    /// `lm_head` (with the final norm).
    pub head: UnitId,
    /// Keep only block inputs in forward; recompute in backward.
    pub checkpointing: bool,
    /// GEMM threads.
    pub threads: usize,
}

/// What one micro-batch did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroStats {
    /// Mean cross-entropy over the answer tokens of this rank's micro-batch.
    pub loss: f32,
    /// Tokens that carried loss.
    pub target_tokens: usize,
    /// Peak bytes of activations this rank kept at once.
    pub activation_bytes: u64,
}

fn unit_spec(name: String, infos: &[TensorInfo]) -> UnitSpec {
    UnitSpec::new(
        name,
        infos
            .iter()
            .map(|t| TensorSpec::new(t.name.clone(), &t.shape))
            .collect(),
    )
}

/// Normal(0, 0.02) matrices and unit norms, or the given values.
fn inits(infos: &[TensorInfo], values: &mut dyn Iterator<Item = Option<Vec<f32>>>) -> Vec<Init> {
    infos
        .iter()
        .map(|t| match values.next().flatten() {
            Some(v) => Init::Values(Arc::from(v)),
            None => match t.kind {
                Kind::Norm => Init::Ones,
                Kind::Bias => Init::Zeros,
                Kind::Embedding | Kind::Linear => Init::normal(0.02),
            },
        })
        .collect()
}

fn f32s<T: Element>(s: &[T]) -> Vec<f32> {
    s.iter().map(|x| x.to_f32()).collect()
}

fn cache_bytes(c: &BlockCache) -> u64 {
    c.bytes()
}

/// Saved state of one block between forward and backward.
enum Saved {
    Full(Box<BlockCache>),
    /// Activation checkpointing: the block input only.
    Input(Vec<f32>),
}

impl Saved {
    fn bytes(&self) -> u64 {
        match self {
            Saved::Full(c) => cache_bytes(c),
            Saved::Input(x) => 4 * x.len() as u64,
        }
    }
}

impl SftModel {
    /// Registers the units. `init`: values for every tensor in
    /// [`tensors`] order (`--init-from`), else the default initialisation.
    pub fn register<C: Communicator>(
        b: &mut EngineBuilder<C>,
        cfg: Config,
        init: Option<Vec<Vec<f32>>>,
        threads: usize,
        checkpointing: bool,
    ) -> Result<Self> {
        cfg.validate();
        let all = tensors(&cfg);
        let mut values: Box<dyn Iterator<Item = Option<Vec<f32>>>> = match init {
            Some(v) => {
                assert_eq!(v.len(), all.len(), "one value vector per tensor");
                Box::new(v.into_iter().map(Some))
            }
            None => Box::new(std::iter::repeat_with(|| None)),
        };
        let embed_info = &all[..1];
        let embed = b.register(
            unit_spec("model.embed_tokens".into(), embed_info),
            inits(embed_info, &mut values),
        )?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let infos = block_tensors(&cfg, i);
            layers.push(b.register(
                unit_spec(format!("model.layers.{i}"), &infos),
                inits(&infos, &mut values),
            )?);
        }
        let head_info = &all[cfg.norm_index()..];
        let head = b.register(
            unit_spec("lm_head".into(), head_info),
            inits(head_info, &mut values),
        )?;
        Ok(SftModel {
            cfg,
            block: Block::new(cfg, threads),
            embed,
            layers,
            head,
            checkpointing,
            threads,
        })
    }

    /// Gathers `u` and converts its parameters to f32 for the CPU ops; the
    /// unit stays gathered until the guard drops.
    fn fetch<T: Element, C: Communicator>(
        e: &mut Engine<C>,
        u: UnitId,
    ) -> Result<(UnitGuard, Vec<f32>)> {
        let p = e.gather(u)?;
        let flat = f32s(p.params::<T>()?);
        Ok((p, flat))
    }

    /// Slices a block unit's flat parameters into its 9 tensors.
    fn block_params<'a>(&self, flat: &'a [f32]) -> BlockParams<'a> {
        let mut rest = flat;
        let parts: Vec<&[f32]> = block_tensors(&self.cfg, 0)
            .iter()
            .map(|t| {
                let (a, b) = rest.split_at(t.numel());
                rest = b;
                a
            })
            .collect();
        BlockParams::from_slices(&parts)
    }

    /// One micro-batch on this rank: forward, loss, backward, `grad_ready`
    /// per unit in reverse order. Gradients are of `loss * loss_scale`. Call
    /// [`Engine::step`] afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn train_micro_batch<T: Element, C: Communicator>(
        &self,
        e: &mut Engine<C>,
        tokens: &[u32],
        targets: &[i32],
        batch: usize,
        seq: usize,
        tracer: &Tracer,
    ) -> Result<MicroStats> {
        let c = &self.cfg;
        let rank = e.rank();
        let rows = batch * seq;
        assert_eq!(tokens.len(), rows);
        assert_eq!(targets.len(), rows);
        let mut act = e.tracker().allocate(Tier::Device, Category::Activations, 0);
        let mut live = 0u64;
        let mut peak = 0u64;
        let mut grow = |act: &mut zero::core::memory::Allocation, live: &mut u64, by: i64| {
            *live = (*live as i64 + by) as u64;
            peak = peak.max(*live);
            act.resize(*live);
        };

        // Forward.
        let fwd = tracer.span(rank, "forward", "compute");
        let (p, table) = Self::fetch::<T, C>(e, self.embed)?;
        let mut x = ops::embedding_forward(&table, tokens, c.dim);
        drop((p, table));
        let mut saved: Vec<Saved> = Vec::with_capacity(c.n_layers);
        for &u in &self.layers {
            let (_unit, flat) = Self::fetch::<T, C>(e, u)?;
            let cache = self
                .block
                .forward(&self.block_params(&flat), &x, batch, seq);
            let next = cache.y.clone();
            let s = if self.checkpointing {
                Saved::Input(std::mem::replace(&mut x, next))
            } else {
                x = next;
                Saved::Full(Box::new(cache))
            };
            grow(&mut act, &mut live, s.bytes() as i64);
            saved.push(s);
        }
        drop(fwd);

        // Head: final norm and LM head on the rows that carry loss only,
        // then its backward right away (its parameters are at hand).
        let bwd = tracer.span(rank, "backward", "compute");
        let picked: Vec<usize> = (0..rows).filter(|&r| targets[r] >= 0).collect();
        let (head, hp) = Self::fetch::<T, C>(e, self.head)?;
        // Tied: the LM head is the embedding table, gathered again.
        let tied = if c.tie_embeddings {
            Some(Self::fetch::<T, C>(e, self.embed)?)
        } else {
            None
        };
        let (norm_w, head_w) = match &tied {
            Some((_, table)) => (&hp[..], &table[..]),
            None => hp.split_at(c.dim),
        };
        let mut hx = Vec::with_capacity(picked.len() * c.dim);
        for &r in &picked {
            hx.extend_from_slice(&x[r * c.dim..(r + 1) * c.dim]);
        }
        let (xn, inv) = ops::rmsnorm_forward(&hx, norm_w, c.norm_eps);
        let logits = ops::linear_forward(&xn, head_w, picked.len(), c.dim, c.vocab, self.threads);
        let picked_targets: Vec<i32> = picked.iter().map(|&r| targets[r]).collect();
        let (loss, mut dlogits) = ops::cross_entropy(&logits, &picked_targets, c.vocab);
        drop(logits);
        let scale = e.loss_scale();
        if scale != 1.0 {
            dlogits.iter_mut().for_each(|g| *g *= scale);
        }
        let mut g = e.grad_buffer::<T>(self.head)?;
        let mut dhead = vec![0.0; head_w.len()];
        let mut dxn = vec![0.0; xn.len()];
        ops::linear_backward(
            &dlogits,
            &xn,
            head_w,
            &mut dhead,
            &mut dxn,
            (picked.len(), c.dim, c.vocab),
            self.threads,
        );
        let mut dnorm = vec![0.0; c.dim];
        let mut dhx = vec![0.0; hx.len()];
        ops::rmsnorm_backward(&dxn, &hx, norm_w, &inv, &mut dhx, &mut dnorm);
        drop(tied);
        drop(head);
        // Tied: the head's share of the embedding's gradient waits for the
        // lookup's (at the end of backward), in f32.
        let (head_grad, mut demb) = if c.tie_embeddings {
            (Vec::new(), dhead)
        } else {
            (dhead, vec![0.0; c.vocab * c.dim])
        };
        for (o, v) in g.iter_mut().zip(dnorm.iter().chain(&head_grad)) {
            *o = T::from_f32(*v);
        }
        e.grad_ready(self.head, g)?;
        let mut dx = vec![0.0; rows * c.dim];
        for (k, &r) in picked.iter().enumerate() {
            dx[r * c.dim..(r + 1) * c.dim].copy_from_slice(&dhx[k * c.dim..(k + 1) * c.dim]);
        }

        // Blocks, last to first.
        for (l, &u) in self.layers.iter().enumerate().rev() {
            let (unit, flat) = Self::fetch::<T, C>(e, u)?;
            let p = self.block_params(&flat);
            let s = saved.pop().expect("one saved state per block");
            let cache = match s {
                Saved::Full(cache) => *cache,
                Saved::Input(input) => {
                    let cache = self.block.forward(&p, &input, batch, seq);
                    grow(&mut act, &mut live, cache_bytes(&cache) as i64);
                    grow(&mut act, &mut live, -(4 * input.len() as i64));
                    cache
                }
            };
            let (d, grads) = self.block.backward(&p, &cache, &dx);
            grow(&mut act, &mut live, -(cache_bytes(&cache) as i64));
            drop(cache);
            dx = d;
            let mut g = e.grad_buffer::<T>(u)?;
            let mut at = 0;
            for t in grads.into_vec() {
                for (o, v) in g[at..at + t.len()].iter_mut().zip(&t) {
                    *o = T::from_f32(*v);
                }
                at += t.len();
            }
            drop(unit);
            e.grad_ready(u, g)?;
            debug_assert_eq!(l, saved.len());
        }

        // Embedding: its backward needs no parameters, so no gather.
        let mut g = e.grad_buffer::<T>(self.embed)?;
        ops::embedding_backward(&dx, tokens, c.dim, &mut demb);
        for (o, v) in g.iter_mut().zip(&demb) {
            *o = T::from_f32(*v);
        }
        e.grad_ready(self.embed, g)?;
        drop(bwd);
        Ok(MicroStats {
            loss,
            target_tokens: picked.len(),
            activation_bytes: peak,
        })
    }

    /// Every tensor's full value, in [`tensors`] order, read with
    /// [`Engine::unit_state`] (a collective in stages 1–3: every rank calls
    /// it; it does not gather, so the stage-3 gather order of training is
    /// left alone). Evaluation uses this snapshot, so it holds the whole
    /// model in f32 on each rank while it runs.
    pub fn snapshot<C: Communicator>(&self, e: &mut Engine<C>) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        let all = tensors(&self.cfg);
        let mut infos = all.iter();
        for u in std::iter::once(self.embed)
            .chain(self.layers.iter().copied())
            .chain(std::iter::once(self.head))
        {
            let flat = e.unit_state(u)?.params;
            let mut rest = &flat[..];
            while !rest.is_empty() {
                let t = infos.next().expect("units cover the tensors");
                let (a, b) = rest.split_at(t.numel());
                out.push(a.to_vec());
                rest = b;
            }
        }
        Ok(out)
    }
}

/// Rotates the rows of `x` `[rows, n_heads * head_dim]`, all at position
/// `pos`, as [`ops::Rope::forward`] does for that position.
fn rope_at(rope: &ops::Rope, x: &mut [f32], pos: usize, n_heads: usize) {
    let half = rope.half;
    let (c, s) = (
        &rope.cos[pos * half..(pos + 1) * half],
        &rope.sin[pos * half..(pos + 1) * half],
    );
    for head in x.chunks_exact_mut(2 * half) {
        debug_assert!(n_heads > 0);
        let (lo, hi) = head.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (lo[i], hi[i]);
            lo[i] = a * c[i] - b * s[i];
            hi[i] = b * c[i] + a * s[i];
        }
    }
}

/// Greedy decoding from a full set of parameters ([`SftModel::snapshot`]
/// order): each prompt is extended by up to `max_new` tokens, stopping at
/// `stop`. Prompts of equal length decode together as one batch: the
/// prompt runs through [`Block::forward`] once, which also gives each
/// layer's rotated keys and values; then every new token runs alone
/// against those cached keys and values (a KV cache).
pub fn generate(
    cfg: &Config,
    block: &Block,
    params: &[Vec<f32>],
    prompts: &[Vec<u32>],
    max_new: usize,
    stop: u32,
    threads: usize,
) -> Vec<Vec<u32>> {
    let (norm, head) = (cfg.norm_index(), cfg.head_index());
    let (dim, hd) = (cfg.dim, cfg.head_dim());
    let (qd, kd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let group = cfg.n_heads / cfg.n_kv_heads;
    let layer = |l: usize| -> Vec<&[f32]> {
        params[cfg.layer_range(l)]
            .iter()
            .map(Vec::as_slice)
            .collect()
    };
    // The next token of each row of `x` `[b, dim]` (final norm, head, argmax).
    let next_tokens = |x: &[f32], b: usize| -> Vec<u32> {
        let (xn, _) = ops::rmsnorm_forward(x, &params[norm], cfg.norm_eps);
        let logits = ops::linear_forward(&xn, &params[head], b, dim, cfg.vocab, threads);
        logits
            .chunks_exact(cfg.vocab)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |m, (t, &v)| if v > m.1 { (t, v) } else { m },
                    )
                    .0 as u32
            })
            .collect()
    };
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    lens.sort_unstable();
    lens.dedup();
    for len in lens {
        let idx: Vec<usize> = (0..prompts.len())
            .filter(|&i| prompts[i].len() == len)
            .collect();
        let b = idx.len();
        let budget = max_new.min(cfg.max_seq.saturating_sub(len));
        if budget == 0 {
            continue;
        }
        // Prefill: keys and values per layer, `[b][pos][kd]` flattened per row.
        let tokens: Vec<u32> = idx.iter().flat_map(|&i| prompts[i].clone()).collect();
        let mut x = ops::embedding_forward(&params[0], &tokens, dim);
        let mut keys: Vec<Vec<Vec<f32>>> = Vec::with_capacity(cfg.n_layers);
        let mut values: Vec<Vec<Vec<f32>>> = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let refs = layer(l);
            let c = block.forward(&BlockParams::from_slices(&refs), &x, b, len);
            let rows = |v: &[f32]| -> Vec<Vec<f32>> {
                v.chunks_exact(len * kd).map(|r| r.to_vec()).collect()
            };
            keys.push(rows(&c.k));
            values.push(rows(&c.v));
            x = c.y;
        }
        let last: Vec<f32> = (0..b)
            .flat_map(|i| x[(i * len + len - 1) * dim..(i * len + len) * dim].to_vec())
            .collect();
        let mut next = next_tokens(&last, b);
        let mut gen: Vec<Vec<u32>> = vec![Vec::new(); b];
        let mut done = vec![false; b];
        for step in 0..budget {
            for i in 0..b {
                if !done[i] {
                    gen[i].push(next[i]);
                    done[i] = next[i] == stop;
                }
            }
            if step + 1 == budget || done.iter().all(|&d| d) {
                break;
            }
            // One new token per row, at position `pos`.
            let pos = len + step;
            let t = pos + 1;
            let mut x = ops::embedding_forward(&params[0], &next, dim);
            for l in 0..cfg.n_layers {
                let refs = layer(l);
                let p = BlockParams::from_slices(&refs);
                let (xn, _) = ops::rmsnorm_forward(&x, p.attn_norm, cfg.norm_eps);
                let mut q = ops::linear_forward(&xn, p.wq, b, dim, qd, threads);
                let mut k = ops::linear_forward(&xn, p.wk, b, dim, kd, threads);
                let mut v = ops::linear_forward(&xn, p.wv, b, dim, kd, threads);
                for (y, bias) in [(&mut q, p.bq), (&mut k, p.bk), (&mut v, p.bv)] {
                    if let Some(bias) = bias {
                        ops::add_bias(y, bias);
                    }
                }
                rope_at(&block.rope, &mut q, pos, cfg.n_heads);
                rope_at(&block.rope, &mut k, pos, cfg.n_kv_heads);
                let mut attn = vec![0.0; b * qd];
                let scale = 1.0 / (hd as f32).sqrt();
                let mut scores = vec![0.0; t];
                for i in 0..b {
                    keys[l][i].extend_from_slice(&k[i * kd..(i + 1) * kd]);
                    values[l][i].extend_from_slice(&v[i * kd..(i + 1) * kd]);
                    let (ks, vs) = (&keys[l][i], &values[l][i]);
                    for h in 0..cfg.n_heads {
                        let g = h / group;
                        let qh = &q[i * qd + h * hd..i * qd + (h + 1) * hd];
                        for (j, sc) in scores.iter_mut().enumerate() {
                            let kh = &ks[j * kd + g * hd..j * kd + (g + 1) * hd];
                            *sc = scale * qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>();
                        }
                        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                        let mut sum = 0.0;
                        for sc in &mut scores {
                            *sc = (*sc - max).exp();
                            sum += *sc;
                        }
                        let o = &mut attn[i * qd + h * hd..i * qd + (h + 1) * hd];
                        for (j, &w) in scores.iter().enumerate() {
                            let vh = &vs[j * kd + g * hd..j * kd + (g + 1) * hd];
                            for (a, &vv) in o.iter_mut().zip(vh) {
                                *a += w / sum * vv;
                            }
                        }
                    }
                }
                let mut h = x;
                ops::matmul(
                    &mut h,
                    &attn,
                    p.wo,
                    ops::Mm::new(b, dim, qd).tb().acc().threads(threads),
                );
                let (xn2, _) = ops::rmsnorm_forward(&h, p.mlp_norm, cfg.norm_eps);
                let (m, _) =
                    ops::swiglu_forward(&xn2, p.gate, p.up, p.down, dim, cfg.hidden, threads);
                x = h.iter().zip(&m).map(|(a, b)| a + b).collect();
            }
            next = next_tokens(&x, b);
        }
        for (k, &i) in idx.iter().enumerate() {
            out[i] = std::mem::take(&mut gen[k]);
        }
    }
    out
}

/// Forward FLOPs of a micro-batch of `batch` sequences of `seq` tokens of
/// which `loss_rows` carry loss (the LM head runs on those only): matrix
/// products only, 2 per multiply-add, attention scores and values counted
/// in full; the usual basis of MFU. Training is 3× this (forward and
/// backward), not counting activation-checkpointing recomputation.
pub fn forward_flops(cfg: &Config, batch: usize, seq: usize, loss_rows: usize) -> f64 {
    let hd = cfg.head_dim();
    let (d, qd, kd, h) = (cfg.dim, cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.hidden);
    let per_token_block = 2.0 * (d * qd + 2 * d * kd + qd * d + 3 * d * h) as f64;
    let attn = 2.0 * 2.0 * (seq * seq * qd) as f64;
    let blocks = cfg.n_layers as f64 * (per_token_block * seq as f64 + attn);
    batch as f64 * blocks + 2.0 * (loss_rows * d * cfg.vocab) as f64
}

/// The elapsed time of `f` in seconds, with its result.
pub fn timed<R>(f: impl FnOnce() -> R) -> (R, f64) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed().as_secs_f64())
}

/// The peak fp32 GEMM rate of this rank with `threads` threads (FLOP/s),
/// measured while every rank does the same.
pub fn measure_gemm_peak(threads: usize) -> f64 {
    let n = 384;
    let a = vec![0.5f32; n * n];
    let b = vec![0.25f32; n * n];
    let mut c = vec![0f32; n * n];
    let p = ops::Mm::new(n, n, n).threads(threads);
    ops::matmul(&mut c, &a, &b, p);
    // The best of several short windows: the machine is shared and noisy.
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let mut reps = 0u32;
        while t.elapsed() < Duration::from_millis(80) {
            ops::matmul(&mut c, &a, &b, p);
            reps += 1;
        }
        best = best.max(2.0 * (n * n * n) as f64 * f64::from(reps) / t.elapsed().as_secs_f64());
    }
    best
}
