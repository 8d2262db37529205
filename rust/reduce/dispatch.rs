//! Which compiled set of reduction kernels this process runs, chosen once from what the CPU has.
//!
//! The wheel is built for the baseline target; the vector sets are compiled beside it with
//! `#[target_feature]` (`super::x86`) and entered only when `is_x86_feature_detected!` says the CPU has
//! every feature they were compiled with. Every set gives bitwise the same results (the tests compare
//! each with the baseline), so ranks on different kernels still agree.

use std::fmt;
use std::sync::OnceLock;

use crate::config;

/// A compiled set of reduction kernels, from slowest to fastest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kernels {
    /// Compiled for the target's baseline (SSE2 on x86-64, NEON on aarch64); float16 converts one
    /// element at a time.
    Baseline,
    /// AVX2, FMA and F16C: 256-bit loops, float16 converted 8 at a time by F16C.
    Avx2,
    /// AVX-512 F, BW, DQ and VL (with AVX2, FMA, F16C): 512-bit loops, 16 float16 at a time.
    Avx512,
}

impl Kernels {
    /// Every set, slowest first.
    pub const ALL: [Kernels; 3] = [Kernels::Baseline, Kernels::Avx2, Kernels::Avx512];

    /// The name `AXONML_KERNELS` takes.
    pub const fn name(self) -> &'static str {
        match self {
            Kernels::Baseline => "baseline",
            Kernels::Avx2 => "avx2",
            Kernels::Avx512 => "avx512",
        }
    }

    /// True when this CPU has every feature the set was compiled with.
    pub fn available(self) -> bool {
        match self {
            Kernels::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx512 => {
                Kernels::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512dq")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// `self`, or the fastest set below it that this CPU has.
    pub fn clamped(self) -> Kernels {
        Kernels::ALL.into_iter().filter(|k| *k <= self && k.available()).max().unwrap_or(Kernels::Baseline)
    }

    /// The set every reduction of this process runs: the fastest the CPU has, capped by
    /// `AXONML_KERNELS` (an unknown name leaves the choice to the CPU). Decided on first use.
    pub fn active() -> Kernels {
        static ACTIVE: OnceLock<Kernels> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let cap = config::kernels_from_env()
                .and_then(|name| Kernels::ALL.into_iter().find(|k| k.name() == name))
                .unwrap_or(Kernels::Avx512);
            cap.clamped()
        })
    }
}

impl fmt::Display for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A kernel set as a type, so the generic kernels (`super::kernels`) pick their conversions at compile
/// time: `KERNELS` is a constant, and the branches on it fold away.
pub(super) trait Isa {
    /// The set this type stands for.
    const KERNELS: Kernels;
}

/// [`Kernels::Baseline`] as a type.
pub(super) struct Baseline;
impl Isa for Baseline {
    const KERNELS: Kernels = Kernels::Baseline;
}

/// [`Kernels::Avx2`] as a type.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Isa for Avx2 {
    const KERNELS: Kernels = Kernels::Avx2;
}

/// [`Kernels::Avx512`] as a type.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Isa for Avx512 {
    const KERNELS: Kernels = Kernels::Avx512;
}
