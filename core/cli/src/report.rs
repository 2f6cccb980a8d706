//! What `plugins list`, `plugins check` and `platform` print: a stable JSON shape for scripts and
//! an aligned table for people.

use std::fmt::Write as _;

use serde::Serialize;
use verl_plugin_host::{PlatformReport, Registry};

#[derive(Debug, Serialize)]
pub struct ComponentJson {
    pub kind: String,
    pub name: String,
    pub priority: i32,
    /// "active", "shadowed" (a higher priority one of the same name wins) or "conflict".
    pub status: &'static str,
    pub description: String,
    /// What the component declares it can do (its kind's capabilities record; `{}` for devices).
    pub capabilities: serde_json::Value,
    /// The plugin-owned config section it reads, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_section: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct PluginJson {
    pub name: String,
    pub version: String,
    pub path: String,
    /// "loaded" or "rejected".
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub description: String,
    pub components: Vec<ComponentJson>,
}

#[derive(Debug, Serialize)]
pub struct ConflictJson {
    pub kind: String,
    pub name: String,
    pub priority: i32,
    pub paths: Vec<String>,
    pub error: String,
}

/// What a `strategy` value runs on the selected platform (see `Registry::resolve_engine`).
#[derive(Debug, Serialize)]
pub struct EngineRouteJson {
    pub strategy: String,
    pub device_type: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plugin: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The `plugins list` document: `{"plugins": [...], "conflicts": [...], "platform": {...},
/// "engines": [...]}`.
#[derive(Debug, Serialize)]
pub struct ListJson<'a> {
    pub plugins: Vec<PluginJson>,
    pub conflicts: Vec<ConflictJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub platform: Option<&'a PlatformReport>,
    /// Each strategy's engine on the selected platform (none without a selection).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<EngineRouteJson>,
}

/// Each strategy's engine on the platform `platform` selected (empty when it selected none).
pub fn engines_json(registry: &Registry, platform: &PlatformReport) -> Vec<EngineRouteJson> {
    let Some(device_type) = platform.selected_device().map(|d| d.device_type.as_str()) else {
        return Vec::new();
    };
    registry
        .engine_routes(device_type)
        .into_iter()
        .map(|(strategy, resolved)| {
            let (engine, plugin, error) = match resolved {
                Ok(c) => (Some(c.name), Some(c.plugin), None),
                Err(e) => (None, None, Some(e.to_string())),
            };
            EngineRouteJson {
                strategy,
                device_type: device_type.to_owned(),
                engine,
                plugin,
                error,
            }
        })
        .collect()
}

/// `Engines on <device type>:` and one `strategy -> engine` line each.
pub fn engines_text(engines: &[EngineRouteJson]) -> String {
    let mut out = String::new();
    let Some(first) = engines.first() else {
        return out;
    };
    let _ = writeln!(
        out,
        "Engines on `{}` (strategy -> engine):",
        first.device_type
    );
    for route in engines {
        let target = match (&route.engine, &route.plugin, &route.error) {
            (Some(engine), Some(plugin), _) => format!("{engine} ({plugin})"),
            (_, _, Some(error)) => format!("none: {error}"),
            _ => String::new(),
        };
        let _ = writeln!(out, "  {:<10} -> {target}", route.strategy);
    }
    out
}

pub fn plugins_json(registry: &Registry) -> Vec<PluginJson> {
    registry
        .plugins()
        .iter()
        .map(|p| PluginJson {
            name: p.name.clone(),
            version: p.version.clone(),
            path: p.origin.describe(),
            status: if p.status.is_ok() {
                "loaded"
            } else {
                "rejected"
            },
            error: p.status.as_ref().err().map(ToString::to_string),
            description: p.description.clone(),
            components: p
                .components
                .iter()
                .map(|c| ComponentJson {
                    kind: c.kind.to_string(),
                    name: c.name.clone(),
                    priority: c.priority,
                    status: registry.status(c).as_str(),
                    description: c.description.clone(),
                    capabilities: match &c.capabilities {
                        serde_json::Value::Null => serde_json::json!({}),
                        declared => declared.clone(),
                    },
                    config_section: c.config_section.clone(),
                })
                .collect(),
        })
        .collect()
}

pub fn conflicts_json(registry: &Registry) -> Vec<ConflictJson> {
    registry
        .conflicts()
        .into_iter()
        .map(|c| ConflictJson {
            kind: c.kind.to_string(),
            name: c.name.clone(),
            priority: c.priority,
            paths: c.origins.iter().map(|o| o.describe()).collect(),
            error: c.message(),
        })
        .collect()
}

/// A capabilities object as `key=value` pairs, nested records flattened to dotted keys (empty
/// lists and records left out), for `--verbose`.
fn capability_pairs(prefix: &str, value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                capability_pairs(&key, v, out);
            }
        }
        serde_json::Value::Array(items) if items.is_empty() => {}
        serde_json::Value::Array(items) => {
            let items: Vec<String> = items
                .iter()
                .map(|i| i.as_str().map_or(i.to_string(), str::to_owned))
                .collect();
            out.push(format!("{prefix}={}", items.join(",")));
        }
        serde_json::Value::String(text) => out.push(format!("{prefix}={text}")),
        serde_json::Value::Null => {}
        other => out.push(format!("{prefix}={other}")),
    }
}

/// The first line of `text`, cut to `max` characters.
fn one_line(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or_default().trim();
    if line.chars().count() <= max {
        return line.to_owned();
    }
    let cut: String = line.chars().take(max.saturating_sub(1)).collect();
    format!("{cut}…")
}

/// The plugins table: one line per plugin and one per component (kind, name, priority, status,
/// description); `verbose` adds each component's config section and declared capabilities as
/// `key=value` lines (the JSON view has them as records).
pub fn plugins_text(plugins: &[PluginJson], conflicts: &[ConflictJson], verbose: bool) -> String {
    let mut out = String::new();
    let loaded = plugins.iter().filter(|p| p.status == "loaded").count();
    let _ = writeln!(
        out,
        "Plugins: {loaded} loaded, {} rejected",
        plugins.len() - loaded
    );
    for p in plugins {
        match &p.error {
            None => {
                let _ = writeln!(out, "  [loaded]   {} {}  {}", p.name, p.version, p.path);
                for c in &p.components {
                    let note = if c.status == "active" {
                        String::new()
                    } else {
                        format!(" ({})", c.status)
                    };
                    let _ = writeln!(
                        out,
                        "      {:<10} {:<14} priority {:>4}{note}  {}",
                        c.kind,
                        c.name,
                        c.priority,
                        one_line(&c.description, 72)
                    );
                    if verbose {
                        if let Some(section) = &c.config_section {
                            let _ = writeln!(out, "          config section: {section}");
                        }
                        let mut pairs = Vec::new();
                        capability_pairs("", &c.capabilities, &mut pairs);
                        for pair in pairs {
                            let _ = writeln!(out, "          {pair}");
                        }
                    }
                }
            }
            Some(error) => {
                let _ = writeln!(out, "  [rejected] {}", p.path);
                for line in error.lines() {
                    let _ = writeln!(out, "      {line}");
                }
            }
        }
    }
    for c in conflicts {
        let _ = writeln!(out, "  conflict: {}", c.error);
    }
    if !verbose && plugins.iter().any(|p| !p.components.is_empty()) {
        let _ = writeln!(
            out,
            "  (--verbose: each component's capabilities; --json: everything as JSON)"
        );
    }
    out
}

pub fn platform_text(report: &PlatformReport) -> String {
    let mut out = String::new();
    match (&report.selected, &report.error) {
        (Some(name), _) => {
            let how = report
                .override_value
                .as_ref()
                .map_or("highest-priority available".to_owned(), |v| {
                    format!("VERL_PLATFORM={v}")
                });
            let _ = writeln!(out, "Platform: {name} ({how})");
        }
        (None, Some(error)) => {
            let _ = writeln!(out, "Platform: none selected: {error}");
        }
        (None, None) => {}
    }
    let _ = writeln!(
        out,
        "  {:<10} {:<9} {:>5} {:>8}  {:<8} {:<6} REASON",
        "DEVICE", "AVAILABLE", "COUNT", "PRIORITY", "VENDOR", "COMM"
    );
    for d in &report.devices {
        let mark = if report.selected.as_deref() == Some(d.name.as_str()) {
            "*"
        } else {
            " "
        };
        let _ = writeln!(
            out,
            "{mark} {:<10} {:<9} {:>5} {:>8}  {:<8} {:<6} {}",
            d.name,
            if d.available { "yes" } else { "no" },
            d.count,
            d.priority,
            d.vendor,
            d.comm_backend,
            d.reason
        );
        if !d.device_names.is_empty() {
            let _ = writeln!(out, "  {:<10} devices: {}", "", d.device_names.join(", "));
        }
        for (k, v) in &d.env_updates {
            let _ = writeln!(out, "  {:<10} sets {k}={v}", "");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn plugin(capabilities: serde_json::Value) -> PluginJson {
        PluginJson {
            name: "p".into(),
            version: "1.0.0".into(),
            path: "/x/libp.so".into(),
            status: "loaded",
            error: None,
            description: "a plugin".into(),
            components: vec![ComponentJson {
                kind: "engine".into(),
                name: "fsdp".into(),
                priority: 100,
                status: "active",
                description: "verl's FSDP engine\nsecond line".into(),
                capabilities,
                config_section: Some("fsdp_config".into()),
            }],
        }
    }

    /// One readable line per component; no JSON in the text view, the capabilities only under
    /// --verbose, nested records as dotted keys.
    #[test]
    fn the_text_view_has_one_line_per_component() {
        let caps = json!({"roles": ["actor", "ref"], "max_world_size": 64,
            "limits": {"tokens": 8, "sizes": []}, "devices": []});
        let plugins = [plugin(caps)];
        let short = plugins_text(&plugins, &[], false);
        let line = short.lines().find(|l| l.contains("fsdp")).unwrap();
        assert!(
            line.contains("priority  100") && line.ends_with("verl's FSDP engine"),
            "{short}"
        );
        assert!(!short.contains('{') && !short.contains("roles"), "{short}");
        assert!(!short.contains("second line"), "{short}");
        let long = plugins_text(&plugins, &[], true);
        for wanted in [
            "config section: fsdp_config",
            "roles=actor,ref",
            "max_world_size=64",
            "limits.tokens=8",
        ] {
            assert!(long.contains(wanted), "`{wanted}` missing:\n{long}");
        }
        assert!(
            !long.contains("devices=") && !long.contains("sizes"),
            "{long}"
        );
        assert!(!long.contains('{'), "{long}");
    }

    #[test]
    fn long_descriptions_are_cut() {
        assert_eq!(one_line("abc", 3), "abc");
        assert_eq!(one_line("abcd", 3), "ab…");
        assert_eq!(one_line("", 3), "");
    }
}
