#!/usr/bin/env python3
"""SandboxFusion's `/run_code` schema, extracted from its source, for verl-core's schema checks.

    python3 scripts/reference/sandbox_schema.py SANDBOXFUSION_CHECKOUT [OUT_JSON]

SANDBOXFUSION_CHECKOUT is a local checkout of https://github.com/bytedance/SandboxFusion. The
script reads the pydantic models and enums of `sandbox/server/sandbox_api.py` (RunCodeRequest,
RunCodeResponse, RunStatus) and `sandbox/runners/types.py` (CommandRunResult, CommandRunStatus,
Language) by their syntax tree (nothing of SandboxFusion is imported or run) and writes each
model's fields (name, whether required, the literal default) and each enum's values as JSON
(default: core/rewards/tests/data/sandbox_fusion_schema.json). Standard library only.

The fake server (`scripts/fake_sandbox_fusion.py`) validates requests and shapes answers with
that file, and `core/rewards/tests/sandbox_parity.rs` checks the client's structs against it.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

MODELS = {
    "sandbox/server/sandbox_api.py": ["RunCodeRequest", "RunCodeResponse"],
    "sandbox/runners/types.py": ["CommandRunResult"],
}
ENUMS = {
    "sandbox/server/sandbox_api.py": ["RunStatus"],
    "sandbox/runners/types.py": ["CommandRunStatus"],
}


def literal(node):
    """A default's value when it is a literal (`Field(10, ...)`'s 10); `...` means required."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Field":
        node = node.args[0] if node.args else ast.Constant(value=None)
    value = ast.literal_eval(node)
    return value


def model_fields(cls: ast.ClassDef) -> list:
    fields = []
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        field = {"name": stmt.target.id, "type": ast.unparse(stmt.annotation)}
        if stmt.value is None:
            field["required"] = True
        else:
            default = literal(stmt.value)
            field["required"] = default is Ellipsis
            if default is not Ellipsis:
                field["default"] = default
        fields.append(field)
    return fields


def enum_values(cls: ast.ClassDef) -> list:
    return [ast.literal_eval(s.value) for s in cls.body if isinstance(s, ast.Assign)]


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    root = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) == 3 else (
        Path(__file__).resolve().parents[2] / "core/rewards/tests/data/sandbox_fusion_schema.json")
    schema = {"models": {}, "enums": {}}
    for relpath in sorted(set(MODELS) | set(ENUMS)):
        path = root / relpath
        if not path.is_file():
            sys.exit(f"{root} is not a SandboxFusion checkout: no {relpath}")
        tree = ast.parse(path.read_text())
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        for name in MODELS.get(relpath, []):
            schema["models"][name] = model_fields(classes[name])
        for name in ENUMS.get(relpath, []):
            schema["enums"][name] = enum_values(classes[name])
        for node in tree.body:
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "Language":
                # `Language = Literal[...]` is an annotated assignment in some versions.
                node = ast.Assign(targets=[node.target], value=node.value)
            if (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "Language"):
                schema["enums"]["Language"] = [ast.literal_eval(e) for e in node.value.slice.elts]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    schema = {"source": "https://github.com/bytedance/SandboxFusion", "commit": commit, **schema}
    out.write_text(json.dumps(schema, indent=1) + "\n")
    print(f"wrote {out}: {', '.join(schema['models'])}; {', '.join(schema['enums'])}")


if __name__ == "__main__":
    main()
