//! `verl-core generate` and `score` through the loaded native rollout and fsdp engine plugins,
//! checked against HF transformers' outputs recorded in runtime/model/fixtures (see make_fixtures.py).

use serde_json::Value;

use crate::helpers::*;

fn compute_plugins() -> tempfile::TempDir {
    bundled_plugins(&["verl_plugin_native", "verl_plugin_fsdp"])
}

fn expected(model: &str) -> Value {
    let path = workspace_root()
        .join("runtime/model/fixtures")
        .join(model)
        .join("expected.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn ids(value: &Value) -> Vec<u64> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

fn floats(value: &Value) -> Vec<f64> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

#[test]
fn greedy_generation_matches_transformers() {
    let plugins = compute_plugins();
    for model in ["tiny-llama", "tiny-qwen2"] {
        let reference = expected(model);
        let model_dir = workspace_root().join("runtime/model/fixtures").join(model);
        for case in reference["greedy"].as_array().unwrap() {
            let prompt: Vec<String> = ids(&case["prompt_ids"])
                .iter()
                .map(u64::to_string)
                .collect();
            let out = verl_core(
                &[
                    "generate",
                    "--json",
                    "--plugin-dir",
                    plugins.path().to_str().unwrap(),
                    "--model",
                    model_dir.to_str().unwrap(),
                    "--prompt-ids",
                    &prompt.join(","),
                    "--max-new-tokens",
                    &reference["max_new_tokens"].to_string(),
                ],
                &[],
            );
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let result = &stdout_json(&out)["results"][0];
            assert_eq!(
                ids(&result["response_ids"]),
                ids(&case["response_ids"]),
                "{model}: greedy continuation differs"
            );
            for (ours, theirs) in floats(&result["logprobs"])
                .iter()
                .zip(floats(&case["logprobs"]))
            {
                assert!(
                    (ours - theirs).abs() < 1e-5,
                    "{model}: logprob {ours} vs transformers {theirs}"
                );
            }
        }
    }
}

#[test]
fn scoring_matches_transformers_log_probs() {
    let plugins = compute_plugins();
    let reference = expected("tiny-llama");
    let input = tempfile::NamedTempFile::new().unwrap();
    let lines: Vec<String> = reference["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            serde_json::json!({"prompt_ids": c["prompt_ids"], "response_ids": c["response_ids"]})
                .to_string()
        })
        .collect();
    std::fs::write(input.path(), lines.join("\n")).unwrap();
    let model_dir = workspace_root().join("runtime/model/fixtures/tiny-llama");
    let out = verl_core(
        &[
            "score",
            "--json",
            "--plugin-dir",
            plugins.path().to_str().unwrap(),
            "--model",
            model_dir.to_str().unwrap(),
            "--input",
            input.path().to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results = stdout_json(&out)["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), lines.len());
    for (result, case) in results.iter().zip(reference["greedy"].as_array().unwrap()) {
        let (ours, theirs) = (floats(&result["logprobs"]), floats(&case["logprobs"]));
        assert_eq!(ours.len(), theirs.len());
        for (a, b) in ours.iter().zip(&theirs) {
            assert!((a - b).abs() < 1e-5, "logprob {a} vs transformers {b}");
        }
    }
    // A malformed line names the file and line.
    std::fs::write(input.path(), "{\"prompt_ids\": [1]}\n").unwrap();
    let out = verl_core(
        &[
            "score",
            "--plugin-dir",
            plugins.path().to_str().unwrap(),
            "--model",
            model_dir.to_str().unwrap(),
            "--input",
            input.path().to_str().unwrap(),
        ],
        &[],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{}:1", input.path().display()))
            && stderr.contains("response_ids"),
        "{stderr}"
    );
}
