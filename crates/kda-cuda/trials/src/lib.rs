//! kda-cuda's test harness: trials that decide at run time whether they can run (a CUDA device,
//! libnvrtc), and the runner of its `harness = false` test targets.
//!
//! - [`test`]: an attribute that registers `fn name()` as a [`Registered`] trial instead of
//!   handing it to libtest. A test target that brings it into scope (`use kda_cuda_trials::test;`)
//!   before invoking `kda_testkit::conformance_tests!` collects every conformance body; new
//!   bodies come along without a change here. [`registered`] turns them into trials, each
//!   reported ignored, by name, when the device is unavailable, never passed silently.
//! - [`run`]: libtest-mimic with the command line `cargo test` passes, except that any number
//!   of name filters is accepted (`cargo test --workspace -- NAME1 NAME2`, as libtest does):
//!   libtest-mimic alone takes one and rejects the run otherwise. Trials run one at a time
//!   unless `--test-threads N` says otherwise: they share one CUDA context, and a trial that
//!   synchronises the context (making or dropping an instance) while another thread captures a
//!   stream would invalidate that capture (and a hung trial would block every later one).

pub use inventory;
pub use kda_cuda_trials_macros::test;
pub use libtest_mimic::{Failed, Trial};

use libtest_mimic::Arguments;

/// One trial body, as [`test`] registers it: its full path and the function.
#[derive(Debug)]
pub struct Registered {
    pub name: &'static str,
    pub run: fn(),
}

inventory::collect!(Registered);

/// Every registered body as a trial, sorted by name, named without the test crate
/// (`conformance::suite::name` → `suite::name`). With `unavailable` (why the device cannot be
/// used), each is ignored, and fails with that reason under `--include-ignored`.
pub fn registered(unavailable: Option<&str>) -> Vec<Trial> {
    let mut all: Vec<&Registered> = inventory::iter::<Registered>.into_iter().collect();
    all.sort_by_key(|r| r.name);
    all.into_iter()
        .map(|r| {
            let name = r.name.split_once("::").map_or(r.name, |(_, rest)| rest);
            let run = r.run;
            needing_device(name, unavailable, move || {
                run();
                Ok(())
            })
        })
        .collect()
}

/// A device check: its name and its body, which says why it failed.
pub type Check = fn() -> Result<(), Failed>;

/// `checks` as trials, in order, each ignored with `unavailable` as [`registered`]'s are.
pub fn checks(unavailable: Option<&str>, checks: &[(&'static str, Check)]) -> Vec<Trial> {
    checks.iter().map(|&(name, check)| needing_device(name, unavailable, check)).collect()
}

/// `body` as trial `name`, ignored (and failing with the reason when run anyway) when the
/// device is `unavailable`.
fn needing_device(
    name: &str,
    unavailable: Option<&str>,
    body: impl FnOnce() -> Result<(), Failed> + Send + 'static,
) -> Trial {
    let reason = unavailable.map(str::to_string);
    Trial::test(name, move || match reason {
        None => body(),
        Some(why) => Err(format!("cannot run without a CUDA device: {why}").into()),
    })
    .with_ignored_flag(unavailable.is_some())
}

/// Run `trials` under the process's command line (see the crate docs) and exit with its status.
pub fn run(trials: Vec<Trial>) -> ! {
    let (args, trials) = arguments(std::env::args().collect(), trials);
    libtest_mimic::run(&args, trials).exit()
}

/// Options of libtest-mimic's command line that take a value as the next argument.
const WITH_VALUE: [&str; 6] =
    ["--test-threads", "--logfile", "--skip", "--color", "--format", "-Z"];

/// The command line split into everything but the name filters, and the filters.
fn split_filters(command_line: Vec<String>) -> (Vec<String>, Vec<String>) {
    let mut rest = Vec::with_capacity(command_line.len());
    let mut filters = Vec::new();
    let mut args = command_line.into_iter();
    rest.extend(args.next());
    while let Some(arg) = args.next() {
        if WITH_VALUE.contains(&arg.as_str()) {
            rest.push(arg);
            rest.extend(args.next());
        } else if arg.starts_with('-') {
            rest.push(arg);
        } else {
            filters.push(arg);
        }
    }
    (rest, filters)
}

/// libtest-mimic's arguments for `command_line`, and the trials left after the name filters:
/// one filter is libtest-mimic's own; with several, a trial runs when any of them matches it
/// (its name contains the filter, or equals it under `--exact`), as under libtest.
fn arguments(command_line: Vec<String>, mut trials: Vec<Trial>) -> (Arguments, Vec<Trial>) {
    let (rest, filters) = split_filters(command_line);
    let mut args = Arguments::from_iter(rest);
    args.test_threads = args.test_threads.or(Some(1));
    match filters.as_slice() {
        [] => {}
        [one] => args.filter = Some(one.clone()),
        many => {
            let exact = args.exact;
            trials.retain(|t| {
                many.iter()
                    .any(|f| if exact { t.name() == f } else { t.name().contains(f.as_str()) })
            });
        }
    }
    (args, trials)
}

#[cfg(test)]
mod tests {
    use super::{Trial, arguments, split_filters};

    fn line(args: &[&str]) -> Vec<String> {
        std::iter::once("harness").chain(args.iter().copied()).map(String::from).collect()
    }

    fn trials(names: &[&str]) -> Vec<Trial> {
        names.iter().map(|n| Trial::test(*n, || Ok(()))).collect()
    }

    fn names(trials: &[Trial]) -> Vec<&str> {
        trials.iter().map(Trial::name).collect()
    }

    #[test]
    fn filters_are_the_positional_arguments() {
        let (rest, filters) = split_filters(line(&[
            "alpha",
            "--test-threads",
            "2",
            "beta",
            "--skip",
            "gamma",
            "--exact",
            "--color=never",
        ]));
        assert_eq!(filters, ["alpha", "beta"]);
        assert_eq!(
            rest,
            ["harness", "--test-threads", "2", "--skip", "gamma", "--exact", "--color=never"]
        );
    }

    #[test]
    fn several_filters_keep_every_trial_any_of_them_matches() {
        let all = ["suite::streams_order", "suite::gemm_bf16", "suite::mx_gemm", "nvrtc_x"];
        let (args, kept) = arguments(line(&["gemm", "streams", "-q"]), trials(&all));
        assert_eq!(names(&kept), ["suite::streams_order", "suite::gemm_bf16", "suite::mx_gemm"]);
        assert_eq!(args.filter, None);
        assert!(args.quiet);
        let (_, kept) = arguments(line(&["--exact", "suite::gemm_bf16", "gemm"]), trials(&all));
        assert_eq!(names(&kept), ["suite::gemm_bf16"]);
    }

    /// Device trials share one CUDA context: one at a time unless the command line asks.
    #[test]
    fn trials_run_one_at_a_time_unless_told_otherwise() {
        let (args, _) = arguments(line(&[]), trials(&["a"]));
        assert_eq!(args.test_threads, Some(1));
        let (args, _) = arguments(line(&["--test-threads", "4", "a", "b"]), trials(&["a"]));
        assert_eq!(args.test_threads, Some(4));
    }

    #[test]
    fn one_filter_or_none_is_libtest_mimics_own() {
        let all = ["a", "b"];
        let (args, kept) = arguments(line(&["a"]), trials(&all));
        assert_eq!((args.filter.as_deref(), names(&kept)), (Some("a"), vec!["a", "b"]));
        let (args, kept) = arguments(line(&[]), trials(&all));
        assert_eq!((args.filter, kept.len()), (None, 2));
    }
}
