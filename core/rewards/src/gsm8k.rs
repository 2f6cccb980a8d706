//! GSM8K: the answer is the number after the last `#### ` (verl `reward_score/gsm8k.py`).

pub const DATA_SOURCE: &str = "openai/gsm8k";

/// Only the tail is searched; the final answer sits at the end (verl clips to 300 characters).
const CLIP_CHARS: usize = 300;

/// How the answer is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// The number after the last `#### ` — also checks the model's format.
    Strict,
    /// The last number anywhere.
    Flexible,
}

fn is_number_char(c: char) -> bool {
    c.is_ascii_digit() || c == '.' || c == ','
}

/// Non-overlapping matches of `-?[0-9.,]+` starting at or after each candidate position,
/// leftmost first, like Python's `re.findall`; `prefix` must precede each match.
fn find_numbers(text: &str, prefix: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let prefix: Vec<char> = prefix.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let start = i + prefix.len();
        if !chars[i..].starts_with(&prefix) || start >= chars.len() {
            i += 1;
            continue;
        }
        let digits_at = if chars[start] == '-' {
            start + 1
        } else {
            start
        };
        let end = chars[digits_at..]
            .iter()
            .position(|&c| !is_number_char(c))
            .map_or(chars.len(), |p| digits_at + p);
        if end > digits_at {
            found.push(chars[start..end].iter().collect());
            i = end;
        } else {
            i += 1;
        }
    }
    found
}

/// The extracted answer, or None when there is none.
pub fn extract_solution(solution: &str, method: Method) -> Option<String> {
    let skip = solution.chars().count().saturating_sub(CLIP_CHARS);
    let tail: String = solution.chars().skip(skip).collect();
    match method {
        Method::Strict => find_numbers(&tail, "#### ")
            .pop()
            .map(|s| s.replace([',', '$'], "")),
        Method::Flexible => {
            let numbers = find_numbers(&tail, "");
            // The last match that is not a lone "."; if every match is one, Python's loop variable
            // is left at the first match, which verl then returns.
            numbers
                .iter()
                .rev()
                .find(|n| n.as_str() != ".")
                .or(numbers.first())
                .cloned()
        }
    }
}

/// `score` when the extracted answer equals `ground_truth` (as strings), `format_score` when an
/// answer was found but differs, 0 when none was found.
pub fn compute_score(
    solution: &str,
    ground_truth: &str,
    method: Method,
    format_score: f64,
    score: f64,
) -> f64 {
    match extract_solution(solution, method) {
        None => 0.0,
        Some(answer) if answer == ground_truth => score,
        Some(_) => format_score,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_takes_the_last_marked_number() {
        assert_eq!(
            extract_solution("3+4=7 #### 7\n#### 1,234", Method::Strict).as_deref(),
            Some("1234")
        );
        assert_eq!(
            extract_solution("#### -12.5 dollars", Method::Strict).as_deref(),
            Some("-12.5")
        );
        // No space after the marker, or no number after it: no answer.
        assert_eq!(extract_solution("####7", Method::Strict), None);
        assert_eq!(extract_solution("#### x", Method::Strict), None);
        assert_eq!(extract_solution("#### -x", Method::Strict), None);
        // Five hashes still contain "#### ".
        assert_eq!(
            extract_solution("##### 5", Method::Strict).as_deref(),
            Some("5")
        );
    }

    #[test]
    fn only_the_last_300_characters_count() {
        let text = format!("#### 5{}", " ".repeat(300));
        assert_eq!(extract_solution(&text, Method::Strict), None);
        let text = format!("{}#### 5", "é".repeat(400));
        assert_eq!(
            extract_solution(&text, Method::Strict).as_deref(),
            Some("5")
        );
    }

    #[test]
    fn flexible_takes_the_last_number() {
        assert_eq!(
            extract_solution("so 12 apples and 15.", Method::Flexible).as_deref(),
            Some("15.")
        );
        assert_eq!(
            extract_solution("x = 3 . done", Method::Flexible).as_deref(),
            Some("3")
        );
        assert_eq!(
            extract_solution("only . here", Method::Flexible).as_deref(),
            Some(".")
        );
        assert_eq!(extract_solution("no digits", Method::Flexible), None);
    }

    #[test]
    fn scores_follow_verl() {
        assert_eq!(
            compute_score("#### 72", "72", Method::Strict, 0.0, 1.0),
            1.0
        );
        assert_eq!(
            compute_score("#### 71", "72", Method::Strict, 0.1, 1.0),
            0.1
        );
        assert_eq!(compute_score("72", "72", Method::Strict, 0.1, 1.0), 0.0);
        // The comparison is textual: "72.0" is not "72".
        assert_eq!(
            compute_score("#### 72.0", "72", Method::Strict, 0.0, 1.0),
            0.0
        );
        assert_eq!(
            compute_score("the answer is 72", "72", Method::Flexible, 0.0, 1.0),
            1.0
        );
    }
}
