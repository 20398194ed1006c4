//! A rank file's layout: its name, its header, where each unit's master,
//! m and v lie ([`FileMap`]), and the check of every rank file against
//! the manifest ([`check_files`]).

use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::Path;

use zero_core::partition::{PartitionPlan, UnitLayout};

use super::super::{ck, io};
use super::names::rank_file;
use super::{Manifest, BLOCK, CHECKPOINT_VERSION, MANIFEST_FILE};
use crate::Result;

/// The first bytes of every rank file.
const MAGIC: &[u8; 8] = b"ZEROCKPT";
/// The header's length: [`MAGIC`], the version and the rank (u32 LE).
pub(super) const HEADER: u64 = 16;

/// The header of rank `rank`'s file.
pub(super) fn header(rank: usize) -> [u8; HEADER as usize] {
    let mut head = [0u8; HEADER as usize];
    head[..8].copy_from_slice(MAGIC);
    head[8..12].copy_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
    head[12..16].copy_from_slice(&(rank as u32).to_le_bytes());
    head
}

/// One of the three f32 arrays a rank file holds per unit, in file order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StateArray {
    /// The fp32 master weights.
    Master,
    /// AdamW's first moment.
    M,
    /// AdamW's second moment.
    V,
}

impl StateArray {
    /// Its position within a unit's part of a rank file.
    fn index(self) -> usize {
        match self {
            Self::Master => 0,
            Self::M => 1,
            Self::V => 2,
        }
    }
}

/// Where each unit's master, m and v lie in one rank file.
pub(super) struct FileMap {
    /// `E_r(u)` per unit, in unit coordinates.
    pub(super) ranges: Vec<Range<usize>>,
    /// Byte offset of each unit's master.
    base: Vec<u64>,
    /// The file's length.
    pub(super) len: u64,
}

impl FileMap {
    /// The file of saving rank `rank` of the plan whose units are
    /// `layouts`.
    pub(super) fn new(layouts: &[UnitLayout], rank: usize) -> Self {
        let mut at = HEADER;
        let mut ranges = Vec::with_capacity(layouts.len());
        let mut base = Vec::with_capacity(layouts.len());
        for l in layouts {
            let e = l.real_range(rank);
            base.push(at);
            at += 12 * e.len() as u64;
            ranges.push(e);
        }
        Self {
            ranges,
            base,
            len: at,
        }
    }

    /// Byte offset of element `i` (unit coordinates, within `E_r(u)`) of
    /// array `kind` of unit `u`.
    pub(super) fn offset(&self, u: usize, kind: StateArray, i: usize) -> u64 {
        let e = &self.ranges[u];
        self.base[u] + 4 * (kind.index() * e.len() + (i - e.start)) as u64
    }
}

/// Every rank file of the checkpoint directory `dir` exists, has the
/// manifest's length and CRC count, and a header naming its rank; `plan`
/// is the saving plan.
pub(crate) fn check_files(dir: &Path, m: &Manifest, plan: &PartitionPlan) -> Result<()> {
    let mpath = dir.join(MANIFEST_FILE);
    if m.files.len() != m.world_size {
        return Err(ck(
            &mpath,
            format!(
                "lists {} rank files for world_size {}",
                m.files.len(),
                m.world_size
            ),
        ));
    }
    for (s, f) in m.files.iter().enumerate() {
        if f.name != rank_file(s) {
            return Err(ck(
                &mpath,
                format!("file #{s} is `{}`, expected `{}`", f.name, rank_file(s)),
            ));
        }
        let path = dir.join(&f.name);
        let expect = FileMap::new(plan.units(), s).len;
        if f.bytes != expect || f.block_size != BLOCK as u64 {
            return Err(ck(
                &mpath,
                format!(
                    "`{}`: {} bytes in blocks of {}, but the units give {expect} bytes in blocks \
                     of {BLOCK}",
                    f.name, f.bytes, f.block_size
                ),
            ));
        }
        if f.crc32.len() != f.bytes.div_ceil(BLOCK as u64) as usize {
            return Err(ck(
                &mpath,
                format!("`{}`: {} CRCs for {} bytes", f.name, f.crc32.len(), f.bytes),
            ));
        }
        let mut file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ck(
                    &path,
                    format!(
                        "missing rank file (rank {s} of the {} saving ranks)",
                        m.world_size
                    ),
                ))
            }
            Err(e) => return Err(ck(&path, format!("open: {e}"))),
        };
        let len = file.metadata().map_err(io(&path, "stat"))?.len();
        if len != f.bytes {
            let how = if len < f.bytes {
                "truncated"
            } else {
                "too long"
            };
            return Err(ck(
                &path,
                format!("{how}: {len} bytes, the manifest says {}", f.bytes),
            ));
        }
        let mut head = [0u8; HEADER as usize];
        file.read_exact(&mut head)
            .map_err(io(&path, "read of the header"))?;
        if &head[..8] != MAGIC {
            return Err(ck(
                &path,
                "not a zero checkpoint rank file (bad magic, a foreign file)",
            ));
        }
        let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        let rank = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
        if version != CHECKPOINT_VERSION {
            return Err(ck(
                &path,
                format!("rank file version {version}, this build reads {CHECKPOINT_VERSION}"),
            ));
        }
        if rank as usize != s {
            return Err(ck(&path, format!("holds rank {rank}, expected rank {s}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use zero_core::partition::{TensorSpec, UnitSpec};

    use super::*;

    /// The documented layout: a 16-byte header, then per unit master | m
    /// | v over the rank's real range; a shard of padding only takes no
    /// bytes.
    #[test]
    fn layout_follows_the_real_ranges() {
        let specs = [
            UnitSpec::new("a", vec![TensorSpec::new("a", &[1000])]),
            UnitSpec::new("b", vec![TensorSpec::new("b", &[3])]),
        ];
        let plan = PartitionPlan::new(&specs, 2).unwrap();
        let (a, b) = (&plan.units()[0], &plan.units()[1]);
        let m0 = FileMap::new(plan.units(), 0);
        let m1 = FileMap::new(plan.units(), 1);
        assert_eq!(m0.ranges, [a.real_range(0), b.real_range(0)]);
        assert!(m1.ranges[1].is_empty(), "b's rank-1 shard is padding");
        let (e0, e1) = (a.real_range(0).len() as u64, a.real_range(1).len() as u64);
        assert_eq!(m0.offset(0, StateArray::Master, 0), HEADER);
        assert_eq!(m0.offset(0, StateArray::M, 0), HEADER + 4 * e0);
        assert_eq!(m0.offset(0, StateArray::V, 5), HEADER + 8 * e0 + 20);
        assert_eq!(m0.offset(1, StateArray::Master, 0), HEADER + 12 * e0);
        assert_eq!(m0.len, HEADER + 12 * (e0 + 3));
        let s1 = a.real_range(1).start;
        assert_eq!(m1.offset(0, StateArray::M, s1 + 2), HEADER + 4 * e1 + 8);
        assert_eq!(m1.len, HEADER + 12 * e1);
        let h = header(258);
        assert_eq!(&h[..8], b"ZEROCKPT");
        assert_eq!(h[8..], [1, 0, 0, 0, 2, 1, 0, 0]);
        assert_eq!(rank_file(12), "rank00012.bin");
    }
}
