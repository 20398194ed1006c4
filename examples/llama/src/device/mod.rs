//! The model on a device backend: the Llama ops as operations on the
//! compute stream of any [`LlamaDevice`], and a trainer
//! ([`DeviceModel`]) whose activations live in the backend's buffers.
//!
//! One composition of the ops serves every backend, so what runs on a GPU
//! (cuBLAS GEMMs, the NVRTC kernels of [`crate::cuda`]) is the sequence the
//! CPU backend runs in the tests, where each op is a
//! [`CpuBackend::launch`](zero::core::backend::CpuBackend::launch) over
//! [`crate::ops`] and the hazard checker proves every access ordered: the
//! trainer's reads of gathered units, its writes of gradients, the
//! engine's collectives around them. With f32 parameters
//! on the CPU the trainer gives the same bits as the CPU trainer
//! ([`crate::train::SftModel`]).
//!
//! With the `cuda` feature the CUDA backend implements [`LlamaDevice`]:
//! its GEMMs are cuBLAS's on the column-major transpose of each row-major
//! product (fp32 accumulation), its other ops the NVRTC kernels, all on
//! the compute stream without waiting for anything; `tests/device_cuda.rs`
//! compares each op and a few training steps with the CPU backend on a
//! GPU.

use zero::comm::Communicator;
use zero::core::backend::{Backend, CpuBackend, Stream};
use zero::core::Element;
use zero::engine::{EngineBackend, EngineComm};
use zero::trace::Tracer;
use zero::{Engine, Result};

use crate::ops::Mm;
use crate::train::{MicroStats, SftModel};
use crate::Config;

mod blas;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod profile;
mod trainer;

pub use profile::{OpKind, OpProfile, OpTime, Phase};
pub use trainer::{mask_words, workspace_bytes, DeviceModel, Workspace, MASK_SLOTS};

/// What trains the registered model on an engine of backend `B`: the CPU
/// trainer ([`SftModel`], on the CPU backend) or [`DeviceModel`] (on any
/// [`LlamaDevice`]), so a training loop is written once.
pub trait Trainer<C: EngineComm<B>, B: EngineBackend> {
    /// The registered model.
    fn model(&self) -> &SftModel;

    /// One micro-batch: forward, loss, backward, `grad_ready` per unit.
    #[allow(clippy::too_many_arguments)]
    fn train_micro_batch<T: Element>(
        &self,
        e: &mut Engine<C, B>,
        tokens: &[u32],
        targets: &[i32],
        batch: usize,
        seq: usize,
        tracer: &Tracer,
    ) -> Result<MicroStats>;
}

impl<C: Communicator + EngineComm<CpuBackend>> Trainer<C, CpuBackend> for SftModel {
    fn model(&self) -> &SftModel {
        self
    }

    fn train_micro_batch<T: Element>(
        &self,
        e: &mut Engine<C, CpuBackend>,
        tokens: &[u32],
        targets: &[i32],
        batch: usize,
        seq: usize,
        tracer: &Tracer,
    ) -> Result<MicroStats> {
        SftModel::train_micro_batch::<T, C>(self, e, tokens, targets, batch, seq, tracer)
    }
}

impl<C: EngineComm<B>, B: LlamaDevice> Trainer<C, B> for DeviceModel<B> {
    fn model(&self) -> &SftModel {
        &self.model
    }

    fn train_micro_batch<T: Element>(
        &self,
        e: &mut Engine<C, B>,
        tokens: &[u32],
        targets: &[i32],
        batch: usize,
        seq: usize,
        tracer: &Tracer,
    ) -> Result<MicroStats> {
        DeviceModel::train_micro_batch::<T, C>(self, e, tokens, targets, batch, seq, tracer)
    }
}

/// Elements of a buffer an op reads, from element `at` (the op's shape
/// says how many).
pub struct Src<'a, B: Backend, T: Element> {
    /// The buffer.
    pub buf: &'a B::Buffer<T>,
    /// The first element.
    pub at: usize,
}

impl<B: Backend, T: Element> Clone for Src<'_, B, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend, T: Element> Copy for Src<'_, B, T> {}

/// Elements of a buffer an op writes, from element `at`.
pub struct Dst<'a, B: Backend, T: Element> {
    /// The buffer.
    pub buf: &'a mut B::Buffer<T>,
    /// The first element.
    pub at: usize,
}

/// The whole of `buf` (from element 0) to read.
pub fn src<B: Backend, T: Element>(buf: &B::Buffer<T>) -> Src<'_, B, T> {
    Src { buf, at: 0 }
}

/// `buf` from element `at` to read.
pub fn src_at<B: Backend, T: Element>(buf: &B::Buffer<T>, at: usize) -> Src<'_, B, T> {
    Src { buf, at }
}

/// The whole of `buf` (from element 0) to write.
pub fn dst<B: Backend, T: Element>(buf: &mut B::Buffer<T>) -> Dst<'_, B, T> {
    Dst { buf, at: 0 }
}

/// `buf` from element `at` to write.
pub fn dst_at<B: Backend, T: Element>(buf: &mut B::Buffer<T>, at: usize) -> Dst<'_, B, T> {
    Dst { buf, at }
}

/// A batch of equal products ([`LlamaDevice::gemm`]): product `i` reads
/// `a` and `b` and writes the output `i` strides further (a stride of 0
/// shares the operand). Outputs of a batch must not overlap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Products.
    pub count: usize,
    /// Elements between two products' `a`.
    pub a: usize,
    /// Elements between two products' `b`.
    pub b: usize,
    /// Elements between two products' outputs.
    pub out: usize,
}

impl Batch {
    /// One product.
    pub const ONE: Batch = Batch {
        count: 1,
        a: 0,
        b: 0,
        out: 0,
    };
}

/// A backend the Llama model runs on: the model's ops, each enqueued on
/// the compute stream, reading and writing the backend's buffers. Element
/// type `T` is the parameters' (f32 or bf16), also the activations';
/// norms' statistics are f32, the row reductions behind them (and behind
/// the softmax and the cross-entropy) f64.
///
/// Every op checks its lengths and returns an error naming the op and the
/// operand that does not fit, before enqueuing anything.
pub trait LlamaDevice: EngineBackend {
    /// What the ops need besides the buffers (rotary tables; on CUDA the
    /// kernels and the cuBLAS handle), made once per model.
    type Ops: Send;
    /// Token ids on the device.
    type Ids: Send;
    /// Targets on the device (`< 0`: ignored).
    type Targets: Send;
    /// The grouping of a batch's rows by token, for the embedding's
    /// backward.
    type EmbedPlan: Send;
    /// The ops of model `cfg`; `threads`: the CPU's GEMM threads.
    fn llama_ops(&self, cfg: &Config, threads: usize) -> Result<Self::Ops>;

    /// Copies `tokens` to the device (on the compute stream).
    fn upload_ids(&self, ops: &Self::Ops, tokens: &[u32]) -> Result<Self::Ids>;

    /// Copies `targets` to the device (on the compute stream).
    fn upload_targets(&self, ops: &Self::Ops, targets: &[i32]) -> Result<Self::Targets>;

    /// LoRA's inverted dropout of `n` elements: `v = x · (kept ? keep :
    /// 0)` with element `i` kept when bit `i % 32` of word `i / 32` of
    /// `mask` is set; `out = v`, or with `accumulate` `out += v` (the
    /// backward's `dx += dx_in ⊙ mask`). f32 arithmetic, as
    /// [`crate::lora`]'s. The mask's 32-bit words
    /// ([`crate::lora::dropout_bits`]) lie in a buffer of f32 as their bit
    /// patterns (`f32::from_bits`: the backends' buffers hold floats), `n /
    /// 32` rounded up of them from `mask.at`.
    #[allow(clippy::too_many_arguments)]
    fn dropout<T: Element>(
        &self,
        ops: &Self::Ops,
        x: Src<'_, Self, T>,
        mask: Src<'_, Self, f32>,
        keep: f32,
        out: Dst<'_, Self, T>,
        n: usize,
        accumulate: bool,
    ) -> Result<()>;

    /// Groups `tokens` by token (`< vocab`) for
    /// [`embedding_backward`](LlamaDevice::embedding_backward), leaving out
    /// the rows of token `pad` (transformers' `padding_idx`: that row of
    /// the table gets no gradient from its lookups).
    fn embed_plan(
        &self,
        ops: &Self::Ops,
        tokens: &[u32],
        vocab: usize,
        pad: Option<u32>,
    ) -> Result<Self::EmbedPlan>;

    /// Copies the `len` elements of gradient `src` into the buffer the
    /// engine lent for them ([`zero::GradBuffer::lent`]), ordered after the
    /// compute stream's work so far.
    fn write_grad<T: Element>(
        &self,
        ops: &Self::Ops,
        src: &Self::Buffer<T>,
        lent: &mut Self::Lent<T>,
        len: usize,
    ) -> Result<()>;

    /// `out = alpha * op(a) op(b) + beta * out` for each product of
    /// `batch` ([`Mm`]'s shapes and strides; its `threads` is ignored).
    fn gemm<T: Element>(
        &self,
        ops: &Self::Ops,
        out: Dst<'_, Self, T>,
        a: Src<'_, Self, T>,
        b: Src<'_, Self, T>,
        mm: Mm,
        batch: Batch,
    ) -> Result<()>;

    /// `y[r, :] += b` for the `rows` rows of `y` `[rows, n]` (a bias). The
    /// default is a product with a column of ones (`k = 1`, accumulated:
    /// `y + 1·b`, exact).
    fn add_bias<T: Element>(
        &self,
        ops: &Self::Ops,
        y: Dst<'_, Self, T>,
        b: Src<'_, Self, T>,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let ones = ones::<Self, T>(self, rows)?;
        let r = self.gemm(ops, y, src(&ones), b, Mm::new(rows, n, 1).acc(), Batch::ONE);
        self.release_on(Stream::Compute, ones);
        r
    }

    /// `db = Σ_r dy[r, :]`, the column sums of `dy` `[rows, n]` (a bias's
    /// gradient), written. The default is a product with a row of ones
    /// (its summation order is the GEMM's).
    fn bias_grad<T: Element>(
        &self,
        ops: &Self::Ops,
        dy: Src<'_, Self, T>,
        db: Dst<'_, Self, T>,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let ones = ones::<Self, T>(self, rows)?;
        let r = self.gemm(ops, db, src(&ones), dy, Mm::new(1, n, rows), Batch::ONE);
        self.release_on(Stream::Compute, ones);
        r
    }

    /// `out[r, :] = table[ids[r], :]` for the `rows` ids, `dim` wide.
    fn embedding_forward<T: Element>(
        &self,
        ops: &Self::Ops,
        table: Src<'_, Self, T>,
        ids: &Self::Ids,
        out: Dst<'_, Self, T>,
        dim: usize,
    ) -> Result<()>;

    /// `dtable[t, :] += dout[r, :]` for every row `r` of token `t` in the
    /// plan (all but the padding token's), rows in increasing order
    /// (`dtable` `[vocab, dim]`, f32).
    fn embedding_backward<T: Element>(
        &self,
        ops: &Self::Ops,
        dout: Src<'_, Self, T>,
        plan: &Self::EmbedPlan,
        dtable: Dst<'_, Self, f32>,
        dim: usize,
    ) -> Result<()>;

    /// RMSNorm of `rows` rows of `dim`: `y = x * inv * w`, `inv = 1 /
    /// rms(x)` per row.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_forward<T: Element>(
        &self,
        ops: &Self::Ops,
        x: Src<'_, Self, T>,
        w: Src<'_, Self, T>,
        y: Dst<'_, Self, T>,
        inv: Dst<'_, Self, f32>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;

    /// Backward of [`rmsnorm_forward`](LlamaDevice::rmsnorm_forward): `dx`
    /// written (or, with `accumulate`, added to) and `dw += ` (f32).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward<T: Element>(
        &self,
        ops: &Self::Ops,
        dy: Src<'_, Self, T>,
        x: Src<'_, Self, T>,
        w: Src<'_, Self, T>,
        inv: Src<'_, Self, f32>,
        dx: Dst<'_, Self, T>,
        dw: Dst<'_, Self, f32>,
        rows: usize,
        dim: usize,
        accumulate: bool,
    ) -> Result<()>;

    /// Rotary embedding in place on `rows` rows of `heads` heads (row `r`
    /// at position `r % seq`); `inverse`: the backward.
    fn rope<T: Element>(
        &self,
        ops: &Self::Ops,
        x: Dst<'_, Self, T>,
        rows: usize,
        seq: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<()>;

    /// Causal softmax of `mats` `[t, t]` score matrices (row `i` over
    /// columns `0..=i`, the rest 0).
    fn softmax_forward<T: Element>(
        &self,
        ops: &Self::Ops,
        s: Src<'_, Self, T>,
        p: Dst<'_, Self, T>,
        mats: usize,
        t: usize,
    ) -> Result<()>;

    /// Backward of the causal softmax: `ds = p ∘ (dp − rowsum(dp ∘ p)) *
    /// scale` on the causal part, 0 elsewhere.
    #[allow(clippy::too_many_arguments)]
    fn softmax_backward<T: Element>(
        &self,
        ops: &Self::Ops,
        p: Src<'_, Self, T>,
        dp: Src<'_, Self, T>,
        ds: Dst<'_, Self, T>,
        mats: usize,
        t: usize,
        scale: f32,
    ) -> Result<()>;

    /// `a = silu(h1) ∘ h3` over `n` elements.
    fn swiglu_forward<T: Element>(
        &self,
        ops: &Self::Ops,
        h1: Src<'_, Self, T>,
        h3: Src<'_, Self, T>,
        a: Dst<'_, Self, T>,
        n: usize,
    ) -> Result<()>;

    /// Backward of [`swiglu_forward`](LlamaDevice::swiglu_forward).
    #[allow(clippy::too_many_arguments)]
    fn swiglu_backward<T: Element>(
        &self,
        ops: &Self::Ops,
        da: Src<'_, Self, T>,
        h1: Src<'_, Self, T>,
        h3: Src<'_, Self, T>,
        dh1: Dst<'_, Self, T>,
        dh3: Dst<'_, Self, T>,
        n: usize,
    ) -> Result<()>;

    /// Starts (`on`) or stops timing each op on the device, per
    /// [`Phase`] and [`OpKind`] ([`profile`]). The default has no timers
    /// ([`take_profile`](LlamaDevice::take_profile) then gives `None`).
    fn set_profiling(&self, ops: &Self::Ops, on: bool) {
        let _ = (ops, on);
    }

    /// The phase the next ops belong to in the profile.
    fn profile_phase(&self, ops: &Self::Ops, phase: Phase) {
        let _ = (ops, phase);
    }

    /// The device times of the ops timed since profiling started or was
    /// last taken (waits for them); `None` for a backend without timers.
    fn take_profile(&self, ops: &Self::Ops) -> Result<Option<OpProfile>> {
        let _ = ops;
        Ok(None)
    }

    /// Mean cross-entropy over the rows whose target is not ignored:
    /// `loss[0]` (f32) and `dlogits`, the loss's gradient (0 on ignored
    /// rows), for `logits` `[targets, vocab]`.
    fn cross_entropy<T: Element>(
        &self,
        ops: &Self::Ops,
        logits: Src<'_, Self, T>,
        targets: &Self::Targets,
        dlogits: Dst<'_, Self, T>,
        loss: Dst<'_, Self, f32>,
        vocab: usize,
    ) -> Result<()>;
}

/// `n` ones on the compute stream (for [`LlamaDevice`]'s bias defaults).
fn ones<B: Backend, T: Element>(dev: &B, n: usize) -> Result<B::Buffer<T>> {
    let mut ones = dev.alloc_on::<T>(Stream::Compute, n, "ones")?;
    dev.fill(Stream::Compute, &mut ones, 0..n, T::from_f32(1.0))?;
    Ok(ones)
}
