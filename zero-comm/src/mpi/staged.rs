//! Collectives on unregistered buffers: staged through the bounce region.
//!
//! Peers can only reach memory inside the shared window, so when some
//! rank's buffers are ordinary heap memory, every rank copies its data into
//! the bounce region at the start of its pool segment, runs the
//! shared-memory algorithm there, and copies the result out, chunk by
//! chunk. Every rank stages (the decision is taken together, see
//! `engine.rs`), and the chunking depends only on the descriptor and the
//! bounce size, which all ranks agreed on, so all ranks run the same rounds.
//!
//! ```text
//!  all_reduce / broadcast: chunks of E elements (E = bounce / size)
//!   buf [ c0 | c1 | c2 ]   round k: buf[c_k] → bounce → shm op → buf[c_k]
//!
//!  reduce_scatter: round k takes piece k (P elements) of every rank's part
//!   send  [ part 0: p0 p1 .. | part 1: p0 p1 .. ]
//!   bounce[ part0.pk | part1.pk | ... | out ]   shm reduce_scatter with
//!   counts = piece sizes; out → recv[k·P ..]
//!
//!  all_gather: round k gathers piece k of every rank's part
//!   bounce[ my piece k | gathered pieces k of ranks 0..n ]
//!   gathered piece of rank p → recv[offset(p) + k·P ..]
//! ```

use super::engine::Engine;
use crate::counts::{counts_hash, offsets, round_pieces};
use crate::op::{OpDesc, OpKind};
use crate::reduce::copy;
use crate::shm::Bufs;
use crate::Result;

fn round_desc(desc: &OpDesc, len: usize, counts: &[usize]) -> OpDesc {
    OpDesc {
        len,
        counts_hash: if counts.is_empty() {
            0
        } else {
            counts_hash(counts)
        },
        ..*desc
    }
}

/// Runs `desc` on this rank's `send`/`recv` through the bounce region.
///
/// # Safety
/// `send` and `recv` are valid for the sizes `desc`/`counts` imply (as for
/// `ShmGroup::run`) and not accessed by anyone else until this returns.
pub(crate) unsafe fn run<T: Copy>(
    e: &mut Engine,
    seq: u64,
    desc: &OpDesc,
    counts: &[usize],
    send: *const T,
    recv: *mut T,
) -> Result<()> {
    let size = std::mem::size_of::<T>();
    let line = 64 / size;
    let cap = e.bounce_bytes() / size;
    let b = e.bounce_ptr().cast::<T>();
    let (me, n) = (e.local_rank(), e.local_size());
    // Per-rank piece of reduce_scatter / all_gather rounds.
    let per = {
        let p = cap / (n + 1);
        if p >= line {
            p / line * line
        } else {
            p.max(1)
        }
    };
    // SAFETY: (whole function) the bounce region holds `cap` elements and is
    // used by this rank alone between rounds; peers touch it only inside
    // a round, where the shm algorithm confines them to the published
    // sizes. User ranges are computed within the sizes the caller
    // guarantees.
    unsafe {
        match desc.kind {
            OpKind::AllReduce | OpKind::Broadcast => {
                let step = (cap / line * line).max(1);
                let mut a = 0;
                while a < desc.len {
                    let c = step.min(desc.len - a);
                    let is_root = desc.kind == OpKind::Broadcast && desc.root == me;
                    if desc.kind == OpKind::AllReduce || is_root {
                        copy(recv.add(a).cast_const(), b, c);
                    }
                    let bufs = Bufs {
                        send: b.cast(),
                        recv: b.cast(),
                    };
                    e.round_algorithm(seq, &round_desc(desc, c, &[]), &[], bufs)?;
                    if !is_root {
                        copy(b.cast_const(), recv.add(a), c);
                    }
                    a += c;
                }
            }
            OpKind::ReduceScatter => {
                let offs = offsets(counts);
                let out = b.add(n * per);
                for (k, piece) in round_pieces(counts, per).enumerate() {
                    let mut at = 0;
                    for p in 0..n {
                        copy(send.add(offs[p] + k * per), b.add(at), piece[p]);
                        at += piece[p];
                    }
                    let bufs = Bufs {
                        send: b.cast(),
                        recv: out.cast(),
                    };
                    e.round_algorithm(seq, &round_desc(desc, at, &piece), &piece, bufs)?;
                    copy(out.cast_const(), recv.add(k * per), piece[me]);
                }
            }
            OpKind::AllGather => {
                let offs = offsets(counts);
                let gathered = b.add(per);
                for (k, piece) in round_pieces(counts, per).enumerate() {
                    copy(send.add(k * per), b, piece[me]);
                    let total: usize = piece.iter().sum();
                    let bufs = Bufs {
                        send: b.cast(),
                        recv: gathered.cast(),
                    };
                    e.round_algorithm(seq, &round_desc(desc, total, &piece), &piece, bufs)?;
                    for (p, o) in offsets(&piece).into_iter().enumerate() {
                        copy(
                            gathered.add(o).cast_const(),
                            recv.add(offs[p] + k * per),
                            piece[p],
                        );
                    }
                }
            }
            OpKind::Barrier => {}
        }
    }
    Ok(())
}
