//! The loops of the CPU primitives, over raw element ranges that the
//! backend validated and (in the checked modes) proved unshared.

pub(crate) use crate::dtype::convert as store;

/// A validated range of a buffer's elements, as a pointer and a length,
/// for operations that run later on a stream's worker thread.
pub(crate) struct Raw<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> Clone for Raw<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Raw<T> {}

// SAFETY: a Raw is only dereferenced (`slice`, `slice_mut`) under the
// contract of those functions: the range is live, and no access that
// conflicts with it runs at the same time. Moving the pointer to another
// thread does not change that; T: Send + Sync (Element).
unsafe impl<T: Send + Sync> Send for Raw<T> {}

impl<T> Raw<T> {
    /// Elements `at..at + len` of the allocation starting at `base`.
    ///
    /// # Safety
    /// `at + len` must not exceed the elements of the allocation at `base`.
    pub(crate) unsafe fn new(base: *mut T, at: usize, len: usize) -> Self {
        // SAFETY: `at <= at + len <=` the allocation's length (caller).
        let ptr = unsafe { base.add(at) };
        Raw { ptr, len }
    }

    /// The range as a shared slice.
    ///
    /// # Safety
    /// The memory must be live for `'a`, and nothing may write these
    /// elements during `'a`.
    pub(crate) unsafe fn slice<'a>(self) -> &'a [T] {
        // SAFETY: the caller's contract; `ptr` is aligned and valid for
        // `len` elements by construction.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The range as an exclusive slice.
    ///
    /// # Safety
    /// The memory must be live for `'a`, and nothing else may read or write
    /// these elements during `'a`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<'a>(self) -> &'a mut [T] {
        // SAFETY: as in `slice`, and exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn store_converts_copies_and_accumulates() {
        let src = [1.5f32, -2.25, 1e-8];
        let mut d = [bf16::ZERO; 3];
        store(&src, &mut d, false);
        assert_eq!(
            d.map(|x| x.to_f32()),
            [1.5, -2.25, bf16::from_f32(1e-8).to_f32()]
        );
        store(&src, &mut d, true);
        assert_eq!(d[0].to_f32(), 3.0);
        let mut h = [f16::ONE; 3];
        store(&[f16::ONE; 3], &mut h, true);
        assert_eq!(h, [f16::from_f32(2.0); 3]);
        let mut same = [0f32; 3];
        store(&src, &mut same, false);
        assert_eq!(same, src);
    }
}
