//! [`ForeignArray`]: an engine's array (a torch or numpy tensor, a C pointer) as kda sees it,
//! and how it becomes a kda tensor: imported in place where its layout allows, copied where not.

use std::any::Any;
use std::fmt;

use half::{bf16, f16};
use kda_core::{Backend, DType, Device, Layout, Op, Tensor};

use crate::error::{EmbedError, Result};

/// Where an array's memory is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory: what the reference backend computes on.
    Host,
    /// Memory of the named backend's device `device` (`"cuda"`, `"ascend"`).
    Device { backend: &'static str, device: i64 },
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Memory::Host => f.write_str("host memory"),
            Memory::Device { backend, device } => write!(f, "{backend} device {device} memory"),
        }
    }
}

/// An array someone else owns: a pointer, dtype, shape, element strides, where it lives and what
/// keeps it alive.
pub struct ForeignArray {
    ptr: *mut u8,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<isize>,
    memory: Memory,
    owner: Box<dyn Any + Send + Sync>,
}

impl fmt::Debug for ForeignArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignArray")
            .field("ptr", &self.ptr)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("strides", &self.strides)
            .field("memory", &self.memory)
            .finish()
    }
}

// SAFETY: a `ForeignArray` is a description of memory whose validity its creator promised
// (see `ForeignArray::new`); the pointer is only dereferenced under that promise, and the owner
// is `Send + Sync`.
unsafe impl Send for ForeignArray {}
// SAFETY: as above; `&ForeignArray` gives no access to the memory.
unsafe impl Sync for ForeignArray {}

/// Whether making a tensor of an array copied it (the engine's memory is read in place when
/// not).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Import {
    InPlace,
    Copied,
}

impl ForeignArray {
    /// Describe the array at `ptr`; `strides` in elements (`None`: row-major).
    ///
    /// # Safety
    /// As long as `owner` lives, every element the shape and strides reach from `ptr` is valid
    /// memory of `memory`'s kind, for reads and (if kda is to write the array) writes, and the
    /// engine orders its own use of it as `kda_core::Device::import_buffer` says.
    pub unsafe fn new(
        ptr: *mut u8,
        dtype: DType,
        shape: Vec<usize>,
        strides: Option<Vec<isize>>,
        memory: Memory,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Self> {
        let strides = match strides {
            None => kda_core::layout::contiguous_strides(&shape)
                .into_iter()
                .map(|s| s as isize)
                .collect(),
            Some(s) if s.len() == shape.len() => s,
            Some(s) => {
                return Err(EmbedError::Array {
                    param: "array",
                    message: format!("{} strides for a shape of rank {}", s.len(), shape.len()),
                });
            }
        };
        Ok(Self { ptr, dtype, shape, strides, memory, owner })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn memory(&self) -> Memory {
        self.memory
    }

    /// The element count; `None` when it overflows (a strided view, numpy's `broadcast_to`,
    /// can describe more elements than any memory holds).
    pub fn numel(&self) -> Option<usize> {
        kda_core::layout::checked_numel(&self.shape)
    }

    /// `Err` naming `param` unless the array is of one of `dtypes`.
    pub fn expect_dtype(&self, param: &'static str, dtypes: &[DType]) -> Result<()> {
        if dtypes.contains(&self.dtype) {
            return Ok(());
        }
        let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        Err(EmbedError::Array {
            param,
            message: format!("dtype {}, expected {}", self.dtype, names.join(" or ")),
        })
    }

    /// `Err` naming `param` unless the array has rank `rank`.
    pub fn expect_rank(&self, param: &'static str, rank: usize, what: &str) -> Result<()> {
        if self.shape.len() == rank {
            return Ok(());
        }
        Err(EmbedError::Array {
            param,
            message: format!("shape {:?}, expected {what}", self.shape),
        })
    }

    /// The layout of the array over the bytes from its pointer on, if its strides are
    /// non-negative.
    fn layout(&self) -> Option<Layout> {
        let strides: Vec<usize> =
            self.strides.iter().map(|&s| usize::try_from(s).ok()).collect::<Option<_>>()?;
        Layout::strided(self.dtype, &self.shape, &strides, 0).ok()
    }

    /// A tensor of `device` holding the array: the engine's memory itself where the backend can
    /// import it, the layout is non-negative and (with `contiguous`) row-major, and the pointer
    /// is aligned; otherwise a copy in kda's memory, made on `stream`. `param` names the array
    /// in errors.
    pub fn to_tensor<B: Backend>(
        self,
        device: &Device<B>,
        stream: &B::Stream,
        param: &'static str,
        contiguous: bool,
    ) -> Result<(Tensor<B>, Import)> {
        let backend = device.info().name;
        let native = match self.memory {
            Memory::Host => backend == "reference",
            Memory::Device { backend: b, .. } => b == backend,
        };
        let Some(layout) = self.layout() else {
            return self.copy_host(device, stream, param);
        };
        let aligned = self.ptr.align_offset(4) == 0;
        if !native || !aligned {
            return self.copy_host(device, stream, param);
        }
        let span = layout.byte_span().end;
        let Self { ptr, owner, .. } = self;
        // SAFETY: `ForeignArray::new`'s contract: the span the layout reaches is valid memory of
        // this backend's kind while `owner` lives, ordered as `import_buffer` asks.
        let buffer = unsafe { device.import_buffer(ptr, span, owner) }?;
        let tensor = Tensor::new(buffer, layout)?;
        if !contiguous || tensor.layout().is_contiguous() {
            return Ok((tensor, Import::InPlace));
        }
        let dense = device.alloc(tensor.dtype(), tensor.shape())?;
        device.launch(stream, Op::Copy { src: tensor, dst: dense.clone() })?;
        Ok((dense, Import::Copied))
    }

    /// Upload a host array's elements (row-major) into a new tensor.
    fn copy_host<B: Backend>(
        &self,
        device: &Device<B>,
        stream: &B::Stream,
        param: &'static str,
    ) -> Result<(Tensor<B>, Import)> {
        if self.memory != Memory::Host {
            return Err(EmbedError::Array {
                param,
                message: format!(
                    "{} cannot be used by the {} backend",
                    self.memory,
                    device.info().name
                ),
            });
        }
        let dst = device.alloc(self.dtype, &self.shape)?;
        // SAFETY: host memory, valid per `ForeignArray::new`'s contract.
        let bytes = unsafe { self.gather_bytes() }?;
        device.launch(stream, Op::Upload { dst: dst.clone(), data: bytes.into() })?;
        Ok((dst, Import::Copied))
    }

    /// The elements in row-major order, as bytes. The byte count is checked (a shape whose
    /// size overflows is an error, not a count that wrapped) and reserved fallibly: a strided
    /// view (numpy's `broadcast_to`) can describe far more elements than its memory holds.
    ///
    /// # Safety
    /// Host memory, valid as `ForeignArray::new` promised.
    unsafe fn gather_bytes(&self) -> Result<Vec<u8>> {
        let bytes = kda_core::layout::checked_size_bytes(self.dtype, &self.shape)
            .map_err(kda_core::Error::from)?;
        let mut out = Vec::new();
        out.try_reserve_exact(bytes).map_err(|_| kda_core::Error::OutOfMemory { bytes })?;
        // SAFETY: forwarded contract.
        unsafe { self.for_each_run(|run| out.extend_from_slice(run)) };
        Ok(out)
    }

    /// The elements in row-major order, as runs of bytes handed to `f` in turn.
    ///
    /// # Safety
    /// Host memory, valid as `ForeignArray::new` promised.
    unsafe fn for_each_run(&self, mut f: impl FnMut(&[u8])) {
        let size = self.dtype.size_bytes();
        if self.shape.contains(&0) {
            return;
        }
        // The trailing dimensions laid out row-major (each stride the count of elements after
        // it; a dimension of size 1 fits any stride) form runs handed over whole: one run for a
        // contiguous array, a row at a time for a sliced one. The rest are walked index by index.
        let (mut outer, mut run) = (self.shape.len(), 1usize);
        while outer > 0 {
            let d = outer - 1;
            if self.shape[d] != 1 && self.strides[d] != run as isize {
                break;
            }
            run *= self.shape[d];
            outer = d;
        }
        let mut index = vec![0usize; outer];
        loop {
            let offset: isize =
                index.iter().zip(&self.strides).map(|(&i, &s)| i as isize * s).sum();
            // SAFETY: every index inside the shape reaches valid memory (the contract), and the
            // `run` elements from this one are the array's next elements, laid out one after
            // the other; they are read as bytes (unaligned).
            let start = unsafe { self.ptr.offset(offset * size as isize) };
            // SAFETY: `run · size` readable bytes at `start`.
            f(unsafe { std::slice::from_raw_parts(start, run * size) });
            // Next index of the outer dimensions, row-major.
            let mut dim = outer;
            loop {
                if dim == 0 {
                    return;
                }
                dim -= 1;
                index[dim] += 1;
                if index[dim] < self.shape[dim] {
                    break;
                }
                index[dim] = 0;
            }
        }
    }

    /// A host array's elements in row-major order as bytes (native endianness): the engine's
    /// memory itself when the array is row-major, a copy otherwise. `param` names it in errors.
    pub fn host_bytes(&self, param: &str) -> Result<std::borrow::Cow<'_, [u8]>> {
        if self.memory != Memory::Host {
            return Err(EmbedError::Array {
                param: "weights",
                message: format!("{param}: {}: expected a host (CPU) array", self.memory),
            });
        }
        let contiguous = kda_core::layout::contiguous_strides(&self.shape)
            .into_iter()
            .zip(&self.strides)
            .zip(&self.shape)
            .all(|((c, &s), &d)| d <= 1 || isize::try_from(c).is_ok_and(|c| c == s));
        let len = kda_core::layout::checked_size_bytes(self.dtype, &self.shape).map_err(|e| {
            EmbedError::Array { param: "weights", message: format!("{param}: {e}") }
        })?;
        if contiguous && (len == 0 || !self.ptr.is_null()) {
            if len == 0 {
                return Ok(std::borrow::Cow::Borrowed(&[]));
            }
            // SAFETY: `ForeignArray::new`'s contract: a row-major array's `len` bytes from `ptr`
            // are valid host memory while `owner` (which `self` holds) lives; the borrow ends
            // with `self`. u8 has no alignment requirement.
            return Ok(std::borrow::Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(self.ptr, len)
            }));
        }
        // SAFETY: host memory, valid per `ForeignArray::new`'s contract.
        Ok(std::borrow::Cow::Owned(unsafe { self.gather_bytes() }?))
    }

    /// A host float array's values as f32 (exact for bf16 and f16), row-major.
    pub fn to_f32(&self, param: &'static str) -> Result<Vec<f32>> {
        self.expect_host(param)?;
        self.expect_dtype(param, &[DType::F32, DType::BF16, DType::F16])?;
        // Sized from the checked element count, reserved fallibly; then converted run by run,
        // with no copy of the bytes in between (at decode the state is most of what the call
        // moves).
        let bytes = kda_core::layout::checked_size_bytes(self.dtype, &self.shape)
            .map_err(kda_core::Error::from)?;
        let numel = bytes / self.dtype.size_bytes();
        let mut out = Vec::new();
        out.try_reserve_exact(numel)
            .map_err(|_| kda_core::Error::OutOfMemory { bytes: numel.saturating_mul(4) })?;
        let dtype = self.dtype;
        let convert = |run: &[u8]| match dtype {
            DType::BF16 => {
                out.extend(run.chunks_exact(2).map(|c| bf16::from_ne_bytes([c[0], c[1]]).to_f32()))
            }
            DType::F16 => {
                out.extend(run.chunks_exact(2).map(|c| f16::from_ne_bytes([c[0], c[1]]).to_f32()))
            }
            _ => out
                .extend(run.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))),
        };
        // SAFETY: host memory, valid per `ForeignArray::new`'s contract.
        unsafe { self.for_each_run(convert) };
        Ok(out)
    }

    /// `Err` naming `param` unless the array is in host memory.
    pub fn expect_host(&self, param: &'static str) -> Result<()> {
        if self.memory == Memory::Host {
            Ok(())
        } else {
            Err(EmbedError::Array {
                param,
                message: format!("{}: expected a host (CPU) array", self.memory),
            })
        }
    }
}
