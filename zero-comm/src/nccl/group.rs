//! [`NcclGroup`]: N ranks of one NCCL communicator as threads of this
//! process, one GPU each; the NCCL id is created once and shared in
//! memory (no host communicator needed).
//!
//! ```text
//!  NcclGroup::new([gpu0, gpu1, ..]) ─ check one GPU per rank ─ ncclGetUniqueId
//!        │ id (shared)
//!        ├──▶ thread 0: stream on gpu0 ─ NcclComm::new(0, N, id) ─ f(comm)
//!        ├──▶ thread 1: stream on gpu1 ─ NcclComm::new(1, N, id) ─ f(comm)
//!        └──▶ ...        (all initialize concurrently, as NCCL requires)
//! ```

use std::sync::Arc;

use cudarc::driver::CudaStream;
use zero_core::CudaDevice;

use super::check::{check_devices, multi_rank_gpu_allowed};
use super::{ffi, NcclComm, NcclError, NcclFailure, NcclId};
use crate::exec::panic_message;
use crate::{CommOptions, Error, Result};

/// The ranks of one NCCL communicator in this process: rank r runs on
/// `devices[r]`.
///
/// ```no_run
/// use zero_comm::{CommOptions, NcclGroup, ReduceOp};
/// use zero_core::CudaDevice;
///
/// let devices = vec![CudaDevice::new(0)?, CudaDevice::new(1)?];
/// let group = NcclGroup::new(devices, &CommOptions::default())?;
/// let sums = group.run(|comm| -> zero_comm::Result<Vec<f32>> {
///     let stream = comm.stream().clone();
///     let mut x = stream.clone_htod(&[comm.rank() as f32 + 1.0; 4]).expect("copy");
///     comm.all_reduce(&mut x, ReduceOp::Sum)?.wait()?;
///     Ok(stream.clone_dtoh(&x).expect("copy"))
/// })?;
/// # Ok::<(), zero_comm::Error>(())
/// ```
pub struct NcclGroup {
    devices: Vec<CudaDevice>,
    id: NcclId,
    opts: CommOptions,
}

impl NcclGroup {
    /// A group of `devices.len()` ranks. Checks that NCCL can be loaded and
    /// that each rank has its own GPU (NCCL refuses two ranks of one
    /// communicator on a GPU, unless NCCL ≥ 2.30 runs with
    /// `NCCL_MULTI_RANK_GPU_ENABLE=1`), then creates the NCCL id.
    pub fn new(devices: Vec<CudaDevice>, opts: &CommOptions) -> Result<NcclGroup> {
        let version = ffi::library()?;
        let ordinals: Vec<usize> = devices.iter().map(CudaDevice::ordinal).collect();
        let env = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").ok();
        check_devices(
            &ordinals,
            version,
            multi_rank_gpu_allowed(version, env.as_deref()),
        )?;
        Ok(NcclGroup {
            devices,
            id: NcclId::new()?,
            opts: opts.clone(),
        })
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.devices.len()
    }

    /// The GPU of each rank.
    pub fn devices(&self) -> &[CudaDevice] {
        &self.devices
    }

    /// The communicator's id.
    pub fn id(&self) -> &NcclId {
        &self.id
    }

    /// Joins the communicator as `rank`, on its GPU, with `stream` (of that
    /// GPU) as the communication stream. Every rank must call this
    /// concurrently from its own thread; see [`NcclComm::new`] for the
    /// timeout.
    pub fn init_rank(&self, rank: usize, stream: Arc<CudaStream>) -> Result<NcclComm> {
        let world = self.world_size();
        let device = self
            .devices
            .get(rank)
            .ok_or_else(|| Error::InvalidArgument {
                rank,
                op: "nccl_init",
                msg: format!("rank {rank} is not a rank of a group of {world}"),
            })?;
        NcclComm::new(rank, world, &self.id, device, stream, &self.opts)
    }

    /// Runs `f` on every rank, each on its own thread with a new stream of
    /// its GPU as communication stream, and returns the results in rank
    /// order.
    ///
    /// When a rank cannot initialize, every rank's error is collected and
    /// the most telling one returned: a rank's own failure (e.g. NCCL
    /// refusing the configuration) before the timeouts it caused in the
    /// others. A rank that panics gives [`Error::RankPanicked`].
    pub fn run<R, F>(&self, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(NcclComm) -> R + Sync,
    {
        let f = &f;
        let results: Vec<Result<R>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.world_size())
                .map(|rank| {
                    std::thread::Builder::new()
                        .name(format!("zero-nccl-{rank}"))
                        .spawn_scoped(s, move || {
                            let comm = self.start_rank(rank)?;
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)))
                                .map_err(|p| Error::RankPanicked {
                                    rank,
                                    msg: panic_message(&*p),
                                })
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|p| {
                        Err(Error::RankPanicked {
                            rank,
                            msg: panic_message(&*p),
                        })
                    }),
                    Err(source) => Err(Error::Thread {
                        what: format!("nccl rank {rank}"),
                        source,
                    }),
                })
                .collect()
        });
        let mut errors = Vec::new();
        let mut ok = Vec::new();
        for r in results {
            match r {
                Ok(v) => ok.push(v),
                Err(e) => errors.push(e),
            }
        }
        match most_telling(errors) {
            Some(e) => Err(e),
            None => Ok(ok),
        }
    }

    fn start_rank(&self, rank: usize) -> Result<NcclComm> {
        let stream = self.devices[rank].context().new_stream().map_err(|e| {
            Error::from(NcclError {
                rank: Some(rank),
                op: "nccl_init",
                failure: NcclFailure::Cuda {
                    call: "cuStreamCreate",
                    detail: e.to_string(),
                },
            })
        })?;
        self.init_rank(rank, stream)
    }
}

/// The first error that is not a consequence of another rank's failure
/// (timeouts, poisoning), else the first.
fn most_telling(errors: Vec<Error>) -> Option<Error> {
    let cause = errors
        .iter()
        .position(|e| !matches!(e, Error::Timeout { .. } | Error::Poisoned { .. }));
    let i = cause.unwrap_or(0);
    errors.into_iter().nth(i)
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("devices", &self.devices)
            .field("id", &self.id)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_cause_wins_over_the_timeouts_it_caused() {
        let timeout = |rank| Error::Timeout {
            rank,
            op: "nccl_init",
            seq: 0,
            phase: "x",
            waited: Duration::from_secs(1),
            arrived: vec![rank],
            missing: vec![],
        };
        let cause = Error::InvalidArgument {
            rank: 1,
            op: "nccl_init",
            msg: "bad".into(),
        };
        let got = most_telling(vec![timeout(0), cause, timeout(2)]).unwrap();
        assert!(matches!(got, Error::InvalidArgument { rank: 1, .. }));
        let got = most_telling(vec![timeout(0), timeout(1)]).unwrap();
        assert!(matches!(got, Error::Timeout { rank: 0, .. }));
        assert!(most_telling(vec![]).is_none());
    }
}
