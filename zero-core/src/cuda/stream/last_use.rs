//! The reuse rule of a buffer, without CUDA: which stream used it last, and
//! so whether a new use must wait for the event of that use.

/// Where a buffer was last used, as far as the host knows.
///
/// `S` identifies a stream (in the CUDA backend, the stream itself, kept
/// alive so that its handle cannot be reused by a new stream). The buffer's
/// event was recorded after that use; the rule is:
///
/// - work on the same stream is ordered after it by the stream: no wait;
/// - work on another stream must wait for the event first;
/// - the host must wait for the event before touching the memory, after
///   which no use is pending.
///
/// Waits chain: a stream that waited for the event and used the buffer
/// records the event again, so the new record covers every earlier use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LastUse<S> {
    /// No use is pending: the memory is free for any stream or the host.
    Idle,
    /// Last used by work enqueued on this stream, whose completion the
    /// buffer's event marks.
    On(S),
}

impl<S: PartialEq> LastUse<S> {
    /// Whether work about to be enqueued on `stream` must first wait for
    /// the buffer's event.
    pub(crate) fn must_wait(&self, stream: &S) -> bool {
        matches!(self, LastUse::On(last) if last != stream)
    }

    /// Whether the host must wait for the buffer's event before touching
    /// the memory.
    pub(crate) fn must_host_wait(&self) -> bool {
        matches!(self, LastUse::On(_))
    }

    /// The buffer's event was just recorded on `stream` after a use.
    pub(crate) fn used_on(&mut self, stream: S) {
        *self = LastUse::On(stream);
    }

    /// The host waited for the event: every use so far has completed.
    pub(crate) fn host_waited(&mut self) {
        *self = LastUse::Idle;
    }

    /// The stream of the pending use, if any.
    pub(crate) fn stream(&self) -> Option<&S> {
        match self {
            LastUse::Idle => None,
            LastUse::On(s) => Some(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays uses and host accesses on a buffer and returns, per step,
    /// whether a wait was needed: `Some(stream)` is a use on that stream,
    /// `None` a host access.
    fn replay(steps: &[Option<u8>]) -> Vec<bool> {
        let mut state = LastUse::Idle;
        steps
            .iter()
            .map(|step| match step {
                Some(s) => {
                    let wait = state.must_wait(s);
                    state.used_on(*s);
                    wait
                }
                None => {
                    let wait = state.must_host_wait();
                    state.host_waited();
                    wait
                }
            })
            .collect()
    }

    #[test]
    fn same_stream_needs_no_wait_other_stream_does() {
        // h2d, h2d, compute, compute, d2h.
        assert_eq!(
            replay(&[Some(2), Some(2), Some(0), Some(0), Some(3)]),
            [false, false, true, false, true]
        );
    }

    #[test]
    fn host_access_waits_once_then_frees() {
        // host, d2h, host, host, h2d (no wait: the host saw d2h complete).
        assert_eq!(
            replay(&[None, Some(3), None, None, Some(2)]),
            [false, false, true, false, false]
        );
    }

    #[test]
    fn every_cross_stream_use_waits_for_the_previous_one() {
        // Property over all short sequences: a use waits exactly when the
        // previous event-recording step was on another stream and no host
        // wait came in between.
        for n in 0..4096u32 {
            let steps: Vec<Option<u8>> = (0..6)
                .map(|i| match (n >> (2 * i)) & 3 {
                    3 => None,
                    s => Some(s as u8),
                })
                .collect();
            let waits = replay(&steps);
            for (i, step) in steps.iter().enumerate() {
                let previous = steps[..i].last().copied().flatten();
                let expected = match (step, steps[..i].last()) {
                    (_, None) | (_, Some(None)) => false,
                    (Some(s), Some(Some(p))) => s != p,
                    (None, Some(Some(_))) => true,
                };
                assert_eq!(waits[i], expected, "{steps:?} at {i} (prev {previous:?})");
            }
        }
    }

    #[test]
    fn stream_of_pending_use() {
        let mut s = LastUse::Idle;
        assert_eq!(s.stream(), None);
        s.used_on(4);
        assert_eq!(s.stream(), Some(&4));
        s.host_waited();
        assert_eq!(s, LastUse::Idle);
    }
}
