//! Sharded checkpoints: save, exact resume, reshard on load.
//!
//! # Layout
//!
//! [`Engine::save_checkpoint`] writes `root/step{global_steps:08}/`
//! (optimizer-step boundaries, skipped fp16 steps included, as DeepSpeed's
//! `global_step{N}` tags):
//!
//! ```text
//!  manifest.json    format, version, world size, stage, dtype, steps
//!                   (applied and global), loss scaler, seed, resolved
//!                   config, units (names, tensors, numel, shard_len),
//!                   per-file bytes and CRC32 per block, client_state
//!  rank00000.bin    header: "ZEROCKPT", u32 LE version, u32 LE rank
//!  rank00001.bin    then per unit u, over E_r(u) = shard_range(r) ∩ 0..numel:
//!  …                  master[E_r(u)] | m[E_r(u)] | v[E_r(u)]   (f32 LE)
//!  model.safetensors  only with stage3_gather_16bit_weights_on_model_save:
//!                     the consolidated weights in the parameter dtype
//!                     (listed in the manifest's optional `model`; see
//!                     `src/engine/export.rs`)
//! ```
//!
//! The files of the saving world hold every real element exactly once,
//! whatever the stage (a stage-0 rank holds the whole state but writes only
//! its `E_r`). Parameters are not stored: in this engine the parameter in
//! the training dtype is always `P::from_f32(master)` (initialised from the
//! same f32 value, rewritten from the new master by every update), so load
//! casts the master.
//!
//! # Atomicity
//!
//! ```text
//!  rank 0: mkdir root/.tmp-stepN-<id>        ── exchange (id) ──
//!  all:    write + fsync rankR.bin            ── exchange (CRCs) ──
//!  all:    gather unit by unit; rank 0 writes model.safetensors (optional)
//!  rank 0: manifest.json + fsync, fsync dir, rename → root/stepN, fsync root,
//!          latest.tmp + fsync → rename latest, fsync root, prune keep_last
//!                                             ── exchange (verdict) ──
//! ```
//!
//! A crash at any point leaves the previous checkpoint (and `latest`)
//! intact or the new one complete; `.tmp-*` directories are ignored by
//! [`Engine::load_checkpoint`].
//!
//! # Load and reshard
//!
//! The saving plan is rebuilt from the manifest (the same
//! [`PartitionPlan::new`] on the saved units and world size). Each rank
//! reads only the byte ranges of the saved files that hold the elements it
//! needs now: its state range (the whole unit in stage 0, its shard from
//! stage 1 on), whose master it also casts into its parameters. A stage
//! 1–2 rank holds the whole unit's parameters but casts only its range:
//! once every rank has loaded, the parameters are all-gathered as after an
//! optimizer step. Reads go whole blocks straight into the rank's store
//! (host buffers, the offloaded tiles, the parameter home)
//! [`DIRECT_BLOCKS`] at a time and the ends of each range through a
//! window of [`READ_BLOCKS`] blocks, sequentially (the kernel reads
//! ahead), verifying the CRC of every block read. Without parameter
//! offload the files are read one after the other, each front to back
//! (unit by unit, master, m, v), so the window serves the block two
//! consecutive ranges share and no block is read twice
//! ([`EngineStats::checkpoint_read_bytes`](super::EngineStats) counts the
//! bytes). With optimizer offload the state is read tile by tile (each
//! piece's master also cast into the parameters), every array in turn, so
//! a block two ranges of one file share is read again where another file
//! was read in between. With parameter offload the parameters' homes are
//! written unit by unit, reading the master a second time when the
//! optimizer state is offloaded too.
//!
//! # Page cache
//!
//! Rank files stream through the page cache once: the save writes behind
//! (starts each write's writeback, waits for and drops what lies
//! [`WRITE_BEHIND`] bytes back, drops the rest after the fsync), the load
//! drops what it has read where no other loading rank reads it too. The
//! files do not crowd the trainer's memory out of the cache, and the
//! stream reuses the same few pages instead of taking fresh ones, which
//! can be slow (see the `cache` module: 4–5× on the development VM).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use zero_comm::agree::{exchange_u64, first_failure};
use zero_comm::Communicator;
use zero_core::optim::LossScaler;
use zero_core::partition::{PartitionPlan, TensorSpec, UnitLayout, UnitSpec};
use zero_core::{bf16, f16, DType, Element};

use super::export::{ExportDtype, MODEL_FILE};
use super::param_offload::ParamOffload;
use super::{Engine, EngineBuilder, Init, StepOutcome, Unit};
use crate::agree::agree_on_setup;
use crate::{Error, Result};

/// The `format` of a checkpoint manifest.
pub const CHECKPOINT_FORMAT: &str = "zero-checkpoint";
/// The manifest and rank-file version this build writes and reads.
pub const CHECKPOINT_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"ZEROCKPT";
const HEADER: u64 = 16;
/// Bytes per CRC32 block of a rank file.
const BLOCK: usize = 1 << 20;
/// The write buffer of a rank file.
const WRITE_BUF: usize = 4 << 20;
/// Blocks read (and verified) at once through a reader's window: the
/// ends of each read, and reads without a whole block.
const READ_BLOCKS: usize = 4;
/// Whole blocks read (and verified) at once straight into the
/// destination; costs no buffer.
const DIRECT_BLOCKS: usize = 8;
/// Elements of the master outside the state range converted at once on
/// load before the cast to the parameter dtype.
const CAST_CHUNK: usize = 1 << 16;
/// Bytes a rank file's write-behind lets run ahead of the disk: once a
/// written range is this far behind the newest write, the writer waits
/// for its writeback and drops it from the page cache.
const WRITE_BEHIND: u64 = 2 * WRITE_BUF as u64;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct TensorEntry {
    name: String,
    shape: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct UnitEntry {
    name: String,
    tensors: Vec<TensorEntry>,
    numel: usize,
    shard_len: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct FileEntry {
    name: String,
    bytes: u64,
    block_size: u64,
    crc32: Vec<u32>,
}

/// The consolidated 16-bit weights written into the checkpoint directory
/// when `stage3_gather_16bit_weights_on_model_save` is set.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ModelFileEntry {
    name: String,
    /// The safetensors dtype: `BF16`, `F16` or `F32` (the parameter dtype).
    dtype: String,
    bytes: u64,
    /// CRC32 of the whole file.
    crc32: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Manifest {
    format: String,
    version: u32,
    world_size: usize,
    stage: u8,
    param_dtype: String,
    steps: u64,
    global_steps: u64,
    loss_scaler: Option<LossScaler>,
    seed: u64,
    config: Value,
    units: Vec<UnitEntry>,
    files: Vec<FileEntry>,
    client_state: Value,
    /// Absent unless `stage3_gather_16bit_weights_on_model_save` (manifests
    /// without it stay version 1 and load as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model: Option<ModelFileEntry>,
}

fn ck(path: &Path, what: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

fn io<'p>(path: &'p Path, op: &str) -> impl FnOnce(std::io::Error) -> Error + 'p {
    let op = op.to_string();
    move |e| ck(path, format!("{op}: {e}"))
}

fn rank_file(r: usize) -> String {
    format!("rank{r:05}.bin")
}

/// Page-cache hints for streaming a rank file through the page cache
/// once: start the writeback of what was just written, wait for it, and
/// drop pages once they are on disk (save) or consumed (load).
///
/// Why: a checkpoint streams gigabytes that nobody reads again soon. Left
/// in the page cache they evict what the trainer uses; and every page the
/// page cache takes from the free lists can be a page the OS has not
/// touched for a while. On a VM with free-page reporting (the balloon
/// hands free guest memory back to the host) such a page costs a host
/// fault on first use: a buffered stream into untouched pages ran at
/// 0.23 GB/s (write) and 0.34 GB/s (read) on the development VM, against
/// 1.2 and 1.1–1.5 GB/s when each range is dropped right after use, so
/// that the next range reuses the pages just freed. Only hints: failures
/// are ignored (the final fsync reports write errors).
mod cache {
    use std::fs::File;

    /// `posix_fadvise(POSIX_FADV_DONTNEED)` over `off..off + len`: clean
    /// pages leave the page cache (partial pages at the ends stay).
    pub(super) fn drop_range(file: &File, off: u64, len: u64) {
        sys::fadvise_dontneed(file, off, len);
    }

    /// Starts the writeback of `off..off + len` without waiting.
    pub(super) fn start_writeback(file: &File, off: u64, len: u64) {
        sys::sync_range(file, off, len, false);
    }

    /// Writes `off..off + len` back, waits for it, and drops it.
    pub(super) fn write_back_and_drop(file: &File, off: u64, len: u64) {
        sys::sync_range(file, off, len, true);
        drop_range(file, off, len);
    }

    #[cfg(target_os = "linux")]
    mod sys {
        use std::fs::File;
        use std::os::fd::AsRawFd;

        fn arg(x: u64) -> libc::off_t {
            libc::off_t::try_from(x).unwrap_or(libc::off_t::MAX)
        }

        fn arg64(x: u64) -> libc::off64_t {
            libc::off64_t::try_from(x).unwrap_or(libc::off64_t::MAX)
        }

        pub(in super::super) fn fadvise_dontneed(file: &File, off: u64, len: u64) {
            if len == 0 {
                return;
            }
            // SAFETY: the descriptor stays open for the call (`file` is
            // borrowed); the call reads only its integer arguments.
            unsafe {
                libc::posix_fadvise(
                    file.as_raw_fd(),
                    arg(off),
                    arg(len),
                    libc::POSIX_FADV_DONTNEED,
                )
            };
        }

        pub(in super::super) fn sync_range(file: &File, off: u64, len: u64, wait: bool) {
            if len == 0 {
                return;
            }
            let flags = if wait {
                libc::SYNC_FILE_RANGE_WAIT_BEFORE
                    | libc::SYNC_FILE_RANGE_WRITE
                    | libc::SYNC_FILE_RANGE_WAIT_AFTER
            } else {
                libc::SYNC_FILE_RANGE_WRITE
            };
            // SAFETY: as above: an open descriptor and integers.
            unsafe { libc::sync_file_range(file.as_raw_fd(), arg64(off), arg64(len), flags) };
        }
    }

    #[cfg(not(target_os = "linux"))]
    mod sys {
        use std::fs::File;

        pub(in super::super) fn fadvise_dontneed(_: &File, _: u64, _: u64) {}
        pub(in super::super) fn sync_range(_: &File, _: u64, _: u64, _: bool) {}
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir, "fsync of the directory"))
}

/// Writes a rank file at arbitrary positions through one buffer of
/// [`WRITE_BUF`] bytes, coalescing contiguous writes into writes that end
/// at multiples of [`WRITE_BUF`] (the whole ones straight from the
/// caller's memory), with write-behind while the writes are sequential
/// (see [`cache`]: the file does not stay in the page cache, and the
/// pages it passes through are reused). The CRC32 of every
/// [`BLOCK`] is computed as the bytes go by while the writes are
/// sequential; otherwise (nvme-offloaded state arrives tile by tile, its
/// master, m and v at three places of the file) by reading the file back
/// block by block at the end.
struct RankWriter {
    file: File,
    path: PathBuf,
    buf: Vec<u8>,
    buf_at: u64,
    next: u64,
    sequential: bool,
    hasher: crc32fast::Hasher,
    in_block: usize,
    crcs: Vec<u32>,
    /// Write-behind (sequential writes only): bytes `..behind` are on
    /// disk and out of the page cache, `behind..buf_at` written and their
    /// writeback started.
    behind: u64,
}

impl RankWriter {
    fn create(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .write(true)
            .read(true)
            .create_new(true)
            .open(path)
            .map_err(io(path, "create"))?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
            buf: Vec::with_capacity(WRITE_BUF),
            buf_at: 0,
            next: 0,
            sequential: true,
            hasher: crc32fast::Hasher::new(),
            in_block: 0,
            crcs: Vec::new(),
            behind: 0,
        })
    }

    /// Writes `bytes` at `at`; with sequential writes, starts their
    /// writeback and waits for and drops what lies more than
    /// [`WRITE_BEHIND`] bytes behind them (write-behind, see [`cache`]).
    fn write_out(&mut self, at: u64, bytes: &[u8]) -> Result<()> {
        self.file
            .write_all_at(bytes, at)
            .map_err(io(&self.path, "write"))?;
        if self.sequential {
            let end = at + bytes.len() as u64;
            cache::start_writeback(&self.file, at, bytes.len() as u64);
            let upto = end.saturating_sub(WRITE_BEHIND) & !0xfff;
            if upto > self.behind {
                cache::write_back_and_drop(&self.file, self.behind, upto - self.behind);
                self.behind = upto;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if !self.buf.is_empty() {
            let buf = std::mem::take(&mut self.buf);
            let r = self.write_out(self.buf_at, &buf);
            self.buf = buf;
            r?;
            self.buf_at += self.buf.len() as u64;
            self.buf.clear();
        }
        Ok(())
    }

    fn hash(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = bytes.len().min(BLOCK - self.in_block);
            self.hasher.update(&bytes[..n]);
            self.in_block += n;
            bytes = &bytes[n..];
            if self.in_block == BLOCK {
                let h = std::mem::replace(&mut self.hasher, crc32fast::Hasher::new());
                self.crcs.push(h.finalize());
                self.in_block = 0;
            }
        }
    }

    /// Writes `bytes` at `pos`, in pieces that end at multiples of
    /// [`WRITE_BUF`] in the file: a piece that fills its whole rest of such
    /// a chunk goes straight from `bytes` to the file, others are gathered
    /// in the buffer (which so never holds more than one chunk).
    fn write(&mut self, pos: u64, mut bytes: &[u8]) -> Result<()> {
        if pos != self.next {
            self.sequential = false;
        }
        self.next = pos + bytes.len() as u64;
        if !self.buf.is_empty() && pos != self.buf_at + self.buf.len() as u64 {
            self.flush()?;
        }
        if self.buf.is_empty() {
            self.buf_at = pos;
        }
        let chunk = WRITE_BUF as u64;
        while !bytes.is_empty() {
            // File position of bytes[0] and the room to the chunk's end.
            let at = self.buf_at + self.buf.len() as u64;
            let room = ((at / chunk + 1) * chunk - at) as usize;
            let n = bytes.len().min(room);
            let (piece, rest) = bytes.split_at(n);
            if self.sequential {
                self.hash(piece);
            }
            if self.buf.is_empty() && n == room {
                self.write_out(at, piece)?;
                self.buf_at = at + n as u64;
            } else {
                self.buf.extend_from_slice(piece);
                if n == room {
                    self.flush()?;
                }
            }
            bytes = rest;
        }
        Ok(())
    }

    fn write_f32(&mut self, pos: u64, values: &[f32]) -> Result<()> {
        if cfg!(target_endian = "little") {
            return self.write(pos, bytemuck::cast_slice(values));
        }
        let mut at = pos;
        for chunk in values.chunks(4096) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
            self.write(at, &bytes)?;
            at += bytes.len() as u64;
        }
        Ok(())
    }

    /// Flushes and fsyncs the file: its length and per-block CRCs.
    fn finish(mut self, len: u64) -> Result<(u64, Vec<u32>)> {
        self.flush()?;
        let written = self.file.metadata().map_err(io(&self.path, "stat"))?.len();
        if written != len {
            return Err(ck(
                &self.path,
                format!("wrote {written} bytes, expected {len}"),
            ));
        }
        if self.sequential && self.next == len {
            if self.in_block > 0 {
                let h = std::mem::replace(&mut self.hasher, crc32fast::Hasher::new());
                self.crcs.push(h.finalize());
            }
        } else {
            self.crcs.clear();
            let mut block = vec![0u8; BLOCK];
            let mut at = 0u64;
            while at < len {
                let n = (len - at).min(BLOCK as u64) as usize;
                self.file
                    .read_exact_at(&mut block[..n], at)
                    .map_err(io(&self.path, "read back for the CRC"))?;
                self.crcs.push(crc32fast::hash(&block[..n]));
                at += n as u64;
            }
        }
        self.file.sync_all().map_err(io(&self.path, "fsync"))?;
        // Nobody reads the file soon: it leaves the page cache.
        cache::drop_range(&self.file, 0, len);
        Ok((len, self.crcs))
    }
}

/// Where each unit's master, m and v lie in one rank file.
struct FileMap {
    /// `E_r(u)` per unit, in unit coordinates.
    ranges: Vec<Range<usize>>,
    /// Byte offset of each unit's master.
    base: Vec<u64>,
    /// The file's length.
    len: u64,
}

impl FileMap {
    fn new(layouts: &[UnitLayout], rank: usize) -> Self {
        let mut at = HEADER;
        let mut ranges = Vec::with_capacity(layouts.len());
        let mut base = Vec::with_capacity(layouts.len());
        for l in layouts {
            let e = l.real_range(rank);
            base.push(at);
            at += 12 * e.len() as u64;
            ranges.push(e);
        }
        Self {
            ranges,
            base,
            len: at,
        }
    }

    /// Byte offset of element `i` (unit coordinates, within `E_r(u)`) of
    /// array `kind` (0 master, 1 m, 2 v) of unit `u`.
    fn offset(&self, u: usize, kind: usize, i: usize) -> u64 {
        let e = &self.ranges[u];
        self.base[u] + 4 * (kind * e.len() + (i - e.start)) as u64
    }
}

/// A verified run of blocks of one rank file, kept after the read that
/// loaded it: consecutive reads (a chunk and the next, an array and the
/// next one of the file) share their boundary block, which is then read
/// and verified once.
struct Window {
    /// The saved rank whose file it is.
    file: usize,
    /// Byte offset of its first byte (a block boundary).
    start: u64,
    /// Bytes of `buf` that hold the window.
    len: usize,
    /// [`READ_BLOCKS`] × [`BLOCK`] bytes once used.
    buf: Vec<u8>,
}

impl Window {
    fn holds(&self, file: usize, at: u64) -> bool {
        self.file == file && self.start <= at && at < self.start + self.len as u64
    }
}

/// Reads element ranges of the saved state, verifying the CRC of every
/// block it reads.
///
/// ```text
///  bytes [off, end) of file s:   |  ·[===|=======|=======|====]·  |
///                                   head     whole blocks     tail
///  head, tail, and reads with no whole block: through the window
///  (≤ READ_BLOCKS blocks, ending at the last block the read needs)
///  whole blocks (little-endian hosts): pread straight into the
///  destination, DIRECT_BLOCKS at a time, CRCs checked there
/// ```
///
/// The window stays cached, so the block a read shares with the next one
/// (an array's last and the next array's first, a chunk's last and the
/// next chunk's first) is read once.
pub(super) struct Reader<'a> {
    dir: &'a Path,
    manifest: &'a Manifest,
    maps: Vec<FileMap>,
    files: Vec<Option<File>>,
    win: Window,
    /// Drop the blocks read from the page cache once they are verified
    /// and copied (see [`Reader::drop_behind`]).
    drop_behind: bool,
    /// Bytes read from the rank files so far.
    pub(super) bytes_read: u64,
}

/// The CRC of block `bi` of the rank file `entry`, whose bytes are
/// `bytes`, is the manifest's.
fn verify(path: &Path, entry: &FileEntry, bi: u64, bytes: &[u8]) -> Result<()> {
    let crc = crc32fast::hash(bytes);
    let want = entry.crc32.get(bi as usize).copied();
    if want == Some(crc) {
        return Ok(());
    }
    let a = bi * BLOCK as u64;
    Err(ck(
        path,
        format!(
            "block {bi} (bytes {a}..{}) is corrupted: CRC32 {crc:#010x}, the manifest says {}",
            a + bytes.len() as u64,
            want.map_or("nothing".to_string(), |w| format!("{w:#010x}"))
        ),
    ))
}

/// Fills `buf` with the blocks of the rank file `entry` from block
/// `first` on and verifies them; `buf` ends at a block boundary or at the
/// file's end. With `drop_behind`, the bytes leave the page cache once
/// read.
fn read_blocks(
    file: &File,
    path: &Path,
    entry: &FileEntry,
    first: u64,
    buf: &mut [u8],
    drop_behind: bool,
) -> Result<()> {
    let start = first * BLOCK as u64;
    let n = buf.len();
    debug_assert!(start + n as u64 <= entry.bytes);
    file.read_exact_at(buf, start)
        .map_err(|e| ck(path, format!("read of {n} bytes at byte {start}: {e}")))?;
    if drop_behind {
        cache::drop_range(file, start, n as u64);
    }
    for (k, bytes) in buf.chunks(BLOCK).enumerate() {
        verify(path, entry, first + k as u64, bytes)?;
    }
    Ok(())
}

/// `dst[k] = f32::from_le_bytes(src[4k..4k + 4])`.
fn le_to_f32(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), 4 * dst.len());
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(src);
    } else {
        for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

impl<'a> Reader<'a> {
    pub(super) fn new(dir: &'a Path, manifest: &'a Manifest, saved: &PartitionPlan) -> Self {
        let maps = (0..manifest.world_size)
            .map(|s| FileMap::new(saved.units(), s))
            .collect();
        Self {
            dir,
            manifest,
            maps,
            files: (0..manifest.world_size).map(|_| None).collect(),
            win: Window {
                file: usize::MAX,
                start: 0,
                len: 0,
                buf: Vec::new(),
            },
            drop_behind: false,
            bytes_read: 0,
        }
    }

    /// Whether the reads that follow drop what they read from the page
    /// cache (off by default). Worth it for bytes that no other rank of
    /// the loading world and no later read of this one needs: they would
    /// otherwise stay cached for nobody, and each read would take fresh
    /// pages (see [`cache`]) instead of reusing the ones just dropped.
    pub(super) fn drop_behind(&mut self, on: bool) {
        self.drop_behind = on;
    }

    /// The parts of `kind[unit][abs]` in the saved files: `(s, lo..hi,
    /// off)`, elements `lo..hi` (unit coordinates) at byte `off` of file
    /// `s`, in element order.
    fn parts(
        &self,
        unit: usize,
        kind: usize,
        abs: Range<usize>,
    ) -> Vec<(usize, Range<usize>, u64)> {
        (0..self.maps.len())
            .filter_map(|s| {
                let e = &self.maps[s].ranges[unit];
                let lo = abs.start.max(e.start);
                let hi = abs.end.min(e.end);
                (lo < hi).then(|| (s, lo..hi, self.maps[s].offset(unit, kind, lo)))
            })
            .collect()
    }

    /// The open file `s`, its path and manifest entry.
    fn file(&mut self, s: usize) -> Result<(&File, PathBuf, &'a FileEntry)> {
        let entry = &self.manifest.files[s];
        let path = self.dir.join(&entry.name);
        if self.files[s].is_none() {
            self.files[s] = Some(File::open(&path).map_err(io(&path, "open"))?);
        }
        Ok((self.files[s].as_ref().expect("opened"), path, entry))
    }

    /// `out[k] = kind[unit][abs.start + k]`.
    pub(super) fn read_into(
        &mut self,
        unit: usize,
        kind: usize,
        abs: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        debug_assert_eq!(abs.len(), out.len());
        for (s, r, off) in self.parts(unit, kind, abs.clone()) {
            let dst = &mut out[r.start - abs.start..r.end - abs.start];
            self.read_file(s, off, dst)?;
        }
        Ok(())
    }

    /// Calls `f(i, bytes)` for consecutive pieces of `kind[unit][abs]`, in
    /// order, through the window: `bytes` holds elements `i..i +
    /// bytes.len() / 4` (unit coordinates) as f32 LE, from verified blocks.
    pub(super) fn for_each(
        &mut self,
        unit: usize,
        kind: usize,
        abs: Range<usize>,
        mut f: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        for (s, r, off) in self.parts(unit, kind, abs) {
            let end = off + 4 * r.len() as u64;
            self.windowed(s, off, end, |at, bytes| {
                f(r.start + ((at - off) / 4) as usize, bytes)
            })?;
        }
        Ok(())
    }

    /// Fills `out` from file `s` at byte `off`: its whole blocks straight
    /// into `out`, the rest through the window.
    fn read_file(&mut self, s: usize, off: u64, out: &mut [f32]) -> Result<()> {
        let end = off + 4 * out.len() as u64;
        let bytes = self.manifest.files[s].bytes;
        let block = BLOCK as u64;
        // Whole blocks in [off, end): the file's last block is whole when
        // the read reaches the end of the file.
        let (b0, b1) = (
            off.div_ceil(block),
            if end == bytes {
                end.div_ceil(block)
            } else {
                end / block
            },
        );
        let mut copy = |at: u64, src: &[u8]| {
            let d = ((at - off) / 4) as usize;
            le_to_f32(src, &mut out[d..d + src.len() / 4]);
        };
        if cfg!(target_endian = "big") || b0 >= b1 {
            return self.windowed(s, off, end, copy);
        }
        let (lo, hi) = (b0 * block, (b1 * block).min(bytes));
        self.windowed(s, off, lo, &mut copy)?;
        let drop = self.drop_behind;
        let (file, path, entry) = self.file(s)?;
        let direct: &mut [u8] = bytemuck::cast_slice_mut(out);
        let direct = &mut direct[(lo - off) as usize..(hi - off) as usize];
        for (k, chunk) in direct.chunks_mut(DIRECT_BLOCKS * BLOCK).enumerate() {
            let first = b0 + (k * DIRECT_BLOCKS) as u64;
            read_blocks(file, &path, entry, first, chunk, drop)?;
        }
        self.bytes_read += hi - lo;
        self.windowed(s, hi, end, |at, src| {
            let d = ((at - off) / 4) as usize;
            le_to_f32(src, &mut out[d..d + src.len() / 4]);
        })
    }

    /// Calls `f(at, bytes)` for consecutive pieces of bytes `off..end` of
    /// file `s`, from the window, loading windows as needed.
    fn windowed(
        &mut self,
        s: usize,
        off: u64,
        end: u64,
        mut f: impl FnMut(u64, &[u8]),
    ) -> Result<()> {
        if off >= end {
            return Ok(());
        }
        let block = BLOCK as u64;
        let last = (end - 1) / block;
        let mut at = off;
        while at < end {
            if !self.win.holds(s, at) {
                let b = at / block;
                let n = (last - b + 1).min(READ_BLOCKS as u64);
                self.win.file = usize::MAX;
                let mut buf = std::mem::take(&mut self.win.buf);
                buf.resize(READ_BLOCKS * BLOCK, 0);
                let drop = self.drop_behind;
                let (file, path, entry) = self.file(s)?;
                let len = (((b + n) * block).min(entry.bytes) - b * block) as usize;
                let read = read_blocks(file, &path, entry, b, &mut buf[..len], drop);
                self.bytes_read += len as u64;
                self.win = Window {
                    file: if read.is_ok() { s } else { usize::MAX },
                    start: b * block,
                    len,
                    buf,
                };
                read?;
            }
            let w = &self.win;
            let hi = end.min(w.start + w.len as u64);
            let a = (at - w.start) as usize;
            f(at, &w.buf[a..a + (hi - at) as usize]);
            at = hi;
        }
        Ok(())
    }
}

/// The checkpoint directory `path` names (itself, or `latest` under it)
/// and its manifest.
fn read_manifest(path: &Path) -> Result<(PathBuf, Manifest)> {
    let dir = if path.join("manifest.json").is_file() {
        path.to_path_buf()
    } else {
        let latest = path.join("latest");
        if !latest.is_file() {
            // A save killed between renaming its directory into place and
            // writing `latest` (the first save, or `latest` deleted): the
            // newest `step*` directory, which is complete (only finished
            // checkpoints are renamed into place).
            return match newest_step_dir(path) {
                Some(dir) => read_manifest(&dir),
                None => Err(ck(
                    path,
                    "neither a checkpoint directory (no manifest.json) nor a checkpoint root (no \
                     `latest` file, no step* directory)",
                )),
            };
        }
        let name = fs::read_to_string(&latest).map_err(io(&latest, "read"))?;
        let name = name.trim();
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            return Err(ck(
                &latest,
                format!("does not name a checkpoint directory: `{name}`"),
            ));
        }
        let dir = path.join(name);
        if !dir.join("manifest.json").is_file() {
            return Err(ck(
                &dir.join("manifest.json"),
                format!("missing (named by {})", latest.display()),
            ));
        }
        dir
    };
    let mpath = dir.join("manifest.json");
    let text = fs::read_to_string(&mpath).map_err(io(&mpath, "read"))?;
    let value: Value =
        serde_json::from_str(&text).map_err(|e| ck(&mpath, format!("not JSON: {e}")))?;
    match value.get("format").and_then(Value::as_str) {
        Some(CHECKPOINT_FORMAT) => {}
        other => {
            return Err(ck(
                &mpath,
                format!("not a zero checkpoint manifest (format {other:?}, expected \"{CHECKPOINT_FORMAT}\")"),
            ))
        }
    }
    match value.get("version").and_then(Value::as_u64) {
        Some(v) if v == u64::from(CHECKPOINT_VERSION) => {}
        other => {
            return Err(ck(
                &mpath,
                format!(
                    "unknown manifest version {} (this build reads version {CHECKPOINT_VERSION})",
                    other.map_or("(none)".to_string(), |v| v.to_string())
                ),
            ))
        }
    }
    let manifest: Manifest = serde_json::from_value(value)
        .map_err(|e| ck(&mpath, format!("malformed manifest: {e}")))?;
    Ok((dir, manifest))
}

/// The saved units must be the registered ones; returns the saving plan.
fn check_units(
    mpath: &Path,
    m: &Manifest,
    specs: &[(UnitSpec, Vec<Init>)],
) -> Result<PartitionPlan> {
    let n = m.units.len().max(specs.len());
    for i in 0..n {
        match (m.units.get(i), specs.get(i)) {
            (Some(s), None) => {
                return Err(ck(
                    mpath,
                    format!(
                        "unit `{}` (#{i}) is in the checkpoint but was not registered",
                        s.name
                    ),
                ))
            }
            (None, Some((r, _))) => {
                return Err(ck(
                    mpath,
                    format!(
                        "unit `{}` (#{i}) was registered but is not in the checkpoint",
                        r.name
                    ),
                ))
            }
            (Some(s), Some((r, _))) => {
                if s.name != r.name {
                    return Err(ck(
                        mpath,
                        format!(
                            "unit #{i} is `{}` in the checkpoint but `{}` in the model",
                            s.name, r.name
                        ),
                    ));
                }
                let saved: Vec<(&str, &[usize])> = s
                    .tensors
                    .iter()
                    .map(|t| (t.name.as_str(), &t.shape[..]))
                    .collect();
                let model: Vec<(&str, &[usize])> = r
                    .tensors
                    .iter()
                    .map(|t| (t.name.as_str(), &t.shape[..]))
                    .collect();
                if saved != model {
                    let fmt = |v: &[(&str, &[usize])]| {
                        v.iter()
                            .map(|(n, s)| format!("{n} {s:?}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    return Err(ck(
                        mpath,
                        format!(
                            "unit `{}`: the checkpoint has tensors [{}], the model [{}]",
                            s.name,
                            fmt(&saved),
                            fmt(&model)
                        ),
                    ));
                }
                if s.numel != r.numel() {
                    return Err(ck(
                        mpath,
                        format!(
                            "unit `{}`: {} elements in the checkpoint, {} in the model",
                            s.name,
                            s.numel,
                            r.numel()
                        ),
                    ));
                }
            }
            (None, None) => unreachable!(),
        }
    }
    saved_plan(mpath, m)
}

/// The plan the checkpoint was saved with, rebuilt from its manifest
/// (`mpath`) alone.
fn saved_plan(mpath: &Path, m: &Manifest) -> Result<PartitionPlan> {
    let specs: Vec<UnitSpec> = m
        .units
        .iter()
        .map(|u| {
            UnitSpec::new(
                u.name.clone(),
                u.tensors
                    .iter()
                    .map(|t| TensorSpec::new(t.name.clone(), &t.shape))
                    .collect(),
            )
        })
        .collect();
    if m.world_size == 0 {
        return Err(ck(mpath, "world_size is 0"));
    }
    let plan = PartitionPlan::new(&specs, m.world_size)?;
    for (l, u) in plan.units().iter().zip(&m.units) {
        if l.shard_len != u.shard_len {
            return Err(ck(
                mpath,
                format!(
                    "unit `{}`: shard_len {} in the manifest, but {} ranks give {} (a manifest \
                     from another partitioning rule)",
                    u.name, u.shard_len, m.world_size, l.shard_len
                ),
            ));
        }
    }
    Ok(plan)
}

/// Opens the checkpoint `path` names (a directory, or a root whose
/// `latest` names one) for reading without an engine: its directory,
/// manifest and saving plan, every rank file checked as on load.
pub(super) fn open_saved(path: &Path) -> Result<(PathBuf, Manifest, PartitionPlan)> {
    let (dir, m) = read_manifest(path)?;
    let plan = saved_plan(&dir.join("manifest.json"), &m)?;
    check_files(&dir, &m, &plan)?;
    Ok((dir, m, plan))
}

/// Every rank file exists, has the manifest's length and CRC count, and a
/// header naming its rank.
fn check_files(dir: &Path, m: &Manifest, plan: &PartitionPlan) -> Result<()> {
    let mpath = dir.join("manifest.json");
    if m.files.len() != m.world_size {
        return Err(ck(
            &mpath,
            format!(
                "lists {} rank files for world_size {}",
                m.files.len(),
                m.world_size
            ),
        ));
    }
    for (s, f) in m.files.iter().enumerate() {
        if f.name != rank_file(s) {
            return Err(ck(
                &mpath,
                format!("file #{s} is `{}`, expected `{}`", f.name, rank_file(s)),
            ));
        }
        let path = dir.join(&f.name);
        let expect = FileMap::new(plan.units(), s).len;
        if f.bytes != expect || f.block_size != BLOCK as u64 {
            return Err(ck(
                &mpath,
                format!(
                    "`{}`: {} bytes in blocks of {}, but the units give {expect} bytes in blocks \
                     of {BLOCK}",
                    f.name, f.bytes, f.block_size
                ),
            ));
        }
        if f.crc32.len() != f.bytes.div_ceil(BLOCK as u64) as usize {
            return Err(ck(
                &mpath,
                format!("`{}`: {} CRCs for {} bytes", f.name, f.crc32.len(), f.bytes),
            ));
        }
        let mut file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ck(
                    &path,
                    format!(
                        "missing rank file (rank {s} of the {} saving ranks)",
                        m.world_size
                    ),
                ))
            }
            Err(e) => return Err(ck(&path, format!("open: {e}"))),
        };
        let len = file.metadata().map_err(io(&path, "stat"))?.len();
        if len != f.bytes {
            let how = if len < f.bytes {
                "truncated"
            } else {
                "too long"
            };
            return Err(ck(
                &path,
                format!("{how}: {len} bytes, the manifest says {}", f.bytes),
            ));
        }
        let mut head = [0u8; HEADER as usize];
        file.read_exact(&mut head)
            .map_err(io(&path, "read of the header"))?;
        if &head[..8] != MAGIC {
            return Err(ck(
                &path,
                "not a zero checkpoint rank file (bad magic, a foreign file)",
            ));
        }
        let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        let rank = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
        if version != CHECKPOINT_VERSION {
            return Err(ck(
                &path,
                format!("rank file version {version}, this build reads {CHECKPOINT_VERSION}"),
            ));
        }
        if rank as usize != s {
            return Err(ck(&path, format!("holds rank {rank}, expected rank {s}")));
        }
    }
    Ok(())
}

/// Deletes the oldest `step*` directories under `root` beyond the newest
/// `keep` (`newest`, the one just published and named by `latest`, is
/// always kept, even if older ones have higher step numbers); what could
/// not be deleted, as warnings.
fn prune(root: &Path, newest: &str, keep: usize) -> Vec<String> {
    let Ok(entries) = fs::read_dir(root) else {
        return vec![format!(
            "checkpoint {}: cannot list it to delete old checkpoints",
            root.display()
        )];
    };
    let mut steps: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n.len() > 4 && n.starts_with("step") && n[4..].bytes().all(|b| b.is_ascii_digit())
        })
        .filter(|n| n != newest)
        .collect();
    steps.sort_by_key(|n| n[4..].parse::<u64>().unwrap_or(0));
    let extra = steps.len().saturating_sub(keep.saturating_sub(1));
    steps[..extra]
        .iter()
        .filter_map(|n| {
            fs::remove_dir_all(root.join(n)).err().map(|e| {
                format!(
                    "checkpoint {}: cannot delete it (keep_last {keep}): {e}",
                    root.join(n).display()
                )
            })
        })
        .collect()
}

impl<C: Communicator> Engine<C> {
    /// Saves a checkpoint to `root/step{N:08}`, `N` the
    /// [`Engine::global_steps`], and returns its path; a
    /// collective, at an optimizer-step boundary only (no micro-batch in
    /// progress, no gradient buffer out). Each rank writes its part of the
    /// fp32 master, m and v (read through the offload store piece by piece
    /// when offloaded); rank 0 writes `manifest.json` (with `client_state`,
    /// the trainer's own JSON: data position, RNG, …), renames the
    /// directory into place, points `root/latest` at it and deletes the
    /// oldest checkpoints beyond [`EngineBuilder::keep_last_checkpoints`].
    /// Every rank returns `Ok` only if every rank's part succeeded. The
    /// format and the crash safety are described in
    /// `src/engine/checkpoint.rs`. With a tracer, each rank records the
    /// span `checkpoint write` (its rank file, through the fsync).
    pub fn save_checkpoint(&mut self, root: &Path, client_state: Value) -> Result<PathBuf> {
        self.guard(|e| e.save_inner(root, client_state))
    }

    fn save_inner(&mut self, root: &Path, client_state: Value) -> Result<PathBuf> {
        self.check_swap("save_checkpoint")?;
        let ga = self.cfg.gradient_accumulation_steps;
        if self.micro != 0 {
            return Err(self.usage(format!(
                "save_checkpoint: in the middle of gradient accumulation ({} of {ga} micro-batches \
                 done); save after the step() that ends the accumulation window",
                self.micro
            )));
        }
        if let Some(u) = self.units.iter().find(|u| u.lent) {
            return Err(self.usage(format!(
                "save_checkpoint: the gradient buffer of unit `{}` is out; hand it back and call \
                 step() first",
                u.layout.name
            )));
        }
        if let Some(u) = self.units.iter().find(|u| u.ready) {
            return Err(self.usage(format!(
                "save_checkpoint: a micro-batch is in progress (unit `{}` is grad_ready); call \
                 step() first",
                u.layout.name
            )));
        }
        if self.open.is_some() || !self.inflight.is_empty() {
            return Err(self.usage(
                "save_checkpoint: gradient reductions are in flight; call step() first".into(),
            ));
        }
        let rank = self.rank;
        let name = format!("step{:08}", self.global_steps);
        let dest = root.join(&name);
        // Round 1: rank 0 makes the temporary directory.
        let prep = if rank == 0 {
            prepare(root, &dest, &name)
        } else {
            Ok(0)
        };
        let id = *prep.as_ref().unwrap_or(&0);
        let words = exchange_u64(&self.comm, &[u64::from(prep.is_err()), id])?;
        if words[0][0] != 0 {
            let why = first_failure(&self.comm, prep.as_ref().err())?;
            prep?;
            return Err(self.usage(format!(
                "save_checkpoint: rank 0 could not create the checkpoint directory under {}: {}",
                root.display(),
                why.map_or_else(String::new, |(_, w)| w)
            )));
        }
        let tmp = root.join(format!(".tmp-{name}-{:016x}", words[0][1]));
        // Round 2: every rank writes its file; rank 0 learns the CRCs.
        let written = {
            let _span = self.tracer.span(rank, "checkpoint write", "checkpoint");
            self.write_rank_file(&tmp.join(rank_file(rank)))
        };
        let (bytes, crcs) = match &written {
            Ok((b, c)) => (*b, c.clone()),
            Err(_) => (0, Vec::new()),
        };
        let head = exchange_u64(
            &self.comm,
            &[u64::from(written.is_err()), bytes, crcs.len() as u64],
        )?;
        let max = head.iter().map(|w| w[2] as usize).max().unwrap_or(0).max(1);
        let mut mine: Vec<u64> = crcs.iter().map(|&c| u64::from(c)).collect();
        mine.resize(max, 0);
        let all = exchange_u64(&self.comm, &mine)?;
        if head.iter().any(|w| w[0] != 0) {
            // Every rank knows: share the first failure's text.
            let failed = first_failure(&self.comm, written.as_ref().err())?;
            if rank == 0 {
                let _ = fs::remove_dir_all(&tmp);
            }
            written?;
            let (bad, why) = failed.expect("a rank failed");
            return Err(self.usage(format!(
                "save_checkpoint: rank {bad} could not write its rank file: {why}; no checkpoint \
                 was written"
            )));
        }
        // `stage3_gather_16bit_weights_on_model_save`: the consolidated
        // weights in the parameter dtype, inside the temporary directory so
        // that the rename publishes them with the rest (a collective).
        let model = if self.cfg.zero.gather_16bit_weights_on_model_save {
            let dtype = ExportDtype::of(self.pdt);
            match self.export_inner(&tmp.join(MODEL_FILE), dtype) {
                Ok(written) => written.map(|(bytes, crc32)| ModelFileEntry {
                    name: MODEL_FILE.into(),
                    dtype: dtype.safetensors_name().into(),
                    bytes,
                    crc32,
                }),
                Err(e) => {
                    if rank == 0 {
                        let _ = fs::remove_dir_all(&tmp);
                    }
                    return Err(e);
                }
            }
        } else {
            None
        };
        // Round 3: rank 0 writes the manifest and publishes the checkpoint.
        let done = if rank == 0 {
            let files = (0..self.world)
                .map(|r| FileEntry {
                    name: rank_file(r),
                    bytes: head[r][1],
                    block_size: BLOCK as u64,
                    crc32: all[r][..head[r][2] as usize]
                        .iter()
                        .map(|&c| c as u32)
                        .collect(),
                })
                .collect();
            let mut manifest = self.manifest(files, client_state);
            manifest.model = model;
            let r = publish(root, &tmp, &dest, &name, &manifest, self.keep_last);
            if r.is_err() {
                let _ = fs::remove_dir_all(&tmp);
            }
            r
        } else {
            Ok(Vec::new())
        };
        let failed = first_failure(&self.comm, done.as_ref().err())?;
        for w in done? {
            self.warn(w);
        }
        if let Some((_, why)) = failed {
            return Err(self.usage(format!(
                "save_checkpoint: rank 0 could not publish {}: {why}",
                dest.display()
            )));
        }
        Ok(dest)
    }

    fn manifest(&self, files: Vec<FileEntry>, client_state: Value) -> Manifest {
        Manifest {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            world_size: self.world,
            stage: self.stage,
            param_dtype: self.pdt.to_string(),
            steps: self.steps,
            global_steps: self.global_steps,
            loss_scaler: self.scaler.clone(),
            seed: self.seed,
            config: serde_json::to_value(&self.cfg).unwrap_or(Value::Null),
            units: self
                .plan
                .units()
                .iter()
                .map(|l| UnitEntry {
                    name: l.name.clone(),
                    tensors: l
                        .tensors
                        .iter()
                        .map(|t| TensorEntry {
                            name: t.name.clone(),
                            shape: t.shape.clone(),
                        })
                        .collect(),
                    numel: l.numel,
                    shard_len: l.shard_len,
                })
                .collect(),
            files,
            client_state,
            model: None,
        }
    }

    /// Start of unit `i`'s state range, in unit coordinates.
    fn state_base(&self, i: usize) -> usize {
        if self.stage == 0 {
            0
        } else {
            self.rank * self.units[i].layout.shard_len
        }
    }

    /// Writes and fsyncs this rank's file: its length and block CRCs.
    fn write_rank_file(&self, path: &Path) -> Result<(u64, Vec<u32>)> {
        let layouts: Vec<UnitLayout> = self.units.iter().map(|u| u.layout.clone()).collect();
        let map = FileMap::new(&layouts, self.rank);
        let mut w = RankWriter::create(path)?;
        let mut head = [0u8; HEADER as usize];
        head[..8].copy_from_slice(MAGIC);
        head[8..12].copy_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
        head[12..16].copy_from_slice(&(self.rank as u32).to_le_bytes());
        w.write(0, &head)?;
        let bases: Vec<usize> = (0..self.units.len()).map(|i| self.state_base(i)).collect();
        match &self.offload {
            Some(off) => off.visit(|u, local, master, m, v| {
                let abs = local.start + bases[u]..local.end + bases[u];
                let e = &map.ranges[u];
                let (lo, hi) = (abs.start.max(e.start), abs.end.min(e.end));
                if lo >= hi {
                    return Ok(());
                }
                let s = lo - abs.start..hi - abs.start;
                w.write_f32(map.offset(u, 0, lo), &master[s.clone()])?;
                w.write_f32(map.offset(u, 1, lo), &m[s.clone()])?;
                w.write_f32(map.offset(u, 2, lo), &v[s])
            })?,
            None => {
                for (u, unit) in self.units.iter().enumerate() {
                    let e = &map.ranges[u];
                    if e.is_empty() {
                        // A shard made only of padding.
                        continue;
                    }
                    let s = e.start - bases[u]..e.end - bases[u];
                    w.write_f32(map.offset(u, 0, e.start), &unit.master[s.clone()])?;
                    w.write_f32(map.offset(u, 1, e.start), &unit.m[s.clone()])?;
                    w.write_f32(map.offset(u, 2, e.start), &unit.v[s])?;
                }
            }
        }
        w.finish(map.len)
    }

    /// Builds the engine from `builder` (the trainer registered the same
    /// units as when saving) and loads the checkpoint at `path` into it: a
    /// collective. `path` is a checkpoint directory (with `manifest.json`)
    /// or a root whose `latest` file names one. The checkpoint may come
    /// from any world size, stage and offload mode: each rank reads only
    /// the byte ranges it needs, verifying their blocks' CRCs. Restores the
    /// parameters (cast from the fp32 master), master, m, v, the step count
    /// (and with it the learning-rate schedule) and the loss scaler, and
    /// returns the trainer's `client_state`. On any error (a missing,
    /// truncated, corrupted or foreign file, an unknown manifest version,
    /// units that differ from the registered ones) no engine is returned;
    /// the error names the file and what is wrong. The registered initial
    /// values are not computed (the load overwrites them). With a tracer
    /// ([`EngineBuilder::tracer`]) each rank records the spans
    /// `checkpoint build` (building the engine) and `checkpoint load`
    /// (reading the state into it).
    pub fn load_checkpoint(builder: EngineBuilder<C>, path: &Path) -> Result<(Engine<C>, Value)> {
        let read = read_manifest(path).and_then(|(dir, m)| {
            let plan = check_units(&dir.join("manifest.json"), &m, &builder.specs)?;
            check_files(&dir, &m, &plan)?;
            Ok((dir, m, plan))
        });
        let (dir, manifest, saved) = agree_on_setup(
            &builder.comm,
            read,
            "checkpoint (its manifest.json and rank files",
        )?;
        // The load overwrites every real element of the master and the
        // parameters (padding is zero either way) and m, v start at zero:
        // the build need not compute the registered initial values.
        let mut builder = builder;
        for (_, inits) in &mut builder.specs {
            inits.fill(Init::Zeros);
        }
        builder.for_load = true;
        let (tracer, rank) = (builder.tracer.clone(), builder.comm.rank());
        let t0 = Instant::now();
        let built = builder.build();
        tracer.record(rank, "checkpoint build", "checkpoint", t0, Instant::now());
        let mut engine = built?;
        let loaded = {
            let _span = tracer.span(rank, "checkpoint load", "checkpoint");
            engine.load_state(&dir, &manifest, &saved)
        };
        let failed = first_failure(&engine.comm, loaded.as_ref().err())?;
        loaded?;
        if let Some((bad, why)) = failed {
            return Err(Error::Usage {
                rank: engine.rank,
                what: format!(
                    "load_checkpoint({}): rank {bad} could not load its part: {why}",
                    dir.display()
                ),
            });
        }
        // Collectives only once every rank has its part: stages 1–2
        // all-gather the parameters each rank cast from its master range,
        // stage 3 gathers its persistent units.
        {
            let _span = tracer.span(rank, "checkpoint gather", "checkpoint");
            engine.gather_updated_params()?;
            engine.finish_param_gathers()?;
        }
        Ok((engine, manifest.client_state))
    }

    fn load_state(&mut self, dir: &Path, m: &Manifest, saved: &PartitionPlan) -> Result<()> {
        let mut reader = Reader::new(dir, m, saved);
        let (stage, rank, pdt) = (self.stage, self.rank, self.pdt);
        let bases: Vec<usize> = (0..self.units.len()).map(|i| self.state_base(i)).collect();
        let mut scratch = vec![0f32; CAST_CHUNK];
        let Engine {
            units,
            offload,
            poff,
            ..
        } = self;
        // Drop-behind (see `Reader::drop_behind`) for what only this rank
        // reads, once: from stage 1 on the ranks' state ranges are
        // disjoint and each reads only its own (the parameters of a stage
        // 1–2 rank are cast from its range and all-gathered afterwards);
        // the master on its last read (the parameters below read it again
        // when the optimizer state is offloaded). A stage-0 rank reads
        // everything: other ranks read those bytes too, and find them in
        // the page cache.
        let own_state = stage >= 1;
        // The offloaded optimizer state, tile by tile. Its pieces cover
        // the rank's parameter range, so each is also cast into the
        // parameters, unless those are offloaded too (their homes are then
        // written unit by unit below, reading the master a second time).
        let cast_in_fill = poff.is_none();
        if let Some(off) = offload.as_mut() {
            off.fill(|u, local, master, mm, v| {
                let abs = local.start + bases[u]..local.end + bases[u];
                reader.drop_behind(own_state && cast_in_fill);
                reader.read_into(u, 0, abs.clone(), master)?;
                if cast_in_fill {
                    let p = units[u]
                        .params
                        .as_mut()
                        .expect("params are home outside collectives");
                    // The parameters hold the whole unit in stages 0–2
                    // and the rank's shard (from bases[u]) in stage 3.
                    let pbase = if stage == 3 { bases[u] } else { 0 };
                    p.store_slice(abs.start - pbase, master);
                }
                reader.drop_behind(own_state);
                reader.read_into(u, 1, abs.clone(), mm)?;
                reader.read_into(u, 2, abs, v)
            })?;
        }
        // Without any offload, file by file and in each file unit by
        // unit: every file is read front to back, and the one window
        // (`Reader`) serves the block two consecutive reads share, so no
        // block is read twice. With parameter offload, unit by unit (each
        // unit's home is written once), every file in turn for each array.
        // With optimizer offload only, the fill above did everything.
        reader.drop_behind(own_state);
        let passes: Vec<Option<usize>> = match poff {
            None if cast_in_fill && offload.is_some() => Vec::new(),
            None => (0..m.world_size).map(Some).collect(),
            Some(_) => vec![None],
        };
        for pass in passes {
            for (i, unit) in units.iter_mut().enumerate() {
                let clip = match pass {
                    Some(s) => saved.units()[i].real_range(s),
                    None => 0..unit.layout.numel,
                };
                load_unit(
                    &mut reader,
                    (i, unit),
                    clip,
                    (stage, rank, pdt),
                    (offload.is_some(), bases[i]),
                    poff.as_mut(),
                    &mut scratch,
                )?;
            }
        }
        // The parameter homes' swap writes are queued: done before any
        // read of them (a gather right after the load read blocks whose
        // write had not completed, and found them never written).
        if let Some(po) = poff.as_mut() {
            po.flush()?;
        }
        self.steps = m.steps;
        self.global_steps = m.global_steps;
        if self.scaler.is_some() {
            if let Some(s) = &m.loss_scaler {
                self.scaler = Some(s.clone());
            }
        }
        self.last = StepOutcome {
            boundary: false,
            skipped: false,
            grad_norm: None,
            lr: self.lr(),
            loss_scale: self.loss_scale(),
            steps: self.steps,
        };
        self.stats.checkpoint_read_bytes = reader.bytes_read;
        Ok(())
    }
}

/// Loads the part of unit `i` that lies in the element range `clip` of
/// the saved unit: its master over the rank's parameter range, cast into
/// the parameters (or their offloaded home), and its optimizer state (not
/// with optimizer offload: `offloaded`; that is filled tile by tile
/// before). `sbase` is the unit's first element in the rank's state.
fn load_unit(
    reader: &mut Reader<'_>,
    (i, unit): (usize, &mut Unit),
    clip: Range<usize>,
    (stage, rank, pdt): (u8, usize, DType),
    (offloaded, state_base): (bool, usize),
    poff: Option<&mut ParamOffload>,
    scratch: &mut [f32],
) -> Result<()> {
    let Unit {
        layout: l,
        params,
        master,
        m: mm,
        v,
        ..
    } = unit;
    let within = |r: Range<usize>| {
        let start = r.start.max(clip.start);
        start..r.end.min(clip.end).max(start)
    };
    // The parameter range this rank casts from the master: the whole unit
    // in stage 0, the rank's real range from stage 1 on (equal to its
    // state range; stages 1–2 hold the whole unit's parameters and
    // all-gather the other ranks' ranges once every rank has loaded,
    // stage 3 holds only the shard).
    let (prange, pbase) = match stage {
        0 => (0..l.numel, 0),
        3 => (l.real_range(rank), rank * l.shard_len),
        _ => (l.real_range(rank), 0),
    };
    let (state, sbase) = match (offloaded, stage) {
        (true, _) => (0..0, 0),
        (false, 0) => (0..l.numel, 0),
        (false, _) => (l.real_range(rank), state_base),
    };
    let (prange, state) = (within(prange), within(state));
    let mut job = MasterLoad {
        reader: &mut *reader,
        unit: i,
        params: prange,
        state: state.clone(),
        master: &mut master[..],
        sbase,
        scratch,
    };
    match poff {
        Some(po) => match pdt {
            DType::F32 => job.run_home::<f32>(po, pbase)?,
            DType::BF16 => job.run_home::<bf16>(po, pbase)?,
            DType::F16 => job.run_home::<f16>(po, pbase)?,
        },
        None => {
            let p = params
                .as_mut()
                .expect("params are home outside collectives");
            job.run(|at, x| p.store_slice(at - pbase, x))?;
        }
    }
    if !state.is_empty() {
        let s = state.start - sbase..state.end - sbase;
        reader.read_into(i, 1, state.clone(), &mut mm[s.clone()])?;
        reader.read_into(i, 2, state, &mut v[s])?;
    }
    Ok(())
}

/// One read of unit `unit`'s saved master over the parameter range
/// `params` (unit coordinates), which contains the state range `state`:
/// the part in `state` goes into `master` (`master[k]` holds element
/// `sbase + k`), and every element is handed on as f32 to be cast to the
/// parameter dtype, from `master` where it went there and through
/// `scratch` ([`CAST_CHUNK`] elements) elsewhere.
struct MasterLoad<'r, 'a, 'b> {
    reader: &'r mut Reader<'a>,
    unit: usize,
    params: Range<usize>,
    state: Range<usize>,
    master: &'b mut [f32],
    sbase: usize,
    scratch: &'b mut [f32],
}

impl MasterLoad<'_, '_, '_> {
    /// Reads the master, calling `cast(i, x)` for consecutive pieces:
    /// `x[k]` is element `i + k`.
    fn run(&mut self, mut cast: impl FnMut(usize, &[f32])) -> Result<()> {
        let (params, state) = (self.params.clone(), self.state.clone());
        if state.is_empty() {
            return self.outside(params, &mut cast);
        }
        debug_assert!(params.start <= state.start && state.end <= params.end);
        self.outside(params.start..state.start, &mut cast)?;
        let x = &mut self.master[state.start - self.sbase..state.end - self.sbase];
        self.reader.read_into(self.unit, 0, state.clone(), x)?;
        cast(state.start, x);
        self.outside(state.end..params.end, &mut cast)
    }

    /// The master over `r`, outside the state range, through `scratch`.
    fn outside(&mut self, r: Range<usize>, cast: &mut impl FnMut(usize, &[f32])) -> Result<()> {
        let scratch = &mut *self.scratch;
        self.reader.for_each(self.unit, 0, r, |at, bytes| {
            let n = scratch.len();
            for (k, src) in bytes.chunks(4 * n).enumerate() {
                let x = &mut scratch[..src.len() / 4];
                le_to_f32(src, x);
                cast(at + k * n, x);
            }
        })
    }

    /// [`MasterLoad::run`] into unit `unit`'s offloaded parameter home
    /// (its shard starts at element `pbase`).
    fn run_home<P: Element>(&mut self, po: &mut ParamOffload, pbase: usize) -> Result<()> {
        po.write_with::<P>(self.unit, |home| {
            self.run(|at, x| {
                for (d, s) in home[at - pbase..at - pbase + x.len()].iter_mut().zip(x) {
                    *d = P::from_f32(*s);
                }
            })
        })
    }
}

/// The `step*` directory of `root` with the highest step that has a
/// manifest.
fn newest_step_dir(root: &Path) -> Option<PathBuf> {
    fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step: u64 = name.strip_prefix("step")?.parse().ok()?;
            e.path()
                .join("manifest.json")
                .is_file()
                .then_some((step, e.path()))
        })
        .max_by_key(|(step, _)| *step)
        .map(|(_, p)| p)
}

/// Rank 0: `root` exists, `dest` does not; makes the temporary directory
/// and returns its id.
fn prepare(root: &Path, dest: &Path, name: &str) -> Result<u64> {
    fs::create_dir_all(root).map_err(io(root, "create the checkpoint root"))?;
    if dest.exists() {
        let latest = fs::read_to_string(root.join("latest")).unwrap_or_default();
        if latest.trim() == name {
            return Err(ck(
                dest,
                "already exists and `latest` names it (this step was saved before); not \
                 overwriting it",
            ));
        }
        // Left by a save that was interrupted after its rename but before
        // `latest` named it; a run resumed from `latest` saves this step
        // again, so the new save replaces it.
        fs::remove_dir_all(dest).map_err(io(dest, "replace (an interrupted save's copy)"))?;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let id = nanos ^ (u64::from(std::process::id()) << 32);
    let tmp = root.join(format!(".tmp-{name}-{id:016x}"));
    fs::create_dir(&tmp).map_err(io(&tmp, "create"))?;
    Ok(id)
}

/// Rank 0, after every rank file is written and fsynced: the manifest,
/// the rename into place, `latest`, and the pruning; warnings of the
/// pruning.
fn publish(
    root: &Path,
    tmp: &Path,
    dest: &Path,
    name: &str,
    manifest: &Manifest,
    keep_last: usize,
) -> Result<Vec<String>> {
    let mpath = tmp.join("manifest.json");
    let text = serde_json::to_string_pretty(manifest)
        .map_err(|e| ck(&mpath, format!("serialize: {e}")))?;
    let mut f = File::create(&mpath).map_err(io(&mpath, "create"))?;
    f.write_all(text.as_bytes()).map_err(io(&mpath, "write"))?;
    f.sync_all().map_err(io(&mpath, "fsync"))?;
    drop(f);
    sync_dir(tmp)?;
    if dest.exists() {
        return Err(ck(
            dest,
            "already exists (this step was saved before); not overwriting it",
        ));
    }
    fs::rename(tmp, dest).map_err(io(dest, "rename into place"))?;
    sync_dir(root)?;
    let ltmp = root.join("latest.tmp");
    let latest = root.join("latest");
    let mut f = File::create(&ltmp).map_err(io(&ltmp, "create"))?;
    f.write_all(name.as_bytes()).map_err(io(&ltmp, "write"))?;
    f.sync_all().map_err(io(&ltmp, "fsync"))?;
    drop(f);
    fs::rename(&ltmp, &latest).map_err(io(&latest, "rename into place"))?;
    sync_dir(root)?;
    Ok(if keep_last > 0 {
        prune(root, name, keep_last)
    } else {
        Vec::new()
    })
}
