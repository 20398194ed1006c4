//! A pool of events, shared by the backends: [`Backend::record`] takes an
//! event from it instead of creating one, and an event goes back when the
//! last handle to it drops.
//!
//! ```text
//!  record ─▶ take: a pooled event whose work is done ─▶ re-record it
//!            (none: create one)            │
//!  handles (clones) ── last one drops ─────┴─▶ put back (up to CAPACITY)
//! ```
//!
//! An event is re-recorded only once no handle refers to it: a handle
//! always means the point it was recorded at (a wait or sync on it later
//! waits for that point, never for a later record), and only an event
//! whose recorded work is done is reused, so a re-record never moves a
//! point still in flight.
//!
//! [`Backend::record`]: super::Backend::record

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Events kept for reuse at most; more are destroyed when they drop.
pub(crate) const CAPACITY: usize = 64;

/// The free events of one backend.
pub(crate) struct EventPool<E> {
    free: Mutex<Vec<E>>,
    created: AtomicU64,
}

impl<E> Default for EventPool<E> {
    fn default() -> Self {
        Self {
            free: Mutex::new(Vec::new()),
            created: AtomicU64::new(0),
        }
    }
}

impl<E> EventPool<E> {
    /// A free event whose work `done` says is complete (the oldest such),
    /// or `None`: then the caller creates one and counts it with
    /// [`EventPool::created_one`].
    pub(crate) fn take(&self, done: impl Fn(&E) -> bool) -> Option<E> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let at = free.iter().position(done)?;
        Some(free.remove(at))
    }

    /// Counts an event created because none could be reused.
    pub(crate) fn created_one(&self) {
        self.created.fetch_add(1, Ordering::Relaxed);
    }

    /// Events created so far (the rest of the records reused one).
    pub(crate) fn created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    fn put(&self, event: E) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < CAPACITY {
            free.push(event);
        }
    }
}

/// An event lent by a pool, shared by the handles of one record
/// (`Arc<Pooled<E>>`): back to the pool when the last one drops.
pub(crate) struct Pooled<E> {
    event: Option<E>,
    pool: Arc<EventPool<E>>,
}

impl<E> Pooled<E> {
    /// `event`, recorded, lent by `pool`.
    pub(crate) fn new(event: E, pool: Arc<EventPool<E>>) -> Self {
        Self {
            event: Some(event),
            pool,
        }
    }

    /// The event.
    pub(crate) fn get(&self) -> &E {
        self.event
            .as_ref()
            .expect("a lent event is present until it drops")
    }
}

impl<E> Drop for Pooled<E> {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            self.pool.put(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_comes_back_when_its_last_handle_drops() {
        let pool = Arc::new(EventPool::<u32>::default());
        let a = Arc::new(Pooled::new(1, pool.clone()));
        let a2 = a.clone();
        drop(a);
        // A handle is still out: nothing to take.
        assert_eq!(pool.take(|_| true), None);
        drop(a2);
        assert_eq!(pool.take(|_| true), Some(1));
    }

    #[test]
    fn only_events_whose_work_is_done_are_taken() {
        let pool = Arc::new(EventPool::<u32>::default());
        for e in [1, 2, 3] {
            drop(Pooled::new(e, pool.clone()));
        }
        assert_eq!(pool.take(|&e| e >= 2), Some(2));
        assert_eq!(pool.take(|&e| e == 2), None);
        assert_eq!(pool.take(|_| true), Some(1));
    }

    #[test]
    fn the_pool_keeps_at_most_its_capacity() {
        let pool = Arc::new(EventPool::<usize>::default());
        for e in 0..CAPACITY + 10 {
            drop(Pooled::new(e, pool.clone()));
        }
        let mut n = 0;
        while pool.take(|_| true).is_some() {
            n += 1;
        }
        assert_eq!(n, CAPACITY);
    }
}
