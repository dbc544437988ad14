//! The beta contract at the dispatch boundary (`docs/design/schedule.md#the-beta-contract`;
//! `docs/design/kda.md#behaviour-4`, `docs/design/kda.md#behaviour-8`).
//!
//! The mixed path's beta leaves the projection already through the fp32 sigmoid
//! ("preprocessed"), so dispatch only slices it to the live tokens; the ordinary path hands
//! dispatch raw beta, and dispatch applies the fp32 sigmoid itself. Applying it twice, or never,
//! is the classic bug, so the flag travels with the tensor ([`Projected::beta_preprocessed`]).
//!
//! [`Projected::beta_preprocessed`]: crate::schedule::Projected::beta_preprocessed

use kda_core::device::Device;
use kda_core::dtype::DType;
use kda_core::error::{Error, Result};
use kda_core::hal::Backend;
use kda_core::op::Op;
use kda_core::tensor::Tensor;

/// The label of the sigmoid dispatch applies to raw beta.
pub const BETA_SIGMOID: &str = "beta_sigmoid";

/// Beta for the first `n_live` tokens, fp32 after the sigmoid. `beta` is `[.., T, lh]` (tokens
/// along the second-to-last dimension, `[1, T, lh]` or `[T, lh]`).
///
/// - `preprocessed`: `beta` must be f32 and is only sliced (a view; nothing is launched).
/// - raw: the live slice goes through [`Op::Sigmoid`] on `stream` into a new f32 tensor.
pub fn prepare_beta<B: Backend>(
    device: &Device<B>,
    stream: &B::Stream,
    beta: &Tensor<B>,
    n_live: usize,
    preprocessed: bool,
) -> Result<Tensor<B>> {
    const OP: &str = "prepare_beta";
    let rank = beta.shape().len();
    if rank < 2 {
        return Err(Error::Shape {
            op: OP,
            param: "beta",
            expected: "[.., T, lh]".into(),
            actual: beta.shape().to_vec(),
        });
    }
    let live = beta.narrow(rank - 2, 0, n_live)?;
    if preprocessed {
        if beta.dtype() != DType::F32 {
            return Err(Error::DType {
                op: OP,
                param: "beta",
                expected: "f32 (preprocessed beta is the fp32 sigmoid)".into(),
                actual: beta.dtype(),
            });
        }
        return Ok(live);
    }
    let y = device.alloc(DType::F32, live.shape())?;
    device.launch_labeled(stream, BETA_SIGMOID, Op::Sigmoid { x: live, y: y.clone() })?;
    Ok(y)
}
