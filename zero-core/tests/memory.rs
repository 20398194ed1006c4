//! Behaviour of the memory tracker: per-category and per-tier current and
//! peak bytes, RAII allocations, reports, and use from many threads.

use std::sync::Barrier;

use zero_core::memory::{Allocation, Category, MemoryReport, MemoryTracker, Tier};

static_assertions::assert_impl_all!(MemoryTracker: Send, Sync, Clone);
static_assertions::assert_impl_all!(Allocation: Send, Sync);
static_assertions::assert_impl_all!(MemoryReport: Send, Sync, Clone);

const MIB: u64 = 1 << 20;

#[test]
fn current_and_peak_per_category() {
    let t = MemoryTracker::new(0);
    let p = t.allocate(Tier::Device, Category::Params, 4 * MIB);
    let g = t.allocate(Tier::Device, Category::Grads, 2 * MIB);
    let m = t.allocate(Tier::Host, Category::Moments, 8 * MIB);
    assert_eq!(
        (p.tier(), p.category(), p.bytes()),
        (Tier::Device, Category::Params, 4 * MIB)
    );
    assert_eq!(t.current(Tier::Device, Category::Params), 4 * MIB);
    assert_eq!(t.current(Tier::Device, Category::Grads), 2 * MIB);
    assert_eq!(t.current(Tier::Host, Category::Moments), 8 * MIB);
    assert_eq!(t.current(Tier::Host, Category::Params), 0);
    assert_eq!(t.tier_current(Tier::Device), 6 * MIB);
    assert_eq!(t.tier_current(Tier::Host), 8 * MIB);
    assert_eq!(t.tier_current(Tier::Nvme), 0);
    drop(g);
    assert_eq!(t.current(Tier::Device, Category::Grads), 0);
    assert_eq!(t.peak(Tier::Device, Category::Grads), 2 * MIB);
    drop((p, m));
    for tier in Tier::ALL {
        assert_eq!(t.tier_current(tier), 0);
    }
    assert_eq!(t.tier_peak(Tier::Device), 6 * MIB);
    assert_eq!(t.tier_peak(Tier::Host), 8 * MIB);
}

#[test]
fn tier_peak_is_peak_of_sum_not_sum_of_peaks() {
    let t = MemoryTracker::new(0);
    let a = t.allocate(Tier::Device, Category::GatheredParams, 300);
    drop(a);
    let b = t.allocate(Tier::Device, Category::CommBuffers, 200);
    assert_eq!(t.peak(Tier::Device, Category::GatheredParams), 300);
    assert_eq!(t.peak(Tier::Device, Category::CommBuffers), 200);
    assert_eq!(t.tier_peak(Tier::Device), 300);
    let c = t.allocate(Tier::Device, Category::Activations, 150);
    assert_eq!(t.tier_peak(Tier::Device), 350);
    drop((b, c));
    assert_eq!(t.tier_peak(Tier::Device), 350);
}

#[test]
fn model_states_sum_only_model_state_categories() {
    let t = MemoryTracker::new(0);
    let _p = t.allocate(Tier::Device, Category::Params, 2);
    let _g = t.allocate(Tier::Device, Category::Grads, 2);
    let master = t.allocate(Tier::Device, Category::Master, 4);
    let _m = t.allocate(Tier::Device, Category::Moments, 8);
    let _gathered = t.allocate(Tier::Device, Category::GatheredParams, 100);
    let _bucket = t.allocate(Tier::Device, Category::CommBuffers, 100);
    let _act = t.allocate(Tier::Device, Category::Activations, 100);
    assert_eq!(t.model_states(Tier::Device), 16);
    assert_eq!(t.tier_current(Tier::Device), 316);
    drop(master);
    assert_eq!(t.model_states(Tier::Device), 12);
    assert_eq!(t.model_states_peak(Tier::Device), 16);
    assert_eq!(t.model_states(Tier::Host), 0);
}

#[test]
fn resize_grows_and_shrinks() {
    let t = MemoryTracker::new(0);
    let mut a = t.allocate(Tier::Host, Category::CommBuffers, 10);
    a.resize(100);
    assert_eq!(a.bytes(), 100);
    assert_eq!(t.current(Tier::Host, Category::CommBuffers), 100);
    a.resize(30);
    assert_eq!(t.current(Tier::Host, Category::CommBuffers), 30);
    assert_eq!(t.peak(Tier::Host, Category::CommBuffers), 100);
    assert_eq!(t.tier_peak(Tier::Host), 100);
    a.resize(0);
    assert_eq!(t.tier_current(Tier::Host), 0);
    a.resize(5);
    drop(a);
    assert_eq!(t.tier_current(Tier::Host), 0);
}

#[test]
fn drop_frees_and_clones_share_state() {
    let t = MemoryTracker::new(2);
    let clone = t.clone();
    {
        let _a = clone.allocate(Tier::Nvme, Category::Master, 1000);
        assert_eq!(t.current(Tier::Nvme, Category::Master), 1000);
    }
    assert_eq!(t.current(Tier::Nvme, Category::Master), 0);
    assert_eq!(t.peak(Tier::Nvme, Category::Master), 1000);
    // An allocation outlives the tracker handle it came from.
    let a = clone.allocate(Tier::Nvme, Category::Master, 7);
    drop(clone);
    assert_eq!(t.current(Tier::Nvme, Category::Master), 7);
    drop(a);
    assert_eq!(t.current(Tier::Nvme, Category::Master), 0);
}

#[test]
fn reset_peaks_sets_peaks_to_current() {
    let t = MemoryTracker::new(0);
    let a = t.allocate(Tier::Device, Category::Params, 50);
    let b = t.allocate(Tier::Device, Category::Activations, 500);
    drop(b);
    assert_eq!(t.tier_peak(Tier::Device), 550);
    t.reset_peaks();
    assert_eq!(t.tier_peak(Tier::Device), 50);
    assert_eq!(t.peak(Tier::Device, Category::Activations), 0);
    assert_eq!(t.peak(Tier::Device, Category::Params), 50);
    assert_eq!(t.model_states_peak(Tier::Device), 50);
    let _c = t.allocate(Tier::Device, Category::Activations, 20);
    assert_eq!(t.tier_peak(Tier::Device), 70);
    drop(a);
}

#[test]
fn report_contents() {
    let t = MemoryTracker::new(5);
    let _p = t.allocate(Tier::Device, Category::Params, 3 * MIB);
    let b = t.allocate(Tier::Device, Category::CommBuffers, MIB / 2);
    drop(b);
    let _m = t.allocate(Tier::Host, Category::Moments, 10 * MIB);
    let r = t.report();
    assert_eq!(r.rank, 5);
    assert_eq!(r.rows.len(), Tier::ALL.len() * Category::ALL.len());
    let p = r.get(Tier::Device, Category::Params).unwrap();
    assert_eq!((p.current, p.peak), (3 * MIB, 3 * MIB));
    let b = r.get(Tier::Device, Category::CommBuffers).unwrap();
    assert_eq!((b.current, b.peak), (0, MIB / 2));
    let zero = r.get(Tier::Nvme, Category::Grads).unwrap();
    assert_eq!((zero.current, zero.peak), (0, 0));
    let device = r.tier(Tier::Device).unwrap();
    assert_eq!((device.current, device.peak), (3 * MIB, 3 * MIB + MIB / 2));
    assert_eq!(
        (device.model_states, device.model_states_peak),
        (3 * MIB, 3 * MIB)
    );
    let host = r.tier(Tier::Host).unwrap();
    assert_eq!((host.current, host.model_states), (10 * MIB, 10 * MIB));

    let json = serde_json::to_string(&r).unwrap();
    let back: MemoryReport = serde_json::from_str(&json).unwrap();
    assert_eq!(back, r);
    assert!(json.contains("\"comm_buffers\""), "{json}");
}

#[test]
fn report_display_is_an_aligned_table() {
    let t = MemoryTracker::new(1);
    let _p = t.allocate(Tier::Device, Category::Params, 3 * MIB);
    let _g = t.allocate(Tier::Device, Category::GatheredParams, MIB + MIB / 4);
    let _m = t.allocate(Tier::Host, Category::Moments, 10 * MIB);
    let text = t.report().to_string();
    println!("{text}");
    for word in [
        "rank 1",
        "MiB",
        "params",
        "gathered_params",
        "moments",
        "model_states",
        "total",
        "device",
        "host",
        "3.00/3.00",
        "1.25/1.25",
        "10.00/10.00",
        "4.25/4.25",
    ] {
        assert!(text.contains(word), "missing {word:?} in\n{text}");
    }
    // The NVMe tier held nothing and is skipped; so are unused categories.
    assert!(!text.contains("nvme"), "{text}");
    assert!(!text.contains("activations"), "{text}");
    // Header and rows have the same width (right-aligned columns).
    let lines: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{text}");
}

#[test]
fn concurrent_allocations_from_many_threads() {
    const THREADS: u64 = 8;
    const ROUNDS: u64 = 1000;
    let t = MemoryTracker::new(0);
    let barrier = Barrier::new(THREADS as usize);
    std::thread::scope(|s| {
        for id in 0..THREADS {
            let t = t.clone();
            let barrier = &barrier;
            s.spawn(move || {
                barrier.wait();
                let mut held = Vec::new();
                for round in 0..ROUNDS {
                    let cat = zero_core::memory::Category::ALL[(round % 7) as usize];
                    let tier = Tier::ALL[(id % 3) as usize];
                    let mut a = t.allocate(tier, cat, 1 + id * 100 + round % 13);
                    if round % 5 == 0 {
                        a.resize(a.bytes() * 2);
                    }
                    held.push(a);
                    if held.len() > 4 {
                        drop(held.remove(0));
                    }
                }
            });
        }
    });
    for tier in Tier::ALL {
        assert_eq!(t.tier_current(tier), 0);
        assert_eq!(t.model_states(tier), 0);
        for cat in Category::ALL {
            assert_eq!(t.current(tier, cat), 0);
        }
    }
    // Thread 7 allocated up to 2 * (1 + 700 + 12) bytes at once on its tier.
    let largest = 2 * (1 + 700 + 12);
    assert!(t.tier_peak(Tier::ALL[(7 % 3) as usize]) >= largest);
    // Peaks of sums never exceed the sum of what could be live at once.
    let bound: u64 = (0..THREADS).map(|id| 5 * 2 * (1 + id * 100 + 12)).sum();
    for tier in Tier::ALL {
        assert!(t.tier_peak(tier) <= bound);
    }
}
