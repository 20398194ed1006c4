//! Writing a rank file: [`RankFileWriter`] puts a unit's master, m and v
//! where the layout says, [`RankWriter`] turns positioned writes into
//! large sequential ones with the CRC32 of every block and write-behind.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use zero_core::partition::UnitLayout;

use super::super::{ck, io, page_cache};
use super::rank_file::{header, FileMap, StateArray};
use super::BLOCK;
use crate::Result;

/// The write buffer of a rank file.
const WRITE_BUF: usize = 4 << 20;
/// Bytes a rank file's write-behind lets run ahead of the disk: once a
/// written range is this far behind the newest write, the writer waits
/// for its writeback and drops it from the page cache.
const WRITE_BEHIND: u64 = 2 * WRITE_BUF as u64;

/// Writes one rank file: the header at creation, then the state of the
/// units in any order and any pieces ([`RankFileWriter::write_state`]),
/// then [`RankFileWriter::finish`] (the file's length and block CRCs for
/// its [`FileEntry`](super::FileEntry)).
pub(crate) struct RankFileWriter {
    w: RankWriter,
    map: FileMap,
}

impl RankFileWriter {
    /// Creates `path` (which must not exist) for saving rank `rank` of the
    /// plan whose units are `layouts`, and writes its header.
    pub(crate) fn create(path: &Path, layouts: &[UnitLayout], rank: usize) -> Result<Self> {
        let mut w = RankWriter::create(path)?;
        w.write(0, &header(rank))?;
        Ok(Self {
            w,
            map: FileMap::new(layouts, rank),
        })
    }

    /// Writes unit `u`'s state over elements `start..start + master.len()`
    /// (unit coordinates; `master[k]`, `m[k]` and `v[k]` hold element
    /// `start + k`), clipped to the part this rank's file holds: master,
    /// then m, then v. Writing every unit's part whole, in order, streams
    /// the file front to back.
    pub(crate) fn write_state(
        &mut self,
        u: usize,
        start: usize,
        master: &[f32],
        m: &[f32],
        v: &[f32],
    ) -> Result<()> {
        debug_assert!(master.len() == m.len() && m.len() == v.len());
        let e = &self.map.ranges[u];
        let (lo, hi) = (start.max(e.start), (start + master.len()).min(e.end));
        if lo >= hi {
            // Nothing of this rank's part (a shard made only of padding).
            return Ok(());
        }
        let s = lo - start..hi - start;
        let at = |kind| self.map.offset(u, kind, lo);
        let (pm, pv, pw) = (at(StateArray::Master), at(StateArray::M), at(StateArray::V));
        self.w.write_f32(pm, &master[s.clone()])?;
        self.w.write_f32(pv, &m[s.clone()])?;
        self.w.write_f32(pw, &v[s])
    }

    /// Flushes and fsyncs the file: its length and per-block CRCs. Fails
    /// when some of the file was not written.
    pub(crate) fn finish(self) -> Result<(u64, Vec<u32>)> {
        self.w.finish(self.map.len)
    }
}

/// Writes a file at arbitrary positions through one buffer of
/// [`WRITE_BUF`] bytes, coalescing contiguous writes into writes that end
/// at multiples of [`WRITE_BUF`] (the whole ones straight from the
/// caller's memory), with write-behind while the writes are sequential
/// (see `page_cache`: the file does not stay in the page cache, and the
/// pages it passes through are reused). The CRC32 of every [`BLOCK`] is
/// computed as the bytes go by while the writes are sequential; otherwise
/// (nvme-offloaded state arrives tile by tile, its master, m and v at
/// three places of the file) by reading the file back block by block at
/// the end.
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
    /// [`WRITE_BEHIND`] bytes behind them (write-behind, see `page_cache`).
    fn write_out(&mut self, at: u64, bytes: &[u8]) -> Result<()> {
        self.file
            .write_all_at(bytes, at)
            .map_err(io(&self.path, "write"))?;
        if self.sequential {
            let end = at + bytes.len() as u64;
            page_cache::start_writeback(&self.file, at, bytes.len() as u64);
            let upto = end.saturating_sub(WRITE_BEHIND) & !0xfff;
            if upto > self.behind {
                page_cache::write_back_and_drop(&self.file, self.behind, upto - self.behind);
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
        page_cache::drop_range(&self.file, 0, len);
        Ok((len, self.crcs))
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::TestDir;
    use super::super::fixture::{plan, value, write_rank};
    use super::*;

    /// The file is the header and every unit's master | m | v over its
    /// real range; its CRCs are those of its 1 MiB blocks; writing it in
    /// pieces (not sequential: the CRCs come from reading it back) gives
    /// the same bytes and CRCs.
    #[test]
    fn writes_the_layout_with_block_crcs() {
        let d = TestDir::new("rank-writer");
        let plan = plan();
        for rank in 0..2 {
            let whole = d.0.join(format!("whole{rank}"));
            let (len, crcs) = write_rank(&whole, rank, None);
            let bytes = std::fs::read(&whole).unwrap();
            assert_eq!(bytes.len() as u64, len);
            let mut want = header(rank).to_vec();
            for (u, l) in plan.units().iter().enumerate() {
                for k in 0..3 {
                    for i in l.real_range(rank) {
                        want.extend_from_slice(&value(u, k, i).to_le_bytes());
                    }
                }
            }
            assert!(
                bytes == want,
                "rank {rank}: the bytes differ from the layout"
            );
            let blocks: Vec<u32> = bytes.chunks(BLOCK).map(crc32fast::hash).collect();
            assert!(blocks.len() > 1);
            assert_eq!(crcs, blocks);
            // 997 elements at a time: master, m, v of a piece are not
            // adjacent in the file.
            let pieces = d.0.join(format!("pieces{rank}"));
            assert_eq!(write_rank(&pieces, rank, Some(997)), (len, crcs));
            assert!(std::fs::read(&pieces).unwrap() == bytes);
        }
    }

    /// An existing file is not overwritten, and a file with a part never
    /// written is refused at the end, naming it.
    #[test]
    fn refuses_existing_and_incomplete_files() {
        let d = TestDir::new("rank-writer-errors");
        let plan = plan();
        let path = d.0.join("rank00000.bin");
        std::fs::write(&path, b"old").unwrap();
        let e = RankFileWriter::create(&path, plan.units(), 0)
            .err()
            .unwrap();
        assert!(e.to_string().contains("create:"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        let path = d.0.join("rank00001.bin");
        let w = RankFileWriter::create(&path, plan.units(), 1).unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(
            e.contains("rank00001.bin") && e.contains("wrote 16 bytes, expected"),
            "{e}"
        );
    }
}
