//! Argument checks of device collectives and groups: pure functions that
//! run before anything is enqueued, so a bad call is an
//! [`Error::InvalidArgument`] naming the collective, the rank and the
//! lengths, and never a hang or a corrupted buffer on the GPU.
//!
//! NCCL's collectives move equal parts: reduce-scatter and all-gather need
//! the full buffer to be exactly `world_size` times the shard.
//!
//! ```text
//!  reduce_scatter: input  [ s0 | s1 | .. | s(w-1) ]  len = w × n
//!                  output [ s(rank) reduced ]         len = n
//!  all_gather:     input  [ own shard ]               len = n
//!                  output [ s0 | s1 | .. | s(w-1) ]   len = w × n
//!  in place: one buffer of w × n; this rank's shard at rank × n
//! ```
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use zero_core::cuda::version::{Version, NCCL_MIN_VERSION};
use zero_core::DType;

use crate::{Error, Result};

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// A buffer as the checks see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Operand {
    pub dtype: DType,
    pub len: usize,
    /// The GPU that holds it.
    pub ordinal: usize,
}

/// The communicator a collective runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Site {
    pub rank: usize,
    pub world: usize,
    pub ordinal: usize,
}

/// A checked collective: what NCCL is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub coll: Coll,
    pub dtype: DType,
    /// NCCL's count argument: elements of the all-reduce, the output shard
    /// of reduce-scatter (`recvcount`), the input shard of all-gather
    /// (`sendcount`).
    pub count: usize,
    /// Elements of the full buffer: the all-reduce's, reduce-scatter's
    /// input, all-gather's output.
    pub total: usize,
    /// Elements to add to the send buffer's start (in-place all-gather:
    /// this rank's shard inside the one buffer).
    pub send_offset: usize,
    /// Elements to add to the receive buffer's start (in-place
    /// reduce-scatter: this rank's shard inside the one buffer).
    pub recv_offset: usize,
}

fn invalid(site: Site, op: &'static str, msg: String) -> Error {
    Error::InvalidArgument {
        rank: site.rank,
        op,
        msg,
    }
}

/// Checks a collective and computes what NCCL is given. `recv` is `None`
/// for the in-place forms, where `send` is the one buffer.
pub(crate) fn plan(
    coll: Coll,
    op: &'static str,
    site: Site,
    send: Operand,
    recv: Option<Operand>,
) -> Result<Plan> {
    let Site {
        rank,
        world,
        ordinal,
    } = site;
    if world == 0 || rank >= world {
        return Err(invalid(
            site,
            op,
            format!("rank {rank} is not a rank of a group of {world}"),
        ));
    }
    let names = if recv.is_some() {
        ["input", "output"]
    } else {
        ["buffer", "buffer"]
    };
    for (name, o) in names.iter().zip([Some(send), recv].into_iter().flatten()) {
        if o.ordinal != ordinal {
            return Err(invalid(
                site,
                op,
                format!(
                    "the {name} is on cuda:{} but this communicator is on cuda:{ordinal}",
                    o.ordinal
                ),
            ));
        }
    }
    if let Some(r) = recv {
        if r.dtype != send.dtype {
            return Err(invalid(
                site,
                op,
                format!("the input is {} but the output is {}", send.dtype, r.dtype),
            ));
        }
    }
    let times = |n: usize| {
        n.checked_mul(world).ok_or_else(|| {
            invalid(
                site,
                op,
                format!("{n} elements × {world} ranks overflows usize"),
            )
        })
    };
    let base = Plan {
        coll,
        dtype: send.dtype,
        count: 0,
        total: 0,
        send_offset: 0,
        recv_offset: 0,
    };
    match (coll, recv) {
        (Coll::AllReduce, None) => Ok(Plan {
            count: send.len,
            total: send.len,
            ..base
        }),
        (Coll::AllReduce, Some(r)) => {
            if r.len != send.len {
                return Err(invalid(
                    site,
                    op,
                    format!(
                        "the input has {} elements but the output has {}: they must be equal",
                        send.len, r.len
                    ),
                ));
            }
            Ok(Plan {
                count: send.len,
                total: send.len,
                ..base
            })
        }
        (Coll::ReduceScatter, Some(r)) => {
            let want = times(r.len)?;
            if send.len != want {
                return Err(invalid(
                    site,
                    op,
                    format!(
                        "the input has {} elements but must be world_size ({world}) × the \
                         output's {} = {want}",
                        send.len, r.len
                    ),
                ));
            }
            Ok(Plan {
                count: r.len,
                total: send.len,
                ..base
            })
        }
        (Coll::AllGather, Some(r)) => {
            let want = times(send.len)?;
            if r.len != want {
                return Err(invalid(
                    site,
                    op,
                    format!(
                        "the output has {} elements but must be world_size ({world}) × the \
                         input's {} = {want}",
                        r.len, send.len
                    ),
                ));
            }
            Ok(Plan {
                count: send.len,
                total: r.len,
                ..base
            })
        }
        (Coll::ReduceScatter | Coll::AllGather, None) => {
            if !send.len.is_multiple_of(world) {
                return Err(invalid(
                    site,
                    op,
                    format!(
                        "the buffer has {} elements, which is not divisible by world_size \
                         {world} (pad it to {})",
                        send.len,
                        send.len.div_ceil(world) * world
                    ),
                ));
            }
            let n = send.len / world;
            let own = rank * n;
            Ok(Plan {
                count: n,
                total: send.len,
                send_offset: if coll == Coll::AllGather { own } else { 0 },
                recv_offset: if coll == Coll::ReduceScatter { own } else { 0 },
                ..base
            })
        }
    }
}

/// NCCL's version code as `major.minor.patch` ([`Version::from_nccl_code`]
/// decodes both encodings).
pub(crate) fn version_string(code: i32) -> String {
    match u32::try_from(code) {
        Ok(c) => Version::from_nccl_code(c).to_string(),
        Err(_) => format!("(invalid version code {code})"),
    }
}

/// Whether NCCL's version code `code` is at least [`NCCL_MIN_VERSION`].
pub(crate) fn version_supported(code: i32) -> bool {
    u32::try_from(code).is_ok_and(|c| Version::from_nccl_code(c).at_least(&NCCL_MIN_VERSION))
}

/// `NCCL_VERSION(2, 30, 0)`: the first that can run two ranks of one
/// communicator on one GPU (with `NCCL_MULTI_RANK_GPU_ENABLE=1`).
pub(crate) const MULTI_RANK_GPU_VERSION: i32 = 23_000;

/// Whether NCCL will accept several ranks on one GPU: version ≥ 2.30 and
/// `NCCL_MULTI_RANK_GPU_ENABLE=1` (`env` is that variable's value).
pub(crate) fn multi_rank_gpu_allowed(version: i32, env: Option<&str>) -> bool {
    version >= MULTI_RANK_GPU_VERSION && env.map(str::trim) == Some("1")
}

/// Checks the GPUs of an in-process group: at least one rank, and one GPU
/// per rank unless NCCL allows sharing (`multi_rank_gpu`).
pub(crate) fn check_devices(ordinals: &[usize], version: i32, multi_rank_gpu: bool) -> Result<()> {
    if ordinals.is_empty() {
        return Err(Error::Config {
            key: "world_size".into(),
            msg: "an NCCL group needs at least one rank (one device per rank)".into(),
        });
    }
    if i32::try_from(ordinals.len()).is_err() {
        return Err(Error::Config {
            key: "world_size".into(),
            msg: format!("{} ranks: NCCL counts ranks in an int", ordinals.len()),
        });
    }
    if multi_rank_gpu {
        return Ok(());
    }
    for (rank, o) in ordinals.iter().enumerate() {
        if let Some(first) = ordinals[..rank].iter().position(|p| p == o) {
            let how = if version >= MULTI_RANK_GPU_VERSION {
                "set NCCL_MULTI_RANK_GPU_ENABLE=1 to let this NCCL (experimentally) share a GPU \
                 between two ranks"
            } else {
                "NCCL 2.30 or later can, experimentally, with NCCL_MULTI_RANK_GPU_ENABLE=1"
            };
            return Err(Error::InvalidArgument {
                rank,
                op: "nccl_group",
                msg: format!(
                    "ranks {first} and {rank} are both on cuda:{o}: NCCL {} runs one rank of a \
                     communicator per GPU ({how})",
                    version_string(version)
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SITE: Site = Site {
        rank: 1,
        world: 4,
        ordinal: 0,
    };

    fn o(dtype: DType, len: usize) -> Operand {
        Operand {
            dtype,
            len,
            ordinal: 0,
        }
    }

    #[track_caller]
    fn invalid_msg(r: Result<Plan>, op: &str) -> String {
        match r {
            Err(Error::InvalidArgument {
                rank,
                op: got_op,
                msg,
            }) => {
                assert_eq!(rank, SITE.rank);
                assert_eq!(got_op, op);
                let full = Error::InvalidArgument {
                    rank,
                    op: got_op,
                    msg: msg.clone(),
                }
                .to_string();
                assert!(
                    full.starts_with(&format!("rank 1: invalid arguments to {op}: ")),
                    "{full}"
                );
                msg
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn all_reduce_plans() {
        let p = plan(
            Coll::AllReduce,
            "all_reduce",
            SITE,
            o(DType::BF16, 10),
            None,
        )
        .unwrap();
        assert_eq!(
            (p.count, p.total, p.send_offset, p.recv_offset),
            (10, 10, 0, 0)
        );
        assert_eq!(p.dtype, DType::BF16);
        let p = plan(
            Coll::AllReduce,
            "all_reduce_into",
            SITE,
            o(DType::F32, 7),
            Some(o(DType::F32, 7)),
        )
        .unwrap();
        assert_eq!(p.count, 7);
        let msg = invalid_msg(
            plan(
                Coll::AllReduce,
                "all_reduce_into",
                SITE,
                o(DType::F32, 7),
                Some(o(DType::F32, 8)),
            ),
            "all_reduce_into",
        );
        assert!(
            msg.contains("input has 7") && msg.contains("output has 8"),
            "{msg}"
        );
    }

    #[test]
    fn reduce_scatter_needs_world_times_output() {
        let p = plan(
            Coll::ReduceScatter,
            "reduce_scatter",
            SITE,
            o(DType::F32, 12),
            Some(o(DType::F32, 3)),
        )
        .unwrap();
        assert_eq!(
            (p.count, p.total, p.send_offset, p.recv_offset),
            (3, 12, 0, 0)
        );
        let msg = invalid_msg(
            plan(
                Coll::ReduceScatter,
                "reduce_scatter",
                SITE,
                o(DType::F32, 10),
                Some(o(DType::F32, 3)),
            ),
            "reduce_scatter",
        );
        assert!(
            msg.contains("input has 10 elements") && msg.contains("(4) × the output's 3 = 12"),
            "{msg}"
        );
    }

    #[test]
    fn all_gather_needs_world_times_input() {
        let p = plan(
            Coll::AllGather,
            "all_gather",
            SITE,
            o(DType::F16, 5),
            Some(o(DType::F16, 20)),
        )
        .unwrap();
        assert_eq!((p.count, p.total), (5, 20));
        let msg = invalid_msg(
            plan(
                Coll::AllGather,
                "all_gather",
                SITE,
                o(DType::F16, 5),
                Some(o(DType::F16, 21)),
            ),
            "all_gather",
        );
        assert!(
            msg.contains("output has 21") && msg.contains("= 20"),
            "{msg}"
        );
    }

    #[test]
    fn in_place_forms_need_divisible_lengths_and_point_at_the_own_shard() {
        let rs = plan(
            Coll::ReduceScatter,
            "reduce_scatter_in_place",
            SITE,
            o(DType::BF16, 16),
            None,
        )
        .unwrap();
        assert_eq!((rs.count, rs.send_offset, rs.recv_offset), (4, 0, 4));
        let ag = plan(
            Coll::AllGather,
            "all_gather_in_place",
            SITE,
            o(DType::BF16, 16),
            None,
        )
        .unwrap();
        assert_eq!((ag.count, ag.send_offset, ag.recv_offset), (4, 4, 0));
        for (coll, op) in [
            (Coll::ReduceScatter, "reduce_scatter_in_place"),
            (Coll::AllGather, "all_gather_in_place"),
        ] {
            let msg = invalid_msg(plan(coll, op, SITE, o(DType::BF16, 18), None), op);
            assert!(
                msg.contains("18 elements") && msg.contains("world_size 4 (pad it to 20)"),
                "{msg}"
            );
        }
        // Empty buffers are fine (every rank skips them alike).
        let p = plan(Coll::ReduceScatter, "rs", SITE, o(DType::F32, 0), None).unwrap();
        assert_eq!(p.count, 0);
    }

    #[test]
    fn dtypes_devices_and_ranks_must_match() {
        let msg = invalid_msg(
            plan(
                Coll::AllGather,
                "all_gather",
                SITE,
                o(DType::BF16, 2),
                Some(o(DType::F32, 8)),
            ),
            "all_gather",
        );
        assert_eq!(msg, "the input is bf16 but the output is f32");

        let elsewhere = Operand {
            ordinal: 3,
            ..o(DType::F32, 8)
        };
        let msg = invalid_msg(
            plan(
                Coll::AllReduce,
                "all_reduce_into",
                SITE,
                o(DType::F32, 8),
                Some(elsewhere),
            ),
            "all_reduce_into",
        );
        assert_eq!(
            msg,
            "the output is on cuda:3 but this communicator is on cuda:0"
        );

        let bad_rank = Site { rank: 4, ..SITE };
        match plan(
            Coll::AllReduce,
            "all_reduce",
            bad_rank,
            o(DType::F32, 8),
            None,
        ) {
            Err(Error::InvalidArgument { rank: 4, msg, .. }) => {
                assert_eq!(msg, "rank 4 is not a rank of a group of 4")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn overflowing_lengths_are_errors() {
        let msg = invalid_msg(
            plan(
                Coll::AllGather,
                "all_gather",
                SITE,
                o(DType::F32, usize::MAX / 2),
                Some(o(DType::F32, 1)),
            ),
            "all_gather",
        );
        assert!(msg.contains("overflows"), "{msg}");
    }

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(version_string(22_105), "2.21.5");
        assert_eq!(version_string(23_007), "2.30.7");
        assert_eq!(version_string(2_804), "2.8.4");
        assert_eq!(version_string(-1), "(invalid version code -1)");
    }

    #[test]
    fn oldest_supported_version_is_2_14() {
        assert!(version_supported(21_400));
        assert!(version_supported(22_805));
        assert!(!version_supported(21_305));
        assert!(!version_supported(2_804));
        assert!(!version_supported(-1));
    }

    #[test]
    fn one_gpu_per_rank_unless_nccl_allows_sharing() {
        check_devices(&[0, 1, 2], 22_105, false).unwrap();
        match check_devices(&[0, 1, 0], 22_105, false) {
            Err(Error::InvalidArgument { rank, op, msg }) => {
                assert_eq!((rank, op), (2, "nccl_group"));
                assert!(msg.starts_with("ranks 0 and 2 are both on cuda:0"), "{msg}");
                assert!(msg.contains("NCCL 2.21.5"), "{msg}");
                assert!(msg.contains("2.30 or later"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
        match check_devices(&[1, 1], 23_007, false) {
            Err(Error::InvalidArgument { msg, .. }) => {
                assert!(msg.contains("set NCCL_MULTI_RANK_GPU_ENABLE=1"), "{msg}")
            }
            other => panic!("{other:?}"),
        }
        check_devices(&[1, 1], 23_007, true).unwrap();
        assert!(matches!(
            check_devices(&[], 23_007, true),
            Err(Error::Config { .. })
        ));

        assert!(!multi_rank_gpu_allowed(22_999, Some("1")));
        assert!(multi_rank_gpu_allowed(23_000, Some("1")));
        assert!(multi_rank_gpu_allowed(23_007, Some(" 1 ")));
        assert!(!multi_rank_gpu_allowed(23_007, Some("0")));
        assert!(!multi_rank_gpu_allowed(23_007, None));
    }
}
