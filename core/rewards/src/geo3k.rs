//! Geometry3K (verl `reward_score/geo3k.py`): 0.9 × accuracy + 0.1 × format. Accuracy is
//! `mathruler.grader.grade_answer` (the `prm800k` module in its mathruler flavour) on the last
//! `\boxed{…}`'s content (`"None"` without one); the format is `<think>…</think>…\boxed{…}…`
//! filling the whole response.

use std::sync::LazyLock;

use regex::Regex;

use super::prm800k::{self, Flavor};
use super::py;

pub const DATA_SOURCE: &str = "hiyouga/geometry3k";

/// verl's default `format_score`.
const FORMAT_SCORE: f64 = 0.1;

static FORMAT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)\A<think>.*</think>.*\\boxed\{.*\}.*\z").expect("valid regex")
});

/// `mathruler.grader.extract_boxed_content`: the stripped text inside the last `\boxed{`, up
/// to its matching brace; `"None"` when there is none or it never closes.
pub fn extract_boxed_content(text: &str) -> String {
    let Some(start) = text.rfind("\\boxed{") else {
        return "None".into();
    };
    let content = &text[start + "\\boxed{".len()..];
    let mut depth = 0i64;
    for (at, c) in content.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if depth == -1 {
            return py::strip(&content[..at]).to_owned();
        }
    }
    "None".into()
}

pub fn compute_score(response: &str, ground_truth: &str) -> f64 {
    let answer = extract_boxed_content(response);
    let acc = if prm800k::grade_answer(&answer, ground_truth, Flavor::MathRuler) {
        1.0
    } else {
        0.0
    };
    let format = if FORMAT.is_match(response) { 1.0 } else { 0.0 };
    (1.0 - FORMAT_SCORE) * acc + FORMAT_SCORE * format
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_content() {
        assert_eq!(extract_boxed_content("a \\boxed{1} \\boxed{ {2} }"), "{2}");
        assert_eq!(extract_boxed_content("\\boxed{3"), "None");
        assert_eq!(extract_boxed_content("3"), "None");
    }

    #[test]
    fn scores() {
        assert_eq!(compute_score("<think>t</think> \\boxed{3}", "3"), 1.0);
        assert_eq!(compute_score("\\boxed{3}", "3"), 0.9);
        assert_eq!(compute_score("<think>t</think> \\boxed{4}", "3"), 0.1);
        assert_eq!(compute_score("<think>t \\boxed{4}", "3"), 0.0);
        assert_eq!(
            compute_score("<think></think>\\boxed{\\frac{25}{2}}", "12.5"),
            1.0
        );
    }
}
