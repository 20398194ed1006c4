//! ZeRO-Offload of the optimizer state: the rank's fp32 master, `m` and `v`
//! live in host memory (`offload_optimizer.device = "cpu"`) or in a swap
//! file under `nvme_path` (`"nvme"`), and AdamW runs on the CPU tile by tile.
//!
//! # Layout
//!
//! The rank's optimizer state is one flat array over the units, in
//! registration order (each unit's state range: its shard in stages 1–3,
//! the whole unit in stage 0, padding included). The flat array is cut into
//! tiles of `sub_group_size` elements; a tile may hold the end of one unit
//! and the start of the next. Each tile is stored as `[master | m | v]`
//! (fp32, `3 · len` elements):
//!
//! ```text
//!  flat state:  [ unit 0 shard | unit 1 shard | unit 2 shard ]
//!  tiles:       [  tile 0  |  tile 1  |  tile 2  |  tile 3 ]      sub_group_size each
//!  cpu:         one HostPool buffer per tile, resident
//!  nvme:        one swap-file region per tile, staged through buffer_count pool buffers
//! ```
//!
//! # The step
//!
//! The accumulated gradient shard (`A`) is the host-side gradient buffer:
//! each reduced bucket is stored into it as it completes (on the CPU a
//! copy between buffers; the CUDA backend will make it a device→host copy
//! on its own stream), so the device tier holds no gradient shard. The
//! global norm is computed on it exactly as without offload. AdamW then
//! runs per tile as a three-stage pipeline:
//!
//! ```text
//!  nvme:  read tile i+1..i+a |  update tile i (CpuAdamW)  |  write tile i-1
//!  cpu:   (state resident)   |  update tile i             |  copy-out tile i-1 → params
//! ```
//!
//! With nvme, `offload_optimizer.pipeline_read` and `pipeline_write`
//! (DeepSpeed's keys and meaning) choose the overlap:
//!
//! | `pipeline_read` | `pipeline_write` | while tile i is updated |
//! |---|---|---|
//! | false | false | nothing: read i, update, write i and wait, then i+1 (DeepSpeed's default) |
//! | true | false | reads of tiles i+1..=i+a in flight (a = `buffer_count` − 1) |
//! | false | true | the write of tile i-1 in flight; tile i is read when needed |
//! | true | true | both (a = `buffer_count` − 2, at least 1) |
//!
//! Their defaults are the resolved config's (see
//! `zero_core::config::OffloadOptimizerConfig`; DeepSpeed's are false,
//! which runs nothing in parallel). Every schedule gives the same bits.
//! A read is submitted `a` tiles ahead, so it is queued before the writes
//! of the tiles updated meanwhile: the I/O threads serve requests in
//! submission order, and a read submitted only when its tile is due
//! would wait behind every write still queued. To free a buffer for a
//! read ahead the step waits for the oldest write, but never for the
//! newest one unless the tile due needs its buffer.
//!
//! The updated parameters go to a host staging buffer (the parameter dtype,
//! the rank's flat shard) and are copied out to the device-tier parameters:
//! per tile behind the update with `cpu`, and only once every rank's tiles
//! were read, updated and written with `nvme`, so that a swap-file error
//! leaves the parameters of the last good step in place on every rank.
//! AdamW on any slicing gives the bits of the unsliced update, so every
//! mode gives bit-identical parameters and optimizer state.
//!
//! # A failed swap write
//!
//! A write that fails in the step (disk full, an I/O error) does not lose
//! the state: the tile's updated `[master | m | v]` is still in the buffer
//! the failed request hands back, so it is copied to host memory (the one
//! allocation of this error path; it is accounted in the host tier) and
//! the step goes on with the remaining tiles, writing them too (a later
//! write that fails is kept the same way). The state after the step is
//! then exactly "the tiles written in this step, in the file, plus the
//! kept tiles", and the staging buffer holds the parameters of every tile
//! updated from it: [`Offload::rescued`] says so, [`Offload::commit`] may
//! copy them out, and every read of the state ([`Offload::read_unit`],
//! [`Offload::visit`]) returns the kept tiles instead of the file's. The
//! step still returns the write's error (naming file, region and block),
//! and [`Offload::step`] refuses to run again while tiles are kept: the
//! trainer saves a checkpoint elsewhere. A failed *read* (a truncated,
//! corrupted, deleted file) ends the step at once and loses the state
//! (tiles before it were already rewritten): nothing is kept.
//!
//! # Streamed (`swap_gradients`)
//!
//! With the gradient shard in its own swap file
//! ([`GradSwap`](super::grad_swap::GradSwap)), tiles end at unit ends and
//! [`Offload::step_streamed`] runs the same pipeline unit by unit: each
//! unit's gradient is read (the next unit's ahead) while its tiles are
//! read, updated and written, and once its last tile is done its updated
//! parameters go out (to the device tier, or to the parameter offload's
//! home), so the staging buffer holds one unit. Nothing waits for a
//! commit across ranks and no tile is kept after a failed write: an error
//! in the step loses the state (resume from a checkpoint).
//!
//! Every buffer (tiles, staging, read/write buffers) comes from a
//! [`HostPool`] sized at build; the step allocates none (except the kept
//! tiles after a failed write).

use std::collections::VecDeque;
use std::ops::Range;

use zero_core::config::{OffloadDevice, ResolvedConfig};
use zero_core::memory::{Allocation, Category, MemoryTracker, Tier};
use zero_core::optim::{AdamWSlices, CpuAdamW};
use zero_core::{DType, Element};
use zero_offload::{
    HostPool, HostPoolOptions, IoError, IoTicket, PooledBuffer, RegionId, RegionSpec, SwapFile,
    SwapOptions,
};

use super::faults::{set_faults, FaultPlan};
use super::grad_swap::GradSwap;
use super::groups::{carve, GroupedStep};
use crate::plan::optimizer_tiles;
use crate::trace::{Io, RankTracer, SwapTraffic, Tracer};
use crate::{Error, Result};

/// Unit `unit`'s state elements `local` (relative to the start of the
/// unit's state range), at offset `at` within their tile.
struct Piece {
    unit: usize,
    local: Range<usize>,
    at: usize,
}

/// A tile: its range of the flat state and the real elements it updates.
struct Tile {
    flat: Range<usize>,
    pieces: Vec<Piece>,
    /// Streamed (`swap_gradients`): the one unit whose state range holds
    /// the tile.
    unit: Option<usize>,
}

impl Tile {
    fn len(&self) -> usize {
        self.flat.len()
    }
    /// Bytes of `[master | m | v]`.
    fn bytes(&self) -> usize {
        self.len() * 12
    }
}

/// Where the tiles live.
enum Store {
    /// `cpu`: one pool buffer per tile, lent for the engine's life.
    Host(Vec<PooledBuffer>),
    /// `nvme`: one region per tile; reads and writes go through pool
    /// buffers.
    Nvme {
        swap: SwapFile,
        regions: Vec<RegionId>,
    },
}

/// A tile whose swap write failed in the last step: its `[master | m | v]`
/// after that step, in host memory (accounted in the host tier).
struct Kept {
    state: Vec<f32>,
    _allocs: [Allocation; 2],
}

/// How the nvme step overlaps transfers with the update
/// (`pipeline_read`, `pipeline_write`).
#[derive(Debug, Clone, Copy)]
struct Schedule {
    /// Tiles read ahead of the one being updated (0: each tile is read
    /// when it is needed).
    ahead: usize,
    /// Whether a tile's write runs behind the update of the next ones
    /// (false: the step waits for it before the next tile).
    write_behind: bool,
}

impl Schedule {
    /// `buffer_count` buffers: with both, one is being updated and one is
    /// being written, the rest are read ahead (at least one).
    fn new(read_ahead: bool, write_behind: bool, buffer_count: usize) -> Schedule {
        let ahead = match (read_ahead, write_behind) {
            (false, _) => 0,
            (true, false) => buffer_count.saturating_sub(1).max(1),
            (true, true) => buffer_count.saturating_sub(2).max(1),
        };
        Schedule {
            ahead,
            write_behind,
        }
    }
}

/// What the engine needs to know per unit.
pub(crate) struct UnitRanges {
    /// Length of the unit's state range (padding included).
    pub(crate) state_len: usize,
    /// The real elements of the state range (relative to its start).
    pub(crate) real: Range<usize>,
    /// Where `real` lies in the unit's parameter buffer.
    pub(crate) params: Range<usize>,
}

/// The offloaded optimizer state of one rank.
pub(crate) struct Offload {
    device: OffloadDevice,
    units: Vec<UnitRanges>,
    /// Flat offset of each unit's state range.
    unit_off: Vec<usize>,
    tiles: Vec<Tile>,
    pool: HostPool,
    store: Store,
    /// Updated parameters, in the parameter dtype, over the flat state.
    staging: PooledBuffer,
    /// The nvme step's overlap of reads and writes with the update.
    schedule: Schedule,
    /// `swap_gradients`: tiles never span units, the staging buffer holds
    /// one unit, and a failed write loses the state (see
    /// [`Offload::step_streamed`]).
    streamed: bool,
    /// Per tile: its state after the last step, when its swap write failed
    /// (see the module docs). All `None` unless [`Offload::rescued`].
    kept: Vec<Option<Kept>>,
    /// Accounts the kept tiles.
    tracker: MemoryTracker,
    /// Spans of the swap traffic and copies (disabled unless
    /// [`Offload::traced`]).
    trace: RankTracer,
    _allocs: Vec<Allocation>,
}

/// Writes unit `i`'s initial master over its state elements `range` into
/// `out`: `master(i, range, out)`.
/// An error (a pretrained source that cannot be read) ends the build.
pub(crate) type InitialMaster<'a> = dyn Fn(usize, Range<usize>, &mut [f32]) -> Result<()> + 'a;

/// The options of a swap file `tag` of rank `rank` under the optimizer's
/// `nvme_path`: the optimizer state's (`"optimizer"`), or the gradient
/// swap's.
pub(crate) fn swap_options(cfg: &ResolvedConfig, rank: usize, tag: &str) -> SwapOptions {
    let dir = cfg
        .zero
        .offload_optimizer
        .nvme_path
        .clone()
        .unwrap_or_default();
    let mut options = SwapOptions::from_aio(dir, rank, &cfg.zero.aio);
    options.tag = tag.into();
    options
}

/// The swap file's regions: one per tile of `lens` elements, holding its
/// `[master | m | v]`.
fn tile_regions(lens: impl Iterator<Item = usize>) -> Vec<RegionSpec> {
    lens.enumerate()
        .map(|(t, len)| RegionSpec::new(format!("tile{t}"), (len * 12) as u64))
        .collect()
}

/// With `offload_optimizer` nvme: the length of rank `rank`'s swap file
/// for optimizer state of `total` elements (the sum of the units' state
/// lengths), known before anything is allocated.
pub(crate) fn swap_file_len(
    cfg: &ResolvedConfig,
    rank: usize,
    state_lens: &[usize],
) -> Result<u64> {
    let tiles = optimizer_tiles(cfg, state_lens);
    Ok(SwapFile::planned_len(
        &swap_options(cfg, rank, "optimizer"),
        &tile_regions(tiles.iter().map(ExactSizeIterator::len)),
    )?)
}

impl Offload {
    /// Lays out the tiles, allocates the pool (and the swap file), and
    /// stores the initial state tile by tile: the master from
    /// `master(i, range, out)` (unit `i`'s state elements `range` into
    /// `out`), `m = v = 0`; so the whole master is never in memory.
    pub(crate) fn new(
        cfg: &ResolvedConfig,
        rank: usize,
        pdt: DType,
        units: Vec<UnitRanges>,
        master: &InitialMaster<'_>,
        tracker: &MemoryTracker,
        faults: Option<FaultPlan>,
    ) -> Result<Offload> {
        let oo = &cfg.zero.offload_optimizer;
        let mut unit_off = Vec::with_capacity(units.len());
        let mut total = 0usize;
        for u in &units {
            unit_off.push(total);
            total += u.state_len;
        }
        let streamed = oo.swap_gradients;
        let lens: Vec<usize> = units.iter().map(|u| u.state_len).collect();
        let mut tiles = Vec::new();
        for Range { start: a, end: b } in optimizer_tiles(cfg, &lens) {
            let mut pieces = Vec::new();
            for (i, u) in units.iter().enumerate() {
                let lo = a.max(unit_off[i] + u.real.start);
                let hi = b.min(unit_off[i] + u.real.end);
                if lo < hi {
                    pieces.push(Piece {
                        unit: i,
                        local: lo - unit_off[i]..hi - unit_off[i],
                        at: lo - a,
                    });
                }
            }
            let unit = streamed
                .then(|| (0..units.len()).find(|&i| unit_off[i] + units[i].state_len > a))
                .flatten();
            tiles.push(Tile {
                flat: a..b,
                pieces,
                unit,
            });
        }
        let max_tile = tiles.iter().map(Tile::bytes).max().unwrap_or(0);
        // The staging buffer: the whole flat state, or (streamed) one unit.
        let staged_len = if streamed {
            units.iter().map(|u| u.state_len).max().unwrap_or(0)
        } else {
            total
        };
        let staging_bytes = (staged_len * pdt.size_in_bytes()).max(1);
        let nvme = oo.device == OffloadDevice::Nvme;
        let buffer_count = oo.buffer_count.max(1);
        let mut sizes: Vec<usize> = if nvme {
            vec![max_tile.max(1); buffer_count]
        } else {
            tiles.iter().map(Tile::bytes).collect()
        };
        sizes.push(staging_bytes);
        let pool = HostPool::new(
            &sizes,
            HostPoolOptions {
                name: format!("rank {rank} optimizer offload"),
                pin_memory: oo.pin_memory,
                ..HostPoolOptions::default()
            },
        )?;
        // The staging buffer first, then the tiles largest first, so that
        // each takes a buffer sized for it.
        let mut staging = pool.acquire(staging_bytes)?;
        staging.fill(0);
        let tile_state = |t: &Tile, out: &mut [f32]| -> Result<()> {
            let len = t.len();
            out.fill(0.0);
            for (i, &off) in unit_off.iter().enumerate() {
                let lo = t.flat.start.max(off);
                let hi = t.flat.end.min(off + units[i].state_len);
                if lo < hi {
                    master(
                        i,
                        lo - off..hi - off,
                        &mut out[lo - t.flat.start..hi - t.flat.start],
                    )?;
                }
            }
            debug_assert_eq!(out.len(), 3 * len);
            Ok(())
        };
        let store = if nvme {
            let mut options = swap_options(cfg, rank, "optimizer");
            set_faults(&mut options, faults);
            let specs = tile_regions(tiles.iter().map(Tile::len));
            let swap = SwapFile::create(options, &specs)?;
            let mut regions = Vec::with_capacity(tiles.len());
            for (t, tile) in tiles.iter().enumerate() {
                let id = swap.region(&specs[t].name)?;
                let mut buf = pool.acquire(tile.bytes())?;
                tile_state(tile, buf.as_mut_slice_of::<f32>()?)?;
                drop(swap.write(id, buf).wait().map_err(|e| e.error)?);
                regions.push(id);
            }
            swap.verify()?;
            Store::Nvme { swap, regions }
        } else {
            let mut order: Vec<usize> = (0..tiles.len()).collect();
            order.sort_by_key(|&t| std::cmp::Reverse(tiles[t].bytes()));
            let mut bufs: Vec<Option<PooledBuffer>> = (0..tiles.len()).map(|_| None).collect();
            for t in order {
                let mut buf = pool.acquire(tiles[t].bytes())?;
                tile_state(&tiles[t], buf.as_mut_slice_of::<f32>()?)?;
                bufs[t] = Some(buf);
            }
            Store::Host(bufs.into_iter().flatten().collect())
        };
        // Accounting: master and moments in their tier; the staging
        // buffer, read/write buffers and rounding as transfer buffers.
        let state_bytes = (total * 4) as u64;
        let tier = if nvme { Tier::Nvme } else { Tier::Host };
        let mut allocs = vec![
            tracker.allocate(tier, Category::Master, state_bytes),
            tracker.allocate(tier, Category::Moments, 2 * state_bytes),
        ];
        let (held, stored) = match &store {
            Store::Host(_) => (pool.bytes_held(), 3 * state_bytes),
            Store::Nvme { swap, .. } => {
                allocs.push(tracker.allocate(
                    Tier::Nvme,
                    Category::CommBuffers,
                    swap.file_len().saturating_sub(3 * state_bytes),
                ));
                (pool.bytes_held(), 0)
            }
        };
        allocs.push(tracker.allocate(
            Tier::Host,
            Category::CommBuffers,
            held.saturating_sub(stored),
        ));
        let ntiles = tiles.len();
        Ok(Offload {
            device: oo.device,
            units,
            unit_off,
            tiles,
            pool,
            store,
            staging,
            schedule: Schedule::new(oo.pipeline_read, oo.pipeline_write, buffer_count),
            streamed,
            kept: (0..ntiles).map(|_| None).collect(),
            tracker: tracker.clone(),
            trace: RankTracer::default(),
            _allocs: allocs,
        })
    }

    /// Records spans (`swap read`, `swap write`, `param copy-out`,
    /// `adam tile`) of `rank` into `tracer`.
    pub(crate) fn traced(mut self, tracer: Tracer, rank: usize) -> Self {
        self.trace = RankTracer::new(tracer, rank);
        self
    }

    /// The swap traffic of the steps so far.
    pub(crate) fn traffic(&self) -> SwapTraffic {
        self.trace.traffic()
    }

    /// Whether the state is in a swap file.
    pub(crate) fn is_nvme(&self) -> bool {
        self.device == OffloadDevice::Nvme
    }

    /// Warnings of the swap file (the `O_DIRECT` fallback).
    pub(crate) fn warnings(&self) -> Vec<String> {
        match &self.store {
            Store::Nvme { swap, .. } => swap.warnings().to_vec(),
            Store::Host(_) => Vec::new(),
        }
    }

    /// The swap file's path, if any.
    pub(crate) fn swap_path(&self) -> Option<&std::path::Path> {
        match &self.store {
            Store::Nvme { swap, .. } => Some(swap.path()),
            Store::Host(_) => None,
        }
    }

    /// The elements of unit `unit`'s parameter buffer the step writes.
    pub(crate) fn param_range(&self, unit: usize) -> Range<usize> {
        self.units[unit].params.clone()
    }

    /// One AdamW step over every tile. `grads[i]` is unit `i`'s accumulated
    /// gradient (its state range), `params[i]` its parameter buffer.
    /// With `cpu` the updated parameters are copied out as the pipeline
    /// goes (not at all when `params` is empty: parameter offload); with
    /// `nvme` they stay in the staging buffer until [`Offload::commit`].
    ///
    /// With `nvme`, an error returned here either lost the state (a failed
    /// read: [`Offload::rescued`] is false) or is a failed write whose
    /// tiles are kept in host memory ([`Offload::rescued`] is true: the
    /// step completed, and the staging buffer and the state readable with
    /// [`Offload::read_unit`] and [`Offload::visit`] are those after it).
    pub(crate) fn step<G: Element, P: Element>(
        &mut self,
        adam: &CpuAdamW,
        k: &GroupedStep<'_>,
        grads: &[&[G]],
        params: &mut [&mut [P]],
    ) -> Result<()> {
        if self.streamed {
            return Err(Error::Unsupported {
                what: "internal: the whole-state step with swap_gradients (it streams)".into(),
            });
        }
        if self.rescued() {
            let held = self.kept.iter().filter(|k| k.is_some()).count();
            let msg = format!(
                "the optimizer step cannot run: the swap writes of {held} tiles failed in the \
                 last step and their state is kept in host memory (save a checkpoint to \
                 another disk and restart from it)"
            );
            return Err(match self.swap_path() {
                Some(path) => zero_core::Error::Io {
                    path: path.to_path_buf(),
                    msg,
                }
                .into(),
                None => Error::Unsupported { what: msg },
            });
        }
        let Some(NvmeStep {
            mut pipe, staging, ..
        }) = self.nvme_step::<P>(true)?
        else {
            return self.step_host(adam, k, grads, params);
        };
        let done = pipe.run(adam, k, &mut Resident(grads), &mut Flat(staging));
        match (done, pipe.write_failed.take()) {
            (Ok(()), None) => Ok(()),
            (Ok(()), Some(e)) => Err(rescued_error(e, pipe.kept, pipe.tiles)),
            (Err(e), _) => {
                // The state is lost: drop what was kept of it.
                pipe.kept.iter_mut().for_each(|k| *k = None);
                Err(e)
            }
        }
    }

    /// [`Offload::step`] with `cpu`: the state is resident and the
    /// gradient shard already in host memory, so each tile is updated in
    /// place and its parameters copied out behind the next tile's update.
    fn step_host<G: Element, P: Element>(
        &mut self,
        adam: &CpuAdamW,
        k: &GroupedStep<'_>,
        grads: &[&[G]],
        params: &mut [&mut [P]],
    ) -> Result<()> {
        let Offload {
            units,
            unit_off,
            tiles,
            store: Store::Host(bufs),
            staging,
            trace,
            ..
        } = self
        else {
            return Err(Error::Unsupported {
                what: "internal: the cpu optimizer step without the state in host memory".into(),
            });
        };
        let staging = staging.as_mut_slice_of::<P>()?;
        let mut behind: Option<usize> = None;
        for (t, tile) in tiles.iter().enumerate() {
            // Copy-in: nothing to move, the state is resident and the
            // gradient shard is already in host memory.
            let span = trace.span("adam tile", "optimizer");
            let low = &mut staging[tile.flat.clone()];
            update_tile(
                adam,
                k,
                tile,
                bufs[t].as_mut_slice_of()?,
                &Resident(grads),
                low,
            )?;
            drop(span);
            if let Some(done) = behind.replace(t) {
                if !params.is_empty() {
                    let _span = trace.span("param copy-out", "offload");
                    copy_out(&tiles[done], units, unit_off, staging, params);
                }
            }
        }
        if let Some(done) = behind {
            if !params.is_empty() {
                let _span = trace.span("param copy-out", "offload");
                copy_out(&tiles[done], units, unit_off, staging, params);
            }
        }
        Ok(())
    }

    /// What both nvme steps set up (`None` with `cpu`): the swap file
    /// verified, the tile pipeline over it (`keep`: see
    /// [`Pipeline::keep`]), the staging buffer as `P` and the units'
    /// ranges.
    fn nvme_step<P: Element>(&mut self, keep: bool) -> Result<Option<NvmeStep<'_, P>>> {
        let Offload {
            units,
            unit_off,
            tiles,
            pool,
            store: Store::Nvme { swap, regions },
            staging,
            schedule,
            kept,
            tracker,
            trace,
            ..
        } = self
        else {
            return Ok(None);
        };
        swap.verify()?;
        Ok(Some(NvmeStep {
            pipe: Pipeline {
                tiles,
                pool,
                swap,
                regions,
                schedule: *schedule,
                trace,
                kept,
                tracker,
                keep,
                write_failed: None,
            },
            staging: staging.as_mut_slice_of::<P>()?,
            units,
            unit_off,
        }))
    }

    /// Streamed (`swap_gradients`): one AdamW step over every tile, unit by
    /// unit, each unit's gradient read from `grads` (the next one read
    /// ahead), and each unit's updated parameters, once its last tile is
    /// done, copied into `params[i]` (the device tier) or, when `params`
    /// is empty (parameter offload), handed to `emit(i, staged)` (over the
    /// unit's state range; units without state too, with an empty slice).
    /// Host memory holds a tile pipeline and one unit's parameters.
    ///
    /// Nothing is kept after an error: the tiles and units before it were
    /// written, the rest not, so the state and the parameters are lost
    /// (the engine fails; resume from a checkpoint).
    pub(crate) fn step_streamed<G: Element, P: Element>(
        &mut self,
        adam: &CpuAdamW,
        k: &GroupedStep<'_>,
        grads: &mut GradSwap,
        params: &mut [&mut [P]],
        emit: &mut Emit<'_, P>,
    ) -> Result<()> {
        let Some(NvmeStep {
            mut pipe,
            staging,
            units,
            unit_off,
        }) = self.nvme_step::<P>(false)?
        else {
            return Err(Error::Unsupported {
                what: "swap_gradients without the optimizer state on nvme".into(),
            });
        };
        // Reads a dropped micro-batch issued ahead hold buffers: gone.
        grads.drain_reads();
        let mut to_params = |u: usize, staged: &[P]| -> Result<()> {
            if params.is_empty() {
                return emit(u, staged);
            }
            let r = &units[u];
            params[u][r.params.clone()].copy_from_slice(&staged[r.real.clone()]);
            Ok(())
        };
        let mut out = PerUnit {
            staging,
            unit_off,
            units,
            emit: &mut to_params,
        };
        let mut feed = Swapped {
            swap: grads,
            cur: None,
        };
        let done = pipe.run::<G, P>(adam, k, &mut feed, &mut out);
        drop(feed.cur.take());
        feed.swap.drain_reads();
        done?;
        for (u, r) in units.iter().enumerate() {
            if r.state_len == 0 {
                to_params(u, &[])?;
            }
        }
        Ok(())
    }

    /// Whether the last nvme step failed only in swap writes and completed
    /// anyway: every tile was updated, the tiles whose write failed are
    /// kept in host memory (the reads of the state return them), and the
    /// staging buffer holds the parameters of the state after the step
    /// (see the module docs).
    pub(crate) fn rescued(&self) -> bool {
        self.kept.iter().any(Option::is_some)
    }

    /// Copies every updated parameter from the staging buffer out to the
    /// parameter buffers (after an `nvme` step that succeeded on every
    /// rank, or whose failed writes were all rescued: see
    /// [`Offload::rescued`]).
    pub(crate) fn commit<P: Element>(&mut self, params: &mut [&mut [P]]) -> Result<()> {
        if params.is_empty() {
            return Ok(());
        }
        let staging = self.staging.as_slice_of::<P>()?;
        let _span = self.trace.span("param copy-out", "offload");
        for tile in &self.tiles {
            copy_out(tile, &self.units, &self.unit_off, staging, params);
        }
        Ok(())
    }

    /// Unit `i`'s updated parameters over its state range (stage 3: its
    /// whole shard, padding included, as zeros), from the staging buffer
    /// of the last step. With parameter offload the engine passes no
    /// parameter buffers to [`Offload::step`] and writes these back to the
    /// shards' home instead.
    pub(crate) fn staged<P: Element>(&self, i: usize) -> Result<&[P]> {
        let off = self.unit_off[i];
        Ok(&self.staging.as_slice_of::<P>()?[off..off + self.units[i].state_len])
    }

    /// Unit `i`'s state range: `(master, m, v)`, padding included (tiles
    /// kept in host memory after a failed write are read from there).
    pub(crate) fn read_unit(&self, i: usize) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let mut parts = self.read_parts(i, 3)?.into_iter();
        let mut next = || parts.next().unwrap_or_default();
        Ok((next(), next(), next()))
    }

    /// Unit `i`'s master over its state range (as [`Offload::read_unit`],
    /// without the moments: export).
    pub(crate) fn read_master(&self, i: usize) -> Result<Vec<f32>> {
        Ok(self.read_parts(i, 1)?.pop().unwrap_or_default())
    }

    /// The first `k` of unit `i`'s `[master, m, v]` over its state range.
    fn read_parts(&self, i: usize, k: usize) -> Result<Vec<Vec<f32>>> {
        let off = self.unit_off[i];
        let n = self.units[i].state_len;
        let mut out = vec![vec![0f32; n]; k];
        for (t, tile) in self.tiles.iter().enumerate() {
            let lo = tile.flat.start.max(off);
            let hi = tile.flat.end.min(off + n);
            if lo >= hi {
                continue;
            }
            let mut copy = |state: &[f32]| {
                let len = tile.len();
                let a = lo - tile.flat.start;
                for (p, o) in out.iter_mut().enumerate() {
                    let at = a + p * len;
                    o[lo - off..hi - off].copy_from_slice(&state[at..at + (hi - lo)]);
                }
            };
            match (&self.store, &self.kept[t]) {
                (_, Some(kept)) => copy(&kept.state),
                (Store::Host(bufs), None) => copy(bufs[t].as_slice_of()?),
                (Store::Nvme { swap, regions }, None) => {
                    let buf = self.pool.acquire(tile.bytes())?;
                    let buf = swap.read(regions[t], buf).wait().map_err(|e| e.error)?;
                    copy(buf.as_slice_of()?);
                }
            }
        }
        Ok(out)
    }

    /// Calls `f(unit, local, master, m, v)` for every piece of real
    /// elements, tile by tile in flat order (units in registration order,
    /// each unit's pieces in increasing order); `local` is relative to the
    /// start of the unit's state range. With nvme one tile is read at a
    /// time into a pool buffer, so the whole state is never in memory
    /// (checkpoint save); tiles kept in host memory after a failed write
    /// are read from there.
    pub(crate) fn visit(
        &self,
        mut f: impl FnMut(usize, Range<usize>, &[f32], &[f32], &[f32]) -> Result<()>,
    ) -> Result<()> {
        for (t, tile) in self.tiles.iter().enumerate() {
            let mut each = |state: &[f32]| -> Result<()> {
                let len = tile.len();
                for p in &tile.pieces {
                    let a = p.at..p.at + p.local.len();
                    f(
                        p.unit,
                        p.local.clone(),
                        &state[a.clone()],
                        &state[a.start + len..a.end + len],
                        &state[a.start + 2 * len..a.end + 2 * len],
                    )?;
                }
                Ok(())
            };
            match (&self.store, &self.kept[t]) {
                (_, Some(kept)) => each(&kept.state)?,
                (Store::Host(bufs), None) => each(bufs[t].as_slice_of()?)?,
                (Store::Nvme { swap, regions }, None) => {
                    let buf = self.pool.acquire(tile.bytes())?;
                    let buf = swap.read(regions[t], buf).wait().map_err(|e| e.error)?;
                    each(buf.as_slice_of()?)?;
                }
            }
        }
        Ok(())
    }

    /// Replaces the whole state, tile by tile: each tile is zeroed
    /// (padding stays zero, as at build) and `f(unit, local, master, m, v)`
    /// fills each of its pieces of real elements (as in
    /// [`Offload::visit`]); with nvme the tile is then written to its
    /// region before the next one is filled (checkpoint load).
    pub(crate) fn fill(
        &mut self,
        mut f: impl FnMut(usize, Range<usize>, &mut [f32], &mut [f32], &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let Offload {
            tiles,
            pool,
            store,
            kept,
            ..
        } = self;
        // The whole state is replaced: nothing kept of an earlier step
        // applies any more.
        kept.iter_mut().for_each(|k| *k = None);
        for (t, tile) in tiles.iter().enumerate() {
            let mut each = |state: &mut [f32]| -> Result<()> {
                let len = tile.len();
                let state = &mut state[..3 * len];
                state.fill(0.0);
                let (master, rest) = state.split_at_mut(len);
                let (m, v) = rest.split_at_mut(len);
                for p in &tile.pieces {
                    let a = p.at..p.at + p.local.len();
                    f(
                        p.unit,
                        p.local.clone(),
                        &mut master[a.clone()],
                        &mut m[a.clone()],
                        &mut v[a],
                    )?;
                }
                Ok(())
            };
            match store {
                Store::Host(bufs) => each(bufs[t].as_mut_slice_of()?)?,
                Store::Nvme { swap, regions } => {
                    let mut buf = pool.acquire(tile.bytes())?;
                    each(buf.as_mut_slice_of()?)?;
                    drop(swap.write(regions[t], buf).wait().map_err(|e| e.error)?);
                }
            }
        }
        if let Store::Nvme { swap, .. } = store {
            swap.verify()?;
        }
        Ok(())
    }
}

/// AdamW on one tile: `state` is the tile's `[master | m | v]`, `staging`
/// the flat staging buffer (the tile's part receives the parameters).
fn update_tile<G: Element, P: Element>(
    adam: &CpuAdamW,
    k: &GroupedStep<'_>,
    tile: &Tile,
    state: &mut [f32],
    grads: &dyn GradFeed<G>,
    low: &mut [P],
) -> Result<()> {
    let len = tile.len();
    let (master, rest) = state.split_at_mut(len);
    let (m, v) = rest.split_at_mut(len);
    let (mut master, mut m, mut v) = (master, m, v);
    let mut low = low;
    let mut cur = 0;
    // The pieces split at group boundaries; one parallel region per group
    // (one in all without groups).
    let mut parts: Vec<Vec<AdamWSlices<'_, G, f32, P>>> = k.ks.iter().map(|_| Vec::new()).collect();
    for p in &tile.pieces {
        for (g, off, n) in k.split(p.unit, p.local.clone()) {
            let start = p.at + off;
            let skip = start - cur;
            let from = p.local.start + off;
            parts[g].push(AdamWSlices {
                master: carve(&mut master, skip, n),
                grad: &grads.grad(p.unit)?[from..from + n],
                m: carve(&mut m, skip, n),
                v: carve(&mut v, skip, n),
                low: Some(carve(&mut low, skip, n)),
            });
            cur = start + n;
        }
    }
    for (k, parts) in k.ks.iter().zip(parts) {
        if !parts.is_empty() {
            adam.step_many(k, parts)?;
        }
    }
    Ok(())
}

/// Copies a tile's updated parameters from `staging` to the units'
/// parameter buffers.
fn copy_out<P: Element>(
    tile: &Tile,
    units: &[UnitRanges],
    unit_off: &[usize],
    staging: &[P],
    params: &mut [&mut [P]],
) {
    for p in &tile.pieces {
        let u = &units[p.unit];
        let src = unit_off[p.unit] + p.local.start;
        let dst = u.params.start + (p.local.start - u.real.start);
        params[p.unit][dst..dst + p.local.len()]
            .copy_from_slice(&staging[src..src + p.local.len()]);
    }
}

/// Where the step finds the gradients of a tile's units.
trait GradFeed<G: Element> {
    /// Before tile `t` of `tiles` is updated: the gradients of its units
    /// are available through [`GradFeed::grad`] until the next call.
    fn prepare(&mut self, tiles: &[Tile], t: usize) -> Result<()>;
    /// Unit `u`'s accumulated gradient (its home).
    fn grad(&self, u: usize) -> Result<&[G]>;
}

/// Every unit's gradient in host memory.
struct Resident<'a, G>(&'a [&'a [G]]);

impl<G: Element> GradFeed<G> for Resident<'_, G> {
    fn prepare(&mut self, _: &[Tile], _: usize) -> Result<()> {
        Ok(())
    }

    fn grad(&self, u: usize) -> Result<&[G]> {
        Ok(self.0[u])
    }
}

/// Streamed: each unit's gradient read from the gradient swap file when
/// its first tile comes up, the next unit's read ahead.
struct Swapped<'a> {
    swap: &'a mut GradSwap,
    /// The unit whose gradient is in `buf`.
    cur: Option<(usize, PooledBuffer)>,
}

impl<G: Element> GradFeed<G> for Swapped<'_> {
    fn prepare(&mut self, tiles: &[Tile], t: usize) -> Result<()> {
        let Some(u) = tiles[t].pieces.first().map(|p| p.unit) else {
            return Ok(());
        };
        if self.cur.as_ref().is_some_and(|(v, _)| *v == u) {
            return Ok(());
        }
        self.cur = None;
        self.cur = Some((u, self.swap.take(u)?));
        let next = tiles[t..]
            .iter()
            .filter_map(|x| x.pieces.first().map(|p| p.unit))
            .find(|&v| v != u);
        if let Some(v) = next {
            self.swap.read_ahead(v)?;
        }
        Ok(())
    }

    fn grad(&self, u: usize) -> Result<&[G]> {
        match &self.cur {
            Some((v, buf)) if *v == u => Ok(buf.as_slice_of::<G>()?),
            _ => Err(Error::Usage {
                rank: self.swap.rank(),
                what: format!("internal: unit #{u}'s gradient was not read for its tile"),
            }),
        }
    }
}

/// Where the step writes a tile's updated parameters.
trait ParamOut<P: Element> {
    /// Tile `t`'s part of the staging buffer.
    fn low(&mut self, tiles: &[Tile], t: usize) -> &mut [P];
    /// After tile `t`'s update.
    fn done(&mut self, tiles: &[Tile], t: usize) -> Result<()>;
}

/// The flat staging buffer over the whole state (copied out at commit).
struct Flat<'a, P>(&'a mut [P]);

impl<P: Element> ParamOut<P> for Flat<'_, P> {
    fn low(&mut self, tiles: &[Tile], t: usize) -> &mut [P] {
        &mut self.0[tiles[t].flat.clone()]
    }

    fn done(&mut self, _: &[Tile], _: usize) -> Result<()> {
        Ok(())
    }
}

/// Streamed: a staging buffer of one unit, handed to `emit` after the
/// unit's last tile.
struct PerUnit<'a, 'e, P> {
    staging: &'a mut [P],
    unit_off: &'a [usize],
    units: &'a [UnitRanges],
    emit: &'a mut Emit<'e, P>,
}

/// `emit(unit, staged)`: unit `unit`'s updated parameters over its state
/// range (padding as zeros).
pub(crate) type Emit<'e, P> = dyn FnMut(usize, &[P]) -> Result<()> + 'e;

impl<P: Element> ParamOut<P> for PerUnit<'_, '_, P> {
    fn low(&mut self, tiles: &[Tile], t: usize) -> &mut [P] {
        let tile = &tiles[t];
        let u = tile.unit.expect("streamed tiles have a unit");
        let at = tile.flat.start - self.unit_off[u];
        &mut self.staging[at..at + tile.len()]
    }

    fn done(&mut self, tiles: &[Tile], t: usize) -> Result<()> {
        let u = tiles[t].unit.expect("streamed tiles have a unit");
        if tiles.get(t + 1).is_some_and(|n| n.unit == Some(u)) {
            return Ok(());
        }
        let n = self.units[u].state_len;
        (self.emit)(u, &self.staging[..n])
    }
}

/// What both nvme steps run on ([`Offload::nvme_step`]).
struct NvmeStep<'a, P> {
    pipe: Pipeline<'a>,
    /// The updated parameters, over the flat state (streamed: one unit).
    staging: &'a mut [P],
    units: &'a [UnitRanges],
    unit_off: &'a [usize],
}

/// The nvme step over the tiles (see the module docs): reads run
/// `schedule.ahead` tiles in front of the update, writes behind it (with
/// `write_behind`), within the pool's buffers.
struct Pipeline<'a> {
    tiles: &'a [Tile],
    pool: &'a HostPool,
    swap: &'a SwapFile,
    regions: &'a [RegionId],
    schedule: Schedule,
    trace: &'a RankTracer,
    kept: &'a mut [Option<Kept>],
    tracker: &'a MemoryTracker,
    /// Whether a tile whose write failed is kept in host memory (else the
    /// failure loses the state: streamed).
    keep: bool,
    /// The first failed write (its tile, and any later one that failed,
    /// are in `kept`).
    write_failed: Option<Error>,
}

impl Pipeline<'_> {
    /// Runs the step. An error loses the state (a failed read, or no host
    /// memory to keep a tile whose write failed): nothing more is
    /// submitted, every request is waited for (so every buffer is back in
    /// the pool) and the first such error is returned. A failed write is
    /// not an error here: its tile is kept and the step goes on.
    fn run<G: Element, P: Element>(
        &mut self,
        adam: &CpuAdamW,
        k: &GroupedStep<'_>,
        grads: &mut dyn GradFeed<G>,
        out: &mut dyn ParamOut<P>,
    ) -> Result<()> {
        let n = self.tiles.len();
        let mut reads: VecDeque<IoTicket<PooledBuffer>> =
            VecDeque::with_capacity(self.schedule.ahead + 1);
        let mut writes: VecDeque<(usize, IoTicket<PooledBuffer>)> =
            VecDeque::with_capacity(self.pool.buffer_count());
        let mut next = 0;
        let mut lost: Option<Error> = None;
        'tiles: for (t, tile) in self.tiles.iter().enumerate() {
            // Writes already done give their buffers back (and a failure
            // is kept now rather than at the end).
            while writes.front().is_some_and(|(_, w)| w.is_complete()) {
                let (i, w) = writes.pop_front().expect("checked above");
                if let Err(e) = self.land(i, w) {
                    lost = Some(e);
                    break 'tiles;
                }
            }
            // Tile t's read and those ahead of it. Without a free buffer,
            // wait for the oldest write, but keep the newest one running
            // behind the update unless tile t itself needs its buffer.
            let last = (t + self.schedule.ahead).min(n - 1);
            while next <= last {
                if self.pool.available() == 0 {
                    let must = next == t;
                    if writes.len() > 1 || (must && !writes.is_empty()) {
                        let (i, w) = writes.pop_front().expect("checked above");
                        let span = self.trace.io_wait(Io::Write, "swap write");
                        let landed = self.land(i, w);
                        drop(span);
                        if let Err(e) = landed {
                            lost = Some(e);
                            break 'tiles;
                        }
                        continue;
                    }
                    if !must {
                        break;
                    }
                }
                match self.pool.acquire(self.tiles[next].bytes()) {
                    Ok(buf) => {
                        let id = self.regions[next];
                        self.trace
                            .io_bytes(Io::Read, self.swap.region_len(id).unwrap_or(0));
                        reads.push_back(self.swap.read(id, buf));
                        next += 1;
                    }
                    Err(e) => {
                        lost = Some(e.into());
                        break 'tiles;
                    }
                }
            }
            let r = reads.pop_front().expect("tile t's read was submitted");
            let span = self.trace.io_wait(Io::Read, "swap read");
            let read = r.wait();
            drop(span);
            let mut buf = match read {
                Ok(b) => b,
                Err(e) => {
                    lost = Some(e.error.into());
                    break;
                }
            };
            if let Err(e) = grads.prepare(self.tiles, t) {
                lost = Some(e);
                break;
            }
            let span = self.trace.span("adam tile", "optimizer");
            let updated = buf
                .as_mut_slice_of::<f32>()
                .map_err(Error::from)
                .and_then(|s| {
                    let low = out.low(self.tiles, t);
                    update_tile(adam, k, tile, &mut s[..3 * tile.len()], &*grads, low)
                });
            drop(span);
            if let Err(e) = updated.and_then(|()| out.done(self.tiles, t)) {
                lost = Some(e);
                break;
            }
            let id = self.regions[t];
            self.trace
                .io_bytes(Io::Write, self.swap.region_len(id).unwrap_or(0));
            let w = self.swap.write(id, buf);
            if self.schedule.write_behind {
                writes.push_back((t, w));
            } else {
                let span = self.trace.io_wait(Io::Write, "swap write");
                let landed = self.land(t, w);
                drop(span);
                if let Err(e) = landed {
                    lost = Some(e);
                    break;
                }
            }
        }
        // Reads left over only after an error.
        let span = (!reads.is_empty()).then(|| self.trace.io_wait(Io::Read, "swap read"));
        for r in reads {
            if let Err(e) = r.wait() {
                lost.get_or_insert(e.error.into());
            }
        }
        drop(span);
        let _span = (!writes.is_empty()).then(|| self.trace.io_wait(Io::Write, "swap write"));
        for (i, w) in writes {
            if let Err(e) = self.land(i, w) {
                lost.get_or_insert(e);
            }
        }
        match lost {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Waits for tile `t`'s write. If it failed, keeps the tile's updated
    /// state (the buffer the request hands back) in host memory and
    /// records the error; an error returned here (no memory for it) loses
    /// the state.
    fn land(&mut self, t: usize, w: IoTicket<PooledBuffer>) -> Result<()> {
        let IoError { error, buffer } = match w.wait() {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        if !self.keep {
            return Err(error.into());
        }
        let len = 3 * self.tiles[t].len();
        let mut state = Vec::new();
        let kept = state
            .try_reserve_exact(len)
            .map_err(|_| {
                io_error(
                    self.swap,
                    format!(
                        "{error}; and the {} bytes of host memory to keep tile {t}'s updated \
                         state could not be allocated: the optimizer state is lost",
                        len * 4
                    ),
                )
            })
            .and_then(|()| Ok(buffer.as_slice_of::<f32>()?));
        let src = kept?;
        state.extend_from_slice(&src[..len]);
        drop(buffer);
        let n = self.tiles[t].len() as u64;
        self.kept[t] = Some(Kept {
            state,
            _allocs: [
                self.tracker.allocate(Tier::Host, Category::Master, 4 * n),
                self.tracker.allocate(Tier::Host, Category::Moments, 8 * n),
            ],
        });
        self.write_failed.get_or_insert(error.into());
        Ok(())
    }
}

/// An I/O error about the swap file.
fn io_error(swap: &SwapFile, msg: String) -> Error {
    zero_core::Error::Io {
        path: swap.path().to_path_buf(),
        msg,
    }
    .into()
}

/// The error of a step whose failed writes were rescued: the first write
/// error, saying what was kept.
fn rescued_error(first: Error, kept: &[Option<Kept>], tiles: &[Tile]) -> Error {
    let (count, bytes) = kept
        .iter()
        .zip(tiles)
        .filter(|(k, _)| k.is_some())
        .fold((0, 0), |(c, b), (_, t)| (c + 1, b + t.bytes()));
    let written = tiles.len() - count;
    let note = format!(
        "the step completed: {count} of its {} tiles could not be written and their updated \
         state is kept in host memory ({bytes} bytes); the other {written} were written",
        tiles.len()
    );
    match first {
        Error::Core(zero_core::Error::Io { path, msg }) => zero_core::Error::Io {
            path,
            msg: format!("{msg}; {note}"),
        }
        .into(),
        other => other,
    }
}
