//! A pinned pool under a real, lowered `RLIMIT_MEMLOCK`.
//!
//! Its own test binary (its own process), because it lowers a process-wide
//! limit; it holds one test so nothing else runs under that limit. It also
//! drops `CAP_IPC_LOCK` from the test thread, which would otherwise let root
//! lock past the limit.

use zero_offload::host::{HostPool, HostPoolOptions, MemLockStatus};
use zero_offload::Error;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
const CAP_IPC_LOCK: u32 = 14;

/// Removes CAP_IPC_LOCK from the calling thread's effective set.
fn drop_cap_ipc_lock() -> std::io::Result<()> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes one header and two CapData structs (version 3),
    // all owned here and laid out as the kernel's structs (repr(C)).
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    data[0].effective &= !(1 << CAP_IPC_LOCK);
    // SAFETY: as above; capset only reads them. Dropping an effective
    // capability is always allowed.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[test]
fn pinned_pool_over_the_limit_fails_with_instructions() {
    drop_cap_ipc_lock().unwrap();
    let limit: u64 = 64 << 10;
    let rl = libc::rlimit {
        rlim_cur: limit,
        rlim_max: libc::RLIM_INFINITY,
    };
    // Keep the hard limit: only the soft one is lowered (always permitted
    // when the hard limit stays as it is, unless it is lower already).
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read or write one rlimit struct owned here.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old), 0);
        let rl = libc::rlimit {
            rlim_max: old.rlim_max,
            ..rl
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl), 0);
    }
    let status = MemLockStatus::current();
    assert_eq!(status.limit, Some(limit));
    assert!(!status.cap_ipc_lock, "CAP_IPC_LOCK was dropped");

    let options = HostPoolOptions {
        pin_memory: true,
        ..HostPoolOptions::default()
    };
    let err = HostPool::new(&[1 << 20], options.clone()).unwrap_err();
    let Error::PinMemory { needed, .. } = &err else {
        panic!("unexpected error {err}");
    };
    assert_eq!(*needed, 1 << 20);
    let msg = err.to_string();
    for want in [
        "65536 bytes",
        "1048576",
        "ulimit -l",
        "limits.conf",
        "memlock=-1",
    ] {
        assert!(msg.contains(want), "missing {want:?} in: {msg}");
    }

    // Within the limit, pinning works and the pages are locked.
    let before = MemLockStatus::current().locked;
    let pool = HostPool::new(&[16 << 10], options.clone()).unwrap();
    assert!(pool.acquire(1).unwrap().is_locked());
    assert!(MemLockStatus::current().locked >= before + (16 << 10));
    drop(pool);

    // Unpinned pools ignore the limit.
    let pool = HostPool::new(&[1 << 20], HostPoolOptions::default()).unwrap();
    assert!(!pool.acquire(1).unwrap().is_locked());
}
