//! Descriptions of collectives, comparable across ranks and processes.

use zero_core::DType;

use crate::ReduceOp;

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum OpKind {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    Barrier = 5,
}

impl OpKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
        }
    }

    fn from_code(c: u8) -> Option<OpKind> {
        [
            OpKind::AllReduce,
            OpKind::ReduceScatter,
            OpKind::AllGather,
            OpKind::Broadcast,
            OpKind::Barrier,
        ]
        .into_iter()
        .find(|k| *k as u8 == c)
    }
}

/// What every rank must agree on for a collective to be valid: kind,
/// reduction, dtype, total element count, per-rank counts and root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpDesc {
    pub kind: OpKind,
    pub reduce: Option<ReduceOp>,
    pub dtype: DType,
    /// Elements of the full buffer (reduce_scatter: input; all_gather: output).
    pub len: usize,
    /// Hash of the per-rank counts (0 where there are none).
    pub counts_hash: u64,
    /// Root rank of a broadcast (0 otherwise).
    pub root: usize,
}

impl OpDesc {
    pub(crate) fn name(&self) -> &'static str {
        self.kind.name()
    }

    /// Packs kind, reduction, dtype and root into one word.
    pub(crate) fn header(&self) -> u64 {
        u64::from(self.kind as u8)
            | u64::from(self.reduce.map_or(0, |r| r.code())) << 8
            | u64::from(self.dtype.code()) << 16
            | (self.root as u64) << 32
    }

    /// The words that cross process boundaries: header, len, counts hash.
    pub(crate) fn words(&self) -> [u64; 3] {
        [self.header(), self.len as u64, self.counts_hash]
    }

    /// Human-readable form of a descriptor published by some rank.
    pub(crate) fn describe_words(w: [u64; 3]) -> String {
        let h = w[0];
        let kind = OpKind::from_code(h as u8);
        let reduce = ReduceOp::from_code((h >> 8) as u8);
        let dtype = DType::from_code((h >> 16) as u8);
        let root = h >> 32;
        let Some(kind) = kind else {
            return format!("<unknown collective {h:#x}>");
        };
        let mut s = String::from(kind.name());
        s.push('(');
        if let Some(r) = reduce {
            s.push_str(r.as_str());
            s.push_str(", ");
        }
        match dtype {
            Some(d) => s.push_str(d.as_str()),
            None => s.push('?'),
        }
        s.push_str(&format!(", {} elements", w[1]));
        if w[2] != 0 {
            s.push_str(&format!(", counts {:016x}", w[2]));
        }
        if kind == OpKind::Broadcast {
            s.push_str(&format!(", root {root}"));
        }
        s.push(')');
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_round_trips_the_fields() {
        let d = OpDesc {
            kind: OpKind::Broadcast,
            reduce: None,
            dtype: DType::BF16,
            len: 77,
            counts_hash: 0,
            root: 3,
        };
        assert_eq!(
            OpDesc::describe_words(d.words()),
            "broadcast(bf16, 77 elements, root 3)"
        );
        let r = OpDesc {
            kind: OpKind::AllReduce,
            reduce: Some(ReduceOp::Avg),
            dtype: DType::F32,
            len: 5,
            counts_hash: 0,
            root: 0,
        };
        assert_eq!(
            OpDesc::describe_words(r.words()),
            "all_reduce(avg, f32, 5 elements)"
        );
    }
}
