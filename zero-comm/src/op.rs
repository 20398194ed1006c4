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

/// What a collective's buffers hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    /// Numbers of a dtype: every collective takes them (reductions
    /// accumulate in f32).
    Num(DType),
    /// Raw bytes, copied exactly: only all-gathered
    /// ([`Communicator::all_gather_bytes`](crate::Communicator::all_gather_bytes)),
    /// never reduced.
    Byte,
}

impl Elem {
    /// The code of [`Elem::Byte`] in a descriptor: not a [`DType::code`].
    const BYTE_CODE: u8 = 0x80;

    /// A stable small integer, for descriptors that cross process
    /// boundaries.
    fn code(self) -> u8 {
        match self {
            Elem::Num(d) => d.code(),
            Elem::Byte => Self::BYTE_CODE,
        }
    }

    fn from_code(c: u8) -> Option<Elem> {
        if c == Self::BYTE_CODE {
            Some(Elem::Byte)
        } else {
            DType::from_code(c).map(Elem::Num)
        }
    }

    /// The name in messages (`"f32"`, ..., `"u8"`).
    fn as_str(self) -> &'static str {
        match self {
            Elem::Num(d) => d.as_str(),
            Elem::Byte => "u8",
        }
    }
}

/// What every rank must agree on for a collective to be valid: kind,
/// reduction, element type, total element count, per-rank counts and root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpDesc {
    pub kind: OpKind,
    pub reduce: Option<ReduceOp>,
    pub elem: Elem,
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

    /// Packs kind, reduction, element type and root into one word.
    pub(crate) fn header(&self) -> u64 {
        u64::from(self.kind as u8)
            | u64::from(self.reduce.map_or(0, |r| r.code())) << 8
            | u64::from(self.elem.code()) << 16
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
        let elem = Elem::from_code((h >> 16) as u8);
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
        match elem {
            Some(e) => s.push_str(e.as_str()),
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
            elem: Elem::Num(DType::BF16),
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
            elem: Elem::Num(DType::F32),
            len: 5,
            counts_hash: 0,
            root: 0,
        };
        assert_eq!(
            OpDesc::describe_words(r.words()),
            "all_reduce(avg, f32, 5 elements)"
        );
        let g = OpDesc {
            kind: OpKind::AllGather,
            reduce: None,
            elem: Elem::Byte,
            len: 12,
            counts_hash: 0xab,
            root: 0,
        };
        assert_eq!(
            OpDesc::describe_words(g.words()),
            "all_gather(u8, 12 elements, counts 00000000000000ab)"
        );
    }

    #[test]
    fn element_codes_are_distinct_and_round_trip() {
        let all: Vec<Elem> = DType::ALL
            .into_iter()
            .map(Elem::Num)
            .chain([Elem::Byte])
            .collect();
        for (i, e) in all.iter().enumerate() {
            assert_eq!(Elem::from_code(e.code()), Some(*e));
            assert!(all[..i].iter().all(|o| o.code() != e.code()), "{e:?}");
        }
    }
}
