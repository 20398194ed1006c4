//! LoRA on the device trainer: each target projection's adapter
//! (`y += s · (drop(x) Aᵀ) Bᵀ`, [`crate::lora`]'s math) as products
//! through [`LlamaDevice::gemm`] (cuBLAS on CUDA) and its inverted dropout
//! through [`LlamaDevice::dropout`], in the CPU trainer's order
//! ([`crate::Block`] with [`crate::BlockLora`]): the same products with
//! the same shapes and accumulation, so on the CPU backend with f32
//! parameters both trainers give the same bits.
//!
//! The frozen base is read where the engine's gather put it, under every
//! `frozen_params` policy (the guard's `frozen_buffer`: the unit's own
//! buffer with `resident`, the buffer the frozen segment's all-gather
//! landed in with `shard` and `offload`, with no copy); the adapters are
//! read from the unit's buffer and their gradients go into its gradient
//! buffer, whose trainable segment holds the adapters alone.
//!
//! Dropout masks are drawn on the host as the CPU trainer draws them
//! ([`crate::lora::dropout_bits`]: the same key per layer and module,
//! the same draws) and kept on the device as bit masks, 1 bit per
//! element, one upload per block through pinned host slots
//! ([`MaskStage`]); backward (and a checkpointed block's recomputation)
//! uses the same bits.

use std::sync::MutexGuard;

use zero::core::backend::{Backend, BufferHandle, Stream};
use zero::core::memory::{Allocation, Category, MemoryTracker, Tier};
use zero::core::partition::UnitLayout;
use zero::core::Element;
use zero::{Error, Result};

use super::{offset, tmp, tmp_scratch, DeviceModel, Params, Shape, Tmp};
use crate::device::{dst_at, src_at, Batch, LlamaDevice};
use crate::lora::{self, LoraConfig, TARGETS};
use crate::ops::Mm;
use crate::Config;

/// One adapted module of a block: where its `A` and `B` are in the unit
/// (the same offsets in the gathered buffer and the gradient buffer).
#[derive(Clone, Copy)]
struct Adapter {
    a: usize,
    b: usize,
}

/// The adapters of one block: per module of [`TARGETS`], its offsets
/// (`None`: not a target), and the rank, scale and dropout of all.
pub(super) struct LayerLora {
    ad: [Option<Adapter>; 7],
    r: usize,
    scale: f32,
    dropout: f32,
}

impl LayerLora {
    /// Layer `l`'s adapters ([`lora::lora_tensors`]) in its unit's layout
    /// `lay`.
    pub(super) fn of(cfg: &Config, lc: &LoraConfig, l: usize, lay: &UnitLayout) -> Result<Self> {
        let names = lora::lora_tensors(cfg, lc, l);
        let mut pairs = names.chunks_exact(2);
        let mut ad = [None; 7];
        for (slot, (m, _)) in ad.iter_mut().zip(TARGETS) {
            if !lc.targets(m) {
                continue;
            }
            let pair = pairs.next().ok_or_else(|| Error::Unsupported {
                what: format!("layer {l}: no adapter tensors for target {m}"),
            })?;
            *slot = Some(Adapter {
                a: offset(lay, &pair[0].name)?,
                b: offset(lay, &pair[1].name)?,
            });
        }
        Ok(LayerLora {
            ad,
            r: lc.r,
            scale: lc.scale(),
            dropout: lc.dropout,
        })
    }
}

/// A block's dropout masks on the device (one upload, its words as f32
/// bit patterns: [`LlamaDevice::dropout`]) and where each target's starts
/// (in 32-bit words).
struct Masks<B: LlamaDevice> {
    bits: Tmp<B, f32>,
    word: [usize; 7],
}

/// What a block's adapters keep from forward for backward: each
/// adapter's `drop(x) Aᵀ` (`[rows, r]`) and the block's dropout masks.
pub(super) struct LoraActs<B: LlamaDevice, T: Element> {
    xa: [Option<Tmp<B, T>>; 7],
    masks: Option<Masks<B>>,
}

impl<B: LlamaDevice, T: Element> LoraActs<B, T> {
    /// Bytes held: the products and the bit masks.
    pub(super) fn bytes(&self) -> u64 {
        let xa: usize = self.xa.iter().flatten().map(|t| t.len()).sum();
        let masks = self.masks.as_ref().map_or(0, |m| m.bits.len());
        (xa * size_of::<T>() + 4 * masks) as u64
    }
}

/// The pinned host slots a block's dropout masks go up through.
///
/// With two, the host draws block `l + 1`'s masks into one slot while
/// block `l`'s copy out of the other may still be queued on the compute
/// stream; rewriting a slot waits (on the host) for the copy out of it
/// enqueued two blocks before, an event per slot.
pub const MASK_SLOTS: usize = zero::estimate::LORA_MASK_SLOTS;

/// The 32-bit words of a block's dropout masks for `rows` rows of input
/// to each target of `lc` in a block of `cfg` ([`lora::dropout_bits`] of
/// each); 0 without dropout. What [`MASK_SLOTS`] pinned slots hold each.
pub fn mask_words(cfg: &Config, lc: &LoraConfig, rows: usize) -> usize {
    if lc.dropout == 0.0 {
        return 0;
    }
    TARGETS
        .iter()
        .filter(|(m, _)| lc.targets(m))
        .map(|(m, _)| {
            let (d_in, _) = lora::module_dims(cfg, m).expect("a TARGETS module");
            (rows * d_in).div_ceil(32)
        })
        .sum()
}

/// [`MASK_SLOTS`] pinned host buffers (the backend's host buffers: pinned
/// on CUDA) that the dropout masks are copied to the device from, on the
/// compute stream, instead of from pageable memory (where the driver's
/// staging may wait for the stream). Allocated at the first upload, all
/// of the largest block's size, and counted in the engine's tracker as
/// host communication buffers.
pub(super) struct MaskStage<B: Backend> {
    slots: Vec<Slot<B>>,
    /// The slot the next upload uses.
    next: usize,
    /// The tracker the slots' bytes go into ([`MaskStage::track`]) …
    tracker: Option<MemoryTracker>,
    /// … and their bytes there.
    tracked: Option<Allocation>,
    /// Test-only: a slot is rewritten without waiting for the copy out of
    /// it ([`DeviceModel::skip_mask_wait_for_tests`]).
    pub(super) skip_wait: bool,
}

struct Slot<B: Backend> {
    host: B::HostBuffer<f32>,
    /// After the last copy out of the slot.
    copied: Option<B::Event>,
}

impl<B: Backend + Clone> MaskStage<B> {
    pub(super) fn new() -> Self {
        MaskStage {
            slots: Vec::new(),
            next: 0,
            tracker: None,
            tracked: None,
            skip_wait: false,
        }
    }

    /// Counts the slots in `tracker` (the engine's), from now on.
    pub(super) fn track(&mut self, tracker: &MemoryTracker) {
        if self.tracker.is_none() {
            self.tracker = Some(tracker.clone());
            self.count();
        }
    }

    /// The slots' bytes into the tracker, once there are any.
    fn count(&mut self) {
        let bytes = self.bytes();
        match (&mut self.tracked, &self.tracker) {
            (Some(t), _) => t.resize(bytes),
            (None, Some(t)) if bytes > 0 => {
                self.tracked = Some(t.allocate(Tier::Host, Category::CommBuffers, bytes))
            }
            (None, _) => {}
        }
    }

    fn bytes(&self) -> u64 {
        self.slots.iter().map(|s| 4 * s.host.len() as u64).sum()
    }

    /// Copies `bits` to a new device buffer (on the compute stream) through
    /// the next slot.
    fn upload(&mut self, dev: &B, bits: &[u32]) -> Result<Tmp<B, f32>> {
        let words = bits.len();
        if self.slots.first().is_none_or(|s| s.host.len() < words) {
            self.grow(dev, words)?;
        }
        let i = self.next;
        self.next = (i + 1) % self.slots.len();
        let slot = &mut self.slots[i];
        if let Some(copied) = slot.copied.take() {
            if !self.skip_wait {
                dev.sync(&copied)?;
            }
        }
        let host = dev.write_host(&mut slot.host, 0..words)?;
        bytemuck::cast_slice_mut::<f32, u32>(host).copy_from_slice(bits);
        let mut d = tmp_scratch::<B, f32>(dev, words, "lora dropout masks")?;
        dev.copy_h2d(Stream::Compute, &slot.host, 0, &mut d, 0, words)?;
        slot.copied = Some(dev.record(Stream::Compute)?);
        Ok(d)
    }

    /// Every slot `words` long: the old ones freed once the copies out of
    /// them finished.
    fn grow(&mut self, dev: &B, words: usize) -> Result<()> {
        for s in &self.slots {
            if let Some(copied) = &s.copied {
                dev.sync(copied)?;
            }
        }
        self.slots.clear();
        for _ in 0..MASK_SLOTS {
            let host = dev.alloc_host::<f32>(words, "lora dropout masks (pinned)")?;
            self.slots.push(Slot { host, copied: None });
        }
        self.next = 0;
        self.count();
        Ok(())
    }
}

/// `(d_in, d_out)` of module `i` of [`TARGETS`].
fn dims(cfg: &Config, i: usize) -> (usize, usize) {
    lora::module_dims(cfg, TARGETS[i].0).expect("a TARGETS module")
}

impl<B: LlamaDevice> DeviceModel<B> {
    /// The dropout masks' pinned slots, for this micro-batch.
    pub(super) fn mask_stage(&self) -> Result<MutexGuard<'_, MaskStage<B>>> {
        self.masks.lock().map_err(|_| Error::Unsupported {
            what: "the dropout masks' staging was poisoned by a panic in an earlier micro-batch"
                .into(),
        })
    }

    /// A block's adapter state before its forward: with a dropout `key`
    /// (training, dropout > 0) the masks of every target, drawn as the
    /// CPU trainer draws them ([`lora::dropout_bits`] of `rows · d_in`
    /// elements, seeded by the key and the module) and uploaded at once
    /// through a pinned slot ([`MaskStage`]).
    pub(super) fn lora_acts<T: Element>(
        &self,
        dev: &B,
        ll: &LayerLora,
        s: Shape,
        key: Option<u64>,
    ) -> Result<LoraActs<B, T>> {
        let masks = match key {
            Some(k) if ll.dropout > 0.0 => {
                let mut bits = Vec::new();
                let mut word = [0; 7];
                for (i, ad) in ll.ad.iter().enumerate() {
                    if ad.is_none() {
                        continue;
                    }
                    word[i] = bits.len();
                    let n = s.rows * dims(&self.model.cfg, i).0;
                    let seed = lora::mix(&[k, i as u64]);
                    bits.extend(lora::dropout_bits(n, ll.dropout, seed).unwrap_or_default());
                }
                Some(Masks {
                    bits: self.mask_stage()?.upload(dev, &bits)?,
                    word,
                })
            }
            _ => None,
        };
        Ok(LoraActs {
            xa: Default::default(),
            masks,
        })
    }

    /// `drop(x)` for module `i` (`n` elements) into a new buffer; `None`
    /// without dropout (the adapter reads `x`).
    fn dropped<T: Element>(
        &self,
        dev: &B,
        ll: &LayerLora,
        la: &LoraActs<B, T>,
        i: usize,
        x: &Tmp<B, T>,
        n: usize,
    ) -> Result<Option<Tmp<B, T>>> {
        let Some(m) = &la.masks else {
            return Ok(None);
        };
        let mut out = tmp::<B, T>(dev, n, "lora dropped input")?;
        let keep = lora::dropout_keep(ll.dropout);
        dev.dropout(
            &self.ops,
            x.src(),
            m.bits.src_at(m.word[i]),
            keep,
            out.dst(),
            n,
            false,
        )?;
        Ok(Some(out))
    }

    /// Adds module `i`'s adapter output (if it has one) to `y`, its base
    /// output for input `x` (`[rows, d_in]`): `y += s · (drop(x) Aᵀ) Bᵀ`
    /// ([`lora::forward`]'s products), keeping `drop(x) Aᵀ` in `la`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn adapt<T: Element>(
        &self,
        dev: &B,
        p: &B::Buffer<T>,
        ll: &LayerLora,
        la: &mut LoraActs<B, T>,
        i: usize,
        x: &Tmp<B, T>,
        y: &mut Tmp<B, T>,
        s: Shape,
    ) -> Result<()> {
        let Some(ad) = ll.ad[i] else {
            return Ok(());
        };
        let (d_in, d_out) = dims(&self.model.cfg, i);
        let (rows, r) = (s.rows, ll.r);
        let xin = self.dropped(dev, ll, la, i, x, rows * d_in)?;
        let xs = xin.as_ref().unwrap_or(x);
        let mut xa = tmp::<B, T>(dev, rows * r, "lora xa")?;
        let ops = &self.ops;
        dev.gemm(
            ops,
            xa.dst(),
            xs.src(),
            src_at(p, ad.a),
            Mm::new(rows, r, d_in).tb(),
            Batch::ONE,
        )?;
        dev.gemm(
            ops,
            y.dst(),
            xa.src(),
            src_at(p, ad.b),
            Mm::new(rows, d_out, r).tb().acc().alpha(ll.scale),
            Batch::ONE,
        )?;
        la.xa[i] = Some(xa);
        Ok(())
    }

    /// Backward of frozen projection `i` of [`TARGETS`] (its weight at
    /// element `w` of `p.base`) with its adapter, if `lora` gives it one
    /// (in `p.unit`): `dx += dy W` (no gradient for `W`), then
    /// [`lora::backward`]'s products: `dA`, `dB` into the unit's gradient
    /// buffer `gb` and the adapter's share of `dx`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn frozen_backward<T: Element>(
        &self,
        dev: &B,
        p: Params<'_, B, T>,
        w: usize,
        lora: Option<(&LayerLora, &LoraActs<B, T>)>,
        i: usize,
        (dy, x): (&Tmp<B, T>, &Tmp<B, T>),
        dx: &mut Tmp<B, T>,
        gb: &mut B::Buffer<T>,
        s: Shape,
    ) -> Result<()> {
        let ops = &self.ops;
        let (d_in, d_out) = s.proj(i);
        let rows = s.rows;
        let back = Mm::new(rows, d_in, d_out).acc();
        dev.gemm(ops, dx.dst(), dy.src(), src_at(p.base, w), back, Batch::ONE)?;
        // The adapter's tensors, in the unit's buffer.
        let pu = p.unit;
        let Some((ll, la)) = lora else {
            return Ok(());
        };
        let Some(ad) = ll.ad[i] else {
            return Ok(());
        };
        let (r, scale) = (ll.r, ll.scale);
        let xa = la.xa[i].as_ref().ok_or_else(|| Error::Unsupported {
            what: format!(
                "internal: no saved adapter product for module {}",
                TARGETS[i].0
            ),
        })?;
        // d(xa) = s · dy B            [rows, r]
        let mut dxa = tmp::<B, T>(dev, rows * r, "lora dxa")?;
        let m = Mm::new(rows, r, d_out).alpha(scale);
        dev.gemm(ops, dxa.dst(), dy.src(), src_at(pu, ad.b), m, Batch::ONE)?;
        // dB += s · dyᵀ xa            [d_out, r]
        let m = Mm::new(d_out, r, rows).ta().acc().alpha(scale);
        dev.gemm(ops, dst_at(gb, ad.b), dy.src(), xa.src(), m, Batch::ONE)?;
        // dA += d(xa)ᵀ drop(x)        [r, d_in]
        let xin = self.dropped(dev, ll, la, i, x, rows * d_in)?;
        let m = Mm::new(r, d_in, rows).ta().acc();
        let xs = xin.as_ref().unwrap_or(x);
        dev.gemm(ops, dst_at(gb, ad.a), dxa.src(), xs.src(), m, Batch::ONE)?;
        drop(xin);
        // dx += (d(xa) A) ⊙ mask      [rows, d_in]
        match &la.masks {
            None => {
                let m = Mm::new(rows, d_in, r).acc();
                dev.gemm(ops, dx.dst(), dxa.src(), src_at(pu, ad.a), m, Batch::ONE)
            }
            Some(mk) => {
                let n = rows * d_in;
                let mut dxin = tmp::<B, T>(dev, n, "lora dx")?;
                let m = Mm::new(rows, d_in, r);
                dev.gemm(ops, dxin.dst(), dxa.src(), src_at(pu, ad.a), m, Batch::ONE)?;
                let keep = lora::dropout_keep(ll.dropout);
                dev.dropout(
                    ops,
                    dxin.src(),
                    mk.bits.src_at(mk.word[i]),
                    keep,
                    dx.dst(),
                    n,
                    true,
                )
            }
        }
    }
}
