"""Regenerate datasets/agent_chat_{train,validation}.jsonl (deterministic, no downloads).

Agent-style conversations: system prompt, multi-turn user/assistant, tool calls with JSON
arguments, tool results, and reasoning. Run: python scripts/make_sample_dataset.py
"""

import json
import random
from pathlib import Path

CITIES = ["Tokyo", "Osaka", "Sapporo", "Fukuoka", "Kyoto", "Nagoya", "Sendai", "Kobe", "Nara", "Naha"]
TABLES = ["orders", "users", "invoices", "tickets", "events"]
TOPICS = ["lora rank", "prefix caching", "speculative decoding", "kv cache", "tensor parallel", "nvfp4"]
SYSTEM = "You are a careful operations agent. Use tools when they help and answer briefly."


def weather(rng, i):
    city = rng.choice(CITIES)
    temp = rng.randint(-5, 35)
    cond = rng.choice(["sunny", "cloudy", "rain", "snow"])
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is the weather in {city} right now?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": f"I need current weather for {city}.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": city, "unit": "celsius"}},
                }
            ],
        },
        {
            "role": "tool",
            "name": "get_weather",
            "content": json.dumps({"city": city, "temp_c": temp, "condition": cond}),
        },
        {"role": "assistant", "content": f"It is {temp} C and {cond} in {city}."},
    ]


def sql(rng, i):
    table = rng.choice(TABLES)
    n = rng.randint(1, 900)
    day = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"How many rows in {table} were created on {day}?"},
        {
            "role": "assistant",
            "content": "Let me count them.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": "run_sql",
                        "arguments": {
                            "query": f"SELECT count(*) FROM {table} WHERE created::date = '{day}'",
                            "limit": 1,
                        },
                    },
                }
            ],
        },
        {"role": "tool", "name": "run_sql", "content": json.dumps({"rows": [[n]]})},
        {"role": "assistant", "content": f"{n} rows in {table} were created on {day}."},
        {"role": "user", "content": "Thanks. Is that more than usual?"},
        {
            "role": "assistant",
            "content": "I only have that one day; compare it with a weekly average to tell.",
        },
    ]


def docs(rng, i):
    topic = rng.choice(TOPICS)
    k = rng.randint(1, 5)
    return [
        {"role": "user", "content": f"Find docs about {topic}."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "search_docs", "arguments": {"query": topic, "top_k": k}},
                }
            ],
        },
        {
            "role": "tool",
            "name": "search_docs",
            "content": json.dumps({"hits": [f"{topic} guide part {j}" for j in range(1, k + 1)]}),
        },
        {"role": "assistant", "content": f"I found {k} pages about {topic}; start with part 1."},
    ]


def ticket(rng, i):
    sev = rng.choice(["low", "medium", "high"])
    svc = rng.choice(["gateway", "trainer", "registry", "vllm-0", "vllm-1"])
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"The {svc} service keeps restarting. Open a {sev} ticket."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Open a ticket with the service and severity.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": "create_ticket",
                        "arguments": {
                            "service": svc,
                            "severity": sev,
                            "title": f"{svc} restarting",
                            "tags": ["ops", svc],
                        },
                    },
                }
            ],
        },
        {"role": "tool", "name": "create_ticket", "content": json.dumps({"id": 1000 + i, "status": "open"})},
        {"role": "assistant", "content": f"Opened ticket {1000 + i} ({sev}) for {svc}."},
    ]


def chat(rng, i):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return [
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {
            "role": "assistant",
            "content": f"{a} plus {b} is {a + b}.",
            "reasoning_content": f"{a}+{b}={a + b}",
        },
        {"role": "user", "content": "And times two?"},
        {"role": "assistant", "content": f"{2 * (a + b)}."},
    ]


KINDS = [weather, sql, docs, ticket, chat]


def build(seed: int, n: int, offset: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"messages": KINDS[(i + offset) % len(KINDS)](rng, i + offset)} for i in range(n)]


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "datasets"
    out.mkdir(exist_ok=True)
    train, seen = [], set()
    for r in build(1, 240, 0):  # unique conversations only (duplicates would only be warned about)
        key = json.dumps(r, sort_keys=True)
        if key not in seen and len(train) < 120:
            seen.add(key)
            train.append(r)
    # validation: disjoint from train (an overlap would leak into eval loss)
    validation = [r for r in build(2, 40, 5000) if json.dumps(r, sort_keys=True) not in seen][:20]
    for name, rows in (("train", train), ("validation", validation)):
        with open(out / f"agent_chat_{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        print(f"wrote {len(rows)} conversations to {out / f'agent_chat_{name}.jsonl'}")


if __name__ == "__main__":
    main()
