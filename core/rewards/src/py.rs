//! The few Python string semantics verl's rules rely on, where Rust's differ.

use serde_json::Value;

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

/// Python's `str()` of a JSON value as `json.loads` gives it: a string as is, anything else as
/// its `repr` (`True`, `None`, `[1, 'a']`, `{'k': 2.0}`). Objects come out in sorted key order
/// (serde_json's; Python keeps the document's order) and integers beyond 64 bits as floats.
pub fn str_of(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => {
            let mut out = String::new();
            repr_into(other, &mut out);
            out
        }
    }
}

fn repr_into(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("None"),
        Value::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (_, Some(u), _) => out.push_str(&u.to_string()),
            (_, _, Some(f)) => out.push_str(&float_repr(f)),
            _ => out.push_str(&n.to_string()),
        },
        Value::String(s) => string_repr_into(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr_into(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                string_repr_into(key, out);
                out.push_str(": ");
                repr_into(item, out);
            }
            out.push('}');
        }
    }
}

/// `repr(str)`: single quotes unless the text holds `'` and no `"`; backslash escapes for the
/// quote, `\\`, `\t` `\n` `\r`, and `\xNN`/`\uNNNN` for characters Python does not print (C0/C1
/// controls, DEL, non-ASCII spaces and separators, the soft hyphen and the common format
/// characters; unassigned code points, which Python also escapes, are kept).
fn string_repr_into(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !printable(c) => {
                let code = u32::from(c);
                out.push_str(&if code < 0x100 {
                    format!("\\x{code:02x}")
                } else if code < 0x10000 {
                    format!("\\u{code:04x}")
                } else {
                    format!("\\U{code:08x}")
                });
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// `str.isprintable` for one character, short of Unicode's unassigned code points.
fn printable(c: char) -> bool {
    !(c.is_control()
        || (c != ' ' && is_space(c))
        || matches!(
            c,
            '\u{ad}'
                | '\u{600}'..='\u{605}'
                | '\u{61c}'
                | '\u{6dd}'
                | '\u{70f}'
                | '\u{180e}'
                | '\u{200b}'..='\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2060}'..='\u{2064}'
                | '\u{2066}'..='\u{206f}'
                | '\u{e000}'..='\u{f8ff}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}'
                | '\u{f0000}'..
        ))
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

    /// Each expected text is what Python 3.11 prints for `str(json.loads(document))`, but for the
    /// object's key order (Python: `{'b': [1], 'a': 'x'}`).
    #[test]
    fn str_of_json_values_as_python() {
        let cases = [
            (r#""a\nb""#, "a\nb"),
            ("null", "None"),
            ("[true, false, null]", "[True, False, None]"),
            (
                "[1, -2.5, 1e-05, 1e16, 3.0]",
                "[1, -2.5, 1e-05, 1e+16, 3.0]",
            ),
            (
                r#"["it's", "say \"hi\"", "both ' \"", "tab\t\\"]"#,
                r#"["it's", 'say "hi"', 'both \' "', 'tab\t\\']"#,
            ),
            (r#"{"b": [1], "a": "x"}"#, "{'a': 'x', 'b': [1]}"),
            (
                r#"["\u0007\u00e9\u00a0\u2028\u200b\u4e2d\ud83d\ude00"]"#,
                r"['\x07é\xa0\u2028\u200b中😀']",
            ),
            ("18446744073709551615", "18446744073709551615"),
            ("[[], {}]", "[[], {}]"),
            // Parsed correctly rounded (serde_json's `float_roundtrip`), as by Python.
            (
                "[9.055385138137417, 0.36363636363636365]",
                "[9.055385138137417, 0.36363636363636365]",
            ),
        ];
        for (document, python) in cases {
            let value: Value = serde_json::from_str(document).unwrap();
            assert_eq!(str_of(&value), python, "{document}");
        }
    }
}
