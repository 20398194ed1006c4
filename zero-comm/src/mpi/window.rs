//! The node's shared memory: control slots and buffer pools in MPI-3
//! shared windows, and how ranks find each other's memory in them.
//!
//! ```text
//!  control window (allocated by local rank 0)   pool window (one segment per rank)
//!  ┌────────┬────────┬─────┐                     ┌──────────────┬──────────────┬───
//!  │ slot 0 │ slot 1 │ ... │                     │ rank 0's pool│ rank 1's pool│...
//!  └────────┴────────┴─────┘                     └──────────────┴──────────────┴───
//!   one ControlSlot per local rank                 mapped at a different address in
//!   (the shm protocol, see crate::shm)             every process: addresses cross
//!                                                  process boundaries as offsets
//! ```
//!
//! A rank publishes a buffer as its offset in its own segment; a peer adds
//! that offset to where *it* mapped the segment (`MPI_Win_shared_query`).
//! Buffers outside the pool cannot be published ([`UNREGISTERED`]); the
//! engine stages them through the pool's bounce region instead.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use zero_core::{Element, HostBuffer};

use super::pool::{FreeList, ALIGN, POOL_ENV};
use super::runtime::{Comm, Runtime, Window};
use crate::shm::{ControlSlot, ShmMemory};
use crate::{Error, Result};

/// The published word of a pointer outside this rank's pool.
pub(crate) const UNREGISTERED: u64 = u64::MAX;

const PAGE: usize = 4096;

fn align_up(p: usize, a: usize) -> usize {
    p.div_ceil(a) * a
}

/// One rank's view of its node's shared memory.
pub(crate) struct Node {
    /// Keeps MPI alive while the memory is mapped.
    _rt: Arc<Runtime>,
    _ctrl: Window,
    _pool: Window,
    slots: *const ControlSlot,
    /// Start of every local rank's pool segment, as mapped in this process.
    bases: Vec<*mut u8>,
    /// Usable bytes of every local rank's segment (whole pages).
    lens: Vec<usize>,
    local_rank: usize,
    local_size: usize,
    /// Bytes at the start of every segment reserved for staging.
    bounce: usize,
    arena: Mutex<FreeList>,
    /// Cleared when the communicator failed: its pages are then left alone
    /// at drop, since a late peer may still touch them.
    clean: AtomicBool,
    created: Instant,
    /// When the last `/proc` check of a peer ran (ns since `created`).
    last_proc_check: AtomicU64,
}

// SAFETY: the raw pointers refer to shared mappings that live as long as the
// windows in `self`; concurrent access to them is governed by the shm
// protocol (slots are atomics; buffers are owned by one collective at a
// time). The allocator is behind a mutex.
unsafe impl Send for Node {}
// SAFETY: as above.
unsafe impl Sync for Node {}

impl Node {
    /// Allocates the control and pool windows over `local` (ranks that
    /// share memory) and initialises this rank's control slot. Collective
    /// over `local`. `pool` bytes per rank, of which `bounce` for staging.
    pub(crate) fn create(local: &Comm, pool: usize, bounce: usize) -> Result<Node> {
        let (me, n) = (local.rank(), local.size());
        let slot = std::mem::size_of::<ControlSlot>();
        let align = std::mem::align_of::<ControlSlot>();
        let ctrl_bytes = if me == 0 { n * slot + align } else { 0 };
        let ctrl = Window::allocate_shared(local, ctrl_bytes, false)?;
        let (base0, size0) = ctrl.query(0)?;
        let first = align_up(base0 as usize, align);
        if first + n * slot > base0 as usize + size0 {
            return Err(Error::Mpi(format!(
                "the control window has {size0} bytes, too small for {n} slots"
            )));
        }
        let slots = first as *const ControlSlot;
        // SAFETY: slot `me` lies within the window (checked above), is
        // aligned for ControlSlot, and only this rank writes it before the
        // barrier below; an all-zero ControlSlot is valid.
        unsafe { std::ptr::write(slots.add(me).cast_mut(), ControlSlot::default()) };
        local.barrier()?;

        let pool_win = Window::allocate_shared(local, pool + PAGE, true).map_err(|e| {
            Error::Mpi(format!(
                "cannot allocate the shared-memory pool ({pool} bytes per rank, {POOL_ENV}; \
                 Open MPI backs it with a sparse file in /dev/shm): {e}"
            ))
        })?;
        let mut bases = Vec::with_capacity(n);
        let mut lens = Vec::with_capacity(n);
        for p in 0..n {
            let (b, size) = pool_win.query(p)?;
            let start = align_up(b as usize, PAGE);
            let usable = (b as usize + size).saturating_sub(start) / PAGE * PAGE;
            bases.push(start as *mut u8);
            lens.push(usable);
        }
        let mine = lens[me];
        if mine < bounce + PAGE {
            return Err(Error::Config {
                key: POOL_ENV.into(),
                msg: format!("a pool of {mine} bytes cannot hold the {bounce}-byte bounce region"),
            });
        }
        let arena = FreeList::new(bounce, mine / ALIGN * ALIGN);
        Ok(Node {
            _rt: local.runtime().clone(),
            _ctrl: ctrl,
            _pool: pool_win,
            slots,
            bases,
            lens,
            local_rank: me,
            local_size: n,
            bounce,
            arena: Mutex::new(arena),
            clean: AtomicBool::new(true),
            created: Instant::now(),
            last_proc_check: AtomicU64::new(0),
        })
    }

    /// The control slots (`local_size` of them).
    pub(crate) fn slots(&self) -> *const ControlSlot {
        self.slots
    }

    /// This rank's bounce region: `bounce_bytes()` bytes, page-aligned.
    pub(crate) fn bounce_ptr(&self) -> *mut u8 {
        self.bases[self.local_rank]
    }

    /// Size of every rank's bounce region (the same on all ranks).
    pub(crate) fn bounce_bytes(&self) -> usize {
        self.bounce
    }

    /// Whether `bytes` bytes at `ptr` lie in this rank's pool (empty ranges
    /// count as registered: nobody reads them).
    pub(crate) fn registered(&self, ptr: *const u8, bytes: usize) -> bool {
        let base = self.bases[self.local_rank] as usize;
        let p = ptr as usize;
        bytes == 0 || (p >= base && p.saturating_add(bytes) <= base + self.lens[self.local_rank])
    }

    /// Marks the communicator as failed: its memory is left as it is.
    pub(crate) fn mark_failed(&self) {
        self.clean.store(false, Ordering::Relaxed);
    }

    /// A zeroed buffer of `len` elements in this rank's pool.
    pub(crate) fn alloc<T: Element>(
        self: &Arc<Self>,
        rank: usize,
        len: usize,
    ) -> Result<HostBuffer<T>> {
        if len == 0 {
            return Ok(HostBuffer::zeros(0)?);
        }
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(zero_core::Error::OutOfHostMemory { bytes: usize::MAX })?;
        let mut arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let Some((off, rounded, dirty)) = arena.alloc(bytes) else {
            let (free, largest) = arena.available();
            return Err(Error::Config {
                key: POOL_ENV.into(),
                msg: format!(
                    "rank {rank}: the shared-memory pool cannot hold {bytes} more bytes \
                     ({len} x {}): the pool has {} bytes per rank ({} for buffers, {free} free, \
                     largest free block {largest}); set {POOL_ENV} larger (e.g. {POOL_ENV}=4G), \
                     or drop buffers from `alloc` that are no longer needed",
                    T::DTYPE,
                    self.lens[self.local_rank],
                    arena.capacity(),
                ),
            });
        };
        drop(arena);
        let ptr = self.bases[self.local_rank].wrapping_add(off);
        // SAFETY: [off, off + rounded) lies in this rank's segment and was
        // just taken from the free list, so nothing else uses it; the first
        // `dirty` bytes may hold an earlier buffer's data, the rest was never
        // handed out and is still zero (fresh shared-memory pages).
        unsafe { std::ptr::write_bytes(ptr, 0, dirty) };
        let lease = PoolLease {
            node: self.clone(),
            off,
            len: rounded,
        };
        let ptr = NonNull::new(ptr.cast::<T>()).expect("pool segments are mapped, not null");
        // SAFETY: the region is valid for `len` elements (rounded >= bytes),
        // 64-byte aligned (page-aligned base + multiple of 64), zeroed, and
        // owned by `lease`, which keeps the window mapped and returns the
        // region to the free list only when the buffer is dropped.
        Ok(unsafe { HostBuffer::from_external(ptr, len, Box::new(lease)) })
    }
}

impl ShmMemory for Node {
    fn publish(&self, ptr: *const u8) -> u64 {
        let base = self.bases[self.local_rank] as usize;
        let p = ptr as usize;
        if p >= base && p < base + self.lens[self.local_rank] {
            (p - base) as u64
        } else {
            UNREGISTERED
        }
    }

    fn resolve(&self, local_rank: usize, word: u64) -> *mut u8 {
        match usize::try_from(word) {
            Ok(off) if word != UNREGISTERED && off < self.lens[local_rank] => {
                self.bases[local_rank].wrapping_add(off)
            }
            _ => std::ptr::null_mut(),
        }
    }

    fn peer_dead(&self, local_rank: usize) -> Option<String> {
        // SAFETY: local_rank < local_size (the shm group only asks about
        // its members) and the slots live as long as self.
        let pid = unsafe { &*self.slots.add(local_rank) }.pid();
        if pid == 0 || pid == u64::from(std::process::id()) {
            return None; // not joined yet, or ourselves
        }
        let pid = libc::pid_t::try_from(pid).ok()?;
        // SAFETY: signal 0 only checks that the process exists; nothing is
        // delivered.
        if unsafe { libc::kill(pid, 0) } == -1
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        {
            return Some(format!("died: its process (pid {pid}) no longer exists"));
        }
        // A process that exited but was not reaped yet still "exists":
        // look at its state, at most every 10 ms.
        let now = self.created.elapsed().as_nanos() as u64;
        let last = self.last_proc_check.load(Ordering::Relaxed);
        if now.saturating_sub(last) < 10_000_000 {
            return None;
        }
        self.last_proc_check.store(now, Ordering::Relaxed);
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
        matches!(state, 'Z' | 'X').then(|| format!("died: its process (pid {pid}) has exited"))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Nobody uses this rank's segment any more (the communicator and all
        // its buffers are gone, and every collective finished its exit
        // phase): give the pages back now rather than at MPI_Finalize.
        if self.clean.load(Ordering::Relaxed) {
            let (base, len) = (self.bases[self.local_rank], self.lens[self.local_rank]);
            // SAFETY: [base, base + len) is this rank's page-aligned segment
            // of a shared file mapping that stays mapped (the window is freed
            // later); punching a hole only discards its contents.
            unsafe { libc::madvise(base.cast(), len, libc::MADV_REMOVE) };
        }
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("local_rank", &self.local_rank)
            .field("local_size", &self.local_size)
            .field("pool_bytes", &self.lens[self.local_rank])
            .finish()
    }
}

/// The owner of a pool buffer: returns its region to the free list.
struct PoolLease {
    node: Arc<Node>,
    off: usize,
    len: usize,
}

impl Drop for PoolLease {
    fn drop(&mut self) {
        self.node
            .arena
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free(self.off, self.len);
    }
}
