"""The record of a run (`OUT/vllm_h200.json`), its "Done when" check, and its RESULTS.md section."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .engines import SPEC_MTP
from .trained import trained_summary

if TYPE_CHECKING:
    from .context import Ctx


def assemble(ctx: Ctx, done: dict[str, dict]) -> dict:
    """The issue's "Done when" record from the stages' results (None where a stage did not run)."""

    def r(stage, *path, default=None):
        x = (done.get(stage) or {}).get("result")
        for p in path:
            if not isinstance(x, dict):
                return default
            x = x.get(p)
        return default if x is None else x

    cp, cs = r("canary_parity") or {}, r("canary_served") or {}
    dec = r("decode") or {}
    quant = r("served", "quantization") or {}
    rec = {
        "benchmark": "vllm_h200",
        "plan": ctx.plan,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host": r("host"),
        "vllm_version": (r("engines", "vllm_version") or [None])[0],
        "quantization": {"method": "modelopt", **quant} if quant else None,
        "speculative": SPEC_MTP if ctx.gpu else None,
        "instances": len([n for n in ("fleet-a", "fleet-b") if n in ctx.engines]),
        "engine_flags": {n: e.args for n, e in ctx.engines.items()},
        "engine_ready_s": {n: e.ready_s for n, e in ctx.engines.items()},
        "read_only_mount": r("host", "mount"),
        "publish": {
            "version": r("publish", "version"),
            "confirmed_by": r("publish", "confirmed_by"),
            "instances_list_the_version": r("publish", "instances_list_the_version"),
            "wall_s": r("publish", "wall_s"),
        },
        "canary_bf16_base": {
            "engine": "bf16 base, --dtype bfloat16, eager, MTP, LoRA",
            "token_agreement": (cp.get("parity") or {}).get("adapter", {}).get("agreement"),
            "base_token_agreement": (cp.get("parity") or {}).get("base", {}).get("agreement"),
            "first_divergence": (cp.get("parity") or {}).get("adapter", {}).get("first_divergence"),
            "max_logprob_diff": (cp.get("parity") or {}).get("adapter", {}).get("max_logprob_diff"),
            "verdict": cp.get("verdict"),
        },
        "canary_nvfp4": {
            "verdict": cs.get("verdict"),
            "effect": cs.get("effect"),
            "acceptance_length": {
                k: (cs.get("speed") or {}).get(k, {}).get("mean_acceptance_length")
                for k in ("base", "adapter")
            },
            "acceptance_rate": {
                k: (cs.get("speed") or {}).get(k, {}).get("acceptance_rate") for k in ("base", "adapter")
            },
            # the canary runs on instance a while instance b serves (and, in main, a merge build may run):
            # not a GPU-exclusive timing, so no number here (the decode rows' tpot_ms are; the canary's
            # own figure stays in OUT/stages/canary_served.json)
            "tpot_ms": None,
            "tpot_not_measured": "the canary runs beside instance b: see decode rows' tpot_ms (GPU exclusive)"
            if cs
            else None,
            "parity": cs.get("parity"),
        },
        "acceptance_length": (dec.get("acceptance_length") or {}),
        "decode_tok_s": dec.get("tok_s"),
        "decode_ratio_adapter_over_base": dec.get("ratio_adapter_over_base"),
        "field_report": dec.get("field_report"),
        "mtp_distillation": {
            k: r("mtp", k)
            for k in (
                "agreement_random",
                "agreement_ridge",
                "agreement_trained",
                "split",
                "kept",
                "expected",
                "train_steps",
                "continuations",
                "seconds",
            )
        },  # fmt: skip
        "mtp_check": r("mtp_check"),
        "stale_kv": r("stale_kv"),
        "release": r("publish2"),
        "merged_vs_hot": r("merged"),
        "bf16_engine": r("staging_bf16"),
        "sweep": r("sweep"),
        "publish_latency": r("publish_latency"),
        "fleet64": {
            "base": r("base64"),
            "build": r("build64"),
            "adapter": r("adapter64"),
            "decode": r("decode64"),
        }
        if ctx.plan == "fleet64"
        else None,
        "trained": trained_summary(
            r("base") if ctx.base_given else None, r("tb_bf16"), r("tb_build"), r("tb_nvfp4"), r("tb_drafter")
        ),
        "stages": {
            k: {
                "ok": v.get("ok"),
                "seconds": v.get("seconds"),
                "at_s": v.get("at_s"),
                "skipped": v.get("skipped"),
                "error": (v.get("error") or "")[:600] or None,
            }
            for k, v in done.items()
        },  # fmt: skip
        "failed": sorted(k for k, v in done.items() if not v.get("ok")),
        "seconds": round(ctx.elapsed, 1),
    }
    rec["done_when"] = done_when(rec)
    return rec


def done_when(rec: dict) -> dict:
    """Each condition of issue 23's "Done when", checked on the record."""
    dec = rec.get("decode_tok_s") or {}
    acc = rec.get("acceptance_length") or {}
    pub = rec.get("publish") or {}
    return {
        "vllm_0.25": str(rec.get("vllm_version") or "").startswith("0.25."),
        "modelopt_nvfp4": ((rec.get("quantization") or {}).get("quant_algo") == "NVFP4"),
        "mtp_3": rec.get("speculative") == SPEC_MTP,
        "two_instances": rec.get("instances") == 2,
        "publish_confirmed_by_both": sorted(pub.get("confirmed_by") or []) == ["fleet-a", "fleet-b"],
        "canary_agreement_0.99": ((rec.get("canary_bf16_base") or {}).get("token_agreement") or 0) >= 0.99,
        "acceptance_base_and_adapter": all(
            v is not None for k in ("base", "adapter") for v in (acc.get(k) or {None: None}).values()
        ),
        "decode_base_and_adapter": all(
            v is not None for k in ("base", "adapter") for v in (dec.get(k) or {None: None}).values()
        ),
    }


def record_into(out: Path, into: Path) -> dict:
    """Add `out`'s record to `into` (`{"records": [...]}`), replacing one of the same date and plan;
    returns its `done_when`. A file holding one bare record (as the first run's was committed) becomes
    the first of the list."""
    rec = json.loads((out / "vllm_h200.json").read_text())
    data = json.loads(into.read_text()) if into.exists() else {"records": []}
    if "records" not in data:
        data = {"records": [data]}
    data["records"] = [
        x for x in data["records"] if not (x.get("date") == rec["date"] and x.get("plan") == rec["plan"])
    ]
    data["records"].append(rec)
    into.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return rec["done_when"]


def markdown(rec: dict) -> str:
    """The RESULTS.md section of one record (figures as measured; n/a where a stage did not run)."""

    def f(x, spec=".3f"):
        return "n/a" if x is None else (f"{x:{spec}}" if isinstance(x, (int, float)) else str(x))

    dec, acc = rec.get("decode_tok_s") or {}, rec.get("acceptance_length") or {}
    cp, cn = rec.get("canary_bf16_base") or {}, rec.get("canary_nvfp4") or {}
    eff = cn.get("effect") or {}
    lines = [
        f"vLLM {rec.get('vllm_version')}, {((rec.get('quantization') or {}).get('quant_algo'))} (ModelOpt), "
        f"MTP {rec.get('speculative')}, {rec.get('instances')} instances on one H200 ({rec.get('date')}, plan {rec.get('plan')})",
        "",
        "| decode tok/s | batch 1 | batch 8 | acceptance length b1 / b8 |",
        "|---|---|---|---|",
    ]
    for k in ("base", "adapter"):
        d, a = dec.get(k) or {}, acc.get(k) or {}
        lines.append(
            f"| {k} | {f(d.get('1'), '.1f')} | {f(d.get('8'), '.1f')} | {f(a.get('1'), '.2f')} / {f(a.get('8'), '.2f')} |"
        )
    fr = rec.get("field_report") or {}
    lines += [
        "",
        f"adapter / base at batch 1: {f(fr.get('ratio_here_batch1'))} (field report: {fr.get('adapter_tok_s')} / "
        f"{fr.get('base_tok_s')} = {fr.get('ratio')})",
        "",
        f"canary, bf16 base served in bfloat16: token agreement {f(cp.get('token_agreement'))} (base "
        f"{f(cp.get('base_token_agreement'))}), first divergence {cp.get('first_divergence')}, max logprob diff "
        f"{f(cp.get('max_logprob_diff'), '.4f')} nats, verdict {cp.get('verdict')}",
        f"canary, NVFP4 instance: verdict {cn.get('verdict')}, acceptance length base/adapter "
        f"{cn.get('acceptance_length')}, TPOT: {cn.get('tpot_not_measured')}, effect retention {f(eff.get('retention'))} "
        f"(engine {f(eff.get('engine_nats'))} vs reference {f(eff.get('reference_nats'))} nats/token, base gap "
        f"{f(eff.get('base_gap_nats'))})",
        *_speed_lines(rec),
        f"failed stages: {', '.join(rec.get('failed') or []) or 'none'}; Done when: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in (rec.get("done_when") or {}).items()),
    ]
    return "\n".join(lines)


def _rows(title: str, table: dict | None) -> list[str]:
    """Markdown rows of a decode table: median tok/s [min-max] per batch, base and adapter, and the ratio."""
    if not table or "tok_s" not in table:
        return [
            f"{title}: not measured ({(table or {}).get('not_measured') or (table or {}).get('error') or 'no result'})"
        ]
    tok, rng, ratio = (
        table["tok_s"],
        table.get("tok_s_range") or {},
        table.get("ratio_adapter_over_base") or {},
    )
    out = [f"{title}: decode tok/s, median of 3 [min-max], adapter/base"]
    for b in tok.get("base") or {}:
        cell = {
            k: f"{tok[k][b]} [{'-'.join(map(str, (rng.get(k) or {}).get(b) or []))}]"
            for k in ("base", "adapter")
        }
        out.append(f"- batch {b}: base {cell['base']}, adapter {cell['adapter']}, ratio {ratio.get(b)}")
    return out


def _speed_lines(rec: dict) -> list[str]:
    """The issue-37 rows (sweep, 64-layer decode, trained base) when the record has them."""
    out: list[str] = []
    for n, t in ((rec.get("sweep") or {}).get("settings") or {}).items():
        out += _rows(f"sweep {n}", t)
    if (f64 := rec.get("fleet64")) is not None:
        out += _rows("64-layer NVFP4, no MTP", f64.get("decode"))
    if (tb := rec.get("trained")) is not None:
        agree = ((tb.get("nvfp4_vs_bf16") or {}).get("agreement")) or {}
        for k in ("bf16", "nvfp4", "nvfp4_drafter"):
            e = tb.get(k) or {}
            dec = {b: d.get("tok_s") for b, d in (e.get("decode") or {}).items()}
            out.append(
                f"trained base, {k}: acceptance length {e.get('greedy_acceptance_length')}, decode tok/s {dec}"
            )
            for t, a in (e.get("adapters") or {}).items():
                if isinstance(a, dict) and "task_metric" in a:
                    out.append(f"  adapter {t}: {a['task_metric']}, vs PEFT fp32 {a['token_agreement_vs_peft_fp32']}, "
                               f"acceptance length {a['acceptance_length']}")  # fmt: skip
            for b, d in (e.get("decode_adapter") or {}).items():
                if isinstance(d, dict):
                    out.append(
                        f"  adapter decode b{b}: {d.get('tok_s')} tok/s, acceptance {d.get('acceptance_length')}"
                    )
        out.append(f"trained base, NVFP4 vs bf16 greedy: token agreement {agree.get('token_agreement')}, "
                   f"prefix agreement {agree.get('prefix_agreement')}")  # fmt: skip
    return out
