//! The device vocabulary every layer of kda-core shares: ids, the handles of streams, events and
//! buffers, the [`Resources`] trait naming a backend's handle types, the execution units ops
//! occupy, and what a backend reports about itself. Nothing here runs anything; the raw backend
//! trait is [`crate::hal`], the façade callers use is [`crate::device`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::dtype::DType;

/// Identifies one backend instance; handles carry it so that mixing instances is an error.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId(u64);

impl InstanceId {
    /// A process-unique id for a new backend instance.
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

macro_rules! handle_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name {
            pub instance: InstanceId,
            pub index: u64,
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.index)
            }
        }
    };
}

handle_id!(
    /// Identifies a stream within its backend instance (`s0`, `s1`, …).
    StreamId,
    "s"
);
handle_id!(
    /// Identifies an event within its backend instance.
    EventId,
    "e"
);
handle_id!(
    /// Identifies a buffer within its backend instance.
    BufferId,
    "buf"
);

/// A backend's stream handle.
pub trait StreamHandle: Clone + Send + Sync + fmt::Debug + 'static {
    fn id(&self) -> StreamId;
}

/// A backend's event handle.
pub trait EventHandle: Clone + Send + Sync + fmt::Debug + 'static {
    fn id(&self) -> EventId;
}

/// A backend's device memory handle. Cloning shares the same memory; the memory is released when
/// the last handle, including those held by queued ops, is dropped.
pub trait BufferHandle: Clone + Send + Sync + fmt::Debug + 'static {
    fn id(&self) -> BufferId;
    fn len_bytes(&self) -> usize;
}

/// How a backend runs ops, as reported by [`Backend::info`](crate::Backend::info).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Ops on different streams really run at the same time.
    pub concurrent_streams: bool,
    /// Both projection GEMMs compete for one matrix unit, so the overlapped schedule keeps them
    /// serialised (`docs/design/schedule.md#matrix-overlap`). False on CPUs, where each stream has
    /// its own cores.
    pub shared_matrix_units: bool,
    /// The backend runs the KDA recurrence (`KdaChunk` prefill, `KdaRecurrent` decode) fastest
    /// on bf16 operands, through the runtime's own tuned operators (on Ascend, CANN's
    /// `aclnnChunkKdaFwd`). A layer whose `CoreOperands` (kda-model) are left
    /// open then runs its core in bf16 (`docs/design/kda.md#core-operand-dtype`).
    pub bf16_core: bool,
    /// A failure while an op executes on the device (a device fault, a kernel's check of device
    /// metadata) stops every stream of the process's device context for good, not only the
    /// failing one: later work on any stream fails with that failure until the process ends
    /// (Ascend: the backend runs with `ACL_STOP_ON_FAILURE`, and CANN keeps the context failed
    /// until it is destroyed). False where `synchronize` reports and clears the failure and the
    /// stream works again (`docs/design/architecture.md#when-errors-surface`).
    pub device_faults_are_fatal: bool,
    /// A short description of the execution model (e.g. "one core per stream").
    pub execution: String,
    /// Host or device threads the backend computes with.
    pub threads: usize,
    /// Input dtypes the dense GEMM accepts.
    pub gemm_inputs: Vec<DType>,
    /// The op families the backend runs on its own hardware path (not an emulation that exists
    /// only off the device). The layer chooses its QKV precision from it
    /// (`docs/design/kda.md#qkv-precision`).
    pub native: NativeOps,
}

/// Which op families a backend can run, as [`Capabilities::native`] reports them. An op family
/// is absent where the chip or the installed runtime lacks it (on Ascend, CANN for A2/A3 has no
/// `aclnnDynamicMxQuantV3`); a layer then takes a path that does not need it instead of failing
/// at its first call.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct NativeOps {
    /// MXFP8 quantization of an activation (`Op::DynamicQuant`).
    pub mx_quant: bool,
    /// The MXFP8 GEMM (`Op::MxGemm`).
    pub mx_gemm: bool,
}

impl NativeOps {
    /// Every op family: what a backend that implements the whole op set reports.
    pub const ALL: Self = Self { mx_quant: true, mx_gemm: true };

    /// Whether the MXFP8 QKV projection (DynamicQuant, then the MX GEMM) can run.
    pub fn mxfp8(self) -> bool {
        self.mx_quant && self.mx_gemm
    }

    /// `mx_quant, mx_gemm` for the families present, `none` when there is none, for `kda info`.
    pub fn describe(self) -> String {
        let present: Vec<&str> = [(self.mx_quant, "mx_quant"), (self.mx_gemm, "mx_gemm")]
            .into_iter()
            .filter_map(|(on, name)| on.then_some(name))
            .collect();
        if present.is_empty() { "none".into() } else { present.join(", ") }
    }
}

/// A backend's name and capabilities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendInfo {
    pub name: &'static str,
    pub instance: InstanceId,
    pub capabilities: Capabilities,
}

/// The handle types of one backend, in the spirit of `wgpu-hal`'s `Api`: what tensors, ops and
/// graphs are generic over. [`crate::hal::Backend`] adds the verbs.
pub trait Resources: Clone + Send + Sync + fmt::Debug + Sized + 'static {
    type Stream: StreamHandle;
    type Event: EventHandle;
    type Buffer: BufferHandle;
}

/// The kind of execution unit an op keeps busy, for the sanitizer's optional exclusive-unit
/// rules (see [`crate::sanitize::ExclusiveUnits`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ComputeUnit {
    /// Matrix multiply units (Ascend's Cube, tensor cores): the GEMMs.
    Matrix,
    /// Vector units: element-wise and reduction kernels.
    Vector,
}
