//! `trainer.balance_batch`: the batch reordered so that every data-parallel rank's contiguous share
//! holds about the same compute, as verl's `RayPPOTrainer._balance_batch` does with
//! `verl/utils/seqlen_balancing.py` (Karmarkar–Karp's largest differencing method over a FLOP
//! estimate per sequence), and the `global_seqlen/*` metrics it logs.
//!
//! The partitions are verl's to the index, ties included (`core/tests/balance_parity.rs` replays
//! verl's own functions' output), so a batch lands on the same ranks in the same order as in verl.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

/// verl's `calculate_workload`: FLOPs of a dense block for a sequence of `seqlen` tokens, up to a
/// constant (`12·h²·s + 2·h·s²` with h = 4096, divided by 2h).
pub fn workload(seqlen: u64) -> u64 {
    24576 * seqlen + seqlen * seqlen
}

/// One partition under construction: verl's `Set`, ordered by sum, then size, then items.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Part {
    sum: u64,
    /// `(index, value)` in the order they joined.
    items: Vec<(usize, u64)>,
}

impl Ord for Part {
    fn cmp(&self, other: &Self) -> Ordering {
        self.sum
            .cmp(&other.sum)
            .then(self.items.len().cmp(&other.items.len()))
            .then_with(|| self.items.cmp(&other.items))
    }
}

impl PartialOrd for Part {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// k partitions, heaviest first: verl's `State`.
#[derive(Debug, PartialEq, Eq)]
struct State {
    parts: Vec<Part>,
}

impl State {
    fn new(items: &[(usize, u64)], k: usize) -> Self {
        let mut parts = vec![Part::default(); k];
        for (part, &(index, value)) in parts.iter_mut().zip(items) {
            part.sum += value;
            part.items.push((index, value));
        }
        let mut state = State { parts };
        state.sort();
        state
    }

    /// Descending; `sort_by` is stable as Python's `sorted(reverse=True)`.
    fn sort(&mut self) {
        self.parts.sort_by(|a, b| b.cmp(a));
    }

    fn spread(&self) -> u64 {
        self.parts[0].sum - self.parts[self.parts.len() - 1].sum
    }

    /// The heaviest part of one takes the lightest of the other, and so on.
    fn merge(&mut self, other: State) {
        for (part, theirs) in self.parts.iter_mut().zip(other.parts.into_iter().rev()) {
            part.sum += theirs.sum;
            part.items.extend(theirs.items);
        }
        self.sort();
    }
}

/// The state verl's min-heap pops first (largest spread, then heaviest first part) is the largest
/// here, for `BinaryHeap`. Distinct states never compare equal: their parts hold distinct indices.
impl Ord for State {
    fn cmp(&self, other: &Self) -> Ordering {
        self.spread()
            .cmp(&other.spread())
            .then_with(|| self.parts[0].cmp(&other.parts[0]))
    }
}

impl PartialOrd for State {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Why a batch cannot be split as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BalanceError {
    #[error("cannot split {items} sequences into {parts} non-empty partitions")]
    TooFew { items: usize, parts: usize },
    #[error("{items} sequences do not split into {parts} partitions of equal size")]
    Uneven { items: usize, parts: usize },
}

/// verl's `get_seqlen_balanced_partitions`: `k` partitions of the indices of `values` with sums
/// as equal as Karmarkar–Karp makes them (each of `values.len() / k` items when `equal_size`),
/// heaviest first, the indices of each in ascending order.
pub fn balanced_partitions(
    values: &[u64],
    k: usize,
    equal_size: bool,
) -> Result<Vec<Vec<usize>>, BalanceError> {
    let items = values.len();
    if k == 0 || items < k {
        return Err(BalanceError::TooFew { items, parts: k });
    }
    if equal_size && !items.is_multiple_of(k) {
        return Err(BalanceError::Uneven { items, parts: k });
    }
    let mut sorted: Vec<(u64, usize)> = values.iter().enumerate().map(|(i, &v)| (v, i)).collect();
    sorted.sort_unstable();
    let as_items = |chunk: &[(u64, usize)]| -> Vec<(usize, u64)> {
        chunk.iter().map(|&(v, i)| (i, v)).collect()
    };
    let mut heap: BinaryHeap<State> = if equal_size {
        sorted
            .chunks(k)
            .map(|chunk| State::new(&as_items(chunk), k))
            .collect()
    } else {
        sorted
            .chunks(1)
            .map(|one| State::new(&as_items(one), k))
            .collect()
    };
    while heap.len() > 1 {
        let mut first = heap.pop().expect("two states");
        first.merge(heap.pop().expect("two states"));
        heap.push(first);
    }
    let state = heap.pop().expect("at least one item");
    let mut partitions: Vec<Vec<usize>> = state
        .parts
        .into_iter()
        .map(|p| p.items.into_iter().map(|(i, _)| i).collect())
        .collect();
    for p in &mut partitions {
        if p.is_empty() {
            return Err(BalanceError::TooFew { items, parts: k });
        }
        p.sort_unstable();
    }
    Ok(partitions)
}

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

    fn sums(values: &[u64], partitions: &[Vec<usize>]) -> Vec<u64> {
        partitions
            .iter()
            .map(|p| p.iter().map(|&i| values[i]).sum())
            .collect()
    }

    #[test]
    fn equal_size_partitions_cover_every_index_once_and_balance_by_hand() {
        // Sorted: 1,2 | 3,4 | 5,6 → states {2}{1} · {4}{3} · {6}{5}, each of spread 1. Of equal
        // spreads the heaviest first part pops first: {6}{5} takes {4}{3} crosswise, giving
        // {6,3}{5,4} (spread 0); then {2}{1} (spread 1) pops before it and takes it crosswise:
        // {2,5,4} = 11 and {1,6,3} = 10.
        let values = [5, 1, 6, 2, 4, 3];
        let p = balanced_partitions(&values, 2, true).unwrap();
        assert_eq!(sums(&values, &p), vec![11, 10]);
        assert_eq!(p, vec![vec![0, 3, 4], vec![1, 2, 5]]);
        let mut all: Vec<usize> = p.concat();
        all.sort_unstable();
        assert_eq!(all, (0..6).collect::<Vec<_>>());
    }

    #[test]
    fn free_size_partitions_balance_sums() {
        let values = [8, 7, 6, 5, 4];
        let p = balanced_partitions(&values, 2, false).unwrap();
        let s = sums(&values, &p);
        assert_eq!(s.iter().sum::<u64>(), 30);
        assert!(s[0].abs_diff(s[1]) <= 2, "{s:?}");
    }

    #[test]
    fn bad_splits_are_errors() {
        assert_eq!(
            balanced_partitions(&[1, 2, 3], 2, true),
            Err(BalanceError::Uneven { items: 3, parts: 2 })
        );
        assert_eq!(
            balanced_partitions(&[1], 2, false),
            Err(BalanceError::TooFew { items: 1, parts: 2 })
        );
    }

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
