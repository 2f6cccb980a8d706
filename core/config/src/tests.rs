use std::path::PathBuf;

use serde_json::{Value, json};

use super::*;
use verl_algo::AdvEstimator;

/// The sections the plugins bundled in this workspace declare.
fn bundled() -> PluginSections {
    ["wandb", "mlflow", "tensorboard", "trackio"]
        .into_iter()
        .fold(
            PluginSections::new().with(SectionKind::Engine, "fsdp_config"),
            |s, name| s.with(SectionKind::Tracker, name),
        )
}

fn load(file: Option<&Path>, env: &[(&str, &str)], args: &[&str]) -> Result<Config, ConfigError> {
    load_with(&bundled(), file, env, args)
}

fn load_with(
    sections: &PluginSections,
    file: Option<&Path>,
    env: &[(&str, &str)],
    args: &[&str],
) -> Result<Config, ConfigError> {
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    Config::load(file, env, &args, sections)
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn defaults_are_verls() {
    let c = load(None, &[], &[]).unwrap();
    assert_eq!(
        c.trainer.default_local_dir,
        "checkpoints/verl_examples/gsm8k"
    );
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 1e-6);
    assert_eq!(c.data.train_batch_size, 1024);
    assert_eq!(c.algorithm.adv_estimator, AdvEstimator::Gae);
    assert_eq!(
        c.actor_rollout_ref.rollout.checkpoint_engine.backend,
        "naive"
    );
    assert_eq!(c.trainer.logger, vec!["console"]);
    let mut expected = Config::default();
    expected.trainer.default_local_dir = c.trainer.default_local_dir.clone();
    assert_eq!(c, expected);
}

#[test]
fn layers_override_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "run.yaml",
        "trainer:\n  total_epochs: 5\n  project_name: proj\n  experiment_name: exp\ndata:\n  train_files: [a.parquet, b.parquet]\n",
    );
    let c = load(Some(&file), &[], &[]).unwrap();
    assert_eq!(
        (c.trainer.total_epochs, c.trainer.default_local_dir.as_str()),
        (5, "checkpoints/proj/exp")
    );
    assert_eq!(c.data.train_files, vec!["a.parquet", "b.parquet"]);
    let env = [
        ("VERL_TRAINER__TOTAL_EPOCHS", "6"),
        ("VERL_trainer__project_name", "envproj"),
    ];
    let c = load(Some(&file), &env, &[]).unwrap();
    assert_eq!(
        (c.trainer.total_epochs, c.trainer.project_name.as_str()),
        (6, "envproj")
    );
    let c = load(
        Some(&file),
        &env,
        &["trainer.total_epochs=7", "trainer.experiment_name=cli"],
    )
    .unwrap();
    assert_eq!(c.trainer.total_epochs, 7);
    // Interpolation sees the final values of every layer.
    assert_eq!(c.trainer.default_local_dir, "checkpoints/envproj/cli");
}

#[test]
fn toml_files_work() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "run.toml",
        "[actor_rollout_ref.actor.optim]\nlr = 3e-6\n[algorithm]\nadv_estimator = \"grpo\"\n",
    );
    let c = load(Some(&file), &[], &[]).unwrap();
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 3e-6);
    assert_eq!(c.algorithm.adv_estimator, AdvEstimator::Grpo);
    let bad = write(&dir, "run.ini", "");
    assert!(
        load(Some(&bad), &[], &[])
            .unwrap_err()
            .to_string()
            .contains("unknown format")
    );
    let broken = write(&dir, "broken.yaml", "trainer: [\n");
    assert!(matches!(
        load(Some(&broken), &[], &[]),
        Err(ConfigError::File { .. })
    ));
}

/// Config text held in memory (the embedded quickstart) is parsed from the string and named in
/// errors by the name it is given; it loads exactly as the same text in a file.
#[test]
fn text_source_parses_like_a_file_and_names_itself() {
    let embedded = |text, format| ConfigSource::Text {
        text,
        format,
        name: "the embedded example.yaml",
    };
    let load_source = |source: ConfigSource, args: &[&str]| {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        Config::load_source(Some(source), Vec::new(), &args, &bundled())
    };
    let yaml = "trainer:\n  total_epochs: 5\n  project_name: proj\nwandb:\n  entity: me\n";
    let dir = tempfile::tempdir().unwrap();
    let file = write(&dir, "run.yaml", yaml);
    let from_text = load_source(embedded(yaml, FileFormat::Yaml), &[]).unwrap();
    let from_file = load(Some(&file), &[], &[]).unwrap();
    assert_eq!(from_text.to_json(), from_file.to_json());
    assert_eq!(from_text.trainer.total_epochs, 5);
    assert_eq!(
        from_text.plugin_section(Slot::Tracker, "wandb").origins["wandb.entity"],
        "the embedded example.yaml"
    );

    let toml = "[actor_rollout_ref.actor.optim]\nlr = 3e-6\n";
    let c = load_source(
        embedded(toml, FileFormat::Toml),
        &["trainer.total_epochs=2"],
    )
    .unwrap();
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 3e-6);
    assert_eq!(c.trainer.total_epochs, 2);

    assert_eq!(
        load_source(
            embedded("trainer:\n  total_epoch: 5\n", FileFormat::Yaml),
            &[]
        ),
        Err(ConfigError::UnknownKey {
            key: "trainer.total_epoch".into(),
            origin: "the embedded example.yaml".into(),
            suggestion: Some("trainer.total_epochs".into()),
        })
    );
    assert!(matches!(
        load_source(embedded("trainer: [\n", FileFormat::Yaml), &[]),
        Err(ConfigError::Syntax { origin, .. }) if origin == "the embedded example.yaml"
    ));
    // NaN and infinities are named by key, not turned into null.
    for (text, format, shown) in [
        (
            "[actor_rollout_ref.actor.optim]\nlr = nan\n",
            FileFormat::Toml,
            "NaN",
        ),
        (
            "trainer:\n  total_epochs: 1\nalgorithm:\n  gamma: -.inf\n",
            FileFormat::Yaml,
            "-inf",
        ),
    ] {
        match load_source(embedded(text, format), &[]) {
            Err(ConfigError::Syntax { message, .. }) => assert!(
                message.contains(shown) && message.contains("finite"),
                "{message}"
            ),
            other => panic!("expected a syntax error for {text:?}, got {other:?}"),
        }
    }
    // A key given twice is refused (as OmegaConf does), naming the key and where its mapping is.
    let twice = "trainer:\n  total_epochs: 2\n  project_name: p\n  total_epochs: 3\n";
    match load_source(embedded(twice, FileFormat::Yaml), &[]) {
        Err(ConfigError::Syntax { origin, message }) => {
            assert_eq!(origin, "the embedded example.yaml");
            assert!(
                message.contains("duplicate")
                    && message.contains("\"total_epochs\"")
                    && message.contains("line 2"),
                "{message}"
            );
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    assert!(matches!(
        load_source(embedded("trainer:\n  total_epochs: many\n", FileFormat::Yaml), &[]),
        Err(ConfigError::Invalid { key, origin, .. })
            if key == "trainer.total_epochs" && origin == "the embedded example.yaml"
    ));
}

#[test]
fn hydra_overrides() {
    let c = load(
        None,
        &[],
        &[
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "trainer.logger=[console,file]",
            "trainer.experiment_name=2024",
            "trainer.project_name='my project'",
            "critic.optim.lr=1",
            "trainer.total_training_steps=5",
            "actor_rollout_ref.rollout.n=8",
            "data.truncation=left",
            "algorithm.kl_ctrl.type=adaptive",
        ],
    )
    .unwrap();
    assert_eq!(c.trainer.logger, vec!["console", "file"]);
    assert_eq!(c.trainer.experiment_name, "2024");
    assert_eq!(c.trainer.project_name, "my project");
    assert_eq!(c.critic.optim.lr, 1.0);
    assert_eq!(c.trainer.total_training_steps, Some(5));
    assert_eq!(c.actor_rollout_ref.rollout.n, 8);
    assert_eq!(c.data.truncation, verl_data::Truncation::Left);
    assert_eq!(c.algorithm.kl_ctrl.kind, verl_algo::KlCtrlType::Adaptive);
    let c = load(
        None,
        &[],
        &[
            "trainer.logger=console",
            "trainer.total_training_steps=null",
        ],
    )
    .unwrap();
    assert_eq!(c.trainer.logger, vec!["console"]);
    assert_eq!(c.trainer.total_training_steps, None);
    let err = load(None, &[], &["trainer.logger=[a"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("command-line override `trainer.logger=[a`")
            && err.contains("expected `,` or `]`"),
        "{err}"
    );
}

#[test]
fn unknown_keys_name_source_and_suggest() {
    let err = load(None, &[], &["trainer.total_epoch=3"]).unwrap_err();
    assert_eq!(
        err,
        ConfigError::UnknownKey {
            key: "trainer.total_epoch".into(),
            origin: "command-line override `trainer.total_epoch=3`".into(),
            suggestion: Some("trainer.total_epochs".into()),
        }
    );
    assert!(
        err.to_string()
            .contains("did you mean `trainer.total_epochs`?")
    );
    let err = load(None, &[], &["trainer.lr=3"]).unwrap_err().to_string();
    assert!(
        err.contains("did you mean `actor_rollout_ref.actor.optim.lr`"),
        "{err}"
    );
    let err = load(None, &[("VERL_ACTOR_ROLLOUT_REF__ROLOUT__N", "2")], &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`actor_rollout_ref.rolout`")
            && err.contains("VERL_ACTOR_ROLLOUT_REF__ROLOUT__N")
            && err.contains("actor_rollout_ref.rollout`?"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "f.yaml",
        "actor_rollout_ref:\n  actor:\n    optim:\n      lrr: 1\n",
    );
    let err = load(Some(&file), &[], &[]).unwrap_err().to_string();
    assert!(
        err.contains("`actor_rollout_ref.actor.optim.lrr` (from config file")
            && err.contains("f.yaml")
            && err.contains("optim.lr`?"),
        "{err}"
    );
    let err = load(None, &[], &["trainer.total_epochs.x=1"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("is a value, not a section"), "{err}");
    // `+`/`++` name an unknown key the same way.
    assert_eq!(
        load(None, &[], &["+trainer.total_epoch=3"]),
        Err(ConfigError::UnknownKey {
            key: "trainer.total_epoch".into(),
            origin: "command-line override `+trainer.total_epoch=3`".into(),
            suggestion: Some("trainer.total_epochs".into()),
        })
    );
    assert!(matches!(
        load(None, &[], &["++reward_model.reward_kwargs.max_resp_len=3"]),
        Err(ConfigError::UnknownKey { key, .. }) if key == "reward_model.reward_kwargs"
    ));
}

#[test]
fn wrong_types_name_key_and_source() {
    let err = load(None, &[("VERL_TRAINER__TOTAL_EPOCHS", "abc")], &[]).unwrap_err();
    let ConfigError::Invalid {
        key,
        origin,
        message,
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(
        (key.as_str(), origin.as_str()),
        (
            "trainer.total_epochs",
            "environment variable VERL_TRAINER__TOTAL_EPOCHS"
        )
    );
    assert!(message.contains("string"), "{message}");
    let err = load(None, &[], &["trainer.logger={a: 1}"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`trainer.logger` (from command-line override `trainer.logger={a: 1}`)")
            && err.contains("a string or a list of strings"),
        "{err}"
    );
    let err = load(None, &[], &["algorithm.adv_estimator=grpoo"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`algorithm.adv_estimator`") && err.contains("grpoo"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = write(&dir, "f.yaml", "trainer:\n  save_freq: often\n");
    let err = load(Some(&file), &[], &[]).unwrap_err().to_string();
    assert!(
        err.contains("`trainer.save_freq` (from config file") && err.contains("f.yaml"),
        "{err}"
    );
}

#[test]
fn non_config_variables_and_free_form_sections() {
    let env = [
        ("VERL_PLATFORM", "cpu"),
        ("VERL_PLUGIN_PATH", "/p"),
        ("VERL_PROBE_ROOT", "/"),
        ("VERL_PLUGIN_ALLOWLIST", "x"),
        ("VERL_FILE_LOGGER_PATH", "/m.jsonl"),
        ("VERL_LOGGING_LEVEL", "INFO"),
        ("PATH", "/bin"),
    ];
    assert!(load(None, &env, &[]).is_ok());
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "f.yaml",
        "defaults:\n  - ppo_trainer\n  - _self_\nhydra:\n  searchpath: []\nactor_rollout_ref:\n  actor:\n    _target_: verl.workers.config.FSDPActorConfig\n    fsdp_config:\n      param_offload: true\nwandb:\n  entity: me\n",
    );
    let c = load_with(
        &bundled().with(SectionKind::Rollout, "vllm"),
        Some(&file),
        &[],
        &[
            "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
            "trainer.mlflow.tracking_uri=http://127.0.0.1:5000",
            "data.apply_chat_template_kwargs.enable_thinking=false",
        ],
    )
    .unwrap();
    assert_eq!(
        c.actor_rollout_ref.actor.sections["fsdp_config"],
        json!({"param_offload": true})
    );
    assert_eq!(
        c.actor_rollout_ref.rollout.engine_kwargs["vllm"]["swap_space"],
        4
    );
    assert_eq!(c.sections["wandb"], json!({"entity": "me"}));
    assert_eq!(
        c.trainer.sections["mlflow"]["tracking_uri"],
        "http://127.0.0.1:5000"
    );
    assert_eq!(
        c.data.apply_chat_template_kwargs,
        json!({"enable_thinking": false})
    );
}

#[test]
fn declared_engine_section_passes_through_with_origins() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "run.yaml",
        "actor_rollout_ref:\n  actor:\n    fsdp_config:\n      param_offload: true\n      wrap_policy:\n        min_num_params: 3\n",
    );
    let c = load(
        Some(&file),
        &[("VERL_ACTOR_ROLLOUT_REF__ACTOR__FSDP_CONFIG__FSDP_SIZE", "2")],
        &["actor_rollout_ref.actor.fsdp_config.param_offload=false"],
    )
    .unwrap();
    let section = c.plugin_section(Slot::Engine(EngineRole::Actor), "fsdp_config");
    let path = "actor_rollout_ref.actor.fsdp_config";
    let from_file = format!("config file {}", file.display());
    assert_eq!(
        section,
        PluginSection {
            path: path.into(),
            value: json!({"param_offload": false, "fsdp_size": 2, "wrap_policy": {"min_num_params": 3}}),
            origins: [
                (
                    "param_offload",
                    "command-line override `actor_rollout_ref.actor.fsdp_config.param_offload=false`"
                ),
                (
                    "fsdp_size",
                    "environment variable VERL_ACTOR_ROLLOUT_REF__ACTOR__FSDP_CONFIG__FSDP_SIZE"
                ),
                ("wrap_policy", &from_file),
                ("wrap_policy.min_num_params", &from_file),
            ]
            .into_iter()
            .map(|(k, v)| (format!("{path}.{k}"), v.to_owned()))
            .collect(),
        }
    );
    let origins: serde_json::Map<String, Value> =
        serde_json::from_str(&section.origins_json()).unwrap();
    assert_eq!(origins.len(), 4);
    // The engine sees its section; the ref's is its own (unset here), not the actor's.
    assert_eq!(
        c.engine_json(EngineRole::Actor)["fsdp_config"],
        section.value
    );
    assert_eq!(c.engine_json(EngineRole::Ref).get("fsdp_config"), None);
    let reference = c.plugin_section(Slot::Engine(EngineRole::Ref), "fsdp_config");
    assert_eq!(
        (
            reference.path.as_str(),
            reference.value,
            reference.origins.len()
        ),
        ("actor_rollout_ref.ref.fsdp_config", json!({}), 0)
    );
    // The section shows and loads back like any other.
    let shown = write(&dir, "shown.yaml", &c.to_yaml());
    assert_eq!(load(Some(&shown), &[], &[]).unwrap(), c);
}

#[test]
fn undeclared_plugin_sections_are_unknown_keys() {
    let err = load(
        None,
        &[],
        &["actor_rollout_ref.actor.fsdp_confg.param_offload=true"],
    )
    .unwrap_err();
    assert_eq!(
        err,
        ConfigError::UnknownKey {
            key: "actor_rollout_ref.actor.fsdp_confg".into(),
            origin: "command-line override `actor_rollout_ref.actor.fsdp_confg.param_offload=true`"
                .into(),
            suggestion: Some("actor_rollout_ref.actor.fsdp_config".into()),
        }
    );
    let err = load(None, &[("VERL_TRAINER__WANDBB__ENTITY", "me")], &[])
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "unknown config key `trainer.wandbb` (from environment variable VERL_TRAINER__WANDBB__ENTITY); did you mean `trainer.wandb`?"
    );
    // Nothing declared: core accepts no plugin section, wherever it sits.
    let none = PluginSections::new();
    for arg in [
        "wandb.entity=me",
        "trainer.mlflow.tracking_uri=x",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "critic.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
        "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.disk.dir=/x",
    ] {
        let err = load_with(&none, None, &[], &[arg]).unwrap_err();
        assert!(
            matches!(err, ConfigError::UnknownKey { .. }),
            "{arg}: {err}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "f.yaml",
        "actor_rollout_ref:\n  actor:\n    megatron: {}\n",
    );
    let err = load(Some(&file), &[], &[]).unwrap_err().to_string();
    assert!(
        err.starts_with("unknown config key `actor_rollout_ref.actor.megatron` (from config file"),
        "{err}"
    );
    // Declared by another plugin, the same keys load; a section is a mapping.
    let megatron = bundled().with(SectionKind::Engine, "megatron");
    assert!(load_with(&megatron, Some(&file), &[], &[]).is_ok());
    let err = load(None, &[], &["wandb=3"]).unwrap_err();
    assert!(
        matches!(&err, ConfigError::Invalid { key, origin, .. } if key == "wandb" && origin == "command-line override `wandb=3`"),
        "{err}"
    );
}

#[test]
fn tracker_sections_at_top_level_and_under_trainer() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "run.yaml",
        "wandb:\n  entity: me\n  project: top\ntrainer:\n  wandb:\n    dir: /d\n    project: nested\n",
    );
    let c = load(Some(&file), &[], &["trainer.mlflow.tracking_uri=http://h"]).unwrap();
    let from_file = format!("config file {}", file.display());
    let wandb = c.plugin_section(Slot::Tracker, "wandb");
    assert_eq!(wandb.path, "wandb");
    assert_eq!(
        wandb.value,
        json!({"dir": "/d", "entity": "me", "project": "top"})
    );
    assert_eq!(
        wandb.origins,
        [
            ("wandb.dir", format!("{from_file}, as `trainer.wandb.dir`")),
            ("wandb.entity", from_file.clone()),
            ("wandb.project", from_file.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    );
    let mlflow = c.plugin_section(Slot::Tracker, "mlflow");
    assert_eq!(
        (mlflow.path.as_str(), &mlflow.value),
        ("trainer.mlflow", &json!({"tracking_uri": "http://h"}))
    );
    assert_eq!(
        mlflow.origins["trainer.mlflow.tracking_uri"],
        "command-line override `trainer.mlflow.tracking_uri=http://h`"
    );
    let unset = c.plugin_section(Slot::Tracker, "trackio");
    assert_eq!((unset.path.as_str(), unset.value), ("trackio", json!({})));
}

#[test]
fn rollout_and_checkpoint_sections_by_name() {
    let sections = PluginSections::new()
        .with(SectionKind::Rollout, "vllm")
        .with(SectionKind::Checkpoint, "disk");
    let c = load_with(
        &sections,
        None,
        &[(
            "VERL_ACTOR_ROLLOUT_REF__ROLLOUT__ENGINE_KWARGS__VLLM__SWAP_SPACE",
            "4",
        )],
        &["actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.disk={dir: /x}"],
    )
    .unwrap();
    let vllm = c.plugin_section(Slot::Rollout, "vllm");
    assert_eq!(vllm.value, json!({"swap_space": 4}));
    assert_eq!(
        vllm.origins["actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space"],
        "environment variable VERL_ACTOR_ROLLOUT_REF__ROLLOUT__ENGINE_KWARGS__VLLM__SWAP_SPACE"
    );
    let disk = c.plugin_section(Slot::Checkpoint, "disk");
    assert_eq!(
        (disk.path.as_str(), &disk.value),
        (
            "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.disk",
            &json!({"dir": "/x"})
        )
    );
    // A value set as a whole: its keys carry the override that set it.
    assert_eq!(
        disk.origins["actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.disk.dir"],
        "command-line override `actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.disk={dir: /x}`"
    );
    assert_eq!(
        Config::default().actor_rollout_ref.rollout.engine_kwargs,
        json!({})
    );
}

#[test]
fn interpolation_errors_and_env() {
    let err = load(
        None,
        &[],
        &["trainer.default_local_dir=ckpt/${trainer.nope}"],
    )
    .unwrap_err();
    assert!(
        matches!(&err, ConfigError::Interpolation { key, .. } if key == "trainer.default_local_dir"),
        "{err}"
    );
    let c = load(
        None,
        &[("CKPT_ROOT", "/data")],
        &["trainer.default_local_dir=${oc.env:CKPT_ROOT}/${trainer.project_name}"],
    )
    .unwrap();
    assert_eq!(c.trainer.default_local_dir, "/data/verl_examples");
}

#[test]
fn yaml_output_loads_back() {
    let dir = tempfile::tempdir().unwrap();
    let c = load(
        None,
        &[],
        &[
            "trainer.logger=[console,file]",
            "algorithm.adv_estimator=grpo",
            "wandb.entity=me",
            "actor_rollout_ref.rollout.n=5",
        ],
    )
    .unwrap();
    let yaml = c.to_yaml();
    assert!(yaml.contains("adv_estimator: grpo"), "{yaml}");
    let file = write(&dir, "shown.yaml", &yaml);
    assert_eq!(load(Some(&file), &[], &[]).unwrap(), c);
    assert_eq!(c.get("actor_rollout_ref.rollout.n"), Some(json!(5)));
    assert_eq!(c.get("trainer.nope"), None);
}

#[test]
fn algorithm_helpers() {
    let c = load(
        None,
        &[],
        &[
            "algorithm.gamma=0.5",
            "algorithm.norm_adv_by_std_in_grpo=false",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.horizon=0",
        ],
    )
    .unwrap();
    let p = c.algorithm.advantage_params();
    assert_eq!(
        (p.gamma, p.lam, p.norm_adv_by_std_in_grpo, p.epsilon),
        (0.5, 1.0, false, 1e-6)
    );
    assert_eq!(
        c.algorithm.kl_ctrl.controller(),
        Err(verl_algo::AlgoError::Horizon)
    );
    assert_eq!(
        Config::default()
            .algorithm
            .kl_ctrl
            .controller()
            .unwrap()
            .value,
        0.001
    );
}

/// Hydra's `+key=value` (add) and `++key=value` (add or override) set a key like `key=value`:
/// every key verl-core knows exists with its default. In plugin sections too.
#[test]
fn hydra_add_and_force_add() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "run.yaml",
        "trainer:\n  total_epochs: 5\nactor_rollout_ref:\n  actor:\n    fsdp_config:\n      fsdp_size: 2\n",
    );
    let c = load(
        Some(&file),
        &[],
        &[
            "+data.seed=7",
            "++trainer.total_epochs=9",
            "+actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "++actor_rollout_ref.actor.fsdp_config.fsdp_size=4",
            "+trainer.wandb.entity=me",
        ],
    )
    .unwrap();
    assert_eq!((c.data.seed, c.trainer.total_epochs), (Some(7), 9));
    assert_eq!(
        c.origin("trainer.total_epochs"),
        Some("command-line override `++trainer.total_epochs=9`")
    );
    let fsdp = c.plugin_section(Slot::Engine(EngineRole::Actor), "fsdp_config");
    assert_eq!(fsdp.value, json!({"fsdp_size": 4, "param_offload": true}));
    assert_eq!(
        fsdp.origins["actor_rollout_ref.actor.fsdp_config.param_offload"],
        "command-line override `+actor_rollout_ref.actor.fsdp_config.param_offload=true`"
    );
    assert_eq!(
        c.plugin_section(Slot::Tracker, "wandb").value,
        json!({"entity": "me"})
    );
}

/// `~key`: a key of core's schema goes back to its built-in default (an optional one is unset),
/// whatever layer set it; a plugin section or a key inside one is removed. Overrides apply in
/// order, so a later set wins over an earlier deletion and the other way round.
#[test]
fn hydra_delete() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "run.yaml",
        "trainer:\n  total_epochs: 5\n  total_training_steps: 40\n  wandb:\n    entity: me\n    project: p\nactor_rollout_ref:\n  actor:\n    optim: {lr: 0.1, weight_decay: 0.5}\n    fsdp_config:\n      param_offload: true\ndata:\n  apply_chat_template_kwargs: {enable_thinking: false}\n",
    );
    let c = load(
        Some(&file),
        &[],
        &[
            "~trainer.total_epochs",
            "~trainer.total_training_steps",
            "~trainer.wandb.entity",
            "~actor_rollout_ref.actor.fsdp_config",
            "~data.apply_chat_template_kwargs",
        ],
    )
    .unwrap();
    let defaults = Config::default();
    assert_eq!(c.trainer.total_epochs, defaults.trainer.total_epochs);
    assert_eq!(c.trainer.total_training_steps, None);
    assert_eq!(c.data.apply_chat_template_kwargs, json!({}));
    assert_eq!(
        c.plugin_section(Slot::Tracker, "wandb").value,
        json!({"project": "p"})
    );
    let fsdp = c.plugin_section(Slot::Engine(EngineRole::Actor), "fsdp_config");
    assert_eq!((fsdp.value, fsdp.origins.len()), (json!({}), 0));

    // A whole section, then one key set again inside it; and a set undone by a later deletion.
    let c = load(
        Some(&file),
        &[],
        &[
            "~actor_rollout_ref.actor.optim",
            "actor_rollout_ref.actor.optim.weight_decay=0.2",
            "trainer.total_epochs=3",
            "~trainer.total_epochs",
            "~trainer.wandb",
            "+trainer.wandb.dir=/d",
        ],
    )
    .unwrap();
    let optim = &c.actor_rollout_ref.actor.optim;
    assert_eq!(
        (optim.lr, optim.weight_decay),
        (defaults.actor_rollout_ref.actor.optim.lr, 0.2)
    );
    assert_eq!(c.trainer.total_epochs, defaults.trainer.total_epochs);
    assert_eq!(
        c.plugin_section(Slot::Tracker, "wandb").value,
        json!({"dir": "/d"})
    );

    // Unknown keys are the usual error; deleting what is not set says so.
    assert!(matches!(
        load(None, &[], &["~trainer.total_epoch"]),
        Err(ConfigError::UnknownKey { key, origin, .. })
            if key == "trainer.total_epoch" && origin == "command-line override `~trainer.total_epoch`"
    ));
    assert_eq!(
        load(None, &[], &["~trainer.wandb.entity"]),
        Err(ConfigError::Invalid {
            key: "trainer.wandb.entity".into(),
            origin: "command-line override `~trainer.wandb.entity`".into(),
            message: "is not set, so there is nothing to delete".into(),
        })
    );
}

/// `key=null`: unset where the key is optional, the default where it is a free-form section or a
/// plugin slot, null for the plugin where it is inside a plugin section, and an error naming the
/// key where null means nothing — from the command line, the environment or a file alike.
#[test]
fn hydra_null() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "run.yaml",
        "trainer:\n  total_training_steps: 40\ndata:\n  val_batch_size: 8\n  apply_chat_template_kwargs: {a: 1}\n",
    );
    let c = load(
        Some(&file),
        &[("VERL_DATA__VAL_BATCH_SIZE", "null")],
        &[
            "trainer.total_training_steps=null",
            "data.apply_chat_template_kwargs=null",
            "actor_rollout_ref.rollout.engine_kwargs=~",
            "trainer.wandb.entity=null",
            "actor_rollout_ref.ref.strategy=null",
        ],
    )
    .unwrap();
    assert_eq!(c.trainer.total_training_steps, None);
    assert_eq!(c.data.val_batch_size, None);
    assert_eq!(c.data.apply_chat_template_kwargs, json!({}));
    assert_eq!(c.actor_rollout_ref.rollout.engine_kwargs, json!({}));
    assert_eq!(c.actor_rollout_ref.reference.strategy, None);
    assert_eq!(
        c.plugin_section(Slot::Tracker, "wandb").value,
        json!({"entity": null})
    );

    assert_eq!(
        load(None, &[], &["trainer.total_epochs=null"]),
        Err(ConfigError::Invalid {
            key: "trainer.total_epochs".into(),
            origin: "command-line override `trainer.total_epochs=null`".into(),
            message: "cannot be null: it has no unset value (its default is 30)".into(),
        })
    );
    let err = load(None, &[], &["actor_rollout_ref.actor.optim=null"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`actor_rollout_ref.actor.optim`") && err.contains("is a section"),
        "{err}"
    );
    let err = load(None, &[], &["trainer={total_epochs: null}"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`trainer.total_epochs`") && err.contains("cannot be null"),
        "{err}"
    );
    let err = load(None, &[("VERL_DATA__TRAIN_BATCH_SIZE", "~")], &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "`data.train_batch_size` (from environment variable VERL_DATA__TRAIN_BATCH_SIZE)"
        ),
        "{err}"
    );
    let bad = write(&dir, "null.yaml", "trainer:\n  logger:\n");
    let err = load(Some(&bad), &[], &[]).unwrap_err().to_string();
    assert!(
        err.contains("`trainer.logger` (from config file") && err.contains("null.yaml"),
        "{err}"
    );
}

/// Every key of the schema is classified (acted on, error when set, warning when set), and every
/// rule names a key of the schema: a new key cannot be added without saying what it does.
#[test]
fn every_schema_key_is_classified() {
    let defaults = Config::default().to_json();
    let mut unclassified = Vec::new();
    audit::for_each_leaf(&defaults, &mut Vec::new(), &mut |path, _| {
        let key = path.join(".");
        if rule_for(&key).is_none() {
            unclassified.push(key);
        }
    });
    for key in FREE_FORM {
        if rule_for(&format!("{key}.anything")).is_none() {
            unclassified.push(format!("{key}.*"));
        }
    }
    assert!(unclassified.is_empty(), "no rule for {unclassified:?}");
    let in_schema = |key: &str| {
        key.split('.')
            .try_fold(&defaults, |v, k| v.get(k))
            .is_some()
    };
    let stray: Vec<&str> = RULES
        .iter()
        .map(|r| r.key)
        .filter(|k| !in_schema(k) && !FREE_FORM.iter().any(|f| k.starts_with(&format!("{f}."))))
        .collect();
    assert!(
        stray.is_empty(),
        "rules for keys the schema lacks: {stray:?}"
    );
    let mut keys: Vec<&str> = RULES.iter().map(|r| r.key).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), RULES.len(), "a key has two rules");
}

/// What a representative verl override does: acted on, an error, a warning, or an unknown key.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Outcome {
    Acted,
    Error,
    Warning,
    Unknown,
}

fn outcome(args: &[&str], ctx: &AuditContext) -> Outcome {
    let config = match load(None, &[], args) {
        Ok(config) => config,
        Err(ConfigError::UnknownKey { .. }) => return Outcome::Unknown,
        Err(e) => panic!("{args:?}: {e}"),
    };
    let findings = audit(&config, ctx);
    if findings.iter().any(|f| f.severity == Severity::Error) {
        Outcome::Error
    } else if findings.is_empty() {
        Outcome::Acted
    } else {
        Outcome::Warning
    }
}

/// Overrides as verl's launch scripts write them (written for this test, after their style),
/// each alone on the defaults with a GRPO run that uses a reference policy.
#[test]
fn verl_style_overrides_are_acted_on_or_reported() {
    use Outcome::*;
    let base = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=True",
    ];
    let cases = [
        (
            "data.train_files=/home/user/data/gsm8k/train.parquet",
            Acted,
        ),
        ("data.max_response_length=1024", Acted),
        ("data.filter_overlong_prompts=True", Acted),
        ("data.truncation='error'", Acted),
        (
            "+data.apply_chat_template_kwargs.enable_thinking=False",
            Acted,
        ),
        (
            "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
            Acted,
        ),
        ("actor_rollout_ref.model.use_remove_padding=True", Acted),
        (
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            Acted,
        ),
        ("actor_rollout_ref.actor.optim.lr=1e-6", Acted),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            Acted,
        ),
        ("actor_rollout_ref.actor.ppo_micro_batch_size=64", Acted),
        ("actor_rollout_ref.actor.kl_loss_type=low_var_kl", Acted),
        ("actor_rollout_ref.actor.use_dynamic_bsz=False", Acted),
        (
            "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            Acted,
        ),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
            Acted,
        ),
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            Acted,
        ),
        ("actor_rollout_ref.rollout.n=5", Acted),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
            Acted,
        ),
        ("algorithm.use_kl_in_reward=False", Acted),
        ("trainer.logger=['console','wandb']", Acted),
        ("trainer.n_gpus_per_node=1", Acted),
        ("trainer.save_freq=20", Acted),
        ("trainer.nnodes=1", Acted),
        ("trainer.n_gpus_per_node=8", Error),
        ("trainer.nnodes=2", Error),
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            Error,
        ),
        (
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            Error,
        ),
        ("actor_rollout_ref.actor.use_dynamic_bsz=True", Acted),
        ("actor_rollout_ref.model.lora_rank=32", Error),
        (
            "actor_rollout_ref.model.enable_activation_offload=True",
            Error,
        ),
        (
            "+actor_rollout_ref.model.override_config.attention_dropout=0.1",
            Error,
        ),
        ("reward_model.enable=True", Error),
        ("reward_model.reward_manager=dapo", Acted),
        ("reward_model.overlong_buffer.enable=True", Acted),
        ("reward_model.overlong_buffer.len=4096", Acted),
        (
            "reward_model.sandbox_fusion.url=http://127.0.0.1:8080/run_code",
            Acted,
        ),
        ("reward_model.sandbox_fusion.max_concurrent=32", Acted),
        ("reward_model.sandbox_fusion.memory_limit_mb=2048", Acted),
        ("custom_reward_function.path=/srv/libmy_reward.so", Acted),
        ("custom_reward_function.name=my_reward", Acted),
        ("+custom_reward_function.reward_kwargs.timeout_s=5", Acted),
        ("data.gen_batch_size=1536", Acted),
        ("algorithm.filter_groups.metric=seq_final_reward", Acted),
        ("algorithm.adv_estimator=gdpo", Acted),
        ("algorithm.adv_estimator=rloo_vectorized", Acted),
        ("algorithm.adv_estimator=optimal_token_baseline", Acted),
        ("algorithm.adv_estimator=tir_optimal_token_baseline", Acted),
        (
            "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
            Acted,
        ),
        (
            "actor_rollout_ref.actor.sum_pi_squared_checkpointing=True",
            Warning,
        ),
        ("algorithm.gdpo_reward_keys=[format,accuracy]", Acted),
        ("algorithm.gdpo_reward_weights=[1.0,0.5]", Acted),
        ("algorithm.kl_penalty=k2+", Acted),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=dro", Acted),
        ("actor_rollout_ref.actor.policy_loss.dro_beta=0.1", Acted),
        ("actor_rollout_ref.actor.tau_neg=1.5", Acted),
        ("actor_rollout_ref.actor.loss_agg_mode=token-sum", Acted),
        (
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
            Warning,
        ),
        ("actor_rollout_ref.rollout.enforce_eager=True", Warning),
        ("actor_rollout_ref.rollout.enable_sleep_mode=False", Warning),
        ("actor_rollout_ref.rollout.mode=sync", Acted),
        (
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
            Warning,
        ),
        ("actor_rollout_ref.model.use_liger=True", Warning),
        ("actor_rollout_ref.nccl_timeout=1200", Acted),
        ("+ray_kwargs.ray_init.num_cpus=16", Warning),
        ("global_profiler.tool=nsys", Warning),
        ("actor_rollout_ref.actor.profiler.enable=True", Warning),
        ("trainer.balance_batch=False", Acted),
        ("trainer.default_hdfs_dir=hdfs://x", Warning),
        ("critic.optim.lr=3e-5", Warning),
        ("critic.model.fsdp_config.param_offload=True", Warning),
        ("reward_model.model.path=/m", Warning),
        (
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            Unknown,
        ),
        ("actor_rollout_ref.rollout.multi_turn.enable=True", Unknown),
        ("+reward_model.reward_kwargs.max_resp_len=4096", Unknown),
    ];
    let ctx = AuditContext::default();
    for (arg, expected) in cases {
        let args: Vec<&str> = base.iter().copied().chain([arg]).collect();
        assert_eq!(outcome(&args, &ctx), expected, "{arg}");
    }
    // verl reads a pass's row count or its token budget, never both: the other is reported.
    for (args, expected) in [
        (
            &[
                "actor_rollout_ref.actor.use_dynamic_bsz=True",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
            ][..],
            Acted,
        ),
        (
            &[
                "actor_rollout_ref.actor.use_dynamic_bsz=True",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            ][..],
            Warning,
        ),
        // The old log-probs batch by rows and fall back to the PPO micro-batch size.
        (
            &[
                "actor_rollout_ref.actor.use_dynamic_bsz=True",
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False",
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=False",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            ][..],
            Acted,
        ),
        // A log-prob budget whose switch is off (the actor's default) is not read.
        (
            &[
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192",
            ][..],
            Warning,
        ),
        (
            &[
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192",
            ][..],
            Acted,
        ),
    ] {
        let args: Vec<&str> = base.iter().chain(args).copied().collect();
        assert_eq!(outcome(&args, &ctx), expected, "{args:?}");
    }
    let config = load(
        None,
        &[],
        &[
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        ],
    )
    .unwrap();
    let findings = audit(&config, &ctx);
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert_eq!(
        findings[0].to_string(),
        "config key `actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`=16 (from command-line \
         override `actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16`) has no effect: \
         actor_rollout_ref.actor.use_dynamic_bsz is true: micro-batches are cut by a token budget"
    );
    // The critic's own keys are acted on when a critic is trained, and its offload is an error.
    for (arg, expected) in [
        ("critic.optim.lr=3e-5", Acted),
        ("critic.model.fsdp_config.param_offload=True", Error),
        ("critic.use_dynamic_bsz=True", Acted),
        ("critic.forward_max_token_len_per_gpu=4096", Warning),
    ] {
        assert_eq!(
            outcome(&["algorithm.adv_estimator=gae", arg], &ctx),
            expected,
            "{arg}"
        );
    }
}

/// A finding names the key, its value and where it came from; `trainer.strict_config=false` turns
/// the errors into warnings; a key a component declares it acts on is not reported; a component's
/// notes on its own section are.
#[test]
fn findings_name_key_value_origin_and_follow_components() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "run.yaml",
        "actor_rollout_ref:\n  rollout:\n    tensor_model_parallel_size: 2\n    gpu_memory_utilization: 0.6\n",
    );
    let args = [
        "actor_rollout_ref.model.lora_rank=32",
        "+actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0",
    ];
    let config = load(Some(&file), &[], &args).unwrap();
    let findings = audit(&config, &AuditContext::default());
    let shown: Vec<String> = findings.iter().map(ToString::to_string).collect();
    assert_eq!(
        shown[0],
        "config key `actor_rollout_ref.model.lora_rank`=32 (from command-line override \
         `actor_rollout_ref.model.lora_rank=32`) is not supported yet: LoRA adapters are not \
         implemented: every parameter is trained (trainer.strict_config=false runs without it)"
    );
    let summary: Vec<(&str, &str, Severity)> = findings
        .iter()
        .map(|f| (f.key.as_str(), f.origin.as_str(), f.severity))
        .collect();
    let from_file = format!("config file {}", file.display());
    assert_eq!(
        summary,
        [
            (
                "actor_rollout_ref.model.lora_rank",
                "command-line override `actor_rollout_ref.model.lora_rank=32`",
                Severity::Error
            ),
            (
                "actor_rollout_ref.rollout.gpu_memory_utilization",
                from_file.as_str(),
                Severity::Warning
            ),
            (
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                from_file.as_str(),
                Severity::Error
            ),
        ]
    );

    // Not strict: the same keys, all warnings, saying they are ignored.
    let lenient = load(
        Some(&file),
        &[],
        &[&args[..], &["trainer.strict_config=false"]].concat(),
    )
    .unwrap();
    let findings = audit(&lenient, &AuditContext::default());
    assert_eq!(findings.len(), 3);
    assert!(findings.iter().all(|f| f.severity == Severity::Warning));
    assert!(
        findings[0]
            .to_string()
            .contains("is not supported yet and is ignored"),
        "{}",
        findings[0]
    );

    // A rollout that acts on the server keys, and an engine that declares its section's offload.
    let ctx = AuditContext {
        world_size: Some(1),
        scope: AuditScope::Training,
        components: vec![
            (
                "actor_rollout_ref.rollout".into(),
                verl_plugin_api::ConfigKeys::default()
                    .acts_on(["tensor_model_parallel_size", "gpu_memory_utilization"]),
            ),
            (
                "actor_rollout_ref.actor".into(),
                verl_plugin_api::ConfigKeys::default()
                    .unsupported("fsdp_config.param_offload", false, "no offload")
                    .unsupported("fsdp_config.mixed_precision", Value::Null, "one dtype")
                    .no_effect(
                        "fsdp_config.wrap_policy",
                        json!({"min_num_params": 0}),
                        "one rank",
                    )
                    .no_effect("fsdp_config.fsdp_size", -1, "one rank"),
            ),
        ],
    };
    let findings = audit(&config, &ctx);
    let summary: Vec<(&str, &str, Severity)> = findings
        .iter()
        .map(|f| (f.key.as_str(), f.origin.as_str(), f.severity))
        .collect();
    assert_eq!(
        summary,
        [
            // A key inside a declared section is reported on its own, with its origin.
            (
                "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
                "command-line override `+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16`",
                Severity::Error
            ),
            (
                "actor_rollout_ref.actor.fsdp_config.param_offload",
                "command-line override `+actor_rollout_ref.actor.fsdp_config.param_offload=true`",
                Severity::Error
            ),
            (
                "actor_rollout_ref.model.lora_rank",
                "command-line override `actor_rollout_ref.model.lora_rank=32`",
                Severity::Error
            ),
        ]
    );
    assert_eq!(
        (findings[0].why.as_str(), findings[1].why.as_str()),
        ("one dtype", "no offload")
    );

    // The world size: 2 × 4 on 8 ranks is acted on; 8 GPUs on one process is not.
    let c = load(
        None,
        &[],
        &["trainer.nnodes=2", "trainer.n_gpus_per_node=4"],
    )
    .unwrap();
    let eight = AuditContext {
        world_size: Some(8),
        ..AuditContext::default()
    };
    assert_eq!(audit(&c, &eight), []);
    let findings = audit(&c, &AuditContext::default());
    assert_eq!(findings.len(), 1);
    assert_eq!(
        (findings[0].key.as_str(), findings[0].severity),
        ("trainer.n_gpus_per_node", Severity::Error)
    );
    assert!(
        findings[0]
            .why
            .contains("2 × 4 must equal the world size, 1"),
        "{}",
        findings[0]
    );
}

/// `trainer.deterministic` reaches every engine and rollout section; a component that does not
/// honour it (a vLLM rollout, the megatron engine) declares so in its section's notes and the
/// audit warns on `trainer.deterministic` with that component's reason; components that act on it
/// declare nothing and nothing is reported.
#[test]
fn the_deterministic_mode_is_reported_by_the_components_that_cannot_honour_it() {
    let config = load(None, &[], &["trainer.deterministic=true"]).unwrap();
    assert_eq!(
        config.engine_json(EngineRole::Actor)["deterministic"],
        json!(true)
    );
    assert_eq!(
        config.engine_json(EngineRole::Ref)["deterministic"],
        json!(true)
    );
    assert_eq!(config.rollout_json()["deterministic"], json!(true));
    assert_eq!(
        Config::default().rollout_json()["deterministic"],
        json!(false)
    );
    let ctx = |rollout: verl_plugin_api::ConfigKeys| AuditContext {
        components: vec![
            ("actor_rollout_ref.rollout".into(), rollout),
            (
                "actor_rollout_ref.actor".into(),
                verl_plugin_api::ConfigKeys::default(),
            ),
        ],
        ..AuditContext::default()
    };
    assert_eq!(audit(&config, &ctx(Default::default())), []);
    let server = verl_plugin_api::ConfigKeys::default().no_effect(
        "deterministic",
        false,
        "the server's kernels are its own",
    );
    let findings = audit(&config, &ctx(server.clone()));
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert_eq!(
        (findings[0].key.as_str(), findings[0].severity),
        ("trainer.deterministic", Severity::Warning)
    );
    assert!(
        findings[0]
            .to_string()
            .contains("the server's kernels are its own")
    );
    // Off (the default), nothing is reported.
    assert_eq!(audit(&Config::default(), &ctx(server)), []);
}

/// `score` and `generate` take `run`'s overrides but read only part of the config: every other
/// key set is reported as without effect there (with the flag that replaces it, where one does),
/// and the reference's section counts for `score` even when training would use no reference.
#[test]
fn one_off_commands_report_what_they_do_not_read() {
    use Outcome::*;
    let scoped = |scope: AuditScope| AuditContext {
        world_size: None,
        components: Vec::new(),
        scope,
    };
    let score = scoped(crate::score_scope());
    for (arg, want) in [
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            Acted,
        ),
        ("actor_rollout_ref.actor.strategy=megatron", Acted),
        (
            "actor_rollout_ref.ref.fsdp_config.forward_prefetch=True",
            Acted,
        ),
        ("actor_rollout_ref.model.use_remove_padding=True", Acted),
        ("trainer.device=cpu", Acted),
        ("trainer.deterministic=true", Acted),
        ("actor_rollout_ref.actor.optim.lr=1e-5", Warning),
        // The actor's plugin sections are not the reference's.
        (
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            Warning,
        ),
        ("actor_rollout_ref.rollout.n=8", Warning),
        ("trainer.n_gpus_per_node=8", Warning),
        ("actor_rollout_ref.model.path=/models/q", Warning),
        // Still an error where the key is read and nothing here does it.
        ("actor_rollout_ref.model.lora_rank=32", Error),
    ] {
        assert_eq!(outcome(&[arg], &score), want, "score: {arg}");
    }
    let config = load(None, &[], &["actor_rollout_ref.model.path=/models/q"]).unwrap();
    let findings = audit(&config, &score);
    assert!(
        findings[0].to_string().contains("--model"),
        "{}",
        findings[0]
    );
    let config = load(None, &[], &["data.train_batch_size=64"]).unwrap();
    let findings = audit(&config, &score);
    assert!(
        findings[0]
            .to_string()
            .contains("`verl-core score` reads only"),
        "{}",
        findings[0]
    );

    let generate = scoped(crate::generate_scope());
    for (arg, want) in [
        ("actor_rollout_ref.rollout.response_length=64", Acted),
        ("actor_rollout_ref.rollout.free_cache_engine=False", Acted),
        ("trainer.deterministic=true", Acted),
        ("actor_rollout_ref.rollout.temperature=0.6", Warning),
        ("trainer.seed=7", Warning),
        ("actor_rollout_ref.actor.strategy=megatron", Warning),
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            Error,
        ),
    ] {
        assert_eq!(outcome(&[arg], &generate), want, "generate: {arg}");
    }
}

/// `actor.use_prefix_grouper`: acted on by an engine that declares so (`fsdp`); `true` warns
/// under one that does not (it changes speed, not results), `false` is fine everywhere.
#[test]
fn the_prefix_grouper_needs_an_engine_that_shares_prompts() {
    let fsdp = AuditContext {
        components: vec![(
            "actor_rollout_ref.actor".into(),
            verl_plugin_api::ConfigKeys::default().acts_on(["use_prefix_grouper"]),
        )],
        ..AuditContext::default()
    };
    let other = AuditContext::default();
    for (value, ctx, want) in [
        ("True", &fsdp, Outcome::Acted),
        ("False", &fsdp, Outcome::Acted),
        ("True", &other, Outcome::Warning),
        ("False", &other, Outcome::Acted),
    ] {
        let arg = format!("actor_rollout_ref.actor.use_prefix_grouper={value}");
        assert_eq!(outcome(&[&arg], ctx), want, "{arg}");
    }
    let config = load(
        None,
        &[],
        &["actor_rollout_ref.actor.use_prefix_grouper=True"],
    )
    .unwrap();
    let finding = audit(&config, &other).remove(0);
    assert!(finding.to_string().contains("`fsdp`"), "{finding}");
    // The engine gets it in its section; unset, it is null (the engine's default).
    assert_eq!(
        config.engine_json(EngineRole::Actor)["use_prefix_grouper"],
        serde_json::json!(true)
    );
    let config = load(None, &[], &[]).unwrap();
    assert!(config.engine_json(EngineRole::Actor)["use_prefix_grouper"].is_null());
}

/// verl's router-replay keys: the mode is refused unless the engine declares it acts on it, the
/// rollout's recording unless the rollout does (the `vllm` and `sglang` adapters do not, and the
/// message names them); verl's unread `record_file` only warns; a mode verl does not know is a
/// syntax error naming it.
#[test]
fn router_replay_keys_need_components_that_act_on_them() {
    let config = load(
        None,
        &[],
        &[
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "actor_rollout_ref.actor.router_replay.record_file=/tmp/r",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        ],
    )
    .unwrap();
    let findings = audit(&config, &AuditContext::default());
    let summary: Vec<(&str, Severity)> = findings
        .iter()
        .map(|f| (f.key.as_str(), f.severity))
        .collect();
    assert_eq!(
        summary,
        [
            (
                "actor_rollout_ref.actor.router_replay.mode",
                Severity::Error
            ),
            (
                "actor_rollout_ref.actor.router_replay.record_file",
                Severity::Warning
            ),
            (
                "actor_rollout_ref.rollout.enable_rollout_routing_replay",
                Severity::Error
            ),
        ]
    );
    assert!(
        findings[2].to_string().contains("`vllm`"),
        "{}",
        findings[2]
    );
    let ctx = AuditContext {
        components: vec![
            (
                "actor_rollout_ref.actor".into(),
                verl_plugin_api::ConfigKeys::default().acts_on(["router_replay.mode"]),
            ),
            (
                "actor_rollout_ref.rollout".into(),
                verl_plugin_api::ConfigKeys::default().acts_on(["enable_rollout_routing_replay"]),
            ),
        ],
        ..AuditContext::default()
    };
    let keys: Vec<String> = audit(&config, &ctx).into_iter().map(|f| f.key).collect();
    assert_eq!(keys, ["actor_rollout_ref.actor.router_replay.record_file"]);

    let err = load(
        None,
        &[],
        &["actor_rollout_ref.actor.router_replay.mode=R4"],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("R4") && err.contains("router_replay"), "{err}");
}
