//! What ranks compare before a launch under
//! [`CommOptions::validate`](crate::CommOptions::validate): each launch as
//! descriptor words, and the message when ranks differ. Pure: the device
//! exchange of the words is `validate.rs`.
//!
//! ```text
//!  ops ─▶ [ number of ops | first op's header | first op's length | hash of all ]
//!  rows of every rank ─▶ compare ─▶ None (all equal), or
//!                       "rank 0: all_reduce(sum, f32, 1024 elements); rank 1: ..."
//! ```

use super::check::Coll;
use super::enqueue::Launch;
use crate::op::{Elem, OpDesc, OpKind};

/// Words per rank: number of ops, the first op's header and length, and a
/// hash of every op's descriptor.
pub(crate) const WORDS: usize = 4;

/// The descriptor of one launch, as compared across ranks.
pub(crate) fn words(ops: &[Launch]) -> [u64; WORDS] {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for l in ops {
        for w in desc(l).words() {
            for b in w.to_le_bytes() {
                hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    let first = ops.first().map_or([0; 3], |l| desc(l).words());
    [ops.len() as u64, first[0], first[1], hash]
}

fn desc(l: &Launch) -> OpDesc {
    OpDesc {
        kind: match l.plan.coll {
            Coll::AllReduce => OpKind::AllReduce,
            Coll::ReduceScatter => OpKind::ReduceScatter,
            Coll::AllGather => OpKind::AllGather,
        },
        reduce: l.reduce,
        elem: Elem::Num(l.plan.dtype),
        len: l.plan.total,
        counts_hash: 0,
        root: 0,
    }
}

/// What rank `r` published, for messages.
fn describe(w: &[u64]) -> String {
    match w[0] {
        0 => "an empty group".into(),
        1 => OpDesc::describe_words([w[1], w[2], 0]),
        n => format!(
            "a group of {n} collectives, first {}",
            OpDesc::describe_words([w[1], w[2], 0])
        ),
    }
}

/// Compares every rank's row with `rank`'s; the mismatch detail.
pub(crate) fn compare(rank: usize, rows: &[u64]) -> Option<String> {
    let mine = &rows[rank * WORDS..(rank + 1) * WORDS];
    let differ = rows.chunks_exact(WORDS).any(|r| r != mine);
    differ.then(|| {
        rows.chunks_exact(WORDS)
            .enumerate()
            .map(|(r, w)| format!("rank {r}: {}", describe(w)))
            .collect::<Vec<_>>()
            .join("; ")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nccl::check::Plan;
    use crate::ReduceOp;
    use zero_core::DType;

    fn launch(coll: Coll, reduce: Option<ReduceOp>, dtype: DType, total: usize) -> Launch {
        Launch {
            name: "x",
            plan: Plan {
                coll,
                dtype,
                count: total,
                total,
                send_offset: 0,
                recv_offset: 0,
            },
            reduce,
            send: 0,
            recv: 0,
        }
    }

    #[test]
    fn equal_launches_agree_and_different_ones_are_described() {
        let a = launch(Coll::AllReduce, Some(ReduceOp::Sum), DType::F32, 1024);
        let b = launch(Coll::AllGather, None, DType::BF16, 64);
        let same: Vec<u64> = [
            words(std::slice::from_ref(&a)),
            words(std::slice::from_ref(&a)),
        ]
        .concat();
        assert_eq!(compare(0, &same), None);
        assert_eq!(compare(1, &same), None);

        let rows: Vec<u64> = [
            words(std::slice::from_ref(&a)),
            words(std::slice::from_ref(&b)),
        ]
        .concat();
        let d = compare(1, &rows).unwrap();
        assert_eq!(
            d,
            "rank 0: all_reduce(sum, f32, 1024 elements); rank 1: all_gather(bf16, 64 elements)"
        );

        // Same first op, different second: caught by the hash.
        let g1 = words(&[a.clone(), b.clone()]);
        let g2 = words(&[a.clone(), launch(Coll::AllGather, None, DType::BF16, 65)]);
        let rows: Vec<u64> = [g1, g2].concat();
        let d = compare(0, &rows).unwrap();
        assert!(
            d.starts_with("rank 0: a group of 2 collectives, first all_reduce(sum, f32"),
            "{d}"
        );
        assert_eq!(describe(&words(&[])), "an empty group");
    }
}
