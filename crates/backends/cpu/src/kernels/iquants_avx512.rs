//! AVX-512 versions of the hot i-quant kernels (x86-64 only).

use super::RowDot;
use redlite_gguf::quant::GgmlType;

/// The AVX-512 kernel for `ty`, if there is one and the CPU has every feature it needs.
pub fn kernel(_ty: GgmlType) -> Option<RowDot> {
    None
}
