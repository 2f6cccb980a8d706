//! PRIME's math rule (verl `reward_score/prime_math/`, the `numina_*` sources): the answer is
//! cut out of the response after the last `answer:`/`answer is`/`\boxed{…}`/`is `/`=` … marker,
//! then graded with prm800k's grader (the `prm800k` module, sympy included); if that fails, with ToRA's
//! `math_equal` (numbers within 1e-4 relative, also against the truth ×100 and ÷100;
//! percentages, `$`, bases `_b`, π substituted and evaluated; intervals, tuples, points and
//! matrices element by element). The score is 1 or 0.
//!
//! verl's `math_equal` ends in `symbolic_equal`, which wraps each sympy call in
//! `with timeout_limit(seconds=…)`; `timeout_limit` is a decorator factory, not a context
//! manager, so every such `with` raises a `TypeError` that the surrounding `except Exception`
//! swallows: that step never finds two answers equal, and neither does this port. Where the
//! Python raises outside such a `try` (a `_` base that is not a number, an `eval` of a bracketed
//! answer against a matrix) the score is 0, as verl's outer `except` makes it.

use std::sync::LazyLock;

use regex::Regex;

use super::prm800k::{self, Flavor};
use super::py;

/// A Python exception that reaches `compute_score`'s `except`.
#[derive(Debug)]
struct Raise;

/// The Python values `math_equal` handles: text, or what `handle_base`/`handle_pi`/`eval` made.
#[derive(Debug, Clone, PartialEq)]
enum Val {
    Str(String),
    Int(i128),
    Float(f64),
    Seq { list: bool, items: Vec<Val> },
}

impl Val {
    /// Python's `str()`.
    fn str(&self) -> String {
        match self {
            Val::Str(s) => s.clone(),
            other => other.repr(),
        }
    }

    fn repr(&self) -> String {
        match self {
            Val::Str(s) => {
                let quote = if s.contains('\'') && !s.contains('"') {
                    '"'
                } else {
                    '\''
                };
                let mut out = String::from(quote);
                for c in s.chars() {
                    match c {
                        '\\' => out.push_str("\\\\"),
                        '\n' => out.push_str("\\n"),
                        '\t' => out.push_str("\\t"),
                        c if c == quote => {
                            out.push('\\');
                            out.push(c);
                        }
                        c => out.push(c),
                    }
                }
                out.push(quote);
                out
            }
            Val::Int(i) => i.to_string(),
            Val::Float(x) => py::float_repr(*x),
            Val::Seq { list, items } => {
                let inner: Vec<String> = items.iter().map(Val::repr).collect();
                match (list, items.len()) {
                    (true, _) => format!("[{}]", inner.join(", ")),
                    (false, 1) => format!("({},)", inner[0]),
                    (false, _) => format!("({})", inner.join(", ")),
                }
            }
        }
    }

    /// `not v and v not in [0, False]`.
    fn falsy_nonzero(&self) -> bool {
        match self {
            Val::Str(s) => s.is_empty(),
            Val::Seq { items, .. } => items.is_empty(),
            Val::Int(_) | Val::Float(_) => false,
        }
    }
}

/// A small Python `eval` for what `handle_pi` and the matrix check feed it: numbers, `+ - * /
/// // % ** ^`, parentheses, tuples and lists. Anything else (a name, LaTeX, a string) raises.
mod pyeval {
    use super::{Raise, Val};

    struct P {
        c: Vec<char>,
        i: usize,
    }

    pub fn eval(s: &str) -> Result<Val, Raise> {
        let mut p = P {
            c: s.chars().collect(),
            i: 0,
        };
        let v = p.tuple()?;
        p.ws();
        if p.i == p.c.len() { Ok(v) } else { Err(Raise) }
    }

    fn num(v: &Val) -> Result<f64, Raise> {
        match v {
            Val::Int(i) => Ok(*i as f64),
            Val::Float(x) => Ok(*x),
            _ => Err(Raise),
        }
    }

    /// Python's `//` on integers (rounds towards minus infinity); None on overflow.
    fn floor_div(x: i128, y: i128) -> Option<i128> {
        let q = x.checked_div(y)?;
        let inexact = x.checked_rem(y)? != 0;
        Some(if inexact && (x < 0) != (y < 0) {
            q - 1
        } else {
            q
        })
    }

    fn arith(op: &str, a: Val, b: Val) -> Result<Val, Raise> {
        if let (Val::Int(x), Val::Int(y)) = (&a, &b) {
            let (x, y) = (*x, *y);
            let int = match op {
                "+" => x.checked_add(y),
                "-" => x.checked_sub(y),
                "*" => x.checked_mul(y),
                "//" if y != 0 => floor_div(x, y),
                "%" if y != 0 => floor_div(x, y).and_then(|q| x.checked_sub(y.checked_mul(q)?)),
                "^" => Some(x ^ y),
                "**" if y >= 0 => u32::try_from(y).ok().and_then(|y| x.checked_pow(y)),
                "/" | "//" | "%" if y == 0 => return Err(Raise),
                _ => None,
            };
            if let Some(v) = int {
                return Ok(Val::Int(v));
            }
            if op != "/" && op != "**" {
                return Err(Raise);
            }
        }
        if op == "^" {
            return Err(Raise);
        }
        let (x, y) = (num(&a)?, num(&b)?);
        let v = match op {
            "+" => x + y,
            "-" => x - y,
            "*" => x * y,
            "/" if y == 0.0 => return Err(Raise),
            "/" => x / y,
            "//" if y == 0.0 => return Err(Raise),
            "//" => (x / y).floor(),
            "%" if y == 0.0 => return Err(Raise),
            "%" => x - y * (x / y).floor(),
            _ => {
                if x == 0.0 && y < 0.0 {
                    return Err(Raise);
                }
                let v = x.powf(y);
                if v.is_nan() {
                    // A negative base to a fractional power is complex in Python.
                    return Err(Raise);
                }
                v
            }
        };
        if v.is_infinite() && x.is_finite() && y.is_finite() {
            return Err(Raise); // OverflowError
        }
        Ok(Val::Float(v))
    }

    impl P {
        fn ws(&mut self) {
            while self.c.get(self.i).is_some_and(|c| *c == ' ' || *c == '\t') {
                self.i += 1;
            }
        }
        fn at(&mut self, s: &str) -> bool {
            self.ws();
            let n = s.chars().count();
            let hit = self.c.len() >= self.i + n
                && self.c[self.i..self.i + n].iter().copied().eq(s.chars());
            if hit {
                self.i += n;
            }
            hit
        }
        /// Comma-separated items up to `close` (not consumed) or the end; whether a comma
        /// was seen.
        fn items(&mut self, close: Option<char>) -> Result<(Vec<Val>, bool), Raise> {
            let mut items = Vec::new();
            let mut comma = false;
            loop {
                self.ws();
                if self.c.get(self.i).copied() == close {
                    return Ok((items, comma));
                }
                items.push(self.xor()?);
                if !self.at(",") {
                    return Ok((items, comma));
                }
                comma = true;
            }
        }
        /// The top level: an expression, or a tuple when there is a comma.
        fn tuple(&mut self) -> Result<Val, Raise> {
            let (mut items, comma) = self.items(None)?;
            match (items.len(), comma) {
                (1, false) => Ok(items.remove(0)),
                (0, _) => Err(Raise),
                _ => Ok(Val::Seq { list: false, items }),
            }
        }
        fn xor(&mut self) -> Result<Val, Raise> {
            let mut v = self.sum()?;
            while self.at("^") {
                v = arith("^", v, self.sum()?)?;
            }
            Ok(v)
        }
        fn sum(&mut self) -> Result<Val, Raise> {
            let mut v = self.term()?;
            loop {
                let op = if self.at("+") {
                    "+"
                } else if self.at("-") {
                    "-"
                } else {
                    return Ok(v);
                };
                v = arith(op, v, self.term()?)?;
            }
        }
        fn term(&mut self) -> Result<Val, Raise> {
            let mut v = self.unary()?;
            loop {
                let op = if self.at("**") {
                    // Not a product: put it back for `power`.
                    self.i -= 2;
                    return Ok(v);
                } else if self.at("*") {
                    "*"
                } else if self.at("//") {
                    "//"
                } else if self.at("/") {
                    "/"
                } else if self.at("%") {
                    "%"
                } else {
                    return Ok(v);
                };
                v = arith(op, v, self.unary()?)?;
            }
        }
        fn unary(&mut self) -> Result<Val, Raise> {
            if self.at("-") {
                return match self.unary()? {
                    Val::Int(i) => i.checked_neg().map(Val::Int).ok_or(Raise),
                    Val::Float(x) => Ok(Val::Float(-x)),
                    _ => Err(Raise),
                };
            }
            if self.at("+") {
                let v = self.unary()?;
                num(&v)?;
                return Ok(v);
            }
            self.power()
        }
        fn power(&mut self) -> Result<Val, Raise> {
            let base = self.atom()?;
            if self.at("**") {
                return arith("**", base, self.unary()?);
            }
            Ok(base)
        }
        fn atom(&mut self) -> Result<Val, Raise> {
            self.ws();
            for (open, close, list) in [('(', ')', false), ('[', ']', true)] {
                if self.at(&open.to_string()) {
                    let (mut items, comma) = self.items(Some(close))?;
                    if !self.at(&close.to_string()) {
                        return Err(Raise);
                    }
                    return Ok(match (list, items.len(), comma) {
                        (false, 1, false) => items.remove(0),
                        _ => Val::Seq { list, items },
                    });
                }
            }
            let start = self.i;
            while self
                .c
                .get(self.i)
                .is_some_and(|c| c.is_ascii_digit() || *c == '.' || *c == '_')
            {
                self.i += 1;
            }
            if matches!(self.c.get(self.i), Some('e' | 'E')) && self.i > start {
                let save = self.i;
                self.i += 1;
                if matches!(self.c.get(self.i), Some('+' | '-')) {
                    self.i += 1;
                }
                let digits = self.i;
                while self.c.get(self.i).is_some_and(char::is_ascii_digit) {
                    self.i += 1;
                }
                if self.i == digits {
                    self.i = save;
                }
            }
            let text: String = self.c[start..self.i].iter().collect();
            if text.is_empty() || self.c.get(self.i).is_some_and(|c| c.is_alphanumeric()) {
                return Err(Raise); // a name, or `2x` (a SyntaxError)
            }
            if text.chars().all(|c| c.is_ascii_digit()) {
                // Python rejects leading zeros in a non-zero decimal integer.
                if text.len() > 1 && text.starts_with('0') && text.chars().any(|c| c != '0') {
                    return Err(Raise);
                }
                return text.parse().map(Val::Int).map_err(|_| Raise);
            }
            super::py::float(&text).map(Val::Float).ok_or(Raise)
        }
    }
}

static DOLLAR_NUMBER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\A\$\d+(\.\d+)?").expect("valid regex"));
static PERCENT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\A\d+(\.\d+)?(%|\\%)\n?\z").expect("valid regex"));

/// Python's `str.isdigit` for one character (decimal digits and the superscripts).
fn is_py_digit(c: char) -> bool {
    c.is_ascii_digit()
        || (c.is_numeric() && !matches!(c, '\u{bc}'..='\u{be}' | '\u{2150}'..='\u{218b}'))
}

/// ToRA's `normalize(answer, pi)`.
fn normalize(answer: Val, pi: f64) -> Result<Val, Raise> {
    let Val::Str(s) = answer else {
        return Ok(answer);
    };
    if DOLLAR_NUMBER.is_match(&s) {
        return Ok(Val::Str(s.chars().skip(1).collect()));
    }
    if PERCENT.is_match(&s) {
        return Ok(Val::Str(s.replace("\\%", "").replace('%', "")));
    }
    // handle_base: "1010_2" → int(float("1010")); raises on anything else before the `_`.
    if let Some((head, _)) = s.split_once('_') {
        let x = py::float(head).ok_or(Raise)?;
        if !x.is_finite() || x.abs() >= 1e38 {
            return Err(Raise);
        }
        return Ok(Val::Int(x.trunc() as i128));
    }
    if !s.contains("\\pi") {
        return Ok(Val::Str(s));
    }
    // handle_pi: `\pi` → `*{pi}` after a digit, else `1*{pi}`; then Python's eval.
    let pi_text = py::float_repr(pi);
    let mut s = s;
    let mut from = 0;
    while let Some(found) = s[from..].find("\\pi") {
        let idx = from + found;
        let after_digit = s[..idx].chars().next_back().is_some_and(is_py_digit);
        let insert = if after_digit {
            format!("*{pi_text}")
        } else {
            format!("1*{pi_text}")
        };
        s = format!("{}{insert}{}", &s[..idx], &s[idx + 3..]);
        // Python resumes at idx + 1 (a character index; the inserted text holds no `\pi`).
        from = idx + s[idx..].chars().next().map_or(1, char::len_utf8);
    }
    Ok(pyeval::eval(&s).unwrap_or(Val::Str(s)))
}

/// `is_digit`: the number `float()` reads from `str(value)` after dropping `{,}` (or, without
/// one, every comma).
fn is_digit(v: &Val) -> Option<f64> {
    let s = v.str();
    if s.contains("{,}") {
        py::float(&s.replace("{,}", ""))
    } else {
        py::float(&s.replace(',', ""))
    }
}

/// `math.isclose(a, b, rel_tol=tol)`.
fn isclose(a: f64, b: f64, tol: f64) -> bool {
    if a == b {
        return true;
    }
    if a.is_infinite() || b.is_infinite() {
        return false;
    }
    let diff = (a - b).abs();
    diff <= tol * b.abs() || diff <= tol * a.abs()
}

static INTERVALS: LazyLock<[(Regex, &str, &str); 4]> = LazyLock::new(|| {
    let re = |p: &str| Regex::new(p).expect("valid regex");
    [
        (re(r"\AInterval\((.*)\)\n?\z"), "[", "]"),
        (re(r"\AInterval\.Ropen\((.*)\)\n?\z"), "[", ")"),
        (re(r"\AInterval\.Lopen\((.*)\)\n?\z"), "(", "]"),
        (re(r"\AInterval\.open\((.*)\)\n?\z"), "(", ")"),
    ]
});

fn format_intervals(prediction: String) -> String {
    for (re, open, close) in INTERVALS.iter() {
        if let Some(c) = re.captures(&prediction) {
            return format!("{open}{}{close}", &c[1]);
        }
    }
    prediction
}

/// `s[1:-1]` on characters.
fn inner(s: &str) -> String {
    let n = s.chars().count();
    s.chars().skip(1).take(n.saturating_sub(2)).collect()
}

fn all_equal(pairs: Vec<(Val, Val)>) -> Result<bool, Raise> {
    // Python builds the whole list before `all`: any element's exception propagates.
    let results = pairs
        .into_iter()
        .map(|(p, r)| math_equal(p, r, std::f64::consts::PI))
        .collect::<Result<Vec<bool>, Raise>>()?;
    Ok(results.into_iter().all(|b| b))
}

fn strs(parts: Vec<&str>) -> Vec<Val> {
    parts.into_iter().map(|p| Val::Str(p.to_owned())).collect()
}

const PMATRIX: &str = "\\begin{pmatrix}";

/// ToRA's `math_equal(prediction, reference, include_percentage=True, tolerance=1e-4, pi=pi)`.
fn math_equal(prediction: Val, reference: Val, pi: f64) -> Result<bool, Raise> {
    const TOL: f64 = 1e-4;
    let mut prediction = normalize(prediction, pi)?;
    let reference = normalize(reference, pi)?;
    if let Val::Str(p) = &prediction
        && p.chars().count() > 1000
    {
        prediction = Val::Str(p.chars().take(1000).collect());
    }
    if let (Val::Str(p), Val::Str(r)) = (&prediction, &reference)
        && (py::strip(p).to_lowercase() == py::strip(r).to_lowercase()
            || p.replace(' ', "") == r.replace(' ', ""))
    {
        return Ok(true);
    }
    if let (Some(p), Some(r)) = (is_digit(&prediction), is_digit(&reference)) {
        return Ok([r / 100.0, r, r * 100.0]
            .into_iter()
            .any(|item| isclose(item, p, TOL)));
    }
    if prediction.falsy_nonzero() {
        return Ok(false);
    }
    let reference = py::strip(&reference.str()).to_owned();
    let prediction = format_intervals(py::strip(&prediction.str()).to_owned());

    let (mut pred_str, mut ref_str) = (prediction.clone(), reference.clone());
    if (prediction.starts_with('[') && prediction.ends_with(']') && !reference.starts_with('('))
        || (prediction.starts_with('(') && prediction.ends_with(')') && !reference.starts_with('['))
    {
        let brackets: &[char] = &['[', ']', '(', ')'];
        pred_str = pred_str.trim_matches(brackets).to_owned();
        ref_str = ref_str.trim_matches(brackets).to_owned();
    }
    let braces: &[char] = &['{', '}', '(', ')'];
    if pred_str.replace(braces, "") == ref_str.replace(braces, "") {
        return Ok(true);
    }

    let first = |s: &str| s.chars().next();
    let last = |s: &str| s.chars().next_back();
    if !prediction.is_empty()
        && !reference.is_empty()
        && matches!(first(&prediction), Some('(' | '['))
        && matches!(last(&prediction), Some(')' | ']'))
        && first(&prediction) == first(&reference)
        && last(&prediction) == last(&reference)
    {
        let (p, r) = (inner(&prediction), inner(&reference));
        let (pp, rp): (Vec<&str>, Vec<&str>) = (p.split(',').collect(), r.split(',').collect());
        if pp.len() == rp.len() && all_equal(strs(pp).into_iter().zip(strs(rp)).collect())? {
            return Ok(true);
        }
    }

    if prediction.contains(',') && reference.contains(',') {
        let pp: Vec<&str> = prediction.split(',').map(py::strip).collect();
        let rp: Vec<&str> = reference.split(',').map(py::strip).collect();
        if pp.len() == rp.len() {
            return all_equal(strs(pp).into_iter().zip(strs(rp)).collect());
        }
    }

    if prediction.starts_with("Point") {
        // `reference[0]` on an empty reference is an IndexError.
        let (Some(rf), Some(rl)) = (first(&reference), last(&reference)) else {
            return Err(Raise);
        };
        if rf == '(' && rl == ')' {
            let chars: Vec<char> = prediction.chars().collect();
            let open = chars.iter().position(|&c| c == '(').map_or(0, |k| k + 1);
            let end = chars.len() - 1;
            let body: String = chars[open.min(end)..end].iter().collect();
            let r = inner(&reference);
            let (pp, rp): (Vec<&str>, Vec<&str>) =
                (body.split(',').collect(), r.split(',').collect());
            if pp.len() == rp.len() && all_equal(strs(pp).into_iter().zip(strs(rp)).collect())? {
                return Ok(true);
            }
        }
    }

    if reference.contains(PMATRIX) && prediction.starts_with("Matrix") {
        // sympy's `Matrix([...])`; its elements in row order. Errors are swallowed.
        let elements = prediction
            .strip_prefix("Matrix(")
            .and_then(|s| s.strip_suffix(')'))
            .and_then(|s| pyeval::eval(s).ok())
            .and_then(|v| match v {
                Val::Seq { list: true, items } => Some(
                    items
                        .into_iter()
                        .flat_map(|row| match row {
                            Val::Seq { items, .. } => items,
                            x => vec![x],
                        })
                        .collect::<Vec<_>>(),
                ),
                _ => None,
            });
        if let Some(elements) = elements {
            let words: Vec<&str> = reference.split_whitespace().collect();
            let items: Vec<Val> = words
                .get(1..words.len().saturating_sub(1))
                .unwrap_or_default()
                .iter()
                .step_by(2)
                .map(|w| Val::Str((*w).to_owned()))
                .collect();
            if elements.len() == items.len()
                && matches!(
                    all_equal(elements.into_iter().zip(items).collect()),
                    Ok(true)
                )
            {
                return Ok(true);
            }
        }
    } else if reference.contains(PMATRIX)
        && prediction.starts_with('[')
        && prediction.ends_with(']')
    {
        // `eval(prediction)` here is outside verl's `try`.
        if let Val::Seq { list: true, items } = pyeval::eval(&prediction)? {
            let body = reference
                .strip_prefix("\\\\begin{pmatrix}")
                .unwrap_or(&reference);
            let body = body.strip_prefix(PMATRIX).unwrap_or(body);
            let body = body.strip_suffix("\\\\end{pmatrix}").unwrap_or(body);
            let body = body.strip_suffix("\\end{pmatrix}").unwrap_or(body);
            let rows: Vec<Val> = body
                .split('\\')
                .map(|row| {
                    if row.contains('&') {
                        Val::Seq {
                            list: true,
                            items: strs(row.split('&').collect()),
                        }
                    } else {
                        Val::Str(row.to_owned())
                    }
                })
                .collect();
            if items.len() == rows.len()
                && matches!(all_equal(items.into_iter().zip(rows).collect()), Ok(true))
            {
                return Ok(true);
            }
        }
    }
    // symbolic_equal: never true in verl (see the module notes).
    Ok(false)
}

/// `s.lower().rfind(marker)` as a character index (the markers are ASCII).
fn rfind_lower(s: &[char], marker: &str) -> Option<usize> {
    let m: Vec<char> = marker.chars().collect();
    if m.len() > s.len() {
        return None;
    }
    (0..=s.len() - m.len()).rev().find(|&k| {
        s[k..k + m.len()]
            .iter()
            .zip(&m)
            .all(|(c, mc)| c.to_lowercase().next() == Some(*mc))
    })
}

fn strip_chars(s: &[char]) -> Vec<char> {
    let text: String = s.iter().collect();
    py::strip(&text).chars().collect()
}

/// `_last_boxed_only_string`: the stripped content of the last `\boxed{…}` (or `\fbox{…}`).
fn last_boxed_content(s: &[char]) -> Option<Vec<char>> {
    let text: String = s.iter().collect();
    let byte = text.rfind("\\boxed").or_else(|| text.rfind("\\fbox"))?;
    let start = text[..byte].chars().count();
    let mut depth = 0i64;
    let mut left = None;
    for (k, &c) in s.iter().enumerate().skip(start) {
        if c == '{' {
            depth += 1;
            left.get_or_insert(k);
        } else if c == '}' {
            depth -= 1;
            if depth == 0 {
                return Some(strip_chars(&s[left? + 1..k]));
            }
        }
    }
    None
}

/// PRIME's `match_answer`: the answer text (the "matched" flag does not affect the score).
pub fn match_answer(response: &str) -> String {
    let mut r: Vec<char> = response.chars().collect();
    for marker in ["answer:", "answer is", "answers are"] {
        if let Some(k) = rfind_lower(&r, marker) {
            r = strip_chars(&r[k + marker.len()..]);
        }
    }
    for marker in [
        "is answer",
        "is the answer",
        "are answers",
        "are the answers",
    ] {
        if let Some(k) = rfind_lower(&r, marker) {
            r = strip_chars(&r[..k]);
        }
    }
    if let Some(boxed) = last_boxed_content(&r).filter(|b| !b.is_empty()) {
        r = boxed;
    }
    if let Some(k) = rfind_lower(&r, ". ") {
        r = strip_chars(&r[..k]);
    }
    for marker in [
        "be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n",
    ] {
        if let Some(k) = rfind_lower(&r, marker) {
            r = strip_chars(&r[k + marker.chars().count()..]);
        }
    }
    r.into_iter().collect()
}

/// verl's `prime_math.compute_score(...)[0]`: 1.0 for a correct answer, else 0.0.
pub fn compute_score(solution: &str, ground_truth: &str) -> f64 {
    let extracted = match_answer(solution);
    if prm800k::grade_answer(&extracted, ground_truth, Flavor::Prime) {
        return 1.0;
    }
    let equal = |pi: f64| {
        math_equal(
            Val::Str(extracted.clone()),
            Val::Str(ground_truth.to_owned()),
            pi,
        )
    };
    let correct = if extracted.contains("\\pi") || ground_truth.contains("\\pi") {
        // Both evaluations run before `any`: an exception in either is a 0.
        // verl tries `math.pi` and the school value 3.14.
        #[allow(clippy::approx_constant)]
        let school_pi = 3.14;
        match (equal(std::f64::consts::PI), equal(school_pi)) {
            (Ok(a), Ok(b)) => a || b,
            _ => false,
        }
    } else {
        equal(std::f64::consts::PI).unwrap_or(false)
    };
    if correct { 1.0 } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_like_prime() {
        assert_eq!(match_answer("The answer is 42."), "42.");
        assert_eq!(match_answer("so $x = 5$"), "5$");
        assert_eq!(
            match_answer("Step 2: \\boxed{\\frac{1}{2}} done"),
            "\\frac{1}{2}"
        );
        assert_eq!(match_answer("7 is the answer"), "7");
        assert_eq!(match_answer("we get 3. Then 4"), "3");
    }

    #[test]
    #[allow(clippy::approx_constant)] // 2 × 3.14, verl's school π
    fn python_eval_and_repr() {
        assert_eq!(pyeval::eval("2*3.14").unwrap(), Val::Float(6.28));
        assert_eq!(pyeval::eval("7/2").unwrap(), Val::Float(3.5));
        assert_eq!(pyeval::eval("-7//2").unwrap(), Val::Int(-4));
        assert_eq!(pyeval::eval("(1, 2)").unwrap().repr(), "(1, 2)");
        assert_eq!(pyeval::eval("[1, [2]]").unwrap().repr(), "[1, [2]]");
        assert!(pyeval::eval("x").is_err() && pyeval::eval("\\frac{1}{2}").is_err());
        assert!(pyeval::eval("1*3.14^2").is_err());
    }

    /// Arbitrary text never panics (Python raises and scores 0, or scores; never a crash).
    #[test]
    fn arbitrary_input_never_panics() {
        const PIECES: [&str; 40] = [
            "\\boxed{",
            "\\fbox{",
            "}",
            "{",
            "\\frac",
            "\\sqrt",
            "[",
            "]",
            "(",
            ")",
            "\\pi",
            "answer is ",
            "Answer:",
            "=",
            ". ",
            "_",
            "^",
            "-",
            "+",
            "*",
            "/",
            "//",
            "%",
            "$",
            ",",
            "x",
            "Point(",
            "Matrix([",
            "\\begin{pmatrix}",
            "\\\\",
            "&",
            "0",
            "7",
            "1e308",
            "99999999999999999999999999999999999999999",
            "!",
            "\\text{",
            " ",
            "Interval(",
            "é",
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for _ in 0..3000 {
            let mut text = |max: usize| {
                let k = 1 + next(max);
                (0..k)
                    .map(|_| PIECES[next(PIECES.len())])
                    .collect::<String>()
            };
            let (a, b) = (text(8), text(5));
            let score = compute_score(&a, &b);
            assert!(score == 0.0 || score == 1.0);
            let g = super::super::geo3k::compute_score(&a, &b);
            assert!((0.0..=1.0).contains(&g));
        }
    }

    #[test]
    fn scores() {
        assert_eq!(
            compute_score("The answer is \\boxed{0.5}", "\\frac{1}{2}"),
            1.0
        );
        assert_eq!(compute_score("Answer: 50\\%", "0.5"), 1.0);
        assert_eq!(compute_score("\\boxed{2\\pi}", "6.28"), 1.0);
        // verl drops a base suffix without converting: 1010_2 reads as 1010.
        assert_eq!(compute_score("\\boxed{1010_2}", "10"), 0.0);
        assert_eq!(compute_score("\\boxed{1010_2}", "1010"), 1.0);
        assert_eq!(compute_score("\\boxed{x_1}", "10"), 0.0);
        assert_eq!(
            compute_score("\\boxed{Interval.Ropen(0, 1)}", "[0, 1)"),
            1.0
        );
        assert_eq!(compute_score("\\boxed{3}", "4"), 0.0);
        // Each as verl's Python scores it.
        assert_eq!(
            compute_score(
                "\\boxed{Matrix([1, 2])}",
                "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"
            ),
            1.0
        );
        assert_eq!(compute_score("\\boxed{Point(1, 2)}", "(1, 2)"), 0.0);
        assert_eq!(compute_score("\\boxed{(0, 2\\pi)}", "(0, 6.28)"), 1.0);
    }
}
