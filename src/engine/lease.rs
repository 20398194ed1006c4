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
use zero_core::{DType, Element};

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

    /// Whether it may be handed back as unit `i` (of `layout`, this
    /// engine's) of an engine training in `pdt`: `Err` says what is wrong,
    /// naming the unit it belongs to when that is another.
    pub(crate) fn check_for(
        &self,
        (i, layout): (usize, &UnitLayout),
        pdt: DType,
    ) -> std::result::Result<(), String> {
        let (name, own) = (&layout.name, &self.layout.name);
        if self.unit != i {
            return Err(format!(
                "grad_ready(`{name}`): the buffer is unit `{own}`'s; hand it back with \
                 grad_ready(`{own}`, ..)"
            ));
        }
        if self.len != layout.padded_numel || T::DTYPE != pdt {
            return Err(format!(
                "grad_ready(`{name}`): expected the {}-element {pdt} buffer from grad_buffer, got \
                 {} elements of {}",
                layout.padded_numel,
                self.len,
                T::DTYPE
            ));
        }
        Ok(())
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
/// the unit).
///
/// Its frozen segment (frozen tensors, `TensorSpec::frozen`) lies in the
/// unit's buffer after the trainable one, except at stage 3 with
/// `frozen_params` `shard` or `offload`: there it is gathered into a
/// buffer of its own and read where it landed, with no copy
/// ([`UnitGuard::frozen_buffer`]); [`UnitGuard::tensor_buffer`],
/// [`UnitGuard::host_tensor`] and [`UnitGuard::params_f32`] find any
/// tensor either way. It needs no borrow of the engine: a trainer keeps it while it
/// asks the engine for the unit's gradient buffer, and may hold several
/// units at once. While any guard of a unit is alive the engine neither
/// frees nor updates its parameters (`step` refuses to run).
#[must_use = "the unit is released when the guard drops: bind it with `let p = engine.gather(u)?`"]
pub struct UnitGuard<B: HostAccess = CpuBackend> {
    params: Arc<DevBuf<B>>,
    /// The frozen segment where it was gathered apart (padded), if it was.
    frozen: Option<Arc<DevBuf<B>>>,
    /// The device the parameters are on (reads are checked host reads).
    backend: B,
    layout: Arc<UnitLayout>,
    unit: usize,
    rank: usize,
    releases: Releases,
}

impl<B: HostAccess> UnitGuard<B> {
    pub(crate) fn new(
        (params, frozen): (Arc<DevBuf<B>>, Option<Arc<DevBuf<B>>>),
        backend: B,
        layout: Arc<UnitLayout>,
        unit: usize,
        rank: usize,
        releases: Releases,
    ) -> Self {
        UnitGuard {
            params,
            frozen,
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
    /// `T` (padded: [`UnitGuard::params_len`] elements are the unit's),
    /// or only its trainable segment where the frozen one was gathered
    /// apart (see [`UnitGuard::frozen_buffer`]). Work that reads it on a
    /// stream must be ordered after the gather like any other access: the
    /// engine's gathers complete before `gather` returns, for the compute
    /// stream.
    pub fn buffer<T: Element>(&self) -> Result<&B::Buffer<T>> {
        typed(&self.params, "UnitGuard::buffer")
    }

    /// The buffer that holds the unit's frozen segment, and where the
    /// segment starts in it: the unit's buffer ([`UnitGuard::buffer`]) at
    /// [`UnitLayout::frozen_offset`], or, at stage 3 with `frozen_params`
    /// `shard` or `offload`, the buffer its all-gather landed in, at 0
    /// (the compute stream reads it after the gather, as the unit's).
    pub fn frozen_buffer<T: Element>(&self) -> Result<(&B::Buffer<T>, usize)> {
        Ok(match &self.frozen {
            Some(f) => (typed(f, "UnitGuard::frozen_buffer")?, 0),
            None => (self.buffer::<T>()?, self.layout.frozen_offset()),
        })
    }

    /// Where tensor `name` lies: the buffer that holds it
    /// ([`UnitGuard::buffer`] or [`UnitGuard::frozen_buffer`]'s) and its
    /// elements there. An unknown tensor is an error naming it.
    pub fn tensor_buffer<T: Element>(&self, name: &str) -> Result<(&B::Buffer<T>, Range<usize>)> {
        let l = &self.layout;
        let t = l.tensor(name).ok_or_else(|| Error::Usage {
            rank: self.rank,
            what: format!("tensor `{name}` of unit `{}`: no such tensor", l.name),
        })?;
        if t.trainable {
            return Ok((self.buffer::<T>()?, t.range()));
        }
        let (b, start) = self.frozen_buffer::<T>()?;
        let at = start + t.offset - l.frozen_offset();
        Ok((b, at..at + t.numel))
    }

    /// Tensor `name` in the training dtype `T` as a host view (on the CPU
    /// backend the memory itself, on a device backend a copy), wherever
    /// it lies.
    pub fn host_tensor<T: Element>(&self, name: &str) -> Result<B::HostRef<'_, T>> {
        let (b, r) = self.tensor_buffer::<T>(name)?;
        Ok(self.backend.host_ref(b, r)?)
    }

    /// The unit's parameters in the training dtype `T` as a host view
    /// ([`UnitGuard::params_len`] elements; on the CPU backend the memory
    /// itself, on a device backend a copy). Where the frozen segment was
    /// gathered apart there is no one view of both: an error says so
    /// (read them with [`UnitGuard::params_f32`],
    /// [`UnitGuard::host_tensor`] or [`UnitGuard::frozen_buffer`]).
    pub fn host_params<T: Element>(&self) -> Result<B::HostRef<'_, T>> {
        if self.frozen.is_some() {
            return Err(Error::Usage {
                rank: self.rank,
                what: format!(
                    "the parameters of unit `{}` as one view: its frozen segment is gathered \
                     into a buffer of its own (stage 3, frozen_params shard or offload); read \
                     them with UnitGuard::params_f32, host_tensor or frozen_buffer",
                    self.layout.name
                ),
            });
        }
        let n = self.params_len();
        Ok(self.backend.host_ref(self.buffer::<T>()?, 0..n)?)
    }

    /// The unit's parameters converted to f32 in [`UnitGuard::params`]'
    /// layout (the trainable segment's real elements and padding, then
    /// the frozen segment's real elements), wherever the frozen segment
    /// lies: the one pass of a trainer that computes in f32.
    pub fn params_f32<T: Element>(&self) -> Result<Vec<f32>> {
        let l = &self.layout;
        let mut out = Vec::with_capacity(self.params_len());
        let f32s = |v: &[T], out: &mut Vec<f32>| out.extend(v.iter().map(|x| x.to_f32()));
        if l.frozen_numel == 0 {
            f32s(
                &self.backend.host_ref(self.buffer::<T>()?, 0..l.numel)?,
                &mut out,
            );
            return Ok(out);
        }
        // The trainable segment with its padding (all of the unit's buffer
        // where the frozen segment is apart), then the frozen elements.
        let (fb, start) = self.frozen_buffer::<T>()?;
        let trainable = self
            .backend
            .host_ref(self.buffer::<T>()?, 0..l.frozen_offset())?;
        f32s(&trainable, &mut out);
        f32s(
            &self.backend.host_ref(fb, start..start + l.frozen_numel)?,
            &mut out,
        );
        Ok(out)
    }
}

/// `buf`'s typed buffer, or a dtype mismatch naming `op`.
fn typed<'a, B: HostAccess, T: Element>(
    buf: &'a DevBuf<B>,
    op: &'static str,
) -> Result<&'a B::Buffer<T>> {
    Ok(buf.typed::<T>().ok_or(zero_core::Error::DTypeMismatch {
        op,
        expected: buf.dtype(),
        got: T::DTYPE,
    })?)
}

impl UnitGuard<CpuBackend> {
    /// The unit's full parameters in the training dtype `T`: the real
    /// elements of the trainable segment; with frozen tensors, followed
    /// by that segment's padding and the frozen segment's real elements
    /// (find a tensor through [`UnitGuard::layout`] or use
    /// [`UnitGuard::param`]); an error where the frozen segment was
    /// gathered apart (see [`UnitGuard::host_params`]).
    pub fn params<T: Element>(&self) -> Result<&[T]> {
        self.host_params::<T>()
    }

    /// One tensor of the unit.
    pub fn param<T: Element>(&self, tensor: &str) -> Result<&[T]> {
        if self.layout.tensor(tensor).is_none() {
            return Err(Error::Usage {
                rank: self.rank,
                what: format!("param(`{}`, `{tensor}`): no such tensor", self.layout.name),
            });
        }
        self.host_tensor::<T>(tensor)
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
