//! Building blocks of the CUDA backend.
//!
//! - [`kernels`]: the CUDA C++ sources of the library (`zero-core/kernels/`),
//!   compiled at run time with NVRTC, and the fused GPU AdamW and gradient
//!   norm built on them.
//! - [`arena`]: one device allocation per rank, sized by the memory plan at
//!   start-up and carved into the engine's buffers.
//! - [`stream`]: the compute, communication and copy streams and the events
//!   that hand buffers between them; pinned host buffers.
//! - `libs` (with `cuda`): finding and opening the driver, NVRTC, cuBLAS
//!   and NCCL libraries as they are installed (CUDA 12 and 13, toolkits and
//!   PyTorch's wheels), so that a missing or too-old library is an error
//!   naming the file, never a panic.
//! - `cublas` (with `cuda`): the cuBLAS functions zero calls, from the
//!   library `libs` opened.
//! - [`version`]: library versions (CUDA's and NCCL's version codes) and
//!   the oldest NCCL zero works with, in every build.
//!
//! Everything that needs cudarc exists only with the `cuda` feature; the
//! planning logic that does not (e.g. how an arena is carved) is in every
//! build, so that it is tested on machines without a GPU.

pub mod arena;
#[cfg(feature = "cuda")]
pub mod cublas;
pub mod kernels;
#[cfg(feature = "cuda")]
pub mod libs;
pub mod stream;
pub mod version;
