//! Child processes whose output is written to a log file as it arrives, each under a time
//! limit: a step that hangs is killed (with everything it started) and still leaves its output
//! behind, so a device run that goes wrong returns what it saw.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How one child ended.
#[derive(Debug, Default)]
pub struct Outcome {
    /// It exited with status 0.
    pub ok: bool,
    /// It was killed at its time limit.
    pub timed_out: bool,
    /// Its exit code (none when killed by a signal).
    pub code: Option<i32>,
    pub seconds: f64,
    /// Its stdout and stderr, as written to the log.
    pub output: String,
}

/// An append-only log shared by the steps of one run.
#[derive(Clone, Debug)]
pub struct Log {
    file: Arc<Mutex<File>>,
    echo: bool,
}

impl Log {
    /// Create (truncate) `path`; with `echo`, every line also goes to stderr.
    pub fn create(path: &Path, echo: bool) -> Result<Self, String> {
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self { file: Arc::new(Mutex::new(file)), echo })
    }

    /// Append one line, flushed at once (the log is what survives a killed run).
    pub fn line(&self, text: &str) {
        if self.echo {
            eprintln!("{text}");
        }
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = writeln!(file, "{text}");
        let _ = file.flush();
    }
}

/// Run `program args` with extra `env`, its output going line by line to `log` (and kept in
/// the outcome), killed with its whole process group after `limit`.
pub fn run(
    log: &Log,
    program: &str,
    args: &[&str],
    env: &[(String, String)],
    limit: Duration,
) -> Result<Outcome, String> {
    log.line(&format!("==> {program} {}", args.join(" ")));
    let start = Instant::now();
    let mut command = Command::new(program);
    command
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = command.spawn().map_err(|e| format!("cannot start {program}: {e}"))?;
    let output = Arc::new(Mutex::new(String::new()));
    let readers = [
        child.stdout.take().map(|o| pump(o, log.clone(), Arc::clone(&output))),
        child.stderr.take().map(|e| pump(e, log.clone(), Arc::clone(&output))),
    ];
    let (status, timed_out) = wait(&mut child, limit);
    if timed_out {
        log.line(&format!(
            "==> {program}: killed after {:.0} s (time limit {} s)",
            start.elapsed().as_secs_f64(),
            limit.as_secs()
        ));
    }
    for reader in readers.into_iter().flatten() {
        let _ = reader.join();
    }
    let output = std::mem::take(&mut *output.lock().unwrap_or_else(PoisonError::into_inner));
    Ok(Outcome {
        ok: !timed_out && status.is_some_and(|s| s.success()),
        timed_out,
        code: status.and_then(|s| s.code()),
        seconds: start.elapsed().as_secs_f64(),
        output,
    })
}

/// Copy `from` line by line into the log and `into`, on its own thread.
fn pump(
    from: impl Read + Send + 'static,
    log: Log,
    into: Arc<Mutex<String>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut bytes = Vec::new();
        // Lines as bytes: a child's non-UTF-8 output must not end the copy.
        while reader.read_until(b'\n', &mut bytes).is_ok_and(|n| n > 0) {
            let line = String::from_utf8_lossy(&bytes);
            let line = line.trim_end_matches(['\n', '\r']);
            log.line(line);
            let mut all = into.lock().unwrap_or_else(PoisonError::into_inner);
            all.push_str(line);
            all.push('\n');
            bytes.clear();
        }
    })
}

/// Wait for `child` up to `limit`; past it, kill its process group. Its exit status (none if it
/// could not be read) and whether it was killed.
fn wait(child: &mut Child, limit: Duration) -> (Option<std::process::ExitStatus>, bool) {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return (Some(status), false),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => break,
            Err(_) => return (None, false),
        }
    }
    // The child's whole group: a cargo or a shell would otherwise leave its own children
    // running, holding the output pipes open.
    #[cfg(unix)]
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .stderr(Stdio::null())
        .status();
    let _ = child.kill();
    (child.wait().ok(), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-stream-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn output_reaches_the_log_and_the_outcome() {
        let dir = scratch("ok");
        let log = Log::create(&dir.join("run.log"), false).unwrap();
        let out = run(
            &log,
            "sh",
            &["-c", "echo one; echo two >&2; exit 3"],
            &[],
            Duration::from_secs(20),
        )
        .unwrap();
        assert!(!out.ok && !out.timed_out);
        assert_eq!(out.code, Some(3));
        assert!(out.output.contains("one") && out.output.contains("two"), "{}", out.output);
        let text = std::fs::read_to_string(dir.join("run.log")).unwrap();
        assert!(text.contains("==> sh") && text.contains("one") && text.contains("two"), "{text}");
    }

    #[test]
    fn a_hanging_child_is_killed_with_its_children_and_leaves_its_output() {
        let dir = scratch("hang");
        let log = Log::create(&dir.join("run.log"), false).unwrap();
        // The shell starts a grandchild that would keep the pipes open.
        let start = Instant::now();
        let out = run(
            &log,
            "sh",
            &["-c", "echo started; sleep 60 & sleep 60"],
            &[],
            Duration::from_millis(500),
        )
        .unwrap();
        assert!(out.timed_out && !out.ok);
        assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
        let text = std::fs::read_to_string(dir.join("run.log")).unwrap();
        assert!(text.contains("started") && text.contains("killed after"), "{text}");
    }
}
