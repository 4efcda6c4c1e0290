"""The results files and the docs agree, and each file says how it was measured: every results
file the README or the docs cite by its full name exists (a figure points at the JSON and command
that reproduce it), every JSON there is named somewhere (a reader finds what it measured), and
each records its device, GPU count, date, commit and command. Names written as a pattern (`{a,b}`
alternatives) need one match, as such patterns zip parts (x{2,4} with tp{2,4}) rather than cross
them; abbreviated names (`...-suffix.json`, a bare `-suffix.json`, a table's `h200-...` under its
column's prefix) and wildcards count for naming a file, not for citing one."""

import fnmatch
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", RESULTS / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"`([a-z_]+-h\d00[^`\s]*\.(?:json|png))`")  # scenario-device...: a full name


def _alternatives(name: str) -> list[str]:
    """Every name a pattern of `{a,b}` alternatives stands for (each brace crossed with the others)."""
    match = re.search(r"\{([^{}]*)\}", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    return [full for alt in match.group(1).split(",") for full in _alternatives(head + alt + tail)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_a_doc_names_exists(doc):
    present = {p.name for p in RESULTS.iterdir()}
    text = doc.read_text()
    missing = []
    for match in CITED.finditer(text):
        name = match.group(1).split("/")[-1]
        if "..." in name or "*" in name or "<" in name:
            continue
        if not any(alt in present for alt in _alternatives(name)):
            missing.append(f"line {text.count(chr(10), 0, match.start()) + 1}: {name}")
    assert not missing, f"{doc.name} cites results files that are not in benchmarks/results: {missing}"


def _named(text: str, present: set[str]) -> set[str]:
    """The results files `text` names: in full or as an alternative of a pattern; abbreviated from
    the full name before it (`...-x.json` or `-x.json`: a start of that name, then the ending);
    under a column's `prefix-...`; or by a wildcard."""
    named, before, column = set(), [], ""
    for token in re.findall(r"`([^`\s]+)`", text):
        alternatives = _alternatives(token.split("/")[-1])
        for alt in alternatives:
            if alt.endswith("-..."):
                column = alt[:-3]
            elif alt.startswith("...") or alt.startswith("-"):
                ending = alt.lstrip(".")
                starts = {full[:i] for full in before for i in range(len(full))}
                named |= {start + ending for start in starts if start + ending in present}
            elif "*" in alt or "..." in alt:
                pattern = alt.replace("...", "*")
                named |= {name for name in present
                          if fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(name, column + pattern)}  # fmt: skip
            elif alt in present or column + alt in present:
                named.add(alt if alt in present else column + alt)
        before = [alt for alt in alternatives if alt in present] or before
    return named


def test_every_results_json_is_named_somewhere():
    """Each JSON under benchmarks/results/ is named in the results index or the docs, so that a
    reader finds what it measured and how (its PNG, where it has one, goes with it)."""
    present = {p.name for p in RESULTS.iterdir()}
    named = _named("\n".join(doc.read_text() for doc in DOCS), present)
    unnamed = sorted(name for name in present if name.endswith(".json") and name not in named)
    assert not unnamed, f"results files no doc names (index them in benchmarks/results/README.md): {unnamed}"


def test_every_results_json_says_where_when_and_how_it_was_measured():
    """Each JSON records its device, GPU count, date, commit and the exact command (the project's
    rule for a GPU claim: reproducible by that command)."""
    lacking = []
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        absent = [key for key in ("device", "gpus", "date", "commit", "command") if not record.get(key)]
        if absent:
            lacking.append(f"{path.name}: {absent}")
    assert not lacking, f"results files without their provenance: {lacking}"
