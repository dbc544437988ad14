//! The short convolution (`docs/design/kda.md#short-conv`): depthwise causal conv1d of width `W`,
//! no bias, then SiLU, `y_t[c] = silu(Σ_j w[c, j] · x_{t-W+1+j}[c])`, with the inputs before a
//! request's first new token taken from its conv state.
//!
//! # Conv state
//!
//! A slot of the state `[N, L, C]` (token-major; f32 in kda's own cache, f32, bf16 or f16 in an
//! engine's, `L ≥ W - 1`) holds past inputs, oldest
//! first. Its **valid history** is the `W - 1` rows starting at row `a - 1`, where `a` is the
//! number of tokens accepted from the last step that wrote it (`a = 1` after a prefill or a plain
//! decode). Every op writes the rows a later step may need and leaves the rest alone:
//!
//! - prefill ([`CausalConv`]) writes the last `W - 1` inputs of the request (history included,
//!   so a request shorter than `W - 1` keeps part of its old history) into rows `0..W-1`;
//! - update ([`CausalConvUpdate`], `n` tokens) reads the history at row `a - 1`, and writes
//!   `(history ++ x)[1..]`, `W - 2 + n` rows, into rows `0..W-2+n`. So if the next step accepts
//!   `a'` of these `n` tokens, rows `a'-1 .. a'-1+W-1` are exactly the inputs before its first
//!   token: speculative tokens that were rejected leave no trace. With `n = 1` and `a = 1` this
//!   is the plain decode shift.
//!
//! A speculative deployment therefore sizes `L = W - 1 + num_spec`.

use crate::error::Result;
use crate::resource::Resources;
use crate::tensor::Tensor;

use super::check;

/// Sizes of a validated [`CausalConv`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ConvDims {
    /// Tokens in the flat batch (`T`).
    pub tokens: usize,
    /// Channels (`C`).
    pub channels: usize,
    /// Conv width (`W ≥ 1`).
    pub width: usize,
    /// Requests (`B`).
    pub batch: usize,
    /// State slots (`N`).
    pub slots: usize,
    /// Rows per state slot (`L ≥ W - 1`).
    pub state_len: usize,
}

/// Depthwise causal conv1d + SiLU over a flat batch of prefill requests of any lengths.
///
/// Request `b` owns rows `query_start_loc[b] .. query_start_loc[b+1]` of `x` and `y`, and state
/// slot `state_slots[b]`; a negative slot marks a padding request, whose rows are zeroed and
/// whose state is untouched. Rows of `y` that belong to no request are left as they are.
/// Offsets and slots are device data, checked when the op runs (an execution error names the
/// request).
#[derive(Clone, Debug)]
pub struct CausalConv<B: Resources> {
    /// Inputs `[T, C]`: the requests' tokens back to back (bf16, f16 or f32).
    pub x: Tensor<B>,
    /// Weights `[C, W]` (any float; fp32 in checkpoints).
    pub weight: Tensor<B>,
    /// `[B + 1]` i32: non-decreasing token offsets, the last at most `T`.
    pub query_start_loc: Tensor<B>,
    /// `[B]` i32: each request's state slot (negative: padding).
    pub state_slots: Tensor<B>,
    /// `[B]` i32: nonzero continues from the slot's history, zero starts fresh (zero history).
    pub has_initial_state: Tensor<B>,
    /// Conv state `[N, L, C]` (f32, bf16 or f16; any strides: an engine's cache in place), read
    /// and written in place (see the module docs).
    pub state: Tensor<B>,
    /// Outputs `[T, C]` (bf16, f16 or f32).
    pub y: Tensor<B>,
}

impl<B: Resources> CausalConv<B> {
    pub const NAME: &'static str = "causal_conv";

    pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![
            ("x", &self.x),
            ("weight", &self.weight),
            ("query_start_loc", &self.query_start_loc),
            ("state_slots", &self.state_slots),
            ("has_initial_state", &self.has_initial_state),
        ]
    }

    /// The state is read and written; as an output its write covers the read for hazard
    /// analysis.
    pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("state", &self.state), ("y", &self.y)]
    }

    /// Check shapes and dtypes and return the sizes.
    pub fn validate(&self) -> Result<ConvDims> {
        const OP: &str = "causal_conv";
        check::float(OP, "x", &self.x)?;
        let [tokens, channels] = check::dims(OP, "x", &self.x, "[T, C]")?;
        let width = check_weight(OP, &self.weight, channels)?;
        check::float(OP, "y", &self.y)?;
        check::shape(OP, "y", &self.y, &[tokens, channels], "T, C of x")?;
        let [starts] = check::dims(OP, "query_start_loc", &self.query_start_loc, "[B + 1]")?;
        let batch = starts.checked_sub(1).ok_or_else(|| crate::Error::Shape {
            op: OP,
            param: "query_start_loc",
            expected: "[B + 1] with B + 1 >= 1".into(),
            actual: self.query_start_loc.shape().to_vec(),
        })?;
        check::meta(OP, "query_start_loc", &self.query_start_loc, &[batch + 1], "B + 1")?;
        check::meta(OP, "state_slots", &self.state_slots, &[batch], "B of query_start_loc")?;
        let why = "B of query_start_loc";
        check::meta(OP, "has_initial_state", &self.has_initial_state, &[batch], why)?;
        let (slots, state_len) = check_state(OP, &self.state, channels, width - 1, width)?;
        Ok(ConvDims { tokens, channels, width, batch, slots, state_len })
    }
}

/// Sizes of a validated [`CausalConvUpdate`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ConvUpdateDims {
    /// Requests (`B`).
    pub batch: usize,
    /// New tokens per request (`n`: 1 for decode, `1 + num_spec` for speculative decode).
    pub tokens: usize,
    /// Channels (`C`).
    pub channels: usize,
    /// Conv width (`W ≥ 1`).
    pub width: usize,
    /// State slots (`N`).
    pub slots: usize,
    /// Rows per state slot (`L`).
    pub state_len: usize,
}

/// Causal conv1d + SiLU for decode (one token per request) and speculative decode (`n` tokens
/// per request, `num_accepted_tokens` saying how many of the previous step's tokens were kept).
///
/// Request `b` reads its history from rows `a-1 .. a-1+W-1` of slot `state_slots[b]`, with
/// `a = num_accepted_tokens[b]` (1 when absent), and writes rows `0 .. W-2+n` (see the module
/// docs). A negative slot marks a padding request: its outputs are zeroed and no state is
/// touched. Slots and counts are checked when the op runs.
#[derive(Clone, Debug)]
pub struct CausalConvUpdate<B: Resources> {
    /// Inputs `[B, n, C]` (bf16, f16 or f32).
    pub x: Tensor<B>,
    /// Weights `[C, W]` (any float).
    pub weight: Tensor<B>,
    /// `[B]` i32: each request's state slot (negative: padding).
    pub state_slots: Tensor<B>,
    /// `[B]` i32, each in `1 ..= L - W + 2`; `None` means 1 for every request.
    pub num_accepted_tokens: Option<Tensor<B>>,
    /// Conv state `[N, L, C]` (f32, bf16 or f16, any strides) with `L >= W - 2 + n`, read and
    /// written in place.
    pub state: Tensor<B>,
    /// Outputs `[B, n, C]` (bf16, f16 or f32).
    pub y: Tensor<B>,
}

impl<B: Resources> CausalConvUpdate<B> {
    pub const NAME: &'static str = "causal_conv_update";

    pub fn inputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        let mut v =
            vec![("x", &self.x), ("weight", &self.weight), ("state_slots", &self.state_slots)];
        if let Some(a) = &self.num_accepted_tokens {
            v.push(("num_accepted_tokens", a));
        }
        v
    }

    /// The state is read and written (see [`CausalConv::outputs`]).
    pub fn outputs(&self) -> Vec<(&'static str, &Tensor<B>)> {
        vec![("state", &self.state), ("y", &self.y)]
    }

    /// Check shapes and dtypes and return the sizes.
    pub fn validate(&self) -> Result<ConvUpdateDims> {
        const OP: &str = "causal_conv_update";
        check::float(OP, "x", &self.x)?;
        let [batch, tokens, channels] = check::dims(OP, "x", &self.x, "[B, n, C]")?;
        let width = check_weight(OP, &self.weight, channels)?;
        check::float(OP, "y", &self.y)?;
        check::shape(OP, "y", &self.y, &[batch, tokens, channels], "B, n, C of x")?;
        check::meta(OP, "state_slots", &self.state_slots, &[batch], "B of x")?;
        if let Some(a) = &self.num_accepted_tokens {
            check::meta(OP, "num_accepted_tokens", a, &[batch], "B of x")?;
        }
        let min_len = (width - 1).max((width + tokens).saturating_sub(2));
        let (slots, state_len) = check_state(OP, &self.state, channels, min_len, width)?;
        Ok(ConvUpdateDims { batch, tokens, channels, width, slots, state_len })
    }
}

/// What a backend whose conv kernels take f32 states only says of a bf16 or f16 conv state (an
/// engine's cache wrapped in place); such a cache runs on the reference backend. Strides are
/// every backend's: the kernels take any view.
pub fn require_f32_conv_state<B: Resources>(
    backend: &'static str,
    state: &Tensor<B>,
) -> Result<()> {
    if state.dtype() == crate::DType::F32 {
        return Ok(());
    }
    Err(crate::Error::Unsupported {
        backend,
        feature: "a bf16 or f16 conv state (an engine's cache wrapped in place)".into(),
    })
}

/// The weight `[C, W]` with `W >= 1`; returns `W`.
fn check_weight<B: Resources>(
    op: &'static str,
    weight: &Tensor<B>,
    channels: usize,
) -> Result<usize> {
    check::float(op, "weight", weight)?;
    let [c, width] = check::dims(op, "weight", weight, "[C, W]")?;
    if c != channels || width == 0 {
        return Err(crate::Error::Shape {
            op,
            param: "weight",
            expected: format!("[{channels}, W] with W >= 1 (C of x)"),
            actual: weight.shape().to_vec(),
        });
    }
    Ok(width)
}

/// The state `[N, L, C]` (f32, bf16 or f16, any strides) with `L >= min_len`; returns `(N, L)`.
fn check_state<B: Resources>(
    op: &'static str,
    state: &Tensor<B>,
    channels: usize,
    min_len: usize,
    width: usize,
) -> Result<(usize, usize)> {
    check::float(op, "state", state)?;
    let [slots, len, c] = check::dims(op, "state", state, "[N, L, C]")?;
    if c != channels || len < min_len {
        return Err(crate::Error::Shape {
            op,
            param: "state",
            expected: format!("[N, L, {channels}] with L >= {min_len} (C of x, W = {width})"),
            actual: state.shape().to_vec(),
        });
    }
    Ok((slots, len))
}
