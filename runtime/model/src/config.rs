//! Model configuration read from a Hugging Face `config.json` / `generation_config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{ModelError, Result, read_json};

/// The decoder families this crate implements. They share one architecture and differ in which
/// projections carry a bias, whether queries and keys are normed per head (Qwen3-MoE) and whether
/// the MLP is a mixture of experts ([`MoeConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen2Moe,
    Qwen3Moe,
}

impl Architecture {
    /// Every architecture that loads: the one list that parsing, the unsupported-architecture
    /// error and the tests read.
    pub const ALL: [Self; 4] = [Self::Llama, Self::Qwen2, Self::Qwen2Moe, Self::Qwen3Moe];

    /// The `architectures[0]` value of a Hugging Face config.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen2Moe => "Qwen2MoeForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// The `model_type` value of a Hugging Face config.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen2Moe => "qwen2_moe",
            Self::Qwen3Moe => "qwen3_moe",
        }
    }

    /// The class of the same decoder under a value head (transformers'
    /// `*ForTokenClassification` with one label: a saved critic).
    pub fn value_head_class(self) -> String {
        self.hf_class()
            .replace("ForCausalLM", "ForTokenClassification")
    }

    /// The architecture a Hugging Face `architectures[0]` names, with an LM or a value head.
    fn of_hf_class(class: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|a| a.hf_class() == class || a.value_head_class() == class)
    }

    /// The architecture a Hugging Face `model_type` names.
    fn of_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.model_type() == model_type)
    }
}

/// The mixture-of-experts MLP of Qwen2-MoE / Qwen3-MoE (transformers' `Qwen2MoeSparseMoeBlock`):
/// a router picks `num_experts_per_tok` of `num_experts` SwiGLU experts per token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub num_experts: i64,
    pub num_experts_per_tok: i64,
    pub moe_intermediate_size: i64,
    /// Qwen2-MoE's shared expert (gated by `sigmoid(shared_expert_gate(x))`); `None` for
    /// Qwen3-MoE, which has none.
    pub shared_expert_intermediate_size: Option<i64>,
    /// Renormalise the top-k routing weights to sum to one.
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is sparse, …
    pub decoder_sparse_step: i64,
    /// … except these, which keep a dense MLP of `intermediate_size`.
    pub mlp_only_layers: Vec<i64>,
    /// Weight of the load-balancing loss in the training loss (when `output_router_logits`).
    pub router_aux_loss_coef: f64,
    /// transformers adds the aux loss to the loss only when this is set (or asked per call).
    pub output_router_logits: bool,
}

impl MoeConfig {
    /// Whether decoder layer `layer` has the sparse MLP (transformers' `Qwen2MoeDecoderLayer`).
    pub fn is_sparse(&self, layer: i64) -> bool {
        !self.mlp_only_layers.contains(&layer) && (layer + 1) % self.decoder_sparse_step == 0
    }
}

/// Hyper-parameters of a decoder-only transformer of the Llama/Qwen2 family.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    /// Fewer than `num_attention_heads` means grouped-query attention.
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: i64,
    /// The LM head reuses `model.embed_tokens.weight` (no `lm_head.weight` tensor).
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2: always; Llama: `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama `attention_bias` only).
    pub o_bias: bool,
    /// Bias on gate/up/down projections (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// Standard deviation of the normal random initialisation.
    pub initializer_range: f64,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    pub pad_token_id: Option<i64>,
    /// RMS norms over each query and key head before the rotation (Qwen3: `q_norm`, `k_norm`).
    #[serde(default)]
    pub qk_norm: bool,
    /// The mixture-of-experts MLP; `None` for a dense model.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
}

/// The subset of a Hugging Face config this crate reads; everything optional so that we can name
/// the missing field ourselves.
#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: Option<i64>,
    hidden_size: Option<i64>,
    intermediate_size: Option<i64>,
    num_hidden_layers: Option<i64>,
    num_attention_heads: Option<i64>,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    hidden_act: Option<String>,
    rope_theta: Option<f64>,
    /// transformers ≥ 5 writes `rope_theta` here; older versions use `rope_scaling`.
    rope_parameters: Option<Value>,
    rope_scaling: Option<Value>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    use_sliding_window: Option<bool>,
    initializer_range: Option<f64>,
    bos_token_id: Option<i64>,
    eos_token_id: Option<TokenIds>,
    pad_token_id: Option<i64>,
    // Mixture of experts (Qwen2-MoE / Qwen3-MoE).
    qkv_bias: Option<bool>,
    num_experts: Option<i64>,
    /// transformers ≥ 5 writes Qwen3-MoE's `num_experts` under this name.
    num_local_experts: Option<i64>,
    num_experts_per_tok: Option<i64>,
    moe_intermediate_size: Option<i64>,
    shared_expert_intermediate_size: Option<i64>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<i64>,
    mlp_only_layers: Option<Vec<i64>>,
    router_aux_loss_coef: Option<f64>,
    output_router_logits: Option<bool>,
}

/// `eos_token_id` is an int or a list of ints in Hugging Face files.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(i64),
    Many(Vec<i64>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<i64> {
        match self {
            Self::One(id) => vec![id],
            Self::Many(ids) => ids,
        }
    }
}

impl ModelConfig {
    /// Reads `config.json` of a checkpoint of one of [`Architecture::ALL`].
    pub fn from_file(path: &Path) -> Result<Self> {
        let hf: HfConfig = read_json(path)?;
        Self::from_hf(hf, path)
    }

    /// Reads `<dir>/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("config.json"))
    }

    fn from_hf(hf: HfConfig, path: &Path) -> Result<Self> {
        let invalid = |reason: String| ModelError::InvalidConfig {
            path: path.to_owned(),
            reason,
        };
        let unsupported = |architecture: &str, supported: fn(Architecture) -> &'static str| {
            ModelError::UnsupportedArchitecture {
                path: path.to_owned(),
                architecture: architecture.to_owned(),
                supported: Architecture::ALL.map(supported).join(", "),
            }
        };
        let architecture = match hf.architectures.as_deref().and_then(|a| a.first()) {
            Some(class) => Architecture::of_hf_class(class)
                .ok_or_else(|| unsupported(class, Architecture::hf_class))?,
            None => {
                let model_type = hf.model_type.as_deref().unwrap_or("<none>");
                Architecture::of_model_type(model_type)
                    .ok_or_else(|| unsupported(model_type, Architecture::model_type))?
            }
        };
        let required = |value: Option<i64>, field: &str| match value {
            Some(v) if v > 0 => Ok(v),
            Some(v) => Err(invalid(format!("`{field}` must be positive, not {v}"))),
            None => Err(invalid(format!("`{field}` is missing"))),
        };
        let hidden_size = required(hf.hidden_size, "hidden_size")?;
        let num_attention_heads = required(hf.num_attention_heads, "num_attention_heads")?;
        let num_key_value_heads = required(
            hf.num_key_value_heads.or(hf.num_attention_heads),
            "num_key_value_heads",
        )?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(invalid(format!(
                "num_attention_heads ({num_attention_heads}) is not a multiple of num_key_value_heads ({num_key_value_heads})"
            )));
        }
        let head_dim = match hf.head_dim {
            Some(d) => required(Some(d), "head_dim")?,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(invalid(format!(
                    "hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_attention_heads}) and head_dim is not given"
                )));
            }
        };
        if head_dim % 2 != 0 {
            return Err(invalid(format!(
                "head_dim ({head_dim}) must be even for rotary embeddings"
            )));
        }
        if let Some(act) = hf.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(invalid(format!(
                "hidden_act {act:?} is not supported (only \"silu\")"
            )));
        }
        if hf.use_sliding_window == Some(true) {
            return Err(invalid("use_sliding_window=true is not supported".into()));
        }
        let (rope_theta, rope_scaling) = rope(&hf).map_err(invalid)?;
        let attention_bias = hf.attention_bias.unwrap_or(false);
        let (qkv_bias, o_bias, mlp_bias) = match architecture {
            // Qwen2 hard-codes bias on q/k/v and none elsewhere.
            Architecture::Qwen2 => (true, false, false),
            Architecture::Llama => (attention_bias, attention_bias, hf.mlp_bias.unwrap_or(false)),
            // transformers' Qwen2MoeAttention: q/k/v bias from `qkv_bias` (default true).
            Architecture::Qwen2Moe => (hf.qkv_bias.unwrap_or(true), false, false),
            Architecture::Qwen3Moe => (attention_bias, attention_bias, false),
        };
        let moe = match architecture {
            Architecture::Llama | Architecture::Qwen2 => None,
            Architecture::Qwen2Moe | Architecture::Qwen3Moe => {
                Some(moe_config(&hf, architecture, &invalid, &required)?)
            }
        };
        Ok(Self {
            architecture,
            vocab_size: required(hf.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: required(hf.intermediate_size, "intermediate_size")?,
            num_hidden_layers: required(hf.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rope_theta,
            rope_scaling,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(2048),
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
            initializer_range: hf.initializer_range.unwrap_or(0.02),
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.map(TokenIds::into_vec).unwrap_or_default(),
            pad_token_id: hf.pad_token_id,
            qk_norm: architecture == Architecture::Qwen3Moe,
            moe,
        })
    }

    /// A `config.json` that transformers loads back into the same model.
    pub fn to_hf_json(&self) -> Value {
        let eos = match self.eos_token_ids.as_slice() {
            [one] => json!(one),
            many => json!(many),
        };
        let mut config = json!({
            "architectures": [self.architecture.hf_class()],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        });
        match self.architecture {
            Architecture::Llama => {
                config["attention_bias"] = json!(self.qkv_bias);
                config["mlp_bias"] = json!(self.mlp_bias);
            }
            Architecture::Qwen2Moe => config["qkv_bias"] = json!(self.qkv_bias),
            Architecture::Qwen3Moe => config["attention_bias"] = json!(self.qkv_bias),
            Architecture::Qwen2 => {}
        }
        if let Some(moe) = &self.moe {
            for (key, value) in [
                ("num_experts", json!(moe.num_experts)),
                ("num_experts_per_tok", json!(moe.num_experts_per_tok)),
                ("moe_intermediate_size", json!(moe.moe_intermediate_size)),
                ("norm_topk_prob", json!(moe.norm_topk_prob)),
                ("decoder_sparse_step", json!(moe.decoder_sparse_step)),
                ("mlp_only_layers", json!(moe.mlp_only_layers)),
                ("router_aux_loss_coef", json!(moe.router_aux_loss_coef)),
                ("output_router_logits", json!(moe.output_router_logits)),
            ] {
                config[key] = value;
            }
            if let Some(size) = moe.shared_expert_intermediate_size {
                config["shared_expert_intermediate_size"] = json!(size);
            }
        }
        // Both spellings: transformers < 5 reads `rope_theta` + `rope_scaling`, ≥ 5 reads
        // `rope_parameters`.
        let mut parameters = json!({ "rope_type": "default" });
        if let Some(scaling) = self.rope_scaling {
            parameters = json!(scaling);
            config["rope_scaling"] = json!(scaling);
        }
        parameters["rope_theta"] = json!(self.rope_theta);
        config["rope_parameters"] = parameters;
        config
    }

    /// Positions the model is made for: `max_position_embeddings`, times the factor of linear
    /// RoPE scaling (Llama 3's scaling is already counted in `max_position_embeddings`).
    pub fn context_length(&self) -> i64 {
        match self.rope_scaling {
            Some(RopeScaling::Linear { factor }) => {
                (self.max_position_embeddings as f64 * factor) as i64
            }
            _ => self.max_position_embeddings,
        }
    }

    /// Parameters of the language model with its LM head.
    pub fn parameter_count(&self) -> u128 {
        let int = |v: i64| v as u128;
        let bias = |present: bool, n: u128| if present { n } else { 0 };
        let (hidden, inter) = (int(self.hidden_size), int(self.intermediate_size));
        let q = int(self.num_attention_heads) * int(self.head_dim);
        let kv = int(self.num_key_value_heads) * int(self.head_dim);
        let attention = 2 * hidden * q
            + 2 * hidden * kv
            + bias(self.qkv_bias, q + 2 * kv)
            + bias(self.o_bias, hidden);
        let mlp = 3 * hidden * inter + bias(self.mlp_bias, 2 * inter + hidden);
        let qk_norm = bias(self.qk_norm, 2 * int(self.head_dim));
        let layer_mlp = |layer: i64| match &self.moe {
            Some(moe) if moe.is_sparse(layer) => {
                let shared = moe
                    .shared_expert_intermediate_size
                    .map_or(0, |s| 3 * hidden * int(s) + hidden);
                let experts = int(moe.num_experts);
                experts * 3 * hidden * int(moe.moe_intermediate_size) + experts * hidden + shared
            }
            _ => mlp,
        };
        let layers: u128 = (0..self.num_hidden_layers)
            .map(|l| attention + qk_norm + layer_mlp(l) + 2 * hidden)
            .sum();
        let embeddings = int(self.vocab_size) * hidden;
        let head = bias(!self.tie_word_embeddings, embeddings);
        embeddings + layers + hidden + head
    }

    /// Number of query heads sharing one key/value head.
    pub fn kv_groups(&self) -> i64 {
        self.num_attention_heads / self.num_key_value_heads
    }
}

/// The [`MoeConfig`] of a Qwen2-MoE / Qwen3-MoE `config.json`, with transformers' defaults.
/// `positive` checks a required positive field (see `ModelConfig::from_hf`).
fn moe_config(
    hf: &HfConfig,
    architecture: Architecture,
    invalid: &impl Fn(String) -> ModelError,
    positive: &impl Fn(Option<i64>, &str) -> Result<i64>,
) -> Result<MoeConfig> {
    let num_experts = positive(hf.num_experts.or(hf.num_local_experts), "num_experts")?;
    let top_k = positive(hf.num_experts_per_tok, "num_experts_per_tok")?;
    if top_k > num_experts {
        return Err(invalid(format!(
            "num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})"
        )));
    }
    let shared_expert_intermediate_size = match architecture {
        Architecture::Qwen2Moe => Some(positive(
            hf.shared_expert_intermediate_size,
            "shared_expert_intermediate_size",
        )?),
        _ => None,
    };
    Ok(MoeConfig {
        num_experts,
        num_experts_per_tok: top_k,
        moe_intermediate_size: positive(hf.moe_intermediate_size, "moe_intermediate_size")?,
        shared_expert_intermediate_size,
        norm_topk_prob: hf.norm_topk_prob.unwrap_or(false),
        decoder_sparse_step: positive(hf.decoder_sparse_step.or(Some(1)), "decoder_sparse_step")?,
        mlp_only_layers: hf.mlp_only_layers.clone().unwrap_or_default(),
        router_aux_loss_coef: hf.router_aux_loss_coef.unwrap_or(0.001),
        output_router_logits: hf.output_router_logits.unwrap_or(false),
    })
}

/// A scaled variant of rotary embeddings (transformers' `rope_type`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// All frequencies divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: i64,
    },
}

/// `rope_theta` and the scaling, from the top-level keys (transformers < 5: `rope_theta`,
/// `rope_scaling`) or `rope_parameters` (transformers ≥ 5). Other variants (dynamic, yarn, …)
/// change the frequencies in ways not implemented here, so they are refused rather than ignored.
fn rope(hf: &HfConfig) -> Result<(f64, Option<RopeScaling>), String> {
    let mut theta = hf.rope_theta;
    let mut scaling = None;
    for (field, params) in [
        ("rope_parameters", &hf.rope_parameters),
        ("rope_scaling", &hf.rope_scaling),
    ] {
        let Some(Value::Object(params)) = params.as_ref() else {
            continue;
        };
        theta = theta.or_else(|| params.get("rope_theta").and_then(Value::as_f64));
        let kind = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str);
        match kind {
            None | Some("default") => {}
            Some(kind @ ("linear" | "llama3")) => {
                let mut tagged = params.clone();
                tagged.insert("rope_type".into(), kind.into());
                let parsed = serde_json::from_value(Value::Object(tagged))
                    .map_err(|e| format!("{field} of type {kind:?}: {e}"))?;
                scaling = scaling.or(Some(parsed));
            }
            Some(kind) => {
                return Err(format!(
                    "{field} of type {kind:?} is not supported (default, linear, llama3)"
                ));
            }
        }
    }
    Ok((theta.unwrap_or(10_000.0), scaling))
}

/// The end-of-sequence and padding ids that generation uses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<i64>,
    pub pad_token_id: Option<i64>,
    pub bos_token_id: Option<i64>,
}

#[derive(Deserialize)]
struct HfGenerationConfig {
    eos_token_id: Option<TokenIds>,
    pad_token_id: Option<i64>,
    bos_token_id: Option<i64>,
}

impl GenerationConfig {
    /// Reads `generation_config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let hf: HfGenerationConfig = read_json(path)?;
        Ok(Self {
            eos_token_ids: hf.eos_token_id.map(TokenIds::into_vec).unwrap_or_default(),
            pad_token_id: hf.pad_token_id,
            bos_token_id: hf.bos_token_id,
        })
    }

    /// `<dir>/generation_config.json` where present, its gaps filled from the model config (as
    /// transformers does).
    pub fn from_dir(dir: &Path, model: &ModelConfig) -> Result<Self> {
        let path = dir.join("generation_config.json");
        let mut config = if path.exists() {
            Self::from_file(&path)?
        } else {
            Self::default()
        };
        if config.eos_token_ids.is_empty() {
            config.eos_token_ids = model.eos_token_ids.clone();
        }
        config.pad_token_id = config.pad_token_id.or(model.pad_token_id);
        config.bos_token_id = config.bos_token_id.or(model.bos_token_id);
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_hf(
            serde_json::from_str(text).unwrap(),
            Path::new("dir/config.json"),
        )
    }

    #[test]
    fn reads_qwen2_with_defaults_and_eos_list() {
        let c = parse(
            r#"{"architectures":["Qwen2ForCausalLM"],"vocab_size":100,"hidden_size":64,
                "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
                "num_key_value_heads":2,"tie_word_embeddings":true,"eos_token_id":[3,4],
                "rope_theta":1000000.0,"hidden_act":"silu"}"#,
        )
        .unwrap();
        assert_eq!(c.architecture, Architecture::Qwen2);
        assert_eq!((c.head_dim, c.kv_groups()), (16, 2));
        assert!(c.qkv_bias && !c.o_bias && !c.mlp_bias && c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![3, 4]);
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(parse(&c.to_hf_json().to_string()).unwrap(), c);
    }

    #[test]
    fn reads_llama_rope_parameters_and_int_eos() {
        let c = parse(
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":100,"hidden_size":64,
                "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"head_dim":32,
                "attention_bias":true,"eos_token_id":2,
                "rope_parameters":{"rope_type":"default","rope_theta":500000.0}}"#,
        )
        .unwrap();
        assert_eq!((c.num_key_value_heads, c.head_dim), (4, 32));
        assert!(c.qkv_bias && c.o_bias && !c.tie_word_embeddings);
        assert_eq!((c.eos_token_ids.as_slice(), c.rope_theta), (&[2][..], 5e5));
        assert_eq!(parse(&c.to_hf_json().to_string()).unwrap(), c);
    }

    #[test]
    fn reads_rope_scaling_in_both_spellings() {
        let base = r#""architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,"intermediate_size":8,
                      "num_hidden_layers":1,"num_attention_heads":2"#;
        let llama3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let v4 = parse(&format!(
            r#"{{{base},"rope_theta":500000.0,"rope_scaling":{{"rope_type":"llama3","factor":8.0,
                "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}}}"#
        ))
        .unwrap();
        let v5 = parse(&format!(
            r#"{{{base},"rope_parameters":{{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,
                "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}}}"#
        ))
        .unwrap();
        assert_eq!((v4.rope_theta, v4.rope_scaling), (5e5, Some(llama3)));
        assert_eq!(v4, v5);
        assert_eq!(parse(&v4.to_hf_json().to_string()).unwrap(), v4);
        let linear = parse(&format!(
            r#"{{{base},"rope_scaling":{{"type":"linear","factor":2.0}}}}"#
        ))
        .unwrap();
        assert_eq!(
            linear.rope_scaling,
            Some(RopeScaling::Linear { factor: 2.0 })
        );
    }

    #[test]
    fn reads_qwen_moe_configs_and_names_missing_moe_keys() {
        let qwen2 = parse(
            r#"{"architectures":["Qwen2MoeForCausalLM"],"vocab_size":10,"hidden_size":8,
                "intermediate_size":8,"num_hidden_layers":4,"num_attention_heads":2,
                "num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":4,
                "shared_expert_intermediate_size":6,"decoder_sparse_step":2,"mlp_only_layers":[3]}"#,
        )
        .unwrap();
        let moe = qwen2.moe.as_ref().unwrap();
        assert_eq!(moe.shared_expert_intermediate_size, Some(6));
        assert!(qwen2.qkv_bias && !qwen2.qk_norm && !moe.norm_topk_prob);
        // Layer 1 is sparse (step 2); 0 and 2 are not on the step, 3 is mlp-only.
        let sparse: Vec<bool> = (0..4).map(|l| moe.is_sparse(l)).collect();
        assert_eq!(sparse, [false, true, false, false]);
        let qwen3 = parse(
            r#"{"model_type":"qwen3_moe","vocab_size":10,"hidden_size":8,"intermediate_size":8,
                "num_hidden_layers":1,"num_attention_heads":2,"num_local_experts":4,
                "num_experts_per_tok":2,"moe_intermediate_size":4,"norm_topk_prob":true}"#,
        )
        .unwrap();
        let moe = qwen3.moe.as_ref().unwrap();
        assert!(qwen3.qk_norm && !qwen3.qkv_bias && moe.norm_topk_prob && moe.num_experts == 4);
        assert_eq!(moe.shared_expert_intermediate_size, None);
        let err = parse(
            r#"{"model_type":"qwen3_moe","vocab_size":10,"hidden_size":8,"intermediate_size":8,
                "num_hidden_layers":1,"num_attention_heads":2,"num_experts":2,
                "num_experts_per_tok":3,"moe_intermediate_size":4}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("num_experts_per_tok (3) exceeds num_experts (2)"),
            "{err}"
        );
        let err = parse(
            r#"{"model_type":"qwen2_moe","vocab_size":10,"hidden_size":8,"intermediate_size":8,
                "num_hidden_layers":1,"num_attention_heads":2,"num_experts":2,
                "num_experts_per_tok":1,"moe_intermediate_size":4}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("`shared_expert_intermediate_size` is missing"),
            "{err}"
        );
    }

    #[test]
    fn unsupported_architectures_list_every_supported_one() {
        let err = parse(r#"{"architectures":["MistralForCausalLM"]}"#)
            .unwrap_err()
            .to_string();
        for architecture in Architecture::ALL {
            assert!(err.contains(architecture.hf_class()), "{err}");
        }
        let err = parse(r#"{"model_type":"mistral"}"#)
            .unwrap_err()
            .to_string();
        for architecture in Architecture::ALL {
            assert!(err.contains(architecture.model_type()), "{err}");
        }
    }

    #[test]
    fn every_architecture_loads_under_both_heads() {
        let sizes = r#""vocab_size":10,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":2,"num_experts":2,"num_experts_per_tok":1,
            "moe_intermediate_size":4,"shared_expert_intermediate_size":4"#;
        for architecture in Architecture::ALL {
            for class in [
                architecture.hf_class().to_owned(),
                architecture.value_head_class(),
            ] {
                let c = parse(&format!(r#"{{"architectures":["{class}"],{sizes}}}"#)).unwrap();
                assert_eq!(c.architecture, architecture, "{class}");
            }
            let model_type = architecture.model_type();
            let c = parse(&format!(r#"{{"model_type":"{model_type}",{sizes}}}"#)).unwrap();
            assert_eq!(c.architecture, architecture, "{model_type}");
        }
    }

    #[test]
    fn errors_name_the_file_and_the_problem() {
        let err = parse(r#"{"architectures":["MistralForCausalLM"]}"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("dir/config.json") && err.contains("MistralForCausalLM"),
            "{err}"
        );
        let err = parse(r#"{"architectures":["LlamaForCausalLM"],"hidden_size":8}"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("dir/config.json") && err.contains("num_attention_heads"),
            "{err}"
        );
        let err = parse(
            r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
                "num_attention_heads":2,"rope_scaling":{"type":"yarn","factor":8.0}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("yarn"), "{err}");
        let err = parse(
            r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
                "num_attention_heads":2,"rope_scaling":{"rope_type":"llama3","factor":8.0}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("llama3") && err.contains("low_freq_factor"),
            "{err}"
        );
    }
}
