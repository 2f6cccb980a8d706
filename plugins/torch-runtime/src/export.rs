//! Writing a Hugging Face model directory that transformers (and [`CausalLM::from_pretrained`])
//! load back.

use std::path::Path;

use crate::error::{ModelError, Result, write_json};
use crate::model::{CausalLM, Head};
use crate::weights::{SINGLE_FILE, write_safetensors};

/// Files besides the weights and config that make a model directory usable, copied when present.
const COMPANION_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
];

impl CausalLM {
    /// Writes `config.json` and `model.safetensors` (fp32 or the model's dtype, HF names) into
    /// `dir`, creating it, and copies the tokenizer and generation files from `companions_from`.
    /// A value-head model is written as `*ForTokenClassification` with one label, as verl's critic.
    pub fn save_pretrained(&self, dir: &Path, companions_from: Option<&Path>) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let mut config = self.config().to_hf_json();
        config["torch_dtype"] = serde_json::json!(dtype_name(self.kind()));
        if self.head() == Head::Value {
            config["architectures"] =
                serde_json::json!([self.config().architecture.value_head_class()]);
            config["num_labels"] = serde_json::json!(1);
        }
        write_json(&dir.join("config.json"), &config)?;
        write_safetensors(&dir.join(SINGLE_FILE), &self.named_tensors())?;
        if let Some(source) = companions_from {
            for name in COMPANION_FILES {
                let from = source.join(name);
                if from.exists() {
                    std::fs::copy(&from, dir.join(name)).map_err(|e| ModelError::io(&from, e))?;
                }
            }
        }
        Ok(())
    }
}

fn dtype_name(kind: tch::Kind) -> &'static str {
    match kind {
        tch::Kind::BFloat16 => "bfloat16",
        tch::Kind::Half => "float16",
        _ => "float32",
    }
}
