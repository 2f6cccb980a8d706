//! `cargo bench -p verl-model --bench deterministic`
//!
//! The throughput cost of the deterministic mode ([`CausalLM::set_batch_invariant`], verl's
//! `trainer.deterministic`), both modes in the same run on the same random weights: Llama, hidden
//! 256, intermediate 768, 4 layers, 4 heads, vocab 8192, fp32, on the threads libtorch is given
//! (`VERL_BENCH_THREADS`, default 2).
//! - engine log-probs: the no-grad forward and response log-probs of 8 sequences × (64 prompt + 64
//!   response tokens), what the fsdp engine's `compute_log_prob` runs;
//! - generation: 8 prompts of 64 tokens, 64 new tokens each, greedy, what the native rollout runs.
//!
//! Repetitions of the two modes alternate, so load from other processes hits both alike; the
//! figures are medians, and the load average is printed beside them.

use std::time::Instant;

use tch::Tensor;
use verl_model::{
    Architecture, CausalLM, ModelConfig, ModelOptions, Rng, SamplingParams, ScoreOutputs,
};

const BATCH: i64 = 8;
const PROMPT: i64 = 64;
const RESPONSE: i64 = 64;
const VOCAB: i64 = 8192;
const REPS: usize = 3;

fn config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: VOCAB,
        hidden_size: 256,
        intermediate_size: 768,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        head_dim: 64,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        initializer_range: 0.02,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        qk_norm: false,
        moe: None,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds `f` takes.
fn time(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn main() {
    let threads = std::env::var("VERL_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    tch::set_num_threads(threads);
    let model = CausalLM::random(config(), &ModelOptions::default()).expect("a model");
    let mut rng = Rng::new(0);
    let mut ids = |n: i64| -> Vec<i64> {
        (0..n)
            .map(|_| (rng.next_u64() % VOCAB as u64) as i64)
            .collect()
    };
    let seqs =
        Tensor::from_slice(&ids(BATCH * (PROMPT + RESPONSE))).view([BATCH, PROMPT + RESPONSE]);
    let mask = seqs.ones_like();
    let prompts: Vec<Vec<i64>> = (0..BATCH).map(|_| ids(PROMPT)).collect();
    let params = SamplingParams {
        max_new_tokens: RESPONSE as usize,
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let score = |model: &CausalLM| {
        tch::no_grad(|| {
            model
                .response_scores(&seqs, &mask, RESPONSE, 1.0, ScoreOutputs::NONE)
                .expect("scores")
        });
    };
    let generate = |model: &CausalLM| {
        model.generate(&prompts, &params, &[]).expect("completions");
    };
    // Warm-up of both modes (decode weights, allocator).
    for on in [false, true] {
        model.set_batch_invariant(on);
        score(&model);
        generate(&model);
    }
    let (mut score_s, mut generate_s) = ([vec![], vec![]], [vec![], vec![]]);
    for _ in 0..REPS {
        for (i, on) in [false, true].into_iter().enumerate() {
            model.set_batch_invariant(on);
            score_s[i].push(time(|| score(&model)));
            generate_s[i].push(time(|| generate(&model)));
            eprintln!(
                "mode {}: log-probs {:.3} s, generation {:.3} s",
                if on { "on" } else { "off" },
                score_s[i].last().expect("timed"),
                generate_s[i].last().expect("timed")
            );
        }
    }
    let tokens = (BATCH * (PROMPT + RESPONSE)) as f64;
    let new_tokens = (BATCH * RESPONSE) as f64;
    println!(
        "deterministic mode cost: {threads} threads, load average {} (medians of {REPS})",
        load_average()
    );
    for (what, times, count, unit) in [
        ("engine log-probs", &score_s, tokens, "tokens/s"),
        ("native generation", &generate_s, new_tokens, "new tokens/s"),
    ] {
        let (off, on) = (median(times[0].clone()), median(times[1].clone()));
        println!(
            "{what:18} off {:9.0} {unit} ({:.1} ms) | on {:9.0} {unit} ({:.1} ms) | on/off throughput {:.2}",
            count / off,
            off * 1e3,
            count / on,
            on * 1e3,
            off / on
        );
    }
}
