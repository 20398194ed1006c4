//! Element types of parameters, gradients and communication buffers.

use half::{bf16, f16};

/// The element types that `zero` stores and communicates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// bfloat16: 8 exponent bits, 7 mantissa bits.
    BF16,
    /// IEEE 754 binary16.
    F16,
}

impl DType {
    /// All dtypes, for tests and tables.
    pub const ALL: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The name used in configs and messages (`"f32"`, `"bf16"`, `"f16"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// A stable small integer, for descriptors that cross process boundaries.
    pub const fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::BF16 => 2,
            DType::F16 => 3,
        }
    }

    /// The inverse of [`DType::code`].
    pub const fn from_code(code: u8) -> Option<DType> {
        match code {
            1 => Some(DType::F32),
            2 => Some(DType::BF16),
            3 => Some(DType::F16),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "fp16" | "float16" => Ok(DType::F16),
            other => Err(format!(
                "unknown dtype `{other}` (expected f32, bf16 or f16)"
            )),
        }
    }
}

/// An element type that buffers hold and collectives move.
///
/// Elements are plain old data (`bytemuck::Pod`), so buffers can be viewed
/// as bytes and placed in shared memory. Reductions accumulate in `f32`:
/// `to_f32` is exact for every implementor, and `from_f32` rounds to nearest,
/// ties to even.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + std::fmt::Debug + 'static {
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Widen to f32 (exact).
    fn to_f32(self) -> f32;
    /// Narrow from f32 (round to nearest even).
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// Converts `src` into `dst` element by element: `dst = D(f32(src))`, or
/// with `add` `dst = D(f32(dst) + f32(src))` (accumulation in f32, rounded
/// once to `D`). The same dtype without `add` is a plain copy. The one loop
/// behind the engine's bucket packing and unpacking and the CPU backend's
/// cast, accumulate, pack and unpack, so that they give the same bits.
///
/// # Panics
/// If the slices differ in length (a caller's bug, checked in debug builds).
pub fn convert<S: Element, D: Element>(src: &[S], dst: &mut [D], add: bool) {
    debug_assert_eq!(src.len(), dst.len());
    if add {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = D::from_f32(d.to_f32() + s.to_f32());
        }
    } else if S::DTYPE == D::DTYPE {
        let s: &[u8] = bytemuck::cast_slice(src);
        bytemuck::cast_slice_mut::<D, u8>(dst).copy_from_slice(s);
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = D::from_f32(s.to_f32());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_sizes() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(d.as_str().parse::<DType>().unwrap(), d);
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(f32::DTYPE.size_in_bytes(), std::mem::size_of::<f32>());
        assert_eq!(bf16::DTYPE.size_in_bytes(), std::mem::size_of::<bf16>());
        assert_eq!(f16::DTYPE.size_in_bytes(), std::mem::size_of::<f16>());
        assert!("f8".parse::<DType>().unwrap_err().contains("f8"));
    }

    #[test]
    fn bf16_conversion_rounds_to_nearest_even() {
        // 1 + 2^-8 lies exactly between two bf16 values; ties go to even (1.0).
        assert_eq!(bf16::from_f32(1.0 + 2f32.powi(-8)).to_f32(), 1.0);
        // 1 + 3*2^-8 lies between 1+2^-7 and 1+2^-6... rounds to even mantissa.
        assert_eq!(
            <bf16 as Element>::from_f32(1.0 + 3.0 * 2f32.powi(-8)).to_f32(),
            1.0 + 2.0 * 2f32.powi(-7)
        );
    }
}
