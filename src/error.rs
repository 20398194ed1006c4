//! The error type of the `zero` engine.

/// Errors of the engine: misuse of its API, disagreement between ranks, and
/// the errors of the crates below it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// From `zero-core`: config, plan, buffers, devices.
    #[error(transparent)]
    Core(#[from] zero_core::Error),
    /// From `zero-comm`: a collective failed, timed out or mismatched.
    #[error(transparent)]
    Comm(#[from] zero_comm::Error),
    /// The API was used out of order or with an argument that does not
    /// fit; `what` names the call and the unit.
    #[error("rank {rank}: {what}")]
    Usage {
        /// The rank that found it.
        rank: usize,
        /// What was called, on which unit, and what is expected instead.
        what: String,
    },
    /// The ranks registered different units or configurations.
    #[error("rank {rank}: the ranks disagree: {what}")]
    Disagreement {
        /// The rank that reports it (every rank reports the same).
        rank: usize,
        /// What differs, naming the unit or key and the ranks.
        what: String,
    },
    /// A checkpoint could not be written or read: a missing, truncated,
    /// corrupted or foreign file, a manifest of an unknown version, units
    /// that do not match the registered ones.
    #[error("checkpoint {}: {what}", path.display())]
    Checkpoint {
        /// The file or directory concerned.
        path: std::path::PathBuf,
        /// What is wrong with it.
        what: String,
    },
    /// The engine does not support this configuration (yet); `what` names
    /// the key or device.
    #[error("{what}")]
    Unsupported {
        /// The key or device and why.
        what: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
