//! Streams, events and pinned host buffers.
//!
//! Each rank works on four streams ([`StreamKind`]): compute (forward,
//! backward, the GPU optimizer), communication (collectives), and one copy
//! stream per direction, so that a gradient bucket can go down to the host
//! while the next one is reduced and the next layer computes. Work moves
//! between streams through events only; nothing here synchronizes the whole
//! device.
//!
//! ```text
//!  h2d      ──[upload tile]──●                       (● record event)
//!                            ╲
//!  compute  ─────[forward]────◆──[use tile]──●       (◆ wait for event)
//!                                            ╲
//!  comm     ──────────────────────────────────◆──[all-gather]──
//! ```
//!
//! With the `cuda` feature:
//!
//! - `Streams` creates the four streams of one rank and hands work from one
//!   to another (`Streams::hand_off`: record on one, wait on the other);
//!   `Fence`s let the host wait for one stream's work so far.
//! - Every device buffer (`arena::DeviceBuffer`) and pinned host buffer
//!   (`PinnedHostBuffer`) carries the event of its last use. Using it on
//!   another stream makes that stream wait for the event first, and reading
//!   or writing a pinned buffer from the host waits for it on the host. The
//!   copies (`Streams::copy_h2d`, `copy_d2h`, `copy_d2d`) and
//!   `DeviceBuffer::use_on` (for kernels and collectives) do this
//!   themselves, so a buffer cannot be reused before the work that last
//!   touched it: the raw device pointer is only reachable through a use.
//! - `PinnedHostBuffer` is page-locked host memory from the CUDA driver
//!   (`cuMemHostAlloc` through cudarc), the endpoint of asynchronous copies.
//!
//! Errors that happen where no `Result` can be returned (`Drop`) are stored
//! in the cudarc context, as cudarc does, and reported by the next copy,
//! hand-off or `Streams::check_err`.
//!
//! # Pinned memory and `RLIMIT_MEMLOCK`
//!
//! `PinnedHostBuffer` does not check `RLIMIT_MEMLOCK` (zero-offload's
//! `MemLockStatus`) before pinning: the driver pins the pages it allocates
//! itself, without `mlock`, so the limit does not apply (pinning works in a
//! container whose `ulimit -l` is 64 KiB) and a check would refuse what
//! would succeed. The limit does apply to `mlock`, which zero-offload's host
//! pool uses. What bounds driver-pinned memory is host RAM and the cgroup's
//! memory limit; a failure is reported as [`Error::PinMemory`](crate::Error::PinMemory)
//! with the driver's reason.

use std::fmt;

// The reuse rule is only driven by the CUDA backend; its tests run in every build.
#[cfg_attr(not(feature = "cuda"), allow(dead_code, unused_imports))]
mod last_use;

#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use last_use::LastUse;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub(crate) use device::{cuda_error, pinned_zeros, UseGuard};
#[cfg(feature = "cuda")]
pub use device::{Fence, PinnedHostBuffer, Streams, Transfer};

/// The streams of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// Forward, backward and the GPU optimizer.
    Compute,
    /// Collectives (all-gather, reduce-scatter, all-reduce).
    Comm,
    /// Copies from host to device.
    HostToDevice,
    /// Copies from device to host.
    DeviceToHost,
}

impl StreamKind {
    /// All kinds, in index order.
    pub const ALL: [StreamKind; 4] = [
        StreamKind::Compute,
        StreamKind::Comm,
        StreamKind::HostToDevice,
        StreamKind::DeviceToHost,
    ];

    /// The name used in messages and traces (`"compute"`, `"comm"`, `"h2d"`,
    /// `"d2h"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            StreamKind::Compute => "compute",
            StreamKind::Comm => "comm",
            StreamKind::HostToDevice => "h2d",
            StreamKind::DeviceToHost => "d2h",
        }
    }

    /// Position in [`StreamKind::ALL`].
    pub const fn index(self) -> usize {
        match self {
            StreamKind::Compute => 0,
            StreamKind::Comm => 1,
            StreamKind::HostToDevice => 2,
            StreamKind::DeviceToHost => 3,
        }
    }
}

impl fmt::Display for StreamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_index_and_names() {
        for (i, k) in StreamKind::ALL.into_iter().enumerate() {
            assert_eq!(k.index(), i);
            assert_eq!(k.to_string(), k.as_str());
        }
        assert_eq!(StreamKind::HostToDevice.as_str(), "h2d");
    }
}
