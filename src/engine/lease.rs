//! What the engine lends to the trainer, and how it comes back.
//!
//! A [`GradBuffer`] is a unit's gradient buffer of one micro-batch. The
//! trainer writes it and hands it back with `Engine::grad_ready`. If it is
//! dropped instead (an error path: the trainer's `?` left the backward
//! pass), the buffer goes back to the engine through a return queue that
//! the engine drains at its next call: the unit then has no gradient in
//! this micro-batch (so `step` refuses with an error naming it, and
//! `zero_grad` starts over), and nothing is wedged.

use std::sync::{Arc, Mutex, PoisonError};

use zero_core::{Element, HostBuffer};

use super::dynbuf::DynBuf;

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
