"""Text for a terminal of a given width: its width, wrapped paragraphs, tables that fit."""

from __future__ import annotations

import shutil
import textwrap

from tabulate import tabulate

# Without a terminal (a pipe, a log), shutil.get_terminal_size reads $COLUMNS, else this.
DEFAULT_WIDTH = 100
MIN_WIDTH = 40
COLUMN_GAP = 2  # tabulate's "simple" format puts two spaces between columns ...
HEADER_PADDING = 2  # ... and makes a column at least its header and two more characters wide


def terminal_width() -> int:
    return max(MIN_WIDTH, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)


def wrap(text: str, width: int, indent: str = "  ") -> str:
    """`text` wrapped to `width`, continuation lines indented; paths and other long words stay whole."""
    return textwrap.fill(text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def fit_table(body: list[list], headers: list[str], width: int, wrappable: dict[int, int]) -> str:
    """A tabulate table ("simple" format) no wider than `width` where it can be: the widest of the
    `wrappable` columns (index -> the narrowest it may get) is narrowed one character at a time
    and its cells wrap onto more lines. Other columns keep their width."""
    body = [[str(cell) for cell in row] for row in body]
    natural = [max([len(h) + HEADER_PADDING] + [len(line) for row in body for line in row[i].splitlines()]) for i, h in enumerate(headers)]
    widths = list(natural)
    while sum(widths) + COLUMN_GAP * (len(widths) - 1) > width:
        narrowable = [i for i, least in wrappable.items() if widths[i] > max(least, len(headers[i]) + HEADER_PADDING)]
        if not narrowable:
            break
        widest = max(narrowable, key=lambda i: widths[i])
        widths[widest] -= 1
    maxcolwidths = [w if w < n else None for w, n in zip(widths, natural)]
    return tabulate(body, headers=headers, disable_numparse=True, maxcolwidths=maxcolwidths)
