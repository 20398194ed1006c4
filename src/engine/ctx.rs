//! What every component of the engine borrows from the rank, in one value:
//! the communicator, the device backend and its stream order, the config
//! and partition plan, the memory tracker and the tracer, and the run's
//! fixed facts (rank, world size, stage, parameter dtype). None of it
//! changes after the build, so a component's call takes `&Ctx` whole
//! beside the parts it changes (`GatherIo`, `AllGatherIo`, `StepIo`,
//! `StateIo`).

use zero_core::backend::Stream;
use zero_core::config::{FrozenParams, ResolvedConfig};
use zero_core::memory::MemoryTracker;
use zero_core::partition::PartitionPlan;
use zero_core::DType;

use crate::trace::Tracer;
use crate::{Error, Result};

/// The rank's fixed context (see the module docs).
pub(super) struct Ctx<C, B> {
    /// Tells this engine's [`UnitId`](super::UnitId)s from another's.
    pub(super) id: u64,
    pub(super) comm: C,
    /// The device every buffer of the engine lives on: parameters,
    /// gradients, optimizer state (unless offloaded), buckets.
    pub(super) backend: B,
    pub(super) cfg: ResolvedConfig,
    pub(super) plan: PartitionPlan,
    pub(super) tracker: MemoryTracker,
    /// Spans of this rank's phases (disabled unless
    /// [`EngineBuilder::tracer`](super::EngineBuilder::tracer)).
    pub(super) tracer: Tracer,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) stage: u8,
    /// The dtype of parameters and of the gradients the trainer writes.
    pub(super) pdt: DType,
    /// The stream whose work the parameter all-gathers start after:
    /// compute (a test may remove that wait, see `SkipWait`).
    pub(super) gather_after: Stream,
    /// Stage 3: where the frozen segments live (never `Auto`).
    pub(super) frozen_policy: FrozenParams,
}

impl<C, B> Ctx<C, B> {
    /// A usage error of this rank.
    pub(super) fn usage(&self, what: String) -> Error {
        Error::Usage {
            rank: self.rank,
            what,
        }
    }

    /// A component's refusal (`Err(why)`) as a usage error of this rank.
    pub(super) fn checked<T>(&self, r: std::result::Result<T, String>) -> Result<T> {
        r.map_err(|what| self.usage(what))
    }

    /// `allgather_bucket_size`: the elements of stage 1–2 all-gathers in
    /// flight at most (at least one unit).
    pub(super) fn gather_limit(&self) -> usize {
        self.cfg.zero.allgather_bucket_size
    }
}
