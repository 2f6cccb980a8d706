//! Packed (THD) batches, verl's `use_remove_padding`: the real tokens of every row of a padded
//! `[B, S]` batch concatenated into one sequence `[1, N]`, each row's positions restarting at 0
//! (rotary), attention causal within each row only, so no padding token is computed. A row may
//! be padded at its end to a multiple of an alignment (Megatron's rule for sequence and context
//! parallelism); those slots come after the row's real tokens, which never attend them, and
//! nothing reads their outputs. The head scores only the response tokens, and returns them in the
//! padded `[B, R]` layout the callers expect.

use tch::{Device, Kind, Tensor};

use crate::error::{ModelError, Result};

/// A run of consecutive queries of one packed sequence and the keys they attend: the keys
/// `key_start .. key_start + key_len` of the packed stream, query `i` of the run attending keys
/// up to `key_len − query_len + i` (causal, aligned at the end: the run is the last `query_len`
/// tokens of the sequence's prefix the keys cover).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub query_start: i64,
    pub query_len: i64,
    pub key_start: i64,
    pub key_len: i64,
}

/// Attention of queries `q` `[1, heads, T, d]` over keys and values `[1, heads, N, d]` confined
/// to `segments`: one scaled-dot-product attention per segment, `[1, heads, T, d]`. One call per
/// sequence computes Σ len² scores where one block-diagonal mask over the stream would compute
/// N² (the fsdp plugin's `packing` bench times the packed path against the padded one).
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    segments: &[Segment],
    scale: f64,
) -> Tensor {
    let outputs: Vec<Tensor> = segments
        .iter()
        .map(|s| {
            let q = q.narrow(2, s.query_start, s.query_len);
            let (k, v) = (
                k.narrow(2, s.key_start, s.key_len),
                v.narrow(2, s.key_start, s.key_len),
            );
            if s.query_len == s.key_len {
                Tensor::scaled_dot_product_attention(
                    &q,
                    &k,
                    &v,
                    None::<&Tensor>,
                    0.0,
                    true,
                    scale,
                    false,
                )
            } else {
                let device = q.device();
                let offset = s.key_len - s.query_len;
                let query = Tensor::arange(s.query_len, (Kind::Int64, device)).view([-1, 1]);
                let key = Tensor::arange(s.key_len, (Kind::Int64, device)).view([1, -1]);
                let mask = key.le_tensor(&(query + offset));
                Tensor::scaled_dot_product_attention(
                    &q,
                    &k,
                    &v,
                    Some(&mask),
                    0.0,
                    false,
                    scale,
                    false,
                )
            }
        })
        .collect();
    if outputs.is_empty() {
        return q.zeros_like();
    }
    Tensor::cat(&outputs, 2)
}

/// How the rows of a padded batch lie in the packed stream, and where the response tokens'
/// predictors are. Built from the batch's `attention_mask` (`[B, S]`, 1 = real token); a row's
/// real tokens need not be contiguous: they are packed in order, each position counting the real
/// tokens before it, exactly as the padded forward pass counts them.
#[derive(Debug)]
pub struct Packing {
    rows: i64,
    seq: i64,
    response_len: i64,
    /// Row `b` occupies `cu_seqlens[b] .. cu_seqlens[b + 1]` of the stream (real tokens, then the
    /// alignment padding).
    cu_seqlens: Vec<i64>,
    /// `[N]` int64: the index into the flattened `[B·S]` batch of the token each slot holds
    /// (alignment slots repeat a token of their row; their outputs are never read).
    source: Tensor,
    /// `[N]` int64: each slot's position in its row.
    positions: Tensor,
    /// The response tokens that are real and follow a real token (the others score zero, as
    /// verl's unpadded forward leaves them): their predictors' slots, their own indices into the
    /// flattened `[B·S]` batch and into the flattened `[B, R]` response.
    predictors: Tensor,
    labels: Tensor,
    targets: Tensor,
}

impl Packing {
    /// The packing of the rows `attention_mask` (`[B, S]`, on any device) describes, each row
    /// padded to a multiple of `multiple` (1: no padding), for scoring the last `response_len`
    /// columns.
    pub fn new(attention_mask: &Tensor, response_len: i64, multiple: i64) -> Result<Self> {
        let (rows, seq) = attention_mask.size2().map_err(|_| {
            ModelError::invalid_input(
                "attention_mask",
                format!("must be [batch, seq], got {:?}", attention_mask.size()),
            )
        })?;
        if response_len < 1 || response_len >= seq {
            return Err(ModelError::invalid_input(
                "response_len",
                format!("must lie in [1, {seq}) for sequences of length {seq}, got {response_len}"),
            ));
        }
        if multiple < 1 {
            return Err(ModelError::invalid_input(
                "multiple",
                format!("the alignment must be at least 1, got {multiple}"),
            ));
        }
        let device = attention_mask.device();
        let mask = Vec::<i64>::try_from(
            attention_mask
                .to_device(Device::Cpu)
                .to_kind(Kind::Int64)
                .reshape([-1]),
        )
        .map_err(|e| ModelError::Torch(e.to_string()))?;
        let mut cu_seqlens = vec![0];
        let (mut source, mut positions) = (Vec::new(), Vec::new());
        // The slot of each real token of the flattened batch.
        let mut slot_of = vec![-1i64; mask.len()];
        for b in 0..rows {
            let row = b * seq;
            let mut len = 0i64;
            for s in 0..seq {
                if mask[(row + s) as usize] != 0 {
                    slot_of[(row + s) as usize] = source.len() as i64;
                    source.push(row + s);
                    positions.push(len);
                    len += 1;
                }
            }
            let padded = (len + multiple - 1) / multiple * multiple;
            for p in len..padded {
                source.push(row);
                positions.push(p);
            }
            cu_seqlens.push(source.len() as i64);
        }
        let (mut predictors, mut labels, mut targets) = (Vec::new(), Vec::new(), Vec::new());
        for b in 0..rows {
            for r in 0..response_len {
                let at = (b * seq + seq - response_len + r) as usize;
                if mask[at] != 0 && slot_of[at - 1] >= 0 {
                    predictors.push(slot_of[at - 1]);
                    labels.push(at as i64);
                    targets.push(b * response_len + r);
                }
            }
        }
        let tensor = |v: &[i64]| Tensor::from_slice(v).to_device(device);
        Ok(Self {
            rows,
            seq,
            response_len,
            source: tensor(&source),
            positions: tensor(&positions),
            predictors: tensor(&predictors),
            labels: tensor(&labels),
            targets: tensor(&targets),
            cu_seqlens,
        })
    }

    /// `B + 1` offsets: row `b` occupies `cu_seqlens[b] .. cu_seqlens[b + 1]` of the stream.
    pub fn cu_seqlens(&self) -> &[i64] {
        &self.cu_seqlens
    }

    /// `N`, the packed stream's length.
    pub fn len(&self) -> i64 {
        *self.cu_seqlens.last().expect("starts with 0")
    }

    /// Whether the batch has no real token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn response_len(&self) -> i64 {
        self.response_len
    }

    /// The `[B, S]` shape of the padded batch.
    pub fn padded_shape(&self) -> [i64; 2] {
        [self.rows, self.seq]
    }

    /// The packed stream's slots `[n]` whose hidden states predict a scored response token.
    pub fn predictors(&self) -> &Tensor {
        &self.predictors
    }

    /// Where the [`Self::predictors`]' values go: indices `[n]` into the flattened `[B, R]`
    /// response.
    pub fn targets(&self) -> &Tensor {
        &self.targets
    }

    /// The token ids `[n]` the [`Self::predictors`] predict, from the padded `input_ids`.
    pub fn labels(&self, input_ids: &Tensor) -> Tensor {
        input_ids
            .to_device(self.labels.device())
            .reshape([-1])
            .index_select(0, &self.labels)
    }

    /// The packed ids `[1, N]` of the padded `input_ids` `[B, S]`.
    pub(crate) fn pack_ids(&self, input_ids: &Tensor) -> Tensor {
        input_ids
            .to_device(self.source.device())
            .reshape([-1])
            .index_select(0, &self.source)
            .view([1, -1])
    }

    /// Positions `[1, T]` of the stream's `tokens` (`None`: all).
    pub(crate) fn positions(&self, tokens: Option<&Tensor>) -> Tensor {
        match tokens {
            Some(tokens) => self.positions.index_select(0, tokens),
            None => self.positions.shallow_clone(),
        }
        .view([1, -1])
    }

    /// The longest row in the stream (alignment included).
    pub(crate) fn max_len(&self) -> i64 {
        self.cu_seqlens
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }

    /// The attention segments of the stream's `tokens` (increasing slots; `None`: all), each run
    /// of consecutive slots of one row attending that row's keys up to its last slot. Keys are
    /// the whole stream's.
    pub(crate) fn segments(&self, tokens: Option<&[i64]>) -> Vec<Segment> {
        match tokens {
            None => self
                .cu_seqlens
                .windows(2)
                .filter(|w| w[1] > w[0])
                .map(|w| Segment {
                    query_start: w[0],
                    query_len: w[1] - w[0],
                    key_start: w[0],
                    key_len: w[1] - w[0],
                })
                .collect(),
            Some(tokens) => {
                let mut segments: Vec<Segment> = Vec::new();
                let mut row = 0;
                for (i, &slot) in tokens.iter().enumerate() {
                    while self.cu_seqlens[row + 1] <= slot {
                        row += 1;
                    }
                    let start = self.cu_seqlens[row];
                    match segments.last_mut() {
                        // The next slot of the same row: the run grows by one query and one key.
                        Some(last)
                            if last.key_start == start && last.key_start + last.key_len == slot =>
                        {
                            last.query_len += 1;
                            last.key_len += 1;
                        }
                        _ => segments.push(Segment {
                            query_start: i as i64,
                            query_len: 1,
                            key_start: start,
                            key_len: slot - start + 1,
                        }),
                    }
                }
                segments
            }
        }
    }

    /// Per-predictor values `[n]` (or `[n, ..]`) in the padded response layout `[B, R]`, zero
    /// where no response token is scored. Differentiable with respect to `values`.
    pub fn unpack_response(&self, values: &Tensor) -> Tensor {
        let mut shape = vec![self.rows * self.response_len];
        shape.extend_from_slice(&values.size()[1..]);
        let spread = Tensor::zeros(shape.as_slice(), (values.kind(), values.device())).index_copy(
            0,
            &self.targets,
            values,
        );
        let mut out = vec![self.rows, self.response_len];
        out.extend_from_slice(&values.size()[1..]);
        spread.view(out.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(rows: &[&[i64]]) -> Tensor {
        let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_slice(&flat).view([rows.len() as i64, -1])
    }

    #[test]
    fn rows_pack_in_order_with_alignment() {
        // Left-padded prompts of 3 columns, right-padded responses of 2.
        let m = mask(&[&[0, 1, 1, 1, 0], &[0, 1, 1, 1, 1], &[0, 0, 1, 0, 0]]);
        let p = Packing::new(&m, 2, 4).unwrap();
        assert_eq!(p.cu_seqlens(), [0, 4, 8, 12]);
        let source = Vec::<i64>::try_from(&p.source).unwrap();
        assert_eq!(source, [1, 2, 3, 0, 6, 7, 8, 9, 12, 10, 10, 10]);
        let positions = Vec::<i64>::try_from(&p.positions).unwrap();
        assert_eq!(positions, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]);
        // Row 0 scores column 3 (predicted by slot 1), row 1 both (slots 5, 6), row 2 none.
        assert_eq!(Vec::<i64>::try_from(&p.predictors).unwrap(), [1, 5, 6]);
        assert_eq!(Vec::<i64>::try_from(&p.targets).unwrap(), [0, 2, 3]);
        let values = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let unpacked = Vec::<f32>::try_from(p.unpack_response(&values).reshape([-1])).unwrap();
        assert_eq!(unpacked, [1.0, 0.0, 2.0, 3.0, 0.0, 0.0]);
    }

    #[test]
    fn runs_of_tokens_attend_their_rows_prefix() {
        let m = mask(&[&[1, 1, 1, 1], &[0, 1, 1, 1]]);
        let p = Packing::new(&m, 1, 2).unwrap();
        assert_eq!(p.cu_seqlens(), [0, 4, 8]);
        // Context-parallel rank 0 of 2: chunks 0 and 3 of each row (one slot each).
        let segments = p.segments(Some(&[0, 3, 4, 7]));
        let s = |query_start, key_start, key_len| Segment {
            query_start,
            query_len: 1,
            key_start,
            key_len,
        };
        assert_eq!(segments, [s(0, 0, 1), s(1, 0, 4), s(2, 4, 1), s(3, 4, 4)]);
        // Consecutive slots of one row form one run.
        let runs = p.segments(Some(&[1, 2, 5, 6]));
        assert_eq!(runs[0].query_len, 2);
        assert_eq!((runs[0].key_start, runs[0].key_len), (0, 3));
        assert_eq!((runs[1].query_start, runs[1].key_len), (2, 3));
    }

    #[test]
    fn bad_input_names_the_argument() {
        let m = mask(&[&[1, 1]]);
        let e = Packing::new(&m, 2, 1).unwrap_err().to_string();
        assert!(e.contains("response_len"), "{e}");
        let e = Packing::new(&m, 1, 0).unwrap_err().to_string();
        assert!(e.contains("multiple"), "{e}");
    }
}
