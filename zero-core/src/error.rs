//! The error type of `zero-core`.

/// Errors of `zero-core`: devices, dtypes and buffers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A backend was asked for that this build does not contain.
    #[error("zero was built without the `{0}` feature; rebuild with `--features {0}`")]
    NotCompiledWith(&'static str),
    /// The backend is compiled in, but the device cannot be used here.
    #[error("no usable {kind} device {ordinal}: {reason}")]
    NoDevice {
        /// Device kind, e.g. `"cuda"`.
        kind: &'static str,
        /// The ordinal that was asked for.
        ordinal: usize,
        /// Why it cannot be used (no driver, no such GPU, ...).
        reason: String,
    },
    /// A buffer of one dtype was used where another was required.
    #[error("dtype mismatch in {op}: expected {expected}, got {got}")]
    DTypeMismatch {
        /// The operation that found the mismatch.
        op: &'static str,
        /// The dtype that was required.
        expected: crate::DType,
        /// The dtype that was given.
        got: crate::DType,
    },
    /// A size or length argument is invalid.
    #[error("invalid size in {op}: {msg}")]
    InvalidSize {
        /// The operation that rejected the size.
        op: &'static str,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// A host allocation failed.
    #[error("cannot allocate {bytes} bytes of host memory")]
    OutOfHostMemory {
        /// The size that was asked for.
        bytes: usize,
    },
    /// A configuration value is invalid; `key` is its path, e.g.
    /// `zero_optimization.stage`.
    #[error("config key `{key}`: {msg}")]
    Config {
        /// The key path, dotted from the top of the JSON document.
        key: String,
        /// What is wrong and what is allowed.
        msg: String,
    },
    /// This machine or build cannot do what was asked (an instruction set
    /// the CPU lacks, ...); the message says what and what is available.
    #[error("not supported here: {0}")]
    Unsupported(String),
    /// A partition plan cannot be built from the given units.
    #[error("partition plan: {0}")]
    Plan(String),
    /// A file operation failed, or a file holds data that fails its checks
    /// (NVMe swap files, checkpoints). `msg` says what was done and what is
    /// wrong, naming the region, block and offset where there is one.
    #[error("{}: {msg}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The operation, where in the file, and what went wrong.
        msg: String,
    },
    /// A pool sized at start-up has no free buffer for a request (it never
    /// grows: no allocation happens in a training step).
    #[error("pool `{pool}` exhausted: {msg}")]
    PoolExhausted {
        /// The pool's name.
        pool: String,
        /// The size asked for and what the pool holds.
        msg: String,
    },
    /// Host memory cannot be pinned (page-locked): the limit is too low or
    /// the OS refused; `msg` states the limit and how to raise it.
    #[error("cannot pin {needed} bytes of host memory: {msg}")]
    PinMemory {
        /// The bytes that were to be pinned.
        needed: u64,
        /// The limit, the cause and how to fix it.
        msg: String,
    },
    /// Device memory does not hold what was planned: e.g. a rank's device
    /// arena needs `needed` bytes where `available` are free. `msg` names
    /// the rank, the largest buffers and the bytes missing, and what to
    /// change.
    #[error("out of device memory: {msg}")]
    OutOfDeviceMemory {
        /// The rank whose plan does not fit.
        rank: usize,
        /// The bytes the plan needs.
        needed: u64,
        /// The bytes the device has free (or the capacity checked against).
        available: u64,
        /// Which buffers are largest, how much is missing, what to change.
        msg: String,
    },
    /// A device-arena request that cannot be served: a bad buffer request,
    /// an unknown name, a slot that another buffer holds, a wrong element
    /// type. `msg` names the buffers.
    #[error("device arena of rank {rank}: {msg}")]
    Arena {
        /// The rank whose arena refused.
        rank: usize,
        /// What was asked and why it cannot be done.
        msg: String,
    },
    /// An error from the CUDA driver, NVRTC or a CUDA library.
    #[error("cuda: {0}")]
    Cuda(Box<dyn std::error::Error + Send + Sync>),
    /// An access to a device buffer that is not ordered after a conflicting
    /// earlier access (the checked CPU backend's hazard checker, see
    /// [`crate::backend`]): the buffer, both operations, their streams and
    /// ranges, as fields of [`Hazard`](crate::backend::Hazard). The new
    /// operation was not run.
    ///
    /// ```text
    /// hazard on buffer "bucket 0" (#7) [0..4096): pack on compute writes
    /// while all_reduce on comm (not waited for) reads [0..8192)
    /// ```
    ///
    /// Boxed, so that every `Result` of the crate stays small.
    #[error("{0}")]
    Hazard(Box<crate::backend::Hazard>),
    /// A device backend was used in a way it cannot serve: a buffer or event
    /// of another backend, a buffer that was freed or lent, an operation
    /// that failed on a stream's queue. `msg` names the buffer or stream.
    #[error("backend: {op}: {msg}")]
    Backend {
        /// The operation that was refused or failed.
        op: &'static str,
        /// What is wrong.
        msg: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
