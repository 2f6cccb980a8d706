//! Training data: verl's dataset rows from parquet or JSONL, chat templates, tokenised prompts
//! with `max_prompt_length` handling, a seeded resumable loader and the built-in synthetic task.

mod jsonl;
mod loader;
mod parquet;
mod prompt;
pub mod synthetic;
mod template;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use jsonl::{read_jsonl, write_jsonl};
pub use loader::{DataLoader, LoaderState};
pub use parquet::{read_parquet, write_parquet};
pub use prompt::{PromptProcessor, TokenizedPrompt};
pub use template::ChatTemplate;
pub use verl_schema::Truncation;

/// What went wrong reading, templating or tokenising data; always names the file (and row).
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Parquet { path: PathBuf, reason: String },
    #[error("{path}: missing column `{column}` (the file has: {found})")]
    MissingColumn {
        path: PathBuf,
        column: String,
        found: String,
    },
    #[error("{path}: {location}: {reason}")]
    Row {
        path: PathBuf,
        location: String,
        reason: String,
    },
    #[error("{0}: unknown data file type (expected .parquet, .jsonl or .json)")]
    Extension(PathBuf),
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error(
        "prompt of sample {index} has {len} tokens, more than data.max_prompt_length={max}; set data.truncation to left, right or middle, or data.filter_overlong_prompts=true"
    )]
    PromptTooLong {
        index: usize,
        len: usize,
        max: usize,
    },
    #[error("synthetic task: {0}")]
    Synthetic(String),
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// verl's `reward_model` column.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RewardSpec {
    pub style: String,
    /// As text: numbers are written out, lists and objects as JSON.
    pub ground_truth: String,
}

/// One row of a verl RL dataset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub data_source: String,
    pub prompt: Vec<Message>,
    pub ability: String,
    pub reward_model: RewardSpec,
    /// Free-form (verl: `{split, index, answer, question}`); `Null` when absent.
    pub extra_info: Value,
}

/// Columns a row must have besides the prompt.
const REQUIRED: [&str; 2] = ["data_source", "reward_model"];

impl Sample {
    /// A row given as a JSON object (both file formats come through here); `prompt_key` is
    /// `data.prompt_key`. The error text names the offending column.
    pub fn from_row(mut row: Map<String, Value>, prompt_key: &str) -> Result<Self, String> {
        let prompt = match row.remove(prompt_key) {
            Some(Value::Array(items)) => items
                .into_iter()
                .map(|m| {
                    serde_json::from_value::<Message>(m).map_err(|e| {
                        format!("column `{prompt_key}`: a message is not {{role, content}}: {e}")
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
            // A bare string is a one-message user prompt (common in hand-written JSONL).
            Some(Value::String(content)) => vec![Message {
                role: "user".into(),
                content,
            }],
            Some(other) => {
                return Err(format!(
                    "column `{prompt_key}`: expected a list of {{role, content}} messages, found {other}"
                ));
            }
            None => return Err(format!("missing `{prompt_key}`")),
        };
        let data_source = match row.remove("data_source") {
            Some(Value::String(s)) => s,
            other => {
                return Err(format!(
                    "column `data_source`: expected a string, found {}",
                    describe(other.as_ref())
                ));
            }
        };
        let ability = match row.remove("ability") {
            Some(Value::String(s)) => s,
            None | Some(Value::Null) => String::new(),
            Some(other) => {
                return Err(format!(
                    "column `ability`: expected a string, found {other}"
                ));
            }
        };
        let reward_model = match row.remove("reward_model") {
            Some(Value::Object(mut spec)) => {
                let style = spec
                    .remove("style")
                    .and_then(|s| s.as_str().map(str::to_owned))
                    .unwrap_or_else(|| "rule".into());
                let ground_truth = match spec.remove("ground_truth") {
                    Some(Value::String(s)) => s,
                    Some(Value::Null) | None => {
                        return Err("column `reward_model`: no `ground_truth`".into());
                    }
                    Some(other) => other.to_string(),
                };
                RewardSpec {
                    style,
                    ground_truth,
                }
            }
            other => {
                return Err(format!(
                    "column `reward_model`: expected {{style, ground_truth}}, found {}",
                    describe(other.as_ref())
                ));
            }
        };
        let extra_info = row.remove("extra_info").unwrap_or(Value::Null);
        Ok(Self {
            data_source,
            prompt,
            ability,
            reward_model,
            extra_info,
        })
    }

    /// The row as verl lays it out, with the prompt under `prompt_key`.
    pub fn to_row(&self, prompt_key: &str) -> Map<String, Value> {
        let mut row = Map::new();
        row.insert("data_source".into(), self.data_source.clone().into());
        row.insert(
            prompt_key.into(),
            serde_json::to_value(&self.prompt).expect("messages serialise"),
        );
        row.insert("ability".into(), self.ability.clone().into());
        row.insert(
            "reward_model".into(),
            serde_json::to_value(&self.reward_model).expect("spec serialises"),
        );
        row.insert("extra_info".into(), self.extra_info.clone());
        row
    }
}

fn describe(value: Option<&Value>) -> String {
    value.map_or_else(|| "nothing".to_owned(), Value::to_string)
}

/// `~/x` → `$HOME/x`, as verl's default paths (`~/data/gsm8k/train.parquet`) expect.
pub fn expand_home(path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => Path::new(&home).join(rest),
        _ => PathBuf::from(path),
    }
}

/// Reads every file in order (`data.train_files` / `data.val_files`), by extension.
pub fn load_samples<S: AsRef<str>>(
    files: &[S],
    prompt_key: &str,
) -> Result<Vec<Sample>, DataError> {
    let mut samples = Vec::new();
    for file in files {
        let path = expand_home(file.as_ref());
        match path.extension().and_then(|e| e.to_str()) {
            Some("parquet") => samples.extend(read_parquet(&path, prompt_key)?),
            Some("jsonl" | "json") => samples.extend(read_jsonl(&path, prompt_key)?),
            _ => return Err(DataError::Extension(path)),
        }
    }
    Ok(samples)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Two verl-shaped samples used by the format tests.
    pub fn samples() -> Vec<Sample> {
        let sample = |i: i64, q: &str, a: &str| Sample {
            data_source: "openai/gsm8k".into(),
            prompt: vec![
                Message {
                    role: "system".into(),
                    content: "Think step by step.".into(),
                },
                Message {
                    role: "user".into(),
                    content: q.into(),
                },
            ],
            ability: "math".into(),
            reward_model: RewardSpec {
                style: "rule".into(),
                ground_truth: a.into(),
            },
            extra_info: serde_json::json!({"split": "train", "index": i, "answer": format!("#### {a}"), "weight": 0.5, "hard": i == 1}),
        };
        vec![
            sample(0, "1+1?", "2"),
            sample(1, "Natalia sold 48 clips…", "72"),
        ]
    }

    #[test]
    fn rows_convert_both_ways() {
        for s in samples() {
            assert_eq!(
                Sample::from_row(s.to_row("question"), "question").unwrap(),
                s
            );
        }
    }

    #[test]
    fn row_errors_name_the_column() {
        let row = |v: Value| v.as_object().unwrap().clone();
        let err = Sample::from_row(row(serde_json::json!({"data_source": "x", "prompt": 3, "reward_model": {"ground_truth": "1"}})), "prompt").unwrap_err();
        assert!(err.contains("column `prompt`"), "{err}");
        let err = Sample::from_row(
            row(serde_json::json!({"prompt": "hi", "reward_model": {"ground_truth": "1"}})),
            "prompt",
        )
        .unwrap_err();
        assert!(err.contains("`data_source`"), "{err}");
        let err = Sample::from_row(
            row(serde_json::json!({"data_source": "x", "prompt": "hi", "reward_model": {}})),
            "prompt",
        )
        .unwrap_err();
        assert!(err.contains("ground_truth"), "{err}");
        // Numbers as ground truth become text; a bare string prompt is a user message.
        let s = Sample::from_row(row(serde_json::json!({"data_source": "x", "prompt": "hi", "reward_model": {"ground_truth": 7}})), "prompt").unwrap();
        assert_eq!(
            (
                s.reward_model.ground_truth.as_str(),
                s.reward_model.style.as_str(),
                s.prompt[0].role.as_str()
            ),
            ("7", "rule", "user")
        );
    }

    #[test]
    fn unknown_extensions_are_refused() {
        assert!(matches!(
            load_samples(&["a.csv"], "prompt"),
            Err(DataError::Extension(_))
        ));
    }
}
