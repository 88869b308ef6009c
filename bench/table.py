"""The three-column markdown table the benches print (measure, value, note), its first column
padded so the table also reads as plain text."""

from __future__ import annotations


def print_rows(rows: list[tuple[str, str, str]], header: tuple[str, str, str] = ("measure", "value", "note"),
               leading_blank: bool = False) -> None:
    width = max(len(r[0]) for r in [header, *rows])
    if leading_blank:
        print()
    print(f"| {header[0]:<{width}} | {header[1]} | {header[2]} |")
    print(f"| {'-' * width} | --- | --- |")
    for name, value, note in rows:
        print(f"| {name:<{width}} | {value} | {note} |")
