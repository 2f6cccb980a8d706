//! Loading and saving model directories: round trips (single file, shards, exported HF dir,
//! value head) and bad input naming the file and the tensor.

use std::path::Path;

use tch::Tensor;
use verl_model::testing::{MODELS, Padding, batch, fixture, load, sequence_ids};
use verl_model::{
    CausalLM, Head, INDEX_FILE, ModelError, ModelOptions, SINGLE_FILE, ScoreOutputs,
    read_safetensors, write_safetensors,
};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

fn logits(model: &CausalLM, name: &str) -> Tensor {
    let seqs = sequence_ids(name);
    let (ids, mask) = batch(&seqs, Padding::Left);
    model.forward(&ids, &mask).unwrap()
}

fn load_err(dir: &Path) -> String {
    let err = CausalLM::from_pretrained(dir, &ModelOptions::default()).unwrap_err();
    err.to_string()
}

#[test]
fn exported_dir_reloads_to_identical_logits() {
    for name in MODELS {
        let model = load(name);
        let out = tempfile::tempdir().unwrap();
        model
            .save_pretrained(out.path(), Some(&fixture(name)))
            .unwrap();
        for file in [
            "config.json",
            SINGLE_FILE,
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            assert!(out.path().join(file).exists(), "{name}: {file} missing");
        }
        let reloaded = CausalLM::from_pretrained(out.path(), &ModelOptions::default()).unwrap();
        assert_eq!(reloaded.config(), model.config());
        assert!(
            logits(&reloaded, name).equal(&logits(&model, name)),
            "{name}"
        );
        // A tied model is saved without lm_head.weight, as transformers saves it.
        let names: Vec<String> = read_safetensors(&out.path().join(SINGLE_FILE))
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            names.contains(&"lm_head.weight".to_owned()),
            !model.config().tie_word_embeddings
        );
    }
}

#[test]
fn sharded_checkpoint_loads() {
    let name = "tiny-llama";
    let model = load(name);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture(name).join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let tensors = model.named_tensors();
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        write_safetensors(&dir.path().join(file), part).unwrap();
        for (tensor, _) in part {
            weight_map.insert(tensor.clone(), file.into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
    let sharded = CausalLM::from_pretrained(dir.path(), &ModelOptions::default()).unwrap();
    assert!(logits(&sharded, name).equal(&logits(&model, name)));

    // A tensor listed in the index but absent from its shard: the shard and tensor are named.
    let (victim, _) = &second[0];
    write_safetensors(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &second[1..],
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("model-00002-of-00002.safetensors") && err.contains(victim.as_str()),
        "{err}"
    );
    // A tensor the index does not list: the index and tensor are named.
    weight_map.remove(victim);
    let index = serde_json::json!({ "weight_map": weight_map });
    std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains(INDEX_FILE) && err.contains(victim.as_str()),
        "{err}"
    );
}

#[test]
fn value_head_initialises_then_round_trips() {
    let name = "tiny-qwen2";
    let options = ModelOptions {
        head: Head::Value,
        seed: 3,
        ..Default::default()
    };
    let critic = CausalLM::from_pretrained(&fixture(name), &options).unwrap();
    let again = CausalLM::from_pretrained(&fixture(name), &options).unwrap();
    let seqs = sequence_ids(name);
    let (ids, mask) = batch(&seqs, Padding::Right);
    let values = critic.values(&ids, &mask).unwrap();
    assert_eq!(values.size(), ids.size());
    assert!(
        values.equal(&again.values(&ids, &mask).unwrap()),
        "the seed fixes the fresh value head"
    );
    assert!(
        critic.forward(&ids, &mask).is_err(),
        "a critic has no LM head"
    );

    let out = tempfile::tempdir().unwrap();
    critic.save_pretrained(out.path(), None).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["architectures"][0], "Qwen2ForTokenClassification");
    let reloaded = CausalLM::from_pretrained(
        out.path(),
        &ModelOptions {
            head: Head::Value,
            seed: 99,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(
        reloaded.values(&ids, &mask).unwrap().equal(&values),
        "score.* is read back, not re-initialised"
    );
}

#[test]
fn random_init_is_seeded() {
    let config = load("tiny-llama").config().clone();
    let make = |seed| {
        CausalLM::random(
            config.clone(),
            &ModelOptions {
                seed,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let (a, b, c) = (make(1), make(1), make(2));
    let name = "model.layers.1.mlp.up_proj.weight";
    let get = |m: &CausalLM| {
        m.named_tensors()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
    };
    assert!(get(&a).equal(&get(&b)) && !get(&a).equal(&get(&c)));
    let std = f64::try_from(get(&a).std(true)).unwrap();
    assert!((std - config.initializer_range).abs() < 0.01, "{std}");
}

#[test]
fn weight_sync_from_named_tensors() {
    let source = load("tiny-qwen2");
    let target = CausalLM::random(source.config().clone(), &ModelOptions::default()).unwrap();
    target.load_named_tensors(&source.named_tensors()).unwrap();
    assert!(logits(&target, "tiny-qwen2").equal(&logits(&source, "tiny-qwen2")));
    let bad = vec![(
        "model.norm.weight".to_owned(),
        Tensor::ones([3], (tch::Kind::Float, tch::Device::Cpu)),
    )];
    let err = target.load_named_tensors(&bad).unwrap_err().to_string();
    assert!(
        err.contains("model.norm.weight") && err.contains("[3]"),
        "{err}"
    );
    let unknown = vec![(
        "model.nope".to_owned(),
        Tensor::ones([3], (tch::Kind::Float, tch::Device::Cpu)),
    )];
    assert!(
        target
            .load_named_tensors(&unknown)
            .unwrap_err()
            .to_string()
            .contains("model.nope")
    );
}

#[test]
fn bad_checkpoints_name_the_file_and_the_tensor() {
    let source = fixture("tiny-llama");
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&source, dir.path());
    let weights = dir.path().join(SINGLE_FILE);
    let tensors = read_safetensors(&weights).unwrap();

    // Missing tensor.
    let kept: Vec<_> = tensors
        .iter()
        .filter(|(n, _)| n != "model.layers.1.self_attn.k_proj.weight")
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    write_safetensors(&weights, &kept).unwrap();
    let err = CausalLM::from_pretrained(dir.path(), &ModelOptions::default()).unwrap_err();
    assert!(matches!(err, ModelError::MissingTensor { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains(&weights.display().to_string())
            && err.contains("model.layers.1.self_attn.k_proj.weight"),
        "{err}"
    );

    // Shape mismatch between the config and the weights.
    write_safetensors(&weights, &tensors).unwrap();
    let config_path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["intermediate_size"] = serde_json::json!(80);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains(SINGLE_FILE)
            && err.contains("model.layers.0.mlp.down_proj.weight")
            && err.contains("[64, 96]"),
        "{err}"
    );

    // Unknown architecture.
    config["intermediate_size"] = serde_json::json!(96);
    config["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("config.json") && err.contains("GPT2LMHeadModel"),
        "{err}"
    );
    std::fs::copy(source.join("config.json"), &config_path).unwrap();

    // Corrupt (truncated) weights.
    let bytes = std::fs::read(source.join(SINGLE_FILE)).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains(SINGLE_FILE) && err.contains("corrupt"),
        "{err}"
    );
    std::fs::write(&weights, b"not a safetensors file").unwrap();
    assert!(load_err(dir.path()).contains("corrupt"));

    // No weights at all.
    std::fs::remove_file(&weights).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains(SINGLE_FILE) && err.contains(INDEX_FILE),
        "{err}"
    );
}

#[test]
fn bf16_parameters_give_close_fp32_log_probs() {
    let name = "tiny-llama";
    let fp32 = load(name);
    let options = ModelOptions {
        kind: tch::Kind::BFloat16,
        ..Default::default()
    };
    let mut bf16 = CausalLM::from_pretrained(&fixture(name), &options).unwrap();
    bf16.set_trainable(false);
    assert!(
        bf16.named_tensors()
            .iter()
            .all(|(_, t)| t.kind() == tch::Kind::BFloat16 && !t.requires_grad())
    );
    let seqs = sequence_ids(name);
    let (ids, mask) = batch(&seqs, Padding::Left);
    let a = fp32
        .response_scores(&ids, &mask, 5, 1.0, ScoreOutputs::NONE)
        .unwrap()
        .log_probs;
    let b = bf16
        .response_scores(&ids, &mask, 5, 1.0, ScoreOutputs::NONE)
        .unwrap()
        .log_probs;
    assert_eq!(b.kind(), tch::Kind::Float);
    let diff = f64::try_from((a - b).abs().max()).unwrap();
    assert!(diff < 0.1, "{diff}");
}
