//! OmegaConf-style interpolation in string values, as verl's configs use it:
//! `${trainer.project_name}` (an absolute key path) and `${oc.env:NAME}` / `${oc.env:NAME,default}`.
//! Referenced strings are resolved recursively; cycles and missing keys are errors.

use std::collections::HashMap;

use serde_json::Value;

/// Resolves every string in `root`. `env` answers `oc.env`. Errors name the key and the problem.
pub fn resolve_all(
    root: &mut Value,
    env: &HashMap<String, String>,
) -> Result<(), (String, String)> {
    let snapshot = root.clone();
    walk(root, &mut Vec::new(), &mut |path, s| {
        let key = path.join(".");
        resolve(&snapshot, s, env, &mut vec![key.clone()]).map_err(|e| (key, e))
    })
}

fn walk(
    value: &mut Value,
    path: &mut Vec<String>,
    f: &mut impl FnMut(&[String], &str) -> Result<String, (String, String)>,
) -> Result<(), (String, String)> {
    match value {
        Value::String(s) if s.contains("${") => *s = f(path, s)?,
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                path.push(k.clone());
                walk(v, path, f)?;
                path.pop();
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter_mut().enumerate() {
                path.push(i.to_string());
                walk(v, path, f)?;
                path.pop();
            }
        }
        _ => {}
    }
    Ok(())
}

fn resolve(
    root: &Value,
    text: &str,
    env: &HashMap<String, String>,
    stack: &mut Vec<String>,
) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find('}')
            .ok_or_else(|| format!("unclosed `${{` in `{text}`"))?
            + start;
        let expr = rest[start + 2..end].trim();
        out.push_str(&evaluate(root, expr, env, stack)?);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn evaluate(
    root: &Value,
    expr: &str,
    env: &HashMap<String, String>,
    stack: &mut Vec<String>,
) -> Result<String, String> {
    if let Some(args) = expr.strip_prefix("oc.env:") {
        let (name, default) = match args.split_once(',') {
            Some((n, d)) => (n.trim(), Some(d.trim().trim_matches(['\'', '"']))),
            None => (args.trim(), None),
        };
        return env
            .get(name)
            .cloned()
            .or(default.map(str::to_owned))
            .ok_or_else(|| {
                format!(
                    "environment variable `{name}` is not set and `${{oc.env:…}}` has no default"
                )
            });
    }
    if stack.iter().any(|k| k == expr) {
        return Err(format!(
            "interpolation cycle: {} -> {expr}",
            stack.join(" -> ")
        ));
    }
    let target = expr
        .split('.')
        .try_fold(root, |v, k| v.get(k))
        .ok_or_else(|| format!("`${{{expr}}}` refers to no config key"))?;
    match target {
        Value::String(s) => {
            stack.push(expr.to_owned());
            let resolved = resolve(root, s, env, stack);
            stack.pop();
            resolved
        }
        // OmegaConf renders a null as "None".
        Value::Null => Ok("None".into()),
        Value::Object(_) | Value::Array(_) => {
            Err(format!("`${{{expr}}}` is a section, not a value"))
        }
        other => Ok(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn resolves_references_and_env() {
        let mut v = json!({
            "trainer": {"project_name": "p", "experiment_name": "${trainer.project_name}-e", "steps": 3,
                        "dir": "ckpt/${trainer.project_name}/${trainer.experiment_name}/${trainer.steps}",
                        "home": "${oc.env:HOME_X}/x", "fallback": "${oc.env:NOPE,'d'}"},
        });
        let env = HashMap::from([("HOME_X".to_owned(), "/h".to_owned())]);
        resolve_all(&mut v, &env).unwrap();
        assert_eq!(v["trainer"]["dir"], "ckpt/p/p-e/3");
        assert_eq!(v["trainer"]["home"], "/h/x");
        assert_eq!(v["trainer"]["fallback"], "d");
    }

    #[test]
    fn errors_name_the_key() {
        let mut v = json!({"a": {"x": "${a.y}", "y": "${a.x}"}});
        let (key, err) = resolve_all(&mut v, &HashMap::new()).unwrap_err();
        assert_eq!(key, "a.x");
        assert!(err.contains("cycle"), "{err}");
        let mut v = json!({"a": "${b.c}"});
        assert!(
            resolve_all(&mut v, &HashMap::new())
                .unwrap_err()
                .1
                .contains("refers to no config key")
        );
        let mut v = json!({"a": "${oc.env:UNSET_VAR}"});
        assert!(
            resolve_all(&mut v, &HashMap::new())
                .unwrap_err()
                .1
                .contains("UNSET_VAR")
        );
    }
}
