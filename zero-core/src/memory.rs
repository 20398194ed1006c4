//! The memory tracker: current and peak bytes per tier and category.
//!
//! Every buffer the engine holds — parameters, gradients, fp32 master
//! weights, AdamW moments, gathered stage-3 units, communication buckets —
//! is accounted in one [`MemoryTracker`] per rank, under a [`Tier`] (where
//! the bytes live) and a [`Category`] (what they are for).
//! [`MemoryTracker::allocate`] returns an RAII [`Allocation`]: its bytes count
//! until it is dropped. The estimator uses the same tiers and categories, so
//! measured peaks can be held against the plan.
//!
//! Three kinds of peak are kept, each updated at every change:
//!
//! - per (tier, category): [`MemoryTracker::peak`];
//! - per tier, the peak of the tier's *sum* over categories
//!   ([`MemoryTracker::tier_peak`]), which is what must fit on a device and
//!   is in general less than the sum of the categories' peaks;
//! - per tier, the peak of the sum of the model-state categories
//!   ([`MemoryTracker::model_states_peak`]), to compare with ZeRO's
//!   16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N.
//!
//! Allocations and frees happen per buffer, not per element, so all counters
//! sit behind one mutex: every update and every report sees one consistent
//! state, which is what makes the peaks of sums exact.
//!
//! ```
//! use zero_core::memory::{Category, MemoryTracker, Tier};
//!
//! let tracker = MemoryTracker::new(0);
//! let params = tracker.allocate(Tier::Device, Category::Params, 2 << 20);
//! {
//!     let _bucket = tracker.allocate(Tier::Device, Category::CommBuffers, 1 << 20);
//!     assert_eq!(tracker.tier_current(Tier::Device), 3 << 20);
//! }
//! assert_eq!(tracker.tier_current(Tier::Device), 2 << 20);
//! assert_eq!(tracker.tier_peak(Tier::Device), 3 << 20);
//! assert_eq!(tracker.model_states(Tier::Device), params.bytes());
//! println!("{}", tracker.report());
//! ```

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

/// Where bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Accelerator memory (or, on a CPU-only run, the memory the "device"
    /// computes in).
    Device,
    /// Host memory (pinned or pageable), e.g. with `offload_optimizer: cpu`.
    Host,
    /// Files on NVMe, e.g. with `offload_optimizer: nvme`.
    Nvme,
}

impl Tier {
    /// All tiers, in report order.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Nvme];

    /// The name used in reports (`"device"`, `"host"`, `"nvme"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Nvme => "nvme",
        }
    }

    /// Position in [`Tier::ALL`].
    const fn index(self) -> usize {
        match self {
            Tier::Device => 0,
            Tier::Host => 1,
            Tier::Nvme => 2,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What bytes are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// The persistent parameter storage (bf16 or fp32), full or a shard.
    Params,
    /// Gradient storage, full or a shard.
    Grads,
    /// fp32 master weights.
    Master,
    /// AdamW first and second moments (`m` and `v`).
    Moments,
    /// Stage-3 units gathered for use: prefetched, in use, or kept live.
    GatheredParams,
    /// Gradient buckets and staging buffers of collectives and transfers.
    CommBuffers,
    /// Activations, as the trainer reports them.
    Activations,
}

impl Category {
    /// All categories, in report order.
    pub const ALL: [Category; 7] = [
        Category::Params,
        Category::Grads,
        Category::Master,
        Category::Moments,
        Category::GatheredParams,
        Category::CommBuffers,
        Category::Activations,
    ];

    /// The name used in reports (`"params"`, `"grads"`, `"master"`,
    /// `"moments"`, `"gathered_params"`, `"comm_buffers"`, `"activations"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Category::Params => "params",
            Category::Grads => "grads",
            Category::Master => "master",
            Category::Moments => "moments",
            Category::GatheredParams => "gathered_params",
            Category::CommBuffers => "comm_buffers",
            Category::Activations => "activations",
        }
    }

    /// Whether the category is a model state in ZeRO's sense: parameters,
    /// gradients, master weights and moments (not gathered units, buffers
    /// or activations).
    pub const fn is_model_state(self) -> bool {
        matches!(
            self,
            Category::Params | Category::Grads | Category::Master | Category::Moments
        )
    }

    /// Position in [`Category::ALL`].
    const fn index(self) -> usize {
        match self {
            Category::Params => 0,
            Category::Grads => 1,
            Category::Master => 2,
            Category::Moments => 3,
            Category::GatheredParams => 4,
            Category::CommBuffers => 5,
            Category::Activations => 6,
        }
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

const TIERS: usize = Tier::ALL.len();
const CATEGORIES: usize = Category::ALL.len();

/// A current value and the highest it has been since the last reset.
#[derive(Debug, Default, Clone, Copy)]
struct Counter {
    current: u64,
    peak: u64,
}

impl Counter {
    fn add(&mut self, bytes: u64) {
        self.current = self.current.saturating_add(bytes);
        self.peak = self.peak.max(self.current);
    }

    fn sub(&mut self, bytes: u64) {
        self.current = self.current.saturating_sub(bytes);
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// All counters of one rank.
#[derive(Debug, Default)]
struct State {
    /// Per tier and category.
    cells: [[Counter; CATEGORIES]; TIERS],
    /// Per tier, the sum over categories.
    tiers: [Counter; TIERS],
    /// Per tier, the sum over the model-state categories.
    model_states: [Counter; TIERS],
}

impl State {
    /// Moves the accounted bytes of (tier, category) from `old` to `new`.
    fn change(&mut self, tier: Tier, category: Category, old: u64, new: u64) {
        let t = tier.index();
        let model = category.is_model_state();
        let counters = [
            Some(&mut self.cells[t][category.index()]),
            Some(&mut self.tiers[t]),
            model.then_some(&mut self.model_states[t]),
        ];
        for counter in counters.into_iter().flatten() {
            if new >= old {
                counter.add(new - old);
            } else {
                counter.sub(old - new);
            }
        }
    }
}

struct Inner {
    rank: usize,
    state: Mutex<State>,
}

/// Current and peak bytes of one rank, per [`Tier`] and [`Category`].
///
/// Cheap to clone (an `Arc`), `Send + Sync`: every component of a rank holds
/// a clone and allocates through it. See the [module docs](self).
#[derive(Clone)]
pub struct MemoryTracker {
    inner: Arc<Inner>,
}

impl fmt::Debug for MemoryTracker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryTracker")
            .field("rank", &self.inner.rank)
            .finish_non_exhaustive()
    }
}

impl MemoryTracker {
    /// An empty tracker for rank `rank`.
    pub fn new(rank: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                rank,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// The rank this tracker belongs to.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The state, also after a panic elsewhere poisoned the mutex: the
    /// counters are plain numbers updated in one step, so they stay usable.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Accounts `bytes` under (`tier`, `category`) until the returned
    /// [`Allocation`] is dropped.
    pub fn allocate(&self, tier: Tier, category: Category, bytes: u64) -> Allocation {
        self.lock().change(tier, category, 0, bytes);
        Allocation {
            tracker: self.clone(),
            tier,
            category,
            bytes,
        }
    }

    /// Bytes now accounted under (`tier`, `category`).
    pub fn current(&self, tier: Tier, category: Category) -> u64 {
        self.lock().cells[tier.index()][category.index()].current
    }

    /// The most bytes accounted under (`tier`, `category`) since the tracker
    /// was created or [`reset_peaks`](Self::reset_peaks) was called.
    pub fn peak(&self, tier: Tier, category: Category) -> u64 {
        self.lock().cells[tier.index()][category.index()].peak
    }

    /// Bytes now accounted in `tier`, all categories together.
    pub fn tier_current(&self, tier: Tier) -> u64 {
        self.lock().tiers[tier.index()].current
    }

    /// The peak of [`tier_current`](Self::tier_current): the most bytes the
    /// tier held at any one time, not the sum of the categories' peaks.
    pub fn tier_peak(&self, tier: Tier) -> u64 {
        self.lock().tiers[tier.index()].peak
    }

    /// Bytes now accounted in `tier` under the model-state categories
    /// (see [`Category::is_model_state`]).
    pub fn model_states(&self, tier: Tier) -> u64 {
        self.lock().model_states[tier.index()].current
    }

    /// The peak of [`model_states`](Self::model_states).
    pub fn model_states_peak(&self, tier: Tier) -> u64 {
        self.lock().model_states[tier.index()].peak
    }

    /// Sets every peak to its current value, e.g. after start-up so that
    /// the next step's peaks are measured alone.
    pub fn reset_peaks(&self) {
        let mut state = self.lock();
        let State {
            cells,
            tiers,
            model_states,
        } = &mut *state;
        for counter in cells
            .iter_mut()
            .flatten()
            .chain(tiers.iter_mut())
            .chain(model_states.iter_mut())
        {
            counter.reset_peak();
        }
    }

    /// A consistent snapshot of every counter.
    pub fn report(&self) -> MemoryReport {
        let state = self.lock();
        let rows = Tier::ALL
            .iter()
            .flat_map(|&tier| Category::ALL.iter().map(move |&category| (tier, category)))
            .map(|(tier, category)| {
                let c = state.cells[tier.index()][category.index()];
                MemoryRow {
                    tier,
                    category,
                    current: c.current,
                    peak: c.peak,
                }
            })
            .collect();
        let tiers = Tier::ALL
            .iter()
            .map(|&tier| {
                let total = state.tiers[tier.index()];
                let model = state.model_states[tier.index()];
                TierTotals {
                    tier,
                    current: total.current,
                    peak: total.peak,
                    model_states: model.current,
                    model_states_peak: model.peak,
                }
            })
            .collect();
        MemoryReport {
            rank: self.inner.rank,
            rows,
            tiers,
        }
    }
}

/// Bytes accounted in a [`MemoryTracker`] for as long as this value lives.
///
/// Dropping it frees its bytes from the tracker (and never panics).
#[must_use = "the bytes are accounted only while the Allocation lives"]
pub struct Allocation {
    tracker: MemoryTracker,
    tier: Tier,
    category: Category,
    bytes: u64,
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("rank", &self.tracker.rank())
            .field("tier", &self.tier)
            .field("category", &self.category)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Allocation {
    /// The bytes accounted.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The tier the bytes are accounted in.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The category the bytes are accounted under.
    pub fn category(&self) -> Category {
        self.category
    }

    /// Changes the accounted size to `bytes` (a buffer that grew or shrank),
    /// updating the peaks if it grew.
    pub fn resize(&mut self, bytes: u64) {
        self.tracker
            .lock()
            .change(self.tier, self.category, self.bytes, bytes);
        self.bytes = bytes;
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // `lock` recovers from poisoning and `change` only does saturating
        // arithmetic, so this cannot panic.
        self.tracker
            .lock()
            .change(self.tier, self.category, self.bytes, 0);
    }
}

/// Current and peak bytes of one (tier, category).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryRow {
    /// Where the bytes live.
    pub tier: Tier,
    /// What they are for.
    pub category: Category,
    /// Bytes accounted when the report was taken.
    pub current: u64,
    /// The most bytes accounted since creation or the last peak reset.
    pub peak: u64,
}

/// The totals of one tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierTotals {
    /// The tier.
    pub tier: Tier,
    /// Bytes accounted, all categories together.
    pub current: u64,
    /// The peak of `current` (the peak of the sum).
    pub peak: u64,
    /// Bytes accounted under the model-state categories.
    pub model_states: u64,
    /// The peak of `model_states`.
    pub model_states_peak: u64,
}

/// A snapshot of a [`MemoryTracker`], for logs and metrics.
///
/// Serializes to JSON (one object per report, e.g. a metrics line);
/// `Display` prints a compact table in MiB.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// The rank the tracker belongs to.
    pub rank: usize,
    /// One row per tier and category, all of them (zeros included), in the
    /// order of [`Tier::ALL`] then [`Category::ALL`].
    pub rows: Vec<MemoryRow>,
    /// One entry per tier, in the order of [`Tier::ALL`].
    pub tiers: Vec<TierTotals>,
}

impl MemoryReport {
    /// The row of (`tier`, `category`).
    pub fn get(&self, tier: Tier, category: Category) -> Option<&MemoryRow> {
        self.rows
            .iter()
            .find(|r| r.tier == tier && r.category == category)
    }

    /// The totals of `tier`.
    pub fn tier(&self, tier: Tier) -> Option<&TierTotals> {
        self.tiers.iter().find(|t| t.tier == tier)
    }

    /// Whether `tier` has held any bytes (current or peak) in any category.
    fn tier_used(&self, tier: Tier) -> bool {
        self.rows
            .iter()
            .any(|r| r.tier == tier && (r.current != 0 || r.peak != 0))
    }
}

/// `bytes` in MiB with two decimals (one from 1000 MiB on).
fn mib(bytes: u64) -> String {
    let v = bytes as f64 / (1024.0 * 1024.0);
    if v >= 1000.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A `current/peak` table cell.
fn cell(current: u64, peak: u64) -> String {
    format!("{}/{}", mib(current), mib(peak))
}

impl fmt::Display for MemoryReport {
    /// A table in MiB, `current/peak` per cell: one line per tier that has
    /// held any bytes, one column per category that any shown tier used,
    /// then the model-state and tier totals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tiers: Vec<Tier> = Tier::ALL
            .into_iter()
            .filter(|&t| self.tier_used(t))
            .collect();
        if tiers.is_empty() {
            return write!(f, "memory of rank {}: nothing allocated", self.rank);
        }
        let row = |t: Tier, c: Category| self.get(t, c).map_or((0, 0), |r| (r.current, r.peak));
        let categories: Vec<Category> = Category::ALL
            .into_iter()
            .filter(|&c| {
                tiers.iter().any(|&t| {
                    let (current, peak) = row(t, c);
                    current != 0 || peak != 0
                })
            })
            .collect();

        let mut header = vec!["tier".to_string()];
        header.extend(categories.iter().map(|c| c.as_str().to_string()));
        header.push("model_states".into());
        header.push("total".into());
        let mut lines = vec![header];
        for &tier in &tiers {
            let mut line = vec![tier.as_str().to_string()];
            line.extend(categories.iter().map(|&c| {
                let (current, peak) = row(tier, c);
                cell(current, peak)
            }));
            let totals = self.tier(tier);
            line.push(
                totals.map_or_else(String::new, |t| cell(t.model_states, t.model_states_peak)),
            );
            line.push(totals.map_or_else(String::new, |t| cell(t.current, t.peak)));
            lines.push(line);
        }
        let widths: Vec<usize> = (0..lines[0].len())
            .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
            .collect();

        write!(f, "memory of rank {} (MiB, current/peak)", self.rank)?;
        for line in &lines {
            writeln!(f)?;
            for (i, (text, width)) in line.iter().zip(&widths).enumerate() {
                if i == 0 {
                    write!(f, "{text:<width$}")?;
                } else {
                    write!(f, "  {text:>width$}")?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static_assertions::assert_impl_all!(MemoryTracker: Send, Sync, Clone);
    static_assertions::assert_impl_all!(Allocation: Send, Sync);

    const MIB: u64 = 1 << 20;

    #[test]
    fn names_and_indices() {
        for (i, t) in Tier::ALL.into_iter().enumerate() {
            assert_eq!(t.index(), i);
            assert_eq!(t.to_string(), t.as_str());
        }
        for (i, c) in Category::ALL.into_iter().enumerate() {
            assert_eq!(c.index(), i);
            assert_eq!(c.to_string(), c.as_str());
        }
        let model: Vec<_> = Category::ALL
            .into_iter()
            .filter(|c| c.is_model_state())
            .collect();
        assert_eq!(
            model,
            [
                Category::Params,
                Category::Grads,
                Category::Master,
                Category::Moments
            ]
        );
        assert_eq!(
            serde_json::to_string(&Category::GatheredParams).unwrap(),
            "\"gathered_params\""
        );
        assert_eq!(serde_json::to_string(&Tier::Nvme).unwrap(), "\"nvme\"");
    }

    #[test]
    fn counters_follow_allocations() {
        let t = MemoryTracker::new(3);
        assert_eq!(t.rank(), 3);
        let a = t.allocate(Tier::Host, Category::Master, 100);
        let mut b = t.allocate(Tier::Host, Category::CommBuffers, 50);
        assert_eq!(t.current(Tier::Host, Category::Master), 100);
        assert_eq!(t.tier_current(Tier::Host), 150);
        assert_eq!(t.model_states(Tier::Host), 100);
        b.resize(10);
        assert_eq!(t.tier_current(Tier::Host), 110);
        assert_eq!(t.tier_peak(Tier::Host), 150);
        assert_eq!(t.peak(Tier::Host, Category::CommBuffers), 50);
        drop(a);
        assert_eq!(t.model_states(Tier::Host), 0);
        assert_eq!(t.model_states_peak(Tier::Host), 100);
        assert_eq!(t.tier_current(Tier::Device), 0);
        drop(b);
        assert_eq!(t.tier_current(Tier::Host), 0);
    }

    #[test]
    fn poisoned_mutex_is_recovered() {
        let t = MemoryTracker::new(0);
        let a = t.allocate(Tier::Device, Category::Params, 8);
        let t2 = t.clone();
        let _ = std::thread::spawn(move || {
            let _guard = t2.inner.state.lock();
            panic!("poison the tracker");
        })
        .join();
        assert!(t.inner.state.is_poisoned());
        assert_eq!(t.current(Tier::Device, Category::Params), 8);
        drop(a);
        assert_eq!(t.current(Tier::Device, Category::Params), 0);
    }

    #[test]
    fn display_of_empty_and_wide_values() {
        let t = MemoryTracker::new(1);
        assert_eq!(
            t.report().to_string(),
            "memory of rank 1: nothing allocated"
        );
        let _a = t.allocate(Tier::Device, Category::Params, 2048 * MIB);
        let text = t.report().to_string();
        assert!(text.contains("2048.0/2048.0"), "{text}");
        assert!(!text.contains("grads"), "{text}");
    }
}
