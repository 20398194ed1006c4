//! The NCCL backend on real GPUs, against [`reference_reduce`], and its
//! failure paths: a missing library, a rank that never joins, a rank that
//! never calls, mismatched collectives, bad arguments.
//!
//! NCCL runs one rank of a communicator per GPU (two ranks on one GPU are
//! refused, see `zero_comm::nccl`), so on a machine with one GPU the
//! collective tests run with world size 1, and with world size = number of
//! GPUs where there are several. With NCCL ≥ 2.30 and
//! `NCCL_MULTI_RANK_GPU_ENABLE=1` in the environment, two ranks share a GPU
//! and the two-rank tests run on one GPU too.
//!
//! Without NCCL or a GPU every GPU test prints a `skipped:` line and
//! passes; the missing-library test runs exactly there.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DeviceRepr, ValidAsZeroBits};
use zero_comm::nccl::{self, NcclError, NcclFailure};
use zero_comm::{
    reference_reduce, CommOptions, Error, NcclComm, NcclGroup, NcclId, ReduceOp, ThreadGroup,
};
use zero_core::{bf16, f16, CudaDevice, DType, Element};

// The handles cross threads as the engine needs: a communicator is shared
// by a rank's compute and prefetch threads; a handle may be waited for by
// another thread than the one that launched it.
static_assertions::assert_impl_all!(NcclComm: Send, Sync);
static_assertions::assert_impl_all!(NcclGroup: Send, Sync);
static_assertions::assert_impl_all!(NcclId: Send, Sync, Copy);
static_assertions::assert_impl_all!(zero_comm::nccl::NcclWork<'static>: Send, Sync);
static_assertions::assert_impl_all!(zero_comm::nccl::NcclBatch<'static>: Send);
static_assertions::assert_impl_all!(NcclError: Send, Sync, std::error::Error);

/// Prints a line that libtest does not capture (`eprintln!` output of a
/// passing test is hidden).
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

fn skip(test: &str, why: &str) {
    say(&format!("{test}: skipped: {why}"));
}

/// Bound on the wall time of every test that expects a failure.
const BOUND: Duration = Duration::from_secs(60);

fn opts(timeout_s: u64) -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(timeout_s))
}

/// `world` devices for the ranks of a group (one GPU each; GPU 0 twice
/// when NCCL allows sharing), or a visible skip.
fn devices(test: &str, world: usize) -> Option<Vec<CudaDevice>> {
    let version = match nccl::version() {
        Ok(v) => v,
        Err(e) => {
            let why = match NcclError::find(&e).map(|n| &n.failure) {
                Some(NcclFailure::Missing { .. }) => "libnccl.so not found".to_string(),
                _ => e.to_string(),
            };
            skip(test, &format!("NCCL is not available ({why})"));
            return None;
        }
    };
    if let Err(e) = CudaDevice::new(0) {
        skip(test, &format!("no CUDA device ({e})"));
        return None;
    }
    let gpus = CudaContext::device_count().unwrap_or(1).max(1) as usize;
    let shared = version >= 23_000
        && std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1");
    let ordinals: Vec<usize> = if gpus >= world {
        (0..world).collect()
    } else if shared && world <= 2 * gpus {
        (0..world).map(|r| r % gpus).collect()
    } else {
        skip(
            test,
            &format!(
                "needs {world} GPUs, found {gpus}: NCCL runs one rank per GPU (NCCL >= 2.30 \
                 with NCCL_MULTI_RANK_GPU_ENABLE=1 lets two ranks share one)"
            ),
        );
        return None;
    };
    Some(
        ordinals
            .into_iter()
            .map(|o| CudaDevice::new(o).expect("open a GPU"))
            .collect(),
    )
}

/// Rank `rank`'s input: halves in [-4, 4], so that every sum over up to 16
/// ranks is exact in bf16 and f16 and the order NCCL adds in cannot matter.
fn input<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f32(((i * 7 + rank * 13) % 17) as f32 * 0.5 - 4.0))
        .collect()
}

#[track_caller]
fn assert_matches<T: Element>(got: &[T], want: &[T], exact: bool, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let tol = match T::DTYPE {
        DType::F32 => 1e-6,
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f32(), w.to_f32());
        let ok = if exact {
            g.to_bits() == w.to_bits()
        } else {
            (g - w).abs() <= tol * w.abs().max(1.0)
        };
        assert!(ok, "{what}: element {i} is {g}, expected {w}");
    }
}

/// Every collective of `comm` on T, against the reference. The buffers
/// are written and read on `compute`, another stream than the
/// communicator's, so cudarc's stream ordering is exercised too.
fn check_collectives<T: Element + DeviceRepr + ValidAsZeroBits>(
    comm: &NcclComm,
    compute: &Arc<CudaStream>,
) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let shard = 37;
    let total = shard * world;
    let inputs: Vec<Vec<T>> = (0..world).map(|r| input::<T>(r, total)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
    let dt = T::DTYPE;
    for op in ReduceOp::ALL {
        // Avg multiplies by 1/N in the element type: exact for N = 2^k.
        let exact = op != ReduceOp::Avg || world.is_power_of_two();
        let want = reference_reduce(&refs, op);

        let mut buf = compute.clone_htod(&inputs[rank]).unwrap();
        comm.all_reduce(&mut buf, op).unwrap().wait().unwrap();
        let got = compute.clone_dtoh(&buf).unwrap();
        assert_matches(&got, &want, exact, &format!("all_reduce {op} {dt}"));

        let send = compute.clone_htod(&inputs[rank]).unwrap();
        let mut recv = compute.alloc_zeros::<T>(total).unwrap();
        comm.all_reduce_into(&send, &mut recv, op)
            .unwrap()
            .wait()
            .unwrap();
        let got = compute.clone_dtoh(&recv).unwrap();
        assert_matches(&got, &want, exact, &format!("all_reduce_into {op} {dt}"));

        let own = &want[rank * shard..(rank + 1) * shard];
        let mut out = compute.alloc_zeros::<T>(shard).unwrap();
        comm.reduce_scatter(&send, &mut out, op)
            .unwrap()
            .wait()
            .unwrap();
        let got = compute.clone_dtoh(&out).unwrap();
        assert_matches(&got, own, exact, &format!("reduce_scatter {op} {dt}"));

        let mut buf = compute.clone_htod(&inputs[rank]).unwrap();
        comm.reduce_scatter_in_place(&mut buf, op)
            .unwrap()
            .wait()
            .unwrap();
        let got = compute.clone_dtoh(&buf).unwrap();
        let what = format!("reduce_scatter_in_place {op} {dt}");
        assert_matches(&got[rank * shard..(rank + 1) * shard], own, exact, &what);
        let before = &inputs[rank];
        assert_matches(&got[..rank * shard], &before[..rank * shard], true, &what);
        assert_matches(
            &got[(rank + 1) * shard..],
            &before[(rank + 1) * shard..],
            true,
            &what,
        );
    }

    // All-gather: shard r of the result is rank r's input shard.
    let gathered: Vec<T> = (0..world)
        .flat_map(|r| inputs[r][r * shard..(r + 1) * shard].to_vec())
        .collect();
    let mine = compute
        .clone_htod(&inputs[rank][rank * shard..(rank + 1) * shard])
        .unwrap();
    let mut all = compute.alloc_zeros::<T>(total).unwrap();
    comm.all_gather(&mine, &mut all).unwrap().wait().unwrap();
    let got = compute.clone_dtoh(&all).unwrap();
    assert_matches(&got, &gathered, true, &format!("all_gather {dt}"));

    let mut partial = vec![T::from_f32(99.0); total];
    partial[rank * shard..(rank + 1) * shard]
        .copy_from_slice(&inputs[rank][rank * shard..(rank + 1) * shard]);
    let mut buf = compute.clone_htod(&partial).unwrap();
    comm.all_gather_in_place(&mut buf).unwrap().wait().unwrap();
    let got = compute.clone_dtoh(&buf).unwrap();
    assert_matches(&got, &gathered, true, &format!("all_gather_in_place {dt}"));
}

/// Three buckets reduce-scattered and one gathered in one NCCL group.
fn check_group(comm: &NcclComm, compute: &Arc<CudaStream>) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let lens = [8 * world, 3 * world, 64 * world];
    let inputs: Vec<Vec<Vec<f32>>> = lens
        .iter()
        .enumerate()
        .map(|(b, &len)| (0..world).map(|r| input::<f32>(r + b, len)).collect())
        .collect();
    let buckets: Vec<_> = inputs
        .iter()
        .map(|per_rank| compute.clone_htod(&per_rank[rank]).unwrap())
        .collect();
    let mut shards: Vec<_> = lens
        .iter()
        .map(|&len| compute.alloc_zeros::<f32>(len / world).unwrap())
        .collect();
    let params = compute.clone_htod(&input::<bf16>(rank, 5)).unwrap();
    let mut gathered = compute.alloc_zeros::<bf16>(5 * world).unwrap();
    let work = {
        let (s0, rest) = shards.split_at_mut(1);
        let (s1, s2) = rest.split_at_mut(1);
        comm.group(|g| {
            g.reduce_scatter(&buckets[0], &mut s0[0], ReduceOp::Sum)
                .reduce_scatter(&buckets[1], &mut s1[0], ReduceOp::Sum)
                .reduce_scatter(&buckets[2], &mut s2[0], ReduceOp::Avg)
                .all_gather(&params, &mut gathered);
        })
        .unwrap()
    };
    assert_eq!((work.op(), work.len()), ("group", 4));
    work.wait().unwrap();
    for (b, op) in [ReduceOp::Sum, ReduceOp::Sum, ReduceOp::Avg]
        .into_iter()
        .enumerate()
    {
        let refs: Vec<&[f32]> = inputs[b].iter().map(|v| &v[..]).collect();
        let n = lens[b] / world;
        let want = reference_reduce(&refs, op);
        let got = compute.clone_dtoh(&shards[b]).unwrap();
        let exact = op != ReduceOp::Avg || world.is_power_of_two();
        assert_matches(&got, &want[rank * n..(rank + 1) * n], exact, "group bucket");
    }
    let want: Vec<bf16> = (0..world).flat_map(|r| input::<bf16>(r, 5)).collect();
    let got = compute.clone_dtoh(&gathered).unwrap();
    assert_matches(&got, &want, true, "group all_gather");
}

fn run_all(test: &str, devs: Vec<CudaDevice>) {
    let world = devs.len();
    let group = NcclGroup::new(devs, &opts(120)).expect("create the group");
    group
        .run(|comm| {
            let compute = comm
                .stream()
                .context()
                .new_stream()
                .expect("a compute stream");
            check_collectives::<f32>(&comm, &compute);
            check_collectives::<bf16>(&comm, &compute);
            check_collectives::<f16>(&comm, &compute);
            check_group(&comm, &compute);
            assert!(comm.failure().is_none());
        })
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    say(&format!(
        "{test}: {world} rank(s) on NCCL {}: all collectives match the reference",
        version_string(nccl::version().unwrap())
    ));
}

#[test]
fn one_rank_matches_the_reference() {
    let test = "one_rank_matches_the_reference";
    if let Some(devs) = devices(test, 1) {
        run_all(test, devs);
    }
}

#[test]
fn every_gpu_as_a_rank_matches_the_reference() {
    let test = "every_gpu_as_a_rank_matches_the_reference";
    let gpus = match devices(test, 1) {
        Some(_) => CudaContext::device_count().unwrap_or(1) as usize,
        None => return,
    };
    let world = gpus.max(2);
    if let Some(devs) = devices(test, world) {
        run_all(test, devs);
    }
}

#[test]
fn bad_arguments_enqueue_nothing_and_fail_the_communicator() {
    let test = "bad_arguments_enqueue_nothing_and_fail_the_communicator";
    let Some(devs) = devices(test, 1) else { return };
    let group = NcclGroup::new(devs, &opts(30)).unwrap();
    group
        .run(|comm| {
            let s = comm.stream().clone();
            let send = s.alloc_zeros::<f32>(10).unwrap();
            let mut recv = s.alloc_zeros::<f32>(3).unwrap();
            match comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum) {
                Err(Error::InvalidArgument { rank: 0, op, msg }) => {
                    assert_eq!(op, "reduce_scatter");
                    assert!(msg.contains("input has 10 elements"), "{msg}");
                }
                other => panic!("expected InvalidArgument, got {other:?}"),
            }
            let mut ok = s.alloc_zeros::<f32>(4).unwrap();
            match comm.all_reduce(&mut ok, ReduceOp::Sum) {
                Err(Error::Poisoned { op, seq, first, .. }) => {
                    assert_eq!((op, seq), ("all_reduce", 2));
                    assert!(first.contains("reduce_scatter"), "{first}");
                }
                other => panic!("expected Poisoned, got {other:?}"),
            };
        })
        .unwrap();
}

#[test]
fn init_times_out_when_a_rank_never_joins() {
    let test = "init_times_out_when_a_rank_never_joins";
    let Some(devs) = devices(test, 1) else { return };
    // A group of 2 where rank 1 never comes: rank 0's non-blocking init
    // must be aborted at the timeout, not hang.
    let id = NcclId::new().unwrap();
    let stream = devs[0].context().new_stream().unwrap();
    let t = Instant::now();
    let r = NcclComm::new(0, 2, &id, &devs[0], stream, &opts(3));
    let took = t.elapsed();
    assert!(took < BOUND, "took {took:?}");
    match r {
        Err(Error::Timeout {
            rank, op, missing, ..
        }) => {
            assert_eq!((rank, op, missing), (0, "nccl_init", vec![1]));
            assert!(took >= Duration::from_secs(3), "{took:?}");
        }
        Err(e) => say(&format!(
            "{test}: NCCL failed the lone rank itself within {took:?}: {e}"
        )),
        Ok(_) => panic!("a group of 2 initialized with one rank"),
    }
}

#[test]
fn a_collective_times_out_when_a_rank_never_calls_it() {
    let test = "a_collective_times_out_when_a_rank_never_calls_it";
    let Some(devs) = devices(test, 2) else { return };
    let group = NcclGroup::new(devs, &opts(3)).unwrap();
    let done = Barrier::new(2);
    let t = Instant::now();
    let results = group
        .run(|comm| {
            let s = comm.stream().clone();
            let mut buf = s.alloc_zeros::<f32>(1 << 16).unwrap();
            let r = if comm.rank() == 0 {
                let r = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap().wait();
                let after = comm.all_reduce(&mut buf, ReduceOp::Sum).map(|_| ());
                Some((r, after))
            } else {
                None
            };
            done.wait();
            r
        })
        .unwrap();
    let took = t.elapsed();
    assert!(took < BOUND, "took {took:?}");
    let (r, after) = results.into_iter().next().flatten().unwrap();
    match r {
        Err(Error::Timeout {
            rank,
            op,
            seq,
            missing,
            ..
        }) => assert_eq!((rank, op, seq, missing), (0, "all_reduce", 1, vec![1])),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(
        matches!(after, Err(Error::Poisoned { seq: 2, .. })),
        "{after:?}"
    );
}

#[test]
fn validate_turns_mismatched_collectives_into_errors() {
    let test = "validate_turns_mismatched_collectives_into_errors";
    let Some(devs) = devices(test, 2) else { return };
    let mut o = opts(30);
    o.validate = true;
    let group = NcclGroup::new(devs, &o).unwrap();
    let results = group
        .run(|comm| {
            let s = comm.stream().clone();
            // Matching first: validation passes.
            let mut a = s.alloc_zeros::<f32>(8).unwrap();
            comm.all_reduce(&mut a, ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap();
            let mut b = s.alloc_zeros::<f32>(8 * (1 + comm.rank())).unwrap();
            comm.all_reduce(&mut b, ReduceOp::Sum).map(|_| ())
        })
        .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Err(Error::Mismatch {
                rank: me,
                seq,
                detail,
            }) => {
                assert_eq!((me, seq), (rank, 2));
                assert!(
                    detail.contains("all_reduce(sum, f32, 8 elements)")
                        && detail.contains("all_reduce(sum, f32, 16 elements)"),
                    "{detail}"
                );
            }
            other => panic!("rank {rank}: expected Mismatch, got {other:?}"),
        }
    }
}

/// NCCL's version code as `major.minor.patch`.
fn version_string(v: i32) -> String {
    format!("{}.{}.{}", v / 10_000, v % 10_000 / 100, v % 100)
}

#[test]
fn the_unique_id_is_created_and_shared_when_nccl_is_present() {
    // Needs the library only (no GPU): the FFI path up to the id.
    let test = "the_unique_id_is_created_and_shared_when_nccl_is_present";
    let v = match nccl::version() {
        Ok(v) => v,
        Err(_) => return skip(test, "libnccl.so not found"),
    };
    assert!(v >= 21_400, "{v}");
    let id = match NcclId::new() {
        Ok(id) => id,
        Err(e) => {
            // NCCL may need a CUDA driver even for the id: an error, no panic.
            assert!(NcclError::find(&e).is_some(), "{e}");
            return skip(test, &format!("NCCL {}: {e}", version_string(v)));
        }
    };
    assert_ne!(id.as_bytes(), &[0u8; NcclId::BYTES]);
    let got = ThreadGroup::run(3, |c| NcclId::share(&c).unwrap()).unwrap();
    assert!(got.iter().all(|g| g == &got[0]));
    assert_ne!(got[0], id, "each call creates a new id");
    say(&format!(
        "{test}: NCCL {}: ids created and broadcast over the threads backend",
        version_string(v)
    ));
}

#[test]
fn a_missing_nccl_library_is_an_error_not_a_panic() {
    let test = "a_missing_nccl_library_is_an_error_not_a_panic";
    const HIDDEN: &str = "ZERO_NCCL_TEST_HIDDEN";
    let e = match nccl::version() {
        Ok(v) if std::env::var_os(HIDDEN).is_some() => {
            skip(
                test,
                &format!(
                    "NCCL {} is found even with the wheels and LD_LIBRARY_PATH hidden ({}); \
                     the missing-library path needs a machine without it",
                    version_string(v),
                    nccl::opened().unwrap_or_default()
                ),
            );
            return;
        }
        Ok(v) => {
            // NCCL is installed (e.g. PyTorch's wheel): run this test
            // again in a process whose environment hides the places zero
            // found it in (no LD_LIBRARY_PATH, HOME, virtualenv, conda or
            // CUDA_HOME).
            say(&format!(
                "{test}: NCCL {} here ({}); checking the missing-library path in a process \
                 that does not see it",
                version_string(v),
                nccl::opened().unwrap_or_default()
            ));
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(HIDDEN, "1")
                .env("HOME", "/nonexistent")
                .env_remove("LD_LIBRARY_PATH")
                .env_remove("PYENV_ROOT")
                .env_remove("VIRTUAL_ENV")
                .env_remove("CONDA_PREFIX")
                .env_remove("CUDA_HOME")
                .env_remove("CUDA_PATH")
                .env_remove("CUDA_ROOT")
                .output()
                .unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            assert!(out.status.success(), "{stdout}\n{stderr}");
            assert!(stdout.contains("1 passed"), "{stdout}\n{stderr}");
            say(stderr.trim_end());
            return;
        }
        Err(e) => e,
    };
    let ne = NcclError::find(&e).unwrap_or_else(|| panic!("not an NcclError: {e}"));
    match &ne.failure {
        NcclFailure::Missing { tried } => {
            assert_eq!(tried, &["libnccl.so.2", "libnccl.so"], "{e}");
            assert!(
                e.to_string().contains("pip install nvidia-nccl-cu13"),
                "{e}"
            );
            say(&format!("{test}: {e}"));
        }
        NcclFailure::Unsupported { msg } => say(&format!("{test}: NCCL unusable: {msg}")),
        other => panic!("unexpected failure {other:?}"),
    }
    // Every entry point fails the same way.
    assert!(NcclError::find(&NcclId::new().unwrap_err()).is_some());
    let g = NcclGroup::new(Vec::new(), &CommOptions::default()).unwrap_err();
    assert!(NcclError::find(&g).is_some(), "{g}");

    // The MPI bootstrap, here over the threads backend: rank 0 cannot
    // create the id; every rank gets an error, none waits for an id.
    let t = Instant::now();
    let got = ThreadGroup::run(2, |c| NcclId::share(&c)).unwrap();
    assert!(t.elapsed() < BOUND);
    assert!(NcclError::find(got[0].as_ref().unwrap_err()).is_some());
    assert!(matches!(got[1], Err(Error::PeerFailed { peer: 0, .. })));

    // With a GPU but no NCCL, the whole bootstrap fails cleanly.
    if let Ok(dev) = CudaDevice::new(0) {
        let got = ThreadGroup::run(2, |c| {
            let stream = dev.context().new_stream().unwrap();
            NcclComm::from_communicator(&c, &dev, stream, &opts(5)).map(|_| ())
        })
        .unwrap();
        for r in got {
            assert!(r.is_err());
        }
    }
    say(&format!("{test}: {e}"));
}
