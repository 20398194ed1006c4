//! Buffers whose element type is chosen at run time (the parameter,
//! accumulation and communication dtypes come from the config).

use std::ops::Range;

use zero_comm::{Communicator, Work};
use zero_core::{bf16, convert as store, f16, DType, Element, HostBuffer};

use crate::Result;

/// A [`HostBuffer`] of f32, bf16 or f16.
pub(crate) enum DynBuf {
    F32(HostBuffer<f32>),
    Bf16(HostBuffer<bf16>),
    F16(HostBuffer<f16>),
}

/// Runs `$e` with `$x` bound to the typed buffer inside `$b`.
macro_rules! with_buf {
    ($b:expr, $x:ident => $e:expr) => {
        match $b {
            $crate::engine::dynbuf::DynBuf::F32($x) => $e,
            $crate::engine::dynbuf::DynBuf::Bf16($x) => $e,
            $crate::engine::dynbuf::DynBuf::F16($x) => $e,
        }
    };
}

impl DynBuf {
    /// A zeroed buffer registered with `comm` (shared memory under MPI).
    pub(crate) fn alloc<C: Communicator>(comm: &C, dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => DynBuf::F32(comm.alloc(len)?),
            DType::BF16 => DynBuf::Bf16(comm.alloc(len)?),
            DType::F16 => DynBuf::F16(comm.alloc(len)?),
        })
    }

    /// Wraps a typed buffer.
    pub(crate) fn from_host<T: Element>(b: HostBuffer<T>) -> Self {
        let mut b = Some(b);
        let any = &mut b as &mut dyn std::any::Any;
        if let Some(x) = any.downcast_mut::<Option<HostBuffer<f32>>>() {
            return DynBuf::F32(x.take().expect("set"));
        }
        if let Some(x) = any.downcast_mut::<Option<HostBuffer<bf16>>>() {
            return DynBuf::Bf16(x.take().expect("set"));
        }
        if let Some(x) = any.downcast_mut::<Option<HostBuffer<f16>>>() {
            return DynBuf::F16(x.take().expect("set"));
        }
        unreachable!("Element is implemented for f32, bf16 and f16 only")
    }

    /// The typed buffer, if the dtype is `T`'s (else the buffer back).
    pub(crate) fn into_host<T: Element>(self) -> std::result::Result<HostBuffer<T>, Self> {
        fn cast<S: Element, T: Element>(
            b: HostBuffer<S>,
        ) -> std::result::Result<HostBuffer<T>, HostBuffer<S>> {
            let mut b = Some(b);
            match (&mut b as &mut dyn std::any::Any).downcast_mut::<Option<HostBuffer<T>>>() {
                Some(t) => Ok(t.take().expect("set")),
                None => Err(b.expect("not taken")),
            }
        }
        match self {
            DynBuf::F32(b) => cast(b).map_err(DynBuf::F32),
            DynBuf::Bf16(b) => cast(b).map_err(DynBuf::Bf16),
            DynBuf::F16(b) => cast(b).map_err(DynBuf::F16),
        }
    }

    pub(crate) fn dtype(&self) -> DType {
        match self {
            DynBuf::F32(_) => DType::F32,
            DynBuf::Bf16(_) => DType::BF16,
            DynBuf::F16(_) => DType::F16,
        }
    }

    pub(crate) fn len(&self) -> usize {
        with_buf!(self, b => b.len())
    }

    pub(crate) fn capacity(&self) -> usize {
        with_buf!(self, b => b.capacity())
    }

    /// Makes every page resident, keeping the contents
    /// ([`HostBuffer::prefault`]).
    pub(crate) fn prefault(&mut self) {
        with_buf!(self, b => b.prefault());
    }

    /// Bytes of the whole allocation.
    pub(crate) fn capacity_bytes(&self) -> u64 {
        (self.capacity() * self.dtype().size_in_bytes()) as u64
    }

    /// The typed slice, if the dtype is `T`'s.
    pub(crate) fn slice<T: Element>(&self) -> Option<&[T]> {
        with_buf!(self, b => (b as &dyn std::any::Any)
            .downcast_ref::<HostBuffer<T>>()
            .map(|b| &b[..]))
    }

    /// The typed mutable slice, if the dtype is `T`'s.
    pub(crate) fn slice_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        with_buf!(self, b => (b as &mut dyn std::any::Any)
            .downcast_mut::<HostBuffer<T>>()
            .map(|b| &mut b[..]))
    }

    /// Elements `range` converted to f32 and appended to `out`.
    pub(crate) fn extend_f32(&self, range: Range<usize>, out: &mut Vec<f32>) {
        with_buf!(self, b => out.extend(b[range].iter().map(|x| x.to_f32())));
    }

    /// Copies (converting) `len` elements from `src[s..]` to `self[d..]`;
    /// with `add`, adds them instead: `d = D(f32(d) + f32(s))`.
    pub(crate) fn store_from(&mut self, d: usize, src: &DynBuf, s: usize, len: usize, add: bool) {
        with_buf!(self, dst => with_buf!(src, sb => {
            store(&sb[s..s + len], &mut dst[d..d + len], add)
        }))
    }

    /// Copies `src` (any dtype) into `self[d..]`, converting.
    pub(crate) fn store_slice<S: Element>(&mut self, d: usize, src: &[S]) {
        with_buf!(self, dst => store(src, &mut dst[d..d + src.len()], false))
    }

    /// Copies the buffer's bytes (all `len` elements) to the start of `dst`.
    pub(crate) fn copy_to_bytes(&self, dst: &mut [u8]) {
        with_buf!(self, b => {
            let s: &[u8] = bytemuck::cast_slice(&b[..]);
            dst[..s.len()].copy_from_slice(s);
        })
    }

    /// Copies raw bytes of this buffer's dtype into `self[d..]`.
    pub(crate) fn store_bytes(&mut self, d: usize, src: &[u8]) {
        let n = src.len() / self.dtype().size_in_bytes();
        with_buf!(self, b => {
            bytemuck::cast_slice_mut::<_, u8>(&mut b[d..d + n]).copy_from_slice(src);
        })
    }

    /// Zeroes `len` elements from `d`.
    pub(crate) fn zero_range(&mut self, d: usize, len: usize) {
        with_buf!(self, b => b[d..d + len].fill(Element::from_f32(0.0)));
    }

    /// All-gather in place with `counts`.
    pub(crate) fn all_gather<C: Communicator>(self, comm: &C, counts: &[usize]) -> Work<DynBuf> {
        match self {
            DynBuf::F32(b) => comm.all_gather_in_place(b, counts).map(DynBuf::F32),
            DynBuf::Bf16(b) => comm.all_gather_in_place(b, counts).map(DynBuf::Bf16),
            DynBuf::F16(b) => comm.all_gather_in_place(b, counts).map(DynBuf::F16),
        }
    }
}

/// Bytes a rank sends for a reduce-scatter or all-gather of `elems`
/// elements of `dtype` with a ring algorithm.
pub(crate) fn ring_bytes(elems: usize, world: usize, dtype: DType) -> u64 {
    (elems * (world - 1) / world.max(1) * dtype.size_in_bytes()) as u64
}
