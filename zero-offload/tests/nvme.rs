//! NVMe swap files: round trips, pipelining, every fault, cleanup.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use zero_core::memory::{Category, MemoryTracker, Tier};
use zero_offload::host::{HostPool, HostPoolOptions};
use zero_offload::nvme::{FaultPlan, RegionSpec, SwapFile, SwapOptions};
use zero_offload::{AlignedBuf, Error};

const BLOCK: usize = 64 << 10;

/// A deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_buf(len: usize, seed: u64) -> AlignedBuf {
    let mut rng = Rng(seed | 1);
    let mut b = AlignedBuf::new(len).unwrap();
    for chunk in b.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    b
}

fn options(dir: &Path) -> SwapOptions {
    SwapOptions {
        block_size: BLOCK,
        thread_count: 2,
        queue_depth: 4,
        ..SwapOptions::new(dir, 0)
    }
}

fn tmpdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("zero-nvme-test")
        .tempdir_in("/tmp")
        .unwrap()
}

/// A file with regions "a" (3.5 blocks) and "b" (2 blocks), both written.
fn small_file(dir: &Path) -> (SwapFile, AlignedBuf, AlignedBuf) {
    small_file_with(options(dir))
}

/// [`small_file`] with `opts`.
fn small_file_with(opts: SwapOptions) -> (SwapFile, AlignedBuf, AlignedBuf) {
    let swap = SwapFile::create(
        opts,
        &[
            RegionSpec::new("a", (BLOCK * 7 / 2) as u64),
            RegionSpec::new("b", (2 * BLOCK) as u64),
        ],
    )
    .unwrap();
    let a = random_buf(BLOCK * 7 / 2, 1);
    let b = random_buf(2 * BLOCK, 2);
    let ra = swap.region("a").unwrap();
    let rb = swap.region("b").unwrap();
    let a = swap.write(ra, a).wait().unwrap();
    let b = swap.write(rb, b).wait().unwrap();
    (swap, a, b)
}

fn io_msg(e: &Error) -> String {
    match e {
        Error::Io { .. } => e.to_string(),
        other => panic!("expected Error::Io, got {other}"),
    }
}

#[test]
fn many_regions_round_trip_random_data() {
    let dir = tmpdir();
    let mut rng = Rng(42);
    // Sizes around the block size: tiny, partial last blocks, exact multiples.
    let mut specs: Vec<RegionSpec> = (0..24)
        .map(|i| {
            let len = match i % 4 {
                0 => 1 + rng.below(100),
                1 => BLOCK as u64 * (1 + rng.below(4)),
                _ => 1 + rng.below(5 * BLOCK as u64),
            };
            RegionSpec::new(format!("tile{i}.{}", ["master", "m", "v"][i % 3]), len)
        })
        .collect();
    specs.push(RegionSpec::new("odd", 4097));
    let planned = SwapFile::planned_len(&options(dir.path()), &specs).unwrap();
    let swap = SwapFile::create(options(dir.path()), &specs).unwrap();
    // The length planned before anything is written is the file's.
    assert_eq!(planned, swap.file_len());
    assert_eq!(std::fs::metadata(swap.path()).unwrap().len(), planned);
    // /tmp is ext4 on the project's machines; elsewhere a fallback must say so.
    assert_eq!(
        swap.direct_io(),
        swap.warnings().is_empty(),
        "{:?}",
        swap.warnings()
    );
    assert_eq!(swap.block_size(), BLOCK);
    let name = swap
        .path()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(name.starts_with("zero-swap-optimizer-rank0-"), "{name}");
    assert!(name.contains(&format!("{:016x}", swap.run_id())), "{name}");

    // Layout: block-aligned, in order, not overlapping, inside the file.
    let mut end = 0;
    for s in &specs {
        let id = swap.region(&s.name).unwrap();
        let off = swap.region_offset(id).unwrap();
        assert_eq!(off % BLOCK as u64, 0);
        assert!(off >= end.max(BLOCK as u64));
        assert_eq!(swap.region_len(id), Some(s.len));
        end = off + s.len;
    }
    assert!(end <= swap.file_len());
    assert_eq!(
        std::fs::metadata(swap.path()).unwrap().len(),
        swap.file_len()
    );

    // Submit every write before waiting on any.
    let tickets: Vec<_> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            swap.write(
                swap.region(&s.name).unwrap(),
                random_buf(s.len as usize, i as u64 + 100),
            )
        })
        .collect();
    for t in tickets {
        t.wait().unwrap();
    }
    let reads: Vec<_> = specs
        .iter()
        .map(|s| {
            swap.read(
                swap.region(&s.name).unwrap(),
                AlignedBuf::new(s.len as usize).unwrap(),
            )
        })
        .collect();
    for (i, (t, s)) in reads.into_iter().zip(&specs).enumerate() {
        let got = t.wait().unwrap();
        let want = random_buf(s.len as usize, i as u64 + 100);
        assert!(got[..] == want[..], "region {} differs", s.name);
    }
    swap.verify().unwrap();

    // Block-aligned ranges of a region.
    let id = swap.region("tile1.m").unwrap();
    let len = swap.region_len(id).unwrap();
    let part = random_buf(BLOCK, 7);
    swap.write_range(id, 0, BLOCK as u64, part).wait().unwrap();
    let got = swap
        .read_range(id, 0, BLOCK as u64, AlignedBuf::new(BLOCK).unwrap())
        .wait()
        .unwrap();
    assert!(got[..] == random_buf(BLOCK, 7)[..]);
    if len > BLOCK as u64 {
        let rest = (len - BLOCK as u64) as usize;
        let got = swap
            .read_range(
                id,
                BLOCK as u64,
                rest as u64,
                AlignedBuf::new(rest).unwrap(),
            )
            .wait()
            .unwrap();
        assert!(got[..] == random_buf(len as usize, 101)[BLOCK..]);
    }
    swap.close().unwrap();
}

#[test]
fn pipelined_reads_compute_and_writes_with_pooled_buffers() {
    let dir = tmpdir();
    let tiles = 6usize;
    let tile_len = 3 * BLOCK + 4096; // a partial last block
    let specs: Vec<_> = (0..tiles)
        .map(|i| RegionSpec::new(format!("t{i}"), tile_len as u64))
        .collect();
    let swap = SwapFile::create(options(dir.path()), &specs).unwrap();
    let ids: Vec<_> = (0..tiles)
        .map(|i| swap.region(&format!("t{i}")).unwrap())
        .collect();
    // Three buffers: the tile being read ahead, computed on, and written.
    let pool = HostPool::new(&[tile_len; 3], HostPoolOptions::default()).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        let mut b = pool.acquire(tile_len).unwrap();
        b.as_mut_slice_of::<f32>().unwrap().fill(i as f32);
        drop(swap.write(id, b).wait().unwrap());
    }
    let passes = 3;
    for _ in 0..passes {
        let mut next = Some(swap.read(ids[0], pool.acquire(tile_len).unwrap()));
        let mut writing = None;
        for i in 0..tiles {
            let mut buf = next.take().unwrap().wait().unwrap();
            if i + 1 < tiles {
                next = Some(swap.read(ids[i + 1], pool.acquire(tile_len).unwrap()));
            }
            for x in buf.as_mut_slice_of::<f32>().unwrap() {
                *x += 1.0;
            }
            if let Some(w) = writing.replace(swap.write(ids[i], buf)) {
                drop(w.wait().unwrap());
            }
            // Out: the read-ahead of tile i+1 (if any) and the write of tile i.
            assert_eq!(pool.available(), if i + 1 < tiles { 1 } else { 2 });
        }
        drop(writing.unwrap().wait().unwrap());
        assert_eq!(pool.available(), 3, "every buffer came back");
        swap.verify().unwrap();
    }
    for (i, &id) in ids.iter().enumerate() {
        let b = swap
            .read(id, pool.acquire(tile_len).unwrap())
            .wait()
            .unwrap();
        let want = (i + passes) as f32;
        assert!(
            b.as_slice_of::<f32>().unwrap().iter().all(|&x| x == want),
            "tile {i}"
        );
    }
}

#[test]
fn concurrent_readers_and_writers_from_several_threads() {
    let dir = tmpdir();
    let n = 8;
    let len = 2 * BLOCK + 100;
    let specs: Vec<_> = (0..n)
        .map(|i| RegionSpec::new(format!("r{i}"), len as u64))
        .collect();
    let swap = SwapFile::create(options(dir.path()), &specs).unwrap();
    for i in 0..n {
        let id = swap.region(&format!("r{i}")).unwrap();
        swap.write(id, random_buf(len, i as u64)).wait().unwrap();
    }
    std::thread::scope(|s| {
        // Writers rewrite the even regions with the same data; readers check
        // the odd ones, all at once.
        for t in 0..2 {
            let swap = &swap;
            s.spawn(move || {
                for round in 0..10 {
                    let i = 2 * ((round + t) % (n / 2));
                    let id = swap.region(&format!("r{i}")).unwrap();
                    swap.write(id, random_buf(len, i as u64)).wait().unwrap();
                }
            });
            s.spawn(move || {
                for round in 0..10 {
                    let i = 2 * ((round + t) % (n / 2)) + 1;
                    let id = swap.region(&format!("r{i}")).unwrap();
                    let got = swap.read(id, AlignedBuf::new(len).unwrap()).wait().unwrap();
                    assert!(got[..] == random_buf(len, i as u64)[..], "r{i}");
                }
            });
        }
    });
    for i in 0..n {
        let id = swap.region(&format!("r{i}")).unwrap();
        let got = swap.read(id, AlignedBuf::new(len).unwrap()).wait().unwrap();
        assert!(got[..] == random_buf(len, i as u64)[..], "r{i}");
    }
    swap.verify().unwrap();
}

#[test]
fn truncated_file_is_a_short_read_error() {
    let dir = tmpdir();
    let (swap, a, _) = small_file(dir.path());
    let rb = swap.region("b").unwrap();
    let cut = swap.region_offset(rb).unwrap() + BLOCK as u64 + 4096;
    OpenOptions::new()
        .write(true)
        .open(swap.path())
        .unwrap()
        .set_len(cut)
        .unwrap();

    // Region "a" lies before the cut and still reads.
    let got = swap
        .read(swap.region("a").unwrap(), AlignedBuf::new(a.len()).unwrap())
        .wait()
        .unwrap();
    assert!(got[..] == a[..]);

    let err = swap
        .read(rb, AlignedBuf::new(2 * BLOCK).unwrap())
        .wait()
        .unwrap_err();
    let msg = io_msg(&err.error);
    assert!(msg.contains(&swap.path().display().to_string()), "{msg}");
    assert!(msg.contains("region `b` block 1"), "{msg}");
    assert!(
        msg.contains(&format!("file offset {}", cut - 4096)),
        "{msg}"
    );
    assert!(
        msg.contains("short read") && msg.contains("truncated"),
        "{msg}"
    );
    assert_eq!(err.buffer.len(), 2 * BLOCK, "the buffer comes back");

    let msg = io_msg(&swap.verify().unwrap_err());
    assert!(msg.contains(&format!("truncated to {cut} bytes")), "{msg}");
}

/// Blocks joined into one transfer (`max_transfer`) or moved one by one
/// give the same bytes, and a damaged block is the same error naming the
/// same block, whatever the transfer size and thread count (one transfer
/// at a time, or several, checksums after the slot is given back).
#[test]
fn joined_transfers_give_the_same_bytes_and_errors() {
    for (max_transfer, threads, depth) in [
        (BLOCK, 1, 4),
        (2 * BLOCK, 2, 4),
        (3 * BLOCK, 1, 4),
        (8 << 20, 2, 4),
        (8 << 20, 1, 1),
        (BLOCK, 3, 8),
    ] {
        let dir = tmpdir();
        let (swap, a, b) = small_file_with(SwapOptions {
            max_transfer,
            thread_count: threads,
            queue_depth: depth,
            ..options(dir.path())
        });
        let ctx = format!("max_transfer {max_transfer}, {threads} threads, queue_depth {depth}");
        assert_eq!(swap.io_threads(), threads + 2, "{ctx}");
        let (ra, rb) = (swap.region("a").unwrap(), swap.region("b").unwrap());
        let got = swap
            .read(ra, AlignedBuf::new(a.len()).unwrap())
            .wait()
            .unwrap();
        assert!(got[..] == a[..], "{ctx}");
        let got = swap
            .read(rb, AlignedBuf::new(b.len()).unwrap())
            .wait()
            .unwrap();
        assert!(got[..] == b[..], "{ctx}");
        // A range starting mid-region.
        let got = swap
            .read_range(
                ra,
                BLOCK as u64,
                2 * BLOCK as u64,
                AlignedBuf::new(2 * BLOCK).unwrap(),
            )
            .wait()
            .unwrap();
        assert!(got[..] == a[BLOCK..3 * BLOCK], "{ctx}");
        // Damage block 2 of "a": the error names it, whatever was joined.
        let at = swap.region_offset(ra).unwrap() + 2 * BLOCK as u64 + 7;
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(swap.path())
            .unwrap();
        f.write_all_at(&[a[2 * BLOCK + 7] ^ 1], at).unwrap();
        f.sync_all().unwrap();
        let err = swap
            .read(ra, AlignedBuf::new(a.len()).unwrap())
            .wait()
            .unwrap_err();
        let msg = io_msg(&err.error);
        assert!(
            msg.contains("region `a` block 2") && msg.contains("checksum mismatch"),
            "{ctx}: {msg}"
        );
    }
}

#[test]
fn flipped_byte_is_a_checksum_error() {
    let dir = tmpdir();
    let (swap, a, _) = small_file(dir.path());
    let ra = swap.region("a").unwrap();
    let at = swap.region_offset(ra).unwrap() + 2 * BLOCK as u64 + 12345;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(swap.path())
        .unwrap();
    let mut byte = [0u8];
    f.read_exact_at(&mut byte, at).unwrap();
    assert_eq!(byte[0], a[2 * BLOCK + 12345]);
    f.write_all_at(&[byte[0] ^ 0x10], at).unwrap();
    f.sync_all().unwrap();

    let err = swap
        .read(ra, AlignedBuf::new(a.len()).unwrap())
        .wait()
        .unwrap_err();
    let msg = io_msg(&err.error);
    assert!(msg.contains("region `a` block 2"), "{msg}");
    assert!(
        msg.contains(&format!("file offset {}", at - 12345)),
        "{msg}"
    );
    assert!(msg.contains("checksum mismatch"), "{msg}");
    assert!(msg.contains(&swap.path().display().to_string()), "{msg}");

    // The blocks before it are intact and read fine on their own.
    let got = swap
        .read_range(ra, 0, 2 * BLOCK as u64, AlignedBuf::new(2 * BLOCK).unwrap())
        .wait()
        .unwrap();
    assert!(got[..] == a[..2 * BLOCK]);
    // Rewriting repairs it.
    let a = swap.write(ra, a).wait().unwrap();
    let got = swap
        .read(ra, AlignedBuf::new(a.len()).unwrap())
        .wait()
        .unwrap();
    assert!(got[..] == a[..]);
}

#[test]
fn foreign_or_damaged_header_fails_verify() {
    let dir = tmpdir();
    let (swap, _, _) = small_file(dir.path());
    swap.verify().unwrap();
    let other = SwapFile::create(
        SwapOptions {
            rank: 1,
            ..options(dir.path())
        },
        &[
            RegionSpec::new("a", (BLOCK * 7 / 2) as u64),
            RegionSpec::new("b", (2 * BLOCK) as u64),
        ],
    )
    .unwrap();
    assert_ne!(other.path(), swap.path());
    assert_ne!(other.run_id(), swap.run_id());
    let mut header = vec![0u8; 4096];
    std::fs::File::open(other.path())
        .unwrap()
        .read_exact_at(&mut header, 0)
        .unwrap();

    let f = OpenOptions::new().write(true).open(swap.path()).unwrap();
    f.write_all_at(&header, 0).unwrap();
    f.sync_all().unwrap();
    let msg = io_msg(&swap.verify().unwrap_err());
    assert!(msg.contains("belongs to another swap file"), "{msg}");
    assert!(
        msg.contains(&format!("run {:016x}, rank 1", other.run_id())),
        "{msg}"
    );
    assert!(msg.contains(&swap.path().display().to_string()), "{msg}");

    f.write_all_at(&[0u8; 4096], 0).unwrap();
    f.sync_all().unwrap();
    let msg = io_msg(&swap.verify().unwrap_err());
    assert!(msg.contains("bad magic"), "{msg}");

    header[40] ^= 1; // damage the other header's fields: its checksum fails
    f.write_all_at(&header, 0).unwrap();
    f.sync_all().unwrap();
    let msg = io_msg(&swap.verify().unwrap_err());
    assert!(msg.contains("checksum mismatch"), "{msg}");
}

#[test]
fn file_deleted_mid_run_fails_verify() {
    let dir = tmpdir();
    let (swap, _, _) = small_file(dir.path());
    std::fs::remove_file(swap.path()).unwrap();
    let msg = io_msg(&swap.verify().unwrap_err());
    assert!(msg.contains("deleted while in use"), "{msg}");
    assert!(msg.contains("st_nlink == 0"), "{msg}");
    let msg = io_msg(&swap.close().unwrap_err());
    assert!(msg.contains("deleted"), "{msg}");
}

#[test]
fn reading_a_block_never_written_is_an_error() {
    let dir = tmpdir();
    let swap = SwapFile::create(
        options(dir.path()),
        &[RegionSpec::new("m", (3 * BLOCK) as u64)],
    )
    .unwrap();
    let id = swap.region("m").unwrap();
    let err = swap
        .read(id, AlignedBuf::new(3 * BLOCK).unwrap())
        .wait()
        .unwrap_err();
    let msg = io_msg(&err.error);
    assert!(
        msg.contains("region `m` block 0") && msg.contains("never written"),
        "{msg}"
    );
    // Write only the first block: the second is still unwritten.
    swap.write_range(id, 0, BLOCK as u64, random_buf(BLOCK, 3))
        .wait()
        .unwrap();
    let err = swap
        .read(id, AlignedBuf::new(3 * BLOCK).unwrap())
        .wait()
        .unwrap_err();
    assert!(io_msg(&err.error).contains("block 1"), "{}", err.error);
}

#[test]
fn injected_enospc_hands_the_buffer_back_intact() {
    let dir = tmpdir();
    let swap = SwapFile::create(
        SwapOptions {
            faults: FaultPlan::enospc_at(2),
            queue_depth: 1, // one piece at a time: write #2 is block 2
            ..options(dir.path())
        },
        &[RegionSpec::new("master", (4 * BLOCK) as u64)],
    )
    .unwrap();
    let id = swap.region("master").unwrap();
    let data = random_buf(4 * BLOCK, 9);
    let err = swap.write(id, data).wait().unwrap_err();
    let msg = io_msg(&err.error);
    assert!(msg.contains(&swap.path().display().to_string()), "{msg}");
    assert!(msg.contains("write of region `master` block 2"), "{msg}");
    let offset = swap.region_offset(id).unwrap() + 2 * BLOCK as u64;
    assert!(msg.contains(&format!("file offset {offset}")), "{msg}");
    assert!(msg.contains("No space left on device"), "{msg}");
    let data = err.buffer;
    assert!(
        data[..] == random_buf(4 * BLOCK, 9)[..],
        "the caller's data survives"
    );

    // The failed block is not readable as if it held data.
    let err = swap
        .read(id, AlignedBuf::new(4 * BLOCK).unwrap())
        .wait()
        .unwrap_err();
    assert!(io_msg(&err.error).contains("block 2"), "{}", err.error);
    // The fault was one-off: a retry with the returned buffer succeeds.
    let data = swap.write(id, data).wait().unwrap();
    let got = swap
        .read(id, AlignedBuf::new(4 * BLOCK).unwrap())
        .wait()
        .unwrap();
    assert!(got[..] == data[..]);
    swap.verify().unwrap();
}

/// `disk_full_from(k)`: block write k and every later one fail (a disk
/// that filled up), each request handing its buffer back intact; the
/// blocks written before stay readable; a range of writes
/// (`fail_write_count`) fails only those.
#[test]
fn injected_full_disk_fails_every_later_write() {
    let dir = tmpdir();
    let swap = SwapFile::create(
        SwapOptions {
            faults: FaultPlan::disk_full_from(3),
            queue_depth: 1, // write #k is the k-th block submitted
            ..options(dir.path())
        },
        &[
            RegionSpec::new("a", (2 * BLOCK) as u64),
            RegionSpec::new("b", (2 * BLOCK) as u64),
            RegionSpec::new("c", BLOCK as u64),
        ],
    )
    .unwrap();
    let [a, b, c] = ["a", "b", "c"].map(|n| swap.region(n).unwrap());
    // #0, #1: a; #2, #3: b (fails at its second block); #4: c.
    swap.write(a, random_buf(2 * BLOCK, 1)).wait().unwrap();
    let err = swap.write(b, random_buf(2 * BLOCK, 2)).wait().unwrap_err();
    let msg = io_msg(&err.error);
    assert!(
        msg.contains("region `b` block 1") && msg.contains("No space left"),
        "{msg}"
    );
    assert!(err.buffer[..] == random_buf(2 * BLOCK, 2)[..]);
    for _ in 0..3 {
        let err = swap.write(c, random_buf(BLOCK, 3)).wait().unwrap_err();
        assert!(io_msg(&err.error).contains("region `c` block 0"));
        assert!(err.buffer[..] == random_buf(BLOCK, 3)[..]);
    }
    let got = swap
        .read(a, AlignedBuf::new(2 * BLOCK).unwrap())
        .wait()
        .unwrap();
    assert!(got[..] == random_buf(2 * BLOCK, 1)[..]);
    swap.verify().unwrap();
    drop(swap);

    // Writes #1 and #2 fail, #3 works again.
    let swap = SwapFile::create(
        SwapOptions {
            faults: FaultPlan {
                fail_write_count: 2,
                ..FaultPlan::enospc_at(1)
            },
            queue_depth: 1,
            ..options(dir.path())
        },
        &[RegionSpec::new("a", BLOCK as u64)],
    )
    .unwrap();
    let a = swap.region("a").unwrap();
    let outcomes: Vec<bool> = (0..4)
        .map(|i| swap.write(a, random_buf(BLOCK, i)).wait().is_ok())
        .collect();
    assert_eq!(outcomes, [true, false, false, true]);
    let got = swap
        .read(a, AlignedBuf::new(BLOCK).unwrap())
        .wait()
        .unwrap();
    assert!(got[..] == random_buf(BLOCK, 3)[..]);
}

#[test]
fn a_dropped_ticket_does_not_lose_its_failure() {
    let dir = tmpdir();
    let swap = SwapFile::create(
        SwapOptions {
            faults: FaultPlan::enospc_at(0),
            queue_depth: 1, // pieces complete in submission order
            ..options(dir.path())
        },
        &[
            RegionSpec::new("a", BLOCK as u64),
            RegionSpec::new("b", BLOCK as u64),
        ],
    )
    .unwrap();
    drop(swap.write(swap.region("a").unwrap(), random_buf(BLOCK, 1)));
    // queue_depth 1: once the second write is done, the first is reported.
    swap.write(swap.region("b").unwrap(), random_buf(BLOCK, 2))
        .wait()
        .unwrap();
    let msg = io_msg(&swap.verify().unwrap_err());
    assert!(
        msg.contains("region `a` block 0") && msg.contains("No space left"),
        "{msg}"
    );
    swap.verify().unwrap(); // reported once
}

/// Unmounts on drop.
struct Mount(std::ffi::CString);

impl Drop for Mount {
    fn drop(&mut self) {
        // SAFETY: a NUL-terminated path owned by self.
        unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Mounts a tmpfs of `size` at `dir`, or says why not.
fn mount_tmpfs(dir: &Path, size: &str) -> Result<Mount, String> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let target = CString::new(dir.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    let fstype = CString::new("tmpfs").unwrap_or_default();
    let data = CString::new(format!("size={size}")).unwrap_or_default();
    // SAFETY: all pointers are NUL-terminated strings owned here; mount does
    // not keep them.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(format!("mount tmpfs: {}", std::io::Error::last_os_error()));
    }
    Ok(Mount(target))
}

#[test]
fn real_enospc_on_a_small_filesystem() {
    let dir = tmpdir();
    let _mount = match mount_tmpfs(dir.path(), "1m") {
        Ok(m) => m,
        Err(why) => {
            println!("skipped real_enospc_on_a_small_filesystem: {why} (needs root/CAP_SYS_ADMIN)");
            return;
        }
    };
    let specs = [RegionSpec::new("v", (4 << 20) as u64)];
    // Preallocation finds the full disk at start-up.
    let err = SwapFile::create(options(dir.path()), &specs).unwrap_err();
    let msg = io_msg(&err);
    assert!(
        msg.contains("cannot reserve") && msg.contains("No space left"),
        "{msg}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "the partial file is removed"
    );

    // Without it, the write hits ENOSPC and the buffer comes back intact.
    let swap = SwapFile::create(
        SwapOptions {
            preallocate: false,
            ..options(dir.path())
        },
        &specs,
    )
    .unwrap();
    let id = swap.region("v").unwrap();
    let err = swap.write(id, random_buf(4 << 20, 5)).wait().unwrap_err();
    let msg = io_msg(&err.error);
    assert!(msg.contains("No space left on device"), "{msg}");
    assert!(msg.contains("write of region `v` block"), "{msg}");
    assert!(msg.contains(&swap.path().display().to_string()), "{msg}");
    assert!(err.buffer[..] == random_buf(4 << 20, 5)[..]);
    drop(swap);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn files_are_fresh_per_run_and_removed_on_drop() {
    let dir = tmpdir();
    let opts = SwapOptions {
        run_id: Some(0xabc),
        tag: "param".into(),
        rank: 3,
        ..options(dir.path())
    };
    let stale = dir
        .path()
        .join("zero-swap-param-rank3-0000000000000abc.swp");
    std::fs::write(&stale, b"stale junk from a crashed run").unwrap();
    let swap = SwapFile::create(opts, &[RegionSpec::new("p", 100)]).unwrap();
    assert_eq!(swap.path(), stale);
    swap.verify().unwrap(); // the stale file was replaced with a valid one
    let tracker = MemoryTracker::new(3);
    let held = swap.account(&tracker, Category::Params);
    assert_eq!(
        tracker.current(Tier::Nvme, Category::Params),
        swap.file_len()
    );
    drop(held);
    drop(swap);
    assert!(!stale.exists(), "removed on drop");

    let a = SwapFile::create(options(dir.path()), &[RegionSpec::new("p", 100)]).unwrap();
    let b = SwapFile::create(options(dir.path()), &[RegionSpec::new("p", 100)]).unwrap();
    assert_ne!(a.path(), b.path(), "a fresh run id per file");
    let path = a.path().to_path_buf();
    a.close().unwrap();
    assert!(!path.exists());
}

#[test]
fn dropping_with_requests_in_flight_completes_them() {
    let dir = tmpdir();
    let swap = SwapFile::create(
        options(dir.path()),
        &[RegionSpec::new("x", (8 * BLOCK) as u64)],
    )
    .unwrap();
    let pool = HostPool::new(&[8 * BLOCK], HostPoolOptions::default()).unwrap();
    let path = swap.path().to_path_buf();
    let t = swap.write(swap.region("x").unwrap(), pool.acquire(8 * BLOCK).unwrap());
    drop(t); // abandoned: the buffer returns to the pool when the write is done
    drop(swap); // drains the queue, then removes the file
    assert!(!path.exists());
    assert_eq!(pool.available(), 1);
}

#[test]
fn direct_io_fallback_is_reported() {
    // Injected: the filesystem "rejects" O_DIRECT.
    let dir = tmpdir();
    let swap = SwapFile::create(
        SwapOptions {
            faults: FaultPlan {
                reject_direct_io: true,
                ..FaultPlan::default()
            },
            ..options(dir.path())
        },
        &[RegionSpec::new("a", 100_000)],
    )
    .unwrap();
    assert!(!swap.direct_io());
    assert_eq!(swap.warnings().len(), 1);
    let w = &swap.warnings()[0];
    assert!(w.contains("O_DIRECT") && w.contains("buffered I/O"), "{w}");
    assert!(w.contains(&swap.path().display().to_string()), "{w}");
    let id = swap.region("a").unwrap();
    swap.write(id, random_buf(100_000, 4)).wait().unwrap();
    let got = swap
        .read(id, AlignedBuf::new(100_000).unwrap())
        .wait()
        .unwrap();
    assert!(got[..] == random_buf(100_000, 4)[..]);

    // Real tmpfs: older kernels reject O_DIRECT there (EINVAL), 6.6+ accept
    // it. Either it works with no warning, or it falls back and says so.
    let shm = tempfile::Builder::new()
        .prefix("zero-nvme-test")
        .tempdir_in("/dev/shm")
        .unwrap();
    let swap = SwapFile::create(options(shm.path()), &[RegionSpec::new("a", 100_000)]).unwrap();
    if swap.direct_io() {
        assert!(swap.warnings().is_empty(), "{:?}", swap.warnings());
        println!("/dev/shm accepts O_DIRECT on this kernel");
    } else {
        assert!(
            swap.warnings().iter().any(|w| w.contains("O_DIRECT")),
            "{:?}",
            swap.warnings()
        );
        println!("/dev/shm fell back: {}", swap.warnings()[0]);
    }
    let id = swap.region("a").unwrap();
    swap.write(id, random_buf(100_000, 4)).wait().unwrap();
    let got = swap
        .read(id, AlignedBuf::new(100_000).unwrap())
        .wait()
        .unwrap();
    assert!(got[..] == random_buf(100_000, 4)[..]);
}

#[test]
fn bad_requests_are_errors_with_the_buffer_back() {
    let dir = tmpdir();
    let (swap, _, _) = small_file(dir.path());
    let ra = swap.region("a").unwrap();
    let msg = swap.region("nope").unwrap_err().to_string();
    assert!(msg.contains("no region `nope` (regions: a, b)"), "{msg}");

    // Buffer too small.
    let err = swap
        .read(ra, AlignedBuf::new(BLOCK).unwrap())
        .wait()
        .unwrap_err();
    assert!(err.error.to_string().contains("too small"), "{}", err.error);
    assert_eq!(err.buffer.len(), BLOCK);
    // Misaligned offset; a partial block that does not end the region;
    // beyond the end; empty.
    for (off, len) in [
        (4096, BLOCK as u64),
        (0, 100),
        (0, 100 * BLOCK as u64),
        (0, 0),
    ] {
        let err = swap
            .read_range(ra, off, len, AlignedBuf::new(4 * BLOCK).unwrap())
            .wait()
            .unwrap_err();
        assert!(matches!(err.error, Error::Io { .. }), "{}", err.error);
    }
    // A final partial block is fine.
    let tail = (BLOCK / 2) as u64;
    swap.read_range(ra, 3 * BLOCK as u64, tail, AlignedBuf::new(BLOCK).unwrap())
        .wait()
        .unwrap();

    // Bad layouts.
    let d = dir.path();
    assert!(SwapFile::create(
        options(d),
        &[RegionSpec::new("a", 1), RegionSpec::new("a", 1)]
    )
    .is_err());
    assert!(SwapFile::create(options(d), &[RegionSpec::new("", 1)]).is_err());
    assert!(SwapFile::create(options(d), &[RegionSpec::new("z", 0)]).is_err());
    let err = SwapFile::create(
        SwapOptions {
            block_size: 1000,
            ..options(d)
        },
        &[],
    )
    .unwrap_err();
    assert!(err.to_string().contains("aio.block_size"), "{err}");
}

// ---------------------------------------------------------------------------
// Bandwidth: swap path vs raw O_DIRECT (run with --ignored --nocapture)
// ---------------------------------------------------------------------------

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Raw O_DIRECT sequential write then read of `buf.len()` bytes in `block`
/// pieces from one thread, on a preallocated file; (write, read) seconds.
fn raw_direct(dir: &Path, buf: &mut AlignedBuf, block: usize) -> (f64, f64) {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("raw.bin");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .unwrap();
    // SAFETY: the fd is open and owned by `f`.
    let rc =
        unsafe { libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, buf.len() as i64) };
    assert_eq!(rc, 0);
    let t = Instant::now();
    for (i, chunk) in buf.chunks(block).enumerate() {
        f.write_all_at(chunk, (i * block) as u64).unwrap();
    }
    let w = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for (i, chunk) in buf.chunks_mut(block).enumerate() {
        f.read_exact_at(chunk, (i * block) as u64).unwrap();
    }
    let r = t.elapsed().as_secs_f64();
    std::fs::remove_file(path).unwrap();
    (w, r)
}

fn swap_path(dir: &Path, buf: AlignedBuf, block: usize, threads: usize) -> (AlignedBuf, f64, f64) {
    let len = buf.len();
    let regions = 8;
    let per = len / regions;
    let specs: Vec<_> = (0..regions)
        .map(|i| RegionSpec::new(format!("r{i}"), per as u64))
        .collect();
    let swap = SwapFile::create(
        SwapOptions {
            block_size: block,
            thread_count: threads,
            ..SwapOptions::new(dir, 0)
        },
        &specs,
    )
    .unwrap();
    assert!(swap.direct_io());
    assert_eq!(swap.io_threads(), threads + 2);
    // One region per request, all in flight, each its own buffer (as the
    // engine's tiles would be); the caller's one buffer is split by copying
    // outside the timed part.
    let mut parts: Vec<AlignedBuf> = (0..regions)
        .map(|i| {
            let mut b = AlignedBuf::new(per).unwrap();
            b.copy_from_slice(&buf[i * per..(i + 1) * per]);
            b
        })
        .collect();
    let ids: Vec<_> = (0..regions)
        .map(|i| swap.region(&format!("r{i}")).unwrap())
        .collect();
    let t = Instant::now();
    let tickets: Vec<_> = parts
        .drain(..)
        .zip(&ids)
        .map(|(b, &id)| swap.write(id, b))
        .collect();
    let mut parts: Vec<_> = tickets.into_iter().map(|t| t.wait().unwrap()).collect();
    let w = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let tickets: Vec<_> = parts
        .drain(..)
        .zip(&ids)
        .map(|(b, &id)| swap.read(id, b))
        .collect();
    let parts: Vec<_> = tickets.into_iter().map(|t| t.wait().unwrap()).collect();
    let r = t.elapsed().as_secs_f64();
    for (i, p) in parts.iter().enumerate() {
        assert!(p[..] == buf[i * per..(i + 1) * per]);
    }
    swap.close().unwrap();
    (buf, w, r)
}

#[test]
#[ignore = "measures disk bandwidth (~GBs of I/O); run with --ignored --nocapture"]
fn swap_vs_raw_bandwidth() {
    let mib: usize = std::env::var("ZERO_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    let block = std::env::var("ZERO_BENCH_BLOCK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 20);
    let dir = tempfile::Builder::new()
        .prefix("zero-nvme-bench")
        .tempdir_in("/tmp")
        .unwrap();
    let mut buf = random_buf(mib << 20, 77);
    let bytes = buf.len();
    println!(
        "{mib} MiB, block {block} B, O_DIRECT on {}",
        dir.path().display()
    );
    let mut rows: Vec<(String, Vec<f64>, Vec<f64>)> = vec![
        ("raw O_DIRECT, 1 thread".into(), vec![], vec![]),
        ("swap, thread_count 1".into(), vec![], vec![]),
        ("swap, thread_count 2".into(), vec![], vec![]),
    ];
    for _ in 0..3 {
        let (w, r) = raw_direct(dir.path(), &mut buf, block);
        rows[0].1.push(gbps(bytes, w));
        rows[0].2.push(gbps(bytes, r));
        for (row, threads) in [(1, 1), (2, 2)] {
            let (b, w, r) = swap_path(dir.path(), buf, block, threads);
            buf = b;
            rows[row].1.push(gbps(bytes, w));
            rows[row].2.push(gbps(bytes, r));
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut raw_w, mut raw_r) = (rows[0].1.clone(), rows[0].2.clone());
    let (raw_w, raw_r) = (median(&mut raw_w), median(&mut raw_r));
    for (name, w, r) in &mut rows {
        let (mw, mr) = (median(w), median(r));
        println!(
            "{name:<24} write {mw:5.2} GB/s ({:4.0}% of raw)  read {mr:5.2} GB/s ({:4.0}% of raw)   runs w {:.2?} r {:.2?}",
            100.0 * mw / raw_w,
            100.0 * mr / raw_r,
            w,
            r
        );
    }
}
