"""HTTP client for one vLLM instance of the fleet: list, load and unload LoRA adapters, canary requests.

Endpoints and their behaviour (vLLM 0.32 CPU, measured; docs/vllm.md):
- `GET /v1/models`: the base card (`parent: null`) and one card per adapter
  `{"id": name, "root": lora_path, "parent": <served base name>}`;
- `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}`: 200 plain text; an
  already-loaded name without `load_inplace` is 400; most rejections are 500 with the worker's
  exception text; a missing `adapter_config.json` is 404. Needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`;
- `POST /v1/unload_lora_adapter {"lora_name"}`: 200;
- `POST /v1/completions`: greedy with `temperature: 0`.

Errors: `Unreachable` (connection refused, timeout) and `InstanceError` (an HTTP error status,
with the response text) name the instance and the request.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from pipeline.config import Instance
from pipeline.errors import UsageError


class InstanceError(Exception):
    """A request to an instance failed; the message names the instance, request and reply."""


class Unreachable(InstanceError):
    """The instance did not answer (connection refused, reset, or timed out)."""


@dataclass
class Card:
    id: str
    root: str | None
    parent: str | None


class InstanceClient:
    """One instance's OpenAI-compatible API. Use as a context manager (closes the connection pool).

    Args:
        instance: name, base URL and the environment variable holding its API key.
        timeout_s: per-request timeout, seconds.

    Raises UsageError when `api_key_env` is set but the variable is not.
    """

    def __init__(self, instance: Instance, timeout_s: float = 30.0):
        self.instance = instance
        headers = {}
        if instance.api_key_env:
            key = instance.api_key()
            if not key:
                raise UsageError(
                    f"fleet instance {instance.name!r}: environment variable {instance.api_key_env} "
                    f"(fleet.instances[].api_key_env) is not set"
                )
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(base_url=instance.url.rstrip("/"), timeout=timeout_s, headers=headers)

    def __enter__(self) -> InstanceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    @property
    def name(self) -> str:
        return self.instance.name

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        where = f"{self.instance.name} ({self.instance.url}): {method} {path}"
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise Unreachable(f"{where}: unreachable ({type(e).__name__}: {e})") from e
        if r.status_code >= 400:
            raise InstanceError(f"{where} -> HTTP {r.status_code}: {r.text.strip()[:400]}")
        return r

    def models(self) -> list[Card]:
        """All cards of `GET /v1/models` (base first, then adapters)."""
        data = self._request("GET", "/v1/models").json().get("data", [])
        return [Card(c["id"], c.get("root"), c.get("parent")) for c in data]

    def adapters(self) -> dict[str, str | None]:
        """{adapter name: lora_path} of the adapters this instance serves (cards with a parent)."""
        return {c.id: c.root for c in self.models() if c.parent is not None}

    def load(self, name: str, path: str, inplace: bool = False) -> None:
        """Load adapter `name` from `path` (absolute, as the instance sees it).

        `inplace=True` re-points an already-loaded name; use a NEW path (vLLM keys its prefix
        cache on name and path, so the same path would reuse KV computed with old weights).
        """
        self._request(
            "POST",
            "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": path, "load_inplace": inplace},
        )

    def unload(self, name: str) -> None:
        self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

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

    def metrics_text(self) -> str:
        """The Prometheus text of `GET /metrics` (vLLM's counters and histograms)."""
        return self._request("GET", "/metrics").text

    def version(self) -> str | None:
        """vLLM's version from `GET /version` (None when the endpoint is absent)."""
        try:
            return self._request("GET", "/version").json().get("version")
        except InstanceError:
            return None

    def healthy(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False
