//! GGUF metadata values: the 13 value types, scalar values and (possibly nested) typed arrays.

use std::fmt;

/// The on-disk metadata value type ids of GGUF (v2/v3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum MetaValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl MetaValueType {
    /// The type with on-disk id `id`, or `None` when `id` is not one of 0..=12.
    pub fn from_id(id: u32) -> Option<MetaValueType> {
        use MetaValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The on-disk id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Lower-case name as gguf-py spells it (`"uint32"`, `"string"`, `"array"` ...).
    pub fn name(self) -> &'static str {
        use MetaValueType::*;
        match self {
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            U32 => "uint32",
            I32 => "int32",
            F32 => "float32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "uint64",
            I64 => "int64",
            F64 => "float64",
        }
    }

    /// The smallest number of bytes a value of this type occupies in a file (for a string: its
    /// length prefix; for an array: its item type and count). Used to bound counts before allocating.
    pub fn min_encoded_size(self) -> u64 {
        use MetaValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

impl fmt::Display for MetaValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(MetaArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: a homogeneous list stored with its item type. Arrays of arrays hold one
/// [`MetaArray`] per item, each with its own item type (as the format allows).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<MetaArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl MetaValue {
    /// The value's type.
    pub fn value_type(&self) -> MetaValueType {
        use MetaValue as V;
        use MetaValueType as T;
        match self {
            V::U8(_) => T::U8,
            V::I8(_) => T::I8,
            V::U16(_) => T::U16,
            V::I16(_) => T::I16,
            V::U32(_) => T::U32,
            V::I32(_) => T::I32,
            V::F32(_) => T::F32,
            V::Bool(_) => T::Bool,
            V::String(_) => T::String,
            V::Array(_) => T::Array,
            V::U64(_) => T::U64,
            V::I64(_) => T::I64,
            V::F64(_) => T::F64,
        }
    }

    /// A readable type name: the scalar type name, or `array[<item type>]` for arrays
    /// (`array[array[int32]]` for nested ones whose first item is an int32 array).
    pub fn type_name(&self) -> String {
        match self {
            MetaValue::Array(a) => a.type_name(),
            v => v.value_type().name().to_string(),
        }
    }

    /// The value as i128 when it is an integer of any width (not bool, not float).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as f64 when it is a float (f32 or f64).
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The string, when the value is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The bool, when the value is a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The array, when the value is an array.
    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl MetaArray {
    /// The item type (every item has it).
    pub fn item_type(&self) -> MetaValueType {
        use MetaArray as A;
        use MetaValueType as T;
        match self {
            A::U8(_) => T::U8,
            A::I8(_) => T::I8,
            A::U16(_) => T::U16,
            A::I16(_) => T::I16,
            A::U32(_) => T::U32,
            A::I32(_) => T::I32,
            A::F32(_) => T::F32,
            A::Bool(_) => T::Bool,
            A::String(_) => T::String,
            A::Array(_) => T::Array,
            A::U64(_) => T::U64,
            A::I64(_) => T::I64,
            A::F64(_) => T::F64,
        }
    }

    /// `array[<item type>]`; for arrays of arrays the first inner array's type is shown.
    pub fn type_name(&self) -> String {
        match self {
            MetaArray::Array(items) => match items.first() {
                Some(inner) => format!("array[{}]", inner.type_name()),
                None => "array[array]".to_string(),
            },
            a => format!("array[{}]", a.item_type().name()),
        }
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        use MetaArray as A;
        match self {
            A::U8(v) => v.len(),
            A::I8(v) => v.len(),
            A::U16(v) => v.len(),
            A::I16(v) => v.len(),
            A::U32(v) => v.len(),
            A::I32(v) => v.len(),
            A::F32(v) => v.len(),
            A::Bool(v) => v.len(),
            A::String(v) => v.len(),
            A::Array(v) => v.len(),
            A::U64(v) => v.len(),
            A::I64(v) => v.len(),
            A::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Item `i` as a [`MetaValue`] (cloned), or `None` past the end.
    pub fn get(&self, i: usize) -> Option<MetaValue> {
        use MetaArray as A;
        use MetaValue as V;
        Some(match self {
            A::U8(v) => V::U8(*v.get(i)?),
            A::I8(v) => V::I8(*v.get(i)?),
            A::U16(v) => V::U16(*v.get(i)?),
            A::I16(v) => V::I16(*v.get(i)?),
            A::U32(v) => V::U32(*v.get(i)?),
            A::I32(v) => V::I32(*v.get(i)?),
            A::F32(v) => V::F32(*v.get(i)?),
            A::Bool(v) => V::Bool(*v.get(i)?),
            A::String(v) => V::String(v.get(i)?.clone()),
            A::Array(v) => V::Array(v.get(i)?.clone()),
            A::U64(v) => V::U64(*v.get(i)?),
            A::I64(v) => V::I64(*v.get(i)?),
            A::F64(v) => V::F64(*v.get(i)?),
        })
    }

    /// Every item as i128 when the item type is an integer type, else `None`.
    pub fn integers(&self) -> Option<Vec<i128>> {
        use MetaArray as A;
        fn conv<T: Copy + Into<i128>>(v: &[T]) -> Vec<i128> {
            v.iter().map(|&x| x.into()).collect()
        }
        Some(match self {
            A::U8(v) => conv(v),
            A::I8(v) => conv(v),
            A::U16(v) => conv(v),
            A::I16(v) => conv(v),
            A::U32(v) => conv(v),
            A::I32(v) => conv(v),
            A::U64(v) => conv(v),
            A::I64(v) => conv(v),
            _ => return None,
        })
    }
}

macro_rules! impl_from {
    ($($t:ty => $v:ident),* $(,)?) => {
        $(impl From<$t> for MetaValue {
            fn from(x: $t) -> MetaValue { MetaValue::$v(x) }
        })*
    };
}
impl_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
           bool => Bool, String => String, MetaArray => Array, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for MetaValue {
    fn from(s: &str) -> MetaValue {
        MetaValue::String(s.to_string())
    }
}

macro_rules! impl_from_vec {
    ($($t:ty => $v:ident),* $(,)?) => {
        $(impl From<Vec<$t>> for MetaValue {
            fn from(x: Vec<$t>) -> MetaValue { MetaValue::Array(MetaArray::$v(x)) }
        })*
    };
}
impl_from_vec!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
               bool => Bool, String => String, MetaArray => Array, u64 => U64, i64 => I64, f64 => F64);

/// How many array items [`Display`](fmt::Display) shows before eliding the rest.
const DISPLAY_ITEMS: usize = 8;

impl fmt::Display for MetaValue {
    /// Scalars plainly, strings quoted and escaped, arrays as `[a, b, … (N items)]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::U8(v) => write!(f, "{v}"),
            MetaValue::I8(v) => write!(f, "{v}"),
            MetaValue::U16(v) => write!(f, "{v}"),
            MetaValue::I16(v) => write!(f, "{v}"),
            MetaValue::U32(v) => write!(f, "{v}"),
            MetaValue::I32(v) => write!(f, "{v}"),
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::Bool(v) => write!(f, "{v}"),
            MetaValue::String(s) => write!(f, "{s:?}"),
            MetaValue::Array(a) => write!(f, "{a}"),
            MetaValue::U64(v) => write!(f, "{v}"),
            MetaValue::I64(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
        }
    }
}

impl fmt::Display for MetaArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.len();
        f.write_str("[")?;
        for i in 0..n.min(DISPLAY_ITEMS) {
            if i > 0 {
                f.write_str(", ")?;
            }
            if let Some(item) = self.get(i) {
                write!(f, "{item}")?;
            }
        }
        if n > DISPLAY_ITEMS {
            write!(f, ", … ({n} items)")?;
        }
        f.write_str("]")
    }
}
