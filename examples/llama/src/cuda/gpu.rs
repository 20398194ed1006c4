//! Loading and launching the Llama kernels (feature `cuda`).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DriverError, LaunchArgs, LaunchConfig, PushKernelArg,
};

use zero::core::cuda::kernels::{load_module, target_arch};
use zero::core::{CudaDevice, DType, Element, Error, Result};

use super::{EmbeddingGradPlan, COL_CHUNK, EW_BLOCK, LANES, LLAMA_SOURCES, ROW_WARPS};

fn driver_err(e: DriverError) -> Error {
    Error::Cuda(Box::new(e))
}

fn size_err(op: &'static str, msg: String) -> Error {
    Error::InvalidSize { op, msg }
}

/// The dtype suffix of an entry point: f32 or bf16 activations.
fn suffix<E: Element>(op: &'static str) -> Result<&'static str> {
    match E::DTYPE {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Err(Error::Unsupported(format!(
            "{op}: the Llama kernels take f32 or bf16 activations, not f16"
        ))),
    }
}

/// The loaded Llama kernels of one device: `LlamaKernels::new(&dev)`,
/// then e.g. `k.rmsnorm_forward(&stream, &x, &w, &mut y, &mut inv, 1e-5)`
/// with `CudaSlice`s or views of the stream's device.
#[derive(Debug)]
pub struct LlamaKernels {
    ctx: Arc<CudaContext>,
    arch: String,
    _modules: Vec<Arc<CudaModule>>,
    functions: HashMap<&'static str, CudaFunction>,
    max_blocks: u32,
}

/// A grid-stride launch of `n` work items in blocks of `block` threads.
fn grid(n: usize, block: u32, max_blocks: u32) -> LaunchConfig {
    let blocks = n.div_ceil(block as usize).clamp(1, max_blocks as usize) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Row kernels: one warp per row, [`ROW_WARPS`] rows per block.
fn rows_grid(rows: usize, max_blocks: u32) -> LaunchConfig {
    grid(rows, ROW_WARPS, max_blocks).with_block(ROW_WARPS * LANES)
}

trait WithBlock {
    fn with_block(self, threads: u32) -> Self;
}

impl WithBlock for LaunchConfig {
    fn with_block(mut self, threads: u32) -> Self {
        self.block_dim = (threads, 1, 1);
        self
    }
}

/// Lengths a launcher checks: `(what, got, wanted)`.
fn check_lens(op: &'static str, lens: &[(&str, usize, usize)]) -> Result<()> {
    for &(what, got, want) in lens {
        if got != want {
            return Err(size_err(
                op,
                format!("{what} has {got} elements, expected {want}"),
            ));
        }
    }
    Ok(())
}

impl LlamaKernels {
    /// Compiles (once per process) and loads every Llama kernel for
    /// `device`, as device code for its architecture, or as PTX for a GPU
    /// newer than NVRTC (zero-core's `target_arch`). Errors: [`Error::Cuda`] when NVRTC is missing or fails, or
    /// when loading fails.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let ctx = device.context().clone();
        let arch = target_arch(&ctx)?;
        let mut modules = Vec::new();
        let mut functions = HashMap::new();
        for src in LLAMA_SOURCES {
            let module = load_module(&ctx, src, &arch)?;
            for &name in src.entry_points {
                functions.insert(name, module.load_function(name).map_err(driver_err)?);
            }
            modules.push(module);
        }
        Ok(LlamaKernels {
            ctx,
            arch,
            _modules: modules,
            functions,
            max_blocks: 1 << 16,
        })
    }

    /// The architecture the kernels were compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// A launch builder for `base_suffix` on `stream`, after checking that
    /// the stream belongs to this device.
    fn builder<'a>(&'a self, stream: &'a CudaStream, name: &str) -> Result<LaunchArgs<'a>> {
        if **stream.context() != *self.ctx {
            return Err(Error::Unsupported(format!(
                "a stream of CUDA device {} used with the kernels of device {}",
                stream.context().ordinal(),
                self.ctx.ordinal()
            )));
        }
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| Error::Unsupported(format!("no Llama kernel `{name}`")))?;
        Ok(stream.launch_builder(f))
    }

    fn entry<E: Element>(op: &'static str, base: &str) -> Result<String> {
        Ok(format!("{base}_{}", suffix::<E>(op)?))
    }

    /// `out[r, :] = table[tokens[r], :]`; a token `>= vocab` gives a row of
    /// NaN (the GPU cannot report it; [`EmbeddingGradPlan::new`] rejects it
    /// on the host).
    pub fn embedding_forward<E: Element>(
        &self,
        stream: &CudaStream,
        table: &impl DevicePtr<E>,
        tokens: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<E>,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "llama_embedding_forward";
        let rows = tokens.len();
        if dim == 0 || !table.len().is_multiple_of(dim) {
            return Err(size_err(
                OP,
                format!("table of {} not [vocab, {dim}]", table.len()),
            ));
        }
        check_lens(OP, &[("out", out.len(), rows * dim)])?;
        let name = Self::entry::<E>(OP, "llama_embedding_fwd")?;
        let (rows64, dim64, vocab64) = (rows as u64, dim as u64, (table.len() / dim) as u64);
        let mut b = self.builder(stream, &name)?;
        let (p_table, _g1) = table.device_ptr(stream);
        let (p_tokens, _g2) = tokens.device_ptr(stream);
        let (p_out, _g3) = out.device_ptr_mut(stream);
        b.arg(&p_table)
            .arg(&p_tokens)
            .arg(&p_out)
            .arg(&rows64)
            .arg(&dim64)
            .arg(&vocab64);
        // SAFETY: llama_embedding_fwd_E(const E*, const u32*, E*, u64 rows,
        // u64 dim, u64 vocab): the kernel is chosen by E; table holds
        // vocab * dim, tokens rows, out rows * dim elements (checked);
        // the guards live past the launch.
        unsafe { b.launch(grid(rows * dim, EW_BLOCK, self.max_blocks)) }.map_err(driver_err)?;
        Ok(())
    }

    /// `dtable += ` the rows of `dout` `[rows, dim]` per token, in the
    /// CPU's order, with `plan` uploaded by [`GpuEmbeddingPlan::new`].
    pub fn embedding_backward<E: Element>(
        &self,
        stream: &CudaStream,
        dout: &impl DevicePtr<E>,
        plan: &GpuEmbeddingPlan,
        dtable: &mut impl DevicePtrMut<f32>,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "llama_embedding_backward";
        check_lens(OP, &[("dout", dout.len(), plan.rows * dim)])?;
        if dim == 0 || !dtable.len().is_multiple_of(dim) || dtable.len() / dim < plan.vocab {
            return Err(size_err(
                OP,
                format!("dtable of {} not [{}, {dim}]", dtable.len(), plan.vocab),
            ));
        }
        if plan.segments == 0 {
            return Ok(());
        }
        let name = Self::entry::<E>(OP, "llama_embedding_bwd")?;
        let (nseg, dim64) = (plan.segments as u64, dim as u64);
        let mut b = self.builder(stream, &name)?;
        let (p_dout, _g1) = dout.device_ptr(stream);
        let (p_order, _g2) = plan.order.device_ptr(stream);
        let (p_start, _g3) = plan.seg_start.device_ptr(stream);
        let (p_token, _g4) = plan.seg_token.device_ptr(stream);
        let (p_dtable, _g5) = dtable.device_ptr_mut(stream);
        b.arg(&p_dout)
            .arg(&p_order)
            .arg(&p_start)
            .arg(&p_token)
            .arg(&p_dtable)
            .arg(&nseg)
            .arg(&dim64);
        // SAFETY: llama_embedding_bwd_E(const E* dout, const u32* order,
        // const u32* seg_start, const u32* seg_token, f32* dtable, u64 nseg,
        // u64 dim): the plan's arrays hold rows, nseg + 1 and nseg entries
        // with rows < plan.rows and tokens < plan.vocab (EmbeddingGradPlan
        // checks them); dout holds rows * dim, dtable at least vocab * dim
        // (checked); the guards live past the launch.
        unsafe { b.launch(grid(plan.segments * dim, EW_BLOCK, self.max_blocks)) }
            .map_err(driver_err)?;
        Ok(())
    }

    /// RMSNorm of the rows of `x` `[rows, d]` (`d = w.len()`): `y`, and the
    /// inverse RMS per row in `inv` (the backward's cache).
    pub fn rmsnorm_forward<E: Element>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<E>,
        w: &impl DevicePtr<E>,
        y: &mut impl DevicePtrMut<E>,
        inv: &mut impl DevicePtrMut<f32>,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "llama_rmsnorm_forward";
        let d = w.len();
        if d == 0 || !x.len().is_multiple_of(d) {
            return Err(size_err(OP, format!("x of {} not [rows, {d}]", x.len())));
        }
        let rows = x.len() / d;
        check_lens(OP, &[("y", y.len(), x.len()), ("inv", inv.len(), rows)])?;
        let name = Self::entry::<E>(OP, "llama_rmsnorm_fwd")?;
        let (rows64, d64) = (rows as u64, d as u64);
        let mut b = self.builder(stream, &name)?;
        let (p_x, _g1) = x.device_ptr(stream);
        let (p_w, _g2) = w.device_ptr(stream);
        let (p_y, _g3) = y.device_ptr_mut(stream);
        let (p_inv, _g4) = inv.device_ptr_mut(stream);
        b.arg(&p_x)
            .arg(&p_w)
            .arg(&p_y)
            .arg(&p_inv)
            .arg(&rows64)
            .arg(&d64)
            .arg(&eps);
        // SAFETY: llama_rmsnorm_fwd_E(const E* x, const E* w, E* y, f32*
        // inv, u64 rows, u64 d, f32 eps): lengths checked above; the guards
        // live past the launch.
        unsafe { b.launch(rows_grid(rows, self.max_blocks)) }.map_err(driver_err)?;
        Ok(())
    }

    /// Backward of [`LlamaKernels::rmsnorm_forward`]: `dx` (added to when
    /// `accumulate`, else written) and `dw += ` the weight gradient (f32).
    /// `scratch` holds at least [`super::rmsnorm_scratch_len`] f32.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward<E: Element>(
        &self,
        stream: &CudaStream,
        dy: &impl DevicePtr<E>,
        x: &impl DevicePtr<E>,
        w: &impl DevicePtr<E>,
        inv: &impl DevicePtr<f32>,
        dx: &mut impl DevicePtrMut<E>,
        dw: &mut impl DevicePtrMut<f32>,
        scratch: &mut impl DevicePtrMut<f32>,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "llama_rmsnorm_backward";
        let d = w.len();
        if d == 0 || !x.len().is_multiple_of(d) {
            return Err(size_err(OP, format!("x of {} not [rows, {d}]", x.len())));
        }
        let rows = x.len() / d;
        check_lens(
            OP,
            &[
                ("dy", dy.len(), x.len()),
                ("dx", dx.len(), x.len()),
                ("inv", inv.len(), rows),
                ("dw", dw.len(), d),
            ],
        )?;
        let nchunks = rows.div_ceil(COL_CHUNK);
        if scratch.len() < nchunks * d {
            return Err(size_err(
                OP,
                format!("scratch of {} < {}", scratch.len(), nchunks * d),
            ));
        }
        if rows == 0 {
            return Ok(());
        }
        let sfx = suffix::<E>(OP)?;
        let (rows64, d64, nchunks64) = (rows as u64, d as u64, nchunks as u64);
        let acc = i32::from(accumulate);
        let (p_dy, _g1) = dy.device_ptr(stream);
        let (p_x, _g2) = x.device_ptr(stream);
        let (p_w, _g3) = w.device_ptr(stream);
        let (p_inv, _g4) = inv.device_ptr(stream);
        let (p_dx, _g5) = dx.device_ptr_mut(stream);
        let (p_dw, _g6) = dw.device_ptr_mut(stream);
        let (p_s, _g7) = scratch.device_ptr_mut(stream);
        let mut b = self.builder(stream, &format!("llama_rmsnorm_bwd_{sfx}"))?;
        b.arg(&p_dy)
            .arg(&p_x)
            .arg(&p_w)
            .arg(&p_inv)
            .arg(&p_dx)
            .arg(&rows64)
            .arg(&d64)
            .arg(&acc);
        // SAFETY: llama_rmsnorm_bwd_E(const E* dy, const E* x, const E* w,
        // const f32* inv, E* dx, u64 rows, u64 d, int accumulate): lengths
        // checked above; the guards live past the launches.
        unsafe { b.launch(rows_grid(rows, self.max_blocks)) }.map_err(driver_err)?;
        let mut b = self.builder(stream, &format!("llama_rmsnorm_dw_partial_{sfx}"))?;
        b.arg(&p_dy)
            .arg(&p_x)
            .arg(&p_inv)
            .arg(&p_s)
            .arg(&rows64)
            .arg(&d64);
        // SAFETY: llama_rmsnorm_dw_partial_E(const E* dy, const E* x, const
        // f32* inv, f32* partial, u64 rows, u64 d): partial holds nchunks *
        // d f32 (checked).
        unsafe { b.launch(grid(nchunks * d, EW_BLOCK, self.max_blocks)) }.map_err(driver_err)?;
        let mut b = self.builder(stream, "llama_colsum_finish")?;
        b.arg(&p_s).arg(&nchunks64).arg(&d64).arg(&p_dw);
        // SAFETY: llama_colsum_finish(const f32* partial, u64 nchunks, u64
        // d, f32* out): partial written by the launch before on the same
        // stream, out holds d f32 (checked).
        unsafe { b.launch(grid(d, EW_BLOCK, self.max_blocks)) }.map_err(driver_err)?;
        Ok(())
    }

    /// Causal softmax of `mats` matrices `[t, t]` of (already scaled)
    /// scores `s` into `p`; row `i` keeps columns `0 ..= i`, the rest are 0.
    pub fn softmax_causal_forward<E: Element>(
        &self,
        stream: &CudaStream,
        s: &impl DevicePtr<E>,
        p: &mut impl DevicePtrMut<E>,
        t: usize,
    ) -> Result<()> {
        const OP: &str = "llama_softmax_causal_forward";
        if t == 0 || !s.len().is_multiple_of(t * t) {
            return Err(size_err(
                OP,
                format!("s of {} not [mats, {t}, {t}]", s.len()),
            ));
        }
        check_lens(OP, &[("p", p.len(), s.len())])?;
        let mats = s.len() / (t * t);
        let name = Self::entry::<E>(OP, "llama_softmax_causal_fwd")?;
        let (mats64, t64) = (mats as u64, t as u64);
        let mut b = self.builder(stream, &name)?;
        let (p_s, _g1) = s.device_ptr(stream);
        let (p_p, _g2) = p.device_ptr_mut(stream);
        b.arg(&p_s).arg(&p_p).arg(&mats64).arg(&t64);
        // SAFETY: llama_softmax_causal_fwd_E(const E* s, E* p, u64 mats,
        // u64 t): both hold mats * t * t elements (checked).
        unsafe { b.launch(rows_grid(mats * t, self.max_blocks)) }.map_err(driver_err)?;
        Ok(())
    }

    /// Backward of the causal softmax: `ds = p * (dp - rowsum(p * dp)) *
    /// scale`, 0 above the diagonal.
    pub fn softmax_causal_backward<E: Element>(
        &self,
        stream: &CudaStream,
        p: &impl DevicePtr<E>,
        dp: &impl DevicePtr<E>,
        ds: &mut impl DevicePtrMut<E>,
        t: usize,
        scale: f32,
    ) -> Result<()> {
        const OP: &str = "llama_softmax_causal_backward";
        if t == 0 || !p.len().is_multiple_of(t * t) {
            return Err(size_err(
                OP,
                format!("p of {} not [mats, {t}, {t}]", p.len()),
            ));
        }
        check_lens(OP, &[("dp", dp.len(), p.len()), ("ds", ds.len(), p.len())])?;
        let mats = p.len() / (t * t);
        let name = Self::entry::<E>(OP, "llama_softmax_causal_bwd")?;
        let (mats64, t64) = (mats as u64, t as u64);
        let mut b = self.builder(stream, &name)?;
        let (p_p, _g1) = p.device_ptr(stream);
        let (p_dp, _g2) = dp.device_ptr(stream);
        let (p_ds, _g3) = ds.device_ptr_mut(stream);
        b.arg(&p_p)
            .arg(&p_dp)
            .arg(&p_ds)
            .arg(&mats64)
            .arg(&t64)
            .arg(&scale);
        // SAFETY: llama_softmax_causal_bwd_E(const E* p, const E* dp, E* ds,
        // u64 mats, u64 t, f32 scale): all hold mats * t * t (checked).
        unsafe { b.launch(rows_grid(mats * t, self.max_blocks)) }.map_err(driver_err)?;
        Ok(())
    }

    /// Cross-entropy of `logits` `[rows, vocab]` against `targets` (`< 0`:
    /// ignored): `dlogits` (the gradient of the mean loss), the per-row
    /// losses and `loss[0]` = their mean over the `count` rows not
    /// ignored (the caller knows `count` from the host batch). A target
    /// `>= vocab` gives NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy<E: Element>(
        &self,
        stream: &CudaStream,
        logits: &impl DevicePtr<E>,
        targets: &impl DevicePtr<i32>,
        count: usize,
        dlogits: &mut impl DevicePtrMut<E>,
        row_losses: &mut impl DevicePtrMut<f32>,
        loss: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "llama_cross_entropy";
        let rows = targets.len();
        if rows == 0 || !logits.len().is_multiple_of(rows) || logits.len() == 0 {
            return Err(size_err(
                OP,
                format!("logits of {} for {rows} targets", logits.len()),
            ));
        }
        let vocab = logits.len() / rows;
        check_lens(
            OP,
            &[
                ("dlogits", dlogits.len(), logits.len()),
                ("row_losses", row_losses.len(), rows),
                ("loss", loss.len(), 1),
            ],
        )?;
        if count > rows {
            return Err(size_err(OP, format!("count {count} > {rows} rows")));
        }
        let name = Self::entry::<E>(OP, "llama_cross_entropy")?;
        let inv = if count == 0 { 0.0 } else { 1.0 / count as f32 };
        let (rows64, vocab64, count64) = (rows as u64, vocab as u64, count as u64);
        let (p_x, _g1) = logits.device_ptr(stream);
        let (p_t, _g2) = targets.device_ptr(stream);
        let (p_dx, _g3) = dlogits.device_ptr_mut(stream);
        let (p_l, _g4) = row_losses.device_ptr_mut(stream);
        let (p_loss, _g5) = loss.device_ptr_mut(stream);
        let mut b = self.builder(stream, &name)?;
        b.arg(&p_x)
            .arg(&p_t)
            .arg(&p_dx)
            .arg(&p_l)
            .arg(&rows64)
            .arg(&vocab64)
            .arg(&inv);
        // SAFETY: llama_cross_entropy_E(const E* logits, const i32* targets,
        // E* dlogits, f32* losses, u64 rows, u64 vocab, f32 inv): lengths
        // checked above; the guards live past the launches.
        unsafe { b.launch(rows_grid(rows, self.max_blocks)) }.map_err(driver_err)?;
        let mut b = self.builder(stream, "llama_loss_mean")?;
        b.arg(&p_l).arg(&rows64).arg(&count64).arg(&p_loss);
        let one_warp = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (LANES, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: llama_loss_mean(const f32* losses, u64 rows, u64 count,
        // f32* out): losses written by the launch before on this stream,
        // out holds 1 f32 (checked); one warp, as the kernel requires.
        unsafe { b.launch(one_warp) }.map_err(driver_err)?;
        Ok(())
    }

    /// `a = silu(h1) * h3`, elementwise.
    pub fn swiglu_forward<E: Element>(
        &self,
        stream: &CudaStream,
        h1: &impl DevicePtr<E>,
        h3: &impl DevicePtr<E>,
        a: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "llama_swiglu_forward";
        let n = h1.len();
        check_lens(OP, &[("h3", h3.len(), n), ("a", a.len(), n)])?;
        let name = Self::entry::<E>(OP, "llama_swiglu_fwd")?;
        let n64 = n as u64;
        let mut b = self.builder(stream, &name)?;
        let (p1, _g1) = h1.device_ptr(stream);
        let (p3, _g2) = h3.device_ptr(stream);
        let (pa, _g3) = a.device_ptr_mut(stream);
        b.arg(&p1).arg(&p3).arg(&pa).arg(&n64);
        // SAFETY: llama_swiglu_fwd_E(const E*, const E*, E*, u64 n): all
        // hold n (checked).
        unsafe { b.launch(grid(n, EW_BLOCK, self.max_blocks)) }.map_err(driver_err)?;
        Ok(())
    }

    /// LoRA's inverted dropout: `out = x · k` (with `accumulate`, `out +=
    /// x · k`), `k = keep` where bit `i % 32` of `bits[i / 32]` is set,
    /// else 0, elementwise.
    pub fn dropout<E: Element>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<E>,
        bits: &impl DevicePtr<u32>,
        keep: f32,
        out: &mut impl DevicePtrMut<E>,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "llama_dropout";
        let n = x.len();
        check_lens(OP, &[("out", out.len(), n)])?;
        if bits.len() < n.div_ceil(32) {
            return Err(size_err(
                OP,
                format!("a mask of {} words for {n} elements", bits.len()),
            ));
        }
        let name = Self::entry::<E>(OP, "llama_dropout")?;
        let (n64, acc) = (n as u64, i32::from(accumulate));
        let mut b = self.builder(stream, &name)?;
        let (px, _g1) = x.device_ptr(stream);
        let (pb, _g2) = bits.device_ptr(stream);
        let (po, _g3) = out.device_ptr_mut(stream);
        b.arg(&px).arg(&pb).arg(&keep).arg(&po).arg(&n64).arg(&acc);
        // SAFETY: llama_dropout_E(const E* x, const u32* bits, f32 keep, E*
        // out, u64 n, int acc): x and out hold n elements, bits at least
        // n / 32 rounded up words (checked).
        unsafe { b.launch(grid(n, EW_BLOCK, self.max_blocks)) }.map_err(driver_err)?;
        Ok(())
    }

    /// Backward of [`LlamaKernels::swiglu_forward`]: `dh1`, `dh3` from `da`.
    pub fn swiglu_backward<E: Element>(
        &self,
        stream: &CudaStream,
        da: &impl DevicePtr<E>,
        h1: &impl DevicePtr<E>,
        h3: &impl DevicePtr<E>,
        dh1: &mut impl DevicePtrMut<E>,
        dh3: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "llama_swiglu_backward";
        let n = da.len();
        check_lens(
            OP,
            &[
                ("h1", h1.len(), n),
                ("h3", h3.len(), n),
                ("dh1", dh1.len(), n),
                ("dh3", dh3.len(), n),
            ],
        )?;
        let name = Self::entry::<E>(OP, "llama_swiglu_bwd")?;
        let n64 = n as u64;
        let mut b = self.builder(stream, &name)?;
        let (pda, _g1) = da.device_ptr(stream);
        let (p1, _g2) = h1.device_ptr(stream);
        let (p3, _g3) = h3.device_ptr(stream);
        let (pd1, _g4) = dh1.device_ptr_mut(stream);
        let (pd3, _g5) = dh3.device_ptr_mut(stream);
        b.arg(&pda).arg(&p1).arg(&p3).arg(&pd1).arg(&pd3).arg(&n64);
        // SAFETY: llama_swiglu_bwd_E(const E* da, const E* h1, const E* h3,
        // E* dh1, E* dh3, u64 n): all hold n (checked).
        unsafe { b.launch(grid(n, EW_BLOCK, self.max_blocks)) }.map_err(driver_err)?;
        Ok(())
    }

    /// RoPE in place on `x` `[rows, heads * head_dim]` (`inverse`: the
    /// backward), the position of row `r` being `r % seq`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope<E: Element>(
        &self,
        stream: &CudaStream,
        tables: &GpuRope,
        x: &mut impl DevicePtrMut<E>,
        seq: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<()> {
        const OP: &str = "llama_rope";
        let width = heads * 2 * tables.half;
        if seq == 0 || seq > tables.max_seq || width == 0 || !x.len().is_multiple_of(width) {
            return Err(size_err(
                OP,
                format!(
                    "x of {} not [rows, {heads} * {}] or seq {seq} not in 1..={}",
                    x.len(),
                    2 * tables.half,
                    tables.max_seq
                ),
            ));
        }
        let rows = x.len() / width;
        let name = Self::entry::<E>(OP, "llama_rope")?;
        let (rows64, seq64, heads64, half64) =
            (rows as u64, seq as u64, heads as u64, tables.half as u64);
        let inv = i32::from(inverse);
        let mut b = self.builder(stream, &name)?;
        let (px, _g1) = x.device_ptr_mut(stream);
        let (pc, _g2) = tables.cos.device_ptr(stream);
        let (ps, _g3) = tables.sin.device_ptr(stream);
        b.arg(&px)
            .arg(&pc)
            .arg(&ps)
            .arg(&rows64)
            .arg(&seq64)
            .arg(&heads64)
            .arg(&half64)
            .arg(&inv);
        // SAFETY: llama_rope_E(E* x, const f32* cos, const f32* sin, u64
        // rows, u64 seq, u64 heads, u64 half, int inverse): x holds rows *
        // heads * 2 * half, the tables max_seq * half >= seq * half
        // (checked).
        unsafe { b.launch(grid(rows * heads * tables.half, EW_BLOCK, self.max_blocks)) }
            .map_err(driver_err)?;
        Ok(())
    }
}

/// An [`EmbeddingGradPlan`] on the device.
#[derive(Debug)]
pub struct GpuEmbeddingPlan {
    order: CudaSlice<u32>,
    seg_start: CudaSlice<u32>,
    seg_token: CudaSlice<u32>,
    rows: usize,
    vocab: usize,
    segments: usize,
}

impl GpuEmbeddingPlan {
    /// Uploads `plan` (built for a vocabulary of `vocab`) on `stream`.
    pub fn new(stream: &Arc<CudaStream>, plan: &EmbeddingGradPlan, vocab: usize) -> Result<Self> {
        let up = |v: &[u32]| {
            // Never an empty allocation: a zero-length slice has no pointer.
            let v = if v.is_empty() { &[0u32][..] } else { v };
            stream.clone_htod(v).map_err(driver_err)
        };
        let rows = plan.rows;
        let segs = plan.seg_token.len();
        let starts_ok = plan.order.len() <= rows
            && plan.seg_start.len() == segs + 1
            && plan.seg_start.first() == Some(&0)
            && plan.seg_start.last() == Some(&(plan.order.len() as u32))
            && plan.seg_start.windows(2).all(|w| w[0] <= w[1]);
        if !starts_ok
            || plan.order.iter().any(|&r| r as usize >= rows)
            || plan.seg_token.iter().any(|&t| t as usize >= vocab)
        {
            return Err(size_err(
                "llama_embedding_backward",
                format!("malformed plan for {rows} rows and a vocabulary of {vocab}"),
            ));
        }
        Ok(GpuEmbeddingPlan {
            order: up(&plan.order)?,
            seg_start: up(&plan.seg_start)?,
            seg_token: up(&plan.seg_token)?,
            rows,
            vocab,
            segments: plan.segments(),
        })
    }
}

/// The RoPE tables of [`super::super::ops::Rope`] on the device.
#[derive(Debug)]
pub struct GpuRope {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    half: usize,
    max_seq: usize,
}

impl GpuRope {
    /// Uploads `rope`'s tables on `stream`.
    pub fn new(stream: &Arc<CudaStream>, rope: &super::super::ops::Rope) -> Result<Self> {
        Ok(GpuRope {
            cos: stream.clone_htod(&rope.cos).map_err(driver_err)?,
            sin: stream.clone_htod(&rope.sin).map_err(driver_err)?,
            half: rope.half,
            max_seq: rope.max_seq,
        })
    }
}
