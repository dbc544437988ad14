//! The QKV/BFG projection schedules (`docs/design/schedule.md`) on any backend: the exact
//! overlapped trace, serial and overlapped outputs identical bit for bit, the sanitizer clean on
//! the real order and objecting to every single-edit mutation of it, capture and replay, a jittered
//! stress run, and the behaviours the seeds' unit tests pin down (4, 7, 8, 9, 10:
//! `docs/design/kda.md#behaviours`).
//!
//! Weights come from one small global model (`H = 16` heads of `D = 8`, hidden 80, so MX blocks
//! include a partial one) sliced per TP rank as a checkpoint loader would: weights ~N(0, 0.02)
//! rounded to bf16, activations ~N(0, 1).

use half::bf16;
use kda_core::graph::Node;
use kda_core::mx::{self, ScaleAlg, num_blocks};
use kda_core::sanitize::{Entry, ExclusiveUnits, Hazard, HazardKind};
use kda_core::{
    Backend, BufferHandle, CaptureError, DType, Device, E8M0, Error, F8E4M3, Op, StreamHandle,
    Tensor,
};
use kda_model::schedule::{
    AuxStream, BfgWeight, MatrixOverlap, Mutation, Projected, ProjectionBuffers, ProjectionDims,
    ProjectionSchedule, ProjectionWeights, QkvBfgProjection, QkvRoute, QkvWeight, ScheduleEvent,
    labels, prepare_beta,
};

use super::Factory;
use super::gemm::download_f64;
use crate::{Gen, Tolerance};

const HIDDEN: usize = 80;
const HEADS: usize = 16;
const HEAD_DIM: usize = 8;
const P: usize = HEADS * HEAD_DIM;

/// How the QKV linear is stored.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Qkv {
    Bf16,
    Mxfp8(ScaleAlg),
}

/// How the F projection is stored.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Bfg {
    Composed,
    Staged,
}

const MXFP8: Qkv = Qkv::Mxfp8(ScaleAlg::OcpFloor);
const POLICIES: [MatrixOverlap; 2] = [MatrixOverlap::Serialized, MatrixOverlap::Concurrent];

/// The global weights, bf16 values held as f32, row-major.
struct Model {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    b: Vec<f32>,
    f_a: Vec<f32>,
    f_b: Vec<f32>,
    g: Vec<f32>,
}

fn bf16_values(v: Vec<f32>) -> Vec<f32> {
    v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect()
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// Rows `start..start + n` of a row-major matrix with `cols` columns.
fn rows(m: &[f32], cols: usize, start: usize, n: usize) -> &[f32] {
    &m[start * cols..(start + n) * cols]
}

/// One rank's host weights.
struct RankWeights {
    dims: ProjectionDims,
    /// `[3 lp, Hd]`: q, k, v shards.
    qkv: Vec<f32>,
    b: Vec<f32>,
    f_a: Vec<f32>,
    f_b: Vec<f32>,
    g: Vec<f32>,
}

impl RankWeights {
    /// The composed fused BFG weight `[lh + 2 lp, Hd]`: F = `f_b @ f_a` in fp32, cast once.
    fn composed(&self) -> Vec<f32> {
        let (d, hd) = (self.dims.head_dim, self.dims.hidden);
        let lp = self.dims.local_projection();
        let mut w = self.b.clone();
        for r in 0..lp {
            for c in 0..hd {
                let dot =
                    (0..d).fold(0.0f32, |s, j| s + self.f_b[r * d + j] * self.f_a[j * hd + c]);
                w.push(bf16::from_f32(dot).to_f32());
            }
        }
        w.extend_from_slice(&self.g);
        w
    }
}

impl Model {
    fn new(seed: u64) -> Self {
        let mut rng = Gen::new(seed);
        let mut w = |n| bf16_values(rng.normal_f32(n, 0.0, 0.02));
        Self {
            q: w(P * HIDDEN),
            k: w(P * HIDDEN),
            v: w(P * HIDDEN),
            b: w(HEADS * HIDDEN),
            f_a: w(HEAD_DIM * HIDDEN),
            f_b: w(P * HEAD_DIM),
            g: w(P * HIDDEN),
        }
    }

    fn rank(&self, tp: usize, rank: usize) -> RankWeights {
        let dims = ProjectionDims { hidden: HIDDEN, heads: HEADS / tp, head_dim: HEAD_DIM };
        let (lh, lp) = (dims.heads, dims.local_projection());
        let mut qkv = Vec::new();
        for m in [&self.q, &self.k, &self.v] {
            qkv.extend_from_slice(rows(m, HIDDEN, rank * lp, lp));
        }
        RankWeights {
            dims,
            qkv,
            b: rows(&self.b, HIDDEN, rank * lh, lh).to_vec(),
            f_a: self.f_a.clone(),
            f_b: rows(&self.f_b, HEAD_DIM, rank * lp, lp).to_vec(),
            g: rows(&self.g, HIDDEN, rank * lp, lp).to_vec(),
        }
    }
}

fn upload_bf16<B: Backend>(b: &Device<B>, s: &B::Stream, shape: &[usize], v: &[f32]) -> Tensor<B> {
    let t = b.alloc(DType::BF16, shape).unwrap();
    b.upload(s, &t, &to_bf16(v)).unwrap();
    t
}

fn upload_f32<B: Backend>(b: &Device<B>, s: &B::Stream, shape: &[usize], v: &[f32]) -> Tensor<B> {
    let t = b.alloc(DType::F32, shape).unwrap();
    b.upload(s, &t, v).unwrap();
    t
}

/// Device weights for one rank; the stream is synchronized, so later work is ordered after the
/// uploads whatever stream it runs on.
fn device_weights<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    w: &RankWeights,
    qkv: Qkv,
    bfg: Bfg,
) -> ProjectionWeights<B> {
    let dims = w.dims;
    let (hd, lh, lp, d) = (dims.hidden, dims.heads, dims.local_projection(), dims.head_dim);
    let qkv = match qkv {
        Qkv::Bf16 => QkvWeight::Bf16 { w: upload_bf16(b, s, &[3 * lp, hd], &w.qkv) },
        Qkv::Mxfp8(alg) => {
            let q = mx::quantize(&w.qkv, 3 * lp, hd, alg).unwrap();
            let data = b.alloc(DType::E4M3, &[3 * lp, hd]).unwrap();
            let scale = b.alloc(DType::E8M0, &[3 * lp, num_blocks(hd)]).unwrap();
            let bytes: Vec<F8E4M3> = q.data.iter().map(|&x| F8E4M3(x)).collect();
            b.upload(s, &data, &bytes).unwrap();
            let scales: Vec<E8M0> = q.scale.iter().map(|&x| E8M0(x)).collect();
            b.upload(s, &scale, &scales).unwrap();
            QkvWeight::Mxfp8 { data, scale, alg }
        }
    };
    let bfg = match bfg {
        Bfg::Composed => {
            BfgWeight::Composed { w: upload_bf16(b, s, &[dims.bfg_width(), hd], &w.composed()) }
        }
        Bfg::Staged => BfgWeight::Staged {
            b: upload_bf16(b, s, &[lh, hd], &w.b),
            f_a: upload_bf16(b, s, &[d, hd], &w.f_a),
            f_b: upload_bf16(b, s, &[lp, d], &w.f_b),
            g: upload_bf16(b, s, &[lp, hd], &w.g),
        },
    };
    b.synchronize(s).unwrap();
    ProjectionWeights::new(dims, qkv, bfg).unwrap()
}

/// An activation `[t, Hd]` ~N(0, 1) in bf16, uploaded on `s` (not synchronized: the schedule
/// must order its readers after the upload).
fn activation<B: Backend>(
    b: &Device<B>,
    s: &B::Stream,
    rng: &mut Gen,
    t: usize,
) -> (Tensor<B>, Vec<f32>) {
    let x = bf16_values(rng.normal_f32(t * HIDDEN, 0.0, 1.0));
    (upload_bf16(b, s, &[t, HIDDEN], &x), x)
}

fn projection<B: Backend>(
    b: &Device<B>,
    weights: &ProjectionWeights<B>,
    schedule: ProjectionSchedule,
    policy: MatrixOverlap,
) -> QkvBfgProjection<B> {
    QkvBfgProjection::new(b, weights.clone(), schedule).unwrap().with_matrix_overlap(policy)
}

/// The bits of every output, downloaded on main.
#[derive(Debug, PartialEq, Eq)]
struct Bits {
    mixed_qkv: Vec<u16>,
    beta: Vec<u32>,
    g1: Vec<u16>,
    g2: Vec<u16>,
}

fn bits<B: Backend>(b: &Device<B>, s: &B::Stream, p: &Projected<B>) -> Bits {
    let half = |t: &Tensor<B>| -> Vec<u16> {
        b.download::<bf16>(s, t).unwrap().into_iter().map(bf16::to_bits).collect()
    };
    Bits {
        mixed_qkv: half(&p.mixed_qkv),
        beta: b.download::<f32>(s, &p.beta).unwrap().into_iter().map(f32::to_bits).collect(),
        g1: half(&p.g1),
        g2: half(&p.g2),
    }
}

/// A backend, its main stream, and one rank's weights (tp 8, the last rank).
fn setup<B: Backend>(
    make: &impl Factory<B>,
    qkv: Qkv,
    bfg: Bfg,
) -> (Device<B>, B::Stream, ProjectionWeights<B>) {
    let b = make();
    let main = b.new_stream().unwrap();
    let weights = device_weights(&b, &main, &setup_rank(), qkv, bfg);
    (b, main, weights)
}

/// The rank [`setup`] uploads.
fn setup_rank() -> RankWeights {
    Model::new(7).rank(8, 7)
}

/// Whether `b` runs MXFP8 QKV: the native MX ops, as `QkvPath::resolve` requires. Without them
/// (Ascend A2/A3) a projection of MXFP8 weights is refused by design ([`expect_mx_refused`]), and
/// the bodies whose MXFP8 form is incidental run the bf16 QKV a layer there runs ([`layer_qkv`]).
fn runs_mxfp8<B: Backend>(b: &Device<B>) -> bool {
    super::native(b).mxfp8()
}

/// The QKV form a layer of an MXFP8 checkpoint runs on `b`: MXFP8 where it can, bf16 otherwise.
fn layer_qkv<B: Backend>(b: &Device<B>) -> Qkv {
    if runs_mxfp8(b) { MXFP8 } else { Qkv::Bf16 }
}

/// [`setup`] with the QKV form a layer runs on the backend ([`layer_qkv`]), which it returns.
fn setup_layer<B: Backend>(
    make: &impl Factory<B>,
    bfg: Bfg,
) -> (Device<B>, B::Stream, ProjectionWeights<B>, Qkv) {
    let b = make();
    let main = b.new_stream().unwrap();
    let qkv = layer_qkv(&b);
    let weights = device_weights(&b, &main, &setup_rank(), qkv, bfg);
    (b, main, weights, qkv)
}

/// A projection of MXFP8 `weights` on a backend without the native MX ops is the typed refusal,
/// naming the weights and the missing capability.
#[track_caller]
fn expect_mx_refused<B: Backend>(b: &Device<B>, weights: &ProjectionWeights<B>) {
    match QkvBfgProjection::new(b, weights.clone(), ProjectionSchedule::Overlapped) {
        Err(Error::Param { param: "ProjectionWeights::qkv", expected, .. })
            if expected.contains("mx_quant") => {}
        other => panic!("expected MXFP8 QKV to be refused without native MX ops, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The trace (`docs/design/kda.md#behaviour-9`)

/// The calls on `main` and `aux` since log entry `from`, in the seeds' notation.
fn trace<B: Backend>(
    b: &Device<B>,
    p: &QkvBfgProjection<B>,
    (main, aux): (&B::Stream, &B::Stream),
    from: usize,
) -> String {
    let stream = |id| {
        if id == main.id() {
            "main"
        } else if id == aux.id() {
            "aux"
        } else {
            "?"
        }
    };
    let event = |id| p.events().which(id).map_or("?", ScheduleEvent::name);
    let log = b.instrumentation().log();
    let steps: Vec<String> = log[from..]
        .iter()
        .filter_map(|e| match e {
            Entry::Launch { stream: s, label, .. } if [main.id(), aux.id()].contains(s) => {
                Some(label.clone())
            }
            Entry::Record { stream: s, event: e } => {
                Some(format!("{}.record({})", stream(*s), event(*e)))
            }
            Entry::Wait { stream: s, event: e } => {
                Some(format!("{}.wait({})", stream(*s), event(*e)))
            }
            _ => None,
        })
        .collect();
    steps.join(" · ")
}

/// The seeds' trace (`docs/design/schedule.md#the-trace`), verbatim.
const SEEDS_TRACE: &str = "main.record(hidden_ready) · aux.wait(hidden_ready) · project_bfg · \
    aux.record(bfg_projection_ready) · dynamic_quant · main.record(quant_ready) · \
    main.wait(bfg_projection_ready) · qkv_matmul · aux.wait(quant_ready) · postprocess_bfg · \
    aux.record(bfg_ready) · main.wait(bfg_ready)";

/// One overlapped call records exactly the seeds' sequence; `Concurrent` only drops the stage-1
/// join; staged F expands `project_bfg` into its four GEMMs; bf16 QKV has no quant op; the
/// captured graph has the same nodes.
pub fn overlapped_trace_is_the_seeds_sequence<B: Backend>(make: &impl Factory<B>) {
    let stage1_join = " · main.wait(bfg_projection_ready)";
    let staged = "project_bfg.b · project_bfg.f_a · project_bfg.f_b · project_bfg.g";
    let cases = [
        (MXFP8, Bfg::Composed, MatrixOverlap::Serialized, SEEDS_TRACE.to_string()),
        (MXFP8, Bfg::Composed, MatrixOverlap::Concurrent, SEEDS_TRACE.replace(stage1_join, "")),
        (
            MXFP8,
            Bfg::Staged,
            MatrixOverlap::Serialized,
            SEEDS_TRACE.replace("project_bfg ", &format!("{staged} ")),
        ),
        (
            Qkv::Bf16,
            Bfg::Composed,
            MatrixOverlap::Serialized,
            SEEDS_TRACE.replace("dynamic_quant · ", ""),
        ),
    ];
    for (mut qkv, bfg, policy, mut expected) in cases {
        let (b, main, mut weights) = setup(make, qkv, bfg);
        if qkv != Qkv::Bf16 && !runs_mxfp8(&b) {
            // Refused by design; the same schedule with the bf16 QKV a layer runs there.
            expect_mx_refused(&b, &weights);
            (qkv, expected) = (Qkv::Bf16, expected.replace("dynamic_quant · ", ""));
            weights = device_weights(&b, &main, &setup_rank(), qkv, bfg);
        }
        assert!(b.instrumentation().is_checked(), "the trace is read from the checked-mode log");
        let (x, _) = activation(&b, &main, &mut Gen::new(1), 5);
        let p = projection(&b, &weights, ProjectionSchedule::Overlapped, policy);
        let aux = p.aux_stream().get(&b).unwrap();
        let from = b.instrumentation().log().len();
        let out = p.forward(&main, &x).unwrap();
        assert_eq!(trace(&b, &p, (&main, &aux), from), expected, "{qkv:?} {bfg:?} {policy:?}");

        // The captured graph: the same nodes, stream 0 = main, events numbered by first record.
        let bufs = p.alloc_buffers(&x).unwrap();
        b.begin_capture(&main).unwrap();
        p.forward_into(&main, &x, &bufs).unwrap();
        let graph = b.end_capture(&main).unwrap();
        let names = ScheduleEvent::ALL.map(ScheduleEvent::name);
        let side = ["main", "aux"];
        let nodes: Vec<String> = graph
            .nodes()
            .iter()
            .map(|n| match n {
                Node::Launch { label, .. } => label.clone(),
                Node::Record { stream, event } => {
                    format!("{}.record({})", side[*stream], names[*event])
                }
                Node::Wait { stream, event } => {
                    format!("{}.wait({})", side[*stream], names[*event])
                }
            })
            .collect();
        assert_eq!(nodes.join(" · "), expected, "captured graph");
        assert_eq!(graph.streams(), 2);
        bits(&b, &main, &out);
        assert!(b.instrumentation().hazards().is_empty(), "{:?}", b.instrumentation().hazards());
    }
}

/// The auxiliary stream is schedule state: projections given clones of one [`AuxStream`] (the
/// layers of one model) fork onto one stream, created once; a projection made without one has
/// its own.
pub fn aux_stream_is_created_once_per_instance<B: Backend>(make: &impl Factory<B>) {
    let (b, main, weights, _) = setup_layer(make, Bfg::Composed);
    let shared = AuxStream::new();
    assert!(shared.created().is_none(), "created on first use");
    let aux = shared.get(&b).unwrap();
    assert_eq!(shared.get(&b).unwrap().id(), aux.id());
    assert_ne!(aux.id(), main.id());
    let (x, _) = activation(&b, &main, &mut Gen::new(2), 3);
    let from = b.instrumentation().log().len();
    for _layer in 0..3 {
        let p = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Serialized)
            .with_aux_stream(shared.clone());
        p.forward(&main, &x).unwrap();
    }
    let streams: std::collections::BTreeSet<_> =
        b.instrumentation().log()[from..].iter().filter_map(Entry::stream).collect();
    assert_eq!(
        streams,
        [main.id(), aux.id()].into_iter().collect(),
        "three layers, one aux stream"
    );
    let own = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Serialized);
    own.forward(&main, &x).unwrap();
    let mine = own.aux_stream().created().unwrap();
    assert_ne!(mine.id(), aux.id(), "a projection without a shared aux stream has its own");
    b.synchronize(&main).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Bit identity, values

/// Serial and overlapped (both policies) give the same bits for T ∈ {1, 3, 64, 257}, TP 1 and
/// TP 8 (rank 0 and the last rank), bf16 and MXFP8 QKV, composed and staged F.
pub fn serial_and_overlapped_are_bit_identical<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let main = b.new_stream().unwrap();
    let model = Model::new(11);
    let mut rng = Gen::new(12);
    let inputs: Vec<(usize, Tensor<B>)> =
        [1, 3, 64, 257].into_iter().map(|t| (t, activation(&b, &main, &mut rng, t).0)).collect();
    for (tp, rank) in [(1, 0), (8, 0), (8, 7)] {
        let host = model.rank(tp, rank);
        for qkv in [Qkv::Bf16, Qkv::Mxfp8(ScaleAlg::OcpFloor), Qkv::Mxfp8(ScaleAlg::RoundUp)] {
            for bfg in [Bfg::Composed, Bfg::Staged] {
                let weights = device_weights(&b, &main, &host, qkv, bfg);
                if qkv != Qkv::Bf16 && !runs_mxfp8(&b) {
                    expect_mx_refused(&b, &weights);
                    continue;
                }
                let serial =
                    projection(&b, &weights, ProjectionSchedule::Serial, MatrixOverlap::Serialized);
                for (t, x) in &inputs {
                    let want = bits(&b, &main, &serial.forward(&main, x).unwrap());
                    for policy in POLICIES {
                        let p = projection(&b, &weights, ProjectionSchedule::Overlapped, policy);
                        let got = bits(&b, &main, &p.forward(&main, x).unwrap());
                        assert!(
                            got == want,
                            "T {t} tp {tp} rank {rank} {qkv:?} {bfg:?} {policy:?}: overlapped differs from serial"
                        );
                    }
                }
            }
        }
    }
    assert!(b.instrumentation().hazards().is_empty());
}

/// `x · w^T` in f64 for row-major `x [m, k]`, `w [n, k]`.
fn matmul(x: &[f32], w: &[f32], k: usize) -> Vec<f64> {
    let (m, n) = (x.len() / k, w.len() / k);
    let mut y = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            y.push((0..k).map(|c| f64::from(x[i * k + c]) * f64::from(w[j * k + c])).sum());
        }
    }
    y
}

/// Column block `cols` of a row-major `[rows, width]` matrix.
fn columns(m: &[f64], width: usize, cols: std::ops::Range<usize>) -> Vec<f64> {
    m.chunks(width).flat_map(|r| r[cols.clone()].iter().copied()).collect()
}

/// The outputs against an independent host computation: dense QKV and the BFG blocks against f64
/// (bf16 tolerance; beta is the sigmoid of the bf16-rounded B columns), MXFP8 QKV bit for bit
/// against the codec's quantization of `x` and its defining GEMM; staged F agrees with the
/// composed F within bf16 rounding, B, G and QKV do not depend on the form.
pub fn projection_matches_host_computation<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let main = b.new_stream().unwrap();
    let host = Model::new(21).rank(8, 7);
    let dims = host.dims;
    let (t, hd, lh, lp, d) = (5, HIDDEN, dims.heads, dims.local_projection(), HEAD_DIM);
    let (x, xv) = activation(&b, &main, &mut Gen::new(22), t);
    let bfg_f64 = matmul(&xv, &host.composed(), hd);
    let width = dims.bfg_width();
    let tol = Tolerance::for_dtype(DType::BF16);
    let mut forms = Vec::new();
    for bfg in [Bfg::Composed, Bfg::Staged] {
        let weights = device_weights(&b, &main, &host, Qkv::Bf16, bfg);
        let p = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Serialized);
        let out = p.forward(&main, &x).unwrap();
        tol.assert_close(
            &[t, 3 * lp],
            &download_f64(&b, &main, &out.mixed_qkv),
            &matmul(&xv, &host.qkv, hd),
        );
        let raw_beta: Vec<f64> = columns(&bfg_f64, width, 0..lh)
            .into_iter()
            .map(|v| f64::from(bf16::from_f64(v).to_f32()))
            .map(|v| 1.0 / (1.0 + (-v).exp()))
            .collect();
        tol.assert_close(&[1, t, lh], &download_f64(&b, &main, &out.beta), &raw_beta);
        let g1 = columns(&bfg_f64, width, lh..lh + lp);
        let g2 = columns(&bfg_f64, width, lh + lp..width);
        // Staged F rounds x · f_a^T to bf16 first: one more bf16 rounding, well inside `tol`.
        tol.assert_close(&[1, t, lh, d], &download_f64(&b, &main, &out.g1), &g1);
        tol.assert_close(&[t, lh, d], &download_f64(&b, &main, &out.g2), &g2);
        forms.push(bits(&b, &main, &out));
    }
    let (composed, staged) = (&forms[0], &forms[1]);
    let as_f64 =
        |v: &[u16]| -> Vec<f64> { v.iter().map(|&x| bf16::from_bits(x).to_f64()).collect() };
    tol.assert_close(&[t, lh * d], &as_f64(&staged.g1), &as_f64(&composed.g1));
    tol.assert_close(&[t, lh * d], &as_f64(&staged.g2), &as_f64(&composed.g2));
    assert_eq!(staged.mixed_qkv, composed.mixed_qkv);

    // MXFP8: quantize x as the spec does, then the defining GEMM, rounded once to bf16.
    for alg in [ScaleAlg::OcpFloor, ScaleAlg::RoundUp] {
        let weights = device_weights(&b, &main, &host, Qkv::Mxfp8(alg), Bfg::Composed);
        if !runs_mxfp8(&b) {
            expect_mx_refused(&b, &weights);
            continue;
        }
        let p = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Serialized);
        let out = p.forward(&main, &x).unwrap();
        let qx = mx::quantize(&to_bf16(&xv), t, hd, alg).unwrap();
        let qw = mx::quantize(&host.qkv, 3 * lp, hd, alg).unwrap();
        let y = mx::gemm::gemm(&qx.data, &qx.scale, &qw.data, &qw.scale, (t, 3 * lp, hd)).unwrap();
        let want: Vec<u16> = y.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        assert_eq!(bits(&b, &main, &out).mixed_qkv, want, "MXFP8 QKV, {alg:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// The sanitizer: clean on the real order

/// Both policies are hazard-free, including the caller's consumers and frees on main after the
/// call (the buffer-lifetime contract); with the matrix units declared shared, `Serialized` stays
/// clean and `Concurrent` is exactly one matrix overlap, the two GEMMs.
pub fn overlapped_schedule_is_hazard_free<B: Backend>(make: &impl Factory<B>) {
    for policy in POLICIES {
        let (b, main, weights, _) = setup_layer(make, Bfg::Composed);
        let vector_only = ExclusiveUnits { matrix: false, vector: true };
        let all = ExclusiveUnits { matrix: true, vector: true };
        let units = if policy == MatrixOverlap::Serialized { all } else { vector_only };
        b.instrumentation().set_exclusive_units(units);
        let p = projection(&b, &weights, ProjectionSchedule::Overlapped, policy);
        for t in [1, 9] {
            let (x, _) = activation(&b, &main, &mut Gen::new(t as u64), t);
            let out = p.forward(&main, &x).unwrap();
            // The caller frees x at once, consumes the outputs, then frees them, all on main.
            b.free(&main, x.buffer().clone()).unwrap();
            bits(&b, &main, &out);
            for buffer in [out.mixed_qkv.buffer(), out.beta.buffer(), out.g1.buffer()] {
                b.free(&main, buffer.clone()).unwrap();
            }
        }
        assert!(
            b.instrumentation().hazards().is_empty(),
            "{policy:?}: {:?}",
            b.instrumentation().hazards()
        );
    }

    // Concurrent on a backend whose matrix units are shared: the one thing it gives up.
    let (b, main, weights, _) = setup_layer(make, Bfg::Composed);
    b.instrumentation().set_exclusive_units(ExclusiveUnits { matrix: true, vector: true });
    let (x, _) = activation(&b, &main, &mut Gen::new(3), 4);
    let p = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Concurrent);
    let h = expect_hazard(p.forward(&main, &x).map(|_| ()));
    assert_hazard(&h, HazardKind::MatrixOverlap, labels::PROJECT_BFG, labels::QKV_MATMUL);
    b.synchronize(&p.aux_stream().get(&b).unwrap()).unwrap();
    b.synchronize(&main).unwrap();
}

// ---------------------------------------------------------------------------------------------
// The mutation table: every single edit is caught, each by its own diagnostic

fn expect_hazard<T: std::fmt::Debug>(r: kda_core::Result<T>) -> Hazard {
    match r {
        Err(Error::Hazard(h)) => *h,
        other => panic!("expected a stream hazard, got {other:?}"),
    }
}

fn expect_capture_error<T: std::fmt::Debug>(r: kda_core::Result<T>) -> CaptureError {
    match r {
        Err(Error::Capture(e)) => e,
        other => panic!("expected a capture error, got {other:?}"),
    }
}

#[track_caller]
fn assert_hazard(h: &Hazard, kind: HazardKind, first: &str, second: &str) {
    assert_eq!(
        (h.kind, h.first.op.label.as_str(), h.second.op.label.as_str()),
        (kind, first, second),
        "{h}"
    );
}

/// A checked backend with both exclusive-unit rules on, MXFP8 QKV (bf16 where the backend has no
/// native MX ops: [`layer_qkv`]) and composed F, `x` uploaded on main just before the call (so an
/// aux reader that is not ordered after it races), and the overlapped projection under
/// `Serialized`.
struct Mutant<B: Backend> {
    b: Device<B>,
    qkv: Qkv,
    main: B::Stream,
    aux: B::Stream,
    x: Tensor<B>,
    p: QkvBfgProjection<B>,
}

impl<B: Backend> Mutant<B> {
    fn new(make: &impl Factory<B>) -> Self {
        let (b, main, weights, qkv) = setup_layer(make, Bfg::Composed);
        assert!(b.instrumentation().is_checked(), "mutation tests need checked mode");
        b.instrumentation().set_exclusive_units(ExclusiveUnits { matrix: true, vector: true });
        let (x, _) = activation(&b, &main, &mut Gen::new(5), 6);
        let p = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Serialized);
        let aux = p.aux_stream().get(&b).unwrap();
        Self { b, qkv, main, aux, x, p }
    }

    fn run(&self, mutation: Mutation) -> kda_core::Result<Projected<B>> {
        self.p.forward_mutated(&self.main, &self.x, mutation)
    }

    /// The mutated schedule captured from main; `end_capture`'s verdict.
    fn capture(&self, mutation: Mutation) -> kda_core::Result<kda_core::graph::Graph<B>> {
        self.b.synchronize(&self.main)?;
        self.b.begin_capture(&self.main)?;
        let queued = self.run(mutation);
        let graph = self.b.end_capture(&self.main);
        queued?;
        graph
    }

    fn finish(&self) {
        self.b.synchronize(&self.aux).unwrap();
        self.b.synchronize(&self.main).unwrap();
    }
}

/// Without the record of `hidden_ready`, the aux wait binds to nothing: the BFG GEMM reads `x`
/// unordered with its upload on main (read-after-write on `x`).
pub fn mutation_drop_record_hidden_ready<B: Backend>(make: &impl Factory<B>) {
    let m = Mutant::new(make);
    let h = expect_hazard(m.run(Mutation::DropRecord(ScheduleEvent::HiddenReady)));
    assert_hazard(&h, HazardKind::ReadAfterWrite, "upload", labels::PROJECT_BFG);
    assert_eq!((h.second.param, h.second.buffer), ("x", m.x.buffer().id()));
    m.finish();
}

/// Without aux's wait on `hidden_ready`: read-after-write on `x`, as above.
pub fn mutation_drop_wait_hidden_ready<B: Backend>(make: &impl Factory<B>) {
    let m = Mutant::new(make);
    let h = expect_hazard(m.run(Mutation::DropWait(ScheduleEvent::HiddenReady)));
    assert_hazard(&h, HazardKind::ReadAfterWrite, "upload", labels::PROJECT_BFG);
    assert_eq!(
        (h.second.param, h.second.buffer, h.second.op.stream),
        ("x", m.x.buffer().id(), m.aux.id())
    );
    m.finish();
}

/// Without the record of `bfg_projection_ready`, the stage-1 join waits on nothing: the two GEMMs
/// may run together, a matrix overlap where the units are shared (not a data race: that is the
/// `Concurrent` policy).
pub fn mutation_drop_record_bfg_projection_ready<B: Backend>(make: &impl Factory<B>) {
    let m = Mutant::new(make);
    let h = expect_hazard(m.run(Mutation::DropRecord(ScheduleEvent::BfgProjectionReady)));
    assert_hazard(&h, HazardKind::MatrixOverlap, labels::PROJECT_BFG, labels::QKV_MATMUL);
    assert_eq!((h.first.op.stream, h.second.op.stream), (m.aux.id(), m.main.id()));
    m.finish();
}

/// Without main's stage-1 join: the same matrix overlap.
pub fn mutation_drop_wait_bfg_projection_ready<B: Backend>(make: &impl Factory<B>) {
    let m = Mutant::new(make);
    let h = expect_hazard(m.run(Mutation::DropWait(ScheduleEvent::BfgProjectionReady)));
    assert_hazard(&h, HazardKind::MatrixOverlap, labels::PROJECT_BFG, labels::QKV_MATMUL);
    m.finish();
}

/// Without the record of `quant_ready`: inside a capture, aux waits on an event the capture never
/// recorded (the device runtime rejects that); run eagerly, the post-process may run alongside
/// DynamicQuant, a vector overlap where the vector units are shared.
pub fn mutation_drop_record_quant_ready<B: Backend>(make: &impl Factory<B>) {
    let m = Mutant::new(make);
    let mutation = Mutation::DropRecord(ScheduleEvent::QuantReady);
    match expect_capture_error(m.capture(mutation)) {
        CaptureError::ExternalEvent { stream, event, .. } => {
            assert_eq!(stream, m.aux.id());
            assert_eq!(m.p.events().which(event), Some(ScheduleEvent::QuantReady));
        }
        other => panic!("expected ExternalEvent, got {other:?}"),
    }
    quant_overlap(&m, mutation);
    m.finish();
}

/// Run `mutation` of `quant_ready` eagerly: with MXFP8 QKV the post-process may run alongside
/// DynamicQuant (a vector overlap); with bf16 QKV there is no quant op for `quant_ready` to order
/// (only the QKV GEMM, on the matrix units), so the mutated call is clean.
fn quant_overlap<B: Backend>(m: &Mutant<B>, mutation: Mutation) -> Option<Hazard> {
    if m.qkv == Qkv::Bf16 {
        let out = m.run(mutation).unwrap();
        bits(&m.b, &m.main, &out);
        assert!(
            m.b.instrumentation().hazards().is_empty(),
            "{:?}",
            m.b.instrumentation().hazards()
        );
        return None;
    }
    let h = expect_hazard(m.run(mutation));
    assert_hazard(&h, HazardKind::VectorOverlap, labels::DYNAMIC_QUANT, labels::POSTPROCESS_BFG);
    Some(h)
}

/// Without aux's wait on `quant_ready`: the post-process is unordered with DynamicQuant, a vector
/// overlap where the vector units are shared.
pub fn mutation_drop_wait_quant_ready<B: Backend>(make: &impl Factory<B>) {
    let m = Mutant::new(make);
    if let Some(h) = quant_overlap(&m, Mutation::DropWait(ScheduleEvent::QuantReady)) {
        assert_eq!((h.first.op.stream, h.second.op.stream), (m.main.id(), m.aux.id()));
    }
    m.finish();
}

/// Main reads beta where dispatch would: a hazard names the producer and the consumer.
fn consume_beta<B: Backend>(m: &Mutant<B>, out: &Projected<B>) -> Hazard {
    let h = expect_hazard(m.b.download::<f32>(&m.main, &out.beta));
    assert_hazard(&h, HazardKind::ReadAfterWrite, labels::POSTPROCESS_BFG, "download");
    assert_eq!((h.first.op.stream, h.second.op.stream), (m.aux.id(), m.main.id()));
    assert_eq!(h.second.buffer, out.beta.buffer().id());
    h
}

/// Without the record of `bfg_ready`, main's join waits on nothing: consuming beta races with the
/// post-process (read-after-write on beta), and inside a capture main waits on an event the
/// capture never recorded, so the aux tail is never joined (`ExternalEvent` on main).
pub fn mutation_drop_record_bfg_ready<B: Backend>(make: &impl Factory<B>) {
    let m = Mutant::new(make);
    let mutation = Mutation::DropRecord(ScheduleEvent::BfgReady);
    match expect_capture_error(m.capture(mutation)) {
        CaptureError::ExternalEvent { stream, event, .. } => {
            assert_eq!(stream, m.main.id());
            assert_eq!(m.p.events().which(event), Some(ScheduleEvent::BfgReady));
        }
        other => panic!("expected ExternalEvent, got {other:?}"),
    }
    let out = m.run(mutation).unwrap();
    consume_beta(&m, &out);
    m.finish();
}

/// Without main's wait on `bfg_ready`: the same read-after-write on beta; in a capture aux's tail
/// (up to its final record) is not joined, and under `Concurrent` (no stage-1 join) aux is never
/// joined at all (`NotJoined`), and main may free `x` while the BFG GEMM reads it.
pub fn mutation_drop_wait_bfg_ready<B: Backend>(make: &impl Factory<B>) {
    let m = Mutant::new(make);
    let mutation = Mutation::DropWait(ScheduleEvent::BfgReady);
    match expect_capture_error(m.capture(mutation)) {
        CaptureError::WorkAfterJoin { stream, label, .. } => {
            assert_eq!((stream, label.as_str()), (m.aux.id(), "record"))
        }
        other => panic!("expected WorkAfterJoin, got {other:?}"),
    }
    let out = m.run(mutation).unwrap();
    consume_beta(&m, &out);
    m.finish();

    // Concurrent: nothing joins aux back.
    let (b, main, weights, _) = setup_layer(make, Bfg::Composed);
    let (x, _) = activation(&b, &main, &mut Gen::new(6), 6);
    b.synchronize(&main).unwrap();
    let p = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Concurrent);
    b.begin_capture(&main).unwrap();
    p.forward_mutated(&main, &x, mutation).unwrap();
    let aux = p.aux_stream().get(&b).unwrap();
    assert_eq!(
        expect_capture_error(b.end_capture(&main)),
        CaptureError::NotJoined { stream: aux.id(), origin: main.id() }
    );
    // Eagerly, freeing x on main is not ordered after the aux GEMM that reads it.
    p.forward_mutated(&main, &x, mutation).unwrap();
    let h = expect_hazard(b.free(&main, x.buffer().clone()));
    assert_hazard(&h, HazardKind::FreeWhileInUse, labels::PROJECT_BFG, "free");
    b.synchronize(&aux).unwrap();
    b.synchronize(&main).unwrap();
}

/// `bfg_ready` recorded before the post-process: main joins too early, so consuming beta races
/// with the post-process (read-after-write on beta), and a capture finds the post-process after
/// aux's last join (`WorkAfterJoin`).
pub fn mutation_record_bfg_ready_before_postprocess<B: Backend>(make: &impl Factory<B>) {
    let m = Mutant::new(make);
    let mutation = Mutation::RecordBfgReadyBeforePostprocess;
    match expect_capture_error(m.capture(mutation)) {
        CaptureError::WorkAfterJoin { stream, label, .. } => {
            assert_eq!((stream, label.as_str()), (m.aux.id(), labels::POSTPROCESS_BFG))
        }
        other => panic!("expected WorkAfterJoin, got {other:?}"),
    }
    let out = m.run(mutation).unwrap();
    consume_beta(&m, &out);
    m.finish();
}

// ---------------------------------------------------------------------------------------------
// Capture and stress

/// The overlapped schedule captured once and replayed 100 times equals eager execution bit for
/// bit (outputs reset to NaN before each replay), for both policies; replays are hazard-free.
pub fn capture_replays_equal_eager<B: Backend>(make: &impl Factory<B>) {
    for policy in POLICIES {
        let (b, main, weights, qkv) = setup_layer(make, Bfg::Composed);
        let (x, _) = activation(&b, &main, &mut Gen::new(8), 33);
        let p = projection(&b, &weights, ProjectionSchedule::Overlapped, policy);
        let eager = bits(&b, &main, &p.forward(&main, &x).unwrap());

        let bufs = p.alloc_buffers(&x).unwrap();
        let reset = || {
            for t in [&bufs.mixed_qkv, &bufs.bfg, &bufs.beta] {
                b.launch(&main, Op::Fill { dst: t.clone(), value: f64::NAN }).unwrap();
            }
        };
        reset();
        b.synchronize(&main).unwrap();
        b.begin_capture(&main).unwrap();
        let out = p.forward_into(&main, &x, &bufs).unwrap();
        let graph = b.end_capture(&main).unwrap();
        let mut ops = vec![(1, labels::PROJECT_BFG)];
        if qkv != Qkv::Bf16 {
            ops.push((0, labels::DYNAMIC_QUANT));
        }
        ops.extend([(0, labels::QKV_MATMUL), (1, labels::POSTPROCESS_BFG)]);
        assert_eq!(graph.ops(), ops);
        let captured = bits(&b, &main, &out);
        assert!(
            captured.beta.iter().all(|&v| f32::from_bits(v).is_nan()),
            "captured ops must not run"
        );
        for replay in 0..100 {
            reset();
            b.launch_graph(&graph, &main).unwrap();
            assert!(
                bits(&b, &main, &out) == eager,
                "{policy:?}: replay {replay} differs from eager"
            );
        }
        assert!(b.instrumentation().hazards().is_empty(), "{:?}", b.instrumentation().hazards());
    }
}

/// 1,000 overlapped calls under random per-op delays (alternating policies, four inputs of
/// different lengths, two buffer sets reused in turn and poisoned before each call) all equal
/// the serial outputs bit for bit.
pub fn stress_jittered_overlapped_equals_serial<B: Backend>(make: &impl Factory<B>, calls: usize) {
    let (b, main, weights, _) = setup_layer(make, Bfg::Composed);
    let mut rng = Gen::new(9);
    let inputs: Vec<Tensor<B>> =
        [1, 3, 17, 64].into_iter().map(|t| activation(&b, &main, &mut rng, t).0).collect();
    let serial = projection(&b, &weights, ProjectionSchedule::Serial, MatrixOverlap::Serialized);
    let expected: Vec<Bits> =
        inputs.iter().map(|x| bits(&b, &main, &serial.forward(&main, x).unwrap())).collect();
    let overlapped =
        POLICIES.map(|policy| projection(&b, &weights, ProjectionSchedule::Overlapped, policy));
    let buffers: Vec<Vec<ProjectionBuffers<B>>> = inputs
        .iter()
        .map(|x| (0..2).map(|_| overlapped[0].alloc_buffers(x).unwrap()).collect())
        .collect();
    for call in 0..calls {
        let i = call % inputs.len();
        let p = &overlapped[(call / inputs.len()) % 2];
        let bufs = &buffers[i][(call / 8) % 2];
        // Poison the outputs first (on main, so ordered after the last call's consumers): a read
        // that overtakes its producer then shows as NaN instead of last call's equal values.
        for t in [&bufs.mixed_qkv, &bufs.bfg, &bufs.beta] {
            b.launch(&main, Op::Fill { dst: t.clone(), value: f64::NAN }).unwrap();
        }
        let out = p.forward_into(&main, &inputs[i], bufs).unwrap();
        assert!(
            bits(&b, &main, &out) == expected[i],
            "call {call}: overlapped differs from serial"
        );
    }
    assert!(b.instrumentation().hazards().is_empty());
}

// ---------------------------------------------------------------------------------------------
// Behaviours 4, 7, 8, 10 (`docs/design/kda.md#behaviours`)

/// Behaviour 4 (`docs/design/kda.md#behaviour-4`): raw beta (bf16 -20, 0, 20, 100, with NaN in the
/// padding rows) is sliced to the live tokens and goes through the fp32 sigmoid, landing in [0, 1];
/// preprocessed beta is only sliced (a view of the same buffer, values untouched, nothing
/// launched).
pub fn prepare_beta_slices_and_applies_the_sigmoid_once<B: Backend>(make: &impl Factory<B>) {
    let b = make();
    let s = b.new_stream().unwrap();
    let (t, lh, live) = (6, 4, 4);
    let mut raw = Vec::new();
    for row in 0..t {
        for h in 0..lh {
            raw.push(if row < live { [-20.0, 0.0, 20.0, 100.0][(row + h) % 4] } else { f32::NAN });
        }
    }
    for shape in [vec![1, t, lh], vec![t, lh]] {
        let beta = upload_bf16(&b, &s, &shape, &raw);
        let out = prepare_beta(&b, &s, &beta, live, false).unwrap();
        let mut want_shape = shape.clone();
        want_shape[shape.len() - 2] = live;
        assert_eq!((out.shape(), out.dtype()), (&want_shape[..], DType::F32));
        let got = b.download::<f32>(&s, &out).unwrap();
        assert!(got.iter().all(|v| (0.0..=1.0).contains(v)), "{got:?}");
        let want: Vec<f64> =
            raw[..live * lh].iter().map(|&v| 1.0 / (1.0 + (-f64::from(v)).exp())).collect();
        Tolerance::for_dtype(DType::F32).assert_close(&want_shape, &got, &want);
        assert_eq!((got[0], got[1], got[3]), (1.0 / (1.0 + 20f32.exp()), 0.5, 1.0));
    }

    // Preprocessed: values that are no sigmoid output show it is not applied again.
    let pre: Vec<f32> = (0..t * lh).map(|i| i as f32 * 0.25 - 2.0).collect();
    let beta = upload_f32(&b, &s, &[1, t, lh], &pre);
    b.synchronize(&s).unwrap();
    let launches = |b: &Device<B>| {
        b.instrumentation().log().iter().filter(|e| matches!(e, Entry::Launch { .. })).count()
    };
    let before = launches(&b);
    let out = prepare_beta(&b, &s, &beta, live, true).unwrap();
    assert_eq!(launches(&b), before, "slicing launches nothing");
    assert_eq!((out.shape(), out.buffer().id()), (&[1, live, lh][..], beta.buffer().id()));
    assert_eq!(b.download::<f32>(&s, &out).unwrap(), pre[..live * lh]);

    // Bad input: more live tokens than rows, preprocessed beta that is not f32, a 1-D beta.
    assert!(matches!(prepare_beta(&b, &s, &beta, t + 1, true), Err(Error::View(_))));
    let raw_beta = upload_bf16(&b, &s, &[1, t, lh], &raw);
    assert!(matches!(prepare_beta(&b, &s, &raw_beta, live, true), Err(Error::DType { .. })));
    let flat = upload_f32(&b, &s, &[lh], &pre[..lh]);
    assert!(matches!(prepare_beta(&b, &s, &flat, 1, false), Err(Error::Shape { .. })));
    b.synchronize(&s).unwrap();
}

/// Behaviour 7 (`docs/design/kda.md#behaviour-7`): beta f32 `[1, T, lh]`, g1 `[1, T, lh, D]`, g2
/// `[T, lh, D]` (views of the one BFG output, no copies), `mixed_qkv` `[T, 3 lp]`; the post-process
/// is one op.
pub fn postprocess_shapes<B: Backend>(make: &impl Factory<B>) {
    for schedule in [ProjectionSchedule::Serial, ProjectionSchedule::Overlapped] {
        let (b, main, weights, _) = setup_layer(make, Bfg::Composed);
        let dims = weights.dims();
        let (lh, d, lp) = (dims.heads, dims.head_dim, dims.local_projection());
        let p = projection(&b, &weights, schedule, MatrixOverlap::Serialized);
        for t in [1, 5] {
            let (x, _) = activation(&b, &main, &mut Gen::new(t as u64), t);
            let from = b.instrumentation().log().len();
            let out = p.forward(&main, &x).unwrap();
            assert_eq!((out.beta.shape(), out.beta.dtype()), (&[1, t, lh][..], DType::F32));
            assert_eq!((out.g1.shape(), out.g1.dtype()), (&[1, t, lh, d][..], DType::BF16));
            assert_eq!((out.g2.shape(), out.g2.dtype()), (&[t, lh, d][..], DType::BF16));
            assert_eq!(
                (out.mixed_qkv.shape(), out.mixed_qkv.dtype()),
                (&[t, 3 * lp][..], DType::BF16)
            );
            assert_eq!(out.g1.buffer().id(), out.g2.buffer().id(), "g1 and g2 view one buffer");
            let post = b.instrumentation().log()[from..]
                .iter()
                .filter(|e| matches!(e, Entry::Launch { label, .. } if label == labels::POSTPROCESS_BFG))
                .count();
            assert_eq!(post, 1, "{schedule:?}");
            bits(&b, &main, &out);
        }
    }
}

/// Behaviour 8 (`docs/design/kda.md#behaviour-8`): the mixed projection hands dispatch preprocessed
/// beta with the flag set, so dispatch only slices it, and its values equal the ordinary path's
/// (raw B columns, sigmoid in dispatch) bit for bit; a second sigmoid would change them.
pub fn mixed_path_passes_preprocessed_beta<B: Backend>(make: &impl Factory<B>) {
    let (b, main, weights, _) = setup_layer(make, Bfg::Composed);
    let (t, live) = (7, 5);
    let (x, _) = activation(&b, &main, &mut Gen::new(10), t);
    for schedule in [ProjectionSchedule::Serial, ProjectionSchedule::Overlapped] {
        let p = projection(&b, &weights, schedule, MatrixOverlap::Serialized);
        let bufs = p.alloc_buffers(&x).unwrap();
        let out = p.forward_into(&main, &x, &bufs).unwrap();
        assert!(out.beta_preprocessed, "the mixed path's beta is preprocessed");
        let mixed = out.dispatch_beta(&b, &main, live).unwrap();
        assert_eq!(mixed.buffer().id(), out.beta.buffer().id(), "only sliced");
        let [raw_b, _, _] = bufs.bfg_parts().unwrap();
        let ordinary = prepare_beta(&b, &main, &raw_b, live, false).unwrap();
        let (m, o): (Vec<f32>, Vec<f32>) =
            (b.download(&main, &mixed).unwrap(), b.download(&main, &ordinary).unwrap());
        assert_eq!(
            m.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            o.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let twice = prepare_beta(&b, &main, &out.beta, live, false).unwrap();
        let twice: Vec<f32> = b.download(&main, &twice).unwrap();
        assert_ne!(twice, m, "a second sigmoid changes the values");
    }
}

/// Behaviour 10 (`docs/design/kda.md#behaviour-10`): DynamicQuant is split out of the QKV linear
/// for MXFP8 on a 2-D bf16 input with the configured `scale_alg` (an op of its own on main, before
/// the stage-1 join, in the captured graph); bf16 QKV has no quant op; MXFP8 on an f32 input keeps
/// the quant inside the linear.
pub fn dynamic_quant_split_decision<B: Backend>(make: &impl Factory<B>) {
    fn graph_of<B: Backend>(
        b: &Device<B>,
        main: &B::Stream,
        p: &QkvBfgProjection<B>,
        x: &Tensor<B>,
    ) -> kda_core::graph::Graph<B> {
        let bufs = p.alloc_buffers(x).unwrap();
        b.synchronize(main).unwrap();
        b.begin_capture(main).unwrap();
        p.forward_into(main, x, &bufs).unwrap();
        b.end_capture(main).unwrap()
    }
    /// (label, stream, scale_alg) of every DynamicQuant node, and the index of every node.
    fn quants<B: Backend>(g: &kda_core::graph::Graph<B>) -> Vec<(usize, String, usize, ScaleAlg)> {
        g.nodes()
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match n {
                Node::Launch { stream, label, op } => match op.op() {
                    Op::DynamicQuant { alg, .. } => Some((i, label.clone(), *stream, *alg)),
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }
    let position = |g: &kda_core::graph::Graph<B>, label: &str| {
        g.nodes()
            .iter()
            .position(|n| matches!(n, Node::Launch { label: l, .. } if l == label))
            .unwrap()
    };
    for alg in [ScaleAlg::OcpFloor, ScaleAlg::RoundUp] {
        let (b, main, weights) = setup(make, Qkv::Mxfp8(alg), Bfg::Composed);
        // A 3-D activation would not be split.
        assert_eq!(
            QkvRoute::decide(weights.qkv(), DType::BF16, 3),
            QkvRoute::QuantInLinear { alg }
        );
        if !runs_mxfp8(&b) {
            expect_mx_refused(&b, &weights);
            continue;
        }
        let p = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Serialized);
        let (x, xv) = activation(&b, &main, &mut Gen::new(4), 3);
        assert_eq!(p.route(&x).unwrap(), QkvRoute::SplitQuant { alg });
        let g = graph_of(&b, &main, &p, &x);
        let found = quants(&g);
        assert_eq!(found.len(), 1, "{alg:?}");
        let (at, label, stream, got) = found[0].clone();
        assert_eq!((label.as_str(), stream, got), (labels::DYNAMIC_QUANT, 0, alg));
        let join =
            g.nodes().iter().position(|n| matches!(n, Node::Wait { stream: 0, event: 1 })).unwrap();
        assert!(
            at < join && join < position(&g, labels::QKV_MATMUL),
            "quant before the stage-1 join"
        );

        // An f32 activation: the quant stays inside the linear, right before the QKV GEMM.
        let x32 = upload_f32(&b, &main, &[3, HIDDEN], &xv);
        assert_eq!(p.route(&x32).unwrap(), QkvRoute::QuantInLinear { alg });
        let g = graph_of(&b, &main, &p, &x32);
        let found = quants(&g);
        assert_eq!(found.len(), 1);
        assert_eq!(
            (found[0].1.as_str(), found[0].2, found[0].3),
            (labels::QKV_LINEAR_QUANT, 0, alg)
        );
        assert_eq!(found[0].0 + 1, position(&g, labels::QKV_MATMUL));
    }
    let (b, main, weights) = setup(make, Qkv::Bf16, Bfg::Composed);
    let p = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Serialized);
    let (x, _) = activation(&b, &main, &mut Gen::new(4), 3);
    assert_eq!(p.route(&x).unwrap(), QkvRoute::Dense);
    let g = graph_of(&b, &main, &p, &x);
    assert!(quants(&g).is_empty(), "bf16 QKV: a plain GEMM, no quant op");
    assert_eq!(g.ops().iter().filter(|(_, l)| *l == labels::QKV_MATMUL).count(), 1);
}

/// Bad input is an error from the call that names it, and nothing is queued.
pub fn projection_rejects_bad_input<B: Backend>(make: &impl Factory<B>) {
    let (b, main, weights, qkv) = setup_layer(make, Bfg::Composed);
    let p = projection(&b, &weights, ProjectionSchedule::Overlapped, MatrixOverlap::Serialized);
    let launches = |b: &Device<B>| {
        b.instrumentation().log().iter().filter(|e| matches!(e, Entry::Launch { .. })).count()
    };
    let before = launches(&b);
    let wrong_width = b.alloc(DType::BF16, &[3, HIDDEN + 1]).unwrap();
    assert!(matches!(p.forward(&main, &wrong_width), Err(Error::Shape { param: "x", .. })));
    let three_d = b.alloc(DType::BF16, &[1, 3, HIDDEN]).unwrap();
    assert!(matches!(p.forward(&main, &three_d), Err(Error::Shape { param: "x", .. })));
    // MXFP8 quantizes bf16 or f32 only; the dense GEMM takes any float.
    let wrong_dtype = if qkv == Qkv::Bf16 { DType::I32 } else { DType::F16 };
    let wrong = b.alloc(wrong_dtype, &[3, HIDDEN]).unwrap();
    assert!(matches!(p.forward(&main, &wrong), Err(Error::DType { param: "x", .. })));
    let x = b.alloc(DType::BF16, &[3, HIDDEN]).unwrap();
    let other = b.alloc(DType::BF16, &[4, HIDDEN]).unwrap();
    let bufs = p.alloc_buffers(&other).unwrap();
    assert!(matches!(p.forward_into(&main, &x, &bufs), Err(Error::Shape { param: "buffers", .. })));
    let serial = projection(&b, &weights, ProjectionSchedule::Serial, MatrixOverlap::Serialized);
    let mut wrong_plan = p.alloc_buffers(&x).unwrap();
    // Quant buffers where the route has none, or none where it quantizes.
    wrong_plan.quant = match wrong_plan.quant {
        Some(_) => None,
        None => Some((
            b.alloc(DType::E4M3, &[3, HIDDEN]).unwrap(),
            b.alloc(DType::E8M0, &[3, num_blocks(HIDDEN)]).unwrap(),
        )),
    };
    let err = serial.forward_into(&main, &x, &wrong_plan);
    assert!(matches!(err, Err(Error::Param { param: "buffers", .. })), "{err:?}");
    assert_eq!(launches(&b), before, "nothing was queued");

    // Weights that do not fit the dims name the parameter.
    let dims = weights.dims();
    let bad = b.alloc(DType::BF16, &[dims.bfg_width() - 1, HIDDEN]).unwrap();
    let err = ProjectionWeights::new(dims, weights.qkv().clone(), BfgWeight::Composed { w: bad });
    assert!(matches!(err, Err(Error::Shape { param: "bfg.w", .. })), "{err:?}");
    let scale = b.alloc(DType::E8M0, &[dims.qkv_width(), num_blocks(HIDDEN)]).unwrap();
    let data = b.alloc(DType::BF16, &[dims.qkv_width(), HIDDEN]).unwrap();
    let qkv = QkvWeight::Mxfp8 { data, scale, alg: ScaleAlg::OcpFloor };
    let err = ProjectionWeights::new(dims, qkv, weights.bfg().clone());
    assert!(matches!(err, Err(Error::DType { param: "qkv.data", .. })), "{err:?}");
}

/// This module's bodies, each registered for every backend: [`crate::conformance_tests!`] calls
/// this with the backend's factories. A public body missing here fails
/// `conformance::tests::every_body_is_registered`.
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_schedule {
    ($plain:expr, $jittered:expr, $checked:expr) => {
        $crate::conformance_tests!(@tests
            schedule_overlapped_trace_is_the_seeds_sequence => schedule::overlapped_trace_is_the_seeds_sequence(&$checked),
            schedule_aux_stream_is_created_once_per_instance => schedule::aux_stream_is_created_once_per_instance(&$checked),
            schedule_serial_and_overlapped_are_bit_identical => schedule::serial_and_overlapped_are_bit_identical(&$plain),
            schedule_projection_matches_host_computation => schedule::projection_matches_host_computation(&$plain),
            schedule_overlapped_is_hazard_free => schedule::overlapped_schedule_is_hazard_free(&$checked),
            schedule_mutation_drop_record_hidden_ready => schedule::mutation_drop_record_hidden_ready(&$checked),
            schedule_mutation_drop_wait_hidden_ready => schedule::mutation_drop_wait_hidden_ready(&$checked),
            schedule_mutation_drop_record_bfg_projection_ready => schedule::mutation_drop_record_bfg_projection_ready(&$checked),
            schedule_mutation_drop_wait_bfg_projection_ready => schedule::mutation_drop_wait_bfg_projection_ready(&$checked),
            schedule_mutation_drop_record_quant_ready => schedule::mutation_drop_record_quant_ready(&$checked),
            schedule_mutation_drop_wait_quant_ready => schedule::mutation_drop_wait_quant_ready(&$checked),
            schedule_mutation_drop_record_bfg_ready => schedule::mutation_drop_record_bfg_ready(&$checked),
            schedule_mutation_drop_wait_bfg_ready => schedule::mutation_drop_wait_bfg_ready(&$checked),
            schedule_mutation_record_bfg_ready_before_postprocess => schedule::mutation_record_bfg_ready_before_postprocess(&$checked),
            schedule_capture_replays_equal_eager => schedule::capture_replays_equal_eager(&$checked),
            schedule_stress_jittered_overlapped_equals_serial => schedule::stress_jittered_overlapped_equals_serial(&$jittered, 1000),
            schedule_prepare_beta_slices_and_applies_the_sigmoid_once => schedule::prepare_beta_slices_and_applies_the_sigmoid_once(&$checked),
            schedule_postprocess_shapes => schedule::postprocess_shapes(&$checked),
            schedule_mixed_path_passes_preprocessed_beta => schedule::mixed_path_passes_preprocessed_beta(&$plain),
            schedule_dynamic_quant_split_decision => schedule::dynamic_quant_split_decision(&$plain),
            schedule_projection_rejects_bad_input => schedule::projection_rejects_bad_input(&$checked),
        );
    };
}
