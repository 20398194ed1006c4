//! Compile-time checks that the public handles can cross threads as the
//! engine needs them to (in the manner of tokio's `tests/async_send_sync.rs`).
//!
//! - `ThreadComm` is `Send + Sync`: it moves to its rank's thread and is
//!   shared (`&ThreadComm`) by that rank's compute and prefetch threads;
//!   the `Communicator` trait requires both.
//! - `HostBuffer<T>` is `Send + Sync`: collectives take it by value and run
//!   on the progress thread.
//! - `CommOptions` and `Error` are `Send + Sync` (configs are shared;
//!   errors cross threads through `ThreadGroup::run` and `Work`).
//! - `Work<R>` is `Send` (a handle can be waited on by another thread) but
//!   not `Sync`: it holds the boxed `FnOnce` that maps the backend's result,
//!   which is only `Send`. `Sync` would buy nothing: every method that
//!   touches the result (`wait`, `wait_timeout`, `map`) consumes the handle,
//!   so it can never be used from two threads at once anyway; only `op`,
//!   `seq` and `is_completed` take `&self`.
//! - The bucketing types: `BucketPlan` is plain data (`Send + Sync`);
//!   `Bucketer<T>` is `Send` (it owns buffers and, during a call, `Work`s)
//!   and is used through `&mut self`.

use static_assertions::assert_impl_all;
use zero_comm::{
    BucketLayout, BucketPlan, Bucketer, CommOptions, Communicator, Error, ReduceOp, ThreadComm,
    ThreadGroup, Work,
};
use zero_core::{bf16, f16, HostBuffer};

assert_impl_all!(ThreadComm: Send, Sync, Communicator);
assert_impl_all!(ThreadGroup: Send, Sync);
assert_impl_all!(HostBuffer<f32>: Send, Sync);
assert_impl_all!(HostBuffer<bf16>: Send, Sync);
assert_impl_all!(HostBuffer<f16>: Send, Sync);
assert_impl_all!(CommOptions: Send, Sync, Clone);
assert_impl_all!(Error: Send, Sync, std::error::Error);
assert_impl_all!(zero_comm::Result<HostBuffer<f32>>: Send, Sync);
assert_impl_all!(ReduceOp: Send, Sync, Copy);

assert_impl_all!(Work<HostBuffer<f32>>: Send);
assert_impl_all!(Work<(HostBuffer<bf16>, HostBuffer<bf16>)>: Send);
assert_impl_all!(Work<()>: Send);
// Not Sync (see the module doc): nothing could use it, so it is not
// asserted either way.

assert_impl_all!(BucketPlan: Send, Sync, Clone);
assert_impl_all!(BucketLayout: Send, Sync, Copy);
assert_impl_all!(Bucketer<f32>: Send);
assert_impl_all!(Bucketer<bf16>: Send);

/// The same in use: a `Work` waited on by another thread than the one that
/// issued it, and a communicator shared by two threads of one rank.
#[test]
fn handles_cross_threads() {
    let out = ThreadGroup::run(2, |comm| {
        let w = comm.all_reduce(HostBuffer::from_slice(&[1.0f32; 4]).unwrap(), ReduceOp::Sum);
        std::thread::scope(|s| {
            let waiter = s.spawn(move || w.wait().unwrap().to_vec());
            // Meanwhile a second thread of this rank issues the next one.
            let next = s
                .spawn(|| comm.barrier().wait().map_err(|e| e.to_string()))
                .join()
                .unwrap();
            (waiter.join().unwrap(), next)
        })
    })
    .unwrap();
    for (sum, next) in out {
        assert_eq!(sum, vec![2.0; 4]);
        next.unwrap();
    }
}
