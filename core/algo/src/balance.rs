//! `trainer.balance_batch`: the batch reordered so that every data-parallel rank's contiguous share
//! holds about the same compute, as verl's `RayPPOTrainer._balance_batch` does with
//! `verl/utils/seqlen_balancing.py` (Karmarkar–Karp's largest differencing method over a FLOP
//! estimate per sequence), and the `global_seqlen/*` metrics it logs.
//!
//! The partitions are verl's to the index, ties included (`core/algo/tests/balance_parity.rs` replays
//! verl's own functions' output), so a batch lands on the same ranks in the same order as in verl.

use std::collections::BTreeMap;

pub use verl_seqlen_balancing::{BalanceError, balanced_partitions, workload};

/// The batch order `trainer.balance_batch` trains in, and its `global_seqlen/*` metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct BalancedOrder {
    /// Row `i` of the balanced batch is row `order[i]` of the original; data-parallel rank `r`
    /// takes the `r`-th contiguous `len / ranks` rows.
    pub order: Vec<usize>,
    /// verl's `log_seqlen_unbalance` under the `global_seqlen` prefix.
    pub metrics: BTreeMap<String, f64>,
}

/// verl's `_balance_batch` (without `keep_minibatch` or the prefix grouper): partitions of equal
/// size over the ranks by workload; within each, rows by ascending workload dealt to both ends
/// (light rows first and last, heavy ones in the middle, verl's ordering against pipeline
/// bubbles). `seqlens` are each row's prompt plus response tokens.
pub fn balance_batch(seqlens: &[u64], ranks: usize) -> Result<BalancedOrder, BalanceError> {
    let workloads: Vec<u64> = seqlens.iter().map(|&s| workload(s)).collect();
    let partitions = balanced_partitions(&workloads, ranks, true)?;
    let order = partitions
        .iter()
        .flat_map(|p| {
            let mut p = p.clone();
            p.sort_by_key(|&i| (workloads[i], i));
            let evens = p.iter().step_by(2).copied().collect::<Vec<_>>();
            let odds_reversed = p
                .iter()
                .skip(1)
                .step_by(2)
                .rev()
                .copied()
                .collect::<Vec<_>>();
            evens.into_iter().chain(odds_reversed)
        })
        .collect();
    Ok(BalancedOrder {
        order,
        metrics: seqlen_unbalance(seqlens, &partitions, "global_seqlen"),
    })
}

/// verl's `log_seqlen_unbalance`: token sums of the contiguous shares before balancing
/// (`min`, `max`, `minmax_diff`, `mean`) and of the partitions (`balanced_min`, `balanced_max`).
pub fn seqlen_unbalance(
    seqlens: &[u64],
    partitions: &[Vec<usize>],
    prefix: &str,
) -> BTreeMap<String, f64> {
    let share = (seqlens.len() / partitions.len()).max(1);
    let before: Vec<u64> = seqlens.chunks(share).map(|c| c.iter().sum()).collect();
    let after: Vec<u64> = partitions
        .iter()
        .map(|p| p.iter().map(|&i| seqlens[i]).sum())
        .collect();
    let (min, max) = min_max(&before);
    let (balanced_min, balanced_max) = min_max(&after);
    let total: u64 = before.iter().sum();
    [
        ("min", min as f64),
        ("max", max as f64),
        ("minmax_diff", (max - min) as f64),
        ("balanced_min", balanced_min as f64),
        ("balanced_max", balanced_max as f64),
        ("mean", total as f64 / partitions.len() as f64),
    ]
    .into_iter()
    .map(|(k, v)| (format!("{prefix}/{k}"), v))
    .collect()
}

fn min_max(values: &[u64]) -> (u64, u64) {
    let min = values.iter().copied().min().unwrap_or(0);
    let max = values.iter().copied().max().unwrap_or(0);
    (min, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rank_deals_light_rows_to_both_ends() {
        let seqlens = [10, 40, 20, 50, 30];
        let b = balance_batch(&seqlens, 1).unwrap();
        // Ascending 10,20,30,40,50 → evens 10,30,50 then odds reversed 40,20.
        assert_eq!(b.order, vec![0, 4, 3, 1, 2]);
        assert_eq!(b.metrics["global_seqlen/min"], 150.0);
        assert_eq!(b.metrics["global_seqlen/balanced_max"], 150.0);
        assert_eq!(b.metrics["global_seqlen/minmax_diff"], 0.0);
    }

    #[test]
    fn two_ranks_get_even_shares_and_the_metrics_say_so() {
        let seqlens = [100, 100, 10, 10];
        let b = balance_batch(&seqlens, 2).unwrap();
        let share =
            |r: usize| -> u64 { b.order[2 * r..2 * r + 2].iter().map(|&i| seqlens[i]).sum() };
        assert_eq!((share(0), share(1)), (110, 110));
        assert_eq!(b.metrics["global_seqlen/min"], 20.0);
        assert_eq!(b.metrics["global_seqlen/max"], 200.0);
        assert_eq!(b.metrics["global_seqlen/minmax_diff"], 180.0);
        assert_eq!(b.metrics["global_seqlen/balanced_min"], 110.0);
        assert_eq!(b.metrics["global_seqlen/mean"], 110.0);
    }
}
