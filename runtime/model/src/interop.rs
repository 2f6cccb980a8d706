//! The glue between the plugin ABI and tch that the engine and rollout plugins share: ABI tensors
//! to and from tch tensors, model errors as plugin errors, and config sections parsed with the
//! offending key named.

use serde::de::DeserializeOwned;
use tch::{Device, Kind, Tensor};
use verl_plugin_api::{DType, ErrorKind, PluginError, TensorRef};

use crate::error::{ModelError, Result};

/// Whether `t` is a contiguous fp32 CPU tensor: one that [`floats`] reads in place.
pub fn is_host_f32(t: &Tensor) -> bool {
    t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous()
}

/// The elements of a contiguous fp32 CPU tensor, in place.
///
/// # Safety
/// `is_host_f32(t)`, and nothing writes to the tensor's storage (through another handle) while
/// the slice is used.
pub unsafe fn floats(t: &Tensor) -> &[f32] {
    debug_assert!(is_host_f32(t));
    // SAFETY: a contiguous fp32 tensor's storage holds `numel` f32 from its data pointer.
    unsafe { std::slice::from_raw_parts(t.data_ptr().cast::<f32>(), t.numel()) }
}

/// [`floats`], writable.
///
/// # Safety
/// `is_host_f32(t)`, and nothing else reads or writes the tensor's storage while the slice is
/// used.
pub unsafe fn floats_mut(t: &mut Tensor) -> &mut [f32] {
    debug_assert!(is_host_f32(t));
    // SAFETY: as for `floats`, and the caller holds the only access.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<f32>(), t.numel()) }
}

/// The tch dtype of an ABI dtype; `None` for one tch does not have.
pub(crate) fn kind_of(dtype: DType) -> Option<Kind> {
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

/// Tensors lent across the ABI as views ([`TensorRef`]): contiguous host tensors in place, any
/// other (a GPU parameter, a strided view) through one staging copy kept here until the next
/// [`LentTensors::lend`].
#[derive(Default)]
pub struct LentTensors {
    /// Name, shape, and a contiguous host tensor sharing the source's storage where it could.
    entries: Vec<(String, Vec<i64>, Tensor)>,
    staged_bytes: usize,
}

impl LentTensors {
    /// Takes `named` (e.g. [`crate::CausalLM::named_tensors`], which share the parameters' storage).
    pub fn lend(&mut self, named: Vec<(String, Tensor)>) -> Result<()> {
        self.staged_bytes = 0;
        self.entries = named
            .into_iter()
            .map(|(name, tensor)| {
                let tensor = tensor.detach();
                let host = if tensor.device() == Device::Cpu && tensor.is_contiguous() {
                    tensor
                } else {
                    let staged = tensor.to_device(Device::Cpu).contiguous();
                    self.staged_bytes += staged.numel() * staged.kind().elt_size_in_bytes();
                    staged
                };
                Ok((name, host.size(), host))
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Views of the lent tensors, valid while `self` is borrowed (and nothing writes the
    /// parameters meanwhile, which the engine's `&mut self` borrow guarantees).
    pub fn views(&self) -> Result<Vec<TensorRef<'_>>> {
        self.entries
            .iter()
            .map(|(name, shape, tensor)| {
                let dtype = dtype_of(tensor.kind()).ok_or_else(|| ModelError::Tensor {
                    tensor: name.clone(),
                    reason: format!("dtype {:?} has no ABI equivalent", tensor.kind()),
                })?;
                let len = tensor.numel() * tensor.kind().elt_size_in_bytes();
                // SAFETY: a contiguous host tensor's storage holds `len` bytes from its data
                // pointer, and `self` keeps the tensor (and so the storage) alive.
                let bytes =
                    unsafe { std::slice::from_raw_parts(tensor.data_ptr().cast::<u8>(), len) };
                TensorRef::new(name, dtype, shape, bytes).map_err(|e| ModelError::Tensor {
                    tensor: name.clone(),
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    /// Bytes copied to make the views (0 when every tensor was contiguous host memory).
    pub fn staged_bytes(&self) -> usize {
        self.staged_bytes
    }
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
    use crate::CausalLM;

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
    fn lent_weights_alias_the_parameters_and_load_in_one_copy() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama");
        let source = CausalLM::from_pretrained(&dir, &crate::ModelOptions::default()).unwrap();
        let mut lent = LentTensors::default();
        lent.lend(source.named_tensors()).unwrap();
        let views = lent.views().unwrap();
        let params = source.named_tensors();
        assert_eq!(views.len(), params.len());
        for (view, (name, param)) in views.iter().zip(&params) {
            assert_eq!(view.name.as_str(), name);
            // In place: the view is the parameter's own storage.
            assert_eq!(
                view.data.as_ptr() as usize,
                param.data_ptr() as usize,
                "{name}"
            );
        }
        assert_eq!(lent.staged_bytes(), 0);

        let options = crate::ModelOptions {
            seed: 99,
            ..Default::default()
        };
        let target = CausalLM::random(source.config().clone(), &options).unwrap();
        assert!(!target.named_tensors()[0].1.equal(&params[0].1));
        let copied = target.load_views(&views).unwrap();
        assert_eq!(copied, views.iter().map(|v| v.data.len()).sum::<usize>());
        for ((name, a), (_, b)) in target.named_tensors().iter().zip(&params) {
            assert!(a.equal(b), "{name}");
            assert_ne!(a.data_ptr(), b.data_ptr(), "{name}: copied, not shared");
        }

        // A strided (non-contiguous) tensor is staged once.
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0])
            .view([2, 2])
            .tr();
        lent.lend(vec![("t".into(), t.shallow_clone())]).unwrap();
        assert_eq!(lent.staged_bytes(), 16);
        let staged = lent.views().unwrap()[0].to_named();
        assert_eq!(
            staged.tensor.to_vec::<f32>().unwrap(),
            vec![1.0, 3.0, 2.0, 4.0]
        );
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
