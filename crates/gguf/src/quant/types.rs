//! The ggml tensor element types as one table of traits (like ggml's `type_traits`):
//! id, name, elements per block and bytes per block. Everything that sizes a tensor goes through here.

/// A ggml tensor element type. Discriminants are the on-disk type ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q8_0 = 8,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    IQ2XXS = 16,
    IQ2XS = 17,
    IQ3XXS = 18,
    IQ1S = 19,
    IQ4NL = 20,
    IQ3S = 21,
    IQ2S = 22,
    IQ4XS = 23,
    IQ1M = 29,
    BF16 = 30,
}

/// The static facts about one type.
#[derive(Debug, Clone, Copy)]
pub struct TypeTraits {
    pub ty: GgmlType,
    /// ggml's name, as `llama-quantize` and gguf-py print it.
    pub name: &'static str,
    /// Elements per block (1 for the float types).
    pub block_elems: usize,
    /// Bytes per block.
    pub block_bytes: usize,
}

/// Every supported type, in id order.
pub const TYPE_TRAITS: &[TypeTraits] = &[
    TypeTraits {
        ty: GgmlType::F32,
        name: "F32",
        block_elems: 1,
        block_bytes: 4,
    },
    TypeTraits {
        ty: GgmlType::F16,
        name: "F16",
        block_elems: 1,
        block_bytes: 2,
    },
    TypeTraits {
        ty: GgmlType::Q4_0,
        name: "Q4_0",
        block_elems: 32,
        block_bytes: 18,
    },
    TypeTraits {
        ty: GgmlType::Q8_0,
        name: "Q8_0",
        block_elems: 32,
        block_bytes: 34,
    },
    TypeTraits {
        ty: GgmlType::Q2K,
        name: "Q2_K",
        block_elems: 256,
        block_bytes: 84,
    },
    TypeTraits {
        ty: GgmlType::Q3K,
        name: "Q3_K",
        block_elems: 256,
        block_bytes: 110,
    },
    TypeTraits {
        ty: GgmlType::Q4K,
        name: "Q4_K",
        block_elems: 256,
        block_bytes: 144,
    },
    TypeTraits {
        ty: GgmlType::Q5K,
        name: "Q5_K",
        block_elems: 256,
        block_bytes: 176,
    },
    TypeTraits {
        ty: GgmlType::Q6K,
        name: "Q6_K",
        block_elems: 256,
        block_bytes: 210,
    },
    TypeTraits {
        ty: GgmlType::Q8K,
        name: "Q8_K",
        block_elems: 256,
        block_bytes: 292,
    },
    TypeTraits {
        ty: GgmlType::IQ2XXS,
        name: "IQ2_XXS",
        block_elems: 256,
        block_bytes: 66,
    },
    TypeTraits {
        ty: GgmlType::IQ2XS,
        name: "IQ2_XS",
        block_elems: 256,
        block_bytes: 74,
    },
    TypeTraits {
        ty: GgmlType::IQ3XXS,
        name: "IQ3_XXS",
        block_elems: 256,
        block_bytes: 98,
    },
    TypeTraits {
        ty: GgmlType::IQ1S,
        name: "IQ1_S",
        block_elems: 256,
        block_bytes: 50,
    },
    TypeTraits {
        ty: GgmlType::IQ4NL,
        name: "IQ4_NL",
        block_elems: 32,
        block_bytes: 18,
    },
    TypeTraits {
        ty: GgmlType::IQ3S,
        name: "IQ3_S",
        block_elems: 256,
        block_bytes: 110,
    },
    TypeTraits {
        ty: GgmlType::IQ2S,
        name: "IQ2_S",
        block_elems: 256,
        block_bytes: 82,
    },
    TypeTraits {
        ty: GgmlType::IQ4XS,
        name: "IQ4_XS",
        block_elems: 256,
        block_bytes: 136,
    },
    TypeTraits {
        ty: GgmlType::IQ1M,
        name: "IQ1_M",
        block_elems: 256,
        block_bytes: 56,
    },
    TypeTraits {
        ty: GgmlType::BF16,
        name: "BF16",
        block_elems: 1,
        block_bytes: 2,
    },
];

impl GgmlType {
    /// The type with on-disk id `id`, or `None` for an id redlite does not know.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPE_TRAITS.iter().find(|t| t.ty as u32 == id).map(|t| t.ty)
    }

    /// The type named `name` (ggml spelling, case-insensitive: "q4_k", "IQ2_XXS").
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TYPE_TRAITS
            .iter()
            .find(|t| t.name.eq_ignore_ascii_case(name))
            .map(|t| t.ty)
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    pub fn traits(self) -> &'static TypeTraits {
        // Every variant has exactly one row in TYPE_TRAITS (checked by a test).
        TYPE_TRAITS
            .iter()
            .find(|t| t.ty == self)
            .expect("type table covers every variant")
    }

    pub fn name(self) -> &'static str {
        self.traits().name
    }

    pub fn block_elems(self) -> usize {
        self.traits().block_elems
    }

    pub fn block_bytes(self) -> usize {
        self.traits().block_bytes
    }

    /// Bytes for a row of `n` elements, or `None` when `n` is not a whole number of blocks
    /// or the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !n.is_multiple_of(be) {
            return None;
        }
        (n / be).checked_mul(self.block_bytes() as u64)
    }

    /// Bits per weight (block bytes × 8 / block elements).
    pub fn bits_per_weight(self) -> f64 {
        self.block_bytes() as f64 * 8.0 / self.block_elems() as f64
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        for t in TYPE_TRAITS {
            assert_eq!(GgmlType::from_id(t.ty as u32), Some(t.ty));
            assert_eq!(GgmlType::from_name(t.name), Some(t.ty));
            assert_eq!(t.ty.traits().name, t.name);
        }
        assert_eq!(GgmlType::from_id(1000), None);
        assert_eq!(GgmlType::Q4K.row_bytes(2048), Some(8 * 144));
        assert_eq!(GgmlType::Q4K.row_bytes(255), None);
        assert_eq!(GgmlType::IQ2XXS.bits_per_weight(), 2.0625);
        assert_eq!(GgmlType::IQ1M.bits_per_weight(), 1.75);
    }
}
