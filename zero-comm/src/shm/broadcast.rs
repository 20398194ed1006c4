//! Broadcast: every rank but the root copies the root's buffer.
//!
//! ```text
//!  before   root [ x ]   rank a [ ? ]   rank b [ ? ]
//!  after    root [ x ]   rank a [ x ]   rank b [ x ]
//! ```

use zero_core::Element;

use super::Ctx;
use crate::reduce::copy;

/// # Safety
/// See `ShmGroup::run`; every buffer holds `desc.len` elements.
pub(crate) unsafe fn run<T: Element>(ctx: &Ctx<'_>) {
    let root = ctx.desc.root;
    if ctx.rank != root {
        // SAFETY: the root's buffer is only read during the collective; this
        // rank's buffer is written by this rank only.
        unsafe { copy(ctx.send::<T>(root), ctx.recv::<T>(ctx.rank), ctx.desc.len) };
    }
}
