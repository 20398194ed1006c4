//! What the tests of `zero_core::backend` share: moving data in and out of
//! any [`Backend`] through its own primitives only, so the same test body
//! runs on the CPU backend and on the CUDA backend.

use zero_core::backend::{Backend, BufferHandle, Stream};
use zero_core::{Element, Result};

/// `data` in a new device buffer, uploaded on the h2d stream; the compute
/// stream waits for the upload, and the host for its end (the host buffer
/// is dropped here).
pub fn upload<B: Backend, T: Element>(dev: &B, data: &[T], label: &str) -> Result<B::Buffer<T>> {
    let mut host = dev.alloc_host::<T>(data.len(), label)?;
    dev.write_host(&mut host, 0..data.len())?
        .copy_from_slice(data);
    let mut buf = dev.alloc::<T>(data.len(), label)?;
    dev.copy_h2d(Stream::HostToDevice, &host, 0, &mut buf, 0, data.len())?;
    let up = dev.record(Stream::HostToDevice)?;
    dev.wait(Stream::Compute, &up)?;
    dev.sync(&up)?;
    Ok(buf)
}

/// The contents of `buf` after everything enqueued on `after`, copied on
/// the d2h stream.
pub fn download_after<B: Backend, T: Element>(
    dev: &B,
    after: Stream,
    buf: &B::Buffer<T>,
) -> Result<Vec<T>> {
    let n = buf.len();
    let written = dev.record(after)?;
    dev.wait(Stream::DeviceToHost, &written)?;
    let mut host = dev.alloc_host::<T>(n, "download")?;
    dev.copy_d2h(Stream::DeviceToHost, buf, 0, &mut host, 0, n)?;
    let done = dev.record(Stream::DeviceToHost)?;
    dev.sync(&done)?;
    Ok(dev.read_host(&host, 0..n)?.to_vec())
}

/// The contents of `buf` after everything enqueued on compute.
pub fn download<B: Backend, T: Element>(dev: &B, buf: &B::Buffer<T>) -> Result<Vec<T>> {
    download_after(dev, Stream::Compute, buf)
}

/// The f32 bits of each element's value (a NaN's payload as `to_f32` gives
/// it).
pub fn bits<T: Element>(x: &[T]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

/// Panics, naming `what` and the element, at the first element of `a`
/// and `b` whose bits differ (or when their lengths do).
pub fn assert_same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
    {
        panic!("{what}: element {i}: {} vs {}", a[i], b[i]);
    }
}

/// The elements' own bytes, NaN payloads included.
pub fn raw_bits<T: Element>(x: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(x).to_vec()
}
