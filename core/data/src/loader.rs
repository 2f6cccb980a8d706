//! The epoch-based, seeded data loader. The order of an epoch is a pure function of
//! `(seed, epoch)`, so a [`LoaderState`] saved in a checkpoint resumes at exactly the next batch.

use serde::{Deserialize, Serialize};

/// Where the loader stands: the epoch and the number of batches of it already handed out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub epoch: u64,
    pub batch: u64,
}

/// Hands out batches of dataset indices.
#[derive(Debug, Clone)]
pub struct DataLoader {
    len: usize,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    /// Train loaders drop the last partial batch (verl: `drop_last=True`); validation keeps it.
    drop_last: bool,
    state: LoaderState,
}

impl DataLoader {
    /// `batch_size` 0 is taken as 1.
    pub fn new(len: usize, batch_size: usize, shuffle: bool, seed: u64, drop_last: bool) -> Self {
        Self {
            len,
            batch_size: batch_size.max(1),
            shuffle,
            seed,
            drop_last,
            state: LoaderState::default(),
        }
    }

    pub fn batches_per_epoch(&self) -> u64 {
        let full = self.len / self.batch_size;
        let partial = !self.drop_last && !self.len.is_multiple_of(self.batch_size);
        (full + usize::from(partial)) as u64
    }

    /// The next batch of the current epoch; None once the epoch is used up, after which the
    /// loader stands at the start of the next epoch.
    pub fn next_batch(&mut self) -> Option<Vec<usize>> {
        if self.state.batch >= self.batches_per_epoch() {
            self.state = LoaderState {
                epoch: self.state.epoch + 1,
                batch: 0,
            };
            return None;
        }
        let order = self.epoch_order(self.state.epoch);
        let start = self.state.batch as usize * self.batch_size;
        let end = (start + self.batch_size).min(self.len);
        self.state.batch += 1;
        Some(order[start..end].to_vec())
    }

    pub fn state(&self) -> LoaderState {
        self.state
    }

    pub fn restore(&mut self, state: LoaderState) {
        self.state = state;
    }

    /// The dataset order of `epoch`: identity without shuffling, else a Fisher–Yates shuffle
    /// driven by SplitMix64 (self-contained, so the order never changes with a dependency).
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix64::new(self.seed ^ epoch.wrapping_mul(0xA076_1D64_78BD_642F));
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        order
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast and well mixed; enough for shuffles and
/// synthetic data.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below 2^-64·n).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epoch(loader: &mut DataLoader) -> Vec<Vec<usize>> {
        std::iter::from_fn(|| loader.next_batch()).collect()
    }

    #[test]
    fn epochs_cover_the_data_once() {
        let mut loader = DataLoader::new(10, 3, true, 7, true);
        assert_eq!(loader.batches_per_epoch(), 3);
        let first = epoch(&mut loader);
        assert_eq!(first.len(), 3);
        let mut seen: Vec<usize> = first.concat();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 9);
        assert_eq!(loader.state(), LoaderState { epoch: 1, batch: 0 });
        let second = epoch(&mut loader);
        assert_ne!(first, second, "each epoch has its own order");
        // Same seed, same orders; another seed, another order.
        let mut again = DataLoader::new(10, 3, true, 7, true);
        assert_eq!(epoch(&mut again), first);
        assert_ne!(
            DataLoader::new(10, 3, true, 8, true).epoch_order(0),
            loader.epoch_order(0)
        );
    }

    #[test]
    fn resume_continues_exactly() {
        let mut full = DataLoader::new(20, 4, true, 1, true);
        let mut expected = Vec::new();
        for _ in 0..2 {
            expected.extend(epoch(&mut full));
        }
        let mut first = DataLoader::new(20, 4, true, 1, true);
        let mut got = vec![first.next_batch().unwrap(), first.next_batch().unwrap()];
        let saved = serde_json::to_string(&first.state()).unwrap();
        let mut resumed = DataLoader::new(20, 4, true, 1, true);
        resumed.restore(serde_json::from_str(&saved).unwrap());
        got.extend(epoch(&mut resumed));
        got.extend(epoch(&mut resumed));
        assert_eq!(got, expected);
    }

    #[test]
    fn validation_order_keeps_the_last_batch() {
        let mut loader = DataLoader::new(5, 2, false, 0, false);
        assert_eq!(epoch(&mut loader), vec![vec![0, 1], vec![2, 3], vec![4]]);
        assert_eq!(DataLoader::new(0, 2, true, 0, true).batches_per_epoch(), 0);
    }
}
