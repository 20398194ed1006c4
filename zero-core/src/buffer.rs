//! Aligned, owned host buffers.

use std::alloc::Layout;
use std::any::Any;
use std::ptr::NonNull;

use crate::{DType, Element, Error, Result};

/// Alignment of every [`HostBuffer`] allocated here: a cache line, and enough
/// for AVX-512 loads and O_DIRECT-free collectives.
pub const BUFFER_ALIGN: usize = 64;

enum Storage {
    /// Allocated by this type with `layout` (zero-sized buffers allocate nothing).
    Heap(Layout),
    /// Memory owned by someone else (a shared-memory window, a pool); the
    /// owner is dropped, returning the memory, when the buffer is dropped.
    External(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
}

/// A contiguous, 64-byte-aligned array of `T` in host memory, owned.
///
/// This is the unit of data that collectives take by value and give back
/// when their work handle is waited on, so no other code can touch the
/// memory while a collective reads or writes it. It dereferences to `[T]`.
///
/// Memory can come from the global allocator ([`HostBuffer::zeros`],
/// [`HostBuffer::from_slice`]) or from an external owner such as a
/// communicator's shared-memory pool ([`HostBuffer::from_external`]).
pub struct HostBuffer<T: Element> {
    ptr: NonNull<T>,
    len: usize,
    /// Elements the memory holds; `len <= cap` (see [`HostBuffer::set_len`]).
    cap: usize,
    storage: Storage,
}

// SAFETY: HostBuffer owns its elements exclusively (like Vec<T>); T: Send + Sync
// is required by Element, and the external owner is Send + Sync.
unsafe impl<T: Element> Send for HostBuffer<T> {}
// SAFETY: shared access only hands out `&[T]`, and T: Sync.
unsafe impl<T: Element> Sync for HostBuffer<T> {}

impl<T: Element> HostBuffer<T> {
    /// A buffer of `len` zeros.
    pub fn zeros(len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(Error::OutOfHostMemory { bytes: usize::MAX })?;
        if bytes == 0 {
            return Ok(Self {
                ptr: aligned_dangling(),
                len,
                cap: len,
                storage: Storage::Heap(Layout::new::<()>()),
            });
        }
        let layout = Layout::from_size_align(bytes, BUFFER_ALIGN)
            .map_err(|_| Error::OutOfHostMemory { bytes })?;
        // SAFETY: layout has non-zero size (checked above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw.cast::<T>()).ok_or(Error::OutOfHostMemory { bytes })?;
        Ok(Self {
            ptr,
            len,
            cap: len,
            storage: Storage::Heap(layout),
        })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[T]) -> Result<Self> {
        let mut buf = Self::zeros(data.len())?;
        buf.copy_from_slice(data);
        Ok(buf)
    }

    /// A buffer of `len` elements produced by `f(index)`.
    pub fn from_fn(len: usize, mut f: impl FnMut(usize) -> T) -> Result<Self> {
        let mut buf = Self::zeros(len)?;
        for (i, x) in buf.iter_mut().enumerate() {
            *x = f(i);
        }
        Ok(buf)
    }

    /// Wraps memory owned by `owner`; dropping the buffer drops `owner`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` elements of `T`,
    /// aligned for `T`, for as long as `owner` lives, and no other code may
    /// access that memory while the buffer exists.
    pub unsafe fn from_external(
        ptr: NonNull<T>,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        Self {
            ptr,
            len,
            cap: len,
            storage: Storage::External(owner),
        }
    }

    /// How many elements the memory holds (the length it was created with).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Changes the length to `len <= capacity()`, keeping the memory: pooled
    /// buffers serve collectives of different sizes without reallocating.
    /// Elements that come back into view hold whatever they held before.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.cap {
            return Err(Error::InvalidSize {
                op: "HostBuffer::set_len",
                msg: format!("length {len} exceeds the capacity {}", self.cap),
            });
        }
        self.len = len;
        Ok(())
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        T::DTYPE
    }

    /// Size in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// A raw pointer to the first element (for collectives that share it).
    pub fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }

    /// A raw mutable pointer to the first element.
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr.as_ptr()
    }

    /// Whether the memory belongs to an external owner (e.g. a shared window).
    pub fn is_external(&self) -> bool {
        matches!(self.storage, Storage::External(_))
    }

    /// The external owner, if any, for backends that recognise their memory.
    pub fn external_owner(&self) -> Option<&(dyn Any + Send + Sync)> {
        match &self.storage {
            Storage::External(o) => Some(o.as_ref()),
            Storage::Heap(_) => None,
        }
    }

    /// Copies the contents into a `Vec`.
    pub fn to_vec(&self) -> Vec<T> {
        self.as_ref().to_vec()
    }
}

fn aligned_dangling<T>() -> NonNull<T> {
    // A non-null, BUFFER_ALIGN-aligned address that is never dereferenced
    // (the buffer is empty).
    NonNull::new(BUFFER_ALIGN as *mut T).expect("non-zero constant")
}

impl<T: Element> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        if let Storage::Heap(layout) = self.storage {
            if layout.size() != 0 {
                // SAFETY: ptr was returned by alloc_zeroed with this layout.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
            }
        }
        // External storage: dropping the owner returns the memory.
    }
}

impl<T: Element> std::ops::Deref for HostBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid for len elements (construction invariant) and
        // the buffer owns them exclusively.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> std::ops::DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in deref, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> AsRef<[T]> for HostBuffer<T> {
    fn as_ref(&self) -> &[T] {
        self
    }
}

impl<T: Element> std::fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("external", &self.is_external())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    static_assertions::assert_impl_all!(HostBuffer<f32>: Send, Sync);
    static_assertions::assert_impl_all!(HostBuffer<bf16>: Send, Sync);

    #[test]
    fn aligned_zeroed_and_owned() {
        for len in [0usize, 1, 3, 1000, 1 << 16] {
            let mut b = HostBuffer::<f32>::zeros(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % BUFFER_ALIGN, 0);
            assert!(b.iter().all(|&x| x == 0.0));
            for (i, x) in b.iter_mut().enumerate() {
                *x = i as f32;
            }
            assert_eq!(b.to_vec(), (0..len).map(|i| i as f32).collect::<Vec<_>>());
        }
    }

    #[test]
    fn external_owner_is_dropped_with_buffer() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        struct Owner(Vec<f32>, Arc<AtomicBool>);
        impl Drop for Owner {
            fn drop(&mut self) {
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let flag = Arc::new(AtomicBool::new(false));
        let mut owner = Box::new(Owner(vec![1.0, 2.0], flag.clone()));
        let ptr = NonNull::new(owner.0.as_mut_ptr()).unwrap();
        // SAFETY: the Vec's heap memory lives as long as `owner`, which the
        // buffer keeps; nothing else touches it.
        let buf = unsafe { HostBuffer::from_external(ptr, 2, owner) };
        assert!(buf.is_external());
        assert_eq!(&buf[..], &[1.0, 2.0]);
        drop(buf);
        assert!(flag.load(Ordering::SeqCst));
    }

    #[test]
    fn absurd_size_is_an_error_not_a_panic() {
        assert!(matches!(
            HostBuffer::<f32>::zeros(usize::MAX / 2),
            Err(Error::OutOfHostMemory { .. })
        ));
    }
}
