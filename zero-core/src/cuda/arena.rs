//! The device arena: one device allocation per rank, planned at start-up and
//! carved into the engine's buffers.
//!
//! Allocating device memory during a step costs time (a `cudaMalloc` can
//! synchronize the device) and fragments memory, and an out-of-memory error
//! halfway through a run is the worst time to learn that a plan does not fit.
//! So every device buffer the engine needs is declared up front as a
//! [`BufferRequest`] (name, [`Category`], bytes, alignment, and when it is
//! live), an [`ArenaPlan`] lays them out in one region, and the plan is checked
//! against what the device has before anything is allocated. With the `cuda`
//! feature, `DeviceArena` (in this module) then makes the one allocation and
//! hands out typed buffers at the planned offsets; nothing is allocated
//! afterwards.
//!
//! # Layout rule
//!
//! Buffers are grouped into *slots*. A buffer has a slot of its own unless it
//! names a shared slot with [`BufferRequest::share`]; the buffers of a shared
//! slot must be live in disjoint [`Phases`] (e.g. gradient buckets, live in
//! backward, and the optimizer's staging tiles, live in the step), and the
//! plan refuses them otherwise.
//!
//! ```text
//!  offset 0                                                      total
//!  | slot 0 (align 4096) | slot 1 (256) | slot 2 (256)   | slot 3 (64) |
//!  | params              | grads        | bucket.0       | flag        |
//!  |                     |              | or step.tile   |             |
//! ```
//!
//! - A slot's alignment is the largest of its buffers' (a power of two; the
//!   default, [`DEVICE_ALIGN`], is what `cudaMalloc` guarantees) and its
//!   extent is its largest buffer rounded up to that alignment.
//! - Slots are placed back to back by decreasing alignment, ties in the order
//!   the slots were first declared. Each extent is a multiple of its own
//!   alignment, hence of every later (smaller or equal, power-of-two) one, so
//!   every slot starts aligned with no gap in between.
//! - The total is therefore exactly the sum of the extents: the least memory
//!   in which the slots can be placed without overlapping when each occupies a
//!   whole number of its alignment units. The same requests always give the
//!   same plan.
//!
//! ```
//! use zero_core::cuda::arena::{ArenaPlan, BufferRequest, Phases};
//! use zero_core::memory::Category;
//!
//! let plan = ArenaPlan::new(0, [
//!     BufferRequest::new("params", Category::Params, 1000),
//!     BufferRequest::new("bucket", Category::CommBuffers, 4096)
//!         .live_in(Phases::BACKWARD)
//!         .share("scratch"),
//!     BufferRequest::new("adam.tile", Category::CommBuffers, 3000)
//!         .live_in(Phases::STEP)
//!         .share("scratch"),
//! ])?;
//! assert_eq!(plan.total_bytes(), 1024 + 4096);
//! assert_eq!(plan.buffer("bucket").unwrap().offset, plan.buffer("adam.tile").unwrap().offset);
//! assert!(plan.check_capacity(4096).is_err());
//! # Ok::<(), zero_core::Error>(())
//! ```

use std::collections::HashMap;
use std::fmt;

use crate::memory::Category;
use crate::{Error, Result};

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub use device::{DeviceArena, DeviceBuffer, DeviceUse};

/// The default alignment of an arena buffer: 256 bytes, what `cudaMalloc`
/// guarantees, so that a carved buffer is as aligned as a fresh allocation.
pub const DEVICE_ALIGN: u64 = 256;

/// The largest alignment a request may ask for (1 GiB).
pub const MAX_ALIGN: u64 = 1 << 30;

/// How many largest slots a capacity error lists.
const LARGEST_LISTED: usize = 3;

/// The phases of a training step in which a buffer is live: a set of up to
/// 32 phases, three of them named.
///
/// Two buffers may share arena memory only when their phase sets are
/// disjoint. A buffer that is live throughout (parameters, master weights)
/// uses [`Phases::ALL`], the default.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Phases(u32);

impl Phases {
    /// The forward pass (stage 3: gathered units, prefetch buffers).
    pub const FORWARD: Phases = Phases(1 << 0);
    /// The backward pass (gradient buckets, reduce-scatter staging).
    pub const BACKWARD: Phases = Phases(1 << 1);
    /// The optimizer step (norm scratch, AdamW tiles, parameter write-back).
    pub const STEP: Phases = Phases(1 << 2);
    /// Every phase: live for the whole run. The default of a request.
    pub const ALL: Phases = Phases(u32::MAX);
    /// No phase (not a valid lifetime for a request; the identity of
    /// [`union`](Self::union)).
    pub const NONE: Phases = Phases(0);

    /// Phase number `index` (0 to 31) alone; 0, 1 and 2 are
    /// [`FORWARD`](Self::FORWARD), [`BACKWARD`](Self::BACKWARD) and
    /// [`STEP`](Self::STEP), the others are free for the engine to name
    /// (e.g. one per stage-3 prefetch window). `None` from 32 on.
    pub const fn nth(index: u32) -> Option<Phases> {
        if index < 32 {
            Some(Phases(1 << index))
        } else {
            None
        }
    }

    /// The phases in `self` or in `other`.
    pub const fn union(self, other: Phases) -> Phases {
        Phases(self.0 | other.0)
    }

    /// Whether some phase is in both sets.
    pub const fn overlaps(self, other: Phases) -> bool {
        self.0 & other.0 != 0
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether `phase` (one phase or a set) is wholly in `self`.
    pub const fn contains(self, phase: Phases) -> bool {
        self.0 & phase.0 == phase.0
    }

    /// The set as a bit mask (bit `i` is phase `i`).
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// The phases in both sets.
    const fn intersection(self, other: Phases) -> Phases {
        Phases(self.0 & other.0)
    }
}

impl Default for Phases {
    /// [`Phases::ALL`].
    fn default() -> Self {
        Phases::ALL
    }
}

impl std::ops::BitOr for Phases {
    type Output = Phases;
    fn bitor(self, rhs: Phases) -> Phases {
        self.union(rhs)
    }
}

impl fmt::Display for Phases {
    /// `all`, `none`, or the phases joined by `+` (`forward+backward`,
    /// `phase5`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Phases::ALL => return f.write_str("all"),
            Phases::NONE => return f.write_str("none"),
            _ => {}
        }
        let mut first = true;
        for i in 0..32 {
            if self.0 & (1 << i) == 0 {
                continue;
            }
            if !first {
                f.write_str("+")?;
            }
            first = false;
            match i {
                0 => f.write_str("forward")?,
                1 => f.write_str("backward")?,
                2 => f.write_str("step")?,
                _ => write!(f, "phase{i}")?,
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Phases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Phases({self})")
    }
}

/// One device buffer the engine will need: what an [`ArenaPlan`] is built
/// from.
///
/// Defaults: alignment [`DEVICE_ALIGN`], live in [`Phases::ALL`], a slot of
/// its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferRequest {
    name: String,
    category: Category,
    bytes: u64,
    align: u64,
    phases: Phases,
    slot: Option<String>,
}

impl BufferRequest {
    /// A buffer called `name` (unique in its plan) of `bytes` bytes,
    /// accounted under `category` in tier `Device`.
    pub fn new(name: impl Into<String>, category: Category, bytes: u64) -> Self {
        Self {
            name: name.into(),
            category,
            bytes,
            align: DEVICE_ALIGN,
            phases: Phases::ALL,
            slot: None,
        }
    }

    /// Sets the alignment in bytes: a power of two up to [`MAX_ALIGN`].
    /// Smaller than [`DEVICE_ALIGN`] packs small buffers (flags, scalars)
    /// tighter; it must still suit the element type the buffer is used as.
    pub fn align(mut self, align: u64) -> Self {
        self.align = align;
        self
    }

    /// Sets the phases in which the buffer is live (default
    /// [`Phases::ALL`]).
    pub fn live_in(mut self, phases: Phases) -> Self {
        self.phases = phases;
        self
    }

    /// Places the buffer in the shared slot `slot`, with every other buffer
    /// that names the same slot. Their phases must be pairwise disjoint.
    pub fn share(mut self, slot: impl Into<String>) -> Self {
        self.slot = Some(slot.into());
        self
    }

    /// The buffer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the bytes are for.
    pub fn category(&self) -> Category {
        self.category
    }

    /// The size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.align
    }

    /// When the buffer is live.
    pub fn phases(&self) -> Phases {
        self.phases
    }

    /// The shared slot, if any.
    pub fn slot(&self) -> Option<&str> {
        self.slot.as_deref()
    }
}

/// A buffer of an [`ArenaPlan`]: its request and where it lies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedBuffer {
    /// The buffer's name.
    pub name: String,
    /// What the bytes are for.
    pub category: Category,
    /// The size in bytes, as requested.
    pub bytes: u64,
    /// The alignment in bytes, as requested.
    pub align: u64,
    /// When the buffer is live.
    pub phases: Phases,
    /// Index of its slot in [`ArenaPlan::slots`].
    pub slot: usize,
    /// Offset from the start of the arena: the offset of its slot, a
    /// multiple of `align`.
    pub offset: u64,
}

impl PlannedBuffer {
    /// The byte range `offset..offset + bytes` in the arena.
    pub fn range(&self) -> std::ops::Range<u64> {
        self.offset..self.offset + self.bytes
    }
}

/// A run of arena memory holding one buffer, or several whose lifetimes do
/// not overlap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaSlot {
    /// The shared slot's name; `None` for a buffer's own slot.
    pub shared: Option<String>,
    /// Offset from the start of the arena, a multiple of `align`.
    pub offset: u64,
    /// Bytes the slot occupies: its largest buffer rounded up to `align`.
    pub extent: u64,
    /// The largest alignment of its buffers.
    pub align: u64,
    /// Indices of its buffers in [`ArenaPlan::buffers`], in request order.
    pub buffers: Vec<usize>,
}

/// Where every device buffer of one rank lies in its arena (see the
/// [module docs](self) for the layout rule).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaPlan {
    rank: usize,
    buffers: Vec<PlannedBuffer>,
    slots: Vec<ArenaSlot>,
    index: HashMap<String, usize>,
    total: u64,
}

impl ArenaPlan {
    /// Lays out `requests` for rank `rank`.
    ///
    /// Errors (naming the rank and the buffers): an empty or duplicate name;
    /// an alignment that is not a power of two or exceeds [`MAX_ALIGN`]; an
    /// empty phase set; two buffers of one shared slot that are live in the
    /// same phase; a total that overflows `u64`.
    pub fn new(rank: usize, requests: impl IntoIterator<Item = BufferRequest>) -> Result<Self> {
        let mut buffers: Vec<PlannedBuffer> = Vec::new();
        let mut index = HashMap::new();
        // Slots in order of first declaration: (shared name, buffer indices).
        let mut groups: Vec<(Option<String>, Vec<usize>)> = Vec::new();
        let mut shared_group: HashMap<String, usize> = HashMap::new();

        for req in requests {
            validate(rank, &req)?;
            let i = buffers.len();
            if index.insert(req.name.clone(), i).is_some() {
                return Err(arena_error(
                    rank,
                    format!("buffer `{}` is requested twice", req.name),
                ));
            }
            match &req.slot {
                Some(slot) => {
                    let g = *shared_group.entry(slot.clone()).or_insert_with(|| {
                        groups.push((Some(slot.clone()), Vec::new()));
                        groups.len() - 1
                    });
                    for &other in &groups[g].1 {
                        let o: &PlannedBuffer = &buffers[other];
                        if o.phases.overlaps(req.phases) {
                            return Err(arena_error(
                                rank,
                                format!(
                                    "buffers `{}` and `{}` share slot `{slot}` but are both \
                                     live in {} (`{}` in {}, `{}` in {}); give them disjoint \
                                     phases or separate slots",
                                    o.name,
                                    req.name,
                                    o.phases.intersection(req.phases),
                                    o.name,
                                    o.phases,
                                    req.name,
                                    req.phases
                                ),
                            ));
                        }
                    }
                    groups[g].1.push(i);
                }
                None => groups.push((None, vec![i])),
            }
            buffers.push(PlannedBuffer {
                name: req.name,
                category: req.category,
                bytes: req.bytes,
                align: req.align,
                phases: req.phases,
                slot: usize::MAX,
                offset: 0,
            });
        }

        let mut slots = Vec::with_capacity(groups.len());
        for (shared, members) in groups {
            let align = members.iter().map(|&i| buffers[i].align).max();
            let bytes = members.iter().map(|&i| buffers[i].bytes).max();
            let (align, bytes) = (align.unwrap_or(1), bytes.unwrap_or(0));
            let extent = round_up(bytes, align).ok_or_else(|| overflow(rank))?;
            slots.push(ArenaSlot {
                shared,
                offset: 0,
                extent,
                align,
                buffers: members,
            });
        }
        // Stable: ties keep the order of first declaration.
        slots.sort_by_key(|s| std::cmp::Reverse(s.align));

        let mut total: u64 = 0;
        for (s, slot) in slots.iter_mut().enumerate() {
            slot.offset = total;
            total = total
                .checked_add(slot.extent)
                .ok_or_else(|| overflow(rank))?;
            for &i in &slot.buffers {
                buffers[i].slot = s;
                buffers[i].offset = slot.offset;
            }
        }
        Ok(Self {
            rank,
            buffers,
            slots,
            index,
            total,
        })
    }

    /// The rank the plan is for.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Bytes of the whole arena: the sum of the slots' extents.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Every buffer, in request order.
    pub fn buffers(&self) -> &[PlannedBuffer] {
        &self.buffers
    }

    /// The buffer called `name`.
    pub fn buffer(&self, name: &str) -> Option<&PlannedBuffer> {
        self.index.get(name).map(|&i| &self.buffers[i])
    }

    /// Index of the buffer called `name` in [`buffers`](Self::buffers).
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// The slots, in arena order (increasing offsets).
    pub fn slots(&self) -> &[ArenaSlot] {
        &self.slots
    }

    /// The most bytes of buffers live at once in any one phase: what the
    /// step needs at its peak, at most [`total_bytes`](Self::total_bytes)
    /// (less when slots are shared by buffers of different sizes).
    pub fn peak_live_bytes(&self) -> u64 {
        (0..32)
            .filter_map(Phases::nth)
            .map(|p| self.live_bytes(p))
            .max()
            .unwrap_or(0)
    }

    /// Bytes of the buffers live in `phase` (every phase of the set), each
    /// rounded up to its alignment.
    pub fn live_bytes(&self, phase: Phases) -> u64 {
        self.buffers
            .iter()
            .filter(|b| b.phases.contains(phase))
            .map(|b| round_up(b.bytes, b.align).unwrap_or(u64::MAX))
            .fold(0u64, u64::saturating_add)
    }

    /// `Ok` if the arena fits in `capacity` bytes; otherwise an error that
    /// names the rank, the bytes needed and missing, and the largest slots
    /// with their buffers.
    pub fn check_capacity(&self, capacity: u64) -> Result<()> {
        if self.total <= capacity {
            return Ok(());
        }
        let missing = self.total - capacity;
        Err(out_of_device_memory(
            self.rank,
            self.total,
            capacity,
            format!(
                "the device arena of rank {} needs {} for {} buffers but {} are available: \
                 {} missing. Largest: {}. Lower the bucket sizes, offload optimizer state or \
                 parameters, or raise the stage",
                self.rank,
                human(self.total),
                self.buffers.len(),
                human(capacity),
                human(missing),
                self.largest_slots()
            ),
        ))
    }

    /// The error of a reservation of this plan that the device refused
    /// although `available` bytes were free by the driver's count (`why`:
    /// the refusal in the backend's words): as
    /// [`check_capacity`](Self::check_capacity)'s, it names the rank, the
    /// bytes, the largest buffers and what to change.
    pub fn refused(&self, available: u64, why: &str) -> Error {
        out_of_device_memory(
            self.rank,
            self.total,
            available,
            format!(
                "rank {} could not reserve its memory plan of {} for {} buffers ({} free): \
                 {why}. Largest: {}. Lower the bucket sizes, offload optimizer state or \
                 parameters, or raise the stage",
                self.rank,
                human(self.total),
                self.buffers.len(),
                human(available),
                self.largest_slots()
            ),
        )
    }

    /// The largest slots with their buffers, for messages about memory.
    pub(crate) fn largest_slots(&self) -> String {
        let mut largest: Vec<&ArenaSlot> = self.slots.iter().collect();
        // Stable: ties in arena order.
        largest.sort_by_key(|s| std::cmp::Reverse(s.extent));
        let listed: Vec<String> = largest
            .iter()
            .take(LARGEST_LISTED)
            .map(|slot| self.describe_slot(slot))
            .collect();
        listed.join("; ")
    }

    /// `` `name` (category, size) `` or, for a shared slot,
    /// `` slot `s` (size): `a` (category), `b` (category) ``.
    fn describe_slot(&self, slot: &ArenaSlot) -> String {
        let member = |i: usize| {
            let b = &self.buffers[i];
            format!("`{}` ({}, {})", b.name, b.category, human(b.bytes))
        };
        match &slot.shared {
            None => slot.buffers.iter().map(|&i| member(i)).collect(),
            Some(name) => format!(
                "slot `{name}` ({}): {}",
                human(slot.extent),
                slot.buffers
                    .iter()
                    .map(|&i| member(i))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// Checks one request on its own.
fn validate(rank: usize, req: &BufferRequest) -> Result<()> {
    let bad = |msg: String| Err(arena_error(rank, msg));
    if req.name.is_empty() {
        return bad("a buffer request has an empty name".into());
    }
    if !req.align.is_power_of_two() || req.align > MAX_ALIGN {
        return bad(format!(
            "buffer `{}`: alignment {} is not a power of two between 1 and {MAX_ALIGN}",
            req.name, req.align
        ));
    }
    if req.phases.is_empty() {
        return bad(format!("buffer `{}` is live in no phase", req.name));
    }
    if req.slot.as_deref() == Some("") {
        return bad(format!("buffer `{}` names an empty shared slot", req.name));
    }
    Ok(())
}

/// `x` rounded up to a multiple of `align` (a power of two); `None` on
/// overflow.
pub(crate) fn round_up(x: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

/// `bytes` for people: exact below 1 KiB, else in KiB/MiB/GiB with two
/// decimals and the exact count.
pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size {
            return format!("{:.2} {unit} ({bytes} bytes)", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} bytes")
}

fn overflow(rank: usize) -> Error {
    arena_error(rank, "the arena's size overflows u64".into())
}

/// An error of the device arena of rank `rank` that is not a lack of memory
/// (a bad request, a busy slot, a wrong element type).
pub(crate) fn arena_error(rank: usize, msg: String) -> Error {
    Error::Arena { rank, msg }
}

/// The arena of rank `rank` needs `needed` bytes where `available` are
/// free; `msg` says which buffers and what to do.
pub(crate) fn out_of_device_memory(rank: usize, needed: u64, available: u64, msg: String) -> Error {
    Error::OutOfDeviceMemory {
        rank,
        needed,
        available,
        msg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static_assertions::assert_impl_all!(ArenaPlan: Send, Sync, Clone);
    static_assertions::assert_impl_all!(BufferRequest: Send, Sync, Clone);

    fn req(name: &str, bytes: u64) -> BufferRequest {
        BufferRequest::new(name, Category::Params, bytes)
    }

    #[test]
    fn phases_sets_and_names() {
        let fb = Phases::FORWARD | Phases::BACKWARD;
        assert!(fb.overlaps(Phases::BACKWARD));
        assert!(!fb.overlaps(Phases::STEP));
        assert!(fb.contains(Phases::FORWARD));
        assert!(!Phases::FORWARD.contains(fb));
        assert!(Phases::ALL.overlaps(Phases::STEP));
        assert!(!Phases::ALL.overlaps(Phases::NONE));
        assert_eq!(fb.to_string(), "forward+backward");
        assert_eq!(Phases::nth(5).unwrap().to_string(), "phase5");
        assert_eq!(Phases::nth(2), Some(Phases::STEP));
        assert_eq!(Phases::nth(32), None);
        assert_eq!(Phases::ALL.to_string(), "all");
        assert_eq!(Phases::NONE.to_string(), "none");
        assert_eq!(Phases::default(), Phases::ALL);
        assert_eq!(format!("{:?}", Phases::STEP), "Phases(step)");
        assert_eq!(fb.bits(), 3);
    }

    #[test]
    fn unshared_buffers_pack_by_alignment() {
        let plan = ArenaPlan::new(
            2,
            [
                req("a", 100).align(64),
                req("b", 300),
                req("c", 5000).align(4096),
                req("d", 0),
                req("e", 1).align(1),
            ],
        )
        .unwrap();
        assert_eq!(plan.rank(), 2);
        let off = |n: &str| plan.buffer(n).unwrap().offset;
        // 4096-aligned first, then the 256s in request order, then 64, then 1.
        assert_eq!(off("c"), 0);
        assert_eq!(off("b"), 8192);
        assert_eq!(off("d"), 8192 + 512);
        assert_eq!(off("a"), 8192 + 512);
        assert_eq!(off("e"), 8192 + 512 + 128);
        assert_eq!(plan.total_bytes(), 8192 + 512 + 128 + 1);
        assert_eq!(plan.slots().len(), 5);
        assert_eq!(plan.position("e"), Some(4));
        assert!(plan.buffer("zz").is_none());
        assert_eq!(plan.buffer("b").unwrap().range(), 8192..8492);
    }

    #[test]
    fn shared_slots_take_the_largest_member() {
        let plan = ArenaPlan::new(
            0,
            [
                req("params", 1000),
                BufferRequest::new("bucket", Category::CommBuffers, 4096)
                    .live_in(Phases::BACKWARD)
                    .share("scratch"),
                BufferRequest::new("tile", Category::Master, 5000)
                    .live_in(Phases::STEP)
                    .share("scratch"),
                BufferRequest::new("gathered", Category::GatheredParams, 10)
                    .live_in(Phases::FORWARD)
                    .share("scratch")
                    .align(512),
            ],
        )
        .unwrap();
        // The shared slot has alignment 512, so it goes first.
        let slot = &plan.slots()[0];
        assert_eq!(slot.shared.as_deref(), Some("scratch"));
        assert_eq!((slot.offset, slot.extent, slot.align), (0, 5120, 512));
        assert_eq!(slot.buffers, vec![1, 2, 3]);
        assert_eq!(plan.buffer("params").unwrap().offset, 5120);
        assert_eq!(plan.total_bytes(), 5120 + 1024);
        assert_eq!(plan.live_bytes(Phases::STEP), 1024 + 5120);
        assert_eq!(plan.live_bytes(Phases::FORWARD), 1024 + 512);
        assert_eq!(plan.peak_live_bytes(), 1024 + 5120);
    }

    #[test]
    fn overlapping_phases_in_a_slot_are_refused() {
        let err = ArenaPlan::new(
            3,
            [
                req("x", 10)
                    .live_in(Phases::FORWARD | Phases::BACKWARD)
                    .share("s"),
                req("y", 10).live_in(Phases::BACKWARD).share("s"),
            ],
        )
        .unwrap_err()
        .to_string();
        for needle in ["rank 3", "`x`", "`y`", "slot `s`", "both live in backward"] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
        // A buffer live throughout cannot share.
        assert!(ArenaPlan::new(0, [req("x", 1).share("s"), req("y", 1).share("s")]).is_err());
        // Alone in a named slot is fine.
        assert!(ArenaPlan::new(0, [req("x", 1).share("s")]).is_ok());
    }

    #[test]
    fn bad_requests_are_refused() {
        let cases: Vec<(Vec<BufferRequest>, &str)> = vec![
            (vec![req("", 1)], "empty name"),
            (vec![req("a", 1), req("a", 2)], "requested twice"),
            (vec![req("a", 1).align(3)], "not a power of two"),
            (vec![req("a", 1).align(0)], "not a power of two"),
            (vec![req("a", 1).align(MAX_ALIGN * 2)], "not a power of two"),
            (vec![req("a", 1).live_in(Phases::NONE)], "no phase"),
            (vec![req("a", 1).share("")], "empty shared slot"),
            (vec![req("a", u64::MAX)], "overflows"),
            (
                vec![req("a", u64::MAX / 2), req("b", u64::MAX / 2)],
                "overflows",
            ),
        ];
        for (reqs, needle) in cases {
            let err = ArenaPlan::new(7, reqs).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle} not in {err}");
            assert!(err.contains("rank 7"), "{err}");
        }
    }

    #[test]
    fn capacity_error_names_rank_largest_and_missing() {
        let plan = ArenaPlan::new(
            5,
            [
                req("small", 256),
                BufferRequest::new("master", Category::Master, 3 << 20),
                BufferRequest::new("bucket", Category::CommBuffers, 1 << 20)
                    .live_in(Phases::BACKWARD)
                    .share("scratch"),
                BufferRequest::new("tile", Category::CommBuffers, 2 << 20)
                    .live_in(Phases::STEP)
                    .share("scratch"),
                req("mid", 1 << 10),
                req("tiny", 1),
            ],
        )
        .unwrap();
        let total = plan.total_bytes();
        assert_eq!(total, (3 << 20) + (2 << 20) + 256 + 1024 + 256);
        plan.check_capacity(total).unwrap();
        let err = plan.check_capacity(total - 1000).unwrap_err().to_string();
        for needle in [
            "rank 5",
            "1000 bytes missing",
            &format!("({total} bytes)"),
            "`master` (master, 3.00 MiB",
            "slot `scratch` (2.00 MiB",
            "`bucket` (comm_buffers, 1.00 MiB",
            "`mid` (params, 1.00 KiB",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
        // Only the three largest slots are listed.
        assert!(!err.contains("`tiny`"), "{err}");
        match plan.check_capacity(total - 1000) {
            Err(Error::OutOfDeviceMemory {
                rank: 5,
                needed,
                available,
                ..
            }) => assert_eq!((needed, available), (total, total - 1000)),
            other => panic!("not OutOfDeviceMemory: {other:?}"),
        }
        assert!(matches!(
            ArenaPlan::new(4, [req("a", 1), req("a", 1)]),
            Err(Error::Arena { rank: 4, .. })
        ));
    }

    #[test]
    fn empty_plan() {
        let plan = ArenaPlan::new(0, []).unwrap();
        assert_eq!(plan.total_bytes(), 0);
        assert_eq!(plan.peak_live_bytes(), 0);
        plan.check_capacity(0).unwrap();
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(10), "10 bytes");
        assert_eq!(human(1536), "1.50 KiB (1536 bytes)");
        assert_eq!(human(3 << 30), "3.00 GiB (3221225472 bytes)");
        assert_eq!(round_up(0, 256), Some(0));
        assert_eq!(round_up(257, 256), Some(512));
        assert_eq!(round_up(u64::MAX, 2), None);
    }
}
