//! DAPO's math rule (verl `reward_score/math_dapo.py`, after Minerva): the answer on the last
//! `Answer: …` line, normalised, must equal the normalised ground truth; without such a line the
//! last `\boxed{…}` in the final 100 characters must equal the ground truth exactly. The score is
//! 1 or −1, with `acc` and the prediction `pred` as extra information.

use std::sync::LazyLock;

use regex::Regex;

use super::py;

/// What verl reports for one response.
#[derive(Debug, Clone, PartialEq)]
pub struct DapoScore {
    pub score: f64,
    pub acc: bool,
    pub pred: String,
}

/// verl clips to the end: "the longest answer in MATH-500 has 159 characters".
const CLIP_CHARS: usize = 300;
/// The boxed fallback only looks at the last 100 characters.
const BOX_WINDOW: usize = 100;
const INVALID: &str = "[INVALID]";

const SUBSTITUTIONS: [(&str, &str); 10] = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
];

const REMOVED_EXPRESSIONS: [&str; 41] = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    "\"",
    "\\dots",
];

fn regex(pattern: &str) -> Regex {
    Regex::new(pattern).expect("a valid pattern")
}

/// Each rewrite of `normalize_final_answer`, in verl's order: pattern and replacement.
static REWRITES: LazyLock<[(Regex, &str); 7]> = LazyLock::new(|| {
    [
        (regex(r"(.*?)(\$)(.*?)(\$)(.*)"), "$$${3}$$"),
        (regex(r"(\\text\{)(.*?)(\})"), "${2}"),
        (regex(r"(\\textbf\{)(.*?)(\})"), "${2}"),
        (regex(r"(\\overline\{)(.*?)(\})"), "${2}"),
        (regex(r"(\\boxed\{)(.*)(\})"), "${2}"),
        // \fracab → \frac{a}{b}, \sqrta → \sqrt{a}
        (regex(r"(frac)([^{])(.)"), "frac{${2}}{${3}}"),
        (regex(r"(sqrt)([^{])"), "sqrt{${2}}"),
    ]
});

static ANSWER_LINE: LazyLock<Regex> = LazyLock::new(|| {
    regex(&format!(
        r"(?i)Answer{s}*:{s}*([^\n]+)",
        s = py::SPACE_CLASS
    ))
});

/// Python's `str.isdigit` for the digits answers use: ASCII, super- and subscripts.
fn is_digit(c: char) -> bool {
    c.is_ascii_digit()
        || matches!(c, '\u{b2}' | '\u{b3}' | '\u{b9}' | '\u{2070}' | '\u{2074}'..='\u{2079}' | '\u{2080}'..='\u{2089}')
}

/// verl's `normalize_final_answer`.
pub fn normalize_final_answer(answer: &str) -> String {
    let mut s = answer.rsplit('=').next().unwrap_or_default().to_owned();
    for (before, after) in SUBSTITUTIONS {
        s = s.replace(before, after);
    }
    for expr in REMOVED_EXPRESSIONS {
        s = s.replace(expr, "");
    }
    for (pattern, replacement) in REWRITES.iter() {
        s = pattern.replace_all(&s, *replacement).into_owned();
    }
    s = s.replace('$', "");
    let digits = s.replace(',', "");
    if !digits.is_empty() && digits.chars().all(is_digit) {
        s = digits;
    }
    py::strip(&s).to_owned()
}

/// The last `\boxed{…}` with balanced braces (only `\boxed{`, not `\boxed ` or `\fbox`).
pub fn last_boxed_only_string(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")?;
    let mut depth = 0i64;
    for (offset, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..=start + offset]);
                }
            }
            _ => {}
        }
    }
    None
}

/// The normalised answer of the last `Answer:` line, or `[INVALID]`.
fn minerva_prediction(solution: &str) -> String {
    let answer = ANSWER_LINE
        .captures_iter(solution)
        .last()
        .and_then(|c| c.get(1))
        .map_or(INVALID, |m| m.as_str());
    normalize_final_answer(answer)
}

pub fn compute_score(solution: &str, ground_truth: &str) -> DapoScore {
    let solution = py::tail(solution, CLIP_CHARS);
    let pred = minerva_prediction(solution);
    let (acc, pred) = if pred != INVALID {
        (pred == normalize_final_answer(ground_truth), pred)
    } else {
        match last_boxed_only_string(py::tail(solution, BOX_WINDOW)) {
            Some(boxed) => {
                let inner = &boxed["\\boxed{".len()..boxed.len() - 1];
                (inner == ground_truth, inner.to_owned())
            }
            None => (false, pred),
        }
    };
    DapoScore {
        score: if acc { 1.0 } else { -1.0 },
        acc,
        pred,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_lines_are_normalised() {
        assert_eq!(normalize_final_answer("x = \\frac12"), "\\frac{1}{2}");
        assert_eq!(normalize_final_answer("1,000 dollars"), "1000");
        assert_eq!(normalize_final_answer("$\\sqrt3$"), "\\sqrt{3}");
        assert_eq!(normalize_final_answer("\\text{(A)}"), "(A)");
        assert_eq!(normalize_final_answer("90^\\circ"), "90");
        // Commas stay unless the rest is all digits.
        assert_eq!(normalize_final_answer("(1, 2)"), "(1,2)");
    }

    #[test]
    fn scores() {
        let s = compute_score("so\nAnswer: 1,000", "1000");
        assert_eq!((s.score, s.acc, s.pred.as_str()), (1.0, true, "1000"));
        // The last line wins; a wrong Answer: line is not rescued by a right box.
        let s = compute_score("Answer: 5\n\\boxed{7}\nanswer: 6", "7");
        assert_eq!((s.score, s.pred.as_str()), (-1.0, "6"));
        // No Answer: line: the box, compared exactly.
        assert!(compute_score("thus \\boxed{\\frac{1}{2}}", "\\frac{1}{2}").acc);
        assert!(!compute_score("thus \\boxed{\\frac12}", "\\frac{1}{2}").acc);
        // The box must sit in the last 100 characters.
        let far = format!("\\boxed{{7}}{}", " ".repeat(100));
        let s = compute_score(&far, "7");
        assert_eq!((s.acc, s.pred.as_str()), (false, INVALID));
    }
}
