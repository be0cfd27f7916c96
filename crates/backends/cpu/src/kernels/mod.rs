//! Quantized dot-product kernels, one module per family, with run-time ISA dispatch.
//!
//! A *row kernel* computes the dot product of one weight row (the raw GGUF bytes of `cols`
//! elements) with one activation row. Quantized weights are multiplied with 8-bit activations
//! ([`q8`]), float weights with the f32 activations themselves; [`RowDot`] says which.
//!
//! # Dispatch
//! [`lookup`] is the one dispatch point: `(type, Isa) → RowDot`. It tries the requested level and
//! falls back to lower ones (AVX-512 → AVX2 → scalar) for types without a kernel at that level.
//! SIMD kernels are only handed out for levels the running CPU supports ([`Isa::supported`]),
//! which is what makes the safe `fn` pointers sound. [`Isa::active`] is the level chosen once per
//! process: the best one available, or the one forced by `REDLITE_ISA=scalar|avx2|avx512`.
//!
//! # Exactness
//! Every SIMD kernel is bit-identical to the scalar kernel of its type (the integer block sums
//! are exact, and the f32 operations are the scalar ones in the scalar order), so results do not
//! depend on the CPU. The activation quantizers are bit-exact with ggml's reference ones
//! (`quantize_row_q8_K_ref`, `quantize_row_q8_0_ref`). [`selftest`] checks all of this at run
//! time against the reference dequantizers of `redlite-gguf`.
//!
//! # Adding kernels from another module
//! Every kernel module exposes `fn kernel(ty: GgmlType, isa: Isa) -> Option<RowDot>` answering
//! for exactly the given level (no fallback: [`lookup`] does that) and is listed in [`MODULES`].
//! An x86 kernel for a level must only be returned when `isa` is that level; `lookup` only asks
//! for supported levels.

pub mod driver;
pub mod fused;
pub mod iquants;
#[cfg(target_arch = "x86_64")]
pub mod iquants_avx2;
#[cfg(target_arch = "x86_64")]
pub mod iquants_avx512;
mod kquants;
#[cfg(target_arch = "x86_64")]
mod kquants_multi_x86;
#[cfg(target_arch = "x86_64")]
mod kquants_x86;
/// The Q4_K AVX-512 VNNI kernels on paired activations (what `matvec` runs at that level), for
/// tests and benchmarks.
#[cfg(target_arch = "x86_64")]
pub use kquants_x86::{q4k_paired_kernel, q4k_paired_q8k, q4k_paired_rows_kernel};
#[cfg(target_arch = "x86_64")]
pub mod q8_0_tiles_x86;
#[cfg(target_arch = "x86_64")]
pub mod tiles_x86;
/// No tile kernel off x86-64: [`DecodeTiles::repack`](tiles_x86::DecodeTiles::repack) says so.
#[cfg(not(target_arch = "x86_64"))]
pub mod tiles_x86 {
    use super::q8::BlockQ8K;
    use redlite_gguf::quant::GgmlType;

    /// Never built off x86-64.
    pub enum DecodeTiles {}

    impl DecodeTiles {
        pub fn repack(_: GgmlType, _: &[u8], _: usize, _: usize) -> Option<DecodeTiles> {
            None
        }
        pub fn matvec_groups(&self, _: usize, _: &[BlockQ8K], _: &[[i32; 4]], _: &mut [f32]) {
            match *self {}
        }
        pub fn needs_pairs(&self) -> bool {
            match *self {}
        }
        pub fn q8_0(&self) -> Option<&Q80Tiles> {
            match *self {}
        }
    }

    /// Never built off x86-64.
    pub enum Q80Tiles {}

    pub const TILE_ROWS: usize = 16;

    pub fn pair_sums(_: &[BlockQ8K]) -> Vec<[i32; 4]> {
        Vec::new()
    }
}
pub mod q8;
#[cfg(target_arch = "x86_64")]
mod q8_0_lanes_x86;
#[cfg(target_arch = "x86_64")]
mod q8_x86;
pub mod selftest;
mod simple;
#[cfg(target_arch = "x86_64")]
mod simple_x86;
#[cfg(target_arch = "x86_64")]
mod x86_util;

use redlite_gguf::quant::GgmlType;
use std::sync::OnceLock;

pub use driver::{init_threads, matmul, matvec, KernelError};
pub use q8::{BlockQ8K, BlockQ8_0};

/// A row kernel, by activation format. `w` is one weight row (`cols / block_elems` blocks of raw
/// GGUF bytes); the activation slice holds the matching `cols` values in its format. Kernels
/// never read past either slice: they process `min(w blocks, activation blocks)` blocks (the
/// driver checks that the two agree).
#[derive(Clone, Copy, Debug)]
pub enum RowDot {
    /// Weight row · Q8_K activations (k-quants and most IQ types).
    Q8K(fn(w: &[u8], x: &[BlockQ8K]) -> f32),
    /// Weight row · Q8_0 activations (Q8_0, Q4_0, IQ4_NL).
    Q8_0(fn(w: &[u8], x: &[BlockQ8_0]) -> f32),
    /// Weight row · f32 activations (F32, F16, BF16).
    F32(fn(w: &[u8], x: &[f32]) -> f32),
}

/// A kernel over several weight rows against one Q8_K activation row: `out[r]` = row `r` of `w`
/// (rows of `row_bytes` bytes) · `x`. Each value is bit-identical to the row kernel [`lookup`]
/// gives for the same type and level ([`lookup_rows`]).
pub type RowsDot = fn(w: &[u8], row_bytes: usize, x: &[BlockQ8K], out: &mut [f32]);

/// Instruction-set level of a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust; the reference for the SIMD kernels.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL (+ AVX2, FMA, F16C); VNNI used where present.
    Avx512,
}

impl Isa {
    /// All levels, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// Lower-case name, as accepted by `REDLITE_ISA`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Parses `scalar`, `avx2` or `avx512` (case-insensitive).
    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(s.trim()))
    }

    /// Whether the running CPU can execute kernels of this level.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every level the running CPU supports, lowest first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.supported()).collect()
    }

    /// The best supported level.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.supported())
            .unwrap_or(Isa::Scalar)
    }

    /// The level used by the driver: `REDLITE_ISA` if set (clamped to the best supported level;
    /// an unknown value is ignored), else [`Isa::best`]. Chosen once per process.
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let best = Isa::best();
            match std::env::var("REDLITE_ISA")
                .ok()
                .and_then(|v| Isa::from_name(&v))
            {
                Some(forced) => forced.min(best),
                None => best,
            }
        })
    }
}

/// Whether the running CPU has AVX-512 VNNI (`vpdpbusd`/`vpdpwssd`).
pub fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        Isa::Avx512.supported() && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One kernel module's answer for exactly one level (see the module docs).
type KernelFn = fn(GgmlType, Isa) -> Option<RowDot>;

/// The kernel modules, searched in order.
const MODULES: &[KernelFn] = &[
    simple::kernel,
    kquants::kernel,
    x86_kernels,
    iquants::kernel,
];

/// The x86-64 SIMD kernels of [`simple_x86`] and [`kquants_x86`]; none on other architectures.
fn x86_kernels(ty: GgmlType, isa: Isa) -> Option<RowDot> {
    #[cfg(target_arch = "x86_64")]
    {
        simple_x86::kernel(ty, isa).or_else(|| kquants_x86::kernel(ty, isa))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

/// The row kernel for `ty` at level `isa` or the best lower level that has one; `None` when the
/// type has no kernel at all. A level the CPU does not support is treated as the best one it does.
pub fn lookup(ty: GgmlType, isa: Isa) -> Option<RowDot> {
    let top = isa.min(Isa::best());
    Isa::ALL
        .into_iter()
        .rev()
        .filter(|&level| level <= top)
        .find_map(|level| MODULES.iter().find_map(|k| k(ty, level)))
}

/// Whether [`lookup`] finds a kernel for `ty` (at any level).
pub fn supported(ty: GgmlType) -> bool {
    lookup(ty, Isa::Scalar).is_some()
}

/// Kernels for `ty` at level `isa` that [`lookup_exact`] does not return but that the CPU can
/// run (e.g. the AVX-512 k-quant kernels without VNNI on a CPU with VNNI), for testing.
pub fn lookup_alternates(ty: GgmlType, isa: Isa) -> Vec<RowDot> {
    #[cfg(target_arch = "x86_64")]
    {
        kquants_x86::alternate(ty, isa).into_iter().collect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        Vec::new()
    }
}

/// The kernel for `ty` at exactly level `isa` (no fallback); `None` if there is none or the CPU
/// does not support `isa`.
pub fn lookup_exact(ty: GgmlType, isa: Isa) -> Option<RowDot> {
    if !isa.supported() {
        return None;
    }
    MODULES.iter().find_map(|k| k(ty, isa))
}

/// A rows kernel ([`RowsDot`]) for `ty` where [`lookup`]`(ty, isa)` returns a row kernel that has
/// one (the AVX-512 VNNI Q4_K kernel: two rows share each block's reduction); `None` otherwise.
pub fn lookup_rows(ty: GgmlType, isa: Isa) -> Option<RowsDot> {
    #[cfg(target_arch = "x86_64")]
    {
        kquants_x86::rows_kernel(ty, isa.min(Isa::best()))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

/// [`lookup_rows`] for products whose rows have `cols` columns: only for rows of at most
/// `REDLITE_ROWS_KERNEL_MAX_COLS` columns (default 512; 0 never). The rows kernel pays where a row
/// is one or two blocks (the tiny models: the per-row reduction and call were most of the cost);
/// on the full-size layout's 2048-column rows read from the memory map it made decode 17 % slower
/// (9.6–9.7 against 11.2–11.7 tok/s, 2 threads), although the kernel bench on owned memory runs
/// it faster at every width.
pub fn lookup_rows_for(ty: GgmlType, isa: Isa, cols: usize) -> Option<RowsDot> {
    static MAX_COLS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let max = *MAX_COLS.get_or_init(|| {
        std::env::var("REDLITE_ROWS_KERNEL_MAX_COLS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(512)
    });
    if cols > max {
        return None;
    }
    lookup_rows(ty, isa)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows kernel serves short rows only (the default limit, 512 columns): longer rows take
    /// the row kernel (`REDLITE_ROWS_KERNEL_MAX_COLS` unset in the test run).
    #[test]
    fn rows_kernel_only_for_short_rows() {
        if std::env::var_os("REDLITE_ROWS_KERNEL_MAX_COLS").is_some() {
            return;
        }
        let isa = Isa::active();
        let has = lookup_rows(GgmlType::Q4K, isa).is_some();
        assert_eq!(lookup_rows_for(GgmlType::Q4K, isa, 256).is_some(), has);
        assert_eq!(lookup_rows_for(GgmlType::Q4K, isa, 512).is_some(), has);
        assert!(lookup_rows_for(GgmlType::Q4K, isa, 768).is_none());
        assert!(lookup_rows_for(GgmlType::Q4K, isa, 2048).is_none());
    }
}
