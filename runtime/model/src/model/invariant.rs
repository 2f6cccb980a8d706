//! The batch-invariant kernels of the deterministic mode (`trainer.deterministic`): a token's
//! result is bit-identical whatever else is in its batch, wherever it sits and however the batch
//! is padded or packed, and a KV-cache decode step computes exactly what the full forward pass
//! computes at that position.
//!
//! libtorch's CPU kernels pick their blocking by shape (MKL's sgemm multiplies one row as a
//! matrix-vector product and more rows as blocked tiles, each rounding differently), so a row's
//! result depends on how many rows share its call. Here every reduction runs in a call whose
//! shape does not depend on the batch:
//! - row-local work (projections, norms, MLPs, the LM head and its log-softmax) runs over tiles
//!   of [`ROW_TILE`] rows, zero-padded, one call per tile: the same shape every call. Within a
//!   tile a row's result does not depend on its position or its neighbours (MKL computes each
//!   output element from its row and column in a fixed order for a fixed shape; the switch tests
//!   check it, and `ROW_TILE × width` is a multiple of the vector width, so no element lands in a
//!   scalar tail loop).
//! - attention runs per sequence over its own real keys (padding is dropped, not masked), in
//!   tiles of [`ATTENTION_TILE`] queries × keys aligned to absolute positions, with an online
//!   softmax over the key tiles in order: the query at position `p` always sees key tiles
//!   `0..=p / ATTENTION_TILE`, the last one causally masked at the same columns, whether it is
//!   one query of a decode step (the rest of its tile zero) or one of a whole sequence.

use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use super::packed::Segment;

/// Rows per call of a row-local operation.
pub(crate) const ROW_TILE: i64 = 16;

/// Queries and keys per attention tile.
pub(crate) const ATTENTION_TILE: i64 = 32;

/// `f` applied to the rows of `x` (its last dimension is the row) in tiles of [`ROW_TILE`] rows,
/// the last tile padded with zero rows; the result keeps `x`'s leading shape.
pub(super) fn rows(x: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> Tensor {
    let size = x.size();
    let (lead, width) = size.split_at(size.len() - 1);
    let count: i64 = lead.iter().product();
    let flat = x.reshape([count, width[0]]);
    let pad = (ROW_TILE - count % ROW_TILE) % ROW_TILE;
    let flat = if pad > 0 {
        Tensor::cat(
            &[flat, x.new_zeros([pad, width[0]], (x.kind(), x.device()))],
            0,
        )
    } else {
        flat
    };
    let out = if count == 0 {
        f(&flat) // no rows: nothing to tile
    } else {
        let outputs: Vec<Tensor> = (0..(count + pad) / ROW_TILE)
            .map(|i| f(&flat.narrow(0, i * ROW_TILE, ROW_TILE)))
            .collect();
        Tensor::cat(&outputs, 0).narrow(0, 0, count)
    };
    let mut shape = lead.to_vec();
    shape.push(out.size()[1]);
    out.reshape(shape.as_slice())
}

/// The queries of one sequence in a forward pass and the keys they attend.
pub(crate) struct Span {
    /// The row of the batch (0 for a packed stream).
    pub row: i64,
    /// `[n]` int64: the queries' indices along the pass's token dimension.
    pub queries: Tensor,
    /// Each query's position in the sequence: it attends `keys[..=position]`.
    pub positions: Vec<i64>,
    /// `[m]` int64: the sequence's keys' indices along the key dimension, in order.
    pub keys: Tensor,
}

impl Span {
    /// The spans of a padded batch: `valid` `[B, S]` (true at real tokens), the pass's queries
    /// at key indices `queries` `[T]` and sequence positions `positions` `[B, T]`. Padding
    /// queries are left out (their outputs are zero and never read).
    pub(crate) fn per_row(valid: &Tensor, queries: &Tensor, positions: &Tensor) -> Vec<Self> {
        let device = valid.device();
        let (b, s) = valid.size2().expect("the mask is [B, S]");
        let valid = Vec::<bool>::try_from(valid.reshape([-1]).to_device(tch::Device::Cpu))
            .expect("a bool mask");
        let queries = Vec::<i64>::try_from(queries.to_device(tch::Device::Cpu)).expect("int64");
        let positions = Vec::<i64>::try_from(positions.reshape([-1]).to_device(tch::Device::Cpu))
            .expect("int64 positions");
        let t = queries.len();
        (0..b as usize)
            .map(|row| {
                let real = &valid[row * s as usize..(row + 1) * s as usize];
                let keys: Vec<i64> = (0..s).filter(|&i| real[i as usize]).collect();
                let (indices, positions): (Vec<i64>, Vec<i64>) = queries
                    .iter()
                    .enumerate()
                    .filter(|(_, q)| real[**q as usize])
                    .map(|(j, _)| (j as i64, positions[row * t + j]))
                    .unzip();
                Self {
                    row: row as i64,
                    queries: Tensor::from_slice(&indices).to_device(device),
                    positions,
                    keys: Tensor::from_slice(&keys).to_device(device),
                }
            })
            .collect()
    }

    /// The span of a packed stream's segment: its queries are the last `query_len` tokens of
    /// the prefix its keys cover.
    pub(crate) fn of_segment(segment: &Segment, device: tch::Device) -> Self {
        debug_assert_eq!(
            segment.prefix_len, 0,
            "the deterministic mode packs every row's prompt"
        );
        let first = segment.key_len - segment.query_len;
        let range = |start, len| Tensor::arange_start(start, start + len, (Kind::Int64, device));
        Self {
            row: 0,
            queries: range(segment.query_start, segment.query_len),
            positions: (first..segment.key_len).collect(),
            keys: range(segment.key_start, segment.key_len),
        }
    }
}

/// Attention of `q` `[B, T, heads, d]` over `k`, `v` `[B, heads, S, d]` (grouped-query heads
/// already repeated) per span; `[B, T, heads, d]`, zero at queries no span covers (padding).
pub(super) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, spans: &[Span], scale: f64) -> Tensor {
    let mut rows: BTreeMap<i64, Tensor> = BTreeMap::new();
    for span in spans {
        if span.positions.is_empty() {
            continue;
        }
        // [heads, n, d] queries, [heads, m, d] keys and values.
        let qs = q
            .get(span.row)
            .index_select(0, &span.queries)
            .transpose(0, 1);
        let ks = k.get(span.row).index_select(1, &span.keys);
        let vs = v.get(span.row).index_select(1, &span.keys);
        let out = sequence_attention(&qs, &span.positions, &ks, &vs, scale).transpose(0, 1);
        let row = rows
            .remove(&span.row)
            .unwrap_or_else(|| q.get(span.row).zeros_like());
        rows.insert(span.row, row.index_copy(0, &span.queries, &out));
    }
    let rows: Vec<Tensor> = (0..q.size()[0])
        .map(|b| rows.remove(&b).unwrap_or_else(|| q.get(b).zeros_like()))
        .collect();
    Tensor::stack(&rows, 0)
}

/// Causal attention of one sequence's queries `q` `[heads, n, d]` at `positions` over its keys
/// and values `[heads, m, d]`, `[heads, n, d]`: flash-style, per query tile, key tiles in order.
fn sequence_attention(q: &Tensor, positions: &[i64], k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
    let (heads, m, d) = k.size3().expect("keys are [heads, m, d]");
    let tile = ATTENTION_TILE;
    let options = (q.kind(), q.device());
    let tiles = (m + tile - 1) / tile;
    let pad = tiles * tile - m;
    let (k, v) = if pad > 0 {
        let zeros = Tensor::zeros([heads, pad, d], options);
        (Tensor::cat(&[k, &zeros], 1), Tensor::cat(&[v, &zeros], 1))
    } else {
        (k.shallow_clone(), v.shallow_clone())
    };
    // Query tile → (the queries' indices into `q`, their rows in the tile).
    let mut groups: BTreeMap<i64, (Vec<i64>, Vec<i64>)> = BTreeMap::new();
    for (i, &p) in positions.iter().enumerate() {
        let group = groups.entry(p / tile).or_default();
        group.0.push(i as i64);
        group.1.push(p % tile);
    }
    // The diagonal tile's causal mask: key column c is visible to query row r when c ≤ r.
    let ar = Tensor::arange(tile, (Kind::Int64, q.device()));
    let hidden = ar.view([1, tile]).gt_tensor(&ar.view([tile, 1]));
    let mut out = q.zeros_like();
    for (j, (indices, tile_rows)) in groups {
        let indices = Tensor::from_slice(&indices).to_device(q.device());
        let tile_rows = Tensor::from_slice(&tile_rows).to_device(q.device());
        let queries = Tensor::zeros([heads, tile, d], options).index_copy(
            1,
            &tile_rows,
            &q.index_select(1, &indices),
        );
        let mut max = Tensor::full([heads, tile, 1], f64::NEG_INFINITY, options);
        let mut sum = Tensor::zeros([heads, tile, 1], options);
        let mut acc = Tensor::zeros([heads, tile, d], options);
        for kt in 0..=j {
            let (keys, values) = (k.narrow(1, kt * tile, tile), v.narrow(1, kt * tile, tile));
            let mut scores = queries.matmul(&keys.transpose(1, 2)) * scale;
            if kt == j {
                scores = scores.masked_fill(&hidden, f64::NEG_INFINITY);
            }
            let next = max.maximum(&scores.amax([-1].as_slice(), true));
            let p = (&scores - &next).exp();
            let alpha = (&max - &next).exp();
            sum = &sum * &alpha + p.sum_dim_intlist(-1, true, p.kind());
            acc = &acc * &alpha + p.matmul(&values);
            max = next;
        }
        let result = (acc / sum).index_select(1, &tile_rows);
        out = out.index_copy(1, &indices, &result);
    }
    out
}
