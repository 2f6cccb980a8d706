//! Strict parsing of a plugin-owned config section (an engine's `fsdp_config`, a logger's
//! `wandb`, a rollout's `engine_kwargs.<name>`): the host validates verl's own keys and hands each
//! plugin its section as JSON, with where every key came from; [`parse_section`] rejects what the
//! plugin does not know with the same messages as the host's own config errors:
//!
//! ```text
//! unknown config key `actor_rollout_ref.actor.fsdp_config.param_ofload` (from config file run.yaml); did you mean `actor_rollout_ref.actor.fsdp_config.param_offload`?
//! config key `wandb.dir` (from environment variable VERL_WANDB__DIR): invalid type: integer `3`, expected path string
//! ```
//!
//! Unknown keys are found by a round trip: the section is deserialised into `T`, `T` is serialised
//! again, and every key of the input missing from that output is unknown; the output's keys at the
//! same level are the candidates for "did you mean". So plugin types need no annotation beyond
//! `Deserialize + Serialize`, and free-form fields (a `serde_json::Value`, a map) accept any key.
//! What breaks the round trip: `alias` (the output has the primary name only) and
//! `skip_serializing*` on a field users may set. Two types sharing one section: [`parse_section2`].

use std::collections::BTreeMap;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::PluginError;

/// The origin named when the host sent none for a key.
const UNKNOWN_ORIGIN: &str = "unknown source";

/// Parses the section at `section_path` (full dotted path, e.g. `actor_rollout_ref.actor.fsdp_config`)
/// from `json` (empty or `null`: every key takes its default) into `T`. `origins_json` maps full
/// dotted key paths to where their values came from (`config file …`, `environment variable …`,
/// `command-line override …`); it may be empty or `{}`.
///
/// Errors are [`PluginError::invalid_config`]: an unknown key names its full path, its origin and
/// the nearest valid key; a wrong type names the full path, its origin and serde's message.
pub fn parse_section<T: DeserializeOwned + Serialize>(
    section_path: &str,
    json: &str,
    origins_json: &str,
) -> Result<T, PluginError> {
    let section = Section::new(section_path, json, origins_json)?;
    let value: T = section.read()?;
    section.check(&section.known(&value)?)?;
    Ok(value)
}

/// [`parse_section`] for a section that two types share, e.g. settings common to a family of
/// plugins and one plugin's own: each reads the keys it knows, a key neither knows is unknown.
/// (Rather than one type with two `#[serde(flatten)]` fields: serde buffers flattened keys, which
/// loses the key path of a wrong type.)
pub fn parse_section2<A, B>(
    section_path: &str,
    json: &str,
    origins_json: &str,
) -> Result<(A, B), PluginError>
where
    A: DeserializeOwned + Serialize,
    B: DeserializeOwned + Serialize,
{
    let section = Section::new(section_path, json, origins_json)?;
    let (a, b): (A, B) = (section.read()?, section.read()?);
    let mut known = section.known(&a)?;
    merge(&mut known, section.known(&b)?);
    section.check(&known)?;
    Ok((a, b))
}

/// One section's input, with what errors need.
struct Section<'a> {
    path: &'a str,
    input: Value,
    origins: BTreeMap<String, String>,
}

impl<'a> Section<'a> {
    fn new(path: &'a str, json: &str, origins_json: &str) -> Result<Self, PluginError> {
        let origins = match origins_json.trim() {
            "" => BTreeMap::new(),
            text => serde_json::from_str(text).map_err(|e| {
                PluginError::invalid_config(format!("config origins of `{path}`: {e}"))
            })?,
        };
        let input = match json.trim() {
            "" => Value::Object(Default::default()),
            text => match serde_json::from_str(text) {
                Ok(Value::Null) => Value::Object(Default::default()),
                Ok(value) => value,
                Err(e) => {
                    return Err(PluginError::invalid_config(format!(
                        "config section `{path}`: {e}"
                    )));
                }
            },
        };
        Ok(Self {
            path,
            input,
            origins,
        })
    }

    /// `T` from the keys it knows; a wrong type names the key.
    fn read<T: DeserializeOwned>(&self) -> Result<T, PluginError> {
        serde_path_to_error::deserialize(self.input.clone()).map_err(|e| {
            let key = match e.path().to_string().as_str() {
                "." => self.path.to_owned(),
                rel => join(self.path, rel),
            };
            PluginError::invalid_config(format!(
                "config key `{key}` (from {}): {}",
                origin(&self.origins, &key),
                e.inner()
            ))
        })
    }

    /// The keys `value` knows: its round trip.
    fn known<T: Serialize>(&self, value: &T) -> Result<Value, PluginError> {
        serde_json::to_value(value).map_err(|e| {
            PluginError::invalid_config(format!("config section `{}`: {e}", self.path))
        })
    }

    /// Rejects the first input key missing from `known`.
    fn check(&self, known: &Value) -> Result<(), PluginError> {
        let Some((path, suggestion)) = first_unknown(&self.input, known, known, &mut Vec::new())
        else {
            return Ok(());
        };
        let key = join(self.path, &path.join("."));
        let hint = suggestion
            .map(|s| format!("; did you mean `{}`?", join(self.path, &s)))
            .unwrap_or_default();
        Err(PluginError::invalid_config(format!(
            "unknown config key `{key}` (from {}){hint}",
            origin(&self.origins, &key)
        )))
    }
}

/// Adds `other`'s keys to `known`, recursively.
fn merge(known: &mut Value, other: Value) {
    match (known, other) {
        (Value::Object(known), Value::Object(other)) => {
            for (k, v) in other {
                match known.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        known.insert(k, v);
                    }
                }
            }
        }
        (known, other) if known.is_null() => *known = other,
        _ => {}
    }
}

fn join(prefix: &str, rel: &str) -> String {
    if prefix.is_empty() || rel.starts_with('[') {
        format!("{prefix}{rel}")
    } else {
        format!("{prefix}.{rel}")
    }
}

/// The origin of `key`, else of its nearest ancestor (a value may have been set as a whole).
fn origin<'a>(origins: &'a BTreeMap<String, String>, key: &str) -> &'a str {
    let mut key = key;
    loop {
        if let Some(origin) = origins.get(key) {
            return origin;
        }
        match key.rfind(['.', '[']) {
            Some(i) => key = &key[..i],
            None => return UNKNOWN_ORIGIN,
        }
    }
}

/// The first key of `input` that `known` (its round trip, `root` at the top) lacks, with the
/// nearest valid key, both relative to the section.
fn first_unknown(
    input: &Value,
    known: &Value,
    root: &Value,
    path: &mut Vec<String>,
) -> Option<(Vec<String>, Option<String>)> {
    match (input, known) {
        (Value::Object(input), Value::Object(known)) => {
            for (key, child) in input {
                path.push(key.clone());
                let found = match known.get(key) {
                    Some(known_child) => first_unknown(child, known_child, root, path),
                    None => Some((
                        path.clone(),
                        suggest(known, &path[..path.len() - 1], key, root),
                    )),
                };
                path.pop();
                if found.is_some() {
                    return found;
                }
            }
            None
        }
        (Value::Array(input), Value::Array(known)) => {
            input.iter().zip(known).enumerate().find_map(|(i, (a, b))| {
                // Keys inside lists are reported on the list key (`a.b[0].c` reads as `a.b`).
                let last = path.pop()?;
                path.push(format!("{last}[{i}]"));
                let found = first_unknown(a, b, root, path);
                path.pop();
                path.push(last);
                found
            })
        }
        _ => None,
    }
}

/// The host's rule: the nearest sibling by edit distance, else the first key of the same name
/// elsewhere in the section.
fn suggest(
    siblings: &serde_json::Map<String, Value>,
    parent: &[String],
    key: &str,
    root: &Value,
) -> Option<String> {
    let close = siblings
        .keys()
        .map(|k| (strsim::levenshtein(k, key), k))
        .filter(|(d, k)| *d <= (k.len() / 3).max(2))
        .min();
    if let Some((_, k)) = close {
        return Some(
            parent
                .iter()
                .cloned()
                .chain([k.clone()])
                .collect::<Vec<_>>()
                .join("."),
        );
    }
    let mut found = None;
    find_key(root, key, &mut Vec::new(), &mut found);
    found
}

fn find_key(v: &Value, key: &str, path: &mut Vec<String>, found: &mut Option<String>) {
    if let Value::Object(map) = v {
        for (k, child) in map {
            if found.is_some() {
                return;
            }
            path.push(k.clone());
            if k == key {
                *found = Some(path.join("."));
            } else {
                find_key(child, key, path, found);
            }
            path.pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::*;

    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(default)]
    struct Wrap {
        min_num_params: u64,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    #[serde(default)]
    struct Section {
        param_offload: bool,
        fsdp_size: i64,
        wrap_policy: Wrap,
        dir: Option<String>,
        extra: BTreeMap<String, Value>,
    }

    impl Default for Section {
        fn default() -> Self {
            Self {
                param_offload: false,
                fsdp_size: -1,
                wrap_policy: Wrap::default(),
                dir: None,
                extra: BTreeMap::new(),
            }
        }
    }

    const PATH: &str = "actor_rollout_ref.actor.fsdp_config";

    fn parse(json: &str, origins: &str) -> Result<Section, String> {
        parse_section::<Section>(PATH, json, origins).map_err(|e| {
            assert_eq!(e.kind, crate::ErrorKind::INVALID_CONFIG);
            e.to_string()
        })
    }

    #[test]
    fn empty_json_gives_defaults() {
        for json in ["", "{}", "null", "  "] {
            assert_eq!(parse(json, "").unwrap(), Section::default());
        }
        let s = parse(
            r#"{"param_offload": true, "wrap_policy": {"min_num_params": 5}, "extra": {"any": {"thing": 1}}}"#,
            "{}",
        )
        .unwrap();
        assert!(s.param_offload);
        assert_eq!(s.wrap_policy.min_num_params, 5);
        assert_eq!(s.extra["any"]["thing"], 1);
    }

    #[test]
    fn unknown_top_level_key_suggests_the_nearest() {
        let origins = format!(r#"{{"{PATH}.param_ofload": "config file run.yaml"}}"#);
        assert_eq!(
            parse(r#"{"param_ofload": true}"#, &origins).unwrap_err(),
            format!(
                "unknown config key `{PATH}.param_ofload` (from config file run.yaml); did you mean `{PATH}.param_offload`?"
            )
        );
        // No close sibling, no suggestion; no origin sent.
        assert_eq!(
            parse(r#"{"zzzzzzzz": 1}"#, "").unwrap_err(),
            format!("unknown config key `{PATH}.zzzzzzzz` (from unknown source)")
        );
    }

    #[test]
    fn unknown_nested_key() {
        // The origin of a value set as a whole covers the keys inside it.
        let origins = format!(
            r#"{{"{PATH}.wrap_policy": "command-line override `{PATH}.wrap_policy={{min_num_param: 1}}`"}}"#
        );
        let err = parse(r#"{"wrap_policy": {"min_num_param": 1}}"#, &origins).unwrap_err();
        assert_eq!(
            err,
            format!(
                "unknown config key `{PATH}.wrap_policy.min_num_param` (from command-line override `{PATH}.wrap_policy={{min_num_param: 1}}`); did you mean `{PATH}.wrap_policy.min_num_params`?"
            )
        );
        // A key valid elsewhere in the section is suggested there.
        let err = parse(r#"{"wrap_policy": {"fsdp_size": 2}}"#, "").unwrap_err();
        assert!(
            err.ends_with(&format!("did you mean `{PATH}.fsdp_size`?")),
            "{err}"
        );
    }

    #[test]
    fn two_types_share_a_section() {
        let (a, b): (Wrap, Section) =
            parse_section2("s", r#"{"min_num_params": 2, "param_offload": true}"#, "").unwrap();
        assert_eq!((a.min_num_params, b.param_offload), (2, true));
        let err = parse_section2::<Wrap, Section>("s", r#"{"min_num_param": 2}"#, "").unwrap_err();
        assert_eq!(
            err.message(),
            "unknown config key `s.min_num_param` (from unknown source); did you mean `s.min_num_params`?"
        );
        let err = parse_section2::<Wrap, Section>("s", r#"{"dir": 2}"#, "").unwrap_err();
        assert!(
            err.message()
                .starts_with("config key `s.dir` (from unknown source): invalid type: integer"),
            "{err}"
        );
    }

    #[test]
    fn wrong_type_names_path_and_origin() {
        let origins =
            format!(r#"{{"{PATH}.wrap_policy.min_num_params": "environment variable VERL_X__Y"}}"#);
        let err = parse(r#"{"wrap_policy": {"min_num_params": "many"}}"#, &origins).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "config key `{PATH}.wrap_policy.min_num_params` (from environment variable VERL_X__Y): invalid type: string \"many\""
            )),
            "{err}"
        );
        let err = parse(r#""all""#, "").unwrap_err();
        assert!(
            err.starts_with(&format!(
                "config key `{PATH}` (from unknown source): invalid type: string"
            )),
            "{err}"
        );
        assert!(
            parse("{", "")
                .unwrap_err()
                .contains(&format!("config section `{PATH}`"))
        );
    }
}
