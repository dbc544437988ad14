//! Opening the files kda reads (`config.json`, shard indexes, safetensors files, and the CLI's
//! inputs): regular files only, read with a size bound.
//!
//! A FIFO, a device, a socket or a directory is refused by name before a byte is read, so an
//! input can neither block kda forever (a FIFO with no writer) nor stream into memory without
//! end (`/dev/zero`). The open itself is non-blocking, so even a FIFO swapped in after a check
//! cannot hang it; the kind is then taken from the open file. The limits and their reasons are in
//! `docs/design/reliability.md`.

use std::fs::{File, Metadata};
use std::io::{self, Read};
use std::path::Path;

/// The largest `config.json` kda reads (real ones are a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// The largest shard index kda reads (Kimi K3's is about 4 MiB).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// Safetensors files smaller than this are read into memory; larger ones are memory-mapped
/// (see `kda_model::weights::Checkpoint::open` for why, and what mapping risks).
pub const COPY_BELOW_BYTES: u64 = 64 << 20;

/// What a non-regular file is, for messages ("a directory", "a FIFO", ...).
pub fn describe_kind(meta: &Metadata) -> &'static str {
    let kind = meta.file_type();
    if kind.is_dir() {
        return "a directory";
    }
    if kind.is_symlink() {
        return "a symbolic link";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO";
        }
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    if kind.is_file() { "a regular file" } else { "not a regular file" }
}

fn not_regular(meta: &Metadata) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("it is {}, expected a regular file", describe_kind(meta)),
    )
}

/// Open `path` for reading if it is a regular file (following symbolic links); returns the file
/// and its length. Never blocks: the open is non-blocking and the kind is checked on the open
/// file.
pub fn open_regular(path: &Path) -> io::Result<(File, u64)> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // A FIFO opened for reading blocks until a writer appears; O_NONBLOCK returns at once.
        // On a regular file it changes nothing.
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    Ok((file, meta.len()))
}

/// The whole of the regular file `path`, at most `max_bytes` long. A file that changes size
/// while it is read is an error, not a short or endless read.
pub fn read_regular(path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
    let (file, len) = open_regular(path)?;
    read_exact_len(file, len, max_bytes)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_text(path: &Path, max_bytes: u64) -> io::Result<String> {
    String::from_utf8(read_regular(path, max_bytes)?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("not UTF-8 text: {e}")))
}

/// Read `len` bytes (the length the open file had) from `file`, at most `max_bytes`: a file that
/// grew or shrank since it was opened is an error.
pub fn read_exact_len(file: File, len: u64, max_bytes: u64) -> io::Result<Vec<u8>> {
    if len > max_bytes {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("it has {len} bytes, more than the {max_bytes} kda reads from such a file"),
        ));
    }
    let capacity = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::OutOfMemory))?;
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(capacity)
        .map_err(|_| io::Error::new(io::ErrorKind::OutOfMemory, format!("{len} bytes")))?;
    // One byte more than expected tells a file that grew from one that did not.
    file.take(len.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("it changed while being read ({len} bytes when opened, {} read)", bytes.len()),
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh scratch directory for a unit test of kda-core (`tag` makes it unique per test).
    fn scratch(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kda-core-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_default();
        dir
    }

    #[test]
    fn regular_files_are_read_and_bounded() {
        let dir = scratch("regular");
        let path = dir.join("a.json");
        std::fs::write(&path, b"{}").unwrap();
        assert_eq!(read_regular(&path, 2).unwrap(), b"{}");
        let e = read_regular(&path, 1).unwrap_err().to_string();
        assert_eq!(e, "it has 2 bytes, more than the 1 kda reads from such a file");
        let e = read_regular(&dir, 10).unwrap_err().to_string();
        assert_eq!(e, "it is a directory, expected a regular file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue #21, item 5: a FIFO (or a device) is refused at once instead of blocking or
    /// streaming forever.
    #[cfg(unix)]
    #[test]
    fn fifos_and_devices_are_refused_without_blocking() {
        let dir = scratch("fifo");
        let fifo = dir.join("input.fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_regular(&fifo, 10).unwrap_err().to_string();
        assert_eq!(e, "it is a FIFO, expected a regular file");
        let e = read_regular(Path::new("/dev/zero"), u64::MAX).unwrap_err().to_string();
        assert_eq!(e, "it is a character device, expected a regular file");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
