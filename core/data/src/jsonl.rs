//! JSONL with the same fields as verl's parquet rows, one object per line.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use serde_json::Value;

use super::{DataError, Sample};

/// Reads every non-blank line; errors name the file and the 1-based line.
pub fn read_jsonl(path: &Path, prompt_key: &str) -> Result<Vec<Sample>, DataError> {
    let io = |source| DataError::Io {
        path: path.to_owned(),
        source,
    };
    let reader = BufReader::new(File::open(path).map_err(io)?);
    let mut samples = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let row_err = |reason: String| DataError::Row {
            path: path.to_owned(),
            location: format!("line {}", i + 1),
            reason,
        };
        let row = match serde_json::from_str::<Value>(&line) {
            Ok(Value::Object(row)) => row,
            Ok(other) => return Err(row_err(format!("expected a JSON object, found {other}"))),
            Err(e) => return Err(row_err(format!("invalid JSON: {e}"))),
        };
        samples.push(Sample::from_row(row, prompt_key).map_err(row_err)?);
    }
    Ok(samples)
}

pub fn write_jsonl(path: &Path, samples: &[Sample], prompt_key: &str) -> Result<(), DataError> {
    let io = |source| DataError::Io {
        path: path.to_owned(),
        source,
    };
    let mut out = BufWriter::new(File::create(path).map_err(io)?);
    for sample in samples {
        serde_json::to_writer(&mut out, &sample.to_row(prompt_key)).map_err(|e| io(e.into()))?;
        out.write_all(b"\n").map_err(io)?;
    }
    out.flush().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{load_samples, tests::samples};

    #[test]
    fn round_trip_and_dispatch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        write_jsonl(&path, &samples(), "prompt").unwrap();
        assert_eq!(read_jsonl(&path, "prompt").unwrap(), samples());
        let parquet = dir.path().join("d.parquet");
        crate::write_parquet(&parquet, &samples(), "prompt").unwrap();
        let both = load_samples(
            &[path.to_str().unwrap(), parquet.to_str().unwrap()],
            "prompt",
        )
        .unwrap();
        assert_eq!(both.len(), 4);
        assert_eq!(both[2], samples()[0]);
    }

    #[test]
    fn bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, "{\"data_source\":\"a\",\"prompt\":\"p\",\"reward_model\":{\"ground_truth\":\"1\"}}\n\n{oops\n").unwrap();
        let err = read_jsonl(&path, "prompt").unwrap_err().to_string();
        assert!(err.contains("d.jsonl: line 3: invalid JSON"), "{err}");
        std::fs::write(&path, "[1]\n").unwrap();
        assert!(
            read_jsonl(&path, "prompt")
                .unwrap_err()
                .to_string()
                .contains("line 1: expected a JSON object")
        );
        std::fs::write(&path, "{\"prompt\":\"p\",\"data_source\":\"a\"}\n").unwrap();
        assert!(
            read_jsonl(&path, "prompt")
                .unwrap_err()
                .to_string()
                .contains("line 1: column `reward_model`")
        );
    }
}
