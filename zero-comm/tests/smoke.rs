use std::time::{Duration, Instant};
use zero_comm::*;
use zero_core::HostBuffer;

#[test]
fn smoke() {
    let out = ThreadGroup::run(3, |c| {
        let r = c.rank() as f32;
        let b = HostBuffer::from_fn(1000, |i| r + i as f32).unwrap();
        let a = c.all_reduce(b, ReduceOp::Sum).wait().unwrap();
        let counts = even_counts(10, 3);
        let s = HostBuffer::from_fn(10, |i| i as f32 * (r + 1.0)).unwrap();
        let o = HostBuffer::zeros(counts[c.rank()]).unwrap();
        let (_, rs) = c
            .reduce_scatter(s, o, &counts, ReduceOp::Sum)
            .wait()
            .unwrap();
        let g = HostBuffer::from_slice(&vec![r; counts[c.rank()]]).unwrap();
        let (_, ag) = c
            .all_gather(g, HostBuffer::zeros(10).unwrap(), &counts)
            .wait()
            .unwrap();
        (a[999], rs.to_vec(), ag.to_vec())
    })
    .unwrap();
    println!("{out:?}");
    assert_eq!(out[0].0, 999.0 * 3.0 + 3.0);
}

#[test]
fn timeout_and_peer_failure() {
    let t = Instant::now();
    let opts = CommOptions::default().with_timeout(Duration::from_millis(300));
    let out = ThreadGroup::run_with(2, &opts, |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(800));
        }
        c.all_reduce(HostBuffer::<f32>::zeros(8).unwrap(), ReduceOp::Sum)
            .wait()
            .map(|_| ())
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    println!("{out:?} {:?}", t.elapsed());
}

#[test]
fn mismatch() {
    let out = ThreadGroup::run(2, |c| {
        let w = if c.rank() == 0 {
            c.all_reduce(HostBuffer::<f32>::zeros(8).unwrap(), ReduceOp::Sum)
                .map(|_| ())
        } else {
            c.broadcast(HostBuffer::<f32>::zeros(8).unwrap(), 1)
                .map(|_| ())
        };
        w.wait().unwrap_err().to_string()
    })
    .unwrap();
    println!("{out:?}");
}
