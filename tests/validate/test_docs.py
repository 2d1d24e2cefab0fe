"""docs/validation.md's check table is generated from the registry: the file and the registry never differ."""

from pipeline.validate import REGISTRY
from pipeline.validate.docs import DOC, main, render, table


def test_docs_table_matches_the_registry():
    text = DOC.read_text()
    assert render(text) == text, "docs/validation.md is stale: run `python -m pipeline.validate.docs`"
    assert main(["--check"]) == 0
    for check_id in REGISTRY:
        assert f"| `{check_id}` |" in text


def test_generator_detects_a_stale_table():
    stale = DOC.read_text().replace("| `keys.pair` |", "| `keys.pairs` |")
    assert render(stale) != stale
    assert table().count("\n") == len(REGISTRY) + 1
