//! The NCCL unique id, and its broadcast from rank 0 over a host
//! communicator (MPI under `mpirun`, or any [`Communicator`]).
//!
//! ```text
//!  rank 0: ncclGetUniqueId ─▶ [ OK, b0, b1, .., b127 ]   129 f32 words,
//!          (or it failed) ─▶ [ FAILED, 0, .., 0 ]        each byte exact
//!                                   │ Communicator::broadcast(root 0)
//!                                   ▼
//!  every rank: decode ─▶ NcclId, or PeerFailed { peer: 0 } when rank 0 failed
//! ```
//!
//! The id travels in a typed broadcast: each byte as the f32 of its value
//! (0.0 ..= 255.0), exact whatever a transport does with floats. Rank 0
//! always takes part in the broadcast, also when it could not create the
//! id, so no rank waits for an id that never comes.

use zero_core::HostBuffer;

use crate::{Communicator, Error, Result};

/// NCCL's unique id: 128 opaque bytes that rank 0 creates
/// (`ncclGetUniqueId`) and every rank of the communicator passes to its
/// initialization. It names rank 0's bootstrap socket: whoever holds it
/// can join, so it travels only to the group's ranks.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NcclId([u8; NcclId::BYTES]);

const OK: f32 = 1.0;
const FAILED: f32 = 2.0;

impl NcclId {
    /// Size of an id in bytes (`NCCL_UNIQUE_ID_BYTES`).
    pub const BYTES: usize = 128;

    /// Creates a new id (`ncclGetUniqueId`), which starts NCCL's bootstrap
    /// root in this process: call it on one rank only.
    ///
    /// Errors: without the `cuda` feature,
    /// [`zero_core::Error::NotCompiledWith`]`("cuda")`; without a usable
    /// NCCL library, an [`NcclError`](super::NcclError). Never panics.
    pub fn new() -> Result<NcclId> {
        #[cfg(feature = "cuda")]
        {
            super::ffi::unique_id()
                .map(NcclId::from_bytes)
                .map_err(Error::from)
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(zero_core::Error::NotCompiledWith("cuda").into())
        }
    }

    /// An id from its bytes (as received from rank 0 by other means).
    pub fn from_bytes(bytes: [u8; NcclId::BYTES]) -> NcclId {
        NcclId(bytes)
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; NcclId::BYTES] {
        &self.0
    }

    /// Rank 0 of `host` creates an id and broadcasts it; every rank
    /// returns it. All ranks of `host` must call this together.
    ///
    /// When rank 0 cannot create the id it returns why, and the other
    /// ranks get [`Error::PeerFailed`] naming rank 0.
    pub fn share<C: Communicator>(host: &C) -> Result<NcclId> {
        Self::share_with(host, NcclId::new)
    }

    /// [`NcclId::share`] with `create` in place of [`NcclId::new`] (run on
    /// rank 0 only).
    pub(crate) fn share_with<C: Communicator>(
        host: &C,
        create: impl FnOnce() -> Result<NcclId>,
    ) -> Result<NcclId> {
        let root = host.rank() == 0;
        let created = if root { Some(create()) } else { None };
        let words = encode(created.as_ref().and_then(|r| r.as_ref().ok()));
        let buf = HostBuffer::from_slice(&words)?;
        let got = host.broadcast(buf, 0).wait()?;
        if let Some(Err(e)) = created {
            return Err(e);
        }
        decode(&got).map_err(|reason| Error::PeerFailed {
            rank: host.rank(),
            op: "nccl_bootstrap",
            seq: 0,
            peer: 0,
            reason,
        })
    }
}

/// The broadcast form of an id (`None`: rank 0 failed).
fn encode(id: Option<&NcclId>) -> Vec<f32> {
    let mut w = vec![0.0f32; 1 + NcclId::BYTES];
    if let Some(id) = id {
        w[0] = OK;
        for (d, &b) in w[1..].iter_mut().zip(id.0.iter()) {
            *d = f32::from(b);
        }
    } else {
        w[0] = FAILED;
    }
    w
}

/// The id in `w`, or why there is none (the reason completes
/// "rank 0 ...").
fn decode(w: &[f32]) -> std::result::Result<NcclId, String> {
    if w.len() != 1 + NcclId::BYTES {
        return Err(format!(
            "sent {} words for the NCCL id instead of {}",
            w.len(),
            1 + NcclId::BYTES
        ));
    }
    if w[0] == FAILED {
        return Err("could not create the NCCL unique id (its own error says why)".into());
    }
    if w[0] != OK {
        return Err(format!("sent a malformed NCCL id (status word {})", w[0]));
    }
    let mut id = [0u8; NcclId::BYTES];
    for (i, (d, &x)) in id.iter_mut().zip(&w[1..]).enumerate() {
        if !(0.0..=255.0).contains(&x) || x.fract() != 0.0 {
            return Err(format!("sent a malformed NCCL id (byte {i} is {x})"));
        }
        *d = x as u8;
    }
    Ok(NcclId(id))
}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The bytes are an address to join; show a fingerprint only.
        let h = self.0.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        write!(f, "NcclId({h:016x})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThreadGroup;

    fn sample() -> NcclId {
        let mut b = [0u8; NcclId::BYTES];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37 % 256) as u8;
        }
        b[5] = 255;
        NcclId::from_bytes(b)
    }

    #[test]
    fn encoding_round_trips_every_byte_exactly() {
        let id = sample();
        assert_eq!(decode(&encode(Some(&id))), Ok(id));
        let all: [u8; 128] = std::array::from_fn(|i| (i * 2) as u8);
        let id = NcclId::from_bytes(all);
        assert_eq!(decode(&encode(Some(&id))), Ok(id));
        assert_eq!(id.as_bytes(), &all);
    }

    #[test]
    fn malformed_words_are_rejected() {
        assert!(decode(&encode(None))
            .unwrap_err()
            .contains("could not create"));
        let mut w = encode(Some(&sample()));
        w[3] = 1.5;
        assert!(decode(&w).unwrap_err().contains("byte 2 is 1.5"));
        w[3] = 256.0;
        assert!(decode(&w).unwrap_err().contains("byte 2 is 256"));
        assert!(decode(&w[..10]).unwrap_err().contains("10 words"));
        let mut w = encode(Some(&sample()));
        w[0] = 7.0;
        assert!(decode(&w).unwrap_err().contains("status word 7"));
    }

    #[test]
    fn debug_shows_a_fingerprint_not_the_address() {
        let s = format!("{:?}", sample());
        assert!(
            s.starts_with("NcclId(") && s.len() == "NcclId()".len() + 16,
            "{s}"
        );
    }

    #[test]
    fn rank_0_broadcasts_the_id_over_a_host_communicator() {
        // The MPI bootstrap path, on the threads backend: no GPU or NCCL needed.
        let got = ThreadGroup::run(3, |c| NcclId::share_with(&c, || Ok(sample()))).unwrap();
        for r in got {
            assert_eq!(r.unwrap(), sample());
        }
    }

    #[test]
    fn a_failing_rank_0_fails_every_rank_without_a_hang() {
        let got = ThreadGroup::run(3, |c| {
            NcclId::share_with(&c, || {
                Err(Error::Config {
                    key: "nccl".into(),
                    msg: "no id today".into(),
                })
            })
        })
        .unwrap();
        match &got[0] {
            Err(Error::Config { msg, .. }) => assert_eq!(msg, "no id today"),
            other => panic!("{other:?}"),
        }
        for (rank, r) in got.iter().enumerate().skip(1) {
            match r {
                Err(Error::PeerFailed {
                    rank: me,
                    op,
                    peer,
                    reason,
                    ..
                }) => {
                    assert_eq!((*me, *op, *peer), (rank, "nccl_bootstrap", 0));
                    assert!(reason.contains("could not create the NCCL unique id"));
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn share_without_a_library_is_an_error_on_every_rank() {
        // Without the cuda feature: NotCompiledWith; with it on a machine
        // without libnccl: an NcclError; with NCCL: every rank gets the id.
        let got = ThreadGroup::run(2, |c| NcclId::share(&c)).unwrap();
        match &got[0] {
            Ok(id) => assert_eq!(got[1].as_ref().unwrap(), id),
            Err(e) => {
                assert!(
                    matches!(e, Error::Core(zero_core::Error::NotCompiledWith("cuda")))
                        || super::super::NcclError::find(e).is_some(),
                    "{e}"
                );
                assert!(matches!(&got[1], Err(Error::PeerFailed { peer: 0, .. })));
            }
        }
    }
}
