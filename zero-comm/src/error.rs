//! The error type of `zero-comm`.

use std::time::Duration;

/// Errors of collectives and communicators.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error from `zero-core` (buffers, dtypes, devices).
    #[error(transparent)]
    Core(#[from] zero_core::Error),
    /// Not every rank arrived at a collective within the timeout.
    #[error(
        "rank {rank}: {op} #{seq} timed out after {waited:?} waiting for ranks {missing:?} \
         ({phase}); ranks that arrived: {arrived:?}"
    )]
    Timeout {
        /// The rank that reports.
        rank: usize,
        /// The collective, e.g. `all_reduce`.
        op: &'static str,
        /// Its sequence number on this communicator (1 is the first).
        seq: u64,
        /// Which wait expired (`"entry"`: waiting for peers to start it;
        /// `"exit"`: waiting for peers to finish it).
        phase: &'static str,
        /// How long this rank waited.
        waited: Duration,
        /// Ranks that had arrived.
        arrived: Vec<usize>,
        /// Ranks that had not.
        missing: Vec<usize>,
    },
    /// Ranks called different collectives at the same position.
    #[error("rank {rank}: collective #{seq} does not match across ranks: {detail}")]
    Mismatch {
        /// The rank that reports.
        rank: usize,
        /// The sequence number at which they differ.
        seq: u64,
        /// What each rank called.
        detail: String,
    },
    /// A peer failed, left, or died while this rank needed it.
    #[error("rank {rank}: {op} #{seq} cannot complete: rank {peer} {reason}")]
    PeerFailed {
        /// The rank that reports.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The peer that failed.
        peer: usize,
        /// What happened to it.
        reason: String,
    },
    /// The communicator failed earlier and cannot be used any more.
    #[error("rank {rank}: {op} #{seq} refused: the communicator failed earlier: {first}")]
    Poisoned {
        /// The rank that reports.
        rank: usize,
        /// The collective that was refused.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The first error, which broke the communicator.
        first: String,
    },
    /// A collective was called with arguments that cannot work.
    #[error("rank {rank}: invalid arguments to {op}: {msg}")]
    InvalidArgument {
        /// The rank that reports.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// `Work::wait_timeout` gave up; the collective goes on in the background.
    #[error("{op} #{seq} did not complete within {waited:?} (it continues in the background)")]
    WaitTimeout {
        /// The collective.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// How long the caller waited.
        waited: Duration,
    },
    /// A rank of a thread group panicked.
    #[error("rank {rank} panicked: {msg}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        msg: String,
    },
    /// A thread (a rank or its progress thread) could not be started.
    #[error("cannot start {what}: {source}")]
    Thread {
        /// Which thread.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// An error from the MPI library or the MPI backend's setup.
    #[error("mpi: {0}")]
    Mpi(String),
    /// A configuration value (environment variable or option) is invalid.
    #[error("invalid configuration `{key}`: {msg}")]
    Config {
        /// The variable or option.
        key: String,
        /// What is wrong.
        msg: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
