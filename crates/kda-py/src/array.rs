//! Python arrays as [`ForeignArray`]s, without a copy: numpy's `__array_interface__` (every
//! numpy dtype, ml_dtypes' bfloat16 included), DLPack's `__dlpack__` (torch and the rest), or
//! the buffer protocol through `numpy.asarray`; and numpy arrays made for kda's results.

use std::ffi::{CStr, c_void};

use kda_core::DType;
use kda_embed::{EmbedError, ForeignArray, Memory};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::to_py;

/// DLPack's `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack's `DLManagedTensor` (the legacy, unversioned capsule `"dltensor"`).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

const DLPACK_CAPSULE: &CStr = c"dltensor";
/// The most dimensions a DLPack tensor may have here (numpy's `NPY_MAXDIMS`; torch allows 25).
const MAX_DLPACK_NDIM: usize = 64;
const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
/// What torch_npu exports Ascend tensors as (`kDLExtDev`).
const KDL_EXT_DEV: i32 = 12;

fn array_error(param: &'static str, message: String) -> PyErr {
    to_py(EmbedError::Array { param, message })
}

/// The kda dtype of a DLPack dtype.
fn dlpack_dtype(param: &'static str, t: &DlDataType) -> PyResult<DType> {
    let dtype = match (t.code, t.bits, t.lanes) {
        (2, 32, 1) => DType::F32,
        (2, 16, 1) => DType::F16,
        (4, 16, 1) => DType::BF16,
        (0, 32, 1) => DType::I32,
        (1, 8, 1) => DType::U8,
        (code, bits, lanes) => {
            let message = format!(
                "DLPack dtype (code {code}, {bits} bits, {lanes} lanes) is not one kda reads (f32, bf16, f16, i32, u8)"
            );
            return Err(array_error(param, message));
        }
    };
    Ok(dtype)
}

/// The kda dtype of a numpy array (`typestr` and, for ml_dtypes' bfloat16, the dtype's name).
fn numpy_dtype(param: &'static str, obj: &Bound<'_, PyAny>, typestr: &str) -> PyResult<DType> {
    let little = cfg!(target_endian = "little");
    let dtype = match typestr {
        "<f4" if little => DType::F32,
        "<f2" if little => DType::F16,
        "<i4" if little => DType::I32,
        "|u1" => DType::U8,
        "<V2" | "|V2" if little => {
            let name: String = obj.getattr("dtype")?.getattr("name")?.extract()?;
            if name != "bfloat16" {
                let message = format!("numpy dtype {name} is not one kda reads");
                return Err(array_error(param, message));
            }
            DType::BF16
        }
        other => {
            let message = format!(
                "numpy dtype {other} is not one kda reads (float32, bfloat16, float16, int32, uint8)"
            );
            return Err(array_error(param, message));
        }
    };
    Ok(dtype)
}

/// `obj` (an array exposing `__array_interface__`, `__dlpack__` or the buffer protocol) as a
/// foreign array kept alive by a reference to it. `stream`: the consumer stream passed to
/// `__dlpack__` for device tensors.
pub fn foreign(
    py: Python<'_>,
    param: &'static str,
    obj: &Bound<'_, PyAny>,
    stream: Option<usize>,
) -> PyResult<ForeignArray> {
    if obj.hasattr("__array_interface__")? {
        return from_array_interface(param, obj);
    }
    if obj.hasattr("__dlpack__")? {
        return from_dlpack(py, param, obj, stream);
    }
    // The buffer protocol: numpy wraps the memory without a copy.
    let numpy = py.import("numpy")?;
    let wrapped = numpy.call_method1("asarray", (obj,)).map_err(|e| {
        array_error(
            param,
            format!("expected an array (__dlpack__, __array_interface__ or a buffer): {e}"),
        )
    })?;
    from_array_interface(param, &wrapped)
}

fn from_array_interface(param: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<ForeignArray> {
    let interface = obj.getattr("__array_interface__")?;
    let interface = interface.cast::<PyDict>()?;
    let get = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        interface
            .get_item(key)?
            .ok_or_else(|| array_error(param, format!("__array_interface__ has no {key}")))
    };
    let (ptr, _readonly): (usize, bool) = get("data")?.extract()?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    let dtype = numpy_dtype(param, obj, &typestr)?;
    let size = dtype.size_bytes() as isize;
    let strides = match interface.get_item("strides")? {
        Some(s) if !s.is_none() => {
            let bytes: Vec<isize> = s.extract()?;
            if bytes.iter().any(|b| b % size != 0) {
                let message = format!("byte strides {bytes:?} are not whole {dtype} elements");
                return Err(array_error(param, message));
            }
            Some(bytes.iter().map(|b| b / size).collect())
        }
        _ => None,
    };
    let owner: Py<PyAny> = obj.clone().unbind();
    // SAFETY: numpy's interface describes memory valid while the array lives; `owner` keeps it
    // alive. The caller of a kda call does not touch the array while the call runs (the call
    // returns with the work complete, or the engine orders its stream).
    unsafe {
        ForeignArray::new(ptr as *mut u8, dtype, shape, strides, Memory::Host, Box::new(owner))
    }
    .map_err(to_py)
}

fn from_dlpack(
    py: Python<'_>,
    param: &'static str,
    obj: &Bound<'_, PyAny>,
    stream: Option<usize>,
) -> PyResult<ForeignArray> {
    let capsule = match stream {
        Some(s) => {
            let kwargs = PyDict::new(py);
            kwargs.set_item("stream", s)?;
            obj.call_method("__dlpack__", PyTuple::empty(py), Some(&kwargs))?
        }
        None => obj.call_method0("__dlpack__")?,
    };
    // SAFETY: `capsule` is a live object; `PyCapsule_GetPointer` checks the type and the name
    // (a wrong one sets an exception and returns null).
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), DLPACK_CAPSULE.as_ptr()) };
    if managed.is_null() {
        return Err(PyErr::take(py).unwrap_or_else(|| {
            array_error(param, "__dlpack__ did not return a \"dltensor\" capsule".into())
        }));
    }
    // SAFETY: a "dltensor" capsule holds a `DLManagedTensor`, alive while the capsule is
    // unconsumed: we leave its name as it is, so the capsule's own destructor frees it once
    // our reference (the owner below) is dropped.
    let t = unsafe { &(*managed.cast::<DlManagedTensor>()).dl_tensor };
    let dtype = dlpack_dtype(param, &t.dtype)?;
    // `ndim` sizes the reads of `shape` and `strides` below: bounded first (numpy's limit; a
    // negative one is refused, not read as 0).
    let ndim = usize::try_from(t.ndim).ok().filter(|&n| n <= MAX_DLPACK_NDIM).ok_or_else(|| {
        array_error(param, format!("DLPack ndim = {}, expected 0..={MAX_DLPACK_NDIM}", t.ndim))
    })?;
    let dims = |p: *const i64| -> Vec<i64> {
        if p.is_null() || ndim == 0 {
            return Vec::new();
        }
        // SAFETY: DLPack: `shape` (and `strides` when non-null) hold `ndim` entries.
        unsafe { std::slice::from_raw_parts(p, ndim) }.to_vec()
    };
    let shape: Vec<usize> = dims(t.shape)
        .into_iter()
        .map(|d| usize::try_from(d).map_err(|_| array_error(param, format!("dimension {d}"))))
        .collect::<PyResult<_>>()?;
    let strides = if t.strides.is_null() {
        None
    } else {
        Some(dims(t.strides).into_iter().map(|s| s as isize).collect())
    };
    let memory = match t.device.device_type {
        KDL_CPU | KDL_CUDA_HOST => Memory::Host,
        KDL_CUDA => Memory::Device { backend: "cuda", device: i64::from(t.device.device_id) },
        KDL_EXT_DEV => Memory::Device { backend: "ascend", device: i64::from(t.device.device_id) },
        other => {
            let message = format!("DLPack device type {other} is not one kda uses");
            return Err(array_error(param, message));
        }
    };
    let data = t.data.cast::<u8>().wrapping_add(t.byte_offset as usize);
    let owner: (Py<PyAny>, Py<PyAny>) = (obj.clone().unbind(), capsule.unbind());
    // SAFETY: the capsule (kept by `owner`, with the producing array) keeps the tensor's memory
    // alive; DLPack's shape and strides describe it.
    unsafe { ForeignArray::new(data, dtype, shape, strides, memory, Box::new(owner)) }
        .map_err(to_py)
}

/// `Err` if `obj` is a numpy array marked read-only: kda writes `param` in place.
pub fn expect_writable(param: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<()> {
    if obj.hasattr("__array_interface__")? {
        let data = obj.getattr("__array_interface__")?.get_item("data")?;
        let (_, readonly): (usize, bool) = data.extract()?;
        if readonly {
            return Err(array_error(param, "is read-only, but kda writes it in place".into()));
        }
    }
    Ok(())
}

/// A new numpy array of `dtype` (`"float32"`, `"uint8"`) and `shape`.
pub fn numpy_empty<'py>(
    py: Python<'py>,
    dtype: &str,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    let numpy = py.import("numpy")?;
    let shape = PyTuple::new(py, shape)?;
    numpy.call_method1("empty", (shape, dtype))
}

/// A new numpy array holding `values` with `shape`.
pub fn numpy_from<'py, T: Copy>(
    py: Python<'py>,
    dtype: &str,
    shape: &[usize],
    values: &[T],
) -> PyResult<Bound<'py, PyAny>> {
    let array = numpy_empty(py, dtype, shape)?;
    let interface = array.getattr("__array_interface__")?;
    let (ptr, _): (usize, bool) = interface.get_item("data")?.extract()?;
    if values.len() != shape.iter().product::<usize>() {
        return Err(array_error("result", format!("{} values for shape {shape:?}", values.len())));
    }
    if !values.is_empty() {
        // SAFETY: a fresh, contiguous numpy array of `values.len()` elements of `T`'s size.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), ptr as *mut T, values.len()) };
    }
    Ok(array)
}
