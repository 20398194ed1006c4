//! Asynchronous work handles.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The completion slot shared by a backend (which fills it) and a [`Work`]
/// handle (which waits on it).
pub(crate) struct Completion<R> {
    slot: Mutex<Option<(Result<R>, Option<OpTiming>)>>,
    cv: Condvar,
    /// Set after `slot` is filled, so waiters can poll without the lock.
    ready: AtomicBool,
}

/// How long a waiter polls before it sleeps on the condition variable.
/// A futex wake-up costs tens of microseconds on these machines, as much as
/// moving a megabyte; collectives that finish within this window are picked
/// up at once. Polling yields, so the progress thread keeps its core.
const POLL_BEFORE_SLEEP: Duration = Duration::from_micros(50);

impl<R> Completion<R> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            slot: Mutex::new(None),
            cv: Condvar::new(),
            ready: AtomicBool::new(false),
        })
    }

    pub(crate) fn complete(&self, r: Result<R>) {
        self.complete_timed(r, None);
    }

    /// Completes with the interval in which the collective ran.
    pub(crate) fn complete_timed(&self, r: Result<R>, timing: Option<OpTiming>) {
        let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        *g = Some((r, timing));
        self.ready.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    fn is_done(&self) -> bool {
        self.slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Waits until completed or `deadline`; `None` on expiry.
    fn take(&self, deadline: Option<Instant>) -> Option<(Result<R>, Option<OpTiming>)> {
        let start = Instant::now();
        let mut polls = 0u32;
        while !self.ready.load(Ordering::Acquire) {
            polls += 1;
            if polls.is_multiple_of(16) {
                if start.elapsed() >= POLL_BEFORE_SLEEP {
                    break;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = g.take() {
                return Some(r);
            }
            match deadline {
                None => g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    g = self
                        .cv
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }
}

/// When a collective ran on its rank's progress thread: from the moment the
/// thread started it (it may then wait for peers to arrive) to the moment
/// its result was ready. Profilers compare it with the trainer's compute to
/// see how much communication was hidden (overlapped) and how much the
/// trainer waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpTiming {
    /// The progress thread started the collective.
    pub started: Instant,
    /// Its result was ready.
    pub finished: Instant,
}

type Mapper<R> = Box<dyn FnOnce(Box<dyn Any + Send>) -> R + Send>;

/// A handle to a collective that runs in the background.
///
/// Collectives return at once with a `Work`; the engine overlaps compute
/// with communication and calls [`Work::wait`] when it needs the result (the
/// buffers it handed over, now reduced or gathered).
///
/// Dropping a `Work` without waiting does not lose the collective: the drop
/// blocks until it has finished (bounded by the communicator's timeout, as
/// every wait inside a collective is), and if it failed, the communicator is
/// marked failed so that the next collective reports the error.
#[must_use = "a collective runs in the background: wait() on its handle to get the buffers back and see errors"]
pub struct Work<R> {
    done: Option<Arc<Completion<Box<dyn Any + Send>>>>,
    map: Option<Mapper<R>>,
    op: &'static str,
    seq: u64,
}

impl<R: 'static> Work<R> {
    pub(crate) fn new(
        done: Arc<Completion<Box<dyn Any + Send>>>,
        op: &'static str,
        seq: u64,
        map: impl FnOnce(Box<dyn Any + Send>) -> R + Send + 'static,
    ) -> Self {
        Self {
            done: Some(done),
            map: Some(Box::new(map)),
            op,
            seq,
        }
    }

    /// A handle whose result is `f` applied to this one's.
    pub fn map<S: 'static>(mut self, f: impl FnOnce(R) -> S + Send + 'static) -> Work<S> {
        let done = self.done.take();
        let inner = self.map.take();
        Work {
            done,
            map: inner.map(|g| -> Mapper<S> { Box::new(move |x| f(g(x))) }),
            op: self.op,
            seq: self.seq,
        }
    }

    /// The collective's name, e.g. `"all_reduce"`.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Its sequence number on the communicator (1 is the first collective).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Whether it has finished (successfully or not); never blocks.
    pub fn is_completed(&self) -> bool {
        self.done.as_ref().is_none_or(|d| d.is_done())
    }

    /// Waits for the collective and returns its buffers.
    ///
    /// Bounded: every wait inside a collective has the communicator's
    /// timeout, so a peer that never arrives gives [`Error::Timeout`].
    pub fn wait(mut self) -> Result<R> {
        self.finish(None)
            .expect("a wait without deadline always completes")
            .0
    }

    /// Like [`Work::wait`], and also says when the collective ran on the
    /// progress thread (`None` if it never started: e.g. the communicator
    /// had already failed).
    pub fn wait_timed(mut self) -> Result<(R, Option<OpTiming>)> {
        let (r, timing) = self
            .finish(None)
            .expect("a wait without deadline always completes");
        r.map(|r| (r, timing))
    }

    /// Like [`Work::wait`], but gives up after `timeout` with
    /// [`Error::WaitTimeout`]; the collective then goes on in the background
    /// and its buffers are released when it ends.
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<R> {
        let (op, seq) = (self.op, self.seq);
        self.finish(Some(Instant::now() + timeout))
            .map(|(r, _)| r)
            .unwrap_or(Err(Error::WaitTimeout {
                op,
                seq,
                waited: timeout,
            }))
    }

    fn finish(&mut self, deadline: Option<Instant>) -> Option<(Result<R>, Option<OpTiming>)> {
        let done = self.done.take()?;
        match done.take(deadline) {
            Some((r, timing)) => {
                let map = self.map.take().expect("map present until finished");
                Some((r.map(map), timing))
            }
            None => {
                // Expired: the backend still holds its own reference to the
                // completion and finishes the work; nothing to wait for here.
                None
            }
        }
    }
}

impl<R> Drop for Work<R> {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            // Block until the collective ends so that it is never cut short
            // (its buffers stay alive in the backend meanwhile). Errors were
            // already recorded by the backend, which poisons the communicator.
            let _ = done.take(None);
        }
    }
}

impl<R> std::fmt::Debug for Work<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("seq", &self.seq)
            .finish()
    }
}
