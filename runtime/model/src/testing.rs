//! The committed fixtures (`fixtures/`: tiny checkpoints and what transformers computed for them,
//! see `fixtures/make_fixtures.py`) and helpers to load and batch them, for the tests of this
//! crate and of the crates that run its models.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tch::{Kind, Tensor};

use crate::{CausalLM, ModelOptions};

/// The dense fixtures with transformers' reference outputs.
pub const MODELS: [&str; 2] = ["tiny-llama", "tiny-qwen2"];

/// The directory of the fixture `name` (`tiny-llama`, …).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// The fixture `name` loaded in fp32 on the CPU.
pub fn load(name: &str) -> CausalLM {
    CausalLM::from_pretrained(&fixture(name), &ModelOptions::default()).unwrap()
}

/// A fixture's `expected.json`: what transformers computed for it.
#[derive(Deserialize)]
pub struct Expected {
    pub temperature: f64,
    pub max_new_tokens: usize,
    pub eos_token_ids: Vec<i64>,
    pub prompts: Vec<Prompt>,
    pub sequences: Vec<Sequence>,
    pub greedy: Vec<Greedy>,
}

/// A prompt and its token ids.
#[derive(Deserialize)]
pub struct Prompt {
    pub text: String,
    pub ids: Vec<i64>,
}

/// A reference sequence with its per-token log-probs and entropy (at temperature 1 and at
/// [`Expected::temperature`]).
#[derive(Deserialize)]
pub struct Sequence {
    pub ids: Vec<i64>,
    pub logprobs: Vec<f64>,
    pub entropy: Vec<f64>,
    pub logprobs_temperature: Vec<f64>,
}

/// A greedy continuation of a prompt.
#[derive(Deserialize)]
pub struct Greedy {
    pub prompt_ids: Vec<i64>,
    pub response_ids: Vec<i64>,
    pub logprobs: Vec<f64>,
}

/// The fixture `name`'s `expected.json`.
pub fn expected(name: &str) -> Expected {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The token ids of the fixture's reference sequences.
pub fn sequence_ids(name: &str) -> Vec<Vec<i64>> {
    expected(name)
        .sequences
        .into_iter()
        .map(|s| s.ids)
        .collect()
}

/// Which side of a row [`batch`] pads.
pub enum Padding {
    Left,
    Right,
}

/// `(input_ids, attention_mask)` of sequences padded to one width with id 0.
pub fn batch(seqs: &[Vec<i64>], padding: Padding) -> (Tensor, Tensor) {
    let width = seqs.iter().map(Vec::len).max().unwrap();
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for s in seqs {
        let pad = width - s.len();
        let (ids_row, mask_row): (Vec<i64>, Vec<i64>) = match padding {
            Padding::Left => (
                vec![0; pad].into_iter().chain(s.iter().copied()).collect(),
                [vec![0; pad], vec![1; s.len()]].concat(),
            ),
            Padding::Right => (
                s.iter().copied().chain(vec![0; pad]).collect(),
                [vec![1; s.len()], vec![0; pad]].concat(),
            ),
        };
        ids.extend(ids_row);
        mask.extend(mask_row);
    }
    let shape = [seqs.len() as i64, width as i64];
    (
        Tensor::from_slice(&ids).view(shape),
        Tensor::from_slice(&mask).view(shape),
    )
}

/// Row `row` of a 2-D tensor as f64.
pub fn row(t: &Tensor, row: i64) -> Vec<f64> {
    Vec::<f64>::try_from(&t.get(row).to_kind(Kind::Double)).unwrap()
}

/// The largest `|a - b|` of two equally long lists.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}
