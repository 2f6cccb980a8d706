//! Fixtures shared by the integration tests (see `fixtures/make_fixtures.py`).
#![allow(dead_code)] // each test binary uses a different part

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tch::{Kind, Tensor};
use verl_torch_runtime::{CausalLM, ModelOptions};

pub const MODELS: [&str; 2] = ["tiny-llama", "tiny-qwen2"];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

pub fn load(name: &str) -> CausalLM {
    CausalLM::from_pretrained(&fixture(name), &ModelOptions::default()).unwrap()
}

#[derive(Deserialize)]
pub struct Expected {
    pub temperature: f64,
    pub max_new_tokens: usize,
    pub eos_token_ids: Vec<i64>,
    pub prompts: Vec<Prompt>,
    pub sequences: Vec<Sequence>,
    pub greedy: Vec<Greedy>,
}

#[derive(Deserialize)]
pub struct Prompt {
    pub text: String,
    pub ids: Vec<i64>,
}

#[derive(Deserialize)]
pub struct Sequence {
    pub ids: Vec<i64>,
    pub logprobs: Vec<f64>,
    pub entropy: Vec<f64>,
    pub logprobs_temperature: Vec<f64>,
}

#[derive(Deserialize)]
pub struct Greedy {
    pub prompt_ids: Vec<i64>,
    pub response_ids: Vec<i64>,
    pub logprobs: Vec<f64>,
}

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

pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}
