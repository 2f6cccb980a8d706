//! The delivery layer every tracker shares: a [`Backend`] only talks to its tool; [`Managed`] turns
//! it into a [`Tracker`] that never blocks training and never loses a metric.
//!
//! - `log` copies the metrics into a bounded queue and returns; one sender thread per tracker
//!   drains it, gathering queued steps into requests of at most [`Backend::max_metrics`] metrics.
//! - Full queue: the call waits up to `enqueue_timeout_ms` for room, then writes that call's
//!   metrics to the spill file itself (a local append), so a slow server costs a step at most that
//!   wait and nothing is dropped.
//! - A request failing with a transient error (network, 5xx, 429) is retried `retries` times with
//!   doubling delays; when it still fails its metrics are spilled and the backend rests (no
//!   requests, spill directly) for a doubling period before the next try, so a dead server does
//!   not stall the queue. A 4xx is not retried. The first failed request is warned about at once
//!   (not after its retries), with its reason and the spill file's path; later ones are debug logs.
//! - `finish` (and `Drop`, for paths that never reach it, like Ctrl-C unwinding) gives the sender
//!   `finish_timeout_s` to deliver what is queued (with one fresh try even while resting) and to
//!   close the run, and returns by then whatever the server does: when time is up it takes over
//!   the request in flight and the queue and spills them, leaving the sender to its request. It
//!   reports what was spilled, and where.
//! - A resumed run (`ComponentInit::resume_step`) cuts the spill and tables files back to the lines
//!   of steps up to the resume step: later ones were left by the interrupted attempt, whose steps
//!   are trained again. A run from scratch starts the tables file over (it is the run's record of
//!   tables) and keeps the spill file (what an earlier run could not deliver is still its data).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, SendTimeoutError, Sender, TrySendError};
use serde_json::{Map, Value, json};
use verl_plugin_api::{ComponentInit, Metric, PluginError, Table, Tracker, TrackerCapabilities};

use crate::TrackerError;
use crate::config::{Context, Delivery, json_number, unix_seconds};

/// One log call: a step's metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub step: u64,
    /// Seconds since the Unix epoch, taken when `log` was called.
    pub wall_time: f64,
    pub metrics: Vec<(String, f64)>,
}

/// The part of a tracker that talks to its tool. Called only from the sender thread.
pub trait Backend: Sized + Send + 'static {
    /// The component name, also the config key of its settings.
    const NAME: &'static str;
    /// Reads settings; no I/O (that belongs in `open`, which is retried).
    fn create(ctx: &Context) -> Result<Self, PluginError>;
    /// The most metrics one `send` may carry (a server's per-request limit).
    fn max_metrics(&self) -> usize {
        usize::MAX
    }
    /// Creates the run (experiment, files, …). Called before the first send; retried until it
    /// succeeds.
    fn open(&mut self) -> Result<(), TrackerError>;
    fn send(&mut self, rows: &[Row]) -> Result<(), TrackerError>;
    /// [`TrackerError::NoTables`] sends the table to a side file next to the spill file.
    fn send_table(&mut self, _step: u64, _table: &Table) -> Result<(), TrackerError> {
        Err(TrackerError::NoTables)
    }
    /// Marks the run finished (`exit_code` 0) or failed.
    fn close(&mut self, exit_code: i32) -> Result<(), TrackerError>;
}

/// Warns through `tracing` when the host installed a subscriber, else on stderr: a cdylib has its
/// own copy of tracing's globals, so a warning could otherwise vanish.
pub fn warn(message: &str) {
    if tracing::dispatcher::has_been_set() {
        tracing::warn!("{message}");
    } else {
        eprintln!("WARN verl-trackers: {message}");
    }
}

/// Gathered steps per round of requests: bounds the sender's working memory.
const GATHER_METRICS: usize = 50_000;
/// Longest rest after repeated failures.
const MAX_REST: Duration = Duration::from_secs(30);

enum Msg {
    Row(Row),
    Table(u64, f64, Table),
    Finish(i32, Sender<()>),
}

/// What the sender thread is delivering, where `finish` can take it over when its time is up.
#[derive(Debug)]
enum Pending {
    Rows(Vec<Row>),
    Table(u64, f64, Table),
    Close(i32),
}

/// The request in flight, and whether `finish` gave up on the sender thread.
#[derive(Debug, Default)]
struct Handover {
    pending: Option<Pending>,
    /// Set by `finish` when time was up: it spilled what the sender held and reported the run's end.
    abandoned: bool,
    /// The run was closed (or closing it failed and was recorded).
    closed: bool,
}

/// The JSONL file of whatever could not be delivered, opened on first use. One line per step or
/// table: `{"tracker", "step", "wall_time", "metrics": {key: number | "NaN" | "Infinity" | "-Infinity"}
/// | "table": {name, columns, rows}, "reason"}`, and a `"finish"` line when closing the run failed.
#[derive(Debug)]
struct Spill {
    tracker: &'static str,
    path: PathBuf,
    file: Option<BufWriter<File>>,
    metrics: usize,
    tables: usize,
}

impl Spill {
    fn append(
        path: &Path,
        file: &mut Option<BufWriter<File>>,
        line: &Value,
    ) -> std::io::Result<()> {
        if file.is_none() {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            *file = Some(BufWriter::new(
                OpenOptions::new().create(true).append(true).open(path)?,
            ));
        }
        let out = file.as_mut().expect("opened above");
        serde_json::to_writer(&mut *out, line)?;
        out.write_all(b"\n")?;
        // Flushed per line: the spill exists for crashes too.
        out.flush()
    }

    fn write(&mut self, mut line: Map<String, Value>, reason: &str) -> bool {
        line.insert("tracker".into(), self.tracker.into());
        line.insert("reason".into(), reason.into());
        match Self::append(&self.path, &mut self.file, &Value::Object(line)) {
            Ok(()) => true,
            Err(e) => {
                warn(&format!(
                    "{}: cannot write the spill file {}: {e}; data lost",
                    self.tracker,
                    self.path.display()
                ));
                false
            }
        }
    }

    fn rows(&mut self, rows: &[Row], reason: &str) {
        for row in rows {
            let metrics: Map<String, Value> = row
                .metrics
                .iter()
                .map(|(k, v)| (k.clone(), json_number(*v)))
                .collect();
            let line = json!({"step": row.step, "wall_time": row.wall_time, "metrics": metrics});
            if self.write(into_map(line), reason) {
                self.metrics += row.metrics.len();
            }
        }
    }

    fn table(&mut self, step: u64, wall_time: f64, table: &Table, reason: &str) {
        if self.write(
            into_map(json!({"step": step, "wall_time": wall_time, "table": table})),
            reason,
        ) {
            self.tables += 1;
        }
    }

    /// The run could not be closed.
    fn finish(&mut self, exit_code: i32, reason: &str) {
        self.write(
            into_map(json!({"finish": {"exit_code": exit_code}})),
            reason,
        );
    }

    fn pending(&mut self, pending: Pending, reason: &str) {
        match pending {
            Pending::Rows(rows) => self.rows(&rows, reason),
            Pending::Table(step, wall_time, table) => self.table(step, wall_time, &table, reason),
            Pending::Close(exit_code) => self.finish(exit_code, reason),
        }
    }
}

/// Cuts a JSONL file of `{"step", …}` lines back to its lines of steps up to `last` (to nothing
/// when `None`): from the first later step, torn line (a kill during a write) or unreadable line
/// on, the rest goes. Lines without a step (a failed close) stay. A missing file stays missing.
fn cut_after(path: &Path, last: Option<u64>) -> std::io::Result<()> {
    let file = match OpenOptions::new().read(true).write(true).open(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        opened => opened?,
    };
    let mut keep = 0u64;
    if let Some(last) = last {
        let mut reader = BufReader::new(&file);
        let mut line = Vec::new();
        loop {
            line.clear();
            let read = reader.read_until(b'\n', &mut line)?;
            let kept = line.ends_with(b"\n")
                && serde_json::from_slice::<Value>(&line).is_ok_and(|v| {
                    v.get("step")
                        .is_none_or(|s| s.as_u64().is_some_and(|s| s <= last))
                });
            if !kept {
                break;
            }
            keep += read as u64;
        }
    }
    if keep < file.metadata()?.len() {
        file.set_len(keep)?;
    }
    Ok(())
}

fn into_map(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => unreachable!("built with json!({{…}})"),
    }
}

/// A panic while a lock was held leaves the data usable (whole lines, counters), so a poisoned
/// lock is taken anyway: losing the spill file would lose metrics.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// State shared by the training thread and the sender thread.
#[derive(Debug)]
struct Shared {
    name: &'static str,
    spill: Mutex<Spill>,
    /// Tables of backends without tables, next to the spill file.
    tables: Mutex<Spill>,
    warned: AtomicBool,
    /// Set by `finish`: past it, the sender spills instead of sending.
    deadline: Mutex<Option<Instant>>,
    handover: Mutex<Handover>,
}

impl Shared {
    fn spill(&self) -> MutexGuard<'_, Spill> {
        lock(&self.spill)
    }

    fn tables(&self) -> MutexGuard<'_, Spill> {
        lock(&self.tables)
    }

    fn deadline(&self) -> Option<Instant> {
        *lock(&self.deadline)
    }

    fn warn_once(&self, reason: &dyn std::fmt::Display) {
        if self.warned.swap(true, Ordering::Relaxed) {
            tracing::debug!("{}: {reason}", self.name);
        } else {
            let path = self.spill().path.display().to_string();
            warn(&format!(
                "{}: {reason}; the run goes on (failed requests are retried), and what {} cannot take is written to {path}",
                self.name, self.name
            ));
        }
    }

    /// The sender starts delivering `pending`; false (and `pending` comes back) when `finish` gave
    /// up on the sender, which then spills instead.
    fn begin(&self, pending: Pending) -> Result<(), Pending> {
        let mut handover = lock(&self.handover);
        if handover.abandoned {
            return Err(pending);
        }
        handover.pending = Some(pending);
        Ok(())
    }

    /// The sender is done with what it began; false when `finish` took it over (and spilled it).
    fn end(&self) -> bool {
        let mut handover = lock(&self.handover);
        match handover.pending.take() {
            Some(Pending::Close(_)) => {
                handover.closed = true;
                true
            }
            Some(_) => true,
            None => false,
        }
    }

    /// `finish`'s time is up: spills what the sender holds and what is queued, and records the run
    /// as not closed unless it was.
    fn take_over(&self, queue: &Receiver<Msg>, exit_code: i32) {
        let (pending, closed) = {
            let mut handover = lock(&self.handover);
            handover.abandoned = true;
            (handover.pending.take(), handover.closed)
        };
        let reason = "finish_timeout_s passed before the server took it";
        let mut spill = self.spill();
        let closing = matches!(pending, Some(Pending::Close(_)));
        if let Some(pending) = pending {
            spill.pending(pending, reason);
        }
        if !closed && !closing {
            spill.finish(exit_code, reason);
        }
        drop(spill);
        for msg in queue.try_iter() {
            match msg {
                Msg::Row(row) => self.spill().rows(&[row], reason),
                Msg::Table(step, wall_time, table) => {
                    self.spill().table(step, wall_time, &table, reason)
                }
                Msg::Finish(..) => {}
            }
        }
    }
}

/// A [`Tracker`] made of a [`Backend`] and the delivery layer.
pub struct Managed<B: Backend> {
    running: Option<Running>,
    // fn() -> B: Managed owns no B (the sender thread does), so it is Send whatever B is.
    backend: PhantomData<fn() -> B>,
}

struct Running {
    tx: Sender<Msg>,
    /// The queue's other end, for `finish` to empty when the sender does not in time.
    rx: Receiver<Msg>,
    shared: Arc<Shared>,
    worker: JoinHandle<()>,
    delivery: Delivery,
}

impl<B: Backend> Default for Managed<B> {
    fn default() -> Self {
        Self {
            running: None,
            backend: PhantomData,
        }
    }
}

impl<B: Backend> Managed<B> {
    pub fn new() -> Self {
        Self::default()
    }

    fn running(&self) -> Result<&Running, PluginError> {
        self.running.as_ref().ok_or_else(|| {
            PluginError::other(format!(
                "tracker `{}` is not initialised or already finished",
                B::NAME
            ))
        })
    }

    /// Queues a message; when the queue stays full, spills it from the calling thread instead.
    fn enqueue(&self, msg: Msg) -> Result<(), PluginError> {
        let running = self.running()?;
        let msg = match running.tx.try_send(msg) {
            Ok(()) => return Ok(()),
            Err(TrySendError::Full(m)) => {
                match running.tx.send_timeout(
                    m,
                    Duration::from_millis(running.delivery.enqueue_timeout_ms),
                ) {
                    Ok(()) => return Ok(()),
                    Err(SendTimeoutError::Timeout(m) | SendTimeoutError::Disconnected(m)) => m,
                }
            }
            Err(TrySendError::Disconnected(m)) => m,
        };
        let reason = "the queue to the sender thread was full (the server is slower than training)";
        running.shared.warn_once(&reason);
        let mut spill = running.shared.spill();
        match msg {
            Msg::Row(row) => spill.rows(&[row], reason),
            Msg::Table(step, wall_time, table) => spill.table(step, wall_time, &table, reason),
            Msg::Finish(..) => unreachable!("finish is not queued through enqueue"),
        }
        Ok(())
    }

    fn stop(&mut self, exit_code: i32) {
        let Some(running) = self.running.take() else {
            return;
        };
        let finish = running.delivery.finish_timeout();
        let deadline = Instant::now() + finish;
        *lock(&running.shared.deadline) = Some(deadline);
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        let finished = running
            .tx
            .send_deadline(Msg::Finish(exit_code, done_tx), deadline)
            .is_ok()
            && done_rx.recv_deadline(deadline).is_ok();
        let name = B::NAME;
        if finished {
            let _ = running.worker.join();
        } else {
            // A request in flight may run to its own timeout: the sender is left to it (the
            // process may end first), and what it held is spilled here.
            running.shared.take_over(&running.rx, exit_code);
            warn(&format!(
                "{name}: the server did not take the rest of the run within finish_timeout_s={}; the run is not marked finished",
                running.delivery.finish_timeout_s
            ));
        }
        let spill = running.shared.spill();
        let tables = running.shared.tables();
        if tables.tables > 0 {
            tracing::info!(
                "{name}: {} validation tables written to {}",
                tables.tables,
                tables.path.display()
            );
        }
        if spill.metrics > 0 || spill.tables > 0 {
            warn(&format!(
                "{name}: {} metrics and {} tables could not be delivered; they are in {}",
                spill.metrics,
                spill.tables,
                spill.path.display()
            ));
        }
    }
}

impl<B: Backend> Tracker for Managed<B> {
    fn capabilities() -> TrackerCapabilities {
        TrackerCapabilities::default().tables(true)
    }

    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        if self.running.is_some() {
            return Err(PluginError::other(format!(
                "tracker `{}` is already initialised",
                B::NAME
            )));
        }
        let ctx = Context::new(B::NAME, init)?;
        let backend = B::create(&ctx)?;
        let delivery = ctx.delivery.clone();
        let spill_path = delivery
            .spill_path
            .clone()
            .unwrap_or_else(|| ctx.run_dir.join(format!("{}-spill.jsonl", B::NAME)));
        let tables_path = spill_path.with_file_name(format!("{}-tables.jsonl", B::NAME));
        let cut = |path: &Path, after: Option<u64>| {
            cut_after(path, after).map_err(|e| {
                PluginError::other(format!("tracker `{}`: {}: {e}", B::NAME, path.display()))
            })
        };
        if ctx.resume_step.is_some() {
            cut(&spill_path, ctx.resume_step)?;
        }
        cut(&tables_path, ctx.resume_step)?;
        let spill = |path| {
            Mutex::new(Spill {
                tracker: B::NAME,
                path,
                file: None,
                metrics: 0,
                tables: 0,
            })
        };
        let shared = Arc::new(Shared {
            name: B::NAME,
            spill: spill(spill_path),
            tables: spill(tables_path),
            warned: AtomicBool::new(false),
            deadline: Mutex::new(None),
            handover: Mutex::default(),
        });
        let (tx, rx) = crossbeam_channel::bounded(delivery.queue_capacity.max(1));
        let rx_for_finish = rx.clone();
        let courier = Courier {
            backend,
            opened: false,
            broken: None,
            shared: shared.clone(),
            rest: delivery.backoff(),
            resting_until: None,
            finish_seen: false,
            delivery: delivery.clone(),
        };
        let worker = std::thread::Builder::new()
            .name(format!("verl-tracker-{}", B::NAME))
            .spawn(move || courier.run(rx))
            .map_err(|e| {
                PluginError::other(format!(
                    "tracker `{}`: cannot start its sender thread: {e}",
                    B::NAME
                ))
            })?;
        self.running = Some(Running {
            tx,
            rx: rx_for_finish,
            shared,
            worker,
            delivery,
        });
        Ok(())
    }

    fn log(&mut self, step: u64, metrics: &[Metric]) -> Result<(), PluginError> {
        if metrics.is_empty() {
            return Ok(());
        }
        let metrics = metrics
            .iter()
            .map(|m| (m.key.to_string(), m.value))
            .collect();
        self.enqueue(Msg::Row(Row {
            step,
            wall_time: unix_seconds(),
            metrics,
        }))
    }

    fn log_table(&mut self, step: u64, table: &Table) -> Result<(), PluginError> {
        self.enqueue(Msg::Table(step, unix_seconds(), table.clone()))
    }

    fn finish(&mut self, exit_code: i32) -> Result<(), PluginError> {
        self.running()?;
        self.stop(exit_code);
        Ok(())
    }
}

impl<B: Backend> Drop for Managed<B> {
    /// Not finished: the run ended abnormally (a panic, an interrupt), so it is closed as failed.
    fn drop(&mut self) {
        self.stop(1);
    }
}

/// The sender thread's state.
struct Courier<B> {
    backend: B,
    opened: bool,
    /// Set when `open` failed for a reason retrying cannot fix: everything is spilled.
    broken: Option<String>,
    shared: Arc<Shared>,
    delivery: Delivery,
    /// The next rest after a request failed all its retries.
    rest: Duration,
    resting_until: Option<Instant>,
    finish_seen: bool,
}

impl<B: Backend> Courier<B> {
    fn run(mut self, rx: Receiver<Msg>) {
        let mut rows: Vec<Row> = Vec::new();
        let mut gathered = 0;
        // Ends when every sender is gone, which `stop` never lets happen before a Finish.
        while let Ok(first) = rx.recv() {
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Row(row) => {
                        gathered += row.metrics.len();
                        rows.push(row);
                        if gathered < GATHER_METRICS {
                            next = rx.try_recv().ok();
                        }
                    }
                    Msg::Table(step, wall_time, table) => {
                        self.deliver(std::mem::take(&mut rows));
                        self.table(step, wall_time, &table);
                    }
                    Msg::Finish(exit_code, done) => {
                        self.deliver(std::mem::take(&mut rows));
                        self.close(exit_code);
                        let _ = done.send(());
                        return;
                    }
                }
            }
            self.deliver(std::mem::take(&mut rows));
            gathered = 0;
        }
    }

    /// Runs `request` for `pending` (a copy of what it sends), which `finish` may take over
    /// meanwhile. None: `finish` has it (and spilled it); else what the request gave, or why it
    /// was not sent.
    fn tracked<T>(
        &mut self,
        pending: Pending,
        force: bool,
        request: impl FnMut(&mut B) -> Result<T, TrackerError>,
    ) -> Option<Result<T, TrackerError>> {
        if let Err(pending) = self.shared.begin(pending) {
            if !matches!(pending, Pending::Close(_)) {
                self.shared
                    .spill()
                    .pending(pending, "finish_timeout_s passed");
            }
            return None;
        }
        let outcome = self.attempt(force, request);
        self.shared.end().then_some(outcome)
    }

    fn deliver(&mut self, rows: Vec<Row>) {
        for chunk in chunks(rows, self.backend.max_metrics()) {
            let pending = Pending::Rows(chunk.clone());
            if let Some(Err(e)) = self.tracked(pending, false, |b| b.send(&chunk)) {
                self.shared.spill().rows(&chunk, &e.to_string());
            }
        }
    }

    fn table(&mut self, step: u64, wall_time: f64, table: &Table) {
        let pending = Pending::Table(step, wall_time, table.clone());
        match self.tracked(pending, false, |b| b.send_table(step, table)) {
            None | Some(Ok(())) => {}
            Some(Err(TrackerError::NoTables)) => {
                self.shared
                    .tables()
                    .table(step, wall_time, table, "this tool has no tables");
            }
            Some(Err(e)) => self
                .shared
                .spill()
                .table(step, wall_time, table, &e.to_string()),
        }
    }

    fn close(&mut self, exit_code: i32) {
        let outcome = self.tracked(Pending::Close(exit_code), true, |b| b.close(exit_code));
        if let Some(Err(e)) = outcome {
            warn(&format!(
                "{}: could not close the run (exit code {exit_code}): {e}",
                B::NAME
            ));
            self.shared.spill().finish(exit_code, &e.to_string());
        }
    }

    /// Runs one request with retries, opening the run first if needed. `force` ignores a rest
    /// (closing the run is worth one more try).
    fn attempt<T>(
        &mut self,
        force: bool,
        mut request: impl FnMut(&mut B) -> Result<T, TrackerError>,
    ) -> Result<T, TrackerError> {
        if let Some(reason) = &self.broken {
            return Err(TrackerError::Skipped(reason.clone()));
        }
        let deadline = self.shared.deadline();
        if deadline.is_some() && !self.finish_seen {
            // `finish` gives a resting backend one fresh try.
            self.finish_seen = true;
            self.resting_until = None;
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Err(TrackerError::Skipped("finish_timeout_s passed".into()));
        }
        if !force && self.resting_until.is_some_and(|until| now < until) {
            return Err(TrackerError::Skipped(
                "resting after repeated failures".into(),
            ));
        }
        if !self.opened {
            match self.retrying(deadline, |b| b.open()) {
                Ok(()) => self.opened = true,
                Err(e) => {
                    if !e.is_transient() {
                        self.broken = Some(format!("could not start the run: {e}"));
                    }
                    return Err(e);
                }
            }
        }
        self.retrying(deadline, &mut request)
    }

    fn retrying<T>(
        &mut self,
        deadline: Option<Instant>,
        mut request: impl FnMut(&mut B) -> Result<T, TrackerError>,
    ) -> Result<T, TrackerError> {
        let mut delay = self.delivery.backoff();
        let mut retries = 0;
        loop {
            // A panicking backend must not take the queue down with it: its request is spilled
            // like any failure, and the backend is not used again.
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                request(&mut self.backend)
            }))
            .unwrap_or_else(|_| Err(TrackerError::Panicked));
            let error = match outcome {
                Ok(value) => {
                    self.rest = self.delivery.backoff();
                    self.resting_until = None;
                    return Ok(value);
                }
                Err(e) => e,
            };
            // Warned at the first failure, not after the retries: against a server that accepts
            // connections and never answers, those take minutes.
            if !matches!(error, TrackerError::NoTables) {
                self.shared.warn_once(&error);
            }
            let in_time = deadline.is_none_or(|d| Instant::now() + delay < d);
            if error.is_transient() && retries < self.delivery.retries && in_time {
                tracing::debug!("{}: {error}; retrying in {delay:?}", B::NAME);
                std::thread::sleep(delay);
                delay *= 2;
                retries += 1;
                continue;
            }
            if matches!(error, TrackerError::Panicked) {
                self.broken = Some(error.to_string());
            }
            if error.is_transient() {
                self.resting_until = Some(Instant::now() + self.rest);
                self.rest = (self.rest * 2).min(MAX_REST);
            }
            return Err(error);
        }
    }
}

/// Splits rows into requests of at most `max` metrics, splitting a step across requests if it alone
/// is larger.
fn chunks(rows: Vec<Row>, max: usize) -> Vec<Vec<Row>> {
    let max = max.max(1);
    let mut out = Vec::new();
    let mut current = Vec::new();
    let mut filled = 0;
    for Row {
        step,
        wall_time,
        mut metrics,
    } in rows
    {
        while !metrics.is_empty() {
            if filled == max {
                out.push(std::mem::take(&mut current));
                filled = 0;
            }
            let rest = metrics.split_off(metrics.len().min(max - filled));
            filled += metrics.len();
            current.push(Row {
                step,
                wall_time,
                metrics,
            });
            metrics = rest;
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(step: u64, n: usize) -> Row {
        Row {
            step,
            wall_time: 0.0,
            metrics: (0..n).map(|i| (format!("m{i}"), i as f64)).collect(),
        }
    }

    #[test]
    fn chunks_respect_the_limit_and_keep_every_metric() {
        let chunks = chunks(vec![row(0, 3), row(1, 2500), row(2, 1)], 1000);
        let sizes: Vec<usize> = chunks
            .iter()
            .map(|c| c.iter().map(|r| r.metrics.len()).sum())
            .collect();
        assert_eq!(sizes, vec![1000, 1000, 504]);
        let steps: Vec<Vec<u64>> = chunks
            .iter()
            .map(|c| c.iter().map(|r| r.step).collect())
            .collect();
        assert_eq!(steps, vec![vec![0, 1], vec![1], vec![1, 2]]);
        let keys: Vec<&str> = chunks
            .iter()
            .flatten()
            .filter(|r| r.step == 1)
            .flat_map(|r| r.metrics.iter().map(|m| m.0.as_str()))
            .collect();
        assert_eq!(keys.len(), 2500);
        assert_eq!(keys[2499], "m2499");
    }

    /// A backend that records what it is sent, as its settings tell it: after `sleep_ms` each,
    /// failing transiently or permanently, or panicking.
    struct Fake {
        sent: Arc<Mutex<Vec<Row>>>,
        mode: String,
        sleep_ms: u64,
    }

    /// What each test's fake backend received, by project.
    type Sent = Mutex<std::collections::HashMap<String, Arc<Mutex<Vec<Row>>>>>;
    /// (step, key) of each metric.
    type Keys = Vec<(u64, String)>;

    fn registry() -> &'static Sent {
        static SENT: std::sync::OnceLock<Sent> = std::sync::OnceLock::new();
        SENT.get_or_init(Default::default)
    }

    impl Backend for Fake {
        const NAME: &'static str = "fake";
        fn create(ctx: &Context) -> Result<Self, PluginError> {
            let sent = registry()
                .lock()
                .unwrap()
                .entry(ctx.project.clone())
                .or_default()
                .clone();
            let mode = ctx.section["mode"].as_str().unwrap_or("ok").to_owned();
            Ok(Self {
                sent,
                mode,
                sleep_ms: ctx.section["sleep_ms"].as_u64().unwrap_or(0),
            })
        }
        fn max_metrics(&self) -> usize {
            3
        }
        fn open(&mut self) -> Result<(), TrackerError> {
            Ok(())
        }
        fn send(&mut self, rows: &[Row]) -> Result<(), TrackerError> {
            std::thread::sleep(Duration::from_millis(self.sleep_ms));
            match self.mode.as_str() {
                "down" => Err(TrackerError::Unreachable {
                    url: "x".into(),
                    reason: "refused".into(),
                }),
                "reject" => Err(TrackerError::Http {
                    url: "x".into(),
                    status: 400,
                    body: "bad".into(),
                }),
                "panic" => panic!("fake backend panics"),
                _ => {
                    self.sent.lock().unwrap().extend_from_slice(rows);
                    Ok(())
                }
            }
        }
        fn close(&mut self, _exit_code: i32) -> Result<(), TrackerError> {
            Ok(())
        }
    }

    /// Logs `steps` steps of 5 metrics with the given settings; returns (delivered, spilled) as
    /// (step, key) pairs and the wall time of the slowest `log` call.
    fn run(project: &str, settings: Value, steps: u64) -> (Keys, Keys, Duration) {
        let dir =
            std::env::temp_dir().join(format!("verl-trackers-{project}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut section = json!({"backoff_ms": 1, "retries": 2});
        section
            .as_object_mut()
            .unwrap()
            .extend(settings.as_object().unwrap().clone());
        let mut run = verl_plugin_api::RunContext::default();
        run.project = project.into();
        run.experiment = "e".into();
        run.run_dir = dir.to_string_lossy().into_owned();
        let init = ComponentInit::new(json!({ "fake": section }), run);
        let mut tracker = Managed::<Fake>::new();
        tracker.init(&init).unwrap();
        let mut slowest = Duration::ZERO;
        for step in 0..steps {
            let metrics: Vec<Metric> = (0..5)
                .map(|i| Metric::new(format!("k{i}"), i as f64))
                .collect();
            let t = Instant::now();
            tracker.log(step, &metrics).unwrap();
            slowest = slowest.max(t.elapsed());
        }
        tracker.finish(0).unwrap();
        let pairs = |rows: &[Row]| {
            rows.iter()
                .flat_map(|r| r.metrics.iter().map(move |m| (r.step, m.0.clone())))
                .collect::<Vec<_>>()
        };
        let delivered = pairs(&registry().lock().unwrap()[project].lock().unwrap());
        let spilled = std::fs::read_to_string(dir.join("fake-spill.jsonl"))
            .unwrap_or_default()
            .lines()
            .flat_map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                let step = v["step"].as_u64();
                v["metrics"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(move |(k, _)| (step.unwrap(), k.clone()))
                    .collect::<Vec<_>>()
            })
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        (delivered, spilled, slowest)
    }

    fn every_metric(steps: u64) -> Keys {
        (0..steps)
            .flat_map(|s| (0..5).map(move |i| (s, format!("k{i}"))))
            .collect()
    }

    #[test]
    fn side_files_are_cut_back_to_the_resume_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x-spill.jsonl");
        let lines = [
            r#"{"step":1,"metrics":{}}"#,
            r#"{"finish":{"exit_code":1}}"#,
            r#"{"step":2,"metrics":{}}"#,
            r#"{"step":3,"metrics":{}}"#,
        ];
        let kept = format!("{}\n", lines[..3].join("\n"));
        // A torn last line (a kill during a write) goes,
        std::fs::write(&path, format!("{kept}{{\"step\":3,")).unwrap();
        cut_after(&path, Some(5)).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), kept);
        // and so do the steps after the resume step.
        std::fs::write(&path, format!("{}\n", lines.join("\n"))).unwrap();
        cut_after(&path, Some(2)).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), kept);
        cut_after(&path, None).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
        let missing = dir.path().join("missing.jsonl");
        cut_after(&missing, Some(1)).unwrap();
        assert!(!missing.exists());
    }

    #[test]
    fn healthy_backend_gets_everything_in_order() {
        let (delivered, spilled, _) = run("healthy", json!({}), 50);
        assert_eq!(delivered, every_metric(50));
        assert!(spilled.is_empty());
    }

    #[test]
    fn a_full_queue_spills_from_the_caller_instead_of_blocking() {
        let (delivered, spilled, slowest) = run(
            "slow",
            json!({"sleep_ms": 200, "queue_capacity": 1, "enqueue_timeout_ms": 5}),
            40,
        );
        assert!(!spilled.is_empty(), "the slow backend cannot keep up");
        // Blocking on the backend would take its 200 ms; the bound leaves room for a loaded
        // machine's scheduling over the 5 ms enqueue timeout.
        assert!(
            slowest < Duration::from_millis(150),
            "log waited {slowest:?}"
        );
        let mut all = [delivered, spilled].concat();
        all.sort();
        assert_eq!(all, {
            let mut e = every_metric(40);
            e.sort();
            e
        });
    }

    /// MLflow at a server that accepts connections and never answers: the first failed request
    /// is warned about while training goes on, `finish` returns within `finish_timeout_s`, and
    /// every step is in the spill file, with the run recorded as not closed.
    #[test]
    fn a_server_that_never_answers_is_warned_about_early_and_bounds_finish() {
        assert!(
            Delivery::default().finish_timeout_s <= 10.0,
            "the documented bound"
        );
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            // Holds every connection open, reading and answering nothing.
            let held: Vec<_> = listener.incoming().collect();
            drop(held);
        });
        let dir = tempfile::tempdir().unwrap();
        let mut run = verl_plugin_api::RunContext::default();
        run.project = "silent".into();
        run.experiment = "e".into();
        run.run_dir = dir.path().to_string_lossy().into_owned();
        let settings = json!({"mlflow": {"tracking_uri": url, "request_timeout_s": 0.5,
            "finish_timeout_s": 1.5, "backoff_ms": 50}});
        let mut tracker = crate::MlflowTracker::new();
        tracker.init(&ComponentInit::new(settings, run)).unwrap();
        let warned = |t: &crate::MlflowTracker| {
            t.running
                .as_ref()
                .unwrap()
                .shared
                .warned
                .load(Ordering::Relaxed)
        };
        let start = Instant::now();
        let mut warned_at = None;
        for step in 0..30 {
            tracker.log(step, &[Metric::new("m", step as f64)]).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            if warned_at.is_none() && warned(&tracker) {
                warned_at = Some(start.elapsed());
            }
        }
        let warned_at = warned_at.expect("warned while training");
        // The first request times out after 0.5 s; its 4 retries would take 2.2 s more.
        assert!(warned_at < Duration::from_millis(1200), "{warned_at:?}");
        let finishing = Instant::now();
        tracker.finish(0).unwrap();
        let took = finishing.elapsed();
        assert!(
            took >= Duration::from_millis(1400) && took < Duration::from_millis(1800),
            "finish took {took:?}"
        );
        let lines: Vec<Value> = std::fs::read_to_string(dir.path().join("mlflow-spill.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let mut steps: Vec<u64> = lines.iter().filter_map(|l| l["step"].as_u64()).collect();
        steps.sort_unstable();
        assert_eq!(steps, (0..30).collect::<Vec<_>>(), "each step spilled once");
        let finish: Vec<&Value> = lines.iter().filter(|l| l.get("finish").is_some()).collect();
        assert_eq!(finish.len(), 1, "{finish:?}");
        assert_eq!(finish[0]["finish"]["exit_code"], 0);
    }

    #[test]
    fn failing_and_panicking_backends_spill_everything() {
        for mode in ["down", "reject", "panic"] {
            let (delivered, mut spilled, _) = run(mode, json!({ "mode": mode }), 10);
            assert!(delivered.is_empty(), "{mode}");
            spilled.sort();
            assert_eq!(spilled, every_metric(10), "{mode}");
        }
    }
}
