"""The one catalogue of finding ids (issue 25 'Also'): every id the code reports is declared with its severity
and doc line, every declaration is reported somewhere, --allow accepts any declared id, the docs are generated."""

from __future__ import annotations

import ast
import re

import pytest

from pipeline.validate import validate_adapter
from pipeline.validate.catalogue import DECLARED, catalogue
from tests.support.helpers import REPO

ID = re.compile(r"^(dataset|fleet|canary)\.[a-z_]+$")
# Strings of that shape that are no finding id: MLflow tag names and config fields of the canary record.
NOT_FINDINGS = {
    "canary.report",
    "canary.min_speed_ratio",
    "canary.min_acceptance_ratio",
    "canary.min_effect_retention",
}


def _reported() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for p in (REPO / "pipeline").rglob("*.py"):
        if p.parent.name == "validate":
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and ID.match(n.value):
                out.setdefault(n.value, set()).add(str(p.relative_to(REPO)))
    return {k: v for k, v in out.items() if k not in NOT_FINDINGS}


def test_every_reported_id_is_declared_and_every_declared_id_reported():
    reported, declared = _reported(), {e.id for e in DECLARED}
    assert sorted(set(reported) - declared) == [], "declare them in pipeline/validate/catalogue.py"
    assert sorted(declared - set(reported)) == [], "a declaration nothing reports"


def test_catalogue_holds_the_rules_and_the_declared_ids_once():
    cat = catalogue()
    assert {"keys.shape", "config.rank", "dataset.overlap", "fleet.hung", "canary.speed"} <= set(cat)
    assert all(e.severity in ("error", "warning", "info") and e.doc for e in cat.values())


@pytest.mark.parametrize("allowed", ["fleet.hung", "dataset.duplicate", "canary.speed", "keys.rank"])
def test_allow_accepts_any_declared_id(allowed):
    from pipeline.train.config import ALLOWABLE

    assert allowed in ALLOWABLE


def test_an_allowed_error_is_kept_as_info_and_recorded(tmp_path, tiny_base):
    from tests.support.helpers import peft_adapter
    from tests.validate.cases import edit_config

    d = peft_adapter(tiny_base, tmp_path / "a")
    edit_config(d, r=16)  # keys.rank: tensors are r=8
    assert not validate_adapter(d, tiny_base).passed
    rep = validate_adapter(d, tiny_base, allow={"keys.rank"})
    f = next(c for c in rep.checks if c.id == "keys.rank")
    assert rep.passed and f.severity == "info" and f.message.startswith("allowed by --allow keys.rank")
    assert rep.bound["allowed"] == ["keys.rank"]


def test_docs_tables_are_generated_from_the_catalogue():
    from pipeline.validate import docs

    text = (REPO / "docs" / "validation.md").read_text()
    assert docs.render(text) == text, "run python -m pipeline.validate.docs"
    for e in DECLARED:
        assert f"| `{e.id}` |" in text
