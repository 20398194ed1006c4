//! A buffer lent to the trainer whose element type is chosen at run time:
//! a gradient buffer while the trainer holds it (host memory on the CPU
//! backend, the device buffer on a GPU; see `GradBuffer` and
//! [`HostAccess::lend`]). Everything else the engine keeps is a backend
//! buffer ([`DevBuf`](super::devbuf::DevBuf)).

use zero_core::backend::HostAccess;
use zero_core::{bf16, f16, DType, Element};

/// A lent buffer ([`HostAccess::Lent`]) of f32, bf16 or f16.
pub(crate) enum DynBuf<B: HostAccess> {
    F32(B::Lent<f32>),
    Bf16(B::Lent<bf16>),
    F16(B::Lent<f16>),
}

impl<B: HostAccess> DynBuf<B> {
    /// Wraps a typed buffer.
    pub(crate) fn from_lent<T: Element>(b: B::Lent<T>) -> Self {
        let mut b = Some(b);
        let any = &mut b as &mut dyn std::any::Any;
        if let Some(x) = any.downcast_mut::<Option<B::Lent<f32>>>() {
            return DynBuf::F32(x.take().expect("set"));
        }
        if let Some(x) = any.downcast_mut::<Option<B::Lent<bf16>>>() {
            return DynBuf::Bf16(x.take().expect("set"));
        }
        if let Some(x) = any.downcast_mut::<Option<B::Lent<f16>>>() {
            return DynBuf::F16(x.take().expect("set"));
        }
        unreachable!("Element is implemented for f32, bf16 and f16 only")
    }

    /// The typed buffer, if the dtype is `T`'s (else the buffer back).
    pub(crate) fn into_lent<T: Element>(self) -> std::result::Result<B::Lent<T>, Self> {
        fn cast<B: HostAccess, S: Element, T: Element>(
            b: B::Lent<S>,
        ) -> std::result::Result<B::Lent<T>, B::Lent<S>> {
            let mut b = Some(b);
            match (&mut b as &mut dyn std::any::Any).downcast_mut::<Option<B::Lent<T>>>() {
                Some(t) => Ok(t.take().expect("set")),
                None => Err(b.expect("not taken")),
            }
        }
        match self {
            DynBuf::F32(b) => cast::<B, _, T>(b).map_err(DynBuf::F32),
            DynBuf::Bf16(b) => cast::<B, _, T>(b).map_err(DynBuf::Bf16),
            DynBuf::F16(b) => cast::<B, _, T>(b).map_err(DynBuf::F16),
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
