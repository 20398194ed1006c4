//! The `result` layer over `mpi::ffi`: one function per MPI call this
//! backend makes, each returning [`Result`] (the MPI error string in
//! [`Error::Mpi`]) instead of a return code.
//!
//! The calls are `unsafe`: the caller passes live handles, buffers valid
//! for the counts, and serialises the calls as the library's thread level
//! demands (see [`super::runtime::Runtime::call`]). The RAII types built on
//! top live in [`super::runtime`].

use std::ffi::{c_int, c_void};

use ::mpi::ffi;

use crate::{Error, Result};

pub(crate) use ffi::{MPI_Comm, MPI_Op, MPI_Request, MPI_Win};

/// Turns an MPI return code into a `Result`.
pub(crate) fn check(rc: c_int, what: &str) -> Result<()> {
    // MPI_SUCCESS is 0 in every implementation (MPI standard, 8.4).
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Mpi(format!("{what} failed: {}", error_string(rc))))
    }
}

/// The library's description of error code `rc`.
pub(crate) fn error_string(rc: c_int) -> String {
    let mut buf = vec![0u8; 1024]; // >= MPI_MAX_ERROR_STRING in OpenMPI and MPICH
    let mut len: c_int = 0;
    // SAFETY: MPI_Error_string writes at most MPI_MAX_ERROR_STRING bytes
    // (256 in OpenMPI, 1024 in MPICH) into `buf`, and its length into `len`;
    // it may be called at any time, even before MPI_Init.
    let rc2 = unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) };
    if rc2 != 0 {
        return format!("MPI error code {rc}");
    }
    buf.truncate(len.clamp(0, 1024) as usize);
    format!("{} (code {rc})", String::from_utf8_lossy(&buf))
}

/// The library's version string (`MPI_Get_library_version`).
pub(crate) fn library_version() -> String {
    let mut buf = vec![0u8; 8192]; // >= MPI_MAX_LIBRARY_VERSION_STRING
    let mut len: c_int = 0;
    // SAFETY: writes at most MPI_MAX_LIBRARY_VERSION_STRING (256 in OpenMPI,
    // 8192 in MPICH) bytes into `buf`; callable before MPI_Init.
    let rc = unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) };
    if rc != 0 {
        return String::new();
    }
    buf.truncate(len.clamp(0, 8192) as usize);
    String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .to_string()
}

/// The thread level MPI was initialised with (`MPI_Query_thread`).
///
/// # Safety
/// MPI must be initialised and not finalised.
pub(crate) unsafe fn query_thread() -> Result<c_int> {
    let mut level: c_int = 0;
    check(
        // SAFETY: MPI is initialised (caller); `level` is a valid out pointer.
        unsafe { ffi::MPI_Query_thread(&mut level) },
        "MPI_Query_thread",
    )?;
    Ok(level)
}

macro_rules! constant {
    ($(#[$m:meta])* $name:ident: $ty:ty = $sym:ident) => {
        $(#[$m])*
        pub(crate) fn $name() -> $ty {
            // SAFETY: the rsmpi C shim defines this as an initialised
            // `const` object that is never written.
            unsafe { ffi::$sym }
        }
    };
}

constant!(/// `MPI_COMM_WORLD`.
    comm_world: MPI_Comm = RSMPI_COMM_WORLD);
constant!(/// `MPI_COMM_NULL`.
    comm_null: MPI_Comm = RSMPI_COMM_NULL);
constant!(/// `MPI_REQUEST_NULL`.
    request_null: MPI_Request = RSMPI_REQUEST_NULL);
constant!(/// `MPI_FLOAT`.
    dt_f32: ffi::MPI_Datatype = RSMPI_FLOAT);
constant!(/// `MPI_UINT8_T`.
    dt_u8: ffi::MPI_Datatype = RSMPI_UINT8_T);
constant!(/// `MPI_INT64_T` (also carries u64 words, bit for bit).
    dt_i64: ffi::MPI_Datatype = RSMPI_INT64_T);
constant!(/// `MPI_SUM`.
    op_sum: MPI_Op = RSMPI_SUM);
constant!(/// `MPI_MIN`.
    op_min: MPI_Op = RSMPI_MIN);
constant!(/// `MPI_MAX`.
    op_max: MPI_Op = RSMPI_MAX);
constant!(/// `MPI_THREAD_SERIALIZED`.
    thread_serialized: c_int = RSMPI_THREAD_SERIALIZED);
constant!(/// `MPI_THREAD_MULTIPLE`.
    thread_multiple: c_int = RSMPI_THREAD_MULTIPLE);

fn status_ignore() -> *mut ffi::MPI_Status {
    // SAFETY: as in `constant!`: an initialised, never-written constant.
    unsafe { ffi::RSMPI_STATUS_IGNORE }
}

/// A count that MPI takes as `int`.
pub(crate) fn count(n: usize, what: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::Mpi(format!(
            "{what}: {n} elements do not fit in an MPI count (at most {})",
            c_int::MAX
        ))
    })
}

/// `MPI_Comm_dup`, with errors returned rather than fatal on the copy.
///
/// # Safety
/// `comm` is a live communicator; collective over it.
pub(crate) unsafe fn comm_dup(comm: MPI_Comm) -> Result<MPI_Comm> {
    let mut out = comm_null();
    // SAFETY: `comm` is live (caller); `out` is a valid out pointer.
    check(unsafe { ffi::MPI_Comm_dup(comm, &mut out) }, "MPI_Comm_dup")?;
    // SAFETY: `out` was just created.
    unsafe { errors_return(out)? };
    Ok(out)
}

/// `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`: the ranks that can share
/// memory with this one.
///
/// # Safety
/// `comm` is a live communicator; collective over it.
pub(crate) unsafe fn comm_split_shared(comm: MPI_Comm, key: c_int) -> Result<MPI_Comm> {
    let mut out = comm_null();
    check(
        // SAFETY: `comm` is live (caller); the split type and info are the
        // library's own constants; `out` is a valid out pointer.
        unsafe {
            ffi::MPI_Comm_split_type(
                comm,
                ffi::RSMPI_COMM_TYPE_SHARED,
                key,
                ffi::RSMPI_INFO_NULL,
                &mut out,
            )
        },
        "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)",
    )?;
    // SAFETY: `out` was just created.
    unsafe { errors_return(out)? };
    Ok(out)
}

/// `MPI_Comm_split` with a non-negative color (every rank gets a comm).
///
/// # Safety
/// `comm` is a live communicator; collective over it.
pub(crate) unsafe fn comm_split(comm: MPI_Comm, color: c_int, key: c_int) -> Result<MPI_Comm> {
    let mut out = comm_null();
    check(
        // SAFETY: `comm` is live (caller); `out` is a valid out pointer.
        unsafe { ffi::MPI_Comm_split(comm, color, key, &mut out) },
        "MPI_Comm_split",
    )?;
    // SAFETY: `out` was just created.
    unsafe { errors_return(out)? };
    Ok(out)
}

/// Makes errors on `comm` return codes instead of aborting the job.
///
/// # Safety
/// `comm` is a live communicator.
unsafe fn errors_return(comm: MPI_Comm) -> Result<()> {
    check(
        // SAFETY: `comm` is live (caller); ERRORS_RETURN is a predefined handler.
        unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) },
        "MPI_Comm_set_errhandler",
    )
}

/// `MPI_Comm_rank` and `MPI_Comm_size`.
///
/// # Safety
/// `comm` is a live communicator.
pub(crate) unsafe fn comm_rank_size(comm: MPI_Comm) -> Result<(usize, usize)> {
    let (mut r, mut n): (c_int, c_int) = (0, 0);
    // SAFETY: `comm` is live (caller); valid out pointers.
    check(unsafe { ffi::MPI_Comm_rank(comm, &mut r) }, "MPI_Comm_rank")?;
    // SAFETY: as above.
    check(unsafe { ffi::MPI_Comm_size(comm, &mut n) }, "MPI_Comm_size")?;
    Ok((r as usize, n as usize))
}

/// `MPI_Comm_free`.
///
/// # Safety
/// `comm` is a live communicator that is not used afterwards.
pub(crate) unsafe fn comm_free(mut comm: MPI_Comm) -> Result<()> {
    // SAFETY: `comm` is live and unused afterwards (caller).
    check(unsafe { ffi::MPI_Comm_free(&mut comm) }, "MPI_Comm_free")
}

/// `MPI_Barrier` (blocking).
///
/// # Safety
/// `comm` is a live communicator; collective over it.
pub(crate) unsafe fn barrier(comm: MPI_Comm) -> Result<()> {
    // SAFETY: `comm` is live (caller).
    check(unsafe { ffi::MPI_Barrier(comm) }, "MPI_Barrier")
}

/// `MPI_Allreduce` of one 64-bit integer (blocking; for setup).
///
/// # Safety
/// `comm` is a live communicator; collective over it; `op` is a
/// predefined integer operation.
pub(crate) unsafe fn allreduce_i64(comm: MPI_Comm, x: i64, op: MPI_Op) -> Result<i64> {
    let mut out: i64 = 0;
    check(
        // SAFETY: one i64 in, one out, both valid; `comm` and `op` live.
        unsafe {
            ffi::MPI_Allreduce(
                (&x as *const i64).cast(),
                (&mut out as *mut i64).cast(),
                1,
                dt_i64(),
                op,
                comm,
            )
        },
        "MPI_Allreduce",
    )?;
    Ok(out)
}

/// `MPI_Allgather` of one 64-bit integer per rank (blocking; for setup).
///
/// # Safety
/// `comm` is a live communicator of `size` ranks; collective over it.
pub(crate) unsafe fn allgather_i64(comm: MPI_Comm, x: i64, size: usize) -> Result<Vec<i64>> {
    let mut out = vec![0i64; size];
    check(
        // SAFETY: one i64 sent, `size` received into a buffer of that length.
        unsafe {
            ffi::MPI_Allgather(
                (&x as *const i64).cast(),
                1,
                dt_i64(),
                out.as_mut_ptr().cast(),
                1,
                dt_i64(),
                comm,
            )
        },
        "MPI_Allgather",
    )?;
    Ok(out)
}

/// `MPI_Win_allocate_shared` of `bytes` bytes (`disp_unit` 1); with
/// `noncontig`, every rank's segment starts on its own page. Returns the
/// window and this rank's base address.
///
/// # Safety
/// `comm` is a live communicator whose ranks share memory (from
/// [`comm_split_shared`]); collective over it.
pub(crate) unsafe fn win_allocate_shared(
    comm: MPI_Comm,
    bytes: usize,
    noncontig: bool,
) -> Result<(MPI_Win, *mut u8)> {
    let size = ffi::MPI_Aint::try_from(bytes)
        .map_err(|_| Error::Mpi(format!("a shared window of {bytes} bytes is too large")))?;
    let mut info = ffi::MPI_Info(std::ptr::null_mut());
    let mut base: *mut c_void = std::ptr::null_mut();
    let mut win = ffi::MPI_Win(std::ptr::null_mut());
    // SAFETY: `info` is created here, set with NUL-terminated strings and
    // freed below; `base` and `win` are valid out pointers (baseptr is a
    // `void **` passed as `void *`, as the standard specifies).
    unsafe {
        if noncontig {
            check(ffi::MPI_Info_create(&mut info), "MPI_Info_create")?;
            check(
                ffi::MPI_Info_set(info, c"alloc_shared_noncontig".as_ptr(), c"true".as_ptr()),
                "MPI_Info_set",
            )?;
        } else {
            info = ffi::RSMPI_INFO_NULL;
        }
        let rc = ffi::MPI_Win_allocate_shared(
            size,
            1,
            info,
            comm,
            (&mut base as *mut *mut c_void).cast(),
            &mut win,
        );
        if noncontig {
            ffi::MPI_Info_free(&mut info);
        }
        check(rc, "MPI_Win_allocate_shared")?;
    }
    Ok((win, base.cast()))
}

/// `MPI_Win_shared_query`: where rank `rank`'s segment of `win` is mapped
/// in this process, and its size in bytes.
///
/// # Safety
/// `win` is a live shared window; `rank` is a rank of its communicator.
pub(crate) unsafe fn win_shared_query(win: MPI_Win, rank: usize) -> Result<(*mut u8, usize)> {
    let mut size: ffi::MPI_Aint = 0;
    let mut unit: c_int = 0;
    let mut base: *mut c_void = std::ptr::null_mut();
    check(
        // SAFETY: `win` is live (caller); valid out pointers (baseptr as above).
        unsafe {
            ffi::MPI_Win_shared_query(
                win,
                rank as c_int,
                &mut size,
                &mut unit,
                (&mut base as *mut *mut c_void).cast(),
            )
        },
        "MPI_Win_shared_query",
    )?;
    Ok((base.cast(), size.max(0) as usize))
}

/// `MPI_Win_free` (collective over the window's communicator).
///
/// # Safety
/// `win` is live and no memory in it is used afterwards.
pub(crate) unsafe fn win_free(mut win: MPI_Win) -> Result<()> {
    // SAFETY: as the caller guarantees.
    check(unsafe { ffi::MPI_Win_free(&mut win) }, "MPI_Win_free")
}

/// A user-defined reduction (`MPI_Op_create`).
///
/// # Safety
/// MPI is initialised; `f` is sound for every datatype it is used with.
pub(crate) unsafe fn op_create(f: ffi::MPI_User_function, commute: bool) -> Result<MPI_Op> {
    let mut op = ffi::MPI_Op(std::ptr::null_mut());
    check(
        // SAFETY: valid out pointer; `f` is sound (caller).
        unsafe { ffi::MPI_Op_create(f, c_int::from(commute), &mut op) },
        "MPI_Op_create",
    )?;
    Ok(op)
}

/// `MPI_Op_free`.
///
/// # Safety
/// `op` is a live user operation not used afterwards.
pub(crate) unsafe fn op_free(mut op: MPI_Op) -> Result<()> {
    // SAFETY: as the caller guarantees.
    check(unsafe { ffi::MPI_Op_free(&mut op) }, "MPI_Op_free")
}

/// `MPI_Iallreduce` of f32 from `send` into `recv` (distinct buffers).
///
/// # Safety
/// `send` and `recv` are valid for `n` f32 until the request completes
/// (and `recv` not otherwise accessed); `comm` and `op` are live.
pub(crate) unsafe fn iallreduce_f32(
    send: *const f32,
    recv: *mut f32,
    n: usize,
    op: MPI_Op,
    comm: MPI_Comm,
) -> Result<MPI_Request> {
    let n = count(n, "MPI_Iallreduce")?;
    let mut req = request_null();
    check(
        // SAFETY: buffers valid for n elements until completion (caller).
        unsafe { ffi::MPI_Iallreduce(send.cast(), recv.cast(), n, dt_f32(), op, comm, &mut req) },
        "MPI_Iallreduce",
    )?;
    Ok(req)
}

/// `MPI_Ireduce_scatter` of f32: `send` holds `sum(counts)` elements,
/// `recv` receives `counts[rank]`.
///
/// # Safety
/// Buffers valid for those counts until the request completes; `counts`
/// has one entry per rank of `comm` and lives until completion as well.
pub(crate) unsafe fn ireduce_scatter_f32(
    send: *const f32,
    recv: *mut f32,
    counts: &[c_int],
    op: MPI_Op,
    comm: MPI_Comm,
) -> Result<MPI_Request> {
    let mut req = request_null();
    check(
        // SAFETY: as the caller guarantees.
        unsafe {
            ffi::MPI_Ireduce_scatter(
                send.cast(),
                recv.cast(),
                counts.as_ptr(),
                dt_f32(),
                op,
                comm,
                &mut req,
            )
        },
        "MPI_Ireduce_scatter",
    )?;
    Ok(req)
}

/// `MPI_Iallgatherv` of bytes.
///
/// # Safety
/// `send` valid for `scount` bytes, `recv` for `sum(counts)` bytes at
/// `displs`, all (and the count arrays) until the request completes.
pub(crate) unsafe fn iallgatherv_u8(
    send: *const u8,
    scount: c_int,
    recv: *mut u8,
    counts: &[c_int],
    displs: &[c_int],
    comm: MPI_Comm,
) -> Result<MPI_Request> {
    let mut req = request_null();
    check(
        // SAFETY: as the caller guarantees.
        unsafe {
            ffi::MPI_Iallgatherv(
                send.cast(),
                scount,
                dt_u8(),
                recv.cast(),
                counts.as_ptr(),
                displs.as_ptr(),
                dt_u8(),
                comm,
                &mut req,
            )
        },
        "MPI_Iallgatherv",
    )?;
    Ok(req)
}

/// `MPI_Iallgather` of `n` u64 per rank.
///
/// # Safety
/// `send` valid for `n`, `recv` for `n * size(comm)` u64 until completion.
pub(crate) unsafe fn iallgather_u64(
    send: *const u64,
    n: c_int,
    recv: *mut u64,
    comm: MPI_Comm,
) -> Result<MPI_Request> {
    let mut req = request_null();
    check(
        // SAFETY: as the caller guarantees.
        unsafe {
            ffi::MPI_Iallgather(
                send.cast(),
                n,
                dt_i64(),
                recv.cast(),
                n,
                dt_i64(),
                comm,
                &mut req,
            )
        },
        "MPI_Iallgather",
    )?;
    Ok(req)
}

/// `MPI_Ibcast` of bytes.
///
/// # Safety
/// `buf` valid for `n` bytes (read on the root, written elsewhere) until
/// the request completes.
pub(crate) unsafe fn ibcast_u8(
    buf: *mut u8,
    n: c_int,
    root: c_int,
    comm: MPI_Comm,
) -> Result<MPI_Request> {
    let mut req = request_null();
    check(
        // SAFETY: as the caller guarantees.
        unsafe { ffi::MPI_Ibcast(buf.cast(), n, dt_u8(), root, comm, &mut req) },
        "MPI_Ibcast",
    )?;
    Ok(req)
}

/// `MPI_Ibarrier`.
///
/// # Safety
/// `comm` is live.
pub(crate) unsafe fn ibarrier(comm: MPI_Comm) -> Result<MPI_Request> {
    let mut req = request_null();
    // SAFETY: `comm` is live (caller); valid out pointer.
    check(unsafe { ffi::MPI_Ibarrier(comm, &mut req) }, "MPI_Ibarrier")?;
    Ok(req)
}

/// `MPI_Isend` of `n` u64 to `dest` with `tag`.
///
/// # Safety
/// `buf` valid for `n` u64 until the send completes.
pub(crate) unsafe fn isend_u64(
    buf: *const u64,
    n: c_int,
    dest: c_int,
    tag: c_int,
    comm: MPI_Comm,
) -> Result<MPI_Request> {
    let mut req = request_null();
    check(
        // SAFETY: as the caller guarantees.
        unsafe { ffi::MPI_Isend(buf.cast(), n, dt_i64(), dest, tag, comm, &mut req) },
        "MPI_Isend",
    )?;
    Ok(req)
}

/// `MPI_Irecv` of `n` u64 from any source with `tag`.
///
/// # Safety
/// `buf` valid for `n` u64 until the receive completes or is cancelled.
pub(crate) unsafe fn irecv_any_u64(
    buf: *mut u64,
    n: c_int,
    tag: c_int,
    comm: MPI_Comm,
) -> Result<MPI_Request> {
    let mut req = request_null();
    check(
        // SAFETY: as the caller guarantees.
        unsafe {
            ffi::MPI_Irecv(
                buf.cast(),
                n,
                dt_i64(),
                ffi::RSMPI_ANY_SOURCE,
                tag,
                comm,
                &mut req,
            )
        },
        "MPI_Irecv",
    )?;
    Ok(req)
}

/// `MPI_Test`: whether `req` completed (it is then set to null).
///
/// # Safety
/// `req` is a live or null request.
pub(crate) unsafe fn test(req: &mut MPI_Request) -> Result<bool> {
    let mut flag: c_int = 0;
    check(
        // SAFETY: `req` is live or null (caller); valid out pointers.
        unsafe { ffi::MPI_Test(req, &mut flag, status_ignore()) },
        "MPI_Test",
    )?;
    Ok(flag != 0)
}

/// `MPI_Cancel` then `MPI_Wait` (for a posted receive).
///
/// # Safety
/// `req` is a live receive request; its buffer stays valid until this returns.
pub(crate) unsafe fn cancel_and_wait(req: &mut MPI_Request) -> Result<()> {
    // SAFETY: `req` is live (caller); cancelling a receive completes it
    // locally, so the wait does not block on other ranks.
    unsafe {
        check(ffi::MPI_Cancel(req), "MPI_Cancel")?;
        check(ffi::MPI_Wait(req, status_ignore()), "MPI_Wait")
    }
}

/// `MPI_Request_free`: lets a send complete in the background.
///
/// # Safety
/// `req` is live; its buffer stays valid until the process finalises MPI.
pub(crate) unsafe fn request_free(req: &mut MPI_Request) -> Result<()> {
    // SAFETY: as the caller guarantees.
    check(unsafe { ffi::MPI_Request_free(req) }, "MPI_Request_free")
}

/// Blocking `MPI_Allreduce` (sum, f32); `send == None` means in place,
/// with `in_place` the library's `MPI_IN_PLACE`.
///
/// # Safety
/// `recv` (and `send`) valid for `n` f32; `comm` live; collective.
pub(crate) unsafe fn allreduce_sum_f32(
    send: *const c_void,
    recv: *mut f32,
    n: c_int,
    comm: MPI_Comm,
) -> Result<()> {
    check(
        // SAFETY: as the caller guarantees.
        unsafe { ffi::MPI_Allreduce(send, recv.cast(), n, dt_f32(), op_sum(), comm) },
        "MPI_Allreduce",
    )
}

/// Blocking `MPI_Reduce_scatter_block` (sum, f32).
///
/// # Safety
/// `send` valid for `n * size(comm)`, `recv` for `n` f32; collective.
pub(crate) unsafe fn reduce_scatter_block_sum_f32(
    send: *const f32,
    recv: *mut f32,
    n: c_int,
    comm: MPI_Comm,
) -> Result<()> {
    check(
        // SAFETY: as the caller guarantees.
        unsafe {
            ffi::MPI_Reduce_scatter_block(send.cast(), recv.cast(), n, dt_f32(), op_sum(), comm)
        },
        "MPI_Reduce_scatter_block",
    )
}

/// Blocking `MPI_Allgather` of f32.
///
/// # Safety
/// `send` valid for `n`, `recv` for `n * size(comm)` f32; collective.
pub(crate) unsafe fn allgather_f32(
    send: *const f32,
    recv: *mut f32,
    n: c_int,
    comm: MPI_Comm,
) -> Result<()> {
    check(
        // SAFETY: as the caller guarantees.
        unsafe { ffi::MPI_Allgather(send.cast(), n, dt_f32(), recv.cast(), n, dt_f32(), comm) },
        "MPI_Allgather",
    )
}
