//! Every CUDA source of the Llama example (`LLAMA_SOURCES`) compiles with
//! NVRTC, with the library's options, for sm_80 and sm_90, without a
//! warning, and defines exactly the entry points it lists. Needs only
//! libnvrtc, no GPU.
//!
//! Unlike zero-core's bit-exact AdamW, these kernels use `expf`/`logf`,
//! whose CUDA implementations are built on `ex2.approx`/`lg2.approx`, so
//! the PTX is not checked for approximate instructions.
//!
//! Run with `ZERO_REQUIRE_NVRTC=1 cargo test -p zero-llama --features cuda
//! --test nvrtc`: zero finds NVRTC 12 or 13 where it is installed (PyTorch's
//! wheels, a toolkit), or put the folder of the one to test first on
//! `LD_LIBRARY_PATH` (`scripts/test-cuda.sh` runs this with 12.8 and 13.0;
//! `ZERO_NVRTC_VERSION=13.0` checks which one compiled). Without the library
//! the tests print a skip line, or fail when `ZERO_REQUIRE_NVRTC=1`.
#![cfg(feature = "cuda")]

use llama::cuda::LLAMA_SOURCES;
use zero::core::cuda::kernels::compile;
use zero_llama as llama;
use zero_testkit::kernel_checks::{compile_clean, nvrtc_or_skip};

#[test]
fn every_llama_source_compiles_cleanly_with_its_entry_points() {
    if !nvrtc_or_skip("every_llama_source_compiles_cleanly_with_its_entry_points") {
        return;
    }
    assert!(!LLAMA_SOURCES.is_empty());
    for src in LLAMA_SOURCES {
        for arch in ["sm_80", "sm_90"] {
            let c = compile_clean(src, arch);
            // The reductions run in warps: the butterfly is shuffles, and
            // nothing is reduced through atomics.
            if src.name != "llama_elementwise.cu" {
                assert!(
                    c.ptx.contains("shfl.sync.bfly"),
                    "{}: no shuffles",
                    src.name
                );
            }
            assert!(!c.ptx.contains("atom."), "{}: atomics", src.name);
        }
    }
}

#[test]
fn nvrtc_messages_point_into_the_right_file() {
    if !nvrtc_or_skip("nvrtc_messages_point_into_the_right_file") {
        return;
    }
    // An error in a .cu file is reported against that file and line, and
    // the Llama header (which includes zero-core's) is found by name.
    let src = zero::core::cuda::kernels::KernelSource {
        name: "broken_llama.cu",
        source: "#include \"llama_math.cuh\"\n\nextern \"C\" __global__ void k() { undefined_name(); }\n",
        headers: llama::cuda::LLAMA_HEADERS,
        entry_points: &["k"],
    };
    let err = compile(&src, "sm_90").unwrap_err().to_string();
    assert!(err.contains("broken_llama.cu(3)"), "{err}");
    assert!(!err.contains("cannot open source file"), "{err}");
}
