"""Every results file the docs cite by its full name exists under benchmarks/results/: a figure
in the README or the docs points at the JSON (and command) that reproduces it. Names written as
a pattern (`{a,b}` alternatives) need at least one match, as such patterns zip parts (x{2,4} with
tp{2,4}) rather than cross them; names abbreviated from the one before (`...-suffix.json`, a
bare `-suffix.json`, a table's `h200-...` under its column's prefix) or with wildcards are left
to the reader."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", RESULTS / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"`([a-z_]+-h\d00[^`\s]*\.(?:json|png))`")  # scenario-device...: a full name


def _alternatives(name: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", name)
    if match is None:
        return [name]
    return [full for alt in match.group(1).split(",") for full in _alternatives(name[: match.start()] + alt + name[match.end() :])]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_a_doc_names_exists(doc):
    present = {p.name for p in RESULTS.iterdir()}
    missing = []
    for match in CITED.finditer(doc.read_text()):
        name = match.group(1).split("/")[-1]
        if "..." in name or "*" in name or "<" in name:
            continue
        if not any(alt in present for alt in _alternatives(name)):
            missing.append(f"line {doc.read_text()[: match.start()].count(chr(10)) + 1}: {name}")
    assert not missing, f"{doc.name} cites results files that are not in benchmarks/results: {missing}"
