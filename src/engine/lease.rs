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

use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use zero_core::backend::{CpuBackend, HostAccess};
use zero_core::partition::UnitLayout;
use zero_core::Element;

use super::devbuf::DevBuf;
use super::dynbuf::DynBuf;
use crate::{Error, Result};

/// Buffers dropped by the trainer, waiting for the engine: (unit, buffer).
pub(crate) struct Returns<B: HostAccess>(Arc<Mutex<Dropped<B>>>);

/// Dropped gradient buffers: (unit, buffer), in drop order.
type Dropped<B> = Vec<(usize, DynBuf<B>)>;

impl<B: HostAccess> Clone for Returns<B> {
    fn clone(&self) -> Self {
        Returns(self.0.clone())
    }
}

impl<B: HostAccess> Default for Returns<B> {
    fn default() -> Self {
        Returns(Arc::default())
    }
}

impl<B: HostAccess> Returns<B> {
    fn push(&self, unit: usize, buf: DynBuf<B>) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((unit, buf));
    }

    /// Everything dropped since the last call, in drop order.
    pub(crate) fn take(&self) -> Dropped<B> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A unit's gradient buffer for one micro-batch, lent by
/// [`Engine::grad_buffer`](super::Engine::grad_buffer): the full unit
/// (real elements and padding), zeroed, in the training dtype. On the CPU
/// backend it derefs to `[T]`; on a device backend it is the device buffer
/// ([`GradBuffer::lent`]), which the trainer's kernels write on the
/// compute stream. Hand it back with
/// [`Engine::grad_ready`](super::Engine::grad_ready); dropping it gives it
/// back unused (the unit then has no gradient in this micro-batch).
///
/// Each trainable tensor's gradient lies at its [`UnitLayout`] offset;
/// [`GradBuffer::tensor_mut`] (CPU) and [`GradBuffer::write_tensor_host`]
/// (any backend) find it by name, and a frozen or unknown tensor is then an
/// error naming it (a frozen tensor's offset lies past the gradient buffer,
/// so indexing the buffer there by hand panics).
#[must_use = "hand the gradient back with Engine::grad_ready; dropping it discards it"]
pub struct GradBuffer<T: Element, B: HostAccess = CpuBackend> {
    buf: Option<B::Lent<T>>,
    len: usize,
    unit: usize,
    /// The unit's layout (tensors by name) and the rank, for the
    /// per-tensor views and their errors.
    layout: Arc<UnitLayout>,
    rank: usize,
    returns: Returns<B>,
    /// The backend that lent it (for [`GradBuffer::write_host`]).
    backend: B,
}

impl<T: Element, B: HostAccess> GradBuffer<T, B> {
    pub(crate) fn new(
        buf: B::Lent<T>,
        (unit, layout, rank): (usize, Arc<UnitLayout>, usize),
        returns: Returns<B>,
        backend: B,
    ) -> Self {
        GradBuffer {
            buf: Some(buf),
            len: layout.padded_numel,
            backend,
            unit,
            layout,
            rank,
            returns,
        }
    }

    /// The layout of the unit it belongs to (where each tensor lies).
    pub fn layout(&self) -> &UnitLayout {
        &self.layout
    }

    /// Where trainable tensor `name`'s gradient lies in the buffer; an
    /// unknown or frozen tensor is an error naming it and the unit.
    pub fn tensor_range(&self, name: &str) -> Result<Range<usize>> {
        let l = &self.layout;
        let usage = |what: String| Error::Usage {
            rank: self.rank,
            what,
        };
        match l.tensor(name) {
            Some(t) if t.trainable => Ok(t.range()),
            Some(_) => Err(usage(format!(
                "gradient of tensor `{name}` of unit `{}`: the tensor is frozen \
                 (TensorSpec::frozen), so it has no gradient; leave it out of the backward pass",
                l.name
            ))),
            None => {
                let names: Vec<&str> = l.tensors.iter().map(|t| t.name.as_str()).collect();
                Err(usage(format!(
                    "gradient of tensor `{name}` of unit `{}`: the unit has no such tensor \
                     (its tensors: {})",
                    l.name,
                    names.join(", ")
                )))
            }
        }
    }

    /// Runs `f` on trainable tensor `name`'s gradient for the host to
    /// write, on any backend (as [`GradBuffer::write_host`]); an unknown
    /// or frozen tensor is an error naming it.
    pub fn write_tensor_host<R>(&mut self, name: &str, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        let r = self.tensor_range(name)?;
        self.write_host(|g| f(&mut g[r]))
    }

    /// The index of the unit it belongs to.
    pub(crate) fn unit(&self) -> usize {
        self.unit
    }

    /// The number of elements (the unit's padded length).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer, handed back (nothing goes to the return queue).
    pub(crate) fn into_inner(mut self) -> B::Lent<T> {
        self.buf.take().expect("a lent buffer holds its memory")
    }

    /// What the backend lent: host memory on the CPU backend, the device
    /// buffer on a GPU (whose kernels write it on the compute stream).
    pub fn lent(&mut self) -> &mut B::Lent<T> {
        self.buf.as_mut().expect("a lent buffer holds its memory")
    }

    /// Runs `f` on the gradient for the host to write, on any backend
    /// ([`HostAccess::lent_mut`]: on the CPU backend the memory itself,
    /// on a GPU a copy written back afterwards): a trainer that computes
    /// its gradients on the host.
    pub fn write_host<R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        let buf = self.buf.as_mut().expect("a lent buffer holds its memory");
        Ok(self.backend.lent_mut(buf, f)?)
    }
}

impl<T: Element> std::ops::Deref for GradBuffer<T, CpuBackend> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

impl<T: Element> std::ops::DerefMut for GradBuffer<T, CpuBackend> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.buf.as_deref_mut().unwrap_or(&mut [])
    }
}

impl<T: Element> GradBuffer<T, CpuBackend> {
    /// Trainable tensor `name`'s gradient (its elements at its layout
    /// offset); an unknown or frozen tensor is an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&[T]> {
        let r = self.tensor_range(name)?;
        Ok(&self[r])
    }

    /// Trainable tensor `name`'s gradient, to write or accumulate into;
    /// an unknown or frozen tensor is an error naming it.
    pub fn tensor_mut(&mut self, name: &str) -> Result<&mut [T]> {
        let r = self.tensor_range(name)?;
        Ok(&mut self[r])
    }
}

impl<T: Element, B: HostAccess> Drop for GradBuffer<T, B> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.returns.push(self.unit, DynBuf::from_lent::<T>(b));
        }
    }
}

impl<T: Element, B: HostAccess> std::fmt::Debug for GradBuffer<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradBuffer")
            .field("unit", &self.unit)
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
pub struct UnitGuard<B: HostAccess = CpuBackend> {
    params: Arc<DevBuf<B>>,
    /// The device the parameters are on (reads are checked host reads).
    backend: B,
    layout: Arc<UnitLayout>,
    unit: usize,
    rank: usize,
    releases: Releases,
}

impl<B: HostAccess> UnitGuard<B> {
    pub(crate) fn new(
        params: Arc<DevBuf<B>>,
        backend: B,
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

    /// The elements [`UnitGuard::params`] covers: the real elements of the
    /// trainable segment; with frozen tensors, followed by that segment's
    /// padding and the frozen segment's real elements.
    pub fn params_len(&self) -> usize {
        let l = &self.layout;
        if l.frozen_numel > 0 {
            l.frozen_offset() + l.frozen_numel
        } else {
            l.numel
        }
    }

    /// The gathered unit as a buffer of the backend, in the training dtype
    /// `T` (padded: [`UnitGuard::params_len`] elements are the unit's).
    /// Work that reads it on a stream must be ordered after the gather
    /// like any other access: the engine's gathers complete before
    /// `gather` returns, for the compute stream.
    pub fn buffer<T: Element>(&self) -> Result<&B::Buffer<T>> {
        Ok(self
            .params
            .typed::<T>()
            .ok_or(zero_core::Error::DTypeMismatch {
                op: "UnitGuard::buffer",
                expected: self.params.dtype(),
                got: T::DTYPE,
            })?)
    }

    /// The unit's parameters in the training dtype `T` as a host view
    /// ([`UnitGuard::params_len`] elements; on the CPU backend the memory
    /// itself, on a device backend a copy).
    pub fn host_params<T: Element>(&self) -> Result<B::HostRef<'_, T>> {
        let n = self.params_len();
        Ok(self.backend.host_ref(self.buffer::<T>()?, 0..n)?)
    }
}

impl UnitGuard<CpuBackend> {
    /// The unit's full parameters in the training dtype `T`: the real
    /// elements of the trainable segment; with frozen tensors, followed
    /// by that segment's padding and the frozen segment's real elements
    /// (find a tensor through [`UnitGuard::layout`] or use
    /// [`UnitGuard::param`]).
    pub fn params<T: Element>(&self) -> Result<&[T]> {
        self.host_params::<T>()
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

impl<B: HostAccess> Drop for UnitGuard<B> {
    fn drop(&mut self) {
        self.releases
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(self.unit);
    }
}

impl<B: HostAccess> std::fmt::Debug for UnitGuard<B> {
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
pub(crate) fn exclusive<B: HostAccess>(
    shared: Arc<DevBuf<B>>,
    unit: usize,
    rank: usize,
) -> Result<DevBuf<B>> {
    Arc::try_unwrap(shared).map_err(|_| Error::Usage {
        rank,
        what: format!("internal: unit #{unit}'s parameters are still held by a UnitGuard"),
    })
}
