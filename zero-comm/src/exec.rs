//! The per-rank progress thread that runs collectives in issue order.

use std::any::Any;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};

use crate::communicator::RawOp;
use crate::work::{Completion, OpTiming, Work};
use crate::{Error, Result};

/// Runs one collective; called on the progress thread in sequence order.
pub(crate) type Runner = Box<dyn FnMut(u64, &RawOp) -> Result<()> + Send>;

type Payload = Box<dyn Any + Send>;

struct Job {
    seq: u64,
    op: RawOp,
    done: Arc<Completion<Payload>>,
}

/// Queue + progress thread of one rank.
///
/// Collectives run one at a time in the order they were issued, which is
/// also their sequence number. The first error poisons the executor: every
/// later collective fails at once with [`Error::Poisoned`], and `on_fail`
/// (given the failing collective's sequence number) tells the peers (so they fail fast instead of waiting for the timeout).
pub(crate) struct Executor {
    queue: Mutex<(u64, Option<Sender<Job>>)>,
    thread: Mutex<Option<JoinHandle<()>>>,
    poisoned: Arc<Mutex<Option<String>>>,
    rank: usize,
}

impl Executor {
    pub(crate) fn spawn(
        name: String,
        rank: usize,
        mut runner: Runner,
        on_fail: Box<dyn Fn(u64) + Send>,
    ) -> Result<Self> {
        let (tx, rx) = unbounded::<Job>();
        let poisoned = Arc::new(Mutex::new(None::<String>));
        let p2 = poisoned.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                while let Some(Job { seq, mut op, done }) = next_job(&rx) {
                    let name = op.desc.name();
                    let first = p2.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let started = std::time::Instant::now();
                    let r = if let Some(first) = first {
                        Err(Error::Poisoned {
                            rank,
                            op: name,
                            seq,
                            first,
                        })
                    } else if let Some(e) = op.error.take() {
                        Err(e)
                    } else {
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runner(seq, &op)))
                            .unwrap_or_else(|p| {
                                Err(Error::RankPanicked {
                                    rank,
                                    msg: panic_message(&*p),
                                })
                            })
                    };
                    match r {
                        Ok(()) => {
                            let timing = OpTiming {
                                started,
                                finished: std::time::Instant::now(),
                            };
                            done.complete_timed(Ok(Box::new(op.keep)), Some(timing));
                        }
                        Err(e) => {
                            let mut g = p2.lock().unwrap_or_else(|e| e.into_inner());
                            if g.is_none() {
                                *g = Some(e.to_string());
                                drop(g);
                                on_fail(seq);
                            }
                            if matches!(
                                e,
                                Error::Timeout { .. }
                                    | Error::PeerFailed { .. }
                                    | Error::RankPanicked { .. }
                            ) {
                                // A peer that arrives late (or is still moving
                                // data) may read or write these buffers: leak
                                // them rather than free memory someone else
                                // can touch. The communicator is dead anyway.
                                std::mem::forget(std::mem::take(&mut op.keep));
                            }
                            done.complete(Err(e));
                        }
                    }
                }
            })
            .map_err(|source| Error::Thread {
                what: format!("the progress thread of rank {rank}"),
                source,
            })?;
        Ok(Self {
            queue: Mutex::new((0, Some(tx))),
            thread: Mutex::new(Some(thread)),
            poisoned,
            rank,
        })
    }

    /// Queues `op`; its sequence number is its position in the queue.
    pub(crate) fn submit(&self, op: RawOp) -> Work<Vec<Payload>> {
        let name = op.desc.name();
        let done = Completion::new();
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.0 += 1;
        let seq = q.0;
        let job = Job {
            seq,
            op,
            done: done.clone(),
        };
        let sent = match &q.1 {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        };
        drop(q);
        if !sent {
            done.complete(Err(Error::Poisoned {
                rank: self.rank,
                op: name,
                seq,
                first: "the communicator is shutting down".into(),
            }));
        }
        Work::new(done, name, seq, |p| {
            *p.downcast::<Vec<Payload>>()
                .expect("executor payload is Vec<Box<dyn Any>>")
        })
    }

    /// The first error, if the executor is poisoned.
    pub(crate) fn poisoned(&self) -> Option<String> {
        self.poisoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Runs what is queued, then stops the thread.
    pub(crate) fn shutdown(&self) {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).1 = None;
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The next job: polls (yielding) for a short while, since collectives
/// usually come in bursts and a futex wake-up costs tens of microseconds,
/// then sleeps until one arrives. `None` when the queue is closed and empty.
fn next_job(rx: &crossbeam_channel::Receiver<Job>) -> Option<Job> {
    let start = std::time::Instant::now();
    let mut polls = 0u32;
    loop {
        match rx.try_recv() {
            Ok(job) => return Some(job),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        polls += 1;
        if polls.is_multiple_of(16) {
            if start.elapsed() >= std::time::Duration::from_micros(50) {
                return rx.recv().ok();
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".into()
    }
}
