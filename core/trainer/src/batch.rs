//! Building the tensors an engine consumes (see `verl_plugin_api::keys` for the layout): prompts
//! left-padded to the longest prompt, responses right-padded to the longest response, so every
//! response starts at the same column.

use verl_plugin_api::{Batch, PluginError, RoutedExperts, Tensor, keys};

use verl_algo::Matrix;

/// A 2-D F32 batch tensor as an algorithm matrix.
pub fn matrix(name: &str, tensor: &Tensor) -> Result<Matrix, PluginError> {
    let [rows, cols] = tensor.shape.as_slice() else {
        return Err(PluginError::other(format!(
            "`{name}` should be 2-D, has shape {:?}",
            tensor.shape.as_slice()
        )));
    };
    let values = tensor
        .to_vec::<f32>()
        .map_err(|e| PluginError::other(format!("`{name}`: {e}")))?;
    Matrix::new(*rows as usize, *cols as usize, values)
        .map_err(|e| PluginError::other(format!("`{name}`: {e}")))
}

/// An algorithm matrix as a 2-D F32 batch tensor.
pub fn tensor(matrix: &Matrix) -> Tensor {
    let (rows, cols) = matrix.shape();
    Tensor::from_slice(&[rows as i64, cols as i64], matrix.data())
        .expect("a matrix's shape matches its data")
}

/// The engine batch for `prompts[i]` followed by `responses[i]`.
pub fn build(
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    pad_id: u32,
) -> Result<Batch, PluginError> {
    if prompts.len() != responses.len() || prompts.is_empty() {
        return Err(PluginError::other(format!(
            "{} prompts for {} responses",
            prompts.len(),
            responses.len()
        )));
    }
    let rows = prompts.len();
    let prompt_len = prompts.iter().map(Vec::len).max().unwrap_or(0);
    // At least one response column, so an empty response still has a well-formed (masked) row.
    let response_len = responses.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let width = prompt_len + response_len;
    let mut input_ids = vec![i64::from(pad_id); rows * width];
    let mut attention = vec![0i64; rows * width];
    let mut response_ids = vec![i64::from(pad_id); rows * response_len];
    let mut response_mask = vec![0f32; rows * response_len];
    for (row, (prompt, response)) in prompts.iter().zip(responses).enumerate() {
        let start = row * width + prompt_len - prompt.len();
        for (i, &t) in prompt.iter().enumerate() {
            input_ids[start + i] = i64::from(t);
            attention[start + i] = 1;
        }
        for (i, &t) in response.iter().enumerate() {
            input_ids[row * width + prompt_len + i] = i64::from(t);
            attention[row * width + prompt_len + i] = 1;
            response_ids[row * response_len + i] = i64::from(t);
            response_mask[row * response_len + i] = 1.0;
        }
    }
    let mut batch = Batch::default();
    batch.insert(
        keys::INPUT_IDS,
        Tensor::from_slice(&[rows as i64, width as i64], &input_ids)?,
    );
    batch.insert(
        keys::ATTENTION_MASK,
        Tensor::from_slice(&[rows as i64, width as i64], &attention)?,
    );
    batch.insert(
        keys::RESPONSES,
        Tensor::from_slice(&[rows as i64, response_len as i64], &response_ids)?,
    );
    batch.insert(
        keys::RESPONSE_MASK,
        Tensor::from_slice(&[rows as i64, response_len as i64], &response_mask)?,
    );
    Ok(batch)
}

/// The `routed_experts` tensor `[B, P+R, L, k]` (int64) of the batch [`build`] makes from
/// `prompts` and `responses`: row `i`'s recorded tokens (its prompt, then its response but the
/// last token) sit where `input_ids` holds them, zeros elsewhere — verl's agent-loop layout.
pub fn routed_experts(
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    routed: &[&RoutedExperts],
) -> Result<Tensor, PluginError> {
    let first = routed
        .first()
        .ok_or_else(|| PluginError::other("routed_experts: no rows"))?;
    let (layers, top_k) = (first.layers as usize, first.top_k as usize);
    let prompt_len = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let width = prompt_len + responses.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let per_token = layers * top_k;
    let mut data = vec![0i64; routed.len() * width * per_token];
    for (row, ((prompt, response), r)) in prompts.iter().zip(responses).zip(routed).enumerate() {
        let bad =
            |reason: String| PluginError::other(format!("routed_experts of row {row}: {reason}"));
        let tokens = r.tokens().map_err(bad)?;
        if (r.layers as usize, r.top_k as usize) != (layers, top_k) {
            return Err(bad(format!(
                "{} layers × top-{}, row 0 has {layers} × top-{top_k}",
                r.layers, r.top_k
            )));
        }
        let fed = (prompt.len() + response.len()).saturating_sub(1);
        if tokens != fed {
            return Err(bad(format!(
                "{tokens} tokens recorded, the prompt and response fed {fed}"
            )));
        }
        let start = (row * width + prompt_len - prompt.len()) * per_token;
        for (slot, &e) in data[start..start + r.experts.len()]
            .iter_mut()
            .zip(&r.experts)
        {
            *slot = i64::from(e);
        }
    }
    Tensor::from_slice(
        &[
            routed.len() as i64,
            width as i64,
            layers as i64,
            top_k as i64,
        ],
        &data,
    )
}

/// Rows `rows` of every tensor of `batch` (all share the batch dimension), with its meta.
pub fn slice_rows(batch: &Batch, rows: std::ops::Range<usize>) -> Result<Batch, PluginError> {
    let mut out = Batch {
        meta_json: batch.meta_json.clone(),
        ..Batch::default()
    };
    for named in batch.tensors.iter() {
        let tensor = &named.tensor;
        let total = tensor.shape.first().map_or(0, |&d| d.max(0) as usize);
        if rows.end > total || tensor.data.len() % total.max(1) != 0 {
            return Err(PluginError::other(format!(
                "`{}` has {total} rows, not rows {}..{}",
                named.name, rows.start, rows.end
            )));
        }
        let row_bytes = tensor.data.len() / total.max(1);
        let mut shape = tensor.shape.to_vec();
        shape[0] = rows.len() as i64;
        out.insert(
            named.name.as_str(),
            Tensor {
                dtype: tensor.dtype,
                shape: shape.into(),
                data: tensor.data[rows.start * row_bytes..rows.end * row_bytes]
                    .to_vec()
                    .into(),
            },
        );
    }
    Ok(out)
}

/// A per-token response tensor (`log_probs`, `values`, …) cut back to each response's length.
pub fn response_values(
    batch: &Batch,
    name: &str,
    lengths: &[usize],
) -> Result<Vec<Vec<f32>>, PluginError> {
    let matrix = matrix(name, batch.require(name)?)?;
    let (rows, cols) = matrix.shape();
    if rows != lengths.len() || lengths.iter().any(|&l| l > cols) {
        return Err(PluginError::other(format!(
            "`{name}` has shape [{rows}, {cols}], too small for the responses"
        )));
    }
    Ok(lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| matrix.row(i)[..len].to_vec())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_sliced_in_every_tensor() {
        let batch = build(
            &[vec![5, 6, 7], vec![8], vec![9]],
            &[vec![1], vec![2, 3], vec![4]],
            0,
        )
        .unwrap();
        let part = slice_rows(&batch, 1..3).unwrap();
        assert_eq!(part.meta_json, batch.meta_json);
        let ids = part.require(keys::INPUT_IDS).unwrap();
        assert_eq!(ids.shape.as_slice(), &[2, 5]);
        assert_eq!(
            ids.to_vec::<i64>().unwrap(),
            vec![0, 0, 8, 2, 3, 0, 0, 9, 4, 0]
        );
        let mask = part.require(keys::RESPONSE_MASK).unwrap();
        assert_eq!(mask.to_vec::<f32>().unwrap(), vec![1.0, 1.0, 1.0, 0.0]);
        assert_eq!(slice_rows(&batch, 0..0).unwrap().tensors.len(), 4);
        let err = slice_rows(&batch, 2..4).unwrap_err().to_string();
        assert!(err.contains("has 3 rows, not rows 2..4"), "{err}");
    }

    #[test]
    fn prompts_pad_left_and_responses_pad_right() {
        let batch = build(&[vec![5, 6, 7], vec![8]], &[vec![1], vec![2, 3]], 0).unwrap();
        let ids = batch.require(keys::INPUT_IDS).unwrap();
        assert_eq!(ids.shape.as_slice(), &[2, 5]);
        assert_eq!(
            ids.to_vec::<i64>().unwrap(),
            vec![5, 6, 7, 1, 0, 0, 0, 8, 2, 3]
        );
        assert_eq!(
            batch
                .require(keys::ATTENTION_MASK)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            vec![1, 1, 1, 1, 0, 0, 0, 1, 1, 1]
        );
        assert_eq!(
            batch
                .require(keys::RESPONSES)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            vec![1, 0, 2, 3]
        );
        assert_eq!(
            batch
                .require(keys::RESPONSE_MASK)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            vec![1.0, 0.0, 1.0, 1.0]
        );
        assert!(build(&[vec![1]], &[], 0).is_err());
    }

    #[test]
    fn routed_experts_sit_where_input_ids_hold_their_tokens() {
        let (prompts, responses) = (vec![vec![5, 6], vec![8]], vec![vec![1, 2], vec![3]]);
        // One layer, top-2: row 0 fed 3 tokens (5, 6, 1), row 1 fed 1 (8).
        let rows = [
            RoutedExperts::new(1, 2, vec![0, 1, 2, 3, 1, 0]),
            RoutedExperts::new(1, 2, vec![3, 2]),
        ];
        let tensor = routed_experts(&prompts, &responses, &[&rows[0], &rows[1]]).unwrap();
        assert_eq!(tensor.shape.as_slice(), &[2, 4, 1, 2]);
        // input_ids: [5 6 1 2] and [0 8 3 0].
        assert_eq!(
            tensor.to_vec::<i64>().unwrap(),
            vec![0, 1, 2, 3, 1, 0, 0, 0, 0, 0, 3, 2, 0, 0, 0, 0]
        );
        let short = RoutedExperts::new(1, 2, vec![0, 1]);
        let err = routed_experts(&prompts, &responses, &[&short, &rows[1]])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("row 0: 1 tokens recorded, the prompt and response fed 3"),
            "{err}"
        );
        let ragged = RoutedExperts::new(2, 2, vec![0, 1, 2]);
        let err = routed_experts(&prompts, &responses, &[&rows[0], &ragged])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("do not split into tokens of 2 layers × top-2"),
            "{err}"
        );
    }

    #[test]
    fn response_values_are_trimmed_per_row() {
        let mut batch = Batch::default();
        batch.insert(
            "log_probs",
            Tensor::from_slice(&[2, 3], &[-1.0f32, -2.0, 0.0, -3.0, 0.0, 0.0]).unwrap(),
        );
        assert_eq!(
            response_values(&batch, "log_probs", &[2, 1]).unwrap(),
            vec![vec![-1.0, -2.0], vec![-3.0]]
        );
        assert!(response_values(&batch, "log_probs", &[4, 1]).is_err());
        assert!(response_values(&batch, "values", &[1, 1]).is_err());
    }
}
