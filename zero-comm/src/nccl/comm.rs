//! [`NcclComm`]: one rank's NCCL communicator, its non-blocking
//! initialization, and the bounded waits that turn hangs into errors.
//!
//! ```text
//!  new(rank, world, id) ─▶ ncclCommInitRankConfig(blocking = 0)
//!                            │ returns at once; NCCL's thread bootstraps
//!                            ▼
//!                          poll ncclCommGetAsyncError ─ ncclInProgress ─▶ again,
//!                            │ ncclSuccess            until the timeout
//!                            ▼                                │ expired / error
//!                          ready                       ncclCommAbort ─▶ Err
//!
//!  drop ─▶ ncclCommFinalize ─ poll ≤ timeout ─▶ ncclCommDestroy
//!          (failed or expired: ncclCommAbort)
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DriverError};
use cudarc::nccl::sys;
use zero_core::CudaDevice;

use super::ffi::{self, api};
use super::{NcclError, NcclFailure, NcclId};
use crate::{CommOptions, Communicator, Error, Result};

/// Why a wait expired, for [`Error::Timeout`]'s `phase`.
pub(crate) const PHASE_INIT: &str = "nccl init: not every rank joined (NCCL cannot say which: \
     all other ranks are listed); the communicator was aborted";
pub(crate) const PHASE_ENQUEUE: &str = "nccl launch: NCCL did not finish enqueueing the \
     collective; the communicator was aborted";
pub(crate) const PHASE_DEVICE: &str = "nccl: the collective did not finish on the GPU: a rank \
     did not call it or called a different one (NCCL cannot say which: all other ranks are \
     listed); the communicator was aborted";

/// One rank of an NCCL communicator: collectives on device buffers of one
/// GPU, enqueued on one communication stream.
///
/// Create it with [`NcclGroup`](super::NcclGroup) (ranks as threads of
/// this process), [`NcclComm::from_communicator`] (ranks as processes,
/// e.g. under `mpirun`: the NCCL id travels over MPI) or [`NcclComm::new`]
/// (an id obtained otherwise). The collectives are in `collectives.rs`.
///
/// `NcclComm` is `Send + Sync`: every NCCL call on it is serialized by an
/// internal lock, and NCCL lets any thread use a communicator as long as
/// calls do not overlap. After any error (a timeout, an NCCL error, bad
/// arguments, a mismatch) the communicator is failed and aborted (so no
/// kernel of it stays stuck), and later collectives return
/// [`Error::Poisoned`].
///
/// ```no_run
/// use std::sync::Arc;
/// use zero_comm::{launch, CommOptions, Communicator, NcclComm, ReduceOp};
/// use zero_core::CudaDevice;
///
/// // Under `mpirun -n 2`: one process per GPU, the NCCL id broadcast over MPI.
/// let opts = CommOptions::from_env()?;
/// launch(2, &opts, |host| -> zero_comm::Result<()> {
///     let device = CudaDevice::new(host.rank())?;
///     let stream = device.context().new_stream().expect("a stream");
///     let nccl = NcclComm::from_communicator(&host, &device, stream.clone(), &opts)?;
///     let mut grads = stream.clone_htod(&vec![1.0f32; 1 << 20]).expect("a copy");
///     nccl.all_reduce(&mut grads, ReduceOp::Avg)?.wait()?;
///     Ok(())
/// })?;
/// # Ok::<(), zero_comm::Error>(())
/// ```
pub struct NcclComm {
    rank: usize,
    world: usize,
    ordinal: usize,
    version: i32,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) opts: CommOptions,
    /// The last sequence number handed out (1 is the first collective).
    seq: AtomicU64,
    state: Mutex<State>,
}

/// What the lock guards: the NCCL handle and whether it failed.
pub(crate) struct State {
    /// The communicator; null once aborted (or after a failed init).
    pub(crate) raw: sys::ncclComm_t,
    /// The first error, which failed the communicator.
    pub(crate) failed: Option<String>,
    /// Device words for [`CommOptions::validate`] (`None` when off).
    pub(crate) scratch: Option<CudaSlice<u64>>,
}

// SAFETY: `raw` is an NCCL communicator handle, which NCCL lets any thread
// use provided calls on it do not overlap; `State` lives inside the
// communicator's Mutex, so every call through `raw` is serialized.
unsafe impl Send for State {}

/// How polling waits between looks: yield for the first ~100 µs (short
/// collectives finish there), then sleep, backing off to 1 ms.
pub(crate) fn backoff(polls: &mut u32, started: Instant) {
    *polls += 1;
    let waited = started.elapsed();
    if waited < Duration::from_micros(100) {
        std::thread::yield_now();
    } else {
        let us = (waited.as_micros() / 8).clamp(20, 1000) as u64;
        std::thread::sleep(Duration::from_micros(us));
    }
}

impl NcclComm {
    /// Joins the communicator named by `id` as `rank` of `world`, on
    /// `device`, with `stream` (a stream of that device) as the
    /// communication stream. All ranks must call this concurrently, each
    /// on its own GPU.
    ///
    /// Bounded by `opts.timeout`: when not every rank joins in time, or
    /// NCCL fails, the half-made communicator is aborted and this returns
    /// [`Error::Timeout`] or an [`NcclError`]. Without a usable NCCL
    /// library: an [`NcclError`] ([`NcclFailure::Missing`]), no panic.
    pub fn new(
        rank: usize,
        world: usize,
        id: &NcclId,
        device: &CudaDevice,
        stream: Arc<CudaStream>,
        opts: &CommOptions,
    ) -> Result<NcclComm> {
        let version = ffi::library().map_err(|e| NcclError {
            rank: Some(rank),
            ..e
        })?;
        let invalid = |msg: String| Error::InvalidArgument {
            rank,
            op: "nccl_init",
            msg,
        };
        if world == 0 || rank >= world {
            return Err(invalid(format!(
                "rank {rank} is not a rank of a group of {world}"
            )));
        }
        let (Ok(n), Ok(r)) = (i32::try_from(world), i32::try_from(rank)) else {
            return Err(invalid(format!(
                "{world} ranks: NCCL counts ranks in an int"
            )));
        };
        let ordinal = device.ordinal();
        let on = stream.context().ordinal();
        if on != ordinal {
            return Err(invalid(format!(
                "the communication stream is on cuda:{on} but the device is cuda:{ordinal}"
            )));
        }
        let comm = NcclComm {
            rank,
            world,
            ordinal,
            version,
            stream,
            opts: opts.clone(),
            seq: AtomicU64::new(0),
            state: Mutex::new(State {
                raw: std::ptr::null_mut(),
                failed: None,
                scratch: None,
            }),
        };
        comm.bind("nccl_init")?;
        let mut config = ffi::nonblocking_config();
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: the library and this symbol are present (library());
        // `raw` and `config` are valid for the call and NCCL copies the
        // config; the rank and size were checked; this device's context is
        // current, which is the device NCCL binds the communicator to.
        let r = unsafe {
            api::ncclCommInitRankConfig(&mut raw, n, ffi::sys_id(id.as_bytes()), r, &mut config)
        };
        let started = Instant::now();
        {
            let mut st = comm.lock();
            st.raw = raw;
            if r != sys::ncclResult_t::ncclSuccess && r != sys::ncclResult_t::ncclInProgress {
                let e = comm.nccl_error(
                    "nccl_init",
                    call_failure_of(&st, "ncclCommInitRankConfig", r),
                );
                comm.fail_locked(&mut st, &e.to_string());
                return Err(e.into());
            }
        }
        let mut polls = 0;
        loop {
            let mut st = comm.lock();
            if comm.async_ready_locked(&mut st, "nccl_init", 0)? {
                break;
            }
            let waited = started.elapsed();
            if waited >= comm.opts.timeout {
                return Err(comm.expire_locked(&mut st, "nccl_init", 0, PHASE_INIT, waited));
            }
            drop(st);
            backoff(&mut polls, started);
        }
        if comm.opts.validate {
            let scratch = comm
                .stream
                .alloc_zeros::<u64>(super::describe::WORDS * world)
                .map_err(|e| comm.cuda_error("nccl_init", "cuMemAllocAsync", e))?;
            comm.lock().scratch = Some(scratch);
        }
        Ok(comm)
    }

    /// Joins an NCCL communicator over the ranks of `host` (e.g. an MPI
    /// communicator under `mpirun`): rank 0 creates the id and broadcasts
    /// its 128 bytes with [`Communicator::broadcast`], then every rank
    /// initializes as [`NcclComm::new`] does, with `host`'s rank and size.
    ///
    /// Every rank takes part in the broadcast even when NCCL is missing on
    /// it, so a failure anywhere gives errors, not a hang.
    pub fn from_communicator<C: Communicator>(
        host: &C,
        device: &CudaDevice,
        stream: Arc<CudaStream>,
        opts: &CommOptions,
    ) -> Result<NcclComm> {
        let rank = host.rank();
        let local = ffi::library().map_err(|e| NcclError {
            rank: Some(rank),
            ..e
        });
        let id = NcclId::share_with(host, || {
            local.clone()?;
            NcclId::new()
        });
        local?;
        NcclComm::new(rank, host.world_size(), &id?, device, stream, opts)
    }

    /// This rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The GPU of this rank.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The communication stream: every collective of this communicator is
    /// enqueued on it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The options it was created with.
    pub fn options(&self) -> &CommOptions {
        &self.opts
    }

    /// The NCCL version code of the loaded library (e.g. 22105 for 2.21.5).
    pub fn nccl_version(&self) -> i32 {
        self.version
    }

    /// The error that failed this communicator, if one did.
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    /// Aborts the communicator (`ncclCommAbort`): its kernels stop, and
    /// every pending and later collective fails. For when the caller knows
    /// a peer is gone (another rank reported an error).
    pub fn abort(&self) {
        let mut st = self.lock();
        self.fail_locked(&mut st, "aborted by the caller");
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands out `n` consecutive sequence numbers; the first.
    pub(crate) fn next_seq(&self, n: usize) -> u64 {
        self.seq.fetch_add(n as u64, Ordering::Relaxed) + 1
    }

    /// Makes this rank's GPU current on the calling thread, as NCCL needs.
    pub(crate) fn bind(&self, op: &'static str) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.cuda_error(op, "cuCtxSetCurrent", e))
    }

    pub(crate) fn nccl_error(&self, op: &'static str, failure: NcclFailure) -> NcclError {
        NcclError {
            rank: Some(self.rank),
            op,
            failure,
        }
    }

    pub(crate) fn cuda_error(&self, op: &'static str, call: &'static str, e: DriverError) -> Error {
        self.nccl_error(
            op,
            NcclFailure::Cuda {
                call,
                detail: e.to_string(),
            },
        )
        .into()
    }

    /// [`Error::Poisoned`] if the communicator failed earlier.
    pub(crate) fn check_poisoned(&self, st: &State, op: &'static str, seq: u64) -> Result<()> {
        match &st.failed {
            Some(first) => Err(Error::Poisoned {
                rank: self.rank,
                op,
                seq,
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Records the first failure and aborts the communicator: its kernels
    /// stop (so none stays stuck waiting for a peer that will not come)
    /// and NCCL's threads end; the handle is gone after.
    pub(crate) fn fail_locked(&self, st: &mut State, why: &str) {
        if st.failed.is_none() {
            st.failed = Some(why.to_string());
        }
        let raw = std::mem::replace(&mut st.raw, std::ptr::null_mut());
        if !raw.is_null() {
            let _ = self.stream.context().bind_to_thread();
            // SAFETY: `raw` is a live communicator (aborting nulls it, so
            // this runs once), used by no other thread (we hold the lock);
            // abort is allowed on a communicator in any state, initializing
            // and in-progress included. Its result is ignored: the handle
            // is gone either way.
            let _ = unsafe { api::ncclCommAbort(raw) };
        }
    }

    /// Fails and aborts after a wait expired; the [`Error::Timeout`].
    pub(crate) fn expire_locked(
        &self,
        st: &mut State,
        op: &'static str,
        seq: u64,
        phase: &'static str,
        waited: Duration,
    ) -> Error {
        let e = Error::Timeout {
            rank: self.rank,
            op,
            seq,
            phase,
            waited,
            arrived: vec![self.rank],
            missing: (0..self.world).filter(|&r| r != self.rank).collect(),
        };
        self.fail_locked(st, &e.to_string());
        e
    }

    /// Polls NCCL's state of the communicator once: `true` when it is idle
    /// (`ncclSuccess`), `false` while `ncclInProgress`. An error fails and
    /// aborts the communicator.
    pub(crate) fn async_ready_locked(
        &self,
        st: &mut State,
        op: &'static str,
        seq: u64,
    ) -> Result<bool> {
        self.check_poisoned(st, op, seq)?;
        if st.raw.is_null() {
            return Err(Error::Poisoned {
                rank: self.rank,
                op,
                seq,
                first: "the NCCL communicator was aborted".into(),
            });
        }
        let mut state = sys::ncclResult_t::ncclInProgress;
        // SAFETY: `raw` is live (not null, not aborted) and we hold the
        // lock; NCCL writes one result through the valid pointer.
        let r = unsafe { api::ncclCommGetAsyncError(st.raw, &mut state) };
        let failure = if r != sys::ncclResult_t::ncclSuccess {
            call_failure_of(st, "ncclCommGetAsyncError", r)
        } else {
            match state {
                sys::ncclResult_t::ncclSuccess => return Ok(true),
                sys::ncclResult_t::ncclInProgress => return Ok(false),
                other => call_failure_of(st, "ncclCommGetAsyncError (asynchronous error)", other),
            }
        };
        let e = self.nccl_error(op, failure);
        self.fail_locked(st, &e.to_string());
        Err(e.into())
    }

    /// Polls until NCCL has finished enqueueing (non-blocking calls return
    /// `ncclInProgress` while NCCL works in its own threads); bounded.
    pub(crate) fn wait_enqueued_locked(
        &self,
        st: &mut State,
        op: &'static str,
        seq: u64,
    ) -> Result<()> {
        let started = Instant::now();
        let mut polls = 0;
        while !self.async_ready_locked(st, op, seq)? {
            let waited = started.elapsed();
            if waited >= self.opts.timeout {
                return Err(self.expire_locked(st, op, seq, PHASE_ENQUEUE, waited));
            }
            backoff(&mut polls, started);
        }
        Ok(())
    }

    /// Waits until the work recorded in `event` is done, bounded by the
    /// timeout, watching NCCL's asynchronous errors. With `held`, under
    /// that lock throughout; otherwise the lock is taken per look, so that
    /// other threads can launch meanwhile.
    pub(crate) fn wait_event(
        &self,
        mut held: Option<&mut State>,
        event: &CudaEvent,
        op: &'static str,
        seq: u64,
    ) -> Result<()> {
        let started = Instant::now();
        let mut polls = 0;
        loop {
            let done = event.try_is_complete();
            let finished = match held.as_deref_mut() {
                Some(st) => self.look_locked(st, done, op, seq, started),
                None => self.look_locked(&mut self.lock(), done, op, seq, started),
            }?;
            if finished {
                return Ok(());
            }
            backoff(&mut polls, started);
        }
    }

    /// One look of [`NcclComm::wait_event`]: `true` when finished.
    fn look_locked(
        &self,
        st: &mut State,
        done: std::result::Result<bool, DriverError>,
        op: &'static str,
        seq: u64,
        started: Instant,
    ) -> Result<bool> {
        // An abort (by a timeout elsewhere) lets the kernels exit early,
        // so a completed event proves nothing once the communicator failed.
        self.check_poisoned(st, op, seq)?;
        self.async_ready_locked(st, op, seq)?;
        match done {
            Ok(true) => Ok(true),
            Ok(false) => {
                let waited = started.elapsed();
                if waited >= self.opts.timeout {
                    Err(self.expire_locked(st, op, seq, PHASE_DEVICE, waited))
                } else {
                    Ok(false)
                }
            }
            Err(e) => {
                let err = self.cuda_error(op, "cuEventQuery", e);
                self.fail_locked(st, &err.to_string());
                Err(err)
            }
        }
    }
}

/// The failure of `call` with result `r`, with NCCL's last error.
pub(crate) fn call_failure_of(st: &State, call: &'static str, r: sys::ncclResult_t) -> NcclFailure {
    ffi::call_failure(call, r, st.raw)
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let timeout = self.opts.timeout;
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        // The scratch words are freed on the stream; drop them first.
        st.scratch = None;
        let raw = std::mem::replace(&mut st.raw, std::ptr::null_mut());
        if raw.is_null() {
            return;
        }
        let _ = self.stream.context().bind_to_thread();
        let failed = st.failed.is_some();
        // SAFETY (all blocks below): `raw` is a live communicator owned by
        // this value, which no other thread can reach any more (`&mut
        // self`, and every NcclWork borrowing it is gone); the library is
        // loaded (it was, to create `raw`). Results are ignored: Drop
        // cannot report them, and an abort ends the handle in any case.
        let abort = |raw| {
            // SAFETY: see above.
            let _ = unsafe { api::ncclCommAbort(raw) };
        };
        if failed {
            abort(raw);
            return;
        }
        // SAFETY: see above.
        let r = unsafe { api::ncclCommFinalize(raw) };
        if r != sys::ncclResult_t::ncclSuccess && r != sys::ncclResult_t::ncclInProgress {
            abort(raw);
            return;
        }
        let started = Instant::now();
        let mut polls = 0;
        loop {
            let mut state = sys::ncclResult_t::ncclInProgress;
            // SAFETY: see above.
            let r = unsafe { api::ncclCommGetAsyncError(raw, &mut state) };
            if r != sys::ncclResult_t::ncclSuccess
                || (state != sys::ncclResult_t::ncclSuccess
                    && state != sys::ncclResult_t::ncclInProgress)
                || started.elapsed() >= timeout
            {
                abort(raw);
                return;
            }
            if state == sys::ncclResult_t::ncclSuccess {
                break;
            }
            backoff(&mut polls, started);
        }
        // SAFETY: see above; finalized, so destroy only frees.
        let _ = unsafe { api::ncclCommDestroy(raw) };
    }
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("ordinal", &self.ordinal)
            .finish()
    }
}
