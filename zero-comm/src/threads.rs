//! The threads backend: N ranks as threads of one process.
//!
//! Collectives read the peers' buffers directly (zero-copy, see [`crate::shm`]
//! for the protocol and one file per algorithm); nothing is sent through
//! channels except the work item to each rank's progress thread.

use std::any::Any;
use std::sync::Arc;

use crate::communicator::RawOp;
use crate::exec::{panic_message, Executor};
use crate::shm::{ControlSlot, SameProcess, ShmGroup, STATE_FAILED, STATE_LEFT};
use crate::work::Work;
use crate::{CommOptions, Communicator, Error, Result};

/// Starts N ranks as threads of this process.
pub struct ThreadGroup;

impl ThreadGroup {
    /// Creates the communicators of an `n`-rank group, one per rank, to be
    /// moved to threads the caller starts. Every rank must use its own.
    pub fn comms(n: usize, opts: &CommOptions) -> Result<Vec<ThreadComm>> {
        if n == 0 {
            return Err(Error::Config {
                key: "world_size".into(),
                msg: "a thread group needs at least one rank".into(),
            });
        }
        let slots: Arc<Vec<ControlSlot>> =
            Arc::new((0..n).map(|_| ControlSlot::default()).collect());
        let mem: Arc<dyn crate::shm::ShmMemory> = Arc::new(SameProcess);
        let comms = (0..n)
            .map(|rank| {
                let keep: Arc<dyn Any + Send + Sync> = slots.clone();
                // SAFETY: `slots` holds n default (unset) slots, kept alive by
                // `keep`; each rank uses its own index.
                let group = Arc::new(unsafe {
                    ShmGroup::new(
                        slots.as_ptr(),
                        n,
                        rank,
                        (0..n).collect(),
                        mem.clone(),
                        opts.timeout,
                        keep,
                    )
                });
                group.join();
                ThreadComm::new(rank, n, group)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(comms)
    }

    /// Runs `f` on `n` ranks (threads) with default options and returns
    /// each rank's result, in rank order.
    ///
    /// A rank that panics fails its peers' pending collectives at once
    /// (they get [`Error::PeerFailed`]) and the call returns
    /// [`Error::RankPanicked`] for the lowest such rank.
    pub fn run<R, F>(n: usize, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(ThreadComm) -> R + Sync,
    {
        Self::run_with(n, &CommOptions::default(), f)
    }

    /// [`ThreadGroup::run`] with options.
    pub fn run_with<R, F>(n: usize, opts: &CommOptions, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(ThreadComm) -> R + Sync,
    {
        let comms = Self::comms(n, opts)?;
        let f = &f;
        let results: Vec<Result<R>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    std::thread::Builder::new()
                        .name(format!("zero-rank-{rank}"))
                        .spawn_scoped(s, move || {
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)))
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| match h {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(Err)
                        .map_err(|p| Error::RankPanicked {
                            rank,
                            msg: panic_message(&*p),
                        }),
                    Err(source) => Err(Error::Thread {
                        what: format!("rank {rank}"),
                        source,
                    }),
                })
                .collect()
        });
        results.into_iter().collect()
    }
}

/// One rank of a [`ThreadGroup`].
pub struct ThreadComm {
    rank: usize,
    size: usize,
    group: Arc<ShmGroup>,
    exec: Executor,
}

impl ThreadComm {
    fn new(rank: usize, size: usize, group: Arc<ShmGroup>) -> Result<Self> {
        let g = group.clone();
        let g_fail = group.clone();
        let exec = Executor::spawn(
            format!("zero-comm-{rank}"),
            rank,
            Box::new(move |seq, op: &RawOp| {
                // SAFETY: the op owns its buffers (op.keep) until it
                // completes, and the caller cannot touch them meanwhile.
                unsafe { g.run(seq, &op.desc, &op.counts, op.bufs) }
            }),
            Box::new(move |_seq| g_fail.set_state(STATE_FAILED)),
        )?;
        Ok(Self {
            rank,
            size,
            group,
            exec,
        })
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn ranks_on_host(&self) -> usize {
        self.world_size()
    }

    fn submit(&self, op: RawOp) -> Work<Vec<Box<dyn Any + Send>>> {
        self.exec.submit(op)
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        // Finish what was queued, then tell the peers this rank is gone.
        self.exec.shutdown();
        let failed = std::thread::panicking() || self.exec.poisoned().is_some();
        self.group
            .set_state(if failed { STATE_FAILED } else { STATE_LEFT });
    }
}

impl std::fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadComm")
            .field("rank", &self.rank)
            .field("world_size", &self.size)
            .finish()
    }
}
