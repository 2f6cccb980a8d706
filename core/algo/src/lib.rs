//! RL algorithm building blocks with verl's semantics: advantage estimators, KL-in-reward
//! controllers, token-level reward placement, DAPO group filtering and the per-step data metrics.
//!
//! Everything works on [`Matrix`], a row-major `[batch × response_length]` f32 array, with masks as
//! 0/1 matrices of the same shape, so the trainer can feed engine outputs in without libtorch.

mod advantage;
mod balance;
mod filter;
mod kl;
mod metrics;
mod rollout_corr;
mod tensor;

pub use advantage::{
    AdvEstimator, AdvantageInput, AdvantageParams, compute_advantage, masked_mean, masked_whiten,
};
pub use balance::{
    BalanceError, BalancedOrder, balance_batch, balanced_partitions, seqlen_unbalance, workload,
};
pub use filter::{DynamicSampler, FILTER_STD_TOLERANCE, SamplerProgress, filter_groups};
pub use kl::{KlController, KlCtrlType, KlPenalty, KlPenaltyOutput, apply_kl_penalty, kl_penalty};
pub use metrics::{
    DataMetricsInput, VarianceProxyInput, compute_data_metrics, rollout_probs_diff, timing_metrics,
    validation_metrics, variance_proxy_metrics,
};
pub use rollout_corr::{Correction, IsLevel, RolloutCorrection, rollout_correction};
pub use tensor::{Matrix, place_scores};

/// What can go wrong in an algorithm call: always a caller's shape or configuration mistake.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AlgoError {
    #[error("`{what}` has shape {got:?}, expected {expected:?}")]
    Shape {
        what: &'static str,
        expected: (usize, usize),
        got: (usize, usize),
    },
    #[error("`{what}` has {got} entries, expected {expected}")]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("matrix data has {len} values, which is not {rows}×{cols}")]
    Data {
        rows: usize,
        cols: usize,
        len: usize,
    },
    #[error("masked whitening needs at least two unmasked values, the mask has {0}")]
    TooFewMasked(usize),
    #[error("advantage estimator `{0}` needs `{1}`")]
    MissingInput(&'static str, &'static str),
    #[error(
        "advantage estimator `{estimator}` needs at least {needs} responses per prompt, a group has {got} (actor_rollout_ref.rollout.n)"
    )]
    GroupTooSmall {
        estimator: &'static str,
        needs: usize,
        got: usize,
    },
    #[error("algorithm.kl_ctrl.horizon must be larger than 0 for the adaptive controller")]
    Horizon,
    #[error("every response in the batch is empty (aborted)")]
    AllAborted,
    #[error(
        "dynamic sampling generated {0} batches without filling the batch (algorithm.filter_groups.max_num_gen_batches); the data may be too easy or too hard"
    )]
    TooManyGenBatches(u64),
    /// `algorithm.rollout_correction` settings or inputs verl would refuse.
    #[error("rollout correction: {0}")]
    RolloutCorrection(String),
}
