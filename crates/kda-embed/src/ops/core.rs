//! The KDA recurrence alone, in flash-linear-attention's tensor conventions
//! (`naive_recurrent_kda` / `naive_chunk_kda`): the one implementation behind `kda.core`
//! (Python) and the CLI's `kda core`.
//!
//! `q`, `k`, `g` `[B, T, H, K]` (`g` the log decay, already activated), `v` `[B, T, H, V]`,
//! `beta` `[B, T, H]` (already through the sigmoid) and optionally `initial_state`
//! `[B, H, K, V]`, each f32 or bf16; out come `o` `[B, T, H, V]` and `final_state`
//! `[B, H, K, V]`, f32. The state is K-first here, as in flash-linear-attention; the ops take the
//! cache's v-first `[N, H, V, K]`, and get the K-first buffer as a transposed view of it, read
//! and written in place. The batch runs as `B` requests of `T` tokens: chunked (`KdaChunk`, one
//! flat batch) or token by token (`KdaRecurrent`, every request starting from and ending in its
//! own state slot).

use half::bf16;
use kda_core::kda::{KdaChunk, KdaRecurrent, MAX_HEAD_DIM};
use kda_core::{Backend, DType, Device, Element, Layout, Op, Tensor};
use kda_reference::{ExecutionMode, ReferenceBackend, ReferenceOptions};
use thiserror::Error;

use crate::array::{ForeignArray, Import};
use crate::error::{EmbedError, Result};

/// Which form of the recurrence runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CoreAlgo {
    /// Chunks of 64 (the prefill form).
    Chunk,
    /// Token by token (the decode form).
    Recurrent,
}

impl CoreAlgo {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "chunk" => Ok(CoreAlgo::Chunk),
            "recurrent" => Ok(CoreAlgo::Recurrent),
            other => Err(EmbedError::Argument {
                param: "algo",
                expected: "\"chunk\" or \"recurrent\"",
                actual: other.to_string(),
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CoreAlgo::Chunk => "chunk",
            CoreAlgo::Recurrent => "recurrent",
        }
    }
}

/// How the recurrence runs.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct CoreOptions {
    pub algo: CoreAlgo,
    /// Multiplies q (after the L2 norm, if any); `None`: `K^-0.5`.
    pub scale: Option<f32>,
    /// L2-normalise q and k first (eps 1e-6 inside the square root).
    pub l2norm: bool,
}

/// One host input: the dtype it came in (kept, so the op sees it as given), its shape, and its
/// values as f32 (exact for bf16), row-major.
#[derive(Copy, Clone, Debug)]
pub struct HostTensor<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub values: &'a [f32],
}

/// The inputs of [`core_on`].
#[derive(Copy, Clone, Debug)]
pub struct CoreInputs<'a> {
    pub q: HostTensor<'a>,
    pub k: HostTensor<'a>,
    pub v: HostTensor<'a>,
    pub g: HostTensor<'a>,
    pub beta: HostTensor<'a>,
    pub initial_state: Option<HostTensor<'a>>,
}

/// Sizes of a problem.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CoreDims {
    pub batch: usize,
    pub tokens: usize,
    pub heads: usize,
    pub k: usize,
    pub v: usize,
}

/// What [`core_on`] can fail with: an input that does not fit the conventions (named, with its
/// dtype and shape), a scale that is not finite, or the device.
#[derive(Debug, Error)]
pub enum CoreError {
    #[error("tensor {param:?} ({dtype}, shape {shape:?}): {reason}")]
    Input { param: &'static str, dtype: DType, shape: Vec<usize>, reason: String },
    #[error("scale: {0}, expected a finite number")]
    Scale(f32),
    #[error(transparent)]
    Device(#[from] kda_core::Error),
}

impl From<CoreError> for EmbedError {
    fn from(e: CoreError) -> Self {
        match e {
            CoreError::Input { param, dtype, shape, reason } => {
                EmbedError::Array { param, message: format!("{dtype}, shape {shape:?}: {reason}") }
            }
            CoreError::Scale(s) => EmbedError::Argument {
                param: "scale",
                expected: "a finite number",
                actual: s.to_string(),
            },
            CoreError::Device(e) => e.into(),
        }
    }
}

/// `o` `[B, T, H, V]` and `final_state` `[B, H, K, V]`, f32, and the scale that was applied.
#[derive(Clone, Debug, PartialEq)]
pub struct CoreOutput {
    pub o: Vec<f32>,
    pub o_shape: [usize; 4],
    pub final_state: Vec<f32>,
    pub state_shape: [usize; 4],
    pub scale: f32,
}

fn input_error(param: &'static str, t: &HostTensor<'_>, reason: String) -> CoreError {
    CoreError::Input { param, dtype: t.dtype, shape: t.shape.to_vec(), reason }
}

impl CoreInputs<'_> {
    fn named(&self) -> [(&'static str, &HostTensor<'_>); 5] {
        [("q", &self.q), ("k", &self.k), ("v", &self.v), ("g", &self.g), ("beta", &self.beta)]
    }

    /// Check the dtypes and shapes against each other before anything is sized by them: every
    /// dimension at least 1 (so what `B` sizes, the slots and the state, is backed by data),
    /// head dims at most [`MAX_HEAD_DIM`] (`K·V` sizes a state the inputs need not hold), and
    /// `B·T` within the i32 offsets the ops take.
    pub fn dims(&self) -> Result<CoreDims, CoreError> {
        let float = [DType::F32, DType::BF16];
        let named = self.named();
        let state = self.initial_state.as_ref().map(|s| ("initial_state", s));
        for (name, t) in named.into_iter().chain(state) {
            if !float.contains(&t.dtype) {
                return Err(input_error(name, t, "expected f32 or bf16".into()));
            }
        }
        let q = &self.q;
        let q_shape = q.shape;
        let [batch, tokens, heads, k] = <[usize; 4]>::try_from(q_shape)
            .map_err(|_| input_error("q", q, "expected [B, T, H, K]".into()))?;
        for (dim, size) in [("B", batch), ("T", tokens), ("H", heads), ("K", k)] {
            if size == 0 {
                return Err(input_error("q", q, format!("{dim} must be at least 1")));
            }
        }
        let head_dim = |name, t, dim: &str, size: usize| {
            if size <= MAX_HEAD_DIM {
                return Ok(());
            }
            let why = format!(
                "{dim} = {size}, expected at most {MAX_HEAD_DIM} (kda's bound on a head dim)"
            );
            Err(input_error(name, t, why))
        };
        head_dim("q", q, "K", k)?;
        let expect = |name, t: &HostTensor<'_>, want: &[usize], what: &str| {
            if t.shape == want {
                return Ok(());
            }
            let why = format!("expected {what} = {want:?} (from q {q_shape:?})");
            Err(input_error(name, t, why))
        };
        expect("k", &self.k, q_shape, "[B, T, H, K]")?;
        expect("g", &self.g, q_shape, "[B, T, H, K]")?;
        let vdim = match self.v.shape {
            &[b, t, h, vd] if [b, t, h] == [batch, tokens, heads] && vd > 0 => vd,
            _ => {
                let want = format!(
                    "expected [B, T, H, V] with [B, T, H] = {:?} (from q {q_shape:?}) and V at \
                     least 1",
                    [batch, tokens, heads]
                );
                return Err(input_error("v", &self.v, want));
            }
        };
        head_dim("v", &self.v, "V", vdim)?;
        expect("beta", &self.beta, &[batch, tokens, heads], "[B, T, H]")?;
        if let Some(s) = &self.initial_state {
            let want = [batch, heads, k, vdim];
            if s.shape != want {
                let why = format!(
                    "expected [B, H, K, V] = {want:?} (K-first, from q {q_shape:?} and v {:?})",
                    self.v.shape
                );
                return Err(input_error("initial_state", s, why));
            }
        }
        // The chunked form's offsets run up to B·T.
        if batch.checked_mul(tokens).is_none_or(|n| i32::try_from(n).is_err()) {
            let why = format!("B·T = {batch}·{tokens} tokens, expected at most {}", i32::MAX);
            return Err(input_error("q", q, why));
        }
        Ok(CoreDims { batch, tokens, heads, k, v: vdim })
    }
}

impl CoreOptions {
    /// The scale applied to q for head dim `k`: [`CoreOptions::scale`], or `K^-0.5`.
    pub fn scale_for(&self, k: usize) -> Result<f32, CoreError> {
        match self.scale {
            Some(s) if s.is_finite() => Ok(s),
            Some(s) => Err(CoreError::Scale(s)),
            None => Ok(1.0 / (k as f32).sqrt()),
        }
    }
}

/// Run the recurrence on `dev`, on a stream of its own, and return the results on the host.
/// Every check runs before anything is allocated.
pub fn core_on<B: Backend>(
    dev: &Device<B>,
    inputs: &CoreInputs<'_>,
    options: CoreOptions,
) -> Result<CoreOutput, CoreError> {
    let dims = inputs.dims()?;
    let scale = options.scale_for(dims.k)?;
    let CoreDims { batch, tokens, heads, k, v } = dims;
    let s = dev.new_stream()?;
    let up = |t: &HostTensor<'_>| upload(dev, &s, t, t.shape);
    let state = dev.alloc(DType::F32, &[batch, heads, k, v])?;
    match &inputs.initial_state {
        Some(init) => dev.upload(&s, &state, init.values)?,
        None => dev.launch(&s, Op::Fill { dst: state.clone(), value: 0.0 })?,
    }
    let o = dev.alloc(DType::F32, &[batch, tokens, heads, v])?;
    let operands = CoreOperands {
        q: up(&inputs.q)?,
        k: up(&inputs.k)?,
        v: up(&inputs.v)?,
        g: up(&inputs.g)?,
        beta: up(&inputs.beta)?,
        state: state.clone(),
        o: o.clone(),
    };
    launch(dev, &s, dims, operands, options.algo, scale, options.l2norm)?;
    Ok(CoreOutput {
        o: dev.download::<f32>(&s, &o)?,
        o_shape: [batch, tokens, heads, v],
        final_state: dev.download::<f32>(&s, &state)?,
        state_shape: [batch, heads, k, v],
        scale,
    })
}

/// The tensors of one recurrence, in the conventions' shapes: `q`, `k`, `g` `[B, T, H, K]`,
/// `v` `[B, T, H, V]`, `beta` `[B, T, H]` (each contiguous, f32 or bf16), `o` `[B, T, H, V]`
/// (contiguous f32) and `state` `[B, H, K, V]` (f32, any non-overlapping strides), which holds
/// the initial state and is updated in place into the final one.
struct CoreOperands<B: Backend> {
    q: Tensor<B>,
    k: Tensor<B>,
    v: Tensor<B>,
    g: Tensor<B>,
    beta: Tensor<B>,
    state: Tensor<B>,
    o: Tensor<B>,
}

/// Queue the recurrence on `s`: the one op both entry points ([`core_on`], [`core`]) run.
fn launch<B: Backend>(
    dev: &Device<B>,
    s: &B::Stream,
    dims: CoreDims,
    t: CoreOperands<B>,
    algo: CoreAlgo,
    scale: f32,
    qk_l2norm: bool,
) -> Result<(), CoreError> {
    let CoreDims { batch, tokens, heads, k, v } = dims;
    // `dims` bounds B·T by i32::MAX, so these fit.
    let (batch_i32, tokens_i32) = (batch as i32, tokens as i32);
    let n = batch * tokens;
    let ints = |shape: &[usize], values: &[i32]| upload_values(dev, s, shape, values);
    // The ops take the cache's v-first `[N, H, V, K]`: the K-first state seen transposed.
    let st = t.state.layout().strides();
    let layout = Layout::strided(
        DType::F32,
        &[batch, heads, v, k],
        &[st[0], st[1], st[3], st[2]],
        t.state.layout().offset(),
    )
    .map_err(kda_core::Error::from)?;
    let state = Tensor::new(t.state.buffer().clone(), layout)?;
    let slots: Vec<i32> = (0..batch_i32).collect();
    let op = match algo {
        CoreAlgo::Chunk => {
            // The B requests back to back: one flat batch of B·T tokens.
            let cu_seqlens: Vec<i32> = (0..=batch_i32).map(|r| r * tokens_i32).collect();
            Op::KdaChunk(KdaChunk {
                chunk_state_slots: None,
                host_meta: None,
                q: t.q.reshape(&[n, heads, k])?,
                k: t.k.reshape(&[n, heads, k])?,
                v: t.v.reshape(&[n, heads, v])?,
                g: t.g.reshape(&[n, heads, k])?,
                gate: None,
                beta: t.beta.reshape(&[n, heads])?,
                cu_seqlens: ints(&[batch + 1], &cu_seqlens)?,
                state_slots: ints(&[batch], &slots)?,
                has_initial_state: ints(&[batch], &vec![1; batch])?,
                state,
                o: t.o.reshape(&[n, heads, v])?,
                scale,
                qk_l2norm,
            })
        }
        CoreAlgo::Recurrent => {
            // Request r starts from slot r (read at its last token, the one accepted) and keeps
            // only the state after its last token, in slot r.
            let mut state_slots = vec![-1i32; n];
            for (r, &slot) in slots.iter().enumerate() {
                state_slots[r * tokens + tokens - 1] = slot;
            }
            Op::KdaRecurrent(KdaRecurrent {
                q: t.q,
                k: t.k,
                v: t.v,
                g: t.g,
                beta: t.beta,
                state_slots: ints(&[batch, tokens], &state_slots)?,
                num_accepted_tokens: Some(ints(&[batch], &vec![tokens_i32; batch])?),
                state,
                o: t.o,
                scale,
                qk_l2norm,
            })
        }
    };
    dev.launch(s, op)?;
    Ok(())
}

/// The inputs of [`core()`]: an engine's host arrays (see the module's conventions), read where
/// they lie when their layout allows (f32 or bf16, row-major, aligned), copied otherwise.
#[derive(Debug)]
pub struct CoreArgs {
    pub q: ForeignArray,
    pub k: ForeignArray,
    pub v: ForeignArray,
    pub g: ForeignArray,
    pub beta: ForeignArray,
    pub initial_state: Option<ForeignArray>,
    /// `true`: `initial_state` (f32, host memory, writable, non-negative strides) is updated in
    /// place into the final state, which is then not written anywhere else.
    pub in_place: bool,
    pub options: CoreOptions,
    /// Threads the op runs on: 1 is the stream's own thread; more, a pool of that many.
    pub threads: usize,
}

impl CoreArgs {
    /// Check every argument (shapes, dtypes, scale, threads, what in place needs) before
    /// anything is allocated: the sizes of the outputs the caller then allocates, and the scale.
    pub fn check(&self) -> Result<(CoreDims, f32)> {
        if self.threads == 0 {
            return Err(EmbedError::Argument {
                param: "threads",
                expected: "a count of at least 1",
                actual: "0".into(),
            });
        }
        fn shape_of(a: &ForeignArray) -> HostTensor<'_> {
            HostTensor { dtype: a.dtype(), shape: a.shape(), values: &[] }
        }
        let inputs = CoreInputs {
            q: shape_of(&self.q),
            k: shape_of(&self.k),
            v: shape_of(&self.v),
            g: shape_of(&self.g),
            beta: shape_of(&self.beta),
            initial_state: self.initial_state.as_ref().map(shape_of),
        };
        let dims = inputs.dims()?;
        let scale = self.options.scale_for(dims.k)?;
        if self.in_place {
            let Some(state) = &self.initial_state else {
                return Err(EmbedError::Array {
                    param: "initial_state",
                    message: "none given, but the final state is to be written in place into it"
                        .into(),
                });
            };
            state.expect_dtype("initial_state", &[DType::F32])?;
        }
        Ok((dims, scale))
    }
}

/// [`core_on`]'s recurrence on the reference backend, for an engine's host arrays, written into
/// `o` (f32 `[B, T, H, V]`) and, unless [`CoreArgs::in_place`], `final_state` (f32
/// `[B, H, K, V]`): both row-major host arrays the caller allocated from [`CoreArgs::check`]'s
/// sizes, written in place. Inputs are read where they lie when their layout allows; the
/// initial state, unless updated in place, is copied into `final_state` once and the op runs
/// on that. Returns the scale applied.
pub fn core(args: CoreArgs, o: ForeignArray, final_state: Option<ForeignArray>) -> Result<f32> {
    let (dims, scale) = args.check()?;
    let worker = Worker::take(args.threads)?;
    run_core(&worker, args, dims, scale, o, final_state)?;
    // Given back only after a call that succeeded: a stream that reported an error starts over.
    worker.give_back();
    Ok(scale)
}

/// A reference device and a stream of it, kept between [`core()`] calls (a stream's worker
/// thread, and a pool's threads, cost more to start than a decode step takes to run). Each call
/// takes one of its thread count, or makes one: concurrent calls never share a stream.
struct Worker {
    threads: usize,
    dev: Device<ReferenceBackend>,
    stream: kda_reference::RefStream,
}

/// The idle [`Worker`]s, at most [`MAX_IDLE_WORKERS`].
static IDLE_WORKERS: std::sync::Mutex<Vec<Worker>> = std::sync::Mutex::new(Vec::new());
const MAX_IDLE_WORKERS: usize = 4;

impl Worker {
    fn take(threads: usize) -> Result<Self> {
        let idle = |w: &Worker| w.threads == threads;
        let mut workers = IDLE_WORKERS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = workers.iter().position(idle) {
            return Ok(workers.swap_remove(at));
        }
        drop(workers);
        let mode = match threads {
            1 => ExecutionMode::PerStream,
            threads => ExecutionMode::SharedPool { threads },
        };
        let dev = ReferenceBackend::with_options(ReferenceOptions { mode, ..Default::default() })?;
        let stream = dev.new_stream()?;
        Ok(Self { threads, dev, stream })
    }

    /// Keep this worker for a later call; not in checked mode, whose record of every call is
    /// kept per device and would grow call after call.
    fn give_back(self) {
        if self.dev.instrumentation().is_checked() {
            return;
        }
        let mut workers = IDLE_WORKERS.lock().unwrap_or_else(|e| e.into_inner());
        if workers.len() < MAX_IDLE_WORKERS {
            workers.push(self);
        }
    }
}

fn run_core(
    worker: &Worker,
    args: CoreArgs,
    dims: CoreDims,
    scale: f32,
    o: ForeignArray,
    final_state: Option<ForeignArray>,
) -> Result<()> {
    let (dev, s) = (&worker.dev, &worker.stream);
    let CoreDims { batch, tokens, heads, k, v } = dims;
    let written = |a: ForeignArray,
                   param: &'static str,
                   shape: &[usize]|
     -> Result<Tensor<ReferenceBackend>> {
        a.expect_dtype(param, &[DType::F32])?;
        if a.shape() != shape {
            let message = format!("shape {:?}, expected {shape:?}", a.shape());
            return Err(EmbedError::Array { param, message });
        }
        match a.to_tensor(dev, s, param, false)? {
            (t, Import::InPlace) => Ok(t),
            (_, Import::Copied) => Err(EmbedError::Array {
                param,
                message: "must be host memory kda writes in place (aligned to 4 bytes, \
                          non-negative strides)"
                    .into(),
            }),
        }
    };
    let o = written(o, "o", &[batch, tokens, heads, v])?;
    let state_shape = [batch, heads, k, v];
    let state = match (args.in_place, args.initial_state, final_state) {
        (true, Some(init), _) => written(init, "initial_state", &state_shape)?,
        (false, init, Some(out)) => {
            let out = written(out, "final_state", &state_shape)?;
            match init {
                Some(init) => {
                    let (init, _) = init.to_tensor(dev, s, "initial_state", false)?;
                    dev.launch(s, Op::Copy { src: init, dst: out.clone() })?;
                }
                None => dev.launch(s, Op::Fill { dst: out.clone(), value: 0.0 })?,
            }
            out
        }
        _ => {
            return Err(EmbedError::Array {
                param: "final_state",
                message: "none given, and the initial state is not updated in place".into(),
            });
        }
    };
    let input = |a: ForeignArray, param| a.to_tensor(dev, s, param, true).map(|(t, _)| t);
    let operands = CoreOperands {
        q: input(args.q, "q")?,
        k: input(args.k, "k")?,
        v: input(args.v, "v")?,
        g: input(args.g, "g")?,
        beta: input(args.beta, "beta")?,
        state,
        o,
    };
    launch(dev, s, dims, operands, args.options.algo, scale, args.options.l2norm)?;
    dev.synchronize(s)?;
    Ok(())
}

/// `t` as a tensor of its own dtype (its values are exact in it).
fn upload<B: Backend>(
    dev: &Device<B>,
    s: &B::Stream,
    t: &HostTensor<'_>,
    shape: &[usize],
) -> Result<Tensor<B>, kda_core::Error> {
    match t.dtype {
        DType::BF16 => {
            let v: Vec<bf16> = t.values.iter().map(|&x| bf16::from_f32(x)).collect();
            upload_values(dev, s, shape, &v)
        }
        _ => upload_values(dev, s, shape, t.values),
    }
}

/// A new tensor of `shape` holding `values` (its dtype is theirs), uploaded on `s`.
pub fn upload_values<B: Backend, T: Element>(
    dev: &Device<B>,
    s: &B::Stream,
    shape: &[usize],
    values: &[T],
) -> Result<Tensor<B>, kda_core::Error> {
    let dst = dev.alloc(T::DTYPE, shape)?;
    dev.upload(s, &dst, values)?;
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize]) -> HostTensor<'_> {
        HostTensor { dtype: DType::F32, shape, values: &[] }
    }

    fn reason(inputs: &CoreInputs<'_>) -> (String, String) {
        match inputs.dims() {
            Err(CoreError::Input { param, reason, .. }) => (param.to_string(), reason),
            other => panic!("expected an input error, got {other:?}"),
        }
    }

    #[test]
    fn shapes_are_checked_before_anything_is_sized_by_them() {
        let (qk, v, beta) = ([2, 3, 4, 8], [2, 3, 4, 5], [2, 3, 4]);
        let good = CoreInputs {
            q: t(&qk),
            k: t(&qk),
            v: t(&v),
            g: t(&qk),
            beta: t(&beta),
            initial_state: None,
        };
        assert_eq!(good.dims().unwrap(), CoreDims { batch: 2, tokens: 3, heads: 4, k: 8, v: 5 });

        // A zero T with a huge K: a state no data backs.
        let huge = [1, 0, 1, 1 << 32];
        let (param, why) = reason(&CoreInputs { q: t(&huge), ..good });
        assert_eq!((param.as_str(), why.as_str()), ("q", "T must be at least 1"));
        let wide = [2, 3, 4, 513];
        let (param, why) = reason(&CoreInputs { q: t(&wide), k: t(&wide), g: t(&wide), ..good });
        assert_eq!(param, "q");
        assert!(why.contains("K = 513, expected at most 512"), "{why}");
        // B·T past the i32 offsets.
        let (big_qk, big_v, big_beta) =
            ([1 << 16, 1 << 15, 1, 1], [1 << 16, 1 << 15, 1, 1], [1 << 16, 1 << 15, 1]);
        let big = CoreInputs {
            q: t(&big_qk),
            k: t(&big_qk),
            v: t(&big_v),
            g: t(&big_qk),
            beta: t(&big_beta),
            initial_state: None,
        };
        let (param, why) = reason(&big);
        assert_eq!(param, "q");
        assert!(why.contains("B·T = 65536·32768 tokens, expected at most 2147483647"), "{why}");
        // The v-first state is the classic mistake.
        let vfirst = [2, 4, 5, 8];
        let (param, why) = reason(&CoreInputs { initial_state: Some(t(&vfirst)), ..good });
        assert_eq!(param, "initial_state");
        assert!(why.contains("expected [B, H, K, V] = [2, 4, 8, 5] (K-first"), "{why}");
        let int = HostTensor { dtype: DType::I32, ..t(&beta) };
        let (param, why) = reason(&CoreInputs { beta: int, ..good });
        assert_eq!((param.as_str(), why.as_str()), ("beta", "expected f32 or bf16"));
        let bad_scale = CoreOptions { algo: CoreAlgo::Chunk, scale: Some(f32::NAN), l2norm: false };
        assert!(matches!(bad_scale.scale_for(8), Err(CoreError::Scale(s)) if s.is_nan()));
        let default = CoreOptions { scale: None, ..bad_scale };
        assert_eq!(default.scale_for(16).unwrap(), 0.25);
    }
}
