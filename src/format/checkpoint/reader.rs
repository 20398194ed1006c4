//! Reading element ranges of the saved state from the rank files, every
//! block read verified against the manifest's CRC32.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use zero_core::partition::PartitionPlan;

use super::super::{ck, io, page_cache};
use super::rank_file::{FileMap, StateArray};
use super::{FileEntry, Manifest, BLOCK};
use crate::Result;

/// Blocks read (and verified) at once through a reader's window: the
/// ends of each read, and reads without a whole block.
const READ_BLOCKS: usize = 4;
/// Whole blocks read (and verified) at once straight into the
/// destination; costs no buffer.
const DIRECT_BLOCKS: usize = 8;

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
pub(crate) struct Reader<'a> {
    dir: &'a Path,
    manifest: &'a Manifest,
    maps: Vec<FileMap>,
    files: Vec<Option<File>>,
    win: Window,
    /// Drop the blocks read from the page cache once they are verified
    /// and copied (see [`Reader::drop_behind`]).
    drop_behind: bool,
    /// Bytes read from the rank files so far.
    bytes_read: u64,
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
        page_cache::drop_range(file, start, n as u64);
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
    /// A reader of the checkpoint directory `dir` with manifest `manifest`
    /// (its files checked, [`check_files`](super::check_files)), saved with
    /// the plan `saved`. Opens the files as it needs them.
    pub(crate) fn new(dir: &'a Path, manifest: &'a Manifest, saved: &PartitionPlan) -> Self {
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

    /// Bytes read from the rank files so far: whole blocks, each counted
    /// every time it is read.
    pub(crate) fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// Whether the reads that follow drop what they read from the page
    /// cache (off by default). Worth it for bytes that no other reader
    /// and no later read of this one needs: they would otherwise stay
    /// cached for nobody, and each read would take fresh pages (see
    /// `page_cache`) instead of reusing the ones just dropped.
    pub(crate) fn drop_behind(&mut self, on: bool) {
        self.drop_behind = on;
    }

    /// The parts of `kind[unit][abs]` in the saved files: `(s, lo..hi,
    /// off)`, elements `lo..hi` (unit coordinates) at byte `off` of file
    /// `s`, in element order.
    fn parts(
        &self,
        unit: usize,
        kind: StateArray,
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

    /// `out[k] = kind[unit][abs.start + k]` (unit coordinates of the saved
    /// unit `unit`; `abs` within its real elements).
    pub(crate) fn read_into(
        &mut self,
        unit: usize,
        kind: StateArray,
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

    /// Calls `f(i, x)` for consecutive pieces of `kind[unit][abs]`, in
    /// order, through the window and `scratch` (pieces of at most
    /// `scratch.len()` elements): `x[k]` is element `i + k` (unit
    /// coordinates), from verified blocks.
    pub(crate) fn for_each(
        &mut self,
        unit: usize,
        kind: StateArray,
        abs: Range<usize>,
        scratch: &mut [f32],
        mut f: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        let n = scratch.len();
        for (s, r, off) in self.parts(unit, kind, abs) {
            let end = off + 4 * r.len() as u64;
            self.windowed(s, off, end, |at, bytes| {
                let i = r.start + ((at - off) / 4) as usize;
                for (k, src) in bytes.chunks(4 * n).enumerate() {
                    let x = &mut scratch[..src.len() / 4];
                    le_to_f32(src, x);
                    f(i + k * n, x);
                }
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
