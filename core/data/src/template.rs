//! Chat templates from a tokenizer's `tokenizer_config.json`, rendered like Hugging Face's
//! `apply_chat_template`: Jinja with `trim_blocks`/`lstrip_blocks`, loop controls, Python string
//! methods, `raise_exception`, and `messages`, `add_generation_prompt`, `bos_token`, `eos_token`
//! in the context.

use std::path::Path;

use minijinja::value::{Serde, Value};
use minijinja::{Environment, ErrorKind, context};
use serde_json::Map;

use super::{DataError, Message};

const NAME: &str = "chat_template";

/// A tokenizer's chat template, or plain concatenation when the tokenizer has none.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// No template: the message contents joined by newlines (a single message renders as itself).
    pub fn plain() -> Self {
        Self {
            env: None,
            bos_token: String::new(),
            eos_token: String::new(),
        }
    }

    /// A template given as Jinja source (e.g. `actor_rollout_ref.model.custom_chat_template`).
    pub fn from_source(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, DataError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| DataError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| DataError::Template(e.to_string()))?;
        Ok(Self {
            env: Some(env),
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// The template of `tokenizer_config.json` (`chat_template` as a string, or HF's list of named
    /// templates, taking `default`); plain when the file has none.
    pub fn from_tokenizer_config(path: &Path) -> Result<Self, DataError> {
        let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
            path: path.to_owned(),
            source,
        })?;
        let config: Map<String, serde_json::Value> = serde_json::from_str(&text)
            .map_err(|e| DataError::Template(format!("{}: {e}", path.display())))?;
        // Special tokens are either strings or serialised AddedTokens `{content, …}`.
        let token = |key: &str| match config.get(key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Object(t)) => t
                .get("content")
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            _ => String::new(),
        };
        let source = match config.get(NAME) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(serde_json::Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
            _ => None,
        };
        match source {
            Some(source) => Self::from_source(&source, &token("bos_token"), &token("eos_token"))
                .map_err(|e| match e {
                    DataError::Template(reason) => {
                        DataError::Template(format!("{}: {reason}", path.display()))
                    }
                    other => other,
                }),
            None => Ok(Self::plain()),
        }
    }

    /// `<dir>/tokenizer_config.json` when it exists, else plain.
    pub fn from_model_dir(dir: &Path) -> Result<Self, DataError> {
        let path = dir.join("tokenizer_config.json");
        if path.is_file() {
            Self::from_tokenizer_config(&path)
        } else {
            Ok(Self::plain())
        }
    }

    pub fn is_plain(&self) -> bool {
        self.env.is_none()
    }

    /// The prompt text. `kwargs` are extra template variables (`data.apply_chat_template_kwargs`,
    /// e.g. `enable_thinking`).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        kwargs: &Map<String, serde_json::Value>,
    ) -> Result<String, DataError> {
        let Some(env) = &self.env else {
            return Ok(messages
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n"));
        };
        let template = env
            .get_template(NAME)
            .map_err(|e| DataError::Template(e.to_string()))?;
        let ctx = context! {
            messages => Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..Value::from(Serde(kwargs))
        };
        template
            .render(ctx)
            .map_err(|e| DataError::Template(describe(&e)))
    }
}

/// The error with its causes (minijinja puts the `raise_exception` message in the source chain).
fn describe(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5's template without the tool-calling branches (keeps its whitespace conventions).
    const QWEN: &str = "{%- if messages[0]['role'] == 'system' %}\n    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n{%- else %}\n    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content.strip() + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

    fn user(content: &str) -> Vec<Message> {
        vec![Message {
            role: "user".into(),
            content: content.into(),
        }]
    }

    #[test]
    fn renders_a_qwen_style_template() {
        let t = ChatTemplate::from_source(QWEN, "", "<|im_end|>").unwrap();
        let text = t.render(&user("1+1?"), true, &Map::new()).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_gen = t.render(&user("1+1?"), false, &Map::new()).unwrap();
        assert!(no_gen.ends_with("<|im_end|>\n"));
    }

    #[test]
    fn hf_conventions_work() {
        // trim/lstrip blocks, bos_token, loop controls, Python string methods, kwargs.
        let source = "{{ bos_token }}{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n{{ m.content.upper() }}{% endfor %}{% if enable_thinking %}<think>{% endif %}";
        let t = ChatTemplate::from_source(source, "<s>", "</s>").unwrap();
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), true.into());
        let two = vec![user("a")[0].clone(), user("b")[0].clone()];
        assert_eq!(t.render(&two, true, &kwargs).unwrap(), "<s>A<think>");
    }

    #[test]
    fn raise_exception_surfaces_its_message() {
        let t = ChatTemplate::from_source(
            "{{ raise_exception('Only user and assistant roles are supported!') }}",
            "",
            "",
        )
        .unwrap();
        let err = t
            .render(&user("x"), true, &Map::new())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Only user and assistant roles are supported!"),
            "{err}"
        );
        assert!(ChatTemplate::from_source("{% if %}", "", "").is_err());
    }

    #[test]
    fn reads_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(&path, r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}]}"#).unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
        assert_eq!(
            t.render(&user("hi"), true, &Map::new()).unwrap(),
            "<s>hi</s>"
        );
        std::fs::write(&path, r#"{"eos_token": "</s>"}"#).unwrap();
        let plain = ChatTemplate::from_model_dir(dir.path()).unwrap();
        assert!(plain.is_plain());
        let two = vec![user("a")[0].clone(), user("b")[0].clone()];
        assert_eq!(plain.render(&two, true, &Map::new()).unwrap(), "a\nb");
        assert!(
            ChatTemplate::from_model_dir(&dir.path().join("none"))
                .unwrap()
                .is_plain()
        );
    }
}
