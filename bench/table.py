"""The markdown table the benches print (by default three columns: measure, value, note), its
first column padded so the table also reads as plain text."""

from __future__ import annotations


def print_rows(rows: list[tuple[str, ...]], header: tuple[str, ...] = ("measure", "value", "note"),
               leading_blank: bool = False) -> None:
    """``rows`` under ``header``, every row as many cells as the header."""
    width = max(len(r[0]) for r in [header, *rows])
    if leading_blank:
        print()
    for row in (header, ("-" * width, *("---",) * (len(header) - 1)), *rows):
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under a header of {len(header)}: {row!r}")
        print(f"| {row[0]:<{width}} | " + " | ".join(row[1:]) + " |")
