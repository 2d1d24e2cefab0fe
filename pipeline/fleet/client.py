"""HTTP client for one vLLM instance of the fleet: list, load and unload LoRA adapters, canary requests.

Endpoints and their behaviour (vLLM 0.32 CPU, measured; docs/vllm.md):
- `GET /version`: `{"version": "0.32.0"}` (nightlies: `0.19.2rc1.dev123+g<sha>`);
- `GET /v1/models`: the base card (`parent: null`, `id` = served model name, `root` = the model
  string given to `vllm serve`) and one card per adapter `{"id": name, "root": lora_path, "parent": <base>}`;
- `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}`: 200 plain text; an
  already-loaded name without `load_inplace` is 400; most rejections are 500 with the worker's
  exception text; a missing `adapter_config.json` is 404. Needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`;
- `POST /v1/unload_lora_adapter {"lora_name"}`: 200;
- `POST /v1/completions`: greedy with `temperature: 0`.

Every request is bounded (`Timeouts`): connect, read, and a longer read for load/unload (the
engine loads in its busy loop; the CPU engine under load takes tens of seconds). Errors name the
instance and the request:
- `Unreachable`: nothing answered (connection refused or reset, connect timeout);
- `Hung` (an `Unreachable`): the instance accepted the connection and sent no answer in time (a
  stopped or wedged process: the kernel still accepts connections for it);
- `InstanceError`: an HTTP error status, with the response text.
`outcome_unknown` is True on an error of a request that changes the instance (load, unload) when
the request may have reached it: a hung instance may still apply it when it resumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from pipeline.config import FleetSection, Instance
from pipeline.errors import Hung, InstanceError, Unreachable, UsageError  # raised by the client


@dataclass(frozen=True)
class Timeouts:
    """Per-request limits, seconds (`fleet.connect_timeout_s`, `fleet.timeout_s`, `fleet.load_timeout_s`)."""

    connect_s: float = 5.0
    read_s: float = 30.0
    load_s: float = 120.0

    @classmethod
    def of(cls, fleet: FleetSection) -> Timeouts:
        return cls(fleet.connect_timeout_s, fleet.timeout_s, fleet.load_timeout_s)

    def httpx(self, read_s: float | None = None) -> httpx.Timeout:
        read = self.read_s if read_s is None else read_s
        return httpx.Timeout(read, connect=self.connect_s)


@dataclass
class Card:
    id: str
    root: str | None
    parent: str | None


class InstanceClient:
    """One instance's OpenAI-compatible API. Use as a context manager (closes the connection pool).

    Args:
        instance: name, base URL and the environment variable holding its API key.
        timeouts: `Timeouts`, or one number: the read timeout of every request, seconds.

    Raises UsageError when `api_key_env` is set but the variable is not.
    """

    def __init__(self, instance: Instance, timeouts: Timeouts | float = Timeouts()):
        self.instance = instance
        self.timeouts = (
            timeouts if isinstance(timeouts, Timeouts) else Timeouts(read_s=timeouts, load_s=timeouts)
        )
        headers = {}
        if instance.api_key_env:
            key = instance.api_key()
            if not key:
                raise UsageError(
                    f"fleet instance {instance.name!r}: environment variable {instance.api_key_env} "
                    f"(fleet.instances[].api_key_env) is not set"
                )
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(
            base_url=instance.url.rstrip("/"), timeout=self.timeouts.httpx(), headers=headers
        )

    def __enter__(self) -> InstanceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    @property
    def name(self) -> str:
        return self.instance.name

    def _request(self, method: str, path: str, changes: bool = False, **kw) -> httpx.Response:
        """One request; `changes`: it changes the instance (load/unload: the longer read timeout)."""
        where = f"{self.instance.name} ({self.instance.url}): {method} {path}"
        if changes:
            kw.setdefault("timeout", self.timeouts.httpx(self.timeouts.load_s))
        try:
            r = self.http.request(method, path, **kw)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise Unreachable(f"{where}: unreachable ({type(e).__name__}: {e})") from e
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as e:
            limit = self.timeouts.load_s if changes else self.timeouts.read_s
            raise Hung(
                f"{where}: accepted the connection but sent no answer within {limit:g} s (hung: a stopped or "
                f"wedged process)"
                + ("; the change may still take effect when it resumes" if changes else ""),
                outcome_unknown=changes,
            ) from e
        except httpx.TransportError as e:
            raise Unreachable(
                f"{where}: connection lost ({type(e).__name__}: {e})", outcome_unknown=changes
            ) from e
        if r.status_code >= 400:
            raise InstanceError(f"{where} -> HTTP {r.status_code}: {r.text.strip()[:400]}", r.status_code)
        return r

    def models(self) -> list[Card]:
        """All cards of `GET /v1/models` (base first, then adapters)."""
        data = self._request("GET", "/v1/models").json().get("data", [])
        return [Card(c["id"], c.get("root"), c.get("parent")) for c in data]

    def base_cards(self) -> list[Card]:
        """The served model's cards (`parent` null): `id` the served name, `root` the `vllm serve` model."""
        return [c for c in self.models() if c.parent is None]

    def adapters(self) -> dict[str, str | None]:
        """{adapter name: lora_path} of the adapters this instance serves (cards with a parent)."""
        return {c.id: c.root for c in self.models() if c.parent is not None}

    def load(self, name: str, path: str, inplace: bool = False) -> None:
        """Load adapter `name` from `path` (absolute, as the instance sees it).

        `inplace=True` re-points an already-loaded name; only the `repoint` swap strategy does,
        with a NEW path, on versions where that is safe (`pipeline.serving.swap`).
        """
        body = {"lora_name": name, "lora_path": path}
        if inplace:
            body["load_inplace"] = True
        self._request("POST", "/v1/load_lora_adapter", changes=True, json=body)

    def unload(self, name: str) -> None:
        self._request("POST", "/v1/unload_lora_adapter", changes=True, json={"lora_name": name})

    def complete(self, model: str, prompt: str, max_tokens: int = 8) -> str:
        """Greedy completion text of `prompt` by `model` (the base's served name or an adapter name)."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return self._request("POST", "/v1/completions", json=body).json()["choices"][0]["text"]

    def completion(self, model: str, prompt: str | list[int], max_tokens: int, **params) -> dict:
        """The whole `/v1/completions` reply (greedy: temperature 0) for a text or token-id prompt.

        `params` go into the request body as they are, e.g. `logprobs=5` (top-5 logprobs per
        generated token), `return_tokens_as_token_ids=True` (tokens as "token_id:N").
        """
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **params}
        return self._request("POST", "/v1/completions", json=body).json()

    def prompt_logprobs(self, model: str, ids: list[int]) -> list[float | None]:
        """Teacher-forced log-probabilities of `ids` under `model`: element j is log p(ids[j] | ids[:j]) (nats).

        Element 0 is None (no context). One completion request with `prompt_logprobs: 0` and
        `max_tokens: 1` (vLLM returns, per prompt position, `{token id: {"logprob", "rank", ...}}`
        holding the prompt's own token; -inf comes back as -9999.0:
        `vllm/entrypoints/openai/completion/protocol.py`, `generate/base/serving.py`
        `clamp_prompt_logprobs`, 0.25.1; the same in 0.32). Such requests do not read the prefix
        cache (`sampling_params.py`: `skip_reading_prefix_cache`), so they are computed afresh.
        """
        reply = self.completion(model, ids, 1, prompt_logprobs=0)
        rows = reply["choices"][0].get("prompt_logprobs") or []
        if len(rows) != len(ids):
            raise InstanceError(
                f"{self.instance.name} ({self.instance.url}): prompt_logprobs of {model} has {len(rows)} "
                f"entries for {len(ids)} prompt tokens"
            )
        out: list[float | None] = []
        for tok, row in zip(ids, rows, strict=True):
            entry = (row or {}).get(str(tok))
            out.append(None if entry is None else float(entry["logprob"]))
        return out

    def metrics_text(self) -> str:
        """The Prometheus text of `GET /metrics` (vLLM's counters and histograms)."""
        return self._request("GET", "/metrics").text

    def version(self) -> str | None:
        """vLLM's version from `GET /version` (None when the endpoint answers with an error).

        Raises Unreachable / Hung when the instance does not answer.
        """
        try:
            return self._request("GET", "/version").json().get("version")
        except Unreachable:
            raise
        except (InstanceError, ValueError):
            return None

    def healthy(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False
