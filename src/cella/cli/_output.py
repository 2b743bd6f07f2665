"""Shared output helpers: rich on a terminal, JSON with --json."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Column, Table
from rich.text import Text

console = Console(stderr=True)
out = Console()

GAP = 2  # columns between two columns of a listing


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def progress_printer(json_mode: bool) -> Any:
    """Progress lines go to stderr, so --json output on stdout stays clean."""

    def show(line: str) -> None:
        console.print(
            f"[dim]{line}[/dim]" if line.startswith("  ") else f"[cyan]•[/cyan] {line}",
            highlight=False,
            markup=True,
        )

    return show


class Listing:
    """A table of things with ids (`sandbox ls`, `snapshot ls`...), fitted to the terminal.

    Id columns are never wrapped or cut: ids are there to be copied. When the terminal is too
    narrow for every column, the `give_way` columns wrap first, in the order given, down to
    their floor width; then the other columns wrap at spaces (never inside a word); then the
    `give_way` columns go down to half their floor; what is still too wide after that, rich
    folds, widest column first. Cells are rich markup.
    """

    def __init__(
        self,
        *headers: str,
        ids: Sequence[str] = ("id",),
        give_way: Mapping[str, int] | None = None,
    ) -> None:
        self.headers = headers
        self.ids = [headers.index(h) for h in ids]
        self.give_way = {headers.index(h): floor for h, floor in (give_way or {}).items()}
        self.rows: list[list[Text]] = []

    def add_row(self, *cells: str) -> None:
        self.rows.append([Text.from_markup(c) for c in cells])

    def _columns(self) -> list[list[Text]]:
        return [[Text(h), *(row[i] for row in self.rows)] for i, h in enumerate(self.headers)]

    def widths(self, available: int) -> list[int]:
        """Each column's width (without the gaps) to fit in `available` cells, if it can."""
        columns = self._columns()
        widths = [max(_longest_line(t) for t in col) for col in columns]
        excess = sum(widths) + GAP * (len(widths) - 1) - available
        at_spaces = [
            (i, max(_longest_word(t) for t in col))
            for i, col in enumerate(columns)
            if i not in self.ids and i not in self.give_way
        ]
        last_resort = [(i, (floor + 1) // 2) for i, floor in self.give_way.items()]
        for i, floor in [*self.give_way.items(), *at_spaces, *last_resort]:
            if excess <= 0:
                break
            cut = min(excess, max(0, widths[i] - floor))
            widths[i] -= cut
            excess -= cut
        return widths

    def table(self, available: int) -> Table:
        widths = self.widths(available)
        columns = [
            Column(header, no_wrap=True, min_width=widths[i])
            if i in self.ids
            else Column(header, max_width=widths[i], overflow="fold")
            for i, header in enumerate(self.headers)
        ]
        table = Table(
            *columns,
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=(0, GAP - 1, 0, 0),
        )
        for row in self.rows:
            table.add_row(*row)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)


def _longest_line(text: Text) -> int:
    return max((Text(line).cell_len for line in text.plain.splitlines()), default=0)


def _longest_word(text: Text) -> int:
    return max((Text(word).cell_len for word in text.plain.split()), default=0)
