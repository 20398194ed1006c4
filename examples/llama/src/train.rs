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
//!
//! With LoRA ([`SftModel::register_lora`]) every base tensor is registered
//! as [`TensorSpec::frozen`] (no gradient, master or moments; never
//! reduced or written) and each block unit also holds its adapters,
//! trainable, under PEFT's names ([`lora::lora_tensors`]). The embedding
//! and head units are then frozen-only: backward computes no gradient for
//! them (only the input gradient through the head).

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use zero::comm::{Communicator, ReduceOp};
use zero::core::backend::CpuBackend;
use zero::core::memory::{Category, Tier};
use zero::core::partition::{TensorSpec, UnitLayout, UnitSpec};
use zero::core::{Element, HostBuffer};
use zero::engine::{EngineBackend, EngineComm};
use zero::trace::Tracer;
use zero::{Engine, EngineBuilder, Init, Result, UnitGuard, UnitId};

use super::lora::{self, LoraConfig, TARGETS};
use super::ops;
use super::{
    block_tensors, tensors, Block, BlockCache, BlockLora, BlockParams, Config, Kind, TensorInfo,
};

/// LoRA for [`SftModel::register_lora`].
#[derive(Clone, Debug)]
pub struct LoraSetup {
    /// Rank, alpha, dropout and target modules.
    pub cfg: LoraConfig,
    /// The seed of the adapters' initialisation ([`lora::init_adapters`])
    /// and of the dropout masks ([`lora::dropout_key`]).
    pub seed: u64,
    /// Every layer's adapters in [`lora::lora_tensors`] order, layer after
    /// layer (`--adapter`); `None`: PEFT's initialisation.
    pub adapters: Option<Vec<Vec<f32>>>,
}

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
    /// LoRA adapters on every block (the base frozen), with the seed of
    /// their dropout masks.
    pub lora: Option<(LoraConfig, u64)>,
    /// `(global step, micro-batch within it)` of the last micro-batch:
    /// the dropout keys.
    micro: Cell<(u64, u64)>,
    /// With LoRA, the initialiser of every base (frozen) tensor, in
    /// [`tensors`] order, as registered: where [`SftModel::export_tensors`]
    /// reads their exact values (a checkpoint's file, or values in
    /// memory, kept alive by this for the model's life).
    frozen_init: Option<Vec<Init>>,
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

/// A unit of `infos`, the first `frozen` of them frozen.
fn unit_spec(name: String, infos: &[TensorInfo], frozen: usize) -> UnitSpec {
    UnitSpec::new(
        name,
        infos
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if i < frozen {
                    TensorSpec::frozen(t.name.clone(), &t.shape)
                } else {
                    TensorSpec::new(t.name.clone(), &t.shape)
                }
            })
            .collect(),
    )
}

/// Where tensor `name` lies in `UnitState::params` of a unit of layout `l`
/// (the trainable real elements, then the frozen ones).
fn state_range(l: &UnitLayout, name: &str) -> std::ops::Range<usize> {
    let t = l.tensor(name).expect("a registered tensor");
    let at = if t.trainable {
        t.offset
    } else {
        l.numel + t.offset - l.frozen_offset()
    };
    at..at + t.numel
}

/// Where tensor `name` lies in a unit's gathered parameters (and, when
/// trainable, in its gradient buffer).
fn range(l: &UnitLayout, name: &str) -> std::ops::Range<usize> {
    l.tensor(name).expect("a registered tensor").range()
}

/// Normal(0, 0.02) matrices and unit norms, or the given initialisers.
fn inits(infos: &[TensorInfo], values: &mut dyn Iterator<Item = Option<Init>>) -> Vec<Init> {
    infos
        .iter()
        .map(|t| match values.next().flatten() {
            Some(i) => i,
            None => match t.kind {
                Kind::Norm => Init::Ones,
                Kind::Bias => Init::Zeros,
                Kind::Embedding | Kind::Linear => Init::normal(0.02),
            },
        })
        .collect()
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
        Self::register_lora(b, cfg, init, None, threads, checkpointing)
    }

    /// [`SftModel::register`], with LoRA when `lora` is given: the base
    /// tensors frozen, the adapters trainable in the block units.
    pub fn register_lora<C: Communicator>(
        b: &mut EngineBuilder<C>,
        cfg: Config,
        init: Option<Vec<Vec<f32>>>,
        lora: Option<LoraSetup>,
        threads: usize,
        checkpointing: bool,
    ) -> Result<Self> {
        let init = init.map(|v| v.into_iter().map(|v| Init::Values(Arc::from(v))).collect());
        Self::register_from(b, cfg, init, lora, threads, checkpointing)
    }

    /// [`SftModel::register_lora`] with one initialiser per tensor of
    /// [`tensors`] (in that order) instead of values: e.g.
    /// `Init::Source` of [`crate::weights::TensorFile`]s, which the
    /// engine's build reads range by range (the weights stream from their
    /// files).
    pub fn register_from<C: Communicator>(
        b: &mut EngineBuilder<C>,
        cfg: Config,
        init: Option<Vec<Init>>,
        lora: Option<LoraSetup>,
        threads: usize,
        checkpointing: bool,
    ) -> Result<Self> {
        cfg.validate();
        let all = tensors(&cfg);
        let frozen_init = lora.as_ref().and(init.clone());
        let mut values: Box<dyn Iterator<Item = Option<Init>>> = match init {
            Some(v) => {
                assert_eq!(v.len(), all.len(), "one initialiser per tensor");
                Box::new(v.into_iter().map(Some))
            }
            None => Box::new(std::iter::repeat_with(|| None)),
        };
        // With LoRA every base tensor is frozen.
        let frozen = |infos: &[TensorInfo]| if lora.is_some() { infos.len() } else { 0 };
        let mut adapters = lora
            .as_ref()
            .and_then(|l| l.adapters.clone())
            .map(Vec::into_iter);
        let embed_info = &all[..1];
        let embed = b.register(
            unit_spec("model.embed_tokens".into(), embed_info, frozen(embed_info)),
            inits(embed_info, &mut values),
        )?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let mut infos = block_tensors(&cfg, i);
            let n_base = frozen(&infos);
            let mut init = inits(&infos, &mut values);
            if let Some(l) = &lora {
                let ad = lora::lora_tensors(&cfg, &l.cfg, i);
                let vals = match adapters.as_mut() {
                    Some(it) => {
                        let v: Vec<Vec<f32>> = it.by_ref().take(ad.len()).collect();
                        assert_eq!(v.len(), ad.len(), "adapter values for every layer");
                        v
                    }
                    None => lora::init_adapters(&cfg, &l.cfg, i, l.seed),
                };
                for (t, v) in ad.iter().zip(&vals) {
                    assert_eq!(t.numel(), v.len(), "adapter {}", t.name);
                }
                init.extend(vals.into_iter().map(|v| Init::Values(Arc::from(v))));
                infos.extend(ad);
            }
            layers.push(b.register(unit_spec(format!("model.layers.{i}"), &infos, n_base), init)?);
        }
        let head_info = &all[cfg.norm_index()..];
        let head = b.register(
            unit_spec("lm_head".into(), head_info, frozen(head_info)),
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
            lora: lora.map(|l| (l.cfg, l.seed)),
            micro: Cell::new((u64::MAX, 0)),
            frozen_init,
        })
    }

    /// Gathers `u` and converts its parameters to f32 for the CPU ops; the
    /// unit stays gathered until the guard drops.
    fn fetch<T: Element, C: Communicator>(
        e: &mut Engine<C>,
        u: UnitId,
    ) -> Result<(UnitGuard, Vec<f32>)> {
        let p = e.gather(u)?;
        // (The frozen segment read where its gather landed.)
        let flat = p.params_f32::<T>()?;
        Ok((p, flat))
    }

    /// Slices block `l`'s gathered parameters (layout `lay`) into its
    /// tensors, with its adapters under LoRA (`key`: the dropout key).
    fn block_params<'a>(
        &'a self,
        flat: &'a [f32],
        lay: &UnitLayout,
        l: usize,
        key: Option<u64>,
    ) -> BlockParams<'a> {
        let parts: Vec<&[f32]> = block_tensors(&self.cfg, l)
            .iter()
            .map(|t| &flat[range(lay, &t.name)])
            .collect();
        let p = BlockParams::from_slices(&parts);
        match &self.lora {
            None => p,
            Some((lc, _)) => {
                let ad: Vec<&[f32]> = lora::lora_tensors(&self.cfg, lc, l)
                    .iter()
                    .map(|t| &flat[range(lay, &t.name)])
                    .collect();
                p.with_lora(BlockLora::from_slices(lc, &ad, key))
            }
        }
    }

    /// The dropout key of layer `l` in this micro-batch; `None` without
    /// LoRA dropout.
    pub(crate) fn dropout_key(&self, rank: usize, l: usize) -> Option<u64> {
        let (lc, seed) = self.lora.as_ref()?;
        if lc.dropout == 0.0 {
            return None;
        }
        let (step, micro) = self.micro.get();
        Some(lora::dropout_key(*seed, step, micro, rank, l))
    }

    /// Counts one micro-batch of optimizer step `step` (the engine's
    /// global steps): the `(step, micro-batch)` of the dropout keys.
    pub(crate) fn next_micro(&self, step: u64) {
        let (last, micro) = self.micro.get();
        self.micro
            .set((step, if last == step { micro + 1 } else { 0 }));
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
        self.next_micro(e.global_steps());
        let frozen = self.lora.is_some();
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
        // The f32 copies of gathered units and the blocks' f32 gradients
        // are the trainer's working memory: counted with the activations.
        let f32_bytes = |v: &[f32]| 4 * v.len() as i64;
        let (p, table) = Self::fetch::<T, C>(e, self.embed)?;
        grow(&mut act, &mut live, f32_bytes(&table));
        let mut x = ops::embedding_forward(&table, tokens, c.dim);
        grow(&mut act, &mut live, -f32_bytes(&table));
        drop((p, table));
        let mut saved: Vec<Saved> = Vec::with_capacity(c.n_layers);
        for (l, &u) in self.layers.iter().enumerate() {
            let (unit, flat) = Self::fetch::<T, C>(e, u)?;
            grow(&mut act, &mut live, f32_bytes(&flat));
            let key = self.dropout_key(rank, l);
            let cache = self.block.forward(
                &self.block_params(&flat, unit.layout(), l, key),
                &x,
                batch,
                seq,
            );
            drop(unit);
            let next = cache.y.clone();
            let s = if self.checkpointing {
                Saved::Input(std::mem::replace(&mut x, next))
            } else {
                x = next;
                Saved::Full(Box::new(cache))
            };
            grow(&mut act, &mut live, s.bytes() as i64);
            saved.push(s);
            grow(&mut act, &mut live, -f32_bytes(&flat));
            drop(flat);
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
        let head_f32 = f32_bytes(&hp) + tied.as_ref().map_or(0, |(_, t)| f32_bytes(t));
        grow(&mut act, &mut live, head_f32);
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
        let mut dhead = vec![0.0; if frozen { 0 } else { head_w.len() }];
        let mut dxn = vec![0.0; xn.len()];
        if frozen {
            // The head is frozen: the input gradient only.
            ops::matmul(
                &mut dxn,
                &dlogits,
                head_w,
                ops::Mm::new(picked.len(), c.dim, c.vocab).threads(self.threads),
            );
        } else {
            ops::linear_backward(
                &dlogits,
                &xn,
                head_w,
                &mut dhead,
                &mut dxn,
                (picked.len(), c.dim, c.vocab),
                self.threads,
            );
        }
        let mut dnorm = vec![0.0; c.dim];
        let mut dhx = vec![0.0; hx.len()];
        ops::rmsnorm_backward(&dxn, &hx, norm_w, &inv, &mut dhx, &mut dnorm);
        drop(tied);
        drop(head);
        drop(hp);
        grow(&mut act, &mut live, -head_f32);
        // Tied: the head's share of the embedding's gradient waits for the
        // lookup's (at the end of backward), in f32.
        let (head_grad, mut demb) = if c.tie_embeddings || frozen {
            (Vec::new(), dhead)
        } else {
            (dhead, vec![0.0; c.vocab * c.dim])
        };
        if !frozen {
            let mut g = e.grad_buffer::<T>(self.head)?;
            for (o, v) in g.iter_mut().zip(dnorm.iter().chain(&head_grad)) {
                *o = T::from_f32(*v);
            }
            e.grad_ready(self.head, g)?;
        }
        let mut dx = vec![0.0; rows * c.dim];
        for (k, &r) in picked.iter().enumerate() {
            dx[r * c.dim..(r + 1) * c.dim].copy_from_slice(&dhx[k * c.dim..(k + 1) * c.dim]);
        }

        // Blocks, last to first.
        for (l, &u) in self.layers.iter().enumerate().rev() {
            let (unit, flat) = Self::fetch::<T, C>(e, u)?;
            grow(&mut act, &mut live, f32_bytes(&flat));
            let lay = unit.layout().clone();
            let p = self.block_params(&flat, &lay, l, self.dropout_key(rank, l));
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
            let grad_bytes = 4 * grads.numel() as i64;
            grow(&mut act, &mut live, grad_bytes);
            grow(&mut act, &mut live, -(cache_bytes(&cache) as i64));
            drop(cache);
            dx = d;
            drop(unit);
            let mut g = e.grad_buffer::<T>(u)?;
            let (names, values) = match &self.lora {
                None => (block_tensors(c, l), grads.into_vec()),
                Some((lc, _)) => (lora::lora_tensors(c, lc, l), grads.lora_vec()),
            };
            for (t, v) in names.iter().zip(&values) {
                for (o, v) in g[range(&lay, &t.name)].iter_mut().zip(v) {
                    *o = T::from_f32(*v);
                }
            }
            e.grad_ready(u, g)?;
            drop(values);
            grow(&mut act, &mut live, -grad_bytes - f32_bytes(&flat));
            debug_assert_eq!(l, saved.len());
        }

        // Embedding: its backward needs no parameters, so no gather; none
        // at all when it is frozen.
        if !frozen {
            let mut g = e.grad_buffer::<T>(self.embed)?;
            ops::embedding_backward(&dx, tokens, c.dim, &mut demb, c.pad_id);
            for (o, v) in g.iter_mut().zip(&demb) {
                *o = T::from_f32(*v);
            }
            e.grad_ready(self.embed, g)?;
        }
        drop(bwd);
        Ok(MicroStats {
            loss,
            target_tokens: picked.len(),
            activation_bytes: peak,
        })
    }

    /// Every tensor's full value, in [`tensors`] order, read with
    /// [`Engine::unit_params`] (a collective in stages 1–3: every rank calls
    /// it; it does not gather, so the stage-3 gather order of training is
    /// left alone). Evaluation uses this snapshot, so it holds the whole
    /// model in f32 on each rank while it runs.
    pub fn snapshot<C: EngineComm<B>, B: EngineBackend>(
        &self,
        e: &mut Engine<C, B>,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.cfg;
        let all = tensors(c);
        let mut out = self.unit_tensors(e, self.embed, &all[..1])?;
        for (l, &u) in self.layers.iter().enumerate() {
            out.extend(self.unit_tensors(e, u, &block_tensors(c, l))?);
        }
        out.extend(self.unit_tensors(e, self.head, &all[c.norm_index()..])?);
        Ok(out)
    }

    /// Every layer's adapters, in [`lora::lora_tensors`] order layer after
    /// layer (a collective, as [`SftModel::snapshot`]); empty without LoRA.
    /// The fp32 master weights (what `--export-adapter` writes: with bf16
    /// or fp16 training, the parameters are their rounding).
    pub fn snapshot_adapters<C: EngineComm<B>, B: EngineBackend>(
        &self,
        e: &mut Engine<C, B>,
    ) -> Result<Vec<Vec<f32>>> {
        let Some((lc, _)) = &self.lora else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for (l, &u) in self.layers.iter().enumerate() {
            let st = e.unit_state(u)?;
            let lay = e.layout(u)?;
            out.extend(
                lora::lora_tensors(&self.cfg, lc, l)
                    .iter()
                    .map(|t| st.master[range(lay, &t.name)].to_vec()),
            );
        }
        Ok(out)
    }

    /// The tensors of `part` that [`tensors`] lists, in that order, read
    /// with [`Engine::unit_params`] (with LoRA, a block with
    /// [`Engine::unit_state`], whose master holds the adapters alone; a
    /// collective in stages 1–3, as [`SftModel::snapshot`]), with LoRA's
    /// adapters folded into each
    /// block ([`lora::merge`], PEFT's `merge_and_unload`, from their fp32
    /// master): the embedding, a block's [`block_tensors`], or the final
    /// norm and (untied) `lm_head.weight` ([`Part::range`]). What a
    /// merged export writes, one unit at a time ([`crate::weights::save_from`]):
    /// the values of [`SftModel::snapshot`] with [`merge_adapters`] of
    /// [`SftModel::snapshot_adapters`], bit for bit.
    pub fn part_tensors<C: EngineComm<B>, B: EngineBackend>(
        &self,
        e: &mut Engine<C, B>,
        part: Part,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.cfg;
        let all = tensors(c);
        match part {
            Part::Embed => self.unit_tensors(e, self.embed, &all[..1]),
            Part::Layer(l) => {
                let u = self.layers[l];
                let Some((lc, _)) = &self.lora else {
                    return self.unit_tensors(e, u, &block_tensors(c, l));
                };
                let st = e.unit_state(u)?;
                let lay = e.layout(u)?;
                let mut base: Vec<Vec<f32>> = block_tensors(c, l)
                    .iter()
                    .map(|t| st.params[state_range(lay, &t.name)].to_vec())
                    .collect();
                self.fold_adapters(&mut base, lc, l, &st.master, lay);
                Ok(base)
            }
            Part::Head => self.unit_tensors(e, self.head, &all[c.norm_index()..]),
        }
    }

    /// Folds layer `l`'s adapters into its base tensors `base`
    /// ([`block_tensors`] order; [`lora::merge`], PEFT's
    /// `merge_and_unload`): the adapters are trainable, their values the
    /// fp32 master `master` of the layer's unit (layout `lay`), as
    /// [`SftModel::snapshot_adapters`] reads them.
    fn fold_adapters(
        &self,
        base: &mut [Vec<f32>],
        lc: &LoraConfig,
        l: usize,
        master: &[f32],
        lay: &UnitLayout,
    ) {
        let c = &self.cfg;
        let ad: Vec<&[f32]> = lora::lora_tensors(c, lc, l)
            .iter()
            .map(|t| &master[range(lay, &t.name)])
            .collect();
        let mut pairs = ad.chunks_exact(2);
        for (i, (name, _)) in TARGETS.iter().enumerate() {
            if !lc.targets(name) {
                continue;
            }
            let ab = pairs.next().expect("an A and a B per target");
            let (d_in, d_out) = lora::module_dims(c, name).expect("a TARGETS module");
            lora::merge(&mut base[i], ab[0], ab[1], d_in, d_out, lc.r, lc.scale());
        }
    }

    /// The tensors of `part` ([`Part::range`] of [`tensors`], in that
    /// order) as an export writes them: what the model is, not its
    /// working copy. Read with [`Engine::unit_master`] (a collective in
    /// stages 1–3: every rank asks for the same parts in the same order;
    /// host memory: one unit's parameters and master):
    ///
    /// - a trainable tensor is its fp32 **master**, not the parameter of
    ///   the training dtype (in a bf16 or fp16 run, the master rounded);
    ///   the master starts as the initial values in f32, so with no step
    ///   taken it is a checkpoint's values bit for bit, whatever their
    ///   dtype (BF16 and F16 widen to F32 exactly);
    /// - a frozen tensor (LoRA's base) is the value it was registered
    ///   with: read again from its initialiser when that holds values
    ///   (`Init::Source`, a checkpoint's file; `Init::Values`), so it is
    ///   the checkpoint's value bit for bit in any training dtype; a
    ///   computed initialiser (a built-in preset's random base) has no
    ///   such value, and the engine's parameter is taken (in a bf16 or
    ///   fp16 run, the rounded value the run trained with);
    /// - with LoRA a block's adapters are folded into its base
    ///   ([`lora::merge`] from their master, as
    ///   [`SftModel::part_tensors`] does), the sum in f32.
    ///
    /// [`crate::export::write`] streams these to files.
    pub fn export_tensors<C: EngineComm<B>, B: EngineBackend>(
        &self,
        e: &mut Engine<C, B>,
        part: Part,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.cfg;
        let unit = match part {
            Part::Embed => self.embed,
            Part::Layer(l) => self.layers[l],
            Part::Head => self.head,
        };
        let all = tensors(c);
        let which = part.range(c);
        let st = e.unit_master(unit)?;
        let lay = e.layout(unit)?;
        let mut out = Vec::with_capacity(which.len());
        for i in which {
            let t = &all[i];
            let tl = lay.tensor(&t.name).expect("a registered tensor");
            out.push(if tl.trainable {
                st.master[tl.range()].to_vec()
            } else {
                self.frozen_values(i, &st.params[state_range(lay, &t.name)])?
            });
        }
        if let (Part::Layer(l), Some((lc, _))) = (part, &self.lora) {
            self.fold_adapters(&mut out, lc, l, &st.master, lay);
        }
        Ok(out)
    }

    /// Frozen tensor `i` of [`tensors`]: its registered initialiser's
    /// values when it holds them, else `engine`, the engine's parameter
    /// (see [`SftModel::export_tensors`]).
    fn frozen_values(&self, i: usize, engine: &[f32]) -> Result<Vec<f32>> {
        let init = self.frozen_init.as_ref().map(|v| &v[i]);
        Ok(match init {
            Some(Init::Source(src)) => {
                let mut v = vec![0f32; engine.len()];
                src.read(0..v.len(), &mut v)?;
                v
            }
            Some(Init::Values(v)) => v.to_vec(),
            Some(Init::Zeros) => vec![0.0; engine.len()],
            Some(Init::Ones) => vec![1.0; engine.len()],
            Some(Init::Constant(x)) => vec![*x; engine.len()],
            _ => engine.to_vec(),
        })
    }

    /// Tensors `infos` of unit `u`, read with [`Engine::unit_params`].
    fn unit_tensors<C: EngineComm<B>, B: EngineBackend>(
        &self,
        e: &mut Engine<C, B>,
        u: UnitId,
        infos: &[TensorInfo],
    ) -> Result<Vec<Vec<f32>>> {
        let flat = e.unit_params(u)?;
        let lay = e.layout(u)?;
        Ok(infos
            .iter()
            .map(|t| flat[state_range(lay, &t.name)].to_vec())
            .collect())
    }
}

/// Folds every layer's adapters (`adapters` in [`lora::lora_tensors`]
/// order, layer after layer) into `base` ([`tensors`] order): `W += s · B A`.
pub fn merge_adapters(cfg: &Config, lc: &LoraConfig, base: &mut [Vec<f32>], adapters: &[Vec<f32>]) {
    let per = 2 * lc.targets.len();
    assert_eq!(
        adapters.len(),
        per * cfg.n_layers,
        "adapters of every layer"
    );
    for l in 0..cfg.n_layers {
        let mut ad = adapters[l * per..(l + 1) * per].chunks_exact(2);
        for (i, (m, _)) in TARGETS.iter().enumerate() {
            if !lc.targets(m) {
                continue;
            }
            let ab = ad.next().expect("an A and a B per target");
            let (d_in, d_out) = lora::module_dims(cfg, m).expect("a TARGETS module");
            // block_tensors order: q, k, v, o, gate, up, down, as TARGETS.
            let w = &mut base[cfg.layer_range(l).start + i];
            lora::merge(w, &ab[0], &ab[1], d_in, d_out, lc.r, lc.scale());
        }
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

/// A part of the model that decoding needs at once: one unit's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// `model.embed_tokens.weight`.
    Embed,
    /// Block `l`'s tensors in [`block_tensors`] order (with LoRA: the
    /// adapters folded in).
    Layer(usize),
    /// `model.norm.weight` and the LM head's weight (the embedding table
    /// when tied).
    Head,
}

impl Part {
    /// Every part of the model of `cfg`, in [`tensors`] order.
    pub fn all(cfg: &Config) -> impl Iterator<Item = Part> {
        std::iter::once(Part::Embed)
            .chain((0..cfg.n_layers).map(Part::Layer))
            .chain(std::iter::once(Part::Head))
    }

    /// The positions in [`tensors`]`(cfg)` of the part's own tensors
    /// (the tied embedding is the embedding's, not the head's).
    pub fn range(self, cfg: &Config) -> std::ops::Range<usize> {
        match self {
            Part::Embed => 0..1,
            Part::Layer(l) => cfg.layer_range(l),
            Part::Head => {
                let n = cfg.norm_index();
                n..n + if cfg.tie_embeddings { 1 } else { 2 }
            }
        }
    }

    /// The part that tensor `i` of [`tensors`]`(cfg)` belongs to.
    pub fn of(cfg: &Config, i: usize) -> Part {
        if i == 0 {
            Part::Embed
        } else if i < cfg.norm_index() {
            Part::Layer((i - 1) / cfg.block_len())
        } else {
            Part::Head
        }
    }
}

/// Where [`generate_from`] gets the model, one [`Part`] at a time, and
/// how the ranks that decode together agree. A source over an engine
/// reads each part when asked ([`EngineSource`]: a collective in stages
/// 1–3), so host memory holds one unit's parameters at a time, not the
/// model; every rank then asks for the same parts in the same order
/// (the loop is driven by [`ParamSource::lengths`] and
/// [`ParamSource::any`], which agree over ranks).
pub trait ParamSource {
    /// The tensors of `part`.
    fn fetch(&mut self, part: Part) -> Result<Vec<Vec<f32>>>;
    /// The prompt lengths of every rank (sorted, unique), given this
    /// rank's. Default: this rank's alone.
    fn lengths(&mut self, mine: &[usize]) -> Result<Vec<usize>> {
        Ok(mine.to_vec())
    }
    /// Whether any rank still decodes, given whether this one does.
    /// Default: this rank's answer.
    fn any(&mut self, mine: bool) -> Result<bool> {
        Ok(mine)
    }
}

/// A full set of parameters in memory ([`SftModel::snapshot`] order).
pub struct FullParams<'a> {
    /// The model.
    pub cfg: &'a Config,
    /// Every tensor, [`tensors`] order.
    pub params: &'a [Vec<f32>],
}

impl ParamSource for FullParams<'_> {
    fn fetch(&mut self, part: Part) -> Result<Vec<Vec<f32>>> {
        let c = self.cfg;
        Ok(match part {
            Part::Embed => vec![self.params[0].clone()],
            Part::Layer(l) => self.params[c.layer_range(l)].to_vec(),
            Part::Head => vec![
                self.params[c.norm_index()].clone(),
                self.params[c.head_index()].clone(),
            ],
        })
    }
}

/// The registered model's parameters, read unit by unit with
/// [`Engine::unit_state`] when [`generate_from`] needs them (a collective
/// in stages 1–3: every rank of the engine decodes together), with the
/// LoRA adapters folded into each block as it is read. Host memory: one
/// unit's values (twice with the head tied), never the model.
pub struct EngineSource<'a, C: EngineComm<B>, B: EngineBackend = CpuBackend> {
    /// The engine.
    pub e: &'a mut Engine<C, B>,
    /// The registered model.
    pub model: &'a SftModel,
}

impl<C: EngineComm<B>, B: EngineBackend> ParamSource for EngineSource<'_, C, B> {
    fn fetch(&mut self, part: Part) -> Result<Vec<Vec<f32>>> {
        let m = self.model;
        let mut out = m.part_tensors(self.e, part)?;
        if part == Part::Head && m.cfg.tie_embeddings {
            out.extend(m.part_tensors(self.e, Part::Embed)?);
        }
        Ok(out)
    }

    fn lengths(&mut self, mine: &[usize]) -> Result<Vec<usize>> {
        // A count per length up to the longest of any rank, summed.
        let longest = self
            .e
            .comm()
            .all_reduce(
                HostBuffer::from_slice(&[mine.iter().copied().max().unwrap_or(0) as f32])?,
                ReduceOp::Max,
            )
            .wait()?
            .to_vec()[0] as usize;
        let mut counts = vec![0f32; longest + 1];
        for &l in mine {
            counts[l] += 1.0;
        }
        let counts = self
            .e
            .comm()
            .all_reduce(HostBuffer::from_slice(&counts)?, ReduceOp::Sum)
            .wait()?
            .to_vec();
        Ok((0..counts.len()).filter(|&l| counts[l] > 0.0).collect())
    }

    fn any(&mut self, mine: bool) -> Result<bool> {
        let v = self
            .e
            .comm()
            .all_reduce(
                HostBuffer::from_slice(&[f32::from(u8::from(mine))])?,
                ReduceOp::Max,
            )
            .wait()?
            .to_vec();
        Ok(v[0] > 0.0)
    }
}

/// Greedy decoding from a full set of parameters ([`SftModel::snapshot`]
/// order): [`generate_from`] over [`FullParams`].
pub fn generate(
    cfg: &Config,
    block: &Block,
    params: &[Vec<f32>],
    prompts: &[Vec<u32>],
    max_new: usize,
    stop: u32,
    threads: usize,
) -> Vec<Vec<u32>> {
    generate_from(
        cfg,
        block,
        &mut FullParams { cfg, params },
        prompts,
        max_new,
        stop,
        threads,
    )
    .expect("parameters in memory")
}

/// Greedy decoding: each prompt is extended by up to `max_new` tokens,
/// stopping at `stop`. Prompts of equal length decode together as one
/// batch: the prompt runs through [`Block::forward`] once, which also
/// gives each layer's rotated keys and values; then every new token runs
/// alone against those cached keys and values (a KV cache). The model
/// comes from `src` one part at a time, as each is needed (each layer
/// once per prompt length and once per new token): with
/// [`EngineSource`] host memory holds one unit's parameters and the KV
/// cache, not the model. Every rank asks for the same parts: the prompt
/// lengths are those of any rank, and a length's decoding stops when no
/// rank has a row left.
pub fn generate_from(
    cfg: &Config,
    block: &Block,
    src: &mut dyn ParamSource,
    prompts: &[Vec<u32>],
    max_new: usize,
    stop: u32,
    threads: usize,
) -> Result<Vec<Vec<u32>>> {
    generate_with(
        cfg,
        block,
        src,
        prompts,
        max_new,
        stop,
        threads,
        &mut |row| super::sampling::argmax(row),
    )
}

/// [`generate_from`] with the next token of each row of logits chosen by
/// `pick` (greedy: [`super::sampling::argmax`]; sampled:
/// [`super::sampling::Sampler::pick`]), rows in prompt order.
#[allow(clippy::too_many_arguments)]
pub fn generate_with(
    cfg: &Config,
    block: &Block,
    src: &mut dyn ParamSource,
    prompts: &[Vec<u32>],
    max_new: usize,
    stop: u32,
    threads: usize,
    pick: &mut dyn FnMut(&[f32]) -> u32,
) -> Result<Vec<Vec<u32>>> {
    let (dim, hd) = (cfg.dim, cfg.head_dim());
    let (qd, kd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let group = cfg.n_heads / cfg.n_kv_heads;
    // The next token of each row of `x` `[b, dim]` (final norm, head, pick).
    let mut next_tokens = |src: &mut dyn ParamSource, x: &[f32], b: usize| -> Result<Vec<u32>> {
        let head = src.fetch(Part::Head)?;
        if b == 0 {
            return Ok(Vec::new());
        }
        let (xn, _) = ops::rmsnorm_forward(x, &head[0], cfg.norm_eps);
        let logits = ops::linear_forward(&xn, &head[1], b, dim, cfg.vocab, threads);
        Ok(logits.chunks_exact(cfg.vocab).map(&mut *pick).collect())
    };
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    lens.sort_unstable();
    lens.dedup();
    for len in src.lengths(&lens)? {
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
        let mut x = ops::embedding_forward(&src.fetch(Part::Embed)?[0], &tokens, dim);
        let mut keys: Vec<Vec<Vec<f32>>> = Vec::with_capacity(cfg.n_layers);
        let mut values: Vec<Vec<Vec<f32>>> = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let p = src.fetch(Part::Layer(l))?;
            if b == 0 {
                continue;
            }
            let refs: Vec<&[f32]> = p.iter().map(Vec::as_slice).collect();
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
        let mut next = next_tokens(src, &last, b)?;
        let mut gen: Vec<Vec<u32>> = vec![Vec::new(); b];
        let mut done = vec![false; b];
        for step in 0..budget {
            for i in 0..b {
                if !done[i] {
                    gen[i].push(next[i]);
                    done[i] = next[i] == stop;
                }
            }
            let active = src.any(done.iter().any(|&d| !d))?;
            if step + 1 == budget || !active {
                break;
            }
            // One new token per row, at position `pos`.
            let pos = len + step;
            let t = pos + 1;
            let mut x = ops::embedding_forward(&src.fetch(Part::Embed)?[0], &next, dim);
            for l in 0..cfg.n_layers {
                let refs = src.fetch(Part::Layer(l))?;
                if b == 0 {
                    continue;
                }
                let refs: Vec<&[f32]> = refs.iter().map(Vec::as_slice).collect();
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
            next = next_tokens(src, &x, b)?;
        }
        for (k, &i) in idx.iter().enumerate() {
            out[i] = std::mem::take(&mut gen[k]);
        }
    }
    Ok(out)
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

/// The dense bf16 tensor-core peak of a GPU by its name (datasheet figures,
/// without sparsity), for the MFU; `None` for a GPU not listed
/// (`llama_sft --peak-tflops` gives it).
pub fn gpu_bf16_peak(name: &str) -> Option<f64> {
    const PEAKS: &[(&str, f64)] = &[
        ("H200", 989.4),
        ("H100 PCIe", 756.0),
        ("H100 NVL", 835.0),
        ("H100", 989.4),
        ("GH200", 989.4),
        ("A100", 312.0),
        ("L40S", 362.1),
        ("A10G", 70.0),
        ("L4", 121.0),
        ("RTX 4090", 165.2),
    ];
    PEAKS
        .iter()
        .find(|(n, _)| name.contains(n))
        .map(|(_, t)| t * 1e12)
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
