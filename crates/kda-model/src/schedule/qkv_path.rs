//! Which precision the QKV projection of an MXFP8 checkpoint runs in, from the backend's
//! capabilities and the caller's request (`docs/design/kda.md#qkv-precision`).

use crate::config::QkvFormat;
use kda_core::error::{Error, Result};
use kda_core::resource::NativeOps;

/// The precision the QKV projection of an MXFP8 checkpoint runs in
/// (`docs/design/kda.md#qkv-precision`); `LayerOptions::qkv`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum QkvPath {
    /// The checkpoint's MXFP8 weight as it is: DynamicQuant of the activation, then the MX GEMM.
    /// Needs the backend's `mx_quant` and `mx_gemm` ([`NativeOps`]).
    Mxfp8,
    /// The MXFP8 weight dequantized once at load time into an exact bf16 copy, and a plain bf16
    /// GEMM of the activation: no quantization op. A dense checkpoint's weight stays as loaded.
    Bf16,
}

impl QkvPath {
    /// The path a layer takes: `requested`, or with `None` MXFP8 where the backend runs the MX
    /// ops natively (`native`) and bf16 elsewhere. A dense checkpoint (`format`) always runs
    /// dense. Asking for [`QkvPath::Mxfp8`] where it cannot run is an [`Error::Param`] on
    /// `LayerOptions::qkv` naming the missing capability, raised when the layer is built.
    pub fn resolve(
        requested: Option<QkvPath>,
        format: QkvFormat,
        native: NativeOps,
        backend: &str,
    ) -> Result<QkvPath> {
        let refuse = |expected: &str, actual: String| Error::Param {
            op: "kda_layer",
            param: "LayerOptions::qkv",
            expected: expected.into(),
            actual,
        };
        match (requested, format) {
            (Some(QkvPath::Mxfp8), QkvFormat::Dense) => Err(refuse(
                "QkvPath::Bf16 or None for a checkpoint whose QKV is dense",
                "QkvPath::Mxfp8 with a dense QKV checkpoint".into(),
            )),
            (_, QkvFormat::Dense) => Ok(QkvPath::Bf16),
            (Some(QkvPath::Mxfp8), QkvFormat::Mxfp8 { .. }) if !native.mxfp8() => Err(refuse(
                "QkvPath::Bf16 or None: QkvPath::Mxfp8 needs capabilities.native mx_quant and \
                 mx_gemm",
                format!(
                    "QkvPath::Mxfp8 on the {backend} backend, whose capabilities.native has {}",
                    native.describe()
                ),
            )),
            (Some(path), QkvFormat::Mxfp8 { .. }) => Ok(path),
            (None, QkvFormat::Mxfp8 { .. }) => {
                Ok(if native.mxfp8() { QkvPath::Mxfp8 } else { QkvPath::Bf16 })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kda_core::mx::ScaleAlg;

    const MX: QkvFormat = QkvFormat::Mxfp8 { scale_alg: ScaleAlg::OcpFloor };
    const NONE: NativeOps = NativeOps { mx_quant: false, mx_gemm: false };

    #[test]
    fn the_capabilities_choose_and_an_impossible_request_names_what_is_missing() {
        let resolve = |req, format, native| QkvPath::resolve(req, format, native, "test");
        assert_eq!(resolve(None, MX, NativeOps::ALL).unwrap(), QkvPath::Mxfp8);
        assert_eq!(resolve(None, MX, NONE).unwrap(), QkvPath::Bf16);
        // One family alone cannot run the MXFP8 projection.
        let quant_only = NativeOps { mx_quant: true, mx_gemm: false };
        assert_eq!(resolve(None, MX, quant_only).unwrap(), QkvPath::Bf16);
        assert_eq!(resolve(Some(QkvPath::Bf16), MX, NativeOps::ALL).unwrap(), QkvPath::Bf16);
        assert_eq!(resolve(None, QkvFormat::Dense, NativeOps::ALL).unwrap(), QkvPath::Bf16);
        match resolve(Some(QkvPath::Mxfp8), MX, quant_only) {
            Err(Error::Param { op, param, expected, actual }) => {
                assert_eq!((op, param), ("kda_layer", "LayerOptions::qkv"));
                assert!(expected.contains("mx_quant and mx_gemm"), "{expected}");
                assert_eq!(
                    actual,
                    "QkvPath::Mxfp8 on the test backend, whose capabilities.native has mx_quant"
                );
            }
            other => panic!("expected the refusal, got {other:?}"),
        }
        match resolve(Some(QkvPath::Mxfp8), QkvFormat::Dense, NativeOps::ALL) {
            Err(Error::Param { param, actual, .. }) => {
                assert_eq!(param, "LayerOptions::qkv");
                assert!(actual.contains("dense QKV checkpoint"), "{actual}");
            }
            other => panic!("expected the refusal, got {other:?}"),
        }
    }
}
