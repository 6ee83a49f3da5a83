"""Golden tests for every user-facing diagnostic (DESIGN §3.4).

Each ``tests/golden/diagnostics/<case>.attn`` is a small spec with exactly one
error (cases named ``many_*`` have several, to show that all are reported, in
source order); ``<case>.txt`` holds the exact ``str(err)`` of the AttncError
that ``compile_file`` raises for it, plus a newline.  The path is given
relative to the repository root so the file name in the message is stable.
``pytest --update-golden`` rewrites the .txt files: read every one it changes.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnc.compiler.errors import AttncError, SpecError
from attnc.compiler.lower import compile_file

ROOT = Path(__file__).resolve().parents[2]
CASE_DIR = ROOT / "tests" / "golden" / "diagnostics"
CASES = sorted(CASE_DIR.glob("*.attn"))

# file:line:col: error: message
HEADER = re.compile(r"^(?P<file>[^\s:]+):(?P<line>\d+):(?P<col>\d+): error: (?P<msg>\S.*)$")


def _compile_error(path: Path, monkeypatch) -> AttncError:
    monkeypatch.chdir(ROOT)
    rel = path.relative_to(ROOT).as_posix()
    try:
        compile_file(rel)
    except AttncError as err:
        return err
    pytest.fail(f"{rel} compiled without error; every diagnostics case must be rejected")


def _parse_report(text: str) -> list[dict]:
    """Split a printed report into diagnostics: header, source line, caret line, notes."""
    lines = text.split("\n")
    out: list[dict] = []
    i = 0
    while i < len(lines):
        m = HEADER.match(lines[i])
        assert m, f"expected 'file:line:col: error: ...', got {lines[i]!r} in:\n{text}"
        assert i + 2 < len(lines), f"diagnostic without source and caret lines:\n{text}"
        source_line, caret_line = lines[i + 1], lines[i + 2]
        notes = []
        i += 3
        while i < len(lines) and lines[i].startswith("note: "):
            notes.append(lines[i][len("note: "):])
            i += 1
        out.append({**m.groupdict(), "source": source_line, "carets": caret_line, "notes": notes})
    return out


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_diagnostic(path: Path, golden, monkeypatch):
    err = _compile_error(path, monkeypatch)
    assert isinstance(err, SpecError), f"{type(err).__name__} is not a SpecError"
    text = str(err)
    rel = path.relative_to(ROOT).as_posix()
    src_lines = path.read_text().split("\n")

    diags = _parse_report(text)
    assert len(diags) == len(err.diagnostics)
    if not path.stem.startswith("many_"):
        assert len(diags) == 1, f"{rel} should have exactly one error, got:\n{text}"
    for d in diags:
        line, col = int(d["line"]), int(d["col"])
        assert d["file"] == rel
        assert 1 <= line <= len(src_lines)
        assert d["source"] == src_lines[line - 1], "the quoted source line is not the reported line"
        assert 1 <= col <= max(1, len(d["source"]))
        carets = d["carets"]
        assert re.fullmatch(r"[ \t]*\^+", carets), f"bad caret line {carets!r}"
        assert carets.index("^") + 1 == col, "the caret column is not the reported column"
        assert len(carets) <= max(len(d["source"]), col), "carets run past the end of the line"
        assert not d["msg"].endswith((".", " ")), d["msg"]

    positions = [(int(d["line"]), int(d["col"])) for d in diags]
    assert positions == sorted(positions), "diagnostics are not in source order"

    golden(f"diagnostics/{path.stem}.txt", text + "\n")


def test_every_golden_has_a_case():
    """No stale expected outputs: each .txt belongs to an .attn case."""
    stems = {p.stem for p in CASES}
    stale = sorted(p.name for p in CASE_DIR.glob("*.txt") if p.stem not in stems)
    assert not stale, f"golden files without a case: {stale}"


def test_many_errors_are_all_reported():
    cases = [p for p in CASES if p.stem.startswith("many_")]
    assert cases, "there must be a case with several errors"
    for p in cases:
        text = p.read_text()
        # the case says how many errors it expects in a leading comment: "# errors: N"
        m = re.search(r"#\s*errors:\s*(\d+)", text)
        assert m, f"{p.name} must say '# errors: N'"
        try:
            compile_file(p)
        except AttncError as err:
            assert len(err.diagnostics) == int(m.group(1)), str(err)
        else:
            pytest.fail(f"{p.name} compiled")


@pytest.mark.parametrize("name", ["match", "type"])
def test_soft_keywords_are_valid_names(name):
    """Soft keywords are ordinary identifiers in Python, so they are fine tensor names
    (and whether a name is accepted must not depend on the Python version).  `case` is one too,
    but a call passes an option by that name (the AHBM kernel's case=), so it is reserved."""
    from attnc.compiler.lower import compile_spec
    program = compile_spec(f"attention t {{ heads = 8  head_dim = 64  tensor {name}: i32[b]\n"
                           f"  mask = k < {name}[b] }}")
    assert [t.name for t in program.tensors] == [name]
