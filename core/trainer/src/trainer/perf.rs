//! The engine performance metrics verl's workers log on every step, computed here around the
//! engine calls the trainer times (so they hold for any engine plugin):
//!
//! - `perf/mfu/actor`, `perf/mfu/critic` (verl's `update_actor` / `update_critic` workers) and
//!   `perf/mfu/actor_infer` (its engine workers' `compute_log_prob`, a forward pass: ⅓ of the
//!   FLOPs): verl's `FlopsCounter` — the dense-transformer estimate of
//!   `verl/utils/flops_counter.py` (`_estimate_qwen2_flops`, which verl uses for Llama, Qwen2,
//!   Qwen3, Mistral, …) over the batch's sequence lengths, × `ppo_epochs`, over the call's time ×
//!   the device's peak FLOP/s × the number of devices;
//! - `perf/max_memory_allocated_gb`, `perf/max_memory_reserved_gb`: verl reads torch's CUDA
//!   caching allocator. On CPU, libtorch has no caching allocator (what it allocates is what it
//!   holds), so both report the process's peak resident set (`VmHWM`), which holds the engines,
//!   the rollout and the trainer of this process. On another device they are not logged: the
//!   allocator's counters are not reachable through libtorch's C API;
//! - `perf/cpu_memory_used_gb`: psutil's `virtual_memory().used` (psutil ≥ 5.9: `MemTotal −
//!   MemAvailable` of `/proc/meminfo`).

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use verl_plugin_api::Metric;

use verl_config::Config;
use verl_data::expand_home;

/// verl's `_DEVICE_FLOPS`: peak FLOP/s by a name the device's product name contains.
const DEVICE_FLOPS: &[(&str, f64)] = &[
    ("CPU", 448e9),
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("MI300X", 1336e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362.05e12),
    ("L40", 181.05e12),
    ("A40", 149.7e12),
    ("L20", 119.5e12),
    ("H20", 148e12),
    ("910B", 354e12),
    ("Ascend910", 354e12),
    ("RTX 3070 Ti", 21.75e12),
];

/// verl's `get_device_flops`: the first entry, in descending order of the names, that
/// `device_name` contains (verl names a CPU device `CPU`); infinite for an unknown device, so
/// that its MFU is 0.
pub fn device_peak_flops(device_name: &str) -> f64 {
    let mut table = DEVICE_FLOPS.to_vec();
    table.sort_by(|a, b| b.0.cmp(a.0));
    table
        .into_iter()
        .find(|(name, _)| device_name.contains(name))
        .map_or(f64::INFINITY, |(_, flops)| flops)
}

/// The model types verl estimates with its dense formula (`ESTIMATE_FUNC` → `_estimate_qwen2_flops`).
const DENSE_MODEL_TYPES: &[&str] = &[
    "qwen2",
    "llama",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3",
    "minicpmv",
    "minicpmo",
    "mistral",
    "seed_oss",
    "glm4v",
    "mimo",
];

/// The `config.json` fields verl's dense estimate reads.
#[derive(Debug, Clone, PartialEq, Deserialize)]
struct Dense {
    hidden_size: u64,
    vocab_size: u64,
    num_hidden_layers: u64,
    num_attention_heads: u64,
    num_key_value_heads: u64,
    intermediate_size: u64,
    head_dim: Option<u64>,
}

/// verl's `FlopsCounter` for one model.
#[derive(Debug, Clone, PartialEq)]
pub struct FlopsCounter {
    /// `None` for a model type verl has no dense estimate for: its MFU is 0, as verl's
    /// `_estimate_unknown_flops`.
    dense: Option<Dense>,
}

impl FlopsCounter {
    /// From a Hugging Face `config.json` (its `model_type` and sizes).
    pub fn from_config(config: &Value) -> Result<Self, String> {
        let model_type = config
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !DENSE_MODEL_TYPES.contains(&model_type) {
            return Ok(Self { dense: None });
        }
        let dense = Dense::deserialize(config).map_err(|e| e.to_string())?;
        if dense.num_attention_heads == 0 {
            return Err("num_attention_heads is 0".into());
        }
        Ok(Self { dense: Some(dense) })
    }

    /// From `<dir>/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, String> {
        let path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let config: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::from_config(&config).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn knows_model(&self) -> bool {
        self.dense.is_some()
    }

    /// verl's `_estimate_qwen2_flops` before its division by the time: the FLOPs of a forward and
    /// backward pass over sequences of `seqlens` tokens (6 per parameter and token for the dense
    /// layers, embedding and LM head counted; 6·s²·head_dim·heads per layer for attention).
    pub fn flops(&self, seqlens: &[u64]) -> f64 {
        let Some(d) = &self.dense else {
            return 0.0;
        };
        let head_dim = d.head_dim.unwrap_or(d.hidden_size / d.num_attention_heads);
        let q_size = d.num_attention_heads * head_dim;
        let kv_size = d.num_key_value_heads * head_dim;
        let mlp = d.hidden_size * d.intermediate_size * 3;
        let attn_linear = d.hidden_size * (q_size + 2 * kv_size + d.num_attention_heads * head_dim);
        let embedding_and_head = d.vocab_size * d.hidden_size * 2;
        let dense = (mlp + attn_linear) * d.num_hidden_layers + embedding_and_head;
        // In f64 as verl's Python integers would overflow nothing; sums here stay exact up to
        // 2^53 per term.
        let tokens: u64 = seqlens.iter().sum();
        let square_sum: f64 = seqlens.iter().map(|&s| (s as f64) * (s as f64)).sum();
        6.0 * dense as f64 * tokens as f64
            + 6.0
                * square_sum
                * head_dim as f64
                * (d.num_attention_heads * d.num_hidden_layers) as f64
    }
}

/// Model FLOP utilisation of `flops` done in `seconds` on `devices` devices of `peak` FLOP/s
/// each (verl: `estimated_flops / promised_flops / world_size`).
pub fn mfu(flops: f64, seconds: f64, peak: f64, devices: usize) -> f64 {
    if seconds > 0.0 && peak > 0.0 {
        flops / seconds / peak / devices.max(1) as f64
    } else {
        0.0
    }
}

/// What the trainer needs for the perf metrics of a step.
#[derive(Debug, Clone)]
pub struct EnginePerf {
    actor: FlopsCounter,
    /// With a critic.
    critic: Option<FlopsCounter>,
    actor_epochs: usize,
    critic_epochs: usize,
    peak_flops: f64,
    devices: usize,
    device_type: String,
}

impl EnginePerf {
    /// For `config`'s models (a model whose `config.json` cannot be read counts no FLOPs, with a
    /// warning) on `devices` devices named `device_name` of type `device_type`.
    pub fn new(config: &Config, device_type: &str, device_name: &str, devices: usize) -> Self {
        let counter = |role: &str, dir: &str| {
            FlopsCounter::from_model_dir(&expand_home(dir)).unwrap_or_else(|e| {
                tracing::warn!("perf/mfu/{role} is 0: no FLOP estimate ({e})");
                FlopsCounter { dense: None }
            })
        };
        let arr = &config.actor_rollout_ref;
        let critic = config.critic_enabled().then(|| {
            let path = config.critic.model.get("path").and_then(Value::as_str);
            counter("critic", path.unwrap_or(&arr.model.path))
        });
        let peak_flops = config
            .trainer
            .device_peak_flops
            .unwrap_or_else(|| device_peak_flops(device_name));
        if peak_flops.is_infinite() {
            tracing::warn!(
                "perf/mfu/* are 0: no peak FLOP/s for the device `{device_name}` in verl's table; \
                 set trainer.device_peak_flops"
            );
        }
        Self {
            actor: counter("actor", &arr.model.path),
            critic,
            actor_epochs: arr.actor.ppo_epochs,
            critic_epochs: config.critic.ppo_epochs.unwrap_or(arr.actor.ppo_epochs),
            peak_flops,
            devices,
            device_type: device_type.to_owned(),
        }
    }

    /// The step's perf metrics: the MFU of each timed engine call in `timing` (`old_log_prob`,
    /// `update_critic`, `update_actor`) over sequences of `seqlens` tokens (prompt + response,
    /// verl's `global_token_num`), and the memory metrics.
    pub fn metrics(&self, seqlens: &[u64], timing: &[(&str, f64)]) -> Vec<Metric> {
        let time = |name: &str| timing.iter().find(|(n, _)| *n == name).map(|(_, t)| *t);
        let mut out = Vec::new();
        let mut push = |key: &'static str, counter: &FlopsCounter, passes: f64, seconds: f64| {
            let flops = counter.flops(seqlens) * passes;
            out.push(Metric::new(
                key,
                mfu(flops, seconds, self.peak_flops, self.devices),
            ));
        };
        // A forward pass is a third of a forward and backward pass (verl's engine workers).
        if let Some(t) = time("old_log_prob") {
            push("perf/mfu/actor_infer", &self.actor, 1.0 / 3.0, t);
        }
        if let (Some(t), Some(critic)) = (time("update_critic"), &self.critic) {
            push("perf/mfu/critic", critic, self.critic_epochs as f64, t);
        }
        if let Some(t) = time("update_actor") {
            push("perf/mfu/actor", &self.actor, self.actor_epochs as f64, t);
        }
        out.extend(
            memory_metrics(&self.device_type)
                .into_iter()
                .map(|(k, v)| Metric::new(k, v)),
        );
        out
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// `field` of a `/proc` file in `key: value kB` lines, in bytes.
fn kib_field(text: &str, field: &str) -> Option<f64> {
    let value = text
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?;
    let kib: f64 = value.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024.0)
}

/// psutil's `virtual_memory().used` from a `/proc/meminfo` text, in GiB.
pub fn cpu_memory_used_gb(meminfo: &str) -> Option<f64> {
    let total = kib_field(meminfo, "MemTotal")?;
    let mut available = kib_field(meminfo, "MemAvailable")?;
    if available > total {
        // psutil's guard against a bogus MemAvailable.
        available = kib_field(meminfo, "MemFree")?;
    }
    Some((total - available) / GIB)
}

/// The process's peak resident set from a `/proc/self/status` text, in GiB.
pub fn peak_rss_gb(status: &str) -> Option<f64> {
    kib_field(status, "VmHWM").map(|b| b / GIB)
}

/// The memory metrics of this process on `device_type` (see the module's notes).
pub fn memory_metrics(device_type: &str) -> Vec<(&'static str, f64)> {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let mut out = Vec::new();
    if device_type == "cpu"
        && let Some(peak) = peak_rss_gb(&read("/proc/self/status"))
    {
        out.push(("perf/max_memory_allocated_gb", peak));
        out.push(("perf/max_memory_reserved_gb", peak));
    }
    if let Some(used) = cpu_memory_used_gb(&read("/proc/meminfo")) {
        out.push(("perf/cpu_memory_used_gb", used));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn device_table_matches_verl_lookup() {
        assert_eq!(device_peak_flops("CPU"), 448e9);
        assert_eq!(device_peak_flops("NVIDIA H200"), 989e12);
        // Descending name order: "L40S" is tried before "L40", "H20" after "H200".
        assert_eq!(device_peak_flops("NVIDIA L40S"), 362.05e12);
        assert_eq!(device_peak_flops("NVIDIA L40"), 181.05e12);
        assert_eq!(device_peak_flops("NVIDIA H20"), 148e12);
        assert_eq!(device_peak_flops("NVIDIA GeForce RTX 4090"), f64::INFINITY);
        assert_eq!(mfu(1e12, 1.0, f64::INFINITY, 1), 0.0);
    }

    #[test]
    fn dense_estimate_by_hand() {
        // hidden 8, vocab 10, 2 layers, 2 heads (head_dim 4), 1 kv head, intermediate 16:
        // mlp 8·16·3 = 384; attention linear 8·(8 + 4 + 4 + 8) = 192; embedding + head 10·8·2 =
        // 160; dense = (384 + 192)·2 + 160 = 1312. Sequences 3 and 5: 6·1312·8 = 62976 plus
        // attention 6·(9 + 25)·4·2·2 = 3264.
        let config = json!({"model_type": "llama", "hidden_size": 8, "vocab_size": 10,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 16});
        let counter = FlopsCounter::from_config(&config).unwrap();
        assert_eq!(counter.flops(&[3, 5]), 62976.0 + 3264.0);
        // An explicit head_dim wins over hidden / heads (Qwen3).
        let mut qwen3 = config.clone();
        qwen3["model_type"] = json!("qwen3");
        qwen3["head_dim"] = json!(16);
        let with_head_dim = FlopsCounter::from_config(&qwen3).unwrap();
        assert!(with_head_dim.flops(&[3, 5]) > counter.flops(&[3, 5]));
        // A model type without verl's dense formula counts nothing (verl logs MFU 0).
        let moe = json!({"model_type": "qwen2_moe"});
        let unknown = FlopsCounter::from_config(&moe).unwrap();
        assert!(!unknown.knows_model());
        assert_eq!(unknown.flops(&[3, 5]), 0.0);
        assert!(FlopsCounter::from_config(&json!({"model_type": "qwen2"})).is_err());
        assert_eq!(mfu(66240.0, 2.0, 1000.0, 4), 66240.0 / 2.0 / 1000.0 / 4.0);
    }

    #[test]
    fn memory_fields_as_psutil_and_proc() {
        let meminfo = "MemTotal:       2097152 kB\nMemFree:  100 kB\nMemAvailable:   1048576 kB\n";
        assert_eq!(cpu_memory_used_gb(meminfo), Some(1.0));
        // A MemAvailable above the total is replaced by MemFree, as psutil does.
        let bogus = "MemTotal: 2097152 kB\nMemFree: 1048576 kB\nMemAvailable: 9999999 kB\n";
        assert_eq!(cpu_memory_used_gb(bogus), Some(1.0));
        assert_eq!(cpu_memory_used_gb("MemFree: 1 kB\n"), None);
        let status = "Name:\tverl-core\nVmPeak:\t 9999 kB\nVmHWM:\t  3145728 kB\nVmRSS:\t 1 kB\n";
        assert_eq!(peak_rss_gb(status), Some(3.0));
        let here = memory_metrics("cpu");
        let keys: Vec<&str> = here.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [
                "perf/max_memory_allocated_gb",
                "perf/max_memory_reserved_gb",
                "perf/cpu_memory_used_gb"
            ],
            "this is Linux"
        );
        assert!(here.iter().all(|(_, v)| *v > 0.0));
        assert_eq!(memory_metrics("cuda").len(), 1);
    }
}
