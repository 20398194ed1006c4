//! The device arena.
//!
//! In every build, properties of the plan over random requests: no two
//! buffers live in the same phase overlap, every buffer is aligned, the
//! total is the sum of the slots' extents (the least for the layout rule),
//! slots are packed without gaps, a plan is refused exactly when a shared
//! slot has buffers live in the same phase, and planning is deterministic.
//!
//! With the `cuda` feature and a GPU, the arena on the device: its size
//! against the driver's free memory, the tracker's accounting, typed views
//! at the planned offsets, slot exclusion. Without a GPU these tests print a
//! skip line and pass.

use std::collections::HashMap;

use proptest::prelude::*;
use zero_core::cuda::arena::{ArenaPlan, BufferRequest, Phases, DEVICE_ALIGN};
use zero_core::memory::Category;

/// One random request: the shared slot, if any, is one of four; a shared
/// buffer is live in one of eight phases, so conflicts happen but rarely.
fn request(i: usize) -> impl Strategy<Value = BufferRequest> {
    let bytes = prop_oneof![
        3 => 0u64..4096,
        2 => 0u64..200_000,
        1 => prop::sample::select(vec![1u64, 255, 256, 257, 4095, 4096, 1 << 20]),
    ];
    let align = prop::sample::select(vec![1u64, 2, 4, 64, 256, 256, 256, 512, 4096]);
    let category = prop::sample::select(Category::ALL.to_vec());
    let sharing = prop_oneof![
        3 => Just(None),
        2 => (0u32..4, 0u32..8).prop_map(Some),
    ];
    let phases = prop_oneof![
        2 => Just(Phases::ALL),
        1 => (1u32..16).prop_map(phase_set),
    ];
    (bytes, align, category, sharing, phases).prop_map(
        move |(bytes, align, cat, sharing, phases)| {
            let r = BufferRequest::new(format!("b{i}"), cat, bytes).align(align);
            match sharing {
                None => r.live_in(phases),
                Some((slot, phase)) => r
                    .share(format!("s{slot}"))
                    .live_in(Phases::nth(phase).expect("phase < 32")),
            }
        },
    )
}

/// 0 to 24 requests with unique names.
fn requests() -> impl Strategy<Value = Vec<BufferRequest>> {
    (0usize..=24).prop_flat_map(|n| (0..n).map(request).collect::<Vec<_>>())
}

/// The set of phases 0 to 3 whose bits are in `mask`.
fn phase_set(mask: u32) -> Phases {
    (0..4)
        .filter(|i| mask & (1 << i) != 0)
        .filter_map(Phases::nth)
        .fold(Phases::NONE, |a, b| a | b)
}

fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// The shared slots with two buffers live in the same phase.
fn conflicts(reqs: &[BufferRequest]) -> Vec<String> {
    let mut by_slot: HashMap<&str, Vec<&BufferRequest>> = HashMap::new();
    for r in reqs {
        if let Some(s) = r.slot() {
            by_slot.entry(s).or_default().push(r);
        }
    }
    let mut bad: Vec<String> = by_slot
        .into_iter()
        .filter(|(_, rs)| {
            rs.iter()
                .enumerate()
                .any(|(i, a)| rs[i + 1..].iter().any(|b| a.phases().overlaps(b.phases())))
        })
        .map(|(s, _)| s.to_string())
        .collect();
    bad.sort();
    bad
}

/// The sum of the slots' extents, computed from the requests alone.
fn expected_total(reqs: &[BufferRequest]) -> u64 {
    let mut groups: HashMap<String, (u64, u64)> = HashMap::new();
    for r in reqs {
        let key = match r.slot() {
            Some(s) => format!("slot:{s}"),
            None => format!("own:{}", r.name()),
        };
        let g = groups.entry(key).or_insert((0, 1));
        g.0 = g.0.max(r.bytes());
        g.1 = g.1.max(r.alignment());
    }
    groups.values().map(|&(b, a)| round_up(b, a)).sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn plans_are_aligned_disjoint_minimal_and_deterministic(reqs in requests(), rank in 0usize..64) {
        let bad = conflicts(&reqs);
        let plan = match ArenaPlan::new(rank, reqs.clone()) {
            Ok(plan) => plan,
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(!bad.is_empty(), "refused without a conflict: {msg}");
                prop_assert!(msg.contains(&format!("rank {rank}")), "{msg}");
                prop_assert!(bad.iter().any(|s| msg.contains(&format!("slot `{s}`"))), "{msg}");
                return Ok(());
            }
        };
        prop_assert!(bad.is_empty(), "accepted conflicting slots {bad:?}");
        prop_assert_eq!(plan.buffers().len(), reqs.len());

        let total = plan.total_bytes();
        for (b, r) in plan.buffers().iter().zip(&reqs) {
            prop_assert_eq!(&b.name, r.name());
            prop_assert_eq!(b.bytes, r.bytes());
            prop_assert_eq!(b.offset % r.alignment(), 0, "{} misaligned", b.name);
            prop_assert!(b.range().end <= total);
            prop_assert_eq!(plan.slots()[b.slot].offset, b.offset);
        }
        // No two buffers live in one phase overlap; overlapping buffers share
        // a slot and are never live together.
        for (i, a) in plan.buffers().iter().enumerate() {
            for b in &plan.buffers()[i + 1..] {
                let overlap = a.range().start < b.range().end && b.range().start < a.range().end;
                if overlap {
                    prop_assert_eq!(a.slot, b.slot);
                    prop_assert!(!a.phases.overlaps(b.phases), "{} and {} live together", a.name, b.name);
                }
            }
        }
        // Slots back to back, by decreasing alignment, each padded to its
        // alignment: the total is the sum of extents, the least possible.
        let mut offset = 0;
        for (s, slot) in plan.slots().iter().enumerate() {
            prop_assert_eq!(slot.offset, offset);
            prop_assert_eq!(slot.offset % slot.align, 0);
            if s > 0 {
                prop_assert!(plan.slots()[s - 1].align >= slot.align);
            }
            let largest = slot.buffers.iter().map(|&i| plan.buffers()[i].bytes).max().unwrap();
            prop_assert_eq!(slot.extent, round_up(largest, slot.align));
            offset += slot.extent;
        }
        prop_assert_eq!(offset, total);
        prop_assert_eq!(total, expected_total(&reqs));
        prop_assert!(plan.peak_live_bytes() <= total);

        // Same requests, same plan.
        prop_assert_eq!(&ArenaPlan::new(rank, reqs.clone()).unwrap(), &plan);

        plan.check_capacity(total).unwrap();
        if total > 0 {
            let msg = plan.check_capacity(total - 1).unwrap_err().to_string();
            prop_assert!(msg.contains(&format!("rank {rank}")), "{msg}");
            prop_assert!(msg.contains("1 bytes missing"), "{msg}");
        }
    }
}

#[test]
fn default_alignment_is_the_cuda_malloc_guarantee() {
    let plan = ArenaPlan::new(
        0,
        (0..10).map(|i| BufferRequest::new(format!("b{i}"), Category::Grads, 1 + i * 25)),
    )
    .unwrap();
    for b in plan.buffers() {
        assert_eq!(b.offset % DEVICE_ALIGN, 0);
    }
    assert_eq!(plan.total_bytes(), 10 * DEVICE_ALIGN);
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::io::Write;

    use half::bf16;
    use zero_core::cuda::arena::{ArenaPlan, BufferRequest, DeviceArena, Phases};
    use zero_core::cuda::stream::Streams;
    use zero_core::memory::{Category, MemoryTracker, Tier};
    use zero_core::CudaDevice;

    const MIB: u64 = 1 << 20;

    /// Writes `line` to stderr in one write, past the harness's capture
    /// (which only catches `print!`/`eprint!`), so that it shows.
    fn note(line: &str) {
        let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
    }

    /// CUDA device 0, or `None` after a skip line.
    fn gpu(test: &str) -> Option<CudaDevice> {
        zero_testkit::kernel_checks::cuda_device_or_skip(test)
    }

    fn plan(rank: usize) -> ArenaPlan {
        ArenaPlan::new(
            rank,
            [
                BufferRequest::new("params", Category::Params, 192 * MIB),
                BufferRequest::new("grads", Category::Grads, 96 * MIB + 6),
                BufferRequest::new("master", Category::Master, 128 * MIB),
                BufferRequest::new("bucket", Category::CommBuffers, 32 * MIB)
                    .live_in(Phases::BACKWARD)
                    .share("scratch"),
                BufferRequest::new("tile", Category::CommBuffers, 48 * MIB)
                    .live_in(Phases::STEP)
                    .share("scratch"),
                BufferRequest::new("overflow", Category::CommBuffers, 4).align(4),
            ],
        )
        .unwrap()
    }

    #[test]
    fn arena_size_matches_the_drivers_free_memory() {
        let Some(dev) = gpu("arena_size_matches_the_drivers_free_memory") else {
            return;
        };
        let streams = Streams::new(&dev).unwrap();
        let tracker = MemoryTracker::new(0);
        let plan = plan(0);
        let total = plan.total_bytes();
        let (free_before, _) = dev.context().mem_get_info().unwrap();
        let arena = DeviceArena::new(&streams, plan, &tracker).unwrap();
        streams.compute().synchronize().unwrap();
        let (free_after, _) = dev.context().mem_get_info().unwrap();
        let used = (free_before - free_after) as u64;
        note(&format!(
            "arena of {total} bytes: the driver's free memory fell by {used} bytes"
        ));
        assert_eq!(arena.size_in_bytes(), total);
        // The driver maps device memory in 2 MiB pages; a stream-ordered
        // pool may reserve somewhat more.
        assert!(used + 2 * MIB >= total, "used {used} < total {total}");
        assert!(used <= total + 64 * MIB, "used {used} >> total {total}");
        // Nothing is accounted until buffers are taken.
        assert_eq!(tracker.tier_current(Tier::Device), 0);
        drop(arena);
        streams.check_err().unwrap();
    }

    #[test]
    fn buffers_are_typed_views_at_their_offsets_and_accounted() {
        let Some(dev) = gpu("buffers_are_typed_views_at_their_offsets_and_accounted") else {
            return;
        };
        let streams = Streams::new(&dev).unwrap();
        let tracker = MemoryTracker::new(3);
        let arena = DeviceArena::new(&streams, plan(3), &tracker).unwrap();
        let extent = |name: &str| {
            let p = arena.plan();
            p.slots()[p.buffer(name).unwrap().slot].extent
        };

        let mut params = arena.take::<bf16>("params").unwrap();
        let mut master = arena.take::<f32>("master").unwrap();
        let mut bucket = arena.take::<f32>("bucket").unwrap();
        assert_eq!(params.len(), (192 * MIB / 2) as usize);
        assert_eq!(
            tracker.tier_current(Tier::Device),
            extent("params") + extent("master") + extent("bucket")
        );
        assert_eq!(
            tracker.current(Tier::Device, Category::Params),
            extent("params")
        );

        // Distinct contents in every live buffer: a wrong offset or length
        // would let one overwrite another.
        let p: Vec<bf16> = (0..params.len())
            .map(|i| bf16::from_f32((i % 251) as f32))
            .collect();
        let m: Vec<f32> = (0..master.len()).map(|i| -(i as f32)).collect();
        let b: Vec<f32> = (0..bucket.len()).map(|i| (i % 977) as f32 + 0.5).collect();
        streams.upload(&p, &mut params).unwrap();
        streams.upload(&m, &mut master).unwrap();
        streams.upload(&b, &mut bucket).unwrap();
        let mut back_p = vec![bf16::ZERO; p.len()];
        let mut back_m = vec![0f32; m.len()];
        let mut back_b = vec![0f32; b.len()];
        streams.download(&mut params, &mut back_p).unwrap();
        streams.download(&mut master, &mut back_m).unwrap();
        streams.download(&mut bucket, &mut back_b).unwrap();
        assert!(back_p == p && back_m == m && back_b == b);

        // Slot exclusion: the tile shares the bucket's memory.
        let err = arena.take::<f32>("tile").unwrap_err().to_string();
        assert!(err.contains("`bucket`") && err.contains("rank 3"), "{err}");
        let err = arena.take::<f32>("bucket").unwrap_err().to_string();
        assert!(err.contains("taken already"), "{err}");
        assert_eq!(arena.is_taken("bucket"), Some(true));
        drop(bucket);
        assert_eq!(arena.is_taken("bucket"), Some(false));
        let tile = arena.take::<f32>("tile").unwrap();
        assert_eq!(tile.offset(), arena.plan().buffer("bucket").unwrap().offset);

        // Element type checks: 96 MiB + 6 bytes are not whole f32s.
        assert!(arena.take::<f32>("grads").is_err());
        let grads = arena.take::<bf16>("grads").unwrap();
        assert_eq!(grads.len(), (48 * MIB + 3) as usize);
        assert!(arena.take::<f32>("nope").is_err());
        let flag = arena.take::<f32>("overflow").unwrap();
        assert_eq!(flag.len(), 1);

        drop((params, master, tile, grads, flag));
        assert_eq!(tracker.tier_current(Tier::Device), 0);
        assert!(tracker.tier_peak(Tier::Device) <= arena.plan().total_bytes());
        streams.check_err().unwrap();
    }

    #[test]
    fn a_plan_larger_than_the_device_is_refused_before_allocating() {
        let Some(dev) = gpu("a_plan_larger_than_the_device_is_refused_before_allocating") else {
            return;
        };
        let streams = Streams::new(&dev).unwrap();
        let (_, total) = dev.context().mem_get_info().unwrap();
        let plan = ArenaPlan::new(
            1,
            [
                BufferRequest::new("params", Category::Params, total as u64),
                BufferRequest::new("master", Category::Master, total as u64 / 2),
            ],
        )
        .unwrap();
        let err = DeviceArena::new(&streams, plan, &MemoryTracker::new(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 1") && err.contains("missing"), "{err}");
        assert!(
            err.contains("`params`") && err.contains("`master`"),
            "{err}"
        );
    }
}
