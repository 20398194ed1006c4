//! The raw `O_DIRECT` baseline of the NVMe benchmarks (`offload`,
//! `infinity`): the fastest this disk writes and reads a preallocated file
//! of the state's size, over a grid of queue depths (threads, one request
//! each in flight, as fio's `psync` with `numjobs`), request sizes and, for
//! `offload`, the memory the requests move to and from (one scratch buffer
//! per thread, as fio does, or memory of the state's size, as the swap
//! path must fill). Included by both benches with `#[path]`.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use zero::offload::AlignedBuf;

fn fail(msg: &str) -> ! {
    eprintln!("raw baseline: {msg}");
    std::process::exit(2)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Queue depths of the raw baseline: `jobs` threads, each with one
/// request in flight (fio's `numjobs` at `iodepth=1`, as `psync` runs).
pub const RAW_JOBS: [usize; 3] = [1, 2, 4];

/// Request sizes of the raw baseline besides the swap's own block size
/// (on these VMs' virtual disks 4 MiB requests ran 2-3x faster than 1 MiB
/// ones at any depth).
pub const RAW_BLOCKS: [usize; 2] = [4 << 20, 16 << 20];

/// One raw pass: `jobs` threads of `block`-byte requests, to and from one
/// scratch buffer per thread (`whole` false, as fio does) or the blocks of
/// one buffer of the file's size (`whole`, as the state's own memory is).
/// On these VMs either may be the faster: both are tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawPass {
    /// Threads, one request each in flight.
    pub jobs: usize,
    /// Bytes per request.
    pub block: usize,
    /// To and from memory of the file's size (else a scratch buffer per
    /// thread).
    pub whole: bool,
}

/// The raw baseline's file: preallocated, `O_DIRECT`, written once in
/// full (untimed) when created, as the swap file is, and then overwritten
/// and read by every timed pass (no unwritten-extent conversion, the same
/// blocks from run to run). Removed when dropped.
pub struct RawFile {
    file: std::fs::File,
    path: PathBuf,
    /// The file's size: the state's bytes rounded up to the largest block.
    bytes: usize,
    /// The state's bytes: times are scaled to them.
    state: usize,
    /// Request sizes tried (the swap's block size first).
    blocks: Vec<usize>,
    /// Memory of the file's size, for the passes to and from it (`None`:
    /// scratch passes only).
    mem: Option<std::sync::Mutex<AlignedBuf>>,
}

impl RawFile {
    /// The file for `state` bytes under `dir`, tried with requests of
    /// `block` bytes and of [`RAW_BLOCKS`]; `whole`: also to and from
    /// memory of the file's size (allocated here). Refuses a disk without
    /// room for it, naming both figures.
    pub fn create(dir: &Path, state: usize, block: usize, whole: bool) -> RawFile {
        let mut blocks = vec![block];
        blocks.extend(RAW_BLOCKS.iter().filter(|&&b| b != block));
        let largest = blocks.iter().copied().max().unwrap_or(block);
        let bytes = state.div_ceil(largest) * largest;
        let free = zero::offload::free_space(dir)
            .unwrap_or_else(|e| fail(&e.to_string()))
            .available;
        if free < bytes as u64 {
            fail(&format!(
                "{bytes} bytes needed under {}, {free} are free",
                dir.display()
            ));
        }
        let path = dir.join(format!("zero-raw-bench-{}.bin", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap_or_else(|e| fail(&format!("{}: {e} (O_DIRECT)", path.display())));
        // SAFETY: the fd is open and owned by `file` for the call.
        let rc = unsafe {
            libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, bytes as i64)
        };
        if rc != 0 {
            fail(&format!(
                "{}: posix_fallocate failed ({rc})",
                path.display()
            ));
        }
        let mem = whole.then(|| {
            let mut mem = AlignedBuf::new(bytes).unwrap_or_else(|e| fail(&e.to_string()));
            mem.iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = (i % 251) as u8);
            std::sync::Mutex::new(mem)
        });
        let raw = RawFile {
            file,
            path,
            bytes,
            state,
            blocks,
            mem,
        };
        raw.pass(
            true,
            RawPass {
                jobs: 1,
                block: largest,
                whole: false,
            },
        );
        raw
    }

    /// One write or read of the whole file in `block` requests by `jobs`
    /// threads, block `i` by thread `i % jobs` (the disk sees the file in
    /// order with `jobs` requests in flight); the time scaled to the
    /// state's bytes.
    pub fn pass(&self, write: bool, p: RawPass) -> Duration {
        let RawPass { jobs, block, whole } = p;
        let blocks = self.bytes / block;
        let mut mem = match (&self.mem, whole) {
            (Some(m), true) => Some(m.lock().unwrap_or_else(|e| e.into_inner())),
            (None, true) => fail("a pass to and from the state's memory, which was not made"),
            _ => None,
        };
        // Per thread, its requests' memory in the file's memory (whole).
        let mut parts: Vec<Vec<Option<&mut [u8]>>> = (0..jobs).map(|_| Vec::new()).collect();
        match mem.as_mut() {
            Some(m) => {
                for (i, c) in m.chunks_mut(block).take(blocks).enumerate() {
                    parts[i % jobs].push(Some(c));
                }
            }
            None => {
                for i in 0..blocks {
                    parts[i % jobs].push(None);
                }
            }
        }
        let t = Instant::now();
        std::thread::scope(|sc| {
            for (j, mine) in parts.into_iter().enumerate() {
                sc.spawn(move || {
                    let mut scratch = (!whole).then(|| {
                        let mut b = AlignedBuf::new(block).unwrap_or_else(|e| fail(&e.to_string()));
                        b.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
                        b
                    });
                    for (k, part) in mine.into_iter().enumerate() {
                        let at = ((j + k * jobs) * block) as u64;
                        let data: &mut [u8] = match (scratch.as_mut(), part) {
                            (Some(b), _) => b,
                            (None, Some(p)) => p,
                            (None, None) => unreachable!("whole passes have their memory"),
                        };
                        let r = if write {
                            self.file.write_all_at(data, at)
                        } else {
                            self.file.read_exact_at(data, at)
                        };
                        r.unwrap_or_else(|e| fail(&format!("raw I/O at {at}: {e}")));
                    }
                });
            }
        });
        // Scaled to the state's bytes from those moved (a block size that
        // does not divide the file leaves its tail out).
        t.elapsed()
            .mul_f64(self.state as f64 / (blocks * block) as f64)
    }

    /// The passes tried, in the order of [`grid_times`](Self::grid_times)'s
    /// times.
    pub fn grid(&self) -> Vec<RawPass> {
        let mut grid = Vec::new();
        let wholes: &[bool] = if self.mem.is_some() {
            &[false, true]
        } else {
            &[false]
        };
        for &whole in wholes {
            for &block in &self.blocks {
                for &jobs in &RAW_JOBS {
                    grid.push(RawPass { jobs, block, whole });
                }
            }
        }
        grid
    }

    /// The grid run `reps` times: per pass of [`grid`](Self::grid), its
    /// (write, read) times, one per repetition.
    pub fn grid_times(&self, reps: usize) -> Vec<Vec<(Duration, Duration)>> {
        let grid = self.grid();
        let mut times = vec![Vec::with_capacity(reps); grid.len()];
        for _ in 0..reps {
            for (p, t) in grid.iter().zip(&mut times) {
                t.push((self.pass(true, *p), self.pass(false, *p)));
            }
        }
        times
    }

    /// The fastest pass of each direction over the grid run `reps` times,
    /// by its median (the disk's best, as fio would find it, measured as
    /// often as the swap path is): (write pass, read pass).
    pub fn fastest(&self, reps: usize) -> (RawPass, RawPass) {
        let times = self.grid_times(reps);
        fastest_of(&self.grid(), &times)
    }
}

/// The passes of `grid` with the least median write and read time in
/// `times` (per pass, its (write, read) times).
pub fn fastest_of(grid: &[RawPass], times: &[Vec<(Duration, Duration)>]) -> (RawPass, RawPass) {
    let pick = |dir: fn(&(Duration, Duration)) -> Duration| {
        grid.iter()
            .zip(times)
            .min_by_key(|(_, t)| median(t.iter().map(dir).collect()))
            .map_or(grid[0], |(p, _)| *p)
    };
    (pick(|t| t.0), pick(|t| t.1))
}

impl Drop for RawFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
