"""docs/results.md is generated from benchmarks/results/*.json and the README quotes it: regenerating reproduces the
committed page, every number of the README's result tables is on that page, and the README's recipe table is the
recipe registry's."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADLINES = ("Quantization accuracy", "Decode speed", "Prefill", "Memory", "Tensor parallelism", "Serving")


def _make_results():
    spec = importlib.util.spec_from_file_location("make_results", ROOT / "benchmarks" / "make_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of ``text``: rows of cells, header and separator rows left out."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            tables.append([r for r in rows[1:] if not set("".join(r)) <= set("-: ")])
            rows = []
    return tables


def test_results_page_is_what_the_json_gives():
    mr = _make_results()
    docs = mr.load()
    assert docs and {d["capability"] for d in docs} == set(mr.SECTIONS)
    for d in docs:
        assert d["command"] and d["gpu"] and re.fullmatch(r"\d{4}-\d{2}-\d{2}", d["date"]) and d["commit"]
    assert (ROOT / "docs" / "results.md").read_text(encoding="utf-8") == mr.render(docs), \
        "docs/results.md is out of date: python benchmarks/make_results.py"


def test_every_readme_result_is_on_the_results_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    results = readme.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    sections = re.split(r"\n### ", results)[1:]
    assert [s.splitlines()[0].strip() for s in sections] == list(HEADLINES)
    checked = 0
    for section in sections:
        for table in _tables(section):
            for row in table:
                for cell in row[1:]:  # the first column names the row
                    if cell.startswith("`") or re.search(r"[a-z]{3}", cell.replace("x", "")):
                        continue  # a label (recipe, implementation, model), not a measurement
                    for number in re.findall(r"\d+(?:\.\d+)?", cell):
                        assert re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", page), (number, row)
                        checked += 1
    assert checked > 100


def test_readme_recipe_table_is_the_registry():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert _make_results().recipes_table() in readme, "python benchmarks/make_results.py --recipes"


def test_readme_speaks_of_the_product_only():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 400
    assert not re.search(r"\b(session|sessions|issue \d+|helper|attempt)\b", readme, re.I)
    dates = re.findall(r"\d{4}-\d{2}-\d{2}", readme)
    assert len(dates) == readme.count("measured on 20") + readme.count("measured on\n20"), dates
