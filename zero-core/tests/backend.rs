//! The device backend seam (`zero_core::backend`).
//!
//! - A conformance suite written against the `Backend` trait only (generic
//!   functions over `B: Backend`, so the CUDA backend can run the same
//!   suite): every primitive against a plain host computation, on every
//!   dtype combination that matters, AdamW and the norm bit-identical to
//!   `CpuAdamW` / `optim::sum_squares`. It runs on every CPU mode.
//! - The hazard checker on the CPU backend: a missing wait or sync fails
//!   with `Error::Hazard` naming the buffer, both operations and both
//!   streams, in Checked mode and in Chaos mode on every seed; the same
//!   program with the wait passes; Inline checks nothing.
//! - Chaos mode: the same numbers as Inline for a correctly ordered
//!   multi-stream program, freed memory poisoned, a drop while in use
//!   reported by the next call.

use zero_core::backend::{
    AccessKind, AdamWPart, Agent, Backend, BufferHandle, CpuBackend, CpuMode, Hazard, PackPiece,
    Stream, UnpackPiece, POISON,
};
use zero_core::optim::{sum_squares, AdamWParams, AdamWSlices, AdamWStep, CpuAdamW, NORM_CHUNK};
use zero_core::{bf16, f16, Element, Error, HostBuffer, Result};

use Stream::{Comm, Compute, DeviceToHost as D2h, HostToDevice as H2d};

/// xorshift64*: deterministic inputs without a `rand` dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Values over several binades, both signs, so that conversions round.
    fn value(&mut self) -> f32 {
        let m = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        let e = (self.next_u64() % 9) as i32 - 4;
        m * 2f32.powi(e)
    }
    fn vec<T: Element>(&mut self, n: usize) -> Vec<T> {
        (0..n).map(|_| T::from_f32(self.value())).collect()
    }
}

/// Every CPU mode: the conformance suite must hold on each.
fn modes() -> Vec<CpuMode> {
    vec![
        CpuMode::Inline,
        CpuMode::Checked,
        CpuMode::Chaos { seed: 1 },
        CpuMode::Chaos { seed: 2 },
    ]
}

fn each_mode(f: impl Fn(&CpuBackend)) {
    for mode in modes() {
        let dev = CpuBackend::with_adamw(mode, CpuAdamW::new().with_threads(2)).unwrap();
        f(&dev);
        dev.sync_all().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
    }
}

// ---------------------------------------------------------------------------
// Generic helpers: only the trait.
// ---------------------------------------------------------------------------

/// `data` in a new device buffer, uploaded on the h2d stream; compute waits
/// for the upload.
fn upload<B: Backend, T: Element>(dev: &B, data: &[T], label: &str) -> Result<B::Buffer<T>> {
    let mut host = dev.alloc_host::<T>(data.len(), label)?;
    dev.write_host(&mut host, 0..data.len())?
        .copy_from_slice(data);
    let mut buf = dev.alloc::<T>(data.len(), label)?;
    dev.copy_h2d(H2d, &host, 0, &mut buf, 0, data.len())?;
    let up = dev.record(H2d)?;
    dev.wait(Compute, &up)?;
    // The host buffer is dropped here: the host must first know the copy
    // finished reading it.
    dev.sync(&up)?;
    Ok(buf)
}

/// The contents of `buf` after everything enqueued on compute.
fn download<B: Backend, T: Element>(dev: &B, buf: &B::Buffer<T>) -> Result<Vec<T>> {
    let n = buf.len();
    let computed = dev.record(Compute)?;
    dev.wait(D2h, &computed)?;
    let mut host = dev.alloc_host::<T>(n, "download")?;
    dev.copy_d2h(D2h, buf, 0, &mut host, 0, n)?;
    let done = dev.record(D2h)?;
    dev.sync(&done)?;
    Ok(dev.read_host(&host, 0..n)?.to_vec())
}

fn bits<T: Element>(x: &[T]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

/// The host computation of `cast`: `D(f32(s))`, or `D(f32(d) + f32(s))`.
fn host_cast<S: Element, D: Element>(src: &[S], dst: &mut [D], accumulate: bool) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = if accumulate {
            D::from_f32(d.to_f32() + s.to_f32())
        } else {
            D::from_f32(s.to_f32())
        };
    }
}

// ---------------------------------------------------------------------------
// Conformance: generic over the backend.
// ---------------------------------------------------------------------------

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
        host_cast(&src[3..203], &mut want[5..205], accumulate);
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
    host_cast(&g0[..20], &mut want[0..20], false);
    host_cast(&g0[20..], &mut want[40..60], false);
    host_cast(&g1[..12], &mut want[20..32], false);
    host_cast(&g1[12..], &mut want[60..72], false);
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
        host_cast(&want[40..60], &mut w0[..], accumulate);
        host_cast(&want[60..70], &mut w1[2..12], accumulate);
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

fn bad_ranges_are_errors<B: Backend>(dev: &B) -> Result<()> {
    let b = dev.alloc::<f32>(8, "b")?;
    let mut bucket = dev.alloc::<f32>(8, "bucket")?;
    let e = dev
        .pack(
            Compute,
            &[PackPiece::<B, f32> {
                src: &b,
                src_at: 4,
                dst_at: 0,
                len: 5,
            }],
            &mut bucket,
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidSize { op: "pack", .. }), "{e}");
    let e = dev.sum_squares(Compute, &[(&b, 7..9)]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidSize {
                op: "sum_squares",
                ..
            }
        ),
        "{e}"
    );
    let mut host = dev.alloc_host::<f32>(4, "h")?;
    assert!(dev.read_host(&host, 2..5).is_err());
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 5..4;
    assert!(dev.write_host(&mut host, backwards).is_err());
    Ok(())
}

#[test]
fn conformance_on_every_cpu_mode() {
    each_mode(|dev| {
        let mode = dev.mode();
        copies_move_the_ranges(dev).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        cast_every_dtype_pair(dev).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        fill_sets_the_range(dev).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        sum_squares_is_the_reference(dev).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        adamw_is_cpu_adamw(dev).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        adamw_rejects_bad_parts(dev).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        pack_unpack_every_dtype_pair(dev).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        bad_ranges_are_errors(dev).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
    });
}

// ---------------------------------------------------------------------------
// The hazard checker.
// ---------------------------------------------------------------------------

/// Gradients packed on compute into "bucket 0", the bucket then read on the
/// communication stream; with `wait` the comm stream waits for the pack.
fn bucket_program(dev: &CpuBackend, wait: bool) -> Result<Vec<f32>> {
    let grads: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    let g = upload(dev, &grads, "grads")?;
    let mut bucket = dev.alloc::<f32>(64, "bucket 0")?;
    let mut out = dev.alloc::<f32>(64, "reduced")?;
    dev.pack(
        Compute,
        &[PackPiece {
            src: &g,
            src_at: 0,
            dst_at: 0,
            len: 64,
        }],
        &mut bucket,
    )?;
    if wait {
        let packed = dev.record(Compute)?;
        dev.wait(Comm, &packed)?;
    }
    dev.cast(Comm, &bucket, 0, &mut out, 0, 64, false)?;
    let reduced = dev.record(Comm)?;
    dev.wait(Compute, &reduced)?;
    let v = download(dev, &out)?;
    dev.sync_all()?;
    Ok(v)
}

fn assert_missing_wait(e: &Error) {
    match e {
        Error::Hazard(h) => {
            let Hazard {
                buffer,
                range,
                op,
                agent,
                access,
                other_op,
                other_agent,
                other_access,
                other_range,
                ..
            } = &**h;
            assert_eq!(buffer, "bucket 0");
            assert_eq!(*range, 0..64);
            assert_eq!(
                (*op, *agent, *access),
                ("cast", Agent::Stream(Comm), AccessKind::Read)
            );
            assert_eq!(
                (*other_op, *other_agent, *other_access),
                ("pack", Agent::Stream(Compute), AccessKind::Write)
            );
            assert_eq!(*other_range, 0..64);
        }
        other => panic!("expected a hazard, got {other}"),
    }
    let msg = e.to_string();
    assert!(
        msg.starts_with("hazard on buffer \"bucket 0\" (#")
            && msg.ends_with(
                "[0..64): cast on comm reads while pack on compute (not waited for) writes [0..64)"
            ),
        "{msg}"
    );
}

/// After the refused program returned early, its buffers were dropped
/// while the pack (never synced) still wrote the bucket: the next call
/// reports that, once; then the backend is usable again.
fn assert_early_drop_reported(dev: &CpuBackend) {
    let e = dev.sync_all().unwrap_err();
    assert!(
        e.to_string()
            .contains("drop on host writes while pack on compute (not synced) writes"),
        "{e}"
    );
    dev.sync_all().unwrap();
}

#[test]
fn a_missing_wait_fails_in_checked_mode_and_on_every_chaos_seed() {
    let want: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    let dev = CpuBackend::new(CpuMode::Checked).unwrap();
    assert_missing_wait(&bucket_program(&dev, false).unwrap_err());
    assert_early_drop_reported(&dev);
    assert_eq!(bucket_program(&dev, true).unwrap(), want);
    for seed in 0..100 {
        let dev = CpuBackend::new(CpuMode::Chaos { seed }).unwrap();
        assert_missing_wait(&bucket_program(&dev, false).unwrap_err());
        assert_early_drop_reported(&dev);
        // The refused operation did not run, and the backend goes on.
        assert_eq!(bucket_program(&dev, true).unwrap(), want, "seed {seed}");
    }
}

#[test]
fn inline_mode_checks_nothing_and_is_the_default() {
    assert_eq!(CpuMode::default(), CpuMode::Inline);
    let dev = CpuBackend::new(CpuMode::Inline).unwrap();
    let want: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    // Inline runs in call order, so the unordered program computes the
    // right numbers: nothing is checked.
    assert_eq!(bucket_program(&dev, false).unwrap(), want);
    let mut b = dev.alloc::<f32>(4, "b").unwrap();
    dev.fill(Compute, &mut b, 0..4, 1.0).unwrap();
    assert_eq!(dev.host_slice(&b, 0..4).unwrap(), &[1.0; 4]);
}

fn checked_modes() -> Vec<CpuBackend> {
    [CpuMode::Checked, CpuMode::Chaos { seed: 3 }]
        .into_iter()
        .map(|m| CpuBackend::new(m).unwrap())
        .collect()
}

#[test]
fn reading_host_memory_before_sync_is_a_hazard() {
    for dev in checked_modes() {
        let src = upload(&dev, &[1.0f32, 2.0, 3.0], "src").unwrap();
        let mut host = dev.alloc_host::<f32>(3, "staging").unwrap();
        let computed = dev.record(Compute).unwrap();
        dev.wait(D2h, &computed).unwrap();
        dev.copy_d2h(D2h, &src, 0, &mut host, 0, 3).unwrap();
        let copied = dev.record(D2h).unwrap();
        let e = dev.read_host(&host, 1..2).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("\"staging\"")
                && msg.contains("[1..2): read_host on host reads while copy_d2h on d2h (not synced) writes [0..3)"),
            "{msg}"
        );
        // A stream waiting is not the host knowing.
        dev.wait(Compute, &copied).unwrap();
        assert!(matches!(dev.host_slice(&host, 0..3), Err(Error::Hazard(_))));
        dev.sync(&copied).unwrap();
        assert_eq!(dev.read_host(&host, 0..3).unwrap(), &[1.0, 2.0, 3.0]);
        // Sum-of-squares results are host reads too.
        let x = dev.sum_squares(Compute, &[(&src, 0..3)]).unwrap();
        let e = dev.read_scalars(&x).unwrap_err();
        assert!(
            e.to_string()
                .contains("read_scalars on host reads while sum_squares on compute"),
            "{e}"
        );
        let done = dev.record(Compute).unwrap();
        dev.sync(&done).unwrap();
        assert_eq!(dev.read_scalars(&x).unwrap(), vec![14.0]);
    }
}

#[test]
fn disjoint_ranges_and_read_read_never_conflict() {
    for dev in checked_modes() {
        let src = upload(&dev, &[1.0f32; 64], "src").unwrap();
        let mut b = dev.alloc::<f32>(64, "b").unwrap();
        let mut c = dev.alloc::<f32>(64, "c").unwrap();
        let mut d = dev.alloc::<f32>(64, "d").unwrap();
        let ready = dev.record(Compute).unwrap();
        for s in [Comm, H2d, D2h] {
            dev.wait(s, &ready).unwrap();
        }
        // Disjoint writes on four streams.
        dev.fill(Compute, &mut b, 0..16, 1.0).unwrap();
        dev.fill(Comm, &mut b, 16..32, 2.0).unwrap();
        dev.fill(H2d, &mut b, 32..48, 3.0).unwrap();
        dev.fill(D2h, &mut b, 48..64, 4.0).unwrap();
        // Reads of one range on four streams.
        dev.copy_d2d(Compute, &src, 0, &mut c, 0, 64).unwrap();
        dev.copy_d2d(Comm, &src, 0, &mut d, 0, 64).unwrap();
        let x = dev.sum_squares(H2d, &[(&src, 0..64)]).unwrap();
        // But an overlapping write on another stream is refused.
        let e = dev.fill(Comm, &mut b, 15..17, 0.0).unwrap_err();
        assert!(e.to_string().contains("[15..17): fill on comm writes while fill on compute (not waited for) writes [0..16)"), "{e}");
        dev.sync_all().unwrap();
        let want: Vec<f32> = (0..64).map(|i| (i / 16 + 1) as f32).collect();
        assert_eq!(dev.host_slice(&b, 0..64).unwrap(), &want[..]);
        assert_eq!(dev.read_scalars(&x).unwrap(), vec![64.0]);
    }
}

#[test]
fn lent_memory_keeps_its_id_and_its_order() {
    for dev in checked_modes() {
        let mut b = upload(&dev, &[1.0f32; 8], "bucket 3").unwrap();
        let id = b.id();
        dev.fill(Compute, &mut b, 0..4, 2.0).unwrap();
        // Lending on comm without waiting for the fill is refused (and the
        // buffer released).
        let e = dev
            .lend(Comm, "all_reduce", b, &[(0..8, AccessKind::Write)])
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("all_reduce on comm writes while fill on compute"),
            "{e}"
        );
        let mut b = upload(&dev, &[1.0f32; 8], "bucket 3").unwrap();
        let id2 = b.id();
        assert_ne!(id, id2);
        dev.fill(Compute, &mut b, 0..4, 2.0).unwrap();
        let filled = dev.record(Compute).unwrap();
        dev.wait(Comm, &filled).unwrap();
        let (loan, mut host) = dev
            .lend(Comm, "all_reduce", b, &[(0..8, AccessKind::Write)])
            .unwrap();
        assert_eq!(loan.id(), id2);
        // Host code (a collective) owns the memory now.
        assert_eq!(&host[..], &[2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]);
        for x in host.iter_mut() {
            *x *= 10.0;
        }
        let (mut b, done) = dev.give_back(loan, host).unwrap();
        assert_eq!((b.id(), b.label()), (id2, "bucket 3"));
        // Using it on compute needs the loan's event.
        let e = dev.fill(Compute, &mut b, 0..1, 0.0).unwrap_err();
        assert!(
            e.to_string().contains(
                "fill on compute writes while all_reduce on comm (not waited for) writes [0..8)"
            ),
            "{e}"
        );
        dev.wait(Compute, &done).unwrap();
        dev.fill(Compute, &mut b, 0..1, 0.0).unwrap();
        assert_eq!(
            download(&dev, &b).unwrap(),
            [0.0, 20.0, 20.0, 20.0, 10.0, 10.0, 10.0, 10.0]
        );
        // A loan whose memory never comes back ends the buffer.
        let (loan, host) = dev
            .lend(Comm, "all_reduce", b, &[(0..8, AccessKind::Write)])
            .unwrap();
        drop(host);
        drop(loan);
        dev.sync_all().unwrap();
        // give_back with too little memory is an error.
        let b = dev.alloc::<f32>(8, "b").unwrap();
        let (loan, _) = dev.lend(Comm, "x", b, &[]).unwrap();
        let e = dev
            .give_back(loan, HostBuffer::zeros(4).unwrap())
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidSize {
                    op: "give_back",
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn memory_from_another_allocator_backs_buffers() {
    for mode in modes() {
        let dev = CpuBackend::new(mode).unwrap();
        let b = dev
            .alloc_with::<bf16, Error>(5, "shared", |n| {
                HostBuffer::from_fn(n, |i| bf16::from_f32(i as f32))
            })
            .unwrap();
        assert_eq!(dev.host_slice(&b, 0..5).unwrap()[4], bf16::from_f32(4.0));
        let e = dev
            .alloc_with::<bf16, Error>(5, "short", |_| HostBuffer::zeros(4))
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidSize {
                    op: "alloc_with",
                    ..
                }
            ),
            "{e}"
        );
        let mut host = dev.into_host(b).unwrap();
        host[0] = bf16::ONE;
        let mut w = dev.wrap(host, "wrapped").unwrap();
        dev.host_slice_mut(&mut w, 1..2).unwrap()[0] = bf16::ONE;
        dev.prefault(&mut w).unwrap();
        assert_eq!(dev.host_slice(&w, 0..2).unwrap(), &[bf16::ONE; 2]);
    }
}

#[test]
fn buffers_and_events_of_another_backend_are_refused() {
    let dev = CpuBackend::new(CpuMode::Checked).unwrap();
    let other = CpuBackend::new(CpuMode::Checked).unwrap();
    let foreign = other.alloc::<f32>(4, "foreign").unwrap();
    let mut mine = dev.alloc::<f32>(4, "mine").unwrap();
    let e = dev
        .copy_d2d(Compute, &foreign, 0, &mut mine, 0, 4)
        .unwrap_err();
    assert!(
        matches!(e, Error::Backend { .. }) && e.to_string().contains("foreign"),
        "{e}"
    );
    let ev = other.record(Compute).unwrap();
    assert!(matches!(
        dev.wait(Comm, &ev),
        Err(Error::Backend { op: "wait", .. })
    ));
    assert!(matches!(
        dev.host_slice(&foreign, 0..1),
        Err(Error::Backend { .. })
    ));
}

#[test]
fn a_drop_while_in_use_is_reported_by_the_next_call() {
    for dev in checked_modes() {
        let src = upload(&dev, &[3.0f32; 1000], "src").unwrap();
        let mut dst = dev.alloc::<f32>(1000, "dst").unwrap();
        let src_id = src.id();
        dev.copy_d2d(Compute, &src, 0, &mut dst, 0, 1000).unwrap();
        // Dropped while the copy (not synced) may still read it.
        drop(src);
        let e = dev.record(Comm).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("\"src\" ({src_id}) [0..1000): drop on host writes while copy_d2d on compute (not synced) reads [0..1000)")),
            "{msg}"
        );
        // Reported once; the copy still saw the data (Chaos: the memory
        // was freed only after the queues passed the drop).
        dev.sync_all().unwrap();
        assert_eq!(dev.host_slice(&dst, 0..1000).unwrap(), &[3.0; 1000][..]);
    }
}

// ---------------------------------------------------------------------------
// Chaos mode.
// ---------------------------------------------------------------------------

/// A correctly ordered multi-stream step: upload, pack on compute, a
/// "collective" on comm (host code on lent memory), unpack with
/// accumulation, the norm, AdamW with a bf16 copy, download. Returns the
/// parameters, the master weights and the norm.
fn ordered_step(dev: &CpuBackend) -> Result<(Vec<bf16>, Vec<f32>, f64)> {
    let mut rng = Rng(21);
    let n = 3000;
    let g0: Vec<bf16> = rng.vec(n);
    let g1: Vec<bf16> = rng.vec(n);
    let master: Vec<f32> = rng.vec(2 * n);
    let (b0, b1) = (upload(dev, &g0, "grad 0")?, upload(dev, &g1, "grad 1")?);
    let mut dm = upload(dev, &master, "master")?;
    let (mut m, mut v) = (dev.alloc::<f32>(2 * n, "m")?, dev.alloc::<f32>(2 * n, "v")?);
    let mut acc = upload(dev, &rng.vec::<f32>(2 * n), "acc")?;
    let mut params = dev.alloc::<bf16>(2 * n, "params")?;
    let mut bucket = dev.alloc::<f32>(2 * n, "bucket 0")?;
    for step in 1..=3u64 {
        dev.pack(
            Compute,
            &[
                PackPiece {
                    src: &b0,
                    src_at: 0,
                    dst_at: 0,
                    len: n,
                },
                PackPiece {
                    src: &b1,
                    src_at: 0,
                    dst_at: n,
                    len: n,
                },
            ],
            &mut bucket,
        )?;
        let packed = dev.record(Compute)?;
        dev.wait(Comm, &packed)?;
        let (loan, mut host) =
            dev.lend(Comm, "all_reduce", bucket, &[(0..2 * n, AccessKind::Write)])?;
        for x in host.iter_mut() {
            *x = *x * 2.0 + 0.25;
        }
        let (b, reduced) = dev.give_back(loan, host)?;
        bucket = b;
        dev.wait(Compute, &reduced)?;
        dev.unpack(
            Compute,
            &bucket,
            &mut [UnpackPiece {
                dst: &mut acc,
                dst_at: 0,
                src_at: 0,
                len: 2 * n,
            }],
            true,
        )?;
        let norm = dev.sum_squares(Compute, &[(&acc, 0..n), (&acc, n..2 * n)])?;
        let k = AdamWStep::new(&AdamWParams::torch_default(), 1e-3, step, 0.5);
        dev.adamw(
            Compute,
            &k,
            vec![AdamWPart {
                master: &mut dm,
                m: &mut m,
                v: &mut v,
                state: 0..2 * n,
                grad: &acc,
                grad_at: 0,
                low: Some((&mut params, 0)),
            }],
        )?;
        let done = dev.record(Compute)?;
        dev.sync(&done)?;
        let _ = dev.read_scalars(&norm)?;
    }
    let norm = dev.sum_squares(Compute, &[(&acc, 0..2 * n)])?;
    let p = download(dev, &params)?;
    let w = download(dev, &dm)?;
    Ok((p, w, dev.read_scalars(&norm)?[0]))
}

#[test]
fn chaos_gives_the_numbers_of_inline_on_every_seed() {
    let (p, w, norm) = ordered_step(&CpuBackend::new(CpuMode::Inline).unwrap()).unwrap();
    for seed in 0..20 {
        let dev = CpuBackend::new(CpuMode::Chaos { seed }).unwrap();
        let (p2, w2, norm2) = ordered_step(&dev).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(bits(&p2), bits(&p), "seed {seed}");
        assert_eq!(bits(&w2), bits(&w), "seed {seed}");
        assert_eq!(norm2.to_bits(), norm.to_bits(), "seed {seed}");
    }
    let (p3, _, _) = ordered_step(&CpuBackend::new(CpuMode::Checked).unwrap()).unwrap();
    assert_eq!(bits(&p3), bits(&p));
}

#[test]
fn chaos_poisons_freed_memory() {
    let dev = CpuBackend::new(CpuMode::Chaos { seed: 5 }).unwrap();
    let mut b = dev.alloc::<bf16>(100, "freed").unwrap();
    let id = b.id();
    dev.fill(Compute, &mut b, 0..100, bf16::ONE).unwrap();
    let done = dev.record(Compute).unwrap();
    dev.sync(&done).unwrap();
    drop(b);
    dev.sync_all().unwrap();
    let bytes = dev
        .quarantined(id)
        .expect("the freed buffer is quarantined");
    assert_eq!(bytes.len(), 200);
    assert!(bytes.iter().all(|&x| x == POISON));
    let poisoned: bf16 = bytemuck::pod_read_unaligned(&bytes[..2]);
    assert!(poisoned.is_nan());
    // The other modes keep nothing.
    let dev = CpuBackend::new(CpuMode::Checked).unwrap();
    let b = dev.alloc::<f32>(4, "x").unwrap();
    let id = b.id();
    drop(b);
    assert_eq!(dev.quarantined(id), None);
}

#[test]
fn chaos_runs_streams_concurrently() {
    // A stream waiting for an event blocks only itself: the host and the
    // other streams go on, and results arrive once the event's work ran.
    let dev = CpuBackend::new(CpuMode::Chaos { seed: 9 }).unwrap();
    let mut a = dev.alloc::<f32>(1 << 16, "a").unwrap();
    let mut b = dev.alloc::<f32>(1 << 16, "b").unwrap();
    for i in 0..50 {
        dev.fill(Compute, &mut a, 0..1 << 16, i as f32).unwrap();
    }
    let filled = dev.record(Compute).unwrap();
    dev.wait(Comm, &filled).unwrap();
    dev.copy_d2d(Comm, &a, 0, &mut b, 0, 1 << 16).unwrap();
    let copied = dev.record(Comm).unwrap();
    dev.sync(&copied).unwrap();
    assert!(dev
        .host_slice(&b, 0..1 << 16)
        .unwrap()
        .iter()
        .all(|&x| x == 49.0));
}
