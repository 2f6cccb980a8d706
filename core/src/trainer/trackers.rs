//! Fan-out to the trackers named in `trainer.logger`. A tracker that fails never fails the run: it
//! is reported once, with the reason, and left out from then on.

use verl_plugin_api::{ComponentInit, ComponentKind, Metric, Table, TrackerCapabilities};
use verl_plugin_host::{Component, Registry, TrackerHandle};

pub struct Trackers {
    /// Name, handle, whether it records tables.
    active: Vec<(String, TrackerHandle, bool)>,
}

impl Trackers {
    /// Creates and initialises every tracker; unknown names are an error (a typo in
    /// `trainer.logger` should not silently drop the metrics), failing initialisation is a warning.
    pub fn start(
        registry: &Registry,
        names: &[String],
        init: impl Fn(&Component) -> ComponentInit,
    ) -> Result<Self, verl_plugin_host::LookupError> {
        let mut active = Vec::new();
        for name in names {
            let component = registry.resolve(ComponentKind::TRACKER, name)?;
            let tables = component.capabilities::<TrackerCapabilities>().tables;
            let mut tracker = component.create_tracker()?;
            match tracker.init(&init(&component)) {
                Ok(()) => active.push((name.clone(), tracker, tables)),
                Err(e) => tracing::warn!("tracker `{name}` is disabled for this run: {e}"),
            }
        }
        Ok(Self { active })
    }

    /// Calls every active tracker (only those that record tables when `tables` is set).
    fn each(
        &mut self,
        what: &str,
        tables: bool,
        mut call: impl FnMut(&mut TrackerHandle) -> Result<(), verl_plugin_api::PluginError>,
    ) {
        self.active.retain_mut(|(name, tracker, records_tables)| {
            if tables && !*records_tables {
                return true;
            }
            match call(tracker) {
                Ok(()) => true,
                Err(e) if e.kind == verl_plugin_api::ErrorKind::UNSUPPORTED => true,
                Err(e) => {
                    tracing::warn!("tracker `{name}` failed to {what} and is disabled for the rest of the run: {e}");
                    false
                }
            }
        });
    }

    pub fn log(&mut self, step: u64, metrics: &[Metric]) {
        self.each("log", false, |t| t.log(step, metrics));
    }

    pub fn log_table(&mut self, step: u64, table: &Table) {
        self.each("log a table", true, |t| t.log_table(step, table));
    }

    pub fn finish(&mut self, exit_code: i32) {
        self.each("finish", false, |t| t.finish(exit_code));
    }
}
