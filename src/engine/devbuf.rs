//! Engine buffers on the device backend whose element type is chosen at
//! run time (the parameter, accumulation and communication dtypes come
//! from the config): [`DevBuf`], an enum over the backend's typed
//! buffers, and [`DynWork`], a device collective on one in flight.
//!
//! Every access goes through the backend: device work is enqueued on a
//! stream (copies, casts, collectives), and the host reads or writes only
//! through the backend's checked host views (`host_*`), which a checked
//! backend refuses unless every conflicting access before was synced.

use std::any::Any;
use std::ops::Range;

use zero_comm::{DeviceCollectives, DeviceWork};
use zero_core::backend::{AccessKind, BufferHandle, HostAccess, Stream};
use zero_core::{bf16, convert, f16, DType, Element};

use super::dynbuf::DynBuf;
use crate::trace::Tracer;
use crate::{Error, Result};

/// A buffer of the backend of f32, bf16 or f16.
pub(crate) enum DevBuf<B: HostAccess> {
    F32(B::Buffer<f32>),
    Bf16(B::Buffer<bf16>),
    F16(B::Buffer<f16>),
}

/// Runs `$e` with `$x` bound to the typed buffer inside `$b`.
macro_rules! with_dev {
    ($b:expr, $x:ident => $e:expr) => {
        match $b {
            $crate::engine::devbuf::DevBuf::F32($x) => $e,
            $crate::engine::devbuf::DevBuf::Bf16($x) => $e,
            $crate::engine::devbuf::DevBuf::F16($x) => $e,
        }
    };
}

/// Runs `$e` (a typed value) with `$x` bound to the typed buffer inside
/// `$b`, wrapping the result in the same variant of `$w`.
macro_rules! map_dev {
    ($b:expr, $w:ident, $x:ident => $e:expr) => {
        match $b {
            $crate::engine::devbuf::DevBuf::F32($x) => $w::F32($e),
            $crate::engine::devbuf::DevBuf::Bf16($x) => $w::Bf16($e),
            $crate::engine::devbuf::DevBuf::F16($x) => $w::F16($e),
        }
    };
}

pub(crate) use {map_dev, with_dev};

impl<B: HostAccess> DevBuf<B> {
    /// A zeroed buffer from `comm`'s allocator (MPI's shared window).
    pub(crate) fn alloc<C: DeviceCollectives<B>>(
        backend: &B,
        comm: &C,
        dtype: DType,
        len: usize,
        label: &str,
    ) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => DevBuf::F32(comm.device_alloc(backend, len, label)?),
            DType::BF16 => DevBuf::Bf16(comm.device_alloc(backend, len, label)?),
            DType::F16 => DevBuf::F16(comm.device_alloc(backend, len, label)?),
        })
    }

    pub(crate) fn dtype(&self) -> DType {
        with_dev!(self, b => b.dtype())
    }

    pub(crate) fn len(&self) -> usize {
        with_dev!(self, b => b.len())
    }

    pub(crate) fn bytes(&self) -> u64 {
        (self.len() * self.dtype().size_in_bytes()) as u64
    }

    /// Makes every page resident (a host write).
    pub(crate) fn prefault(&mut self, backend: &B) -> Result<()> {
        with_dev!(self, b => backend.prefault(b)?);
        Ok(())
    }

    /// Zeroes the buffer on `stream`.
    pub(crate) fn fill_zero(&mut self, backend: &B, stream: Stream) -> Result<()> {
        let n = self.len();
        with_dev!(self, b => backend.fill(stream, b, 0..n, Element::from_f32(0.0))?);
        Ok(())
    }

    /// Zeroes the buffer from the host (checked: every earlier access must
    /// have been synced).
    pub(crate) fn host_zero(&mut self, backend: &B) -> Result<()> {
        let n = self.len();
        with_dev!(self, b => {
            let mut v = backend.host_mut(b, 0..n)?;
            v.fill(Element::from_f32(0.0));
            backend.commit(v)?;
        });
        Ok(())
    }

    /// The typed contents for the host to read (checked), if the dtype is
    /// `T`'s.
    pub(crate) fn host_ref<'a, T: Element>(
        &'a self,
        backend: &'a B,
    ) -> Result<Option<B::HostRef<'a, T>>> {
        match self.typed::<T>() {
            Some(t) => Ok(Some(backend.host_ref(t, 0..t.len())?)),
            None => Ok(None),
        }
    }

    /// Lends the buffer to the trainer as the operation `backward` on the
    /// compute stream (it writes all of it).
    pub(crate) fn lend(self, backend: &B) -> Result<(DynLoan<B>, DynBuf<B>)> {
        fn one<B: HostAccess, T: Element>(
            backend: &B,
            b: B::Buffer<T>,
        ) -> Result<(B::Loan<T>, B::Lent<T>)> {
            let n = b.len();
            Ok(backend.lend(Stream::Compute, "backward", b, &[(0..n, AccessKind::Write)])?)
        }
        Ok(match self {
            DevBuf::F32(b) => {
                let (l, m) = one::<B, _>(backend, b)?;
                (DynLoan::F32(l), DynBuf::from_lent::<f32>(m))
            }
            DevBuf::Bf16(b) => {
                let (l, m) = one::<B, _>(backend, b)?;
                (DynLoan::Bf16(l), DynBuf::from_lent::<bf16>(m))
            }
            DevBuf::F16(b) => {
                let (l, m) = one::<B, _>(backend, b)?;
                (DynLoan::F16(l), DynBuf::from_lent::<f16>(m))
            }
        })
    }

    /// The typed buffer, if the dtype is `T`'s.
    pub(crate) fn typed<T: Element>(&self) -> Option<&B::Buffer<T>> {
        with_dev!(self, b => (b as &dyn Any).downcast_ref::<B::Buffer<T>>())
    }

    /// The typed buffer, if the dtype is `T`'s.
    pub(crate) fn typed_mut<T: Element>(&mut self) -> Option<&mut B::Buffer<T>> {
        with_dev!(self, b => (b as &mut dyn Any).downcast_mut::<B::Buffer<T>>())
    }

    /// The typed contents for the host to write (checked; commit the view
    /// with [`HostAccess::commit`]), if the dtype is `T`'s.
    pub(crate) fn host_typed_mut<'a, T: Element>(
        &'a mut self,
        backend: &'a B,
    ) -> Result<Option<B::HostMut<'a, T>>> {
        match self.typed_mut::<T>() {
            Some(t) => {
                let n = t.len();
                Ok(Some(backend.host_mut(t, 0..n)?))
            }
            None => Ok(None),
        }
    }

    /// Runs `f` on the bytes of elements `range` for the host to write
    /// (checked), then commits them.
    pub(crate) fn write_bytes<R>(
        &mut self,
        backend: &B,
        range: Range<usize>,
        f: impl FnOnce(&mut [u8]) -> Result<R>,
    ) -> Result<R> {
        with_dev!(self, b => {
            let mut v = backend.host_mut(b, range)?;
            let r = f(bytemuck::cast_slice_mut(&mut v[..]))?;
            backend.commit(v)?;
            Ok(r)
        })
    }

    /// Elements `range` converted to f32 and appended to `out` (a checked
    /// host read).
    pub(crate) fn extend_f32(
        &self,
        backend: &B,
        range: Range<usize>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        with_dev!(self, b => out.extend(backend.host_ref(b, range)?.iter().map(|x| x.to_f32())));
        Ok(())
    }

    /// Stores `src` (any dtype) at `self[at..at + src.len()]`, converting
    /// (a checked host write).
    pub(crate) fn store_slice<S: Element>(
        &mut self,
        backend: &B,
        at: usize,
        src: &[S],
    ) -> Result<()> {
        let r = at..at + src.len();
        with_dev!(self, b => {
            let mut v = backend.host_mut(b, r)?;
            convert(src, &mut v[..], false);
            backend.commit(v)?;
        });
        Ok(())
    }

    /// `self[at..at + len] = src[src_at..][..len]` on `stream`, converting
    /// (a device copy).
    pub(crate) fn copy_from(
        &mut self,
        backend: &B,
        stream: Stream,
        at: usize,
        src: &DevBuf<B>,
        src_at: usize,
        len: usize,
    ) -> Result<()> {
        with_dev!(self, d => with_dev!(src, s => backend.cast(stream, s, src_at, d, at, len, false)?));
        Ok(())
    }

    /// `dst[..len] = self[..len]` (the same dtype), a device-to-host copy
    /// on `stream`.
    pub(crate) fn copy_to_host(
        &self,
        backend: &B,
        stream: Stream,
        dst: &mut DynHost<B>,
        len: usize,
    ) -> Result<()> {
        match (self, dst) {
            (DevBuf::F32(s), DynHost::F32(d)) => backend.copy_d2h(stream, s, 0, d, 0, len)?,
            (DevBuf::Bf16(s), DynHost::Bf16(d)) => backend.copy_d2h(stream, s, 0, d, 0, len)?,
            (DevBuf::F16(s), DynHost::F16(d)) => backend.copy_d2h(stream, s, 0, d, 0, len)?,
            (s, d) => {
                return Err(Error::from(zero_core::Error::DTypeMismatch {
                    op: "DevBuf::copy_to_host",
                    expected: s.dtype(),
                    got: d.dtype(),
                }))
            }
        }
        Ok(())
    }

    /// All-gather in place with `counts`, on the communication stream
    /// after `after`.
    pub(crate) fn all_gather<C: DeviceCollectives<B>>(
        self,
        backend: &B,
        comm: &C,
        counts: &[usize],
        after: &B::Event,
    ) -> DynWork<B> {
        map_dev!(self, DynWork, b => comm.device_all_gather(backend, b, counts, after))
    }
}

/// A host buffer of the backend ([`Backend::HostBuffer`]: pinned on a GPU)
/// of f32, bf16 or f16: the staging of the offloaded optimizer on a
/// device backend.
pub(crate) enum DynHost<B: HostAccess> {
    F32(B::HostBuffer<f32>),
    Bf16(B::HostBuffer<bf16>),
    F16(B::HostBuffer<f16>),
}

impl<B: HostAccess> DynHost<B> {
    /// A zeroed host buffer of `len` elements of `dtype`.
    pub(crate) fn alloc(backend: &B, dtype: DType, len: usize, label: &str) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => DynHost::F32(backend.alloc_host(len, label)?),
            DType::BF16 => DynHost::Bf16(backend.alloc_host(len, label)?),
            DType::F16 => DynHost::F16(backend.alloc_host(len, label)?),
        })
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            DynHost::F32(b) => b.len(),
            DynHost::Bf16(b) => b.len(),
            DynHost::F16(b) => b.len(),
        }
    }

    pub(crate) fn dtype(&self) -> DType {
        match self {
            DynHost::F32(_) => DType::F32,
            DynHost::Bf16(_) => DType::BF16,
            DynHost::F16(_) => DType::F16,
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        (self.len() * self.dtype().size_in_bytes()) as u64
    }

    /// Runs `f` on the bytes of elements `range` for the host to write
    /// (after every earlier access was synced).
    pub(crate) fn write_bytes<R>(
        &mut self,
        backend: &B,
        range: Range<usize>,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R> {
        Ok(match self {
            DynHost::F32(b) => f(bytemuck::cast_slice_mut(backend.write_host(b, range)?)),
            DynHost::Bf16(b) => f(bytemuck::cast_slice_mut(backend.write_host(b, range)?)),
            DynHost::F16(b) => f(bytemuck::cast_slice_mut(backend.write_host(b, range)?)),
        })
    }

    /// `dst[at..at + len] = self[..len]` (the same dtype), a host-to-device
    /// copy on `stream`.
    pub(crate) fn copy_to_device(
        &self,
        backend: &B,
        stream: Stream,
        dst: &mut DevBuf<B>,
        at: usize,
        len: usize,
    ) -> Result<()> {
        match (self, dst) {
            (DynHost::F32(s), DevBuf::F32(d)) => backend.copy_h2d(stream, s, 0, d, at, len)?,
            (DynHost::Bf16(s), DevBuf::Bf16(d)) => backend.copy_h2d(stream, s, 0, d, at, len)?,
            (DynHost::F16(s), DevBuf::F16(d)) => backend.copy_h2d(stream, s, 0, d, at, len)?,
            (s, d) => {
                return Err(Error::from(zero_core::Error::DTypeMismatch {
                    op: "DynHost::copy_to_device",
                    expected: d.dtype(),
                    got: s.dtype(),
                }))
            }
        }
        Ok(())
    }

    /// The typed buffer, if the dtype is `T`'s.
    pub(crate) fn typed<T: Element>(&self) -> Option<&B::HostBuffer<T>> {
        match self {
            DynHost::F32(b) => (b as &dyn Any).downcast_ref(),
            DynHost::Bf16(b) => (b as &dyn Any).downcast_ref(),
            DynHost::F16(b) => (b as &dyn Any).downcast_ref(),
        }
    }

    /// The typed buffer, if the dtype is `T`'s.
    pub(crate) fn typed_mut<T: Element>(&mut self) -> Option<&mut B::HostBuffer<T>> {
        match self {
            DynHost::F32(b) => (b as &mut dyn Any).downcast_mut(),
            DynHost::Bf16(b) => (b as &mut dyn Any).downcast_mut(),
            DynHost::F16(b) => (b as &mut dyn Any).downcast_mut(),
        }
    }
}

/// A buffer lent to the trainer ([`HostAccess::lend`]).
pub(crate) enum DynLoan<B: HostAccess> {
    F32(B::Loan<f32>),
    Bf16(B::Loan<bf16>),
    F16(B::Loan<f16>),
}

impl<B: HostAccess> DynLoan<B> {
    /// Takes the trainer's memory back under the lent buffer's id.
    pub(crate) fn give_back(self, backend: &B, mem: DynBuf<B>, rank: usize) -> Result<DevBuf<B>> {
        fn one<B: HostAccess, T: Element>(
            backend: &B,
            loan: B::Loan<T>,
            mem: DynBuf<B>,
            rank: usize,
        ) -> Result<B::Buffer<T>> {
            let mem = mem.into_lent::<T>().map_err(|m| Error::Usage {
                rank,
                what: format!(
                    "internal: a gradient buffer was lent as {} and came back as {}",
                    T::DTYPE,
                    m.dtype()
                ),
            })?;
            Ok(backend.give_back(loan, mem)?.0)
        }
        Ok(match self {
            DynLoan::F32(l) => DevBuf::F32(one::<B, _>(backend, l, mem, rank)?),
            DynLoan::Bf16(l) => DevBuf::Bf16(one::<B, _>(backend, l, mem, rank)?),
            DynLoan::F16(l) => DevBuf::F16(one::<B, _>(backend, l, mem, rank)?),
        })
    }
}

/// A device collective on a bucket, in flight.
pub(crate) enum DynWork<B: HostAccess> {
    F32(DeviceWork<B, f32>),
    Bf16(DeviceWork<B, bf16>),
    F16(DeviceWork<B, f16>),
}

impl<B: HostAccess> DynWork<B> {
    /// Whether the collective was refused before it started.
    pub(crate) fn is_refused(&self) -> bool {
        match self {
            DynWork::F32(w) => w.is_refused(),
            DynWork::Bf16(w) => w.is_refused(),
            DynWork::F16(w) => w.is_refused(),
        }
    }

    /// Waits for the collective (recording it into `tracer`) and returns
    /// the bucket and the event after which its result may be used.
    pub(crate) fn wait(self, tracer: &Tracer, rank: usize) -> Result<(DevBuf<B>, B::Event)> {
        fn one<B: HostAccess, T: Element>(
            tracer: &Tracer,
            rank: usize,
            w: DeviceWork<B, T>,
        ) -> Result<(B::Buffer<T>, B::Event)> {
            let op = w.op();
            let (done, timing) = w.wait_timed().map_err(comm_error)?;
            if let Some(t) = timing {
                tracer.record(rank, op, "collective", t.started, t.finished);
            }
            Ok(done)
        }
        Ok(match self {
            DynWork::F32(w) => {
                let (b, e) = one(tracer, rank, w)?;
                (DevBuf::F32(b), e)
            }
            DynWork::Bf16(w) => {
                let (b, e) = one(tracer, rank, w)?;
                (DevBuf::Bf16(b), e)
            }
            DynWork::F16(w) => {
                let (b, e) = one(tracer, rank, w)?;
                (DevBuf::F16(b), e)
            }
        })
    }
}

/// A collective refused for an error of the backend (a hazard: an access
/// of the bucket not ordered after the packing) is that error, not a
/// communication failure.
pub(crate) fn comm_error(e: zero_comm::Error) -> Error {
    match e {
        zero_comm::Error::Core(e @ zero_core::Error::Hazard(_)) => Error::Core(e),
        e => Error::Comm(e),
    }
}
