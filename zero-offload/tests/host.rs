//! The host-memory pool: reuse without allocation, exhaustion, pinning.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::{Arc, Mutex};

use zero_core::memory::{Category, MemoryTracker, Tier};
use zero_offload::host::{HostPool, HostPoolOptions, MemLockStatus, PinRegistrar, PAGE_SIZE};
use zero_offload::{Error, Result};

/// Counts heap allocations made by the current thread, so a test can prove
/// that a code path does not allocate while other tests run in parallel.
struct CountingAlloc;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // try_with: the thread-local may already be gone at thread exit.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards to the system allocator unchanged; counting touches only
// a const-initialized thread-local without a destructor.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller upholds `alloc`'s contract, passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

#[test]
fn buffers_are_reused_without_allocation() {
    let pool = HostPool::new(&[3 << 20, 1 << 20, 10_000], HostPoolOptions::default()).unwrap();
    assert_eq!(pool.buffer_count(), 3);
    assert_eq!(pool.capacities(), &[3 << 20, 1 << 20, 12_288]);
    assert_eq!(pool.bytes_held(), (4 << 20) + 12_288);

    // First loans: remember where each slot's memory is.
    let mut seen = std::collections::HashMap::new();
    for bytes in [5000, 1 << 20, 2 << 20] {
        let b = pool.acquire(bytes).unwrap();
        seen.insert(b.slot(), b.as_ptr() as usize);
    }
    assert_eq!(seen.len(), 3, "each size went to its own best-fitting slot");

    let before = allocs();
    for i in 0..1000usize {
        let small = pool.acquire(1 + i % 10_000).unwrap();
        let mut mid = pool.acquire(1 << 20).unwrap();
        let big = pool.acquire(3 << 20).unwrap();
        // Smallest fit: the small request takes the small slot while free.
        assert_eq!(small.capacity(), 12_288);
        assert_eq!(mid.capacity(), 1 << 20);
        assert_eq!(big.capacity(), 3 << 20);
        for b in [&small, &big] {
            assert_eq!(
                b.as_ptr() as usize,
                seen[&b.slot()],
                "same memory every loan"
            );
            assert_eq!(b.as_ptr() as usize % PAGE_SIZE, 0);
        }
        mid[i] = i as u8;
        assert_eq!(mid.as_ptr() as usize, seen[&mid.slot()]);
        assert_eq!(pool.available(), 0);
    }
    assert_eq!(allocs() - before, 0, "acquire/drop must not allocate");
    assert_eq!(pool.available(), 3);

    // Contents survive a loan (reused memory, not fresh zeros).
    let mut b = pool.acquire(1 << 20).unwrap();
    b.as_mut_slice_of::<f32>().unwrap().fill(7.0);
    let slot = b.slot();
    drop(b);
    let b = pool.acquire(1 << 20).unwrap();
    assert_eq!(b.slot(), slot);
    assert!(b.as_slice_of::<f32>().unwrap().iter().all(|&x| x == 7.0));
}

#[test]
fn pages_are_prefaulted() {
    let pool = HostPool::new(&[4 << 20, 8192], HostPoolOptions::default()).unwrap();
    for bytes in [4 << 20, 8192] {
        let b = pool.acquire(bytes).unwrap();
        let pages = b.capacity() / PAGE_SIZE;
        let mut resident = vec![0u8; pages];
        // SAFETY: the range is the buffer's own mapping (page-aligned, capacity
        // bytes) and `resident` has one byte per page.
        let rc =
            unsafe { libc::mincore(b.as_ptr() as *mut _, b.capacity(), resident.as_mut_ptr()) };
        assert_eq!(rc, 0);
        let missing = resident.iter().filter(|&&r| r & 1 == 0).count();
        assert_eq!(
            missing, 0,
            "{missing} of {pages} pages not resident after creation"
        );
    }
}

#[test]
fn exhaustion_is_an_error_not_an_allocation() {
    let pool = HostPool::new(
        &[8192, 8192],
        HostPoolOptions {
            name: "optimizer-tiles".into(),
            ..HostPoolOptions::default()
        },
    )
    .unwrap();
    let a = pool.acquire(8192).unwrap();
    let _b = pool.acquire(100).unwrap();
    let err = pool.acquire(1).unwrap_err();
    match &err {
        Error::PoolExhausted { pool, msg } => {
            assert_eq!(pool, "optimizer-tiles");
            assert!(msg.contains("0 of 2 buffers"), "{msg}");
        }
        e => panic!("unexpected error {e}"),
    }
    drop(a);
    assert!(pool.acquire(8192).is_ok());
    let err = pool.acquire(8193).unwrap_err().to_string();
    assert!(err.contains("largest of its 2 buffers holds 8192"), "{err}");
    assert!(HostPool::new(&[0], HostPoolOptions::default()).is_err());
}

#[test]
fn buffers_outlive_the_pool_handle() {
    let pool = HostPool::new(&[4096], HostPoolOptions::default()).unwrap();
    let mut b = pool.acquire(4096).unwrap();
    drop(pool);
    b.fill(3);
    assert!(b.iter().all(|&x| x == 3));
    drop(b); // unmaps now; must not crash
}

#[test]
fn bytes_are_accounted_in_the_tracker() {
    let tracker = MemoryTracker::new(0);
    let pool = HostPool::new(&[1 << 20, 5000], HostPoolOptions::default()).unwrap();
    let held = pool.account(&tracker, Category::Moments);
    assert_eq!(held.bytes(), (1 << 20) + 8192);
    assert_eq!(
        tracker.current(Tier::Host, Category::Moments),
        (1 << 20) + 8192
    );
    drop(held);
    assert_eq!(tracker.tier_current(Tier::Host), 0);
}

/// Records the ranges it is given, like cudaHostRegister would.
#[derive(Debug, Default)]
struct Recorder {
    registered: Mutex<Vec<(usize, usize)>>,
    unregistered: Mutex<Vec<(usize, usize)>>,
    fail_after: Option<usize>,
}

impl PinRegistrar for Recorder {
    fn register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let mut r = self.registered.lock().unwrap();
        if self.fail_after == Some(r.len()) {
            return Err(Error::Cuda("cudaHostRegister failed (test)".into()));
        }
        r.push((ptr as usize, len));
        Ok(())
    }
    fn unregister(&self, ptr: *mut u8, len: usize) {
        self.unregistered.lock().unwrap().push((ptr as usize, len));
    }
}

fn pinned(name: &str, registrar: Option<Arc<dyn PinRegistrar>>) -> HostPoolOptions {
    HostPoolOptions {
        name: name.into(),
        pin_memory: true,
        registrar,
        ..HostPoolOptions::default()
    }
}

#[test]
fn pinned_pool_locks_or_explains_the_limit() {
    let sizes = [16 << 10, 16 << 10];
    let status = MemLockStatus::current();
    let recorder = Arc::new(Recorder::default());
    let result = HostPool::new(&sizes, pinned("pinned", Some(recorder.clone())));
    match status.check(32 << 10) {
        Ok(()) => {
            let pool = result.unwrap();
            assert!(pool.is_pinned());
            let a = pool.acquire(1).unwrap();
            let b = pool.acquire(1).unwrap();
            assert!(a.is_locked() && b.is_locked());
            let mut got = recorder.registered.lock().unwrap().clone();
            got.sort_unstable();
            let mut want = vec![
                (a.as_ptr() as usize, 16 << 10),
                (b.as_ptr() as usize, 16 << 10),
            ];
            want.sort_unstable();
            assert_eq!(got, want, "each buffer registered once, after allocation");
            assert!(recorder.unregistered.lock().unwrap().is_empty());
            drop((a, b, pool));
            let mut gone = recorder.unregistered.lock().unwrap().clone();
            gone.sort_unstable();
            assert_eq!(gone, want, "each buffer unregistered when the pool is gone");
        }
        Err(_) => {
            let msg = result.unwrap_err().to_string();
            assert!(msg.contains("ulimit -l"), "{msg}");
        }
    }
}

#[test]
fn a_failing_registrar_fails_creation_and_unwinds() {
    if MemLockStatus::current().check(32 << 10).is_err() {
        println!("skipped: RLIMIT_MEMLOCK below 32 KiB");
        return;
    }
    let recorder = Arc::new(Recorder {
        fail_after: Some(1),
        ..Recorder::default()
    });
    let err =
        HostPool::new(&[16 << 10, 16 << 10], pinned("p", Some(recorder.clone()))).unwrap_err();
    assert!(err.to_string().contains("cudaHostRegister"), "{err}");
    let registered = recorder.registered.lock().unwrap().clone();
    assert_eq!(registered.len(), 1);
    assert_eq!(*recorder.unregistered.lock().unwrap(), registered);
}

#[test]
fn memlock_message_states_limit_need_and_fix() {
    let status = MemLockStatus {
        limit: Some(64 << 10),
        locked: 8192,
        cap_ipc_lock: false,
    };
    let err = status.check(1 << 20).unwrap_err();
    let Error::PinMemory { needed, msg } = &err else {
        panic!("unexpected error {err}");
    };
    assert_eq!(*needed, 1 << 20);
    let text = err.to_string();
    for want in [
        "1048576 bytes",                 // needed
        "65536 bytes (64 KiB",           // the limit, also as ulimit -l shows it
        "8192 bytes are locked already", // what is held
        "1056768 bytes in all",
        "ulimit -l",
        "/etc/security/limits.conf",
        "memlock",
        "docker run --ulimit memlock=-1",
    ] {
        assert!(text.contains(want), "missing {want:?} in: {msg}");
    }
    assert!(status.check(56 << 10).is_ok());
}
