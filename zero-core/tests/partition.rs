//! Properties of the partition plan over random units and world sizes:
//! shards cover every padded element exactly once, aligned and balanced;
//! real ranges and tensor ranges tile the real elements; `locate` maps the
//! concatenated real elements back to units; plans round-trip through JSON.

use proptest::prelude::*;
use zero_core::partition::{PartitionPlan, TensorSpec, UnitSpec, SHARD_ALIGN};

/// Primes that show up as awkward tensor sizes.
const PRIMES: [usize; 10] = [1, 2, 3, 7, 31, 97, 251, 1021, 2039, 4999];

/// A shape of 1 to 3 dimensions with 1 to 4999 elements, sometimes a prime.
fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        prop::sample::select(PRIMES.to_vec()).prop_map(|p| vec![p]),
        (1usize..5000).prop_map(|n| vec![n]),
        (1usize..71, 1usize..71).prop_map(|(a, b)| vec![a, b]),
        (1usize..17, 1usize..17, 1usize..17).prop_map(|(a, b, c)| vec![a, b, c]),
    ]
}

/// 1 to 20 units of 1 to 6 tensors each, with unique names.
fn units() -> impl Strategy<Value = Vec<UnitSpec>> {
    prop::collection::vec(prop::collection::vec(shape(), 1..=6), 1..=20).prop_map(|units| {
        units
            .into_iter()
            .enumerate()
            .map(|(u, shapes)| {
                UnitSpec::new(
                    format!("unit.{u}"),
                    shapes
                        .iter()
                        .enumerate()
                        .map(|(t, s)| TensorSpec::new(format!("t{t}"), s))
                        .collect(),
                )
            })
            .collect()
    })
}

fn plan_and_world() -> impl Strategy<Value = (Vec<UnitSpec>, usize)> {
    (units(), 1usize..=64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn shards_cover_padded_units_exactly_once((specs, world) in plan_and_world()) {
        let plan = PartitionPlan::new(&specs, world).unwrap();
        prop_assert_eq!(plan.world_size(), world);
        prop_assert_eq!(plan.units().len(), specs.len());
        for (i, unit) in plan.units().iter().enumerate() {
            prop_assert_eq!(unit.numel, specs[i].numel());
            prop_assert!(unit.padded_numel >= unit.numel);
            prop_assert_eq!(unit.padded_numel % (world * SHARD_ALIGN), 0);
            prop_assert!(unit.padding() < world * SHARD_ALIGN, "padding {}", unit.padding());
            prop_assert_eq!(unit.shard_len % SHARD_ALIGN, 0);
            prop_assert!(unit.shard_len > 0);
            prop_assert_eq!(unit.world_size(), world);
            // Consecutive, equal-length shards from 0 to padded_numel.
            let mut next = 0;
            for rank in 0..world {
                let shard = plan.shard_range(i, rank);
                prop_assert_eq!(&shard, &unit.shard_range(rank));
                prop_assert_eq!(shard.start, next);
                prop_assert_eq!(shard.len(), unit.shard_len);
                next = shard.end;
            }
            prop_assert_eq!(next, unit.padded_numel);
            // Each shard is below numel / world + SHARD_ALIGN.
            prop_assert!(unit.shard_len * world < unit.numel + world * SHARD_ALIGN);
        }
        prop_assert_eq!(plan.numel(), specs.iter().map(UnitSpec::numel).sum::<usize>());
        prop_assert_eq!(plan.padded_numel(), plan.units().iter().map(|u| u.padded_numel).sum::<usize>());
        prop_assert_eq!(plan.shard_numel() * world, plan.padded_numel());
    }

    #[test]
    fn real_ranges_partition_real_elements((specs, world) in plan_and_world()) {
        let plan = PartitionPlan::new(&specs, world).unwrap();
        for unit in plan.units() {
            let mut covered = vec![0u8; unit.numel];
            let mut next = 0;
            for rank in 0..world {
                let real = unit.real_range(rank);
                let shard = unit.shard_range(rank);
                prop_assert!(real.end <= unit.numel);
                if !real.is_empty() {
                    prop_assert_eq!(real.start, shard.start);
                    prop_assert!(real.end <= shard.end);
                    prop_assert_eq!(real.start, next);
                    next = real.end;
                }
                for x in &mut covered[real] {
                    *x += 1;
                }
            }
            prop_assert_eq!(next, unit.numel);
            prop_assert!(covered.iter().all(|&c| c == 1));
        }
    }

    #[test]
    fn tensor_ranges_tile_the_unit((specs, world) in plan_and_world()) {
        let plan = PartitionPlan::new(&specs, world).unwrap();
        for (unit, spec) in plan.units().iter().zip(&specs) {
            prop_assert_eq!(&unit.name, &spec.name);
            prop_assert_eq!(unit.tensors.len(), spec.tensors.len());
            let mut next = 0;
            for (layout, tensor) in unit.tensors.iter().zip(&spec.tensors) {
                prop_assert_eq!(&layout.name, &tensor.name);
                prop_assert_eq!(&layout.shape, &tensor.shape);
                prop_assert_eq!(layout.numel, tensor.numel());
                prop_assert_eq!(layout.range(), next..next + tensor.numel());
                prop_assert_eq!(unit.tensor(&tensor.name), Some(layout));
                next = layout.range().end;
            }
            prop_assert_eq!(next, unit.numel);
        }
    }

    #[test]
    fn locate_maps_back_to_units(
        (specs, world) in plan_and_world(),
        a in any::<prop::sample::Index>(),
        b in any::<prop::sample::Index>(),
    ) {
        let plan = PartitionPlan::new(&specs, world).unwrap();
        let total = plan.numel();
        let (x, y) = (a.index(total + 1), b.index(total + 1));
        let range = x.min(y)..x.max(y);
        // Unit start offsets in the concatenation of real elements.
        let starts: Vec<usize> = plan
            .units()
            .iter()
            .scan(0, |acc, u| {
                let start = *acc;
                *acc += u.numel;
                Some(start)
            })
            .collect();
        let pieces = plan.locate(range.clone());
        prop_assert_eq!(pieces.iter().map(|(_, r)| r.len()).sum::<usize>(), range.len());
        let mut global = range.start;
        let mut last_unit = None;
        for (unit, r) in &pieces {
            prop_assert!(!r.is_empty());
            prop_assert!(r.end <= plan.units()[*unit].numel);
            prop_assert!(last_unit.is_none_or(|u| u < *unit), "pieces out of order");
            // The piece's first element is the next element of `range`.
            prop_assert_eq!(starts[*unit] + r.start, global);
            global += r.len();
            last_unit = Some(*unit);
        }
        prop_assert_eq!(global, range.end);
        // Ranges reaching past the end are clamped to the model.
        let beyond = plan.locate(range.start..total + 100);
        prop_assert_eq!(beyond.iter().map(|(_, r)| r.len()).sum::<usize>(), total - range.start);
    }

    #[test]
    fn plan_round_trips_through_json((specs, world) in plan_and_world()) {
        let plan = PartitionPlan::new(&specs, world).unwrap();
        let json = serde_json::to_string(&plan).unwrap();
        let back: PartitionPlan = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(back, plan);
    }

    #[test]
    fn plan_is_deterministic((specs, world) in plan_and_world()) {
        prop_assert_eq!(
            PartitionPlan::new(&specs, world).unwrap(),
            PartitionPlan::new(&specs, world).unwrap()
        );
    }
}

#[test]
fn locate_every_single_element() {
    let specs: Vec<UnitSpec> = [5usize, 1, 64, 33]
        .iter()
        .enumerate()
        .map(|(i, &n)| UnitSpec::new(format!("u{i}"), vec![TensorSpec::new("x", &[n])]))
        .collect();
    let plan = PartitionPlan::new(&specs, 3).unwrap();
    let mut expected = Vec::new();
    for (u, unit) in plan.units().iter().enumerate() {
        for e in 0..unit.numel {
            expected.push((u, e));
        }
    }
    for (g, &(u, e)) in expected.iter().enumerate() {
        assert_eq!(plan.locate(g..g + 1), vec![(u, e..e + 1)]);
    }
}
