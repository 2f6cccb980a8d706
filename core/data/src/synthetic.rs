//! The built-in synthetic task for `verl-core data gen` and the quickstart: multi-digit addition
//! (`12+34=` → `#### 46`). Its alphabet is tiny (digits, `+`, `=`, space, `#`) and its prompts
//! short, so a small model learns it in minutes; [`write_tokenizer`] writes the matching
//! character-level tokenizer.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::loader::SplitMix64;
use super::{DataError, Message, RewardSpec, Sample, write_parquet};

/// The `data_source` of the task's rows (the reward dispatcher scores it GSM8K-style).
pub const DATA_SOURCE: &str = "verl-core/addition";

/// Special tokens of the character tokenizer, in id order.
pub const SPECIAL_TOKENS: [&str; 4] = ["<pad>", "<s>", "</s>", "<unk>"];
/// The task's characters, after the special tokens.
pub const ALPHABET: &str = "0123456789+= #";

/// The most problems one task makes (train and validation together): about 2 GB while generating.
const MAX_PROBLEMS: usize = 10_000_000;

/// Difficulty and size knobs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdditionTask {
    /// Each operand has between `min_digits` and `max_digits` digits (uniformly), then a
    /// uniform value of that length.
    pub min_digits: u32,
    pub max_digits: u32,
    /// Numbers added per problem.
    pub operands: u32,
    pub train_size: usize,
    pub val_size: usize,
    pub seed: u64,
}

impl Default for AdditionTask {
    fn default() -> Self {
        Self {
            min_digits: 1,
            max_digits: 2,
            operands: 2,
            train_size: 2048,
            val_size: 128,
            seed: 42,
        }
    }
}

impl AdditionTask {
    /// `(train, validation)`, with no problem in both.
    pub fn generate(&self) -> Result<(Vec<Sample>, Vec<Sample>), DataError> {
        if !(1..=9).contains(&self.min_digits) || !(self.min_digits..=9).contains(&self.max_digits)
        {
            return Err(DataError::Synthetic(format!(
                "need 1 <= min_digits <= max_digits <= 9, got {}..{}",
                self.min_digits, self.max_digits
            )));
        }
        if !(2..=8).contains(&self.operands) {
            return Err(DataError::Synthetic(format!(
                "operands must be 2..=8, got {}",
                self.operands
            )));
        }
        if self.train_size == 0 {
            return Err(DataError::Synthetic(
                "train_size must be at least 1".to_owned(),
            ));
        }
        // Every problem is held in memory (and in a set of those seen) before writing.
        let wanted = self
            .train_size
            .checked_add(self.val_size)
            .filter(|&n| n <= MAX_PROBLEMS)
            .ok_or_else(|| {
                DataError::Synthetic(format!(
                    "train_size {} + val_size {} is more than the {MAX_PROBLEMS} problems this task makes",
                    self.train_size, self.val_size
                ))
            })?;
        let per_operand: u64 = (self.min_digits..=self.max_digits)
            .map(|d| numbers_with_digits(d).1 - numbers_with_digits(d).0 + 1)
            .sum();
        let distinct = per_operand.checked_pow(self.operands).unwrap_or(u64::MAX);
        if wanted as u64 > distinct {
            return Err(DataError::Synthetic(format!(
                "{wanted} problems asked, but only {distinct} distinct ones exist; raise max_digits or operands"
            )));
        }
        let mut rng = SplitMix64::new(self.seed);
        let mut seen = HashSet::new();
        let mut problems = Vec::with_capacity(wanted);
        // Rejection sampling; the bound only matters when nearly every problem is asked for.
        let mut attempts = 0usize;
        while problems.len() < wanted {
            attempts += 1;
            if attempts > 100 * wanted + 10_000 {
                return Err(DataError::Synthetic(format!(
                    "found only {} distinct problems of {wanted}; raise max_digits or operands",
                    problems.len()
                )));
            }
            let operands: Vec<u64> = (0..self.operands)
                .map(|_| {
                    let digits = self.min_digits
                        + rng.below(u64::from(self.max_digits - self.min_digits + 1)) as u32;
                    let (lo, hi) = numbers_with_digits(digits);
                    lo + rng.below(hi - lo + 1)
                })
                .collect();
            if seen.insert(operands.clone()) {
                problems.push(operands);
            }
        }
        let val = problems.split_off(self.train_size);
        Ok((to_samples(&problems, "train"), to_samples(&val, "test")))
    }

    /// Writes `train.parquet` and `test.parquet` (verl's names) into `dir`; returns their paths.
    pub fn write(&self, dir: &Path) -> Result<(PathBuf, PathBuf), DataError> {
        let (train, val) = self.generate()?;
        std::fs::create_dir_all(dir).map_err(|source| DataError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let (train_path, val_path) = (dir.join("train.parquet"), dir.join("test.parquet"));
        write_parquet(&train_path, &train, "prompt")?;
        write_parquet(&val_path, &val, "prompt")?;
        Ok((train_path, val_path))
    }
}

/// The smallest and largest number with `digits` digits (1 digit includes 0).
fn numbers_with_digits(digits: u32) -> (u64, u64) {
    let hi = 10u64.pow(digits) - 1;
    if digits == 1 {
        (0, hi)
    } else {
        (10u64.pow(digits - 1), hi)
    }
}

fn to_samples(problems: &[Vec<u64>], split: &str) -> Vec<Sample> {
    problems
        .iter()
        .enumerate()
        .map(|(index, operands)| {
            let question = format!("{}=", operands.iter().map(u64::to_string).collect::<Vec<_>>().join("+"));
            let answer = operands.iter().sum::<u64>().to_string();
            Sample {
                data_source: DATA_SOURCE.into(),
                prompt: vec![Message { role: "user".into(), content: question.clone() }],
                ability: "math".into(),
                reward_model: RewardSpec { style: "rule".into(), ground_truth: answer.clone() },
                extra_info: json!({"split": split, "index": index, "question": question, "answer": format!("#### {answer}")}),
            }
        })
        .collect()
}

/// Writes a character-level `tokenizer.json` over [`ALPHABET`] (ids after [`SPECIAL_TOKENS`]) and
/// a `tokenizer_config.json` without a chat template, so prompts render as their plain text.
pub fn write_tokenizer(dir: &Path) -> Result<(), DataError> {
    let vocab: serde_json::Map<String, serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .map(|t| t.to_string())
        .chain(ALPHABET.chars().map(String::from))
        .enumerate()
        .map(|(id, t)| (t, id.into()))
        .collect();
    let added: Vec<_> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(id, t)| json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "unk_token": SPECIAL_TOKENS[3],
        "model_max_length": 512,
    });
    std::fs::create_dir_all(dir).map_err(|source| DataError::Io {
        path: dir.to_owned(),
        source,
    })?;
    for (name, value) in [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", config),
    ] {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(&value).expect("JSON values serialise");
        std::fs::write(&path, text).map_err(|source| DataError::Io { path, source })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read_parquet;

    #[test]
    fn generates_disjoint_deterministic_splits() {
        let task = AdditionTask {
            train_size: 300,
            val_size: 50,
            ..Default::default()
        };
        let (train, val) = task.generate().unwrap();
        assert_eq!((train.len(), val.len()), (300, 50));
        let questions: HashSet<&str> = train.iter().map(|s| s.prompt[0].content.as_str()).collect();
        assert_eq!(questions.len(), 300);
        assert!(
            val.iter()
                .all(|s| !questions.contains(s.prompt[0].content.as_str()))
        );
        assert_eq!(task.generate().unwrap().0, train, "same seed, same data");
        for s in train.iter().chain(&val) {
            let q = s.prompt[0].content.trim_end_matches('=');
            let sum: u64 = q.split('+').map(|n| n.parse::<u64>().unwrap()).sum();
            assert_eq!(s.reward_model.ground_truth, sum.to_string());
            assert!(q.split('+').all(|n| n.len() <= 2));
            // The SFT target (verl-rewards' tests check that it earns the full reward).
            let target = s.extra_info["answer"].as_str().unwrap();
            assert!(
                s.prompt[0]
                    .content
                    .chars()
                    .chain(target.chars())
                    .all(|c| ALPHABET.contains(c))
            );
        }
    }

    #[test]
    fn knobs_are_checked() {
        let too_many = AdditionTask {
            min_digits: 1,
            max_digits: 1,
            train_size: 100,
            val_size: 1,
            ..Default::default()
        };
        assert!(
            too_many
                .generate()
                .unwrap_err()
                .to_string()
                .contains("only 100 distinct")
        );
        assert!(
            AdditionTask {
                min_digits: 3,
                max_digits: 2,
                ..Default::default()
            }
            .generate()
            .is_err()
        );
        assert!(
            AdditionTask {
                operands: 1,
                ..Default::default()
            }
            .generate()
            .is_err()
        );
        // Sizes are bounded before anything is allocated (and their sum cannot wrap around).
        let sized = |train_size, val_size| {
            AdditionTask {
                max_digits: 9,
                operands: 8,
                train_size,
                val_size,
                ..Default::default()
            }
            .generate()
            .unwrap_err()
            .to_string()
        };
        assert!(sized(0, 5).contains("train_size must be at least 1"));
        assert!(sized(1_000_000_000_000, 128).contains("train_size 1000000000000 + val_size 128"));
        assert!(sized(usize::MAX, 128).contains("more than the 10000000 problems"));
        // Three 3-digit operands.
        let (train, _) = AdditionTask {
            min_digits: 3,
            max_digits: 3,
            operands: 3,
            train_size: 5,
            val_size: 1,
            ..Default::default()
        }
        .generate()
        .unwrap();
        assert!(train.iter().all(|s| s.prompt[0].content.len() == 12));
    }

    #[test]
    fn writes_verl_parquet_and_a_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let task = AdditionTask {
            train_size: 20,
            val_size: 5,
            ..Default::default()
        };
        let (train_path, val_path) = task.write(dir.path()).unwrap();
        let (train, val) = task.generate().unwrap();
        assert_eq!(read_parquet(&train_path, "prompt").unwrap(), train);
        assert_eq!(read_parquet(&val_path, "prompt").unwrap(), val);
        write_tokenizer(dir.path()).unwrap();
        let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        let enc = tok.encode("12+34=#### 46", false).unwrap();
        // '1' is id 4+1 = 5 (four special tokens first).
        assert_eq!(enc.get_ids()[0], 5);
        assert_eq!(enc.get_ids().len(), 13);
        assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "12+34=#### 46");
        assert_eq!(tok.token_to_id("</s>"), Some(2));
        assert_eq!(tok.get_vocab_size(true), 18);
    }
}
