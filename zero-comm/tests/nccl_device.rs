//! Device collectives on the CUDA backend's buffers: NCCL on the
//! backend's communication stream ([`NcclComm::for_backend`]) and host
//! collectives through pinned staging buffers ([`HostStaged`], several
//! ranks on one GPU), each against the host communicator's own result on
//! the same data, through the generic [`Backend`] calls only (pinned
//! upload, collective, download).
//!
//! Without a GPU (or NCCL, for the NCCL tests) each test prints a
//! `skipped:` line and passes. The same test body runs on the CPU backend
//! everywhere (direct and staged), so the checks themselves are known to
//! hold before a GPU runs them.

#[cfg(feature = "cuda")]
use std::io::Write;
#[cfg(feature = "cuda")]
use std::time::Duration;

#[cfg(feature = "cuda")]
use zero_comm::nccl::{self, NcclError};
use zero_comm::{
    offsets, Communicator, DeviceCollectives, Error, HostStaged, ReduceOp, ThreadComm, ThreadGroup,
};
#[cfg(feature = "cuda")]
use zero_comm::{CommOptions, NcclComm};
#[cfg(feature = "cuda")]
use zero_core::backend::CudaBackend;
use zero_core::backend::{Backend, BufferHandle, CpuBackend, CpuMode, Stream};
use zero_core::{bf16, Element, HostBuffer};

#[cfg(feature = "cuda")]
fn skip(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "{test}: skipped: {why}");
}

#[cfg(feature = "cuda")]
fn backend(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            skip(test, &format!("no GPU ({e})"));
            None
        }
    }
}

#[cfg(feature = "cuda")]
fn nccl_present(test: &str) -> bool {
    match nccl::version() {
        Ok(_) => true,
        Err(e) => {
            let why = NcclError::find(&e).map_or(e.to_string(), |n| n.to_string());
            skip(test, &format!("NCCL is not available ({why})"));
            false
        }
    }
}

#[cfg(feature = "cuda")]
fn opts() -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(60))
}

fn input<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f32(((i * 7 + rank * 13) % 29) as f32 * 0.5 - 7.0))
        .collect()
}

fn bits<T: Element>(x: &[T]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

/// Uploads `data` into a new device buffer through a pinned buffer.
fn upload<B: Backend, T: Element>(
    dev: &B,
    data: &[T],
    label: &str,
) -> zero_core::Result<B::Buffer<T>> {
    let mut host = dev.alloc_host::<T>(data.len(), label)?;
    dev.write_host(&mut host, 0..data.len())?
        .copy_from_slice(data);
    let mut buf = dev.alloc::<T>(data.len(), label)?;
    dev.copy_h2d(Stream::HostToDevice, &host, 0, &mut buf, 0, data.len())?;
    let done = dev.record(Stream::HostToDevice)?;
    dev.sync(&done)?;
    Ok(buf)
}

/// Downloads `buf` after `ready` (the stream that copies waits for it).
fn download<B: Backend, T: Element>(
    dev: &B,
    buf: &B::Buffer<T>,
    ready: &B::Event,
) -> zero_core::Result<Vec<T>> {
    let mut host = dev.alloc_host::<T>(buf.len(), "download")?;
    dev.wait(Stream::DeviceToHost, ready)?;
    dev.copy_d2h(Stream::DeviceToHost, buf, 0, &mut host, 0, buf.len())?;
    let done = dev.record(Stream::DeviceToHost)?;
    dev.sync(&done)?;
    Ok(dev.read_host(&host, 0..buf.len())?.to_vec())
}

/// One rank: all-reduce of a prefix, reduce-scatter and all-gather in
/// place, each compared with `comm`'s host collective on the same data;
/// the buffer's tail (past the collectives) must be left alone.
fn rank_body<B: Backend, T: Element, D: DeviceCollectives<B>>(
    dev: &B,
    comm: &ThreadComm,
    dc: &D,
    shard: usize,
) -> Result<(), String> {
    let rank = comm.rank();
    let e = |what: &'static str| move |err: Error| format!("rank {rank}: {what}: {err}");
    let z = |what: &'static str| move |err: zero_core::Error| format!("rank {rank}: {what}: {err}");
    let world = comm.world_size();
    let counts = vec![shard; world];
    let total = shard * world;
    let data = input::<T>(comm.rank(), total + 5);
    let buf = upload(dev, &data, "bucket").map_err(z("upload"))?;
    let ready = dev.record(Stream::Compute).map_err(z("record"))?;

    let (buf, done) = dc
        .device_all_reduce(dev, buf, total, ReduceOp::Sum, &ready)
        .wait()
        .map_err(e("all_reduce"))?;
    dc.device_sync(dev, &done).map_err(e("device_sync"))?;
    let got = download(dev, &buf, &done).map_err(z("download"))?;
    let want = comm
        .all_reduce(
            HostBuffer::from_slice(&data[..total]).unwrap(),
            ReduceOp::Sum,
        )
        .wait()
        .map_err(e("host all_reduce"))?;
    assert_eq!(bits(&got[..total]), bits(&want), "all_reduce");
    assert_eq!(bits(&got[total..]), bits(&data[total..]), "all_reduce tail");

    let (buf, done) = dc
        .device_reduce_scatter(dev, buf, &counts, ReduceOp::Sum, &done)
        .wait()
        .map_err(e("reduce_scatter"))?;
    let scattered = download(dev, &buf, &done).map_err(z("download"))?;
    let want = comm
        .reduce_scatter_in_place(
            HostBuffer::from_slice(&got[..total]).unwrap(),
            &counts,
            ReduceOp::Sum,
        )
        .wait()
        .map_err(e("host reduce_scatter"))?;
    let own = offsets(&counts)[comm.rank()]..offsets(&counts)[comm.rank()] + shard;
    assert_eq!(
        bits(&scattered[own.clone()]),
        bits(&want[own.clone()]),
        "reduce_scatter"
    );

    let (buf, done) = dc
        .device_all_gather(dev, buf, &counts, &done)
        .wait()
        .map_err(e("all_gather"))?;
    let gathered = download(dev, &buf, &done).map_err(z("download"))?;
    let want = comm
        .all_gather_in_place(
            HostBuffer::from_slice(&scattered[..total]).unwrap(),
            &counts,
        )
        .wait()
        .map_err(e("host all_gather"))?;
    assert_eq!(bits(&gathered[..total]), bits(&want), "all_gather");
    assert_eq!(
        bits(&gathered[total..]),
        bits(&data[total..]),
        "all_gather tail"
    );
    dev.sync_all().map_err(z("sync_all"))?;
    Ok(())
}

/// The test body on the CPU backend, direct (the buffer lent to the host
/// collective) and staged, in the checked and chaos modes.
#[test]
fn the_test_body_holds_on_the_cpu_backend() {
    for mode in [CpuMode::Checked, CpuMode::Chaos { seed: 8 }] {
        for world in [1, 2, 3] {
            for r in ThreadGroup::run(world, |host| {
                let dev = CpuBackend::new(mode).map_err(|e| e.to_string())?;
                rank_body::<_, f32, _>(&dev, &host, &host, 100)?;
                rank_body::<_, bf16, _>(&dev, &host, &host, 37)?;
                let staged = HostStaged::new(host);
                rank_body::<_, f32, _>(&dev, staged.comm(), &staged, 100)?;
                rank_body::<_, bf16, _>(&dev, staged.comm(), &staged, 37)
            })
            .unwrap()
            {
                r.unwrap();
            }
        }
    }
}

/// NCCL on one GPU (world 1: one rank per GPU): the plumbing of raw views
/// on the backend's communication stream, its events and the bounded sync.
#[cfg(feature = "cuda")]
#[test]
fn nccl_device_collectives_give_what_the_host_gives() {
    const TEST: &str = "nccl_device_collectives_give_what_the_host_gives";
    let Some(dev) = backend(TEST) else { return };
    if !nccl_present(TEST) {
        return;
    }
    for r in ThreadGroup::run(1, |host| {
        let nccl = NcclComm::for_backend(&host, &dev, &opts()).map_err(|e| e.to_string())?;
        rank_body::<_, f32, _>(&dev, &host, &nccl, 1000)?;
        rank_body::<_, bf16, _>(&dev, &host, &nccl, 37)
    })
    .unwrap()
    {
        r.unwrap();
    }
}

/// A communicator on another stream than the backend's communication
/// stream would not be ordered by its events: refused, naming the fix.
#[cfg(feature = "cuda")]
#[test]
fn an_nccl_communicator_on_another_stream_is_refused() {
    const TEST: &str = "an_nccl_communicator_on_another_stream_is_refused";
    let Some(dev) = backend(TEST) else { return };
    if !nccl_present(TEST) {
        return;
    }
    let msg = ThreadGroup::run(1, |host| {
        let stream = dev.streams().device().context().new_stream().unwrap();
        let nccl =
            NcclComm::from_communicator(&host, dev.streams().device(), stream, &opts()).unwrap();
        let buf = dev.alloc::<f32>(8, "bucket").unwrap();
        let ev = dev.record(Stream::Compute).unwrap();
        nccl.device_all_reduce(&dev, buf, 8, ReduceOp::Sum, &ev)
            .wait()
            .unwrap_err()
            .to_string()
    })
    .unwrap()
    .remove(0);
    assert!(msg.contains("NcclComm::for_backend"), "{msg}");
}

/// Two ranks on one GPU through pinned staging buffers: what NCCL refuses
/// (before 2.30) runs through the host communicator.
#[cfg(feature = "cuda")]
#[test]
fn staged_collectives_run_two_ranks_on_one_gpu() {
    const TEST: &str = "staged_collectives_run_two_ranks_on_one_gpu";
    if backend(TEST).is_none() {
        return;
    }
    for world in [1, 2, 3] {
        for r in ThreadGroup::run(world, |host| {
            let dev = CudaBackend::new(0).map_err(|e| e.to_string())?;
            let staged = HostStaged::new(host);
            rank_body::<_, f32, _>(&dev, staged.comm(), &staged, 1000)?;
            rank_body::<_, bf16, _>(&dev, staged.comm(), &staged, 37)?;
            // The second round reused the first round's staging buffers.
            let held = staged.staging_bytes();
            rank_body::<_, f32, _>(&dev, staged.comm(), &staged, 1000)?;
            assert_eq!(staged.staging_bytes(), held, "staging grew on reuse");
            Ok::<(), String>(())
        })
        .unwrap()
        {
            r.unwrap();
        }
    }
}
