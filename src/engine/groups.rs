//! Parameter groups: a learning-rate scale and a weight decay per group of
//! tensors (PyTorch's optimizer `param_groups`; Hugging Face's default of
//! no decay on biases and norms), and the AdamW constants of one step per
//! group.
//!
//! Every tensor is in exactly one group: the first whose predicate matches
//! it, in the order the groups were added, else the default group (the
//! config's learning rate and weight decay). AdamW is elementwise, so a
//! step over a unit split at group boundaries gives, in each group, the
//! bits of one call with that group's constants.

use std::ops::Range;

use zero_core::optim::{AdamWParams, AdamWStep};
use zero_core::partition::UnitLayout;

/// A group of tensors with its own learning rate and weight decay.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// Its name (in messages and the agreement between ranks).
    pub name: String,
    /// Multiplies the scheduled learning rate (1.0: the schedule's).
    pub lr_scale: f64,
    /// The decoupled weight decay; `None`: the config's.
    pub weight_decay: Option<f64>,
}

impl ParamGroup {
    /// A group with the scheduled learning rate and weight decay `wd`.
    pub fn with_weight_decay(name: impl Into<String>, wd: f64) -> Self {
        ParamGroup {
            name: name.into(),
            lr_scale: 1.0,
            weight_decay: Some(wd),
        }
    }
}

/// Whether a tensor is a bias, a norm's weight or an embedding (by its
/// unit's and its own name): Hugging Face's usual set for no weight decay.
pub fn is_bias_norm_or_embedding(unit: &str, tensor: &str) -> bool {
    let full = format!("{unit}.{tensor}").to_ascii_lowercase();
    full.ends_with("bias") || full.contains("norm") || full.contains("embed")
}

/// Which group each element of each unit is in: per unit, runs of
/// elements (unit coordinates, padding included) and their group index
/// (0: the default group; `i + 1`: the `i`-th added group).
#[derive(Debug, Clone)]
pub(crate) struct GroupMap {
    groups: Vec<ParamGroup>,
    spans: Vec<Vec<(Range<usize>, usize)>>,
}

impl GroupMap {
    /// The map of `layouts` under `groups`, each a group and its
    /// predicate `(unit, tensor) -> bool`.
    pub(crate) fn new(layouts: &[UnitLayout], groups: &[(ParamGroup, GroupPredicate)]) -> GroupMap {
        let spans = layouts
            .iter()
            .map(|l| {
                let mut runs: Vec<(Range<usize>, usize)> = Vec::new();
                let mut push = |r: Range<usize>, g: usize| match runs.last_mut() {
                    Some((last, lg)) if *lg == g && last.end == r.start => last.end = r.end,
                    _ if r.is_empty() => {}
                    _ => runs.push((r, g)),
                };
                let mut at = 0;
                let mut tensors: Vec<_> = l.tensors.iter().collect();
                tensors.sort_by_key(|t| t.offset);
                for t in tensors {
                    push(at..t.offset, 0);
                    let g = group_of(groups, &l.name, &t.name);
                    push(t.offset..t.offset + t.numel, g);
                    at = t.offset + t.numel;
                }
                push(at..l.padded_numel, 0);
                runs
            })
            .collect();
        GroupMap {
            groups: groups.iter().map(|(g, _)| g.clone()).collect(),
            spans,
        }
    }

    /// The constants of update `step` for every group (default first):
    /// `lr` (scheduled) times the group's scale, its weight decay or the
    /// config's.
    pub(crate) fn steps(
        &self,
        opt: &AdamWParams,
        lr: f64,
        step: u64,
        grad_scale: f32,
    ) -> Vec<AdamWStep> {
        let mut ks = vec![AdamWStep::new(opt, lr, step, grad_scale)];
        for g in &self.groups {
            let mut p = *opt;
            if let Some(wd) = g.weight_decay {
                p.weight_decay = wd;
            }
            ks.push(AdamWStep::new(&p, lr * g.lr_scale, step, grad_scale));
        }
        ks
    }

    /// The runs of unit `u` within its elements `r` (unit coordinates), as
    /// `(group, offset from r.start, length)`, in order.
    pub(crate) fn split(&self, u: usize, r: Range<usize>) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        if let Some(spans) = self.spans.get(u) {
            for (s, g) in spans {
                let (a, b) = (s.start.max(r.start), s.end.min(r.end));
                if a < b {
                    out.push((*g, a - r.start, b - a));
                }
            }
        }
        // The runs cover the whole padded unit (see `new`).
        debug_assert_eq!(out.iter().map(|x| x.2).sum::<usize>(), r.len());
        out
    }
}

/// Which tensors a group holds: `(unit, tensor) -> bool`.
pub type GroupPredicate = Box<dyn Fn(&str, &str) -> bool + Send>;

/// One AdamW step of every group: the constants per group and where each
/// group's elements are.
pub(crate) struct GroupedStep<'a> {
    /// The constants per group, default first.
    pub(crate) ks: &'a [AdamWStep],
    /// The groups' elements.
    pub(crate) map: &'a GroupMap,
    /// Per unit, its first element of this rank's optimizer state (unit
    /// coordinates of state element 0).
    pub(crate) bases: &'a [usize],
}

impl GroupedStep<'_> {
    /// The runs of unit `u`'s state elements `state` (state coordinates)
    /// as `(group, offset from state.start, length)`.
    pub(crate) fn split(&self, u: usize, state: Range<usize>) -> Vec<(usize, usize, usize)> {
        let base = self.bases[u];
        self.map.split(u, base + state.start..base + state.end)
    }
}

/// Skips `skip` elements of `s`, returns the next `n` and leaves `s` at
/// the rest.
pub(crate) fn carve<'a, T>(s: &mut &'a mut [T], skip: usize, n: usize) -> &'a mut [T] {
    let (head, tail) = std::mem::take(s)[skip..].split_at_mut(n);
    *s = tail;
    head
}

/// The group of tensor `tensor` of unit `unit`: 0 (default) or `i + 1`
/// for the first of `groups` whose predicate holds.
pub(crate) fn group_of(groups: &[(ParamGroup, GroupPredicate)], unit: &str, tensor: &str) -> usize {
    groups
        .iter()
        .position(|(_, member)| member(unit, tensor))
        .map_or(0, |i| i + 1)
}

/// `range` shifted down by `base` (an empty range anywhere maps to 0..0:
/// a shard made only of padding).
pub(crate) fn relative(range: Range<usize>, base: usize) -> Range<usize> {
    if range.is_empty() {
        0..0
    } else {
        range.start - base..range.end - base
    }
}
