//! The embedded default job: with `quickstart.enable`, `verl-core run` makes whatever is missing
//! before training — the synthetic addition task in verl's parquet format, a tiny Llama (config +
//! character tokenizer, random weights) and a short supervised warm-up of it ([`crate::sft`]) — so
//! a fresh machine needs no network, model or data.

use std::path::Path;

use serde_json::json;
use verl_plugin_host::Registry;

pub use crate::config::{QuickstartConfig, TinyModel};

use crate::config::Config;
use crate::data::expand_home;
use crate::data::synthetic::{self, SPECIAL_TOKENS};
use crate::placement::Placement;
use crate::sft::run_sft;
use crate::trainer::TrainError;

/// The example config `verl-core run` uses when given none.
pub const QUICKSTART_YAML: &str = include_str!("../../examples/quickstart.yaml");

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |error| TrainError::Io {
        path: path.to_path_buf(),
        error,
    }
}

fn write_json(path: &Path, value: serde_json::Value) -> Result<(), TrainError> {
    std::fs::write(
        path,
        serde_json::to_string_pretty(&value).expect("JSON values serialise"),
    )
    .map_err(io(path))
}

/// `config.json`, `generation_config.json` and the character tokenizer of the tiny model.
pub fn write_tiny_model(dir: &Path, model: &TinyModel) -> Result<(), TrainError> {
    synthetic::write_tokenizer(dir)?;
    let vocab = SPECIAL_TOKENS.len() + synthetic::ALPHABET.chars().count();
    write_json(
        &dir.join("config.json"),
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": model.hidden_size,
            "intermediate_size": model.intermediate_size,
            "num_hidden_layers": model.num_hidden_layers,
            "num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": model.num_key_value_heads,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        }),
    )?;
    write_json(
        &dir.join("generation_config.json"),
        json!({ "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0 }),
    )
}

/// Makes what the config points at and is missing: the task's parquet files, and the warmed-up
/// model at `actor_rollout_ref.model.path` (from a random tiny model next to it).
pub fn prepare(
    config: &Config,
    registry: &Registry,
    placement: &Placement,
) -> Result<(), TrainError> {
    let quick = &config.quickstart;
    if !quick.enable {
        return Ok(());
    }
    let (train, val) =
        match (
            config.data.train_files.first(),
            config.data.val_files.first(),
        ) {
            (Some(t), Some(v)) => (expand_home(t), expand_home(v)),
            _ => return Err(TrainError::Invalid(
                "quickstart needs data.train_files and data.val_files (where to write the task)"
                    .into(),
            )),
        };
    if !train.is_file() || !val.is_file() {
        let (train_samples, val_samples) = quick.task.generate()?;
        for (path, samples) in [(&train, &train_samples), (&val, &val_samples)] {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(io(dir))?;
            }
            crate::data::write_parquet(path, samples, "prompt")?;
        }
        eprintln!(
            "quickstart: wrote {} training and {} validation problems to {}",
            train_samples.len(),
            val_samples.len(),
            train.parent().unwrap_or(Path::new(".")).display()
        );
    }
    let model_dir = expand_home(&config.actor_rollout_ref.model.path);
    if !model_dir.join("model.safetensors").is_file() {
        let base = model_dir.with_file_name(format!(
            "{}-base",
            model_dir
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("model")
        ));
        std::fs::create_dir_all(&base).map_err(io(&base))?;
        write_tiny_model(&base, &quick.model)?;
        let mut sft = config.sft.clone();
        sft.base_model = Some(base.to_string_lossy().into_owned());
        sft.random_init = true;
        sft.output_dir = Some(model_dir.to_string_lossy().into_owned());
        run_sft(config, &sft, registry, placement)?;
    }
    Ok(())
}
