//! verl's parquet files (as pandas writes them: snappy, the prompt a list of structs).

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type,
    UInt32Type, UInt64Type,
};
use arrow_array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int64Array, ListArray, RecordBatch, StringArray,
    StructArray,
};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Fields, Schema};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use serde_json::{Map, Number, Value};

use super::{DataError, REQUIRED, Sample};

/// Reads all rows. Columns other than verl's five are ignored.
pub fn read_parquet(path: &Path, prompt_key: &str) -> Result<Vec<Sample>, DataError> {
    let perr = |e: &dyn std::fmt::Display| DataError::Parquet {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let file = File::open(path).map_err(|source| DataError::Io {
        path: path.to_owned(),
        source,
    })?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| perr(&e))?;
    let schema = builder.schema().clone();
    for column in REQUIRED.iter().copied().chain([prompt_key]) {
        if schema.column_with_name(column).is_none() {
            let found = schema
                .fields()
                .iter()
                .map(|f| f.name().as_str())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(DataError::MissingColumn {
                path: path.to_owned(),
                column: column.to_owned(),
                found,
            });
        }
    }
    let wanted: Vec<&str> = [
        "data_source",
        prompt_key,
        "ability",
        "reward_model",
        "extra_info",
    ]
    .into_iter()
    .filter(|c| schema.column_with_name(c).is_some())
    .collect();
    let mut samples = Vec::new();
    for batch in builder.build().map_err(|e| perr(&e))? {
        let batch = batch.map_err(|e| perr(&e))?;
        for i in 0..batch.num_rows() {
            let row_no = samples.len();
            let row_err = |reason: String| DataError::Row {
                path: path.to_owned(),
                location: format!("row {row_no}"),
                reason,
            };
            let mut row = Map::new();
            for &column in &wanted {
                let array = batch
                    .column_by_name(column)
                    .expect("column checked in the schema");
                let value = to_json(array.as_ref(), i)
                    .map_err(|e| row_err(format!("column `{column}`: {e}")))?;
                row.insert(column.to_owned(), value);
            }
            samples.push(Sample::from_row(row, prompt_key).map_err(row_err)?);
        }
    }
    Ok(samples)
}

/// One cell as JSON (the types pandas/pyarrow write for verl's columns).
fn to_json(array: &dyn Array, i: usize) -> Result<Value, String> {
    if array.is_null(i) {
        return Ok(Value::Null);
    }
    let float = |v: f64| Number::from_f64(v).map_or(Value::Null, Value::Number);
    Ok(match array.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => array.as_boolean().value(i).into(),
        DataType::Int8 => array.as_primitive::<Int8Type>().value(i).into(),
        DataType::Int16 => array.as_primitive::<Int16Type>().value(i).into(),
        DataType::Int32 => array.as_primitive::<Int32Type>().value(i).into(),
        DataType::Int64 => array.as_primitive::<Int64Type>().value(i).into(),
        DataType::UInt8 => array.as_primitive::<UInt8Type>().value(i).into(),
        DataType::UInt16 => array.as_primitive::<UInt16Type>().value(i).into(),
        DataType::UInt32 => array.as_primitive::<UInt32Type>().value(i).into(),
        DataType::UInt64 => array.as_primitive::<UInt64Type>().value(i).into(),
        DataType::Float32 => float(f64::from(array.as_primitive::<Float32Type>().value(i))),
        DataType::Float64 => float(array.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => array.as_string::<i32>().value(i).into(),
        DataType::LargeUtf8 => array.as_string::<i64>().value(i).into(),
        DataType::Utf8View => array.as_string_view().value(i).into(),
        DataType::List(_) => list_to_json(array.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list_to_json(array.as_list::<i64>().value(i).as_ref())?,
        DataType::Struct(fields) => {
            let s = array.as_struct();
            let mut map = Map::new();
            for (field, column) in fields.iter().zip(s.columns()) {
                map.insert(field.name().clone(), to_json(column.as_ref(), i)?);
            }
            Value::Object(map)
        }
        other => return Err(format!("unsupported type {other}")),
    })
}

fn list_to_json(values: &dyn Array) -> Result<Value, String> {
    (0..values.len())
        .map(|j| to_json(values, j))
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// Writes `samples` in verl's layout, snappy-compressed like pandas. `extra_info` must be a flat
/// object of strings, integers, floats and booleans whose keys and types follow the first row's
/// (pandas writes a struct column); it is left out when the first row has none.
pub fn write_parquet(path: &Path, samples: &[Sample], prompt_key: &str) -> Result<(), DataError> {
    let perr = |e: &dyn std::fmt::Display| DataError::Parquet {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let strings = |f: &dyn Fn(&Sample) -> &str| -> ArrayRef {
        Arc::new(samples.iter().map(|s| Some(f(s))).collect::<StringArray>())
    };
    let utf8 = |name: &str| Field::new(name, DataType::Utf8, true);

    let message_fields = Fields::from(vec![utf8("content"), utf8("role")]);
    let messages = samples.iter().flat_map(|s| &s.prompt);
    let message_values = StructArray::new(
        message_fields.clone(),
        vec![
            Arc::new(
                messages
                    .clone()
                    .map(|m| Some(m.content.as_str()))
                    .collect::<StringArray>(),
            ),
            Arc::new(
                messages
                    .map(|m| Some(m.role.as_str()))
                    .collect::<StringArray>(),
            ),
        ],
        None,
    );
    let item = Arc::new(Field::new("item", DataType::Struct(message_fields), true));
    let prompt = ListArray::new(
        item,
        OffsetBuffer::from_lengths(samples.iter().map(|s| s.prompt.len())),
        Arc::new(message_values),
        None,
    );
    let reward_model = StructArray::new(
        Fields::from(vec![utf8("ground_truth"), utf8("style")]),
        vec![
            strings(&|s| &s.reward_model.ground_truth),
            strings(&|s| &s.reward_model.style),
        ],
        None,
    );

    let mut columns: Vec<(Field, ArrayRef)> = vec![
        (utf8("data_source"), strings(&|s| &s.data_source)),
        (
            Field::new(prompt_key, prompt.data_type().clone(), true),
            Arc::new(prompt),
        ),
        (utf8("ability"), strings(&|s| &s.ability)),
        (
            Field::new("reward_model", reward_model.data_type().clone(), true),
            Arc::new(reward_model),
        ),
    ];
    if let Some(extra) = extra_info_column(samples).map_err(|(row, reason)| DataError::Row {
        path: path.to_owned(),
        location: format!("row {row}"),
        reason,
    })? {
        columns.push((
            Field::new("extra_info", extra.data_type().clone(), true),
            Arc::new(extra),
        ));
    }
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = columns.into_iter().unzip();
    let batch =
        RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).map_err(|e| perr(&e))?;
    let file = File::create(path).map_err(|source| DataError::Io {
        path: path.to_owned(),
        source,
    })?;
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let mut writer =
        ArrowWriter::try_new(file, batch.schema(), Some(props)).map_err(|e| perr(&e))?;
    writer.write(&batch).map_err(|e| perr(&e))?;
    writer.close().map_err(|e| perr(&e))?;
    Ok(())
}

/// Every row's value of `key` through `get`, which must accept it as the first row's type.
fn extra_column<'a, T, A: FromIterator<Option<T>>>(
    samples: &'a [Sample],
    key: &str,
    example: &Value,
    get: impl Fn(&'a Value) -> Option<T>,
) -> Result<A, (usize, String)> {
    (0..samples.len())
        .map(|row| {
            let v = samples[row].extra_info.get(key).ok_or_else(|| {
                (
                    row,
                    format!("extra_info has no `{key}` (the first row has)"),
                )
            })?;
            get(v).map(Some).ok_or_else(|| {
                (
                    row,
                    format!("extra_info.{key} is {v}, but the first row's is {example}"),
                )
            })
        })
        .collect()
}

/// The `extra_info` struct column, typed from the first row; `Err((row, reason))` on a mismatch.
fn extra_info_column(samples: &[Sample]) -> Result<Option<StructArray>, (usize, String)> {
    let Some(Value::Object(first)) = samples.first().map(|s| &s.extra_info) else {
        return Ok(None);
    };
    if first.is_empty() {
        return Ok(None);
    }
    let mut fields = Vec::new();
    let mut arrays: Vec<ArrayRef> = Vec::new();
    for (key, example) in first {
        let (data_type, array): (DataType, ArrayRef) = match example {
            Value::String(_) => (
                DataType::Utf8,
                Arc::new(extra_column::<_, StringArray>(
                    samples,
                    key,
                    example,
                    Value::as_str,
                )?),
            ),
            Value::Bool(_) => (
                DataType::Boolean,
                Arc::new(extra_column::<_, BooleanArray>(
                    samples,
                    key,
                    example,
                    Value::as_bool,
                )?),
            ),
            Value::Number(n) if n.is_i64() => (
                DataType::Int64,
                Arc::new(extra_column::<_, Int64Array>(
                    samples,
                    key,
                    example,
                    Value::as_i64,
                )?),
            ),
            Value::Number(_) => (
                DataType::Float64,
                Arc::new(extra_column::<_, Float64Array>(
                    samples,
                    key,
                    example,
                    Value::as_f64,
                )?),
            ),
            other => {
                return Err((
                    0,
                    format!(
                        "extra_info.{key} is {other}; only strings, numbers and booleans can be written"
                    ),
                ));
            }
        };
        fields.push(Field::new(key, data_type, true));
        arrays.push(array);
    }
    Ok(Some(StructArray::new(Fields::from(fields), arrays, None)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::samples;

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.parquet");
        write_parquet(&path, &samples(), "prompt").unwrap();
        assert_eq!(read_parquet(&path, "prompt").unwrap(), samples());
    }

    /// Written by pandas 3.1 / pyarrow 26 (`DataFrame.to_parquet`, snappy, `large_string`
    /// columns) in the layout of verl's `examples/data_preprocess/gsm8k.py`.
    #[test]
    fn reads_a_pandas_file() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/testdata/gsm8k_pandas.parquet");
        let rows = read_parquet(&path, "prompt").unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].data_source, "openai/gsm8k");
        assert_eq!(rows[0].prompt[0].role, "user");
        assert!(rows[0].prompt[0].content.starts_with("Natalia sold clips"));
        assert_eq!(
            rows[1].reward_model,
            crate::RewardSpec {
                style: "rule".into(),
                ground_truth: "10".into()
            }
        );
        assert_eq!(rows[1].extra_info["index"], 1);
        assert_eq!(rows[1].extra_info["split"], "train");
    }

    #[test]
    fn missing_column_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.parquet");
        write_parquet(&path, &samples(), "question").unwrap();
        let err = read_parquet(&path, "prompt").unwrap_err().to_string();
        assert!(
            err.contains("q.parquet")
                && err.contains("missing column `prompt`")
                && err.contains("question"),
            "{err}"
        );
    }

    #[test]
    fn malformed_row_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.parquet");
        let truth = StructArray::new(
            Fields::from(vec![Field::new("ground_truth", DataType::Utf8, true)]),
            vec![Arc::new(StringArray::from(vec!["1", "2"]))],
            None,
        );
        let schema = Arc::new(Schema::new(vec![
            Field::new("data_source", DataType::Utf8, true),
            Field::new("prompt", DataType::Utf8, true),
            Field::new("reward_model", truth.data_type().clone(), true),
        ]));
        let columns: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(vec![Some("a"), None])),
            Arc::new(StringArray::from(vec!["p", "q"])),
            Arc::new(truth),
        ];
        let batch = RecordBatch::try_new(schema.clone(), columns).unwrap();
        let mut w = ArrowWriter::try_new(File::create(&path).unwrap(), schema, None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let err = read_parquet(&path, "prompt").unwrap_err().to_string();
        assert!(
            err.contains("bad.parquet: row 1: column `data_source`: expected a string, found null"),
            "{err}"
        );
    }

    #[test]
    fn extra_info_must_keep_its_shape() {
        let dir = tempfile::tempdir().unwrap();
        let mut rows = samples();
        rows[1].extra_info["index"] = "one".into();
        let err = write_parquet(&dir.path().join("x.parquet"), &rows, "prompt")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("row 1") && err.contains("extra_info.index"),
            "{err}"
        );
    }
}
