//! [`LlamaDevice`] on the CUDA backend: the GEMMs through cuBLAS (fp32
//! accumulation), the other ops through the NVRTC kernels of
//! [`crate::cuda`], every one enqueued on the backend's compute stream.
//!
//! The backend's buffers reach cuBLAS and the kernels as
//! [`CudaBackend::read_view`]s and [`CudaBackend::raw_view`]s, which carry
//! no event: an op runs after exactly what the compute stream was ordered
//! after (its own earlier work and the engine's waits). Nothing here
//! synchronises with the host. What the ops own (token ids, targets, the
//! embedding plan, the RoPE tables, a scratch for per-row partial sums)
//! are cudarc slices allocated, written, read and freed on the compute
//! stream alone, so the events cudarc keeps for them only order the
//! compute stream after itself.
//!
//! Two things the driver may do on its own: copying the ids and targets
//! from pageable host memory (`cuMemcpyHtoDAsync`) may wait for the
//! compute stream while it stages them (once per micro-batch, before its
//! forward); and dropping the ops waits for the compute stream, before
//! the kernels' modules are unloaded (once per model). LoRA's dropout
//! masks go up through the trainer's pinned slots (the backend's host
//! buffers), not from pageable memory.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::{
    sys as driver_sys, sys::CUdeviceptr, CudaEvent, CudaSlice, CudaStream, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceSlice, DriverError, SyncOnDrop,
};
use zero::core::backend::{
    Backend, BufferHandle, CudaBackend, CudaBuffer, CudaReadView, CudaView, Stream,
};
use zero::core::cuda::cublas::{BlasHandle, CublasError};
use zero::core::{DType, Device, Element, Error};
use zero::Result;

use super::blas::{self, Operand};
use super::profile::{gemm_flops, gemm_kind, OpKind, OpProfile, Phase, Recorder};
use super::{Batch, Dst, LlamaDevice, Src};
use crate::cuda::{
    rmsnorm_scratch_len, EmbeddingGradPlan, GpuEmbeddingPlan, GpuRope, LlamaKernels,
};
use crate::ops::{Mm, Rope};
use crate::Config;

/// Every op runs on this stream.
const COMPUTE: Stream = Stream::Compute;

/// The CUDA backend's [`LlamaDevice::Ops`]: the kernels, the RoPE tables
/// and the cuBLAS handle of one backend (bound to its compute stream).
pub struct CudaOps {
    /// The compute stream of the backend the ops were made for.
    stream: Arc<CudaStream>,
    kernels: LlamaKernels,
    rope: GpuRope,
    head_dim: usize,
    max_seq: usize,
    /// The vocabulary (a GEMM with an operand this wide is the LM head's,
    /// in the profile).
    vocab: usize,
    /// Timing events around each op when profiling ([`super::profile`]).
    prof: Recorder<CudaEvent>,
    /// What an op uses exclusively while it enqueues.
    state: Mutex<State>,
}

struct State {
    blas: BlasHandle,
    /// f32 scratch on the compute stream (RMSNorm's partial sums, the
    /// cross-entropy's per-row losses), grown on demand; the ops that use
    /// it are ordered by the stream.
    scratch: Option<CudaSlice<f32>>,
}

/// Token ids on the device, and on the host for the range checks.
pub struct CudaIds {
    host: Box<[u32]>,
    /// `None` for no rows (the driver has no empty allocation).
    dev: Option<CudaSlice<u32>>,
}

/// A dropout mask's 32-bit words where a buffer of f32 holds them as bit
/// patterns ([`LlamaDevice::dropout`]), as the kernel's `const u32*`
/// (the same size, the same bits).
struct Words<'a>(CudaReadView<'a, f32>);

impl DeviceSlice<u32> for Words<'_> {
    fn len(&self) -> usize {
        DeviceSlice::<f32>::len(&self.0)
    }
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::<f32>::stream(&self.0)
    }
}

impl DevicePtr<u32> for Words<'_> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.0.device_ptr(stream)
    }
}

/// Targets on the device (`< 0`: ignored), and on the host for the range
/// checks and the count of rows not ignored (the loss's divisor).
pub struct CudaTargets {
    host: Box<[i32]>,
    count: usize,
    dev: Option<CudaSlice<i32>>,
}

/// [`GpuEmbeddingPlan`] with its row count.
pub struct CudaEmbedPlan {
    plan: GpuEmbeddingPlan,
    rows: usize,
}

fn invalid(op: &'static str, msg: String) -> zero::Error {
    Error::InvalidSize { op, msg }.into()
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> zero::Error {
    move |e| Error::Cuda(format!("{what}: {e}").into()).into()
}

fn blas_failed(what: &'static str) -> impl FnOnce(CublasError) -> zero::Error {
    move |e| Error::Cuda(format!("cuBLAS {what}: {e}").into()).into()
}

/// `buf` from `at` as an [`Operand`] of the checks.
fn operand<T: Element>(buf: &CudaBuffer<T>, at: usize) -> Operand<'_> {
    Operand {
        len: buf.len(),
        label: buf.label(),
        at,
    }
}

/// The `n` elements of `s` to read, after checking they lie in its buffer
/// (an error of `op` naming operand `what`).
fn read<'a, T: Element>(
    dev: &'a CudaBackend,
    op: &'static str,
    what: &str,
    s: Src<'a, CudaBackend, T>,
    n: usize,
) -> Result<CudaReadView<'a, T>> {
    operand(s.buf, s.at).check(op, what, n)?;
    Ok(dev.read_view(COMPUTE, s.buf, s.at..s.at + n)?)
}

/// The `n` elements of `d` to write, checked as [`read`]'s.
fn write<'a, T: Element>(
    dev: &'a CudaBackend,
    op: &'static str,
    what: &str,
    d: Dst<'a, CudaBackend, T>,
    n: usize,
) -> Result<CudaView<'a, T>> {
    operand(d.buf, d.at).check(op, what, n)?;
    Ok(dev.raw_view(COMPUTE, d.buf, d.at..d.at + n)?)
}

/// cuBLAS's element type of `T`: f32 or bf16.
fn blas_type<T: Element>(op: &'static str) -> Result<cublas_sys::cudaDataType> {
    match T::DTYPE {
        DType::F32 => Ok(cublas_sys::cudaDataType::CUDA_R_32F),
        DType::BF16 => Ok(cublas_sys::cudaDataType::CUDA_R_16BF),
        other => Err(Error::Unsupported(format!(
            "{op}: the Llama model on CUDA takes f32 or bf16 parameters, not {other}"
        ))
        .into()),
    }
}

fn transpose(t: bool) -> cublas_sys::cublasOperation_t {
    if t {
        cublas_sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        cublas_sys::cublasOperation_t::CUBLAS_OP_N
    }
}

impl CudaOps {
    /// Errors unless `dev` is the backend these ops were made for (the
    /// cuBLAS handle enqueues on that backend's compute stream).
    fn check(&self, dev: &CudaBackend, op: &'static str) -> Result<()> {
        if Arc::ptr_eq(&self.stream, dev.cuda_stream(COMPUTE)) {
            Ok(())
        } else {
            Err(Error::Backend {
                op,
                msg: "the Llama ops were made for another CUDA backend (each backend needs \
                      its own, from its llama_ops)"
                    .into(),
            }
            .into())
        }
    }

    fn lock(&self, op: &'static str) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| {
            Error::Backend {
                op,
                msg: "the Llama ops' state was poisoned by a panic during an earlier op".into(),
            }
            .into()
        })
    }
}

impl Drop for CudaOps {
    /// Waits for the compute stream before the kernels' modules are
    /// unloaded and the cuBLAS handle destroyed (which would wait for the
    /// device anyway): a model's work may still be queued. A failure is
    /// stored in the context and reported by the backend's next call.
    fn drop(&mut self) {
        let ctx = self.stream.context();
        ctx.record_err(ctx.bind_to_thread());
        ctx.record_err(self.stream.synchronize());
    }
}

impl State {
    /// `n` elements of the scratch (grown on the compute stream first when
    /// shorter: the old one is freed there after the work using it).
    fn scratch(&mut self, stream: &Arc<CudaStream>, n: usize) -> Result<CudaViewMut<'_, f32>> {
        if self.scratch.as_ref().is_none_or(|s| s.len() < n) {
            let grown = stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(driver("cuMemAllocAsync (Llama ops scratch)"))?;
            self.scratch = Some(grown);
        }
        let s = self.scratch.as_mut().and_then(|s| s.try_slice_mut(0..n));
        s.ok_or_else(|| invalid("llama_scratch", format!("no scratch of {n} elements")))
    }
}

impl LlamaDevice for CudaBackend {
    type Ops = CudaOps;
    type Ids = CudaIds;
    type Targets = CudaTargets;
    type EmbedPlan = CudaEmbedPlan;

    /// The kernels (compiled by NVRTC once per process), the RoPE tables
    /// and a cuBLAS handle on the compute stream; `threads` is the CPU's
    /// and ignored.
    fn llama_ops(&self, cfg: &Config, _threads: usize) -> Result<CudaOps> {
        const OP: &str = "llama_ops";
        let Device::Cuda(device) = self.device() else {
            return Err(Error::Backend {
                op: OP,
                msg: "the CUDA backend reports a non-CUDA device".into(),
            }
            .into());
        };
        let head_dim = cfg.head_dim();
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(invalid(
                OP,
                format!("RoPE needs an even head_dim, not {head_dim}"),
            ));
        }
        let stream = self.cuda_stream(COMPUTE).clone();
        let kernels = LlamaKernels::new(&device)?;
        let host_rope = Rope::new(head_dim, cfg.max_seq, cfg.rope_theta);
        let rope = GpuRope::new(&stream, &host_rope)?;
        device
            .context()
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let blas = BlasHandle::new(&stream)?;
        let on = stream.clone();
        let prof = Recorder::new(Box::new(move || {
            on.record_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(driver("cuEventRecord (op profile)"))
        }));
        Ok(CudaOps {
            stream,
            kernels,
            rope,
            head_dim,
            max_seq: host_rope.max_seq,
            vocab: cfg.vocab,
            prof,
            state: Mutex::new(State {
                blas,
                scratch: None,
            }),
        })
    }

    fn upload_ids(&self, ops: &CudaOps, tokens: &[u32]) -> Result<CudaIds> {
        ops.check(self, "llama_upload_ids")?;
        let dev = if tokens.is_empty() {
            None
        } else {
            Some(
                ops.stream
                    .clone_htod(tokens)
                    .map_err(driver("cuMemcpyHtoDAsync (token ids)"))?,
            )
        };
        Ok(CudaIds {
            host: tokens.into(),
            dev,
        })
    }

    fn dropout<T: Element>(
        &self,
        ops: &CudaOps,
        x: Src<'_, Self, T>,
        mask: Src<'_, Self, f32>,
        keep: f32,
        out: Dst<'_, Self, T>,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "llama_dropout";
        ops.check(self, OP)?;
        let xv = read(self, OP, "x", x, n)?;
        let bits = Words(read(self, OP, "mask", mask, n.div_ceil(32))?);
        let mut ov = write(self, OP, "out", out, n)?;
        if n > 0 {
            ops.kernels
                .dropout(&ops.stream, &xv, &bits, keep, &mut ov, accumulate)?;
        }
        Ok(())
    }

    fn upload_targets(&self, ops: &CudaOps, targets: &[i32]) -> Result<CudaTargets> {
        ops.check(self, "llama_upload_targets")?;
        let dev = if targets.is_empty() {
            None
        } else {
            Some(
                ops.stream
                    .clone_htod(targets)
                    .map_err(driver("cuMemcpyHtoDAsync (targets)"))?,
            )
        };
        Ok(CudaTargets {
            host: targets.into(),
            count: targets.iter().filter(|&&t| t >= 0).count(),
            dev,
        })
    }

    fn embed_plan(
        &self,
        ops: &CudaOps,
        tokens: &[u32],
        vocab: usize,
        pad: Option<u32>,
    ) -> Result<CudaEmbedPlan> {
        ops.check(self, "llama_embedding_backward")?;
        let host = EmbeddingGradPlan::new(tokens, vocab, pad)?;
        Ok(CudaEmbedPlan {
            plan: GpuEmbeddingPlan::new(&ops.stream, &host, vocab)?,
            rows: tokens.len(),
        })
    }

    /// The lent buffer is device memory: a copy on the compute stream.
    fn write_grad<T: Element>(
        &self,
        ops: &CudaOps,
        src: &CudaBuffer<T>,
        lent: &mut CudaBuffer<T>,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "llama_write_grad";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::WriteGrad, 0.0);
        operand(src, 0).check(OP, "gradient", len)?;
        if lent.len() < len {
            return Err(invalid(
                OP,
                format!(
                    "{len} gradient elements for a lent buffer of {}",
                    lent.len()
                ),
            ));
        }
        self.copy_d2d(COMPUTE, src, 0, lent, 0, len)?;
        Ok(())
    }

    /// cuBLAS `GemmEx` (one product) or `GemmStridedBatchedEx` on the
    /// column-major transpose of the row-major product (`blas::plan`),
    /// fp32 accumulation (`CUBLAS_COMPUTE_32F`, no TF32), `alpha` and
    /// `beta` passed as f32 (cudarc's `Gemm<bf16>` would round them to
    /// bf16 first).
    fn gemm<T: Element>(
        &self,
        ops: &CudaOps,
        out: Dst<'_, Self, T>,
        a: Src<'_, Self, T>,
        b: Src<'_, Self, T>,
        mm: Mm,
        batch: Batch,
    ) -> Result<()> {
        const OP: &str = "llama_gemm";
        ops.check(self, OP)?;
        let ty = blas_type::<T>(OP)?;
        let p = blas::plan(
            OP,
            &mm,
            &batch,
            operand(a.buf, a.at),
            operand(b.buf, b.at),
            operand(out.buf, out.at),
        )?;
        let av = read(self, OP, "a", a, p.a_len)?;
        let bv = read(self, OP, "b", b, p.b_len)?;
        let mut cv = write(self, OP, "out", out, p.out_len)?;
        let Some(g) = p.call else {
            return Ok(());
        };
        let _t = ops
            .prof
            .timer(gemm_kind(&mm, &batch, ops.vocab), gemm_flops(&mm, &batch));
        let state = ops.lock(OP)?;
        ops.stream
            .context()
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let s = &*ops.stream;
        // The call's first operand is the trait's `b` (see blas.rs).
        let (pa, _ga) = bv.device_ptr(s);
        let (pb, _gb) = av.device_ptr(s);
        let (pc, _gc) = cv.device_ptr_mut(s);
        let (alpha, beta) = (g.alpha, g.beta);
        let compute = cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        // SAFETY: the handle enqueues on the compute stream (checked
        // above: these ops belong to this backend). plan() checked that
        // every product's operands lie within the views (the spans of
        // `count` operands `stride` apart, each `(rows - 1) * ld + cols`
        // long in the layout cuBLAS reads with these transposition flags
        // and leading dimensions, which are at least the rows' widths),
        // and the views within their live buffers; outputs of a batch do
        // not overlap, and the output's buffer is borrowed exclusively
        // while the inputs are borrowed shared, so it overlaps neither.
        // The element types are T's, alpha and beta host f32 (the
        // default host pointer mode), read before the call returns.
        let done = unsafe {
            if g.count == 1 {
                state.blas.gemm_ex(
                    transpose(g.transa),
                    transpose(g.transb),
                    g.m,
                    g.n,
                    g.k,
                    (&alpha as *const f32).cast(),
                    pa as *const _,
                    ty,
                    g.lda,
                    pb as *const _,
                    ty,
                    g.ldb,
                    (&beta as *const f32).cast(),
                    pc as *mut _,
                    ty,
                    g.ldc,
                    compute,
                    algo,
                )
            } else {
                state.blas.gemm_strided_batched_ex(
                    transpose(g.transa),
                    transpose(g.transb),
                    g.m,
                    g.n,
                    g.k,
                    (&alpha as *const f32).cast(),
                    pa as *const _,
                    ty,
                    g.lda,
                    g.stride_a,
                    pb as *const _,
                    ty,
                    g.ldb,
                    g.stride_b,
                    (&beta as *const f32).cast(),
                    pc as *mut _,
                    ty,
                    g.ldc,
                    g.stride_c,
                    g.count,
                    compute,
                    algo,
                )
            }
        };
        done.map_err(blas_failed(if g.count == 1 {
            "cublasGemmEx (llama_gemm)"
        } else {
            "cublasGemmStridedBatchedEx (llama_gemm)"
        }))
    }

    fn set_profiling(&self, ops: &CudaOps, on: bool) {
        ops.prof.set(on);
    }

    fn profile_phase(&self, ops: &CudaOps, phase: Phase) {
        ops.prof.phase(phase);
    }

    /// Reads the timing events back (waiting for each).
    fn take_profile(&self, ops: &CudaOps) -> Result<Option<OpProfile>> {
        let p = ops.prof.take(|a, b| {
            a.elapsed_ms(b)
                .map(|ms| f64::from(ms) / 1e3)
                .map_err(driver("cuEventElapsedTime (op profile)"))
        })?;
        Ok(Some(p))
    }

    fn embedding_forward<T: Element>(
        &self,
        ops: &CudaOps,
        table: Src<'_, Self, T>,
        ids: &CudaIds,
        out: Dst<'_, Self, T>,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "llama_embedding_forward";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::Embedding, 0.0);
        let rows = ids.host.len();
        let vocab = (table.buf.len().saturating_sub(table.at)) / dim.max(1);
        if let Some((r, t)) = ids
            .host
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(invalid(
                OP,
                format!("token {t} at row {r} is outside the table of {vocab} rows"),
            ));
        }
        let tv = read(self, OP, "table", table, vocab * dim)?;
        let mut ov = write(self, OP, "out", out, rows * dim)?;
        match &ids.dev {
            Some(d) if dim > 0 => {
                ops.kernels
                    .embedding_forward(&ops.stream, &tv, d, &mut ov, dim)?;
            }
            _ => {}
        }
        Ok(())
    }

    fn embedding_backward<T: Element>(
        &self,
        ops: &CudaOps,
        dout: Src<'_, Self, T>,
        plan: &CudaEmbedPlan,
        dtable: Dst<'_, Self, f32>,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "llama_embedding_backward";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::Embedding, 0.0);
        let vocab = (dtable.buf.len().saturating_sub(dtable.at)) / dim.max(1);
        let dv = read(self, OP, "dout", dout, plan.rows * dim)?;
        let mut tv = write(self, OP, "dtable", dtable, vocab * dim)?;
        if plan.rows == 0 || dim == 0 {
            return Ok(());
        }
        // The kernel checks the table holds the plan's vocabulary.
        ops.kernels
            .embedding_backward(&ops.stream, &dv, &plan.plan, &mut tv, dim)?;
        Ok(())
    }

    fn rmsnorm_forward<T: Element>(
        &self,
        ops: &CudaOps,
        x: Src<'_, Self, T>,
        w: Src<'_, Self, T>,
        y: Dst<'_, Self, T>,
        inv: Dst<'_, Self, f32>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "llama_rmsnorm_forward";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::Norm, 0.0);
        let xv = read(self, OP, "x", x, rows * dim)?;
        let wv = read(self, OP, "w", w, dim)?;
        let mut yv = write(self, OP, "y", y, rows * dim)?;
        let mut iv = write(self, OP, "inv", inv, rows)?;
        if rows == 0 {
            return Ok(());
        }
        ops.kernels
            .rmsnorm_forward(&ops.stream, &xv, &wv, &mut yv, &mut iv, eps)?;
        Ok(())
    }

    /// The kernels' semantics are the trait's: `dx` written or, with
    /// `accumulate`, added to; `dw +=` the weight gradient.
    fn rmsnorm_backward<T: Element>(
        &self,
        ops: &CudaOps,
        dy: Src<'_, Self, T>,
        x: Src<'_, Self, T>,
        w: Src<'_, Self, T>,
        inv: Src<'_, Self, f32>,
        dx: Dst<'_, Self, T>,
        dw: Dst<'_, Self, f32>,
        rows: usize,
        dim: usize,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "llama_rmsnorm_backward";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::Norm, 0.0);
        let dyv = read(self, OP, "dy", dy, rows * dim)?;
        let xv = read(self, OP, "x", x, rows * dim)?;
        let wv = read(self, OP, "w", w, dim)?;
        let iv = read(self, OP, "inv", inv, rows)?;
        let mut dxv = write(self, OP, "dx", dx, rows * dim)?;
        let mut dwv = write(self, OP, "dw", dw, dim)?;
        if rows == 0 {
            return Ok(());
        }
        let mut state = ops.lock(OP)?;
        let mut scratch = state.scratch(&ops.stream, rmsnorm_scratch_len(rows, dim))?;
        ops.kernels.rmsnorm_backward(
            &ops.stream,
            &dyv,
            &xv,
            &wv,
            &iv,
            &mut dxv,
            &mut dwv,
            &mut scratch,
            accumulate,
        )?;
        Ok(())
    }

    fn rope<T: Element>(
        &self,
        ops: &CudaOps,
        x: Dst<'_, Self, T>,
        rows: usize,
        seq: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<()> {
        const OP: &str = "llama_rope";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::Rope, 0.0);
        if seq == 0 || seq > ops.max_seq {
            return Err(invalid(OP, format!("seq {seq} not in 1..={}", ops.max_seq)));
        }
        let n = rows * heads * ops.head_dim;
        let mut xv = write(self, OP, "x", x, n)?;
        if n == 0 {
            return Ok(());
        }
        ops.kernels
            .rope(&ops.stream, &ops.rope, &mut xv, seq, heads, inverse)?;
        Ok(())
    }

    fn softmax_forward<T: Element>(
        &self,
        ops: &CudaOps,
        s: Src<'_, Self, T>,
        p: Dst<'_, Self, T>,
        mats: usize,
        t: usize,
    ) -> Result<()> {
        const OP: &str = "llama_softmax_causal_forward";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::Softmax, 0.0);
        let n = mats * t * t;
        let sv = read(self, OP, "s", s, n)?;
        let mut pv = write(self, OP, "p", p, n)?;
        if n == 0 {
            return Ok(());
        }
        ops.kernels
            .softmax_causal_forward(&ops.stream, &sv, &mut pv, t)?;
        Ok(())
    }

    /// The kernel's `ds = p ∘ (dp − rowsum(p ∘ dp)) · scale` (0 above the
    /// diagonal) is the trait's.
    fn softmax_backward<T: Element>(
        &self,
        ops: &CudaOps,
        p: Src<'_, Self, T>,
        dp: Src<'_, Self, T>,
        ds: Dst<'_, Self, T>,
        mats: usize,
        t: usize,
        scale: f32,
    ) -> Result<()> {
        const OP: &str = "llama_softmax_causal_backward";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::Softmax, 0.0);
        let n = mats * t * t;
        let pv = read(self, OP, "p", p, n)?;
        let dpv = read(self, OP, "dp", dp, n)?;
        let mut dsv = write(self, OP, "ds", ds, n)?;
        if n == 0 {
            return Ok(());
        }
        ops.kernels
            .softmax_causal_backward(&ops.stream, &pv, &dpv, &mut dsv, t, scale)?;
        Ok(())
    }

    fn swiglu_forward<T: Element>(
        &self,
        ops: &CudaOps,
        h1: Src<'_, Self, T>,
        h3: Src<'_, Self, T>,
        a: Dst<'_, Self, T>,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "llama_swiglu_forward";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::Swiglu, 0.0);
        let h1v = read(self, OP, "h1", h1, n)?;
        let h3v = read(self, OP, "h3", h3, n)?;
        let mut av = write(self, OP, "a", a, n)?;
        if n == 0 {
            return Ok(());
        }
        ops.kernels
            .swiglu_forward(&ops.stream, &h1v, &h3v, &mut av)?;
        Ok(())
    }

    fn swiglu_backward<T: Element>(
        &self,
        ops: &CudaOps,
        da: Src<'_, Self, T>,
        h1: Src<'_, Self, T>,
        h3: Src<'_, Self, T>,
        dh1: Dst<'_, Self, T>,
        dh3: Dst<'_, Self, T>,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "llama_swiglu_backward";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::Swiglu, 0.0);
        let dav = read(self, OP, "da", da, n)?;
        let h1v = read(self, OP, "h1", h1, n)?;
        let h3v = read(self, OP, "h3", h3, n)?;
        let mut d1 = write(self, OP, "dh1", dh1, n)?;
        let mut d3 = write(self, OP, "dh3", dh3, n)?;
        if n == 0 {
            return Ok(());
        }
        ops.kernels
            .swiglu_backward(&ops.stream, &dav, &h1v, &h3v, &mut d1, &mut d3)?;
        Ok(())
    }

    /// The kernel's mean over `count` rows is the trait's with `count` the
    /// rows not ignored (counted at upload); its per-row losses go to the
    /// scratch. No rows (or no vocabulary, where every target must be
    /// ignored): `loss = 0`, as the CPU's.
    fn cross_entropy<T: Element>(
        &self,
        ops: &CudaOps,
        logits: Src<'_, Self, T>,
        targets: &CudaTargets,
        dlogits: Dst<'_, Self, T>,
        loss: Dst<'_, Self, f32>,
        vocab: usize,
    ) -> Result<()> {
        const OP: &str = "llama_cross_entropy";
        ops.check(self, OP)?;
        let _t = ops.prof.timer(OpKind::CrossEntropy, 0.0);
        if let Some((r, t)) = targets
            .host
            .iter()
            .enumerate()
            .find(|(_, &t)| t >= 0 && t as usize >= vocab)
        {
            return Err(invalid(
                OP,
                format!("target {t} at row {r} is outside the vocabulary of {vocab}"),
            ));
        }
        let rows = targets.host.len();
        let n = rows * vocab;
        let lv = read(self, OP, "logits", logits, n)?;
        let mut dv = write(self, OP, "dlogits", dlogits, n)?;
        operand(loss.buf, loss.at).check(OP, "loss", 1)?;
        let Some(dev_targets) = targets.dev.as_ref().filter(|_| n > 0) else {
            self.fill(COMPUTE, loss.buf, loss.at..loss.at + 1, 0.0)?;
            return Ok(());
        };
        let mut loss_v = write(self, OP, "loss", loss, 1)?;
        let mut state = ops.lock(OP)?;
        let mut row_losses = state.scratch(&ops.stream, rows)?;
        ops.kernels.cross_entropy(
            &ops.stream,
            &lv,
            dev_targets,
            targets.count,
            &mut dv,
            &mut row_losses,
            &mut loss_v,
        )?;
        Ok(())
    }
}
