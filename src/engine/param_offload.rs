//! Stage-3 parameter offload (`zero_optimization.offload_param.device`
//! `"cpu"` or `"nvme"`, ZeRO-Infinity): the rank's shard of every unit, in
//! the parameter dtype, lives in host memory or in the rank's parameter
//! swap file instead of the device tier.
//!
//! # Layout
//!
//! ```text
//!  cpu:   one HostPool buffer per unit shard, resident (pin_memory honoured)
//!  nvme:  one swap-file region per unit shard ("unit<i>"), and buffer_count
//!         HostPool staging buffers of buffer_size elements (at most the
//!         largest unit shard: a larger buffer_size allocates no more) for
//!         reads and write-backs
//! ```
//!
//! # Fetch
//!
//! A gather copies the rank's shard from its home into its slot of the
//! gathered (device-tier) unit buffer and all-gathers it. With `cpu` the
//! copy runs when the gather is launched, i.e. at prefetch time along the
//! recorded order. With `nvme` the swap read is issued further ahead than
//! the gather prefetch (the units of the prefetch window plus
//! [`NVME_EXTRA_AHEAD`](crate::schedule::NVME_EXTRA_AHEAD) more), into
//! one of the staging buffers; the launch waits for it. One staging buffer is always left for on-demand reads, so
//! at most `buffer_count - 1` reads run ahead.
//!
//! # Write-back
//!
//! After the optimizer step the updated shard goes back to its home: with
//! `cpu` AdamW writes it straight into the host buffer (or it is copied
//! from the optimizer offload's staging buffer); with `nvme` each unit's
//! shard is written through a staging buffer, up to `buffer_count` writes
//! in flight. Persistent units (`stage3_param_persistence_threshold`)
//! keep their home here too; their gathered copy stays on the device tier
//! (as `GatheredParams`) and is refreshed from the home after each step.
//!
//! # Host cache (`max_in_cpu`)
//!
//! With `cpu` every shard is in host memory, so a `max_in_cpu` smaller
//! than the rank's total shard is a config error. With `nvme`,
//! `max_in_cpu` (elements, DeepSpeed's default 1e9) bounds a host cache of
//! unit shards, kept next to the staging buffers:
//!
//! ```text
//!  cache: one HostPool buffer per unit shard that fits, in unit order,
//!         while the shards' elements add up to at most max_in_cpu;
//!         filled with those shards at build; accounted as
//!         (Tier::Host, Category::Params)
//! ```
//!
//! - A gather of a cached shard copies it from the cache: no swap read
//!   (counted in `EngineStats::param_cache_hits`; swap reads in
//!   `EngineStats::param_swap_reads`), and no read is issued ahead for it.
//! - A shard read from the swap file is then cached: into a free cache
//!   buffer that fits, or else into the buffer of the least recently used
//!   cached shard whose buffer fits (LRU); if none fits it is not cached.
//!   No allocation: the buffers are made at build.
//! - Write-back is write-through: a cached shard is updated in the cache
//!   and written to the swap file in the same step, so the file is never
//!   stale (a later fault or eviction loses nothing).
//! - With `max_in_cpu` at least the rank's total shard every shard is
//!   cached at build and the swap file is only written, never read, in
//!   the steps. With `max_in_cpu = 0` there is no cache.
//! - Corruption of the swap file is caught by the checksums when a shard
//!   is read from it: a cached shard is not read, and its next write-back
//!   rewrites its blocks.

use std::collections::VecDeque;

use zero_comm::Communicator;
use zero_core::config::{OffloadDevice, ResolvedConfig};
use zero_core::memory::{Allocation, Category, MemoryTracker, Tier};
use zero_core::{DType, Element};
use zero_offload::{
    AlignedBuf, HostPool, HostPoolOptions, IoTicket, PooledBuffer, RegionId, RegionSpec, SwapFile,
    SwapOptions,
};

use super::faults::{set_faults, FaultPlan};
use super::health::Health;
use crate::trace::{Io, RankTracer, SwapTraffic, Tracer};
use crate::{Error, Result};

enum Home {
    Host(Vec<PooledBuffer>),
    Nvme {
        swap: SwapFile,
        regions: Vec<RegionId>,
    },
}

/// Where [`ParamOffload::load_into`] found a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fetch {
    /// cpu: the host buffer.
    Host,
    /// nvme: the host cache (no swap read).
    Cached,
    /// nvme: the swap file.
    Read,
}

/// The offloaded parameter shards of one rank.
pub(crate) struct ParamOffload {
    /// Bytes of each unit's shard.
    bytes: Vec<usize>,
    pool: HostPool,
    home: Home,
    /// nvme: reads issued ahead of the gather, per unit.
    reads: Vec<Option<IoTicket<PooledBuffer>>>,
    /// nvme: reads in flight ahead.
    pending: usize,
    /// nvme: most reads ahead (`buffer_count - 1`).
    max_ahead: usize,
    /// nvme: write-backs in flight.
    writes: VecDeque<IoTicket<PooledBuffer>>,
    /// nvme: the host cache (`max_in_cpu`); `None` when it holds nothing.
    cache_pool: Option<HostPool>,
    /// nvme: each unit's cached shard.
    cache: Vec<Option<PooledBuffer>>,
    /// nvme: when each cached shard was last used (LRU).
    last_use: Vec<u64>,
    tick: u64,
    /// The first read error of this rank (reported at the next step).
    pub(crate) failed: Option<Error>,
    /// Spans of the fetches, write-backs and swap traffic (disabled
    /// unless [`ParamOffload::traced`]).
    trace: RankTracer,
    _allocs: Vec<Allocation>,
}

/// The options of rank `rank`'s parameter swap file.
fn swap_options(cfg: &ResolvedConfig, rank: usize) -> SwapOptions {
    let dir = cfg.zero.offload_param.nvme_path.clone().unwrap_or_default();
    let mut options = SwapOptions::from_aio(dir, rank, &cfg.zero.aio);
    options.tag = "params".into();
    options
}

/// The swap file's regions: one per unit shard of `bytes[i]` bytes.
fn unit_regions(bytes: &[usize]) -> Vec<RegionSpec> {
    bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| RegionSpec::new(format!("unit{i}"), b.max(1) as u64))
        .collect()
}

/// With `offload_param` nvme: the length of rank `rank`'s swap file for
/// shards of `bytes[i]` bytes, known before anything is allocated.
pub(crate) fn swap_file_len(cfg: &ResolvedConfig, rank: usize, bytes: &[usize]) -> Result<u64> {
    Ok(SwapFile::planned_len(
        &swap_options(cfg, rank),
        &unit_regions(bytes),
    )?)
}

impl ParamOffload {
    /// Builds the homes and stores the initial shards, one at a time:
    /// `init(i, out)` writes unit `i`'s shard (padding included, as bytes
    /// of `pdt`) into `out`, of `bytes[i]` bytes; so the whole model is
    /// never in memory.
    pub(crate) fn new(
        cfg: &ResolvedConfig,
        rank: usize,
        pdt: DType,
        bytes: Vec<usize>,
        init: &dyn Fn(usize, &mut [u8]) -> Result<()>,
        tracker: &MemoryTracker,
        faults: Option<FaultPlan>,
    ) -> Result<ParamOffload> {
        let op = &cfg.zero.offload_param;
        let size = pdt.size_in_bytes();
        let total: u64 = bytes.iter().map(|&b| b as u64).sum();
        let nvme = op.device == OffloadDevice::Nvme;
        let buffer_count = op.buffer_count.max(1);
        let sizes: Vec<usize> = if nvme {
            // buffer_size (checked to hold the largest shard) is an upper
            // bound: no buffer is made larger than the largest shard.
            let largest = bytes.iter().copied().max().unwrap_or(0);
            vec![op.buffer_size.saturating_mul(size).min(largest).max(1); buffer_count]
        } else {
            bytes.iter().map(|&b| b.max(1)).collect()
        };
        let pool = HostPool::new(
            &sizes,
            HostPoolOptions {
                name: format!("rank {rank} parameter offload"),
                pin_memory: op.pin_memory,
                ..HostPoolOptions::default()
            },
        )?;
        let mut allocs = Vec::new();
        // nvme: the cache buffers, one per unit shard (in unit order) while
        // the shards' elements fit in max_in_cpu.
        let mut cache: Vec<Option<PooledBuffer>> = (0..bytes.len()).map(|_| None).collect();
        let mut cache_pool = None;
        if nvme {
            let mut room = op.max_in_cpu.saturating_mul(size);
            let mut cached = Vec::new();
            for (i, &b) in bytes.iter().enumerate() {
                if b <= room {
                    room -= b;
                    cached.push(i);
                }
            }
            if !cached.is_empty() {
                let sizes: Vec<usize> = cached.iter().map(|&i| bytes[i].max(1)).collect();
                let cp = HostPool::new(
                    &sizes,
                    HostPoolOptions {
                        name: format!("rank {rank} parameter cache (offload_param.max_in_cpu)"),
                        pin_memory: op.pin_memory,
                        ..HostPoolOptions::default()
                    },
                )?;
                // Largest first, so that each takes the buffer sized for it.
                cached.sort_by_key(|&i| std::cmp::Reverse(bytes[i]));
                for i in cached {
                    let mut buf = cp.acquire(bytes[i].max(1))?;
                    buf.fill(0);
                    init(i, &mut buf[..bytes[i]])?;
                    cache[i] = Some(buf);
                }
                allocs.push(cp.account(tracker, Category::Params));
                cache_pool = Some(cp);
            }
        }
        let home = if nvme {
            let mut options = swap_options(cfg, rank);
            set_faults(&mut options, faults);
            let specs = unit_regions(&bytes);
            let swap = SwapFile::create(options, &specs)?;
            let mut regions = Vec::with_capacity(bytes.len());
            for (i, spec) in specs.iter().enumerate() {
                let id = swap.region(&spec.name)?;
                let mut buf = pool.acquire(bytes[i].max(1))?;
                buf.fill(0);
                init(i, &mut buf[..bytes[i]])?;
                drop(swap.write(id, buf).wait().map_err(|e| e.error)?);
                regions.push(id);
            }
            swap.verify()?;
            allocs.push(tracker.allocate(Tier::Nvme, Category::Params, total));
            allocs.push(tracker.allocate(
                Tier::Nvme,
                Category::CommBuffers,
                swap.file_len().saturating_sub(total),
            ));
            allocs.push(tracker.allocate(Tier::Host, Category::CommBuffers, pool.bytes_held()));
            Home::Nvme { swap, regions }
        } else {
            // Largest first, so that each takes the buffer sized for it.
            let mut order: Vec<usize> = (0..bytes.len()).collect();
            order.sort_by_key(|&i| std::cmp::Reverse(bytes[i]));
            let mut bufs: Vec<Option<PooledBuffer>> = (0..bytes.len()).map(|_| None).collect();
            for i in order {
                let mut buf = pool.acquire(bytes[i].max(1))?;
                buf.fill(0);
                init(i, &mut buf[..bytes[i]])?;
                bufs[i] = Some(buf);
            }
            allocs.push(tracker.allocate(Tier::Host, Category::Params, total));
            allocs.push(tracker.allocate(
                Tier::Host,
                Category::CommBuffers,
                pool.bytes_held().saturating_sub(total),
            ));
            Home::Host(bufs.into_iter().flatten().collect())
        };
        Ok(ParamOffload {
            reads: (0..bytes.len()).map(|_| None).collect(),
            bytes,
            pool,
            home,
            pending: 0,
            max_ahead: buffer_count - 1,
            writes: VecDeque::new(),
            last_use: vec![0; cache.len()],
            cache,
            cache_pool,
            tick: 0,
            failed: None,
            trace: RankTracer::default(),
            _allocs: allocs,
        })
    }

    /// Records spans (`param fetch`, `param write back`, `swap read`,
    /// `swap write`) of `rank` into `tracer`.
    pub(crate) fn traced(mut self, tracer: Tracer, rank: usize) -> Self {
        self.trace = RankTracer::new(tracer, rank);
        self
    }

    /// The swap traffic since the engine was built.
    pub(crate) fn traffic(&self) -> SwapTraffic {
        self.trace.traffic()
    }

    /// Whether the shards are in a swap file.
    pub(crate) fn is_nvme(&self) -> bool {
        matches!(self.home, Home::Nvme { .. })
    }

    /// The parameter swap file, if any.
    pub(crate) fn swap_path(&self) -> Option<&std::path::Path> {
        match &self.home {
            Home::Nvme { swap, .. } => Some(swap.path()),
            Home::Host(_) => None,
        }
    }

    /// Warnings of the swap file (the `O_DIRECT` fallback).
    pub(crate) fn warnings(&self) -> Vec<String> {
        match &self.home {
            Home::Nvme { swap, .. } => swap.warnings().to_vec(),
            Home::Host(_) => Vec::new(),
        }
    }

    /// nvme: issues the read of unit `i`'s shard ahead of its gather, if a
    /// staging buffer is free for it. Returns false when none is (the
    /// caller stops reading ahead).
    pub(crate) fn read_ahead(&mut self, i: usize) -> bool {
        let Home::Nvme { swap, regions } = &self.home else {
            return true;
        };
        if self.reads[i].is_some() || self.cache[i].is_some() {
            return true;
        }
        if self.pending >= self.max_ahead {
            return false;
        }
        match self.pool.acquire(self.bytes[i].max(1)) {
            Ok(buf) => {
                self.trace
                    .io_bytes(Io::Read, swap.region_len(regions[i]).unwrap_or(0));
                self.reads[i] = Some(swap.read(regions[i], buf));
                self.pending += 1;
                true
            }
            Err(_) => false,
        }
    }

    /// Whether unit `i`'s shard read was issued ahead (nvme).
    pub(crate) fn has_read(&self, i: usize) -> bool {
        self.reads[i].is_some()
    }

    /// Copies unit `i`'s shard into `dst` (the bytes of the rank's slot of
    /// the gathered unit): from the host, the cache, or the swap read (issued
    /// ahead or now, then cached). On a read error the slot is zeroed and
    /// the error kept in [`ParamOffload::failed`]: the step reports it on
    /// every rank (so that no rank leaves a collective the others are in).
    pub(crate) fn load_into(&mut self, i: usize, dst: &mut [u8]) -> Fetch {
        let _span = self.trace.span("param fetch", "offload");
        let n = self.bytes[i];
        self.tick += 1;
        let (r, how) = match &self.home {
            Home::Host(bufs) => {
                dst.copy_from_slice(&bufs[i][..n]);
                (Ok(()), Fetch::Host)
            }
            Home::Nvme { .. } if self.cache[i].is_some() => {
                self.last_use[i] = self.tick;
                if let Some(c) = &self.cache[i] {
                    dst.copy_from_slice(&c[..n]);
                }
                (Ok(()), Fetch::Cached)
            }
            Home::Nvme { swap, regions } => {
                let ticket = match self.reads[i].take() {
                    Some(t) => {
                        self.pending -= 1;
                        Ok(t)
                    }
                    None => self.pool.acquire(n.max(1)).map(|buf| {
                        self.trace
                            .io_bytes(Io::Read, swap.region_len(regions[i]).unwrap_or(0));
                        swap.read(regions[i], buf)
                    }),
                };
                let span = self.trace.io_wait(Io::Read, "swap read");
                let r = ticket
                    .map_err(Error::from)
                    .and_then(|t| t.wait().map_err(|e| e.error.into()));
                drop(span);
                match r {
                    Ok(buf) => {
                        dst.copy_from_slice(&buf[..n]);
                        self.cache_insert(i, &buf[..n]);
                        (Ok(()), Fetch::Read)
                    }
                    Err(e) => (Err(e), Fetch::Read),
                }
            }
        };
        if let Err(e) = r {
            dst.fill(0);
            self.failed.get_or_insert(e);
        }
        how
    }

    /// Caches unit `i`'s shard `src` (just read from the swap file): in a
    /// free cache buffer that fits, else in the buffer of the least
    /// recently used cached shard that fits; not at all if none fits.
    fn cache_insert(&mut self, i: usize, src: &[u8]) {
        let Some(cp) = &self.cache_pool else {
            return;
        };
        let need = src.len().max(1);
        let mut buf = match cp.acquire(need) {
            Ok(b) => b,
            Err(_) => {
                let victim = (0..self.cache.len())
                    .filter(|&j| {
                        j != i && self.cache[j].as_ref().is_some_and(|b| b.capacity() >= need)
                    })
                    .min_by_key(|&j| self.last_use[j]);
                let Some(mut b) = victim.and_then(|j| self.cache[j].take()) else {
                    return;
                };
                // Cannot fail: the capacity was checked above.
                if b.set_len(need).is_err() {
                    return;
                }
                b
            }
        };
        buf[..src.len()].copy_from_slice(src);
        self.cache[i] = Some(buf);
        self.last_use[i] = self.tick;
    }

    /// Waits for every read issued ahead (end of a micro-batch: the next
    /// step changes the shards).
    pub(crate) fn drain_reads(&mut self) {
        let _span = (self.pending > 0).then(|| self.trace.io_wait(Io::Read, "swap read"));
        for r in &mut self.reads {
            if let Some(t) = r.take() {
                if let Err(e) = t.wait() {
                    self.failed.get_or_insert(e.error.into());
                }
            }
        }
        self.pending = 0;
    }
    /// nvme, at the end of every micro-batch (`step`): every rank learns
    /// whether every rank could read its shards in it (a failed read fed
    /// zeros to the gather so that no rank left the collectives) and
    /// whether its swap file is intact ([`ParamOffload::check`]). On an
    /// error anywhere nothing is updated, `health` is failed and the
    /// parameters are lost. `step` is the number of the step under way.
    /// Nothing to agree on with `cpu`.
    pub(crate) fn micro_batch_verdict<C: Communicator>(
        &mut self,
        comm: &C,
        health: &mut Health,
        step: u64,
    ) -> Result<()> {
        if !self.is_nvme() {
            return Ok(());
        }
        health.params_verdict(comm, self.check(), |bad, why| {
            format!(
                "the parameter swap file of rank {bad} could not be read in step {step} ({why}); \
                 nothing was updated and the parameters are lost"
            )
        })
    }

    /// Checks the swap file (deleted, truncated, foreign header) and the
    /// reads since the last check; the first error.
    pub(crate) fn check(&mut self) -> Result<()> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        match &self.home {
            Home::Nvme { swap, .. } => Ok(swap.verify()?),
            Home::Host(_) => Ok(()),
        }
    }

    /// cpu: every unit's host shard, typed, for AdamW to write into.
    pub(crate) fn host_shards<P: Element>(&mut self) -> Result<Option<Vec<&mut [P]>>> {
        let bytes = &self.bytes;
        match &mut self.home {
            Home::Host(bufs) => {
                let mut out = Vec::with_capacity(bufs.len());
                for (b, &n) in bufs.iter_mut().zip(bytes) {
                    if n == 0 {
                        // A unit with only frozen tensors: no shard here.
                        out.push(&mut [][..]);
                        continue;
                    }
                    let s = b.as_mut_slice_of::<P>()?;
                    out.push(&mut s[..n / std::mem::size_of::<P>()]);
                }
                Ok(Some(out))
            }
            Home::Nvme { .. } => Ok(None),
        }
    }

    /// Writes unit `i`'s updated shard home: `fill` gets the shard
    /// (zeroed, padding included) to write. With nvme the write is queued
    /// (see [`ParamOffload::flush`]); a staging buffer is freed first by
    /// waiting for the oldest write when all are in use.
    pub(crate) fn write_with<P: Element>(
        &mut self,
        i: usize,
        fill: impl FnOnce(&mut [P]) -> Result<()>,
    ) -> Result<()> {
        let _span = self.trace.span("param write back", "offload");
        let n = self.bytes[i];
        if n == 0 {
            return fill(&mut []);
        }
        match &mut self.home {
            Home::Host(bufs) => {
                let s = bufs[i].as_mut_slice_of::<P>()?;
                fill(&mut s[..n / std::mem::size_of::<P>()])
            }
            Home::Nvme { swap, regions } => {
                let mut buf = loop {
                    match self.pool.acquire(n.max(1)) {
                        Ok(b) => break b,
                        Err(e) => match self.writes.pop_front() {
                            Some(w) => {
                                let _span = self.trace.io_wait(Io::Write, "swap write");
                                drop(w.wait().map_err(|e| e.error)?)
                            }
                            None => return Err(e.into()),
                        },
                    }
                };
                buf.fill(0);
                let s = buf.as_mut_slice_of::<P>()?;
                fill(&mut s[..n / std::mem::size_of::<P>()])?;
                // Write-through: the cached copy and the file both get
                // the new shard.
                if let Some(c) = self.cache[i].as_mut() {
                    c[..n].copy_from_slice(&buf[..n]);
                }
                self.trace
                    .io_bytes(Io::Write, swap.region_len(regions[i]).unwrap_or(0));
                self.writes.push_back(swap.write(regions[i], buf));
                Ok(())
            }
        }
    }

    /// Waits for every queued write; the first error.
    pub(crate) fn flush(&mut self) -> Result<()> {
        let _span = (!self.writes.is_empty()).then(|| self.trace.io_wait(Io::Write, "swap write"));
        let mut first = None;
        for w in self.writes.drain(..) {
            if let Err(e) = w.wait() {
                first.get_or_insert(e.error);
            }
        }
        match first {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Unit `i`'s shard (padding included) as f32, read from its home
    /// (outside the step; allocates).
    pub(crate) fn shard_f32(&self, i: usize, pdt: DType) -> Result<Vec<f32>> {
        let n = self.bytes[i];
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut raw = AlignedBuf::new(n.max(1))?;
        match &self.home {
            Home::Host(bufs) => raw[..n].copy_from_slice(&bufs[i][..n]),
            Home::Nvme { .. } if self.cache[i].is_some() => {
                if let Some(c) = &self.cache[i] {
                    raw[..n].copy_from_slice(&c[..n]);
                }
            }
            Home::Nvme { swap, regions } => {
                raw = swap.read(regions[i], raw).wait().map_err(|e| e.error)?;
            }
        }
        let elems = n / pdt.size_in_bytes();
        Ok(match pdt {
            DType::F32 => raw.as_slice_of::<f32>()?[..elems].to_vec(),
            DType::BF16 => to_f32(&raw.as_slice_of::<zero_core::bf16>()?[..elems]),
            DType::F16 => to_f32(&raw.as_slice_of::<zero_core::f16>()?[..elems]),
        })
    }
}

fn to_f32<T: Element>(s: &[T]) -> Vec<f32> {
    s.iter().map(|x| x.to_f32()).collect()
}
