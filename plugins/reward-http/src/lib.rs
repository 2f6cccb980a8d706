//! The `http` reward: posts each batch of `{data_source, solution_str, ground_truth, extra_info}`
//! items to a user's reward server and reads back one score per item, so reward functions written
//! in Python (or anything that serves HTTP) score verl-core runs.
//!
//! Selected with `custom_reward_function.path=http://HOST:PORT[/PATH]`. Its settings are keys of
//! `custom_reward_function.reward_kwargs`: `timeout_s` (per request, default 60), `max_retries`
//! (default 3), `max_concurrency` (requests in flight, default 4) and `batch_size` (items per
//! request, default 64); every other key is sent to the server as `kwargs`, the function's
//! keyword arguments, as verl passes `reward_kwargs`.
//!
//! The protocol: `POST <url>` with `{"name": <custom_reward_function.name>, "kwargs": {…},
//! "items": [{"data_source", "solution_str", "ground_truth", "extra_info"}, …]}`; the answer is
//! `{"scores": [s, …]}`, one per item in order, each a number (or bool) or a dict with `score` and
//! any extra keys (`acc`, `pred`, …), as verl's reward functions return. A non-2xx answer's
//! `{"error": …}` (or text) is carried into the error. Connection failures, timeouts, 429 and 5xx
//! are retried with exponential backoff (0.25 s, 0.5 s, …); other answers fail at once.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value, json};
use ureq::Agent;
use verl_plugin_api::{
    ComponentInit, PluginBuilder, PluginError, Reward, RewardItem, RewardOutput, RewardRequest,
    RewardScore,
};

/// The plugin's own keys of `reward_kwargs`; the rest are the function's.
const OWN_KEYS: [&str; 4] = ["timeout_s", "max_retries", "max_concurrency", "batch_size"];
const FIRST_BACKOFF: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Settings {
    timeout_s: f64,
    max_retries: u32,
    max_concurrency: usize,
    batch_size: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            timeout_s: 60.0,
            max_retries: 3,
            max_concurrency: 4,
            batch_size: 64,
        }
    }
}

/// What the host sends: the `custom_reward_function` section.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Section {
    path: Option<String>,
    name: String,
    reward_kwargs: Map<String, Value>,
}

#[derive(Debug)]
struct Client {
    agent: Agent,
    url: String,
    name: String,
    kwargs: Map<String, Value>,
    settings: Settings,
}

#[derive(Debug, Default)]
pub struct HttpReward {
    client: Option<Client>,
}

/// One request's result, filled in by whichever worker made it.
type Slot = Mutex<Option<Result<Vec<RewardScore>, PluginError>>>;

/// Why one request failed, and whether trying again may help.
struct Failure {
    message: String,
    transient: bool,
}

fn invalid(message: String) -> PluginError {
    PluginError::invalid_config(message)
}

impl Client {
    fn new(init: &ComponentInit) -> Result<Self, PluginError> {
        let section: Section = init.config("http reward")?;
        let url = section
            .path
            .filter(|p| p.starts_with("http://") || p.starts_with("https://"))
            .ok_or_else(|| {
                invalid(
                    "custom_reward_function.path must be the reward server's URL (http://HOST:PORT) for the `http` reward"
                        .into(),
                )
            })?;
        let (own, kwargs): (Map<String, Value>, Map<String, Value>) = section
            .reward_kwargs
            .into_iter()
            .partition(|(k, _)| OWN_KEYS.contains(&k.as_str()));
        let settings: Settings = serde_json::from_value(Value::Object(own))
            .map_err(|e| invalid(format!("custom_reward_function.reward_kwargs: {e}")))?;
        if !(settings.timeout_s.is_finite() && settings.timeout_s > 0.0) {
            return Err(invalid(format!(
                "custom_reward_function.reward_kwargs.timeout_s={} must be a positive number of seconds",
                settings.timeout_s
            )));
        }
        for (key, value) in [
            ("max_concurrency", settings.max_concurrency),
            ("batch_size", settings.batch_size),
        ] {
            if value == 0 {
                return Err(invalid(format!(
                    "custom_reward_function.reward_kwargs.{key} must be at least 1"
                )));
            }
        }
        // Statuses are classified here (retry or not), not turned into transport errors.
        let agent = Agent::config_builder()
            .timeout_global(Some(Duration::from_secs_f64(settings.timeout_s)))
            .http_status_as_error(false)
            .build()
            .into();
        Ok(Self {
            agent,
            url,
            name: section.name,
            kwargs,
            settings,
        })
    }

    /// One request: the scores of `items` (which start at `first` in the batch).
    fn post(&self, items: &[RewardItem], first: usize) -> Result<Vec<RewardScore>, Failure> {
        let body = json!({"name": self.name, "kwargs": self.kwargs, "items": items});
        let mut response = self
            .agent
            .post(&self.url)
            .send_json(&body)
            .map_err(|e| Failure {
                message: e.to_string(),
                transient: true,
            })?;
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().map_err(|e| Failure {
            message: format!("reading the answer: {e}"),
            transient: true,
        })?;
        if !(200..300).contains(&status) {
            return Err(Failure {
                message: format!("HTTP {status}: {}", server_message(&text)),
                transient: status == 429 || status >= 500,
            });
        }
        let fail = |message: String| Failure {
            message,
            transient: false,
        };
        let answer: Value = serde_json::from_str(&text)
            .map_err(|e| fail(format!("the answer is not JSON ({e}): {text:.200}")))?;
        let scores = answer
            .get("scores")
            .and_then(Value::as_array)
            .ok_or_else(|| fail(format!("the answer has no `scores` list: {text:.200}")))?;
        if scores.len() != items.len() {
            return Err(fail(format!(
                "{} scores for {} items",
                scores.len(),
                items.len()
            )));
        }
        scores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                RewardScore::from_verl_result(s)
                    .map_err(|reason| fail(format!("item {}: {reason}", first + i)))
            })
            .collect()
    }

    /// [`Client::post`] with retries of transient failures.
    fn post_with_retries(
        &self,
        items: &[RewardItem],
        first: usize,
    ) -> Result<Vec<RewardScore>, PluginError> {
        let mut backoff = FIRST_BACKOFF;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.post(items, first) {
                Ok(scores) => return Ok(scores),
                Err(f) if f.transient && attempt <= self.settings.max_retries => {
                    std::thread::sleep(backoff);
                    backoff *= 2;
                }
                Err(f) => {
                    let last = first + items.len() - 1;
                    return Err(PluginError::other(format!(
                        "reward server {} (items {first}..={last}, {attempt} attempt{}): {}",
                        self.url,
                        if attempt == 1 { "" } else { "s" },
                        f.message
                    )));
                }
            }
        }
    }

    /// Every chunk of `batch_size` items, at most `max_concurrency` requests at a time; the
    /// first error (by item order) fails the batch.
    fn score(&self, items: &[RewardItem]) -> Result<Vec<RewardScore>, PluginError> {
        let chunks: Vec<&[RewardItem]> = items.chunks(self.settings.batch_size).collect();
        let results: Vec<Slot> = chunks.iter().map(|_| Mutex::new(None)).collect();
        let next = AtomicUsize::new(0);
        let workers = self.settings.max_concurrency.min(chunks.len());
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(chunk) = chunks.get(i) else { break };
                        let result = self.post_with_retries(chunk, i * self.settings.batch_size);
                        *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
                    }
                });
            }
        });
        let mut scores = Vec::with_capacity(items.len());
        for slot in results {
            let result = slot
                .into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .ok_or_else(|| PluginError::other("a request was not made"))?;
            scores.extend(result?);
        }
        Ok(scores)
    }
}

/// The server's own words: `{"error": …}`'s text, else the body, cut to 500 characters.
fn server_message(text: &str) -> String {
    let message = serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| match v.get("error") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => Some(other.to_string()),
            None => None,
        })
        .unwrap_or_else(|| text.trim().to_owned());
    message.chars().take(500).collect()
}

impl Reward for HttpReward {
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        self.client = Some(Client::new(init)?);
        Ok(())
    }

    fn compute(&mut self, request: &RewardRequest) -> Result<RewardOutput, PluginError> {
        let client = self
            .client
            .as_ref()
            .ok_or_else(|| PluginError::other("compute before init"))?;
        client.score(&request.items).map(RewardOutput::new)
    }
}

/// The plugin as registered (also what tests register as a built-in).
pub fn plugin() -> PluginBuilder {
    PluginBuilder::new(
        "reward-http",
        env!("CARGO_PKG_VERSION"),
        "rewards from a user's reward server over HTTP",
    )
    .reward(
        "http",
        0,
        "posts {data_source, solution_str, ground_truth, extra_info} batches to custom_reward_function.path (a URL)",
        HttpReward::default,
    )
}

verl_plugin_api::export_plugin!(plugin());
