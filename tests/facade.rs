//! The facade's documented paths: `zero::core` and `zero::comm` re-export
//! the workspace crates, and a trainer-shaped use of them works end to end.

use zero::comm::{
    even_counts, reference_reduce, BucketPlan, Bucketer, Communicator, ReduceOp, ThreadGroup,
};
use zero::core::{bf16, DType, Device, HostBuffer};

#[test]
fn bucketed_gradient_average_then_sharded_gather() {
    let lens = [7usize, 1000, 3, 4097, 1];
    let world = 3;
    let out = ThreadGroup::run(world, |comm| {
        let r = comm.rank();
        let mut grads: Vec<Vec<bf16>> = lens
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|i| bf16::from_f32((i * (r + 1)) as f32 % 17.0))
                    .collect()
            })
            .collect();
        let mut b = Bucketer::<bf16>::new(&comm, BucketPlan::new(&lens, 1500).unwrap()).unwrap();
        let mut views: Vec<&mut [bf16]> = grads.iter_mut().map(|g| &mut g[..]).collect();
        b.all_reduce(&comm, &mut views, ReduceOp::Avg).unwrap();

        // Then the ZeRO-3 shape: every rank owns an even share of a flat
        // buffer and gathers the rest in place.
        let counts = even_counts(10_001, world);
        let mut flat = HostBuffer::<f32>::zeros(10_001).unwrap();
        let start: usize = counts[..r].iter().sum();
        for x in &mut flat[start..start + counts[r]] {
            *x = r as f32;
        }
        let flat = comm.all_gather_in_place(flat, &counts).wait().unwrap();
        (grads, flat.to_vec())
    })
    .unwrap();

    for (t, &n) in lens.iter().enumerate() {
        let inputs: Vec<Vec<bf16>> = (0..world)
            .map(|r| {
                (0..n)
                    .map(|i| bf16::from_f32((i * (r + 1)) as f32 % 17.0))
                    .collect()
            })
            .collect();
        let refs: Vec<&[bf16]> = inputs.iter().map(|v| &v[..]).collect();
        let want = reference_reduce(&refs, ReduceOp::Avg);
        for (grads, _) in &out {
            assert_eq!(grads[t], want, "tensor {t}");
        }
    }
    let counts = even_counts(10_001, world);
    let want: Vec<f32> = (0..world)
        .flat_map(|r| std::iter::repeat_n(r as f32, counts[r]))
        .collect();
    for (_, flat) in &out {
        assert_eq!(flat, &want);
    }
}

#[test]
fn core_types_through_the_facade() {
    assert_eq!(DType::BF16.size_in_bytes(), 2);
    assert!(Device::Cpu.is_cpu());
    // Without a GPU (or the feature) this is an error, never a panic.
    if let Err(e) = Device::cuda(0) {
        assert!(!e.to_string().is_empty());
    }
}
