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
//! element, one upload per block; backward (and a checkpointed block's
//! recomputation) uses the same bits.

use zero::core::backend::BufferHandle;
use zero::core::partition::UnitLayout;
use zero::core::Element;
use zero::{Error, Result};

use super::{offset, tmp, DeviceModel, Params, Shape, Tmp};
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

/// A block's dropout masks on the device (one upload) and where each
/// target's starts (in 32-bit words).
struct Masks<B: LlamaDevice> {
    bits: B::Mask,
    word: [usize; 7],
    words: usize,
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
        let masks = self.masks.as_ref().map_or(0, |m| m.words);
        (xa * size_of::<T>() + 4 * masks) as u64
    }
}

/// `(d_in, d_out)` of module `i` of [`TARGETS`].
fn dims(cfg: &Config, i: usize) -> (usize, usize) {
    lora::module_dims(cfg, TARGETS[i].0).expect("a TARGETS module")
}

impl<B: LlamaDevice> DeviceModel<B> {
    /// A block's adapter state before its forward: with a dropout `key`
    /// (training, dropout > 0) the masks of every target, drawn as the
    /// CPU trainer draws them ([`lora::dropout_bits`] of `rows · d_in`
    /// elements, seeded by the key and the module) and uploaded at once.
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
                    bits: dev.upload_mask(&self.ops, &bits)?,
                    word,
                    words: bits.len(),
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
            &m.bits,
            m.word[i],
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
                    &mk.bits,
                    mk.word[i],
                    keep,
                    dx.dst(),
                    n,
                    true,
                )
            }
        }
    }
}
