"""The progress bar of the benchmarks (tqdm, on rank 0's stderr).

It is drawn only on a terminal: in a log or a pipe tqdm's carriage returns pile up into one
unreadable line (the intro line printed before the run says what is being timed instead). Its
description is cut or padded to a fixed width, so that the bar does not jump from case to case,
and it is cleared when done, so that the table follows on a clean line.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

DESCRIPTION_WIDTH = 36
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit}s [{elapsed}<{remaining}]"


def progress_bar(total: int, unit: str, show: bool, file=None) -> tqdm:
    """A bar of `total` steps; disabled unless `show` (rank 0) and `file` (stderr) is a terminal."""
    file = sys.stderr if file is None else file
    on_terminal = bool(getattr(file, "isatty", lambda: False)())
    return tqdm(
        total=total,
        desc="starting".ljust(DESCRIPTION_WIDTH),
        unit=unit,
        file=file,
        disable=not (show and on_terminal),
        leave=False,
        dynamic_ncols=True,
        bar_format=BAR_FORMAT,
    )


def describe(bar: tqdm, text: str) -> None:
    """Set the bar's description, cut or padded to DESCRIPTION_WIDTH characters."""
    if len(text) > DESCRIPTION_WIDTH:
        text = text[: DESCRIPTION_WIDTH - 3] + "..."
    bar.set_description_str(text.ljust(DESCRIPTION_WIDTH))
