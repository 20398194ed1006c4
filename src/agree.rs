//! Agreements among ranks that end in `zero`'s own errors, on top of the
//! byte collectives of [`zero_comm::agree`].
//!
//! ```text
//!  rank 0: built Ok(x)        ─┐  first_failure  ─▶ rank 0: Err(Usage "rank 1 could not
//!  rank 1: built Err("no dir") ─┘  (one collective,        set up its ...: no dir")
//!                                  two on a failure) ─▶ rank 1: Err("no dir") (its own)
//! ```

use zero_comm::agree::first_failure;
use zero_comm::Communicator;

use crate::{Error, Result};

/// Every rank learns whether every rank could set up `what` (`built` is
/// this rank's attempt), so that all fail together instead of hanging in
/// the next collective: this rank's own error, or one naming the first
/// rank that failed. A collective: every rank calls it at the same point.
pub(crate) fn agree_on_setup<C: Communicator, T>(
    comm: &C,
    built: Result<T>,
    what: &str,
) -> Result<T> {
    let failed = first_failure(comm, built.as_ref().err())?;
    let ok = built?;
    match failed {
        Some((r, why)) => Err(Error::Usage {
            rank: comm.rank(),
            what: format!("rank {r} could not set up its {what}): {why}"),
        }),
        None => Ok(ok),
    }
}
