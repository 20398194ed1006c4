//! The CPU backend's own checks (`zero_core::backend`); what every backend
//! must do is in `backend_conformance.rs`.
//!
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
use zero_core::optim::{AdamWParams, AdamWStep};
use zero_core::{bf16, Error, HostBuffer, Result};

use zero_testkit::backend::{bits, download, upload};
use zero_testkit::rng::Rng;
use Stream::{Comm, Compute, DeviceToHost as D2h, HostToDevice as H2d};

/// Every CPU mode.
fn modes() -> Vec<CpuMode> {
    vec![
        CpuMode::Inline,
        CpuMode::Checked,
        CpuMode::Chaos { seed: 1 },
        CpuMode::Chaos { seed: 2 },
    ]
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

/// `alloc_on` and `release_on` order a buffer by one stream: another
/// stream must wait for its zeroing before it reads it, and for its last
/// access to be ordered before the release; both are hazards otherwise.
#[test]
fn buffers_of_one_stream_are_ordered_by_it() {
    for dev in checked_modes() {
        let mut a = dev.alloc_on::<f32>(Compute, 16, "a").unwrap();
        let mut b = dev.alloc::<f32>(16, "b").unwrap();
        let e = dev.copy_d2d(Comm, &a, 0, &mut b, 0, 16).unwrap_err();
        assert!(e.to_string().contains("fill on compute"), "{e}");
        let ev = dev.record(Compute).unwrap();
        dev.wait(Comm, &ev).unwrap();
        dev.copy_d2d(Comm, &a, 0, &mut b, 0, 16).unwrap();
        dev.fill(Compute, &mut a, 0..16, 1.0).unwrap_err();
        // Released on compute while the comm read is not waited for.
        let ev = dev.record(Comm).unwrap();
        dev.release_on(Compute, a);
        let e = dev.record(Compute).unwrap_err();
        assert!(e.to_string().contains("release_on on compute"), "{e}");
        // With the wait, it is clean.
        let c = dev.alloc_on::<f32>(Compute, 16, "c").unwrap();
        dev.wait(Compute, &ev).unwrap();
        dev.copy_d2d(Compute, &c, 0, &mut b, 0, 16).unwrap();
        dev.release_on(Compute, c);
        dev.sync_all().unwrap();
        assert_eq!(dev.host_slice(&b, 0..16).unwrap(), &[0.0; 16][..]);
    }
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
