//! Search-R1's exact match (verl `reward_score/search_r1_like_qa_em.py`): the text of the last
//! `<answer>…</answer>` must equal one of the ground truth's `target` answers after SQuAD's
//! normalisation (lower case, no punctuation, no articles, single spaces). A right answer given
//! among more than ten opening or closing tags earns a quarter.

use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use super::py;

/// What the score is for a response whose tags are spammed.
const TAG_LIMIT: usize = 10;

static ANSWER_TAG: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)<answer>(.*?)</answer>").expect("a valid pattern"));
static ARTICLES: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b(a|an|the)\b").expect("a valid pattern"));

/// SQuAD's `normalize_answer`.
pub fn normalize_answer(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punct: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    let no_articles = ARTICLES.replace_all(&no_punct, " ");
    no_articles
        .split(py::is_space)
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The stripped text of the last complete answer tag.
pub fn extract_solution(solution: &str) -> Option<&str> {
    ANSWER_TAG
        .captures_iter(solution)
        .last()
        .and_then(|c| c.get(1))
        .map(|m| py::strip(m.as_str()))
}

/// The ground truth's `target`: one answer or a list of them (verl's `{"target": [...]}`).
pub fn targets(ground_truth: &Value) -> Result<Vec<&str>, String> {
    fn text(v: &Value) -> Result<&str, String> {
        v.as_str()
            .ok_or_else(|| format!("a target answer is not a string: {v}"))
    }
    match ground_truth.get("target") {
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(items)) => items.iter().map(text).collect(),
        Some(other) => Err(format!(
            "`target` must be a string or a list of strings, found {other}"
        )),
        None => Err(format!(
            "expected an object with `target` (a string or a list of strings), found {ground_truth}"
        )),
    }
}

/// 1 for an exact match (¼ with more than ten tags), 0 otherwise.
pub fn compute_score(solution: &str, targets: &[&str]) -> f64 {
    let Some(answer) = extract_solution(solution) else {
        return 0.0;
    };
    let answer = normalize_answer(answer);
    if !targets.iter().any(|t| normalize_answer(t) == answer) {
        return 0.0;
    }
    let spammed = solution.matches("<answer>").count() > TAG_LIMIT
        || solution.matches("</answer>").count() > TAG_LIMIT;
    if spammed { 0.25 } else { 1.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_match_after_normalisation() {
        assert_eq!(normalize_answer("The  Beatles!"), "beatles");
        assert_eq!(normalize_answer("U.S.A."), "usa");
        assert_eq!(
            compute_score("<answer>x</answer><answer> the Nile. </answer>", &["Nile"]),
            1.0
        );
        assert_eq!(compute_score("<answer>Nile", &["Nile"]), 0.0);
        assert_eq!(
            compute_score("<answer>Seine</answer>", &["Nile", "Seine"]),
            1.0
        );
        let spam = format!("{}<answer>Nile</answer>", "</answer>".repeat(10));
        assert_eq!(compute_score(&spam, &["Nile"]), 0.25);
    }

    #[test]
    fn targets_are_a_string_or_a_list() {
        let gt: Value = serde_json::json!({"target": ["a", "b"]});
        assert_eq!(targets(&gt).unwrap(), vec!["a", "b"]);
        assert_eq!(
            targets(&serde_json::json!({"target": "a"})).unwrap(),
            vec!["a"]
        );
        assert!(
            targets(&serde_json::json!("a"))
                .unwrap_err()
                .contains("target")
        );
        assert!(targets(&serde_json::json!({"target": [1]})).is_err());
    }
}
