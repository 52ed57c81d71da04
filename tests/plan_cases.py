"""Helpers shared by the plan tests (test_schedule, test_tables): markdown tables as data."""

from __future__ import annotations


def parse_table(md: str) -> tuple[list[str], dict[str, list[str]]]:
    """Header cells and {first cell: other cells} of a markdown table."""
    rows = [line.strip() for line in md.strip().splitlines() if line.strip().startswith("|")]

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    return cells(rows[0]), {c[0]: c[1:] for c in map(cells, rows[2:])}
