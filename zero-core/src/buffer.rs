//! Aligned, owned host buffers.

use std::alloc::Layout;
use std::any::Any;
use std::ptr::NonNull;

use crate::{DType, Element, Error, Result};

/// Alignment of every [`HostBuffer`] allocated here: a cache line, and enough
/// for AVX-512 loads and O_DIRECT-free collectives.
pub const BUFFER_ALIGN: usize = 64;

/// Buffers of at least this many bytes are anonymous mappings: the kernel
/// hands out zeroed pages, so [`HostBuffer::zeros`] writes nothing (the
/// pages are faulted in on first touch; see [`HostBuffer::prefault`]).
const MAP_THRESHOLD: usize = 1 << 20;

/// The page size assumed for pre-faulting (x86-64 and most aarch64 kernels;
/// a larger real page only means some writes are redundant).
const PAGE: usize = 4096;

enum Storage {
    /// Allocated by this type with `layout` (zero-sized buffers allocate nothing).
    Heap(Layout),
    /// Memory owned by someone else (a shared-memory window, a pool); the
    /// owner is dropped, returning the memory, when the buffer is dropped.
    External(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
    /// An anonymous private mapping of this many bytes (a multiple of
    /// [`PAGE`]), page-aligned and so [`BUFFER_ALIGN`]-aligned.
    Mapped(usize),
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
    ///
    /// Buffers of 1 MiB or more are anonymous mappings (advised
    /// `MADV_HUGEPAGE`) whose zero pages the kernel supplies on first touch:
    /// creating one writes nothing. Call [`prefault`](Self::prefault) where
    /// the first touch must not happen later, in a hot loop.
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
        if bytes >= MAP_THRESHOLD {
            return Self::mapped(len, bytes);
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

    /// `len` zeros (`bytes` of them, at least [`MAP_THRESHOLD`]) in an
    /// anonymous mapping.
    fn mapped(len: usize, bytes: usize) -> Result<Self> {
        let map_len = bytes
            .checked_add(PAGE - 1)
            .map(|b| b & !(PAGE - 1))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(Error::OutOfHostMemory { bytes })?;
        // SAFETY: an anonymous private mapping at an address the kernel
        // picks touches no existing memory.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::OutOfHostMemory { bytes });
        }
        // SAFETY: [raw, raw + map_len) is the mapping just made; madvise
        // only changes how the kernel backs it, and a failure (no THP
        // support) leaves ordinary pages.
        unsafe { libc::madvise(raw, map_len, libc::MADV_HUGEPAGE) };
        let ptr = NonNull::new(raw.cast::<T>()).ok_or(Error::OutOfHostMemory { bytes })?;
        debug_assert_eq!(ptr.as_ptr() as usize % BUFFER_ALIGN, 0);
        Ok(Self {
            ptr,
            len,
            cap: len,
            storage: Storage::Mapped(map_len),
        })
    }

    /// Makes every page of the memory resident and writable, keeping the
    /// contents, so that later accesses take no page fault: one
    /// `madvise(MADV_POPULATE_WRITE)` for a mapping, else (older kernels,
    /// heap or external memory) a volatile read and write of one byte per
    /// page. Cheap for memory already touched.
    pub fn prefault(&mut self) {
        if let Storage::Mapped(map_len) = self.storage {
            // SAFETY: [ptr, ptr + map_len) is the mapping this buffer owns;
            // populating it only allocates its pages (contents unchanged).
            let rc = unsafe {
                libc::madvise(self.ptr.as_ptr().cast(), map_len, libc::MADV_POPULATE_WRITE)
            };
            if rc == 0 {
                return;
            }
        }
        let bytes = self.cap * std::mem::size_of::<T>();
        let base = self.ptr.as_ptr().cast::<u8>();
        for offset in (0..bytes).step_by(PAGE) {
            // SAFETY: offset < bytes, inside the memory this buffer owns
            // exclusively (&mut self); the byte is written back unchanged.
            // Volatile, so that the compiler keeps the write.
            unsafe {
                let p = base.add(offset);
                p.write_volatile(p.read_volatile());
            }
        }
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
            Storage::Heap(_) | Storage::Mapped(_) => None,
        }
    }

    /// Gives back the external owner of the memory (see
    /// [`from_external`](Self::from_external)) without dropping it, or the
    /// buffer itself if its memory is not external.
    pub fn into_external_owner(mut self) -> std::result::Result<Box<dyn Any + Send + Sync>, Self> {
        // A zero-sized heap layout: dropping `self` then frees nothing.
        match std::mem::replace(&mut self.storage, Storage::Heap(Layout::new::<()>())) {
            Storage::External(owner) => Ok(owner),
            own => {
                self.storage = own;
                Err(self)
            }
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
        match self.storage {
            Storage::Heap(layout) => {
                if layout.size() != 0 {
                    // SAFETY: ptr was returned by alloc_zeroed with this layout.
                    unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
                }
            }
            Storage::Mapped(map_len) => {
                // SAFETY: [ptr, ptr + map_len) is the mapping this buffer
                // owns and no reference into it outlives `self`. A failure
                // cannot be reported from drop and leaves the mapping in
                // place, which is safe.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), map_len) };
            }
            Storage::External(_) => {}
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
    fn mapped_buffers_are_aligned_zeroed_and_prefault_keeps_contents() {
        // Around the mapping threshold, including lengths that are not a
        // page multiple.
        for len in [(MAP_THRESHOLD / 4) - 1, MAP_THRESHOLD / 4, (3 << 20) + 5] {
            let mut b = HostBuffer::<f32>::zeros(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % BUFFER_ALIGN, 0);
            assert!(b.iter().all(|&x| x == 0.0));
            for (i, x) in b.iter_mut().enumerate() {
                *x = i as f32;
            }
            b.prefault();
            assert!(b.iter().enumerate().all(|(i, &x)| x == i as f32));
            let c = HostBuffer::from_slice(&b[..]).unwrap();
            assert_eq!(c.to_vec(), b.to_vec());
            b.set_len(1).unwrap();
            b.set_len(len).unwrap();
            assert_eq!(b[len - 1], (len - 1) as f32);
        }
        let mut small = HostBuffer::<bf16>::zeros(100).unwrap();
        small.prefault();
        assert!(small.iter().all(|&x| x == bf16::ZERO));
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
