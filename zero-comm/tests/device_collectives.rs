//! Device collectives over the CPU backend (`DeviceCollectives` for every
//! host `Communicator`), on the threads backend with 1 to 4 ranks and every
//! CPU mode: all-reduce, reduce-scatter in place and all-gather in place
//! give exactly what the communicator gives on host buffers; the buffer
//! keeps its id; a use on another stream without waiting for the
//! collective's completion event, or a collective started before its data
//! was ready, is `Error::Hazard` (and the peers fail instead of waiting).
//!
//! Every test runs twice: on the direct path (the buffer's memory lent to
//! the host collective) and through [`HostStaged`] (copies into pinned
//! staging buffers and back, as several ranks on one GPU run), whose
//! device steps the same hazard checker sees.

use zero_comm::{
    offsets, Communicator, DeviceCollectives, Error, HostStaged, ReduceOp, ThreadComm, ThreadGroup,
};
use zero_core::backend::{Backend, BufferHandle, CpuBackend, CpuMode, Stream};
use zero_core::{bf16, Element, HostBuffer};

use Stream::{Comm, Compute};

// A handle can be waited on by another thread than the one that started it.
static_assertions::assert_impl_all!(zero_comm::DeviceWork<CpuBackend, f32>: Send);

fn modes() -> Vec<CpuMode> {
    vec![
        CpuMode::Inline,
        CpuMode::Checked,
        CpuMode::Chaos { seed: 0 },
        CpuMode::Chaos { seed: 1 },
    ]
}

/// Distinct, rounding-sensitive values per rank and element.
fn input<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f32(((i * 7 + rank * 13) % 29) as f32 * 0.37 - 4.1 + rank as f32 * 1e-3))
        .collect()
}

fn bits<T: Element>(x: &[T]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

/// The two ways of running device collectives on the CPU backend.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// The buffer's memory lent to the host collective.
    Direct,
    /// Through staging buffers ([`HostStaged`]).
    Staged,
}

const PATHS: [Path; 2] = [Path::Direct, Path::Staged];

/// Runs `body` on `world` thread ranks with the device collectives of
/// `path`: `body(comm, device_collectives)`.
macro_rules! on_ranks {
    ($world:expr, $path:expr, |$comm:ident, $dc:ident| $body:expr) => {
        ThreadGroup::run($world, |comm| match $path {
            Path::Direct => {
                let $comm = &comm;
                let $dc = &comm;
                $body
            }
            Path::Staged => {
                let staged = HostStaged::new(comm);
                let $comm = staged.comm();
                let $dc = &staged;
                $body
            }
        })
        .unwrap()
    };
}

/// One rank: every collective on a device buffer and, for comparison, on a
/// host buffer through the communicator itself. The device buffer is
/// longer than the collectives (a bucket filled to part of its capacity);
/// its tail must be left alone.
fn rank_body<T: Element, D: DeviceCollectives<CpuBackend>>(
    comm: &ThreadComm,
    dc: &D,
    dev: &CpuBackend,
) -> Result<(), String> {
    let mode = dev.mode();
    let ctx = |what: &str| {
        format!(
            "{mode:?} rank {} of {}: {what}",
            comm.rank(),
            comm.world_size()
        )
    };
    let world = comm.world_size();
    let counts: Vec<usize> = [3usize, 5, 0, 4][..world].to_vec();
    let total: usize = counts.iter().sum();
    let cap = total + 6;
    let data = input::<T>(comm.rank(), cap);

    let mut buf = dc
        .device_alloc::<T>(dev, cap, "bucket 0")
        .map_err(|e| e.to_string())?;
    let id = buf.id();
    dev.host_slice_mut(&mut buf, 0..cap)
        .map_err(|e| e.to_string())?
        .copy_from_slice(&data);
    let ready = dev.record(Compute).map_err(|e| e.to_string())?;

    // all_reduce of the first `total` elements.
    let (buf, done) = dc
        .device_all_reduce(dev, buf, total, ReduceOp::Sum, &ready)
        .wait()
        .map_err(|e| ctx(&e.to_string()))?;
    assert_eq!(buf.id(), id, "{}", ctx("id kept"));
    dev.sync(&done).map_err(|e| e.to_string())?;
    let want = comm
        .all_reduce(
            HostBuffer::from_slice(&data[..total]).unwrap(),
            ReduceOp::Sum,
        )
        .wait()
        .map_err(|e| e.to_string())?;
    let got = dev.host_slice(&buf, 0..cap).map_err(|e| e.to_string())?;
    assert_eq!(bits(&got[..total]), bits(&want), "{}", ctx("all_reduce"));
    assert_eq!(
        bits(&got[total..]),
        bits(&data[total..]),
        "{}",
        ctx("all_reduce tail")
    );
    let reduced = got.to_vec();

    // reduce_scatter in place, after an event on another stream.
    let ev = dev.record(Comm).map_err(|e| e.to_string())?;
    let (buf, done) = dc
        .device_reduce_scatter(dev, buf, &counts, ReduceOp::Sum, &ev)
        .wait()
        .map_err(|e| ctx(&e.to_string()))?;
    dev.sync(&done).map_err(|e| e.to_string())?;
    let want = comm
        .reduce_scatter_in_place(
            HostBuffer::from_slice(&reduced[..total]).unwrap(),
            &counts,
            ReduceOp::Sum,
        )
        .wait()
        .map_err(|e| e.to_string())?;
    let got = dev.host_slice(&buf, 0..cap).map_err(|e| e.to_string())?;
    assert_eq!(
        bits(&got[..total]),
        bits(&want),
        "{}",
        ctx("reduce_scatter")
    );
    assert_eq!(
        bits(&got[total..]),
        bits(&data[total..]),
        "{}",
        ctx("reduce_scatter tail")
    );
    let scattered = got.to_vec();

    // all_gather in place.
    let (buf, done) = dc
        .device_all_gather(dev, buf, &counts, &done)
        .wait()
        .map_err(|e| ctx(&e.to_string()))?;
    dev.sync(&done).map_err(|e| e.to_string())?;
    let want = comm
        .all_gather_in_place(
            HostBuffer::from_slice(&scattered[..total]).unwrap(),
            &counts,
        )
        .wait()
        .map_err(|e| e.to_string())?;
    let got = dev.host_slice(&buf, 0..cap).map_err(|e| e.to_string())?;
    assert_eq!(bits(&got[..total]), bits(&want), "{}", ctx("all_gather"));
    // This rank's part is the one it reduced.
    let own = offsets(&counts)[comm.rank()]..offsets(&counts)[comm.rank()] + counts[comm.rank()];
    assert_eq!(
        bits(&got[own.clone()]),
        bits(&scattered[own]),
        "{}",
        ctx("own part")
    );
    assert_eq!(
        bits(&got[total..]),
        bits(&data[total..]),
        "{}",
        ctx("all_gather tail")
    );
    dev.sync_all().map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn device_collectives_give_what_the_communicator_gives() {
    for path in PATHS {
        for world in 1..=4 {
            for mode in modes() {
                let results = on_ranks!(world, path, |comm, dc| {
                    let dev = CpuBackend::new(mode).map_err(|e| e.to_string())?;
                    rank_body::<f32, _>(comm, dc, &dev)?;
                    rank_body::<bf16, _>(comm, dc, &dev)
                });
                for r in results {
                    r.unwrap_or_else(|e| panic!("{path:?}: {e}"));
                }
            }
        }
    }
}

/// Staging buffers are allocated by the first collectives and reused by
/// every later one on the same backend: the second round allocates
/// nothing. Another backend's collectives never get them (its operations
/// would refuse them): they allocate their own.
#[test]
fn staged_collectives_reuse_their_staging_buffers() {
    for world in 1..=3 {
        let results = ThreadGroup::run(world, |comm| {
            let staged = HostStaged::new(comm);
            let dev = CpuBackend::new(CpuMode::Checked).unwrap();
            rank_body::<f32, _>(staged.comm(), &staged, &dev).unwrap();
            let first = staged.staging_bytes();
            rank_body::<f32, _>(staged.comm(), &staged, &dev).unwrap();
            let second = staged.staging_bytes();
            let other = CpuBackend::new(CpuMode::Chaos { seed: 3 }).unwrap();
            rank_body::<f32, _>(staged.comm(), &staged, &other).unwrap();
            (first, second, staged.staging_bytes())
        })
        .unwrap();
        // One collective in flight at a time: one buffer of the largest
        // collective (the sum of the counts, f32) per backend. One rank
        // stages nothing (its collectives' results are their inputs).
        let total: usize = [3usize, 5, 0, 4][..world].iter().sum();
        let total = if world == 1 { 0 } else { total };
        for r in results {
            assert_eq!(r, (total * 4, total * 4, 2 * total * 4), "world {world}");
        }
    }
}

#[test]
fn using_the_result_without_waiting_for_its_event_is_a_hazard() {
    for (path, writer) in PATHS.into_iter().zip(["all_reduce", "copy_h2d"]) {
        for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 4 }] {
            let results = on_ranks!(2, path, |comm, dc| {
                let dev = CpuBackend::new(mode).unwrap();
                let mut buf = dc.device_alloc::<f32>(&dev, 8, "bucket 1").unwrap();
                dev.fill(Compute, &mut buf, 0..8, comm.rank() as f32 + 1.0)
                    .unwrap();
                let filled = dev.record(Compute).unwrap();
                let (mut buf, done) = dc
                    .device_all_reduce(&dev, buf, 8, ReduceOp::Sum, &filled)
                    .wait()
                    .unwrap();
                // The host collective has finished, but compute has not
                // waited for its event: on a GPU the result may still be
                // on its way.
                let e = dev.fill(Compute, &mut buf, 0..1, 0.0).unwrap_err();
                let msg = e.to_string();
                let want = format!(
                    "[0..1): fill on compute writes while {writer} on comm (not waited for) writes [0..8)"
                );
                assert!(
                    msg.contains("\"bucket 1\"") && msg.contains(&want),
                    "{path:?}: {msg}"
                );
                // So is the host reading it without a sync.
                assert!(matches!(
                    dev.host_slice(&buf, 0..8),
                    Err(zero_core::Error::Hazard(_))
                ));
                dev.wait(Compute, &done).unwrap();
                dev.fill(Compute, &mut buf, 0..1, 0.0).unwrap();
                let end = dev.record(Compute).unwrap();
                dev.sync(&end).unwrap();
                dev.host_slice(&buf, 0..8).unwrap().to_vec()
            });
            for r in results {
                assert_eq!(r, [0.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0], "{path:?}");
            }
        }
    }
}

#[test]
fn a_collective_started_before_its_data_is_ready_fails_on_every_rank() {
    for (path, reader) in PATHS.into_iter().zip(["all_reduce", "copy_d2h"]) {
        for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 6 }] {
            let results = on_ranks!(2, path, |comm, dc| {
                let dev = CpuBackend::new(mode).unwrap();
                let mut buf = dc.device_alloc::<f32>(&dev, 8, "bucket 2").unwrap();
                let before = dev.record(Compute).unwrap();
                dev.fill(Compute, &mut buf, 0..8, 1.0).unwrap();
                // `before` does not cover the fill.
                let r = dc
                    .device_all_reduce(&dev, buf, 8, ReduceOp::Sum, &before)
                    .wait();
                (comm.rank(), r.map(|_| ()).unwrap_err())
            });
            for (rank, e) in results {
                match &e {
                    Error::Core(zero_core::Error::Hazard(h)) => {
                        assert_eq!(
                            (h.buffer.as_str(), h.op, h.other_op),
                            ("bucket 2", reader, "fill"),
                            "{path:?}"
                        );
                    }
                    other => panic!("{path:?} rank {rank}: expected a hazard, got {other}"),
                }
            }
        }
    }
}

#[test]
fn a_refused_rank_fails_its_peers_instead_of_hanging() {
    for path in PATHS {
        // Rank 1 asks for more elements than its buffer holds; rank 0 is fine.
        let results = on_ranks!(2, path, |comm, dc| {
            let dev = CpuBackend::new(CpuMode::Checked).unwrap();
            let buf = dc.device_alloc::<f32>(&dev, 8, "bucket").unwrap();
            let ev = dev.record(Compute).unwrap();
            let len = if comm.rank() == 1 { 9 } else { 8 };
            let r = dc
                .device_all_reduce(&dev, buf, len, ReduceOp::Sum, &ev)
                .wait();
            r.map(|_| ()).unwrap_err().to_string()
        });
        assert!(
            results[1].contains("buffer \"bucket\"")
                && results[1].contains("has 8 elements, the collective needs 9"),
            "{path:?}: {}",
            results[1]
        );
        assert!(results[0].contains("rank 1"), "{path:?}: {}", results[0]);
    }
}

#[test]
fn dropping_a_device_work_keeps_the_communicator_in_step() {
    for path in PATHS {
        let results = on_ranks!(3, path, |comm, dc| {
            let dev = CpuBackend::new(CpuMode::Chaos { seed: 2 }).unwrap();
            let buf = dc.device_alloc::<f32>(&dev, 4, "dropped").unwrap();
            let ev = dev.record(Compute).unwrap();
            drop(dc.device_all_reduce(&dev, buf, 4, ReduceOp::Sum, &ev));
            let mut b = dc.device_alloc::<f32>(&dev, 4, "next").unwrap();
            dev.fill(Compute, &mut b, 0..4, 2.0).unwrap();
            let ev = dev.record(Compute).unwrap();
            let (b, done) = dc
                .device_all_reduce(&dev, b, 4, ReduceOp::Sum, &ev)
                .wait()
                .unwrap();
            dev.sync(&done).unwrap();
            let _ = comm;
            dev.host_slice(&b, 0..4).unwrap().to_vec()
        });
        assert!(results.iter().all(|r| r == &[6.0; 4]), "{path:?}");
    }
}
