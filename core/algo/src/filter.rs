//! DAPO dynamic sampling (`algorithm.filter_groups`): groups whose responses all scored the same
//! teach nothing under group-relative advantages, so they are dropped and more prompts are
//! generated until the batch is full.

use std::collections::HashMap;

use super::AlgoError;

/// Relative tolerance under which a group's metrics count as equal: verl drops a group when
/// numpy's `np.std` of its metrics is 0, but whether rounding leaves an exact 0 depends on the
/// values and on numpy's summation order (eight scores of 0.1 give 0, three give 1.4e-17).
pub const FILTER_STD_TOLERANCE: f64 = 1e-6;

/// Rows to keep: those of groups whose metric has a population std above
/// [`FILTER_STD_TOLERANCE`] × max(1, largest |metric| of the group), and of groups with a single
/// response. Returns the kept row indices, in order, and the number of kept groups.
pub fn filter_groups(index: &[u64], metric: &[f64]) -> Result<(Vec<usize>, usize), AlgoError> {
    if index.len() != metric.len() {
        return Err(AlgoError::Length {
            what: "metric",
            expected: index.len(),
            got: metric.len(),
        });
    }
    let mut groups: HashMap<u64, Vec<f64>> = HashMap::new();
    for (&id, &value) in index.iter().zip(metric) {
        groups.entry(id).or_default().push(value);
    }
    let kept: HashMap<u64, bool> = groups
        .into_iter()
        .map(|(id, values)| {
            let n = values.len() as f64;
            let mean = values.iter().sum::<f64>() / n;
            let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            let scale = values.iter().fold(1.0f64, |s, v| s.max(v.abs()));
            (
                id,
                values.len() == 1 || var.sqrt() > FILTER_STD_TOLERANCE * scale,
            )
        })
        .collect();
    let rows = (0..index.len()).filter(|&i| kept[&index[i]]).collect();
    Ok((rows, kept.values().filter(|&&k| k).count()))
}

/// Where the batch stands after one more generation round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplerProgress {
    /// Fewer than `train_batch_size` prompts kept so far: generate another batch.
    NeedMore,
    /// Enough prompts: train on the first `train_batch_size × n` kept rows.
    Full,
}

/// Counts kept prompts across generation rounds of one training step.
#[derive(Debug, Clone)]
pub struct DynamicSampler {
    target_prompts: usize,
    /// `max_num_gen_batches` ≤ 0 means no bound, as in verl.
    max_num_gen_batches: i64,
    gen_batches: u64,
    kept_prompts: usize,
}

impl DynamicSampler {
    pub fn new(target_prompts: usize, max_num_gen_batches: i64) -> Self {
        Self {
            target_prompts,
            max_num_gen_batches,
            gen_batches: 0,
            kept_prompts: 0,
        }
    }

    /// Records one generated batch that kept `kept_groups` prompts.
    pub fn record(&mut self, kept_groups: usize) -> Result<SamplerProgress, AlgoError> {
        self.gen_batches += 1;
        self.kept_prompts += kept_groups;
        if self.kept_prompts >= self.target_prompts {
            return Ok(SamplerProgress::Full);
        }
        match u64::try_from(self.max_num_gen_batches) {
            Ok(max) if max > 0 && self.gen_batches >= max => {
                Err(AlgoError::TooManyGenBatches(self.gen_batches))
            }
            _ => Ok(SamplerProgress::NeedMore),
        }
    }

    /// Generation rounds used in this step (verl's `train/num_gen_batches`).
    pub fn gen_batches(&self) -> u64 {
        self.gen_batches
    }

    /// Starts the next training step.
    pub fn reset(&mut self) {
        self.gen_batches = 0;
        self.kept_prompts = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_with_equal_metrics_are_dropped() {
        // Group 1: {1, 1} (std 0, dropped); group 2: {0, 1} (kept); group 3: alone (kept).
        let (rows, groups) = filter_groups(&[1, 2, 1, 2, 3], &[1.0, 0.0, 1.0, 1.0, 0.0]).unwrap();
        assert_eq!(rows, vec![1, 3, 4]);
        assert_eq!(groups, 2);
        assert!(filter_groups(&[1], &[]).is_err());
    }

    #[test]
    fn equal_metrics_with_rounding_noise_are_dropped() {
        // 0.1 summed in different orders: the group's std is ~1e-17, not 0.
        let noisy = [0.1, 0.1, 0.30000000000000004 - 0.2];
        assert!(noisy[2] != 0.1);
        let (rows, groups) = filter_groups(&[5, 5, 5], &noisy).unwrap();
        assert_eq!((rows, groups), (vec![], 0));
        let eight = [0.1; 8];
        assert_eq!(filter_groups(&[1; 8], &eight).unwrap(), (vec![], 0));
        // A real difference, even a small one, keeps the group.
        let (rows, _) = filter_groups(&[5, 5], &[0.1, 0.1001]).unwrap();
        assert_eq!(rows, vec![0, 1]);
    }

    #[test]
    fn sampler_stops_when_full_or_out_of_tries() {
        let mut s = DynamicSampler::new(4, 3);
        assert_eq!(s.record(1), Ok(SamplerProgress::NeedMore));
        assert_eq!(s.record(2), Ok(SamplerProgress::NeedMore));
        assert_eq!(s.record(0), Err(AlgoError::TooManyGenBatches(3)));
        s.reset();
        assert_eq!(s.record(5), Ok(SamplerProgress::Full));
        assert_eq!(s.gen_batches(), 1);
        let mut unbounded = DynamicSampler::new(1, 0);
        for _ in 0..10 {
            assert_eq!(unbounded.record(0), Ok(SamplerProgress::NeedMore));
        }
    }
}
