//! One entry point for both backends: threads when run directly, MPI when
//! started by `mpirun`/`srun`.
//!
//! ```no_run
//! use zero_comm::{launch, CommOptions, Communicator, ReduceOp};
//!
//! // `cargo run --example x`              → 2 ranks as threads
//! // `mpirun -n 2 cargo run --example x`  → 1 rank per process, over MPI
//! let sums = launch(2, &CommOptions::from_env()?, |comm| {
//!     let mut buf = comm.alloc::<f32>(4).unwrap();
//!     buf.fill(comm.rank() as f32 + 1.0);
//!     comm.all_reduce(buf, ReduceOp::Sum).wait().unwrap().to_vec()
//! })?;
//! println!("{} rank(s) here: {sums:?}", sums.len());
//! # Ok::<(), zero_comm::Error>(())
//! ```

use std::any::Any;

use zero_core::{Element, HostBuffer};

use crate::communicator::RawOp;
use crate::exec::panic_message;
use crate::work::Work;
use crate::{CommOptions, Communicator, Error, MpiComm, Result, ThreadComm, ThreadGroup};

/// A communicator of either backend.
///
/// Both variants exist in every build; without the `mpi` feature no
/// [`MpiComm`] can be created ([`MpiComm::init`] returns
/// `NotCompiledWith("mpi")`).
#[derive(Debug)]
pub enum Comm {
    /// A rank of a [`ThreadGroup`] (threads of this process).
    Threads(ThreadComm),
    /// A rank of an MPI job (this process).
    Mpi(MpiComm),
}

impl Communicator for Comm {
    fn rank(&self) -> usize {
        match self {
            Comm::Threads(c) => c.rank(),
            Comm::Mpi(c) => c.rank(),
        }
    }

    fn world_size(&self) -> usize {
        match self {
            Comm::Threads(c) => c.world_size(),
            Comm::Mpi(c) => c.world_size(),
        }
    }

    fn backend(&self) -> &'static str {
        match self {
            Comm::Threads(c) => c.backend(),
            Comm::Mpi(c) => c.backend(),
        }
    }

    fn ranks_on_host(&self) -> usize {
        match self {
            Comm::Threads(c) => c.ranks_on_host(),
            Comm::Mpi(c) => c.ranks_on_host(),
        }
    }

    fn alloc<T: Element>(&self, len: usize) -> Result<HostBuffer<T>> {
        match self {
            Comm::Threads(c) => c.alloc(len),
            Comm::Mpi(c) => c.alloc(len),
        }
    }

    fn submit(&self, op: RawOp) -> Work<Vec<Box<dyn Any + Send>>> {
        match self {
            Comm::Threads(c) => c.submit(op),
            Comm::Mpi(c) => c.submit(op),
        }
    }
}

fn env_set(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty())
}

/// Whether this process was started by an MPI launcher: Open MPI's
/// `mpirun` (`OMPI_COMM_WORLD_SIZE`), MPICH/Hydra (`PMI_SIZE`), a PMIx
/// launcher (`PMIX_RANK`), or Slurm's `srun` with more than one task
/// (`SLURM_NTASKS` > 1 and `SLURM_PROCID`).
pub fn launched_by_mpi() -> bool {
    env_set("OMPI_COMM_WORLD_SIZE")
        || env_set("PMI_SIZE")
        || env_set("PMIX_RANK")
        || (env_set("SLURM_PROCID")
            && std::env::var("SLURM_NTASKS")
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .is_some_and(|n| n > 1))
}

/// Runs `f` on every rank this process hosts and returns their results in
/// rank order.
///
/// Under `mpirun`/`srun` ([`launched_by_mpi`]) it initialises MPI and runs
/// `f` once, on this process's rank ([`Comm::Mpi`]; a one-element `Vec`).
/// Otherwise it runs `threads` ranks as threads of this process
/// ([`Comm::Threads`], [`ThreadGroup::run_with`]). A rank that panics
/// gives [`Error::RankPanicked`] (its peers' collectives fail instead of
/// hanging).
pub fn launch<R: Send>(
    threads: usize,
    opts: &CommOptions,
    f: impl Fn(Comm) -> R + Sync,
) -> Result<Vec<R>> {
    if launched_by_mpi() {
        let comm = MpiComm::init(opts)?;
        let rank = comm.rank();
        // The communicator moves into `f`; if `f` panics it is dropped while
        // unwinding and marks this rank failed for its peers.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(Comm::Mpi(comm))))
            .map(|r| vec![r])
            .map_err(|p| Error::RankPanicked {
                rank,
                msg: panic_message(&*p),
            })
    } else {
        ThreadGroup::run_with(threads, opts, |c| f(Comm::Threads(c)))
    }
}
