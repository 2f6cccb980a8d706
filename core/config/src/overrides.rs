//! Hydra's override grammar, the part verl users type: `key.path=value`, `+key.path=value`,
//! `++key.path=value` and `~key.path`, where value is a number, `true`/`false`, `null`, a quoted or
//! bare string, a list `[a,b]` or a dict `{k: v}`, nested. Environment variables use the same value
//! syntax.

use serde_json::{Map, Number, Value};

/// One override as Hydra writes it.
#[derive(Debug, Clone, PartialEq)]
pub enum Override<'a> {
    /// `key=value`, `+key=value` (add a key) or `++key=value` (add or override). Every key
    /// verl-core accepts already exists with its default, so all three set it; an unknown key is
    /// the same error whichever form names it.
    Set(Vec<String>, &'a str),
    /// `~key`: back to the built-in default (an optional key: unset); a plugin section, or a key
    /// inside one or inside a free-form section, is removed.
    Delete(Vec<String>),
}

/// Parses `key.path=value`, `+key.path=value`, `++key.path=value` or `~key.path`.
pub fn parse_override(arg: &str) -> Result<Override<'_>, String> {
    if let Some(key) = arg.strip_prefix('~') {
        if key.contains('=') {
            return Err(
                "`~key=value` (delete only if the value matches) is not supported; delete with `~key`"
                    .into(),
            );
        }
        return key_path(key).map(Override::Delete);
    }
    let body = arg
        .strip_prefix("++")
        .or_else(|| arg.strip_prefix('+'))
        .unwrap_or(arg);
    let (key, value) = body.split_once('=').ok_or(
        "expected `key.path=value` (or `+key.path=value`, `++key.path=value`, `~key.path`)",
    )?;
    Ok(Override::Set(key_path(key)?, value))
}

/// `a.b.c` → `["a","b","c"]`.
fn key_path(key: &str) -> Result<Vec<String>, String> {
    let key = key.trim();
    let path: Vec<String> = key.split('.').map(str::to_owned).collect();
    if path.iter().any(|p| {
        p.is_empty()
            || !p
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    }) {
        return Err(format!("`{key}` is not a dotted key path"));
    }
    Ok(path)
}

/// Parses a value; `as_string` keeps a bare value as text (for keys whose type is a string, so
/// `trainer.experiment_name=2024` stays "2024"), while quotes are still removed.
pub fn parse_value(text: &str, as_string: bool) -> Result<Value, String> {
    let trimmed = text.trim();
    if as_string && !trimmed.starts_with(['\'', '"']) {
        return Ok(Value::String(trimmed.to_owned()));
    }
    let mut parser = Parser {
        chars: trimmed.chars().collect(),
        pos: 0,
    };
    let value = parser.value(true)?;
    parser.skip_ws();
    if parser.pos != parser.chars.len() {
        return Err(format!(
            "unexpected `{}` at position {}",
            parser.chars[parser.pos], parser.pos
        ));
    }
    Ok(value)
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += 1;
        }
    }

    fn expect(&mut self, c: char) -> Result<(), String> {
        self.skip_ws();
        if self.peek() == Some(c) {
            self.pos += 1;
            Ok(())
        } else {
            Err(format!("expected `{c}` at position {}", self.pos))
        }
    }

    /// `top` is true outside brackets, where `,` `]` `}` `:` are ordinary characters.
    fn value(&mut self, top: bool) -> Result<Value, String> {
        self.skip_ws();
        match self.peek() {
            Some('[') => self.list(),
            Some('{') => self.dict(),
            Some(q @ ('\'' | '"')) => self.quoted(q).map(Value::String),
            _ => Ok(scalar(self.bare(top, false).trim())),
        }
    }

    fn list(&mut self) -> Result<Value, String> {
        self.expect('[')?;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.value(false)?);
            self.skip_ws();
            match self.peek() {
                Some(',') => self.pos += 1,
                Some(']') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(format!("expected `,` or `]` at position {}", self.pos)),
            }
        }
    }

    fn dict(&mut self) -> Result<Value, String> {
        self.expect('{')?;
        let mut map = Map::new();
        self.skip_ws();
        if self.peek() == Some('}') {
            self.pos += 1;
            return Ok(Value::Object(map));
        }
        loop {
            self.skip_ws();
            let key = match self.peek() {
                Some(q @ ('\'' | '"')) => self.quoted(q)?,
                _ => self.bare(false, true).trim().to_owned(),
            };
            if key.is_empty() {
                return Err(format!("expected a key at position {}", self.pos));
            }
            self.expect(':')?;
            map.insert(key, self.value(false)?);
            self.skip_ws();
            match self.peek() {
                Some(',') => self.pos += 1,
                Some('}') => {
                    self.pos += 1;
                    return Ok(Value::Object(map));
                }
                _ => return Err(format!("expected `,` or `}}` at position {}", self.pos)),
            }
        }
    }

    fn quoted(&mut self, quote: char) -> Result<String, String> {
        let start = self.pos;
        self.pos += 1;
        let mut out = String::new();
        while let Some(c) = self.peek() {
            self.pos += 1;
            match c {
                '\\' if matches!(self.peek(), Some(n) if n == quote || n == '\\') => {
                    out.push(self.chars[self.pos]);
                    self.pos += 1;
                }
                c if c == quote => return Ok(out),
                c => out.push(c),
            }
        }
        Err(format!("unterminated string starting at position {start}"))
    }

    /// Text up to a delimiter; `${…}` interpolations are kept whole.
    fn bare(&mut self, top: bool, key: bool) -> String {
        let mut out = String::new();
        let mut depth = 0usize;
        while let Some(c) = self.peek() {
            if depth == 0 && !top && (matches!(c, ',' | ']' | '}') || (key && c == ':')) {
                break;
            }
            if c == '{' && out.ends_with('$') {
                depth += 1;
            } else if c == '}' && depth > 0 {
                depth -= 1;
            }
            out.push(c);
            self.pos += 1;
        }
        out
    }
}

/// A bare word: null, a boolean (Hydra accepts any case), an integer, a float, else a string.
fn scalar(text: &str) -> Value {
    match text.to_ascii_lowercase().as_str() {
        "null" | "~" => return Value::Null,
        "true" => return Value::Bool(true),
        "false" => return Value::Bool(false),
        _ => {}
    }
    if let Ok(i) = text.parse::<i64>() {
        return Value::Number(i.into());
    }
    let looks_numeric = text
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_digit() || matches!(c, '-' | '+' | '.'));
    match text
        .parse::<f64>()
        .ok()
        .filter(|_| looks_numeric)
        .and_then(Number::from_f64)
    {
        Some(n) => Value::Number(n),
        None => Value::String(text.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(text: &str) -> Value {
        parse_value(text, false).unwrap()
    }

    #[test]
    fn scalars() {
        assert_eq!(p("1e-6"), json!(1e-6));
        assert_eq!(p("-3"), json!(-3));
        assert_eq!(p("0.5"), json!(0.5));
        assert_eq!(p("True"), json!(true));
        assert_eq!(p("null"), Value::Null);
        assert_eq!(p("console"), json!("console"));
        assert_eq!(p("inf"), json!("inf"));
        assert_eq!(p("'1e-6'"), json!("1e-6"));
        assert_eq!(p(r#""a \"b\"""#), json!("a \"b\""));
        assert_eq!(p(""), json!(""));
        assert_eq!(
            p("checkpoints/${trainer.project_name}/x"),
            json!("checkpoints/${trainer.project_name}/x")
        );
        assert_eq!(parse_value("2024", true).unwrap(), json!("2024"));
        assert_eq!(parse_value("'quoted'", true).unwrap(), json!("quoted"));
    }

    #[test]
    fn lists_and_dicts() {
        assert_eq!(p("[console,file]"), json!(["console", "file"]));
        assert_eq!(p("[ 'a b' , 2, [true] ]"), json!(["a b", 2, [true]]));
        assert_eq!(p("[]"), json!([]));
        assert_eq!(
            p("{project: x, 'tags': [1, 2]}"),
            json!({"project": "x", "tags": [1, 2]})
        );
        assert_eq!(p("[${a.b},c]"), json!(["${a.b}", "c"]));
        assert!(
            parse_value("[a,b", false)
                .unwrap_err()
                .contains("expected `,` or `]`")
        );
        assert!(
            parse_value("'open", false)
                .unwrap_err()
                .contains("unterminated")
        );
        assert!(
            parse_value("[a] x", false)
                .unwrap_err()
                .contains("unexpected")
        );
    }

    #[test]
    fn keys() {
        let set = |arg| match parse_override(arg).unwrap() {
            Override::Set(path, value) => (path.join("."), value.to_owned()),
            other => panic!("{arg}: {other:?}"),
        };
        assert_eq!(set("a.b_c=1"), ("a.b_c".into(), "1".into()));
        assert_eq!(set("a=x=y").1, "x=y");
        assert_eq!(set("+a.b=1"), ("a.b".into(), "1".into()));
        assert_eq!(set("++a.b=[x]"), ("a.b".into(), "[x]".into()));
        assert_eq!(
            parse_override("~a.b").unwrap(),
            Override::Delete(vec!["a".into(), "b".into()])
        );
        assert!(
            parse_override("~a.b=1")
                .unwrap_err()
                .contains("delete with `~key`")
        );
        for bad in ["a..b=1", "novalue", "+++a=1", "~", "~a.", "+=1"] {
            assert!(parse_override(bad).is_err(), "{bad}");
        }
    }
}
