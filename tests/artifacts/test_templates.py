"""Chat templates run within bounds (a sibling of issue 30 kind 2: a parser without bounds is one kind of
program without bounds, and a chat template is a program from an untrusted adapter directory).

Before: `pipeline validate` (and `register`) rendered an adapter's template in its own process; each of
these took it to 8-23 GB of memory or ran without end. Now each is one clear error within seconds, and
the worker that ran it is replaced.
"""

from __future__ import annotations

import shutil
import time

import pytest

from pipeline.artifacts import templates
from pipeline.artifacts.templates import TemplateRenderError

HUGE_VALUE = "{{ 'x' * 3000000000 }}"
DOUBLING = (
    "{% set ns = namespace(x=[1]) %}{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}{% endfor %}"
    "{{ ns.x | length }}"
)
ENDLESS_OUTPUT = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
ENDLESS_SILENT = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    "template, says, timeout_s",
    [
        (HUGE_VALUE, "needs more than 1024 MiB", 10),
        (DOUBLING, "needs more than 1024 MiB", 10),
        (ENDLESS_OUTPUT, "renders more than 1048576 characters", 10),
        (ENDLESS_SILENT, "did not render within 1 s", 1),
    ],
    ids=["huge-value", "doubling", "endless-output", "endless-silent"],
)
def test_a_template_without_bounds_is_an_error(template, says, timeout_s):
    t0 = time.monotonic()
    with pytest.raises(TemplateRenderError, match=says) as e:
        templates.render(template, {"messages": []}, timeout_s=timeout_s)
    assert e.value.kind == "bounds" and time.monotonic() - t0 < 15
    t0 = time.monotonic()  # the same template again: refused at once, not run (validation renders ~20 times)
    with pytest.raises(TemplateRenderError, match=says):
        templates.render(template, {"messages": []}, timeout_s=timeout_s)
    assert time.monotonic() - t0 < 0.1
    # the next template renders (a new worker where the old one was killed)
    assert templates.render("{{ messages | length }}", {"messages": [1, 2]}) == "2"


def test_template_errors_keep_jinja_s_type_and_message():
    with pytest.raises(TemplateRenderError, match=r"TemplateSyntaxError: Expected an expression") as e:
        templates.render("{{ }}", {})
    assert e.value.kind == "TemplateSyntaxError"
    with pytest.raises(TemplateRenderError, match=r"TemplateError: no system role"):
        templates.render("{{ raise_exception('no system role') }}", {})
    # the sandbox still holds: no attribute escape
    with pytest.raises(TemplateRenderError, match="SecurityError"):
        templates.render("{{ ''.__class__.__mro__[1].__subclasses__() }}", {})


def test_validate_reports_a_hostile_template_in_seconds(tiny_base, tmp_path):
    """End to end: an adapter shipping a template that doubles a list until memory runs out."""
    from pipeline.validate import validate_adapter
    from tests.support.helpers import peft_adapter

    d = peft_adapter(tiny_base, tmp_path / "a")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_base / f, d / f)
    (d / "chat_template.jinja").write_text(DOUBLING)
    t0 = time.monotonic()
    rep = validate_adapter(d, tiny_base)
    assert time.monotonic() - t0 < 30
    msgs = [f.message for f in rep.findings if f.id == "template.render"]
    assert msgs and all("needs more than 1024 MiB" in m for m in msgs), rep.findings
    assert not rep.passed
