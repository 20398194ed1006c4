//! MPI's process-wide lifetime: initialisation, call serialisation, handle
//! ownership and finalisation.
//!
//! MPI can be initialised once per process and finalised once. Every
//! [`MpiComm`](super::MpiComm) (and every buffer from its pool) holds an
//! `Arc<Runtime>`; the first `MpiComm::init` initialises MPI, the last drop
//! finalises it. Handles (communicators, windows, operations) created by
//! the communicators are *retired* here when dropped and freed just before
//! `MPI_Finalize`, in the order they were created: freeing a window is
//! collective (it synchronises the window's ranks), so doing it at drop time
//! could block a rank on a peer that still uses its communicator, or that
//! failed. At finalisation every rank frees the same handles in the same
//! order, so the collective frees line up. A dropped communicator's pool
//! pages are returned to the kernel at drop time (see `window.rs`), so only
//! address space stays reserved until then.

use std::any::Any;
use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use ::mpi::environment::Universe;
use ::mpi::Threading;

use super::raw::{self, MPI_Comm, MPI_Op, MPI_Win};
use crate::{Error, Result};

/// A handle whose freeing waits for finalisation.
pub(crate) enum Retired {
    Comm(MPI_Comm),
    Win(MPI_Win),
    Op(MPI_Op),
    /// Memory MPI may still read until it is finalised (send buffers of
    /// requests that were freed before completion).
    Memory(#[allow(dead_code)] Box<dyn Any + Send>),
}

/// The process's MPI library, initialised.
pub(crate) struct Runtime {
    /// `None` when someone else initialised MPI (they finalise it).
    universe: Mutex<Option<Universe>>,
    /// Held around every MPI call when the library is below
    /// `MPI_THREAD_MULTIPLE` (several communicators' progress threads may
    /// call MPI; `MPI_THREAD_SERIALIZED` forbids concurrent calls).
    serialize: Option<Mutex<()>>,
    /// `MPI_IN_PLACE` of this library, where known (see [`Runtime::in_place`]).
    in_place: Option<usize>,
    next_id: AtomicU64,
    retired: Mutex<Vec<(u64, Retired)>>,
}

// SAFETY: the raw handles in `retired` are process-global identifiers that
// any thread may pass to MPI; calls are serialised by `serialize` where the
// library requires it. The Universe is only dropped (finalised) once.
unsafe impl Send for Runtime {}
// SAFETY: as above; all interior state is behind mutexes or atomics.
unsafe impl Sync for Runtime {}

static RUNTIME: Mutex<Weak<Runtime>> = Mutex::new(Weak::new());

fn level_name(level: c_int) -> String {
    if level == raw::thread_multiple() {
        "MPI_THREAD_MULTIPLE".into()
    } else if level == raw::thread_serialized() {
        "MPI_THREAD_SERIALIZED".into()
    } else {
        // SINGLE and FUNNELED: below what zero needs.
        match Threading::from(level) {
            Threading::Single => "MPI_THREAD_SINGLE".into(),
            Threading::Funneled => "MPI_THREAD_FUNNELED".into(),
            other => format!("{other:?}"),
        }
    }
}

impl Runtime {
    /// The process's runtime: initialises MPI (asking for
    /// `MPI_THREAD_MULTIPLE`) on first use.
    pub(crate) fn get() -> Result<Arc<Runtime>> {
        let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(rt) = slot.upgrade() {
            return Ok(rt);
        }
        if ::mpi::environment::is_finalized() {
            return Err(Error::Mpi(
                "MPI was finalized when the last MpiComm (and its buffers) was dropped, and MPI \
                 cannot be initialized twice in one process; keep an MpiComm alive for as long \
                 as the program uses MPI"
                    .into(),
            ));
        }
        let (universe, level) = match ::mpi::initialize_with_threading(Threading::Multiple) {
            Some((u, _)) => {
                // SAFETY: MPI was just initialised.
                (Some(u), unsafe { raw::query_thread()? })
            }
            // Initialised by someone else (another library, or the caller
            // through rsmpi): use it, leave finalisation to them.
            // SAFETY: MPI is initialised (initialize returns None only then)
            // and not finalised (checked above).
            None => (None, unsafe { raw::query_thread()? }),
        };
        if level < raw::thread_serialized() {
            // Dropping `universe` finalises MPI again right away.
            return Err(Error::Mpi(format!(
                "the MPI library provides thread level {}, but zero needs at least \
                 MPI_THREAD_SERIALIZED (each communicator calls MPI from its own progress \
                 thread); use an MPI built with thread support",
                level_name(level)
            )));
        }
        let version = raw::library_version();
        // MPI_IN_PLACE is a macro, not a symbol, so the bindings lack it:
        // `(void *) 1` in Open MPI, `(void *) -1` in MPICH and its
        // derivatives. Elsewhere the native baselines use a copy instead.
        let in_place = if version.contains("Open MPI") {
            Some(1usize)
        } else if ["MPICH", "MVAPICH", "Intel(R) MPI"]
            .iter()
            .any(|n| version.contains(n))
        {
            Some(usize::MAX)
        } else {
            None
        };
        let rt = Arc::new(Runtime {
            universe: Mutex::new(universe),
            serialize: (level < raw::thread_multiple()).then(|| Mutex::new(())),
            in_place,
            next_id: AtomicU64::new(0),
            retired: Mutex::new(Vec::new()),
        });
        *slot = Arc::downgrade(&rt);
        Ok(rt)
    }

    /// Runs `f` (which calls MPI) serialised with every other MPI call of
    /// this process, where the thread level requires it.
    pub(crate) fn call<R>(&self, f: impl FnOnce() -> R) -> R {
        let _guard: Option<MutexGuard<'_, ()>> = self
            .serialize
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()));
        f()
    }

    /// This library's `MPI_IN_PLACE`, if known.
    pub(crate) fn in_place(&self) -> Option<*const std::ffi::c_void> {
        self.in_place.map(|v| v as *const std::ffi::c_void)
    }

    /// A creation number: handles are freed in this order at finalisation.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Hands `what` over to be freed at finalisation.
    pub(crate) fn retire(&self, id: u64, what: Retired) {
        self.retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, what));
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let mut retired = std::mem::take(self.retired.get_mut().unwrap_or_else(|e| e.into_inner()));
        retired.sort_by_key(|(id, _)| *id);
        let mut memory = Vec::new();
        for (_, r) in retired {
            // Errors cannot be reported from here (Drop never fails); the
            // process is shutting MPI down anyway.
            // SAFETY: every retired handle is live, owned by the runtime
            // alone, and no longer used by anyone (its owner was dropped).
            let _ = unsafe {
                match r {
                    Retired::Win(w) => raw::win_free(w),
                    Retired::Comm(c) => raw::comm_free(c),
                    Retired::Op(o) => raw::op_free(o),
                    Retired::Memory(m) => {
                        memory.push(m);
                        Ok(())
                    }
                }
            };
        }
        // MPI_Finalize, if this process initialised MPI.
        drop(
            self.universe
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        drop(memory);
    }
}

/// A communicator owned by this backend; freed at finalisation.
pub(crate) struct Comm {
    raw: MPI_Comm,
    id: u64,
    rank: usize,
    size: usize,
    rt: Arc<Runtime>,
}

// SAFETY: an MPI communicator handle may be used from any thread; calls go
// through `Runtime::call`, which serialises them where required.
unsafe impl Send for Comm {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for Comm {}

impl Comm {
    /// Takes ownership of a communicator just created by a `raw` call.
    ///
    /// # Safety
    /// `raw` is a live communicator that nothing else frees.
    pub(crate) unsafe fn adopt(rt: &Arc<Runtime>, raw: MPI_Comm) -> Result<Comm> {
        let id = rt.next_id();
        // SAFETY: `raw` is live (caller).
        match rt.call(|| unsafe { raw::comm_rank_size(raw) }) {
            Ok((rank, size)) => Ok(Comm {
                raw,
                id,
                rank,
                size,
                rt: rt.clone(),
            }),
            Err(e) => {
                rt.retire(id, Retired::Comm(raw));
                Err(e)
            }
        }
    }

    /// A duplicate of `MPI_COMM_WORLD`, so this backend's traffic never
    /// matches anyone else's.
    pub(crate) fn dup_world(rt: &Arc<Runtime>) -> Result<Comm> {
        // SAFETY: MPI is initialised (rt exists); COMM_WORLD is live.
        let raw = rt.call(|| unsafe { raw::comm_dup(raw::comm_world()) })?;
        // SAFETY: just created, owned by nobody else.
        unsafe { Comm::adopt(rt, raw) }
    }

    /// A duplicate of this communicator.
    pub(crate) fn dup(&self) -> Result<Comm> {
        // SAFETY: self.raw is live while self lives.
        let raw = self.rt.call(|| unsafe { raw::comm_dup(self.raw) })?;
        // SAFETY: just created, owned by nobody else.
        unsafe { Comm::adopt(&self.rt, raw) }
    }

    /// The ranks of this communicator that share memory with this one,
    /// ordered by their rank here.
    pub(crate) fn split_shared(&self) -> Result<Comm> {
        let key = self.rank as c_int;
        // SAFETY: self.raw is live.
        let raw = self
            .rt
            .call(|| unsafe { raw::comm_split_shared(self.raw, key) })?;
        // SAFETY: just created, owned by nobody else.
        unsafe { Comm::adopt(&self.rt, raw) }
    }

    /// `MPI_Comm_split` by `color`, ordered by `key`.
    pub(crate) fn split(&self, color: usize, key: usize) -> Result<Comm> {
        // SAFETY: self.raw is live.
        let raw = self
            .rt
            .call(|| unsafe { raw::comm_split(self.raw, color as c_int, key as c_int) })?;
        // SAFETY: just created, owned by nobody else.
        unsafe { Comm::adopt(&self.rt, raw) }
    }

    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The raw handle, for `raw` calls (valid while `self` lives).
    pub(crate) fn raw(&self) -> MPI_Comm {
        self.raw
    }

    /// The runtime this communicator belongs to.
    pub(crate) fn runtime(&self) -> &Arc<Runtime> {
        &self.rt
    }

    /// Blocking barrier (set-up only).
    pub(crate) fn barrier(&self) -> Result<()> {
        // SAFETY: self.raw is live.
        self.rt.call(|| unsafe { raw::barrier(self.raw) })
    }

    /// Blocking all-reduce of one integer (set-up only).
    pub(crate) fn all_reduce_i64(&self, x: i64, op: MPI_Op) -> Result<i64> {
        // SAFETY: self.raw is live; `op` is a predefined operation.
        self.rt
            .call(|| unsafe { raw::allreduce_i64(self.raw, x, op) })
    }

    /// Blocking all-gather of one integer per rank (set-up only).
    pub(crate) fn all_gather_i64(&self, x: i64) -> Result<Vec<i64>> {
        // SAFETY: self.raw is live and has `size` ranks.
        self.rt
            .call(|| unsafe { raw::allgather_i64(self.raw, x, self.size) })
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.rt.retire(self.id, Retired::Comm(self.raw));
    }
}

/// A shared-memory window owned by this backend; freed at finalisation.
pub(crate) struct Window {
    raw: MPI_Win,
    id: u64,
    rt: Arc<Runtime>,
}

// SAFETY: a window handle may be used from any thread (calls serialised by
// `Runtime::call` where required); the mapped memory is shared by design.
unsafe impl Send for Window {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for Window {}

impl Window {
    /// `MPI_Win_allocate_shared` over `comm` (ranks sharing memory) of
    /// `bytes` bytes for this rank.
    pub(crate) fn allocate_shared(comm: &Comm, bytes: usize, noncontig: bool) -> Result<Window> {
        let rt = comm.runtime();
        // SAFETY: comm.raw is live and from split_shared (or a split of it).
        let (raw, _base) =
            rt.call(|| unsafe { raw::win_allocate_shared(comm.raw(), bytes, noncontig) })?;
        Ok(Window {
            raw,
            id: rt.next_id(),
            rt: rt.clone(),
        })
    }

    /// Where rank `r`'s segment is mapped in this process, and its size.
    pub(crate) fn query(&self, r: usize) -> Result<(*mut u8, usize)> {
        // SAFETY: self.raw is live; `r` is a rank of its communicator (the
        // callers iterate over the communicator's size).
        self.rt
            .call(|| unsafe { raw::win_shared_query(self.raw, r) })
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        self.rt.retire(self.id, Retired::Win(self.raw));
    }
}

/// A user-defined MPI reduction; freed at finalisation.
pub(crate) struct UserOp {
    raw: MPI_Op,
    id: u64,
    rt: Arc<Runtime>,
}

// SAFETY: an MPI_Op handle may be used from any thread.
unsafe impl Send for UserOp {}
// SAFETY: as above; never mutated.
unsafe impl Sync for UserOp {}

impl UserOp {
    /// Creates the operation (`commute == false`: MPI applies it in rank
    /// order).
    ///
    /// # Safety
    /// `f` must be sound for every datatype the operation is used with.
    pub(crate) unsafe fn create(
        rt: &Arc<Runtime>,
        f: ::mpi::ffi::MPI_User_function,
        commute: bool,
    ) -> Result<UserOp> {
        // SAFETY: MPI is initialised; `f` is sound (caller).
        let raw = rt.call(|| unsafe { raw::op_create(f, commute) })?;
        Ok(UserOp {
            raw,
            id: rt.next_id(),
            rt: rt.clone(),
        })
    }

    /// The raw handle.
    pub(crate) fn raw(&self) -> MPI_Op {
        self.raw
    }
}

impl Drop for UserOp {
    fn drop(&mut self) {
        self.rt.retire(self.id, Retired::Op(self.raw));
    }
}
