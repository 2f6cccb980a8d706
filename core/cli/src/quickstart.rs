//! The embedded default job: with `quickstart.enable`, `verl-core run` makes whatever is missing
//! before training — the synthetic addition task in verl's parquet format, a tiny Llama (config +
//! character tokenizer, random weights) and a short supervised warm-up of it ([`verl_trainer::sft`]) — so
//! a fresh machine needs no network, model or data. It writes only inside its own directory
//! (`quickstart.dir`) and never over an existing file: data and model paths the user points
//! elsewhere are used as given, or refused when they do not exist.

use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use verl_plugin_host::Registry;

pub use verl_config::TinyModel;

use verl_config::Config;
use verl_data::expand_home;
use verl_data::synthetic::{self, SPECIAL_TOKENS};
use verl_trainer::placement::Placement;
use verl_trainer::sft::run_sft;
use verl_trainer::trainer::TrainError;

/// The example config `verl-core run` uses when given none.
pub const QUICKSTART_YAML: &str = include_str!("../../../examples/quickstart.yaml");

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
    let mut config = json!({
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
    });
    if model.num_experts > 0 {
        // Qwen3-MoE: every layer sparse, experts as wide as the dense MLP would be split among
        // the routed ones, top-k weights renormalised, transformers' aux-loss defaults.
        let extra = json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "head_dim": model.hidden_size / model.num_attention_heads,
            "num_experts": model.num_experts,
            "num_experts_per_tok": model.num_experts_per_tok,
            "moe_intermediate_size": (model.intermediate_size / model.num_experts_per_tok.max(1)).max(1),
            "norm_topk_prob": true,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001,
            "output_router_logits": false,
        });
        for (key, value) in extra.as_object().expect("an object") {
            config[key] = value.clone();
        }
    }
    write_json(&dir.join("config.json"), config)?;
    write_json(
        &dir.join("generation_config.json"),
        json!({ "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0 }),
    )
}

/// What the quickstart makes: the data files and the model directory the config points at that
/// are missing. Only paths inside its own directory (`quickstart.dir`) are ever made; an existing
/// path is used as given and never written to, and a missing one elsewhere is an error.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    pub train: Vec<PathBuf>,
    pub val: Vec<PathBuf>,
    /// The warmed-up model to make, from a random tiny model in the sibling `<name>-base`.
    pub model: Option<PathBuf>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.train.is_empty() && self.val.is_empty() && self.model.is_none()
    }
}

/// `path` made absolute against `cwd`, with `.` and `..` resolved by name (the path may not
/// exist yet, so links are not followed).
fn lexical(path: &Path, cwd: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in cwd.join(path).components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// What the quickstart would make for `config`, run from `cwd`; an error names the key whose
/// path it will not write. Checks everything before anything is made.
pub fn plan(config: &Config, cwd: &Path) -> Result<Plan, TrainError> {
    let quick = &config.quickstart;
    let dir = lexical(&expand_home(&quick.dir), cwd);
    let inside = |path: &Path| {
        let path = lexical(path, cwd);
        path != dir && path.starts_with(&dir)
    };
    let refuse = |key: &str, path: &Path, what: &str| {
        TrainError::Invalid(format!(
            "{key}: {} {what}, and the quickstart writes only inside its directory {} \
             (quickstart.dir)",
            path.display(),
            dir.display()
        ))
    };
    let mut plan = Plan::default();
    let data = &config.data;
    for (key, files, planned) in [
        ("data.train_files", &data.train_files, &mut plan.train),
        ("data.val_files", &data.val_files, &mut plan.val),
    ] {
        if files.is_empty() {
            return Err(TrainError::Invalid(format!(
                "the quickstart needs {key} (where its task is, or is to be written)"
            )));
        }
        for file in files {
            let path = expand_home(file);
            if cwd.join(&path).exists() {
                continue;
            }
            if !inside(&path) {
                return Err(refuse(
                    key,
                    &path,
                    "does not exist: prepare it (e.g. with verl's examples/data_preprocess), or \
                     give a path inside that directory to have the synthetic task written there;",
                ));
            }
            planned.push(path);
        }
    }
    let key = "actor_rollout_ref.model.path";
    let model = expand_home(&config.actor_rollout_ref.model.path);
    if !cwd.join(&model).exists() {
        if !inside(&model) {
            return Err(refuse(
                key,
                &model,
                "is not a directory here (nothing is downloaded): give a local Hugging Face \
                 model directory, or a path inside that directory to have the warmed-up tiny \
                 model made there;",
            ));
        }
        plan.model = Some(model);
    } else if inside(&model) && !cwd.join(&model).join("model.safetensors").is_file() {
        return Err(TrainError::Invalid(format!(
            "{key}: {} exists but holds no model.safetensors; the quickstart never writes over \
             files: remove it to have the warmed-up model made again",
            model.display()
        )));
    }
    Ok(plan)
}

/// Writes `path` through `write` without ever replacing a file: into a temporary file next to
/// it, then linked into place only if nothing is there.
fn create_new(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), TrainError>,
) -> Result<(), TrainError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let name = path
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy());
    let partial = path.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    let written = write(&partial).and_then(|()| match std::fs::hard_link(&partial, path) {
        // Made meanwhile by someone else: theirs stays.
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(io(path)(e)),
        _ => Ok(()),
    });
    // The temporary file may be missing if `write` failed before creating it.
    let _ = std::fs::remove_file(&partial);
    written
}

/// Makes what [`plan`] finds missing: the task's parquet files, and the warmed-up model (from a
/// random tiny model in the sibling `<name>-base`, made unless it exists).
pub fn prepare(
    config: &Config,
    registry: &Registry,
    placement: &Placement,
) -> Result<(), TrainError> {
    let quick = &config.quickstart;
    if !quick.enable {
        return Ok(());
    }
    let cwd = std::env::current_dir().map_err(io(Path::new(".")))?;
    let plan = plan(config, &cwd)?;
    if placement.run().rank > 0 {
        return wait_for_rank_0(config, &cwd, plan);
    }
    if !plan.train.is_empty() || !plan.val.is_empty() {
        let (train_samples, val_samples) = quick.task.generate()?;
        for (paths, samples) in [(&plan.train, &train_samples), (&plan.val, &val_samples)] {
            for path in paths {
                create_new(path, |partial| {
                    Ok(verl_data::write_parquet(partial, samples, "prompt")?)
                })?;
                eprintln!(
                    "quickstart: wrote {} problems to {}",
                    samples.len(),
                    path.display()
                );
            }
        }
    }
    if let Some(model_dir) = &plan.model {
        let base = model_dir.with_file_name(format!(
            "{}-base",
            model_dir
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("model")
        ));
        if !base.exists() {
            // Written aside and renamed whole, so a base is either complete or absent.
            let partial = base.with_file_name(format!(
                ".{}.partial-{}",
                base.file_name().unwrap_or_default().to_string_lossy(),
                std::process::id()
            ));
            std::fs::create_dir_all(&partial).map_err(io(&partial))?;
            write_tiny_model(&partial, &quick.model)?;
            std::fs::rename(&partial, &base).map_err(io(&base))?;
        }
        // Written aside and renamed into place, so other ranks waiting for it never see half
        // a model.
        let partial = model_dir.with_file_name(format!(
            ".{}.partial-{}",
            model_dir.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id()
        ));
        let mut sft = config.sft.clone();
        sft.base_model = Some(base.to_string_lossy().into_owned());
        sft.random_init = true;
        sft.output_dir = Some(partial.to_string_lossy().into_owned());
        // Rank 0 warms the model up on its own, for every rank.
        run_sft(config, &sft, registry, &placement.alone())?;
        std::fs::rename(&partial, model_dir).map_err(io(model_dir))?;
    }
    Ok(())
}

/// The other ranks of a multi-rank run wait until rank 0 has made what `plan` lists (every path
/// appears complete, by a link or a rename), for at most `actor_rollout_ref.nccl_timeout`.
fn wait_for_rank_0(config: &Config, cwd: &Path, mut pending: Plan) -> Result<(), TrainError> {
    let timeout = Duration::from_secs(config.actor_rollout_ref.nccl_timeout);
    let started = Instant::now();
    while !pending.is_empty() {
        if started.elapsed() >= timeout {
            return Err(TrainError::Invalid(format!(
                "waited {} s (actor_rollout_ref.nccl_timeout) for rank 0 to make the quickstart's {:?}",
                timeout.as_secs(),
                pending
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
        pending = plan(config, cwd)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &str, train: &str, val: &str, model: &str) -> Config {
        let mut c = Config::default();
        c.quickstart.enable = true;
        c.quickstart.dir = dir.into();
        c.data.train_files = vec![train.into()];
        c.data.val_files = vec![val.into()];
        c.actor_rollout_ref.model.path = model.into();
        c
    }

    /// Inside its directory the quickstart makes what is missing; elsewhere it uses what exists
    /// and refuses what does not, naming the key; it never plans over an existing path.
    #[test]
    fn plans_only_inside_its_directory() {
        let cwd = tempfile::tempdir().unwrap();
        let cwd = cwd.path();
        let c = config(
            "q",
            "q/data/train.parquet",
            "q/data/test.parquet",
            "q/model-sft",
        );
        assert_eq!(
            plan(&c, cwd).unwrap(),
            Plan {
                train: vec!["q/data/train.parquet".into()],
                val: vec!["q/data/test.parquet".into()],
                model: Some("q/model-sft".into()),
            }
        );

        // verl's GSM8K quickstart overrides: nothing of theirs exists, nothing is planned there.
        let home = cwd.join("home");
        let train = format!("{}/data/gsm8k/train.parquet", home.display());
        let val = format!("{}/data/gsm8k/test.parquet", home.display());
        for (c, key) in [
            (
                config("q", &train, "q/t.parquet", "q/m"),
                "data.train_files",
            ),
            (config("q", "q/t.parquet", &val, "q/m"), "data.val_files"),
            (
                config(
                    "q",
                    "q/t.parquet",
                    "q/v.parquet",
                    "Qwen/Qwen2.5-0.5B-Instruct",
                ),
                "actor_rollout_ref.model.path",
            ),
            // `..` leads out of the directory; the directory itself is not inside it.
            (
                config("q", "q/../t.parquet", "q/v.parquet", "q/m"),
                "data.train_files",
            ),
            (
                config("q", "q/t.parquet", "q/v.parquet", "q"),
                "actor_rollout_ref.model.path",
            ),
        ] {
            let err = plan(&c, cwd).unwrap_err().to_string();
            assert!(
                err.starts_with(key) && err.contains("writes only inside its directory"),
                "{key}: {err}"
            );
        }

        // What exists is used as given, inside or out.
        std::fs::create_dir_all(home.join("data/gsm8k")).unwrap();
        std::fs::write(&train, "x").unwrap();
        std::fs::create_dir_all(cwd.join("q/data")).unwrap();
        std::fs::write(cwd.join("q/data/test.parquet"), "x").unwrap();
        let user_model = cwd.join("models/qwen");
        std::fs::create_dir_all(&user_model).unwrap();
        let c = config(
            "q",
            &train,
            "q/data/test.parquet",
            user_model.to_str().unwrap(),
        );
        assert!(plan(&c, cwd).unwrap().is_empty());

        // A model directory of its own without weights is left alone, with a message.
        std::fs::create_dir_all(cwd.join("q/model-sft")).unwrap();
        let c = config("q", &train, "q/data/test.parquet", "q/model-sft");
        let err = plan(&c, cwd).unwrap_err().to_string();
        assert!(err.contains("holds no model.safetensors"), "{err}");
    }

    #[test]
    fn create_new_never_replaces_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/f.txt");
        let write = |text: &'static str| move |p: &Path| std::fs::write(p, text).map_err(io(p));
        create_new(&path, write("first")).unwrap();
        create_new(&path, write("second")).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "first");
        let left: Vec<_> = std::fs::read_dir(dir.path().join("sub")).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file is left");
    }
}
