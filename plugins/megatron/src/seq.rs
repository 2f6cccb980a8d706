//! Sequence parallelism's collectives on hidden states `[B, T, H]` split along `T` into
//! tensor-parallel-size equal slices, rank `r` holding slice `r`.

use tch::Tensor;

use crate::comm::Comm;

/// This rank's slice of a whole sequence.
pub fn slice(comm: &Comm, full: &Tensor) -> Tensor {
    let t = full.size()[1] / i64::from(comm.tp_size());
    full.narrow(1, i64::from(comm.tp_rank()) * t, t)
}

/// The whole sequence from every rank's slice.
pub fn all_gather(comm: &Comm, mine: &Tensor) -> verl_torch_runtime::Result<Tensor> {
    let (b, t, h) = mine.size3()?;
    let stacked = comm.all_gather_tp(mine)?; // [tp, B, t, H]
    Ok(stacked
        .permute([1, 0, 2, 3])
        .reshape([b, i64::from(comm.tp_size()) * t, h]))
}

/// This rank's slice of the sum over ranks of `full`.
pub fn reduce_scatter(comm: &Comm, full: &Tensor) -> verl_torch_runtime::Result<Tensor> {
    let (b, s, h) = full.size3()?;
    let tp = i64::from(comm.tp_size());
    let chunks = full.reshape([b, tp, s / tp, h]).permute([1, 0, 2, 3]);
    comm.reduce_scatter_tp(&chunks)
}
