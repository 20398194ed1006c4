//! The host-memory tier: page-aligned buffers, allocated once, reused.
//!
//! Offloaded optimizer state (fp32 master, `m`, `v` of a rank's shard) and
//! stage-3 parameter shards live in host memory between their trips to the
//! device or to NVMe. Every such buffer comes from a [`HostPool`] built at
//! start-up from the memory plan:
//!
//! ```text
//!   start-up (once)                       training step (no allocation)
//!   ---------------                       ------------------------------
//!   mmap (2 MiB-aligned when large)       pool.acquire(bytes) -> PooledBuffer
//!   madvise(MADV_HUGEPAGE)                  ... read / compute / write ...
//!   touch every page (pre-fault)          drop(buffer)  -> back into its slot
//!   mlock            (pin_memory: true)
//!   PinRegistrar::register (CUDA, later)
//! ```
//!
//! Why pre-fault: on these machines writing freshly mapped memory runs at
//! ~1.6 GB/s (page faults; ~6.8 GB/s with huge pages) against ~22 GB/s for
//! memory already touched, so the first step would otherwise pay for the
//! faults, and a pinned buffer must be resident anyway.
//!
//! `pin_memory: true` locks the buffers with `mlock`. Before allocating, the
//! pool checks `RLIMIT_MEMLOCK` against the total (see [`MemLockStatus`]); a
//! limit that is too low is an [`Error::PinMemory`] that states the limit,
//! the bytes needed and how to raise it. Registering the buffers with the
//! CUDA driver (`cudaHostRegister`, through cudarc) is left to a
//! [`PinRegistrar`] that the CUDA backend will provide; this crate calls it
//! once per buffer after locking and once before unmapping.
//!
//! ```
//! use zero_offload::host::{HostPool, HostPoolOptions};
//!
//! let pool = HostPool::new(&[1 << 20, 1 << 20, 4096], HostPoolOptions::default())?;
//! let mut tile = pool.acquire(1000)?; // the smallest free buffer that fits
//! tile.as_mut_slice_of::<f32>()?.fill(1.0);
//! assert_eq!(tile.len(), 1000);
//! assert_eq!(tile.as_ptr() as usize % 4096, 0);
//! drop(tile); // back into the pool
//! assert_eq!(pool.available(), 3);
//! # Ok::<(), zero_offload::Error>(())
//! ```

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use zero_core::memory::{Allocation, Category, MemoryTracker, Tier};

use crate::{Error, Result};

/// The alignment of every buffer, and the unit its capacity is rounded to:
/// enough for `O_DIRECT` on devices with 512-byte or 4 KiB logical blocks.
pub const PAGE_SIZE: usize = 4096;

/// The size of a transparent huge page on x86-64; buffers at least this large
/// are aligned to it so that `MADV_HUGEPAGE` can back them with huge pages.
const HUGE_PAGE: usize = 2 << 20;

/// `n` rounded up to a multiple of `to` (a power of two), or `None` on
/// overflow.
pub(crate) fn round_up(n: usize, to: usize) -> Option<usize> {
    Some(n.checked_add(to - 1)? & !(to - 1))
}

/// The last OS error as text, e.g. `"Cannot allocate memory (os error 12)"`.
fn os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

// ---------------------------------------------------------------------------
// AlignedBuf
// ---------------------------------------------------------------------------

/// An owned, page-aligned, pre-faulted byte buffer in host memory, mapped
/// with `mmap`.
///
/// Its capacity is its length rounded up to [`PAGE_SIZE`]; it dereferences to
/// the first [`len`](Self::len) bytes. Buffers of 2 MiB or more are aligned
/// to 2 MiB and advised with `MADV_HUGEPAGE`. All pages are touched at
/// creation, so no page fault happens when the buffer is used. It is the unit
/// of data that [`SwapFile`](crate::nvme::SwapFile) requests move.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    locked: bool,
}

// SAFETY: AlignedBuf owns its mapping exclusively (like Vec<u8>); nothing
// else holds its pointer.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` zero bytes (`len >= 1`), huge-page advised and
    /// pre-faulted.
    pub fn new(len: usize) -> Result<Self> {
        Self::with_options(len, true)
    }

    /// As [`new`](Self::new); `huge_pages: false` skips `MADV_HUGEPAGE`.
    pub fn with_options(len: usize, huge_pages: bool) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidSize {
                op: "AlignedBuf::new",
                msg: "a buffer needs at least one byte".into(),
            });
        }
        let cap = round_up(len, PAGE_SIZE).ok_or(Error::OutOfHostMemory { bytes: len })?;
        let align = if huge_pages && cap >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            PAGE_SIZE
        };
        let ptr = map_aligned(cap, align)?;
        let buf = AlignedBuf {
            ptr,
            len,
            cap,
            locked: false,
        };
        if huge_pages {
            // SAFETY: [ptr, ptr + cap) is a mapping this buffer owns; madvise
            // only changes how the kernel backs it. Failure (no THP support)
            // leaves ordinary pages, which is fine.
            unsafe {
                libc::madvise(buf.ptr.as_ptr().cast(), cap, libc::MADV_HUGEPAGE);
            }
        }
        buf.prefault();
        Ok(buf)
    }

    /// Writes one byte per page so that every page is resident.
    fn prefault(&self) {
        let base = self.ptr.as_ptr();
        for offset in (0..self.cap).step_by(PAGE_SIZE) {
            // SAFETY: offset < cap, inside the mapping this buffer owns, and
            // no reference to the memory exists yet; anonymous memory is
            // already zero, so writing zero keeps the contents.
            unsafe { base.add(offset).write_volatile(0) };
        }
    }

    /// Locks the pages in memory (`mlock`).
    fn lock(&mut self) -> Result<()> {
        // SAFETY: [ptr, ptr + cap) is a mapping this buffer owns.
        let rc = unsafe { libc::mlock(self.ptr.as_ptr().cast(), self.cap) };
        if rc != 0 {
            let err = os_error();
            return Err(Error::PinMemory {
                needed: self.cap as u64,
                msg: format!("mlock failed: {err}. {}", MEMLOCK_HOWTO),
            });
        }
        self.locked = true;
        Ok(())
    }

    /// The length in bytes (what the buffer dereferences to).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is zero (possible after [`set_len`](Self::set_len)).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes mapped: the length at creation rounded up to [`PAGE_SIZE`].
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the length to `len <= capacity()`, keeping the memory, so one
    /// buffer serves tiles of different sizes. Bytes that come back into
    /// view hold what they held before.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.cap {
            return Err(Error::InvalidSize {
                op: "AlignedBuf::set_len",
                msg: format!("length {len} exceeds the capacity {}", self.cap),
            });
        }
        self.len = len;
        Ok(())
    }

    /// Whether the pages are locked in memory (`pin_memory`).
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// A pointer to the first byte (page-aligned).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// A mutable pointer to the first byte (page-aligned).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes viewed as `T` (e.g. `f32`); an error if the length is not
    /// a multiple of `size_of::<T>()`.
    pub fn as_slice_of<T: bytemuck::Pod>(&self) -> Result<&[T]> {
        bytemuck::try_cast_slice(self).map_err(|e| cast_error::<T>(self.len, e))
    }

    /// The bytes viewed mutably as `T`; an error if the length is not a
    /// multiple of `size_of::<T>()`.
    pub fn as_mut_slice_of<T: bytemuck::Pod>(&mut self) -> Result<&mut [T]> {
        let len = self.len;
        bytemuck::try_cast_slice_mut(self).map_err(|e| cast_error::<T>(len, e))
    }
}

fn cast_error<T>(len: usize, e: bytemuck::PodCastError) -> Error {
    Error::InvalidSize {
        op: "AlignedBuf::as_slice_of",
        msg: format!(
            "{len} bytes cannot be viewed as {} ({e:?})",
            std::any::type_name::<T>()
        ),
    }
}

/// Maps `cap` bytes (a multiple of `PAGE_SIZE`) of anonymous memory at an
/// address aligned to `align` (`PAGE_SIZE` or `HUGE_PAGE`).
fn map_aligned(cap: usize, align: usize) -> Result<NonNull<u8>> {
    let extra = align - PAGE_SIZE;
    let total = cap
        .checked_add(extra)
        .ok_or(Error::OutOfHostMemory { bytes: cap })?;
    // SAFETY: an anonymous private mapping at an address the kernel picks
    // touches no existing memory.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(Error::OutOfHostMemory { bytes: cap });
    }
    let start = raw as usize;
    let aligned = (start + align - 1) & !(align - 1);
    let head = aligned - start;
    let tail = extra - head;
    // Give back the unaligned head and the tail; both are page multiples
    // because mmap returns page-aligned addresses.
    if head > 0 {
        // SAFETY: [start, start + head) is part of the mapping just made and
        // nothing refers to it.
        unsafe { libc::munmap(raw, head) };
    }
    if tail > 0 {
        // SAFETY: [aligned + cap, aligned + cap + tail) is the end of the
        // mapping just made and nothing refers to it.
        unsafe { libc::munmap((aligned + cap) as *mut libc::c_void, tail) };
    }
    NonNull::new(aligned as *mut u8).ok_or(Error::OutOfHostMemory { bytes: cap })
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: [ptr, ptr + cap) is the mapping this buffer owns and no
        // reference into it outlives `self`. munmap also unlocks locked
        // pages. A failure cannot be reported from drop and leaves the
        // mapping in place, which is safe.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialized bytes (mmap gives
        // zeroed memory) owned by self; the borrow ties the slice to self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .field("locked", &self.locked)
            .finish()
    }
}

// ---------------------------------------------------------------------------
// Pinning: RLIMIT_MEMLOCK and the CUDA hook
// ---------------------------------------------------------------------------

/// How to raise the locked-memory limit, appended to every pinning error.
const MEMLOCK_HOWTO: &str = "Raise the locked-memory limit: `ulimit -l unlimited` \
     (or a value in KiB) in the shell that starts the job; for a user, a `memlock` line \
     in /etc/security/limits.conf (e.g. `*  -  memlock  unlimited`, then log in again); \
     in Docker, `docker run --ulimit memlock=-1`; or set `pin_memory: false`";

/// What the OS allows this process to lock: `RLIMIT_MEMLOCK`, what is
/// locked already, and whether `CAP_IPC_LOCK` lifts the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemLockStatus {
    /// The soft limit in bytes; `None` when unlimited.
    pub limit: Option<u64>,
    /// Bytes this process has locked already (`VmLck`).
    pub locked: u64,
    /// Whether the calling thread holds `CAP_IPC_LOCK`, which makes the kernel
    /// ignore the limit.
    pub cap_ipc_lock: bool,
}

impl MemLockStatus {
    /// The status of this process and thread (`getrlimit`,
    /// `/proc/thread-self/status`).
    pub fn current() -> MemLockStatus {
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into the struct we own.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
        let limit = if rc != 0 || rl.rlim_cur == libc::RLIM_INFINITY {
            None
        } else {
            Some(rl.rlim_cur)
        };
        // Capabilities are per thread (mlock checks the caller's); VmLck is
        // per process. Kernels before 3.17 have no /proc/thread-self.
        let status = std::fs::read_to_string("/proc/thread-self/status")
            .or_else(|_| std::fs::read_to_string("/proc/self/status"))
            .unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
        };
        let locked = field("VmLck:")
            .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024);
        const CAP_IPC_LOCK: u32 = 14;
        let cap_ipc_lock = field("CapEff:")
            .and_then(|v| u64::from_str_radix(v, 16).ok())
            .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0);
        MemLockStatus {
            limit,
            locked,
            cap_ipc_lock,
        }
    }

    /// `Ok` if `needed` more bytes can be locked; otherwise an
    /// [`Error::PinMemory`] that states the limit, what is locked already,
    /// the bytes needed and how to raise the limit.
    pub fn check(&self, needed: u64) -> Result<()> {
        let Some(limit) = self.limit else {
            return Ok(());
        };
        if self.cap_ipc_lock || self.locked.saturating_add(needed) <= limit {
            return Ok(());
        }
        Err(Error::PinMemory {
            needed,
            msg: format!(
                "RLIMIT_MEMLOCK is {limit} bytes ({} KiB, as `ulimit -l` shows it), \
                 {} bytes are locked already, and pin_memory needs {needed} bytes more \
                 ({} bytes in all). {MEMLOCK_HOWTO}",
                limit / 1024,
                self.locked,
                self.locked.saturating_add(needed),
            ),
        })
    }
}

/// The hook that registers pinned buffers with an accelerator runtime.
///
/// The CUDA backend will implement it with `cudaHostRegister` /
/// `cudaHostUnregister` (through cudarc), so that copies between these
/// buffers and the device run asynchronously at full PCIe speed. This crate
/// does not implement CUDA: it only calls the hook.
///
/// A [`HostPool`] with `pin_memory: true` calls [`register`](Self::register)
/// once per buffer, after the buffer is mapped, pre-faulted and locked, and
/// [`unregister`](Self::unregister) once per successfully registered buffer
/// before unmapping it (when the pool and all its loaned buffers are gone).
/// `ptr` is page-aligned and valid for `len` bytes between the two calls; an
/// implementation must not read or write through it, only hand it to the
/// runtime.
pub trait PinRegistrar: Send + Sync + fmt::Debug {
    /// Registers `[ptr, ptr + len)`; an error fails the pool's creation.
    fn register(&self, ptr: *mut u8, len: usize) -> Result<()>;
    /// Unregisters a range that [`register`](Self::register) accepted.
    /// Cannot fail (it runs in `Drop`); an implementation records problems
    /// itself.
    fn unregister(&self, ptr: *mut u8, len: usize);
}

// ---------------------------------------------------------------------------
// HostPool
// ---------------------------------------------------------------------------

/// Options of a [`HostPool`].
#[derive(Debug, Clone)]
pub struct HostPoolOptions {
    /// A name for errors and reports. Default `"host"`.
    pub name: String,
    /// Lock the buffers in memory (DeepSpeed `offload_optimizer.pin_memory`
    /// / `offload_param.pin_memory`). Default false.
    pub pin_memory: bool,
    /// Advise `MADV_HUGEPAGE`. Default true.
    pub huge_pages: bool,
    /// With `pin_memory`, also register each buffer with an accelerator
    /// runtime (the CUDA backend). Default none.
    pub registrar: Option<Arc<dyn PinRegistrar>>,
}

impl Default for HostPoolOptions {
    fn default() -> Self {
        HostPoolOptions {
            name: "host".into(),
            pin_memory: false,
            huge_pages: true,
            registrar: None,
        }
    }
}

/// The memory of a pool, shared by the pool and its loaned buffers; it is
/// unmapped when the last of them is dropped.
struct PoolShared {
    name: String,
    /// `slots[i]` is `Some` while buffer `i` is in the pool.
    slots: Mutex<Vec<Option<AlignedBuf>>>,
    /// Capacity of each slot, in slot order (for messages and choice).
    capacities: Vec<usize>,
    /// The sum of the capacities.
    bytes: u64,
    pinned: bool,
    /// The registrar and the ranges it accepted.
    registered: Vec<(usize, usize)>,
    registrar: Option<Arc<dyn PinRegistrar>>,
}

impl PoolShared {
    /// The slots, also after a panic elsewhere poisoned the mutex (a slot
    /// is either taken or not; no state is half-updated).
    fn slots(&self) -> MutexGuard<'_, Vec<Option<AlignedBuf>>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for PoolShared {
    fn drop(&mut self) {
        if let Some(registrar) = &self.registrar {
            for &(ptr, len) in &self.registered {
                registrar.unregister(ptr as *mut u8, len);
            }
        }
        // The buffers unmap themselves when `slots` drops.
    }
}

/// A fixed set of page-aligned host buffers, allocated once and lent out.
///
/// See the [module docs](self). `acquire` never allocates: it hands out the
/// smallest free buffer whose capacity fits, or fails with
/// [`Error::PoolExhausted`]. Cheap to clone (an `Arc`); `Send + Sync`.
#[derive(Clone)]
pub struct HostPool {
    shared: Arc<PoolShared>,
}

impl fmt::Debug for HostPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPool")
            .field("name", &self.shared.name)
            .field("buffers", &self.shared.capacities.len())
            .field("bytes", &self.shared.bytes)
            .field("pinned", &self.shared.pinned)
            .finish_non_exhaustive()
    }
}

impl HostPool {
    /// Allocates one buffer per entry of `sizes` (bytes, each at least 1),
    /// pre-faulted, huge-page advised and, with `pin_memory`, locked and
    /// registered.
    ///
    /// With `pin_memory`, `RLIMIT_MEMLOCK` is checked against the total
    /// first ([`MemLockStatus::check`]), so a low limit fails here, before
    /// anything is mapped, with an error that says how to raise it.
    pub fn new(sizes: &[usize], options: HostPoolOptions) -> Result<HostPool> {
        let mut capacities = Vec::with_capacity(sizes.len());
        for &size in sizes {
            if size == 0 {
                return Err(Error::InvalidSize {
                    op: "HostPool::new",
                    msg: format!("pool `{}`: a buffer size of 0 bytes", options.name),
                });
            }
            capacities
                .push(round_up(size, PAGE_SIZE).ok_or(Error::OutOfHostMemory { bytes: size })?);
        }
        let bytes = capacities.iter().map(|&c| c as u64).sum::<u64>();
        if options.pin_memory {
            MemLockStatus::current().check(bytes)?;
        }
        let mut slots = Vec::with_capacity(sizes.len());
        let mut registered = Vec::new();
        // On an error below, `slots` drops (unmapping) and the ranges
        // registered so far are unregistered by this guard.
        struct Unregister<'a>(
            &'a Option<Arc<dyn PinRegistrar>>,
            &'a mut Vec<(usize, usize)>,
        );
        impl Drop for Unregister<'_> {
            fn drop(&mut self) {
                if let Some(r) = self.0 {
                    for &(ptr, len) in self.1.iter() {
                        r.unregister(ptr as *mut u8, len);
                    }
                }
            }
        }
        let guard = Unregister(&options.registrar, &mut registered);
        for &size in sizes {
            let mut buf = AlignedBuf::with_options(size, options.huge_pages)?;
            if options.pin_memory {
                buf.lock()?;
                if let Some(registrar) = &options.registrar {
                    registrar.register(buf.as_mut_ptr(), buf.capacity())?;
                    guard.1.push((buf.as_ptr() as usize, buf.capacity()));
                }
            }
            slots.push(Some(buf));
        }
        let registered = std::mem::take(guard.1);
        drop(guard);
        Ok(HostPool {
            shared: Arc::new(PoolShared {
                name: options.name,
                slots: Mutex::new(slots),
                capacities,
                bytes,
                pinned: options.pin_memory,
                registered,
                registrar: options.registrar,
            }),
        })
    }

    /// Lends the smallest free buffer whose capacity is at least `bytes`,
    /// with its length set to `bytes`; it returns to the pool when the
    /// [`PooledBuffer`] is dropped. Never allocates on success; fails with
    /// [`Error::PoolExhausted`] when no free buffer fits.
    pub fn acquire(&self, bytes: usize) -> Result<PooledBuffer> {
        let mut slots = self.shared.slots();
        let best = slots
            .iter()
            .enumerate()
            .filter(|(i, s)| s.is_some() && self.shared.capacities[*i] >= bytes)
            .min_by_key(|(i, _)| self.shared.capacities[*i])
            .map(|(i, _)| i);
        let taken = best.and_then(|i| slots[i].take().map(|b| (i, b)));
        let Some((slot, mut buf)) = taken else {
            let free = slots.iter().filter(|s| s.is_some()).count();
            drop(slots);
            return Err(self.exhausted(bytes, free));
        };
        drop(slots);
        // Cannot fail: the capacity was checked above.
        let _ = buf.set_len(bytes);
        Ok(PooledBuffer {
            buf: Some(buf),
            slot,
            pool: Arc::clone(&self.shared),
        })
    }

    fn exhausted(&self, bytes: usize, free: usize) -> Error {
        let largest = self.shared.capacities.iter().max().copied().unwrap_or(0);
        let msg = if bytes > largest {
            format!(
                "{bytes} bytes asked for, but the largest of its {} buffers holds {largest} \
                 bytes (the memory plan sized the pool too small)",
                self.shared.capacities.len()
            )
        } else {
            format!(
                "{bytes} bytes asked for, but no free buffer fits: {free} of {} buffers \
                 ({} bytes in all) are free, the rest are in use (a buffer was not given back, \
                 or the plan allows fewer tiles in flight)",
                self.shared.capacities.len(),
                self.shared.bytes
            )
        };
        Error::PoolExhausted {
            pool: self.shared.name.clone(),
            msg,
        }
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Bytes the pool holds (all buffers, lent or not; capacities).
    pub fn bytes_held(&self) -> u64 {
        self.shared.bytes
    }

    /// The number of buffers.
    pub fn buffer_count(&self) -> usize {
        self.shared.capacities.len()
    }

    /// The capacity of each buffer, in the order of `sizes` at creation.
    pub fn capacities(&self) -> &[usize] {
        &self.shared.capacities
    }

    /// The number of buffers in the pool now (not lent out).
    pub fn available(&self) -> usize {
        self.shared.slots().iter().filter(|s| s.is_some()).count()
    }

    /// Whether the buffers are locked (`pin_memory`).
    pub fn is_pinned(&self) -> bool {
        self.shared.pinned
    }

    /// Accounts [`bytes_held`](Self::bytes_held) in `tracker` under
    /// ([`Tier::Host`], `category`) for as long as the returned
    /// [`Allocation`] lives; the engine keeps it next to the pool.
    pub fn account(&self, tracker: &MemoryTracker, category: Category) -> Allocation {
        tracker.allocate(Tier::Host, category, self.shared.bytes)
    }
}

/// A buffer lent by a [`HostPool`]; dropping it gives it back.
///
/// Dereferences to its bytes (`[u8]`). It can be moved into an NVMe request
/// and comes back when the request is waited on.
pub struct PooledBuffer {
    /// Always `Some` until drop.
    buf: Option<AlignedBuf>,
    slot: usize,
    pool: Arc<PoolShared>,
}

impl PooledBuffer {
    fn inner(&self) -> &AlignedBuf {
        // `buf` is `Some` from construction until `drop`.
        match &self.buf {
            Some(b) => b,
            None => unreachable!("PooledBuffer used after drop"),
        }
    }

    fn inner_mut(&mut self) -> &mut AlignedBuf {
        match &mut self.buf {
            Some(b) => b,
            None => unreachable!("PooledBuffer used after drop"),
        }
    }

    /// The length in bytes (as asked for in [`HostPool::acquire`]).
    pub fn len(&self) -> usize {
        self.inner().len()
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.inner().is_empty()
    }

    /// The capacity of the buffer's slot.
    pub fn capacity(&self) -> usize {
        self.inner().capacity()
    }

    /// Sets the length to `len <= capacity()`.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        self.inner_mut().set_len(len)
    }

    /// Whether the pages are locked.
    pub fn is_locked(&self) -> bool {
        self.inner().is_locked()
    }

    /// The slot index in the pool (stable across loans: the same slot is
    /// the same memory).
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// A pointer to the first byte (page-aligned).
    pub fn as_ptr(&self) -> *const u8 {
        self.inner().as_ptr()
    }

    /// A mutable pointer to the first byte (page-aligned).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.inner_mut().as_mut_ptr()
    }

    /// The bytes viewed as `T`.
    pub fn as_slice_of<T: bytemuck::Pod>(&self) -> Result<&[T]> {
        self.inner().as_slice_of()
    }

    /// The bytes viewed mutably as `T`.
    pub fn as_mut_slice_of<T: bytemuck::Pod>(&mut self) -> Result<&mut [T]> {
        self.inner_mut().as_mut_slice_of()
    }
}

impl Deref for PooledBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.inner()
    }
}

impl DerefMut for PooledBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.inner_mut()
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut slots = self.pool.slots();
            if let Some(slot) = slots.get_mut(self.slot) {
                *slot = Some(buf);
            }
        }
    }
}

impl fmt::Debug for PooledBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledBuffer")
            .field("pool", &self.pool.name)
            .field("slot", &self.slot)
            .field("buf", &self.buf)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static_assertions::assert_impl_all!(AlignedBuf: Send, Sync);
    static_assertions::assert_impl_all!(HostPool: Send, Sync, Clone);
    static_assertions::assert_impl_all!(PooledBuffer: Send, Sync);

    #[test]
    fn rounding() {
        assert_eq!(round_up(0, 4096), Some(0));
        assert_eq!(round_up(1, 4096), Some(4096));
        assert_eq!(round_up(4096, 4096), Some(4096));
        assert_eq!(round_up(usize::MAX, 4096), None);
    }

    #[test]
    fn large_buffers_are_huge_page_aligned() {
        let b = AlignedBuf::new(HUGE_PAGE + 1).unwrap();
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(b.capacity(), HUGE_PAGE + PAGE_SIZE);
        assert!(b.iter().all(|&x| x == 0));
        let small = AlignedBuf::with_options(10, false).unwrap();
        assert_eq!(small.as_ptr() as usize % PAGE_SIZE, 0);
        assert_eq!(small.len(), 10);
        assert!(AlignedBuf::new(0).is_err());
    }

    #[test]
    fn typed_views() {
        let mut b = AlignedBuf::new(16).unwrap();
        b.as_mut_slice_of::<f32>().unwrap().fill(2.5);
        assert_eq!(b.as_slice_of::<f32>().unwrap(), &[2.5; 4]);
        b.set_len(6).unwrap();
        assert!(b.as_slice_of::<f32>().is_err());
        assert!(b.set_len(PAGE_SIZE + 1).is_err());
    }

    #[test]
    fn memlock_check_is_pure() {
        let unlimited = MemLockStatus {
            limit: None,
            locked: 0,
            cap_ipc_lock: false,
        };
        assert!(unlimited.check(u64::MAX).is_ok());
        let capped = MemLockStatus {
            limit: Some(1 << 20),
            locked: 4096,
            cap_ipc_lock: true,
        };
        assert!(capped.check(1 << 30).is_ok());
        let low = MemLockStatus {
            cap_ipc_lock: false,
            ..capped
        };
        assert!(low.check((1 << 20) - 4096).is_ok());
        let msg = low.check((1 << 20) - 4095).unwrap_err().to_string();
        assert!(msg.contains("1048576 bytes"), "{msg}");
    }
}
