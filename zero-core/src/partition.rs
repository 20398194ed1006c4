//! The partition plan: which elements of which unit each rank owns.
//!
//! A trainer registers its parameters as *units* ([`UnitSpec`]): a layer, an
//! embedding. A unit is a list of named, shaped tensors that are packed
//! contiguously, in the given order, into one flat buffer. That buffer is
//! padded at its end so that it splits into `world_size` equal *shards*, and
//! rank `r` owns shard `r` of every unit. Parameters, gradients, fp32 master
//! weights and AdamW moments are all partitioned with the same plan, so a
//! shard of one corresponds element for element to the shards of the others.
//!
//! # The padding rule
//!
//! Every shard's length is a multiple of [`SHARD_ALIGN`] elements, so that
//! each shard starts on an aligned boundary for vector loads and collectives.
//! A unit of `numel` real elements is therefore padded to
//!
//! ```text
//! padded_numel = smallest multiple of (world_size * SHARD_ALIGN) that is >= numel
//! shard_len    = padded_numel / world_size          (a multiple of SHARD_ALIGN)
//! ```
//!
//! The padding of one unit is thus at most `world_size * SHARD_ALIGN - 1`
//! elements, and every rank's shard is shorter than
//! `numel / world_size + SHARD_ALIGN`. Users of the plan keep padding
//! elements zero, so that they do not change reductions or norms, and never
//! copy them into a tensor. Memory
//! figures elsewhere ("16Ψ/N plus the documented padding") refer to this
//! rule.
//!
//! A unit of 300 elements (tensors `w` `[16, 16]`, `b` `[16]`, `g` `[28]`) on
//! 4 ranks: `world_size * SHARD_ALIGN = 128`, so `padded_numel = 384` and
//! `shard_len = 96`. Tensors are packed from offset 0 (top), the padded
//! buffer is cut into equal shards (bottom), and each rank's real range is
//! its shard cut off at `numel`:
//!
//! ```text
//!          0                                   256 272     300       384
//! tensors  |            w [16, 16]             | b |   g   |  padding  |
//! shards   |   rank 0    |   rank 1    |    rank 2     |    rank 3     |
//!          0             96            192             288           384
//! real          0..96        96..192       192..288        288..300
//! ```
//!
//! A shard may hold only padding: a unit of 10 elements on 4 ranks is padded
//! to 128 and ranks 1, 2 and 3 own no real element (their
//! [`UnitLayout::real_range`] is empty). Shards are still equal, so
//! collectives over a unit always move `world_size` equal pieces.
//!
//! # Frozen tensors
//!
//! A tensor registered with [`TensorSpec::frozen`] (`requires_grad =
//! false`) has parameters but no gradient, fp32 master or moments. A unit
//! is laid out as its *trainable segment* (the trainable tensors in
//! registration order, padded as above) followed by its *frozen segment*
//! (the frozen tensors in registration order, padded the same way), and
//! each segment is split evenly across the ranks, so gradient and optimizer
//! shards stay balanced whatever the mix:
//!
//! ```text
//!  params   | trainable a, b | pad | frozen w, c | pad |
//!           0                padded_numel           param_len()
//!  grads    | trainable a, b | pad |
//! ```
//!
//! A trainable tensor's offset is the same in the parameter buffer and in
//! the gradient buffer (whose length is `padded_numel`); a frozen tensor's
//! offset is in the parameter buffer only. Trainers should find every
//! tensor through [`UnitLayout::tensor`] rather than assume registration
//! order. A unit may hold only frozen tensors (`padded_numel == 0`).
//!
//! # Example
//!
//! ```
//! use zero_core::partition::{PartitionPlan, TensorSpec, UnitSpec};
//!
//! let units = [
//!     UnitSpec::new("embed", vec![TensorSpec::new("weight", &[1000, 64])]),
//!     UnitSpec::new(
//!         "layer.0",
//!         vec![TensorSpec::new("w", &[64, 64]), TensorSpec::new("b", &[64])],
//!     ),
//! ];
//! let plan = PartitionPlan::new(&units, 4)?;
//! let layer = plan.unit(plan.find("layer.0").unwrap()).unwrap();
//! assert_eq!(layer.numel, 64 * 64 + 64);
//! assert_eq!(layer.shard_len % zero_core::partition::SHARD_ALIGN, 0);
//! assert_eq!(layer.tensor("b").unwrap().range(), 4096..4160);
//! assert_eq!(plan.shard_range(1, 3), 3 * layer.shard_len..4 * layer.shard_len);
//! # Ok::<(), zero_core::Error>(())
//! ```

use std::collections::HashSet;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Alignment of every shard, in elements: each shard's length is a multiple
/// of this (64 bytes of bf16, 128 bytes of f32).
pub const SHARD_ALIGN: usize = 32;

/// A named tensor of a unit, as the trainer registers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// The tensor's name, unique within its unit (e.g. `"q_proj.weight"`).
    pub name: String,
    /// The tensor's shape; an empty shape is a scalar (one element).
    pub shape: Vec<usize>,
    /// Whether the tensor trains (`requires_grad`; true from
    /// [`TensorSpec::new`]). A frozen tensor has parameters only: no
    /// gradient, no fp32 master, no moments (see the module docs).
    #[serde(default = "yes")]
    pub trainable: bool,
}

fn yes() -> bool {
    true
}

impl TensorSpec {
    /// A trainable tensor spec named `name` of shape `shape`.
    pub fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            trainable: true,
        }
    }

    /// A frozen tensor spec (`requires_grad = false`) named `name` of shape
    /// `shape`.
    pub fn frozen(name: impl Into<String>, shape: &[usize]) -> Self {
        Self {
            trainable: false,
            ..Self::new(name, shape)
        }
    }

    /// The number of elements: the product of the shape (saturating at
    /// `usize::MAX`; [`PartitionPlan::new`] rejects such sizes).
    pub fn numel(&self) -> usize {
        self.shape.iter().fold(1usize, |n, &d| n.saturating_mul(d))
    }

    /// The number of elements, or `None` if it overflows `usize`.
    fn checked_numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }
}

/// A unit of parameters: named tensors packed into one flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitSpec {
    /// The unit's name, unique within a plan (e.g. `"layers.3"`).
    pub name: String,
    /// The unit's tensors, in the order they are packed.
    pub tensors: Vec<TensorSpec>,
}

impl UnitSpec {
    /// A unit named `name` made of `tensors`, packed in this order.
    pub fn new(name: impl Into<String>, tensors: Vec<TensorSpec>) -> Self {
        Self {
            name: name.into(),
            tensors,
        }
    }

    /// The number of real elements: the sum of the tensors' (saturating at
    /// `usize::MAX`; [`PartitionPlan::new`] rejects such sizes).
    pub fn numel(&self) -> usize {
        self.tensors
            .iter()
            .fold(0usize, |n, t| n.saturating_add(t.numel()))
    }
}

/// Where one tensor lies in its unit's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorLayout {
    /// The tensor's name.
    pub name: String,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// Offset of the tensor's first element in the unit's flat buffer.
    /// Tensors are packed contiguously in the order of the [`UnitSpec`].
    pub offset: usize,
    /// The number of elements (the product of `shape`).
    pub numel: usize,
    /// Whether the tensor trains: it lies in the trainable segment
    /// (`offset + numel <= UnitLayout::padded_numel`), else in the frozen
    /// one (`offset >= UnitLayout::frozen_offset()`).
    #[serde(default = "yes")]
    pub trainable: bool,
}

impl TensorLayout {
    /// The tensor's elements in the unit's flat buffer:
    /// `offset..offset + numel`.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// The layout of one unit: its tensors, its padding and its shards.
///
/// `numel`, `padded_numel`, `shard_len`, [`shard_range`](Self::shard_range)
/// and [`real_range`](Self::real_range) describe the *trainable segment*
/// (what gradients, the fp32 master and the moments cover); for a unit
/// without frozen tensors that is the whole unit. Frozen tensors follow in
/// the frozen segment, `frozen_offset()..param_len()`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitLayout {
    /// The unit's name.
    pub name: String,
    /// The unit's tensors: the trainable ones packed contiguously from
    /// offset 0 in registration order, then the frozen ones from
    /// [`frozen_offset`](Self::frozen_offset) in registration order.
    pub tensors: Vec<TensorLayout>,
    /// The number of real elements of the trainable segment (the sum of
    /// the trainable tensors').
    pub numel: usize,
    /// The length of the trainable segment including padding: the
    /// smallest multiple of `world_size * SHARD_ALIGN` that is at least
    /// `numel` (0 for a unit with only frozen tensors). Gradient buffers
    /// have this length.
    pub padded_numel: usize,
    /// The length of each rank's shard of the trainable segment:
    /// `padded_numel / world_size`, a multiple of [`SHARD_ALIGN`].
    pub shard_len: usize,
    /// The number of real elements of the frozen segment (0 without
    /// frozen tensors).
    #[serde(default)]
    pub frozen_numel: usize,
    /// The length of the frozen segment including padding (a multiple of
    /// `world_size * SHARD_ALIGN`, as the trainable one).
    #[serde(default)]
    pub frozen_padded: usize,
    /// The number of ranks the segments are split into.
    #[serde(default)]
    pub ranks: usize,
}

impl UnitLayout {
    /// The number of shards (ranks) the unit is split into.
    pub fn world_size(&self) -> usize {
        if self.ranks > 0 {
            return self.ranks;
        }
        // A hand-made layout without `ranks`: from the trainable segment.
        self.padded_numel.checked_div(self.shard_len).unwrap_or(0)
    }

    /// The length of the unit's parameter buffer (what [`gather`] returns):
    /// the trainable segment, then the frozen segment, both padded.
    ///
    /// [`gather`]: https://docs.rs/zero (`Engine::gather`)
    pub fn param_len(&self) -> usize {
        self.padded_numel + self.frozen_padded
    }

    /// Where the frozen segment starts in the parameter buffer: right after
    /// the padded trainable segment.
    pub fn frozen_offset(&self) -> usize {
        self.padded_numel
    }

    /// The frozen segment in the parameter buffer, padding included.
    pub fn frozen_range(&self) -> Range<usize> {
        self.padded_numel..self.param_len()
    }

    /// The length of each rank's shard of the frozen segment.
    pub fn frozen_shard_len(&self) -> usize {
        self.frozen_padded
            .checked_div(self.world_size())
            .unwrap_or(0)
    }

    /// Whether the unit has trainable elements (else it has no gradient).
    pub fn is_trainable(&self) -> bool {
        self.numel > 0
    }

    /// The real elements of the unit, trainable and frozen.
    pub fn total_numel(&self) -> usize {
        self.numel + self.frozen_numel
    }

    /// The elements that rank `rank` owns, in padded coordinates:
    /// `rank * shard_len..(rank + 1) * shard_len`.
    ///
    /// # Panics
    /// If `rank >= world_size`.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        assert!(
            rank < self.world_size(),
            "rank {rank} out of range for unit `{}` split into {} shards",
            self.name,
            self.world_size()
        );
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// The real (non-padding) elements that rank `rank` owns: its shard
    /// range intersected with `0..numel`. Empty for a rank whose shard holds
    /// only padding.
    ///
    /// # Panics
    /// If `rank >= world_size`.
    pub fn real_range(&self, rank: usize) -> Range<usize> {
        let shard = self.shard_range(rank);
        shard.start.min(self.numel)..shard.end.min(self.numel)
    }

    /// The number of padding elements: `padded_numel - numel`, at most
    /// `world_size * SHARD_ALIGN - 1`.
    pub fn padding(&self) -> usize {
        self.padded_numel - self.numel
    }

    /// The unit as a trainer registers it (tensors in packing order:
    /// trainable, then frozen), which lays out as this layout again.
    pub fn spec(&self) -> UnitSpec {
        UnitSpec::new(
            self.name.clone(),
            self.tensors
                .iter()
                .map(|t| TensorSpec {
                    trainable: t.trainable,
                    ..TensorSpec::new(t.name.clone(), &t.shape)
                })
                .collect(),
        )
    }

    /// The layout of the tensor named `name`, if the unit has one.
    pub fn tensor(&self, name: &str) -> Option<&TensorLayout> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// How every unit of a model is padded and split across `world_size` ranks.
///
/// Built once from the units a trainer registers ([`PartitionPlan::new`]);
/// every rank builds the same plan from the same units. It serializes to
/// JSON (for checkpoints), and deserializing checks that the stored layout
/// is the one this rule produces, so a corrupted plan is an error, not a
/// silently wrong layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "PlanData")]
pub struct PartitionPlan {
    world_size: usize,
    units: Vec<UnitLayout>,
}

/// The serialized form of a [`PartitionPlan`], validated on the way in.
#[derive(Deserialize)]
struct PlanData {
    world_size: usize,
    units: Vec<UnitLayout>,
}

impl TryFrom<PlanData> for PartitionPlan {
    type Error = Error;

    fn try_from(data: PlanData) -> Result<Self> {
        let specs: Vec<UnitSpec> = data.units.iter().map(UnitLayout::spec).collect();
        let plan = PartitionPlan::new(&specs, data.world_size)?;
        // Layouts stored before `ranks` existed read it as 0.
        let mut stored = data.units;
        for u in stored.iter_mut().filter(|u| u.ranks == 0) {
            u.ranks = data.world_size;
        }
        if let Some((want, got)) = plan.units.iter().zip(&stored).find(|(a, b)| a != b) {
            return Err(Error::Plan(format!(
                "stored layout of unit `{}` is inconsistent: expected {} elements padded to {} \
                 in shards of {} for world size {}, found {} padded to {} in shards of {} \
                 (or different tensor offsets)",
                want.name,
                want.numel,
                want.padded_numel,
                want.shard_len,
                data.world_size,
                got.numel,
                got.padded_numel,
                got.shard_len,
            )));
        }
        Ok(plan)
    }
}

impl PartitionPlan {
    /// Lays out `units` for `world_size` ranks.
    ///
    /// An empty list of units gives an empty plan.
    ///
    /// # Errors
    /// [`Error::Plan`], naming the unit or tensor, if `world_size` is 0, a
    /// unit or tensor name is empty, two units share a name, two tensors of
    /// a unit share a name, a unit has no elements, or a size overflows
    /// `usize`.
    pub fn new(units: &[UnitSpec], world_size: usize) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::Plan("world size must be at least 1, got 0".into()));
        }
        let align = world_size.checked_mul(SHARD_ALIGN).ok_or_else(|| {
            Error::Plan(format!(
                "world size {world_size} times the shard alignment {SHARD_ALIGN} overflows"
            ))
        })?;
        let mut unit_names = HashSet::with_capacity(units.len());
        let mut layouts = Vec::with_capacity(units.len());
        let mut total_padded = 0usize;
        let mut total_real = 0usize;
        for (index, unit) in units.iter().enumerate() {
            if unit.name.is_empty() {
                return Err(Error::Plan(format!("unit {index} has an empty name")));
            }
            if !unit_names.insert(unit.name.as_str()) {
                return Err(Error::Plan(format!(
                    "duplicate unit name `{}` (unit {index})",
                    unit.name
                )));
            }
            let layout = layout_unit(unit, align, world_size)?;
            total_real = total_real.checked_add(layout.numel).ok_or_else(|| {
                Error::Plan(format!(
                    "total number of elements overflows at unit `{}`",
                    unit.name
                ))
            })?;
            total_padded = total_padded
                .checked_add(layout.param_len())
                .ok_or_else(|| {
                    Error::Plan(format!(
                        "total padded number of elements overflows at unit `{}`",
                        unit.name
                    ))
                })?;
            layouts.push(layout);
        }
        Ok(Self {
            world_size,
            units: layouts,
        })
    }

    /// The number of ranks the plan splits each unit across.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// All units, in registration order.
    pub fn units(&self) -> &[UnitLayout] {
        &self.units
    }

    /// The unit at `index`, or `None` if there is no such unit.
    pub fn unit(&self, index: usize) -> Option<&UnitLayout> {
        self.units.get(index)
    }

    /// The index of the unit named `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.units.iter().position(|u| u.name == name)
    }

    /// The number of real elements of all units (Ψ), trainable and
    /// frozen.
    pub fn numel(&self) -> usize {
        self.units.iter().map(UnitLayout::total_numel).sum()
    }

    /// The number of trainable real elements of all units.
    pub fn trainable_numel(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// The number of frozen real elements of all units.
    pub fn frozen_numel(&self) -> usize {
        self.units.iter().map(|u| u.frozen_numel).sum()
    }

    /// The number of trainable elements of all units including padding
    /// (what gradients and optimizer state cover).
    pub fn padded_numel(&self) -> usize {
        self.units.iter().map(|u| u.padded_numel).sum()
    }

    /// The length of all units' parameter buffers (trainable and frozen
    /// segments, padding included).
    pub fn param_numel(&self) -> usize {
        self.units.iter().map(UnitLayout::param_len).sum()
    }

    /// The number of trainable elements each rank owns: the sum of the
    /// units' shard lengths (`padded_numel() / world_size()`), padding
    /// included.
    pub fn shard_numel(&self) -> usize {
        self.units.iter().map(|u| u.shard_len).sum()
    }

    /// The elements of unit `unit` that rank `rank` owns, in the unit's
    /// padded coordinates (see [`UnitLayout::shard_range`]).
    ///
    /// # Panics
    /// If `unit >= units().len()` or `rank >= world_size()`; both are
    /// indices the caller takes from this plan.
    pub fn shard_range(&self, unit: usize, rank: usize) -> Range<usize> {
        let Some(layout) = self.units.get(unit) else {
            panic!(
                "unit index {unit} out of range for a plan of {} units",
                self.units.len()
            );
        };
        layout.shard_range(rank)
    }

    /// Where the elements `range` of the concatenation of all units' *real*
    /// elements (in unit order, without padding) lie: a list of
    /// `(unit index, range within that unit)`, in order, with no empty
    /// piece. Used to reshard checkpoints between world sizes.
    ///
    /// Only the part of `range` inside `0..numel()` is located, so the
    /// pieces' lengths add up to `range.len()` exactly when the range lies
    /// inside the model; an empty or reversed range gives no piece.
    pub fn locate(&self, range: Range<usize>) -> Vec<(usize, Range<usize>)> {
        let mut pieces = Vec::new();
        if range.start >= range.end {
            return pieces;
        }
        let mut base = 0usize;
        for (index, unit) in self.units.iter().enumerate() {
            if base >= range.end {
                break;
            }
            // Cannot overflow: `new` checked that the total fits in usize.
            let end = base + unit.numel;
            if end > range.start {
                let start = range.start.max(base) - base;
                let stop = range.end.min(end) - base;
                pieces.push((index, start..stop));
            }
            base = end;
        }
        pieces
    }
}

/// Packs the tensors of `unit` and pads it to a multiple of `align`
/// (`world_size * SHARD_ALIGN`).
fn layout_unit(unit: &UnitSpec, align: usize, world_size: usize) -> Result<UnitLayout> {
    let mut tensor_names = HashSet::with_capacity(unit.tensors.len());
    let mut tensors = Vec::with_capacity(unit.tensors.len());
    let mut offset = 0usize;
    let pad = |numel: usize, what: &str| {
        numel.div_ceil(align).checked_mul(align).ok_or_else(|| {
            Error::Plan(format!(
                "unit `{}` of {numel} {what}elements overflows when padded to a multiple of {align}",
                unit.name
            ))
        })
    };
    let mut trainable_numel = None;
    // Trainable tensors first, then the frozen ones from the padded end of
    // the trainable segment.
    let order = unit
        .tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| t.trainable)
        .chain(
            unit.tensors
                .iter()
                .enumerate()
                .filter(|(_, t)| !t.trainable),
        );
    for (index, tensor) in order {
        if !tensor.trainable && trainable_numel.is_none() {
            trainable_numel = Some(offset);
            offset = pad(offset, "trainable ")?;
        }
        if tensor.name.is_empty() {
            return Err(Error::Plan(format!(
                "tensor {index} of unit `{}` has an empty name",
                unit.name
            )));
        }
        if !tensor_names.insert(tensor.name.as_str()) {
            return Err(Error::Plan(format!(
                "duplicate tensor name `{}` in unit `{}`",
                tensor.name, unit.name
            )));
        }
        let overflow = || {
            Error::Plan(format!(
                "size of tensor `{}` {:?} in unit `{}` overflows",
                tensor.name, tensor.shape, unit.name
            ))
        };
        let numel = tensor.checked_numel().ok_or_else(overflow)?;
        let next = offset.checked_add(numel).ok_or_else(overflow)?;
        tensors.push(TensorLayout {
            name: tensor.name.clone(),
            shape: tensor.shape.clone(),
            offset,
            numel,
            trainable: tensor.trainable,
        });
        offset = next;
    }
    let (numel, padded_numel, frozen_numel) = match trainable_numel {
        None => (offset, pad(offset, "")?, 0),
        Some(t) => {
            let padded = pad(t, "trainable ")?;
            (t, padded, offset - padded)
        }
    };
    if numel + frozen_numel == 0 {
        return Err(Error::Plan(format!(
            "unit `{}` has no elements ({} tensors)",
            unit.name,
            unit.tensors.len()
        )));
    }
    let frozen_padded = pad(frozen_numel, "frozen ")?;
    padded_numel.checked_add(frozen_padded).ok_or_else(|| {
        Error::Plan(format!(
            "unit `{}`: its padded segments overflow",
            unit.name
        ))
    })?;
    Ok(UnitLayout {
        name: unit.name.clone(),
        tensors,
        numel,
        padded_numel,
        shard_len: padded_numel / world_size,
        frozen_numel,
        frozen_padded,
        ranks: world_size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(name: &str, shapes: &[(&str, &[usize])]) -> UnitSpec {
        UnitSpec::new(
            name,
            shapes.iter().map(|(n, s)| TensorSpec::new(*n, s)).collect(),
        )
    }

    fn plan_err(units: &[UnitSpec], world_size: usize) -> String {
        match PartitionPlan::new(units, world_size) {
            Err(Error::Plan(msg)) => msg,
            other => panic!("expected a plan error, got {other:?}"),
        }
    }

    #[test]
    fn numel_of_specs() {
        assert_eq!(TensorSpec::new("s", &[]).numel(), 1);
        assert_eq!(TensorSpec::new("z", &[3, 0]).numel(), 0);
        assert_eq!(TensorSpec::new("w", &[3, 4, 5]).numel(), 60);
        assert_eq!(TensorSpec::new("big", &[usize::MAX, 2]).numel(), usize::MAX);
        let u = unit("u", &[("a", &[2, 3]), ("b", &[4])]);
        assert_eq!(u.numel(), 10);
    }

    #[test]
    fn documented_example_layout() {
        let u = unit("u", &[("w", &[16, 16]), ("b", &[16]), ("g", &[28])]);
        let plan = PartitionPlan::new(&[u], 4).unwrap();
        let l = plan.unit(0).unwrap();
        assert_eq!(l.numel, 300);
        assert_eq!(l.padded_numel, 384);
        assert_eq!(l.shard_len, 96);
        assert_eq!(l.padding(), 84);
        assert_eq!(l.world_size(), 4);
        assert_eq!(l.tensor("w").unwrap().range(), 0..256);
        assert_eq!(l.tensor("b").unwrap().range(), 256..272);
        assert_eq!(l.tensor("g").unwrap().range(), 272..300);
        assert!(l.tensor("nope").is_none());
        let shards: Vec<_> = (0..4).map(|r| l.shard_range(r)).collect();
        assert_eq!(shards, [0..96, 96..192, 192..288, 288..384]);
        let real: Vec<_> = (0..4).map(|r| l.real_range(r)).collect();
        assert_eq!(real, [0..96, 96..192, 192..288, 288..300]);
    }

    #[test]
    fn frozen_tensors_follow_the_padded_trainable_segment() {
        let u = UnitSpec::new(
            "u",
            vec![
                TensorSpec::frozen("w", &[10, 10]),
                TensorSpec::new("a", &[40]),
                TensorSpec::frozen("c", &[5]),
                TensorSpec::new("b", &[30]),
            ],
        );
        let plan = PartitionPlan::new(&[u], 2).unwrap();
        let l = &plan.units()[0];
        assert_eq!((l.numel, l.padded_numel, l.shard_len), (70, 128, 64));
        assert_eq!(
            (l.frozen_numel, l.frozen_padded, l.frozen_shard_len()),
            (105, 128, 64)
        );
        assert_eq!(
            (l.frozen_offset(), l.param_len(), l.world_size()),
            (128, 256, 2)
        );
        assert_eq!(l.tensor("a").unwrap().range(), 0..40);
        assert_eq!(l.tensor("b").unwrap().range(), 40..70);
        assert_eq!(l.tensor("w").unwrap().range(), 128..228);
        assert_eq!(l.tensor("c").unwrap().range(), 228..233);
        assert!(!l.tensor("w").unwrap().trainable && l.tensor("a").unwrap().trainable);
        assert_eq!(l.real_range(1), 64..70);
        assert_eq!(
            (plan.numel(), plan.trainable_numel(), plan.frozen_numel()),
            (175, 70, 105)
        );
        // The layout survives serialization with its flags.
        let json = serde_json::to_string(&plan).unwrap();
        assert_eq!(serde_json::from_str::<PartitionPlan>(&json).unwrap(), plan);

        let only = UnitSpec::new("f", vec![TensorSpec::frozen("w", &[3])]);
        let plan = PartitionPlan::new(&[only], 4).unwrap();
        let l = &plan.units()[0];
        assert!(!l.is_trainable());
        assert_eq!((l.padded_numel, l.shard_len, l.frozen_padded), (0, 0, 128));
        assert_eq!((l.world_size(), l.tensor("w").unwrap().offset), (4, 0));
        assert!(l.real_range(3).is_empty());
    }

    #[test]
    fn small_unit_leaves_ranks_with_only_padding() {
        let plan = PartitionPlan::new(&[unit("tiny", &[("x", &[10])])], 4).unwrap();
        let l = &plan.units()[0];
        assert_eq!((l.padded_numel, l.shard_len), (128, 32));
        assert_eq!(l.real_range(0), 0..10);
        for r in 1..4 {
            assert!(l.real_range(r).is_empty());
        }
    }

    #[test]
    fn exact_multiple_needs_no_padding() {
        let plan = PartitionPlan::new(&[unit("u", &[("x", &[256])])], 8).unwrap();
        let l = &plan.units()[0];
        assert_eq!((l.padded_numel, l.shard_len, l.padding()), (256, 32, 0));
        let plan = PartitionPlan::new(&[unit("u", &[("x", &[257])])], 8).unwrap();
        assert_eq!(plan.units()[0].padding(), 8 * SHARD_ALIGN - 1);
    }

    #[test]
    fn world_size_one() {
        let plan = PartitionPlan::new(&[unit("u", &[("x", &[33])])], 1).unwrap();
        let l = &plan.units()[0];
        assert_eq!((l.padded_numel, l.shard_len), (64, 64));
        assert_eq!(l.shard_range(0), 0..64);
        assert_eq!(l.real_range(0), 0..33);
    }

    #[test]
    fn plan_totals_and_lookup() {
        let units = [
            unit("a", &[("x", &[100])]),
            unit("b", &[("y", &[10, 10]), ("z", &[5])]),
        ];
        let plan = PartitionPlan::new(&units, 2).unwrap();
        assert_eq!(plan.world_size(), 2);
        assert_eq!(plan.numel(), 205);
        assert_eq!(plan.padded_numel(), 128 + 128);
        assert_eq!(plan.shard_numel(), 64 + 64);
        assert_eq!(plan.find("b"), Some(1));
        assert_eq!(plan.find("c"), None);
        assert!(plan.unit(2).is_none());
        assert_eq!(plan.shard_range(1, 1), 64..128);
    }

    #[test]
    fn empty_plan() {
        let plan = PartitionPlan::new(&[], 3).unwrap();
        assert!(plan.units().is_empty());
        assert_eq!(
            (plan.numel(), plan.padded_numel(), plan.shard_numel()),
            (0, 0, 0)
        );
        assert!(plan.locate(0..10).is_empty());
    }

    #[test]
    fn zero_sized_tensor_inside_a_unit_is_allowed() {
        let u = unit("u", &[("a", &[4]), ("empty", &[0, 7]), ("b", &[2])]);
        let plan = PartitionPlan::new(&[u], 1).unwrap();
        let l = &plan.units()[0];
        assert_eq!(l.tensor("empty").unwrap().range(), 4..4);
        assert_eq!(l.tensor("b").unwrap().range(), 4..6);
    }

    #[test]
    fn locate_across_units() {
        let units = [
            unit("a", &[("x", &[10])]),
            unit("b", &[("x", &[5])]),
            unit("c", &[("x", &[7])]),
        ];
        let plan = PartitionPlan::new(&units, 3).unwrap();
        assert_eq!(plan.locate(0..22), vec![(0, 0..10), (1, 0..5), (2, 0..7)]);
        assert_eq!(plan.locate(8..12), vec![(0, 8..10), (1, 0..2)]);
        assert_eq!(plan.locate(10..15), vec![(1, 0..5)]);
        assert_eq!(plan.locate(14..16), vec![(1, 4..5), (2, 0..1)]);
        assert_eq!(plan.locate(20..100), vec![(2, 5..7)]);
        assert!(plan.locate(22..30).is_empty());
        assert!(plan.locate(5..5).is_empty());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = plan.locate(9..3);
        assert!(reversed.is_empty());
    }

    #[test]
    fn error_world_size_zero() {
        let msg = plan_err(&[unit("a", &[("x", &[1])])], 0);
        assert!(msg.contains("world size"), "{msg}");
    }

    #[test]
    fn error_world_size_overflow() {
        let msg = plan_err(&[unit("a", &[("x", &[1])])], usize::MAX / 2);
        assert!(msg.contains("overflows"), "{msg}");
    }

    #[test]
    fn error_empty_unit_name() {
        let msg = plan_err(&[unit("a", &[("x", &[1])]), unit("", &[("x", &[1])])], 2);
        assert!(
            msg.contains("unit 1") && msg.contains("empty name"),
            "{msg}"
        );
    }

    #[test]
    fn error_empty_tensor_name() {
        let msg = plan_err(&[unit("a", &[("", &[1])])], 2);
        assert!(msg.contains("`a`") && msg.contains("empty name"), "{msg}");
    }

    #[test]
    fn error_duplicate_unit_names() {
        let msg = plan_err(
            &[unit("layer", &[("x", &[1])]), unit("layer", &[("y", &[1])])],
            2,
        );
        assert!(
            msg.contains("duplicate unit") && msg.contains("`layer`"),
            "{msg}"
        );
    }

    #[test]
    fn error_duplicate_tensor_names() {
        let msg = plan_err(&[unit("layer", &[("w", &[2]), ("w", &[3])])], 2);
        assert!(
            msg.contains("duplicate tensor") && msg.contains("`w`") && msg.contains("`layer`"),
            "{msg}"
        );
    }

    #[test]
    fn error_unit_without_elements() {
        let msg = plan_err(&[unit("nothing", &[])], 2);
        assert!(
            msg.contains("`nothing`") && msg.contains("no elements"),
            "{msg}"
        );
        let msg = plan_err(&[unit("zeros", &[("z", &[0])])], 2);
        assert!(
            msg.contains("`zeros`") && msg.contains("no elements"),
            "{msg}"
        );
    }

    #[test]
    fn error_tensor_size_overflow() {
        let msg = plan_err(&[unit("huge", &[("w", &[usize::MAX, 2])])], 1);
        assert!(
            msg.contains("`w`") && msg.contains("`huge`") && msg.contains("overflows"),
            "{msg}"
        );
    }

    #[test]
    fn error_unit_size_overflow() {
        let msg = plan_err(
            &[unit(
                "huge",
                &[("a", &[usize::MAX / 2 + 1]), ("b", &[usize::MAX / 2 + 1])],
            )],
            1,
        );
        assert!(msg.contains("`huge`") && msg.contains("overflows"), "{msg}");
    }

    #[test]
    fn error_padding_overflow() {
        let msg = plan_err(&[unit("edge", &[("a", &[usize::MAX - 1])])], 1);
        assert!(
            msg.contains("`edge`") && msg.contains("padded") && msg.contains("overflows"),
            "{msg}"
        );
    }

    #[test]
    fn error_total_overflow() {
        let half = (usize::MAX / 2 / SHARD_ALIGN) * SHARD_ALIGN;
        let msg = plan_err(
            &[
                unit("a", &[("x", &[half])]),
                unit("b", &[("x", &[half])]),
                unit("c", &[("x", &[half])]),
            ],
            1,
        );
        assert!(msg.contains("`c`") && msg.contains("overflows"), "{msg}");
    }

    #[test]
    fn serde_round_trip_and_validation() {
        let units = [
            unit("a", &[("x", &[3, 5]), ("y", &[])]),
            unit("b", &[("z", &[99])]),
        ];
        let plan = PartitionPlan::new(&units, 5).unwrap();
        let json = serde_json::to_string(&plan).unwrap();
        let back: PartitionPlan = serde_json::from_str(&json).unwrap();
        assert_eq!(back, plan);

        // A tampered shard length is rejected with the unit's name.
        let mut value: serde_json::Value = serde_json::from_str(&json).unwrap();
        value["units"][1]["shard_len"] = serde_json::json!(64);
        let err = serde_json::from_value::<PartitionPlan>(value).unwrap_err();
        assert!(err.to_string().contains("`b`"), "{err}");

        // So is a world size of zero.
        let mut value: serde_json::Value = serde_json::from_str(&json).unwrap();
        value["world_size"] = serde_json::json!(0);
        assert!(serde_json::from_value::<PartitionPlan>(value).is_err());
    }

    #[test]
    #[should_panic(expected = "rank 4 out of range")]
    fn shard_range_rank_out_of_range_panics() {
        let plan = PartitionPlan::new(&[unit("a", &[("x", &[1])])], 4).unwrap();
        let _ = plan.shard_range(0, 4);
    }

    #[test]
    #[should_panic(expected = "unit index 1 out of range")]
    fn shard_range_unit_out_of_range_panics() {
        let plan = PartitionPlan::new(&[unit("a", &[("x", &[1])])], 4).unwrap();
        let _ = plan.shard_range(1, 0);
    }
}
