"""docs/validation.md's check table is generated from the rule table: the file and `RULES` never differ."""

from pipeline.validate import RULES
from pipeline.validate.docs import DOC, main, render, table


def test_docs_table_matches_the_rules():
    text = DOC.read_text()
    assert render(text) == text, "docs/validation.md is stale: run `python -m pipeline.validate.docs`"
    assert main(["--check"]) == 0
    for check_id in RULES:
        assert f"| `{check_id}` |" in text


def test_generator_detects_a_stale_table():
    stale = DOC.read_text().replace("| `keys.pair` |", "| `keys.pairs` |")
    assert render(stale) != stale
    assert table().count("\n") == len(RULES) + 1
