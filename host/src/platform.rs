//! Platform selection: detect every registered device family through one probe context, then pick
//! one. `VERL_PLATFORM` (case-insensitive) wins; otherwise the available family with the highest
//! priority; CPU is the fallback. A detection that panics or overruns its time budget is reported as
//! failed and skipped; a detection that rejects the configuration (e.g. conflicting visible-devices
//! variables) stops selection, because running anyway would silently use the wrong devices.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use verl_plugin_api::{Detection, DeviceInfo, ErrorKind, PluginError, ProbeContext};

use crate::registry::{Component, Registry};

pub const PLATFORM_ENV: &str = "VERL_PLATFORM";
pub const PROBE_ROOT_ENV: &str = "VERL_PROBE_ROOT";
/// Detection reads a few sysfs files; anything slower than this is treated as broken.
pub const DEFAULT_DETECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The real probe: `VERL_PROBE_ROOT` (default `/`) and this process's environment.
pub fn process_probe() -> ProbeContext {
    let root = std::env::var(PROBE_ROOT_ENV)
        .ok()
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "/".to_owned());
    ProbeContext::new(root, std::env::vars())
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceReport {
    pub name: String,
    pub available: bool,
    pub count: u32,
    pub reason: String,
    pub priority: i32,
    pub plugin: String,
    pub origin: String,
    pub vendor: String,
    pub device_type: String,
    pub comm_backend: String,
    pub visible_devices_env: Vec<String>,
    pub device_names: Vec<String>,
    /// Variables to set before compute starts, as `[key, value]`.
    pub env_updates: Vec<(String, String)>,
    /// Why detection failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip)]
    fatal: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlatformError {
    #[error("{PLATFORM_ENV}={value} names no registered platform; valid names: {}", valid.join(", "))]
    UnknownOverride { value: String, valid: Vec<String> },
    #[error("{PLATFORM_ENV} selects `{name}`, but it is not available: {reason}")]
    OverrideUnavailable { name: String, reason: String },
    #[error("platform `{name}`: {message}")]
    Detection { name: String, message: String },
    #[error("platforms {} are all available with priority {priority}; choose one with {PLATFORM_ENV}", names.join(" and "))]
    Ambiguous { names: Vec<String>, priority: i32 },
    #[error("no platform is available (not even cpu)")]
    NoDevice,
}

#[derive(Debug, Clone, Serialize)]
pub struct PlatformReport {
    pub selected: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The `VERL_PLATFORM` value in force, if any.
    #[serde(rename = "override", skip_serializing_if = "Option::is_none")]
    pub override_value: Option<String>,
    pub devices: Vec<DeviceReport>,
    /// Device families whose detection did not finish in time: their threads may still run
    /// plugin code (and read the environment), so the process environment must not change
    /// while they live.
    #[serde(skip)]
    pub unfinished: Vec<String>,
}

impl PlatformReport {
    pub fn selected_device(&self) -> Option<&DeviceReport> {
        let name = self.selected.as_deref()?;
        self.devices.iter().find(|d| d.name == name)
    }
}

type Probed = Result<(DeviceInfo, Detection), PluginError>;

fn probe_one(component: &Component, probe: &ProbeContext) -> Probed {
    let device = component
        .create_device()
        .map_err(|e| PluginError::other(e.to_string()))?;
    let info = device.info()?;
    let detection = device.detect(probe)?;
    Ok((info, detection))
}

/// Detects every device family concurrently, each within `timeout`, and selects the platform.
pub fn detect_platform(
    registry: &Registry,
    probe: &ProbeContext,
    timeout: Duration,
) -> (PlatformReport, Result<String, PlatformError>) {
    let devices = registry.devices();
    let (tx, rx) = mpsc::channel::<(usize, Probed)>();
    let mut threads = Vec::new();
    for (index, (_, resolved)) in devices.iter().enumerate() {
        if let Ok(component) = resolved {
            let name = component.name.clone();
            let (tx, component, probe) = (tx.clone(), component.clone(), probe.clone());
            // A hung detection keeps its thread; it is detached and dies with the process.
            let spawned = std::thread::Builder::new()
                .name(format!("detect-{name}"))
                .spawn(move || drop(tx.send((index, probe_one(&component, &probe)))));
            match spawned {
                Ok(handle) => threads.push((index, handle)),
                Err(e) => tracing::warn!("cannot start detection of {name}: {e}"),
            }
        }
    }
    drop(tx);
    let mut results: Vec<Option<Probed>> = (0..devices.len()).map(|_| None).collect();
    let deadline = Instant::now() + timeout;
    while let Ok((index, probed)) =
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
    {
        results[index] = Some(probed);
    }
    // A detection that reported is done but for its thread's exit: joined, so that only the
    // unfinished ones outlive this call.
    let mut unfinished = Vec::new();
    for (index, handle) in threads {
        if results[index].is_some() {
            let _ = handle.join();
        } else {
            unfinished.push(devices[index].0.clone());
        }
    }

    let reports: Vec<DeviceReport> = devices
        .iter()
        .zip(results)
        .map(|((name, resolved), probed)| match resolved {
            Err(lookup) => failed_report(name, None, lookup.to_string(), false),
            Ok(component) => match probed {
                None => failed_report(
                    name,
                    Some(component),
                    format!("detection did not finish within {timeout:?}"),
                    false,
                ),
                Some(Err(e)) => {
                    let fatal = e.kind == ErrorKind::INVALID_CONFIG;
                    let message = if e.kind == ErrorKind::PANIC {
                        format!("detection failed: {e}")
                    } else {
                        e.to_string()
                    };
                    failed_report(name, Some(component), message, fatal)
                }
                Some(Ok((info, detection))) => report(component, info, detection),
            },
        })
        .collect();

    let override_value = probe
        .var(PLATFORM_ENV)
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned);
    let selection = select(&reports, override_value.as_deref());
    let report = PlatformReport {
        selected: selection.as_ref().ok().cloned(),
        error: selection.as_ref().err().map(ToString::to_string),
        override_value,
        devices: reports,
        unfinished,
    };
    (report, selection)
}

fn select(reports: &[DeviceReport], override_value: Option<&str>) -> Result<String, PlatformError> {
    if let Some(value) = override_value {
        let Some(chosen) = reports.iter().find(|r| r.name.eq_ignore_ascii_case(value)) else {
            let mut valid: Vec<String> = reports.iter().map(|r| r.name.clone()).collect();
            valid.sort();
            return Err(PlatformError::UnknownOverride {
                value: value.to_owned(),
                valid,
            });
        };
        if let Some(error) = &chosen.error {
            return Err(PlatformError::Detection {
                name: chosen.name.clone(),
                message: error.clone(),
            });
        }
        if !chosen.available {
            return Err(PlatformError::OverrideUnavailable {
                name: chosen.name.clone(),
                reason: chosen.reason.clone(),
            });
        }
        return Ok(chosen.name.clone());
    }
    if let Some(fatal) = reports.iter().find(|r| r.fatal) {
        return Err(PlatformError::Detection {
            name: fatal.name.clone(),
            message: fatal.error.clone().unwrap_or_default(),
        });
    }
    let available: Vec<&DeviceReport> = reports.iter().filter(|r| r.available).collect();
    let Some(top) = available.iter().map(|r| r.priority).max() else {
        return Err(PlatformError::NoDevice);
    };
    let best: Vec<String> = available
        .iter()
        .filter(|r| r.priority == top)
        .map(|r| r.name.clone())
        .collect();
    match best.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(PlatformError::Ambiguous {
            names: best,
            priority: top,
        }),
    }
}

fn report(component: &Component, info: DeviceInfo, detection: Detection) -> DeviceReport {
    DeviceReport {
        name: component.name.clone(),
        available: detection.available && detection.count > 0,
        count: detection.count,
        reason: detection.reason,
        priority: component.priority,
        plugin: component.plugin.clone(),
        origin: component.origin.describe(),
        vendor: info.vendor,
        device_type: info.device_type,
        comm_backend: info.comm_backend,
        visible_devices_env: info.visible_devices_env,
        device_names: detection.device_names,
        env_updates: detection
            .env_updates
            .into_iter()
            .map(|e| (e.key, e.value))
            .collect(),
        error: None,
        fatal: false,
    }
}

fn failed_report(
    name: &str,
    component: Option<&Component>,
    error: String,
    fatal: bool,
) -> DeviceReport {
    DeviceReport {
        name: name.to_owned(),
        available: false,
        count: 0,
        reason: error.clone(),
        priority: component.map_or(0, |c| c.priority),
        plugin: component.map(|c| c.plugin.clone()).unwrap_or_default(),
        origin: component.map(|c| c.origin.describe()).unwrap_or_default(),
        vendor: String::new(),
        device_type: String::new(),
        comm_backend: String::new(),
        visible_devices_env: Vec::new(),
        device_names: Vec::new(),
        env_updates: Vec::new(),
        error: Some(error),
        fatal,
    }
}
