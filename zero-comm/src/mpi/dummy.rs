//! [`MpiComm`] in builds without the `mpi` feature: the same names, no
//! values. [`MpiComm::init`] returns
//! [`zero_core::Error::NotCompiledWith`]`("mpi")`, so code that names the
//! MPI backend compiles everywhere and fails clearly at run time.

use std::any::Any;
use std::convert::Infallible;

use zero_core::{Element, HostBuffer};

use crate::communicator::RawOp;
use crate::work::Work;
use crate::{CommOptions, Communicator, Result};

/// One rank of an MPI job. This build has no `mpi` feature: no value of
/// this type can exist, and [`MpiComm::init`] fails with
/// `NotCompiledWith("mpi")`.
pub struct MpiComm {
    never: Infallible,
}

impl MpiComm {
    /// Fails: this build has no MPI backend (rebuild with `--features mpi`).
    pub fn init(_opts: &CommOptions) -> Result<MpiComm> {
        Err(zero_core::Error::NotCompiledWith("mpi").into())
    }

    /// This rank's index among the ranks of its node.
    pub fn local_rank(&self) -> usize {
        match self.never {}
    }

    /// Number of ranks on this node.
    pub fn local_size(&self) -> usize {
        match self.never {}
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        match self.never {}
    }

    /// Whether `buf` lies in this rank's shared-memory pool.
    pub fn is_registered<T: Element>(&self, _buf: &HostBuffer<T>) -> bool {
        match self.never {}
    }

    /// Baseline: `MPI_Allreduce` (sum, in place).
    pub fn native_all_reduce(&self, _buf: &mut HostBuffer<f32>) -> Result<()> {
        match self.never {}
    }

    /// Baseline: `MPI_Reduce_scatter_block` (sum).
    pub fn native_reduce_scatter_block(
        &self,
        _send: &HostBuffer<f32>,
        _recv: &mut HostBuffer<f32>,
    ) -> Result<()> {
        match self.never {}
    }

    /// Baseline: `MPI_Allgather`.
    pub fn native_all_gather(
        &self,
        _send: &HostBuffer<f32>,
        _recv: &mut HostBuffer<f32>,
    ) -> Result<()> {
        match self.never {}
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        match self.never {}
    }

    fn world_size(&self) -> usize {
        match self.never {}
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn submit(&self, _op: RawOp) -> Work<Vec<Box<dyn Any + Send>>> {
        match self.never {}
    }
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, _f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.never {}
    }
}
