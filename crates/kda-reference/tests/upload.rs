//! One rank's loaded checkpoint weights, uploaded into the projection schedule's device weights,
//! arrive byte for byte; weights that cannot be uploaded are a clear error.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test setup")]

use half::bf16;
use kda_core::{E8M0, Error, F8E4M3};
use kda_model::config::{KdaConfig, Tp};
use kda_model::schedule::{BfgWeight, ProjectionWeights, QkvWeight};
use kda_model::weights::{BfgMode, LoadOptions, QkvWeights, load_layer};
use kda_reference::ReferenceBackend;
use kda_testkit::checkpoint::{SyntheticCheckpoint, SyntheticSpec, scaled_config};

#[test]
fn loaded_weights_upload_byte_for_byte() {
    let config = scaled_config(&KdaConfig::kimi_k3(), 96, 8, 4);
    let checkpoint = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), 5));
    let tp = Tp::new(2, 1).unwrap();
    let layer = load_layer(&checkpoint, &config, tp, 0, LoadOptions::default()).unwrap().weights;
    let b = ReferenceBackend::new();
    let s = b.new_stream().unwrap();
    let w = ProjectionWeights::upload(&b, &s, &layer).unwrap();
    assert_eq!((w.dims().hidden, w.dims().heads, w.dims().head_dim), (96, 4, 4));

    let BfgWeight::Composed { w: bfg } = w.bfg() else { panic!("a composed BFG") };
    let host = layer.bfg.weight().unwrap().as_bf16().unwrap();
    assert_eq!(b.download::<bf16>(&s, bfg).unwrap(), host);

    let (
        QkvWeight::Mxfp8 { data, scale, alg },
        Some(QkvWeights::Mxfp8 { data: hd, scale: hs, scale_alg }),
    ) = (w.qkv(), layer.qkv.weights())
    else {
        panic!("K3 QKV is MXFP8")
    };
    assert_eq!(*alg, scale_alg);
    let data: Vec<u8> = b.download::<F8E4M3>(&s, data).unwrap().iter().map(|v| v.0).collect();
    let scale: Vec<u8> = b.download::<E8M0>(&s, scale).unwrap().iter().map(|v| v.0).collect();
    assert_eq!((data.as_slice(), scale.as_slice()), (hd.as_u8().unwrap(), hs.as_u8().unwrap()));
}

#[test]
fn a_staged_bfg_is_not_uploaded_as_one_weight() {
    let config = scaled_config(&KdaConfig::kimi_k3(), 96, 8, 4);
    let checkpoint = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), 5));
    let options = LoadOptions { bfg_mode: BfgMode::Staged, ..LoadOptions::default() };
    let layer = load_layer(&checkpoint, &config, Tp::SINGLE, 0, options).unwrap().weights;
    let b = ReferenceBackend::new();
    let s = b.new_stream().unwrap();
    match ProjectionWeights::upload(&b, &s, &layer) {
        Err(Error::Param { param: "bfg", actual, .. }) => {
            assert!(actual.contains("Staged"), "{actual}")
        }
        other => panic!("expected a bfg parameter error, got {other:?}"),
    }
}
