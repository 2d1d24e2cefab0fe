"""Two stand-in tasks with a held-out metric, for adapters trained on a stand-in base (`pipeline dev task-data`).

An adapter must change something measurable for "does the fleet serve it as trained" to have an answer
beyond token parity (issue 36 item 2). Both tasks are generated here, deterministically from a seed, as
chat-format JSONL (`{"messages": [...]}`, the format `datasets/` and axolotl's `chat_template` type read):

- `toolcall`: a user asks for the weather, a currency conversion or a documentation search in free words; the
  assistant answers with one tool call in the chat template's format (`tool_calls` in the message, rendered
  by the template). Values (cities, amounts, currencies, queries) are copied from the request; the held-out
  split uses cities and queries the training split never shows. Metric: `tool_call` (parse rate, exact match).
- `snake`: "Name this as a Python identifier: maximum retry count" -> `maximum_retry_count`. The held-out
  split uses word combinations the training split never shows. Metric: `exact_match`.

`pipeline.canary.task` scores them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pipeline.artifacts.atomic import write_text_atomic
from pipeline.errors import UsageError

TASKS = {"toolcall": "tool_call", "snake": "exact_match"}  # task -> its metric (pipeline.canary.task.KINDS)

_CITIES = (
    "Sapporo Sendai Tokyo Yokohama Nagoya Kyoto Osaka Kobe Hiroshima Fukuoka Naha Kanazawa Niigata Nara Kochi "
    "Paris Lyon Berlin Munich Hamburg Vienna Zurich Geneva Madrid Lisbon Rome Milan Oslo Helsinki Dublin Prague "
    "Warsaw Budapest Athens Cairo Nairobi Lagos Mumbai Delhi Seoul Busan Taipei Manila Jakarta Sydney Perth "
    "Toronto Chicago Denver Boston Seattle Austin Lima Bogota Quito"
).split()
_CURRENCIES = "USD EUR JPY GBP CHF CAD AUD KRW INR SEK NOK".split()
_TOPICS = (
    "retry policy|connection pool|rate limits|token refresh|cache eviction|log rotation|schema migration|"
    "backup restore|health checks|load balancing|batch size|memory limits|timeouts|error codes|pagination|"
    "webhooks|feature flags|access tokens|file uploads|audit logs|dead letter queue|circuit breaker|"
    "graceful shutdown|hot reload|config overlay|lora adapters|model registry|canary release|rollback plan|"
    "speculative decoding|kv cache|prefix caching|chunked prefill|quantization|tensor parallel"
).split("|")
_WORDS = (
    "max min total count retry delay timeout batch size user name file path cache key value token index "
    "buffer queue limit rate window step epoch learning loss grad norm scale shard rank alpha layer head "
    "hidden state input output prefix suffix start end first last next prev block page chunk seed version "
    "alias model base adapter weight bias config record event hook request response header body status "
    "error code message level depth width height length offset cursor"
).split()

_WEATHER = (
    "What is the weather in {city} right now?",
    "How warm is it in {city} today, in {unit}?",
    "Check the weather for {city} please ({unit}).",
    "Is it raining in {city}? Give me {unit}.",
    "weather {city} {unit}",
)
_CONVERT = (
    "Convert {amount} {src} to {dst}.",
    "How much is {amount} {src} in {dst}?",
    "I have {amount} {src}; what is that in {dst}?",
    "{amount} {src} to {dst} please",
)
_SEARCH = (
    "Find the docs about {topic}.",
    "Search the documentation for {topic}.",
    "Where is {topic} explained in the docs?",
    "docs: {topic}",
)
_SNAKE = (
    "Name this as a Python identifier: {words}",
    "Give the snake_case variable name for: {words}",
    "snake_case: {words}",
)
SYSTEM = {
    "toolcall": "You are an operations agent. Tools: get_weather(city, unit), convert_currency(amount, "
    "from_currency, to_currency), search_docs(query). Answer every request with one tool call.",
    "snake": "You turn descriptions into Python identifiers. Answer with the identifier only.",
}


def _toolcall(rng: random.Random, cities: list[str], topics: list[str]) -> dict:
    kind = rng.choice(("weather", "convert", "search"))
    if kind == "weather":
        city, unit = rng.choice(cities), rng.choice(("celsius", "fahrenheit"))
        user = rng.choice(_WEATHER).format(city=city, unit=unit)
        if "{unit}" not in user and unit == "fahrenheit":
            unit = "celsius"  # the request names no unit: the default
        call = {"name": "get_weather", "arguments": {"city": city, "unit": unit}}
    elif kind == "convert":
        src, dst = rng.sample(_CURRENCIES, 2)
        amount = rng.choice((rng.randint(1, 999), rng.randint(1000, 99999)))
        user = rng.choice(_CONVERT).format(amount=amount, src=src, dst=dst)
        call = {
            "name": "convert_currency",
            "arguments": {"amount": amount, "from_currency": src, "to_currency": dst},
        }
    else:
        topic = rng.choice(topics)
        user = rng.choice(_SEARCH).format(topic=topic)
        call = {"name": "search_docs", "arguments": {"query": topic}}
    return {
        "messages": [
            {"role": "system", "content": SYSTEM["toolcall"]},
            {"role": "user", "content": user},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        ]
    }


def _snake(rng: random.Random, words: tuple[str, ...]) -> dict:
    user = rng.choice(_SNAKE).format(words=" ".join(words))
    return {
        "messages": [
            {"role": "system", "content": SYSTEM["snake"]},
            {"role": "user", "content": user},
            {"role": "assistant", "content": "_".join(words)},
        ]
    }


def generate(task: str, n_train: int = 1200, n_validation: int = 64, seed: int = 0) -> tuple[list, list]:
    """(train, validation) conversations of `task`; validation never shows a training city/topic/word combination.

    Raises UsageError for an unknown task."""
    if task not in TASKS:
        raise UsageError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
    rng = random.Random(f"{task}:{seed}")
    if task == "toolcall":
        cities, topics = list(_CITIES), list(_TOPICS)
        rng.shuffle(cities)
        rng.shuffle(topics)
        held_c, held_t = cities[:10], topics[:6]
        train = [_toolcall(rng, cities[10:], topics[6:]) for _ in range(n_train)]
        # held out: only unseen cities and topics (currency amounts are drawn fresh)
        val = [_toolcall(rng, held_c, held_t) for _ in range(n_validation)]
        return train, val
    seen: set[tuple[str, ...]] = set()

    def combo() -> tuple[str, ...]:
        return tuple(rng.sample(_WORDS, rng.choice((2, 2, 3, 3, 4))))

    train = []
    while len(train) < n_train:
        w = combo()
        seen.add(w)
        train.append(_snake(rng, w))
    val = []
    while len(val) < n_validation:
        w = combo()
        if w not in seen:
            seen.add(w)
            val.append(_snake(rng, w))
    return train, val


def write_task_data(
    task: str, out_dir: Path, n_train: int = 1200, n_validation: int = 64, seed: int = 0
) -> dict:
    """Write `{task}_train.jsonl` and `{task}_validation.jsonl` into `out_dir` (each atomically).

    Returns {"train": path, "validation": path, "metric": kind, "n_train", "n_validation"}.
    Raises UsageError for an unknown task or an `out_dir` that is a file."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir} is a file: give a directory for the task data")
    train, val = generate(task, n_train, n_validation, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in (("train", train), ("validation", val)):
        p = out_dir / f"{task}_{split}.jsonl"
        write_text_atomic(p, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        paths[split] = str(p)
    return paths | {"metric": TASKS[task], "n_train": len(train), "n_validation": len(val)}
