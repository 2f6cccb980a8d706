//! Backward passes through collectives. libtorch's autograd (as tch exposes it) has no custom
//! functions, so a collective whose backward is another collective (Megatron's `f`: identity
//! forward, all-reduce backward; sequence parallelism's all-gather / reduce-scatter pair) is a
//! *cut*: its output is a fresh leaf holding the forward result, and the tape remembers the
//! source it came from. [`Tape::backward`] runs `loss.backward()`, which stops at the leaves, then
//! goes through the cuts newest first: the leaf's accumulated gradient, through the backward
//! collective, is sent into the source's graph. A cut's leaf is only used after the cut, so by
//! the time it is reached every later segment has added its share to the leaf's gradient.
//!
//! The residual stream is cut (identity both ways) at each sub-layer's input as well, so that
//! every part of the graph lies between two cuts and is traversed once: no graph is retained and
//! the backward pass costs what one `loss.backward()` would.
//!
//! A collective whose backward is the identity (Megatron's `g`, the all-reduce after a
//! row-parallel layer) needs no cut: `sum.detach() + (x − x.detach())` has the all-reduced value
//! exactly (the difference is exactly zero) and passes the gradient straight to `x`. That is
//! right only when everything computed from the sum is replicated (every rank's gradient of the
//! sum is the whole gradient): a shard's own computation must not depend on a reduced value
//! (the vocab-parallel entropy therefore reduces `Σ e^z` and `Σ e^z·z` separately and divides
//! afterwards).

use std::cell::RefCell;
use std::rc::Rc;

use tch::{Kind, Tensor};

use crate::comm::{Comm, Scope};
use crate::seq;

/// What a cut's backward does with the leaf's gradient.
#[derive(Debug, Clone)]
pub enum Backward {
    Identity,
    /// Sums the gradient over the tensor-parallel ranks (Megatron's `f`).
    AllReduce,
    /// The leaf is the whole sequence gathered from every rank's slice, and every rank's
    /// gradient is partial: the slices of the summed gradient go back (all-gather's conjugate).
    ReduceScatterSeq,
    /// The leaf is the whole sequence gathered, and every rank's gradient is already whole
    /// (computed from replicated weights): each rank keeps its own slice.
    SliceSeq,
    /// The leaf is this rank's slice of a reduce-scattered sequence: the gradients of every
    /// slice are gathered (reduce-scatter's conjugate).
    GatherSeq,
    /// The leaf is every context-parallel rank's keys or values in sequence order: each rank's
    /// gradient (from its queries) is partial, and each keeps the sum over its own chunks.
    ReduceScatterContext,
    /// As `ReduceScatterContext` for a packed stream's keys or values.
    ReduceScatterPacked(Rc<seq::PackedContext>),
}

struct Cut {
    source: Tensor,
    leaf: Tensor,
    backward: Backward,
}

/// The cuts of one forward pass that will be differentiated.
#[derive(Default)]
pub struct Tape {
    cuts: RefCell<Vec<Cut>>,
}

impl Tape {
    /// A leaf holding `value` (the forward result of a collective on `source`), remembered
    /// with the backward collective that takes its gradient back to `source`.
    pub fn cut(&self, source: &Tensor, value: &Tensor, backward: Backward) -> Tensor {
        if !source.requires_grad() {
            return value.shallow_clone();
        }
        let leaf = value.detach().set_requires_grad(true);
        self.cuts.borrow_mut().push(Cut {
            source: source.shallow_clone(),
            leaf: leaf.shallow_clone(),
            backward,
        });
        leaf
    }

    /// Backpropagates `loss` (a scalar, the same on every tensor-parallel rank) through the
    /// recorded cuts into the parameters' gradients.
    pub fn backward(self, loss: &Tensor, comm: &Comm) -> verl_model::Result<()> {
        loss.f_backward()?;
        for cut in self.cuts.into_inner().into_iter().rev() {
            let grad = cut.leaf.grad();
            if !grad.defined() {
                continue; // nothing after the cut depended on it
            }
            let grad = match cut.backward {
                Backward::Identity => grad,
                Backward::AllReduce => {
                    let mut grad = grad.contiguous();
                    comm.all_reduce(Scope::Tensor, &mut grad, verl_distributed::ReduceOp::Sum)?;
                    grad
                }
                Backward::ReduceScatterSeq => seq::reduce_scatter(comm, &grad)?,
                Backward::SliceSeq => seq::slice(comm, &grad),
                Backward::GatherSeq => seq::all_gather(comm, &grad)?,
                Backward::ReduceScatterContext => seq::reduce_scatter_context(comm, &grad)?,
                Backward::ReduceScatterPacked(layout) => layout.reduce_scatter(comm, &grad)?,
            };
            (&cut.source * grad).sum(Kind::Float).f_backward()?;
        }
        Ok(())
    }
}

/// Megatron's `g` without a cut: the sum of `x` over `scope`'s ranks, with the gradient passing
/// to `x` unchanged.
pub fn all_reduce_identity_backward(
    comm: &Comm,
    scope: Scope,
    x: &Tensor,
) -> verl_model::Result<Tensor> {
    let mut sum = x.detach().contiguous();
    comm.all_reduce(scope, &mut sum, verl_distributed::ReduceOp::Sum)?;
    if !x.requires_grad() {
        return Ok(sum);
    }
    Ok(sum + (x - x.detach()))
}
