//! Data-parallel gradient averaging with zero-comm, end to end.
//!
//! Without a launcher, N ranks run as threads of this process:
//!
//! ```text
//! cargo run --example allreduce -- --ranks 4
//! ```
//!
//! Under MPI every process is a rank (`scripts/mpirun.sh` adds
//! `--oversubscribe --allow-run-as-root` for containers):
//!
//! ```text
//! mpirun -n 2 cargo run --example allreduce
//! ```
//!
//! Every rank makes "gradients" for a few hundred tensors of mixed sizes, as
//! a model has (embeddings, projections, norms), averages them across ranks
//! in buckets of `--bucket` elements (DeepSpeed's `reduce_bucket_size`),
//! checks every element against the value each rank can compute on its own,
//! and prints the time per step.

use std::time::Instant;

use zero_comm::{launch, BucketPlan, Bucketer, CommOptions, Communicator, ReduceOp};

/// The gradient rank `r` holds for element `i` of tensor `t`: small
/// integers, so the average over ranks is exact in f32.
fn grad(r: usize, t: usize, i: usize) -> f32 {
    ((r * 7 + t * 3 + i) % 16) as f32
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => match args.get(i + 1).and_then(|v| v.parse().ok()) {
            Some(v) => v,
            None => {
                eprintln!("error: {name} needs a positive integer");
                std::process::exit(2);
            }
        },
        None => default,
    }
}

fn main() {
    let ranks = arg("--ranks", 2);
    let bucket = arg("--bucket", 5_000_000);
    let steps = arg("--steps", 5);
    if ranks == 0 || bucket == 0 {
        eprintln!("error: --ranks and --bucket must be positive");
        std::process::exit(2);
    }
    // A Llama-like mix: per layer two norms, four attention and three MLP
    // projections; plus embedding and head.
    let (hidden, inter, layers, vocab) = (512, 1376, 8, 4096);
    let mut lens = vec![vocab * hidden];
    for _ in 0..layers {
        lens.extend([hidden, hidden * hidden, hidden * hidden, hidden * hidden]);
        lens.extend([hidden * hidden, hidden, hidden * inter, hidden * inter]);
        lens.push(inter * hidden);
    }
    lens.push(hidden);
    lens.push(hidden * vocab);
    let params: usize = lens.iter().sum();

    let opts = match CommOptions::from_env() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let result = launch(ranks, &opts, |comm| -> zero_comm::Result<Option<String>> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let plan = BucketPlan::new(&lens, bucket)?;
        let buckets = plan.buckets().len();
        let mut bucketer = Bucketer::<f32>::new(&comm, plan)?;
        let mut grads: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
        let mut best = f64::INFINITY;
        for _ in 0..steps {
            for (t, g) in grads.iter_mut().enumerate() {
                for (i, x) in g.iter_mut().enumerate() {
                    *x = grad(rank, t, i);
                }
            }
            let mut views: Vec<&mut [f32]> = grads.iter_mut().map(|g| &mut g[..]).collect();
            comm.barrier().wait()?;
            let t0 = Instant::now();
            bucketer.all_reduce(&comm, &mut views, ReduceOp::Avg)?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        for (t, g) in grads.iter().enumerate() {
            for (i, &x) in g.iter().enumerate() {
                let want = (0..world).map(|r| grad(r, t, i)).sum::<f32>() / world as f32;
                if x != want {
                    return Err(zero_comm::Error::InvalidArgument {
                        rank,
                        op: "allreduce example",
                        msg: format!("tensor {t} element {i}: got {x}, expected {want}"),
                    });
                }
            }
        }
        Ok((rank == 0).then(|| {
            format!(
                "backend {}, {world} ranks: averaged {params} gradients ({:.1} MiB f32) in {buckets} \
                 buckets of <= {bucket} elements; best step {:.2} ms; every element checked",
                comm.backend(),
                (params * 4) as f64 / (1 << 20) as f64,
                best * 1e3
            )
        }))
    });
    match result {
        Ok(per_rank) => {
            for r in per_rank {
                match r {
                    Ok(Some(line)) => println!("{line}"),
                    Ok(None) => {}
                    Err(e) => {
                        eprintln!("error: {e}");
                        std::process::exit(1);
                    }
                }
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
