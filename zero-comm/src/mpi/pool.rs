//! The registered-buffer pool: each rank's segment of the node's shared
//! window, handed out by a local free-list allocator.
//!
//! ```text
//!  rank r's segment (ZERO_MPI_SHM_POOL bytes, page-aligned)
//!  ┌──────────────┬───────────────────────────────────────────────┐
//!  │ bounce       │ arena: buffers from `alloc`, 64-byte aligned   │
//!  │ (staging of  │ [ buf ][ free ][  buf  ][ never used: zero ... ]│
//!  │ unregistered │                                  ▲ `fresh`     │
//!  │ buffers)     │                                                │
//!  └──────────────┴───────────────────────────────────────────────┘
//! ```
//!
//! The window is a sparse file in `/dev/shm` (Open MPI's `osc/sm`), so the
//! pool reserves address space only: pages are allocated when first
//! written, and a large default costs nothing until buffers use it. Memory
//! above `fresh` has never been handed out and is still zero; reused memory
//! is zeroed again by `alloc`.

use crate::{Error, Result};

/// Environment variable with the pool size per rank.
pub(crate) const POOL_ENV: &str = "ZERO_MPI_SHM_POOL";

/// Default pool size per rank: 1 GiB of address space.
pub(crate) const DEFAULT_POOL: usize = 1 << 30;

/// Smallest pool accepted.
pub(crate) const MIN_POOL: usize = 1 << 20;

/// Alignment of every buffer in the pool (a cache line; AVX-512 loads).
pub(crate) const ALIGN: usize = 64;

/// The bounce region of a pool of `pool` bytes: 1/16 of it, at most 32 MiB,
/// whole pages. Large enough that staging unregistered buffers costs a few
/// synchronisations per 32 MiB, small enough to leave the pool to buffers.
pub(crate) fn bounce_bytes(pool: usize) -> usize {
    ((pool / 16).min(32 << 20) / 4096) * 4096
}

/// Parses a byte size: a number with an optional binary suffix
/// (`K`, `M`, `G`, `T`, optionally followed by `iB` or `B`), e.g. `512M`,
/// `2G`, `1.5GiB`, `1073741824`.
pub(crate) fn parse_bytes(s: &str) -> Option<usize> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let suffix = suffix.trim().to_ascii_lowercase();
    let unit: u64 = match suffix.as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    if num.is_empty() {
        return None;
    }
    let bytes = if num.contains('.') {
        let x: f64 = num.parse().ok()?;
        let b = x * unit as f64;
        if !(b.is_finite() && b >= 0.0 && b < usize::MAX as f64) {
            return None;
        }
        b as usize
    } else {
        usize::try_from(num.parse::<u64>().ok()?.checked_mul(unit)?).ok()?
    };
    Some(bytes)
}

/// The pool size from `ZERO_MPI_SHM_POOL`, or the default.
pub(crate) fn pool_size_from_env() -> Result<usize> {
    let Ok(v) = std::env::var(POOL_ENV) else {
        return Ok(DEFAULT_POOL);
    };
    let bytes = parse_bytes(&v).ok_or_else(|| Error::Config {
        key: POOL_ENV.into(),
        msg: format!("`{v}` is not a size in bytes (examples: 1073741824, 512M, 2G)"),
    })?;
    if bytes < MIN_POOL {
        return Err(Error::Config {
            key: POOL_ENV.into(),
            msg: format!("`{v}` is {bytes} bytes; the pool needs at least {MIN_POOL} (1M)"),
        });
    }
    Ok(bytes)
}

/// A first-fit free list over `[start, end)` with coalescing.
#[derive(Debug)]
pub(crate) struct FreeList {
    /// Free ranges `(offset, len)`, sorted, never adjacent.
    free: Vec<(usize, usize)>,
    /// Offsets at or above this were never handed out (still zero).
    fresh: usize,
    start: usize,
    end: usize,
}

impl FreeList {
    /// All of `[start, end)` free; both multiples of [`ALIGN`].
    pub(crate) fn new(start: usize, end: usize) -> Self {
        debug_assert!(start.is_multiple_of(ALIGN) && end.is_multiple_of(ALIGN) && start <= end);
        Self {
            free: if end > start {
                vec![(start, end - start)]
            } else {
                Vec::new()
            },
            fresh: start,
            start,
            end,
        }
    }

    /// Bytes the arena spans.
    pub(crate) fn capacity(&self) -> usize {
        self.end - self.start
    }

    /// Free bytes in total, and the largest free block.
    pub(crate) fn available(&self) -> (usize, usize) {
        let total = self.free.iter().map(|f| f.1).sum();
        let largest = self.free.iter().map(|f| f.1).max().unwrap_or(0);
        (total, largest)
    }

    /// Takes `len` bytes (rounded up to [`ALIGN`]); returns the offset, the
    /// rounded length, and how many bytes at the start may hold old data
    /// (the rest is known to be zero).
    pub(crate) fn alloc(&mut self, len: usize) -> Option<(usize, usize, usize)> {
        let len = len.checked_add(ALIGN - 1)? / ALIGN * ALIGN;
        let i = self.free.iter().position(|f| f.1 >= len)?;
        let (off, flen) = self.free[i];
        if flen == len {
            self.free.remove(i);
        } else {
            self.free[i] = (off + len, flen - len);
        }
        let dirty = self.fresh.saturating_sub(off).min(len);
        self.fresh = self.fresh.max(off + len);
        Some((off, len, dirty))
    }

    /// Returns `[off, off + len)` (as given by `alloc`).
    pub(crate) fn free(&mut self, off: usize, len: usize) {
        let i = self.free.partition_point(|f| f.0 < off);
        debug_assert!(i == self.free.len() || off + len <= self.free[i].0);
        debug_assert!(i == 0 || self.free[i - 1].0 + self.free[i - 1].1 <= off);
        self.free.insert(i, (off, len));
        // Coalesce with the next, then with the previous range.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("1073741824"), Some(1 << 30));
        assert_eq!(parse_bytes("512M"), Some(512 << 20));
        assert_eq!(parse_bytes("512m"), Some(512 << 20));
        assert_eq!(parse_bytes("2G"), Some(2 << 30));
        assert_eq!(parse_bytes("2GiB"), Some(2 << 30));
        assert_eq!(parse_bytes(" 64 KB "), Some(64 << 10));
        assert_eq!(parse_bytes("1.5G"), Some(3 << 29));
        assert_eq!(parse_bytes("1T"), Some(1 << 40));
        for bad in ["", "G", "12X", "-1", "1..5G", "1e9", "99999999999999999999"] {
            assert_eq!(parse_bytes(bad), None, "{bad}");
        }
    }

    #[test]
    fn bounce_is_pages_and_bounded() {
        assert_eq!(bounce_bytes(DEFAULT_POOL), 32 << 20);
        assert_eq!(bounce_bytes(64 << 20), 4 << 20);
        assert_eq!(bounce_bytes(MIN_POOL), 64 << 10);
        assert_eq!(bounce_bytes(MIN_POOL + 123) % 4096, 0);
    }

    #[test]
    fn reused_memory_is_reported_dirty() {
        let mut f = FreeList::new(0, 4096);
        let (a, la, da) = f.alloc(100).unwrap();
        assert_eq!((a, la, da), (0, 128, 0));
        f.free(a, la);
        let (b, lb, db) = f.alloc(256).unwrap();
        assert_eq!((b, lb, db), (0, 256, 128));
        assert!(f.alloc(4096).is_none());
        assert_eq!(f.available(), (4096 - 256, 4096 - 256));
    }

    proptest! {
        /// Live blocks never overlap, stay aligned and inside the arena,
        /// and freeing everything restores one block.
        #[test]
        fn blocks_are_disjoint_and_coalesce(ops in proptest::collection::vec((0usize..5000, any::<bool>()), 1..200)) {
            let mut f = FreeList::new(4096, 4096 + 64 * 1024);
            let mut live: Vec<(usize, usize)> = Vec::new();
            for (len, free_one) in ops {
                if free_one && !live.is_empty() {
                    let (o, l) = live.swap_remove(len % live.len());
                    f.free(o, l);
                } else if let Some((o, l, _)) = f.alloc(len.max(1)) {
                    prop_assert!(o % ALIGN == 0 && l % ALIGN == 0 && l >= len.max(1));
                    prop_assert!(o >= 4096 && o + l <= 4096 + 64 * 1024);
                    for &(p, q) in &live {
                        prop_assert!(o + l <= p || p + q <= o);
                    }
                    live.push((o, l));
                }
            }
            for (o, l) in live {
                f.free(o, l);
            }
            prop_assert_eq!(f.available(), (64 * 1024, 64 * 1024));
        }
    }
}
