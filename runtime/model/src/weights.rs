//! safetensors I/O: a single `model.safetensors`, a sharded `model.safetensors.index.json`, and
//! named-tensor files (optimizer moments, weight sync).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, View};
use serde::Deserialize;
use tch::{Kind, Tensor};

use crate::error::{ModelError, Result, read_json};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F64 => Kind::Double,
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Double => Dtype::F64,
        Kind::Float => Dtype::F32,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        _ => return None,
    })
}

/// A tensor copied to host memory, in the form safetensors serialises.
struct HostTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl HostTensor {
    fn new(name: &str, tensor: &Tensor) -> Result<Self> {
        let unsupported = || ModelError::Tensor {
            tensor: name.to_owned(),
            reason: format!("dtype {:?} cannot be stored in safetensors", tensor.kind()),
        };
        let dtype = dtype_of(tensor.kind()).ok_or_else(unsupported)?;
        let tensor = tensor.detach().to_device(tch::Device::Cpu).contiguous();
        let numel = tensor.numel();
        let mut data = vec![0u8; numel * tensor.kind().elt_size_in_bytes()];
        tensor.f_copy_data_u8(&mut data, numel)?;
        let shape = tensor.size().iter().map(|&d| d as usize).collect();
        Ok(Self { dtype, shape, data })
    }
}

impl View for &HostTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes named tensors to one safetensors file (any dtype safetensors knows; bit-exact).
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let host = tensors
        .iter()
        .map(|(name, t)| Ok((name.as_str(), HostTensor::new(name, t)?)))
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(host.iter().map(|(n, t)| (*n, t)), None, path).map_err(|e| {
        ModelError::CorruptSafetensors {
            path: path.to_owned(),
            reason: e.to_string(),
        }
    })
}

/// Overwrites `target`'s values (converting dtype and device) without recording a gradient.
/// tch's in-place ops take `&mut`; a shallow clone shares the storage.
pub fn assign(target: &Tensor, source: &Tensor) -> Result<()> {
    let mut target = target.shallow_clone();
    Ok(tch::no_grad(|| target.f_copy_(source))?)
}

/// A safetensors file's bytes and parsed header.
struct SafetensorsFile<'a> {
    path: &'a Path,
    tensors: SafeTensors<'a>,
}

impl<'a> SafetensorsFile<'a> {
    fn read(path: &Path) -> Result<Vec<u8>> {
        std::fs::read(path).map_err(|e| ModelError::io(path, e))
    }

    fn parse(path: &'a Path, bytes: &'a [u8]) -> Result<Self> {
        let tensors =
            SafeTensors::deserialize(bytes).map_err(|e| ModelError::CorruptSafetensors {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Self { path, tensors })
    }

    /// The tensor `name` in its stored dtype, on the CPU; `None` when the file lacks it.
    fn tensor(&self, name: &str) -> Result<Option<Tensor>> {
        let Ok(view) = self.tensors.tensor(name) else {
            return Ok(None);
        };
        let kind = kind_of(view.dtype()).ok_or_else(|| ModelError::UnsupportedDtype {
            path: self.path.to_owned(),
            tensor: name.to_owned(),
            dtype: format!("{:?}", view.dtype()),
        })?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        Ok(Some(Tensor::f_from_data_size(view.data(), &shape, kind)?))
    }
}

/// Reads every tensor of one safetensors file, sorted by name, in its stored dtype.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let bytes = SafetensorsFile::read(path)?;
    let file = SafetensorsFile::parse(path, &bytes)?;
    let mut names = file.tensors.names();
    names.sort_unstable();
    names
        .into_iter()
        .map(|name| {
            let tensor = file.tensor(name)?.expect("listed by the header");
            Ok((name.to_owned(), tensor))
        })
        .collect()
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

/// Where a model directory keeps its tensors.
enum Layout {
    Single(PathBuf),
    Sharded {
        index_path: PathBuf,
        dir: PathBuf,
        index: ShardIndex,
    },
}

impl Layout {
    fn of(dir: &Path) -> Result<Self> {
        let single = dir.join(SINGLE_FILE);
        if single.exists() {
            return Ok(Self::Single(single));
        }
        let index_path = dir.join(INDEX_FILE);
        if !index_path.exists() {
            let reason = format!("no {SINGLE_FILE} or {INDEX_FILE}");
            return Err(ModelError::io(
                single,
                std::io::Error::new(std::io::ErrorKind::NotFound, reason),
            ));
        }
        let index = read_json(&index_path)?;
        Ok(Self::Sharded {
            index_path,
            dir: dir.to_owned(),
            index,
        })
    }

    /// The file holding `name`, if the checkpoint lists it.
    fn file_of(&self, name: &str) -> Option<PathBuf> {
        match self {
            Self::Single(path) => Some(path.clone()),
            Self::Sharded { dir, index, .. } => {
                index.weight_map.get(name).map(|file| dir.join(file))
            }
        }
    }

    /// The file that lists the tensors (named when one is not listed).
    fn listing(&self) -> &Path {
        match self {
            Self::Single(path) => path,
            Self::Sharded { index_path, .. } => index_path,
        }
    }
}

/// Copies checkpoint tensors from a model directory into `targets` (converting dtype and device),
/// checking that every shape matches. Names for which `optional` is true may be absent (e.g. a fresh
/// value head); the ones that were absent are returned.
pub(crate) fn load_into(
    dir: &Path,
    targets: &[(String, Tensor)],
    optional: impl Fn(&str) -> bool,
) -> Result<Vec<String>> {
    let layout = Layout::of(dir)?;
    let mut by_file: BTreeMap<PathBuf, Vec<&(String, Tensor)>> = BTreeMap::new();
    let mut absent = Vec::new();
    for target in targets {
        match layout.file_of(&target.0) {
            Some(file) => by_file.entry(file).or_default().push(target),
            None if optional(&target.0) => absent.push(target.0.clone()),
            None => {
                return Err(ModelError::MissingTensor {
                    path: layout.listing().to_owned(),
                    tensor: target.0.clone(),
                });
            }
        }
    }
    for (path, targets) in by_file {
        let bytes = SafetensorsFile::read(&path)?;
        let file = SafetensorsFile::parse(&path, &bytes)?;
        for (name, target) in targets {
            let Some(source) = file.tensor(name)? else {
                if optional(name) {
                    absent.push(name.clone());
                    continue;
                }
                return Err(ModelError::MissingTensor {
                    path,
                    tensor: name.clone(),
                });
            };
            if source.size() != target.size() {
                return Err(ModelError::ShapeMismatch {
                    path,
                    tensor: name.clone(),
                    found: source.size(),
                    expected: target.size(),
                });
            }
            assign(target, &source)?;
        }
    }
    Ok(absent)
}

/// Copies `sources` into the same-named `targets`: a weight update from named tensors. Every source
/// must name a target of the same shape.
pub(crate) fn copy_named(
    targets: &HashMap<String, Tensor>,
    sources: &[(String, Tensor)],
) -> Result<()> {
    for (name, source) in sources {
        let target = targets.get(name).ok_or_else(|| ModelError::Tensor {
            tensor: name.clone(),
            reason: "the model has no parameter of this name".into(),
        })?;
        if source.size() != target.size() {
            return Err(ModelError::Tensor {
                tensor: name.clone(),
                reason: format!(
                    "shape {:?} does not match the parameter's {:?}",
                    source.size(),
                    target.size()
                ),
            });
        }
        assign(target, source)?;
    }
    Ok(())
}
