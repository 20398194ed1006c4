//! What went wrong inside NCCL or around it, with the rank and operation.
//!
//! [`NcclError`] reaches users as
//! [`Error::Core`](crate::Error::Core)`(`[`zero_core::Error::Cuda`]`(..))`,
//! the crate's variant for errors of CUDA libraries, so the error enum keeps
//! its shape in every build; match it with `downcast_ref::<NcclError>()`.

use std::fmt;

/// An error of the NCCL library or of the NCCL backend's calls around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclError {
    /// The rank that reports (`None` before a rank is known, e.g. while
    /// loading the library or creating the unique id).
    pub rank: Option<usize>,
    /// The backend operation, e.g. `"init"`, `"all_reduce"`, `"group"`.
    pub op: &'static str,
    /// What failed.
    pub failure: NcclFailure,
}

/// The kinds of [`NcclError`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NcclFailure {
    /// The NCCL library could not be loaded: no file of it was found
    /// where zero looks (`zero_core::cuda::libs::candidates`).
    Missing {
        /// The file names looked for.
        tried: Vec<String>,
    },
    /// The library was loaded but cannot be used: too old, or a symbol
    /// the backend needs is missing.
    Unsupported {
        /// What is wrong, with the version found.
        msg: String,
    },
    /// An NCCL call returned an error, or the communicator reported one
    /// asynchronously (`ncclCommGetAsyncError`).
    Call {
        /// The NCCL function.
        call: &'static str,
        /// NCCL's result code, e.g. `ncclInvalidUsage`.
        code: String,
        /// NCCL's description of the code and its last error message.
        detail: String,
    },
    /// A CUDA driver call of the backend failed (context, event, copy).
    Cuda {
        /// What was done.
        call: &'static str,
        /// The driver's error.
        detail: String,
    },
}

impl fmt::Display for NcclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("nccl: ")?;
        if let Some(rank) = self.rank {
            write!(f, "rank {rank}: ")?;
        }
        write!(f, "{}: ", self.op)?;
        match &self.failure {
            NcclFailure::Missing { tried } => write!(
                f,
                "the NCCL library was not found (zero looks for {} already loaded, on \
                 LD_LIBRARY_PATH, through the system loader, in PyTorch's \
                 site-packages/nvidia/nccl/lib, in $CUDA_HOME and /usr/local/cuda*); \
                 collectives on device buffers need it: install it with `pip install \
                 nvidia-nccl-cu13` or `pip install nvidia-nccl-cu12`, or your distribution's \
                 libnccl2 package",
                tried.join(", ")
            ),
            NcclFailure::Unsupported { msg } => f.write_str(msg),
            NcclFailure::Call { call, code, detail } => {
                write!(f, "{call} failed: {code}")?;
                if !detail.is_empty() {
                    write!(f, " ({detail})")?;
                }
                Ok(())
            }
            NcclFailure::Cuda { call, detail } => write!(f, "{call} failed: {detail}"),
        }
    }
}

impl std::error::Error for NcclError {}

impl From<NcclError> for crate::Error {
    fn from(e: NcclError) -> Self {
        crate::Error::Core(zero_core::Error::Cuda(Box::new(e)))
    }
}

impl NcclError {
    /// The [`NcclError`] inside `e`, if `e` carries one.
    pub fn find(e: &crate::Error) -> Option<&NcclError> {
        match e {
            crate::Error::Core(zero_core::Error::Cuda(b)) => b.downcast_ref::<NcclError>(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_rank_op_and_cause() {
        let e = NcclError {
            rank: Some(1),
            op: "init",
            failure: NcclFailure::Call {
                call: "ncclCommInitRankConfig",
                code: "ncclInvalidUsage".into(),
                detail: "Multiple Ranks are using the same GPU".into(),
            },
        };
        assert_eq!(
            e.to_string(),
            "nccl: rank 1: init: ncclCommInitRankConfig failed: ncclInvalidUsage \
             (Multiple Ranks are using the same GPU)"
        );
        let missing = NcclError {
            rank: None,
            op: "load",
            failure: NcclFailure::Missing {
                tried: vec!["libnccl.so.2".into(), "libnccl.so".into()],
            },
        };
        let msg = missing.to_string();
        assert!(
            msg.starts_with(
                "nccl: load: the NCCL library was not found (zero looks for libnccl.so.2, \
                 libnccl.so already loaded, on LD_LIBRARY_PATH"
            ),
            "{msg}"
        );
        assert!(msg.contains("pip install nvidia-nccl-cu13"), "{msg}");
        assert!(!msg.contains("link"), "{msg}");

        let wrapped: crate::Error = e.clone().into();
        assert_eq!(NcclError::find(&wrapped), Some(&e));
        assert!(wrapped.to_string().contains("rank 1: init"), "{wrapped}");
    }
}
