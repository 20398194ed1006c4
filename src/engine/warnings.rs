//! The warnings an engine gives ([`Warnings`]): the config's, the
//! components' at build, and those of later calls (a stage-3 gather order
//! that differs from the recorded one, a non-finite gradient norm without
//! a loss scaler, a checkpoint's), each once.

/// The warnings given so far, each once; rank 0 also prints them.
pub(super) struct Warnings {
    rank: usize,
    given: Vec<String>,
}

impl Warnings {
    /// Rank `rank`'s warnings, starting with `first` (the build's).
    pub(super) fn new(rank: usize, first: Vec<String>) -> Self {
        let mut w = Self {
            rank,
            given: Vec::new(),
        };
        first.into_iter().for_each(|m| w.give(m));
        w
    }

    /// Gives `msg` unless it was given before.
    pub(super) fn give(&mut self, msg: String) {
        if !self.given.contains(&msg) {
            if self.rank == 0 {
                eprintln!("zero: warning: {msg}");
            }
            self.given.push(msg);
        }
    }

    /// Every warning given, in order.
    pub(super) fn given(&self) -> &[String] {
        &self.given
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_warning_once_in_order() {
        let mut w = Warnings::new(1, vec!["a".into(), "b".into(), "a".into()]);
        w.give("c".into());
        w.give("b".into());
        assert_eq!(w.given(), ["a", "b", "c"]);
    }
}
