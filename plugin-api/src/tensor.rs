//! Tensors and batches as plain bytes: the format every plugin understands, whatever its backend.

use abi_stable::StableAbi;
use abi_stable::std_types::{RSlice, RStr, RString, RVec};

use crate::{Handover, PluginError, WeightSourceKind, wire};

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

/// A borrowed tensor: a view into memory its owner keeps alive for the view's lifetime (an
/// engine's parameters, a weight file mapped by the host).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq)]
pub struct TensorRef<'a> {
    pub name: RStr<'a>,
    pub dtype: DType,
    pub shape: RSlice<'a, i64>,
    pub data: RSlice<'a, u8>,
}

impl<'a> TensorRef<'a> {
    /// A view; fails when `data` is not exactly `shape` × the dtype's size.
    pub fn new(
        name: &'a str,
        dtype: DType,
        shape: &'a [i64],
        data: &'a [u8],
    ) -> Result<Self, PluginError> {
        let width = dtype.size().ok_or_else(|| {
            PluginError::other(format!("tensor `{name}`: unknown dtype code {}", dtype.0))
        })?;
        let bytes = numel(shape)?.checked_mul(width);
        if bytes != Some(data.len()) {
            return Err(PluginError::other(format!(
                "tensor `{name}`: shape {shape:?} of {} needs {} bytes, got {}",
                dtype.name(),
                bytes.map_or("too many".to_owned(), |b| b.to_string()),
                data.len()
            )));
        }
        Ok(Self {
            name: name.into(),
            dtype,
            shape: shape.into(),
            data: data.into(),
        })
    }

    /// An owned copy.
    pub fn to_named(&self) -> NamedTensor {
        NamedTensor::new(
            self.name.as_str(),
            Tensor {
                dtype: self.dtype,
                shape: self.shape.as_slice().into(),
                data: self.data.as_slice().into(),
            },
        )
    }
}

impl NamedTensor {
    /// A view of this tensor.
    pub fn as_ref(&self) -> TensorRef<'_> {
        TensorRef {
            name: self.name.as_rstr(),
            dtype: self.tensor.dtype,
            shape: self.tensor.shape.as_rslice(),
            data: self.tensor.data.as_rslice(),
        }
    }
}

/// New weights for a rollout, by reference: the trainer's tensors borrowed for the call (memory),
/// or where a weight sync put them (a directory, a collective), as its [`Handover`] says. Nothing
/// is copied on the way; the rollout copies once, into its own parameters.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct WeightSource<'a> {
    /// The trainer's `global_steps` when the weights were taken.
    pub version: u64,
    /// The tensors (memory sources; also given to weight syncs, which publish them).
    pub tensors: RSlice<'a, TensorRef<'a>>,
    /// The [`Handover`] record as JSON; empty for memory.
    handover: RStr<'a>,
}

impl<'a> WeightSource<'a> {
    /// Borrowed tensors.
    pub fn memory(version: u64, tensors: &'a [TensorRef<'a>]) -> Self {
        Self {
            version,
            tensors: tensors.into(),
            handover: RStr::from(""),
        }
    }

    /// What a weight sync published; `handover_json` is [`WeightSource::encode_handover`]'s text.
    /// Memory handovers keep `tensors`; the others carry none.
    pub fn from_handover(
        version: u64,
        tensors: &'a [TensorRef<'a>],
        handover_json: &'a str,
    ) -> Self {
        let memory = handover_json.is_empty()
            || wire::decode::<Handover>("handover", handover_json)
                .is_ok_and(|h| h.kind == WeightSourceKind::Memory);
        Self {
            version,
            tensors: if memory {
                tensors.into()
            } else {
                RSlice::default()
            },
            handover: handover_json.into(),
        }
    }

    /// The text [`WeightSource::from_handover`] takes.
    pub fn encode_handover(handover: &Handover) -> RString {
        wire::encode(handover)
    }

    /// Where the weights are.
    pub fn handover(&self) -> Result<Handover, PluginError> {
        if self.handover.is_empty() {
            Ok(Handover::memory())
        } else {
            wire::decode("handover", self.handover.as_str())
        }
    }

    pub fn kind(&self) -> Result<WeightSourceKind, PluginError> {
        self.handover().map(|h| h.kind)
    }

    /// Bytes of tensor data the source references.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }
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
