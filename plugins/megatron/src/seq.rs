//! The collectives of sequence and context parallelism.
//!
//! Sequence parallelism: hidden states `[B, T, H]` split along `T` into tensor-parallel-size
//! equal slices, rank `r` holding slice `r`. Context parallelism: the sequence in `2·cp` equal
//! chunks, rank `i` holding chunks `i` and `2·cp − 1 − i` (the early chunk's causal attention is
//! cheap, the late one's dear: every rank gets the same work); keys and values `[B, kv, T, d]`
//! are gathered from every rank into sequence order.

use tch::{Device, Kind, Tensor};

use crate::comm::{Comm, Scope};

/// This rank's slice of a whole sequence.
pub fn slice(comm: &Comm, full: &Tensor) -> Tensor {
    let t = full.size()[1] / i64::from(comm.tp_size());
    full.narrow(1, i64::from(comm.tp_rank()) * t, t)
}

/// The whole sequence from every rank's slice.
pub fn all_gather(comm: &Comm, mine: &Tensor) -> verl_model::Result<Tensor> {
    let (b, t, h) = mine.size3()?;
    let stacked = comm.all_gather(Scope::Tensor, mine)?; // [tp, B, t, H]
    Ok(stacked
        .permute([1, 0, 2, 3])
        .reshape([b, i64::from(comm.tp_size()) * t, h]))
}

/// This rank's slice of the sum over ranks of `full`.
pub fn reduce_scatter(comm: &Comm, full: &Tensor) -> verl_model::Result<Tensor> {
    let (b, s, h) = full.size3()?;
    let tp = i64::from(comm.tp_size());
    let chunks = full.reshape([b, tp, s / tp, h]).permute([1, 0, 2, 3]);
    comm.reduce_scatter(Scope::Tensor, &chunks)
}

/// The sequence positions of context-parallel rank `rank`'s tokens in a sequence of `len`
/// (a multiple of `2·cp`), in order.
pub fn context_tokens(cp: u32, rank: u32, len: i64, device: Device) -> Tensor {
    let chunk = len / (2 * i64::from(cp));
    let start = |c: i64| Tensor::arange_start(c * chunk, (c + 1) * chunk, (Kind::Int64, device));
    let (first, last) = (i64::from(rank), 2 * i64::from(cp) - 1 - i64::from(rank));
    Tensor::cat(&[start(first), start(last)], 0)
}

/// Where the sequence's chunk `g` lies among the gathered ranks' chunks (rank `r`'s two chunks
/// at `2r` and `2r + 1`).
fn gathered_chunk(cp: i64, g: i64) -> i64 {
    if g < cp {
        2 * g
    } else {
        2 * (2 * cp - 1 - g) + 1
    }
}

/// Every context-parallel rank's keys or values `[B, kv, 2c, d]`, in sequence order
/// `[B, kv, 2·cp·c, d]`.
pub fn gather_context(comm: &Comm, mine: &Tensor) -> verl_model::Result<Tensor> {
    let cp = i64::from(comm.cp_size());
    let size = mine.size();
    let (b, kv, t, d) = (size[0], size[1], size[2], size[3]);
    let c = t / 2;
    // [cp, B, kv, 2, c, d] → [2·cp chunks (rank-major), B, kv, c, d]
    let chunks = comm
        .all_gather(Scope::Context, mine)?
        .view([cp, b, kv, 2, c, d])
        .permute([0, 3, 1, 2, 4, 5])
        .reshape([2 * cp, b, kv, c, d]);
    let order: Vec<i64> = (0..2 * cp).map(|g| gathered_chunk(cp, g)).collect();
    Ok(chunks
        .index_select(0, &Tensor::from_slice(&order).to_device(mine.device()))
        .permute([1, 2, 0, 3, 4])
        .reshape([b, kv, 2 * cp * c, d]))
}

/// This rank's chunks of the sum over context-parallel ranks of `full` `[B, kv, S, d]` in
/// sequence order (the conjugate of [`gather_context`]).
pub fn reduce_scatter_context(comm: &Comm, full: &Tensor) -> verl_model::Result<Tensor> {
    let cp = i64::from(comm.cp_size());
    let size = full.size();
    let (b, kv, s, d) = (size[0], size[1], size[2], size[3]);
    let c = s / (2 * cp);
    // Sequence chunks → rank-major chunks: the inverse of `gather_context`'s order.
    let mut inverse = vec![0i64; (2 * cp) as usize];
    for g in 0..2 * cp {
        inverse[gathered_chunk(cp, g) as usize] = g;
    }
    let rank_major = full
        .reshape([b, kv, 2 * cp, c, d])
        .permute([2, 0, 1, 3, 4])
        .index_select(0, &Tensor::from_slice(&inverse).to_device(full.device()))
        .view([cp, 2, b, kv, c, d])
        .permute([0, 2, 3, 1, 4, 5])
        .reshape([cp, b, kv, 2 * c, d]);
    comm.reduce_scatter(Scope::Context, &rank_major)
}

/// A packed stream's context-parallel layout (verl's THD with `context_parallel_size > 1`): every
/// row (a multiple of `2·cp` slots long) split in `2·cp` chunks, rank `i` holding chunks `i` and
/// `2·cp − 1 − i` of each row, as Megatron partitions THD batches.
#[derive(Debug)]
pub struct PackedContext {
    /// This rank's slots, in stream order.
    pub mine: Tensor,
    /// Every rank's slots, rank-major: where each gathered key comes from.
    every: Tensor,
    /// The gathered rank-major position of each slot of the stream.
    order: Tensor,
}

impl PackedContext {
    pub fn new(comm: &Comm, cu_seqlens: &[i64], device: Device) -> Self {
        let cp = comm.cp_size();
        let tokens = |rank: u32| {
            let rows: Vec<Tensor> = cu_seqlens
                .windows(2)
                .map(|w| context_tokens(cp, rank, w[1] - w[0], device) + w[0])
                .collect();
            Tensor::cat(&rows, 0)
        };
        let every = Tensor::cat(&(0..cp).map(tokens).collect::<Vec<_>>(), 0);
        Self {
            mine: tokens(comm.cp_rank()),
            order: every.argsort(0, false),
            every,
        }
    }

    /// Every context-parallel rank's keys or values `[1, kv, n, d]` (each rank's slots) in
    /// stream order, `[1, kv, cp·n, d]`.
    pub fn gather(&self, comm: &Comm, mine: &Tensor) -> verl_model::Result<Tensor> {
        let size = mine.size();
        let (kv, n, d) = (size[1], size[2], size[3]);
        let cp = i64::from(comm.cp_size());
        Ok(comm
            .all_gather(Scope::Context, mine)?
            .permute([1, 2, 0, 3, 4])
            .reshape([1, kv, cp * n, d])
            .index_select(2, &self.order))
    }

    /// This rank's slots of the sum over context-parallel ranks of `full` `[1, kv, N, d]` in
    /// stream order (the conjugate of [`Self::gather`]).
    pub fn reduce_scatter(&self, comm: &Comm, full: &Tensor) -> verl_model::Result<Tensor> {
        let size = full.size();
        let (kv, d) = (size[1], size[3]);
        let cp = i64::from(comm.cp_size());
        let rank_major = full
            .index_select(2, &self.every)
            .view([1, kv, cp, -1, d])
            .permute([2, 0, 1, 3, 4])
            .contiguous();
        comm.reduce_scatter(Scope::Context, &rank_major)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_hold_an_early_and_a_late_chunk() {
        let tokens = |rank| Vec::<i64>::try_from(&context_tokens(2, rank, 8, Device::Cpu)).unwrap();
        assert_eq!(tokens(0), [0, 1, 6, 7]);
        assert_eq!(tokens(1), [2, 3, 4, 5]);
        // Gathered rank-major [r0c0, r0c3, r1c1, r1c2]: sequence chunk g sits at …
        assert_eq!(
            (0..4).map(|g| gathered_chunk(2, g)).collect::<Vec<_>>(),
            [0, 2, 3, 1]
        );
    }
}
