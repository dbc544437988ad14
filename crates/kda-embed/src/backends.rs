//! The one backend selector, shared by the bindings and the `kda` CLI: every backend kda knows
//! ([`BackendKind`]), a value of some per-backend type for whichever backend was chosen at run
//! time ([`PerBackend`]), and the two ways to reach code written once over `B: Backend`:
//! [`on_backend!`](crate::on_backend) on a held value and [`for_kind!`](crate::for_kind) on a
//! kind.
//!
//! Every backend is always compiled in: without its feature, kda-cuda and kda-ascend compile to
//! twins whose constructors say which feature builds them in (the candle `dummy_cuda_backend`
//! pattern), so no match here, and no caller's match, carries a `cfg`.

use std::fmt;

use kda_core::Backend;

pub use kda_ascend::AscendBackend;
pub use kda_cuda::CudaBackend;
pub use kda_reference::ReferenceBackend;

/// The backends kda knows.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The CPU reference backend, the numerical oracle (always available).
    Reference,
    /// NVIDIA GPUs through CUDA.
    Cuda,
    /// Ascend NPUs through ACL.
    Ascend,
}

impl BackendKind {
    pub const ALL: [Self; 3] = [Self::Reference, Self::Cuda, Self::Ascend];

    /// The names [`BackendKind::parse`] accepts, for messages.
    pub const NAMES: &'static str = "\"reference\", \"cuda\" or \"ascend\"";

    /// The backend's name: `"reference"`, `"cuda"` or `"ascend"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Reference => "reference",
            Self::Cuda => "cuda",
            Self::Ascend => "ascend",
        }
    }

    /// The backend named `name` (as [`BackendKind::name`] spells it).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A type made per backend: `Of<B>` is what [`PerBackend`]'s variant for `B` holds (a session,
/// a layer, a cache on that backend).
pub trait Family {
    type Of<B: Backend>;
}

/// One value of the family `F`, on whichever backend was chosen at run time.
pub enum PerBackend<F: Family> {
    Reference(F::Of<ReferenceBackend>),
    Cuda(F::Of<CudaBackend>),
    Ascend(F::Of<AscendBackend>),
}

impl<F: Family> fmt::Debug for PerBackend<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PerBackend({})", self.kind())
    }
}

impl<F: Family> PerBackend<F> {
    /// The backend the value is on.
    pub fn kind(&self) -> BackendKind {
        match self {
            Self::Reference(_) => BackendKind::Reference,
            Self::Cuda(_) => BackendKind::Cuda,
            Self::Ascend(_) => BackendKind::Ascend,
        }
    }
}

/// A backend [`PerBackend`] has a variant for: how to put a value of a family into that variant
/// and take it out again, so that code holding one backend's value (a layer) can reach the
/// same backend's value of another family (the cache it is given).
pub trait KnownBackend: Backend {
    const KIND: BackendKind;

    fn wrap<F: Family>(value: F::Of<Self>) -> PerBackend<F>;

    /// The value when `any` is on this backend.
    fn get<F: Family>(any: &PerBackend<F>) -> Option<&F::Of<Self>>;

    /// The value when `any` is on this backend.
    fn get_mut<F: Family>(any: &mut PerBackend<F>) -> Option<&mut F::Of<Self>>;
}

macro_rules! known_backend {
    ($($backend:ident => $variant:ident),* $(,)?) => {
        $( impl KnownBackend for $backend {
            const KIND: BackendKind = BackendKind::$variant;

            fn wrap<F: Family>(value: F::Of<Self>) -> PerBackend<F> {
                PerBackend::$variant(value)
            }

            fn get<F: Family>(any: &PerBackend<F>) -> Option<&F::Of<Self>> {
                match any {
                    PerBackend::$variant(value) => Some(value),
                    _ => None,
                }
            }

            fn get_mut<F: Family>(any: &mut PerBackend<F>) -> Option<&mut F::Of<Self>> {
                match any {
                    PerBackend::$variant(value) => Some(value),
                    _ => None,
                }
            }
        } )*
    };
}

known_backend! { ReferenceBackend => Reference, CudaBackend => Cuda, AscendBackend => Ascend }

/// Evaluate `$body` with `$x` bound to the value `$any` (a [`PerBackend`], or a reference to
/// one) holds and `$B` naming its backend type. The body is compiled once per backend, so it
/// calls code generic over `B: Backend` (and `$B::get` reaches other families' values).
#[macro_export]
macro_rules! on_backend {
    ($any:expr, |$B:ident, $x:pat_param| $body:expr) => {
        match $any {
            $crate::backends::PerBackend::Reference($x) => {
                #[allow(dead_code)]
                type $B = $crate::backends::ReferenceBackend;
                $body
            }
            $crate::backends::PerBackend::Cuda($x) => {
                #[allow(dead_code)]
                type $B = $crate::backends::CudaBackend;
                $body
            }
            $crate::backends::PerBackend::Ascend($x) => {
                #[allow(dead_code)]
                type $B = $crate::backends::AscendBackend;
                $body
            }
        }
    };
}

/// Evaluate `$body` with `$B` naming the backend type of `$kind` (a [`BackendKind`]); the body
/// is compiled once per backend.
#[macro_export]
macro_rules! for_kind {
    ($kind:expr, |$B:ident| $body:expr) => {
        match $kind {
            $crate::backends::BackendKind::Reference => {
                type $B = $crate::backends::ReferenceBackend;
                $body
            }
            $crate::backends::BackendKind::Cuda => {
                type $B = $crate::backends::CudaBackend;
                $body
            }
            $crate::backends::BackendKind::Ascend => {
                type $B = $crate::backends::AscendBackend;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each backend's name, for a family that is the backend's kind.
    struct Kinds;
    impl Family for Kinds {
        type Of<B: Backend> = BackendKind;
    }

    fn of_kind(kind: BackendKind) -> PerBackend<Kinds> {
        for_kind!(kind, |B| <B as KnownBackend>::wrap::<Kinds>(<B as KnownBackend>::KIND))
    }

    #[test]
    fn kinds_round_trip_through_names_and_variants() {
        for kind in BackendKind::ALL {
            assert_eq!(BackendKind::parse(kind.name()), Some(kind));
            let any = of_kind(kind);
            assert_eq!(any.kind(), kind);
            // The body sees the variant's backend: its KIND and the value agree.
            let seen = on_backend!(&any, |B, k| {
                assert_eq!(<B as KnownBackend>::KIND, *k);
                <B as KnownBackend>::get(&any).copied()
            });
            assert_eq!(seen, Some(kind));
        }
        assert_eq!(BackendKind::parse("tpu"), None);
        // Another backend's value is not this backend's.
        assert!(<CudaBackend as KnownBackend>::get(&of_kind(BackendKind::Reference)).is_none());
    }
}
