//! [`Checkpoint`]: the tensors of an HF-style safetensors checkpoint, memory-mapped.
//!
//! A checkpoint directory holds either one [`SINGLE_FILE`] or an [`INDEX_FILE`] whose
//! `weight_map` names the shard file of every tensor. Headers are parsed and validated when the
//! checkpoint is opened (the `safetensors` crate checks that the offsets tile the data and that
//! every tensor's byte count matches its dtype and shape), so a truncated or corrupt file is an
//! error there, naming the file; tensor bytes are only touched when a loader reads its region.
//!
//! Only regular files are opened ([`kda_core::file`]): a directory, FIFO or device in a file's place
//! is an error naming it. Files below [`COPY_BELOW_BYTES`] are read into memory, larger ones are
//! memory-mapped (see [`Checkpoint::open`]).
//!
//! There is no cargo-fuzz target (it needs a nightly toolchain): the property tests of
//! `kda-model/tests/fuzz_parsers.rs` play its part, mutating a committed seed corpus (safetensors
//! files, `config.json` texts, shard indexes, batch metadata) and requiring `Ok` or a clean
//! error, never a panic; `kda-testkit/tests/checkpoint_loading.rs` adds truncations and byte
//! flips through the whole load path.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::ops::{Deref, Range};
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use serde::Deserialize;

use super::WeightError;
use super::source::{DenseTensor, TensorRead, TensorSource};
use kda_core::dtype::DType;
use kda_core::file::{
    COPY_BELOW_BYTES, MAX_INDEX_BYTES, open_regular, read_exact_len, read_regular_text,
};

/// The file name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The file name of a sharded checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The kda dtype of a safetensors dtype, where there is one.
pub fn dtype_from_safetensors(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F32 => DType::F32,
        Dtype::I32 => DType::I32,
        Dtype::U8 => DType::U8,
        Dtype::F8_E4M3 => DType::E4M3,
        Dtype::F8_E8M0 => DType::E8M0,
        _ => return None,
    })
}

/// The safetensors dtype a kda dtype is stored as.
pub fn dtype_to_safetensors(dtype: DType) -> Dtype {
    match dtype {
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F32 => Dtype::F32,
        DType::I32 => Dtype::I32,
        DType::U8 => Dtype::U8,
        DType::E4M3 => Dtype::F8_E4M3,
        DType::E8M0 => Dtype::F8_E8M0,
    }
}

/// The bytes of one file: mapped from disk (large files), or owned (small files read whole,
/// in-memory checkpoints).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// One parsed safetensors file.
struct Shard {
    path: String,
    bytes: Bytes,
}

/// Where a tensor lives.
#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range in the shard's bytes.
    bytes: Range<usize>,
}

/// The tensors of a checkpoint: one safetensors file or a sharded set.
pub struct Checkpoint {
    origin: String,
    /// The shard index file, when the checkpoint was opened from one on disk.
    index: Option<String>,
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("origin", &self.origin)
            .field("shards", &self.shards.iter().map(|s| &s.path).collect::<Vec<_>>())
            .field("tensors", &self.entries.len())
            .finish()
    }
}

/// `model.safetensors.index.json`: only the `weight_map` matters.
#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

/// Parse the tensor table of one safetensors file held in `bytes`.
fn parse_shard(
    path: &str,
    shard: usize,
    bytes: &[u8],
) -> Result<BTreeMap<String, Entry>, WeightError> {
    let (header_len, metadata) = SafeTensors::read_metadata(bytes).map_err(|e| {
        let message = match size_mismatch(bytes) {
            Some(detail) => format!("{e} ({detail})"),
            None => e.to_string(),
        };
        WeightError::Safetensors { path: path.to_string(), message }
    })?;
    // read_metadata checked that 8 + header + data is exactly the file, and that the offsets
    // tile the data; the sums below cannot overflow or leave the file.
    let data_start = 8 + header_len;
    Ok(metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let (s, e) = info.data_offsets;
            let entry = Entry {
                shard,
                dtype: info.dtype,
                shape: info.shape.clone(),
                bytes: data_start + s..data_start + e,
            };
            (name, entry)
        })
        .collect())
}

/// For a file the safetensors parser rejected: the size its header implies against the size it
/// has (what a truncated or padded file gets wrong), when the header is readable enough to say.
fn size_mismatch(bytes: &[u8]) -> Option<String> {
    let len = bytes.len();
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header_end = n.checked_add(8)?;
    let Some(header) = bytes.get(8..header_end) else {
        return Some(format!("the header declares {n} header bytes, the file has {len} bytes"));
    };
    let value: serde_json::Value = serde_json::from_slice(header).ok()?;
    let data_end = value
        .as_object()?
        .values()
        .filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    let expected = usize::try_from(data_end).ok()?.checked_add(header_end)?;
    (expected != len).then(|| format!("expected {expected} bytes from the header, found {len}"))
}

fn io_error(path: &Path, action: &'static str, e: std::io::Error) -> WeightError {
    WeightError::Io { path: path.display().to_string(), action, message: e.to_string() }
}

/// The bytes of the regular file `path`: read whole below [`COPY_BELOW_BYTES`], else mapped
/// read-only.
fn load_file(path: &Path) -> Result<Bytes, WeightError> {
    let (file, len) = open_regular(path).map_err(|e| io_error(path, "open", e))?;
    if len < COPY_BELOW_BYTES {
        let bytes =
            read_exact_len(file, len, COPY_BELOW_BYTES).map_err(|e| io_error(path, "read", e))?;
        return Ok(Bytes::Owned(bytes));
    }
    map_file(path, &file)
}

/// Map the open `file` read-only.
fn map_file(path: &Path, file: &File) -> Result<Bytes, WeightError> {
    // SAFETY: the mapping is read-only and lives as long as the Checkpoint that owns it. The
    // contract a caller accepts (see `Checkpoint::open`) is that checkpoint files are not
    // modified or truncated while a Checkpoint maps them: then the bytes behind every slice we
    // hand out stay valid and unchanged, which is all `Mmap`'s `Deref` requires.
    let map = unsafe { memmap2::Mmap::map(file) }.map_err(|e| io_error(path, "map", e))?;
    Ok(Bytes::Mapped(map))
}

impl Checkpoint {
    /// Open a checkpoint: a directory (its [`INDEX_FILE`] if present, else its [`SINGLE_FILE`]),
    /// a `.json` shard index, or one `.safetensors` file. Every file must be a regular file (a
    /// directory, FIFO, device or symlink loop in its place is an error naming it).
    ///
    /// Files below [`COPY_BELOW_BYTES`] are read into memory: nothing that happens to them
    /// afterwards can affect kda. Larger files are memory-mapped, because a shard of a real
    /// checkpoint is gigabytes of which one TP rank of one layer reads a few megabytes; those
    /// must not be modified or truncated while the checkpoint is open (a mapped file that
    /// shrinks makes later reads fault with SIGBUS, which the `kda` binary reports naming the
    /// mapped files). Serving stacks treat checkpoints as read-only, and writers that replace a
    /// file by renaming a new one over it, as kda's own do, are safe.
    pub fn open(path: &Path) -> Result<Checkpoint, WeightError> {
        if path.is_dir() {
            // An entry that exists in any form is the one meant: if it is not a readable
            // regular file, say so rather than that it does not exist.
            let exists = |p: &Path| std::fs::symlink_metadata(p).is_ok();
            let index = path.join(INDEX_FILE);
            if exists(&index) {
                return Checkpoint::open_index(&index);
            }
            let single = path.join(SINGLE_FILE);
            if exists(&single) {
                return Checkpoint::open_file(&single);
            }
            return Err(WeightError::Io {
                path: path.display().to_string(),
                action: "find a checkpoint in",
                message: format!("neither {INDEX_FILE} nor {SINGLE_FILE} exists"),
            });
        }
        if path.extension().is_some_and(|e| e == "json") {
            Checkpoint::open_index(path)
        } else {
            Checkpoint::open_file(path)
        }
    }

    /// One safetensors file.
    pub fn open_file(path: &Path) -> Result<Checkpoint, WeightError> {
        let origin = path.display().to_string();
        let bytes = load_file(path)?;
        let entries = parse_shard(&origin, 0, &bytes)?;
        Ok(Checkpoint {
            origin: origin.clone(),
            index: None,
            shards: vec![Shard { path: origin, bytes }],
            entries,
        })
    }

    /// A sharded checkpoint from its index file; shard files are looked up beside it.
    pub fn open_index(path: &Path) -> Result<Checkpoint, WeightError> {
        let text =
            read_regular_text(path, MAX_INDEX_BYTES).map_err(|e| io_error(path, "read", e))?;
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut checkpoint = Checkpoint::from_index(&path.display().to_string(), &text, |file| {
            let full: PathBuf = dir.join(file);
            Ok((full.display().to_string(), load_file(&full)?))
        })?;
        checkpoint.index = Some(path.display().to_string());
        Ok(checkpoint)
    }

    /// One safetensors file held in memory (`origin` names it in errors).
    pub fn from_bytes(origin: &str, bytes: Vec<u8>) -> Result<Checkpoint, WeightError> {
        let entries = parse_shard(origin, 0, &bytes)?;
        Ok(Checkpoint {
            origin: origin.to_string(),
            index: None,
            shards: vec![Shard { path: origin.to_string(), bytes: Bytes::Owned(bytes) }],
            entries,
        })
    }

    /// A sharded checkpoint held in memory: the index text and the shard files by name.
    pub fn from_index_bytes(
        origin: &str,
        index: &str,
        files: &BTreeMap<String, Vec<u8>>,
    ) -> Result<Checkpoint, WeightError> {
        Checkpoint::from_index(origin, index, |file| match files.get(file) {
            Some(b) => Ok((file.to_string(), Bytes::Owned(b.clone()))),
            None => Err(WeightError::Io {
                path: file.to_string(),
                action: "open",
                message: "no such shard".into(),
            }),
        })
    }

    fn from_index(
        origin: &str,
        text: &str,
        mut open: impl FnMut(&str) -> Result<(String, Bytes), WeightError>,
    ) -> Result<Checkpoint, WeightError> {
        let index_error =
            |message: String| WeightError::Index { path: origin.to_string(), message };
        let index: ShardIndex =
            serde_json::from_str(text).map_err(|e| index_error(e.to_string()))?;
        let files: BTreeSet<&str> = index.weight_map.values().map(String::as_str).collect();
        let mut shards = Vec::with_capacity(files.len());
        let mut tables = BTreeMap::new();
        for file in files {
            // Shards sit beside the index: a name that could leave the directory is not one.
            if file.is_empty()
                || file == "."
                || file == ".."
                || file.contains(['/', '\\'])
                || file.contains('\0')
            {
                return Err(index_error(format!(
                    "shard file name {file:?} is not a plain file name in the index's directory"
                )));
            }
            let (path, bytes) = open(file)?;
            tables.insert(file, parse_shard(&path, shards.len(), &bytes)?);
            shards.push(Shard { path, bytes });
        }
        let mut entries = BTreeMap::new();
        for (name, file) in &index.weight_map {
            let entry = tables.get(file.as_str()).and_then(|t| t.get(name)).ok_or_else(|| {
                index_error(format!("weight_map puts {name:?} in {file}, which does not hold it"))
            })?;
            entries.insert(name.clone(), entry.clone());
        }
        Ok(Checkpoint { origin: origin.to_string(), index: None, shards, entries })
    }

    /// The safetensors files this checkpoint reads.
    pub fn files(&self) -> Vec<&str> {
        self.shards.iter().map(|s| s.path.as_str()).collect()
    }

    /// The shard index file, when the checkpoint was opened from one on disk.
    pub fn index_file(&self) -> Option<&str> {
        self.index.as_deref()
    }

    /// The shards that are memory-mapped (at least [`COPY_BELOW_BYTES`]): the files that must
    /// not shrink while this checkpoint is open.
    pub fn mapped_files(&self) -> Vec<&str> {
        self.shards
            .iter()
            .filter(|s| matches!(s.bytes, Bytes::Mapped(_)))
            .map(|s| s.path.as_str())
            .collect()
    }
}

impl TensorSource for Checkpoint {
    fn origin(&self) -> String {
        self.origin.clone()
    }

    fn names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    fn tensor(&self, name: &str) -> Result<Box<dyn TensorRead + '_>, WeightError> {
        let not_found = || WeightError::NotFound { origin: self.origin.clone(), name: name.into() };
        let (key, entry) = self.entries.get_key_value(name).ok_or_else(not_found)?;
        let dtype = dtype_from_safetensors(entry.dtype).ok_or_else(|| {
            WeightError::dtype(
                name,
                "one of bf16, f16, f32, i32, u8, F8_E4M3, F8_E8M0",
                format!("{:?}", entry.dtype),
            )
        })?;
        let shard = self.shards.get(entry.shard).ok_or_else(not_found)?;
        let bytes = shard.bytes.get(entry.bytes.clone()).ok_or_else(not_found)?;
        Ok(Box::new(DenseTensor { name: key, dtype, shape: &entry.shape, bytes }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::source::read_all;
    use safetensors::tensor::TensorView;

    /// A fresh scratch directory for one test (`tag` makes it unique per test).
    fn scratch(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kda-model-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_default();
        dir
    }

    fn file(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn reads_regions_of_every_supported_dtype() {
        let f32s: Vec<u8> =
            [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let bytes = file(&[
            ("a", Dtype::F32, vec![3, 2], f32s),
            ("q", Dtype::F8_E4M3, vec![2, 2], vec![0x38, 0x40, 0xB8, 0x00]),
            ("s", Dtype::U8, vec![2, 1], vec![127, 128]),
            ("z", Dtype::I64, vec![1], vec![0; 8]),
        ]);
        let c = Checkpoint::from_bytes("mem", bytes).unwrap();
        assert_eq!(c.names(), vec!["a", "q", "s", "z"]);
        let a = c.tensor("a").unwrap();
        assert_eq!((a.dtype(), a.shape()), (DType::F32, &[3usize, 2][..]));
        assert_eq!(a.read(&[1..3, 1..2]).unwrap().as_f32().unwrap(), &[4.0, 6.0]);
        let q = read_all(&*c.tensor("q").unwrap()).unwrap();
        assert_eq!((q.dtype(), q.as_u8().unwrap()), (DType::E4M3, &[0x38, 0x40, 0xB8, 0][..]));
        assert_eq!(c.tensor("s").unwrap().dtype(), DType::U8);
        let e = c.tensor("z").unwrap_err().to_string();
        assert!(e.contains("z: dtype I64"), "{e}");
        let e = c.tensor("nope").unwrap_err().to_string();
        assert_eq!(e, "mem: no tensor named \"nope\"");
    }

    #[test]
    fn truncated_and_corrupt_files_are_clean_errors() {
        let bytes = file(&[("a", Dtype::F32, vec![4], vec![0; 16])]);
        for cut in [0, 3, 8, 20, bytes.len() - 1] {
            let e = Checkpoint::from_bytes("f.safetensors", bytes[..cut].to_vec()).unwrap_err();
            assert!(matches!(e, WeightError::Safetensors { .. }), "cut {cut}: {e}");
            assert!(e.to_string().starts_with("f.safetensors: not a valid safetensors file"));
        }
        let e = Checkpoint::from_bytes("f", bytes[..bytes.len() - 1].to_vec()).unwrap_err();
        let want =
            format!("expected {} bytes from the header, found {}", bytes.len(), bytes.len() - 1);
        assert!(e.to_string().contains(&want), "{e}");
        let e = Checkpoint::from_bytes("f", bytes[..20].to_vec()).unwrap_err();
        assert!(e.to_string().contains("the file has 20 bytes"), "{e}");
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Checkpoint::from_bytes("f", longer).is_err());
    }

    /// Issue #21, item 4: a checkpoint below the copy threshold is read whole when opened, so a
    /// file truncated afterwards changes nothing (a mapped one faults with SIGBUS on the next
    /// read).
    #[test]
    fn small_files_are_read_whole_so_truncation_cannot_fault() {
        let dir = scratch("truncate");
        let values: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let path = dir.join(SINGLE_FILE);
        std::fs::write(&path, file(&[("a", Dtype::F32, vec![4096], bytes)])).unwrap();
        let c = Checkpoint::open(&dir).unwrap();
        assert!(c.mapped_files().is_empty());
        assert_eq!(c.files(), vec![path.display().to_string()]);
        File::options().write(true).open(&path).unwrap().set_len(0).unwrap();
        let a = read_all(&*c.tensor("a").unwrap()).unwrap();
        assert_eq!(a.as_f32().unwrap(), &values[..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue #21, item 7: a checkpoint file that exists but is a directory, a FIFO or a symlink
    /// loop is named as such, not reported missing or "cannot map: No such device".
    #[cfg(unix)]
    #[test]
    fn entries_that_are_not_regular_files_are_named() {
        let dir = scratch("kinds");
        let single = dir.join(SINGLE_FILE);
        let error = |path: &Path| Checkpoint::open(path).unwrap_err().to_string();
        std::fs::create_dir(&single).unwrap();
        let want = format!(
            "{}: cannot open: it is a directory, expected a regular file",
            single.display()
        );
        assert_eq!(error(&dir), want);
        std::fs::remove_dir(&single).unwrap();

        std::os::unix::fs::symlink(SINGLE_FILE, &single).unwrap();
        let e = error(&dir);
        assert!(e.starts_with(&format!("{}: cannot open: ", single.display())), "{e}");
        assert!(e.contains("symbolic links"), "{e}");
        std::fs::remove_file(&single).unwrap();

        let c = std::ffi::CString::new(single.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(
            error(&dir),
            format!("{}: cannot open: it is a FIFO, expected a regular file", single.display())
        );
        std::fs::remove_file(&single).unwrap();

        let index = dir.join(INDEX_FILE);
        std::fs::write(&index, r#"{"weight_map": {"a": "shard.safetensors"}}"#).unwrap();
        std::fs::create_dir(dir.join("shard.safetensors")).unwrap();
        let shard = dir.join("shard.safetensors");
        assert_eq!(
            error(&dir),
            format!("{}: cannot open: it is a directory, expected a regular file", shard.display())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn index_names_are_checked() {
        let shard = file(&[("a", Dtype::U8, vec![1], vec![7])]);
        let files = BTreeMap::from([("s1.safetensors".to_string(), shard)]);
        let ok = r#"{"metadata": {"total_size": 1}, "weight_map": {"a": "s1.safetensors"}}"#;
        let c = Checkpoint::from_index_bytes("idx", ok, &files).unwrap();
        assert_eq!(read_all(&*c.tensor("a").unwrap()).unwrap().as_u8().unwrap(), &[7]);
        for (bad, needle) in [
            (r#"{"weight_map": {"b": "s1.safetensors"}}"#, "does not hold it"),
            (r#"{"weight_map": {"a": "../s1.safetensors"}}"#, "not a plain file name"),
            (r#"{"weight_map": {"a": "s2.safetensors"}}"#, "no such shard"),
            (r#"{"weight_map": 3}"#, "invalid shard index"),
            ("", "invalid shard index"),
        ] {
            let e = Checkpoint::from_index_bytes("idx", bad, &files).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
