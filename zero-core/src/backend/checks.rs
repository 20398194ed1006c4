//! The argument checks every backend runs before it enqueues anything, so
//! that the CPU and CUDA backends refuse the same arguments with the same
//! messages.

use std::ops::Range;

use super::BufferId;
use crate::{Error, Result};

/// The length of `r`; an error if it ends before it starts.
pub(crate) fn range_len(op: &'static str, r: &Range<usize>) -> Result<usize> {
    if r.start > r.end {
        return Err(Error::InvalidSize {
            op,
            msg: format!("range [{}..{}) ends before it starts", r.start, r.end),
        });
    }
    Ok(r.end - r.start)
}

/// `Ok` if elements `at..at + len` lie in buffer `label` (`id`) of
/// `buf_len` elements.
pub(crate) fn bounds(
    op: &'static str,
    label: &str,
    id: BufferId,
    buf_len: usize,
    at: usize,
    len: usize,
) -> Result<()> {
    match at.checked_add(len) {
        Some(end) if end <= buf_len => Ok(()),
        _ => Err(Error::InvalidSize {
            op,
            msg: format!(
                "elements [{at}..{at}+{len}) outside buffer {label:?} ({id}) of {buf_len} elements"
            ),
        }),
    }
}

/// `Ok` if the `len` elements at `src` and at `dst_at` of buffer `label`
/// (`id`) do not overlap (`copy_within`).
pub(crate) fn disjoint(
    op: &'static str,
    label: &str,
    id: BufferId,
    src: &Range<usize>,
    dst_at: usize,
    len: usize,
) -> Result<()> {
    if src.start < dst_at.saturating_add(len) && dst_at < src.end {
        return Err(Error::InvalidSize {
            op,
            msg: format!(
                "source [{}..{}) and destination [{dst_at}..{}) overlap in buffer {label:?} ({id})",
                src.start,
                src.end,
                dst_at.saturating_add(len),
            ),
        });
    }
    Ok(())
}

/// Prefixes an argument error with the part or piece it concerns (`what
/// i: ...`).
pub(crate) fn item_error(e: Error, what: &str, i: usize) -> Error {
    match e {
        Error::InvalidSize { op, msg } => Error::InvalidSize {
            op,
            msg: format!("{what} {i}: {msg}"),
        },
        Error::Backend { op, msg } => Error::Backend {
            op,
            msg: format!("{what} {i}: {msg}"),
        },
        other => other,
    }
}
