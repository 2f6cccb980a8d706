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
        assert!(re.is_match("\x1f") && re.is_match("\u{a0}") && !re.is_match("a"));
    }
}
