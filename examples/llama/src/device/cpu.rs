//! [`LlamaDevice`] on the CPU backend: every op is a
//! [`CpuBackend::launch`] on the compute stream running [`crate::ops`]
//! (through f32 for bf16 elements), so the hazard checker sees each access
//! the GPU's kernel would make.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use zero::core::backend::{Backend, BufferHandle, CpuBackend, CpuBuffer, In, Out, Running, Stream};
use zero::core::{DType, Element, Error, HostBuffer};
use zero::Result;

use super::profile::{gemm_flops, gemm_kind, OpKind, OpProfile, Phase, Recorder};
use super::{Batch, Dst, LlamaDevice, Src};
use crate::ops::{self, Mm, Rope};
use crate::Config;

/// The CPU backend's [`LlamaDevice::EmbedPlan`]: the tokens and the
/// padding token whose rows [`ops::embedding_backward`] skips.
pub struct CpuEmbedPlan {
    tokens: Arc<[u32]>,
    pad: Option<u32>,
}

/// The CPU backend's [`LlamaDevice::Ops`].
pub struct CpuOps {
    rope: Arc<Rope>,
    threads: usize,
    /// The vocabulary (the LM head's GEMMs in the profile).
    vocab: usize,
    /// The host's clock around each op when profiling: the ops' own time
    /// in [`CpuMode::Inline`](zero::core::backend::CpuMode::Inline), where
    /// a launch runs at once (in the other modes, the enqueueing).
    prof: Recorder<Instant>,
}

fn invalid(op: &'static str, msg: String) -> zero::Error {
    Error::InvalidSize { op, msg }.into()
}

/// The elements `n` of `s` (checked by the backend) as an argument.
fn input<'a, T: Element>(
    dev: &CpuBackend,
    s: Src<'a, CpuBackend, T>,
    n: usize,
) -> Result<In<'a, T>> {
    Ok(dev.input(s.buf, s.at..s.at + n)?)
}

fn output<'a, T: Element>(
    dev: &CpuBackend,
    d: Dst<'a, CpuBackend, T>,
    n: usize,
) -> Result<Out<'a, T>> {
    Ok(dev.output(d.buf, d.at..d.at + n)?)
}

fn f32s<T: Element>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// `v` as f32: borrowed when it is f32 already, widened otherwise.
fn f32_view<T: Element>(v: &[T]) -> Cow<'_, [f32]> {
    if T::DTYPE == DType::F32 {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(f32s(v))
    }
}

fn store<T: Element>(out: &mut [T], v: &[f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o = T::from_f32(*x);
    }
}

/// Elements an operand of `rows` rows of `cols` with row stride `ld`
/// spans.
fn extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

/// The extents of `a`, `b` and the output of one product of `mm`.
fn gemm_extents(mm: &Mm) -> (usize, usize, usize) {
    let a = if mm.ta {
        extent(mm.k, mm.m, mm.lda)
    } else {
        extent(mm.m, mm.k, mm.lda)
    };
    let b = if mm.tb {
        extent(mm.n, mm.k, mm.ldb)
    } else {
        extent(mm.k, mm.n, mm.ldb)
    };
    (a, b, extent(mm.m, mm.n, mm.ldc))
}

/// The span of a batch of operands `one` long, `stride` apart.
fn span(one: usize, stride: usize, count: usize) -> usize {
    if count == 0 || one == 0 {
        0
    } else {
        (count - 1) * stride + one
    }
}

impl LlamaDevice for CpuBackend {
    type Ops = CpuOps;
    type Ids = Arc<[u32]>;
    type Targets = Arc<[i32]>;
    type EmbedPlan = CpuEmbedPlan;

    fn llama_ops(&self, cfg: &Config, threads: usize) -> Result<CpuOps> {
        Ok(CpuOps {
            rope: Arc::new(Rope::new(cfg.head_dim(), cfg.max_seq, cfg.rope_theta)),
            threads: threads.max(1),
            vocab: cfg.vocab,
            prof: Recorder::new(Box::new(|| Ok(Instant::now()))),
        })
    }

    fn set_profiling(&self, ops: &CpuOps, on: bool) {
        ops.prof.set(on);
    }

    fn profile_phase(&self, ops: &CpuOps, phase: Phase) {
        ops.prof.phase(phase);
    }

    fn take_profile(&self, ops: &CpuOps) -> Result<Option<OpProfile>> {
        let p = ops
            .prof
            .take(|a, b| Ok(b.saturating_duration_since(*a).as_secs_f64()))?;
        Ok(Some(p))
    }

    fn upload_ids(&self, _: &CpuOps, tokens: &[u32]) -> Result<Arc<[u32]>> {
        Ok(Arc::from(tokens))
    }

    fn upload_targets(&self, _: &CpuOps, targets: &[i32]) -> Result<Arc<[i32]>> {
        Ok(Arc::from(targets))
    }

    /// [`crate::lora`]'s `x · k` (and `out + x · k`) per element.
    fn dropout<T: Element>(
        &self,
        _: &CpuOps,
        x: Src<'_, Self, T>,
        mask: Src<'_, Self, f32>,
        keep: f32,
        out: Dst<'_, Self, T>,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        let args = (
            input(self, x, n)?,
            input(self, mask, n.div_ceil(32))?,
            output(self, out, n)?,
        );
        self.launch(
            Stream::Compute,
            "llama_dropout",
            args,
            move |run, (x, bits, mut out)| {
                let (x, out) = (x.get(run), out.get(run));
                let bits: &[u32] = bytemuck::cast_slice(bits.get(run));
                for (i, (o, v)) in out.iter_mut().zip(x).enumerate() {
                    let k = if crate::lora::kept(bits, i) {
                        keep
                    } else {
                        0.0
                    };
                    let v = v.to_f32() * k;
                    *o = T::from_f32(if accumulate { o.to_f32() + v } else { v });
                }
                Ok(())
            },
        )?;
        Ok(())
    }

    fn embed_plan(
        &self,
        _: &CpuOps,
        tokens: &[u32],
        vocab: usize,
        pad: Option<u32>,
    ) -> Result<CpuEmbedPlan> {
        if let Some((r, t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(invalid(
                "llama_embedding_backward",
                format!("token {t} at row {r} is outside the vocabulary of {vocab}"),
            ));
        }
        Ok(CpuEmbedPlan {
            tokens: Arc::from(tokens),
            pad,
        })
    }

    fn write_grad<T: Element>(
        &self,
        ops: &CpuOps,
        src: &CpuBuffer<T>,
        lent: &mut HostBuffer<T>,
        len: usize,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::WriteGrad, 0.0);
        // The lent memory is the host's: wait for the compute stream, then
        // copy as host code (the engine orders its reduction after that).
        self.sync(&self.record(Stream::Compute)?)?;
        let g = self.host_slice(src, 0..len)?;
        let have = lent.len();
        let out = lent.get_mut(..len).ok_or_else(|| {
            invalid(
                "llama_write_grad",
                format!("{len} gradient elements for a lent buffer of {have}"),
            )
        })?;
        out.copy_from_slice(g);
        Ok(())
    }

    fn gemm<T: Element>(
        &self,
        ops: &CpuOps,
        out: Dst<'_, Self, T>,
        a: Src<'_, Self, T>,
        b: Src<'_, Self, T>,
        mm: Mm,
        batch: Batch,
    ) -> Result<()> {
        let _t = ops
            .prof
            .timer(gemm_kind(&mm, &batch, ops.vocab), gemm_flops(&mm, &batch));
        const OP: &str = "llama_gemm";
        let (ea, eb, ec) = gemm_extents(&mm);
        if batch.count > 1 && batch.out < ec {
            return Err(invalid(
                OP,
                format!(
                    "outputs of {ec} elements {} apart overlap within the batch",
                    batch.out
                ),
            ));
        }
        let n = batch.count;
        let args = (
            input(self, a, span(ea, batch.a, n))?,
            input(self, b, span(eb, batch.b, n))?,
            output(self, out, span(ec, batch.out, n))?,
        );
        let mm = mm.threads(ops.threads);
        self.launch(
            Stream::Compute,
            OP,
            args,
            move |run: &Running, (a, b, mut c)| {
                let (a, b, c) = (f32_view(a.get(run)), f32_view(b.get(run)), c.get(run));
                for i in 0..n {
                    let a = &a[i * batch.a..][..ea];
                    let b = &b[i * batch.b..][..eb];
                    let c = &mut c[i * batch.out..][..ec];
                    if T::DTYPE == DType::F32 {
                        // In place: the same bits as a copy multiplied and stored back.
                        ops::matmul(bytemuck::cast_slice_mut(c), a, b, mm);
                    } else {
                        let mut acc = f32s(c);
                        ops::matmul(&mut acc, a, b, mm);
                        store(c, &acc);
                    }
                }
                Ok(())
            },
        )?;
        Ok(())
    }

    /// [`ops::add_bias`], the CPU trainer's loop (the same bits).
    fn add_bias<T: Element>(
        &self,
        ops: &CpuOps,
        y: Dst<'_, Self, T>,
        b: Src<'_, Self, T>,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Bias, 0.0);
        let args = (output(self, y, rows * n)?, input(self, b, n)?);
        self.launch(
            Stream::Compute,
            "llama_add_bias",
            args,
            move |run, (mut y, b)| {
                let mut v = f32s(y.get(run));
                ops::add_bias(&mut v, &f32s(b.get(run)));
                store(y.get(run), &v);
                Ok(())
            },
        )?;
        Ok(())
    }

    /// [`ops::bias_backward`] into zeros, rows in order (the CPU
    /// trainer's bits).
    fn bias_grad<T: Element>(
        &self,
        ops: &CpuOps,
        dy: Src<'_, Self, T>,
        db: Dst<'_, Self, T>,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Bias, 0.0);
        let args = (input(self, dy, rows * n)?, output(self, db, n)?);
        self.launch(
            Stream::Compute,
            "llama_bias_grad",
            args,
            move |run, (dy, mut db)| {
                let mut g = vec![0.0; n];
                ops::bias_backward(&f32s(dy.get(run)), &mut g);
                store(db.get(run), &g);
                Ok(())
            },
        )?;
        Ok(())
    }

    fn embedding_forward<T: Element>(
        &self,
        ops: &CpuOps,
        table: Src<'_, Self, T>,
        ids: &Arc<[u32]>,
        out: Dst<'_, Self, T>,
        dim: usize,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Embedding, 0.0);
        const OP: &str = "llama_embedding_forward";
        let rows = ids.len();
        let vocab = (table.buf.len().saturating_sub(table.at)) / dim.max(1);
        if let Some((r, t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(invalid(
                OP,
                format!("token {t} at row {r} is outside the table of {vocab} rows"),
            ));
        }
        let args = (
            input(self, table, vocab * dim)?,
            output(self, out, rows * dim)?,
        );
        let ids = ids.clone();
        self.launch(Stream::Compute, OP, args, move |run, (table, mut out)| {
            let y = ops::embedding_forward(&f32s(table.get(run)), &ids, dim);
            store(out.get(run), &y);
            Ok(())
        })?;
        Ok(())
    }

    fn embedding_backward<T: Element>(
        &self,
        ops: &CpuOps,
        dout: Src<'_, Self, T>,
        plan: &CpuEmbedPlan,
        dtable: Dst<'_, Self, f32>,
        dim: usize,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Embedding, 0.0);
        const OP: &str = "llama_embedding_backward";
        let rows = plan.tokens.len();
        let vocab = (dtable.buf.len().saturating_sub(dtable.at)) / dim.max(1);
        let args = (
            input(self, dout, rows * dim)?,
            output(self, dtable, vocab * dim)?,
        );
        let (tokens, pad) = (plan.tokens.clone(), plan.pad);
        self.launch(Stream::Compute, OP, args, move |run, (dout, mut dt)| {
            ops::embedding_backward(&f32s(dout.get(run)), &tokens, dim, dt.get(run), pad);
            Ok(())
        })?;
        Ok(())
    }

    fn rmsnorm_forward<T: Element>(
        &self,
        ops: &CpuOps,
        x: Src<'_, Self, T>,
        w: Src<'_, Self, T>,
        y: Dst<'_, Self, T>,
        inv: Dst<'_, Self, f32>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Norm, 0.0);
        let args = (
            input(self, x, rows * dim)?,
            input(self, w, dim)?,
            output(self, y, rows * dim)?,
            output(self, inv, rows)?,
        );
        self.launch(
            Stream::Compute,
            "llama_rmsnorm_forward",
            args,
            move |run, (x, w, mut y, mut inv)| {
                let (yv, iv) = ops::rmsnorm_forward(&f32s(x.get(run)), &f32s(w.get(run)), eps);
                store(y.get(run), &yv);
                inv.get(run).copy_from_slice(&iv);
                Ok(())
            },
        )?;
        Ok(())
    }

    fn rmsnorm_backward<T: Element>(
        &self,
        ops: &CpuOps,
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
        let _t = ops.prof.timer(OpKind::Norm, 0.0);
        let args = (
            (input(self, dy, rows * dim)?, input(self, x, rows * dim)?),
            (input(self, w, dim)?, input(self, inv, rows)?),
            output(self, dx, rows * dim)?,
            output(self, dw, dim)?,
        );
        self.launch(
            Stream::Compute,
            "llama_rmsnorm_backward",
            args,
            move |run, ((dy, x), (w, inv), mut dx, mut dw)| {
                let mut d = if accumulate {
                    f32s(dx.get(run))
                } else {
                    vec![0.0; rows * dim]
                };
                ops::rmsnorm_backward(
                    &f32s(dy.get(run)),
                    &f32s(x.get(run)),
                    &f32s(w.get(run)),
                    inv.get(run),
                    &mut d,
                    dw.get(run),
                );
                store(dx.get(run), &d);
                Ok(())
            },
        )?;
        Ok(())
    }

    fn rope<T: Element>(
        &self,
        ops: &CpuOps,
        x: Dst<'_, Self, T>,
        rows: usize,
        seq: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Rope, 0.0);
        const OP: &str = "llama_rope";
        if seq == 0 || seq > ops.rope.max_seq {
            return Err(invalid(
                OP,
                format!("seq {seq} not in 1..={}", ops.rope.max_seq),
            ));
        }
        let args = output(self, x, rows * heads * 2 * ops.rope.half)?;
        let rope = ops.rope.clone();
        self.launch(Stream::Compute, OP, args, move |run, mut x| {
            let mut v = f32s(x.get(run));
            if inverse {
                rope.backward(&mut v, seq, heads);
            } else {
                rope.forward(&mut v, seq, heads);
            }
            store(x.get(run), &v);
            Ok(())
        })?;
        Ok(())
    }

    fn softmax_forward<T: Element>(
        &self,
        ops: &CpuOps,
        s: Src<'_, Self, T>,
        p: Dst<'_, Self, T>,
        mats: usize,
        t: usize,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Softmax, 0.0);
        let n = mats * t * t;
        let args = (input(self, s, n)?, output(self, p, n)?);
        self.launch(
            Stream::Compute,
            "llama_softmax_causal_forward",
            args,
            move |run, (s, mut p)| {
                let mut v = f32s(s.get(run));
                ops::softmax_causal(&mut v, t);
                store(p.get(run), &v);
                Ok(())
            },
        )?;
        Ok(())
    }

    fn softmax_backward<T: Element>(
        &self,
        ops: &CpuOps,
        p: Src<'_, Self, T>,
        dp: Src<'_, Self, T>,
        ds: Dst<'_, Self, T>,
        mats: usize,
        t: usize,
        scale: f32,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Softmax, 0.0);
        let n = mats * t * t;
        let args = (
            input(self, p, n)?,
            input(self, dp, n)?,
            output(self, ds, n)?,
        );
        self.launch(
            Stream::Compute,
            "llama_softmax_causal_backward",
            args,
            move |run, (p, dp, mut ds)| {
                let mut v = f32s(dp.get(run));
                ops::softmax_causal_backward(&f32s(p.get(run)), &mut v, t, scale);
                store(ds.get(run), &v);
                Ok(())
            },
        )?;
        Ok(())
    }

    fn swiglu_forward<T: Element>(
        &self,
        ops: &CpuOps,
        h1: Src<'_, Self, T>,
        h3: Src<'_, Self, T>,
        a: Dst<'_, Self, T>,
        n: usize,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Swiglu, 0.0);
        let args = (
            input(self, h1, n)?,
            input(self, h3, n)?,
            output(self, a, n)?,
        );
        self.launch(
            Stream::Compute,
            "llama_swiglu_forward",
            args,
            move |run, (h1, h3, mut a)| {
                let v = ops::swiglu_act(&f32s(h1.get(run)), &f32s(h3.get(run)));
                store(a.get(run), &v);
                Ok(())
            },
        )?;
        Ok(())
    }

    fn swiglu_backward<T: Element>(
        &self,
        ops: &CpuOps,
        da: Src<'_, Self, T>,
        h1: Src<'_, Self, T>,
        h3: Src<'_, Self, T>,
        dh1: Dst<'_, Self, T>,
        dh3: Dst<'_, Self, T>,
        n: usize,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::Swiglu, 0.0);
        let args = (
            (
                input(self, da, n)?,
                input(self, h1, n)?,
                input(self, h3, n)?,
            ),
            output(self, dh1, n)?,
            output(self, dh3, n)?,
        );
        self.launch(
            Stream::Compute,
            "llama_swiglu_backward",
            args,
            move |run, ((da, h1, h3), mut dh1, mut dh3)| {
                let (mut g1, mut g3) = (vec![0.0; n], vec![0.0; n]);
                ops::swiglu_act_backward(
                    &f32s(da.get(run)),
                    &f32s(h1.get(run)),
                    &f32s(h3.get(run)),
                    &mut g1,
                    &mut g3,
                );
                store(dh1.get(run), &g1);
                store(dh3.get(run), &g3);
                Ok(())
            },
        )?;
        Ok(())
    }

    fn cross_entropy<T: Element>(
        &self,
        ops: &CpuOps,
        logits: Src<'_, Self, T>,
        targets: &Arc<[i32]>,
        dlogits: Dst<'_, Self, T>,
        loss: Dst<'_, Self, f32>,
        vocab: usize,
    ) -> Result<()> {
        let _t = ops.prof.timer(OpKind::CrossEntropy, 0.0);
        const OP: &str = "llama_cross_entropy";
        if let Some((r, t)) = targets
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab && t >= 0)
        {
            return Err(invalid(
                OP,
                format!("target {t} at row {r} is outside the vocabulary of {vocab}"),
            ));
        }
        let n = targets.len() * vocab;
        let args = (
            input(self, logits, n)?,
            output(self, dlogits, n)?,
            output(self, loss, 1)?,
        );
        let targets = targets.clone();
        self.launch(
            Stream::Compute,
            OP,
            args,
            move |run, (logits, mut dl, mut loss)| {
                let (l, g) = ops::cross_entropy(&f32s(logits.get(run)), &targets, vocab);
                store(dl.get(run), &g);
                loss.get(run)[0] = l;
                Ok(())
            },
        )?;
        Ok(())
    }
}
