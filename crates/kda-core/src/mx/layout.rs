//! Where the E8M0 scales of a quantized `[rows, K]` matrix sit.
//!
//! - [`ScaleLayout::Plain`]: `[rows, ceil(K/32)]`, row-major.
//! - Ascend pairs the scales: their count along K is padded to even with zero bytes and stored in
//!   pairs. Activations ([`ScaleLayout::AscendActivation`]): `[rows, ceil(K/64), 2]`. Weights
//!   ([`ScaleLayout::AscendWeight`]), which Ascend stores transposed as `[K, N]` with
//!   `rows = N`: `[ceil(K/64), N, 2]`, i.e. scale pair `g` of every output channel together.
//!
//! The element bytes of a weight are transposed with [`transpose_bytes`].

use std::fmt;

use super::{MxError, elements, expect_len, num_blocks};

/// A scale layout (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ScaleLayout {
    Plain,
    AscendActivation,
    AscendWeight,
}

impl ScaleLayout {
    /// The shape of the scale tensor of a quantized `[rows, k]` matrix.
    pub fn scale_shape(self, rows: usize, k: usize) -> Vec<usize> {
        let pairs = k.div_ceil(64);
        match self {
            ScaleLayout::Plain => vec![rows, num_blocks(k)],
            ScaleLayout::AscendActivation => vec![rows, pairs, 2],
            ScaleLayout::AscendWeight => vec![pairs, rows, 2],
        }
    }

    /// Where plain scale `[row, block]` sits in this layout (a flat index).
    fn index(self, rows: usize, k: usize, row: usize, block: usize) -> usize {
        match self {
            ScaleLayout::Plain => row * num_blocks(k) + block,
            ScaleLayout::AscendActivation => row * 2 * k.div_ceil(64) + block,
            ScaleLayout::AscendWeight => ((block / 2) * rows + row) * 2 + block % 2,
        }
    }

    fn len(self, rows: usize, k: usize) -> Result<usize, MxError> {
        let shape = self.scale_shape(rows, k);
        shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or(MxError::Overflow {
            what: "scale layout",
            rows,
            k,
        })
    }

    /// Re-lay plain scales (`[rows, ceil(k/32)]`) in this layout; pad bytes are 0.
    pub fn from_plain(self, plain: &[u8], rows: usize, k: usize) -> Result<Vec<u8>, MxError> {
        expect_len(
            "ScaleLayout::from_plain",
            "plain",
            plain.len(),
            ScaleLayout::Plain.len(rows, k)?,
        )?;
        let mut out = vec![0u8; self.len(rows, k)?];
        let blocks = num_blocks(k);
        for row in 0..rows {
            for block in 0..blocks {
                out[self.index(rows, k, row, block)] = plain[row * blocks + block];
            }
        }
        Ok(out)
    }

    /// Read scales in this layout back into the plain layout (pad bytes are dropped).
    pub fn to_plain(self, scales: &[u8], rows: usize, k: usize) -> Result<Vec<u8>, MxError> {
        expect_len("ScaleLayout::to_plain", "scales", scales.len(), self.len(rows, k)?)?;
        let blocks = num_blocks(k);
        let mut out = vec![0u8; elements("ScaleLayout::to_plain", rows, blocks)?];
        for row in 0..rows {
            for block in 0..blocks {
                out[row * blocks + block] = scales[self.index(rows, k, row, block)];
            }
        }
        Ok(out)
    }
}

impl fmt::Display for ScaleLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScaleLayout::Plain => "plain",
            ScaleLayout::AscendActivation => "ascend activation",
            ScaleLayout::AscendWeight => "ascend weight",
        })
    }
}

/// Transpose a row-major `[rows, cols]` byte matrix to `[cols, rows]` (a weight's E4M3 bytes
/// from the Linear `[N, K]` to Ascend's `[K, N]`, and back with the sizes swapped).
pub fn transpose_bytes(data: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>, MxError> {
    expect_len("transpose_bytes", "data", data.len(), elements("transpose_bytes", rows, cols)?)?;
    let mut out = vec![0u8; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [ScaleLayout; 3] =
        [ScaleLayout::Plain, ScaleLayout::AscendActivation, ScaleLayout::AscendWeight];

    #[test]
    fn shapes() {
        // K = 7168: 224 blocks, 112 pairs; K = 100: 4 blocks, 2 pairs; K = 33: 2 blocks, 1 pair.
        assert_eq!(ScaleLayout::Plain.scale_shape(256, 7168), vec![256, 224]);
        assert_eq!(ScaleLayout::AscendActivation.scale_shape(256, 7168), vec![256, 112, 2]);
        assert_eq!(ScaleLayout::AscendWeight.scale_shape(4608, 7168), vec![112, 4608, 2]);
        assert_eq!(ScaleLayout::AscendActivation.scale_shape(3, 100), vec![3, 2, 2]);
        assert_eq!(ScaleLayout::AscendWeight.scale_shape(3, 33), vec![1, 3, 2]);
        assert_eq!(ScaleLayout::AscendWeight.scale_shape(3, 0), vec![0, 3, 2]);
    }

    #[test]
    fn ascend_layouts_by_hand() {
        // rows = 2, K = 80: 3 blocks per row, padded to 4 (2 pairs).
        let plain = [1, 2, 3, 11, 12, 13];
        let act = ScaleLayout::AscendActivation.from_plain(&plain, 2, 80).unwrap();
        assert_eq!(act, vec![1, 2, 3, 0, 11, 12, 13, 0]);
        let weight = ScaleLayout::AscendWeight.from_plain(&plain, 2, 80).unwrap();
        // [pair, row, 2]: pair 0 = blocks 0-1 of rows 0 and 1, pair 1 = block 2 and padding.
        assert_eq!(weight, vec![1, 2, 11, 12, 3, 0, 13, 0]);
    }

    #[test]
    fn conversions_round_trip() {
        for (rows, k) in [(1, 1), (3, 32), (2, 64), (5, 100), (4, 7168), (0, 64), (3, 0)] {
            let blocks = num_blocks(k);
            let plain: Vec<u8> = (0..rows * blocks).map(|i| (i * 7 % 251) as u8 + 1).collect();
            for layout in ALL {
                let laid = layout.from_plain(&plain, rows, k).unwrap();
                assert_eq!(laid.len(), layout.scale_shape(rows, k).iter().product::<usize>());
                assert_eq!(layout.to_plain(&laid, rows, k).unwrap(), plain, "{layout} {rows}x{k}");
                // Pads are exactly the zero bytes (the plain values are all non-zero).
                let pads = laid.iter().filter(|&&b| b == 0).count();
                assert_eq!(pads, laid.len() - plain.len(), "{layout} {rows}x{k}");
            }
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let err = ScaleLayout::AscendWeight.from_plain(&[0; 5], 2, 80).unwrap_err();
        assert!(matches!(err, MxError::Length { param: "plain", expected: 6, actual: 5, .. }));
        assert!(ScaleLayout::AscendActivation.to_plain(&[0; 6], 2, 80).is_err());
        assert!(transpose_bytes(&[0; 5], 2, 3).is_err());
    }

    #[test]
    fn transpose_round_trips() {
        let data: Vec<u8> = (0..12).collect();
        let t = transpose_bytes(&data, 3, 4).unwrap();
        assert_eq!(t[..3], [0, 4, 8]);
        assert_eq!(transpose_bytes(&t, 4, 3).unwrap(), data);
    }
}
