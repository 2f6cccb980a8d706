//! Rule rewards dispatched on a sample's `data_source`, with verl's score semantics
//! (`verl.utils.reward_score.default_compute_score`).

pub mod gsm8k;
pub mod math;

use crate::data::synthetic;

/// The reward of one response could not be computed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RewardError {
    #[error("no rule reward for data_source `{0}`; built-in sources: {known}", known = KNOWN_SOURCES.join(", "))]
    UnknownDataSource(String),
}

/// `data_source` values that verl scores with the MATH rule.
const MATH_SOURCES: [&str; 3] = [
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
];

const KNOWN_SOURCES: [&str; 5] = [
    gsm8k::DATA_SOURCE,
    MATH_SOURCES[0],
    MATH_SOURCES[1],
    MATH_SOURCES[2],
    synthetic::DATA_SOURCE,
];

/// The score of `response` against `ground_truth` for a sample from `data_source`.
pub fn compute_score(
    data_source: &str,
    response: &str,
    ground_truth: &str,
) -> Result<f64, RewardError> {
    if data_source == gsm8k::DATA_SOURCE {
        Ok(gsm8k::compute_score(
            response,
            ground_truth,
            gsm8k::Method::Strict,
            0.0,
            1.0,
        ))
    } else if MATH_SOURCES.contains(&data_source) {
        Ok(math::compute_score(response, ground_truth))
    } else if data_source == synthetic::DATA_SOURCE {
        // The synthetic task answers in GSM8K's `#### <number>` format, so it is scored the same way.
        Ok(gsm8k::compute_score(
            response,
            ground_truth,
            gsm8k::Method::Strict,
            0.0,
            1.0,
        ))
    } else {
        Err(RewardError::UnknownDataSource(data_source.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatches_on_data_source() {
        assert_eq!(compute_score("openai/gsm8k", "so #### 72", "72"), Ok(1.0));
        assert_eq!(
            compute_score(
                "DigitalLearningGmbH/MATH-lighteval",
                "\\boxed{\\frac12}",
                "\\frac{1}{2}"
            ),
            Ok(1.0)
        );
        assert_eq!(compute_score("lighteval/MATH", "\\boxed{3}", "4"), Ok(0.0));
        assert_eq!(
            compute_score(synthetic::DATA_SOURCE, "#### 579", "579"),
            Ok(1.0)
        );
        assert_eq!(compute_score(synthetic::DATA_SOURCE, "579", "579"), Ok(0.0));
        let err = compute_score("my/data", "x", "y").unwrap_err();
        assert!(err.to_string().contains("my/data") && err.to_string().contains("openai/gsm8k"));
    }
}
