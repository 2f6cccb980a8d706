//! Fan-out to the trackers named in `trainer.logger`. A tracker that fails never fails the run: it
//! is reported once, with the reason, and left out from then on.

use verl_plugin_api::{ComponentInit, ComponentKind, Metric, Table, TrackerBox};
use verl_plugin_host::Registry;

pub struct Trackers {
    active: Vec<(String, TrackerBox)>,
}

impl Trackers {
    /// Creates and initialises every tracker; unknown names are an error (a typo in
    /// `trainer.logger` should not silently drop the metrics), failing initialisation is a warning.
    pub fn start(registry: &Registry, names: &[String], init: &ComponentInit) -> Result<Self, verl_plugin_host::LookupError> {
        let mut active = Vec::new();
        for name in names {
            let mut tracker = registry.resolve(ComponentKind::TRACKER, name)?.create_tracker()?;
            match tracker.init(init).into_result() {
                Ok(()) => active.push((name.clone(), tracker)),
                Err(e) => tracing::warn!("tracker `{name}` is disabled for this run: {e}"),
            }
        }
        Ok(Self { active })
    }

    fn each(&mut self, what: &str, mut call: impl FnMut(&mut TrackerBox) -> Result<(), verl_plugin_api::PluginError>) {
        self.active.retain_mut(|(name, tracker)| match call(tracker) {
            Ok(()) => true,
            Err(e) if e.kind == verl_plugin_api::ErrorKind::UNSUPPORTED => true,
            Err(e) => {
                tracing::warn!("tracker `{name}` failed to {what} and is disabled for the rest of the run: {e}");
                false
            }
        });
    }

    pub fn log(&mut self, step: u64, metrics: &[Metric]) {
        self.each("log", |t| t.log(step, metrics.into()).into_result());
    }

    pub fn log_table(&mut self, step: u64, table: &Table) {
        self.each("log a table", |t| t.log_table(step, table).into_result());
    }

    pub fn finish(&mut self, exit_code: i32) {
        self.each("finish", |t| t.finish(exit_code).into_result());
    }
}
