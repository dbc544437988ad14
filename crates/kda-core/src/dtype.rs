//! Element types the HAL moves and computes with.

use std::fmt;

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

/// The dtype of a device tensor's elements.
///
/// `E4M3` is the OCP `float8_e4m3fn` element of MXFP8 and `E8M0` its shared block scale; on the
/// host both are carried as raw bytes ([`F8E4M3`], [`E8M0`]) because the codec, not the storage,
/// gives them meaning.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    BF16,
    F16,
    F32,
    I32,
    U8,
    E4M3,
    E8M0,
}

impl DType {
    /// Every dtype, for exhaustive tests and CLI listings.
    pub const ALL: [DType; 7] =
        [DType::BF16, DType::F16, DType::F32, DType::I32, DType::U8, DType::E4M3, DType::E8M0];

    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 | DType::E4M3 | DType::E8M0 => 1,
        }
    }

    /// The lower-case name used in messages, the CLI and safetensors-style listings.
    pub const fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::U8 => "u8",
            DType::E4M3 => "e4m3",
            DType::E8M0 => "e8m0",
        }
    }

    /// The IEEE-style floats that kernels read and write as numbers (bf16, f16, f32).
    pub const fn is_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One raw `float8_e4m3fn` byte.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

/// One raw E8M0 scale byte (`2^(b - 127)`, `0xFF` is NaN).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
#[repr(transparent)]
pub struct E8M0(pub u8);

/// A host type whose bytes are exactly one element of a [`DType`].
pub trait Element: Pod + Send + Sync + fmt::Debug {
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DType = DType::$d; })*
    };
}

element!(bf16 => BF16, f16 => F16, f32 => F32, i32 => I32, u8 => U8, F8E4M3 => E4M3, E8M0 => E8M0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_host_types() {
        assert_eq!(DType::BF16.size_bytes(), std::mem::size_of::<bf16>());
        assert_eq!(DType::F16.size_bytes(), std::mem::size_of::<f16>());
        assert_eq!(DType::F32.size_bytes(), std::mem::size_of::<f32>());
        assert_eq!(DType::I32.size_bytes(), std::mem::size_of::<i32>());
        assert_eq!(DType::E4M3.size_bytes(), std::mem::size_of::<F8E4M3>());
        assert_eq!(DType::E8M0.size_bytes(), std::mem::size_of::<E8M0>());
        assert_eq!(DType::ALL.iter().filter(|d| d.is_float()).count(), 3);
    }
}
