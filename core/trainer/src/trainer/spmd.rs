//! The trainer as one of several data-parallel ranks (SPMD: every rank runs the same loop).
//!
//! Every rank loads the same data in the same order and holds the same global batch of prompts.
//! Generation is sharded: each rank generates for its contiguous slice of the prompts (a prompt's
//! `n` responses stay together), each prompt sampled from its own seed (the step's seed and the
//! prompt's index in the global batch), so the samples do not depend on the number of ranks.
//! The generated rows and their scores are all-gathered, so every rank builds the same global
//! batch; each engine call takes the rank's contiguous slice of its rows, and the per-token
//! outputs (log-probs, values) are all-gathered back. The algorithm (KL in reward, advantages,
//! data metrics) then runs on the global batch on every rank, exactly as on one rank; the
//! engines normalise their losses by the global batch and sum gradients across ranks. Rank 0
//! alone logs, writes the trainer's state and commits checkpoints.
//!
//! The exchange goes through the actor engine's process group (`Engine::all_gather_object`); on
//! one rank nothing is exchanged.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::TrainError;
use verl_algo::Matrix;
use verl_config::Config;

/// Where this process is among the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ranks {
    pub rank: u32,
    pub world_size: u32,
}

impl Ranks {
    /// Rank 0: the one that logs and commits.
    pub fn leader(&self) -> bool {
        self.rank == 0
    }

    pub fn single(&self) -> bool {
        self.world_size <= 1
    }

    /// This rank's contiguous part of `len` items: the first `len % world_size` ranks take one
    /// more.
    pub fn part(&self, len: usize) -> Range<usize> {
        let (world, rank) = (self.world_size.max(1) as usize, self.rank as usize);
        let (base, extra) = (len / world, len % world);
        let start = rank * base + rank.min(extra);
        start..start + base + usize::from(rank < extra)
    }
}

/// With several ranks, each takes an equal share of the batch's responses, so that every rank
/// runs the same number of engine mini-batches (and so of collectives).
pub(super) fn check_data_parallel(config: &Config, ranks: Ranks) -> Result<(), TrainError> {
    let world = ranks.world_size as usize;
    let responses = config.data.train_batch_size * config.actor_rollout_ref.rollout.n;
    if world > 1 && !responses.is_multiple_of(world) {
        return Err(TrainError::Invalid(format!(
            "data.train_batch_size × actor_rollout_ref.rollout.n = {responses} responses per step do not split evenly over {world} data-parallel ranks (WORLD_SIZE)"
        )));
    }
    Ok(())
}

/// SplitMix64's finaliser: a well-mixed 64-bit value from any input.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The sampling seed of the prompt at `index` of a request whose seed is `request_seed`:
/// whichever rank generates it, the prompt samples the same.
pub(super) fn prompt_seed(request_seed: u64, index: u64) -> u64 {
    mix(request_seed ^ mix(index))
}

/// A matrix as it crosses between ranks: f32 bit patterns (exact, NaN included).
#[derive(Serialize, Deserialize)]
pub(super) struct MatrixRows {
    cols: usize,
    bits: Vec<u32>,
}

impl MatrixRows {
    pub fn of(matrix: &Matrix) -> Self {
        Self {
            cols: matrix.shape().1,
            bits: matrix.data().iter().map(|v| v.to_bits()).collect(),
        }
    }

    /// The rows of every rank's part, in rank order, as one matrix.
    pub fn concat(parts: Vec<Self>, name: &str) -> Result<Matrix, String> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if let Some(odd) = parts.iter().position(|p| p.cols != cols) {
            return Err(format!(
                "`{name}` has {} columns on rank {odd}, {cols} on rank 0",
                parts[odd].cols
            ));
        }
        let data: Vec<f32> = parts
            .into_iter()
            .flat_map(|p| p.bits)
            .map(f32::from_bits)
            .collect();
        let rows = data.len().checked_div(cols).unwrap_or(0);
        Matrix::new(rows, cols, data).map_err(|e| format!("`{name}`: {e}"))
    }
}

/// Scores as they cross between ranks: f64 bit patterns.
pub(super) fn score_bits(scores: &[f64]) -> Vec<u64> {
    scores.iter().map(|s| s.to_bits()).collect()
}

pub(super) fn scores_of(bits: &[u64]) -> Vec<f64> {
    bits.iter().map(|&b| f64::from_bits(b)).collect()
}

/// A rank's outcome of a step every rank takes part in (writing its part of a checkpoint…),
/// as exchanged: `None` when it succeeded, else its error.
pub(super) type Outcome = Option<String>;

/// The ranks that failed, with their errors, for one message; `None` when every rank succeeded.
pub(super) fn failures(outcomes: &[Outcome]) -> Option<String> {
    let failed: Vec<String> = outcomes
        .iter()
        .enumerate()
        .filter_map(|(rank, o)| o.as_ref().map(|e| format!("rank {rank}: {e}")))
        .collect();
    (!failed.is_empty()).then(|| failed.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_item_once_in_rank_order() {
        for world_size in 1..=5u32 {
            for len in 0..=13 {
                let parts: Vec<Range<usize>> = (0..world_size)
                    .map(|rank| Ranks { rank, world_size }.part(len))
                    .collect();
                let flat: Vec<usize> = parts.iter().flat_map(|p| p.clone()).collect();
                assert_eq!(flat, (0..len).collect::<Vec<_>>(), "{world_size} {len}");
                let sizes: Vec<usize> = parts.iter().map(|p| p.len()).collect();
                assert!(
                    sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
                    "{sizes:?}"
                );
            }
        }
        assert_eq!(
            Ranks {
                rank: 1,
                world_size: 2
            }
            .part(8),
            4..8
        );
    }

    #[test]
    fn the_batch_must_split_evenly_over_the_ranks() {
        let mut config = Config::default();
        config.data.train_batch_size = 3;
        config.actor_rollout_ref.rollout.n = 2;
        let ranks = |world_size| Ranks {
            rank: 0,
            world_size,
        };
        assert!(check_data_parallel(&config, ranks(1)).is_ok());
        assert!(check_data_parallel(&config, ranks(2)).is_ok());
        assert!(check_data_parallel(&config, ranks(3)).is_ok());
        let err = check_data_parallel(&config, ranks(4))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "data.train_batch_size × actor_rollout_ref.rollout.n = 6 responses per step do not split evenly over 4 data-parallel ranks (WORLD_SIZE)"
        );
    }

    #[test]
    fn prompt_seeds_differ_by_prompt_and_request() {
        let seeds: std::collections::BTreeSet<u64> = (0..1000)
            .flat_map(|i| [prompt_seed(7, i), prompt_seed(8, i)])
            .collect();
        assert_eq!(seeds.len(), 2000);
        assert_eq!(prompt_seed(7, 3), prompt_seed(7, 3));
    }

    #[test]
    fn matrices_cross_exactly_and_concatenate_in_rank_order() {
        let a = Matrix::new(1, 2, vec![0.1, f32::NAN]).unwrap();
        let b = Matrix::new(2, 2, vec![-0.0, f32::MIN_POSITIVE, 1e-30, 3.0]).unwrap();
        let wire = |m: &Matrix| -> MatrixRows {
            serde_json::from_slice(&serde_json::to_vec(&MatrixRows::of(m)).unwrap()).unwrap()
        };
        let joined = MatrixRows::concat(vec![wire(&a), wire(&b)], "x").unwrap();
        assert_eq!(joined.shape(), (3, 2));
        let bits: Vec<u32> = joined.data().iter().map(|v| v.to_bits()).collect();
        let want: Vec<u32> = a
            .data()
            .iter()
            .chain(b.data())
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(bits, want);
        let odd = Matrix::new(1, 3, vec![0.0; 3]).unwrap();
        let err = MatrixRows::concat(vec![wire(&a), wire(&odd)], "values").unwrap_err();
        assert_eq!(err, "`values` has 3 columns on rank 1, 2 on rank 0");
    }

    #[test]
    fn failures_name_every_failed_rank() {
        assert_eq!(failures(&[None, None]), None);
        assert_eq!(
            failures(&[None, Some("disk full".into()), Some("gone".into())]).unwrap(),
            "rank 1: disk full; rank 2: gone"
        );
    }
}
