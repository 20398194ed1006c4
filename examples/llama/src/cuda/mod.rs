//! GPU kernels of the Llama example's non-GEMM ops (the GEMMs go through
//! cuBLAS): embedding, RMSNorm, RoPE, causal softmax (attention's fused
//! softmax between the two cuBLAS products), SwiGLU and cross-entropy, each
//! forward and backward, for f32 or bf16 activations with f32 accumulation,
//! except the row reductions (RMSNorm's and the softmax's sums,
//! cross-entropy's log-sum-exp), which accumulate in f64 as
//! [`super::ops`] does.
//!
//! # Sources
//!
//! The CUDA C++ lives in the crate's `cuda/`: `llama_math.cuh` holds every
//! per-lane and per-element body, written to compile both under NVRTC and
//! as plain host C++; the `.cu` files hold the `__global__` wrappers.
//! [`LLAMA_SOURCES`] lists them for
//! [`compile`](zero::core::cuda::kernels::compile), each with
//! [`LLAMA_HEADERS`] as its own headers (NVRTC gets them by name, and
//! zero-core's `zero_math.cuh`, which `llama_math.cuh` includes, from the
//! library's). Row reductions run one row per warp, in three
//! phases (lanes fold strided elements, a shuffle butterfly combines them,
//! lanes write); `tests/kernels_on_host.rs` runs the same phases on the
//! host against [`super::ops`], `tests/nvrtc.rs` compiles every source,
//! `tests/cuda_kernels.rs` runs the kernels on a GPU.
//!
//! Nothing uses atomics: every result is run-to-run identical. The weight
//! gradients of RMSNorm and the embedding are reduced in a fixed order (the
//! embedding's in exactly the CPU's order, through an
//! [`EmbeddingGradPlan`] built on the host from the batch's tokens).
//!
//! # Launching
//!
//! With the `cuda` feature, `LlamaKernels` compiles the sources once per
//! process and architecture, loads them into a device and launches them on
//! a caller's stream; every launcher checks lengths and returns without
//! waiting.

use zero::core::cuda::kernels::{KernelHeader, KernelSource};

/// RMSNorm forward, backward and weight-gradient kernels.
pub const NORM_ENTRY_POINTS: &[&str] = &[
    "llama_rmsnorm_fwd_f32",
    "llama_rmsnorm_bwd_f32",
    "llama_rmsnorm_dw_partial_f32",
    "llama_rmsnorm_fwd_bf16",
    "llama_rmsnorm_bwd_bf16",
    "llama_rmsnorm_dw_partial_bf16",
    "llama_colsum_finish",
];

/// Causal softmax and cross-entropy kernels.
pub const SOFTMAX_ENTRY_POINTS: &[&str] = &[
    "llama_softmax_causal_fwd_f32",
    "llama_softmax_causal_bwd_f32",
    "llama_cross_entropy_f32",
    "llama_softmax_causal_fwd_bf16",
    "llama_softmax_causal_bwd_bf16",
    "llama_cross_entropy_bf16",
    "llama_loss_mean",
];

/// Embedding, SwiGLU, LoRA's dropout and RoPE kernels.
pub const ELEMENTWISE_ENTRY_POINTS: &[&str] = &[
    "llama_embedding_fwd_f32",
    "llama_embedding_bwd_f32",
    "llama_swiglu_fwd_f32",
    "llama_swiglu_bwd_f32",
    "llama_dropout_f32",
    "llama_rope_f32",
    "llama_embedding_fwd_bf16",
    "llama_embedding_bwd_bf16",
    "llama_swiglu_fwd_bf16",
    "llama_swiglu_bwd_bf16",
    "llama_dropout_bf16",
    "llama_rope_bf16",
];

/// The header every Llama source includes (it includes zero-core's
/// `zero_math.cuh`, which NVRTC gets from the library's headers).
pub const LLAMA_HEADERS: &[KernelHeader] = &[KernelHeader {
    name: "llama_math.cuh",
    source: include_str!("../../cuda/llama_math.cuh"),
}];

/// Every CUDA source of the Llama example.
pub const LLAMA_SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "llama_norm.cu",
        source: include_str!("../../cuda/llama_norm.cu"),
        headers: LLAMA_HEADERS,
        entry_points: NORM_ENTRY_POINTS,
    },
    KernelSource {
        name: "llama_softmax.cu",
        source: include_str!("../../cuda/llama_softmax.cu"),
        headers: LLAMA_HEADERS,
        entry_points: SOFTMAX_ENTRY_POINTS,
    },
    KernelSource {
        name: "llama_elementwise.cu",
        source: include_str!("../../cuda/llama_elementwise.cu"),
        headers: LLAMA_HEADERS,
        entry_points: ELEMENTWISE_ENTRY_POINTS,
    },
];

/// Lanes per row of the row kernels (`LLAMA_LANES`).
pub const LANES: u32 = 32;
/// Rows (warps) per block of the row kernels (`LLAMA_ROW_WARPS`).
pub const ROW_WARPS: u32 = 4;
/// Threads per block of the elementwise and column kernels
/// (`LLAMA_EW_BLOCK`).
pub const EW_BLOCK: u32 = 256;
/// Rows per partial sum of the RMSNorm weight gradient (`LLAMA_COL_CHUNK`).
pub const COL_CHUNK: usize = 256;

/// Scratch (f32 elements) the RMSNorm backward needs for `rows` rows of
/// width `d`: one partial sum per chunk of [`COL_CHUNK`] rows and column.
pub fn rmsnorm_scratch_len(rows: usize, d: usize) -> usize {
    rows.div_ceil(COL_CHUNK) * d
}

/// The rows of a batch grouped by token, for the embedding backward: rows
/// `order[seg_start[s] .. seg_start[s + 1]]` hold token `seg_token[s]`, in
/// increasing row order (a stable sort), so each table row's gradient adds
/// its rows in the CPU's order, one GPU thread per element, no atomics.
/// The padding token's rows are left out (transformers' `padding_idx`):
/// no thread writes its table row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbeddingGradPlan {
    /// Rows of the batch (the padding token's included).
    pub rows: usize,
    /// Row indices sorted by token (stable), the padding token's left out.
    pub order: Vec<u32>,
    /// Where each token's rows start in `order`, plus the end.
    pub seg_start: Vec<u32>,
    /// The token of each segment, increasing.
    pub seg_token: Vec<u32>,
}

impl EmbeddingGradPlan {
    /// Groups `tokens` (one per row) but those equal to `pad`; errors on a
    /// token `>= vocab` or more than `u32::MAX` rows.
    pub fn new(tokens: &[u32], vocab: usize, pad: Option<u32>) -> zero::core::Result<Self> {
        let invalid = |msg: String| zero::core::Error::InvalidSize {
            op: "llama_embedding_backward",
            msg,
        };
        if u32::try_from(tokens.len()).is_err() {
            return Err(invalid(format!("{} rows exceed u32", tokens.len())));
        }
        if let Some((r, &t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(invalid(format!(
                "token {t} at row {r} is outside the vocabulary of {vocab}"
            )));
        }
        let mut order: Vec<u32> = (0..tokens.len() as u32)
            .filter(|&r| Some(tokens[r as usize]) != pad)
            .collect();
        order.sort_by_key(|&r| tokens[r as usize]);
        let mut seg_start = Vec::new();
        let mut seg_token = Vec::new();
        for (k, &r) in order.iter().enumerate() {
            let t = tokens[r as usize];
            if seg_token.last() != Some(&t) {
                seg_start.push(k as u32);
                seg_token.push(t);
            }
        }
        seg_start.push(order.len() as u32);
        Ok(EmbeddingGradPlan {
            rows: tokens.len(),
            order,
            seg_start,
            seg_token,
        })
    }

    /// The number of distinct tokens.
    pub fn segments(&self) -> usize {
        self.seg_token.len()
    }
}

#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
pub use gpu::*;
