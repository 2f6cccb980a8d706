//! How records cross the boundary: as JSON text.
//!
//! abi_stable checks the exact layout of every `#[repr(C)]` type reachable from the root module, so
//! a plain struct can never gain a field without breaking every plugin built before. Prefix types
//! can grow, but abi_stable only hands them out as `'static` references, which fits the root module
//! and the vtables, not values made per call. So the per-call *records* (run context, sampling
//! parameters, requests, completions, device facts, capabilities, the manifest) cross as JSON:
//! a newer side's extra fields are ignored by an older reader, and an older side's missing fields
//! take their defaults (every record is `#[serde(default)]`). Bulk data (tensors, weights, metrics)
//! stays in fixed binary containers that are keyed by name, so they grow by new keys, never by new
//! fields; see [`Batch`](crate::Batch) and [`WeightSource`](crate::WeightSource).

use abi_stable::std_types::RString;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::PluginError;

/// A record as JSON text. Records are plain data, so serialising cannot fail.
pub fn encode<T: Serialize>(record: &T) -> RString {
    serde_json::to_string(record)
        .expect("records serialise")
        .into()
}

/// A record from JSON text; `what` names it in the error (a peer sent something unreadable).
pub fn decode<T: DeserializeOwned>(what: &str, text: &str) -> Result<T, PluginError> {
    serde_json::from_str(text).map_err(|e| {
        PluginError::other(format!(
            "unreadable {what} record across the plugin boundary: {e}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::*;

    #[derive(Serialize, Deserialize, Debug, PartialEq, Default)]
    #[serde(default)]
    struct Old {
        a: u32,
    }

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    #[serde(default)]
    struct New {
        a: u32,
        b: String,
    }

    impl Default for New {
        fn default() -> Self {
            Self {
                a: 0,
                b: "fallback".into(),
            }
        }
    }

    #[test]
    fn records_grow_in_both_directions() {
        let from_new = encode(&New {
            a: 3,
            b: "x".into(),
        });
        assert_eq!(decode::<Old>("t", &from_new).unwrap(), Old { a: 3 });
        let from_old = encode(&Old { a: 4 });
        assert_eq!(
            decode::<New>("t", &from_old).unwrap(),
            New {
                a: 4,
                b: "fallback".into()
            }
        );
        let err = decode::<Old>("sampling", "\"text\"").unwrap_err();
        assert!(err.message().contains("sampling record"), "{err}");
    }
}
