//! The few Python string semantics verl's rules rely on, where Rust's differ.

/// Python's `str.isspace` (what `str.split()`, `str.strip()` and `re`'s `\s` use): Unicode White_Space
/// less U+180E, plus the separators U+001C–U+001F.
pub fn is_space(c: char) -> bool {
    matches!(
        c,
        '\t'..='\r'
            | '\x1c'..='\x20'
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// `re`'s `\s` as a character class for the `regex` crate.
pub const SPACE_CLASS: &str = r"[\t-\r\x1C-\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}]";

/// `str.strip()`.
pub fn strip(s: &str) -> &str {
    s.trim_matches(is_space)
}

/// `s[-n:]` on characters.
pub fn tail(s: &str, n: usize) -> &str {
    match s.char_indices().rev().nth(n.saturating_sub(1)) {
        Some((at, _)) if n > 0 => &s[at..],
        _ if n == 0 => "",
        _ => s,
    }
}

/// Python's `float(s)`: surrounding whitespace, a sign, `_` between digits, `inf`/`infinity`/
/// `nan` in any case; None where Python raises `ValueError`.
pub fn float(s: &str) -> Option<f64> {
    let t = strip(s);
    let body = t.strip_prefix(['+', '-']).unwrap_or(t);
    let lower = body.to_ascii_lowercase();
    if ["inf", "infinity", "nan"].contains(&lower.as_str()) {
        return t.parse().ok();
    }
    let bytes = body.as_bytes();
    let ok_chars = bytes
        .iter()
        .all(|&b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-' | b'_'));
    // An underscore must sit between two digits.
    let ok_underscores = bytes.iter().enumerate().all(|(k, &b)| {
        b != b'_'
            || (k > 0
                && bytes[k - 1].is_ascii_digit()
                && bytes.get(k + 1).is_some_and(u8::is_ascii_digit))
    });
    if body.is_empty() || !ok_chars || !ok_underscores {
        return None;
    }
    t.replace('_', "").parse().ok()
}

/// Python's `repr(float)`: the shortest round-trip digits, in exponent form below 1e-4 and from
/// 1e16 on.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{x:e}"); // e.g. "-1.5e16", "1e-5"
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    if !(-4..16).contains(&exp) {
        return format!(
            "{mantissa}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        );
    }
    let plain = format!("{x}");
    if plain.contains('.') {
        plain
    } else {
        format!("{plain}.0")
    }
}

/// Python's `str(int(x))` for a finite float: truncated towards zero, every digit.
pub fn int_text(x: f64) -> String {
    let t = x.trunc();
    if t == 0.0 {
        "0".into()
    } else {
        format!("{t:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_whitespace_and_slices() {
        assert_eq!(strip("\x1c a \u{3000}\n"), "a");
        // U+180E is not whitespace for Python 3.
        assert_eq!(strip("\u{180e}a"), "\u{180e}a");
        assert_eq!(tail("héllo", 3), "llo");
        assert_eq!(tail("hé", 3), "hé");
        assert_eq!(tail("abc", 0), "");
        let re = regex::Regex::new(SPACE_CLASS).unwrap();
        assert_eq!(float(" 1_000.5 "), Some(1000.5));
        assert_eq!(float("1__0"), None);
        assert_eq!(float("-Infinity"), Some(f64::NEG_INFINITY));
        assert_eq!(float(".5e1"), Some(5.0));
        assert_eq!(float("1,0"), None);
        assert_eq!(float(""), None);
        assert_eq!(float_repr(1.0), "1.0");
        assert_eq!(float_repr(std::f64::consts::TAU), "6.283185307179586");
        assert_eq!(float_repr(1e-5), "1e-05");
        assert_eq!(float_repr(1.5e16), "1.5e+16");
        assert_eq!(float_repr(0.0001), "0.0001");
        assert_eq!(int_text(-0.5), "0");
        assert_eq!(int_text(1e20), "100000000000000000000");
        assert!(re.is_match("\x1f") && re.is_match("\u{a0}") && !re.is_match("a"));
    }
}
