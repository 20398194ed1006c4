//! What the zero workspace's tests share, built once as a dev-only crate
//! (never published) instead of being included into each test binary:
//!
//! - [`rng`]: a small deterministic generator, so tests need no `rand`;
//! - [`backend`]: data in and out of any device backend through its own
//!   primitives, for the tests that run on every backend;
//! - [`kernel_checks`]: the tests of CUDA sources, for zero-core's kernels
//!   and the Llama model's: host check drivers built with the C++ compiler,
//!   NVRTC compilation with no warning, GPU 0 or a visible skip;
//! - `mlp` and `runs` (feature `engine`): the engine tests' model, a
//!   small MLP driven through the engine API, and training it on thread
//!   ranks with states compared bit for bit;
//! - `llama_kernel_cases` (feature `llama`): what the Llama kernel tests
//!   share on the host and on a GPU;
//! - [`temp`]: a fresh temp directory removed on drop.
//!
//! The features keep the facade out of zero-core's tests: zero-core takes
//! this crate with no feature, the facade's tests with `engine`, the Llama
//! crate's with `llama`.

pub mod backend;
pub mod kernel_checks;
#[cfg(feature = "llama")]
pub mod llama_kernel_cases;
#[cfg(feature = "engine")]
pub mod mlp;
pub mod rng;
#[cfg(feature = "engine")]
pub mod runs;
pub mod temp;
