//! What the engine lends to the trainer, and how it comes back.
//!
//! A [`UnitGuard`] is a unit's gathered parameters, from
//! `Engine::gather` until it is dropped: it holds them (shared, read
//! only), so the trainer can read them while it writes the unit's
//! gradient; dropping it releases the unit (stage 3 frees or keeps the
//! gathered buffer), through a queue the engine drains at its next call.
//!
//! A [`GradBuffer`] is a unit's gradient buffer of one micro-batch. The
//! trainer writes it and hands it back with `Engine::grad_ready`. If it is
//! dropped instead (an error path: the trainer's `?` left the backward
//! pass), the buffer goes back to the engine through a return queue that
//! the engine drains at its next call: the unit then has no gradient in
//! this micro-batch (so `step` refuses with an error naming it, and
//! `zero_grad` starts over), and nothing is wedged.

use std::sync::{Arc, Mutex, PoisonError};

use zero_core::backend::CpuBackend;
use zero_core::partition::UnitLayout;
use zero_core::{Element, HostBuffer};

use super::devbuf::DevBuf;
use super::dynbuf::DynBuf;
use crate::{Error, Result};

/// Buffers dropped by the trainer, waiting for the engine: (unit, buffer).
#[derive(Clone, Default)]
pub(crate) struct Returns(Arc<Mutex<Vec<(usize, DynBuf)>>>);

impl Returns {
    fn push(&self, unit: usize, buf: DynBuf) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((unit, buf));
    }

    /// Everything dropped since the last call, in drop order.
    pub(crate) fn take(&self) -> Vec<(usize, DynBuf)> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A unit's gradient buffer for one micro-batch, lent by
/// [`Engine::grad_buffer`](super::Engine::grad_buffer): the full unit
/// (real elements and padding), zeroed, in the training dtype. Derefs to
/// `[T]`. Hand it back with [`Engine::grad_ready`](super::Engine::grad_ready);
/// dropping it gives it back unused (the unit then has no gradient in this
/// micro-batch).
#[must_use = "hand the gradient back with Engine::grad_ready; dropping it discards it"]
pub struct GradBuffer<T: Element> {
    buf: Option<HostBuffer<T>>,
    unit: usize,
    returns: Returns,
}

impl<T: Element> GradBuffer<T> {
    pub(crate) fn new(buf: HostBuffer<T>, unit: usize, returns: Returns) -> Self {
        GradBuffer {
            buf: Some(buf),
            unit,
            returns,
        }
    }

    /// The index of the unit it belongs to.
    pub(crate) fn unit(&self) -> usize {
        self.unit
    }

    /// The buffer, handed back (nothing goes to the return queue).
    pub(crate) fn into_inner(mut self) -> HostBuffer<T> {
        self.buf.take().expect("a lent buffer holds its memory")
    }
}

impl<T: Element> std::ops::Deref for GradBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

impl<T: Element> std::ops::DerefMut for GradBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.buf.as_deref_mut().unwrap_or(&mut [])
    }
}

impl<T: Element> Drop for GradBuffer<T> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.returns.push(self.unit, DynBuf::from_host(b));
        }
    }
}

impl<T: Element> std::fmt::Debug for GradBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradBuffer")
            .field("unit", &self.unit)
            .field("len", &self.len())
            .field("dtype", &T::DTYPE)
            .finish()
    }
}

/// Units released by dropped guards, waiting for the engine, in drop order.
#[derive(Clone, Default)]
pub(crate) struct Releases(Arc<Mutex<Vec<usize>>>);

impl Releases {
    /// Everything released since the last call, in drop order.
    pub(crate) fn take(&self) -> Vec<usize> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A gathered unit's parameters, from
/// [`Engine::gather`](super::Engine::gather) until dropped (which releases
/// the unit). It needs no borrow of the engine: a trainer keeps it while it
/// asks the engine for the unit's gradient buffer, and may hold several
/// units at once. While any guard of a unit is alive the engine neither
/// frees nor updates its parameters (`step` refuses to run).
#[must_use = "the unit is released when the guard drops: bind it with `let p = engine.gather(u)?`"]
pub struct UnitGuard {
    params: Arc<DevBuf>,
    /// The device the parameters are on (reads are checked host reads).
    backend: CpuBackend,
    layout: Arc<UnitLayout>,
    unit: usize,
    rank: usize,
    releases: Releases,
}

impl UnitGuard {
    pub(crate) fn new(
        params: Arc<DevBuf>,
        backend: CpuBackend,
        layout: Arc<UnitLayout>,
        unit: usize,
        rank: usize,
        releases: Releases,
    ) -> Self {
        UnitGuard {
            params,
            backend,
            layout,
            unit,
            rank,
            releases,
        }
    }

    /// The unit's layout (its tensors' names, shapes and offsets).
    pub fn layout(&self) -> &UnitLayout {
        &self.layout
    }

    /// The unit's full parameters in the training dtype `T`: the real
    /// elements of the trainable segment; with frozen tensors, followed
    /// by that segment's padding and the frozen segment's real elements
    /// (find a tensor through [`UnitGuard::layout`] or use
    /// [`UnitGuard::param`]).
    pub fn params<T: Element>(&self) -> Result<&[T]> {
        let s =
            self.params
                .host_slice::<T>(&self.backend)?
                .ok_or(zero_core::Error::DTypeMismatch {
                    op: "UnitGuard::params",
                    expected: self.params.dtype(),
                    got: T::DTYPE,
                })?;
        let l = &self.layout;
        let end = if l.frozen_numel > 0 {
            l.frozen_offset() + l.frozen_numel
        } else {
            l.numel
        };
        Ok(&s[..end])
    }

    /// One tensor of the unit.
    pub fn param<T: Element>(&self, tensor: &str) -> Result<&[T]> {
        let all = self.params::<T>()?;
        let t = self.layout.tensor(tensor).ok_or_else(|| Error::Usage {
            rank: self.rank,
            what: format!("param(`{}`, `{tensor}`): no such tensor", self.layout.name),
        })?;
        Ok(&all[t.offset..t.offset + t.numel])
    }
}

impl Drop for UnitGuard {
    fn drop(&mut self) {
        self.releases
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(self.unit);
    }
}

impl std::fmt::Debug for UnitGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitGuard")
            .field("unit", &self.layout.name)
            .field("dtype", &self.params.dtype())
            .finish()
    }
}

/// The only holder of a shared buffer gets it back (to update it, or to
/// hand it to a collective); a lease still alive is an internal error
/// naming unit `unit` (the engine refuses steps while units are
/// gathered, so it means a bug, not a misuse).
pub(crate) fn exclusive(shared: Arc<DevBuf>, unit: usize, rank: usize) -> Result<DevBuf> {
    Arc::try_unwrap(shared).map_err(|_| Error::Usage {
        rank,
        what: format!("internal: unit #{unit}'s parameters are still held by a UnitGuard"),
    })
}
