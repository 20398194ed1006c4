//! Every CUDA source of the library compiles with NVRTC, with the library's
//! options, for sm_80 and sm_90, without a warning, and defines the entry
//! points it lists; the PTX has no approximate or flush-to-zero
//! arithmetic. Needs only libnvrtc, no GPU.
//!
//! Run here with `ZERO_REQUIRE_NVRTC=1 cargo test -p zero-core --features
//! cuda --test nvrtc`: zero finds NVRTC 12 or 13 where it is installed
//! (PyTorch's wheels, a toolkit), or put the folder of the one to test first
//! on `LD_LIBRARY_PATH` (`scripts/test-cuda.sh` runs this with 12.8 and
//! 13.0; `ZERO_NVRTC_VERSION=13.0` checks which one compiled). Without the
//! library the tests print a skip line, or fail when `ZERO_REQUIRE_NVRTC=1`.
#![cfg(feature = "cuda")]

use zero_core::cuda::kernels::{compile, KernelError, KernelSource, SOURCES};
use zero_core::Error;
use zero_testkit::kernel_checks::{compile_clean, nvrtc_or_skip};

const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

#[test]
fn every_source_compiles_cleanly_with_its_entry_points() {
    if !nvrtc_or_skip("every_source_compiles_cleanly_with_its_entry_points") {
        return;
    }
    assert!(!SOURCES.is_empty());
    for src in SOURCES {
        for arch in ARCHS {
            let c = compile_clean(src, arch);
            assert_eq!((c.name, c.arch.as_str()), (src.name, arch));
            let want = format!(".target {arch}");
            assert!(
                c.ptx.contains(&want),
                "{}: no `{want}` in the PTX",
                src.name
            );
            // The math must be IEEE-rounded whatever the options: no
            // approximate division/sqrt, no flushed denormals.
            for bad in [".approx", ".ftz", ".full."] {
                assert!(
                    !c.ptx.contains(bad),
                    "{} for {arch}: `{bad}` instruction in the PTX",
                    src.name
                );
            }
        }
    }
}

#[test]
fn virtual_architectures_give_ptx_only() {
    if !nvrtc_or_skip("virtual_architectures_give_ptx_only") {
        return;
    }
    for src in SOURCES {
        let c = compile_clean(src, "compute_90");
        assert!(c.cubin.is_none(), "{}: CUBIN for compute_90", src.name);
        assert!(c.ptx.contains(".target sm_90"), "{}", src.name);
    }
}

#[test]
fn adamw_math_is_the_reference_instruction_sequence() {
    if !nvrtc_or_skip("adamw_math_is_the_reference_instruction_sequence") {
        return;
    }
    let src = SOURCES.iter().find(|s| s.name == "adamw.cu").unwrap();
    let c = compile_clean(src, "sm_90");
    // The f32 kernel without a copy: per element 4 FMAs, 5 multiplies, one
    // IEEE square root and one IEEE division; 4 elements in the vector body
    // and one in the tail loop.
    let start = c.ptx.find(".entry adamw_gf32_mf32_pnone(").unwrap();
    let end = start + c.ptx[start..].find("\n}").unwrap();
    let body = &c.ptx[start..end];
    let count = |op: &str| body.matches(op).count();
    assert_eq!(count("fma.rn.f32"), 5 * 4, "{body}");
    assert_eq!(count("mul.rn.f32"), 5 * 5, "{body}");
    assert_eq!(count("sqrt.rn.f32"), 5, "{body}");
    assert_eq!(count("div.rn.f32"), 5, "{body}");
    // master, grad, m and v each with one 16-byte load per group of four,
    // and master, m and v with one 16-byte store.
    let v4_loads = body
        .lines()
        .filter(|l| l.contains("ld.global.") && l.contains(".v4."));
    assert_eq!(v4_loads.count(), 4, "{body}");
    let v4_stores = body
        .lines()
        .filter(|l| l.contains("st.global.") && l.contains(".v4."));
    assert_eq!(v4_stores.count(), 3, "{body}");
}

#[test]
fn compile_errors_name_the_source_and_carry_the_log() {
    if !nvrtc_or_skip("compile_errors_name_the_source_and_carry_the_log") {
        return;
    }
    let bad = KernelSource {
        name: "broken.cu",
        source:
            "#include \"zero_math.cuh\"\nextern \"C\" __global__ void k() { undefined_name(); }\n",
        headers: &[],
        entry_points: &["k"],
    };
    let err = compile(&bad, "sm_90").unwrap_err();
    let Error::Cuda(inner) = &err else {
        panic!("unexpected error {err}")
    };
    match inner.downcast_ref::<KernelError>() {
        Some(KernelError::Compile {
            source_name, log, ..
        }) => {
            assert_eq!(*source_name, "broken.cu");
            assert!(log.contains("undefined_name"), "{log}");
        }
        other => panic!("unexpected error {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("broken.cu") && msg.contains("undefined_name"),
        "{msg}"
    );

    // A warning is in the log of a successful compilation.
    let warns = KernelSource {
        name: "warns.cu",
        source: "extern \"C\" __global__ void k(int* p) { int unused_var; p[0] = 1; }\n",
        headers: &[],
        entry_points: &["k"],
    };
    let c = compile(&warns, "sm_80").unwrap();
    assert!(c.log.contains("warning"), "log: {:?}", c.log);

    // Malformed architectures are rejected before NVRTC sees them.
    for arch in ["sm_90 --fmad=true", "", "sm_9\0"] {
        let e = compile(SOURCES.first().unwrap(), arch).unwrap_err();
        assert!(e.to_string().contains(SOURCES[0].name), "{e}");
    }
}

#[test]
fn convert_kernels_read_their_pieces_in_place_and_add_with_ieee_rounding() {
    if !nvrtc_or_skip("convert_kernels_read_their_pieces_in_place_and_add_with_ieee_rounding") {
        return;
    }
    let src = SOURCES.iter().find(|s| s.name == "convert.cu").unwrap();
    for arch in ARCHS {
        let c = compile_clean(src, arch);
        for entry in src.entry_points {
            let start = c.ptx.find(&format!(".entry {entry}(")).unwrap();
            let end = start + c.ptx[start..].find("\n}").unwrap();
            let body = &c.ptx[start..end];
            // `__grid_constant__`: the 3 KiB of pieces are read from
            // parameter space, never copied to each thread's local memory.
            assert!(
                !body.contains(".local"),
                "{entry} for {arch}: local memory\n{body}"
            );
            assert!(body.contains("ld.param"), "{entry} for {arch}\n{body}");
            // The accumulation is one IEEE-rounded f32 addition.
            assert_eq!(
                body.matches("add.rn.f32").count(),
                1,
                "{entry} for {arch}\n{body}"
            );
        }
    }
}
