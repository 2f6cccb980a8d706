//! The behaviour every HTTP rollout backend shares, as one test suite (feature `testing`) that
//! each backend runs against its own mock server with [`backend_tests!`](crate::backend_tests):
//! answers grouped by prompt, replicas that must agree, stale weights refused, handovers refused
//! before any server is touched, strict section parsing, and a started server that dies being
//! started again with the rollout's weights. What differs per backend (request bodies, the reload
//! sequence, launch flags) stays in the backend's own tests.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use verl_plugin_api::{
    ComponentInit, ErrorKind, FinishReason, GenerateRequest, Handover, Rollout, RunContext,
    SamplingParams, WeightSource,
};

use crate::mock::MockServer;

/// A backend under test: its rollout and a mock of its server.
pub trait Backend {
    type Rollout: Rollout + Default;
    /// The rollout's name, and its section's under `engine_kwargs`.
    const NAME: &'static str;
    /// A key of the backend's own section misspelled, and the key the error must suggest.
    const MISSPELLED: (&'static str, &'static str);
    /// The mock of one server holding weights of version `version` (its reloads set it). Its
    /// answer to a request for `n` samples of a prompt `[p, ..]` with stop ids `[.., s]`: sample
    /// `j` is `[p + j, s]`, log-probs `[-0.25, -0.5]`, finish reason stop.
    fn mock(version: Arc<Mutex<String>>) -> MockServer;
    /// The generation endpoint.
    const GENERATE: &'static str;
    /// The endpoint that loads weights from a directory, and the JSON pointer of the directory
    /// in its body.
    const LOAD: (&'static str, &'static str);
}

/// The generation requests `mock` received.
fn generations<B: Backend>(mock: &MockServer) -> usize {
    mock.requests_to(B::GENERATE).len()
}

/// The weight directories `mock` was asked to load, in order.
fn loads<B: Backend>(mock: &MockServer) -> Vec<PathBuf> {
    let (path, pointer) = B::LOAD;
    mock.requests_to(path)
        .iter()
        .map(|r| {
            PathBuf::from(
                r.body
                    .pointer(pointer)
                    .and_then(Value::as_str)
                    .unwrap_or(""),
            )
        })
        .collect()
}

/// The value of `--name` in a launch command line.
pub fn flag<'a>(launch: &'a crate::Launch, name: &str) -> Option<&'a str> {
    let i = launch.args.iter().position(|a| a == name)?;
    launch.args.get(i + 1).map(String::as_str)
}

/// Runs the suite for a [`Backend`]: one `#[test]` each, in a module named `shared`.
#[macro_export]
macro_rules! backend_tests {
    ($backend:ty) => {
        mod shared {
            use $crate::testing;
            #[test]
            fn answers_become_completions_grouped_by_prompt() {
                testing::answers_become_completions_grouped_by_prompt::<$backend>();
            }
            #[test]
            fn replicas_must_agree() {
                testing::replicas_must_agree::<$backend>();
            }
            #[test]
            fn stale_weights_are_refused() {
                testing::stale_weights_are_refused::<$backend>();
            }
            #[test]
            fn a_directory_without_weights_is_refused_before_any_server_is_touched() {
                testing::a_directory_without_weights_is_refused_before_any_server_is_touched::<
                    $backend,
                >();
            }
            #[test]
            fn memory_handovers_point_at_the_disk_sync() {
                testing::memory_handovers_point_at_the_disk_sync::<$backend>();
            }
            #[test]
            fn the_section_is_parsed_strictly() {
                testing::the_section_is_parsed_strictly::<$backend>();
            }
            #[test]
            fn a_started_server_that_dies_is_started_again_with_the_rollouts_weights() {
                testing::a_started_server_that_dies_is_started_again_with_the_rollouts_weights::<
                    $backend,
                >();
            }
        }
    };
}

/// The section path of backend `B`.
fn section<B: Backend>() -> String {
    format!("actor_rollout_ref.rollout.engine_kwargs.{}", B::NAME)
}

/// What the trainer sends a rollout, with `section` as the backend's own.
pub fn init<B: Backend>(section: Value) -> ComponentInit {
    let mut run = RunContext::default();
    run.seed = 3;
    ComponentInit::new(
        json!({"name": B::NAME, "model": {"path": "/m"}, "engine_kwargs": {B::NAME: section},
            "ignore_eos": false}),
        run,
    )
}

/// A rollout attached to `mocks`.
pub fn attached<B: Backend>(mocks: &[&MockServer]) -> B::Rollout {
    let mut rollout = B::Rollout::default();
    let urls: Vec<&str> = mocks.iter().map(|m| m.url()).collect();
    rollout
        .init(&init::<B>(json!({"urls": urls, "startup_timeout_s": 5})))
        .unwrap_or_else(|e| panic!("init: {e}"));
    rollout
}

fn version(v: &str) -> Arc<Mutex<String>> {
    Arc::new(Mutex::new(v.to_owned()))
}

/// A handover directory as the disk weight sync writes it (contents irrelevant to a mock).
pub fn weights_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model.safetensors"), b"{}").unwrap();
    dir
}

/// The handover of the files in `dir`, as the disk weight sync encodes it.
pub fn file_handover(dir: &Path) -> String {
    WeightSource::encode_handover(&Handover::file(dir.to_string_lossy())).to_string()
}

/// Sampling settings with every field away from its default.
pub fn sampling(n: u32) -> SamplingParams {
    let mut s = SamplingParams::default();
    s.n = n;
    s.temperature = 0.7;
    s.top_p = 0.9;
    s.top_k = -1;
    s.max_new_tokens = 8;
    s.stop_token_ids = vec![9];
    s.seed = Some(11);
    s
}

fn one_prompt() -> GenerateRequest {
    GenerateRequest::new(vec![vec![1]], sampling(1))
}

pub fn answers_become_completions_grouped_by_prompt<B: Backend>() {
    let mock = B::mock(version("default"));
    let mut rollout = attached::<B>(&[&mock]);
    let out = rollout
        .generate(&GenerateRequest::new(vec![vec![10], vec![20]], sampling(2)))
        .unwrap();
    let got: Vec<(u32, Vec<u32>)> = out
        .completions
        .iter()
        .map(|c| (c.prompt_index, c.response_ids.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (0, vec![10, 9]),
            (0, vec![11, 9]),
            (1, vec![20, 9]),
            (1, vec![21, 9])
        ]
    );
    for c in &out.completions {
        assert_eq!(c.logprobs, [-0.25, -0.5]);
        assert_eq!(c.finish_reason, FinishReason::Stop);
    }
    assert_eq!(out.weight_version, None);
    assert_eq!(generations::<B>(&mock), 2, "one request per prompt");
}

pub fn replicas_must_agree<B: Backend>() {
    let (a, b) = (B::mock(version("default")), B::mock(version("17")));
    let urls = [a.url(), b.url()];
    let err = B::Rollout::default()
        .init(&init::<B>(json!({"urls": urls})))
        .unwrap_err();
    assert!(
        err.message().contains("different weights") && err.message().contains("`17`"),
        "{err}"
    );
}

pub fn stale_weights_are_refused<B: Backend>() {
    let held = version("default");
    let mock = B::mock(held.clone());
    let mut rollout = attached::<B>(&[&mock]);
    let dir = weights_dir();
    rollout
        .update_weights(&WeightSource::from_handover(
            2,
            &[],
            &file_handover(dir.path()),
        ))
        .unwrap();
    // The server restarts (or another client reloads it): it no longer holds step 2.
    *held.lock().unwrap() = "default".into();
    let err = rollout.generate(&one_prompt()).unwrap_err();
    assert_eq!(err.kind, ErrorKind::UNAVAILABLE);
    assert!(
        err.message()
            .contains("holds weights of version `default`, not `2`")
            && err.message().contains(mock.url()),
        "{err}"
    );
    assert_eq!(generations::<B>(&mock), 0);
}

pub fn a_directory_without_weights_is_refused_before_any_server_is_touched<B: Backend>() {
    let mock = B::mock(version("default"));
    let mut rollout = attached::<B>(&[&mock]);
    let empty = tempfile::tempdir().unwrap();
    for dir in [empty.path().to_path_buf(), empty.path().join("missing")] {
        let err = rollout
            .update_weights(&WeightSource::from_handover(5, &[], &file_handover(&dir)))
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::IO);
        assert!(err.message().contains(&dir.display().to_string()), "{err}");
    }
    assert!(loads::<B>(&mock).is_empty());
    // The servers still hold what they held: generation goes on.
    rollout.generate(&one_prompt()).unwrap();
}

pub fn memory_handovers_point_at_the_disk_sync<B: Backend>() {
    let mock = B::mock(version("default"));
    let mut rollout = attached::<B>(&[&mock]);
    let err = rollout
        .update_weights(&WeightSource::memory(1, &[]))
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::UNSUPPORTED);
    assert!(
        err.message().contains("checkpoint_engine.backend=disk"),
        "{err}"
    );
}

pub fn the_section_is_parsed_strictly<B: Backend>() {
    let (typo, meant) = B::MISSPELLED;
    let path = section::<B>();
    let err = B::Rollout::default()
        .init(&init::<B>(json!({"urls": ["http://127.0.0.1:1"], typo: 2})))
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::INVALID_CONFIG);
    assert!(
        err.message()
            .contains(&format!("unknown config key `{path}.{typo}`"))
            && err
                .message()
                .contains(&format!("did you mean `{path}.{meant}`")),
        "{err}"
    );
    let err = B::Rollout::default()
        .init(&init::<B>(json!({"urls": ["localhost:8000"]})))
        .unwrap_err();
    assert!(
        err.message().contains(&format!("{}.urls[0]", B::NAME)),
        "{err}"
    );
    let err = B::Rollout::default()
        .init(&init::<B>(json!({"max_restarts": -1})))
        .unwrap_err();
    assert!(
        err.message().contains(&format!("{path}.max_restarts")),
        "{err}"
    );
}

/// The process of a started server stands in for it (a shell printing its pid) while `mock`
/// answers its HTTP side: the rollout starts it with `command` on the mock's port.
pub fn a_started_server_that_dies_is_started_again_with_the_rollouts_weights<B: Backend>() {
    let held = version("default");
    let mock = B::mock(held.clone());
    let port = mock.url().rsplit(':').next().unwrap().to_owned();
    let logs = tempfile::tempdir().unwrap();
    let mut rollout = B::Rollout::default();
    let mut init = init::<B>(json!({
        "command": ["sh", "-c", "echo serving $$; exec sleep 1000"],
        "port": port.parse::<u16>().unwrap(),
        "log_dir": logs.path(),
        "startup_timeout_s": 10,
    }));
    // A GPU run: weights are reloaded in place (vLLM restarts a CPU server on new weights).
    init.run.device_type = "cuda".into();
    rollout.init(&init).unwrap_or_else(|e| panic!("init: {e}"));
    let handover = weights_dir();
    rollout
        .update_weights(&WeightSource::from_handover(
            4,
            &[],
            &file_handover(handover.path()),
        ))
        .unwrap();
    // The weight sync removes its directory once the update returns.
    let handover_path = handover.path().to_path_buf();
    drop(handover);

    let log = logs.path().join(format!("server-{port}.log"));
    let pid = logged_pid(&log);
    // SAFETY: signals the shell this test had the rollout start.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_dead(pid);
    // A server started again holds the model directory's weights.
    *held.lock().unwrap() = "default".into();

    let out = rollout.generate(&one_prompt()).unwrap();
    assert_eq!(out.weight_version, Some(4));
    assert_eq!(*held.lock().unwrap(), "4");
    let kept = logs.path().join("weights/step_4");
    assert_eq!(loads::<B>(&mock), [handover_path, kept.clone()]);
    assert!(
        kept.join("model.safetensors").is_file(),
        "the kept copy outlives the handover"
    );
    let restarted = logs.path().join(format!("server-{port}.restart-1.log"));
    assert_ne!(logged_pid(&restarted), pid, "a new process");
}

/// The pid a test server's log names (`serving <pid>`), once it is there.
fn logged_pid(log: &Path) -> libc::pid_t {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(pid) = text
            .strip_prefix("serving ")
            .and_then(|rest| rest.trim().parse().ok())
        {
            return pid;
        }
        assert!(Instant::now() < deadline, "{}: {text:?}", log.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `pid` is a zombie or gone.
fn wait_dead(pid: libc::pid_t) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() && !crate::process::is_zombie(pid as u32) {
        assert!(Instant::now() < deadline, "process {pid} survived SIGKILL");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A tensor a [`FakeCollective`] was given to broadcast.
#[derive(Debug, Clone, PartialEq)]
pub struct SentTensor {
    pub name: String,
    pub dtype: verl_plugin_api::DType,
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

/// What a [`FakeCollective`] was asked: the groups it joined, the tensors of each send.
#[derive(Debug, Default)]
pub struct TransferLog {
    pub joins: Vec<crate::GroupPlan>,
    pub sends: Vec<Vec<SentTensor>>,
}

/// The trainer's end of a collective weight sync, recording instead of broadcasting; `fail_send`
/// makes every send fail with that message. A mock server proves the two ends overlap by
/// answering a join or update request only once the log shows the trainer's side of it.
#[derive(Clone, Default)]
pub struct FakeCollective {
    pub log: Arc<Mutex<TransferLog>>,
    pub fail_send: Option<String>,
}

impl crate::Collective for FakeCollective {
    fn check(&self) -> Result<(), verl_plugin_api::PluginError> {
        Ok(())
    }

    fn join(
        &mut self,
        plan: &crate::GroupPlan,
    ) -> Result<Box<dyn crate::WeightSender>, verl_plugin_api::PluginError> {
        self.log.lock().unwrap().joins.push(plan.clone());
        Ok(Box::new(self.clone()))
    }
}

impl crate::WeightSender for FakeCollective {
    fn send(
        &mut self,
        tensors: &[verl_plugin_api::TensorRef<'_>],
    ) -> Result<(), verl_plugin_api::PluginError> {
        if let Some(message) = &self.fail_send {
            return Err(verl_plugin_api::PluginError::other(message.clone()));
        }
        let sent = tensors
            .iter()
            .map(|t| SentTensor {
                name: t.name.to_string(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
                data: t.data.to_vec(),
            })
            .collect();
        self.log.lock().unwrap().sends.push(sent);
        Ok(())
    }
}

/// Waits up to 5 s for `ready` (a mock server's side of a collective waiting for the
/// trainer's); whether it came.
pub fn eventually(ready: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while !ready() {
        if start.elapsed() > Duration::from_secs(5) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// Two small tensors of two dtypes, as an engine lends them.
pub fn lent_tensors() -> Vec<verl_plugin_api::NamedTensor> {
    use verl_plugin_api::{NamedTensor, Tensor};
    vec![
        NamedTensor::new(
            "model.embed_tokens.weight",
            Tensor::from_slice(&[2, 3], &[0.5f32, -1.0, 2.0, 0.25, 3.5, -4.0]).unwrap(),
        ),
        NamedTensor::new(
            "model.counts",
            Tensor::from_slice(&[2], &[7i64, -9]).unwrap(),
        ),
    ]
}

/// `rollout.update_weights` of [`lent_tensors`] lent as a memory source (what the `naive` weight
/// sync hands over), tagged `version`.
pub fn sync_lent(
    rollout: &mut dyn Rollout,
    version: u64,
) -> Result<(), verl_plugin_api::PluginError> {
    let named = lent_tensors();
    let views: Vec<_> = named.iter().map(|t| t.as_ref()).collect();
    rollout.update_weights(&WeightSource::memory(version, &views))
}
