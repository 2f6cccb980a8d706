//! Fan-out to the trackers named in `trainer.logger`. A tracker that fails never fails the run: it
//! is reported once, with the reason, and left out from then on. A tracker's config that is wrong
//! is the user's to fix, so it stops the run before step 1 instead.

use verl_plugin_api::{
    ComponentInit, ComponentKind, ErrorKind, Metric, PluginError, Table, TrackerCapabilities,
};
use verl_plugin_host::{Registry, TrackerHandle};

struct Active {
    name: String,
    tracker: TrackerHandle,
    /// Whether it records tables.
    tables: bool,
    /// Its init record, sent by [`Trackers::start`].
    init: ComponentInit,
}

pub struct Trackers {
    active: Vec<Active>,
    /// Set by [`Trackers::start`]: a run that fails before it has nothing to finish.
    started: bool,
}

impl Trackers {
    /// Creates every tracker; unknown names are an error (a typo in `trainer.logger` should not
    /// silently drop the metrics). `init` makes each one's init record, sent by [`Self::start`].
    pub fn create(
        registry: &Registry,
        names: &[String],
        init: impl Fn(&verl_plugin_host::Component) -> ComponentInit,
    ) -> Result<Self, verl_plugin_host::LookupError> {
        let mut active = Vec::new();
        for name in names {
            let component = registry.resolve(ComponentKind::TRACKER, name)?;
            active.push(Active {
                name: name.clone(),
                tracker: component.create_tracker()?,
                tables: component.capabilities::<TrackerCapabilities>().tables,
                init: init(&component),
            });
        }
        Ok(Self {
            active,
            started: false,
        })
    }

    /// Initialises every tracker, telling it the step the run resumes after (see
    /// [`ComponentInit::resume_step`]). A tracker that cannot start (its server is down, …) is
    /// a warning and left out; one that rejects its config section is an error.
    pub fn start(&mut self, resume_step: Option<u64>) -> Result<(), (String, PluginError)> {
        self.started = true;
        let mut started = Vec::with_capacity(self.active.len());
        for mut a in std::mem::take(&mut self.active) {
            a.init.resume_step = resume_step;
            match a.tracker.init(&a.init) {
                Ok(()) => started.push(a),
                Err(e) if e.kind == ErrorKind::INVALID_CONFIG => {
                    self.active = started;
                    return Err((a.name, e));
                }
                Err(e) => tracing::warn!("tracker `{}` is disabled for this run: {e}", a.name),
            }
        }
        self.active = started;
        Ok(())
    }

    /// Calls every active tracker (only those that record tables when `tables` is set).
    fn each(
        &mut self,
        what: &str,
        tables: bool,
        mut call: impl FnMut(&mut TrackerHandle) -> Result<(), PluginError>,
    ) {
        self.active.retain_mut(|a| {
            if tables && !a.tables {
                return true;
            }
            match call(&mut a.tracker) {
                Ok(()) => true,
                Err(e) if e.kind == ErrorKind::UNSUPPORTED => true,
                Err(e) => {
                    tracing::warn!(
                        "tracker `{}` failed to {what} and is disabled for the rest of the run: {e}",
                        a.name
                    );
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
        if !self.started {
            return;
        }
        self.each("finish", false, |t| t.finish(exit_code));
    }
}
