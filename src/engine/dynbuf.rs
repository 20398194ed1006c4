//! Host memory whose element type is chosen at run time: a gradient
//! buffer's memory while the trainer holds it (lent by the backend, see
//! `GradBuffer`). Everything else the engine keeps is a backend buffer
//! ([`DevBuf`](super::devbuf::DevBuf)).

use zero_core::{bf16, f16, DType, Element, HostBuffer};

/// A [`HostBuffer`] of f32, bf16 or f16.
pub(crate) enum DynBuf {
    F32(HostBuffer<f32>),
    Bf16(HostBuffer<bf16>),
    F16(HostBuffer<f16>),
}

impl DynBuf {
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
}

/// Bytes a rank sends for a reduce-scatter or all-gather of `elems`
/// elements of `dtype` with a ring algorithm.
pub(crate) fn ring_bytes(elems: usize, world: usize, dtype: DType) -> u64 {
    (elems * (world - 1) / world.max(1) * dtype.size_in_bytes()) as u64
}
