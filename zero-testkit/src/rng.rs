//! Random numbers for tests, without `rand`.

use zero_core::Element;

/// A small deterministic generator (xorshift64*), so tests need no `rand`.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
    /// Values over several binades (2^-4 to 2^4), both signs, so that
    /// conversions round.
    pub fn value(&mut self) -> f32 {
        let m = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        let e = (self.next_u64() % 9) as i32 - 4;
        m * 2f32.powi(e)
    }
    /// `n` [`value`](Self::value)s as `T`.
    pub fn vec<T: Element>(&mut self, n: usize) -> Vec<T> {
        (0..n).map(|_| T::from_f32(self.value())).collect()
    }
}
