//! Streams, events, the buffer-reuse guard and pinned host buffers on a GPU.
//!
//! Every test needs CUDA device 0; without one it prints a skip line (on
//! stderr, past the harness's capture) and passes. The buffers are large
//! (64 MiB and more) so that a missing wait would show as wrong bytes: a
//! copy that overtook the one before it would read or write data that is
//! not there yet.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::time::Instant;

use cudarc::driver::result;
use half::bf16;
use zero_core::cuda::arena::{ArenaPlan, BufferRequest, DeviceArena, Phases};
use zero_core::cuda::stream::{PinnedHostBuffer, StreamKind, Streams};
use zero_core::memory::{Category, MemoryTracker, Tier};
use zero_core::{CudaDevice, Error};

use zero_testkit::kernel_checks;

/// Elements of the large test buffers (f32: 64 MiB).
const N: usize = 16 << 20;

/// Writes `line` to stderr in one write, past the harness's capture
/// (which only catches `print!`/`eprint!`), so that it shows.
fn note(line: &str) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// CUDA device 0, or `None` after a skip line.
fn gpu(test: &str) -> Option<CudaDevice> {
    kernel_checks::cuda_device_or_skip(test)
}

/// `a`, `b` and `c`: N f32 each; `bucket`/`tile` share a slot.
fn arena(streams: &Streams, tracker: &MemoryTracker) -> DeviceArena {
    let bytes = (N * 4) as u64;
    let plan = ArenaPlan::new(
        0,
        [
            BufferRequest::new("a", Category::Params, bytes),
            BufferRequest::new("b", Category::GatheredParams, bytes),
            BufferRequest::new("c", Category::Grads, bytes),
            BufferRequest::new("bucket", Category::CommBuffers, bytes)
                .live_in(Phases::BACKWARD)
                .share("scratch"),
            BufferRequest::new("tile", Category::CommBuffers, bytes)
                .live_in(Phases::STEP)
                .share("scratch"),
        ],
    )
    .unwrap();
    DeviceArena::new(streams, plan, tracker).unwrap()
}

fn pattern(seed: u32) -> Vec<f32> {
    (0..N as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as f32)
        .collect()
}

#[test]
fn round_trip_through_the_copy_and_compute_streams() {
    let Some(dev) = gpu("round_trip_through_the_copy_and_compute_streams") else {
        return;
    };
    let streams = Streams::new(&dev).unwrap();
    let tracker = MemoryTracker::new(0);
    let arena = arena(&streams, &tracker);
    let mut a = arena.take::<f32>("a").unwrap();
    let mut b = arena.take::<f32>("b").unwrap();
    let data = pattern(1);
    let mut src = PinnedHostBuffer::from_slice(streams.device(), &data).unwrap();
    let mut dst = PinnedHostBuffer::<f32>::zeros(streams.device(), N).unwrap();
    let _pinned = dst.account(&tracker, Category::CommBuffers);
    assert_eq!(tracker.tier_current(Tier::Host), (N * 4) as u64);

    // h2d -> compute -> d2h with no explicit synchronization: the guards
    // make each stream wait for the previous copy.
    let up = streams.copy_h2d(&mut src, &mut a).unwrap();
    assert_eq!(up.stream_kind(), StreamKind::HostToDevice);
    drop(up);
    let _ = streams
        .copy_d2d(StreamKind::Compute, &mut a, &mut b)
        .unwrap();
    streams.copy_d2h(&mut b, &mut dst).unwrap().wait().unwrap();
    assert!(dst.as_slice().unwrap() == &data[..]);

    // The same with explicit hand-offs and a fence, on the comm stream.
    let data2 = pattern(2);
    src.as_mut_slice().unwrap().copy_from_slice(&data2);
    let _ = streams.copy_h2d(&mut src, &mut a).unwrap();
    streams
        .hand_off(StreamKind::HostToDevice, StreamKind::Comm)
        .unwrap();
    let _ = streams.copy_d2d(StreamKind::Comm, &mut a, &mut b).unwrap();
    let fence = streams.fence(StreamKind::Comm).unwrap();
    fence.wait().unwrap();
    assert!(b.is_idle().unwrap());
    let mut back = vec![0f32; N];
    streams.download(&mut b, &mut back).unwrap();
    assert!(back == data2);
    streams.check_err().unwrap();
}

#[test]
fn pinned_and_pageable_copies_give_the_same_bytes() {
    let Some(dev) = gpu("pinned_and_pageable_copies_give_the_same_bytes") else {
        return;
    };
    let streams = Streams::new(&dev).unwrap();
    let arena = arena(&streams, &MemoryTracker::new(0));
    let mut a = arena.take::<f32>("a").unwrap();
    let mut b = arena.take::<f32>("b").unwrap();
    let data = pattern(3);

    let t = Instant::now();
    streams.upload(&data, &mut a).unwrap();
    let mut pageable = vec![0f32; N];
    streams.download(&mut a, &mut pageable).unwrap();
    let pageable_s = t.elapsed().as_secs_f64();

    let mut src = PinnedHostBuffer::from_slice(streams.device(), &data).unwrap();
    let mut dst = PinnedHostBuffer::<f32>::zeros(streams.device(), N).unwrap();
    let t = Instant::now();
    let _ = streams.copy_h2d(&mut src, &mut b).unwrap();
    streams.copy_d2h(&mut b, &mut dst).unwrap().wait().unwrap();
    let pinned_s = t.elapsed().as_secs_f64();

    assert!(pageable == data);
    assert!(dst.as_slice().unwrap() == &data[..]);
    let gb = 2.0 * (N * 4) as f64 / 1e9;
    note(&format!(
        "round trip of {} MiB: pageable {:.1} GB/s, pinned {:.1} GB/s",
        (N * 4) >> 20,
        gb / pageable_s,
        gb / pinned_s
    ));

    // bf16 through both paths.
    let half: Vec<bf16> = (0..1000).map(|i| bf16::from_f32(i as f32 * 0.25)).collect();
    let plan = ArenaPlan::new(0, [BufferRequest::new("h", Category::Params, 2000)]).unwrap();
    let small = DeviceArena::new(&streams, plan, &MemoryTracker::new(0)).unwrap();
    let mut h = small.take::<bf16>("h").unwrap();
    let mut pinned = PinnedHostBuffer::from_slice(streams.device(), &half).unwrap();
    let _ = streams.copy_h2d(&mut pinned, &mut h).unwrap();
    let mut back = vec![bf16::ZERO; 1000];
    streams.download(&mut h, &mut back).unwrap();
    assert_eq!(back, half);
}

#[test]
fn the_reuse_guard_orders_work_across_streams_and_the_host() {
    let Some(dev) = gpu("the_reuse_guard_orders_work_across_streams_and_the_host") else {
        return;
    };
    let streams = Streams::new(&dev).unwrap();
    let arena = arena(&streams, &MemoryTracker::new(0));
    let mut a = arena.take::<f32>("a").unwrap();
    let mut c = arena.take::<f32>("c").unwrap();
    let (p1, p2) = (pattern(11), pattern(12));
    let mut src = PinnedHostBuffer::from_slice(streams.device(), &p1).unwrap();
    let mut dst = PinnedHostBuffer::<f32>::zeros(streams.device(), N).unwrap();

    for _ in 0..3 {
        // Host write after read: overwriting the pinned source waits for the
        // upload that reads it, so `a` gets p1, not p2.
        src.as_mut_slice().unwrap().copy_from_slice(&p1);
        let _ = streams.copy_h2d(&mut src, &mut a).unwrap();
        src.as_mut_slice().unwrap().copy_from_slice(&p2);
        // Read after write across streams: d2h waits for the upload.
        let _ = streams.copy_d2h(&mut a, &mut dst).unwrap();
        // Write after read across streams: the next upload into `a` waits
        // for the download that reads it, so `dst` still gets p1.
        let _ = streams.copy_h2d(&mut src, &mut a).unwrap();
        assert!(dst.as_slice().unwrap() == &p1[..]);
        // And `a` ends with p2, moved on the comm stream into `c`.
        let _ = streams.copy_d2d(StreamKind::Comm, &mut a, &mut c).unwrap();
        let _ = streams.copy_d2h(&mut c, &mut dst).unwrap();
        assert!(dst.as_slice().unwrap() == &p2[..]);
    }

    // A use by raw work (a memset, standing in for a kernel) on the compute
    // stream waits for the upload before it and is waited for by the
    // download after it.
    let _ = streams.copy_h2d(&mut src, &mut a).unwrap();
    let compute = streams.compute().clone();
    let use_a = a.use_on(&compute).unwrap();
    // SAFETY: the pointer is valid for N f32 (4N bytes) in work on
    // `compute`, which waits for the upload; finish() records the memset.
    unsafe { result::memset_d8_async(use_a.device_ptr(), 0x3f, N * 4, compute.cu_stream()) }
        .unwrap();
    use_a.finish().unwrap();
    let _ = streams.copy_d2h(&mut a, &mut dst).unwrap();
    let expected = f32::from_bits(0x3f3f_3f3f);
    assert!(dst.as_slice().unwrap().iter().all(|&x| x == expected));

    // A slot handed from one buffer to the next: the tile's first use waits
    // for the bucket's last.
    let mut bucket = arena.take::<f32>("bucket").unwrap();
    src.as_mut_slice().unwrap().copy_from_slice(&p1);
    let _ = streams.copy_h2d(&mut src, &mut bucket).unwrap();
    drop(bucket);
    let mut tile = arena.take::<f32>("tile").unwrap();
    let _ = streams.copy_d2h(&mut tile, &mut dst).unwrap();
    assert!(dst.as_slice().unwrap() == &p1[..]);
    drop(tile);

    // Dropping buffers with copies in flight waits for them (no error, no
    // use after free).
    let mut doomed = PinnedHostBuffer::<f32>::zeros(streams.device(), N).unwrap();
    let _ = streams.copy_d2h(&mut a, &mut doomed).unwrap();
    drop(doomed);
    let _ = streams.copy_h2d(&mut src, &mut a).unwrap();
    drop(a);
    drop(c);
    drop(arena);
    streams.check_err().unwrap();
}

#[test]
fn mismatched_lengths_are_errors() {
    let Some(dev) = gpu("mismatched_lengths_are_errors") else {
        return;
    };
    let streams = Streams::new(&dev).unwrap();
    let arena = arena(&streams, &MemoryTracker::new(0));
    let mut a = arena.take::<f32>("a").unwrap();
    let mut short = PinnedHostBuffer::<f32>::zeros(streams.device(), 10).unwrap();
    let err = streams.copy_h2d(&mut short, &mut a).unwrap_err();
    assert!(matches!(err, Error::InvalidSize { .. }), "{err}");
    assert!(err.to_string().contains("`a`"), "{err}");
    // Shortening the device side makes them match.
    a.set_len(10).unwrap();
    streams
        .copy_d2h(&mut a, &mut short)
        .unwrap()
        .wait()
        .unwrap();
    assert!(a.set_len(N + 1).is_err());
    assert!(short.set_len(11).is_err());
    assert!(streams.upload(&[1.0f32; 3], &mut a).is_err());
}
