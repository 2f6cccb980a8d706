//! Tensors and batches as plain bytes: the format every plugin understands, whatever its backend.

use abi_stable::StableAbi;
use abi_stable::std_types::{RString, RVec};

use crate::PluginError;

/// Element type of a [`Tensor`]. A newtype rather than an enum so new types can be added without
/// changing the layout that abi_stable checks.
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DType(pub u8);

impl DType {
    pub const F32: Self = Self(0);
    pub const F64: Self = Self(1);
    pub const F16: Self = Self(2);
    pub const BF16: Self = Self(3);
    pub const I64: Self = Self(4);
    pub const I32: Self = Self(5);
    pub const U8: Self = Self(6);
    pub const BOOL: Self = Self(7);

    /// Bytes per element, `None` for a code this build does not know.
    pub fn size(self) -> Option<usize> {
        Some(match self {
            Self::F64 | Self::I64 => 8,
            Self::F32 | Self::I32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::U8 | Self::BOOL => 1,
            _ => return None,
        })
    }

    /// The safetensors spelling (also used in error messages).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F64 => "F64",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::I64 => "I64",
            Self::I32 => "I32",
            Self::U8 => "U8",
            Self::BOOL => "BOOL",
            _ => "unknown",
        }
    }
}

/// A Rust element type with a [`DType`]; values cross as little-endian bytes.
pub trait Element: Copy + Sized {
    const DTYPE: DType;
    fn write_le(self, out: &mut Vec<u8>);
    fn read_le(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn read_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("chunk has the element size"))
            }
        }
    };
}
element!(f32, DType::F32);
element!(f64, DType::F64);
element!(i64, DType::I64);
element!(i32, DType::I32);
element!(u8, DType::U8);

/// A dense, contiguous, row-major tensor.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: RVec<i64>,
    pub data: RVec<u8>,
}

impl Tensor {
    /// Builds a tensor from values; fails when `shape` does not hold exactly `values.len()` elements.
    pub fn from_slice<T: Element>(shape: &[i64], values: &[T]) -> Result<Self, PluginError> {
        let numel = numel(shape)?;
        if numel != values.len() {
            return Err(PluginError::other(format!(
                "shape {shape:?} holds {numel} elements but {} values were given",
                values.len()
            )));
        }
        let mut data = Vec::with_capacity(numel * std::mem::size_of::<T>());
        values.iter().for_each(|v| v.write_le(&mut data));
        Ok(Self {
            dtype: T::DTYPE,
            shape: shape.into(),
            data: data.into(),
        })
    }

    /// The values, checking that the dtype and byte length agree with `T` and the shape.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, PluginError> {
        if self.dtype != T::DTYPE {
            return Err(PluginError::other(format!(
                "tensor has dtype {} but {} was requested",
                self.dtype.name(),
                T::DTYPE.name()
            )));
        }
        let width = std::mem::size_of::<T>();
        if self.data.len() != numel(&self.shape)? * width {
            return Err(PluginError::other(format!(
                "tensor of shape {:?} and dtype {} has {} bytes",
                self.shape.as_slice(),
                self.dtype.name(),
                self.data.len()
            )));
        }
        Ok(self.data.chunks_exact(width).map(T::read_le).collect())
    }

    pub fn numel(&self) -> usize {
        numel(&self.shape).unwrap_or(0)
    }
}

fn numel(shape: &[i64]) -> Result<usize, PluginError> {
    shape.iter().try_fold(1usize, |acc, &d| {
        usize::try_from(d)
            .ok()
            .and_then(|d| acc.checked_mul(d))
            .ok_or_else(|| PluginError::other(format!("invalid tensor shape {shape:?}")))
    })
}

#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct NamedTensor {
    pub name: RString,
    pub tensor: Tensor,
}

impl NamedTensor {
    pub fn new(name: impl Into<String>, tensor: Tensor) -> Self {
        Self {
            name: RString::from(name.into()),
            tensor,
        }
    }
}

/// A batch in the spirit of verl's `DataProto`: named tensors sharing the batch dimension, plus
/// non-tensor fields as a JSON object.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Default)]
pub struct Batch {
    pub tensors: RVec<NamedTensor>,
    pub meta_json: RString,
}

impl Batch {
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| &t.tensor)
    }

    /// Like [`Batch::get`] but a missing tensor is an error naming it.
    pub fn require(&self, name: &str) -> Result<&Tensor, PluginError> {
        self.get(name)
            .ok_or_else(|| PluginError::other(format!("batch has no tensor `{name}`")))
    }

    /// Inserts or replaces the tensor called `name`.
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) {
        let name = name.into();
        match self.tensors.iter_mut().find(|t| t.name == name.as_str()) {
            Some(slot) => slot.tensor = tensor,
            None => self.tensors.push(NamedTensor::new(name, tensor)),
        }
    }
}

/// Weights handed from the trainer to a rollout, tagged with the training step they come from.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Default)]
pub struct WeightBundle {
    pub tensors: RVec<NamedTensor>,
    pub global_steps: abi_stable::std_types::ROption<u64>,
}

/// One scalar metric, named with verl's conventions (`actor/pg_loss`, `critic/score/mean`, …).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct Metric {
    pub key: RString,
    pub value: f64,
}

impl Metric {
    pub fn new(key: impl Into<String>, value: f64) -> Self {
        Self {
            key: RString::from(key.into()),
            value,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_values_and_rejects_mismatches() {
        let t = Tensor::from_slice(&[2, 2], &[1.0f32, -2.5, 3.25, 0.0]).unwrap();
        assert_eq!(t.data.len(), 16);
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, -2.5, 3.25, 0.0]);
        assert!(
            t.to_vec::<i64>()
                .unwrap_err()
                .message()
                .contains("dtype F32")
        );
        assert!(Tensor::from_slice(&[3], &[1i64, 2]).is_err());
        assert!(Tensor::from_slice(&[-1], &[1i64]).is_err());
        let mut bad = t.clone();
        bad.data.pop();
        assert!(
            bad.to_vec::<f32>()
                .unwrap_err()
                .message()
                .contains("15 bytes")
        );
    }

    #[test]
    fn batch_insert_replaces_by_name() {
        let mut b = Batch::default();
        b.insert("x", Tensor::from_slice(&[1], &[1i64]).unwrap());
        b.insert("x", Tensor::from_slice(&[1], &[2i64]).unwrap());
        assert_eq!(b.tensors.len(), 1);
        assert_eq!(b.require("x").unwrap().to_vec::<i64>().unwrap(), vec![2]);
        assert!(b.require("y").unwrap_err().message().contains("`y`"));
    }
}
