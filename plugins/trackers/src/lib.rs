//! # verl-plugin-trackers
//!
//! verl-core's tracker plugin: four tracker components, picked like verl's
//! `trainer.logger=[console,wandb,mlflow,…]`:
//!
//! | component     | writes to                                                              |
//! |---------------|------------------------------------------------------------------------|
//! | `tensorboard` | event files under `<dir>/<project>/<experiment>` ([`tensorboard`])     |
//! | `mlflow`      | an MLflow tracking server's REST API ([`mlflow`])                      |
//! | `trackio`     | a Trackio server's HTTP API ([`trackio`])                              |
//! | `wandb`       | an offline wandb run directory for `wandb sync` ([`wandb`])            |
//!
//! ## Configuration
//! Each tracker reads its settings from the JSON config the host passes in
//! `ComponentInit.config_json` (the whole run config): the object under the top-level key of its
//! name (`mlflow: {…}`), over the one under `trainer.<name>`; then the tool's usual environment
//! variables (`MLFLOW_TRACKING_URI`, `TRACKIO_SERVER_URL`, `WANDB_DIR`, `TENSORBOARD_DIR`, …);
//! then defaults from the run context (project, experiment, run directory; blank context fields
//! fall back to verl's `trainer.project_name` / `trainer.experiment_name`). The whole config,
//! with values of keys naming a token, password or secret masked, becomes the run's
//! params/config. Each backend module lists its keys; these delivery keys apply to all (defaults):
//!
//! | key                  | default                        | meaning                                      |
//! |----------------------|--------------------------------|----------------------------------------------|
//! | `queue_capacity`     | 256                            | log calls buffered for the sender thread      |
//! | `enqueue_timeout_ms` | 50                             | wait for room in a full queue, then spill     |
//! | `retries`            | 4                              | retries of a failed request (transient errors)|
//! | `backoff_ms`         | 250                            | first retry delay, doubling; also first rest  |
//! | `finish_timeout_s`   | 10                             | the most `finish` takes; the rest is spilled  |
//! | `request_timeout_s`  | 10                             | limit of one HTTP request                     |
//! | `spill_path`         | `<run_dir>/<name>-spill.jsonl` | what could not be delivered                   |
//!
//! ## Delivery: no metric lost, no step slowed
//! See [`delivery`]: logging happens on a sender thread behind a bounded queue; failures are
//! retried, then spilled to the JSONL spill file (its path is printed), and never fail the run.
//! Validation tables go to the tool (MLflow artifact, Trackio table, wandb table) or, for
//! TensorBoard, to `<name>-tables.jsonl` next to the spill file.
//!
//! Messages use `tracing`; a plugin library has its own copy of tracing's globals, so warnings go
//! to stderr unless a subscriber was installed in this library.

pub mod config;
pub mod delivery;
mod error;
mod http;
pub mod mlflow;
pub mod tensorboard;
pub mod trackio;
pub mod wandb;

pub use delivery::{Backend, Managed};
pub use error::TrackerError;

/// The TensorBoard tracker.
pub type TensorboardTracker = Managed<tensorboard::Tensorboard>;
/// The MLflow tracker.
pub type MlflowTracker = Managed<mlflow::Mlflow>;
/// The Trackio tracker.
pub type TrackioTracker = Managed<trackio::Trackio>;
/// The wandb (offline) tracker.
pub type WandbTracker = Managed<wandb::Wandb>;

verl_plugin_api::export_plugin!(
    verl_plugin_api::PluginBuilder::new(
        "trackers",
        env!("CARGO_PKG_VERSION"),
        "Experiment trackers: TensorBoard, MLflow, Trackio, wandb (offline)"
    )
    .tracker(
        "tensorboard",
        50,
        "TensorBoard event files",
        TensorboardTracker::new
    )
    .config_section("tensorboard")
    .tracker(
        "mlflow",
        50,
        "MLflow tracking server (REST)",
        MlflowTracker::new
    )
    .config_section("mlflow")
    .tracker("trackio", 50, "Trackio server (HTTP)", TrackioTracker::new)
    .config_section("trackio")
    .tracker(
        "wandb",
        50,
        "Weights & Biases offline run, uploaded with `wandb sync`",
        WandbTracker::new
    )
    .config_section("wandb")
);

#[cfg(test)]
mod tests {
    use verl_plugin_api::abi_stable::std_types::RSlice;
    use verl_plugin_api::{ComponentInit, ComponentKind, Metric, RunContext};

    /// The exported manifest lists the four trackers, and one created through the stable
    /// interface (as the host does) logs and finishes.
    #[test]
    fn manifest_registers_four_trackers() {
        let manifest = super::__verl_plugin_manifest().into_result().unwrap();
        let info = manifest.info().unwrap();
        let names: Vec<&str> = info.components.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["tensorboard", "mlflow", "trackio", "wandb"]);
        assert!(
            info.components
                .iter()
                .all(|c| c.kind == ComponentKind::TRACKER
                    && c.capabilities == serde_json::json!({"tables": true}))
        );

        let dir =
            std::env::temp_dir().join(format!("verl-trackers-manifest-{}", std::process::id()));
        let mut tracker = manifest
            .factory
            .create_tracker("tensorboard".into())
            .into_result()
            .unwrap();
        let mut run = RunContext::default();
        run.project = "p".into();
        run.experiment = "e".into();
        run.run_dir = dir.to_string_lossy().into_owned();
        let init = verl_plugin_api::wire::encode(&ComponentInit::new(serde_json::json!({}), run));
        tracker.init(init.as_rstr()).into_result().unwrap();
        tracker
            .log(0, RSlice::from_slice(&[Metric::new("m", 1.0)]))
            .into_result()
            .unwrap();
        tracker.finish(0).into_result().unwrap();
        let events = std::fs::read_dir(dir.join("tensorboard/p/e"))
            .unwrap()
            .count();
        assert_eq!(events, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
