//! The CUDA backend's buffer pool on a GPU: memory reserved up front
//! (`CudaBackend::reserve`, what the engine does with its memory plan)
//! serves later buffers without the pool asking the driver for more, and
//! a reservation the device cannot give is an error that leaves the
//! backend working.
//!
//! One test in its own binary: the pool is the device's, shared by every
//! backend of the process, so no other test may allocate meanwhile.
//! Without a GPU it prints a skip line and passes.
#![cfg(feature = "cuda")]

use std::io::Write;

use zero_core::backend::{Backend, BufferHandle, CudaBackend, Stream};
use zero_core::Error;

const MIB: u64 = 1 << 20;

#[test]
fn a_reserved_pool_serves_later_buffers_without_growing() {
    let dev = match CudaBackend::new(0) {
        Ok(dev) => dev,
        Err(Error::NoDevice { reason, .. }) => {
            let _ = writeln!(
                std::io::stderr(),
                "a_reserved_pool_serves_later_buffers_without_growing: skipped: no GPU ({reason})"
            );
            return;
        }
        Err(e) => panic!("a GPU is present but the CUDA backend cannot start: {e}"),
    };
    let reserve = 512 * MIB;
    dev.reserve(reserve).unwrap();
    let reserved = dev.pool_reserved().unwrap();
    assert!(
        reserved >= reserve,
        "the pool holds {reserved} bytes after reserving {reserve}"
    );
    // Buffers of odd sizes, allocated, used and freed in rounds, through
    // `alloc` (the service stream) and `alloc_on` (a stream's own order),
    // all within the reservation at any time.
    for round in 0..4 {
        let mut bufs = Vec::new();
        for k in 0..6usize {
            let len = ((24 + 7 * k + round) << 20) / 4;
            let b = if k % 2 == 0 {
                dev.alloc::<f32>(len, "planned")
            } else {
                dev.alloc_on::<f32>(Stream::Compute, len, "planned, stream-ordered")
            }
            .unwrap();
            assert_eq!(b.len(), len);
            bufs.push(b);
        }
        let mut b = bufs.pop().unwrap();
        let n = b.len();
        dev.fill(Stream::Compute, &mut b, 0..n, 1.5).unwrap();
        dev.release_on(Stream::Compute, b);
        drop(bufs);
        dev.sync_all().unwrap();
    }
    assert_eq!(
        dev.pool_reserved().unwrap(),
        reserved,
        "buffers within the reservation made the pool ask the driver for more"
    );
    // More than the device has: an error naming the call and the bytes,
    // and the backend goes on.
    let (_, total) = dev.memory_info().unwrap();
    let e = dev.reserve(2 * total).unwrap_err();
    assert!(matches!(e, Error::Backend { op: "reserve", .. }), "{e}");
    assert!(e.to_string().contains(&(2 * total).to_string()), "{e}");
    let b = dev
        .alloc::<f32>(1024, "after a refused reservation")
        .unwrap();
    drop(b);
    dev.sync_all().unwrap();
}
