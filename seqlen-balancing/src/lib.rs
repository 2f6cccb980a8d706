//! verl's sequence-length balancing (`verl/utils/seqlen_balancing.py`), shared by the trainer and
//! the engines so that there is one implementation:
//!
//! - [`balanced_partitions`]: Karmarkar–Karp's largest differencing method, verl's
//!   `get_seqlen_balanced_partitions`, to the index (ties included);
//! - [`micro_batch_count`] and [`micro_batches`]: verl's `rearrange_micro_batches`, the
//!   micro-batches of `use_dynamic_bsz` (a token budget per micro-batch instead of a row count).
//!
//! verl-core's trainer uses the first for `trainer.balance_batch` (equal-size partitions over the
//! data-parallel ranks); the engines use the others to cut their rows by a token budget.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

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
    /// verl asserts `max_token_len >= max_seq_len`, the padded width of the batch.
    #[error(
        "a micro-batch budget of {max_token_len} tokens is smaller than one sequence: the batch's \
         rows are {max_seq_len} tokens wide (prompt + response, padded)"
    )]
    TokenBudget {
        max_token_len: u64,
        max_seq_len: u64,
    },
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

/// How many micro-batches verl's `rearrange_micro_batches` cuts rows of `seqlens` real tokens
/// into with a budget of `max_token_len` tokens each: enough for the total
/// (`ceil(Σ seqlens / max_token_len)`), at most one per row, and at least one. The budget must
/// hold a whole row of the padded batch (`max_seq_len` wide), as verl asserts.
///
/// verl then raises the count to the largest over the data-parallel ranks (`same_micro_num_in_dp`),
/// which the caller does before [`micro_batches`].
pub fn micro_batch_count(
    seqlens: &[u64],
    max_seq_len: u64,
    max_token_len: u64,
) -> Result<usize, BalanceError> {
    if max_token_len < max_seq_len {
        return Err(BalanceError::TokenBudget {
            max_token_len,
            max_seq_len,
        });
    }
    let total: u64 = seqlens.iter().sum();
    let needed = usize::try_from(total.div_ceil(max_token_len)).unwrap_or(usize::MAX);
    Ok(needed.min(seqlens.len()).max(1))
}

/// verl's `rearrange_micro_batches` with `use_dynamic_bsz_balance` (its default): `count`
/// partitions of the rows balanced by [`workload`] (Karmarkar–Karp, sizes free), ordered by
/// workload from the heaviest down (ties by first index), then the even positions reversed
/// followed by the odd ones, so that the lightest micro-batches run first and last. Each
/// partition lists row indices in ascending order; together they cover every row once.
pub fn micro_batches(seqlens: &[u64], count: usize) -> Result<Vec<Vec<usize>>, BalanceError> {
    let workloads: Vec<u64> = seqlens.iter().map(|&s| workload(s)).collect();
    let mut partitions = balanced_partitions(&workloads, count, false)?;
    let key = |p: &Vec<usize>| (p.iter().map(|&i| workloads[i]).sum::<u64>(), p[0]);
    // Stable, like Python's `sort(reverse=True)`.
    partitions.sort_by_key(|p| std::cmp::Reverse(key(p)));
    let evens_reversed = partitions.iter().step_by(2).rev().cloned();
    let odds = partitions.iter().skip(1).step_by(2).cloned();
    Ok(evens_reversed.chain(odds).collect())
}

/// `inverse[order[i]] = i`: where each original row sits after the rows were taken in `order`
/// (verl's `get_reverse_idx`); `order` must be a permutation of `0..order.len()`.
pub fn inverse_permutation(order: &[usize]) -> Vec<usize> {
    let mut inverse = vec![0; order.len()];
    for (position, &row) in order.iter().enumerate() {
        inverse[row] = position;
    }
    inverse
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
    fn micro_batch_count_by_hand() {
        // 10 + 20 + 30 + 40 = 100 tokens in budgets of 40: ceil(2.5) = 3.
        assert_eq!(micro_batch_count(&[10, 20, 30, 40], 40, 40), Ok(3));
        // Never more micro-batches than rows, never fewer than one.
        assert_eq!(micro_batch_count(&[40, 40], 40, 40), Ok(2));
        assert_eq!(micro_batch_count(&[0, 0], 8, 8), Ok(1));
        assert_eq!(micro_batch_count(&[5, 5, 5], 40, 1000), Ok(1));
        // The budget must hold the padded width, not only the longest real sequence (verl).
        assert_eq!(
            micro_batch_count(&[10, 20], 48, 40),
            Err(BalanceError::TokenBudget {
                max_token_len: 40,
                max_seq_len: 48
            })
        );
    }

    #[test]
    fn micro_batches_put_light_ones_at_both_ends() {
        // Five rows of one sequence each, one per micro-batch: workloads ascend with length, so
        // by weight the micro-batches are [4], [3], [2], [1], [0]; evens reversed [0], [2], [4],
        // then odds [3], [1].
        let seqlens = [10, 20, 30, 40, 50];
        let p = micro_batches(&seqlens, 5).unwrap();
        assert_eq!(p, vec![vec![0], vec![2], vec![4], vec![3], vec![1]]);
        // Two micro-batches: every row exactly once, token sums close.
        let p = micro_batches(&seqlens, 2).unwrap();
        let mut all = p.concat();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3, 4]);
        let s = sums(&seqlens, &p);
        assert!(s[0].abs_diff(s[1]) <= 10, "{s:?}");
        // Of two, the heavier runs first (the evens are position 0 alone, then position 1).
        assert!(s[0] >= s[1]);
    }

    #[test]
    fn inverse_restores_the_input_order() {
        let order = [3, 0, 4, 1, 2];
        let inverse = inverse_permutation(&order);
        assert_eq!(inverse, vec![1, 3, 4, 0, 2]);
        let taken: Vec<usize> = order.iter().map(|&r| r * 10).collect();
        let restored: Vec<usize> = inverse.iter().map(|&i| taken[i]).collect();
        assert_eq!(restored, vec![0, 10, 20, 30, 40]);
    }
}
