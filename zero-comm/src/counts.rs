//! Element counts per rank for collectives with uneven sizes.

/// Splits `len` elements over `world` ranks as evenly as possible: the first
/// `len % world` ranks get one element more.
pub fn even_counts(len: usize, world: usize) -> Vec<usize> {
    assert!(world > 0, "world size must be positive");
    let (q, r) = (len / world, len % world);
    (0..world).map(|i| q + usize::from(i < r)).collect()
}

/// Exclusive prefix sums of `counts`: where each rank's part starts.
pub fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut acc = 0;
    counts
        .iter()
        .map(|&c| {
            let o = acc;
            acc += c;
            o
        })
        .collect()
}

/// A 64-bit FNV-1a hash of the counts, so ranks can compare them cheaply.
pub(crate) fn counts_hash(counts: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in counts {
        for b in (c as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn even_counts_cover_exactly_and_balance(len in 0usize..1_000_000, world in 1usize..=64) {
            let c = even_counts(len, world);
            prop_assert_eq!(c.len(), world);
            prop_assert_eq!(c.iter().sum::<usize>(), len);
            let (mn, mx) = (c.iter().min().unwrap(), c.iter().max().unwrap());
            prop_assert!(mx - mn <= 1);
            let o = offsets(&c);
            for i in 1..world {
                prop_assert_eq!(o[i], o[i - 1] + c[i - 1]);
            }
        }
    }

    #[test]
    fn hash_distinguishes_permutations() {
        assert_ne!(counts_hash(&[1, 2]), counts_hash(&[2, 1]));
        assert_eq!(counts_hash(&[3, 3]), counts_hash(&[3, 3]));
    }
}
