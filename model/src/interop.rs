//! The glue between the plugin ABI and tch that the engine and rollout plugins share: ABI tensors
//! to and from tch tensors, model errors as plugin errors, and config sections parsed with the
//! offending key named.

use serde::de::DeserializeOwned;
use tch::{Device, Kind, Tensor};
use verl_plugin_api::{DType, ErrorKind, NamedTensor, PluginError};

use crate::error::{ModelError, Result};

/// Whether `t` is a contiguous fp32 CPU tensor: one that [`floats`] reads in place.
pub(crate) fn is_host_f32(t: &Tensor) -> bool {
    t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous()
}

/// The elements of a contiguous fp32 CPU tensor, in place.
///
/// # Safety
/// `is_host_f32(t)`, and nothing writes to the tensor's storage (through another handle) while
/// the slice is used.
pub(crate) unsafe fn floats(t: &Tensor) -> &[f32] {
    debug_assert!(is_host_f32(t));
    // SAFETY: a contiguous fp32 tensor's storage holds `numel` f32 from its data pointer.
    unsafe { std::slice::from_raw_parts(t.data_ptr().cast::<f32>(), t.numel()) }
}

/// [`floats`], writable.
///
/// # Safety
/// `is_host_f32(t)`, and nothing else reads or writes the tensor's storage while the slice is
/// used.
pub(crate) unsafe fn floats_mut(t: &mut Tensor) -> &mut [f32] {
    debug_assert!(is_host_f32(t));
    // SAFETY: as for `floats`, and the caller holds the only access.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<f32>(), t.numel()) }
}

fn kind_of(dtype: DType) -> Option<Kind> {
    Some(match dtype {
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::I64 => Kind::Int64,
        DType::I32 => Kind::Int,
        DType::U8 => Kind::Uint8,
        DType::BOOL => Kind::Bool,
        _ => return None,
    })
}

fn dtype_of(kind: Kind) -> Option<DType> {
    Some(match kind {
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Int64 => DType::I64,
        Kind::Int => DType::I32,
        Kind::Uint8 => DType::U8,
        Kind::Bool => DType::BOOL,
        _ => return None,
    })
}

/// Copies the ABI tensor called `name` into a tch tensor on `device`, keeping its dtype.
pub fn to_tch(name: &str, tensor: &verl_plugin_api::Tensor, device: Device) -> Result<Tensor> {
    let bad = |reason: String| ModelError::Tensor {
        tensor: name.to_owned(),
        reason,
    };
    let kind = kind_of(tensor.dtype)
        .ok_or_else(|| bad(format!("unknown dtype code {}", tensor.dtype.0)))?;
    let expected = tensor.numel() * kind.elt_size_in_bytes();
    if tensor.data.len() != expected || tensor.shape.iter().any(|&d| d < 0) {
        return Err(bad(format!(
            "shape {:?} of {} needs {expected} bytes, got {}",
            tensor.shape.as_slice(),
            tensor.dtype.name(),
            tensor.data.len()
        )));
    }
    Ok(Tensor::f_from_data_size(&tensor.data, &tensor.shape, kind)?.to_device(device))
}

/// Copies a tch tensor (any device) into an ABI tensor of the same dtype, bit for bit.
pub fn from_tch(name: &str, tensor: &Tensor) -> Result<verl_plugin_api::Tensor> {
    let dtype = dtype_of(tensor.kind()).ok_or_else(|| ModelError::Tensor {
        tensor: name.to_owned(),
        reason: format!("dtype {:?} has no ABI equivalent", tensor.kind()),
    })?;
    let host = tensor.detach().to_device(Device::Cpu).contiguous();
    let numel = host.numel();
    let mut data = vec![0u8; numel * host.kind().elt_size_in_bytes()];
    host.f_copy_data_u8(&mut data, numel)?;
    Ok(verl_plugin_api::Tensor {
        dtype,
        shape: host.size().into(),
        data: data.into(),
    })
}

/// Named tch tensors (e.g. [`crate::CausalLM::named_tensors`]) as ABI named tensors.
pub fn named_from_tch(tensors: &[(String, Tensor)]) -> Result<Vec<NamedTensor>> {
    tensors
        .iter()
        .map(|(name, t)| Ok(NamedTensor::new(name.clone(), from_tch(name, t)?)))
        .collect()
}

/// ABI named tensors as tch tensors on `device`.
pub fn named_to_tch(tensors: &[NamedTensor], device: Device) -> Result<Vec<(String, Tensor)>> {
    tensors
        .iter()
        .map(|t| Ok((t.name.to_string(), to_tch(&t.name, &t.tensor, device)?)))
        .collect()
}

impl From<ModelError> for PluginError {
    fn from(e: ModelError) -> Self {
        let kind = match e {
            ModelError::Io { .. } => ErrorKind::IO,
            ModelError::InvalidConfig { .. } | ModelError::UnsupportedArchitecture { .. } => {
                ErrorKind::INVALID_CONFIG
            }
            _ => ErrorKind::OTHER,
        };
        PluginError::new(kind, e.to_string())
    }
}

/// Deserialises a component's JSON config section. Unknown keys are ignored (verl sections carry
/// many that a backend does not use); a wrong type or value is an error that names the key's path
/// (`optim.lr`), which plain serde_json does not.
pub fn parse_config<T: DeserializeOwned>(json: &str, component: &str) -> Result<T, PluginError> {
    let text = if json.trim().is_empty() { "{}" } else { json };
    serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text)).map_err(|e| {
        PluginError::invalid_config(format!(
            "config of `{component}`: key `{}`: {}",
            e.path(),
            e.inner()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_round_trip_bit_exactly() {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Int64] {
            let t = Tensor::from_slice(&[1.5f32, -2.25, 3.0, 1e-3])
                .view([2, 2])
                .to_kind(kind);
            let abi = from_tch("t", &t).unwrap();
            assert!(to_tch("t", &abi, Device::Cpu).unwrap().equal(&t));
        }
        let mut bad = from_tch("w", &Tensor::from_slice(&[1.0f32, 2.0])).unwrap();
        bad.data.pop();
        let err = to_tch("w", &bad, Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("\"w\"") && err.contains("7"), "{err}");
    }

    #[test]
    fn config_errors_name_the_key() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)] // only parsed
        struct Optim {
            lr: f64,
        }
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Section {
            optim: Optim,
        }
        let err = parse_config::<Section>(r#"{"unused": 1, "optim": {"lr": "fast"}}"#, "fsdp")
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
        assert!(
            err.message().contains("`optim.lr`") && err.message().contains("fsdp"),
            "{err}"
        );
    }
}
