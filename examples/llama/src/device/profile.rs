//! Where a device step's time goes: the device time of the trainer's ops
//! per phase (forward, the head, backward) and kind (linear, attention and
//! LM-head GEMMs, softmax, norms, ...), and the compute stream's time
//! between them (what is not a model op: fresh buffers' zeroing, copies,
//! casts, waits for the engine's collectives, and idle time while the
//! host enqueues or blocks).
//!
//! Off unless [`DeviceModel::set_profiling`](super::DeviceModel::set_profiling)
//! turned it on: then each op is bracketed by two timing events on the
//! compute stream (CUDA), which the report reads back
//! ([`DeviceModel::take_profile`](super::DeviceModel::take_profile)). Off,
//! an op pays one relaxed atomic load. Backends without timers (the CPU)
//! report nothing.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Mutex;

use zero::{Error, Result};

use super::Batch;
use crate::ops::Mm;

/// The part of a micro-batch an op belongs to, as the trainer marks it
/// ([`LlamaDevice::profile_phase`](super::LlamaDevice::profile_phase)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// The embedding and the blocks' forward.
    Forward,
    /// The final norm, the LM head, the loss and their backward.
    Head,
    /// The blocks' backward (with their recomputed forward under
    /// activation checkpointing) and the embedding's.
    Backward,
}

impl Phase {
    /// The phase's name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Head => "head",
            Phase::Backward => "backward",
        }
    }

    pub(crate) fn from_index(i: u8) -> Phase {
        match i {
            0 => Phase::Forward,
            1 => Phase::Head,
            _ => Phase::Backward,
        }
    }

    pub(crate) fn index(self) -> u8 {
        self as u8
    }
}

/// What an op is, for the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKind {
    /// A product with a weight of a block (`x Wᵀ`, `dyᵀ x`, `dy W`).
    GemmLinear,
    /// A batched product of attention (`Q Kᵀ`, `P V` and their backward),
    /// over `[seq, seq]` score matrices.
    GemmAttention,
    /// A product with the LM head (a vocabulary-wide operand).
    GemmHead,
    /// The causal softmax (forward or backward) over the score matrices.
    Softmax,
    /// RMSNorm, forward or backward.
    Norm,
    /// Rotary embedding, forward or backward.
    Rope,
    /// SwiGLU, forward or backward.
    Swiglu,
    /// The embedding's lookup or its gradient.
    Embedding,
    /// The cross-entropy and its gradient.
    CrossEntropy,
    /// A gradient copied into the buffer the engine lent.
    WriteGrad,
    /// A bias added or its gradient.
    Bias,
}

impl OpKind {
    /// The kind's name in the report.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::GemmLinear => "gemm linear",
            OpKind::GemmAttention => "gemm attention",
            OpKind::GemmHead => "gemm lm_head",
            OpKind::Softmax => "softmax",
            OpKind::Norm => "rmsnorm",
            OpKind::Rope => "rope",
            OpKind::Swiglu => "swiglu",
            OpKind::Embedding => "embedding",
            OpKind::CrossEntropy => "cross-entropy",
            OpKind::WriteGrad => "grad copy",
            OpKind::Bias => "bias",
        }
    }
}

/// One row of a profile: the ops of one kind in one phase.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    /// The phase.
    pub phase: Phase,
    /// The kind, or `None` for the compute stream's time between ops.
    pub kind: Option<OpKind>,
    /// Device seconds.
    pub seconds: f64,
    /// Ops (or gaps) counted.
    pub count: usize,
    /// Floating-point operations of the GEMMs counted (2 per
    /// multiply-add; 0 for other kinds).
    pub flops: f64,
}

/// The device time of a trainer's ops since profiling started or was last
/// read: one [`OpTime`] per phase and kind, and per phase the time between
/// ops (`kind: None`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpProfile {
    /// The rows, by phase then kind (gaps last in each phase).
    pub rows: Vec<OpTime>,
    /// Device seconds from the first op's start to the last op's end (per
    /// micro-batch, summed).
    pub span_s: f64,
}

impl OpProfile {
    /// Seconds in ops (all rows but the gaps).
    pub fn op_seconds(&self) -> f64 {
        self.rows
            .iter()
            .filter(|r| r.kind.is_some())
            .map(|r| r.seconds)
            .sum()
    }

    /// Adds `other`'s rows and span to this one.
    pub fn merge(&mut self, other: &OpProfile) {
        let mut by: BTreeMap<(Phase, Option<OpKind>), OpTime> = self
            .rows
            .drain(..)
            .map(|r| ((r.phase, r.kind), r))
            .collect();
        for r in &other.rows {
            let e = by.entry((r.phase, r.kind)).or_insert(OpTime {
                phase: r.phase,
                kind: r.kind,
                seconds: 0.0,
                count: 0,
                flops: 0.0,
            });
            e.seconds += r.seconds;
            e.count += r.count;
            e.flops += r.flops;
        }
        self.rows = order(by);
        self.span_s += other.span_s;
    }
}

/// Rows by phase, the ops' kinds first (in [`OpKind`] order), the gaps
/// last.
fn order(by: BTreeMap<(Phase, Option<OpKind>), OpTime>) -> Vec<OpTime> {
    let mut rows: Vec<OpTime> = by.into_values().collect();
    rows.sort_by_key(|r| (r.phase, r.kind.is_none(), r.kind));
    rows
}

/// The spans of one micro-batch as recorded, `(phase, kind, start, end,
/// flops)` in seconds from any origin, in enqueue order: the profile
/// (gaps between consecutive spans go to the phase of the later one).
pub(crate) fn summarise(spans: &[(Phase, OpKind, f64, f64, f64)]) -> OpProfile {
    let mut by: BTreeMap<(Phase, Option<OpKind>), OpTime> = BTreeMap::new();
    let mut add = |phase: Phase, kind: Option<OpKind>, s: f64, flops: f64| {
        let e = by.entry((phase, kind)).or_insert(OpTime {
            phase,
            kind,
            seconds: 0.0,
            count: 0,
            flops: 0.0,
        });
        e.seconds += s;
        e.count += 1;
        e.flops += flops;
    };
    let mut last_end: Option<f64> = None;
    for &(phase, kind, start, end, flops) in spans {
        if let Some(prev) = last_end {
            add(phase, None, (start - prev).max(0.0), 0.0);
        }
        add(phase, Some(kind), (end - start).max(0.0), flops);
        last_end = Some(end);
    }
    let span_s = match (spans.first(), spans.last()) {
        (Some(f), Some(l)) => (l.3 - f.2).max(0.0),
        _ => 0.0,
    };
    OpProfile {
        rows: order(by),
        span_s,
    }
}

/// A product's kind in the profile: batched products, and those reading a
/// head's columns out of wider rows, are attention's (the trainer batches
/// or strides nothing else), one with a vocabulary-wide dimension is the
/// LM head's, the rest are the blocks' linear layers.
pub(crate) fn gemm_kind(mm: &Mm, batch: &Batch, vocab: usize) -> OpKind {
    let strided = mm.lda != if mm.ta { mm.m } else { mm.k }
        || mm.ldb != if mm.tb { mm.k } else { mm.n }
        || mm.ldc != mm.n;
    if batch.count > 1 || strided {
        OpKind::GemmAttention
    } else if [mm.m, mm.n, mm.k].contains(&vocab) {
        OpKind::GemmHead
    } else {
        OpKind::GemmLinear
    }
}

/// 2 per multiply-add of every product of the batch.
pub(crate) fn gemm_flops(mm: &Mm, batch: &Batch) -> f64 {
    2.0 * mm.m as f64 * mm.n as f64 * mm.k as f64 * batch.count as f64
}

/// A stamp of the device's clock: on CUDA a timing event recorded on the
/// compute stream, on the CPU an [`std::time::Instant`].
pub(crate) type StampFn<S> = Box<dyn Fn() -> Result<S> + Send + Sync>;

/// One recorded op: `(phase, kind, start, end, flops)`.
type Span<S> = (Phase, OpKind, S, S, f64);

/// The timings of one backend's ops, kept by its [`LlamaDevice::Ops`](super::LlamaDevice::Ops):
/// off, [`timer`](Recorder::timer) costs one relaxed load.
pub(crate) struct Recorder<S> {
    on: AtomicBool,
    phase: AtomicU8,
    stamp: StampFn<S>,
    /// `(phase, kind, start, end, flops)` in enqueue order, and the first
    /// error a stamp met (reported by [`take`](Recorder::take)).
    spans: Mutex<(Vec<Span<S>>, Option<String>)>,
}

/// Times one op from its creation to its drop (see [`Recorder::timer`]).
pub(crate) struct Timer<'a, S> {
    rec: &'a Recorder<S>,
    start: Option<(Phase, OpKind, f64, S)>,
}

impl<S> Recorder<S> {
    pub(crate) fn new(stamp: StampFn<S>) -> Self {
        Recorder {
            on: AtomicBool::new(false),
            phase: AtomicU8::new(Phase::Forward.index()),
            stamp,
            spans: Mutex::new((Vec::new(), None)),
        }
    }

    /// Starts or stops recording (what was recorded stays until taken).
    pub(crate) fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// The phase the next ops belong to.
    pub(crate) fn phase(&self, phase: Phase) {
        self.phase.store(phase.index(), Ordering::Relaxed);
    }

    /// A timer of an op of `kind` (`flops` for a GEMM) that stamps now and
    /// when dropped; nothing when recording is off.
    pub(crate) fn timer(&self, kind: OpKind, flops: f64) -> Timer<'_, S> {
        let mut t = Timer {
            rec: self,
            start: None,
        };
        if self.on.load(Ordering::Relaxed) {
            let phase = Phase::from_index(self.phase.load(Ordering::Relaxed));
            match (self.stamp)() {
                Ok(s) => t.start = Some((phase, kind, flops, s)),
                Err(e) => self.failed(e),
            }
        }
        t
    }

    fn failed(&self, e: zero::Error) {
        if let Ok(mut g) = self.spans.lock() {
            g.1.get_or_insert_with(|| e.to_string());
        }
    }

    /// The profile of what was recorded since the last call, cleared;
    /// `elapsed(a, b)`: seconds from stamp `a` to stamp `b` (may wait for
    /// the device). Errors: a stamp that failed, naming it.
    pub(crate) fn take(&self, elapsed: impl Fn(&S, &S) -> Result<f64>) -> Result<OpProfile> {
        let (spans, failed) = {
            let mut g = self.spans.lock().map_err(|_| Error::Unsupported {
                what: "the op profile was poisoned by a panic".into(),
            })?;
            (std::mem::take(&mut g.0), g.1.take())
        };
        if let Some(f) = failed {
            return Err(Error::Unsupported {
                what: format!("profiling the Llama ops: a timing stamp failed: {f}"),
            });
        }
        let Some(origin) = spans.first().map(|s| &s.2) else {
            return Ok(OpProfile::default());
        };
        let mut secs = Vec::with_capacity(spans.len());
        for (phase, kind, s, e, flops) in &spans {
            secs.push((
                *phase,
                *kind,
                elapsed(origin, s)?,
                elapsed(origin, e)?,
                *flops,
            ));
        }
        Ok(summarise(&secs))
    }
}

impl<S> Drop for Timer<'_, S> {
    fn drop(&mut self) {
        if let Some((phase, kind, flops, start)) = self.start.take() {
            match (self.rec.stamp)() {
                Ok(end) => {
                    if let Ok(mut g) = self.rec.spans.lock() {
                        g.0.push((phase, kind, start, end, flops));
                    }
                }
                Err(e) => self.rec.failed(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_go_to_the_later_ops_phase_and_the_span_covers_all() {
        let spans = [
            (Phase::Forward, OpKind::GemmLinear, 0.0, 1.0, 10.0),
            (Phase::Forward, OpKind::Norm, 1.5, 2.0, 0.0),
            (Phase::Backward, OpKind::GemmLinear, 3.0, 5.0, 20.0),
        ];
        let p = summarise(&spans);
        assert_eq!(p.span_s, 5.0);
        assert_eq!(p.op_seconds(), 3.5);
        let row = |ph: Phase, k: Option<OpKind>| {
            p.rows
                .iter()
                .find(|r| r.phase == ph && r.kind == k)
                .cloned()
                .unwrap_or_else(|| panic!("no row {ph:?} {k:?} in {:?}", p.rows))
        };
        assert_eq!(row(Phase::Forward, None).seconds, 0.5);
        assert_eq!(row(Phase::Backward, None).seconds, 1.0);
        assert_eq!(row(Phase::Backward, Some(OpKind::GemmLinear)).flops, 20.0);
        // Gaps last within a phase.
        assert_eq!(p.rows.last().map(|r| r.kind), Some(None));
        let mut twice = p.clone();
        twice.merge(&p);
        assert_eq!(twice.span_s, 10.0);
        assert_eq!(row(Phase::Forward, Some(OpKind::GemmLinear)).count, 1);
        let f = twice
            .rows
            .iter()
            .find(|r| r.phase == Phase::Forward && r.kind == Some(OpKind::GemmLinear))
            .map(|r| (r.count, r.seconds));
        assert_eq!(f, Some((2, 2.0)));
    }
}
