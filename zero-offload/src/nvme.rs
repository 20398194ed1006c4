//! The NVMe tier: per-rank swap files of checksummed, block-aligned regions,
//! read and written asynchronously with `O_DIRECT`.
//!
//! # Layout
//!
//! One [`SwapFile`] per rank and purpose (optimizer state, parameters) lives
//! under `nvme_path`, named `zero-swap-<tag>-rank<r>-<run id>.swp`: the run id
//! is fresh per run, so a file is never reused across runs, and a stale file
//! of the same name is replaced. It is removed on drop (clean shutdown).
//!
//! ```text
//!   offset 0                 H                H+k*B
//!   +------------------------+----------------+------------------+-- ...
//!   | header (H bytes,       | region "m"     | region "v"       |
//!   |  a multiple of B)      | ceil(len/B)    | starts on a      |
//!   | magic, version, run id,|   blocks of B  |   block boundary |
//!   | rank, B, region table, |                |                  |
//!   | CRC32 of the header    |                |                  |
//!   +------------------------+----------------+------------------+-- ...
//!   B = aio.block_size (default 1 MiB, a multiple of 4096)
//! ```
//!
//! # Integrity
//!
//! Every data block has a CRC32 (`crc32fast`) of the region bytes it holds,
//! kept in memory when the block is written and checked when it is read.
//! The file belongs to this run only, so the checksums need not be stored
//! in it. A read fails, naming the file, region, block and offset, when the
//! file is shorter than the block (truncated), when a checksum differs
//! (corruption), or when the block was never written. [`SwapFile::verify`],
//! which the engine calls once per step, re-reads the header (a foreign or
//! overwritten header is an error), checks that the file was not deleted
//! (`st_nlink == 0`) or truncated, and returns failures of requests whose
//! tickets were dropped without waiting.
//!
//! # I/O engine
//!
//! A request (read or write of a region, or of a block-aligned range of one)
//! is split into `block_size` pieces. A pool of threads takes pieces in
//! submission order and runs positioned reads and writes (`pread`/`pwrite`)
//! on the one file descriptor, and the CRC32 of each piece, off the caller's
//! thread. A thread takes, with a piece, the pieces queued right behind it
//! that continue it (the same request, the next bytes of the file and of
//! the buffer), up to [`SwapOptions::max_transfer`] bytes (8 MiB), and
//! moves them in one call: each block keeps its own checksum and its own
//! error, and the first failing block in file order is the request's error
//! as before. On this project's VMs 1 MiB requests (`aio.block_size`'s
//! default) reach only part of the disk: `cargo bench --bench offload`
//! measured the swap path (one I/O thread) at 42-57% (write), 60-69%
//! (read) and 62-65% (the step's pattern) of the best raw `O_DIRECT` pass
//! with 1 MiB transfers and at 64-72%, 82% and 80-85% with 8 MiB ones
//! while other builds ran on the 2 vCPUs; on the quiet machine the gain is
//! smaller (65-70% → 67-81%; see the README's offload section).
//!
//! At most `min(queue_depth, thread_count + 1)` transfers (pieces, or runs
//! of joined pieces) are in flight at once (`thread_count` is DeepSpeed
//! `aio.intra_op_parallelism` / `thread_count`), and the pool has one
//! thread more than that, `thread_count + 2`, so that checksums do not
//! take a transfer's place: a thread gives its transfer slot back as soon
//! as its bytes are moved, then checksums them (a read checks its blocks;
//! a write computes theirs from the buffer it just wrote, which does not
//! change while the request owns it) while another thread starts the next
//! transfer. With `queue_depth` 1 a thread holds the slot until the run
//! is reported, so runs start and complete strictly in submission order.
//! The CRC32
//! (`crc32fast`) runs at ~20-30 GB/s on one core over data not in cache;
//! timed inside the bench's passes the I/O threads spent ~5% of their time
//! in it and ~95% in transfers, but on the 2 vCPUs loaded by other work
//! (load 5-6) a build with the checksums left out read 12-19% and wrote
//! ~57% faster: the checksum's share grows with the competition for the
//! CPU, which the raw baseline does not need. Before, a thread held its
//! slot through its checksums, and the pool was `thread_count + 1`
//! threads: the swap path ran at 58-84% (write), 76-80% (read) and 68-77%
//! (step pattern) of the raw baseline in `cargo bench --bench offload`,
//! and at 84-87%, 83-86% and 83-85% after (three runs each, alternated;
//! the README's offload section has more).
//! Reading through a small per-thread staging buffer and copying out
//! (memory just used takes the VM's disk reads faster, see the README's
//! offload section) was tried and gained nothing measurable. So did, on
//! 2026-11-26, one read transfer at a time through two 4 MiB staging
//! buffers with the copy and checksum on another thread: a standalone
//! program read 768 MiB that way at 3.1-3.2 GB/s against 2.7 GB/s
//! straight into the state's memory, but half an hour later at 2.5-2.8
//! against 2.6-2.7 GB/s, and the swap path built on it read at 78% of the
//! raw baseline where the path without it read at 85% in the same rounds.
//!
//! Why threads and not `io_uring` or libaio: on this class of machine
//! (MEASUREMENTS.md) `O_DIRECT` sequential throughput was the same with
//! io_uring and libaio and did not move with queue depth or block size
//! (write ~1.4 GB/s, read ~1.1 GB/s sustained), so a thread pool of
//! positioned calls reaches the disk's rate with no extra dependency and no
//! kernel-version requirements; the `#[ignore]`d test `swap_vs_raw_bandwidth`
//! in `tests/nvme.rs` compares the swap path with raw `O_DIRECT` I/O.
//!
//! Requests are asynchronous: [`SwapFile::write`] and [`SwapFile::read`] take
//! the buffer by value and return an [`IoTicket`]; [`IoTicket::wait`] gives
//! the buffer back, also on failure (inside [`IoError`]), so the caller's
//! data survives a failed write. A pipeline over tiles reads tile `i+1`
//! while it computes on tile `i` and writes tile `i-1`:
//!
//! ```no_run
//! use zero_offload::nvme::{RegionSpec, SwapFile, SwapOptions};
//! use zero_offload::AlignedBuf;
//!
//! let tile = 4 << 20;
//! let regions: Vec<RegionSpec> = (0..8).map(|i| RegionSpec::new(format!("m{i}"), tile)).collect();
//! let swap = SwapFile::create(SwapOptions::new("/local_nvme", 0), &regions)?;
//! let ids: Vec<_> = regions.iter().map(|r| swap.region(&r.name)).collect::<Result<_, _>>()?;
//! for &id in &ids {
//!     swap.write(id, AlignedBuf::new(tile as usize)?).wait()?; // initial state
//! }
//! let mut next = Some(swap.read(ids[0], AlignedBuf::new(tile as usize)?));
//! let mut writing = None;
//! for i in 0..ids.len() {
//!     let mut buf = next.take().map(|t| t.wait()).transpose()?.expect("submitted above");
//!     if i + 1 < ids.len() {
//!         next = Some(swap.read(ids[i + 1], AlignedBuf::new(tile as usize)?));
//!     }
//!     buf.as_mut_slice_of::<f32>()?.iter_mut().for_each(|x| *x += 1.0); // compute on tile i
//!     if let Some(w) = writing.replace(swap.write(ids[i], buf)) {
//!         drop(w.wait()?); // tile i-1 is on disk
//!     }
//! }
//! if let Some(w) = writing {
//!     drop(w.wait()?);
//! }
//! swap.verify()?;
//! # Ok::<(), zero_offload::Error>(())
//! ```
//!
//! If the filesystem rejects `O_DIRECT` (`EINVAL` at open or at the first
//! aligned transfer), the file falls back to buffered I/O and
//! [`SwapFile::warnings`] says so; nothing pretends to bypass the page cache.

use std::collections::VecDeque;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use zero_core::config::AioConfig;
use zero_core::memory::{Allocation, Category, MemoryTracker, Tier};

use crate::host::{round_up, AlignedBuf, PooledBuffer, PAGE_SIZE};
use crate::{Error, Result};

/// Locks `m`, also after a panic elsewhere poisoned it: every state behind
/// these mutexes is updated in single steps and stays consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------
// Buffers that requests can own
// ---------------------------------------------------------------------------

/// A buffer that a swap-file request can own while I/O threads read or
/// write its memory.
///
/// Implemented by [`AlignedBuf`] and [`PooledBuffer`].
///
/// # Safety
///
/// An implementor guarantees that [`io_ptr`](Self::io_ptr) returns a pointer
/// aligned to [`PAGE_SIZE`] and valid for reads and writes of
/// [`io_capacity`](Self::io_capacity) bytes; that the pointer stays valid,
/// at the same address, when the value is moved, until the value is
/// dropped; and that no other code reads or writes that memory while the
/// value is owned by a request (the memory is not shared through another
/// handle).
pub unsafe trait IoBuffer: Send + 'static {
    /// The first byte of the memory.
    fn io_ptr(&mut self) -> *mut u8;
    /// The length in bytes that the buffer exposes to its user.
    fn io_len(&self) -> usize;
    /// The bytes valid behind [`io_ptr`](Self::io_ptr) (at least `io_len`).
    fn io_capacity(&self) -> usize;
}

// SAFETY: AlignedBuf owns an mmap'd region at a fixed, page-aligned address
// that moves of the struct do not change; it is unmapped only on drop.
unsafe impl IoBuffer for AlignedBuf {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
    fn io_capacity(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: a PooledBuffer owns its AlignedBuf exclusively while lent out (the
// pool's slot is empty until the PooledBuffer drops), so the guarantees of
// AlignedBuf carry over.
unsafe impl IoBuffer for PooledBuffer {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
    fn io_capacity(&self) -> usize {
        self.capacity()
    }
}

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

/// Faults to inject, for tests of the error paths (feature `testing`; a
/// build without it has no fault path at all). Default: none.
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Fail the block write with this sequence number (0-based, counted
    /// over the file's life in the order the I/O threads start them) with
    /// `fail_write_errno`, as if the device had returned it. Default none.
    pub fail_write_at: Option<u64>,
    /// How many block writes fail, from `fail_write_at` on (0 counts as
    /// 1; `u64::MAX`: every later one, as on a full disk). Default 0.
    pub fail_write_count: u64,
    /// The errno of the injected write failure; 0 means `ENOSPC`.
    pub fail_write_errno: i32,
    /// Behave as if the filesystem rejected `O_DIRECT` with `EINVAL`.
    /// Default false.
    pub reject_direct_io: bool,
    /// Hold every block write this long before it reaches the file (its
    /// block reads as never written meanwhile), as a slow device: for
    /// tests that a caller waits for its writes. Default zero.
    pub write_delay: std::time::Duration,
}

#[cfg(feature = "testing")]
impl FaultPlan {
    /// Fails the `k`-th block write (0-based) with `ENOSPC`.
    pub fn enospc_at(k: u64) -> FaultPlan {
        FaultPlan {
            fail_write_at: Some(k),
            fail_write_count: 1,
            fail_write_errno: libc::ENOSPC,
            ..FaultPlan::default()
        }
    }

    /// Fails the `k`-th block write (0-based) and every later one with
    /// `ENOSPC`, as a disk that filled up.
    pub fn disk_full_from(k: u64) -> FaultPlan {
        FaultPlan {
            fail_write_count: u64::MAX,
            ..FaultPlan::enospc_at(k)
        }
    }

    /// Every block write held `delay` before it reaches the file.
    pub fn slow_writes(delay: std::time::Duration) -> FaultPlan {
        FaultPlan {
            write_delay: delay,
            ..FaultPlan::default()
        }
    }

    /// Whether the block write with sequence number `seq` fails.
    fn fails_write(&self, seq: u64) -> bool {
        self.fail_write_at
            .is_some_and(|k| seq >= k && seq - k < self.fail_write_count.max(1))
    }
}

/// Options of a [`SwapFile`].
#[derive(Debug, Clone)]
pub struct SwapOptions {
    /// The directory (DeepSpeed `offload_optimizer.nvme_path` /
    /// `offload_param.nvme_path`); created if missing. No default.
    pub dir: PathBuf,
    /// The rank, in the file name and the header. No default.
    pub rank: usize,
    /// What the file holds, in its name (`[A-Za-z0-9_-]`, 1 to 64
    /// characters). Default `"optimizer"`.
    pub tag: String,
    /// The run id in the file name and header; `None` draws a fresh one.
    /// Default none.
    pub run_id: Option<u64>,
    /// Block size in bytes (DeepSpeed `aio.block_size`; a multiple of
    /// 4096). Default 1048576.
    pub block_size: usize,
    /// Transfers (runs of joined pieces, see `max_transfer`) in flight at
    /// once (DeepSpeed `aio.queue_depth`); at most `thread_count + 1` are,
    /// whatever this says. Default 8.
    pub queue_depth: usize,
    /// I/O threads (DeepSpeed `aio.intra_op_parallelism`, formerly
    /// `thread_count`): `thread_count + 1` transfers are in flight at most
    /// (within `queue_depth`), and the pool runs one thread more, so that
    /// checksums overlap transfers (see the module docs). Default 1.
    pub thread_count: usize,
    /// The largest transfer, in bytes: an I/O thread joins consecutive
    /// blocks of one request, contiguous in the file and in the buffer, into
    /// one `pread`/`pwrite` of at most this many bytes (each block keeps its
    /// own checksum). zero's own setting: on the VMs measured, 4 MiB
    /// requests ran up to 2-3× faster than 1 MiB ones (the `aio.block_size`
    /// default), while a smaller block keeps checksums and errors
    /// fine-grained. A value at most `block_size` turns joining off.
    /// Default 8388608.
    pub max_transfer: usize,
    /// Open with `O_DIRECT` (falling back, with a warning, where the
    /// filesystem rejects it). Default true.
    pub direct_io: bool,
    /// Reserve the file's blocks at creation (`posix_fallocate`), so a full
    /// disk fails at start-up rather than in a step. Default true.
    pub preallocate: bool,
    /// Faults to inject (tests; feature `testing`). Default none.
    #[cfg(feature = "testing")]
    pub faults: FaultPlan,
}

impl SwapOptions {
    /// Options for rank `rank` under `dir`, with the defaults above.
    pub fn new(dir: impl Into<PathBuf>, rank: usize) -> SwapOptions {
        let aio = AioConfig::default();
        SwapOptions {
            dir: dir.into(),
            rank,
            tag: "optimizer".into(),
            run_id: None,
            block_size: aio.block_size,
            queue_depth: aio.queue_depth,
            thread_count: aio.thread_count,
            max_transfer: DEFAULT_MAX_TRANSFER,
            direct_io: true,
            preallocate: true,
            #[cfg(feature = "testing")]
            faults: FaultPlan::default(),
        }
    }

    /// Options taking `block_size`, `queue_depth` and `thread_count` from
    /// the resolved `aio` block.
    pub fn from_aio(dir: impl Into<PathBuf>, rank: usize, aio: &AioConfig) -> SwapOptions {
        SwapOptions {
            block_size: aio.block_size,
            queue_depth: aio.queue_depth,
            thread_count: aio.thread_count,
            ..SwapOptions::new(dir, rank)
        }
    }

    /// Whether the fault plan has the filesystem reject `O_DIRECT`: never
    /// without the feature `testing`.
    fn rejects_direct_io(&self) -> bool {
        #[cfg(feature = "testing")]
        return self.faults.reject_direct_io;
        #[cfg(not(feature = "testing"))]
        false
    }

    /// Checks the values; errors name the DeepSpeed key.
    fn validate(&self) -> Result<()> {
        if self.block_size == 0 || !self.block_size.is_multiple_of(PAGE_SIZE) {
            return Err(Error::Config {
                key: "aio.block_size".into(),
                msg: format!(
                    "{} is not a positive multiple of {PAGE_SIZE} (O_DIRECT alignment)",
                    self.block_size
                ),
            });
        }
        if self.queue_depth == 0 {
            return Err(Error::Config {
                key: "aio.queue_depth".into(),
                msg: "must be at least 1".into(),
            });
        }
        if self.thread_count == 0 {
            return Err(Error::Config {
                key: "aio.intra_op_parallelism".into(),
                msg: "must be at least 1".into(),
            });
        }
        let tag_ok = !self.tag.is_empty()
            && self.tag.len() <= 64
            && self
                .tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !tag_ok {
            return Err(Error::Io {
                path: self.dir.clone(),
                msg: format!(
                    "swap file tag {:?} must be 1 to 64 characters of [A-Za-z0-9_-]",
                    self.tag
                ),
            });
        }
        Ok(())
    }
}

/// A region to lay out in a swap file: a name and a length in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    /// Unique within the file, 1 to 255 bytes of UTF-8.
    pub name: String,
    /// Length in bytes, at least 1.
    pub len: u64,
}

impl RegionSpec {
    /// A region `name` of `len` bytes.
    pub fn new(name: impl Into<String>, len: u64) -> RegionSpec {
        RegionSpec {
            name: name.into(),
            len,
        }
    }
}

/// A region of a [`SwapFile`], from [`SwapFile::region`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionId(usize);

/// Where a region lies in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Region {
    name: String,
    /// File offset, a multiple of the block size.
    offset: u64,
    len: u64,
    /// Index of its first block in `FileShared::blocks`.
    first_block: usize,
}

// ---------------------------------------------------------------------------
// Header
// ---------------------------------------------------------------------------

const MAGIC: [u8; 8] = *b"ZEROSWAP";
const VERSION: u32 = 1;
/// Bytes before the region table.
const FIXED: usize = 8 + 4 + 4 + 8 + 8 + 8 + 8 + 4;

/// The header at offset 0 of a swap file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    run_id: u64,
    rank: u64,
    block_size: u64,
    total_len: u64,
    /// (name, offset, len)
    regions: Vec<(String, u64, u64)>,
}

impl Header {
    /// Little-endian: magic, version, encoded length (with the CRC), run id,
    /// rank, block size, file length, region count, then per region a u16
    /// name length, the name, offset and length, then the CRC32 of all
    /// bytes before it.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED + 4 + self.regions.len() * 32);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes()); // length, patched below
        out.extend_from_slice(&self.run_id.to_le_bytes());
        out.extend_from_slice(&self.rank.to_le_bytes());
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&self.total_len.to_le_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for (name, offset, len) in &self.regions {
            out.extend_from_slice(&(name.len() as u16).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        let total = (out.len() + 4) as u32;
        out[12..16].copy_from_slice(&total.to_le_bytes());
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Parses and checks a header; the error says what is wrong.
    fn decode(bytes: &[u8]) -> std::result::Result<Header, String> {
        let mut r = Reader { bytes, pos: 0 };
        let magic = r.take(8)?;
        if magic != MAGIC {
            return Err(format!(
                "bad magic {:02x?} (expected {:?}): not a zero swap file header",
                magic,
                String::from_utf8_lossy(&MAGIC)
            ));
        }
        let version = r.u32()?;
        if version != VERSION {
            return Err(format!(
                "format version {version}, this build reads version {VERSION}"
            ));
        }
        let total = r.u32()? as usize;
        if total < FIXED + 4 || total > bytes.len() {
            return Err(format!(
                "header length {total} is impossible (have {} bytes)",
                bytes.len()
            ));
        }
        let stored = u32::from_le_bytes(bytes[total - 4..total].try_into().unwrap_or([0; 4]));
        let actual = crc32fast::hash(&bytes[..total - 4]);
        if stored != actual {
            return Err(format!(
                "header checksum mismatch (stored {stored:#010x}, computed {actual:#010x})"
            ));
        }
        let run_id = r.u64()?;
        let rank = r.u64()?;
        let block_size = r.u64()?;
        let total_len = r.u64()?;
        let count = r.u32()?;
        let mut regions = Vec::new();
        for _ in 0..count {
            let n = r.u16()? as usize;
            let name = String::from_utf8(r.take(n)?.to_vec())
                .map_err(|_| "region name is not UTF-8".to_string())?;
            regions.push((name, r.u64()?, r.u64()?));
        }
        Ok(Header {
            run_id,
            rank,
            block_size,
            total_len,
            regions,
        })
    }
}

/// A bounds-checked little-endian reader.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(format!("header ends early at byte {}", self.bytes.len()));
        };
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u16(&mut self) -> std::result::Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        let mut a = [0; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        let mut a = [0; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
}

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

/// A block's state: 0 when never written (or while a write of it is in
/// flight or failed), else `WRITTEN | crc32`.
const WRITTEN: u64 = 1 << 32;

/// [`SwapOptions::max_transfer`]'s default.
const DEFAULT_MAX_TRANSFER: usize = 8 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Read => "read",
            Kind::Write => "write",
        }
    }
}

/// A pointer into a request's buffer that a piece carries to an I/O thread.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the pointer targets memory owned by the request (IoBuffer
// contract), which outlives the piece (the piece holds the request's Arc);
// pieces of one request cover disjoint byte ranges.
unsafe impl Send for SendPtr {}

/// The completion side of a request, without its buffer type.
trait Completion: Send + Sync {
    /// Whether a piece of the request before file offset `at` failed
    /// already (the pieces after it are skipped).
    fn failed_before(&self, at: u64) -> bool;
    /// The piece at file offset `at` is done, with an error or not. The
    /// request reports the error of its first failing piece in file order,
    /// whichever I/O thread finished first, so the error names the same
    /// block on every run.
    fn finish(&self, at: u64, outcome: Option<Error>);
}

struct ReqState<B> {
    remaining: usize,
    /// The failing piece's file offset and error (the first in file order).
    error: Option<(u64, Error)>,
    /// Always `Some` until the ticket takes it.
    buffer: Option<B>,
    /// The ticket was dropped before completion: report a failure through
    /// `deferred`.
    abandoned: bool,
    /// The ticket took the result.
    taken: bool,
}

struct Request<B> {
    state: Mutex<ReqState<B>>,
    done: Condvar,
    deferred: Arc<Mutex<Vec<Error>>>,
}

impl<B: IoBuffer> Completion for Request<B> {
    fn failed_before(&self, at: u64) -> bool {
        lock(&self.state)
            .error
            .as_ref()
            .is_some_and(|(first, _)| *first < at)
    }

    fn finish(&self, at: u64, outcome: Option<Error>) {
        let mut st = lock(&self.state);
        if let Some(e) = outcome {
            if st.error.as_ref().is_none_or(|(first, _)| at < *first) {
                st.error = Some((at, e));
            }
        }
        st.remaining = st.remaining.saturating_sub(1);
        if st.remaining == 0 {
            if st.abandoned {
                if let Some((_, e)) = st.error.take() {
                    lock(&self.deferred).push(e);
                }
            }
            self.done.notify_all();
        }
    }
}

/// One block of a request.
struct Piece {
    req: Arc<dyn Completion>,
    kind: Kind,
    ptr: SendPtr,
    /// Bytes transferred: `logical` rounded up to 4096.
    io_len: usize,
    /// Region bytes in the block (what the checksum covers).
    logical: usize,
    file_offset: u64,
    /// Index into `FileShared::blocks`.
    block: usize,
    region: usize,
    block_in_region: u64,
}

/// A pending request: wait on it to get the buffer back.
///
/// Dropping a ticket without waiting does not cancel or lose the work: the
/// request completes, its buffer is dropped afterwards (a [`PooledBuffer`]
/// returns to its pool), and a failure is kept and returned by the next
/// [`SwapFile::verify`] or [`SwapFile::close`].
#[must_use = "wait on the ticket to get the buffer back and see errors"]
pub struct IoTicket<B: IoBuffer> {
    req: Arc<Request<B>>,
}

impl<B: IoBuffer> IoTicket<B> {
    /// Blocks until the request is done; gives the buffer back, with the
    /// data read for a read. On failure the buffer comes back inside the
    /// [`IoError`] (for a write, with the caller's data intact).
    pub fn wait(self) -> std::result::Result<B, IoError<B>> {
        let mut st = lock(&self.req.state);
        while st.remaining > 0 {
            st = self
                .req
                .done
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
        st.taken = true;
        let error = st.error.take().map(|(_, e)| e);
        let Some(buffer) = st.buffer.take() else {
            unreachable!("an IoTicket's buffer is taken only by wait(self)");
        };
        match error {
            None => Ok(buffer),
            Some(error) => Err(IoError { error, buffer }),
        }
    }

    /// Whether the request is done (`wait` will not block).
    pub fn is_complete(&self) -> bool {
        lock(&self.req.state).remaining == 0
    }
}

impl<B: IoBuffer> Drop for IoTicket<B> {
    fn drop(&mut self) {
        let mut st = lock(&self.req.state);
        if st.taken {
            return;
        }
        if st.remaining > 0 {
            st.abandoned = true;
        } else if let Some((_, e)) = st.error.take() {
            lock(&self.req.deferred).push(e);
        }
    }
}

impl<B: IoBuffer> fmt::Debug for IoTicket<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoTicket")
            .field("complete", &self.is_complete())
            .finish()
    }
}

/// A failed request: the error and the buffer that was moved into it.
pub struct IoError<B> {
    /// What went wrong ([`Error::Io`] naming file, region and offset, or an
    /// argument error).
    pub error: Error,
    /// The buffer, handed back (after a failed write, with its data intact).
    pub buffer: B,
}

impl<B> IoError<B> {
    /// The error and the buffer.
    pub fn into_parts(self) -> (Error, B) {
        (self.error, self.buffer)
    }
}

impl<B> fmt::Debug for IoError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<B> fmt::Display for IoError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl<B> std::error::Error for IoError<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<B> From<IoError<B>> for Error {
    /// Drops the buffer, keeps the error (for `?`).
    fn from(e: IoError<B>) -> Error {
        e.error
    }
}

// ---------------------------------------------------------------------------
// The file and its I/O threads
// ---------------------------------------------------------------------------

struct Queue {
    pieces: VecDeque<Piece>,
    in_flight: usize,
    shutdown: bool,
}

/// What the I/O threads and the handle share.
struct FileShared {
    path: PathBuf,
    file: File,
    regions: Vec<Region>,
    /// Per data block: see [`WRITTEN`].
    blocks: Vec<AtomicU64>,
    block_size: usize,
    /// Transfers in flight at most: `min(queue_depth, thread_count + 1)`.
    transfers: usize,
    /// See [`SwapOptions::max_transfer`].
    max_transfer: usize,
    queue: Mutex<Queue>,
    work: Condvar,
    /// Block writes started, for [`FaultPlan::fail_write_at`].
    #[cfg(feature = "testing")]
    writes: AtomicU64,
    #[cfg(feature = "testing")]
    faults: FaultPlan,
}

impl FileShared {
    fn piece_error(&self, p: &Piece, what: impl fmt::Display) -> Error {
        let name = self.regions.get(p.region).map_or("?", |r| r.name.as_str());
        Error::Io {
            path: self.path.clone(),
            msg: format!(
                "{} of region `{name}` block {} (file offset {}, {} bytes): {what}",
                p.kind.as_str(),
                p.block_in_region,
                p.file_offset,
                p.logical
            ),
        }
    }

    /// The fault plan's failure or delay of the block write `p` (feature
    /// `testing`): counts the write, fails it when the plan says so, else
    /// holds it for the plan's delay.
    #[cfg(feature = "testing")]
    fn inject_write_fault(&self, p: &Piece) -> Option<Error> {
        let seq = self.writes.fetch_add(1, Ordering::Relaxed);
        if self.faults.fails_write(seq) {
            let errno = match self.faults.fail_write_errno {
                0 => libc::ENOSPC,
                e => e,
            };
            let err = std::io::Error::from_raw_os_error(errno);
            return Some(self.piece_error(p, format!("{err} (injected fault)")));
        }
        if !self.faults.write_delay.is_zero() {
            std::thread::sleep(self.faults.write_delay);
        }
        None
    }

    /// Runs a run of pieces (consecutive blocks of one request, contiguous
    /// in the file and in the buffer: see [`take_run`]) as one transfer;
    /// each piece's outcome, `None` on success. The transfer slot goes back
    /// as soon as the bytes are moved, before the checksums (see
    /// [`transfer_done`](Self::transfer_done)).
    fn run(&self, run: &[Piece], slot: &mut Slot<'_>) -> Vec<Option<Error>> {
        match run[0].kind {
            Kind::Write => self.run_write(run, slot),
            Kind::Read => self.run_read(run, slot),
        }
    }

    /// A run's transfer is over: with more than one transfer in flight
    /// allowed, its slot goes back now, so the next transfer starts while
    /// this thread checksums; with one, the slot is held until the run is
    /// reported, so runs start and complete strictly in submission order.
    fn transfer_done(&self, slot: &mut Slot<'_>) {
        if self.transfers > 1 {
            slot.release();
        }
    }

    /// The run's bytes, `len` of them from its first piece's pointer.
    ///
    /// # Safety
    /// `len` is at most the run's total `io_len` (the pieces are contiguous
    /// in the request's buffer, which holds them), and the caller is the
    /// only one touching them (a request's pieces are disjoint, and nobody
    /// else touches the buffer until the request completes).
    #[allow(clippy::mut_from_ref)]
    unsafe fn run_bytes(run: &[Piece], len: usize) -> &mut [u8] {
        // SAFETY: forwarded from the caller (the IoBuffer contract: valid
        // for io_capacity >= the rounded length checked at submit).
        unsafe { std::slice::from_raw_parts_mut(run[0].ptr.0, len) }
    }

    /// The index of the piece of `run` holding byte `at` of the run, and
    /// `at` within it.
    fn piece_at(run: &[Piece], at: usize) -> (usize, usize) {
        let mut start = 0;
        for (k, p) in run.iter().enumerate() {
            if at < start + p.io_len {
                return (k, at - start);
            }
            start += p.io_len;
        }
        (run.len() - 1, run[run.len() - 1].io_len)
    }

    /// Writes the run, then checksums the blocks written (the request's
    /// buffer does not change while the request owns it).
    fn run_write(&self, run: &[Piece], slot: &mut Slot<'_>) -> Vec<Option<Error>> {
        let mut out: Vec<Option<Error>> = run.iter().map(|_| None).collect();
        // Every block marked unwritten until its bytes are on disk and its
        // checksum is known.
        for p in run {
            self.blocks[p.block].store(0, Ordering::Release);
        }
        // An injected fault fails its block; the blocks before it are
        // written, the ones after it skipped (their request failed).
        #[allow(unused_mut)]
        let mut todo = run.len();
        #[cfg(feature = "testing")]
        for (k, p) in run.iter().enumerate() {
            if let Some(err) = self.inject_write_fault(p) {
                out[k] = Some(err);
                todo = k;
                break;
            }
        }
        let len: usize = run[..todo].iter().map(|p| p.io_len).sum();
        // SAFETY: the first `todo` pieces' bytes (see `run_bytes`).
        let data = unsafe { Self::run_bytes(run, len) };
        let mut done = 0;
        let mut failed = None;
        while done < len {
            match self
                .file
                .write_at(&data[done..], run[0].file_offset + done as u64)
            {
                Ok(0) => {
                    failed = Some("the device accepted no bytes".to_string());
                    break;
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        self.transfer_done(slot);
        let (bad, in_bad) = match failed {
            Some(_) => Self::piece_at(run, done),
            None => (todo, 0),
        };
        for p in &run[..bad.min(todo)] {
            // SAFETY: this piece's bytes, as in `run_bytes`.
            let data = unsafe { std::slice::from_raw_parts(p.ptr.0, p.logical) };
            let crc = crc32fast::hash(data);
            self.blocks[p.block].store(WRITTEN | u64::from(crc), Ordering::Release);
        }
        if let Some(why) = failed {
            let p = &run[bad];
            out[bad] = Some(self.piece_error(
                p,
                format_args!("{why} after {in_bad} of {} bytes", p.io_len),
            ));
        }
        out
    }

    fn run_read(&self, run: &[Piece], slot: &mut Slot<'_>) -> Vec<Option<Error>> {
        let mut out: Vec<Option<Error>> = run.iter().map(|_| None).collect();
        let states: Vec<u64> = run
            .iter()
            .map(|p| self.blocks[p.block].load(Ordering::Acquire))
            .collect();
        // A block never written fails; the blocks before it are read.
        let todo = states
            .iter()
            .position(|s| s & WRITTEN == 0)
            .unwrap_or(run.len());
        if todo < run.len() {
            out[todo] = Some(self.piece_error(
                &run[todo],
                "the block was never written (or its last write failed); refusing to return \
                 undefined data",
            ));
        }
        let len: usize = run[..todo].iter().map(|p| p.io_len).sum();
        // SAFETY: the first `todo` pieces' bytes (see `run_bytes`).
        let data = unsafe { Self::run_bytes(run, len) };
        let mut done = 0;
        let mut failed = None;
        while done < len {
            match self
                .file
                .read_at(&mut data[done..], run[0].file_offset + done as u64)
            {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        self.transfer_done(slot);
        // The pieces read in full are checked; the one the transfer stopped
        // in (if any) fails, the ones after it are skipped.
        let mut start = 0;
        for (k, p) in run[..todo].iter().enumerate() {
            let got = done.saturating_sub(start);
            let piece_done = got.min(p.io_len);
            if piece_done < p.logical {
                out[k] = Some(match failed {
                    Some(e) if piece_done > 0 => self.piece_error(
                        p,
                        format_args!(
                            "short read: {piece_done} of {} bytes, then {e} (file truncated?)",
                            p.io_len
                        ),
                    ),
                    Some(e) => self.piece_error(p, e),
                    None => {
                        let size = self.file.metadata().map(|m| m.len()).ok();
                        self.piece_error(
                            p,
                            format_args!(
                                "short read: got {piece_done} of {} bytes; the file was truncated (now {} bytes)",
                                p.logical,
                                size.map_or("of unknown size".into(), |s| s.to_string())
                            ),
                        )
                    }
                });
                break;
            }
            let bytes = &data[start..start + p.logical];
            let crc = crc32fast::hash(bytes);
            let expected = (states[k] & 0xffff_ffff) as u32;
            if crc != expected {
                out[k] = Some(self.piece_error(
                    p,
                    format_args!(
                        "checksum mismatch (expected crc32 {expected:#010x}, read {crc:#010x}): \
                         the data on disk is corrupt"
                    ),
                ));
            }
            start += p.io_len;
        }
        out
    }
}

/// Takes the next run of pieces from the queue: the first piece, and the
/// pieces right behind it that continue it (the same request and kind, the
/// next bytes of the file and of the buffer), up to `max_transfer` bytes.
/// Pieces are queued in submission order, so a request's blocks are
/// adjacent.
fn take_run(q: &mut Queue, max_transfer: usize) -> Vec<Piece> {
    let mut run: Vec<Piece> = q.pieces.pop_front().into_iter().collect();
    let mut len = run.first().map_or(0, |p| p.io_len);
    while let (Some(last), Some(next)) = (run.last(), q.pieces.front()) {
        let continues = std::ptr::addr_eq(Arc::as_ptr(&last.req), Arc::as_ptr(&next.req))
            && last.kind == next.kind
            && last.io_len == last.logical
            && next.file_offset == last.file_offset + last.io_len as u64
            && next.ptr.0 == last.ptr.0.wrapping_add(last.io_len)
            && len + next.io_len <= max_transfer;
        if !continues {
            break;
        }
        len += next.io_len;
        run.extend(q.pieces.pop_front());
    }
    run
}

/// A transfer slot (one of `FileShared::transfers`) held by an I/O thread;
/// given back by [`release`](Self::release) or on drop (also when the
/// transfer panicked).
struct Slot<'a> {
    shared: &'a FileShared,
    held: bool,
}

impl Slot<'_> {
    fn release(&mut self) {
        if std::mem::take(&mut self.held) {
            lock(&self.shared.queue).in_flight -= 1;
            self.shared.work.notify_one();
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// The loop of one I/O thread: take a run of pieces and a transfer slot
/// (at most `transfers` in flight), run it as one transfer, report each
/// piece; drain the queue before exiting on shutdown. The slot goes back
/// when the transfer is over, before the checksums, so another thread's
/// transfer goes on meanwhile (with `transfers` 1: when the run is
/// reported).
fn worker(shared: Arc<FileShared>) {
    loop {
        let run = {
            let mut q = lock(&shared.queue);
            loop {
                if !q.pieces.is_empty() && q.in_flight < shared.transfers {
                    break;
                }
                if q.pieces.is_empty() && q.shutdown {
                    return;
                }
                q = shared.work.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
            q.in_flight += 1;
            take_run(&mut q, shared.max_transfer)
        };
        let mut slot = Slot {
            shared: &shared,
            held: true,
        };
        if run.is_empty() {
            continue;
        }
        let outcomes = if run[0].req.failed_before(run[0].file_offset) {
            // An earlier piece failed: the request's error stands.
            run.iter().map(|_| None).collect()
        } else {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shared.run(&run, &mut slot)))
                .unwrap_or_else(|_| {
                    run.iter()
                        .map(|p| Some(shared.piece_error(p, "the I/O thread panicked")))
                        .collect()
                })
        };
        // With one transfer at a time the slot is still held: the runs then
        // start and complete strictly in submission order.
        for (piece, outcome) in run.iter().zip(outcomes) {
            piece.req.finish(piece.file_offset, outcome);
        }
        drop(run);
        slot.release();
    }
}

/// A per-rank swap file of named regions on NVMe. See the [module docs](self).
///
/// `Send + Sync`: requests may be submitted from several threads.
pub struct SwapFile {
    shared: Arc<FileShared>,
    workers: Vec<JoinHandle<()>>,
    header: Header,
    /// The encoded header, padded with zeros to a multiple of 4096.
    header_bytes: Vec<u8>,
    /// A buffer for re-reading the header in `verify`.
    header_buf: Mutex<AlignedBuf>,
    total_len: u64,
    direct: bool,
    warnings: Vec<String>,
    deferred: Arc<Mutex<Vec<Error>>>,
    removed: bool,
}

impl fmt::Debug for SwapFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SwapFile")
            .field("path", &self.shared.path)
            .field("run_id", &format_args!("{:016x}", self.header.run_id))
            .field("rank", &self.header.rank)
            .field("regions", &self.shared.regions.len())
            .field("bytes", &self.total_len)
            .field("direct_io", &self.direct)
            .finish_non_exhaustive()
    }
}

/// A fresh run id: time, process id and a counter, mixed (splitmix64).
fn fresh_run_id() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = nanos
        ^ (u64::from(std::process::id()) << 32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A swap file's layout, before anything is written.
struct Planned {
    header: Header,
    layout: Vec<Region>,
    /// Blocks of all regions.
    nblocks: usize,
    /// The file's length: the header's blocks and every region's.
    total_len: u64,
}

/// Lays out `regions` under `options` (block size) for run `run_id`:
/// checks the names and lengths, places each region at a block boundary
/// after the header.
fn plan_layout(options: &SwapOptions, regions: &[RegionSpec], run_id: u64) -> Result<Planned> {
    let bs = options.block_size as u64;
    let dir = &options.dir;
    // Layout.
    let mut names = std::collections::HashSet::new();
    let mut table = Vec::with_capacity(regions.len());
    for r in regions {
        if r.name.is_empty() || r.name.len() > 255 {
            return Err(io_err(
                dir,
                format!("region name {:?} must be 1 to 255 bytes", r.name),
            ));
        }
        if !names.insert(r.name.as_str()) {
            return Err(io_err(
                dir,
                format!("region name `{}` appears twice", r.name),
            ));
        }
        if r.len == 0 {
            return Err(io_err(dir, format!("region `{}` has length 0", r.name)));
        }
        table.push((r.name.clone(), 0u64, r.len));
    }
    let mut header = Header {
        run_id,
        rank: options.rank as u64,
        block_size: bs,
        total_len: 0,
        regions: table,
    };
    let encoded_len = header.encode().len() as u64;
    let header_space = encoded_len.div_ceil(bs) * bs;
    let mut offset = header_space;
    let mut layout = Vec::with_capacity(regions.len());
    let mut nblocks = 0usize;
    for entry in &mut header.regions {
        let blocks = entry.2.div_ceil(bs);
        entry.1 = offset;
        layout.push(Region {
            name: entry.0.clone(),
            offset,
            len: entry.2,
            first_block: nblocks,
        });
        nblocks = usize::try_from(blocks)
            .ok()
            .and_then(|b| nblocks.checked_add(b))
            .ok_or_else(|| io_err(dir, "the regions are too large"))?;
        offset = blocks
            .checked_mul(bs)
            .and_then(|b| offset.checked_add(b))
            .ok_or_else(|| io_err(dir, "the regions are too large"))?;
    }
    header.total_len = offset;
    let total_len = offset;
    Ok(Planned {
        header,
        layout,
        nblocks,
        total_len,
    })
}

fn io_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

fn open_file(path: &Path, create: bool, direct: bool) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).mode(0o600);
    if create {
        o.create_new(true);
    }
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

fn is_einval(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

impl SwapFile {
    /// The length in bytes the file for `regions` under `options` will
    /// have (header and block padding included): what
    /// [`SwapFile::create`] reserves, known before anything is written.
    ///
    /// # Errors
    /// Invalid options, or a region whose name or length `create` refuses.
    pub fn planned_len(options: &SwapOptions, regions: &[RegionSpec]) -> Result<u64> {
        options.validate()?;
        Ok(plan_layout(options, regions, 0)?.total_len)
    }

    /// Creates the swap file of `options.rank` under `options.dir` with
    /// `regions` laid out in order, each starting on a block boundary;
    /// writes and re-reads the header, reserves the blocks (with
    /// `preallocate`) and starts the I/O threads.
    ///
    /// A stale file of the same name is replaced. If the filesystem rejects
    /// `O_DIRECT`, the file uses buffered I/O and [`warnings`](Self::warnings)
    /// says so.
    pub fn create(options: SwapOptions, regions: &[RegionSpec]) -> Result<SwapFile> {
        options.validate()?;
        let run_id = options.run_id.unwrap_or_else(fresh_run_id);
        let dir = &options.dir;
        let Planned {
            header,
            layout,
            nblocks,
            total_len,
        } = plan_layout(&options, regions, run_id)?;
        let mut header_bytes = header.encode();
        let header_io = round_up(header_bytes.len(), PAGE_SIZE)
            .ok_or_else(|| io_err(dir, "the region table is too large"))?;
        header_bytes.resize(header_io, 0);

        // The file.
        std::fs::create_dir_all(dir)
            .map_err(|e| io_err(dir, format!("cannot create the nvme_path directory: {e}")))?;
        let path = dir.join(format!(
            "zero-swap-{}-rank{}-{run_id:016x}.swp",
            options.tag, options.rank
        ));
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(io_err(
                    &path,
                    format!("cannot replace the stale swap file: {e}"),
                ))
            }
        }
        let mut warnings = Vec::new();
        let fallback_warning = |why: &dyn fmt::Display| {
            format!(
                "{}: the filesystem rejected O_DIRECT ({why}); using buffered I/O, so reads and \
                 writes go through the page cache (more host memory, and bandwidth that does \
                 not reflect the disk). Put nvme_path on a filesystem that supports O_DIRECT \
                 (ext4, xfs) for real NVMe offload",
                path.display()
            )
        };
        let mut direct = options.direct_io;
        let mut file = if direct && options.rejects_direct_io() {
            direct = false;
            warnings.push(fallback_warning(
                &"Invalid argument (os error 22), injected fault",
            ));
            open_file(&path, true, false)
        } else {
            match open_file(&path, true, direct) {
                Err(e) if direct && is_einval(&e) => {
                    direct = false;
                    warnings.push(fallback_warning(&e));
                    open_file(&path, true, false)
                }
                other => other,
            }
        }
        .map_err(|e| io_err(&path, format!("cannot create the swap file: {e}")))?;

        // Reserve or size it.
        let cleanup = |e: Error| {
            let _ = std::fs::remove_file(&path);
            e
        };
        if options.preallocate {
            let len = libc::off_t::try_from(total_len)
                .map_err(|_| cleanup(io_err(&path, "the file is too large")))?;
            // SAFETY: posix_fallocate only reads its arguments; the fd is open
            // for writing and owned by `file`.
            let rc =
                unsafe { libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, len) };
            if rc != 0 {
                let e = std::io::Error::from_raw_os_error(rc);
                return Err(cleanup(io_err(
                    &path,
                    format!(
                        "cannot reserve {total_len} bytes for the swap file ({} regions): {e}",
                        regions.len()
                    ),
                )));
            }
        } else {
            file.set_len(total_len).map_err(|e| {
                cleanup(io_err(
                    &path,
                    format!("cannot size the swap file to {total_len} bytes: {e}"),
                ))
            })?;
        }

        // Write the header and read it back (this also probes O_DIRECT).
        let mut header_buf = AlignedBuf::new(header_io).map_err(cleanup)?;
        let probe = |file: &File, buf: &mut AlignedBuf| -> std::io::Result<()> {
            buf.copy_from_slice(&header_bytes);
            file.write_all_at(buf, 0)?;
            buf.fill(0);
            file.read_exact_at(buf, 0)
        };
        if let Err(e) = probe(&file, &mut header_buf) {
            if direct && is_einval(&e) {
                direct = false;
                warnings.push(fallback_warning(&e));
                file = open_file(&path, false, false).map_err(|e| {
                    cleanup(io_err(&path, format!("cannot reopen the swap file: {e}")))
                })?;
                probe(&file, &mut header_buf).map_err(|e| {
                    cleanup(io_err(
                        &path,
                        format!("cannot write the header at offset 0: {e}"),
                    ))
                })?;
            } else {
                return Err(cleanup(io_err(
                    &path,
                    format!("cannot write the header at offset 0: {e}"),
                )));
            }
        }
        if header_buf[..] != header_bytes[..] {
            return Err(cleanup(io_err(
                &path,
                "the header read back at offset 0 differs from the one written",
            )));
        }

        let shared = Arc::new(FileShared {
            path: path.clone(),
            file,
            regions: layout,
            blocks: (0..nblocks).map(|_| AtomicU64::new(0)).collect(),
            block_size: options.block_size,
            transfers: options.queue_depth.min(options.thread_count + 1),
            max_transfer: options.max_transfer,
            queue: Mutex::new(Queue {
                pieces: VecDeque::new(),
                in_flight: 0,
                shutdown: false,
            }),
            work: Condvar::new(),
            #[cfg(feature = "testing")]
            writes: AtomicU64::new(0),
            #[cfg(feature = "testing")]
            faults: options.faults.clone(),
        });
        let mut swap = SwapFile {
            shared,
            workers: Vec::with_capacity(options.thread_count + 2),
            header,
            header_bytes,
            header_buf: Mutex::new(header_buf),
            total_len,
            direct,
            warnings,
            deferred: Arc::new(Mutex::new(Vec::new())),
            removed: false,
        };
        for i in 0..options.thread_count + 2 {
            let shared = Arc::clone(&swap.shared);
            let handle = std::thread::Builder::new()
                .name(format!("zero-aio-r{}-{i}", options.rank))
                .spawn(move || worker(shared))
                .map_err(|e| io_err(&path, format!("cannot start I/O thread {i}: {e}")))?;
            swap.workers.push(handle);
        }
        Ok(swap)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// The run id in the file's name and header.
    pub fn run_id(&self) -> u64 {
        self.header.run_id
    }

    /// The threads doing I/O and checksums: `thread_count + 2` (see the
    /// module docs).
    pub fn io_threads(&self) -> usize {
        self.workers.len()
    }

    /// The block size (bytes).
    pub fn block_size(&self) -> usize {
        self.shared.block_size
    }

    /// The file's length in bytes (header and all regions, block-aligned).
    pub fn file_len(&self) -> u64 {
        self.total_len
    }

    /// Whether I/O bypasses the page cache (`O_DIRECT`).
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// Warnings for the caller to surface (e.g. the `O_DIRECT` fallback).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The region called `name`; an error lists the regions there are.
    pub fn region(&self, name: &str) -> Result<RegionId> {
        match self.shared.regions.iter().position(|r| r.name == name) {
            Some(i) => Ok(RegionId(i)),
            None => {
                let names: Vec<&str> = self
                    .shared
                    .regions
                    .iter()
                    .map(|r| r.name.as_str())
                    .collect();
                Err(io_err(
                    &self.shared.path,
                    format!("no region `{name}` (regions: {})", names.join(", ")),
                ))
            }
        }
    }

    /// The length in bytes of a region (`None` for an id of another file).
    pub fn region_len(&self, region: RegionId) -> Option<u64> {
        self.shared.regions.get(region.0).map(|r| r.len)
    }

    /// The file offset where a region starts (a multiple of the block size).
    pub fn region_offset(&self, region: RegionId) -> Option<u64> {
        self.shared.regions.get(region.0).map(|r| r.offset)
    }

    /// Writes the whole region from the first `region_len` bytes of `buf`.
    pub fn write<B: IoBuffer>(&self, region: RegionId, buf: B) -> IoTicket<B> {
        let len = self.region_len(region).unwrap_or(0);
        self.submit(Kind::Write, region, 0, len, buf)
    }

    /// Reads the whole region into the first `region_len` bytes of `buf`.
    pub fn read<B: IoBuffer>(&self, region: RegionId, buf: B) -> IoTicket<B> {
        let len = self.region_len(region).unwrap_or(0);
        self.submit(Kind::Read, region, 0, len, buf)
    }

    /// Writes `len` bytes at `offset` in the region from the start of `buf`.
    /// `offset` must be a multiple of the block size, and `len` a multiple
    /// of it too unless the range ends at the region's end (each block's
    /// checksum covers the whole block).
    pub fn write_range<B: IoBuffer>(
        &self,
        region: RegionId,
        offset: u64,
        len: u64,
        buf: B,
    ) -> IoTicket<B> {
        self.submit(Kind::Write, region, offset, len, buf)
    }

    /// Reads `len` bytes at `offset` in the region into the start of `buf`;
    /// the same alignment rules as [`write_range`](Self::write_range).
    pub fn read_range<B: IoBuffer>(
        &self,
        region: RegionId,
        offset: u64,
        len: u64,
        buf: B,
    ) -> IoTicket<B> {
        self.submit(Kind::Read, region, offset, len, buf)
    }

    /// Checks a request's arguments; the error names what is wrong.
    fn check_request<B: IoBuffer>(
        &self,
        kind: Kind,
        region: RegionId,
        offset: u64,
        len: u64,
        buf: &mut B,
    ) -> Result<()> {
        let bad = |msg: String| {
            io_err(
                &self.shared.path,
                format!("{} request: {msg}", kind.as_str()),
            )
        };
        let Some(r) = self.shared.regions.get(region.0) else {
            return Err(bad(format!(
                "region id {} does not belong to this file ({} regions)",
                region.0,
                self.shared.regions.len()
            )));
        };
        let bs = self.shared.block_size as u64;
        let end = offset.checked_add(len).filter(|&e| e <= r.len);
        let Some(end) = end else {
            return Err(bad(format!(
                "range {offset}+{len} exceeds region `{}` of {} bytes",
                r.name, r.len
            )));
        };
        if len == 0 || !offset.is_multiple_of(bs) || (!len.is_multiple_of(bs) && end != r.len) {
            return Err(bad(format!(
                "range {offset}+{len} of region `{}` ({} bytes) is not block-aligned: the \
                 offset must be a multiple of {bs} and the length too, unless the range ends \
                 at the region's end",
                r.name, r.len
            )));
        }
        let need_len = usize::try_from(len).unwrap_or(usize::MAX);
        let need_cap = round_up(need_len, PAGE_SIZE).unwrap_or(usize::MAX);
        if buf.io_len() < need_len || buf.io_capacity() < need_cap {
            return Err(bad(format!(
                "buffer of {} bytes (capacity {}) is too small for {len} bytes of region `{}` \
                 (needs capacity {need_cap})",
                buf.io_len(),
                buf.io_capacity(),
                r.name
            )));
        }
        if !(buf.io_ptr() as usize).is_multiple_of(PAGE_SIZE) {
            return Err(bad(format!("buffer is not aligned to {PAGE_SIZE} bytes")));
        }
        Ok(())
    }

    fn submit<B: IoBuffer>(
        &self,
        kind: Kind,
        region: RegionId,
        offset: u64,
        len: u64,
        mut buf: B,
    ) -> IoTicket<B> {
        let checked = self.check_request(kind, region, offset, len, &mut buf);
        let base = buf.io_ptr();
        let bs = self.shared.block_size as u64;
        let pieces = if checked.is_ok() {
            len.div_ceil(bs) as usize
        } else {
            0
        };
        let req = Arc::new(Request {
            state: Mutex::new(ReqState {
                remaining: pieces,
                // An argument error comes before every piece.
                error: checked.err().map(|e| (0, e)),
                buffer: Some(buf),
                abandoned: false,
                taken: false,
            }),
            done: Condvar::new(),
            deferred: Arc::clone(&self.deferred),
        });
        if pieces > 0 {
            let r = &self.shared.regions[region.0];
            let completion: Arc<dyn Completion> = req.clone();
            let mut q = lock(&self.shared.queue);
            for i in 0..pieces as u64 {
                let at = offset + i * bs;
                let logical = bs.min(offset + len - at) as usize;
                q.pieces.push_back(Piece {
                    req: Arc::clone(&completion),
                    kind,
                    // Within the buffer: i * bs < len <= io_len (checked).
                    ptr: SendPtr(base.wrapping_add((i * bs) as usize)),
                    io_len: round_up(logical, PAGE_SIZE).unwrap_or(logical),
                    logical,
                    file_offset: r.offset + at,
                    block: r.first_block + (at / bs) as usize,
                    region: region.0,
                    block_in_region: at / bs,
                });
            }
            drop(q);
            self.shared.work.notify_all();
        }
        IoTicket { req }
    }

    /// Checks the file once (the engine calls it once per step): failures
    /// of requests whose tickets were dropped, the file deleted
    /// (`st_nlink == 0`) or truncated, and the header re-read from offset 0
    /// (foreign, overwritten or corrupt).
    pub fn verify(&self) -> Result<()> {
        {
            let mut deferred = lock(&self.deferred);
            if !deferred.is_empty() {
                let more = deferred.len() - 1;
                let first = deferred.remove(0);
                deferred.clear();
                return Err(match first {
                    Error::Io { path, msg } if more > 0 => Error::Io {
                        path,
                        msg: format!(
                            "{msg} (and {more} more failed requests whose tickets were dropped)"
                        ),
                    },
                    e => e,
                });
            }
        }
        let path = &self.shared.path;
        let meta = self
            .shared
            .file
            .metadata()
            .map_err(|e| io_err(path, format!("fstat failed: {e}")))?;
        if meta.nlink() == 0 {
            return Err(io_err(
                path,
                "the swap file was deleted while in use (st_nlink == 0): something removed \
                 files under nvme_path during the run",
            ));
        }
        if meta.len() < self.total_len {
            return Err(io_err(
                path,
                format!(
                    "the swap file was truncated to {} bytes; its regions need {}",
                    meta.len(),
                    self.total_len
                ),
            ));
        }
        let mut buf = lock(&self.header_buf);
        let read = self.shared.file.read_exact_at(&mut buf, 0);
        if let Err(e) = read {
            return Err(io_err(
                path,
                format!("cannot re-read the header at offset 0: {e}"),
            ));
        }
        if buf[..] == self.header_bytes[..] {
            return Ok(());
        }
        let what = match Header::decode(&buf) {
            Err(why) => format!("the header at offset 0 is invalid: {why}"),
            Ok(h) if h.run_id != self.header.run_id || h.rank != self.header.rank => format!(
                "the header at offset 0 belongs to another swap file (run {:016x}, rank {}); \
                 this file is run {:016x}, rank {}",
                h.run_id, h.rank, self.header.run_id, self.header.rank
            ),
            Ok(_) => {
                "the header at offset 0 was overwritten (its region table or sizes differ)".into()
            }
        };
        Err(io_err(path, what))
    }

    /// Accounts [`file_len`](Self::file_len) in `tracker` under
    /// ([`Tier::Nvme`], `category`) while the returned [`Allocation`] lives.
    pub fn account(&self, tracker: &MemoryTracker, category: Category) -> Allocation {
        tracker.allocate(Tier::Nvme, category, self.total_len)
    }

    /// Waits for all requests, stops the I/O threads and removes the file,
    /// returning any failure that [`verify`](Self::verify) would have and
    /// the removal's error. Dropping the file does the same, silently.
    pub fn close(mut self) -> Result<()> {
        self.shutdown();
        let deferred = {
            let mut d = lock(&self.deferred);
            if d.is_empty() {
                None
            } else {
                Some(d.remove(0))
            }
        };
        self.removed = true;
        let removed = std::fs::remove_file(&self.shared.path);
        if let Some(e) = deferred {
            return Err(e);
        }
        match removed {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(io_err(
                &self.shared.path,
                "the swap file was deleted while in use",
            )),
            Err(e) => Err(io_err(
                &self.shared.path,
                format!("cannot remove the swap file: {e}"),
            )),
        }
    }

    /// Lets the I/O threads drain the queue, then joins them.
    fn shutdown(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.work.notify_all();
        for handle in self.workers.drain(..) {
            // A worker catches panics of its I/O; a panic elsewhere in it
            // has nothing left to report here.
            let _ = handle.join();
        }
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        self.shutdown();
        if !self.removed {
            // Nothing to report from drop; `close` reports this.
            let _ = std::fs::remove_file(&self.shared.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static_assertions::assert_impl_all!(SwapFile: Send, Sync);
    static_assertions::assert_impl_all!(IoTicket<AlignedBuf>: Send, Sync);
    static_assertions::assert_impl_all!(IoTicket<PooledBuffer>: Send, Sync);
    static_assertions::assert_impl_all!(IoError<AlignedBuf>: Send, Sync);

    fn header() -> Header {
        Header {
            run_id: 0x1234,
            rank: 3,
            block_size: 1 << 20,
            total_len: 5 << 20,
            regions: vec![
                ("master".into(), 1 << 20, 100),
                ("m".into(), 2 << 20, 2 << 20),
            ],
        }
    }

    #[test]
    fn header_round_trip() {
        let h = header();
        let mut bytes = h.encode();
        assert_eq!(Header::decode(&bytes), Ok(h.clone()));
        bytes.resize(4096, 0); // padding after the header is ignored
        assert_eq!(Header::decode(&bytes), Ok(h));
    }

    #[test]
    fn header_damage_is_described() {
        let good = header().encode();
        let mut b = good.clone();
        b[0] = b'X';
        assert!(Header::decode(&b).unwrap_err().contains("bad magic"));
        let mut b = good.clone();
        b[8] = 9;
        assert!(Header::decode(&b).unwrap_err().contains("version 9"));
        let mut b = good.clone();
        b[20] ^= 1; // inside the run id
        assert!(Header::decode(&b).unwrap_err().contains("checksum"));
        assert!(Header::decode(&good[..10])
            .unwrap_err()
            .contains("ends early"));
        let mut b = good.clone();
        b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Header::decode(&b).unwrap_err().contains("impossible"));
        assert!(Header::decode(&[0; 4096]).is_err());
    }

    #[test]
    fn options_are_validated() {
        let mut o = SwapOptions::new("/tmp", 0);
        o.block_size = 1000;
        assert!(o
            .validate()
            .unwrap_err()
            .to_string()
            .contains("aio.block_size"));
        let mut o = SwapOptions::new("/tmp", 0);
        o.queue_depth = 0;
        assert!(o
            .validate()
            .unwrap_err()
            .to_string()
            .contains("aio.queue_depth"));
        let mut o = SwapOptions::new("/tmp", 0);
        o.thread_count = 0;
        assert!(o.validate().is_err());
        let mut o = SwapOptions::new("/tmp", 0);
        o.tag = "../x".into();
        assert!(o.validate().is_err());
        let aio = AioConfig {
            block_size: 8192,
            queue_depth: 2,
            thread_count: 3,
            ..AioConfig::default()
        };
        let o = SwapOptions::from_aio("/tmp", 1, &aio);
        assert_eq!((o.block_size, o.queue_depth, o.thread_count), (8192, 2, 3));
        assert!(o.validate().is_ok());
    }

    #[test]
    fn run_ids_differ() {
        let a = fresh_run_id();
        let b = fresh_run_id();
        assert_ne!(a, b);
    }
}
