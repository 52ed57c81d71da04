"""Every "design §N" the code cites is a section of docs/design.md, and nothing cites a document
outside the repository."""

from __future__ import annotations

import itertools
import json
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


def _doc_table(text: str, after: int) -> list[str]:
    """The lines of the first markdown table in ``text`` after position ``after``."""
    lines = text[after:].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    stop = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [line.rstrip() for line in lines[start:stop]]


def test_design_worked_tables_are_what_the_code_prints():
    """Design §3.3's table is ``tawpipe plan``'s output row for row; §3.4's WeiPipe rows are the
    same rows of the code's table."""
    from tawpipe.plan import Topology, build_plan

    text = (ROOT / "docs" / "design.md").read_text()
    s33, s34, s4 = text.index("\n### 3.3 "), text.index("\n### 3.4 "), text.index("\n## 4. ")
    cmd = "`tawpipe plan --nodes 2 --per-node 2 --layers 4 --micro-batches 2` prints:"
    at = text.index(cmd, s33, s34)
    doc = _doc_table(text, at)
    code = build_plan(Topology(2, 2), 4, 2).table().splitlines()
    assert len(doc) == len(code), f"design §3.3 has {len(doc)} table lines, the code prints {len(code)}"
    for d, c in zip(doc, code):
        assert d == c, f"design §3.3 row differs:\n doc:  {d}\n code: {c}"

    shown = re.compile(r"rows ([\d, ]+) and (\d+) of (\d+):").search(text, s34, s4)
    assert shown, "design §3.4 no longer says which rows it shows: the pattern is wrong"
    doc = _doc_table(text, shown.end())
    code = build_plan(Topology(1, 4), 4, 2, algo="weipipe").table().splitlines()
    assert doc[:2] == code[:2]  # header and rule
    assert len(code) - 2 == int(shown.group(3))
    step = lambda line: line.split("|")[1].strip()  # noqa: E731
    code_rows = {step(line): line for line in code[2:]}
    assert [step(d) for d in doc[2:]] == [s.strip() for s in shown.group(1).split(",")] + [shown.group(2)]
    for d in doc[2:]:
        assert d == code_rows[step(d)], f"design §3.4 step {step(d)} differs:\n doc:  {d}\n code: {code_rows[step(d)]}"


def test_design_section_1_names_every_module_and_package():
    """Design §1's layer table is the map of the tree: every package and module is in it, and so is
    every package in README's table."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design[design.index("## 1. Overview"):design.index("## 2. Notation")]
    rows = {name: line for line in section.splitlines() if re.match(r"\| \d+ \|", line)
            for name in re.findall(r"`([^`]+)`", line.split("|")[2])}
    package = ROOT / "tawpipe"
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        row = rows.get(rel.parts[0] + ("/" if len(rel.parts) > 1 else ""))
        assert row is not None, f"design §1 has no row for {rel.parts[0]}"
        if len(rel.parts) > 1:  # a module of a package: named in its package's row
            named = f"`{rel.parts[-2]}/`" if rel.name == "__init__.py" else f"`{rel.name}`"  # a package by its folder
            assert named in row, f"design §1 does not name {rel}"
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| layer | where | what it does |"):readme.index("## The schedule, printed")]
    for sub in sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file()):
        assert f"tawpipe/{sub}/" in table or f"`{sub}/`" in table, f"README's table lacks tawpipe/{sub}/"


def test_readme_says_what_fits_where_as_the_committed_map_does():
    """README's "What fits where" table is the committed map's ``largest_fits`` (``map.json``),
    row by row in the map's order of methods: the README copies the simulator's figures, and a map
    played again must bring the table along."""
    from tawpipe.sim.atlas import METHODS

    fits = json.loads((ROOT / "benchmarks" / "results" / "sim_map" / "map.json").read_text())["stats"]["largest_fits"]
    after = (ROOT / "README.md").read_text().split("**What fits where.**", 1)[1].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("|"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), after[start:]))
    header, rows = [c.strip() for c in table[0].strip("|").split("|")], table[2:]
    models = [m.lower() for m in header[1:]]
    assert models == list(fits), f"README's columns {header[1:]} are not the map's models {list(fits)}"
    assert len(rows) == len(METHODS), f"README's table has {len(rows)} rows, the map {len(METHODS)} methods"
    for method, row in zip(METHODS, rows):
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        want = ["none" if fits[m][method] is None else f"{fits[m][method] // 1024}k" for m in models]
        assert cells == want, f"README's row {row!r} is not the map's {method}: {want}"
