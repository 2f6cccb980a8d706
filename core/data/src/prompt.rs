//! Prompts as token ids: chat template, then the tokenizer without special tokens (verl:
//! `apply_chat_template(..., add_generation_prompt=True)` then `tokenizer(add_special_tokens=False)`),
//! then `data.max_prompt_length` with `filter_overlong_prompts` / `truncation`.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{ChatTemplate, DataError, Sample, Truncation};

/// A templated, tokenised prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedPrompt {
    pub text: String,
    pub ids: Vec<u32>,
    pub truncated: bool,
}

/// Template + tokenizer + length policy.
#[derive(Debug)]
pub struct PromptProcessor {
    template: ChatTemplate,
    tokenizer: tokenizers::Tokenizer,
    tokenizer_path: PathBuf,
    pub max_prompt_length: usize,
    pub filter_overlong_prompts: bool,
    pub truncation: Truncation,
    /// `data.apply_chat_template_kwargs`.
    pub template_kwargs: Map<String, Value>,
}

impl PromptProcessor {
    /// `tokenizer_json` is a Hugging Face `tokenizer.json`.
    pub fn new(
        template: ChatTemplate,
        tokenizer_json: &Path,
        max_prompt_length: usize,
        filter_overlong_prompts: bool,
        truncation: Truncation,
    ) -> Result<Self, DataError> {
        let tokenizer =
            tokenizers::Tokenizer::from_file(tokenizer_json).map_err(|e| DataError::Tokenizer {
                path: tokenizer_json.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            template,
            tokenizer,
            tokenizer_path: tokenizer_json.to_owned(),
            max_prompt_length,
            filter_overlong_prompts,
            truncation,
            template_kwargs: Map::new(),
        })
    }

    /// The prompt of sample `index` without any length policy.
    pub fn tokenize(&self, sample: &Sample) -> Result<TokenizedPrompt, DataError> {
        let text = self
            .template
            .render(&sample.prompt, true, &self.template_kwargs)?;
        let encoding =
            self.tokenizer
                .encode(text.as_str(), false)
                .map_err(|e| DataError::Tokenizer {
                    path: self.tokenizer_path.clone(),
                    reason: e.to_string(),
                })?;
        Ok(TokenizedPrompt {
            text,
            ids: encoding.get_ids().to_vec(),
            truncated: false,
        })
    }

    /// The prompt after the length policy: None when it is too long and overlong prompts are
    /// filtered, else cut according to `truncation` (or an error for `error`).
    pub fn process(
        &self,
        index: usize,
        sample: &Sample,
    ) -> Result<Option<TokenizedPrompt>, DataError> {
        let mut prompt = self.tokenize(sample)?;
        let (len, max) = (prompt.ids.len(), self.max_prompt_length);
        if len <= max {
            return Ok(Some(prompt));
        }
        if self.filter_overlong_prompts {
            return Ok(None);
        }
        prompt.ids = match self.truncation {
            Truncation::Error => return Err(DataError::PromptTooLong { index, len, max }),
            Truncation::Left => prompt.ids[len - max..].to_vec(),
            Truncation::Right => prompt.ids[..max].to_vec(),
            Truncation::Middle => {
                let head = max / 2;
                [&prompt.ids[..head], &prompt.ids[len - (max - head)..]].concat()
            }
        };
        prompt.truncated = true;
        Ok(Some(prompt))
    }

    /// Tokenises a dataset, dropping overlong prompts when `filter_overlong_prompts` is set.
    /// Returns the kept samples with their prompts, in order.
    pub fn prepare(
        &self,
        samples: Vec<Sample>,
    ) -> Result<Vec<(Sample, TokenizedPrompt)>, DataError> {
        let mut kept = Vec::with_capacity(samples.len());
        for (index, sample) in samples.into_iter().enumerate() {
            if let Some(prompt) = self.process(index, &sample)? {
                kept.push((sample, prompt));
            }
        }
        Ok(kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic;
    use crate::{Message, RewardSpec};

    fn sample(content: &str) -> Sample {
        Sample {
            data_source: synthetic::DATA_SOURCE.into(),
            prompt: vec![Message {
                role: "user".into(),
                content: content.into(),
            }],
            ability: String::new(),
            reward_model: RewardSpec {
                style: "rule".into(),
                ground_truth: "0".into(),
            },
            extra_info: Value::Null,
        }
    }

    fn processor(
        max: usize,
        filter: bool,
        truncation: Truncation,
    ) -> (tempfile::TempDir, PromptProcessor) {
        let dir = tempfile::tempdir().unwrap();
        synthetic::write_tokenizer(dir.path()).unwrap();
        let template = ChatTemplate::from_model_dir(dir.path()).unwrap();
        let p = PromptProcessor::new(
            template,
            &dir.path().join("tokenizer.json"),
            max,
            filter,
            truncation,
        )
        .unwrap();
        (dir, p)
    }

    #[test]
    fn length_policies() {
        let ids = |p: &PromptProcessor, s: &str| p.tokenize(&sample(s)).unwrap().ids;
        let (_d, p) = processor(4, false, Truncation::Left);
        let full = ids(&p, "12+34=");
        assert_eq!(full.len(), 6);
        assert_eq!(
            p.process(0, &sample("12+34=")).unwrap().unwrap().ids,
            full[2..]
        );
        let (_d, p) = processor(4, false, Truncation::Right);
        assert_eq!(
            p.process(0, &sample("12+34=")).unwrap().unwrap().ids,
            full[..4]
        );
        let (_d, p) = processor(3, false, Truncation::Middle);
        // Head 1 token, tail 2 tokens.
        let cut = p.process(0, &sample("12+34=")).unwrap().unwrap();
        assert_eq!(cut.ids, [&full[..1], &full[4..]].concat());
        assert!(cut.truncated);
        let (_d, p) = processor(4, false, Truncation::Error);
        let err = p.process(3, &sample("12+34=")).unwrap_err().to_string();
        assert!(
            err.contains("sample 3 has 6 tokens") && err.contains("max_prompt_length=4"),
            "{err}"
        );
        assert!(!p.process(0, &sample("1+2=")).unwrap().unwrap().truncated);
        let (_d, p) = processor(4, true, Truncation::Error);
        let kept = p.prepare(vec![sample("12+34="), sample("1+2=")]).unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].1.text, "1+2=");
    }

    #[test]
    fn missing_tokenizer_is_named() {
        let err = PromptProcessor::new(
            ChatTemplate::plain(),
            Path::new("/nonexistent/tokenizer.json"),
            4,
            false,
            Truncation::Error,
        )
        .unwrap_err();
        assert!(err.to_string().contains("/nonexistent/tokenizer.json"));
    }
}
