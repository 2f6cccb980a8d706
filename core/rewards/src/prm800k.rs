//! OpenAI prm800k's answer grader, in the two copies verl scores with: `prime_math/__init__.py`
//! (`grade_answer`, the numina sources) and `mathruler.grader` (`grade_answer`, geo3k). An
//! answer is right when its MATH normalisation equals the truth's, or its prm800k
//! normalisation (LaTeX to text through pylatexenc) does, or — element by element for tuples
//! and intervals — sympy simplifies the difference to 0 ([`symbolic`]); unreduced fractions and
//! integers must match exactly.
//!
//! The copies differ: mathruler drops spaces and braces after normalising and does not strip
//! `liter`; prime runs sympy in a child process with a 10 s timeout (a timeout is "wrong";
//! nothing a grader meets here comes near it).

use std::sync::LazyLock;

use regex::Regex;

use super::{latex_text, math, py, symbolic};

/// Which copy of the grader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// verl's `prime_math`.
    Prime,
    /// `mathruler.grader` (geo3k).
    MathRuler,
}

/// `^\\text\{(?P<text>.+?)\}$` (Python's `$` also matches before a final newline).
static TEXT_WRAPPER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\A\\text\{(.+?)\}\n?\z").expect("valid regex"));

/// prm800k's `math_normalize.normalize_answer`: strip, unwrap `\text{…}`, the MATH
/// normalisation; where that raises, the unwrapped answer.
pub fn normalize_answer(answer: &str) -> String {
    let mut answer = py::strip(answer).to_owned();
    if let Some(c) = TEXT_WRAPPER.captures(&answer) {
        answer = py::strip(&c[1]).to_owned();
    }
    math::strip_string(&answer).unwrap_or(answer)
}

const UNITS: [&str; 17] = [
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
    // prime only.
    "liter",
];

static UNIT_RES: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    UNITS
        .iter()
        .map(|u| Regex::new(&format!(r"{u}(es)?(s)? *(\^[0-9]+)?")).expect("valid regex"))
        .collect()
});
static CIRC: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\^ *\\circ").expect("valid regex"));
static THIN_SPACE_COMMA: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r",\\! *").expect("valid regex"));
static MINUS_SPACE: LazyLock<Regex> = LazyLock::new(|| Regex::new("- *").expect("valid regex"));
static MIXED_NUMBER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new("([0-9]) +([0-9])").expect("valid regex"));
static THOUSANDS: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(\d)(,)(\d\d\d)(\z|\D)").expect("valid regex"));
static FRACTION: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\A-?[0-9]+.?/0*[1-9][0-9]*.?\n?\z").expect("valid regex"));
static BAD_EXPONENTS: LazyLock<[Regex; 2]> = LazyLock::new(|| {
    [
        Regex::new(r"\^[0-9]+\^").expect("valid regex"),
        Regex::new(r"\^[0-9][0-9]+").expect("valid regex"),
    ]
});

/// `_is_float(s) and _is_int(float(s))`: the integer's text.
fn as_int_text(s: &str) -> Option<String> {
    let x = py::float(s)?;
    // `int(round(x))` raises on inf and nan (caught: not an int).
    if !x.is_finite() || (x - x.round_ties_even()).abs() > 1e-7 {
        return None;
    }
    Some(py::int_text(x.round_ties_even()))
}

/// `_strip_properly_formatted_commas`.
fn strip_thousands(expr: &str) -> String {
    let mut expr = expr.to_owned();
    loop {
        let next = THOUSANDS.replace_all(&expr, "${1}${3}${4}").into_owned();
        if next == expr {
            return next;
        }
        expr = next;
    }
}

/// `_str_is_int`.
fn str_is_int(x: &str) -> bool {
    py::float(&strip_thousands(x))
        .is_some_and(|x| x.is_finite() && (x - x.round_ties_even()).abs() <= 1e-7)
}

/// `_parse_latex`: None where pylatexenc raises.
fn parse_latex(expr: &str) -> Option<String> {
    let expr = expr
        .replace("\\tfrac", "\\frac")
        .replace("\\dfrac", "\\frac")
        .replace("\\frac", " \\frac");
    let text = latex_text::latex_to_text(&expr)?
        .replace('√', "sqrt")
        .replace('π', "pi")
        .replace('∞', "inf")
        .replace('∪', "U")
        .replace(['·', '×'], "*");
    Some(py::strip(&text).to_owned())
}

/// prm800k's `_normalize`.
fn normalize(expr: &str, flavor: Flavor) -> String {
    let mut expr = match TEXT_WRAPPER.captures(expr) {
        Some(c) => c[1].to_owned(),
        None => expr.to_owned(),
    };
    expr = expr
        .replace("\\%", "%")
        .replace("\\$", "$")
        .replace(['$', '%'], "")
        .replace(" or ", " , ")
        .replace(" and ", " , ")
        .replace("million", "*10^6")
        .replace("billion", "*10^9")
        .replace("trillion", "*10^12");
    let units = match flavor {
        Flavor::Prime => &UNIT_RES[..],
        Flavor::MathRuler => &UNIT_RES[..UNITS.len() - 1],
    };
    for unit in units {
        expr = unit.replace_all(&expr, "").into_owned();
    }
    expr = CIRC.replace_all(&expr, "").into_owned();
    if expr.len() > 1 && expr.starts_with('{') && expr.ends_with('}') {
        expr = expr[1..expr.len() - 1].to_owned();
    }
    expr = THIN_SPACE_COMMA.replace_all(&expr, "").into_owned();
    if let Some(int) = as_int_text(&expr) {
        expr = int;
    }
    if expr.contains('\\')
        && let Some(text) = parse_latex(&expr)
    {
        expr = text;
    }
    expr = MINUS_SPACE.replace_all(&expr, "-").into_owned();
    expr = MIXED_NUMBER.replace_all(&expr, "${1}+${2}").into_owned();
    if flavor == Flavor::MathRuler {
        expr = expr.replace([' ', '{', '}'], "");
    }
    expr = expr.to_lowercase();
    if str_is_int(&expr) {
        // `_str_to_int`: every comma out, then `int(float(x))`.
        if let Some(x) = py::float(&expr.replace(',', "")) {
            expr = py::int_text(x);
        }
    }
    expr
}

fn should_allow_eval(expr: &str) -> bool {
    let letters: std::collections::HashSet<char> = expr
        .replace("sqrt", "")
        .replace("frac", "")
        .chars()
        .filter(|c| c.is_alphabetic())
        .collect();
    letters.len() <= 2
        && !expr.contains("^{")
        && !expr.contains("^(")
        && BAD_EXPONENTS.iter().all(|re| !re.is_match(expr))
}

fn are_equal_under_sympy(truth: &str, given: &str) -> bool {
    let expr = format!("({truth})-({given})");
    should_allow_eval(&expr) && symbolic::simplifies_to_zero(&expr)
}

const TUPLE_CHARS: [char; 4] = ['(', ')', '[', ']'];

fn split_tuple(expr: &str) -> Vec<String> {
    let expr = strip_thousands(expr);
    if expr.is_empty() {
        return Vec::new();
    }
    let chars: Vec<char> = expr.chars().collect();
    let n = chars.len();
    if n > 2
        && TUPLE_CHARS.contains(&chars[0])
        && TUPLE_CHARS.contains(&chars[n - 1])
        && !chars[1..n - 1].iter().any(|c| TUPLE_CHARS.contains(c))
    {
        let inner: String = chars[1..n - 1].iter().collect();
        inner.split(',').map(|e| py::strip(e).to_owned()).collect()
    } else {
        vec![expr]
    }
}

/// prm800k's `grade_answer(given_answer, ground_truth)`.
pub fn grade_answer(given: &str, truth: &str, flavor: Flavor) -> bool {
    if normalize_answer(truth) == normalize_answer(given) {
        return true;
    }
    let truth_n = normalize(truth, flavor);
    let given_n = normalize(given, flavor);
    if truth_n == given_n {
        return true;
    }
    if given_n.is_empty() {
        return false;
    }
    let truth_elems = split_tuple(&truth_n);
    let given_elems = split_tuple(&given_n);
    let first = |s: &str| s.chars().next();
    let last = |s: &str| s.chars().next_back();
    if truth_elems.len() > 1
        && (first(&truth_n) != first(&given_n) || last(&truth_n) != last(&given_n))
    {
        return false;
    }
    if truth_elems.len() != given_elems.len() {
        return false;
    }
    truth_elems.iter().zip(&given_elems).all(|(t, g)| {
        if FRACTION.is_match(t) && FRACTION.is_match(g) {
            // Unreduced fractions must be written the same.
            t == g
        } else if str_is_int(t) != str_is_int(g) {
            false
        } else {
            are_equal_under_sympy(t, g)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisations() {
        assert_eq!(
            normalize("\\frac{\\sqrt{3}}{2}", Flavor::Prime),
            "sqrt(3)/2"
        );
        assert_eq!(normalize("1,000", Flavor::Prime), "1000");
        assert_eq!(normalize("10\\%", Flavor::Prime), "10");
        assert_eq!(normalize("5 liters", Flavor::Prime), "5");
        assert_eq!(normalize("5 liters", Flavor::MathRuler), "5liters");
        assert_eq!(normalize("3 \\frac{1}{2}", Flavor::Prime), "3+1/2");
        assert_eq!(normalize("\\text{(A)}", Flavor::Prime), "(a)");
        assert_eq!(normalize("{x} + {y}", Flavor::MathRuler), "x+y");
        assert_eq!(normalize_answer(" \\text{ 0.5 } "), "\\frac{1}{2}");
    }

    #[test]
    fn grades() {
        let g = |a, b| grade_answer(a, b, Flavor::Prime);
        assert!(g("0.5", "\\frac12"));
        assert!(g("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"));
        assert!(g("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"));
        assert!(g("2(x+1)", "2x+2"));
        assert!(g("(1,2)", "\\left( 1, 2 \\right)"));
        // Unreduced fractions and integers need the same text.
        assert!(!g("2/4", "1/2"));
        assert!(!g("6/2", "3"));
        assert!(!g("(1, 2)", "[1, 2]"));
        assert!(!g("0.333", "\\frac13"));
    }
}
