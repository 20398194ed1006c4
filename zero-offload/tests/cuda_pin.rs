//! `CudaPinRegistrar` on a GPU: a pinned pool's buffers are registered
//! with the driver (the driver reports them as page-locked host memory),
//! copies to the device and back through them give the same bytes, and
//! dropping the pool unregisters every buffer without a failure. Without
//! a GPU it prints a `skipped:` line and passes.
#![cfg(feature = "cuda")]

use std::io::Write;

use cudarc::driver::sys;
use zero_core::CudaDevice;
use zero_offload::cuda::CudaPinRegistrar;
use zero_offload::host::PinRegistrar;
use zero_offload::{HostPool, HostPoolOptions};

#[test]
fn pinned_pool_buffers_are_registered_and_copy_both_ways() {
    let device = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "pinned_pool_buffers_are_registered_and_copy_both_ways: skipped: no GPU ({e})"
            );
            return;
        }
    };
    let registrar = CudaPinRegistrar::new(&device);
    let pool = HostPool::new(
        &[4 << 20, 1 << 20],
        HostPoolOptions {
            name: "pinned test".into(),
            pin_memory: true,
            registrar: Some(registrar.clone() as std::sync::Arc<dyn PinRegistrar>),
            ..HostPoolOptions::default()
        },
    )
    .expect("a pinned, registered pool (memlock limit?)");
    let mut buf = pool.acquire(4 << 20).unwrap();
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    // The driver knows the memory as page-locked host memory.
    let mut flags = 0u32;
    // SAFETY: `buf` is live host memory; the call only queries.
    let r = unsafe { sys::cuMemHostGetFlags(&mut flags, buf.as_mut_ptr().cast()) };
    assert_eq!(
        r,
        sys::CUresult::CUDA_SUCCESS,
        "cuMemHostGetFlags: not registered"
    );

    let stream = device.context().default_stream();
    let dev = stream.clone_htod(&buf[..]).unwrap();
    let mut back = vec![0u8; buf.len()];
    stream.memcpy_dtoh(&dev, &mut back).unwrap();
    stream.synchronize().unwrap();
    assert!(back == buf[..], "the bytes changed on the way");
    drop(buf);
    drop(pool);
    assert!(
        registrar.failures().is_empty(),
        "{:?}",
        registrar.failures()
    );
}
