//! [`DeviceModel`]: the registered Llama trained with its activations in a
//! device backend's buffers, every op on the compute stream.
//!
//! The sequence of ops is the CPU trainer's ([`SftModel::train_micro_batch`]
//! over [`crate::Block`]), op for op: the same products with the same
//! shapes, strides and accumulation order, so on the CPU backend with f32
//! parameters both give the same bits. Attention runs as batched products
//! per head (the batch over the sequences of the micro-batch), the causal
//! softmax over every head at once.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use zero::core::backend::{Backend, BufferHandle, Stream};
use zero::core::memory::{Category, Tier};
use zero::core::partition::UnitLayout;
use zero::core::Element;
use zero::engine::EngineComm;
use zero::trace::Tracer;
use zero::{Engine, Error, Result, UnitGuard};

use super::{dst_at, src_at, Batch, Dst, LlamaDevice, OpProfile, Phase, Src};
use crate::lora::LoraConfig;
use crate::ops::Mm;
use crate::train::{MicroStats, SftModel};
use crate::{block_tensors, tensors, Config};

mod lora;
pub use lora::{mask_words, MASK_SLOTS};
use lora::{LayerLora, LoraActs, MaskStage};

/// A Llama registered with an engine ([`SftModel::register`]), trained on
/// the engine's device backend.
pub struct DeviceModel<B: LlamaDevice> {
    /// The registered model (units, configuration, checkpointing).
    pub model: SftModel,
    ops: B::Ops,
    /// The largest bytes of the trainer's own buffers live at once in the
    /// last micro-batch.
    workspace_peak: AtomicU64,
    /// The pinned host slots LoRA's dropout masks go up through.
    masks: Mutex<MaskStage<B>>,
}

/// Whether the model's base is frozen (LoRA): then the embedding and the
/// head get no gradient and the blocks' gradients are their adapters'.
fn frozen(m: &SftModel) -> bool {
    m.lora.is_some()
}

/// A block's tensors' offsets in the buffers they are read from
/// ([`Params`]; trainable ones also in its gradient buffer): `wq, wk,
/// wv, wo, gate, up, down, attn_norm, mlp_norm`. With q/k/v biases
/// (Qwen2), `bias` holds theirs.
struct BlockAt {
    w: [usize; 9],
    bias: Option<[usize; 3]>,
    /// Whether the base tensors train (a full fine-tune: their gradients
    /// go into the unit's gradient buffer at the offsets of `w` and
    /// `bias`) or are frozen (LoRA: read from the frozen segment, no
    /// gradient).
    train_base: bool,
    /// With LoRA, the adapters' offsets ([`LayerLora`]).
    lora: Option<LayerLora>,
}

impl BlockAt {
    /// `frozen_at`: where the unit's frozen segment starts in the buffer
    /// it is read from ([`UnitGuard::frozen_buffer`]).
    fn of(m: &SftModel, l: usize, lay: &UnitLayout, frozen_at: usize) -> Result<Self> {
        let cfg = &m.cfg;
        let names = block_tensors(cfg, l);
        let base = |name: &str| -> Result<usize> {
            let at = offset(lay, name)?;
            Ok(match lay.tensor(name).is_some_and(|t| t.trainable) {
                true => at,
                false => frozen_at + at - lay.frozen_offset(),
            })
        };
        let mut w = [0; 9];
        for (o, t) in w.iter_mut().zip(&names) {
            *o = base(&t.name)?;
        }
        // One buffer holds a block's base tensors (`Params::base`): all
        // trainable or all frozen.
        let trains = |name: &str| lay.tensor(name).is_some_and(|t| t.trainable);
        let train_base = trains(&names[0].name);
        if let Some(t) = names.iter().find(|t| trains(&t.name) != train_base) {
            return Err(Error::Unsupported {
                what: format!(
                    "unit {}: tensor {} is {} but {} is not: the device trainer trains a \
                     block's base tensors all or none",
                    lay.name,
                    t.name,
                    if train_base { "frozen" } else { "trainable" },
                    names[0].name
                ),
            });
        }
        let bias = match &names[9..] {
            [q, k, v] => Some([base(&q.name)?, base(&k.name)?, base(&v.name)?]),
            _ => None,
        };
        let lora = match &m.lora {
            Some((lc, _)) => Some(LayerLora::of(cfg, lc, l, lay)?),
            None => None,
        };
        Ok(BlockAt {
            w,
            bias,
            train_base,
            lora,
        })
    }
}

/// A block's gathered parameters: the buffer of its base tensors (under
/// LoRA the frozen segment's, read where its gather landed) and the
/// unit's buffer (its adapters; the same buffer in a full fine-tune).
struct Params<'a, B: LlamaDevice, T: Element> {
    base: &'a B::Buffer<T>,
    unit: &'a B::Buffer<T>,
}

impl<B: LlamaDevice, T: Element> Clone for Params<'_, B, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: LlamaDevice, T: Element> Copy for Params<'_, B, T> {}

impl<'a, B: LlamaDevice, T: Element> Params<'a, B, T> {
    /// Unit `g`'s (a block's) buffers, and where its frozen segment
    /// starts in the base one.
    fn of(g: &'a UnitGuard<B>) -> Result<(Self, usize)> {
        let unit = g.buffer::<T>()?;
        if g.layout().frozen_numel == 0 {
            return Ok((Params { base: unit, unit }, 0));
        }
        let (base, at) = g.frozen_buffer::<T>()?;
        Ok((Params { base, unit }, at))
    }
}

/// Where tensor `name` of `g` is read: its buffer and offset there.
fn read_at<'g, B: LlamaDevice, T: Element>(
    g: &'g UnitGuard<B>,
    name: &str,
) -> Result<(&'g B::Buffer<T>, usize)> {
    let (b, r) = g.tensor_buffer::<T>(name)?;
    Ok((b, r.start))
}

fn offset(lay: &UnitLayout, name: &str) -> Result<usize> {
    lay.tensor(name)
        .map(|t| t.offset)
        .ok_or_else(|| Error::Unsupported {
            what: format!("tensor {name} is not in unit {}", lay.name),
        })
}

/// The activations of one block's forward that its backward reads.
struct Acts<B: LlamaDevice, T: Element> {
    x: Tmp<B, T>,
    xn1: Tmp<B, T>,
    inv1: Tmp<B, f32>,
    q: Tmp<B, T>,
    k: Tmp<B, T>,
    v: Tmp<B, T>,
    probs: Tmp<B, T>,
    attn: Tmp<B, T>,
    h: Tmp<B, T>,
    xn2: Tmp<B, T>,
    inv2: Tmp<B, f32>,
    h1: Tmp<B, T>,
    h3: Tmp<B, T>,
    a: Tmp<B, T>,
    /// With LoRA: the adapters' `drop(x) Aᵀ` and the dropout bit masks.
    lora: Option<LoraActs<B, T>>,
}

impl<B: LlamaDevice, T: Element> Acts<B, T> {
    fn bytes(&self) -> u64 {
        let t = [
            &self.x,
            &self.xn1,
            &self.q,
            &self.k,
            &self.v,
            &self.probs,
            &self.attn,
            &self.h,
            &self.xn2,
            &self.h1,
            &self.h3,
            &self.a,
        ];
        let n: usize = t.iter().map(|b| b.len()).sum();
        let lora = self.lora.as_ref().map_or(0, LoraActs::bytes);
        (n * size_of::<T>() + 4 * (self.inv1.len() + self.inv2.len())) as u64 + lora
    }
}

/// The gradients of the queries, keys and values.
type Qkv<B, T> = (Tmp<B, T>, Tmp<B, T>, Tmp<B, T>);

/// A block's forward: what its backward reads, and its output.
type Forward<B, T> = (Box<Acts<B, T>>, Tmp<B, T>);

/// What forward keeps of a block.
enum Saved<B: LlamaDevice, T: Element> {
    Full(Box<Acts<B, T>>),
    /// Activation checkpointing: the block input only.
    Input(Tmp<B, T>),
}

/// A buffer of the trainer's, on the compute stream alone: allocated and
/// zeroed in its order ([`Backend::alloc_on`]) and freed in its order when
/// dropped ([`Backend::release_on`]), so neither blocks the host.
struct Tmp<B: Backend, T: Element> {
    buf: Option<B::Buffer<T>>,
    dev: B,
}

thread_local! {
    /// Bytes of the trainer's buffers ([`Tmp`]) live on this thread, and
    /// their peak: what [`DeviceModel::workspace_peak`] reports (a
    /// micro-batch allocates and frees them all on its caller's thread).
    static LIVE: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// `bytes` more (or fewer) of the trainer's buffers live on this thread.
fn meter(bytes: u64, alloc: bool) {
    LIVE.with(|c| {
        let (live, peak) = c.get();
        let live = if alloc {
            live + bytes
        } else {
            live.saturating_sub(bytes)
        };
        c.set((live, peak.max(live)));
    });
}

fn tmp<B: Backend + Clone, T: Element>(dev: &B, len: usize, label: &str) -> Result<Tmp<B, T>> {
    let t = Tmp {
        buf: Some(dev.alloc_on::<T>(Stream::Compute, len, label)?),
        dev: dev.clone(),
    };
    meter((len * size_of::<T>()) as u64, true);
    Ok(t)
}

/// [`tmp`] for a buffer overwritten whole before it is read (the score
/// matrices): not zeroed ([`Backend::alloc_scratch_on`]; NaN on the
/// checked CPU backend, so a read of what was not written shows).
fn tmp_scratch<B: Backend + Clone, T: Element>(
    dev: &B,
    len: usize,
    label: &str,
) -> Result<Tmp<B, T>> {
    let t = Tmp {
        buf: Some(dev.alloc_scratch_on::<T>(Stream::Compute, len, label)?),
        dev: dev.clone(),
    };
    meter((len * size_of::<T>()) as u64, true);
    Ok(t)
}

impl<B: Backend, T: Element> std::ops::Deref for Tmp<B, T> {
    type Target = B::Buffer<T>;
    fn deref(&self) -> &B::Buffer<T> {
        self.buf.as_ref().expect("a live buffer")
    }
}

impl<B: Backend, T: Element> std::ops::DerefMut for Tmp<B, T> {
    fn deref_mut(&mut self) -> &mut B::Buffer<T> {
        self.buf.as_mut().expect("a live buffer")
    }
}

impl<B: Backend, T: Element> Tmp<B, T> {
    fn src(&self) -> Src<'_, B, T> {
        self.src_at(0)
    }
    fn src_at(&self, at: usize) -> Src<'_, B, T> {
        Src { buf: self, at }
    }
    fn dst(&mut self) -> Dst<'_, B, T> {
        self.dst_at(0)
    }
    fn dst_at(&mut self, at: usize) -> Dst<'_, B, T> {
        Dst { buf: self, at }
    }
}

impl<B: Backend, T: Element> Drop for Tmp<B, T> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            meter((b.len() * size_of::<T>()) as u64, false);
            self.dev.release_on(Stream::Compute, b);
        }
    }
}

/// The sequences' shapes of a micro-batch.
#[derive(Clone, Copy)]
struct Shape {
    batch: usize,
    seq: usize,
    rows: usize,
    dim: usize,
    hd: usize,
    heads: usize,
    kv: usize,
    qd: usize,
    kd: usize,
    hidden: usize,
}

impl Shape {
    fn new(c: &Config, batch: usize, seq: usize) -> Self {
        let hd = c.head_dim();
        Shape {
            batch,
            seq,
            rows: batch * seq,
            dim: c.dim,
            hd,
            heads: c.n_heads,
            kv: c.n_kv_heads,
            qd: c.n_heads * hd,
            kd: c.n_kv_heads * hd,
            hidden: c.hidden,
        }
    }

    /// Elements of one head's `[t, t]` matrices of every sequence.
    fn mats(&self) -> usize {
        self.batch * self.heads * self.seq * self.seq
    }

    /// `(d_in, d_out)` of projection `i` of a block (q, k, v, o, gate,
    /// up, down).
    fn proj(&self, i: usize) -> (usize, usize) {
        match i {
            0 => (self.dim, self.qd),
            1 | 2 => (self.dim, self.kd),
            3 => (self.qd, self.dim),
            4 | 5 => (self.dim, self.hidden),
            _ => (self.hidden, self.dim),
        }
    }

    /// The kv head of query head `h`.
    fn kv_of(&self, h: usize) -> usize {
        h / (self.heads / self.kv)
    }
}

/// `y[rows, out] = x[rows, in] Wᵀ`.
fn linear(rows: usize, d_in: usize, d_out: usize) -> Mm {
    Mm::new(rows, d_out, d_in).tb()
}

/// The contiguous runs `(first row, rows)` of `picked` (increasing).
fn runs(picked: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &r in picked {
        match out.last_mut() {
            Some((s, n)) if *s + *n == r => *n += 1,
            _ => out.push((r, 1)),
        }
    }
    out
}

impl<B: LlamaDevice> DeviceModel<B> {
    /// The model on `backend` (the engine's, [`Engine::device_backend`]);
    /// `threads`: the CPU backend's GEMM threads.
    ///
    /// With LoRA ([`SftModel::register_lora`]) the adapters train on the
    /// device as the CPU trainer trains them (the same products, the same
    /// dropout masks, kept as bit masks), the frozen base read in place
    /// from the gathered units.
    pub fn new(model: SftModel, backend: &B, threads: usize) -> Result<Self> {
        let ops = backend.llama_ops(&model.cfg, threads)?;
        Ok(DeviceModel {
            model,
            ops,
            workspace_peak: AtomicU64::new(0),
            masks: Mutex::new(MaskStage::new()),
        })
    }

    /// Test-only: LoRA's dropout masks rewrite a pinned slot without
    /// waiting for the copy out of it, so that a test can prove the
    /// backend's hazard checker catches it.
    #[doc(hidden)]
    pub fn skip_mask_wait_for_tests(&mut self) {
        if let Ok(m) = self.masks.get_mut() {
            m.skip_wait = true;
        }
    }

    /// The largest bytes of the trainer's own buffers (activations,
    /// workspaces, gradients before their copy into the engine's buffers)
    /// live at once in the last micro-batch; at most [`workspace_bytes`]
    /// of its shape.
    pub fn workspace_peak(&self) -> u64 {
        self.workspace_peak.load(Ordering::Relaxed)
    }

    /// Starts (`on`) or stops timing each op of the micro-batches on the
    /// device ([`super::profile`]); off by default, and cheap when off.
    pub fn set_profiling(&self, backend: &B, on: bool) {
        backend.set_profiling(&self.ops, on);
    }

    /// The device time of the ops since profiling started or was last
    /// taken, per phase and kind (waits for the ops); `None` on a backend
    /// without timers.
    pub fn take_profile(&self, backend: &B) -> Result<Option<OpProfile>> {
        backend.take_profile(&self.ops)
    }

    /// One micro-batch on this rank, as [`SftModel::train_micro_batch`]:
    /// forward, loss, backward, `grad_ready` per unit in reverse order, on
    /// the engine's backend. Call [`Engine::step`] afterwards.
    pub fn train_micro_batch<T: Element, C: EngineComm<B>>(
        &self,
        e: &mut Engine<C, B>,
        tokens: &[u32],
        targets: &[i32],
        batch: usize,
        seq: usize,
        tracer: &Tracer,
    ) -> Result<MicroStats> {
        let m = &self.model;
        let c = &m.cfg;
        let s = Shape::new(c, batch, seq);
        let rank = e.rank();
        if tokens.len() != s.rows || targets.len() != s.rows {
            return Err(Error::Usage {
                rank,
                what: format!(
                    "{} tokens and {} targets for {batch} sequences of {seq}",
                    tokens.len(),
                    targets.len()
                ),
            });
        }
        let owned = e.device_backend().clone();
        let dev = &owned;
        let ops = &self.ops;
        m.next_micro(e.global_steps());
        let frozen = frozen(m);
        self.mask_stage()?.track(e.tracker());
        let live_before = LIVE.with(|c| {
            let (live, _) = c.get();
            c.set((live, live));
            live
        });
        let mut act = e.tracker().allocate(Tier::Device, Category::Activations, 0);
        let (mut live, mut peak) = (0u64, 0u64);
        let mut grow = |by: i64| {
            live = (live as i64 + by) as u64;
            peak = peak.max(live);
            act.resize(live);
        };
        // Every upload before any compute: a copy from pageable memory may
        // wait for the stream (the driver stages it).
        let ids = dev.upload_ids(ops, tokens)?;
        let picked: Vec<usize> = (0..s.rows).filter(|&r| targets[r] >= 0).collect();
        let np = picked.len();
        let picked_targets: Vec<i32> = picked.iter().map(|&r| targets[r]).collect();
        let tgt = dev.upload_targets(ops, &picked_targets)?;
        let plan = dev.embed_plan(ops, tokens, c.vocab, c.pad_id)?;

        // Forward.
        dev.profile_phase(ops, Phase::Forward);
        let fwd = tracer.span(rank, "forward", "compute");
        let mut x = tmp::<B, T>(dev, s.rows * s.dim, "x")?;
        {
            let g = e.gather(m.embed)?;
            let (eb, ea) = read_at::<B, T>(&g, &tensors(c)[0].name)?;
            dev.embedding_forward(ops, src_at(eb, ea), &ids, x.dst(), s.dim)?;
        }
        grow(bytes::<B, T>(&x));
        let mut saved: Vec<Saved<B, T>> = Vec::with_capacity(c.n_layers);
        for (l, &u) in m.layers.iter().enumerate() {
            let g = e.gather(u)?;
            let (p, frozen_at) = Params::<B, T>::of(&g)?;
            let at = BlockAt::of(m, l, g.layout(), frozen_at)?;
            let key = m.dropout_key(rank, l);
            // Counted: what forward keeps, and the current block input.
            let x_bytes = bytes::<B, T>(&x);
            let (acts, y) = self.block_forward(dev, p, &at, x, s, key)?;
            drop(g);
            let s_ = if m.checkpointing {
                Saved::Input(acts.x)
            } else {
                Saved::Full(acts)
            };
            grow(saved_bytes(&s_) as i64 - x_bytes + bytes::<B, T>(&y));
            saved.push(s_);
            x = y;
        }
        drop(fwd);

        // Head: the final norm and the LM head on the rows that carry loss,
        // then its backward at once.
        let bwd = tracer.span(rank, "backward", "compute");
        dev.profile_phase(ops, Phase::Head);
        let runs = runs(&picked);
        let scale = e.loss_scale();
        let head = e.gather(m.head)?;
        let tied = if c.tie_embeddings {
            Some(e.gather(m.embed)?)
        } else {
            None
        };
        // Where the head's tensors are read (a frozen head's segment may
        // be gathered apart); a trained head's lie there at their layout
        // offsets, which its gradient buffer shares.
        let head_names = &tensors(c)[c.norm_index()..];
        let (hp, norm_at) = read_at::<B, T>(&head, &head_names[0].name)?;
        let (wbuf, w_at) = match &tied {
            Some(t) => read_at::<B, T>(t, &tensors(c)[0].name)?,
            None => read_at::<B, T>(&head, &head_names[1].name)?,
        };
        let mut hx = tmp::<B, T>(dev, np * s.dim, "head input")?;
        let mut k = 0;
        for &(r0, n) in &runs {
            dev.copy_d2d(
                Stream::Compute,
                &x,
                r0 * s.dim,
                &mut hx,
                k * s.dim,
                n * s.dim,
            )?;
            k += n;
        }
        let mut xn = tmp::<B, T>(dev, np * s.dim, "head norm")?;
        let mut inv = tmp::<B, f32>(dev, np, "head inv rms")?;
        dev.rmsnorm_forward(
            ops,
            hx.src(),
            src_at(hp, norm_at),
            xn.dst(),
            inv.dst(),
            np,
            s.dim,
            c.norm_eps,
        )?;
        let mut logits = tmp::<B, T>(dev, np * c.vocab, "logits")?;
        dev.gemm(
            ops,
            logits.dst(),
            xn.src(),
            src_at(wbuf, w_at),
            linear(np, s.dim, c.vocab),
            Batch::ONE,
        )?;
        let mut dlogits = tmp::<B, T>(dev, np * c.vocab, "dlogits")?;
        let mut loss = tmp::<B, f32>(dev, 1, "loss")?;
        dev.cross_entropy(ops, logits.src(), &tgt, dlogits.dst(), loss.dst(), c.vocab)?;
        drop(logits);
        // The loss scale enters as the products' alpha (the CPU trainer
        // scales dlogits first: the same bits for a power-of-two scale).
        let head_len = e.layout(m.head)?.numel;
        // A frozen head (LoRA) gets no gradient: the input gradient only.
        let mut gh = match frozen {
            true => None,
            false => Some(tmp::<B, T>(dev, head_len, "lm_head grad")?),
        };
        let mut dhead_tied = if c.tie_embeddings && !frozen {
            Some(tmp::<B, T>(dev, c.vocab * s.dim, "tied head grad")?)
        } else {
            None
        };
        if let Some(gh) = gh.as_mut() {
            let dw = match dhead_tied.as_mut() {
                Some(d) => d.dst(),
                None => gh.dst_at(w_at),
            };
            dev.gemm(
                ops,
                dw,
                dlogits.src(),
                xn.src(),
                Mm::new(c.vocab, s.dim, np).ta().alpha(scale),
                Batch::ONE,
            )?;
        }
        let mut dxn = tmp::<B, T>(dev, np * s.dim, "head dnorm")?;
        dev.gemm(
            ops,
            dxn.dst(),
            dlogits.src(),
            src_at(wbuf, w_at),
            Mm::new(np, s.dim, c.vocab).alpha(scale),
            Batch::ONE,
        )?;
        drop(dlogits);
        let mut dnorm = tmp::<B, f32>(dev, s.dim, "head norm grad")?;
        let mut dhx = tmp::<B, T>(dev, np * s.dim, "head dx")?;
        dev.rmsnorm_backward(
            ops,
            dxn.src(),
            hx.src(),
            src_at(hp, norm_at),
            inv.src(),
            dhx.dst(),
            dnorm.dst(),
            np,
            s.dim,
            false,
        )?;
        drop((tied, head));
        if let Some(mut gh) = gh {
            dev.cast(Stream::Compute, &dnorm, 0, &mut gh, norm_at, s.dim, false)?;
            let mut g = e.grad_buffer::<T>(m.head)?;
            dev.write_grad(ops, &gh, g.lent(), head_len)?;
            e.grad_ready(m.head, g)?;
        }
        let mut demb = match frozen {
            true => None,
            false => Some(tmp::<B, f32>(dev, c.vocab * s.dim, "embedding grad")?),
        };
        if let (Some(d), Some(demb)) = (&dhead_tied, demb.as_mut()) {
            dev.cast(Stream::Compute, d, 0, demb, 0, c.vocab * s.dim, false)?;
        }
        drop(dhead_tied);
        let mut dx = tmp::<B, T>(dev, s.rows * s.dim, "dx")?;
        let mut k = 0;
        for &(r0, n) in &runs {
            dev.copy_d2d(
                Stream::Compute,
                &dhx,
                k * s.dim,
                &mut dx,
                r0 * s.dim,
                n * s.dim,
            )?;
            k += n;
        }
        grow(bytes::<B, T>(&dx) - bytes::<B, T>(&x));
        drop((hx, xn, inv, dxn, dhx, x));

        // Blocks, last to first.
        dev.profile_phase(ops, Phase::Backward);
        for (l, &u) in m.layers.iter().enumerate().rev() {
            let g = e.gather(u)?;
            let (p, frozen_at) = Params::<B, T>::of(&g)?;
            let at = BlockAt::of(m, l, g.layout(), frozen_at)?;
            let key = m.dropout_key(rank, l);
            let sv = saved.pop().ok_or_else(|| Error::Usage {
                rank,
                what: format!("no saved activations for layer {l}"),
            })?;
            grow(-(saved_bytes(&sv) as i64));
            let acts = match sv {
                Saved::Full(a) => a,
                Saved::Input(x) => self.block_forward(dev, p, &at, x, s, key)?.0,
            };
            grow(acts.bytes() as i64);
            let len = g.layout().numel;
            let mut gb = tmp::<B, T>(dev, len, "block grad")?;
            let next = self.block_backward(dev, p, &at, &acts, dx, &mut gb, s)?;
            drop(g);
            grow(-(acts.bytes() as i64));
            drop(acts);
            dx = next;
            let mut lent = e.grad_buffer::<T>(u)?;
            dev.write_grad(ops, &gb, lent.lent(), len)?;
            e.grad_ready(u, lent)?;
        }

        // Embedding: no parameters needed, so no gather; nothing at all
        // when it is frozen.
        if let Some(demb) = demb.as_mut() {
            dev.embedding_backward(ops, dx.src(), &plan, demb.dst(), s.dim)?;
        }
        grow(-bytes::<B, T>(&dx));
        drop(dx);
        if let Some(demb) = demb {
            let n = c.vocab * s.dim;
            let mut ge = tmp::<B, T>(dev, n, "embedding grad")?;
            dev.cast(Stream::Compute, &demb, 0, &mut ge, 0, n, false)?;
            let mut g = e.grad_buffer::<T>(m.embed)?;
            dev.write_grad(ops, &ge, g.lent(), n)?;
            e.grad_ready(m.embed, g)?;
        }
        drop(bwd);

        dev.sync(&dev.record(Stream::Compute)?)?;
        let loss = dev.host_ref(&loss, 0..1)?[0];
        let peak_now = LIVE.with(|c| c.get().1);
        self.workspace_peak
            .store(peak_now.saturating_sub(live_before), Ordering::Relaxed);
        Ok(MicroStats {
            loss,
            target_tokens: np,
            activation_bytes: peak,
        })
    }

    /// A block's forward from input `x`: what its backward reads, and the
    /// output `y = h + down(silu(gate) ∘ up)`; with LoRA each target's
    /// adapter adds its output after its projection (`key`: the block's
    /// dropout key, [`SftModel`]'s).
    fn block_forward<T: Element>(
        &self,
        dev: &B,
        p: Params<'_, B, T>,
        at: &BlockAt,
        x: Tmp<B, T>,
        s: Shape,
        key: Option<u64>,
    ) -> Result<Forward<B, T>> {
        let (c, ops) = (&self.model.cfg, &self.ops);
        let [wq, wk, wv, wo, gate, up, down, n1, n2] = at.w;
        let (rows, dim) = (s.rows, s.dim);
        let mut xn1 = tmp::<B, T>(dev, rows * dim, "xn1")?;
        let mut inv1 = tmp::<B, f32>(dev, rows, "inv1")?;
        dev.rmsnorm_forward(
            ops,
            x.src(),
            src_at(p.base, n1),
            xn1.dst(),
            inv1.dst(),
            rows,
            dim,
            c.norm_eps,
        )?;
        let mut q = self.project(dev, &xn1, p.base, wq, (rows, dim, s.qd), "q")?;
        let mut k = self.project(dev, &xn1, p.base, wk, (rows, dim, s.kd), "k")?;
        let mut v = self.project(dev, &xn1, p.base, wv, (rows, dim, s.kd), "v")?;
        if let Some([bq, bk, bv]) = at.bias {
            dev.add_bias(ops, q.dst(), src_at(p.base, bq), rows, s.qd)?;
            dev.add_bias(ops, k.dst(), src_at(p.base, bk), rows, s.kd)?;
            dev.add_bias(ops, v.dst(), src_at(p.base, bv), rows, s.kd)?;
        }
        let mut lora = match &at.lora {
            Some(ll) => Some(self.lora_acts(dev, ll, s, key)?),
            None => None,
        };
        if let (Some(ll), Some(la)) = (&at.lora, lora.as_mut()) {
            self.adapt(dev, p.unit, ll, la, 0, &xn1, &mut q, s)?;
            self.adapt(dev, p.unit, ll, la, 1, &xn1, &mut k, s)?;
            self.adapt(dev, p.unit, ll, la, 2, &xn1, &mut v, s)?;
        }
        dev.rope(ops, q.dst(), rows, s.seq, s.heads, false)?;
        dev.rope(ops, k.dst(), rows, s.seq, s.kv, false)?;
        let t = s.seq;
        let scale = 1.0 / (s.hd as f32).sqrt();
        let mut scores = tmp_scratch::<B, T>(dev, s.mats(), "scores")?;
        for h in 0..s.heads {
            let g = s.kv_of(h);
            dev.gemm(
                ops,
                scores.dst_at(h * t * t),
                q.src_at(h * s.hd),
                k.src_at(g * s.hd),
                Mm::new(t, t, s.hd).tb().ld(s.qd, s.kd, t).alpha(scale),
                Batch {
                    count: s.batch,
                    a: t * s.qd,
                    b: t * s.kd,
                    out: s.heads * t * t,
                },
            )?;
        }
        let mut probs = tmp_scratch::<B, T>(dev, s.mats(), "probs")?;
        dev.softmax_forward(ops, scores.src(), probs.dst(), s.batch * s.heads, t)?;
        drop(scores);
        let mut attn = tmp::<B, T>(dev, rows * s.qd, "attn")?;
        for h in 0..s.heads {
            let g = s.kv_of(h);
            dev.gemm(
                ops,
                attn.dst_at(h * s.hd),
                probs.src_at(h * t * t),
                v.src_at(g * s.hd),
                Mm::new(t, s.hd, t).ld(t, s.kd, s.qd),
                Batch {
                    count: s.batch,
                    a: s.heads * t * t,
                    b: t * s.kd,
                    out: t * s.qd,
                },
            )?;
        }
        let mut h = tmp::<B, T>(dev, rows * dim, "h")?;
        dev.copy_d2d(Stream::Compute, &x, 0, &mut h, 0, rows * dim)?;
        dev.gemm(
            ops,
            h.dst(),
            attn.src(),
            src_at(p.base, wo),
            linear(rows, s.qd, dim).acc(),
            Batch::ONE,
        )?;
        if let (Some(ll), Some(la)) = (&at.lora, lora.as_mut()) {
            self.adapt(dev, p.unit, ll, la, 3, &attn, &mut h, s)?;
        }
        let mut xn2 = tmp::<B, T>(dev, rows * dim, "xn2")?;
        let mut inv2 = tmp::<B, f32>(dev, rows, "inv2")?;
        dev.rmsnorm_forward(
            ops,
            h.src(),
            src_at(p.base, n2),
            xn2.dst(),
            inv2.dst(),
            rows,
            dim,
            c.norm_eps,
        )?;
        let mut h1 = self.project(dev, &xn2, p.base, gate, (rows, dim, s.hidden), "h1")?;
        let mut h3 = self.project(dev, &xn2, p.base, up, (rows, dim, s.hidden), "h3")?;
        if let (Some(ll), Some(la)) = (&at.lora, lora.as_mut()) {
            self.adapt(dev, p.unit, ll, la, 4, &xn2, &mut h1, s)?;
            self.adapt(dev, p.unit, ll, la, 5, &xn2, &mut h3, s)?;
        }
        let mut a = tmp::<B, T>(dev, rows * s.hidden, "swiglu")?;
        dev.swiglu_forward(ops, h1.src(), h3.src(), a.dst(), rows * s.hidden)?;
        let mut mlp = self.project(dev, &a, p.base, down, (rows, s.hidden, dim), "mlp out")?;
        if let (Some(ll), Some(la)) = (&at.lora, lora.as_mut()) {
            self.adapt(dev, p.unit, ll, la, 6, &a, &mut mlp, s)?;
        }
        let mut y = tmp::<B, T>(dev, rows * dim, "y")?;
        dev.copy_d2d(Stream::Compute, &h, 0, &mut y, 0, rows * dim)?;
        dev.cast(Stream::Compute, &mlp, 0, &mut y, 0, rows * dim, true)?;
        let acts = Box::new(Acts {
            x,
            xn1,
            inv1,
            q,
            k,
            v,
            probs,
            attn,
            h,
            xn2,
            inv2,
            h1,
            h3,
            a,
            lora,
        });
        Ok((acts, y))
    }

    /// `x[rows, d_in] Wᵀ` into a new buffer, for the weight `W` `[d_out,
    /// d_in]` at element `w` of the unit's buffer `p`.
    fn project<T: Element>(
        &self,
        dev: &B,
        x: &Tmp<B, T>,
        p: &B::Buffer<T>,
        w: usize,
        (rows, d_in, d_out): (usize, usize, usize),
        label: &str,
    ) -> Result<Tmp<B, T>> {
        let mut y = tmp::<B, T>(dev, rows * d_out, label)?;
        dev.gemm(
            &self.ops,
            y.dst(),
            x.src(),
            src_at(p, w),
            linear(rows, d_in, d_out),
            Batch::ONE,
        )?;
        Ok(y)
    }

    /// Backward of `y = x Wᵀ` for `W` `[d_out, d_in]` at element `w` of
    /// the unit's buffer `p`: `dW = dyᵀ x` written into `gb[w..]`, and
    /// `dx = dy W` written, or with `acc` added to (as
    /// [`crate::ops::linear_backward`]).
    #[allow(clippy::too_many_arguments)]
    fn linear_backward<T: Element>(
        &self,
        dev: &B,
        p: &B::Buffer<T>,
        w: usize,
        gb: &mut B::Buffer<T>,
        dy: &Tmp<B, T>,
        x: &Tmp<B, T>,
        dx: &mut Tmp<B, T>,
        (rows, d_in, d_out): (usize, usize, usize),
        acc: bool,
    ) -> Result<()> {
        let ops = &self.ops;
        let dw = Mm::new(d_out, d_in, rows).ta();
        dev.gemm(ops, dst_at(gb, w), dy.src(), x.src(), dw, Batch::ONE)?;
        let back = Mm::new(rows, d_in, d_out);
        let back = if acc { back.acc() } else { back };
        dev.gemm(ops, dx.dst(), dy.src(), src_at(p, w), back, Batch::ONE)
    }

    /// Backward of projection `i` of a block (q, k, v, o, gate, up, down:
    /// [`crate::lora::TARGETS`]' order) for its output gradient `dy` and
    /// input `x`, into `dx`: with a trained base the full backward
    /// ([`linear_backward`](Self::linear_backward): `dW` into `gb`, `dx`
    /// written, or with `acc` added to), with a frozen one the input
    /// gradient alone and the adapter's
    /// ([`frozen_backward`](Self::frozen_backward): `dx` added to, `dA`
    /// and `dB` into `gb`).
    #[allow(clippy::too_many_arguments)]
    fn proj_backward<T: Element>(
        &self,
        dev: &B,
        p: Params<'_, B, T>,
        at: &BlockAt,
        lora: Option<(&LayerLora, &LoraActs<B, T>)>,
        i: usize,
        (dy, x): (&Tmp<B, T>, &Tmp<B, T>),
        dx: &mut Tmp<B, T>,
        gb: &mut B::Buffer<T>,
        s: Shape,
        acc: bool,
    ) -> Result<()> {
        let w = at.w[i];
        if at.train_base {
            let (d_in, d_out) = s.proj(i);
            self.linear_backward(dev, p.base, w, gb, dy, x, dx, (s.rows, d_in, d_out), acc)
        } else {
            self.frozen_backward(dev, p, w, lora, i, (dy, x), dx, gb, s)
        }
    }

    /// A block's backward for output gradient `dy` ([`crate::Block`]'s,
    /// with LoRA [`crate::BlockLora`]'s): each projection's backward by
    /// [`proj_backward`](Self::proj_backward); the norms' weight gradients
    /// and the biases' written into `gb` (the unit's gradient layout) when
    /// the base trains, else dropped (the norms') or not computed (the
    /// biases'). Returns `dx`.
    #[allow(clippy::too_many_arguments)]
    fn block_backward<T: Element>(
        &self,
        dev: &B,
        p: Params<'_, B, T>,
        at: &BlockAt,
        c: &Acts<B, T>,
        dy: Tmp<B, T>,
        gb: &mut B::Buffer<T>,
        s: Shape,
    ) -> Result<Tmp<B, T>> {
        let ops = &self.ops;
        let [_, _, _, _, _, _, _, n1, n2] = at.w;
        let lora = match (&at.lora, &c.lora) {
            (Some(ll), Some(la)) => Some((ll, la)),
            (None, _) => None,
            (Some(_), None) => {
                return Err(Error::Unsupported {
                    what: "internal: a LoRA backward without the block's saved adapters".into(),
                })
            }
        };
        let proj =
            |i: usize,
             io: (&Tmp<B, T>, &Tmp<B, T>),
             dx: &mut Tmp<B, T>,
             gb: &mut B::Buffer<T>,
             acc: bool| { self.proj_backward(dev, p, at, lora, i, io, dx, gb, s, acc) };
        let (rows, dim, hid) = (s.rows, s.dim, s.hidden);
        // MLP branch.
        let mut da = tmp::<B, T>(dev, rows * hid, "da")?;
        proj(6, (&dy, &c.a), &mut da, gb, false)?;
        let mut dh1 = tmp::<B, T>(dev, rows * hid, "dh1")?;
        let mut dh3 = tmp::<B, T>(dev, rows * hid, "dh3")?;
        dev.swiglu_backward(
            ops,
            da.src(),
            c.h1.src(),
            c.h3.src(),
            dh1.dst(),
            dh3.dst(),
            rows * hid,
        )?;
        drop(da);
        let mut dxn2 = tmp::<B, T>(dev, rows * dim, "dxn2")?;
        proj(4, (&dh1, &c.xn2), &mut dxn2, gb, false)?;
        proj(5, (&dh3, &c.xn2), &mut dxn2, gb, true)?;
        drop((dh1, dh3));
        let mut dh = tmp::<B, T>(dev, rows * dim, "dh")?;
        dev.copy_d2d(Stream::Compute, &dy, 0, &mut dh, 0, rows * dim)?;
        drop(dy);
        // A frozen base's norms share this one for their dropped weight
        // gradients.
        let mut dn2 = tmp::<B, f32>(dev, dim, "mlp norm grad")?;
        dev.rmsnorm_backward(
            ops,
            dxn2.src(),
            c.h.src(),
            src_at(p.base, n2),
            c.inv2.src(),
            dh.dst(),
            dn2.dst(),
            rows,
            dim,
            true,
        )?;
        drop(dxn2);
        // Attention branch.
        let mut dattn = tmp::<B, T>(dev, rows * s.qd, "dattn")?;
        proj(3, (&dh, &c.attn), &mut dattn, gb, false)?;
        let (dq, dk, dv) = self.attention_backward(dev, c, dattn, s)?;
        // The biases' gradients: column sums of the projections' output
        // gradients (before RoPE, where the bias is added).
        if let (true, Some([bq, bk, bv])) = (at.train_base, at.bias) {
            dev.bias_grad(ops, dq.src(), dst_at(gb, bq), rows, s.qd)?;
            dev.bias_grad(ops, dk.src(), dst_at(gb, bk), rows, s.kd)?;
            dev.bias_grad(ops, dv.src(), dst_at(gb, bv), rows, s.kd)?;
        }
        let mut dxn1 = tmp::<B, T>(dev, rows * dim, "dxn1")?;
        proj(0, (&dq, &c.xn1), &mut dxn1, gb, false)?;
        proj(1, (&dk, &c.xn1), &mut dxn1, gb, true)?;
        proj(2, (&dv, &c.xn1), &mut dxn1, gb, true)?;
        drop((dq, dk, dv));
        let mut dx = tmp::<B, T>(dev, rows * dim, "dx")?;
        dev.copy_d2d(Stream::Compute, &dh, 0, &mut dx, 0, rows * dim)?;
        let mut dn1 = match at.train_base {
            true => Some(tmp::<B, f32>(dev, dim, "attn norm grad")?),
            false => None,
        };
        dev.rmsnorm_backward(
            ops,
            dxn1.src(),
            c.x.src(),
            src_at(p.base, n1),
            c.inv1.src(),
            dx.dst(),
            dn1.as_mut().unwrap_or(&mut dn2).dst(),
            rows,
            dim,
            true,
        )?;
        if let Some(dn1) = &dn1 {
            dev.cast(Stream::Compute, dn1, 0, gb, n1, dim, false)?;
            dev.cast(Stream::Compute, &dn2, 0, gb, n2, dim, false)?;
        }
        Ok(dx)
    }

    /// Attention's backward from `dattn` (the gradient of its output
    /// before `o_proj`): `(dq, dk, dv)`, the queries' and keys' before
    /// RoPE (where the projections and their biases are).
    fn attention_backward<T: Element>(
        &self,
        dev: &B,
        c: &Acts<B, T>,
        dattn: Tmp<B, T>,
        s: Shape,
    ) -> Result<Qkv<B, T>> {
        let ops = &self.ops;
        let rows = s.rows;
        let t = s.seq;
        let scale = 1.0 / (s.hd as f32).sqrt();
        let mut dp = tmp_scratch::<B, T>(dev, s.mats(), "dprobs")?;
        let mut dq = tmp::<B, T>(dev, rows * s.qd, "dq")?;
        let mut dk = tmp::<B, T>(dev, rows * s.kd, "dk")?;
        let mut dv = tmp::<B, T>(dev, rows * s.kd, "dv")?;
        let per_seq = |a: usize, b: usize, out: usize| Batch {
            count: s.batch,
            a,
            b,
            out,
        };
        let mats = s.heads * t * t;
        for h in 0..s.heads {
            let g = s.kv_of(h);
            // dP = dO Vᵀ
            dev.gemm(
                ops,
                dp.dst_at(h * t * t),
                dattn.src_at(h * s.hd),
                c.v.src_at(g * s.hd),
                Mm::new(t, t, s.hd).tb().ld(s.qd, s.kd, t),
                per_seq(t * s.qd, t * s.kd, mats),
            )?;
            // dV += Pᵀ dO
            dev.gemm(
                ops,
                dv.dst_at(g * s.hd),
                c.probs.src_at(h * t * t),
                dattn.src_at(h * s.hd),
                Mm::new(t, s.hd, t).ta().ld(t, s.qd, s.kd).acc(),
                per_seq(mats, t * s.qd, t * s.kd),
            )?;
        }
        let mut ds = tmp_scratch::<B, T>(dev, s.mats(), "dscores")?;
        dev.softmax_backward(
            ops,
            c.probs.src(),
            dp.src(),
            ds.dst(),
            s.batch * s.heads,
            t,
            scale,
        )?;
        drop(dp);
        for h in 0..s.heads {
            let g = s.kv_of(h);
            // dQ = dS K
            dev.gemm(
                ops,
                dq.dst_at(h * s.hd),
                ds.src_at(h * t * t),
                c.k.src_at(g * s.hd),
                Mm::new(t, s.hd, t).ld(t, s.kd, s.qd),
                per_seq(mats, t * s.kd, t * s.qd),
            )?;
            // dK += dSᵀ Q
            dev.gemm(
                ops,
                dk.dst_at(g * s.hd),
                ds.src_at(h * t * t),
                c.q.src_at(h * s.hd),
                Mm::new(t, s.hd, t).ta().ld(t, s.qd, s.kd).acc(),
                per_seq(mats, t * s.qd, t * s.kd),
            )?;
        }
        drop((ds, dattn));
        dev.rope(ops, dq.dst(), rows, t, s.heads, true)?;
        dev.rope(ops, dk.dst(), rows, t, s.kv, true)?;
        Ok((dq, dk, dv))
    }
}

fn bytes<B: Backend, T: Element>(b: &Tmp<B, T>) -> i64 {
    (b.len() * size_of::<T>()) as i64
}

fn saved_bytes<B: LlamaDevice, T: Element>(s: &Saved<B, T>) -> u64 {
    match s {
        Saved::Full(a) => a.bytes(),
        Saved::Input(x) => bytes::<B, T>(x) as u64,
    }
}

/// The device memory [`DeviceModel`] allocates at most in a micro-batch of
/// a shape ([`workspace_bytes`]): what the engine reserves for it
/// ([`zero::EngineBuilder::device_workspace`]) so that the device pool
/// grows by nothing after the build; and the pinned host memory it
/// stages uploads through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workspace {
    /// The largest bytes of the trainer's own buffers live at once
    /// (activations, workspaces, LoRA's adapter products and dropout
    /// masks, gradients before their copy into the engine's buffers):
    /// [`DeviceModel::workspace_peak`] measures it.
    pub buffers: u64,
    /// What the CUDA ops allocate besides (token ids, targets, the
    /// embedding's gradient plan, the norms' and the loss's scratch, the
    /// RoPE tables, the ones of a bias), which the CPU backend does not.
    pub ops: u64,
    /// Pinned host memory, not device memory (not in
    /// [`total`](Workspace::total)): the [`MASK_SLOTS`] slots LoRA's
    /// dropout masks go up through, each of a block's masks
    /// ([`mask_words`]); 0 without dropout. The engine's tracker counts
    /// them as host communication buffers.
    pub host_pinned: u64,
}

impl Workspace {
    /// The device memory: [`buffers`](Workspace::buffers) and
    /// [`ops`](Workspace::ops).
    pub fn total(&self) -> u64 {
        self.buffers + self.ops
    }
}

/// [`DeviceModel`]'s memory in a micro-batch of `batch` sequences of
/// `seq` tokens of model `cfg` with elements of `elem` bytes (2 for
/// bf16), a full fine-tune or with LoRA adapters `lora` (the base frozen;
/// with dropout, its masks), with or without activation checkpointing,
/// every token a target (the most): the trainer's allocations replayed in
/// its order by size.
pub fn workspace_bytes(
    cfg: &Config,
    lora: Option<&LoraConfig>,
    batch: usize,
    seq: usize,
    checkpointing: bool,
    elem: usize,
) -> Workspace {
    let s = Shape::new(cfg, batch, seq);
    let e = elem as u64;
    let (r, d, q, k, h) = (
        s.rows as u64,
        s.dim as u64,
        s.qd as u64,
        s.kd as u64,
        s.hidden as u64,
    );
    let m = s.mats() as u64;
    let v = cfg.vocab as u64;
    let np = r;
    let frozen = lora.is_some();
    let numel = |t: &[crate::TensorInfo]| t.iter().map(|t| t.numel() as u64).sum::<u64>();
    // A block's gradient buffer: its trainable tensors (the adapters with
    // LoRA).
    let block_len = match lora {
        None => numel(&block_tensors(cfg, 0)),
        Some(lc) => numel(&crate::lora::lora_tensors(cfg, lc, 0)),
    };
    let head_len = numel(&tensors(cfg)[cfg.norm_index()..]);
    // Per projection (q, k, v, o, gate, up, down) with an adapter: the
    // bytes of its `drop(x) Aᵀ` and of its (dropped) input; and a block's
    // dropout masks (f32 words).
    let adapters: [Option<(u64, u64)>; 7] = std::array::from_fn(|i| {
        let lc = lora.filter(|lc| lc.targets(crate::lora::TARGETS[i].0))?;
        Some((e * r * lc.r as u64, e * r * s.proj(i).0 as u64))
    });
    let masks = lora.map_or(0, |lc| 4 * mask_words(cfg, lc, s.rows) as u64);
    let dropout = masks > 0;
    // Projection i's adapter in forward (`adapt`): its dropped input while
    // `drop(x) Aᵀ` is made, which stays.
    let adapt = |l: &mut Ledger, i: usize| {
        if let Some((xa, xin)) = adapters[i] {
            l.alloc(if dropout { xin } else { 0 });
            l.alloc(xa);
            l.free(if dropout { xin } else { 0 });
        }
    };
    // Projection i's frozen backward with its adapter (`frozen_backward`):
    // d(xa), and with dropout the dropped input, then the adapter's input
    // gradient before the mask.
    let back = |l: &mut Ledger, i: usize| {
        if let Some((xa, xin)) = adapters[i] {
            l.alloc(xa);
            if dropout {
                l.alloc(xin);
                l.free(xin);
                l.alloc(xin);
                l.free(xin);
            }
            l.free(xa);
        }
    };
    let mut l = Ledger::default();
    // Acts of one block: x, xn1, h, xn2; q, attn; k, v; probs; h1, h3, a;
    // inv1, inv2; the adapters' products and the masks.
    let lora_acts: u64 = adapters.iter().flatten().map(|a| a.0).sum::<u64>() + masks;
    let acts = e * (4 * r * d + 2 * r * q + 2 * r * k + m + 3 * r * h) + 8 * r + lora_acts;
    // A block's forward from its input (live), as block_forward: leaves
    // acts (without x) and y live.
    let forward = |l: &mut Ledger| {
        l.alloc(e * r * d + 4 * r); // xn1, inv1
        l.alloc(e * (r * q + 2 * r * k)); // q, k, v
        l.alloc(masks);
        for i in 0..3 {
            adapt(l, i);
        }
        l.alloc(e * m); // scores
        l.alloc(e * m); // probs
        l.free(e * m); // scores
        l.alloc(e * r * q); // attn
        l.alloc(e * r * d); // h
        adapt(l, 3);
        l.alloc(e * r * d + 4 * r); // xn2, inv2
        l.alloc(2 * e * r * h); // h1, h3
        adapt(l, 4);
        adapt(l, 5);
        l.alloc(e * r * h); // a
        l.alloc(e * r * d); // mlp out
        adapt(l, 6);
        l.alloc(e * r * d); // y
        l.free(e * r * d); // mlp out
    };
    l.alloc(e * r * d); // x
    for _ in 0..cfg.n_layers {
        forward(&mut l);
        if checkpointing {
            // Only the block input stays.
            l.free(acts - e * r * d);
        }
    }
    // Head; y of the last block is x. A frozen head (LoRA) has no
    // gradients, nor has the embedding.
    let (gh, emb) = match frozen {
        true => (0, 0),
        false => (e * head_len, 4 * v * d),
    };
    let tied = if cfg.tie_embeddings && !frozen {
        e * v * d
    } else {
        0
    };
    l.alloc(2 * e * np * d + 4 * np); // hx, xn, inv
    l.alloc(2 * e * np * v + 4); // logits, dlogits, loss
    l.free(e * np * v); // logits
    l.alloc(gh); // lm_head grad
    l.alloc(tied);
    l.alloc(e * np * d); // dxn
    l.free(e * np * v); // dlogits
    l.alloc(4 * d + e * np * d); // dnorm, dhx
    l.free(gh); // lm_head grad, handed to the engine
    l.alloc(emb); // embedding grad (f32)
    l.free(tied);
    l.alloc(e * r * d); // dx
    l.free(3 * e * np * d + 4 * np + e * np * d + e * r * d); // hx, xn, inv, dxn, dhx, x
                                                              // The attention norm's weight gradient (a frozen one shares the MLP
                                                              // norm's).
    let dn1 = if frozen { 0 } else { 4 * d };
    for _ in 0..cfg.n_layers {
        if checkpointing {
            // The saved input becomes the recomputed block's x; its y is
            // dropped at once.
            forward(&mut l);
            l.free(e * r * d);
        }
        l.alloc(e * block_len); // block grad

        // block_backward(dy = dx).
        l.alloc(e * r * h); // da
        back(&mut l, 6);
        l.alloc(2 * e * r * h); // dh1, dh3
        l.free(e * r * h); // da
        l.alloc(e * r * d); // dxn2
        back(&mut l, 4);
        back(&mut l, 5);
        l.free(2 * e * r * h); // dh1, dh3
        l.alloc(e * r * d); // dh
        l.free(e * r * d); // dy
        l.alloc(4 * d); // mlp norm grad
        l.free(e * r * d); // dxn2
        l.alloc(e * r * q); // dattn
        back(&mut l, 3);
        l.alloc(e * (m + r * q + 2 * r * k)); // dprobs, dq, dk, dv
        l.alloc(e * m); // dscores
        l.free(e * m); // dprobs
        l.free(e * m + e * r * q); // dscores, dattn
        l.alloc(e * r * d); // dxn1
        for i in 0..3 {
            back(&mut l, i);
        }
        l.free(e * (r * q + 2 * r * k)); // dq, dk, dv
        l.alloc(e * r * d + dn1); // dx, attn norm grad
        l.free(2 * e * r * d + 4 * d + dn1); // dh, dxn1, the norm grads
        l.free(acts); // the block's activations
        l.free(e * block_len); // block grad
    }
    l.free(e * r * d); // dx (after the embedding's backward)
    l.alloc(if frozen { 0 } else { e * v * d }); // embedding grad (T)

    // The CUDA ops' own: ids, targets (u32/i32), the embedding plan (three
    // u32 arrays of at most rows + 1), the norms' and the loss's f32
    // scratch, the RoPE tables (f32 cos and sin, made with the ops), the
    // ones of a bias (one at a time).
    let scratch = (crate::cuda::rmsnorm_scratch_len(s.rows, s.dim) as u64).max(np) * 4;
    let rope = 8 * cfg.max_seq as u64 * (s.hd as u64 / 2);
    let ones = if cfg.qkv_bias { e * r } else { 0 };
    Workspace {
        buffers: l.peak,
        ops: 4 * (r + np) + 4 * (3 * r + 1) + scratch + rope + ones,
        host_pinned: MASK_SLOTS as u64 * masks,
    }
}

/// Bytes live and their peak, for [`workspace_bytes`].
#[derive(Default)]
struct Ledger {
    live: u64,
    peak: u64,
}

impl Ledger {
    fn alloc(&mut self, bytes: u64) {
        self.live += bytes;
        self.peak = self.peak.max(self.live);
    }

    fn free(&mut self, bytes: u64) {
        self.live = self.live.saturating_sub(bytes);
    }
}
