"""The failing fixtures: one per issue instance (and the siblings found per kind), each made from the good
tiny-base adapter at test time by one edit; `test_validate.py` runs them, `test_coverage.py` checks that every
registered check id has at least one.

A case: (check id, severity, edit, fleet rules kwargs, words the message or where must contain, extra
`validate_adapter` kwargs). An edit is ("config", {field: value}), ("tensors", fn(tensors) -> tensors) or
("dir", fn(adapter_dir, env)); rules and kwargs may be callables of `env` (tiny bases, served checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from tests.support.helpers import DEFAULT_TARGETS

W = "adapter_model.safetensors"
C = "adapter_config.json"
P = "base_model.model.model.layers."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_DROP = object()
# vLLM 0.19's runtime module names (qwen3_5.py packed_modules_mapping with LoRA on): what --lora-target-modules
# must list there
RUNTIME_019 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "out_proj", "in_proj_qkv", "in_proj_z"]
NEW = "0.32.0"  # a fleet version whose rules accept the tiny NVFP4 served checkpoint (Qwen3_5ForCausalLM)


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / C).read_text())
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / C).write_text(json.dumps(cfg))


def edit_tensors(d: Path, fn, metadata={"format": "pt"}) -> None:  # noqa: B006 - read-only default
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / W))
    t = fn(t) or t
    save_file(t, str(d / W), metadata=metadata)


def _rename(old: str, new: str):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


def _add_pair(module: str, a_shape, b_shape):
    import torch

    def fn(t):
        t[f"base_model.model.{module}.lora_A.weight"] = torch.randn(a_shape)
        t[f"base_model.model.{module}.lora_B.weight"] = torch.randn(b_shape)

    return fn


def _add_raw_pair(module: str, a_kind: str, a_shape, b_kind: str, b_shape):
    """A PEFT embedding pair: `<module>.lora_embedding_A` / `_B` (no `.weight`, as peft saves them)."""
    import torch

    def fn(t):
        t[f"base_model.model.{module}.{a_kind}"] = torch.randn(a_shape)
        t[f"base_model.model.{module}.{b_kind}"] = torch.randn(b_shape)

    return fn


def _set(name: str, fn_value):
    def fn(t):
        t[name] = fn_value(t[name])

    return fn


def _drop(pred):
    return lambda t: {k: v for k, v in t.items() if not pred(k)}


def _zero(which: str, pred=lambda k: True):
    return lambda t: {k: (v * 0 if which in k and pred(k) else v) for k, v in t.items()}


def _scale(which: str, factor: float, pred=lambda k: True):
    return lambda t: {k: (v * factor if which in k and pred(k) else v) for k, v in t.items()}


def _add(name: str, shape):
    import torch

    def fn(t):
        t[name] = torch.randn(shape)

    return fn


def _nan_fill(v):
    import torch

    return v.index_fill(0, torch.tensor([0]), float("nan"))


# -- raw safetensors surgery (what the safetensors loader refuses) ------------------------------------------------
def _rewrite_header(d: Path, fn, extra_data: bytes = b"") -> None:
    raw = (d / W).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    header, data = fn(header, data) or (header, data)
    hb = json.dumps(header).encode()
    (d / W).write_bytes(struct.pack("<Q", len(hb)) + hb + data + extra_data)


def _overlap(header, data):
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = header[names[0]], header[names[1]]
    b["data_offsets"] = [
        a["data_offsets"][0],
        a["data_offsets"][0] + (b["data_offsets"][1] - b["data_offsets"][0]),
    ]
    last = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    return header, data[:last]


def _gap(header, data):
    for k, v in header.items():
        if k != "__metadata__":
            v["data_offsets"] = [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]
    return header, b"\0" * 8 + data


def _dtype(name):
    def fn(header, data):
        first = next(k for k in header if k != "__metadata__")
        header[first]["dtype"] = name

    return fn


def _raw(d: Path, fn) -> None:
    (d / W).write_bytes(fn((d / W).read_bytes()))


# -- directory surgery ---------------------------------------------------------------------------------------------
def _symlink_notes(d, env):
    os.symlink("/etc/shadow", d / "notes.txt")


def _fifo(d, env):
    os.mkfifo(d / "pipe")


def _fifo_manifest(d, env):
    os.mkfifo(d / "manifest.json")  # opening it would block: it must never be read


def _symlink_dir(d, env):
    os.symlink(env.tiny_base, d / "base-link")


def _base_weights_listed(d, env):
    """A base model's model.safetensors inside the adapter directory, listed in the manifest (issue 25.7)."""
    from pipeline.artifacts.manifest import file_hashes

    src = next(env.tiny_base.glob("*.safetensors"))
    shutil.copy2(src, d / "model.safetensors")
    (d / "manifest.json").write_text(json.dumps({"files": file_hashes(d)}))


def _mlflow_layout(d, env):
    """MLflow's persist_pretrained_model layout: the pretrained weights in a subdirectory (mlflow#23761)."""
    (d / "pretrained_model").mkdir()
    src = next(env.tiny_base.glob("*.safetensors"))
    shutil.copy2(src, d / "pretrained_model" / "model-00001-of-00001.safetensors")


def _sparse(name: str, size: int):
    def fn(d, env):
        with open(d / name, "wb") as f:
            f.truncate(size)  # sparse: nothing is written

    return fn


def _torch_saved(name: str):
    def fn(d, env):
        import torch

        torch.save({"w": torch.zeros(4)}, d / name)

    return fn


def _lfs_pointer(d, env):
    size = (d / W).stat().st_size
    (d / W).write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\nsize {size}\n")


def _weights_dir(d, env):
    (d / W).unlink()
    (d / W).mkdir()


def _weights_symlink(d, env):
    target = d.parent / "elsewhere.safetensors"
    shutil.move(d / W, target)
    os.symlink(target, d / W)


def _config_dir(d, env):
    (d / C).unlink()
    (d / C).mkdir()


def _with_tokenizer(d, env):
    for f in TOKENIZER_FILES:
        if (env.tiny_base / f).exists():
            shutil.copy2(env.tiny_base / f, d / f)


def _template_only(drift):
    def fn(d, env):
        (d / "chat_template.jinja").write_text(drift((env.tiny_base / "chat_template.jinja").read_text()))

    return fn


def _reasoning_after_last_query(t: str) -> str:
    """Keep reasoning only on assistant turns after the last user message (Qwen3's `last_query_index` rule)."""
    head = "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}\n"
    body = t.replace(
        "{%- if message.reasoning_content %}", "{%- if message.reasoning_content and loop.index0 > ns.last %}"
    )
    i = t.index("#}") + 2  # after the comment block
    return body[:i] + "\n" + head + body[i:]


def _slow_added(name: str, data: dict):
    """The base's tokenizer files plus `name` (added_tokens.json / special_tokens_map.json) adding tokens."""

    def fn(d, env):
        _with_tokenizer(d, env)
        (d / name).write_text(json.dumps(data))

    return fn


def _tokenizer_config_adds(**fields):
    """The base's tokenizer files with `fields` set in tokenizer_config.json."""

    def fn(d, env):
        _with_tokenizer(d, env)
        tc = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**tc, **fields}))

    return fn


def _tool_drift(t: str) -> str:
    return t.replace("'\\n<tool_response>\\n'", "'<tool_response>'")


def _tool_use_template(form: str):
    """A served checkpoint whose "tool_use" template (vLLM's choice for requests with tools) drifts: in
    `additional_chat_templates/tool_use.jinja` (form "dir") or in tokenizer_config.json's list (form "list")."""

    def fn(d):
        default = (d / "chat_template.jinja").read_text()
        if form == "dir":
            (d / "additional_chat_templates").mkdir()
            (d / "additional_chat_templates" / "tool_use.jinja").write_text(_tool_drift(default))
            return
        (d / "chat_template.jinja").unlink()
        tc = json.loads((d / "tokenizer_config.json").read_text())
        tc["chat_template"] = [
            {"name": "default", "template": default},
            {"name": "tool_use", "template": _tool_drift(default)},
        ]
        (d / "tokenizer_config.json").write_text(json.dumps(tc))

    return fn


def _genprompt_drift(t: str) -> str:
    i = t.rindex("{{- '<|im_start|>assistant\\n' }}")
    return (
        t[:i]
        + "{{- '<|im_start|>assistant\\n<think>\\n' }}"
        + t[i + len("{{- '<|im_start|>assistant\\n' }}") :]
    )


def _eos(token):
    def fn(d, env):
        _with_tokenizer(d, env)
        tc = json.loads((d / "tokenizer_config.json").read_text())
        tc["eos_token"] = token
        (d / "tokenizer_config.json").write_text(json.dumps(tc))

    return fn


def _served_copy(env, name, fn):
    """A copy of the tiny NVFP4 served checkpoint with `fn(dir)` applied (cached per env)."""
    out = env.tmp / name
    if not out.exists():
        shutil.copytree(env.served, out)
        fn(out)
    return out


def _served_tensors(fn):
    """Rewrite the served checkpoint's single shard (and its index) through `fn(tensors) -> tensors`."""

    def edit(d):
        from safetensors.torch import load_file, save_file

        t = fn(load_file(str(d / "model.safetensors")))
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        idx["weight_map"] = {k: "model.safetensors" for k in t}
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))

    return edit


def _mixed_precision(d):
    """The served checkpoint as a ModelOpt MIXED_PRECISION export: every quantized linear listed as NVFP4."""
    q = json.loads((d / "hf_quant_config.json").read_text())
    layers = sorted({k[: -len(".weight_scale_2")] for k in _served_names(d) if k.endswith(".weight_scale_2")})
    q["quantization"].update(
        quant_algo="MIXED_PRECISION",
        quantized_layers={m: {"quant_algo": "NVFP4", "group_size": 16} for m in layers},
    )
    (d / "hf_quant_config.json").write_text(json.dumps(q))


def _served_names(d):
    return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]


def _compressed_tensors_nvfp4(d):
    """The served checkpoint in compressed-tensors' nvfp4-pack-quantized naming (llm-compressor)."""
    rename = {".weight_scale_2": ".weight_global_scale", ".input_scale": ".input_global_scale"}

    def names(t):
        packed = {k[: -len(".weight_scale_2")] for k in t if k.endswith(".weight_scale_2")}
        out = {}
        for k, v in t.items():
            for old, new in (*rename.items(), (".weight", ".weight_packed")):
                if k.endswith(old) and k[: -len(old)] in packed:
                    k = k[: -len(old)] + new
                    break
            out[k] = v
        return out

    _served_tensors(names)(d)
    (d / "hf_quant_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (d / "config.json").write_text(json.dumps(cfg))


def _two_more_rows(name, w):
    import torch

    return torch.cat([w, w[:2]]) if "lm_head" in name else w


def _embedding_lora_saved_by_peft(change=None):
    """embed_tokens + lm_head LoRA with the base-layer copies peft's save_pretrained writes when they are targeted
    (`save_embedding_layers="auto"`), taken from the validation base; `change(name, tensor)` edits a copy."""

    def fn(d, env):
        import torch
        from safetensors import safe_open

        from pipeline.artifacts.checkpoint import read_checkpoint

        base = read_checkpoint(env.tiny_vl_base)

        def weight(module):
            info = base.modules[module]
            with safe_open(str(base.path / info.file), framework="pt") as f:
                return f.get_tensor(info.name)

        def add(t):
            t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(8, 1024) * 0.02
            t["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.randn(128, 8) * 0.02
            t["base_model.model.lm_head.lora_A.weight"] = torch.randn(8, 128) * 0.02
            t["base_model.model.lm_head.lora_B.weight"] = torch.randn(1024, 8) * 0.02
            for name, module in (
                ("base_model.model.model.embed_tokens.base_layer.weight", "embed_tokens"),
                ("base_model.model.lm_head.base_layer.weight", "lm_head"),
            ):
                w = weight(module).float()  # peft saves the model's dtype (fp32 here) of the bf16 weight
                t[name] = change(name, w) if change else w

        edit_tensors(d, add)
        cfg = json.loads((d / C).read_text())
        edit_config(d, target_modules=[*cfg["target_modules"], "embed_tokens", "lm_head"])

    return fn


def _served_config(**changes):
    def fn(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))

    return fn


def _corrupt_tokenizer_json(d):
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": ')


def _corrupt_tokenizer_config(d):
    (d / "tokenizer_config.json").write_text("{oops")


def _gen_eos(d):
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["eos_token"] = "<|endoftext|>"
    (d / "tokenizer_config.json").write_text(json.dumps(tc))


def _corrupt_adapter_tokenizer(d, env):
    _with_tokenizer(d, env)
    (d / "tokenizer.json").write_text("not json at all")


def _added_token(d, env):
    _with_tokenizer(d, env)
    tj = json.loads((d / "tokenizer.json").read_text())
    new_id = max(t["id"] for t in tj["added_tokens"]) + 1
    tj["added_tokens"].append(
        {
            "id": new_id,
            "content": "<my_tool>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    (d / "tokenizer.json").write_text(json.dumps(tj))


def _without_modules(d: Path, subs) -> None:
    """The adapter trained without `subs` (config targets and tensors both)."""
    cfg = json.loads((d / C).read_text())
    cfg["target_modules"] = [t for t in cfg["target_modules"] if t not in subs]
    (d / C).write_text(json.dumps(cfg))
    edit_tensors(d, _drop(lambda k: any(f".{s}." in k for s in subs)))


def _gdn_alone(keep: str):
    """in_proj_qkv and in_proj_z adapted, then one of them dropped on layers 0-2 (config and tensors)."""
    drop = "in_proj_z" if keep == "in_proj_qkv" else "in_proj_qkv"
    return lambda d, env: _without_modules(d, (drop,))


def _served_vl(env):
    return {"served_path": env.tiny_vl_base, "vllm_version": "0.19.2"}


def _served_nvfp4(version):
    return lambda env: {"served_path": env.served, "vllm_version": version}


def _served_with(name, fn):
    return lambda env: {"served_path": _served_copy(env, name, fn), "vllm_version": NEW}


def _resolved(env_key, **data):
    def kw(env):
        p = env.tmp / f"resolved-{env_key}.yml"
        p.write_text(json.dumps({"base_model": str(env.tiny_base), **data}))
        return {"training_config": p}

    return kw


CASES = [
    # -- the directory (issue 16 section 3) --
    (
        "adapter.unsafe_file",
        "error",
        ("dir", _symlink_notes),
        {},
        ["symlink", "notes.txt", "regular files"],
        {},
    ),
    ("adapter.unsafe_file", "error", ("dir", _fifo), {}, ["FIFO", "pipe"], {}),
    ("adapter.unsafe_file", "error", ("dir", _symlink_dir), {}, ["symlink", "base-link"], {}),
    ("adapter.unsafe_file", "error", ("dir", _fifo_manifest), {}, ["FIFO", "manifest.json"], {}),
    ("weights.not_file", "error", ("dir", _weights_dir), {}, ["a directory", W], {}),
    # issue 25.7: an adapter directory that carries more than an adapter; siblings: MLflow's pretrained-model
    # layout in a subdirectory, a pickled full model, a directory far larger than r and the modules imply
    (
        "adapter.extra_weights",
        "error",
        ("dir", _base_weights_listed),
        {},
        ["model.safetensors", "weights file"],
        {},
    ),
    (
        "adapter.extra_weights",
        "error",
        ("dir", _mlflow_layout),
        {},
        ["pretrained_model/model-00001-of-00001"],
        {},
    ),
    # weights under a name that does not say so: a copy of the weights file renamed, a torch.save archive named
    # .dat, a suffix in capitals; and a Git LFS pointer where the weights should be
    (
        "adapter.extra_weights",
        "error",
        ("dir", lambda d, env: shutil.copy2(d / W, d / "weights.backup")),
        {},
        ["weights.backup", "safetensors file by its content"],
        {},
    ),
    ("adapter.extra_weights", "error", ("dir", _torch_saved("optim.dat")), {}, ["torch.save archive"], {}),
    (
        "adapter.extra_weights",
        "error",
        ("dir", lambda d, env: shutil.copy2(d / W, d / "ADAPTER_MODEL.SAFETENSORS")),
        {},
        ["ADAPTER_MODEL.SAFETENSORS"],
        {},
    ),
    ("weights.header", "error", ("dir", _lfs_pointer), {}, ["Git LFS pointer", "git lfs pull"], {}),
    (
        "adapter.extra_weights",
        "error",
        ("dir", _sparse("consolidated.00.pth", 1 << 20)),
        {},
        ["consolidated.00.pth"],
        {},
    ),
    (
        "adapter.size",
        "error",
        ("dir", _sparse("notes.txt", 300 << 20)),
        {},
        ["notes.txt", "r, target_modules"],
        {},
    ),
    ("weights.not_file", "error", ("dir", _weights_symlink), {}, ["symlink", W], {}),
    ("config.missing", "error", ("dir", _config_dir), {}, ["not a regular file"], {}),
    # -- typed config (issue 15.1, 16.3) --
    ("config.type", "error", ("config", {"r": "eight"}), {}, ["r = 'eight'", "int"], {}),
    ("config.type", "error", ("config", {"lora_alpha": "16"}), {}, ["lora_alpha = '16'"], {}),
    ("config.type", "error", ("config", {"target_modules": 5}), {}, ["target_modules"], {}),
    ("config.type", "error", ("config", {"layers_to_transform": "0"}), {}, ["layers_to_transform"], {}),
    ("config.type", "error", ("config", {"use_rslora": "yes"}), {}, ["use_rslora"], {}),
    (
        "config.type",
        "error",
        ("config", {"target_modules": ".*_proj", "layers_to_transform": [0]}),
        {},
        ["cannot be used when target_modules is a regex"],
        {},
    ),
    (
        "config.regex",
        "error",
        ("config", {"rank_pattern": {"q_proj(": 8}}),
        {},
        ["q_proj(", "not a valid regex"],
        {},
    ),
    ("config.regex", "error", ("config", {"alpha_pattern": {"[": 4}}), {}, ["alpha_pattern"], {}),
    ("config.regex", "error", ("config", {"target_modules": "model.*(q_proj"}), {}, ["target_modules"], {}),
    ("config.nonfinite", "error", ("config", {"lora_alpha": float("nan")}), {}, ["lora_alpha is nan"], {}),
    ("config.nonfinite", "error", ("config", {"lora_alpha": float("inf")}), {}, ["lora_alpha is inf"], {}),
    ("config.nonfinite", "error", ("config", {"r": float("nan")}), {}, ["r is nan"], {}),
    (
        "config.nonfinite",
        "error",
        ("config", {"alpha_pattern": {"q_proj": float("-inf")}}),
        {},
        ["alpha_pattern"],
        {},
    ),
    # -- what vLLM refuses --
    ("config.peft_type", "error", ("config", {"peft_type": "LOHA"}), {}, ["LORA", C], {}),
    ("config.required", "error", ("config", {"lora_alpha": _DROP}), {}, ["lora_alpha", "re-save"], {}),
    (
        "config.rank",
        "error",
        ("config", {"rank_pattern": {"q_proj": 24}}),
        {},
        ["rank_pattern[q_proj] = 24 exceeds", "--max-lora-rank 16"],
        {},
    ),
    ("config.rank", "error", ("config", {"rank_pattern": {"q_proj": 32}}), {}, ["--max-lora-rank 16"], {}),
    ("config.rank", "error", ("config", {"r": 0}), {}, ["not a positive integer"], {}),
    ("config.alpha_negative", "error", ("config", {"lora_alpha": -16}), {}, ["is negative"], {}),
    (
        "config.alpha_negative",
        "error",
        ("config", {"alpha_pattern": {"q_proj": -8}}),
        {},
        ["alpha_pattern"],
        {},
    ),
    ("config.dora", "error", ("config", {"use_dora": True}), {}, ["DoRA", "retrain without"], {}),
    ("config.bias", "error", ("config", {"bias": "all"}), {}, ["bias", "'none'"], {}),
    (
        "config.modules_to_save",
        "error",
        ("config", {"modules_to_save": ["lm_head"]}),
        {},
        ["modules_to_save"],
        {},
    ),
    (
        "config.layer_replication",
        "error",
        ("config", {"layer_replication": [[0, 2]]}),
        {},
        ["layer_replication"],
        {},
    ),
    ("config.init", "error", ("config", {"init_lora_weights": "pissa"}), {}, ["pissa", "convert"], {}),
    ("config.init", "error", ("config", {"init_lora_weights": "loftq"}), {}, ["loftq"], {}),
    # issue 25.5: LoRA-GA rewrites the base (W - scale*B0A0) although vLLM calls it plain; siblings: PiSSA's
    # prefix form, CorDA; KaSA (a field this peft does not know) and the variants peft tags is_lora_variant
    (
        "config.init",
        "error",
        ("config", {"init_lora_weights": "lora_ga"}),
        {},
        ["lora_ga_init", "modified base"],
        {},
    ),
    ("config.init", "error", ("config", {"init_lora_weights": "pissa_niter_16"}), {}, ["pissa_init"], {}),
    ("config.init", "error", ("config", {"init_lora_weights": "corda"}), {}, ["corda_init"], {}),
    # an init string peft does not dispatch: peft raises at load, vLLM 0.32+ refuses it (_init_is_supported), the
    # 0.19 fleet serves it as plain LoRA; sibling: the string "true" (not the boolean)
    (
        "config.init",
        "error",
        ("config", {"init_lora_weights": "kaiming_fancy"}),
        {"vllm_version": NEW},
        ["'kaiming_fancy' is no init peft", "Unknown initialization", "0.32+ refuses"],
        {},
    ),
    ("config.init", "error", ("config", {"init_lora_weights": "true"}), {}, ["'true' is no init peft"], {}),
    (
        "config.unknown_field",
        "error",
        ("config", {"kasa_config": {"svd_rank": 8}}),
        {},
        ["kasa_config", "not a field of peft", "drops unknown fields"],
        {},
    ),
    ("config.variant", "error", ("config", {"velora_config": {"num_groups": 2}}), {}, ["velora_config"], {}),
    ("config.variant", "error", ("config", {"arrow_config": {"top_k": 2}}), {}, ["arrow_config"], {}),
    ("config.lora_bias", "error", ("config", {"lora_bias": True}), {}, ["lora_bias"], {}),
    ("config.alora", "error", ("config", {"alora_invocation_tokens": [1, 2]}), {}, ["aLoRA"], {}),
    ("config.qalora", "error", ("config", {"use_qalora": True}), {}, ["QALoRA"], {}),
    ("config.bdlora", "error", ("config", {"use_bdlora": {"nblocks": 2}}), {}, ["BD-LoRA"], {}),
    (
        "config.target_parameters",
        "error",
        ("config", {"target_parameters": ["mlp.down_proj.weight"]}),
        {},
        ["target_parameters", "linear modules"],
        {},
    ),
    # -- config vs tensors (issue 15.3, 15.5) --
    (
        "config.target_absent",
        "error",
        ("config", {"target_modules": DEFAULT_TARGETS + ["in_proj_qkvz"]}),
        {},
        ["'in_proj_qkvz' matches no module"],
        {},
    ),
    (
        "config.target_absent",
        "error",
        ("config", {"target_modules": DEFAULT_TARGETS + ["qkv_proj"]}),
        {},
        ["'qkv_proj'"],
        {},
    ),
    (
        "config.target_absent",
        "error",
        ("config", {"target_modules": "model\\.layers\\.\\d+\\.attn\\.c_attn"}),
        {},
        ["c_attn"],
        {},
    ),
    # helper-7: a layer the base does not have was named by nothing but 10 keys.not_targeted errors
    ("config.target_absent", "error", ("config", {"layers_to_transform": [99]}), {}, ["layer(s) [99]"], {}),
    # a plain string is PEFT's full-name regex: the message says so instead of suggesting the same name
    ("config.target_absent", "error", ("config", {"target_modules": "q_proj"}), {}, ["full module name"], {}),
    (
        "keys.not_targeted",
        "error",
        ("config", {"layers_to_transform": [0, 1, 2]}),
        {},
        ["layers 3", "PEFT would skip"],
        {},
    ),
    ("keys.not_targeted", "error", ("config", {"exclude_modules": ["down_proj"]}), {}, ["mlp.down_proj"], {}),
    (
        "keys.not_targeted",
        "error",
        ("config", {"layers_to_transform": [3], "layers_pattern": "layers"}),
        {},
        ["layers 0-2"],
        {},
    ),
    (
        "keys.not_targeted",
        "error",
        ("config", {"target_modules": ".*\\.(q_proj|k_proj|v_proj|o_proj)"}),
        {},
        ["PEFT would skip"],
        {},
    ),
    (
        "keys.bias",
        "error",
        ("tensors", _add(P + "0.mlp.up_proj.lora_B.bias", (256,))),
        {},
        ["bias", "lora_bias"],
        {},
    ),
    ("keys.bias", "error", ("tensors", _add(P + "1.mlp.down_proj.lora_A.bias", (8,))), {}, ["bias"], {}),
    (
        "keys.partial",
        "error",
        ("tensors", _drop(lambda k: ".1.mlp.up_proj." in k)),
        {},
        ["mlp.up_proj adapted on 3 of 4 layers", "missing on layers 1"],
        {},
    ),
    ("keys.partial", "error", ("tensors", _drop(lambda k: ".2." in k)), {}, ["missing on layers 2"], {}),
    (
        "keys.declared_absent",
        "error",
        ("config", {"target_modules": DEFAULT_TARGETS + ["in_proj_b"]}),
        {},
        ["linear_attn.in_proj_b (layers 0-2)"],
        {},
    ),
    # -- key grammar (issue 15.2) --
    (
        "keys.grammar",
        "error",
        ("tensors", _rename(".lora_A.weight", ".lora_A.default.weight")),
        {},
        ["lora_A.default.weight", "save_pretrained"],
        {},
    ),
    (
        "keys.grammar",
        "error",
        ("tensors", _rename(".lora_B.weight", ".lora_B")),
        {},
        ["vLLM expects lora_B.weight"],
        {},
    ),
    (
        "keys.grammar",
        "error",
        ("tensors", _add("base_model.model.model.embed_tokens.lora_embedding_A.weight", (8, 4))),
        {},
        ["lora_embedding_A.weight"],
        {},
    ),
    (
        "keys.unknown",
        "error",
        ("tensors", _add("base_model.model.model.norm.weight", (128,))),
        {},
        ["model.norm.weight", "lora_A.weight"],
        {},
    ),
    (
        "keys.pair",
        "error",
        ("tensors", _drop(lambda k: k == P + "1.mlp.down_proj.lora_B.weight")),
        {},
        ["lora_B missing", "layers.1.mlp.down_proj"],
        {},
    ),
    (
        "keys.embedding",
        "error",
        ("tensors", _add_pair("lm_head", (8, 128), (1024, 8))),
        {},
        ["lm_head", "allow_embedding_targets"],
        {},
    ),
    (
        "keys.embedding",
        "error",
        ("tensors", _add_pair("lm_head", (8, 128), (1024, 8))),
        {"allow_embedding_targets": True},
        ["no embedding LoRA", "0.19"],
        {},
    ),
    # embed_tokens / lm_head tensors the config does not target: PEFT skips them, a 0.32+ fleet serves them
    (
        "keys.not_targeted",
        "error",
        ("tensors", _add_pair("lm_head", (8, 128), (1024, 8))),
        {"allow_embedding_targets": True, "vllm_version": NEW},
        ["tensors adapt lm_head but adapter_config.json does not target it", "training and serving differ"],
        {},
    ),
    (
        "keys.not_targeted",
        "error",
        (
            "tensors",
            _add_raw_pair("model.embed_tokens", "lora_embedding_A", (8, 1024), "lora_embedding_B", (128, 8)),
        ),
        {"allow_embedding_targets": True, "vllm_version": NEW},
        ["tensors adapt model.embed_tokens but"],
        {},
    ),
    # peft writes the base embed_tokens/lm_head next to their LoRA (`...base_layer.weight`); vLLM skips them, so one
    # that is not the base's (trained or resized embeddings) is not served; an exact copy is bytes nobody reads
    (
        "keys.base_copy",
        "error",
        ("dir", _embedding_lora_saved_by_peft(lambda n, w: w + 0.01 if "embed_tokens" in n else w)),
        {"allow_embedding_targets": True, "vllm_version": NEW},
        ["embed_tokens.base_layer.weight: row 0 differs", "is_base_embedding_weights"],
        {},
    ),
    (
        "keys.base_copy",
        "error",
        ("dir", _embedding_lora_saved_by_peft(_two_more_rows)),
        {"allow_embedding_targets": True, "vllm_version": NEW},
        ["shape [1026, 128] vs the base's lm_head [1024, 128]"],
        {},
    ),
    (
        "keys.base_copy",
        "warning",
        ("dir", _embedding_lora_saved_by_peft()),
        {"allow_embedding_targets": True, "vllm_version": NEW},
        ["identical to the base", "save_embedding_layers=False"],
        {},
    ),
    # issue 25.8: where the fleet serves embedding LoRA (0.32+), the vocabulary must match (vLLM raises at load);
    # siblings: lm_head lora_B of another vocabulary, lora_embedding_B of another hidden size
    (
        "keys.embedding_shape",
        "error",
        (
            "tensors",
            _add_raw_pair("model.embed_tokens", "lora_embedding_A", (8, 1026), "lora_embedding_B", (128, 8)),
        ),
        {"allow_embedding_targets": True, "vllm_version": NEW},
        ["lora_embedding_A is [8, 1026]", "vocabulary 1024"],
        {},
    ),
    (
        "keys.embedding_shape",
        "error",
        ("tensors", _add_pair("lm_head", (8, 128), (1026, 8))),
        {"allow_embedding_targets": True, "vllm_version": NEW},
        ["lm_head lora_B is [1026, 8]"],
        {},
    ),
    (
        "keys.embedding_shape",
        "error",
        (
            "tensors",
            _add_raw_pair("model.embed_tokens", "lora_embedding_A", (8, 1024), "lora_embedding_B", (64, 8)),
        ),
        {"allow_embedding_targets": True, "vllm_version": NEW},
        ["lora_embedding_B is [64, 8]"],
        {},
    ),
    (
        "config.weight_tying",
        "error",
        ("config", {"ensure_weight_tying": True}),
        {},
        ["tie_word_embeddings false", "tied nothing"],
        {},
    ),
    (
        "keys.mtp",
        "error",
        ("tensors", _add_pair("mtp.layers.0.mlp.up_proj", (8, 128), (256, 8))),
        {},
        ["mtp.layers.0.mlp.up_proj", "drop mtp"],
        {},
    ),
    (
        "keys.visual",
        "error",
        ("tensors", _add_pair("model.visual.blocks.0.attn.qkv", (8, 128), (384, 8))),
        {},
        ["visual.blocks.0.attn.qkv", "lora_target_modules"],
        {},
    ),
    (
        "keys.module",
        "error",
        ("tensors", _rename(P + "3.self_attn.q_proj", P + "0.self_attn.q_proj")),
        {},
        ["self_attn.q_proj does not exist on layer 0 (linear_attention)"],
        {},
    ),
    (
        "keys.module",
        "error",
        ("tensors", _add_pair("model.norm", (8, 128), (128, 8))),
        {},
        ["norm is not a decoder-layer module"],
        {},
    ),
    (
        "keys.conv1d",
        "error",
        ("tensors", _add_pair("model.layers.0.linear_attn.conv1d", (8, 4), (512, 8))),
        {},
        ["conv1d", "applies nothing"],
        {},
    ),
    (
        "keys.layer",
        "error",
        ("tensors", _rename(P + "2.mlp.", P + "9.mlp.")),
        {},
        ["layer 9 >= the base's 4 layers"],
        {},
    ),
    (
        "keys.shape",
        "error",
        ("tensors", _set(P + "0.mlp.up_proj.lora_A.weight", lambda v: v[:, :64].contiguous())),
        {},
        ["lora_A [8, 64]", "in_features 128"],
        {},
    ),
    ("keys.rank", "error", ("config", {"r": 16}), {}, ["tensor rank 8 != configured r 16"], {}),
    (
        "keys.fleet_targets",
        "error",
        None,
        {"lora_target_modules": ["q_proj", "o_proj", "gate_proj", "in_proj_qkv"], "vllm_version": "0.25.1"},
        ["7 of 25 adapted modules are outside the fleet's --lora-target-modules", "down_proj on layers 0-3"],
        {},
    ),
    # -- issue 25.1: --lora-target-modules as each version matches it --
    # 0.19 matches runtime names only: a fleet started with PEFT names drops q/k/v, gate/up (qkv_proj, gate_up_proj)
    (
        "keys.fleet_targets",
        "error",
        None,
        {"lora_target_modules": DEFAULT_TARGETS, "vllm_version": "0.19.2"},
        ["q_proj (applied through 'qkv_proj')", "runtime module names only", "11 of 25"],
        {},
    ),
    # sibling: on 0.19 the fused name in_proj_qkvz opens nothing (LoRA splits it into in_proj_qkv + in_proj_z)
    (
        "keys.fleet_targets",
        "error",
        None,
        {"lora_target_modules": RUNTIME_019[:-2] + ["in_proj_qkvz"], "vllm_version": "0.19.1"},
        ["in_proj_qkv on layers 0-2", "in_proj_z on layers 0-2"],
        {},
    ),
    # sibling: 0.20 is packed-aware but in_proj_z is its own runtime module: listing in_proj_qkv does not open it
    (
        "keys.fleet_targets",
        "error",
        None,
        {"lora_target_modules": [t for t in DEFAULT_TARGETS if t != "in_proj_z"], "vllm_version": "0.20.0"},
        ["in_proj_z on layers 0-2"],
        {},
    ),
    # -- issue 25.2: in_proj_qkv without in_proj_z crashes the engine at activation --
    (
        "keys.gdn_partial",
        "error",
        ("dir", _gdn_alone("in_proj_qkv")),
        {"vllm_version": "0.25.1"},
        ["in_proj_qkv is adapted without in_proj_z on layers 0-2", "#47639"],
        {},
    ),
    (
        "keys.gdn_partial",
        "error",
        ("dir", _gdn_alone("in_proj_qkv")),
        {"vllm_version": "0.27.1"},
        ["0.27"],
        {},
    ),
    # sibling found in 0.32's fix: a missing in_proj_qkv still leaves no slice for in_proj_z (ValueError)
    (
        "keys.gdn_partial",
        "error",
        ("dir", _gdn_alone("in_proj_z")),
        {"vllm_version": "0.32.0"},
        ["in_proj_z is adapted without in_proj_qkv"],
        {},
    ),
    # the fully-sharded skip of 0.19 (a table fact that had no reader)
    (
        "keys.fully_sharded",
        "error",
        None,
        {"fully_sharded_loras": True, "vllm_version": "0.19.1"},
        ["in_proj_qkv", "--fully-sharded-loras"],
        {},
    ),
    # -- served layout and versions (issue 14) --
    (
        "keys.served_layout",
        "warning",
        None,
        _served_vl,
        ["Qwen3_5ForConditionalGeneration", "pipeline publish", "model.language_model.layers."],
        {},
    ),
    (
        "keys.served_layout",
        "warning",
        ("tensors", _rename(P + "0.", "base_model.model.model.language_model.layers.0.")),
        _served_vl,
        ["mixes layouts"],
        {},
    ),
    # without a served checkpoint the served class is still known where the version registers one for qwen3_5
    # (0.19-0.26: the VL class): text-layout keys change nothing there (and publish renames them, test_normalise)
    (
        "keys.served_layout",
        "warning",
        None,
        {"vllm_version": "0.19.2"},
        ["no served checkpoint given", "only class vLLM 0.19 registers", "pipeline publish"],
        {},
    ),
    (
        "keys.served_layout",
        "warning",
        None,
        {"vllm_version": "0.25.1"},
        ["only class vLLM 0.21-0.26 registers"],
        {},
    ),
    (
        "keys.mixed_layout",
        "error",
        (
            "tensors",
            lambda t: (
                t
                | {
                    k.replace(P, "base_model.model.model.language_model.layers."): v.clone()
                    for k, v in t.items()
                    if ".0.mlp.up_proj" in k
                }
            ),
        ),
        {},
        ["layers.0.mlp.up_proj is stored under 2 prefixes"],
        {},
    ),
    (
        "config.patterns_ignored",
        "warning",
        ("config", {"alpha_pattern": {"down_proj": 160}}),
        {},
        ["ignores rank_pattern/alpha_pattern", "down_proj", "pipeline publish"],
        {},
    ),
    (
        "serving.version_unknown",
        "error",
        None,
        {"vllm_version": "0.28.0"},
        ["0.28.0", "--allow serving.version_unknown"],
        {},
    ),
    ("serving.version_unknown", "error", None, {"vllm_version": "nightly"}, ["does not parse"], {}),
    ("serving.version_unknown", "error", None, {"vllm_version": "0.18.1"}, ["0.18.1 lies outside"], {}),
    (
        "serving.version_unknown",
        "info",
        None,
        {"vllm_version": "0.30.0"},
        ["allowed"],
        {"allow": {"serving.version_unknown"}},
    ),
    (
        "served.architecture",
        "error",
        None,
        _served_nvfp4("0.19.2"),
        ["Qwen3_5ForCausalLM", "would not start"],
        {},
    ),
    (
        "served.nvfp4_gdn_scales",
        "error",
        None,
        _served_nvfp4("0.19.2rc1.dev123+gabcdef"),
        ["#38517", "0.20.0"],
        {},
    ),
    # issue 25.4 siblings: the bug is the base's, so an adapter without in_proj_qkv is refused too, and on
    # 0.19.1 (a release, not a nightly) the same
    (
        "served.nvfp4_gdn_scales",
        "error",
        ("dir", lambda d, e: _without_modules(d, ("in_proj_qkv", "in_proj_z"))),
        _served_nvfp4("0.19.1"),
        ["every request", "no adapter change"],
        {},
    ),
    # the same NVFP4 in_proj_qkv under another quantization name: a ModelOpt MIXED_PRECISION export (NVFP4 layers
    # per quantized_layers) and compressed-tensors' nvfp4-pack-quantized format (weight_packed +
    # weight_global_scale: compressed_tensors_w4a4_nvfp4.py creates the same torch.empty slots)
    (
        "served.nvfp4_gdn_scales",
        "error",
        None,
        lambda env: {
            "served_path": _served_copy(env, "mixed-precision", _mixed_precision),
            "vllm_version": "0.19.2",
        },
        ["MIXED_PRECISION", "#38517"],
        {},
    ),
    (
        "served.nvfp4_gdn_scales",
        "error",
        None,
        lambda env: {
            "served_path": _served_copy(env, "ct-nvfp4", _compressed_tensors_nvfp4),
            "vllm_version": "0.19.2",
        },
        ["COMPRESSED-TENSORS", "weight_global_scale", "#38517"],
        {},
    ),
    # issue 25.6: the drafter reads mtp.* only; siblings: no MTP tensors at all, the MTP layer without mtp.fc
    (
        "served.mtp",
        "error",
        None,
        _served_with(
            "mtp-vl-prefix",
            _served_tensors(
                lambda t: {
                    ("model.language_model." + k if k.startswith("mtp.") else k): v for k, v in t.items()
                }
            ),
        ),
        ["model.language_model.mtp.*", "reads only tensors named mtp.*"],
        {},
    ),
    (
        "served.mtp",
        "error",
        None,
        _served_with(
            "mtp-none", _served_tensors(lambda t: {k: v for k, v in t.items() if not k.startswith("mtp.")})
        ),
        ["no mtp.* tensors", "fleet.speculative_mtp"],
        {},
    ),
    (
        "served.mtp",
        "error",
        None,
        _served_with(
            "mtp-nofc", _served_tensors(lambda t: {k: v for k, v in t.items() if not k.startswith("mtp.fc.")})
        ),
        ["['mtp.fc']"],
        {},
    ),
    # a config that declares no MTP layer to run (0, or not an integer: the check crashed on int('one'))
    (
        "served.mtp",
        "error",
        None,
        _served_with("mtp-zero", _served_config(mtp_num_hidden_layers=0)),
        ["mtp_num_hidden_layers = 0", "positive integer"],
        {},
    ),
    (
        "served.mtp",
        "error",
        None,
        _served_with("mtp-str", _served_config(mtp_num_hidden_layers="one")),
        ["mtp_num_hidden_layers = 'one'"],
        {},
    ),
    # a finite adapter that vLLM turns into Inf: the scale is folded into lora_B in the serving dtype at load
    # (lora_weights.py optimize): an absurd lora_alpha in bf16, an fp32 lora_B beyond fp16's 65504 on an fp16 fleet
    ("values.overflow", "error", ("config", {"lora_alpha": 1e300}), {}, ["bfloat16's largest", "Inf"], {}),
    (
        "values.overflow",
        "error",
        ("tensors", _scale("lora_B", 1e6, lambda k: ".layers.3.mlp.up_proj" in k)),
        _served_with("fp16", _served_config(torch_dtype="float16")),
        ["layers.3.mlp.up_proj", "float16's largest 6.55e+04"],
        {},
    ),
    ("fleet.rank_oversized", "warning", None, {"max_lora_rank": 512}, ["512", "#22782"], {}),
    ("fleet.rank_oversized", "warning", None, {"max_lora_rank": 64}, ["64"], {}),
    (
        "fleet.resolver_base",
        "error",
        None,
        {"loading_mode": "resolver", "served_model": "Qwen/Qwen3.6-27B-NVFP4"},
        ["Qwen/Qwen3.6-27B-NVFP4", "404", "pipeline publish"],
        {},
    ),
    # -- values (issue 15.4, 16.3) --
    (
        "values.nonfinite",
        "error",
        ("tensors", _set(P + "2.mlp.down_proj.lora_B.weight", _nan_fill)),
        {},
        ["NaN/Inf", "layers.2.mlp.down_proj.lora_B", "retrain"],
        {},
    ),
    ("values.untrained", "error", ("tensors", _zero("lora_B")), {}, ["every lora_B (or lora_A) is zero"], {}),
    ("values.untrained", "error", ("tensors", _zero("lora_A")), {}, ["changes nothing"], {}),
    ("values.untrained", "error", ("config", {"lora_alpha": 0}), {}, ["lora_alpha is 0"], {}),
    (
        "values.no_effect",
        "error",
        ("tensors", _zero("lora_B", lambda k: "0.mlp.up_proj" in k)),
        {},
        ["1 of 25 modules", "mlp.up_proj on layers 0"],
        {},
    ),
    (
        "values.no_effect",
        "error",
        ("tensors", _zero("lora_A", lambda k: "self_attn.v_proj" in k)),
        {},
        ["self_attn.v_proj on layers 3"],
        {},
    ),
    # issue 25.10: no effect relative to the base weight in the serving dtype (bf16), not an absolute 1e-12
    (
        "values.untrained",
        "error",
        ("tensors", _scale("lora_B", 1e-6)),
        {},
        ["changes nothing the engine can represent", "bfloat16"],
        {},
    ),
    (
        "values.no_effect",
        "error",
        ("tensors", _scale("lora_B", 1e-6, lambda k: "mlp.down_proj" in k)),
        {},
        ["4 of 25 modules have an update below", "mlp.down_proj on layers 0-3"],
        {},
    ),
    (
        "values.no_effect",
        "warning",
        ("tensors", _scale("lora_B", 1e-4, lambda k: "mlp.up_proj" in k)),
        {},
        ["rounded away in serving", "mlp.up_proj on layers 0-3"],
        {},
    ),
    (
        "values.norm_outlier",
        "warning",
        ("tensors", _set(P + "1.mlp.up_proj.lora_B.weight", lambda v: v * 1000)),
        {},
        ["layers.1.mlp.up_proj", "median", "learning rate"],
        {},
    ),
    (
        "values.size_band",
        "error",
        ("tensors", _drop(lambda k: "q_proj" not in k)),
        {},
        ["implied by r, target_modules"],
        {},
    ),
    # -- safetensors as the loader enforces it (issue 16.3, 15.10) --
    (
        "weights.header",
        "error",
        ("dir", lambda d, e: _rewrite_header(d, _overlap)),
        {},
        ["overlaps", "InvalidOffset"],
        {},
    ),
    ("weights.header", "error", ("dir", lambda d, e: _rewrite_header(d, _gap)), {}, ["leaves a gap"], {}),
    (
        "weights.header",
        "error",
        ("dir", lambda d, e: _rewrite_header(d, lambda h, x: None, b"junk")),
        {},
        ["MetadataIncompleteBuffer"],
        {},
    ),
    (
        "weights.header",
        "error",
        ("dir", lambda d, e: _rewrite_header(d, _dtype("F17"))),
        {},
        ["unknown dtype"],
        {},
    ),
    ("weights.header", "error", ("dir", lambda d, e: _rewrite_header(d, _dtype("BF16"))), {}, ["needs"], {}),
    (
        "weights.header",
        "error",
        ("dir", lambda d, e: _raw(d, lambda b: b[:8] + b" " + b[9:])),
        {},
        ["does not start with"],
        {},
    ),
    (
        "weights.metadata",
        "warning",
        ("dir", lambda d, e: edit_tensors(d, lambda t: t, metadata=None)),
        {},
        ["no __metadata__", "pipeline publish"],
        {},
    ),
    (
        "weights.metadata",
        "warning",
        ("dir", lambda d, e: edit_tensors(d, lambda t: t, metadata={"format": "tf"})),
        {},
        ["format 'tf'"],
        {},
    ),
    (
        "weights.dtype",
        "error",
        ("tensors", _set(P + "0.mlp.up_proj.lora_A.weight", lambda v: v.double())),
        {},
        ["F64", "0.mlp.up_proj", "bf16"],
        {},
    ),
    # -- tokenizer and template (issue 15.6) --
    (
        "template.divergence",
        "error",
        ("dir", _template_only(_tool_drift)),
        {},
        ["tool_call", "chat_template.jinja"],
        {},
    ),
    # vLLM renders a request with tools through the tokenizer's "tool_use" template when it has one
    # (transformers get_chat_template): a served tool_use template that differs from the training template
    # diverges on tool conversations only; siblings: additional_chat_templates/ and tokenizer_config's list form
    (
        "template.divergence",
        "error",
        ("dir", _template_only(lambda t: t)),
        _served_with("tool-use-dir", _tool_use_template("dir")),
        ["tool_call", "tool-use-dir"],
        {},
    ),
    (
        "template.divergence",
        "error",
        ("dir", _template_only(lambda t: t)),
        _served_with("tool-use-list", _tool_use_template("list")),
        ["tool_call", "tool-use-list"],
        {},
    ),
    (
        "template.divergence",
        "error",
        ("dir", _template_only(_genprompt_drift)),
        {},
        ["generation prompt", "<think>"],
        {},
    ),
    # issue 25.11: a template that keeps reasoning_content on the last turn only (and, a sibling, only after the
    # last user message, as Qwen3's does) diverges from one that keeps it on every turn only in a conversation
    # with reasoning in its history
    (
        "template.divergence",
        "error",
        (
            "dir",
            _template_only(
                lambda t: t.replace(
                    "{%- if message.reasoning_content %}", "{%- if message.reasoning_content and loop.last %}"
                )
            ),
        ),
        {},
        ["reasoning_history", "<think>"],
        {},
    ),
    (
        "template.divergence",
        "error",
        ("dir", _template_only(_reasoning_after_last_query)),
        {},
        ["reasoning_history"],
        {},
    ),
    # siblings: tokens added only through the slow-tokenizer files transformers also reads
    (
        "tokenizer.added_tokens",
        "error",
        ("dir", _slow_added("added_tokens.json", {"<my_tool>": 1024})),
        {},
        ["<my_tool>", "added_tokens.json"],
        {},
    ),
    (
        "tokenizer.added_tokens",
        "error",
        ("dir", _slow_added("special_tokens_map.json", {"additional_special_tokens": ["<sep2>"]})),
        {},
        ["<sep2>"],
        {},
    ),
    # tokenizer_config.json too: transformers 5 adds its extra_special_tokens, added_tokens_decoder entries and
    # special tokens (pad_token...) missing from tokenizer.json's vocabulary
    (
        "tokenizer.added_tokens",
        "error",
        ("dir", _tokenizer_config_adds(extra_special_tokens={"image_token": "<img_new>"})),
        {},
        ["<img_new>", "tokenizer_config.json"],
        {},
    ),
    (
        "tokenizer.added_tokens",
        "error",
        (
            "dir",
            _tokenizer_config_adds(
                added_tokens_decoder={"1030": {"content": "<my_tool3>", "special": True, "normalized": False}}
            ),
        ),
        {},
        ["<my_tool3>"],
        {},
    ),
    (
        "tokenizer.added_tokens",
        "error",
        ("dir", _tokenizer_config_adds(pad_token="<pad_new>")),
        {},
        ["<pad_new>"],
        {},
    ),
    (
        "template.divergence",
        "error",
        ("dir", _with_tokenizer),
        {},
        ["chatml"],
        _resolved("chatml", chat_template="chatml"),
    ),
    # the same template rendered with the training config's chat_template_kwargs (axolotl passes them; vLLM only
    # when a request sends them): enable_thinking false empties the think block of every generation prompt
    (
        "template.divergence",
        "error",
        ("dir", _with_tokenizer),
        {},
        [
            "generation prompt",
            "chat_template_kwargs {'enable_thinking': False}",
            "--default-chat-template-kwargs",
        ],
        _resolved(
            "thinking-off", chat_template="tokenizer_default", chat_template_kwargs={"enable_thinking": False}
        ),
    ),
    (
        "template.eos_terminator",
        "error",
        ("dir", _eos("<|endoftext|>")),
        {},
        ["'<|im_end|>'", "eos_token is '<|endoftext|>'", "loops"],
        {},
    ),
    (
        "template.eos_terminator",
        "error",
        ("dir", _with_tokenizer),
        _served_with("gen-eos", _gen_eos),
        ["stops only at ids [0]", "generation_config.json"],
        {},
    ),
    (
        "template.training",
        "error",
        ("dir", _with_tokenizer),
        {},
        ["not one of axolotl's templates"],
        _resolved("nosuch", chat_template="no_such_template"),
    ),
    (
        "template.render",
        "error",
        ("dir", _template_only(lambda t: t.replace("message.content +", "message.content|int +", 1))),
        {},
        ["does not render"],
        {},
    ),
    (
        "tokenizer.served_unreadable",
        "error",
        ("dir", _with_tokenizer),
        _served_with("bad-tok", _corrupt_tokenizer_json),
        ["tokenizer.json", "cannot be loaded"],
        {},
    ),
    (
        "tokenizer.served_unreadable",
        "error",
        ("dir", _with_tokenizer),
        _served_with("bad-tokcfg", _corrupt_tokenizer_config),
        ["not valid JSON"],
        {},
    ),
    ("tokenizer.unreadable", "error", ("dir", _corrupt_adapter_tokenizer), {}, ["cannot be loaded"], {}),
    (
        "tokenizer.added_tokens",
        "error",
        ("dir", _added_token),
        {},
        ["<my_tool>", "retrain without adding tokens"],
        {},
    ),
]


def served_missing(d):
    (d / "chat_template.jinja").unlink()


def _no_base_tok(d, env):
    _with_tokenizer(d, env)


CASES += [
    ("template.unchecked", "info", None, {}, ["no training template"], {}),
    ("served.unchecked", "warning", None, {"served_path": None}, ["no served checkpoint given"], {}),
    (
        "base.unreadable",
        "error",
        None,
        {},
        ["no config.json", "--base"],
        {"base_dir": Path("/nonexistent-base")},
    ),
    ("base.missing", "error", None, {}, ["pass --base"], {"base_dir": None, "require_base": True}),
    (
        "config.rslora_parity",
        "error",
        ("config", {"use_rslora": True, "lora_alpha": 1e308}),
        {},
        ["fold by hand"],
        {"fold_rslora": True},
    ),
]
CASES.append(
    (
        "template.served_missing",
        "error",
        ("dir", _with_tokenizer),
        _served_with("no-tmpl", served_missing),
        ["no chat template"],
        {},
    )
)
