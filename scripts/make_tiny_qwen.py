"""Dev helper: build a tiny random-weight Qwen model + tokenizer + LoRA adapter locally.

Runs with the fleet venv's python (needs torch, transformers, tokenizers, peft):
    .fleet-venv/bin/python scripts/make_tiny_qwen.py OUT_DIR [--arch qwen3_5|qwen3] [--seed 0]
Writes OUT_DIR/base (model + tokenizer), OUT_DIR/lora_a and OUT_DIR/lora_b (two
different random LoRA adapters, r=8, safetensors). Never touches any model hub.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The fleet venv's PyPI torchvision cannot load its C ops; without the launcher's
# guard `from transformers import Qwen3ForCausalLM` fails (torchvision::nms).
import runpy  # noqa: E402

runpy.run_path(
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support", "vllm_cpu_launcher.py"
    ),
    run_name="_fleet_launcher_patches",
)

import torch  # noqa: E402

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Hello world! This is a tiny tokenizer for testing LoRA adapters.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ? ! ( ) [ ] { }",
] * 50


def build_tokenizer(out: str, vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 64,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<tool_call>", "</tool_call>"],
        model_max_length=512,
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return fast


def build_config(arch: str, vocab: int, tok):
    common = dict(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="bfloat16",
    )
    if arch == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(
            **common,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=1,
        )
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    else:
        from transformers import Qwen3Config

        cfg = Qwen3Config(**common)
        cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def build_model(arch: str, cfg):
    if arch == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM as cls
    else:
        from transformers import Qwen3ForCausalLM as cls
    model = cls(cfg).to(torch.bfloat16)
    return model


def build_lora(base_dir: str, out: str, arch: str, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, bias="none", target_modules=targets, task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    peft_model.save_pretrained(out, safe_serialization=True)
    # vLLM's resolver compares base_model_name_or_path to the served model path.
    with open(os.path.join(out, "adapter_config.json")) as f:
        ac = json.load(f)
    ac["base_model_name_or_path"] = os.path.abspath(base_dir)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(ac, f, indent=2)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--arch", choices=["qwen3_5", "qwen3"], default="qwen3_5")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    base = os.path.join(a.out, "base")
    os.makedirs(base, exist_ok=True)
    tok = build_tokenizer(base)
    cfg = build_config(a.arch, -(-len(tok) // 64) * 64, tok)  # pad vocab to a multiple of 64
    model = build_model(a.arch, cfg)
    model.save_pretrained(base, safe_serialization=True)
    # sanity: forward pass
    ids = tok("Hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids)
    print("forward ok", tuple(out.logits.shape), "params", sum(p.numel() for p in model.parameters()))
    build_lora(base, os.path.join(a.out, "lora_a"), a.arch, a.seed + 1)
    build_lora(base, os.path.join(a.out, "lora_b"), a.arch, a.seed + 2)
    print(json.dumps(cfg.to_dict(), indent=1, default=str))
    print("wrote", os.path.abspath(a.out))


if __name__ == "__main__":
    sys.exit(main())
