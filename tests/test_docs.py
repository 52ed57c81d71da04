"""Every "design §N" the code cites is a section of docs/design.md, and nothing cites a document
outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("tawpipe", "csrc", "tests", "benchmarks") for p in (ROOT / d).rglob("*")
           if p.suffix in {".py", ".cpp", ".h", ".cu", ".md"}]


def _sections() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    return {m.group(1).rstrip(".") for m in re.finditer(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, re.M)}


def test_every_design_citation_resolves():
    sections = _sections()
    assert {"3.2", "4.2", "5.3", "6.4", "7.3"} <= sections
    cited = {}
    for p in SOURCES:
        for m in re.finditer(r"design §(\d+(?:\.\d+)?)(?:\s*-\s*§(\d+(?:\.\d+)?))?", p.read_text()):
            for ref in filter(None, m.groups()):
                cited.setdefault(ref, []).append(p.relative_to(ROOT).as_posix())
    assert cited, "no citations found: the pattern is wrong"
    missing = {ref: where for ref, where in cited.items() if ref not in sections}
    assert not missing, f"cited sections missing from docs/design.md: {missing}"


def test_no_citations_of_outside_documents():
    for p in SOURCES:
        for line in p.read_text().splitlines():
            assert not re.search(r"\bspec\s*§", line, re.I), f"{p}: {line.strip()}"


def test_readme_snippets_are_copies_of_tested_examples():
    """A README code block introduced by 'From [`examples/X`]' is a verbatim excerpt of X, which
    tests/test_examples.py runs: the snippet cannot rot while the example passes."""
    readme = (ROOT / "README.md").read_text()
    found = re.findall(r"From \[`(examples/[\w./]+)`\].*?\n```python\n(.*?)```", readme, re.S)
    assert found, "no example snippet found in README.md: the pattern is wrong"
    for path, block in found:
        for piece in block.strip().split("\n\n\n"):  # excerpts: whole top-level definitions
            assert piece in (ROOT / path).read_text(), f"README snippet differs from {path}: {piece[:80]}"
    # the quick start: exactly the two commands CI and newcomers run
    quick = re.search(r"## Quick start.*?```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert [line.split("#")[0].strip() for line in quick] == ["bash install.sh && tawpipe train",
                                                              "python3 -m pytest -q"]
