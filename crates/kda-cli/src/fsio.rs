//! How `kda` touches files: inputs are regular files read whole, outputs are written atomically
//! and never onto an input (`docs/design/reliability.md`).
//!
//! - [`read_input`]: a regular file only (a FIFO, a device or a directory is refused at once
//!   rather than blocking or reading without end);
//! - [`check_outputs`]: before any work, refuse an output that is one of the command's inputs
//!   (including every file of a checkpoint it loads), another output, or not a regular file;
//! - [`write_atomic`]: write a temporary file in the output's directory, sync it, rename it over
//!   the output: a full disk, a file-size limit or a crash leaves the previous output whole,
//!   never a half-written file. A file kda has mapped is never truncated in place by kda.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kda_core::file::{describe_kind, read_regular};

use crate::error::CliError;

fn io_error(action: &'static str, path: &Path, source: std::io::Error) -> CliError {
    CliError::Io { action, path: path.display().to_string(), source }
}

/// The bytes of the regular file `path` (an input).
pub fn read_input(path: &Path) -> Result<Vec<u8>, CliError> {
    read_regular(path, u64::MAX).map_err(|source| io_error("read", path, source))
}

/// The identity of an existing file (device and inode), following symbolic links.
#[cfg(unix)]
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn identity(path: &Path) -> Option<PathBuf> {
    fs::canonicalize(path).ok()
}

/// Check, before any work, that each output (`(flag, path)`) can be replaced: where it exists
/// it must be a regular file, and it must not be any of `inputs` (through any name: links are
/// followed) or another output.
pub fn check_outputs(outputs: &[(&'static str, &Path)], inputs: &[&Path]) -> Result<(), CliError> {
    for (i, &(flag, path)) in outputs.iter().enumerate() {
        let argument = |reason: String| CliError::Argument { arg: flag, reason };
        let id = identity(path);
        let same = |p: &Path| p == path || (id.is_some() && identity(p) == id);
        if let Some((other, _)) = outputs[..i].iter().find(|(_, p)| same(p)) {
            return Err(argument(format!("{} is also the output of {other}", path.display())));
        }
        let Ok(meta) = fs::metadata(path) else { continue };
        if !meta.is_file() {
            return Err(argument(format!(
                "{} is {}; kda writes an output by renaming a new file over it, so it must be a \
                 regular file or not exist yet",
                path.display(),
                describe_kind(&meta)
            )));
        }
        if let Some(input) = inputs.iter().find(|input| identity(input) == id) {
            return Err(argument(format!(
                "{} is the input {}; kda never overwrites what it reads",
                path.display(),
                input.display()
            )));
        }
    }
    Ok(())
}

/// Where the bytes of `path` really go: the target of a symbolic link (so the link survives),
/// else `path` itself.
fn destination(path: &Path) -> Result<PathBuf, CliError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => {
            fs::canonicalize(path).map_err(|source| io_error("resolve the link", path, source))
        }
        _ => Ok(path.to_path_buf()),
    }
}

/// Replace the file at `path` with `bytes`, atomically: a temporary file beside it is written,
/// synced and renamed over it. On any failure the temporary file is removed and `path` is left
/// as it was.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CliError> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let target = destination(path)?;
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let temp = dir.join(format!(".{name}.kda-{}-{n}.tmp", std::process::id()));
    let result = write_then_rename(&temp, &target, bytes);
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result.map_err(|source| io_error("write", path, source))
}

fn write_then_rename(temp: &Path, target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = File::options().write(true).create_new(true).open(temp)?;
    file.write_all(bytes)?;
    if let Ok(old) = fs::metadata(target) {
        // Keep the permissions of the file being replaced, as writing into it would.
        file.set_permissions(old.permissions())?;
    }
    file.sync_all()?;
    drop(file);
    fs::rename(temp, target)?;
    // Make the rename itself durable where the platform allows opening a directory.
    if let Some(dir) = target.parent().filter(|d| !d.as_os_str().is_empty())
        && let Ok(d) = File::open(dir)
    {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kda-fsio-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn atomic_writes_replace_the_file_and_leave_nothing_else() {
        let dir = scratch("atomic");
        let out = dir.join("out.bin");
        write_atomic(&out, b"first").unwrap();
        write_atomic(&out, b"second").unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"second");
        assert_eq!(entries(&dir), ["out.bin"]);
        // Into a directory that does not exist: an error naming the output, nothing written.
        let e = write_atomic(&dir.join("no/such/out.bin"), b"x").unwrap_err().to_string();
        assert!(e.starts_with(&format!("cannot write {}", dir.join("no/such/out.bin").display())));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_symlinked_output_keeps_its_link() {
        let dir = scratch("link");
        let real = dir.join("real.bin");
        fs::write(&real, b"old").unwrap();
        std::os::unix::fs::symlink("real.bin", dir.join("link.bin")).unwrap();
        write_atomic(&dir.join("link.bin"), b"new").unwrap();
        assert_eq!(fs::read(&real).unwrap(), b"new");
        assert!(fs::symlink_metadata(dir.join("link.bin")).unwrap().file_type().is_symlink());
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue #21, item 3: an output that is an input (by any name) is refused before any work.
    #[test]
    fn outputs_that_are_inputs_or_special_files_are_refused() {
        let dir = scratch("guard");
        let input = dir.join("in.safetensors");
        fs::write(&input, b"data").unwrap();
        let fresh = dir.join("out.safetensors");
        assert!(check_outputs(&[("--output", &fresh)], &[&input]).is_ok());
        let e = check_outputs(&[("--output", &input)], &[&input]).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "invalid argument --output: {} is the input {}; kda never overwrites what it reads",
                input.display(),
                input.display()
            )
        );
        let dotted = dir.join(".").join("in.safetensors");
        assert!(check_outputs(&[("--output", &dotted)], &[&input]).is_err());
        #[cfg(unix)]
        {
            fs::hard_link(&input, dir.join("hard")).unwrap();
            assert!(check_outputs(&[("--output", &dir.join("hard"))], &[&input]).is_err());
        }
        let e = check_outputs(&[("--output", &dir)], &[]).unwrap_err().to_string();
        assert!(e.contains("is a directory; kda writes an output by renaming"), "{e}");
        fs::write(&fresh, b"old").unwrap();
        let e = check_outputs(&[("--svg", &fresh), ("--chrome", &fresh)], &[]).unwrap_err();
        assert!(e.to_string().contains("is also the output of --svg"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
