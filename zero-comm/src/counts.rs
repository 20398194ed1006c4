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

/// Cuts a collective with per-rank `counts` into rounds of at most `per`
/// elements per rank: round k holds elements `k*per ..` of each rank's
/// part, so yields, for each round, every rank's piece (0 once a rank's part
/// is used up). The rounds together cover every count exactly once.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn round_pieces(counts: &[usize], per: usize) -> impl Iterator<Item = Vec<usize>> + '_ {
    assert!(per > 0, "a round must move at least one element per rank");
    let rounds = counts.iter().max().copied().unwrap_or(0).div_ceil(per);
    (0..rounds).map(move |k| {
        counts
            .iter()
            .map(|&c| c.saturating_sub(k * per).min(per))
            .collect()
    })
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

    proptest! {
        #[test]
        fn round_pieces_cover_each_count_once(
            counts in proptest::collection::vec(0usize..1000, 1..9),
            per in 1usize..300,
        ) {
            let mut sums = vec![0; counts.len()];
            for piece in round_pieces(&counts, per) {
                prop_assert!(piece.iter().all(|&x| x <= per));
                prop_assert!(piece.iter().any(|&x| x > 0), "no empty rounds");
                for (s, x) in sums.iter_mut().zip(&piece) {
                    *s += x;
                }
            }
            prop_assert_eq!(sums, counts);
        }
    }

    #[test]
    fn hash_distinguishes_permutations() {
        assert_ne!(counts_hash(&[1, 2]), counts_hash(&[2, 1]));
        assert_eq!(counts_hash(&[3, 3]), counts_hash(&[3, 3]));
    }
}
