//! What every device backend must do, checked on each: the same generic
//! bodies (functions over `B: Backend`, using only the trait) run as one
//! `#[test]` per backend through [`conformance!`]:
//!
//! - on the CPU backend always, in every mode (`Inline`, `Checked`, and
//!   `Chaos` on two seeds);
//! - on the CUDA backend when built with `--features cuda` and a GPU is
//!   present; without one each test prints `<name>: skipped: no GPU (...)`
//!   and passes (a GPU that is there but cannot start the backend fails).
//!
//! Every primitive is checked against a plain host computation
//! (`zero_core::convert` for casts, packs and unpacks, `optim::sum_squares`
//! and `CpuAdamW` bit for bit for the norm and AdamW), on every dtype
//! combination, by range (offsets into both buffers), with more ranges than
//! one conversion launch takes; arguments out of range are errors that
//! change nothing; events order work across all four streams, also when
//! they come from the backend's pool (reused while other handles are
//! kept). Three more tests (`cuda_only`) need a GPU: a buffer dropped while
//! in use is freed only after its work, events are reused once done, and
//! another backend's buffers and events are refused.

use zero_core::backend::{
    AccessKind, AdamWPart, Backend, BufferHandle, CpuBackend, CpuMode, HostAccess, PackPiece,
    Stream, UnpackPiece,
};
use zero_core::optim::{sum_squares, AdamWParams, AdamWSlices, AdamWStep, CpuAdamW, NORM_CHUNK};
use zero_core::{bf16, convert, f16, DType, Element, Error, Result};
use zero_testkit::backend::{bits, download, download_after, raw_bits, upload};
use zero_testkit::rng::Rng;

use Stream::{Comm, Compute, DeviceToHost as D2h, HostToDevice as H2d};

/// Defines one `#[test]` per check and backend: modules `cpu_inline`,
/// `cpu_checked`, `cpu_chaos_1`, `cpu_chaos_2` and (with `cuda`) `cuda`,
/// each with a test named after every check.
macro_rules! conformance {
    ($($check:ident),* $(,)?) => {
        mod cpu_inline {
            $(#[test] fn $check() { super::on_cpu(zero_core::backend::CpuMode::Inline, super::$check); })*
        }
        mod cpu_checked {
            $(#[test] fn $check() { super::on_cpu(zero_core::backend::CpuMode::Checked, super::$check); })*
        }
        mod cpu_chaos_1 {
            $(#[test] fn $check() { super::on_cpu(zero_core::backend::CpuMode::Chaos { seed: 1 }, super::$check); })*
        }
        mod cpu_chaos_2 {
            $(#[test] fn $check() { super::on_cpu(zero_core::backend::CpuMode::Chaos { seed: 2 }, super::$check); })*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            $(#[test] fn $check() { super::on_cuda(stringify!($check), super::$check); })*
        }
    };
}

conformance!(
    alloc_gives_zeros_of_the_size_asked,
    copies_move_the_ranges,
    host_copies_move_the_ranges,
    same_dtype_copies_keep_the_bits,
    cast_every_dtype_pair,
    fill_sets_the_range,
    sum_squares_is_the_reference,
    adamw_is_cpu_adamw,
    adamw_rejects_bad_parts,
    pack_unpack_every_dtype_pair,
    pack_unpack_more_ranges_than_one_launch,
    bad_ranges_are_errors_and_change_nothing,
    events_order_work_across_streams,
    pooled_events_keep_their_points,
    host_views_read_and_write_back,
    large_host_views_read_and_write_back,
    adopt_keeps_the_contents,
    a_lent_buffer_comes_back_the_same,
    buffers_of_one_stream_are_zero_and_reused_in_its_order,
);

/// Runs `check` on a CPU backend in `mode`, then syncs everything (which
/// reports an error stored by a drop).
fn on_cpu(mode: CpuMode, check: fn(&CpuBackend) -> Result<()>) {
    let dev = CpuBackend::with_adamw(mode, CpuAdamW::new().with_threads(2)).unwrap();
    check(&dev).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
    dev.sync_all().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
}

/// Runs `check` on the CUDA backend of GPU 0, or prints a skip line when
/// there is no GPU.
#[cfg(feature = "cuda")]
fn on_cuda(name: &str, check: fn(&zero_core::backend::CudaBackend) -> Result<()>) {
    use std::io::Write;
    let dev = match zero_core::backend::CudaBackend::new(0) {
        Ok(dev) => dev,
        Err(Error::NoDevice { reason, .. }) => {
            // Straight to stderr: libtest hides `eprintln!` output of
            // passing tests.
            let _ = writeln!(std::io::stderr(), "{name}: skipped: no GPU ({reason})");
            return;
        }
        Err(e) => panic!("a GPU is present but the CUDA backend cannot start: {e}"),
    };
    check(&dev).unwrap_or_else(|e| panic!("cuda ({}): {e}", dev.arch()));
    dev.sync_all().unwrap_or_else(|e| panic!("cuda: {e}"));
}

// ---------------------------------------------------------------------------
// The checks: generic over the backend.
// ---------------------------------------------------------------------------

fn alloc_gives_zeros_of_the_size_asked<B: Backend>(dev: &B) -> Result<()> {
    let a = dev.alloc::<bf16>(1000, "weights")?;
    assert_eq!(
        (a.len(), a.label(), a.dtype()),
        (1000, "weights", DType::BF16)
    );
    assert!(!a.is_empty());
    assert_eq!(download(dev, &a)?, vec![bf16::ZERO; 1000]);
    let empty = dev.alloc::<f32>(0, "empty")?;
    assert!(empty.is_empty());
    assert_eq!(download(dev, &empty)?, Vec::<f32>::new());
    let h = dev.alloc_host::<f16>(33, "staging")?;
    assert_eq!((h.len(), h.label(), h.dtype()), (33, "staging", DType::F16));
    assert_eq!(dev.read_host(&h, 0..33)?, &[f16::ZERO; 33][..]);
    assert_ne!(a.id(), empty.id());
    assert_ne!(a.id(), h.id());
    Ok(())
}

fn host_copies_move_the_ranges<B: Backend>(dev: &B) -> Result<()> {
    let data: Vec<f32> = Rng(17).vec(300);
    let mut host = dev.alloc_host::<f32>(300, "host")?;
    dev.write_host(&mut host, 0..300)?.copy_from_slice(&data);
    let mut d = dev.alloc::<f32>(200, "d")?;
    dev.copy_h2d(H2d, &host, 40, &mut d, 10, 150)?;
    let up = dev.record(H2d)?;
    dev.wait(D2h, &up)?;
    let mut back = dev.alloc_host::<f32>(100, "back")?;
    dev.copy_d2h(D2h, &d, 5, &mut back, 20, 60)?;
    let done = dev.record(D2h)?;
    dev.sync(&done)?;
    // d[10..160] = data[40..190]; back[20..80] = d[5..65].
    let mut want_d = vec![0.0; 200];
    want_d[10..160].copy_from_slice(&data[40..190]);
    let mut want_back = vec![0.0; 100];
    want_back[20..80].copy_from_slice(&want_d[5..65]);
    assert_eq!(dev.read_host(&back, 0..100)?, &want_back[..]);
    assert_eq!(dev.read_host(&back, 30..35)?, &want_back[30..35]);
    // The host's own writes by range.
    dev.write_host(&mut back, 90..100)?.fill(-2.0);
    want_back[90..100].fill(-2.0);
    assert_eq!(dev.read_host(&back, 0..100)?, &want_back[..]);
    assert_eq!(download_after(dev, D2h, &d)?, want_d);
    Ok(())
}

/// Elements whose bits a conversion through f32 could change: NaNs with
/// payloads (signalling and quiet), both zeros, subnormals, infinities.
fn odd_bits<T: Element>() -> Vec<T> {
    let patterns: &[u64] = &[
        0x7F80_0001,
        0x7FC0_1234,
        0xFF80_0F00,
        0x8000_0000,
        0x0000_0001,
        0x807F_FFFF,
        0x7F80_0000,
        0x7D01,
        0x7C01,
        0xFE01,
        0xFC01,
        0x8000,
        0x0001,
        0x3F80_0000,
    ];
    patterns
        .iter()
        .map(|&p| {
            let bytes = p.to_le_bytes();
            bytemuck::pod_read_unaligned(&bytes[..size_of::<T>()])
        })
        .collect()
}

fn same_dtype_copies_keep_the_bits_of<B: Backend, T: Element>(dev: &B) -> Result<()> {
    let odd: Vec<T> = odd_bits();
    let n = odd.len();
    let a = upload(dev, &odd, "odd")?;
    let mut b = dev.alloc::<T>(4 * n, "b")?;
    dev.copy_d2d(Compute, &a, 0, &mut b, 0, n)?;
    dev.cast(Compute, &a, 0, &mut b, n, n, false)?;
    dev.pack(
        Compute,
        &[PackPiece::<B, T> {
            src: &a,
            src_at: 0,
            dst_at: 2 * n,
            len: n,
        }],
        &mut b,
    )?;
    dev.copy_within(Compute, &mut b, 0..n, 3 * n)?;
    let got = download(dev, &b)?;
    for k in 0..4 {
        assert_eq!(
            raw_bits(&got[k * n..(k + 1) * n]),
            raw_bits(&odd),
            "{} copy {k} (d2d, cast, pack, copy_within)",
            T::DTYPE
        );
    }
    let mut c = dev.alloc::<T>(n, "c")?;
    dev.unpack(
        Compute,
        &b,
        &mut [UnpackPiece::<B, T> {
            dst: &mut c,
            dst_at: 0,
            src_at: n,
            len: n,
        }],
        false,
    )?;
    assert_eq!(
        raw_bits(&download(dev, &c)?),
        raw_bits(&odd),
        "{} unpack",
        T::DTYPE
    );
    Ok(())
}

fn same_dtype_copies_keep_the_bits<B: Backend>(dev: &B) -> Result<()> {
    same_dtype_copies_keep_the_bits_of::<B, f32>(dev)?;
    same_dtype_copies_keep_the_bits_of::<B, bf16>(dev)?;
    same_dtype_copies_keep_the_bits_of::<B, f16>(dev)
}

fn copies_move_the_ranges<B: Backend>(dev: &B) -> Result<()> {
    let mut rng = Rng(7);
    let data: Vec<bf16> = rng.vec(100);
    let a = upload(dev, &data, "a")?;
    let mut b = dev.alloc::<bf16>(100, "b")?;
    dev.copy_d2d(Compute, &a, 10, &mut b, 50, 30)?;
    dev.copy_within(Compute, &mut b, 50..60, 0)?;
    let mut want = vec![bf16::ZERO; 100];
    want[50..80].copy_from_slice(&data[10..40]);
    want.copy_within(50..60, 0);
    assert_eq!(download(dev, &b)?, want);
    // Bad arguments are errors and change nothing.
    let e = dev.copy_d2d(Compute, &a, 90, &mut b, 0, 11).unwrap_err();
    assert!(
        matches!(e, Error::InvalidSize { op: "copy_d2d", .. }),
        "{e}"
    );
    let e = dev.copy_within(Compute, &mut b, 0..10, 5).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidSize {
                op: "copy_within",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("overlap"), "{e}");
    let e = dev.copy_within(Compute, &mut b, 95..105, 0).unwrap_err();
    assert!(matches!(e, Error::InvalidSize { .. }), "{e}");
    assert_eq!(download(dev, &b)?, want);
    Ok(())
}

fn cast_one<B: Backend, S: Element, D: Element>(dev: &B, rng: &mut Rng) -> Result<()> {
    let n = 257;
    let src: Vec<S> = rng.vec(n);
    let init: Vec<D> = rng.vec(n);
    let s = upload(dev, &src, "src")?;
    for accumulate in [false, true] {
        let mut d = upload(dev, &init, "dst")?;
        dev.cast(Compute, &s, 3, &mut d, 5, 200, accumulate)?;
        let mut want = init.clone();
        convert(&src[3..203], &mut want[5..205], accumulate);
        assert_eq!(
            bits(&download(dev, &d)?),
            bits(&want),
            "cast {} -> {} accumulate {accumulate}",
            S::DTYPE,
            D::DTYPE
        );
    }
    Ok(())
}

fn cast_every_dtype_pair<B: Backend>(dev: &B) -> Result<()> {
    let rng = &mut Rng(11);
    cast_one::<B, f32, f32>(dev, rng)?;
    cast_one::<B, f32, bf16>(dev, rng)?;
    cast_one::<B, f32, f16>(dev, rng)?;
    cast_one::<B, bf16, f32>(dev, rng)?;
    cast_one::<B, bf16, bf16>(dev, rng)?;
    cast_one::<B, bf16, f16>(dev, rng)?;
    cast_one::<B, f16, f32>(dev, rng)?;
    cast_one::<B, f16, bf16>(dev, rng)?;
    cast_one::<B, f16, f16>(dev, rng)
}

fn fill_sets_the_range<B: Backend>(dev: &B) -> Result<()> {
    let data: Vec<f16> = Rng(3).vec(64);
    let mut b = upload(dev, &data, "b")?;
    dev.fill(Compute, &mut b, 8..40, f16::from_f32(-1.5))?;
    let mut want = data.clone();
    want[8..40].fill(f16::from_f32(-1.5));
    assert_eq!(download(dev, &b)?, want);
    let e = dev.fill(Compute, &mut b, 60..65, f16::ZERO).unwrap_err();
    assert!(matches!(e, Error::InvalidSize { op: "fill", .. }), "{e}");
    Ok(())
}

fn sum_squares_one<B: Backend, G: Element>(dev: &B, rng: &mut Rng) -> Result<()> {
    let big: Vec<G> = rng.vec(2 * NORM_CHUNK + 1001);
    let small: Vec<G> = rng.vec(33);
    let a = upload(dev, &big, "big")?;
    let b = upload(dev, &small, "small")?;
    let parts = [(&a, 17..big.len()), (&b, 0..33), (&a, 5..5), (&b, 1..2)];
    let x = dev.sum_squares(Compute, &parts)?;
    let done = dev.record(Compute)?;
    dev.sync(&done)?;
    let got = dev.read_scalars(&x)?;
    let want = [
        sum_squares(&big[17..]),
        sum_squares(&small[..]),
        0.0,
        sum_squares(&small[1..2]),
    ];
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "sum_squares of {}",
        G::DTYPE
    );
    Ok(())
}

fn sum_squares_is_the_reference<B: Backend>(dev: &B) -> Result<()> {
    let rng = &mut Rng(5);
    sum_squares_one::<B, f32>(dev, rng)?;
    sum_squares_one::<B, bf16>(dev, rng)?;
    sum_squares_one::<B, f16>(dev, rng)
}

fn adamw_one<B: Backend, G: Element, P: Element>(dev: &B, rng: &mut Rng) -> Result<()> {
    let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-2, 3, 0.75);
    // Two parts of different sizes at different offsets; the second has no
    // low-precision copy.
    let (n0, n1) = (3000, 517);
    let master: Vec<f32> = rng.vec(4000);
    let m: Vec<f32> = rng.vec(4000);
    let v: Vec<f32> = rng.vec(4000).iter().map(|x: &f32| x.abs()).collect();
    let grad: Vec<G> = rng.vec(5000);
    let low: Vec<P> = rng.vec(3500);
    let (mut dm, mut dmo, mut dv) = (
        upload(dev, &master, "master")?,
        upload(dev, &m, "m")?,
        upload(dev, &v, "v")?,
    );
    let dg = upload(dev, &grad, "grad")?;
    let mut dl = upload(dev, &low, "low")?;
    let (mut master2, mut m2, mut v2) = (
        dev.alloc::<f32>(600, "master2")?,
        dev.alloc(600, "m2")?,
        dev.alloc(600, "v2")?,
    );
    dev.copy_d2d(Compute, &dm, 3000, &mut master2, 0, 600)?;
    dev.copy_d2d(Compute, &dmo, 3000, &mut m2, 0, 600)?;
    dev.copy_d2d(Compute, &dv, 3000, &mut v2, 0, 600)?;
    dev.adamw(
        Compute,
        &k,
        vec![
            AdamWPart::<B, G, P> {
                master: &mut dm,
                m: &mut dmo,
                v: &mut dv,
                state: 0..n0,
                grad: &dg,
                grad_at: 100,
                low: Some((&mut dl, 400)),
            },
            AdamWPart::<B, G, P> {
                master: &mut master2,
                m: &mut m2,
                v: &mut v2,
                state: 50..50 + n1,
                grad: &dg,
                grad_at: 4000,
                low: None,
            },
        ],
    )?;
    // The same update through CpuAdamW on host slices.
    let (mut hm, mut hmo, mut hv, mut hl) = (master.clone(), m.clone(), v.clone(), low.clone());
    let (mut hm2, mut hmo2, mut hv2) = (
        master[3000..3600].to_vec(),
        m[3000..3600].to_vec(),
        v[3000..3600].to_vec(),
    );
    CpuAdamW::new().step_many(
        &k,
        vec![
            AdamWSlices {
                master: &mut hm[..n0],
                grad: &grad[100..100 + n0],
                m: &mut hmo[..n0],
                v: &mut hv[..n0],
                low: Some(&mut hl[400..400 + n0]),
            },
            AdamWSlices {
                master: &mut hm2[50..50 + n1],
                grad: &grad[4000..4000 + n1],
                m: &mut hmo2[50..50 + n1],
                v: &mut hv2[50..50 + n1],
                low: None,
            },
        ],
    )?;
    let what = format!("adamw grad {} copy {}", G::DTYPE, P::DTYPE);
    assert_eq!(bits(&download(dev, &dm)?), bits(&hm), "{what}: master");
    assert_eq!(bits(&download(dev, &dmo)?), bits(&hmo), "{what}: m");
    assert_eq!(bits(&download(dev, &dv)?), bits(&hv), "{what}: v");
    assert_eq!(bits(&download(dev, &dl)?), bits(&hl), "{what}: low");
    assert_eq!(
        bits(&download(dev, &master2)?),
        bits(&hm2),
        "{what}: master 2"
    );
    assert_eq!(bits(&download(dev, &m2)?), bits(&hmo2), "{what}: m 2");
    assert_eq!(bits(&download(dev, &v2)?), bits(&hv2), "{what}: v 2");
    Ok(())
}

fn adamw_is_cpu_adamw<B: Backend>(dev: &B) -> Result<()> {
    let rng = &mut Rng(9);
    adamw_one::<B, f32, f32>(dev, rng)?;
    adamw_one::<B, f32, bf16>(dev, rng)?;
    adamw_one::<B, bf16, bf16>(dev, rng)?;
    adamw_one::<B, bf16, f16>(dev, rng)?;
    adamw_one::<B, f16, f32>(dev, rng)?;
    adamw_one::<B, f16, f16>(dev, rng)
}

fn adamw_rejects_bad_parts<B: Backend>(dev: &B) -> Result<()> {
    let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, 1, 1.0);
    let (mut a, mut m, mut v) = (
        dev.alloc::<f32>(10, "a")?,
        dev.alloc(10, "m")?,
        dev.alloc(10, "v")?,
    );
    let g = dev.alloc::<bf16>(8, "g")?;
    let e = dev
        .adamw::<bf16, bf16>(
            Compute,
            &k,
            vec![AdamWPart {
                master: &mut a,
                m: &mut m,
                v: &mut v,
                state: 0..10,
                grad: &g,
                grad_at: 0,
                low: None,
            }],
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidSize { op: "adamw", .. }), "{e}");
    assert!(e.to_string().contains("part 0"), "{e}");
    Ok(())
}

fn pack_unpack_one<B: Backend, S: Element, D: Element>(dev: &B, rng: &mut Rng) -> Result<()> {
    let g0: Vec<S> = rng.vec(40);
    let g1: Vec<S> = rng.vec(24);
    let (b0, b1) = (upload(dev, &g0, "g0")?, upload(dev, &g1, "g1")?);
    let init: Vec<D> = rng.vec(80);
    let mut bucket = upload(dev, &init, "bucket")?;
    // Stage-1 style: each unit's shards to the rank sections of the bucket.
    let pieces = [
        PackPiece::<B, S> {
            src: &b0,
            src_at: 0,
            dst_at: 0,
            len: 20,
        },
        PackPiece::<B, S> {
            src: &b0,
            src_at: 20,
            dst_at: 40,
            len: 20,
        },
        PackPiece::<B, S> {
            src: &b1,
            src_at: 0,
            dst_at: 20,
            len: 12,
        },
        PackPiece::<B, S> {
            src: &b1,
            src_at: 12,
            dst_at: 60,
            len: 12,
        },
    ];
    dev.pack(Compute, &pieces, &mut bucket)?;
    let mut want = init.clone();
    convert(&g0[..20], &mut want[0..20], false);
    convert(&g0[20..], &mut want[40..60], false);
    convert(&g1[..12], &mut want[20..32], false);
    convert(&g1[12..], &mut want[60..72], false);
    let what = format!("pack {} -> {}", S::DTYPE, D::DTYPE);
    assert_eq!(bits(&download(dev, &bucket)?), bits(&want), "{what}");

    // Unpack back into S-typed homes, storing then accumulating.
    let a0: Vec<S> = rng.vec(20);
    let a1: Vec<S> = rng.vec(12);
    for accumulate in [false, true] {
        let (mut h0, mut h1) = (upload(dev, &a0, "home0")?, upload(dev, &a1, "home1")?);
        let mut pieces = [
            UnpackPiece::<B, S> {
                dst: &mut h0,
                dst_at: 0,
                src_at: 40,
                len: 20,
            },
            UnpackPiece::<B, S> {
                dst: &mut h1,
                dst_at: 2,
                src_at: 60,
                len: 10,
            },
        ];
        dev.unpack(Compute, &bucket, &mut pieces, accumulate)?;
        let (mut w0, mut w1) = (a0.clone(), a1.clone());
        convert(&want[40..60], &mut w0[..], accumulate);
        convert(&want[60..70], &mut w1[2..12], accumulate);
        assert_eq!(
            bits(&download(dev, &h0)?),
            bits(&w0),
            "un{what} {accumulate}"
        );
        assert_eq!(
            bits(&download(dev, &h1)?),
            bits(&w1),
            "un{what} {accumulate}"
        );
    }
    Ok(())
}

fn pack_unpack_every_dtype_pair<B: Backend>(dev: &B) -> Result<()> {
    let rng = &mut Rng(13);
    pack_unpack_one::<B, f32, f32>(dev, rng)?;
    pack_unpack_one::<B, f32, bf16>(dev, rng)?;
    pack_unpack_one::<B, bf16, f32>(dev, rng)?;
    pack_unpack_one::<B, bf16, bf16>(dev, rng)?;
    pack_unpack_one::<B, f16, f32>(dev, rng)?;
    pack_unpack_one::<B, f32, f16>(dev, rng)?;
    pack_unpack_one::<B, bf16, f16>(dev, rng)
}

/// 250 ranges of 1 to 70 elements from three sources into one bucket, and
/// 130 ranges of the bucket into 130 buffers, stored and accumulated: more
/// than one conversion launch takes on CUDA.
fn pack_unpack_more_ranges_than_one_launch<B: Backend>(dev: &B) -> Result<()> {
    let mut rng = Rng(23);
    let srcs: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(5000)).collect();
    let bufs = srcs
        .iter()
        .enumerate()
        .map(|(i, s)| upload(dev, s, &format!("grad {i}")))
        .collect::<Result<Vec<_>>>()?;
    // (source, src_at, dst_at, len), bucket ranges disjoint with gaps.
    let mut plan = Vec::new();
    let mut at = 0;
    for i in 0..250 {
        let len = 1 + (rng.next_u64() % 70) as usize;
        let src_at = (rng.next_u64() % (5000 - len as u64)) as usize;
        plan.push((i % 3, src_at, at, len));
        at += len + (rng.next_u64() % 3) as usize;
    }
    let init: Vec<bf16> = rng.vec(at + 5);
    let mut bucket = upload(dev, &init, "bucket")?;
    let pieces: Vec<PackPiece<'_, B, f32>> = plan
        .iter()
        .map(|&(s, src_at, dst_at, len)| PackPiece {
            src: &bufs[s],
            src_at,
            dst_at,
            len,
        })
        .collect();
    dev.pack(Compute, &pieces, &mut bucket)?;
    let mut want = init.clone();
    for &(s, src_at, dst_at, len) in &plan {
        convert(
            &srcs[s][src_at..src_at + len],
            &mut want[dst_at..dst_at + len],
            false,
        );
    }
    assert_eq!(bits(&download(dev, &bucket)?), bits(&want), "pack");

    // Bucket range i to buffer i, one element in.
    let back = &plan[..130];
    for accumulate in [false, true] {
        let homes_init: Vec<Vec<f16>> = back.iter().map(|p| rng.vec(p.3 + 2)).collect();
        let mut homes = homes_init
            .iter()
            .map(|h| upload(dev, h, "home"))
            .collect::<Result<Vec<_>>>()?;
        let mut pieces: Vec<UnpackPiece<'_, B, f16>> = homes
            .iter_mut()
            .zip(back)
            .map(|(dst, &(_, _, src_at, len))| UnpackPiece {
                dst,
                dst_at: 1,
                src_at,
                len,
            })
            .collect();
        dev.unpack(Compute, &bucket, &mut pieces, accumulate)?;
        drop(pieces);
        for (i, ((home, init), &(_, _, src_at, len))) in
            homes.iter().zip(&homes_init).zip(back).enumerate()
        {
            let mut w = init.clone();
            convert(&want[src_at..src_at + len], &mut w[1..1 + len], accumulate);
            assert_eq!(
                bits(&download(dev, home)?),
                bits(&w),
                "unpack {accumulate} piece {i}"
            );
        }
    }
    Ok(())
}

fn bad_ranges_are_errors_and_change_nothing<B: Backend>(dev: &B) -> Result<()> {
    let data: Vec<f32> = Rng(29).vec(8);
    let b = upload(dev, &data, "b")?;
    let mut bucket = upload(dev, &data, "bucket")?;
    let is_invalid =
        |e: &Error, op: &str| matches!(e, Error::InvalidSize { op: o, .. } if *o == op);
    let e = dev
        .pack(
            Compute,
            &[
                PackPiece::<B, f32> {
                    src: &b,
                    src_at: 0,
                    dst_at: 0,
                    len: 2,
                },
                PackPiece::<B, f32> {
                    src: &b,
                    src_at: 4,
                    dst_at: 2,
                    len: 5,
                },
            ],
            &mut bucket,
        )
        .unwrap_err();
    assert!(is_invalid(&e, "pack"), "{e}");
    let e = dev
        .unpack(
            Compute,
            &b,
            &mut [UnpackPiece::<B, f32> {
                dst: &mut bucket,
                dst_at: 6,
                src_at: 0,
                len: 3,
            }],
            true,
        )
        .unwrap_err();
    assert!(is_invalid(&e, "unpack"), "{e}");
    let e = dev
        .cast(Compute, &b, 7, &mut bucket, 0, 2, false)
        .unwrap_err();
    assert!(is_invalid(&e, "cast"), "{e}");
    let e = dev
        .cast(Compute, &b, usize::MAX, &mut bucket, 0, 2, true)
        .unwrap_err();
    assert!(is_invalid(&e, "cast"), "{e}");
    let e = dev
        .sum_squares(Compute, &[(&b, 0..8), (&b, 7..9)])
        .unwrap_err();
    assert!(is_invalid(&e, "sum_squares"), "{e}");
    let mut host = dev.alloc_host::<f32>(4, "h")?;
    let e = dev.copy_h2d(H2d, &host, 2, &mut bucket, 0, 3).unwrap_err();
    assert!(is_invalid(&e, "copy_h2d"), "{e}");
    let e = dev.copy_d2h(D2h, &b, 0, &mut host, 1, 4).unwrap_err();
    assert!(is_invalid(&e, "copy_d2h"), "{e}");
    assert!(dev.read_host(&host, 2..5).is_err());
    let (start, end) = (5, 4);
    assert!(dev.write_host(&mut host, start..end).is_err());
    // Nothing was written.
    assert_eq!(download(dev, &bucket)?, data);
    assert_eq!(dev.read_host(&host, 0..4)?, &[0.0; 4][..]);
    Ok(())
}

/// A chain over all four streams, each step made to wait for the previous
/// one by an event only (no host sync in between): upload on h2d, convert
/// on compute, copy within on comm, download on d2h. Large enough that on
/// a GPU a missing wait would show as stale data.
fn events_order_work_across_streams<B: Backend>(dev: &B) -> Result<()> {
    let n = 1 << 20;
    let data: Vec<f32> = Rng(31).vec(n);
    let mut host = dev.alloc_host::<f32>(n, "upload")?;
    dev.write_host(&mut host, 0..n)?.copy_from_slice(&data);
    let mut a = dev.alloc::<f32>(n, "a")?;
    let mut b = dev.alloc::<bf16>(2 * n, "b")?;
    dev.copy_h2d(H2d, &host, 0, &mut a, 0, n)?;
    let uploaded = dev.record(H2d)?;
    dev.wait(Compute, &uploaded)?;
    dev.cast(Compute, &a, 0, &mut b, 0, n, false)?;
    let converted = dev.record(Compute)?;
    dev.wait(Comm, &converted)?;
    dev.copy_within(Comm, &mut b, 0..n, n)?;
    let copied = dev.record(Comm)?;
    dev.wait(D2h, &copied)?;
    let mut out = dev.alloc_host::<bf16>(n, "download")?;
    dev.copy_d2h(D2h, &b, n, &mut out, 0, n)?;
    let done = dev.record(D2h)?;
    dev.sync(&done)?;
    let mut want = vec![bf16::ZERO; n];
    convert(&data, &mut want, false);
    assert_eq!(dev.read_host(&out, 0..n)?, &want[..]);
    // The host buffer of the upload is rewritten only after every stream's
    // work is done.
    dev.sync_all()?;
    dev.write_host(&mut host, 0..n)?.fill(0.0);
    Ok(())
}

/// Events come from a pool (`record` reuses an event whose work is done
/// and that no handle refers to any more). With many records, waits and
/// syncs on every stream, handles dropped at once (their events go back
/// and are reused) and clones of others kept for later, each kept event
/// still means the point it was recorded at. A pool that reused a kept
/// event early (say, when one of its clones dropped) would make a later
/// wait wait for another stream's point: an unordered access on the
/// checked CPU backend, wrong data in Chaos mode and on a device.
fn pooled_events_keep_their_points<B: Backend>(dev: &B) -> Result<()> {
    let (chunks, len) = (48, 4096);
    let n = chunks * len;
    let data: Vec<f32> = Rng(57).vec(n);
    let mut host = dev.alloc_host::<f32>(n, "upload")?;
    dev.write_host(&mut host, 0..n)?.copy_from_slice(&data);
    let mut a = dev.alloc::<f32>(n, "a")?;
    let mut b = dev.alloc::<bf16>(n, "b")?;
    // One scratch buffer per churning stream: each stream's churn is
    // ordered on its own.
    let mut scratch = [
        dev.alloc::<f32>(len, "comm")?,
        dev.alloc::<f32>(len, "d2h")?,
    ];
    let mut kept = Vec::new();
    for k in 0..chunks {
        dev.copy_h2d(H2d, &host, k * len, &mut a, k * len, len)?;
        let uploaded = dev.record(H2d)?;
        kept.push(uploaded.clone());
        drop(uploaded);
        for (j, s) in [Comm, D2h].into_iter().enumerate() {
            dev.fill(s, &mut scratch[j], 0..len, k as f32)?;
            let e = dev.record(s)?;
            if k % 5 == j {
                dev.sync(&e)?;
            }
            if k % 3 == 0 {
                dev.wait(Compute, &e)?;
            }
        }
    }
    // Latest first: each chunk is read on compute after its own upload.
    while let Some(uploaded) = kept.pop() {
        let k = kept.len();
        dev.wait(Compute, &uploaded)?;
        dev.cast(Compute, &a, k * len, &mut b, k * len, len, false)?;
    }
    let mut want = vec![bf16::ZERO; n];
    convert(&data, &mut want, false);
    assert_eq!(raw_bits(&download(dev, &b)?), raw_bits(&want));
    // The upload buffer is rewritten only after every stream's work.
    dev.sync_all()?;
    dev.write_host(&mut host, 0..n)?.fill(0.0);
    Ok(())
}

/// The checked CPU backend's events come from its pool: records whose
/// handles are gone reuse events instead of making new ones.
#[test]
fn cpu_events_are_reused() {
    for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 3 }] {
        let dev = CpuBackend::new(mode).unwrap();
        for _ in 0..1000 {
            let e = dev.record(Compute).unwrap();
            dev.sync(&e).unwrap();
        }
        assert!(
            dev.events_created() <= 2,
            "{mode:?}: {} events for 1000 records",
            dev.events_created()
        );
        // Handles kept alive each hold their own event.
        let kept: Vec<_> = (0..10).map(|_| dev.record(Comm).unwrap()).collect();
        assert!(dev.events_created() >= 10, "{mode:?}");
        drop(kept);
    }
}

/// [`HostAccess`] views: a read view holds the range's elements; a
/// mutable view changes exactly its range once committed, and the
/// device's work afterwards sees the change; a range outside the buffer is
/// an error.
fn host_views_read_and_write_back<B: HostAccess>(dev: &B) -> Result<()> {
    let data: Vec<f32> = Rng(41).vec(1000);
    let mut buf = upload(dev, &data, "viewed")?;
    assert_eq!(bits(&dev.host_ref(&buf, 100..300)?), bits(&data[100..300]));
    let mut view = dev.host_mut(&mut buf, 200..250)?;
    assert_eq!(bits(&view), bits(&data[200..250]));
    view.iter_mut().for_each(|x| *x = -*x);
    dev.commit(view)?;
    let mut want = data.clone();
    want[200..250].iter_mut().for_each(|x| *x = -*x);
    assert_eq!(bits(&download(dev, &buf)?), bits(&want));
    // The device sees the committed values.
    let mut copy = dev.alloc::<f32>(1000, "copy")?;
    dev.copy_d2d(Compute, &buf, 0, &mut copy, 0, 1000)?;
    assert_eq!(bits(&download_after(dev, Compute, &copy)?), bits(&want));
    assert!(matches!(
        dev.host_ref(&buf, 990..1001),
        Err(Error::InvalidSize { .. })
    ));
    Ok(())
}

/// Host views of tens of MiB, at odd offsets (on CUDA they go through
/// the backend's pinned staging buffers, 8 MiB at a time), read and write
/// back the same bits as small ones, f32 and bf16.
fn large_host_views_read_and_write_back<B: HostAccess>(dev: &B) -> Result<()> {
    let n = (21 << 20) / 4 + 777;
    let data: Vec<f32> = Rng(43).vec(n);
    let mut buf = upload(dev, &data, "large view")?;
    let r = 3..n - 5;
    assert_eq!(
        bits(&dev.host_ref(&buf, r.clone())?),
        bits(&data[r.clone()])
    );
    let w = 1001..n - 1;
    let mut view = dev.host_mut(&mut buf, w.clone())?;
    assert_eq!(bits(&view), bits(&data[w.clone()]));
    view.iter_mut().for_each(|x| *x = 2.0 * *x + 1.0);
    dev.commit(view)?;
    let mut want = data.clone();
    want[w].iter_mut().for_each(|x| *x = 2.0 * *x + 1.0);
    let mut copy = dev.alloc::<f32>(n, "large copy")?;
    dev.copy_d2d(Compute, &buf, 0, &mut copy, 0, n)?;
    assert_eq!(bits(&download_after(dev, Compute, &copy)?), bits(&want));
    // bf16: the pieces split at element boundaries of a 2-byte type.
    let m = n + 3;
    let halves: Vec<bf16> = Rng(44).vec(m).into_iter().map(bf16::from_f32).collect();
    let mut h = dev.alloc::<bf16>(m, "large bf16 view")?;
    let mut view = dev.host_mut(&mut h, 0..m)?;
    view.copy_from_slice(&halves);
    dev.commit(view)?;
    assert_eq!(raw_bits(&dev.host_ref(&h, 1..m)?), raw_bits(&halves[1..]));
    Ok(())
}

/// A buffer adopted from host memory holds its contents, of every dtype.
fn adopt_keeps_the_contents<B: HostAccess>(dev: &B) -> Result<()> {
    fn one<B: HostAccess, T: Element>(dev: &B) -> Result<()> {
        let data = odd_bits::<T>();
        let mut mem = zero_core::HostBuffer::<T>::zeros(data.len())?;
        mem.copy_from_slice(&data);
        let buf = dev.adopt(mem, "adopted")?;
        assert_eq!(buf.len(), data.len());
        assert_eq!(buf.label(), "adopted");
        assert_eq!(raw_bits(&download(dev, &buf)?), raw_bits(&data));
        Ok(())
    }
    one::<B, f32>(dev)?;
    one::<B, bf16>(dev)?;
    one::<B, f16>(dev)
}

/// A buffer lent (as the trainer's gradient buffer is) comes back with the
/// same id and label, holding what was written while it was lent.
fn a_lent_buffer_comes_back_the_same<B: HostAccess>(dev: &B) -> Result<()> {
    let mut buf = dev.alloc::<f32>(64, "lent")?;
    dev.fill(Compute, &mut buf, 0..64, 1.5)?;
    let id = buf.id();
    let (loan, lent) = dev.lend(Compute, "backward", buf, &[(0..64, AccessKind::Write)])?;
    let (buf, event) = dev.give_back(loan, lent)?;
    assert_eq!((buf.id(), buf.label(), buf.len()), (id, "lent", 64));
    dev.sync(&event)?;
    assert_eq!(download(dev, &buf)?, vec![1.5f32; 64]);
    Ok(())
}

/// `alloc_on` gives zeros to its stream; a buffer released on that stream
/// while its work is still queued is not reused under that work: many
/// buffers allocated, written, read and released in a row, each read
/// checked.
fn buffers_of_one_stream_are_zero_and_reused_in_its_order<B: HostAccess>(dev: &B) -> Result<()> {
    let n = 1 << 16;
    let mut out = dev.alloc::<f32>(n * 8, "out")?;
    for k in 0..8 {
        let mut a = dev.alloc_on::<f32>(Compute, n, "a")?;
        let mut z = dev.alloc_on::<f32>(Compute, n, "zeros")?;
        // `z` must read zero even where `a`'s memory of the last round was.
        dev.cast(Compute, &z, 0, &mut a, 0, n, true)?;
        dev.fill(Compute, &mut z, 0..n, 0.0)?;
        dev.fill(Compute, &mut a, 0..n, k as f32)?;
        dev.cast(Compute, &z, 0, &mut a, 0, n, true)?;
        dev.copy_d2d(Compute, &a, 0, &mut out, k * n, n)?;
        dev.release_on(Compute, a);
        dev.release_on(Compute, z);
    }
    dev.sync(&dev.record(Compute)?)?;
    let got = download(dev, &out)?;
    for k in 0..8 {
        assert!(
            got[k * n..(k + 1) * n].iter().all(|&v| v == k as f32),
            "round {k}: a buffer of the stream did not hold its values"
        );
    }
    Ok(())
}

/// What only the CUDA backend must show on a GPU: memory of a dropped
/// buffer is reused only after the work that used it, events are reused
/// once their work is done, and buffers and events of another backend are
/// refused.
#[cfg(feature = "cuda")]
mod cuda_only {
    use super::*;
    use zero_core::backend::CudaBackend;

    #[test]
    fn a_buffer_dropped_while_in_use_is_freed_after_its_work() {
        on_cuda(
            "a_buffer_dropped_while_in_use_is_freed_after_its_work",
            |dev| {
                let n = 1 << 22;
                let data: Vec<f32> = Rng(37).vec(n);
                let a = upload(dev, &data, "a")?;
                let mut b = dev.alloc::<bf16>(n, "b")?;
                // Several passes keep compute busy while `a` is dropped and its
                // memory is asked for again and overwritten from another stream.
                for _ in 0..4 {
                    dev.cast(Compute, &a, 0, &mut b, 0, n, false)?;
                }
                drop(a);
                let mut c = dev.alloc::<f32>(n, "c")?;
                dev.fill(Comm, &mut c, 0..n, f32::NAN)?;
                let mut want = vec![bf16::ZERO; n];
                convert(&data, &mut want, false);
                assert_eq!(raw_bits(&download(dev, &b)?), raw_bits(&want));
                Ok(())
            },
        );
    }

    #[test]
    fn events_are_reused_once_done() {
        on_cuda("events_are_reused_once_done", |dev| {
            for _ in 0..1000 {
                let e = dev.record(Compute)?;
                dev.sync(&e)?;
            }
            let created = dev.events_created();
            assert!(created <= 2, "{created} events for 1000 records");
            Ok(())
        });
    }

    #[test]
    fn buffers_and_events_of_another_backend_are_refused() {
        on_cuda("buffers_and_events_of_another_backend_are_refused", |dev| {
            let other = CudaBackend::new(0)?;
            let a = other.alloc::<f32>(4, "theirs")?;
            let mut b = dev.alloc::<f32>(4, "ours")?;
            let e = dev.copy_d2d(Compute, &a, 0, &mut b, 0, 4).unwrap_err();
            assert!(matches!(e, Error::Backend { op: "copy_d2d", .. }), "{e}");
            assert!(e.to_string().contains("theirs"), "{e}");
            let ev = other.record(Compute)?;
            let e = dev.wait(Comm, &ev).unwrap_err();
            assert!(matches!(e, Error::Backend { op: "wait", .. }), "{e}");
            Ok(())
        });
    }
}
