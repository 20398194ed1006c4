//! Library versions (CUDA's and NCCL's version codes) and the oldest NCCL
//! zero works with: in every build, so that zero-comm's NCCL checks and
//! [`libs`](super) (with `cuda`) share one definition.

use std::fmt;

/// A library version: `major.minor`, with a patch level where the library
/// reports one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level (NCCL and cuBLAS report one).
    pub patch: Option<u32>,
}

impl Version {
    /// `major.minor` without a patch level.
    pub const fn new(major: u32, minor: u32) -> Self {
        Self {
            major,
            minor,
            patch: None,
        }
    }

    /// The driver API's version code (`cuDriverGetVersion`: 12080 is 12.8).
    pub const fn from_cuda_code(code: u32) -> Self {
        Self::new(code / 1000, code % 1000 / 10)
    }

    /// NCCL's version code (`ncclGetVersion`: 22805 is 2.28.5; codes
    /// before 2.9 are `major × 1000 + minor × 100 + patch`).
    pub const fn from_nccl_code(code: u32) -> Self {
        let (major, minor, patch) = if code < 20_900 {
            (code / 1000, code % 1000 / 100, code % 100)
        } else {
            (code / 10_000, code % 10_000 / 100, code % 100)
        };
        Self {
            major,
            minor,
            patch: Some(patch),
        }
    }

    /// Whether this is at least `other` (patch levels ignored when either
    /// lacks one).
    pub fn at_least(&self, other: &Version) -> bool {
        let a = (self.major, self.minor);
        let b = (other.major, other.minor);
        match (self.patch, other.patch) {
            (Some(p), Some(q)) if a == b => p >= q,
            _ => a >= b,
        }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if let Some(p) = self.patch {
            write!(f, ".{p}")?;
        }
        Ok(())
    }
}

/// NCCL 2.14.0, the oldest NCCL zero works with: the first with
/// non-blocking communicators (`ncclConfig_t.blocking`,
/// `ncclCommFinalize`), which zero-comm's NCCL backend needs.
pub const NCCL_MIN_VERSION: Version = Version {
    major: 2,
    minor: 14,
    patch: Some(0),
};
