//! Hierarchical all-reduce across nodes, in one shared-memory round.
//!
//! Within a node, local rank r owns chunk r of the buffer (the chunks of
//! [`crate::shm`]'s all-reduce). Inside the round it reduces chunk r from
//! every local rank's buffer into f32 (the intra-node reduce-scatter), then
//! all-reduces that f32 partial with the ranks of the same local index on
//! the other nodes through MPI, then writes the final values into every
//! local rank's buffer (the intra-node all-gather):
//!
//! ```text
//!  node 0: ranks 0,1          node 1: ranks 2,3          (chunk c0 | c1)
//!  rank 0: x0 = a0+a1 (c0) ──MPI_Iallreduce── rank 2: x1 = a2+a3 (c0)
//!  rank 1: y0 = a0+a1 (c1) ──MPI_Iallreduce── rank 3: y1 = a2+a3 (c1)
//!  rank 0 writes x0+x1 into c0 of ranks 0,1; rank 2 into c0 of ranks 2,3
//!  rank 1 writes y0+y1 into c1 of ranks 0,1; rank 3 into c1 of ranks 2,3
//! ```
//!
//! Only 1/N of the buffer leaves each rank, every rank's link is busy, and
//! the buffer is read and written once. Partials stay in f32 between the
//! stages, and bf16/f16 round once at the end, so the result is
//! `T(finish(Σ_nodes Σ_local x))` in f32. The order therefore differs from
//! [`crate::reference_reduce`] (strict rank order) in the grouping: each
//! node's ranks are summed first, in rank order, then the node partials in
//! the order MPI chooses (for two nodes a single f32 addition, which does
//! not depend on order). Sums of values that are exact in f32 are
//! bit-identical to the reference; Max is identical whatever the order.

use zero_core::Element;

use super::net::{Net, NET_CHUNK};
use super::upcast::{finish_into, reduce_partial};
use crate::shm::{chunk, Ctx};
use crate::Result;

/// The body of the shared-memory round (see the module doc).
///
/// # Safety
/// Inside `ShmGroup::run_with`: every local rank's buffer (send == recv)
/// holds `desc.len` elements and stays valid until the exit phase.
pub(crate) unsafe fn all_reduce<T: Element>(
    ctx: &Ctx<'_>,
    net: &mut Net,
    seq: u64,
    world: usize,
) -> Result<()> {
    let n = ctx.peers.len();
    let range = chunk::<T>(ctx.desc.len, n, ctx.rank);
    let op = ctx.desc.reduce.expect("all_reduce has an op");
    let mut s = range.start;
    while s < range.end {
        let m = NET_CHUNK.min(range.end - s);
        // SAFETY: s + m <= range.end <= desc.len, within every buffer.
        let srcs: Vec<*const T> = (0..n).map(|p| unsafe { ctx.send::<T>(p).add(s) }).collect();
        // SAFETY: as above.
        let dsts: Vec<*mut T> = (0..n).map(|p| unsafe { ctx.recv::<T>(p).add(s) }).collect();
        let out = net.cross_all_reduce(
            seq,
            ctx.desc,
            op,
            // SAFETY: the sources hold m elements from s, and only this
            // rank touches chunk `rank` of any buffer during the round.
            |part| unsafe { reduce_partial(&srcs, part, op) },
            m,
        )?;
        // SAFETY: as above; `out` is private scratch, not a buffer.
        unsafe { finish_into(out, op, world, &dsts) };
        s += m;
    }
    Ok(())
}
