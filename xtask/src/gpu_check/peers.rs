//! The side-by-side comparison of `gpu-check`: kda's kernels against their peers on the same
//! GPU in the same run, interleaved, repeated, with medians.
//!
//! Two measuring servers run at once, each holding its data on the device: kda's
//! (`gpu_bench --serve`) and the peers' (`peer_server.py`: flash-linear-attention's Triton
//! `chunk_kda` from the bundled `fla-core` wheel, and torch's bf16 matmul, on the machine's own
//! torch and Triton). Each answers one request at a time, `<id> <case> <target ms>`, with the
//! mean time per call over as many calls as fill the target (fixed at its first, warm-up,
//! request), timed with CUDA events, its reply tagged with the request's id. This side asks:
//! one warm-up round, then rounds in a shuffled order (seeded), kda and its peer back to back
//! for each case, their order alternating by round; so both see the same clocks and thermals,
//! and a median over rounds drops the outliers. The result is one JSON object and `peers.md`,
//! a table for the run's closing note, both rewritten after every round.
//!
//! Each request has its own time limit (longer in the warm-up round, where Triton compiles and
//! autotunes). A request given up on is still running on its server: its reply, when it comes,
//! is recognised by its id and dropped, never taken as the answer to a later request; the next
//! request first waits for it, and a server that never answers is given up on.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use super::json_string;
use super::stream::Log;

/// The peers' wheels: pure Python, carried in the bundle (the GPU machine has no network).
pub const WHEELS: [&str; 2] = ["fla-core", "einops"];

/// The peers' server, run with the machine's Python.
const PEER_SERVER: &str = include_str!("../../../crates/kda-cuda/peers/peer_server.py");

/// Each measurement fills about this long.
const TARGET_MS: f64 = 40.0;

/// How long one request may take in the warm-up round (a case's first: inputs made, Triton's
/// compiles and autotuning, kda's graph captures) and in the timed rounds.
/// How long kda's server may take to say it is ready (the peers' half as long again).
const STARTUP: Duration = Duration::from_secs(60);

pub const REQUEST_LIMITS: (Duration, Duration) = (Duration::from_secs(90), Duration::from_secs(20));

/// How to run the comparison.
#[derive(Debug)]
pub struct Setup {
    /// kda's server: program and its leading arguments (`--serve` is added).
    pub kda: (String, Vec<String>),
    pub env: Vec<(String, String)>,
    /// Where the peers' wheels are.
    pub wheels: PathBuf,
    /// Where `peers.md` goes.
    pub out_dir: PathBuf,
    pub quick: bool,
    /// The whole comparison's limit.
    pub limit: Duration,
    /// One request's limits: in the warm-up round, and in the timed rounds.
    pub request_limits: (Duration, Duration),
}

/// The comparison's outcome (so far, while it runs).
#[derive(Debug)]
pub struct Comparison {
    pub json: String,
    /// The table for the closing note (`peers.md`).
    pub table: String,
    /// Every round ran.
    pub complete: bool,
    /// What was missing or went wrong (empty when nothing).
    pub note: String,
}

/// The wheels of [`WHEELS`] found in `dir`.
pub fn wheels(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().replace('_', "-"));
            name.is_some_and(|n| n.ends_with(".whl") && WHEELS.iter().any(|w| n.starts_with(w)))
        })
        .collect();
    found.sort();
    found
}

/// What one case measures, for the table's derived figures.
#[derive(Copy, Clone, Debug, PartialEq)]
enum Work {
    /// Tokens per call: tokens/s.
    Tokens(f64),
    /// Floating-point operations per call: TFLOP/s and the fraction of the measured peak.
    Flops(f64),
    /// Bytes moved per call: GB/s.
    Bytes(f64),
    /// A latency: µs per call.
    Latency,
}

/// One row of the comparison: kda's case, its peer's (if any), and what it measures.
#[derive(Clone, Debug, PartialEq)]
struct Case {
    group: &'static str,
    kda: String,
    peer: Option<String>,
    work: Work,
}

/// The measured peak: a square bf16 GEMM of this size on both sides.
const PEAK: usize = 8192;

/// Every case, in table order. `quick` keeps T ∈ {1, 128} and fewer layer figures.
fn cases(quick: bool) -> Vec<Case> {
    let tokens: &[usize] = if quick { &[1, 128] } else { &[1, 16, 128, 1024] };
    let (hidden, qkv, bfg) = (7168usize, 4608usize, 3084usize);
    let mut all = Vec::new();
    for (t, h) in [(8192usize, 96usize), (8192, 12)] {
        let id = format!("chunk:{t}:{h}:128");
        let work = Work::Tokens(t as f64);
        all.push(Case { group: "chunked prefill", kda: id.clone(), peer: Some(id), work });
    }
    let gemm = |m: usize, n: usize, k: usize| {
        let id = format!("gemm:{m}:{n}:{k}");
        let work = Work::Flops(2.0 * (m * n * k) as f64);
        Case { group: "projection GEMM (bf16)", kda: id.clone(), peer: Some(id), work }
    };
    all.push(Case { group: "measured peak (bf16 GEMM)", ..gemm(PEAK, PEAK, PEAK) });
    for &t in tokens {
        all.push(gemm(t, qkv, hidden));
        all.push(gemm(t, bfg, hidden));
    }
    for path in ["exact", "fast"] {
        let (m, n, k) = (1024usize, qkv, hidden);
        let work = Work::Flops(2.0 * (m * n * k) as f64);
        all.push(Case {
            group: "MXFP8 GEMM",
            kda: format!("mx_gemm:{m}:{n}:{k}:{path}"),
            peer: None,
            work,
        });
    }
    let quant = Work::Bytes((1024 * hidden * 2 + 1024 * hidden + 1024 * hidden / 32) as f64);
    all.push(Case {
        group: "DynamicQuant",
        kda: format!("quant:1024:{hidden}"),
        peer: None,
        work: quant,
    });
    for &t in tokens {
        for schedule in ["serial", "overlapped_serialized", "overlapped_concurrent"] {
            for graph in ["eager", "graph"] {
                all.push(Case {
                    group: "projection schedule (K3 TP8, MXFP8 QKV)",
                    kda: format!("schedule:{schedule}:{t}:{graph}"),
                    peer: None,
                    work: Work::Latency,
                });
            }
        }
    }
    let prefill = Work::Tokens(4.0 * 1024.0);
    all.push(Case {
        group: "layer (K3 TP8)",
        kda: "layer_prefill:4:1024:eager".into(),
        peer: None,
        work: prefill,
    });
    for graph in ["eager", "graph"] {
        all.push(Case {
            group: "layer (K3 TP8)",
            kda: format!("layer_decode:32:{graph}"),
            peer: None,
            work: Work::Latency,
        });
    }
    all
}

/// Why a request has no answer.
#[derive(Debug, PartialEq)]
enum Failure {
    /// No answer within its limit: the request may still be running there.
    Late(String),
    /// The server answered with an error, an answer this side cannot read, or is gone.
    Failed(String),
}

impl Failure {
    fn message(self) -> String {
        match self {
            Failure::Late(m) | Failure::Failed(m) => m,
        }
    }
}

/// A measuring server: a child speaking the line protocol on stdin/stdout, its stderr (and
/// any stdout line outside the protocol) going to the log.
struct Server {
    name: &'static str,
    child: Child,
    stdin: ChildStdin,
    replies: Receiver<String>,
    /// The cases it announced it can measure (`@ready case-kind ...`).
    kinds: Vec<String>,
    log: Log,
    /// The last request's id.
    last_id: u64,
    /// A request given up on whose reply has not come yet (the server is still on it).
    behind: Option<u64>,
    /// Why it is no longer asked anything.
    stuck: Option<String>,
}

impl Server {
    fn start(
        log: &Log,
        name: &'static str,
        program: &str,
        args: &[String],
        env: &[(String, String)],
        ready_within: Duration,
    ) -> Result<Self, String> {
        log.line(&format!("==> {name}: {program} {}", args.join(" ")));
        let mut command = Command::new(program);
        command
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let mut child =
            command.spawn().map_err(|e| format!("{name}: cannot start {program}: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let (tx, replies) = channel();
        if let Some(out) = child.stdout.take() {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    match line.strip_prefix('@') {
                        Some(reply) => {
                            if tx.send(reply.to_string()).is_err() {
                                break;
                            }
                        }
                        None => log.line(&format!("[{name}] {line}")),
                    }
                }
            });
        }
        if let Some(err) = child.stderr.take() {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    log.line(&format!("[{name}] {line}"));
                }
            });
        }
        let mut server = Self {
            name,
            child,
            stdin,
            replies,
            kinds: Vec::new(),
            log: log.clone(),
            last_id: 0,
            behind: None,
            stuck: None,
        };
        let ready = server.reply(ready_within)?;
        let kinds = ready.strip_prefix("ready").ok_or_else(|| format!("{name}: said {ready:?}"))?;
        server.kinds = kinds.split_whitespace().map(String::from).collect();
        if server.kinds.is_empty() {
            return Err(format!("{name}: can measure nothing (see the log)"));
        }
        Ok(server)
    }

    fn reply(&mut self, within: Duration) -> Result<String, String> {
        match self.replies.recv_timeout(within) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => {
                Err(format!("{}: no answer within {:.0} s", self.name, within.as_secs_f64()))
            }
            Err(RecvTimeoutError::Disconnected) => Err(format!("{}: exited", self.name)),
        }
    }

    fn measures(&self, case: &str) -> bool {
        let kind = case.split(':').next().unwrap_or_default();
        self.kinds.iter().any(|k| k == kind)
    }

    /// Milliseconds per call of `case`, asked as request `id`, answered within `within`.
    fn measure(&mut self, case: &str, within: Duration) -> Result<f64, Failure> {
        let deadline = Instant::now() + within;
        if let Some(why) = &self.stuck {
            return Err(Failure::Failed(why.clone()));
        }
        // A request given up on is still running there: its reply comes before any other.
        if let Some(late) = self.behind {
            match self.answer(late, deadline) {
                Ok(line) => self.log.line(&format!(
                    "[{}] late reply to request #{late} dropped: {line}",
                    self.name
                )),
                Err(e) => {
                    let why =
                        format!("{}: still busy with request #{late}: {}", self.name, e.message());
                    self.stuck = Some(why.clone());
                    return Err(Failure::Failed(why));
                }
            }
            self.behind = None;
        }
        self.last_id += 1;
        let id = self.last_id;
        writeln!(self.stdin, "{id} {case} {TARGET_MS}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| Failure::Failed(format!("{}: {e}", self.name)))?;
        let reply = match self.answer(id, deadline) {
            Ok(reply) => reply,
            Err(Failure::Late(e)) => {
                self.behind = Some(id);
                return Err(Failure::Late(e));
            }
            Err(e) => return Err(e),
        };
        let unexpected =
            || Failure::Failed(format!("{}: unexpected reply {reply:?} to {case}", self.name));
        let mut words = reply.splitn(4, ' ');
        match (words.next(), words.next(), words.next(), words.next()) {
            (Some("result"), _, Some(c), Some(ms)) if c == case => ms
                .trim()
                .parse()
                .map_err(|_| Failure::Failed(format!("{}: bad time in {reply:?}", self.name))),
            (Some("error"), _, Some(c), message) if c == case => {
                Err(Failure::Failed(message.unwrap_or("error").to_string()))
            }
            _ => Err(unexpected()),
        }
    }

    /// The reply to request `id` (the whole line after `@`), dropping (and logging) replies to
    /// earlier requests that come first.
    fn answer(&mut self, id: u64, deadline: Instant) -> Result<String, Failure> {
        loop {
            let within = deadline.saturating_duration_since(Instant::now());
            let line = self.reply(within).map_err(|e| {
                if e.ends_with("exited") { Failure::Failed(e) } else { Failure::Late(e) }
            })?;
            match line.split_whitespace().nth(1).and_then(|w| w.parse::<u64>().ok()) {
                Some(rid) if rid == id => return Ok(line),
                Some(rid) if rid < id => {
                    self.log.line(&format!(
                        "[{}] late reply to request #{rid} dropped: {line}",
                        self.name
                    ));
                }
                _ => {
                    return Err(Failure::Failed(format!(
                        "{}: reply {line:?} is not to request #{id}",
                        self.name
                    )));
                }
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        #[cfg(unix)]
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Each side's samples of one case, and the first error.
#[derive(Debug, Default)]
struct Samples {
    kda: Vec<f64>,
    peer: Vec<f64>,
    error: Option<String>,
}

/// A seeded shuffle (xorshift), so a rerun asks in the same orders.
fn shuffle<T>(items: &mut [T], seed: &mut u64) {
    for i in (1..items.len()).rev() {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        items.swap(i, (*seed % (i as u64 + 1)) as usize);
    }
}

fn median(samples: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 { s[n / 2] } else { 0.5 * (s[n / 2 - 1] + s[n / 2]) })
}

/// Unpack `wheels` (zip files) into `into` with Python's zipfile, for `PYTHONPATH`.
fn unpack(wheels: &[PathBuf], into: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(into);
    std::fs::create_dir_all(into).map_err(|e| format!("{}: {e}", into.display()))?;
    let script =
        "import sys, zipfile\nfor w in sys.argv[2:]: zipfile.ZipFile(w).extractall(sys.argv[1])";
    let mut args = vec!["-c".to_string(), script.to_string(), into.to_string_lossy().into_owned()];
    args.extend(wheels.iter().map(|w| w.to_string_lossy().into_owned()));
    let status =
        Command::new("python3").args(&args).status().map_err(|e| format!("python3: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("unpacking {wheels:?} failed")) }
}

/// Start the peers' server (Python, with the wheels on its path), or say why not.
fn start_peer(log: &Log, setup: &Setup, within: Duration) -> Result<Server, String> {
    let found = wheels(&setup.wheels);
    let site = std::env::temp_dir().join(format!("kda-peers-{}", std::process::id()));
    if found.is_empty() {
        log.line(&format!(
            "peers: no wheels in {} (fla's chunk_kda is skipped)",
            setup.wheels.display()
        ));
    } else {
        unpack(&found, &site)?;
    }
    let script = site.join("peer_server.py");
    std::fs::create_dir_all(&site).map_err(|e| e.to_string())?;
    std::fs::write(&script, PEER_SERVER).map_err(|e| format!("{}: {e}", script.display()))?;
    let mut env = setup.env.clone();
    let path = std::env::var("PYTHONPATH").unwrap_or_default();
    let path = if path.is_empty() {
        site.display().to_string()
    } else {
        format!("{}:{path}", site.display())
    };
    env.push(("PYTHONPATH".into(), path));
    let args = vec![script.to_string_lossy().into_owned()];
    Server::start(log, "peer", "python3", &args, &env, within)
}

/// Run the comparison (see the module docs) within `setup.limit`. After every round the
/// figures so far are written (`peers.md`, `gpu-comparison.json` in `setup.out_dir`) and handed
/// to `progress`, so a run cut short keeps what it measured.
pub fn compare(
    log: &Log,
    setup: &Setup,
    progress: &mut dyn FnMut(&Comparison),
) -> Result<Comparison, String> {
    let deadline = Instant::now() + setup.limit;
    let left = || deadline.saturating_duration_since(Instant::now());
    let mut kda_args = setup.kda.1.clone();
    kda_args.push("--serve".into());
    let mut kda =
        Server::start(log, "kda", &setup.kda.0, &kda_args, &setup.env, STARTUP.min(left()))?;
    let mut notes = Vec::new();
    // torch's import and CUDA start take a while on a fresh machine.
    let mut peer = match start_peer(log, setup, (STARTUP + STARTUP / 2).min(left())) {
        Ok(p) => Some(p),
        Err(e) => {
            notes.push(format!("no peer server: {e}"));
            None
        }
    };
    let all = cases(setup.quick);
    let mut samples: Vec<Samples> = all.iter().map(|_| Samples::default()).collect();
    let rounds = if setup.quick { 3 } else { 5 };
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut done = 0;
    // Round 0 warms up (Triton's compiles and autotuning, kda's graph instantiation); it is
    // not kept, and a request that runs past its limit there only warms up longer.
    'rounds: for round in 0..=rounds {
        let mut order: Vec<usize> = (0..all.len()).collect();
        if round > 0 {
            shuffle(&mut order, &mut seed);
        }
        let limit = if round == 0 { setup.request_limits.0 } else { setup.request_limits.1 };
        for &i in &order {
            let case = &all[i];
            if samples[i].error.is_some() {
                continue;
            }
            let peer_case =
                case.peer.as_ref().filter(|c| peer.as_ref().is_some_and(|p| p.measures(c)));
            let kda_first = round % 2 == 0;
            for side in [kda_first, !kda_first] {
                if left().is_zero() {
                    notes.push(format!("stopped at the time limit in round {round}"));
                    break 'rounds;
                }
                let within = limit.min(left());
                let got = match (side, peer_case, peer.as_mut()) {
                    (true, _, _) => kda.measure(&case.kda, within),
                    (false, Some(c), Some(p)) => p.measure(c, within),
                    _ => continue,
                };
                let who = if side { "kda" } else { "peer" };
                match got {
                    Ok(ms) if round > 0 => {
                        if side {
                            samples[i].kda.push(ms)
                        } else {
                            samples[i].peer.push(ms)
                        }
                    }
                    Ok(_) => {}
                    Err(Failure::Late(e)) if round == 0 => {
                        log.line(&format!(
                            "compare: {who} {}: warm-up past its limit: {e}",
                            case.kda
                        ));
                    }
                    Err(e) => {
                        let e = e.message();
                        log.line(&format!("compare: {who} {}: {e}", case.kda));
                        let e = if e.starts_with(who) { e } else { format!("{who}: {e}") };
                        samples[i].error = Some(e);
                    }
                }
            }
        }
        done = round;
        if round > 0 {
            let so_far = summarise(&all, &samples, (done, rounds), &notes, peer.is_some());
            write_out(setup, &so_far);
            progress(&so_far);
        }
    }
    if peer.is_none() {
        notes.push("peer figures missing (see the log)".into());
    }
    let errors = samples.iter().filter(|s| s.error.is_some()).count();
    if errors > 0 {
        notes.push(format!("{errors} case(s) failed (see the rows and the log)"));
    }
    let comparison = summarise(&all, &samples, (done, rounds), &notes, peer.is_some());
    write_out(setup, &comparison);
    drop(peer);
    drop(kda);
    Ok(comparison)
}

/// `peers.md` and `gpu-comparison.json` in the output folder (best effort: the report holds
/// the same).
fn write_out(setup: &Setup, c: &Comparison) {
    let _ = std::fs::write(setup.out_dir.join("peers.md"), &c.table);
    let _ = std::fs::write(setup.out_dir.join("gpu-comparison.json"), &c.json);
}

/// The comparison as it stands after `done` of `planned` rounds.
fn summarise(
    all: &[Case],
    samples: &[Samples],
    (done, planned): (usize, usize),
    notes: &[String],
    peer_present: bool,
) -> Comparison {
    let peak = |side: fn(&Samples) -> &Vec<f64>| {
        let i = all.iter().position(|c| c.kda == format!("gemm:{PEAK}:{PEAK}:{PEAK}"))?;
        let ms = median(side(&samples[i]))?;
        Some(2.0 * (PEAK as f64).powi(3) / (ms * 1e-3))
    };
    let (kda_peak, peer_peak) = (peak(|s| &s.kda), peak(|s| &s.peer));
    let rows: Vec<Row> =
        all.iter().zip(samples).map(|(case, s)| Row::new(case, s, kda_peak)).collect();
    let table = markdown(&rows, done, kda_peak, peer_peak);
    let errors = samples.iter().filter(|s| s.error.is_some()).count();
    let complete = done == planned && errors == 0 && peer_present;
    let note = notes.join("; ");
    let json = format!(
        "{{ \"rounds\": {done}, \"rounds_planned\": {planned}, \"target_ms\": {TARGET_MS}, \
         \"measured_peak_tflops\": {{ \"kda_cublas\": {}, \"torch\": {} }}, \"rows\": [\n{}\n  ], \
         \"table\": {}, \"notes\": {} }}",
        num(kda_peak.map(|f| f / 1e12)),
        num(peer_peak.map(|f| f / 1e12)),
        rows.iter().map(Row::json).collect::<Vec<_>>().join(",\n"),
        json_string(&table),
        json_string(&note),
    );
    Comparison { json, table, complete, note }
}

fn num(x: Option<f64>) -> String {
    x.filter(|v| v.is_finite()).map_or("null".into(), |v| format!("{v:.6}"))
}

/// One case's medians and derived figures.
#[derive(Debug)]
struct Row {
    group: &'static str,
    case: String,
    kda_ms: Option<f64>,
    peer_ms: Option<f64>,
    kda_range: Option<(f64, f64)>,
    samples: usize,
    /// kda's derived figure and its unit.
    figure: Option<(f64, &'static str)>,
    /// Fraction of kda's measured GEMM peak (GEMM-like cases).
    of_peak: Option<f64>,
    error: Option<String>,
}

impl Row {
    fn new(case: &Case, s: &Samples, peak: Option<f64>) -> Self {
        let kda_ms = median(&s.kda);
        let range = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (lo <= hi).then_some((lo, hi))
        };
        let figure = kda_ms.map(|ms| match case.work {
            Work::Tokens(n) => (n / (ms * 1e-3), "tokens/s"),
            Work::Flops(f) => (f / (ms * 1e-3) / 1e12, "TFLOP/s"),
            Work::Bytes(b) => (b / (ms * 1e-3) / 1e9, "GB/s"),
            Work::Latency => (ms * 1e3, "µs"),
        });
        let of_peak = match (case.work, kda_ms, peak) {
            (Work::Flops(f), Some(ms), Some(p)) => Some(f / (ms * 1e-3) / p),
            _ => None,
        };
        Self {
            group: case.group,
            case: case.kda.clone(),
            kda_ms,
            peer_ms: median(&s.peer),
            kda_range: range(&s.kda),
            samples: s.kda.len(),
            figure,
            of_peak,
            error: s.error.clone(),
        }
    }

    fn json(&self) -> String {
        format!(
            "    {{ \"group\": {}, \"case\": {}, \"kda_ms\": {}, \"kda_min_ms\": {}, \"kda_max_ms\": {}, \
             \"peer_ms\": {}, \"kda_over_peer\": {}, \"figure\": {}, \"unit\": {}, \
             \"fraction_of_measured_peak\": {}, \"samples\": {}, \"error\": {} }}",
            json_string(self.group),
            json_string(&self.case),
            num(self.kda_ms),
            num(self.kda_range.map(|r| r.0)),
            num(self.kda_range.map(|r| r.1)),
            num(self.peer_ms),
            num(self.kda_ms.zip(self.peer_ms).map(|(k, p)| k / p)),
            num(self.figure.map(|f| f.0)),
            self.figure.map_or("null".into(), |f| json_string(f.1)),
            num(self.of_peak),
            self.samples,
            self.error.as_deref().map_or("null".into(), json_string),
        )
    }
}

/// The table for the closing note.
fn markdown(rows: &[Row], rounds: usize, kda_peak: Option<f64>, peer_peak: Option<f64>) -> String {
    let ms = |x: Option<f64>| x.map_or("–".into(), |v| format!("{v:.4}"));
    let mut out = format!(
        "Medians of {rounds} interleaved rounds (CUDA events). Measured bf16 GEMM peak \
         ({PEAK}³): kda/cuBLAS {} TFLOP/s, torch {} TFLOP/s.\n\n\
         | group | case | kda ms | peer ms | kda / peer | kda figure | of peak |\n\
         |---|---|---|---|---|---|---|\n",
        kda_peak.map_or("–".into(), |p| format!("{:.0}", p / 1e12)),
        peer_peak.map_or("–".into(), |p| format!("{:.0}", p / 1e12)),
    );
    for r in rows {
        let ratio = r.kda_ms.zip(r.peer_ms).map_or("–".into(), |(k, p)| format!("{:.2}", k / p));
        let figure = match (&r.error, r.figure) {
            (Some(e), _) => format!("error: {}", e.replace('|', "/")),
            (None, Some((v, unit))) => format!("{v:.1} {unit}"),
            (None, None) => "–".into(),
        };
        let of_peak = r.of_peak.map_or("–".into(), |f| format!("{:.0} %", 100.0 * f));
        out.push_str(&format!(
            "| {} | `{}` | {} | {} | {ratio} | {figure} | {of_peak} |\n",
            r.group,
            r.case,
            ms(r.kda_ms),
            ms(r.peer_ms)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_pair_kda_with_its_peers_where_there_is_one() {
        let all = cases(false);
        let peered: Vec<&str> =
            all.iter().filter(|c| c.peer.is_some()).map(|c| c.kda.as_str()).collect();
        assert!(peered.contains(&"chunk:8192:96:128") && peered.contains(&"gemm:1024:4608:7168"));
        assert!(peered.contains(&"gemm:8192:8192:8192"));
        let schedules = all.iter().filter(|c| c.kda.starts_with("schedule:")).count();
        assert_eq!(schedules, 3 * 4 * 2, "three schedules x four T x eager/graph");
        assert!(cases(true).len() < all.len());
    }

    #[test]
    fn medians_ignore_what_is_not_finite() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, f64::NAN, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn a_shuffle_is_a_permutation_and_repeatable() {
        let (mut a, mut b) = ((0..20).collect::<Vec<_>>(), (0..20).collect::<Vec<_>>());
        let (mut s1, mut s2) = (7u64, 7u64);
        shuffle(&mut a, &mut s1);
        shuffle(&mut b, &mut s2);
        assert_eq!(a, b);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
    }

    #[test]
    fn rows_derive_rates_and_the_table_names_missing_peers() {
        let case =
            Case { group: "g", kda: "gemm:2:2:2".into(), peer: None, work: Work::Flops(2e12) };
        let s = Samples { kda: vec![1000.0, 2000.0, 3000.0], peer: vec![], error: None };
        let row = Row::new(&case, &s, Some(1e12));
        assert_eq!(row.kda_ms, Some(2000.0));
        assert_eq!(row.figure, Some((1.0, "TFLOP/s")));
        assert_eq!(row.of_peak, Some(1.0));
        let table = markdown(&[row], 5, Some(1e12), None);
        assert!(
            table.contains("| g | `gemm:2:2:2` | 2000.0000 | – | – | 1.0 TFLOP/s | 100 % |"),
            "{table}"
        );
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-compare-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A stand-in kda server (a shell loop answering `@result <id> <case> 2.5`, `slow` running
    /// first for the requests it names) and no usable peer (no Python packages: the peer
    /// server cannot import torch).
    fn stand_in(dir: &Path, slow: &str, limit: Duration) -> Setup {
        let fake = format!(
            "case \"$1\" in --serve) ;; *) exit 2;; esac; \
             echo '@ready chunk gemm mx_gemm quant schedule layer_prefill layer_decode'; \
             n=0; while read id case target; do n=$((n+1)); {slow} \
             echo \"@result $id $case 2.5\"; done"
        );
        Setup {
            kda: ("sh".into(), vec!["-c".into(), fake, "sh".into()]),
            env: vec![("PYTHONNOUSERSITE".into(), "1".into())],
            wheels: dir.join("no-wheels"),
            out_dir: dir.to_path_buf(),
            quick: true,
            limit,
            request_limits: (Duration::from_secs(1), Duration::from_secs(1)),
        }
    }

    /// The whole exchange: every kda case gets its rounds, the peer's absence is a note, and
    /// the table and JSON are written after every round. Request 40 (in round 1) answers after
    /// its limit, with a different figure: that case fails, its late reply is dropped by its id,
    /// and every other case gets its own answers.
    #[test]
    fn a_late_reply_is_dropped_never_taken_for_the_next_case() {
        let dir = scratch("late");
        let log = Log::create(&dir.join("gpu-check.log"), false).unwrap();
        let slow =
            "if [ $n -eq 40 ]; then sleep 1.5; echo \"@result $id $case 777.25\"; continue; fi;";
        let setup = stand_in(&dir, slow, Duration::from_secs(60));
        let mut seen = Vec::new();
        let c = compare(&log, &setup, &mut |c| seen.push(c.json.clone())).unwrap();
        assert!(!c.complete && c.note.contains("peer"), "{}", c.note);
        assert!(c.json.starts_with("{ \"rounds\": 3, \"rounds_planned\": 3"), "{}", c.json);
        assert!(!c.json.contains("777.25"), "the late figure was taken: {}", c.json);
        let failed: Vec<&str> = c.json.lines().filter(|l| !l.contains("\"error\": null")).collect();
        let failed: Vec<&&str> = failed.iter().filter(|l| l.contains("\"case\"")).collect();
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].contains("no answer within"), "{}", failed[0]);
        assert!(c.note.contains("1 case(s) failed"), "{}", c.note);
        assert!(
            c.json.contains("\"case\": \"chunk:8192:96:128\", \"kda_ms\": 2.500000"),
            "{}",
            c.json
        );
        let text = std::fs::read_to_string(dir.join("gpu-check.log")).unwrap();
        assert!(text.contains("late reply to request #40 dropped"), "{text}");
        // Written after each timed round, the rounds counting up.
        assert_eq!(seen.len(), 3);
        for (i, json) in seen.iter().enumerate() {
            assert!(json.starts_with(&format!("{{ \"rounds\": {}", i + 1)), "{json}");
        }
        let table = std::fs::read_to_string(dir.join("peers.md")).unwrap();
        assert!(table.contains("| chunked prefill | `chunk:8192:96:128` | 2.5000 |"), "{table}");
        assert!(std::fs::read_to_string(dir.join("gpu-comparison.json")).unwrap() == c.json);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A server that stops answering (request 30 on, in round 1) is given up on after its next
    /// request waits for it in vain: the rest of the comparison fails at once instead of
    /// waiting out every request's limit, and what round 1 had measured is kept.
    #[test]
    fn a_server_that_stops_answering_is_given_up_on() {
        let dir = scratch("stuck");
        let log = Log::create(&dir.join("gpu-check.log"), false).unwrap();
        let slow = "if [ $n -ge 30 ]; then sleep 30; fi;";
        let setup = stand_in(&dir, slow, Duration::from_secs(20));
        let start = Instant::now();
        let c = compare(&log, &setup, &mut |_| {}).unwrap();
        assert!(start.elapsed() < Duration::from_secs(15), "{:?}", start.elapsed());
        assert!(!c.complete);
        assert!(c.json.contains("still busy with request #30"), "{}", c.json);
        assert!(c.json.contains("\"samples\": 1"), "round 1's figures are kept: {}", c.json);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn wheels_are_found_by_name() {
        let dir = std::env::temp_dir().join(format!("xtask-wheels-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["fla_core-0.6.0-py3-none-any.whl", "einops-0.8.1-py3-none-any.whl", "other.whl"] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        assert_eq!(wheels(&dir).len(), 2);
        let _ = std::fs::remove_dir_all(dir);
    }
}
