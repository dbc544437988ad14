//! `kda plan` end to end (the table, `--tp`, `--svg`, `--timeline-svg`), and `LayerOptions::auto` with the one
//! line `kda run --auto` prints (docs/design/planner.md#layeroptionsauto).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test setup")]

mod common;

use common::{TempDir, kda, stderr, stdout, write_safetensors};
use kda_core::sanitize::Entry;
use kda_model::config::{KdaConfig, Tp};
use kda_model::layer::{BatchShape, LayerOptions, LayerPlan, PLAN_CONFIGS};
use kda_model::plan::chips::Chip;
use kda_model::weights::{LayerWeights, LoadOptions, load_layer};
use kda_reference::{ReferenceBackend, ReferenceOptions};
use kda_testkit::checkpoint::{
    SyntheticCheckpoint, SyntheticSpec, scaled_config, write_checkpoint,
};
use kda_testkit::conformance::layer::{Model, tiny_config};
use safetensors::tensor::Dtype;

/// Layer 0 of a synthetic checkpoint of `config`, rank 0 of `tp` ranks.
fn weights(config: &KdaConfig, tp: usize) -> LayerWeights {
    let checkpoint = SyntheticCheckpoint::new(SyntheticSpec::new(config.clone(), 0));
    let tp = Tp::new(tp, 0).unwrap();
    load_layer(&checkpoint, config, tp, 0, LoadOptions::default()).unwrap().weights
}

fn record(weights: &LayerWeights) -> LayerPlan {
    let options = ReferenceOptions { checked: true, ..ReferenceOptions::default() };
    let b = ReferenceBackend::with_options(options).unwrap();
    LayerPlan::record(&b, &b.new_stream().unwrap(), weights).unwrap()
}

fn tiny() -> KdaConfig {
    scaled_config(&KdaConfig::kimi_k3(), 256, 4, 32)
}

#[test]
fn plan_prints_the_six_configurations_and_a_recommendation() {
    let o = kda(&["plan", "--chip", "910b", "--tokens", "1,1024"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("Ascend 910B") && out.contains("assumed"), "{out}");
    assert!(out.contains("co ser'd") && out.contains("st conc"), "{out}");
    assert!(out.contains("composed 22.02 MB, staged (f_a + f_b shard) 2.23 MB"), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| l.trim_start().starts_with("1024")).collect();
    assert_eq!(rows.len(), 1, "{out}");
    assert!(PLAN_CONFIGS.iter().any(|c| rows[0].ends_with(c.name)), "{out}");
}

#[test]
fn plan_refuses_an_unknown_chip_and_a_tp_that_does_not_divide_the_heads() {
    let o = kda(&["plan", "--chip", "tpu"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--chip"), "{}", stderr(&o));
    let o = kda(&["plan", "--tp", "5"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--tp") && stderr(&o).contains("96 heads"), "{}", stderr(&o));
}

/// `--tp 4` plans rank 0 of four: 24 of K3's 96 heads, and F's weight bytes of that shard.
#[test]
fn plan_tp_gives_the_per_rank_shapes() {
    let o = kda(&["plan", "--chip", "h200", "--tp", "4", "--tokens", "16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let (hidden, head_dim, heads) = (7168usize, 128usize, 96 / 4);
    assert!(out.contains(&format!("hidden {hidden}, {heads} local heads of {head_dim}")), "{out}");
    let lp = heads * head_dim;
    let composed = 2 * lp * hidden;
    let staged = 2 * (head_dim * hidden + lp * head_dim);
    let line = format!(
        "composed {:.2} MB, staged (f_a + f_b shard) {:.2} MB",
        composed as f64 / 1e6,
        staged as f64 / 1e6
    );
    assert!(out.contains(&line), "{line} not in {out}");
    assert!(out.contains("TP4"), "{out}");
}

/// `--timeline-svg` is well-formed and draws one box per op of the recommended configuration's
/// predicted forward, with the op's label.
#[test]
fn plan_timeline_svg_draws_one_box_per_predicted_op() {
    let dir = TempDir::new("plan-timeline-svg");
    let path = dir.path("plan.svg");
    let args =
        ["plan", "--chip", "910b", "--tokens", "16", "--timeline-svg", path.to_str().unwrap()];
    let o = kda(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&path).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("well-formed SVG");
    let mut drawn: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("rect") && n.attribute("class") == Some("op"))
        .map(|n| n.attribute("data-label").unwrap().to_string())
        .collect();
    // The recommended configuration, from the same plan computed here through the library.
    let plan = record(&weights(&KdaConfig::kimi_k3(), 8));
    let choice = plan.choose(&Chip::Ascend910B.figures(), BatchShape::Prefill, 16).unwrap();
    let forward = plan
        .forwards
        .iter()
        .find(|f| f.config == choice.config() && f.shape == BatchShape::Prefill)
        .unwrap();
    let mut launched: Vec<String> = forward.logs[0]
        .iter()
        .filter_map(|e| match e {
            Entry::Launch { label, .. } => Some(label.clone()),
            _ => None,
        })
        .collect();
    assert!(text.contains(choice.config().name), "the title names the configuration");
    assert!(launched.len() > 10, "the whole layer: {launched:?}");
    drawn.sort();
    launched.sort();
    assert_eq!(drawn, launched);
}

/// `(x, y)` of each vertex of a polyline.
fn polyline(node: roxmltree::Node<'_, '_>) -> Vec<(f64, f64)> {
    node.attribute("points")
        .unwrap()
        .split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').unwrap();
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

fn number(node: roxmltree::Node<'_, '_>, name: &str) -> f64 {
    node.attribute(name).unwrap().parse().unwrap()
}

/// `--svg` draws the table: one line per configuration with one vertex per T in increasing T,
/// log axes on both sides, the vertical order at each T that of the predicted times, and the
/// recommended configuration ringed; all checked against the plan computed here through the
/// library.
#[test]
fn plan_svg_draws_time_against_t_per_configuration_on_log_axes() {
    let dir = TempDir::new("plan-svg");
    let path = dir.path("plan.svg");
    // Unsorted, and equal ratios (16x) between neighbours once sorted.
    let tokens = [256usize, 1, 4096, 16];
    let o = kda(&[
        "plan",
        "--chip",
        "910b",
        "--tokens",
        "256,1,4096,16",
        "--svg",
        path.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&path).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("well-formed SVG");
    let title = doc.descendants().find(|n| n.attribute("class") == Some("title")).unwrap();
    let title = title.text().unwrap();
    assert!(
        title.contains("Ascend 910B") && title.contains("TP8") && title.contains("prefill"),
        "{title}"
    );

    let plan = record(&weights(&KdaConfig::kimi_k3(), 8));
    let figures = Chip::Ascend910B.figures();
    let mut sorted = tokens;
    sorted.sort_unstable();
    let choices: Vec<_> =
        sorted.iter().map(|&t| plan.choose(&figures, BatchShape::Prefill, t).unwrap()).collect();
    let time = |config: &str, i: usize| {
        let p = choices[i].predictions.iter().find(|p| p.config.name == config).unwrap();
        p.simulation.makespan
    };

    let lines: Vec<_> =
        doc.descendants().filter(|n| n.attribute("class") == Some("series-line")).collect();
    let names: Vec<&str> = lines.iter().map(|n| n.attribute("data-config").unwrap()).collect();
    assert_eq!(names, PLAN_CONFIGS.iter().map(|c| c.name).collect::<Vec<_>>());
    let legend: Vec<&str> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("legend-entry"))
        .map(|n| n.text().unwrap())
        .collect();
    assert_eq!(legend, names);
    let vertices: Vec<Vec<(f64, f64)>> = lines.iter().map(|&n| polyline(n)).collect();
    for (name, v) in names.iter().zip(&vertices) {
        assert_eq!(v.len(), tokens.len(), "{name}: one vertex per T");
        assert!(v.windows(2).all(|w| w[0].0 < w[1].0), "{name}: x increases with T: {v:?}");
        // Log x: 1, 16, 256, 4096 are equally spaced.
        let gaps: Vec<f64> = v.windows(2).map(|w| w[1].0 - w[0].0).collect();
        assert!(gaps.iter().all(|g| (g - gaps[0]).abs() < 0.02), "{name}: {gaps:?}");
        // Log y: the drop between two vertices is proportional to the log of their time ratio,
        // with the same factor for every pair (fitted on the two ends).
        let k = (v[0].1 - v[3].1) / (time(name, 3) / time(name, 0)).ln();
        assert!(k > 0.0, "{name}: longer times are drawn higher");
        for i in 1..3 {
            let expected = v[0].1 - k * (time(name, i) / time(name, 0)).ln();
            assert!((v[i].1 - expected).abs() < 0.05, "{name} at T = {}: {v:?}", sorted[i]);
        }
    }
    // At each T, the vertical order of the lines is the order of the predicted times
    // (SVG y grows downwards: a longer time is a smaller y).
    for i in 0..sorted.len() {
        for a in 0..names.len() {
            for b in 0..names.len() {
                let (ta, tb) = (time(names[a], i), time(names[b], i));
                if ta > tb * 1.001 {
                    assert!(
                        vertices[a][i].1 < vertices[b][i].1,
                        "T = {}: {} above {}",
                        sorted[i],
                        names[a],
                        names[b]
                    );
                }
            }
        }
    }
    // The same log factor on both decade grids: a decade of time is as many pixels as
    // ln(10) times the fitted factor, and the decades are evenly spaced.
    let decade_ys: Vec<f64> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("y-decade"))
        .map(|n| number(n, "y1"))
        .collect();
    assert!(decade_ys.len() >= 2, "{decade_ys:?}");
    let step = decade_ys[0] - decade_ys[1];
    assert!(decade_ys.windows(2).all(|w| (w[0] - w[1] - step).abs() < 0.02), "{decade_ys:?}");
    let v = &vertices[0];
    let k = (v[0].1 - v[3].1) / (time(names[0], 3) / time(names[0], 0)).ln();
    assert!((k * 10f64.ln() - step).abs() < 0.05, "{k} per e-fold against {step} per decade");
    // A tick at each T, on its vertices' x.
    let ticks: Vec<(usize, f64)> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("t-tick"))
        .map(|n| (n.attribute("data-tokens").unwrap().parse().unwrap(), number(n, "x1")))
        .collect();
    assert_eq!(ticks.iter().map(|t| t.0).collect::<Vec<_>>(), sorted);
    for (i, (_, x)) in ticks.iter().enumerate() {
        assert!((x - v[i].0).abs() < 0.01, "{ticks:?} {v:?}");
    }
    // The recommended configuration at each T is ringed, on its vertex.
    let rings: Vec<_> =
        doc.descendants().filter(|n| n.attribute("class") == Some("recommended")).collect();
    assert_eq!(rings.len(), sorted.len());
    for (i, ring) in rings.iter().enumerate() {
        let chosen = choices[i].config().name;
        assert_eq!(ring.attribute("data-config"), Some(chosen), "T = {}", sorted[i]);
        let line = names.iter().position(|n| *n == chosen).unwrap();
        let (x, y) = vertices[line][i];
        assert!((number(*ring, "cx") - x).abs() < 0.01 && (number(*ring, "cy") - y).abs() < 0.01);
    }
}

/// `auto` takes the configuration with the smallest predicted time, and its options are that
/// configuration's; its line names what it picked and the predictions behind it.
#[test]
fn auto_picks_the_fastest_predicted_configuration() {
    let plan = record(&weights(&tiny(), 1));
    assert_eq!(plan.forwards.len(), PLAN_CONFIGS.len() * BatchShape::ALL.len());
    for chip in Chip::ALL {
        let figures = chip.figures();
        for shape in BatchShape::ALL {
            for tokens in [1, 64, 4096] {
                let (options, choice) = LayerOptions::auto(&plan, &figures, shape, tokens).unwrap();
                assert_eq!(choice.predictions.len(), PLAN_CONFIGS.len());
                let best = choice.predictions[choice.chosen].simulation.makespan;
                for p in &choice.predictions {
                    assert!(best <= p.simulation.makespan, "{chip:?} {shape:?} T={tokens}");
                }
                assert_eq!(options, choice.config().options());
                let line = choice.explain();
                assert!(line.contains(choice.config().name), "{line}");
                assert!(line.contains(&format!("predicted {:.1} µs", best * 1e6)), "{line}");
                assert!(!line.contains('\n'), "{line}");
            }
        }
    }
    // Bigger batches predict longer forwards.
    let figures = Chip::H200.figures();
    let at = |t| {
        plan.choose(&figures, BatchShape::Prefill, t).unwrap().predictions[0].simulation.makespan
    };
    assert!(at(4096) > at(64));
}

#[test]
fn auto_needs_a_checked_device_to_record_on() {
    let b = ReferenceBackend::new();
    let err = LayerPlan::record(&b, &b.new_stream().unwrap(), &weights(&tiny(), 1)).unwrap_err();
    assert!(err.to_string().contains("checked mode"), "{err}");
}

#[test]
fn run_auto_prints_the_choice_in_one_line() {
    let o = kda(&[
        "run",
        "--preset",
        "tiny",
        "--requests",
        "1",
        "--tokens",
        "16",
        "--decode-steps",
        "1",
        "--auto",
        "h200",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().filter(|l| l.trim_start().starts_with("plan: ")).collect();
    assert_eq!(lines.len(), 1, "{out}");
    let line = lines[0];
    assert!(line.contains("NVIDIA H200") && line.contains("prefill of 16 tokens"), "{line}");
    assert!(line.contains("predicted") && line.contains("next best"), "{line}");
    let chosen = PLAN_CONFIGS.iter().find(|c| line.contains(&format!("plan: {} on", c.name)));
    assert!(chosen.is_some(), "{line}");
}

#[test]
fn auto_on_an_empty_plan_names_the_plan() {
    let figures = Chip::H200.figures();
    let err =
        LayerOptions::auto(&LayerPlan::default(), &figures, BatchShape::Decode, 8).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("plan") && text.contains("decode"), "{text}");
}

/// `kda layer --auto` prints the plan's choice for the input's live tokens in one line and runs
/// that configuration's schedule.
#[test]
fn layer_auto_prints_the_choice_and_runs_its_schedule() {
    let dir = TempDir::new("plan-layer-auto");
    let ckpt = dir.path("ckpt");
    let config = tiny_config(Model::K3);
    let spec = SyntheticSpec::new(config.clone(), 5);
    write_checkpoint(&ckpt, &SyntheticCheckpoint::new(spec), 1).unwrap();
    let (rows, hidden) = (6usize, config.hidden_size);
    let x: Vec<u8> = (0..rows * hidden)
        .flat_map(|i| half::bf16::from_f32((i % 7) as f32 * 0.1 - 0.3).to_le_bytes())
        .collect();
    let qsl: Vec<u8> = [0i32, 6].iter().flat_map(|v| v.to_le_bytes()).collect();
    let input = dir.path("in.safetensors");
    write_safetensors(
        &input,
        &[
            ("hidden_states".to_string(), Dtype::BF16, vec![rows, hidden], x),
            ("query_start_loc".to_string(), Dtype::I32, vec![2], qsl),
        ],
    );
    let output = dir.path("out.safetensors");
    let o = kda(&[
        "layer",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
        "--auto",
        "910b",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let line = out.lines().find(|l| l.starts_with("plan: ")).unwrap_or_default();
    assert!(line.contains("Ascend 910B") && line.contains("prefill of 6 tokens"), "{out}");
    let chosen = PLAN_CONFIGS.iter().find(|c| line.starts_with(&format!("plan: {} on", c.name)));
    let chosen = chosen.unwrap_or_else(|| panic!("no configuration named in {line}"));
    let schedule = format!("{:?} schedule", chosen.schedule).to_lowercase();
    assert!(out.contains(&schedule), "{schedule} not in {out}");
    assert!(output.exists());
}

/// `--recording` calibrates the host from the checked-in runs and prints predicted against
/// measured; the measured column is each run's median round.
#[test]
fn plan_recording_prints_predicted_against_measured() {
    let path =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../kda-model/tests/data/plan_host_prefill.json");
    let o = kda(&["plan", "--recording", path, "--tokens", "16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let rec: kda_model::plan::Recording =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for run in &rec.runs {
        let mut rounds = run.rounds_s.clone();
        rounds.sort_by(f64::total_cmp);
        let median = rounds[rounds.len() / 2];
        let row = out
            .lines()
            .find(|l| {
                let mut words = l.split_whitespace();
                words.next() == Some(&run.tokens.to_string()) && l.contains(&run.config)
            })
            .unwrap_or_else(|| panic!("no row for {} at {}: {out}", run.config, run.tokens));
        assert!(row.contains(&format!("{:.2} ms", median * 1e3)), "{row}");
    }
    assert!(out.contains("streams share units") && out.contains("calibrated op kinds"), "{out}");
}
