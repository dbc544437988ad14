//! The `kda` binary's signal dispositions: the two signals a hostile environment can raise
//! against a correct program end it with a message instead of a silent death
//! (`docs/design/reliability.md`).
//!
//! - `SIGXFSZ` (a write past `ulimit -f`) is ignored, so the write fails with `EFBIG` and kda
//!   reports it like any other I/O error; the atomic writers leave the previous output whole.
//! - `SIGBUS` comes from a memory-mapped checkpoint file that shrank under kda (only files of
//!   at least 64 MiB are mapped: see `Checkpoint::open`). It cannot be recovered from, so the
//!   handler prints one line naming the mapped files and exits with status 1.

use std::sync::OnceLock;

/// The SIGBUS message, prepared before any file is mapped (a handler may not allocate).
static MAPPED: OnceLock<Vec<u8>> = OnceLock::new();

const UNNAMED: &[u8] = b"error: a memory-mapped file shrank or changed while kda read it \
(SIGBUS); checkpoint files must not be truncated or rewritten in place while kda runs\n";

/// Install the dispositions; called once, first thing in `main`.
pub fn install() {
    #[cfg(unix)]
    // SAFETY: `signal` with SIG_IGN and `sigaction` with a handler that only calls
    // async-signal-safe functions (`write`, `_exit`) and reads an already-initialised
    // `OnceLock` (an atomic load); the `sigaction` struct is zero-initialised, then filled.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
    }
}

/// Name `files` in the message a SIGBUS prints (the first checkpoint opened with mapped files
/// is the one named).
pub fn name_mapped_files(files: &[&str]) {
    if files.is_empty() {
        return;
    }
    let message = format!(
        "error: a memory-mapped checkpoint file shrank or changed while kda read it (SIGBUS): \
         one of {}; checkpoint files must not be truncated or rewritten in place while kda runs\n",
        files.join(", ")
    );
    let _ = MAPPED.set(message.into_bytes());
}

#[cfg(unix)]
extern "C" fn on_sigbus(_signal: libc::c_int) {
    let message = MAPPED.get().map_or(UNNAMED, Vec::as_slice);
    // SAFETY: `write` and `_exit` are async-signal-safe; `message` is a live static slice.
    unsafe {
        libc::write(2, message.as_ptr().cast(), message.len());
        libc::_exit(1);
    }
}
