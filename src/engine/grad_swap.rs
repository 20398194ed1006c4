//! Gradient swap (`zero_optimization.offload_optimizer.swap_gradients`,
//! with the optimizer state on nvme): the rank's accumulated gradient
//! shard lives in its own swap file, one region per unit, instead of
//! host memory, so that host memory does not grow with the model (the
//! fp32 gradient shard of a 4B-parameter model is 16 GB on its own).
//!
//! ```text
//!  bucket reduced ─▶ unpack unit u into a window buffer (A dtype)
//!                      │  (later micro-batches: read u's region first, add)
//!                      ├─▶ norm term of u (sum of squares, kept per unit)
//!                      └─▶ copy into a pool buffer ─▶ write region "grad<u>"
//!  step:  tile by tile, each unit's region is read (one ahead) while its
//!         tiles are updated
//! ```
//!
//! As DeepSpeed's ZeRO-Infinity does, the norm is taken as the gradient
//! goes to the swap file: unit `u`'s term is the sum of squares of its
//! accumulated shard after the last micro-batch, the same function of the
//! same values as without the swap, so the norm, the clipping and the
//! update have the same bits.
//!
//! Every buffer comes from a [`HostPool`] of `buffer_count` buffers of the
//! largest unit's shard, allocated at build. A failed write or read in
//! the backward pass does not leave the collectives (every rank keeps
//! reducing): it is kept and reported by [`GradSwap::check`] before the
//! step, which then fails on every rank with nothing updated.

use std::collections::VecDeque;
use std::ops::Range;

use zero_comm::agree::first_failure;
use zero_comm::Communicator;
use zero_core::config::ResolvedConfig;
use zero_core::memory::{Allocation, Category, MemoryTracker, Tier};
use zero_core::partition::PartitionPlan;
use zero_core::{DType, Element};
use zero_offload::{
    HostPool, HostPoolOptions, IoTicket, PooledBuffer, RegionId, RegionSpec, SwapFile, SwapOptions,
};

use super::faults::{set_faults, FaultPlan};
use super::groups::relative;
use crate::plan::{grad_home_bytes, grad_swap_buffers};
use crate::trace::{Io, RankTracer, SwapTraffic, Tracer};
use crate::{Error, Result};

/// One region per unit with a gradient (`bytes[u] > 0`).
fn regions(bytes: &[usize]) -> Vec<RegionSpec> {
    bytes
        .iter()
        .enumerate()
        .filter(|(_, &b)| b > 0)
        .map(|(u, &b)| RegionSpec::new(format!("grad{u}"), b as u64))
        .collect()
}

/// The length of a gradient swap file with `options` (the optimizer's
/// `nvme_path`, tag `"gradients"`) for gradient homes of `bytes[u]` bytes
/// (0: the unit has no gradient), known before anything is allocated (the
/// disk-space check).
pub(crate) fn swap_file_len(options: &SwapOptions, bytes: &[usize]) -> Result<u64> {
    Ok(SwapFile::planned_len(options, &regions(bytes))?)
}

/// The gradient swap file of one rank.
pub(crate) struct GradSwap {
    rank: usize,
    swap: SwapFile,
    /// Per unit: its region (`None`: no gradient).
    regions: Vec<Option<RegionId>>,
    /// Per unit: the bytes of its gradient home.
    bytes: Vec<usize>,
    dtype: DType,
    pool: HostPool,
    /// Writes in flight, oldest first.
    writes: VecDeque<(usize, IoTicket<PooledBuffer>)>,
    /// Reads issued ahead for the step, oldest first.
    reads: VecDeque<(usize, IoTicket<PooledBuffer>)>,
    /// Per unit: the norm's range of its home.
    norm: Vec<Range<usize>>,
    /// Per unit: the sum of squares of what was last stored.
    sums: Vec<f64>,
    /// The first error of the backward pass (reported by `check`).
    failed: Option<Error>,
    trace: RankTracer,
    _allocs: Vec<Allocation>,
}

impl GradSwap {
    /// Creates the swap file with `options` (one region per unit with a
    /// gradient: [`grad_home_bytes`]) and the pool.
    pub(crate) fn new(
        cfg: &ResolvedConfig,
        plan: &PartitionPlan,
        (rank, mut options): (usize, SwapOptions),
        tracker: &MemoryTracker,
        faults: Option<FaultPlan>,
    ) -> Result<GradSwap> {
        let dtype = cfg.grad_accum_dtype;
        let bytes = grad_home_bytes(cfg, plan);
        // The norm's terms: the rank's real elements of each shard (as
        // `OptimizerShard`'s ranges with a separate accumulation buffer).
        let norm = plan
            .units()
            .iter()
            .map(|l| relative(l.real_range(rank), rank * l.shard_len))
            .collect();
        set_faults(&mut options, faults);
        let specs = regions(&bytes);
        let swap = SwapFile::create(options, &specs)?;
        let mut ids = Vec::with_capacity(bytes.len());
        for (u, &b) in bytes.iter().enumerate() {
            ids.push(if b > 0 {
                Some(swap.region(&format!("grad{u}"))?)
            } else {
                None
            });
        }
        let largest = bytes.iter().copied().max().unwrap_or(0);
        let (count, size) = grad_swap_buffers(cfg, largest);
        let pool = HostPool::new(
            &vec![size; count],
            HostPoolOptions {
                name: format!("rank {rank} gradient swap"),
                pin_memory: cfg.zero.offload_optimizer.pin_memory,
                ..HostPoolOptions::default()
            },
        )?;
        let allocs = vec![
            tracker.allocate(Tier::Nvme, Category::Grads, swap.file_len()),
            tracker.allocate(Tier::Host, Category::CommBuffers, pool.bytes_held()),
        ];
        let n = bytes.len();
        Ok(GradSwap {
            rank,
            swap,
            regions: ids,
            bytes,
            dtype,
            pool,
            writes: VecDeque::new(),
            reads: VecDeque::new(),
            norm,
            sums: vec![0.0; n],
            failed: None,
            trace: RankTracer::default(),
            _allocs: allocs,
        })
    }

    /// Records spans (`grad swap write`, `grad swap read`) of `rank`.
    pub(crate) fn traced(mut self, tracer: Tracer, rank: usize) -> Self {
        self.trace = RankTracer::new(tracer, rank);
        self
    }

    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The swap file's path.
    pub(crate) fn path(&self) -> &std::path::Path {
        self.swap.path()
    }

    /// Warnings of the swap file (the `O_DIRECT` fallback).
    pub(crate) fn warnings(&self) -> Vec<String> {
        self.swap.warnings().to_vec()
    }

    /// Unit `u`'s norm range of its home.
    pub(crate) fn norm_range(&self, u: usize) -> Range<usize> {
        self.norm[u].clone()
    }

    fn region(&self, u: usize) -> Result<RegionId> {
        self.regions[u].ok_or_else(|| Error::Usage {
            rank: self.rank,
            what: format!("internal: unit #{u} has no gradient region"),
        })
    }

    /// A pool buffer of `bytes`, waiting for the oldest write (a failed
    /// write is kept as the first error), or else dropping the oldest read
    /// issued ahead, when none is free.
    fn buffer(&mut self, bytes: usize) -> Result<PooledBuffer> {
        while self.pool.available() == 0 {
            if let Some((_, w)) = self.writes.pop_front() {
                let _span = self.trace.io_wait(Io::Write, "grad swap write");
                if let Err(e) = w.wait() {
                    self.failed.get_or_insert(e.error.into());
                }
            } else if let Some((_, r)) = self.reads.pop_front() {
                let _span = self.trace.io_wait(Io::Read, "grad swap read");
                let _ = r.wait();
            } else {
                break;
            }
        }
        Ok(self.pool.acquire(bytes)?)
    }

    /// Waits for the writes in flight up to the last one of unit `u`.
    fn land_writes_of(&mut self, u: usize) {
        let Some(last) = self.writes.iter().rposition(|(v, _)| *v == u) else {
            return;
        };
        let _span = self.trace.io_wait(Io::Write, "grad swap write");
        for (_, w) in self.writes.drain(..=last) {
            if let Err(e) = w.wait() {
                self.failed.get_or_insert(e.error.into());
            }
        }
    }

    /// A later micro-batch: issues the read of unit `u`'s stored gradient
    /// ahead of [`GradSwap::load`] (when its bucket is reduced), while a
    /// buffer is left for the stores. Loads come in the order of these
    /// calls (the buckets' order).
    pub(crate) fn prefetch(&mut self, u: usize) {
        if self.regions[u].is_none() || self.pool.available() < 2 {
            return;
        }
        self.land_writes_of(u);
        if let Err(e) = self.read_ahead(u) {
            self.failed.get_or_insert(e);
        }
    }

    /// Stores unit `u`'s accumulated gradient `home` (its whole home, in
    /// the home dtype) and its norm term `sum`: copied into a pool buffer
    /// and written behind. An error here is kept for
    /// [`GradSwap::check`]; the backward pass goes on.
    pub(crate) fn store<G: Element>(&mut self, u: usize, home: &[G], sum: f64) {
        self.sums[u] = sum;
        let r = (|| -> Result<()> {
            let id = self.region(u)?;
            let mut buf = self.buffer(self.bytes[u])?;
            buf.as_mut_slice_of::<G>()?[..home.len()].copy_from_slice(home);
            self.trace.io_bytes(Io::Write, self.bytes_of(id));
            self.writes.push_back((u, self.swap.write(id, buf)));
            Ok(())
        })();
        if let Err(e) = r {
            self.failed.get_or_insert(e);
        }
    }

    /// Reads unit `u`'s stored gradient into `out` (a later micro-batch
    /// adds to it): the read issued ahead by [`GradSwap::prefetch`], or
    /// now, after the unit's writes in flight landed. A failed read leaves
    /// `out` as it is and is kept for [`GradSwap::check`].
    pub(crate) fn load<G: Element>(&mut self, u: usize, out: &mut [G]) {
        let r = (|| -> Result<()> {
            let buf = if self.reads.front().is_some_and(|(v, _)| *v == u) {
                self.take(u)?
            } else {
                self.drain_reads();
                self.land_writes_of(u);
                let id = self.region(u)?;
                let buf = self.buffer(self.bytes[u])?;
                let _span = self.trace.io_wait(Io::Read, "grad swap read");
                self.trace.io_bytes(Io::Read, self.bytes_of(id));
                self.swap.read(id, buf).wait().map_err(|e| e.error)?
            };
            out.copy_from_slice(&buf.as_slice_of::<G>()?[..out.len()]);
            Ok(())
        })();
        if let Err(e) = r {
            self.failed.get_or_insert(e);
        }
    }

    /// Waits for every write in flight (a failure is kept).
    fn flush_writes(&mut self) {
        let _span =
            (!self.writes.is_empty()).then(|| self.trace.io_wait(Io::Write, "grad swap write"));
        while let Some((_, w)) = self.writes.pop_front() {
            if let Err(e) = w.wait() {
                self.failed.get_or_insert(e.error.into());
            }
        }
    }

    /// Before the step: every write landed, and the first error of the
    /// backward pass, if any (then the gradients are incomplete and the
    /// step must not run). The error is reported once.
    pub(crate) fn check(&mut self) -> Result<()> {
        self.flush_writes();
        match self.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Before the step: every rank learns whether every rank stored (and,
    /// accumulating, read back) its gradients ([`GradSwap::check`]). On
    /// an error anywhere the step fails on every rank (`rank` is this
    /// one) with nothing updated; `zero_grad` drops the micro-batch and
    /// training can go on.
    pub(crate) fn verdict<C: Communicator>(&mut self, comm: &C, rank: usize) -> Result<()> {
        let r = self.check();
        let failed = first_failure(comm, r.as_ref().err())?;
        r?;
        match failed {
            None => Ok(()),
            Some((bad, why)) => Err(Error::Usage {
                rank,
                what: format!(
                    "the gradient swap file of rank {bad} failed in this micro-batch ({why}); \
                     nothing was updated: call zero_grad() and run the micro-batch again"
                ),
            }),
        }
    }

    /// Drops what the backward pass stored (`zero_grad`, an aborted
    /// micro-batch): the writes in flight land, errors are forgotten (the
    /// next micro-batch rewrites every region it uses).
    pub(crate) fn reset(&mut self) {
        self.flush_writes();
        self.drain_reads();
        self.failed = None;
        self.sums.iter_mut().for_each(|s| *s = 0.0);
    }

    /// This rank's part of the squared norm: the units' terms in unit
    /// order.
    pub(crate) fn sum_squares(&self) -> f64 {
        self.sums.iter().fold(0f64, |a, s| a + s)
    }

    /// The step: issues the read of unit `u`'s gradient ahead (a unit
    /// without a gradient, or no free buffer: nothing is issued).
    pub(crate) fn read_ahead(&mut self, u: usize) -> Result<()> {
        // Without a free buffer the read waits for `take`.
        if self.regions[u].is_none()
            || self.reads.iter().any(|(v, _)| *v == u)
            || self.pool.available() == 0
        {
            return Ok(());
        }
        let id = self.region(u)?;
        let buf = self.pool.acquire(self.bytes[u])?;
        self.trace.io_bytes(Io::Read, self.bytes_of(id));
        self.reads.push_back((u, self.swap.read(id, buf)));
        Ok(())
    }

    /// The step: unit `u`'s gradient (read ahead, or now), as a pool
    /// buffer of the home dtype. Reads issued ahead for units before `u`
    /// are dropped.
    pub(crate) fn take(&mut self, u: usize) -> Result<PooledBuffer> {
        while let Some((v, r)) = self.reads.pop_front() {
            let _span = self.trace.io_wait(Io::Read, "grad swap read");
            let got = r.wait().map_err(|e| Error::from(e.error));
            if v == u {
                return got;
            }
        }
        let id = self.region(u)?;
        let buf = self.pool.acquire(self.bytes[u])?;
        let _span = self.trace.io_wait(Io::Read, "grad swap read");
        self.trace.io_bytes(Io::Read, self.bytes_of(id));
        self.swap.read(id, buf).wait().map_err(|e| e.error.into())
    }

    /// Waits for the reads issued ahead (after an error in the step).
    pub(crate) fn drain_reads(&mut self) {
        while let Some((_, r)) = self.reads.pop_front() {
            let _ = r.wait();
        }
    }

    /// The bytes a request of region `id` moves.
    fn bytes_of(&self, id: RegionId) -> u64 {
        self.swap.region_len(id).unwrap_or(0)
    }

    /// The swap traffic since the engine was built.
    pub(crate) fn traffic(&self) -> SwapTraffic {
        self.trace.traffic()
    }

    /// The home dtype.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }
}

impl Drop for GradSwap {
    /// Requests still in flight hold pool buffers and point into the
    /// file: they land before either goes.
    fn drop(&mut self) {
        self.flush_writes();
        self.drain_reads();
    }
}
