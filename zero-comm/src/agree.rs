//! Small agreements among ranks, on the host: every rank's bytes, every
//! rank's u64 words, and which rank failed first and why.
//!
//! ```text
//!  exchange_u64   rank 0 [ w0 w1 ]   ─┐   one all_gather_bytes of 8·n bytes
//!                 rank 1 [ x0 x1 ]   ─┴─▶ every rank: [[w0 w1], [x0 x1]]
//!
//!  exchange_bytes rank 0 [ a a a ]   ─┐   round 1: exchange_u64 of the lengths [3, 1]
//!                 rank 1 [ b ]       ─┴─▶ round 2: all_gather_bytes, counts [3, 1]
//!                                         every rank: [[a a a], [b]]
//!
//!  first_failure  rank 0: ok         ─┐   round 1: exchange_u64 of [failed?, text length]
//!                 rank 1: Err("disk")─┤   round 2 (only if one failed): the lowest
//!                 rank 2: Err("net") ─┘   failing rank's text, all_gather_bytes with
//!                                         counts [0, 4, 0]; every rank: Some((1, "disk"))
//! ```
//!
//! Every function is a collective: all ranks call it at the same point.
//! Bytes and words travel as bytes ([`Communicator::all_gather_bytes`]), so
//! every bit pattern arrives as it left, NaN-looking ones included. Ranks
//! that pass [`exchange_u64`] different numbers of words get
//! [`Error::Mismatch`], not a hang.

use std::fmt::Display;

use crate::counts::offsets;
use crate::{Communicator, Error, Result};

/// Every rank's `words`, in rank order (little-endian bytes on the wire,
/// so any bit pattern arrives exactly). Every rank must pass the same
/// number of words; one collective.
///
/// ```
/// use zero_comm::{agree::exchange_u64, Communicator, ThreadGroup};
///
/// let all = ThreadGroup::run(2, |comm| {
///     exchange_u64(&comm, &[comm.rank() as u64, u64::MAX]).unwrap()
/// })
/// .unwrap();
/// assert_eq!(all[1], vec![vec![0, u64::MAX], vec![1, u64::MAX]]);
/// ```
pub fn exchange_u64<C: Communicator>(comm: &C, words: &[u64]) -> Result<Vec<Vec<u64>>> {
    let world = comm.world_size();
    let n = words.len() * 8;
    let send: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let (_, recv) = comm
        .all_gather_bytes(send, vec![0; n * world], &vec![n; world])
        .wait()?;
    Ok((0..world)
        .map(|r| {
            recv[r * n..(r + 1) * n]
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect()
        })
        .collect())
}

/// Every rank's `bytes`, in rank order; the lengths may differ from rank
/// to rank. Two collectives: the lengths, then the bytes.
///
/// ```
/// use zero_comm::{agree::exchange_bytes, Communicator, ThreadGroup};
///
/// let all = ThreadGroup::run(2, |comm| {
///     exchange_bytes(&comm, &vec![b'a' + comm.rank() as u8; comm.rank() + 1]).unwrap()
/// })
/// .unwrap();
/// assert_eq!(all[0], vec![b"a".to_vec(), b"bb".to_vec()]);
/// ```
pub fn exchange_bytes<C: Communicator>(comm: &C, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let lens = exchange_u64(comm, &[bytes.len() as u64])?;
    let counts = lens
        .iter()
        .enumerate()
        .map(|(r, w)| {
            usize::try_from(w[0]).map_err(|_| Error::InvalidArgument {
                rank: comm.rank(),
                op: "exchange_bytes",
                msg: format!(
                    "rank {r} sends {} bytes, more than this rank can address",
                    w[0]
                ),
            })
        })
        .collect::<Result<Vec<usize>>>()?;
    let total = counts.iter().sum();
    let (_, recv) = comm
        .all_gather_bytes(bytes.to_vec(), vec![0; total], &counts)
        .wait()?;
    Ok(offsets(&counts)
        .into_iter()
        .zip(&counts)
        .map(|(o, &c)| recv[o..o + c].to_vec())
        .collect())
}

/// Every rank learns the lowest rank whose `local` error is set, and that
/// error's text; `None` when no rank has one. One collective when no rank
/// failed, two when one did.
///
/// ```
/// use zero_comm::{agree::first_failure, Communicator, ThreadGroup};
///
/// let seen = ThreadGroup::run(3, |comm| {
///     let local = match comm.rank() {
///         1 => Some("disk full"),
///         2 => Some("no network"),
///         _ => None,
///     };
///     first_failure(&comm, local).unwrap()
/// })
/// .unwrap();
/// assert_eq!(seen, vec![Some((1, "disk full".to_string())); 3]);
/// ```
pub fn first_failure<C: Communicator, E: Display + ?Sized>(
    comm: &C,
    local: Option<&E>,
) -> Result<Option<(usize, String)>> {
    let text = local.map(|e| e.to_string());
    let len = text.as_ref().map_or(0, String::len) as u64;
    let head = exchange_u64(comm, &[u64::from(text.is_some()), len])?;
    let Some(first) = head.iter().position(|w| w[0] != 0) else {
        return Ok(None);
    };
    // Only the first failing rank sends its text.
    let mut counts = vec![0; head.len()];
    counts[first] = usize::try_from(head[first][1]).map_err(|_| Error::InvalidArgument {
        rank: comm.rank(),
        op: "first_failure",
        msg: format!(
            "rank {first} reports an error text of {} bytes, more than this rank can address",
            head[first][1]
        ),
    })?;
    let send = match text {
        Some(t) if comm.rank() == first => t.into_bytes(),
        _ => Vec::new(),
    };
    let (_, why) = comm
        .all_gather_bytes(send, vec![0; counts[first]], &counts)
        .wait()?;
    Ok(Some((first, String::from_utf8_lossy(&why).into_owned())))
}
