//! The chip table: per-chip figures with each figure's provenance
//! (docs/design/planner.md#the-chip-table).

use std::fmt;

use super::calibrate::{CacheSizes, Calibration};
use super::{CostUnit, OpWork, PlanError, op_time};
use kda_core::sanitize::Entry;

/// Where a figure comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Provenance {
    /// A vendor's public figure; the source names the document.
    Published(&'static str),
    /// Our assumption, with the reason.
    Assumed(&'static str),
    /// Measured on this machine at start-up.
    Measured,
}

impl fmt::Display for Provenance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Provenance::Published(source) => write!(f, "published ({source})"),
            Provenance::Assumed(why) => write!(f, "assumed ({why})"),
            Provenance::Measured => write!(f, "measured"),
        }
    }
}

/// One figure and where it comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure<T> {
    pub value: T,
    pub provenance: Provenance,
}

fn published<T>(value: T, source: &'static str) -> Figure<T> {
    Figure { value, provenance: Provenance::Published(source) }
}

fn assumed<T>(value: T, why: &'static str) -> Figure<T> {
    Figure { value, provenance: Provenance::Assumed(why) }
}

fn measured<T>(value: T) -> Figure<T> {
    Figure { value, provenance: Provenance::Measured }
}

/// What the cost model knows of one chip.
#[derive(Clone, Debug, PartialEq)]
pub struct ChipFigures {
    pub name: &'static str,
    /// Dense bf16 matrix rate, FLOP/s.
    pub matrix_flops: Figure<f64>,
    /// Dense MXFP8 matrix rate, FLOP/s.
    pub mx_matrix_flops: Figure<f64>,
    /// Memory bandwidth seen by matrix and vector kernels, bytes/s.
    pub vector_bytes_per_s: Figure<f64>,
    /// Bandwidth of copies, fills and transfers, bytes/s (bytes read plus written).
    pub copy_bytes_per_s: Figure<f64>,
    /// Host issue cost of one launch, seconds.
    pub launch_s: Figure<f64>,
    /// Both streams' matrix ops share one matrix unit (they serialise).
    pub shared_matrix_units: Figure<bool>,
    /// The streams share one set of units: ops of different streams never overlap (true for a
    /// host whose second core is taken by other work).
    pub shared_streams: Figure<bool>,
    /// Seconds a wait on another stream's event costs the waiting stream.
    pub wait_s: Figure<f64>,
    /// Per-op-kind costs fitted to this machine's measurements (`kda plan --calibrate`); the
    /// kinds it knows override the roofline.
    pub calibration: Option<Calibration>,
}

/// The chips with a built-in table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chip {
    Ascend910B,
    Ascend950,
    H200,
}

impl Chip {
    pub const ALL: [Chip; 3] = [Chip::Ascend910B, Chip::Ascend950, Chip::H200];

    /// The chip's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Chip::Ascend910B => "910b",
            Chip::Ascend950 => "950",
            Chip::H200 => "h200",
        }
    }

    /// The chip named `name` (`910b`, `950`, `h200`).
    pub fn parse(name: &str) -> Option<Chip> {
        Chip::ALL.into_iter().find(|c| c.name().eq_ignore_ascii_case(name))
    }

    /// The chip's figures (docs/design/planner.md#the-chip-table).
    pub fn figures(self) -> ChipFigures {
        const CUBE: &str =
            "Ascend's Cube units are shared by both streams (docs/design/schedule.md)";
        const LAUNCH: &str = "typical kernel launch overhead, not a vendor figure";
        const COPY: &str = "copies taken at the HBM bandwidth";
        const WAIT: &str = "an event wait is taken as free next to the ops";
        const STREAMS: &str = "the vector units of each stream's ops run side by side";
        match self {
            Chip::Ascend910B => ChipFigures {
                name: "Ascend 910B",
                matrix_flops: assumed(313e12, "widely reported FP16 dense rate; bf16 taken equal"),
                mx_matrix_flops: assumed(313e12, "no FP8 matrix unit: taken at the bf16 rate"),
                vector_bytes_per_s: assumed(1.6e12, "widely reported HBM2e bandwidth"),
                copy_bytes_per_s: assumed(1.6e12, COPY),
                launch_s: assumed(10e-6, LAUNCH),
                shared_matrix_units: assumed(true, CUBE),
                shared_streams: assumed(false, STREAMS),
                wait_s: assumed(0.0, WAIT),
                calibration: None,
            },
            Chip::Ascend950 => ChipFigures {
                name: "Ascend 950 (DT)",
                matrix_flops: assumed(500e12, "half the announced 1 PFLOPS FP8 rate"),
                mx_matrix_flops: published(1e15, "Huawei Connect 2025 Ascend roadmap, FP8"),
                vector_bytes_per_s: published(
                    4.0e12,
                    "Huawei Connect 2025 Ascend roadmap, 950DT HBM",
                ),
                copy_bytes_per_s: assumed(4.0e12, COPY),
                launch_s: assumed(10e-6, LAUNCH),
                shared_matrix_units: assumed(true, CUBE),
                shared_streams: assumed(false, STREAMS),
                wait_s: assumed(0.0, WAIT),
                calibration: None,
            },
            Chip::H200 => ChipFigures {
                name: "NVIDIA H200 SXM",
                matrix_flops: published(989e12, "NVIDIA H200 datasheet, BF16 dense (1979 sparse)"),
                mx_matrix_flops: assumed(
                    989e12,
                    "Hopper has no MX block scales: taken at the bf16 rate",
                ),
                vector_bytes_per_s: published(4.8e12, "NVIDIA H200 datasheet, HBM3e"),
                copy_bytes_per_s: assumed(4.8e12, COPY),
                launch_s: assumed(4e-6, LAUNCH),
                shared_matrix_units: assumed(
                    false,
                    "SMs are partitioned between concurrent kernels",
                ),
                shared_streams: assumed(false, STREAMS),
                wait_s: assumed(0.0, WAIT),
                calibration: None,
            },
        }
    }
}

impl ChipFigures {
    /// This machine, from figures measured at start-up: the bf16 and MXFP8 GEMM rates of one
    /// core, the memory bandwidth, the launch cost; the reference backend gives each stream its
    /// own core.
    pub fn host(
        gemm_flops: f64,
        mx_gemm_flops: f64,
        bytes_per_s: f64,
        launch_s: f64,
    ) -> ChipFigures {
        ChipFigures {
            name: "this host",
            matrix_flops: measured(gemm_flops),
            mx_matrix_flops: measured(mx_gemm_flops),
            vector_bytes_per_s: measured(bytes_per_s),
            copy_bytes_per_s: measured(bytes_per_s),
            launch_s: measured(launch_s),
            shared_matrix_units: Figure {
                value: false,
                provenance: Provenance::Assumed("the reference backend: one core per stream"),
            },
            shared_streams: Figure {
                value: false,
                provenance: Provenance::Assumed("one core per stream, both free"),
            },
            wait_s: Figure {
                value: 0.0,
                provenance: Provenance::Assumed("not measured before calibration"),
            },
            calibration: None,
        }
    }

    /// Which ops of different streams cannot overlap on this chip.
    pub fn sharing(&self) -> super::Sharing {
        super::Sharing {
            matrix: self.shared_matrix_units.value,
            all: self.shared_streams.value,
            wait_s: self.wait_s.value,
        }
    }

    /// These figures with per-op-kind costs fitted to measurements.
    pub fn calibrated(self, calibration: Calibration) -> ChipFigures {
        ChipFigures { calibration: Some(calibration), ..self }
    }

    /// The predicted time of an op of `kind` on `unit` doing `work`: its fitted cost where the
    /// calibration measured the kind, the roofline ([`op_time`]) otherwise.
    pub fn op_seconds(&self, kind: &str, unit: CostUnit, work: OpWork) -> f64 {
        self.calibration
            .as_ref()
            .and_then(|c| c.time(kind, work))
            .unwrap_or_else(|| op_time(self, unit, work))
    }

    /// [`Self::op_seconds`] of a log entry (0 for anything but a launch).
    pub fn entry_seconds(&self, entry: &Entry, work: OpWork) -> f64 {
        match entry {
            Entry::Launch { label, unit, .. } => {
                self.op_seconds(label, CostUnit::from(*unit), work)
            }
            _ => 0.0,
        }
    }

    /// Each figure's name, value as text and provenance, for the table.
    pub fn rows(&self) -> Vec<(&'static str, String, &Provenance)> {
        vec![
            (
                "matrix FLOP/s",
                format!("{:.3e}", self.matrix_flops.value),
                &self.matrix_flops.provenance,
            ),
            (
                "MXFP8 matrix FLOP/s",
                format!("{:.3e}", self.mx_matrix_flops.value),
                &self.mx_matrix_flops.provenance,
            ),
            (
                "vector bytes/s",
                format!("{:.3e}", self.vector_bytes_per_s.value),
                &self.vector_bytes_per_s.provenance,
            ),
            (
                "copy bytes/s",
                format!("{:.3e}", self.copy_bytes_per_s.value),
                &self.copy_bytes_per_s.provenance,
            ),
            ("launch s", format!("{:.1e}", self.launch_s.value), &self.launch_s.provenance),
            (
                "shared matrix unit",
                self.shared_matrix_units.value.to_string(),
                &self.shared_matrix_units.provenance,
            ),
            (
                "streams share units",
                self.shared_streams.value.to_string(),
                &self.shared_streams.provenance,
            ),
            ("wait s", format!("{:.1e}", self.wait_s.value), &self.wait_s.provenance),
        ]
    }
}

/// Where Linux describes the caches of the first core: one `index*` folder per cache, each with
/// its `level`, `type` and `size`.
const CPU0_CACHES: &str = "/sys/devices/system/cpu/cpu0/cache";

/// This host's L2 (one core's) and L3 (shared) data-cache sizes, as Linux reports them; the
/// recorder stores them with its measurements so that a recording is fitted against the caches
/// it was measured on (docs/design/planner.md#calibration).
pub fn host_caches() -> Result<CacheSizes, PlanError> {
    Ok(CacheSizes { l2_bytes: cache_size(2)?, l3_bytes: cache_size(3)? })
}

/// The size of the data (or unified) cache of `level` of the first core.
fn cache_size(level: u32) -> Result<f64, PlanError> {
    let fail = |reason: String| PlanError::NoCacheSize {
        level,
        path: format!("{CPU0_CACHES}/index*/size"),
        reason,
    };
    let entries = std::fs::read_dir(CPU0_CACHES).map_err(|e| fail(e.to_string()))?;
    let read = |dir: &std::path::Path, name: &str| {
        std::fs::read_to_string(dir.join(name)).map(|t| t.trim().to_string())
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        let is_level = read(&dir, "level").is_ok_and(|l| l == level.to_string());
        let is_data = read(&dir, "type").is_ok_and(|t| t != "Instruction");
        if is_level && is_data {
            let text = read(&dir, "size").map_err(|e| fail(e.to_string()))?;
            return parse_cache_size(&text)
                .ok_or_else(|| fail(format!("unreadable size {text:?}")));
        }
    }
    Err(fail("no such cache level".to_string()))
}

/// A sysfs cache size (`1024K`, `32M`, `512`) in bytes.
fn parse_cache_size(text: &str) -> Option<f64> {
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let scale = match unit {
        "" => 1.0,
        "K" => 1024.0,
        "M" => 1024.0 * 1024.0,
        _ => return None,
    };
    digits.parse::<f64>().ok().map(|d| d * scale)
}

#[cfg(test)]
mod cache_tests {
    use super::parse_cache_size;

    #[test]
    fn sysfs_cache_sizes_parse_to_bytes() {
        assert_eq!(parse_cache_size("1024K"), Some(1_048_576.0));
        assert_eq!(parse_cache_size("32M"), Some(33_554_432.0));
        assert_eq!(parse_cache_size("512"), Some(512.0));
        assert_eq!(parse_cache_size("2G"), None);
        assert_eq!(parse_cache_size("K"), None);
    }
}
