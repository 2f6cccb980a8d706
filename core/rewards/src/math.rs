//! MATH: the last `\boxed{…}` compared with the ground truth after the Hendrycks MATH string
//! normalisation (verl `reward_score/math_reward.py`, from lm-evaluation-harness).
//!
//! Where the Python raises inside the normalisation (an index past the end, a failed assert),
//! `strip_string` returns None and the comparison falls back to the raw strings, as verl's
//! `is_equiv` does in its `except`.

/// 1.0 when the last boxed answer is equivalent to `ground_truth`, else 0.0.
pub fn compute_score(solution: &str, ground_truth: &str) -> f64 {
    match last_boxed_only_string(solution).and_then(|boxed| remove_boxed(&boxed)) {
        Some(answer) if is_equiv(&answer, ground_truth) => 1.0,
        _ => 0.0,
    }
}

pub fn is_equiv(a: &str, b: &str) -> bool {
    match (strip_string(a), strip_string(b)) {
        (Some(a), Some(b)) => a == b,
        _ => a == b,
    }
}

/// The last `\boxed{…}` (balanced braces) or `\fbox{…}`; `\boxed x` up to the next `$`.
pub fn last_boxed_only_string(text: &str) -> Option<String> {
    if let Some((_, after)) = text.rsplit_once("\\boxed ") {
        return Some(format!("\\boxed {}", after.split('$').next().unwrap_or("")));
    }
    let start = text.rfind("\\boxed").or_else(|| text.rfind("\\fbox"))?;
    let mut depth = 0i64;
    for (offset, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[start..=start + offset].to_owned());
                }
            }
            _ => {}
        }
    }
    None
}

/// The content of `\boxed{…}` / `\boxed …`; None for anything else (e.g. `\fbox{…}`, where verl's
/// assert fails and the score is 0).
pub fn remove_boxed(boxed: &str) -> Option<String> {
    if boxed.contains("\\boxed ") {
        return boxed.strip_prefix("\\boxed ").map(str::to_owned);
    }
    boxed
        .strip_prefix("\\boxed{")?
        .strip_suffix('}')
        .map(str::to_owned)
}

/// The MATH normalisation; None where the Python raises.
pub fn strip_string(s: &str) -> Option<String> {
    let mut s = s.replace('\n', "").replace("\\!", "").replace("\\\\", "\\");
    s = s.replace("tfrac", "frac").replace("dfrac", "frac");
    s = s.replace("\\left", "").replace("\\right", "");
    s = s.replace("^{\\circ}", "").replace("^\\circ", "");
    s = s.replace("\\$", "");
    s = remove_right_units(&s)?;
    s = s.replace("\\\\%", "").replace("\\%", "");
    s = s.replace(" .", " 0.").replace("{.", "{0.");
    if s.is_empty() {
        return Some(s);
    }
    if s.starts_with('.') {
        s.insert(0, '0');
    }
    // Drop a short left-hand side such as "k = ".
    let parts: Vec<&str> = s.split('=').collect();
    if parts.len() == 2 && parts[0].chars().count() <= 2 {
        s = parts[1].to_owned();
    }
    s = fix_sqrt(&s)?;
    s = s.replace(' ', "");
    s = fix_fracs(&s)?;
    if s == "0.5" {
        s = "\\frac{1}{2}".to_owned();
    }
    Some(fix_a_slash_b(&s))
}

/// `x \text{ units}` → `x`; more than one `\text{ ` is an assert failure in the Python.
fn remove_right_units(s: &str) -> Option<String> {
    let parts: Vec<&str> = s.split("\\text{ ").collect();
    match parts.len() {
        1 => Some(s.to_owned()),
        2 => Some(parts[0].to_owned()),
        _ => None,
    }
}

/// `\sqrt3` → `\sqrt{3}`.
fn fix_sqrt(s: &str) -> Option<String> {
    let mut parts = s.split("\\sqrt");
    let mut out = parts.next().unwrap_or("").to_owned();
    for part in parts {
        let first = part.chars().next()?;
        if first == '{' {
            out.push_str("\\sqrt");
            out.push_str(part);
        } else {
            out.push_str(&format!("\\sqrt{{{first}}}{}", &part[first.len_utf8()..]));
        }
    }
    Some(out)
}

/// `\frac12` → `\frac{1}{2}`, `\frac1{72}` → `\frac{1}{72}`.
fn fix_fracs(s: &str) -> Option<String> {
    let mut parts = s.split("\\frac");
    let mut out = parts.next().unwrap_or("").to_owned();
    for part in parts {
        out.push_str("\\frac");
        let mut chars = part.chars();
        let a = chars.next()?;
        if a == '{' {
            out.push_str(part);
            continue;
        }
        let Some(b) = chars.next() else {
            // The Python returns the input unchanged when fewer than two characters follow.
            return Some(s.to_owned());
        };
        let rest = chars.as_str();
        if b == '{' {
            out.push_str(&format!("{{{a}}}{{{rest}"));
        } else {
            out.push_str(&format!("{{{a}}}{{{b}}}{rest}"));
        }
    }
    Some(out)
}

/// `a/b` of two integers written canonically (what Python's `int()` round-trips) → `\frac{a}{b}`.
fn fix_a_slash_b(s: &str) -> String {
    let canonical = |t: &str| {
        let digits = t.strip_prefix('-').unwrap_or(t);
        t == "0"
            || (!digits.is_empty()
                && !digits.starts_with('0')
                && digits.bytes().all(|c| c.is_ascii_digit()))
    };
    match s.split_once('/') {
        Some((a, b)) if !b.contains('/') && canonical(a) && canonical(b) => {
            format!("\\frac{{{a}}}{{{b}}}")
        }
        _ => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_last_boxed_answer() {
        assert_eq!(
            last_boxed_only_string("a \\boxed{1} b \\boxed{\\frac{1}{2}} c").as_deref(),
            Some("\\boxed{\\frac{1}{2}}")
        );
        assert_eq!(
            last_boxed_only_string("$\\boxed 5$ end").as_deref(),
            Some("\\boxed 5")
        );
        assert_eq!(
            last_boxed_only_string("\\fbox{7}").as_deref(),
            Some("\\fbox{7}")
        );
        assert_eq!(last_boxed_only_string("\\boxed{unclosed"), None);
        assert_eq!(last_boxed_only_string("nothing"), None);
        assert_eq!(remove_boxed("\\boxed{x}").as_deref(), Some("x"));
        assert_eq!(remove_boxed("\\boxed 5").as_deref(), Some("5"));
        assert_eq!(remove_boxed("\\fbox{7}"), None);
    }

    #[test]
    fn normalisation_matches_the_harness() {
        assert_eq!(
            strip_string("\\dfrac{1}{2}").as_deref(),
            Some("\\frac{1}{2}")
        );
        assert_eq!(strip_string("\\frac12").as_deref(), Some("\\frac{1}{2}"));
        assert_eq!(
            strip_string("\\frac1{72}").as_deref(),
            Some("\\frac{1}{72}")
        );
        assert_eq!(strip_string("0.5").as_deref(), Some("\\frac{1}{2}"));
        // ".5" → "0.5" → ½, as the harness does.
        assert_eq!(strip_string(".5").as_deref(), Some("\\frac{1}{2}"));
        assert_eq!(strip_string(".25").as_deref(), Some("0.25"));
        assert_eq!(strip_string("3/4").as_deref(), Some("\\frac{3}{4}"));
        assert_eq!(strip_string("03/4").as_deref(), Some("03/4"));
        assert_eq!(strip_string("k = 7").as_deref(), Some("7"));
        assert_eq!(strip_string("\\sqrt3").as_deref(), Some("\\sqrt{3}"));
        assert_eq!(strip_string("90^\\circ").as_deref(), Some("90"));
        assert_eq!(strip_string("10\\%").as_deref(), Some("10"));
        assert_eq!(strip_string("5 \\text{ cm}").as_deref(), Some("5"));
        assert_eq!(
            strip_string("\\left( 1, 2 \\right)").as_deref(),
            Some("(1,2)")
        );
        // Raises in Python: a trailing \sqrt, a trailing \frac, two unit markers.
        assert_eq!(strip_string("2\\sqrt"), None);
        assert_eq!(strip_string("\\frac"), None);
        assert_eq!(strip_string("1 \\text{ a} \\text{ b}"), None);
        // Fewer than two characters after \frac: the input comes back unchanged.
        assert_eq!(strip_string("\\frac1").as_deref(), Some("\\frac1"));
    }

    #[test]
    fn scores() {
        assert_eq!(compute_score("so \\boxed{\\dfrac{1}{2}}", "\\frac12"), 1.0);
        assert_eq!(compute_score("so \\boxed{0.5}", "\\frac{1}{2}"), 1.0);
        assert_eq!(compute_score("\\boxed{2}", "3"), 0.0);
        assert_eq!(compute_score("no box 3", "3"), 0.0);
        assert_eq!(compute_score("\\fbox{3}", "3"), 0.0);
        // Both raise in the normalisation → compared raw.
        assert_eq!(compute_score("\\boxed{x\\sqrt}", "x\\sqrt"), 1.0);
        assert!(is_equiv("\\left(1,2\\right)", "(1, 2)"));
    }
}
