#!/usr/bin/env python3
"""Checks the relative links of README.md and the book (docs/src/**/*.md).

For every relative link (inline `[text](target)`, images, and reference definitions
`[name]: target`), outside code blocks and code spans:
  - the target file or directory exists, relative to the linking file;
  - a `#anchor` names a heading of the target (or of the linking file, for `#anchor` alone),
    with the ids mdBook and GitHub give headings: lowercase, punctuation dropped except `-` and
    `_`, each whitespace character a `-`, repeated ids suffixed `-1`, `-2`, ...
And for the book: every chapter in docs/src is listed in SUMMARY.md, and every SUMMARY entry
exists. A repository path cited in a code span (`core/algo/src/kl.rs`, `plugins/vllm/`: a span
starting with one of the repository's top-level directories) must exist too, so that moved files
leave no stale citation behind.

Prints `file:line: link -> reason` for each problem and exits 1; exits 0 when all is well.
Standard library only.  Usage: python3 scripts/check-docs-links.py [REPO_ROOT]
"""

import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# A code span: a run of backticks, then anything up to the same run, within one paragraph.
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
# Inline link or image: `](target)` or `](<target>)`, with an optional title.
INLINE = re.compile(r"\]\(\s*(<[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>\n]*>|\S+)", re.M)
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
HTML_ID = re.compile(r"<[a-zA-Z][^>]*\s(?:id|name)=[\"']([^\"']+)[\"']")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def mask_fences(text):
    """The text with fenced code blocks blanked (newlines kept, so lines still count)."""
    lines = text.split("\n")
    fence = None
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            lines[i] = ""
        elif m:
            fence = m.group(1)
            lines[i] = ""
    return "\n".join(lines)


def mask_code(text):
    """The text with fenced blocks and code spans blanked (newlines kept, so lines still count)."""
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), mask_fences(text))


def heading_text(raw):
    """A heading's rendered text: code spans kept without their backticks, links as their text,
    HTML tags dropped."""
    raw = re.sub(r"(`+)(.+?)\1", lambda m: m.group(2).strip(), raw)
    raw = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    raw = re.sub(r"<[^>]+>", "", raw)
    return raw


def slug(text):
    out = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return "".join(out)


_anchors = {}


def anchors(path):
    """The ids of a Markdown file's headings (and of HTML elements with an id or name)."""
    if path in _anchors:
        return _anchors[path]
    used = set()
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    fence = None
    prev = ""
    for line in lines:
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            prev = ""
            continue
        if m:
            fence = m.group(1)
            prev = ""
            continue
        title = None
        h = ATX.match(line)
        if h:
            title = h.group(2) or ""
        elif SETEXT.match(line) and prev.strip() and not ATX.match(prev):
            # `---` under a paragraph line is a heading; a table's delimiter row has `|`.
            if "|" not in line and not prev.lstrip().startswith(("-", "*", "+", ">", "|")):
                title = prev.strip()
        if title is not None:
            base = slug(heading_text(title))
            ident, n = base, 0
            while ident in used:
                n += 1
                ident = f"{base}-{n}"
            used.add(ident)
        for hid in HTML_ID.findall(line):
            used.add(hid)
        prev = line
    _anchors[path] = used
    return used


def links(path):
    """(line, target) of every link in the file outside code."""
    text = mask_code(path.read_text(encoding="utf-8"))
    found = []
    for rx in (INLINE, REFDEF):
        for m in rx.finditer(text):
            target = m.group(1)
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            found.append((text.count("\n", 0, m.start(1)) + 1, target))
    return sorted(found)


def shown(path):
    """A path as the report shows it: relative to the working directory when under it."""
    path = os.path.normpath(os.path.abspath(path))
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def check_link(path, target):
    """None when the link resolves, else why not."""
    if SCHEME.match(target) or target.startswith("//"):
        return None  # absolute URL: not checked here
    if target == "":
        return "empty link target"
    file_part, _, anchor = target.partition("#")
    if file_part.startswith("/"):
        return "absolute path (links must be relative)"
    dest = path if file_part == "" else (path.parent / unquote(file_part))
    if not dest.exists():
        return f"no such file: {shown(dest)}"
    if anchor:
        if dest.is_dir():
            return "an anchor on a directory"
        if dest.suffix.lower() != ".md":
            return None  # e.g. GitHub's #L10 line anchors: not checked
        if unquote(anchor) not in anchors(dest.resolve()):
            return f"no heading with id #{anchor} in {shown(dest)}"
    return None


def check_summary(src):
    """Problems of the book's table of contents, as (file, line, link, reason)."""
    problems = []
    summary = src / "SUMMARY.md"
    if not summary.exists():
        return [(summary, 1, "SUMMARY.md", "the book has no SUMMARY.md")]
    listed = set()
    for line, target in links(summary):
        file_part = target.partition("#")[0]
        if SCHEME.match(target):
            continue
        if file_part == "":
            problems.append((summary, line, target, "a draft chapter (no file)"))
            continue
        listed.add((src / unquote(file_part)).resolve())
    for chapter in sorted(src.rglob("*.md")):
        if chapter.name == "SUMMARY.md":
            continue
        if chapter.resolve() not in listed:
            problems.append((chapter, 1, chapter.relative_to(src).as_posix(), "chapter not listed in SUMMARY.md"))
    return problems


def cited_paths(path, root):
    """The repository paths cited in `path`'s code spans (outside fenced blocks), as (line, path)."""
    text = mask_fences(path.read_text(encoding="utf-8"))
    tops = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    tops -= {"target"}
    found = []
    for m in CODE_SPAN.finditer(text):
        span = m.group(2).strip()
        if re.search(r"[\s*<>{}$|]", span) or "/" not in span:
            continue
        span = re.sub(r":\d+(-\d+)?$", "", span)  # file:line
        if span.split("/", 1)[0] in tops:
            found.append((text.count("\n", 0, m.start()) + 1, span))
    return found


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    src = root / "docs" / "src"
    files = [root / "README.md"] + sorted(src.rglob("*.md"))
    problems = []
    for path in files:
        if not path.exists():
            problems.append((path, 1, path.name, "missing"))
            continue
        for line, target in links(path):
            reason = check_link(path, target)
            if reason:
                problems.append((path, line, target, reason))
        for line, cited in cited_paths(path, root):
            if not (root / cited).exists():
                problems.append((path, line, cited, "cites a repository path that does not exist"))
    problems += check_summary(src)
    for path, line, target, reason in problems:
        print(f"{shown(path)}:{line}: {target} -> {reason}")
    if problems:
        print(f"check-docs-links: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    count = sum(len(links(p)) for p in files if p.exists())
    print(f"check-docs-links: {count} links in {len(files)} files, all resolve", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
