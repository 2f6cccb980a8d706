//! The Python program that runs a call-based (LeetCode-style, `fn_name`) problem's function on
//! one test case, behaving as verl's wrapper in `sandbox_fusion/utils.py` does: the same names
//! are in scope for the solution, the arguments are one JSON value per stdin line, the function
//! is a global or a method of `Solution()`, and the result is printed as JSON (dict, list,
//! tuple, bool, None) or with `str`. A failure to find or call the function is written to
//! stderr and the program still exits 0 — verl's wrapper does the same, so such a case counts as
//! a wrong answer rather than a runtime error, as in verl.

/// Modules whose public names come into scope before the solution, in this order, followed by
/// `builtins` and `typing`: later ones win, so `builtins` restores `pow`, `open` and `exit` over
/// those of `math`, `io` and `sys`. Solutions that use `Counter`, `sqrt` or `List` without
/// importing them work, as under verl. Then each is bound by its own name (`time` stays
/// `datetime.time`, as under verl).
const MODULES: [&str; 16] = [
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
];

fn python_tuple(names: &[&str]) -> String {
    names.iter().map(|n| format!("{n:?}, ")).collect()
}

/// The program: the scope set-up, `solution` verbatim, then the call of `fn_name`.
pub fn call_based(solution: &str, fn_name: &str) -> String {
    // A JSON string is a Python string literal.
    let name = serde_json::Value::from(fn_name).to_string();
    format!(
        r#"import traceback
import importlib as _importlib
for _module_name in ({modules}"builtins", "typing"):
    _module = _importlib.import_module(_module_name)
    _public = getattr(_module, "__all__", None)
    if _public is None:
        _public = [_n for _n in vars(_module) if not _n.startswith("_")]
    globals().update({{_n: getattr(_module, _n) for _n in _public}})
for _module_name in ({modules}):
    globals()[_module_name] = _importlib.import_module(_module_name)
del _importlib, _module_name, _module, _public

{solution}

def _verl_core_call(_name):
    _text = sys.stdin.read()
    _args = []
    if _text.strip():
        try:
            _args = [json.loads(_line) for _line in _text.split("\n")]
        except json.JSONDecodeError as _e:
            sys.stderr.write(f"driver: stdin is not one JSON argument per line: {{_e}}\n")
            return
    try:
        _scope = globals()
        _fn = None
        if _name in _scope:
            _fn = _scope[_name]
        elif "Solution" in _scope:
            _fn = getattr(_scope["Solution"](), _name)
        if not _fn:
            sys.stderr.write(f"driver: no function or Solution method {{_name!r}}\n")
            return
        _result = _fn(*_args)
    except Exception:
        sys.stderr.write(traceback.format_exc())
        return
    if _result is None or isinstance(_result, (dict, list, tuple, bool)):
        print(json.dumps(_result))
    else:
        print(str(_result))

_verl_core_call({name})
"#,
        modules = python_tuple(&MODULES),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_solution_is_embedded_verbatim_and_the_name_quoted() {
        let program = call_based("def f(x):\n    return x\n", "f\"x");
        assert!(program.contains("\ndef f(x):\n    return x\n\n"));
        assert!(
            program.ends_with("_verl_core_call(\"f\\\"x\")\n"),
            "{program}"
        );
        assert!(program.contains("for _module_name in (\"string\", \"re\", "));
    }
}
