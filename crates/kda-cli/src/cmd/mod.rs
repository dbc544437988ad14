//! One module per `kda` subcommand, plus what they share.

pub mod bench;
pub mod core;
pub mod info;
pub mod precision;
pub mod quant;
pub mod run;
pub mod schedule;
pub mod tensor_file;

use std::time::{Duration, Instant};

/// Time `f` `repeats` times (after one warm-up call) and return the median.
pub fn median_time<E>(repeats: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<Duration, E> {
    f()?;
    let mut times = Vec::with_capacity(repeats.max(1));
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2])
}

/// Milliseconds, for reports.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
