"""Chat templates rendered with jinja2 + tokenizers equal transformers' `apply_chat_template`, and the training
template resolves as axolotl resolves it (both libraries are the reference here)."""

import pytest

from pipeline.validate.chat import ChatTokenizer
from pipeline.validate.template import CONVERSATIONS, resolve_axolotl_template


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_rendering_equals_transformers(tiny_base, name, generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_base))
    ours = ChatTokenizer.load(tiny_base)
    messages, tools = CONVERSATIONS[name]
    if generation_prompt:
        messages = messages[: max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool")) + 1]
    kw = dict(tools=tools, add_generation_prompt=generation_prompt, enable_thinking=True)
    want = hf.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.render_ids(ours.template, messages, **kw) == list(
        hf(want, add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize(
    "choice", ["tokenizer_default", "chatml", "qwen3_5", "tokenizer_default_fallback_chatml"]
)
def test_template_resolution_equals_axolotl(tiny_base, choice):
    from axolotl.utils.chat_templates import get_chat_template_from_config
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_base))
    data = {"chat_template": choice, "datasets": [{"path": "x.jsonl", "type": "chat_template"}]}
    want = get_chat_template_from_config(data, data["datasets"][0], hf)
    assert resolve_axolotl_template(data, ChatTokenizer.load(tiny_base).template)[0] == want


def test_special_tokens_and_eos(tiny_base):
    tok = ChatTokenizer.load(tiny_base)
    assert tok.special["eos_token"] == "<|im_end|>" and tok.tokenizer.token_to_id("<|im_end|>") in tok.eos_ids


@pytest.mark.parametrize(
    "text, says",
    [(None, "no such file"), ("a: [", "not valid YAML"), ("just a string", "mapping")],
)
def test_a_bad_training_config_option_is_a_usage_error(tmp_path, text, says):
    """helper-7: a bad --training-config gave six template.* 'could not run' errors (exit 1)."""
    from pipeline.errors import UsageError
    from pipeline.validate import validate_adapter

    tc = tmp_path / "tc.yml"
    if text is not None:
        tc.write_text(text)
    with pytest.raises(UsageError, match=says):
        validate_adapter(tmp_path, None, training_config=tc)


@pytest.mark.parametrize("form", ["dir", "list"])
def test_named_templates_are_the_ones_transformers_picks(tiny_base, tmp_path, form):
    """A tokenizer with a "tool_use" template (additional_chat_templates/ or tokenizer_config's list): with tools
    transformers (and vLLM, which asks it with the request's tools) renders through it, without tools the default."""
    import shutil

    from transformers import AutoTokenizer

    from tests.validate.cases import _tool_use_template

    d = shutil.copytree(tiny_base, tmp_path / "tok")
    _tool_use_template(form)(d)
    hf, ours = AutoTokenizer.from_pretrained(str(d)), ChatTokenizer.load(d)
    for name in ("tool_call", "plain"):
        messages, tools = CONVERSATIONS[name]
        want = hf.apply_chat_template(messages, tools=tools, tokenize=False, enable_thinking=True)
        got = ours.render_ids(ours.template_for(tools), messages, tools, enable_thinking=True)
        assert got == list(hf(want, add_special_tokens=False)["input_ids"]), name
    assert ours.template_for(CONVERSATIONS["tool_call"][1]) != ours.template


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_render_hf_equals_transformers_and_is_bounded(tiny_base, tmp_path, name):
    """`--behaviour` and `canary` rendered an adapter's template with transformers in their own
    process (no bounds: tests/artifacts/test_templates.py); `render_hf` renders the same text in the
    bounded worker."""
    import shutil

    from transformers import AutoTokenizer

    from pipeline.artifacts.templates import TemplateRenderError
    from pipeline.validate.chat import render_hf

    hf = AutoTokenizer.from_pretrained(str(tiny_base))
    messages, tools = CONVERSATIONS[name]
    for gen in (False, True):
        want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
        assert render_hf(hf, messages, tools, add_generation_prompt=gen) == want
    if name != "plain":
        return
    d = tmp_path / "tok"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_base / f, d / f)
    (d / "chat_template.jinja").write_text("{{ 'x' * 3000000000 }}")
    hostile = AutoTokenizer.from_pretrained(str(d))
    with pytest.raises(TemplateRenderError, match="needs more than 1024 MiB"):
        render_hf(hostile, messages)
