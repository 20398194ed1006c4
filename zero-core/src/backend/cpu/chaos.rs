//! Chaos mode's machinery: one worker thread per stream running its queue
//! in order with random delays, real events (a worker waits for another's
//! progress), and freed memory poisoned and quarantined once no queue can
//! touch it any more.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::super::{BufferId, Stream};
use crate::{Error, Result};

/// Freed memory kept (poisoned) before it goes back to the allocator, so
/// that a late reader sees NaN rather than another buffer's data.
const QUARANTINE_BYTES: usize = 64 << 20;

/// The byte every byte of a freed buffer is set to in Chaos mode (`0xFF`:
/// all-ones elements are NaN in f32, bf16 and f16).
pub const POISON: u8 = 0xFF;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An operation of a stream: runs on the stream's worker.
pub(crate) type Job = Box<dyn FnOnce() -> Result<()> + Send>;

enum Item {
    /// An operation, after sleeping `delay`.
    Run(Job, Duration),
    /// Wait until stream `stream` has completed `seq` items.
    Wait { stream: usize, seq: u64 },
    /// One queue's share of a freed buffer (see [`Grave`]).
    Release(Arc<Grave>),
    /// Leave the loop (the backend is dropped).
    Stop,
}

/// How many items each worker has completed.
struct Progress {
    done: Mutex<[u64; 4]>,
    cv: Condvar,
}

impl Progress {
    fn wait_until(&self, stream: usize, seq: u64) {
        let mut g = lock(&self.done);
        while g[stream] < seq {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn advance(&self, stream: usize) {
        lock(&self.done)[stream] += 1;
        self.cv.notify_all();
    }
}

struct Queue {
    items: Mutex<VecDeque<Item>>,
    cv: Condvar,
}

/// Memory of a dropped buffer, released when every queue passed the point
/// where it was dropped.
pub(crate) struct Grave {
    id: BufferId,
    remaining: AtomicUsize,
    mem: Mutex<Option<Box<dyn Any + Send>>>,
    ptr: *mut u8,
    bytes: usize,
    quarantine: Arc<Quarantine>,
}

// SAFETY: `ptr` points into the allocation owned by `mem` (Send); it is
// only written by the last `release`, when no queued operation can touch
// the memory any more.
unsafe impl Send for Grave {}
// SAFETY: as above; shared access only decrements an atomic.
unsafe impl Sync for Grave {}

impl Grave {
    fn release(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        if let Some(mem) = lock(&self.mem).take() {
            // SAFETY: every queue has run every item enqueued before the
            // buffer was dropped, and no item enqueued later can name it
            // (the handle is gone), so nothing else touches these bytes;
            // `mem` keeps them allocated.
            unsafe { std::ptr::write_bytes(self.ptr, POISON, self.bytes) };
            self.quarantine.keep(self.id, mem, self.ptr, self.bytes);
        }
    }
}

struct Quarantined {
    id: BufferId,
    _mem: Box<dyn Any + Send>,
    ptr: *const u8,
    bytes: usize,
}

/// Recently freed, poisoned memory, oldest first.
#[derive(Default)]
pub(crate) struct Quarantine {
    list: Mutex<(VecDeque<Quarantined>, usize)>,
}

// SAFETY: the pointers point into the allocations the entries own; they
// are only read (copied out) under the lock.
unsafe impl Send for Quarantine {}
// SAFETY: as above.
unsafe impl Sync for Quarantine {}

impl Quarantine {
    fn keep(&self, id: BufferId, mem: Box<dyn Any + Send>, ptr: *const u8, bytes: usize) {
        let mut g = lock(&self.list);
        g.1 += bytes;
        g.0.push_back(Quarantined {
            id,
            _mem: mem,
            ptr,
            bytes,
        });
        while g.1 > QUARANTINE_BYTES && g.0.len() > 1 {
            let old = g.0.pop_front().expect("non-empty");
            g.1 -= old.bytes;
        }
    }

    /// A copy of the poisoned bytes of freed buffer `id`, if still kept.
    pub(crate) fn bytes(&self, id: BufferId) -> Option<Vec<u8>> {
        let g = lock(&self.list);
        g.0.iter().find(|q| q.id == id).map(|q| {
            // SAFETY: the entry owns the allocation behind `ptr`, which
            // holds `bytes` bytes and is no longer written by anyone.
            unsafe { std::slice::from_raw_parts(q.ptr, q.bytes) }.to_vec()
        })
    }
}

/// splitmix64: the delays are a deterministic function of the seed and
/// the order in which work was enqueued.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Most operations run at once; some wait up to 50 µs, a few up to
    /// 500 µs, so streams overtake each other in every order.
    fn delay(&mut self) -> Duration {
        let r = self.next();
        let micros = match r % 100 {
            0..60 => 0,
            60..95 => (r >> 8) % 50,
            _ => 50 + (r >> 8) % 450,
        };
        Duration::from_micros(micros)
    }
}

/// The four stream workers of one backend in Chaos mode.
pub(crate) struct Workers {
    queues: Vec<Arc<Queue>>,
    progress: Arc<Progress>,
    /// Items pushed per stream (the queue position of the last one).
    pushed: Mutex<[u64; 4]>,
    rng: Mutex<Rng>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    quarantine: Arc<Quarantine>,
}

impl Workers {
    /// Starts one worker per stream; `failed` receives the first error of
    /// an operation that fails on a worker.
    pub(crate) fn start(seed: u64, failed: Arc<Mutex<Option<Error>>>) -> Result<Self> {
        let progress = Arc::new(Progress {
            done: Mutex::new([0; 4]),
            cv: Condvar::new(),
        });
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        for s in Stream::ALL {
            let q = Arc::new(Queue {
                items: Mutex::new(VecDeque::new()),
                cv: Condvar::new(),
            });
            let (q2, p2, f2) = (q.clone(), progress.clone(), failed.clone());
            let t = std::thread::Builder::new()
                .name(format!("zero-chaos-{s}"))
                .spawn(move || run_worker(s.index(), &q2, &p2, &f2))
                .map_err(|e| Error::Backend {
                    op: "CpuBackend::new",
                    msg: format!("cannot start the Chaos worker of stream {s}: {e}"),
                })?;
            queues.push(q);
            threads.push(t);
        }
        Ok(Workers {
            queues,
            progress,
            pushed: Mutex::new([0; 4]),
            rng: Mutex::new(Rng(seed)),
            threads: Mutex::new(threads),
            quarantine: Arc::new(Quarantine::default()),
        })
    }

    /// The queue position the next item of `stream` will have.
    pub(crate) fn next_seq(&self, stream: Stream) -> u64 {
        lock(&self.pushed)[stream.index()] + 1
    }

    /// Items pushed so far on `stream`.
    pub(crate) fn pushed(&self, stream: Stream) -> u64 {
        lock(&self.pushed)[stream.index()]
    }

    fn push(&self, stream: usize, item: Item) {
        lock(&self.pushed)[stream] += 1;
        let q = &self.queues[stream];
        lock(&q.items).push_back(item);
        q.cv.notify_one();
    }

    /// Queues an operation on `stream`, after a random delay.
    pub(crate) fn run(&self, stream: Stream, job: Job) {
        let delay = lock(&self.rng).delay();
        self.push(stream.index(), Item::Run(job, delay));
    }

    /// Makes `stream` wait until `on` completed `seq` items.
    pub(crate) fn wait(&self, stream: Stream, on: Stream, seq: u64) {
        self.push(
            stream.index(),
            Item::Wait {
                stream: on.index(),
                seq,
            },
        );
    }

    /// Items `stream`'s worker completed so far.
    pub(crate) fn completed(&self, stream: Stream) -> u64 {
        lock(&self.progress.done)[stream.index()]
    }

    /// Blocks the calling thread until `stream` completed `seq` items.
    pub(crate) fn wait_until(&self, stream: Stream, seq: u64) {
        self.progress.wait_until(stream.index(), seq);
    }

    /// Blocks until, per stream, the items up to `seqs` are done.
    pub(crate) fn wait_all(&self, seqs: [u64; 4]) {
        for (s, seq) in seqs.into_iter().enumerate() {
            self.progress.wait_until(s, seq);
        }
    }

    /// Frees `mem` (`bytes` bytes at `ptr`) once every queue ran what was
    /// enqueued before now: then its bytes are poisoned and kept in the
    /// quarantine for a while.
    pub(crate) fn bury(&self, id: BufferId, mem: Box<dyn Any + Send>, ptr: *mut u8, bytes: usize) {
        let grave = Arc::new(Grave {
            id,
            remaining: AtomicUsize::new(4),
            mem: Mutex::new(Some(mem)),
            ptr,
            bytes,
            quarantine: self.quarantine.clone(),
        });
        for s in 0..4 {
            self.push(s, Item::Release(grave.clone()));
        }
    }

    pub(crate) fn quarantine(&self) -> &Quarantine {
        &self.quarantine
    }
}

fn run_worker(s: usize, q: &Queue, progress: &Progress, failed: &Mutex<Option<Error>>) {
    loop {
        let item = {
            let mut g = lock(&q.items);
            loop {
                if let Some(item) = g.pop_front() {
                    break item;
                }
                g = q.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        match item {
            Item::Run(job, delay) => {
                if delay.is_zero() {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(delay);
                }
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).unwrap_or_else(
                    |_| {
                        Err(Error::Backend {
                            op: "chaos worker",
                            msg: format!("an operation on stream {} panicked", Stream::ALL[s]),
                        })
                    },
                );
                if let Err(e) = r {
                    lock(failed).get_or_insert(e);
                }
            }
            Item::Wait { stream, seq } => progress.wait_until(stream, seq),
            Item::Release(grave) => grave.release(),
            Item::Stop => return,
        }
        progress.advance(s);
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // Every queued item runs before Stop: graves are released, and
        // operations finish before the memory they point into can go.
        for s in 0..4 {
            self.push(s, Item::Stop);
        }
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
    }
}
