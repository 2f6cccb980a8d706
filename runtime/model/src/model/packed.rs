//! Packed (THD) batches, verl's `use_remove_padding`: the real tokens of every row of a padded
//! `[B, S]` batch concatenated into one sequence `[1, N]`, each row's positions restarting at 0
//! (rotary), attention causal within each row only, so no padding token is computed. A row may
//! be padded at its end to a multiple of an alignment (Megatron's rule for sequence and context
//! parallelism); those slots come after the row's real tokens, which never attend them, and
//! nothing reads their outputs. The head scores only the response tokens, and returns them in the
//! padded `[B, R]` layout the callers expect.

use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use crate::error::{ModelError, Result};

/// A run of consecutive queries of one packed sequence and the keys they attend: the slots
/// `prefix_start .. prefix_start + prefix_len` (a prompt the sequence shares with an earlier
/// row, see [`Packing::sharing_prompts`]; none when `prefix_len` is 0), then `key_start ..
/// key_start + key_len` of the packed stream. Query `i` of the run attends keys up to `keys −
/// query_len + i` of that list (`keys`: both lengths; causal, aligned at the end: the run is the
/// last `query_len` tokens of the sequence's prefix the keys cover).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub query_start: i64,
    pub query_len: i64,
    pub prefix_start: i64,
    pub prefix_len: i64,
    pub key_start: i64,
    pub key_len: i64,
}

impl Segment {
    /// How many keys the run attends, the shared prefix's included.
    pub fn keys(&self) -> i64 {
        self.prefix_len + self.key_len
    }

    /// The stream slot of key `i` of the run's list.
    pub fn key_slot(&self, i: i64) -> i64 {
        if i < self.prefix_len {
            self.prefix_start + i
        } else {
            self.key_start + i - self.prefix_len
        }
    }
}

/// Attention of queries `q` `[1, heads, T, d]` over keys and values `[1, kv_heads, N, d]`
/// (grouped-query attention: query head `h` reads key/value head `h / (heads / kv_heads)`)
/// confined to the segments `grids` lays out, `[1, heads, T, d]`.
///
/// The segments are laid left-aligned into padded grids `[rows, heads, len, d]` (a segment's
/// query at its position among its keys, so one causal attention per grid confines each query to
/// its own sequence's prefix), and the outputs gathered back. One attention per grid instead of
/// one per sequence: a batch of short sequences was dominated by the calls' overhead (32 rows of
/// ~64 tokens: 5 calls per row per layer, forward and backward). Grids group sequences of similar
/// lengths, so the padding they compute stays under the sequences' own work (see [`Grids::new`]).
pub(crate) fn attend(q: &Tensor, k: &Tensor, v: &Tensor, grids: &Grids, scale: f64) -> Tensor {
    attend_with(q, k, v, grids, scale, MATH_SCORES)
}

/// Up to this many attention scores per grid (`rows · heads · len²`, 32 MB in fp32) a grid
/// runs as plain batched products, above it as libtorch's flash attention. At short lengths the
/// products are faster: flash attention's CPU kernel works in blocks of 32 queries, a few small
/// products each, and the key/value heads of grouped-query attention are shared by a view
/// instead of copied (issue 14's bench, 32 rows of ~64 tokens, 4 heads / 2 key-value heads:
/// 4.8–6.2 ms against 8.3–9.6 ms per layer, forward and backward, in PyTorch 2.13 on 2 threads;
/// the whole `update_actor` 5–12% faster in 4 of 5 alternating pairs on a noisy machine). Past
/// it, flash attention keeps memory linear in the length.
const MATH_SCORES: i64 = 1 << 23;

/// [`attend`], with grids of at most `math_scores` scores as batched products.
fn attend_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    grids: &Grids,
    scale: f64,
    math_scores: i64,
) -> Tensor {
    if grids.grids.is_empty() {
        return q.zeros_like();
    }
    let (q, k, v) = (q.squeeze_dim(0), k.squeeze_dim(0), v.squeeze_dim(0));
    let (heads, kv_heads, d) = (q.size()[0], k.size()[0], q.size()[2]);
    let groups = heads / kv_heads;
    let outputs: Vec<Tensor> = grids
        .grids
        .iter()
        .map(|g| {
            // [heads, rows · len, d] → [heads, rows, len, d].
            let lay = |t: &Tensor, slots: &Tensor| {
                let n = t.size()[0];
                t.index_select(1, slots).view([n, g.rows, g.len, d])
            };
            let (q, k, v) = (lay(&q, &g.queries), lay(&k, &g.keys), lay(&v, &g.keys));
            let out = if g.rows * heads * g.len * g.len <= math_scores {
                // Batch (kv head, row); each batch's matrix rows are its query heads' queries.
                let queries = q
                    .view([kv_heads, groups, g.rows, g.len, d])
                    .permute([0, 2, 1, 3, 4])
                    .reshape([kv_heads * g.rows, groups * g.len, d]);
                let at = |t: Tensor| t.reshape([kv_heads * g.rows, g.len, d]);
                let (keys, values) = (at(k), at(v));
                let causal = Tensor::ones([g.len, g.len], (Kind::Bool, q.device()))
                    .triu(1)
                    .repeat([groups, 1]);
                let scores = (queries.matmul(&keys.transpose(1, 2)) * scale)
                    .masked_fill(&causal, f64::NEG_INFINITY);
                scores
                    .softmax(-1, scores.kind())
                    .matmul(&values)
                    .view([kv_heads, g.rows, groups, g.len, d])
                    .permute([0, 2, 1, 3, 4])
            } else {
                let rows_first = |t: Tensor| t.transpose(0, 1);
                rows_first(Tensor::scaled_dot_product_attention(
                    &rows_first(q),
                    &rows_first(k),
                    &rows_first(v),
                    None::<&Tensor>,
                    0.0,
                    true,
                    scale,
                    groups > 1,
                ))
            };
            out.reshape([heads, g.rows * g.len, d])
        })
        .collect();
    let all = if outputs.len() == 1 {
        outputs.into_iter().next().expect("one grid")
    } else {
        Tensor::cat(&outputs, 1)
    };
    all.index_select(1, &grids.gather).unsqueeze(0)
}

/// One padded grid of [`Grids`]: `rows` segments of at most `len` keys, as the stream slots each
/// of its `rows · len` cells reads.
#[derive(Debug)]
struct Grid {
    rows: i64,
    len: i64,
    /// `[rows · len]`: the query slot of each cell (padding cells repeat one; their outputs are
    /// never gathered, so they get no gradient).
    queries: Tensor,
    /// `[rows · len]`: the key slot of each cell (padding cells lie after every real query of
    /// their row, which the causal mask keeps from attending them).
    keys: Tensor,
}

/// Attention segments laid out for batched attention (see [`attend`]).
#[derive(Debug)]
pub(crate) struct Grids {
    grids: Vec<Grid>,
    /// `[T]`: each query's cell among the grids' cells, concatenated.
    gather: Tensor,
}

impl Grids {
    /// The layout of `segments` (queries `0..T` each in exactly one segment). Segments sorted by
    /// key length, longest first, share a grid while their length is at least `1/√2` of its
    /// longest: each grid computes at most twice its segments' own attention scores, in
    /// `⌈2 log₂(longest / shortest)⌉ + 1` grids at most.
    pub(crate) fn new(segments: &[Segment], device: Device) -> Self {
        let queries: i64 = segments.iter().map(|s| s.query_len).sum();
        let mut order: Vec<&Segment> = segments.iter().collect();
        order.sort_by_key(|s| std::cmp::Reverse(s.keys()));
        let mut gather = vec![0i64; queries as usize];
        let mut grids = Vec::new();
        let mut base = 0i64;
        let mut rest = order.as_slice();
        while let Some(first) = rest.first() {
            let len = first.keys();
            let rows = rest
                .iter()
                .take_while(|s| 2 * s.keys() * s.keys() >= len * len)
                .count();
            let (members, after) = rest.split_at(rows);
            let cells = rows * len as usize;
            let (mut query_cells, mut key_cells) =
                (Vec::with_capacity(cells), Vec::with_capacity(cells));
            for (row, s) in members.iter().enumerate() {
                // The queries are the last `query_len` of the segment's keys.
                let first_query = s.keys() - s.query_len;
                for cell in 0..len {
                    let real_key = cell < s.keys();
                    key_cells.push(s.key_slot(if real_key { cell } else { 0 }));
                    let is_query = real_key && cell >= first_query;
                    query_cells.push(s.query_start + if is_query { cell - first_query } else { 0 });
                    if is_query {
                        gather[(s.query_start + cell - first_query) as usize] =
                            base + row as i64 * len + cell;
                    }
                }
            }
            let tensor = |v: &[i64]| Tensor::from_slice(v).to_device(device);
            grids.push(Grid {
                rows: rows as i64,
                len,
                queries: tensor(&query_cells),
                keys: tensor(&key_cells),
            });
            base += cells as i64;
            rest = after;
        }
        Self {
            grids,
            gather: Tensor::from_slice(&gather).to_device(device),
        }
    }
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
    /// Row `b`'s own slots are `cu_seqlens[b] .. cu_seqlens[b + 1]` of the stream (its real
    /// tokens after any shared prompt, then the alignment padding).
    cu_seqlens: Vec<i64>,
    /// Per row, the slots `(start, len)` of the prompt it shares with an earlier row (`len` 0:
    /// none, see [`Self::sharing_prompts`]). The row's keys are those, then its own slots; a
    /// token's index among them is its position.
    shared: Vec<(i64, i64)>,
    /// Whether the stream is the batch's real tokens one slot each: no alignment slots (which
    /// repeat a token) and no shared prompts (whose other rows' tokens have no slot).
    one_slot_per_token: bool,
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
    /// Each predictor's row and position (its index among the row's keys).
    predictor_keys: Vec<(usize, i64)>,
}

impl Packing {
    /// The packing of the rows `attention_mask` (`[B, S]`, on any device) describes, each row
    /// padded to a multiple of `multiple` (1: no padding), for scoring the last `response_len`
    /// columns.
    pub fn new(attention_mask: &Tensor, response_len: i64, multiple: i64) -> Result<Self> {
        Self::build(attention_mask, None, response_len, multiple)
    }

    /// [`Self::new`] (without alignment) sharing prompts: a row whose prompt — the real tokens
    /// of its first `S − R` columns — equals an earlier row's is packed without it, its tokens
    /// attending that row's prompt slots instead (the `n` samples of a prompt in GRPO; verl's
    /// `use_prefix_grouper`). Exact: under causal attention a prompt's keys, values and hidden
    /// states depend on its own tokens alone, so every row scores what its whole sequence would,
    /// and the shared prompt's gradient is the sum of its rows' as when each computes it. A
    /// batch of `n` samples of prompts of `P` tokens and responses of `R` packs `P + n·R`
    /// tokens per prompt instead of `n·(P + R)`.
    pub fn sharing_prompts(
        input_ids: &Tensor,
        attention_mask: &Tensor,
        response_len: i64,
    ) -> Result<Self> {
        Self::build(attention_mask, Some(input_ids), response_len, 1)
    }

    fn build(
        attention_mask: &Tensor,
        share_by: Option<&Tensor>,
        response_len: i64,
        multiple: i64,
    ) -> Result<Self> {
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
        let flat = |t: &Tensor| {
            Vec::<i64>::try_from(t.to_device(Device::Cpu).to_kind(Kind::Int64).reshape([-1]))
                .map_err(|e| ModelError::Torch(e.to_string()))
        };
        let mask = flat(attention_mask)?;
        let ids = match share_by {
            Some(ids) if ids.size() == attention_mask.size() => Some(flat(ids)?),
            Some(ids) => {
                return Err(ModelError::invalid_input(
                    "input_ids",
                    format!(
                        "shape {:?} differs from the attention mask's {:?}",
                        ids.size(),
                        attention_mask.size()
                    ),
                ));
            }
            None => None,
        };
        let prompt_columns = (seq - response_len) as usize;
        // Each distinct prompt's real tokens and the slots of the row that packed them.
        let mut prompts: HashMap<Vec<i64>, (i64, i64)> = HashMap::new();
        let (mut cu_seqlens, mut shared) = (vec![0], Vec::with_capacity(rows as usize));
        let (mut source, mut positions) = (Vec::new(), Vec::new());
        // The slot and position of each real token of the flattened batch.
        let mut slot_of = vec![-1i64; mask.len()];
        let mut position_of = vec![0i64; mask.len()];
        for (b, row_mask) in mask.chunks(seq as usize).enumerate() {
            let row = b * seq as usize;
            let mut prefix = (0, 0);
            if let Some(ids) = &ids {
                let prompt: Vec<i64> = (0..prompt_columns)
                    .filter(|&s| row_mask[s] != 0)
                    .map(|s| ids[row + s])
                    .collect();
                if !prompt.is_empty() {
                    let len = prompt.len() as i64;
                    let first = *prompts.entry(prompt).or_insert((source.len() as i64, len));
                    if first.0 != source.len() as i64 {
                        prefix = first;
                    }
                }
            }
            let mut len = 0i64;
            for (s, &m) in row_mask.iter().enumerate() {
                if m == 0 {
                    continue;
                }
                slot_of[row + s] = if len < prefix.1 {
                    prefix.0 + len
                } else {
                    source.push((row + s) as i64);
                    positions.push(len);
                    source.len() as i64 - 1
                };
                position_of[row + s] = len;
                len += 1;
            }
            let own = source.len() as i64 - cu_seqlens[b];
            let padded = (own + multiple - 1) / multiple * multiple;
            for p in len..len + padded - own {
                source.push(row as i64);
                positions.push(p);
            }
            cu_seqlens.push(source.len() as i64);
            shared.push(prefix);
        }
        let (mut predictors, mut labels, mut targets) = (Vec::new(), Vec::new(), Vec::new());
        let mut predictor_keys = Vec::new();
        for b in 0..rows {
            for r in 0..response_len {
                let at = (b * seq + seq - response_len + r) as usize;
                if mask[at] != 0 && slot_of[at - 1] >= 0 {
                    predictors.push(slot_of[at - 1]);
                    predictor_keys.push((b as usize, position_of[at - 1]));
                    labels.push(at as i64);
                    targets.push(b * response_len + r);
                }
            }
        }
        let real = mask.iter().filter(|&&m| m != 0).count();
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
            predictor_keys,
            one_slot_per_token: source.len() == real,
            cu_seqlens,
            shared,
        })
    }

    /// `B + 1` offsets: row `b`'s own slots are `cu_seqlens[b] .. cu_seqlens[b + 1]` of the
    /// stream.
    pub fn cu_seqlens(&self) -> &[i64] {
        &self.cu_seqlens
    }

    /// How many rows share an earlier row's prompt instead of packing their own.
    pub fn rows_sharing_a_prompt(&self) -> usize {
        self.shared.iter().filter(|(_, len)| *len > 0).count()
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

    /// The packed stream's slots `[n]` whose hidden states predict a scored response token (a
    /// shared prompt's last slot predicts the first response token of each row sharing it).
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

    /// Per-token values `[B·S, ..]` of the padded batch, laid out as the stream's `[N, ..]`
    /// (alignment slots repeat a token of their row).
    pub(crate) fn pack_tokens(&self, values: &Tensor) -> Tensor {
        values.index_select(0, &self.source.to_device(values.device()))
    }

    /// The stream's per-slot values `[N, ..]` in the padded batch's layout `[B·S, ..]`, zero at
    /// padding. `None` unless the stream holds each real token in one slot (no alignment slots,
    /// no shared prompts).
    pub(crate) fn unpack_tokens(&self, values: &Tensor) -> Option<Tensor> {
        if !self.one_slot_per_token {
            return None;
        }
        let mut shape = vec![self.rows * self.seq];
        shape.extend_from_slice(&values.size()[1..]);
        let source = self.source.to_device(values.device());
        Some(
            Tensor::zeros(shape.as_slice(), (values.kind(), values.device()))
                .index_copy(0, &source, values),
        )
    }

    /// Positions `[1, T]` of the stream's `tokens` (`None`: all).
    pub(crate) fn positions(&self, tokens: Option<&Tensor>) -> Tensor {
        match tokens {
            Some(tokens) => self.positions.index_select(0, tokens),
            None => self.positions.shallow_clone(),
        }
        .view([1, -1])
    }

    /// The most keys a row has (its shared prompt and alignment included).
    pub(crate) fn max_len(&self) -> i64 {
        self.cu_seqlens
            .windows(2)
            .zip(&self.shared)
            .map(|(w, (_, prefix))| prefix + w[1] - w[0])
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
                .zip(&self.shared)
                .filter(|(w, _)| w[1] > w[0])
                .map(|(w, &(prefix_start, prefix_len))| Segment {
                    query_start: w[0],
                    query_len: w[1] - w[0],
                    prefix_start,
                    prefix_len,
                    key_start: w[0],
                    key_len: w[1] - w[0],
                })
                .collect(),
            Some(tokens) => {
                let positions = Vec::<i64>::try_from(&self.positions.to_device(Device::Cpu))
                    .expect("int64 positions");
                let mut row = 0;
                self.runs(tokens.iter().map(|&slot| {
                    while self.cu_seqlens[row + 1] <= slot {
                        row += 1;
                    }
                    (row, positions[slot as usize])
                }))
            }
        }
    }

    /// The attention segments of the [`Self::predictors`] as queries: each run of consecutive
    /// positions of one row attending that row's keys up to its last.
    pub(crate) fn predictor_segments(&self) -> Vec<Segment> {
        self.runs(self.predictor_keys.iter().copied())
    }

    /// Segments of queries given as (row, position) in order, consecutive positions of one row
    /// forming one run.
    fn runs(&self, queries: impl Iterator<Item = (usize, i64)>) -> Vec<Segment> {
        let mut segments: Vec<Segment> = Vec::new();
        let mut last_row = None;
        for (i, (row, position)) in queries.enumerate() {
            let (prefix_start, prefix_len) = self.shared[row];
            match segments.last_mut() {
                // The row's next position: the run grows by one query and one key.
                Some(last) if last_row == Some(row) && last.keys() == position => {
                    last.query_len += 1;
                    if position < prefix_len {
                        last.prefix_len += 1;
                    } else {
                        last.key_len += 1;
                    }
                }
                _ => {
                    let in_prefix = (position + 1).min(prefix_len);
                    segments.push(Segment {
                        query_start: i as i64,
                        query_len: 1,
                        prefix_start,
                        prefix_len: in_prefix,
                        key_start: self.cu_seqlens[row],
                        key_len: position + 1 - in_prefix,
                    });
                }
            }
            last_row = Some(row);
        }
        segments
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

    /// Queries `query_start .. + query_len` over the keys `key_start .. + key_len`, no shared
    /// prefix.
    fn segment(query_start: i64, query_len: i64, key_start: i64, key_len: i64) -> Segment {
        Segment {
            query_start,
            query_len,
            prefix_start: 0,
            prefix_len: 0,
            key_start,
            key_len,
        }
    }

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
        let s = |query_start, key_start, key_len| segment(query_start, 1, key_start, key_len);
        assert_eq!(segments, [s(0, 0, 1), s(1, 0, 4), s(2, 4, 1), s(3, 4, 4)]);
        // Consecutive slots of one row form one run.
        let runs = p.segments(Some(&[1, 2, 5, 6]));
        assert_eq!(runs[0].query_len, 2);
        assert_eq!((runs[0].key_start, runs[0].key_len), (0, 3));
        assert_eq!((runs[1].query_start, runs[1].key_len), (2, 3));
    }

    #[test]
    fn rows_with_equal_prompts_share_one() {
        // Prompts of 3 columns, responses of 2. Rows 0, 1 and 3 have the prompt [7, 8], row 2
        // another; row 1's response is one token, row 3's empty.
        let ids = Tensor::from_slice(&[
            0i64, 7, 8, 4, 5, 0, 7, 8, 6, 0, 9, 7, 8, 3, 3, 0, 7, 8, 0, 0,
        ])
        .view([4, 5]);
        let m = mask(&[
            &[0, 1, 1, 1, 1],
            &[0, 1, 1, 1, 0],
            &[1, 1, 1, 1, 1],
            &[0, 1, 1, 0, 0],
        ]);
        let p = Packing::sharing_prompts(&ids, &m, 2).unwrap();
        assert_eq!(p.cu_seqlens(), [0, 4, 5, 10, 10]);
        assert_eq!(p.rows_sharing_a_prompt(), 2);
        assert_eq!(p.shared, [(0, 0), (0, 2), (0, 0), (0, 2)]);
        let source = Vec::<i64>::try_from(&p.source).unwrap();
        assert_eq!(source, [1, 2, 3, 4, 8, 10, 11, 12, 13, 14]);
        let positions = Vec::<i64>::try_from(&p.positions).unwrap();
        assert_eq!(positions, [0, 1, 2, 3, 2, 0, 1, 2, 3, 4]);
        // Row 1's response token is predicted by the shared prompt's last slot.
        assert_eq!(
            Vec::<i64>::try_from(&p.predictors).unwrap(),
            [1, 2, 1, 7, 8]
        );
        assert_eq!(p.max_len(), 5);
        assert!(
            p.unpack_tokens(&Tensor::zeros([10], (Kind::Float, Device::Cpu)))
                .is_none()
        );
        let s = |query_start, query_len, prefix_len, key_start, key_len| Segment {
            query_start,
            query_len,
            prefix_start: 0,
            prefix_len,
            key_start,
            key_len,
        };
        let whole = p.segments(None);
        assert_eq!(whole[1], s(4, 1, 2, 4, 1));
        assert_eq!(whole.len(), 3);
        let predictors = p.predictor_segments();
        assert_eq!(
            predictors,
            [s(0, 2, 0, 0, 3), s(2, 1, 2, 4, 0), s(3, 2, 0, 5, 4)]
        );
        // Without sharing, every row packs its own prompt.
        let own = Packing::new(&m, 2, 1).unwrap();
        assert_eq!(own.cu_seqlens(), [0, 4, 7, 12, 14]);
    }

    /// Attention of each segment alone, written out: softmax(q kᵀ · scale + causal mask) v.
    fn attend_by_hand(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        segments: &[Segment],
        scale: f64,
    ) -> Tensor {
        let mut out = q.zeros_like();
        for s in segments {
            let q = q.narrow(2, s.query_start, s.query_len);
            let slots: Vec<i64> = (0..s.keys()).map(|i| s.key_slot(i)).collect();
            let slots = Tensor::from_slice(&slots);
            let (k, v) = (k.index_select(2, &slots), v.index_select(2, &slots));
            let query = Tensor::arange(s.query_len, (Kind::Int64, Device::Cpu)).view([-1, 1]);
            let key = Tensor::arange(s.keys(), (Kind::Int64, Device::Cpu)).view([1, -1]);
            let hidden = key.gt_tensor(&(query + (s.keys() - s.query_len)));
            let scores = (q.matmul(&k.transpose(-2, -1)) * scale)
                .masked_fill(&hidden, f64::NEG_INFINITY)
                .softmax(-1, Kind::Double);
            out = out.slice_scatter(
                &scores.matmul(&v),
                2,
                s.query_start,
                s.query_start + s.query_len,
                1,
            );
        }
        out
    }

    #[test]
    fn grids_attend_as_each_segment_alone_with_the_same_gradients() {
        // Whole rows of very different lengths (three grids), and context-parallel runs (queries
        // the last few of their keys, two runs sharing one row's keys).
        let whole = |lens: &[i64]| {
            let mut start = 0;
            lens.iter()
                .map(|&len| {
                    let s = segment(start, len, start, len);
                    start += len;
                    s
                })
                .collect::<Vec<_>>()
        };
        let runs = vec![
            segment(0, 2, 0, 5),
            segment(2, 1, 0, 9),
            segment(3, 3, 9, 3),
        ];
        // Rows sharing a prompt: slots 0..4 a prompt and its row's response 4..7; three runs
        // whose keys are that prompt (or its first 3 slots) then their own slots, if any.
        let after_prompt = |query_start, query_len, prefix_len, key_start, key_len| Segment {
            prefix_start: 0,
            prefix_len,
            ..segment(query_start, query_len, key_start, key_len)
        };
        let sharing = vec![
            segment(0, 7, 0, 7),
            after_prompt(7, 5, 4, 7, 5),
            after_prompt(12, 2, 3, 0, 0),
            after_prompt(14, 3, 4, 12, 2),
        ];
        for (segments, keys) in [
            (whole(&[9, 1, 3, 7, 8, 2, 9]), 39),
            (runs, 12),
            (sharing, 14),
        ] {
            let queries: i64 = segments.iter().map(|s| s.query_len).sum();
            let grids = Grids::new(&segments, Device::Cpu);
            assert!(grids.grids.len() >= 2, "{grids:?}");
            tch::manual_seed(3);
            // Four query heads over two key/value heads (grouped-query attention).
            let leaf = |heads: i64, n: i64| {
                Tensor::randn([1, heads, n, 4], (Kind::Double, Device::Cpu)).set_requires_grad(true)
            };
            let (q, k, v) = (leaf(4, queries), leaf(2, keys), leaf(2, keys));
            let weight = Tensor::randn([1, 4, queries, 4], (Kind::Double, Device::Cpu));
            let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Tensor| {
                for t in [&q, &k, &v] {
                    let mut g = t.grad();
                    if g.defined() {
                        let _ = g.zero_();
                    }
                }
                let out = f(&q, &k, &v);
                (&out * &weight).sum(Kind::Double).backward();
                (
                    out.detach(),
                    [q.grad().copy(), k.grad().copy(), v.grad().copy()],
                )
            };
            let (want, want_grads) = run(&|q, k, v| {
                let shared = |t: &Tensor| t.repeat_interleave_self_int(2, 1, None);
                attend_by_hand(q, &shared(k), &shared(v), &segments, 0.5)
            });
            // Every grid as batched products, every grid as flash attention, and the default.
            for math_scores in [i64::MAX, 0, MATH_SCORES] {
                let (got, got_grads) =
                    run(&|q, k, v| attend_with(q, k, v, &grids, 0.5, math_scores));
                let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
                let gap = diff(&got, &want);
                assert!(gap < 1e-12, "{math_scores}: outputs differ by {gap}");
                for (g, w) in got_grads.iter().zip(&want_grads) {
                    let gap = diff(g, w);
                    assert!(gap < 1e-12, "{math_scores}: gradients differ by {gap}");
                }
            }
        }
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
