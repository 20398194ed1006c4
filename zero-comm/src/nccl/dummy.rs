//! [`NcclComm`] and [`NcclGroup`] in builds without the `cuda` feature: the
//! same names, no values. Creating them returns
//! [`zero_core::Error::NotCompiledWith`]`("cuda")`, so code that names the
//! NCCL backend compiles everywhere and fails clearly at run time.

use std::convert::Infallible;

use zero_core::CudaDevice;

use crate::{CommOptions, Result};

fn not_compiled<T>() -> Result<T> {
    Err(zero_core::Error::NotCompiledWith("cuda").into())
}

/// Always [`zero_core::Error::NotCompiledWith`]`("cuda")` in this build.
pub fn version() -> Result<i32> {
    not_compiled()
}

/// The NCCL library zero opened: none in this build.
pub fn opened() -> Option<String> {
    None
}

/// One rank of an NCCL communicator. This build has no `cuda` feature: no
/// value of this type can exist.
pub struct NcclComm {
    never: Infallible,
}

impl NcclComm {
    /// This rank.
    pub fn rank(&self) -> usize {
        match self.never {}
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        match self.never {}
    }

    /// The GPU of this rank.
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, _f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.never {}
    }
}

/// The ranks of one NCCL communicator in this process. This build has no
/// `cuda` feature: [`NcclGroup::new`] always fails.
pub struct NcclGroup {
    never: Infallible,
}

impl NcclGroup {
    /// Fails: this build has no CUDA backend (rebuild with
    /// `--features cuda`).
    pub fn new(_devices: Vec<CudaDevice>, _opts: &CommOptions) -> Result<NcclGroup> {
        not_compiled()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        match self.never {}
    }
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, _f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn every_entry_point_says_which_feature_is_missing() {
        for e in [
            NcclGroup::new(Vec::new(), &CommOptions::default()).unwrap_err(),
            version().unwrap_err(),
            crate::NcclId::new().unwrap_err(),
        ] {
            assert!(
                matches!(e, Error::Core(zero_core::Error::NotCompiledWith("cuda"))),
                "{e}"
            );
        }
    }
}
