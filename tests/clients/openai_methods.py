"""Every KV cache method through the official `openai` Python package, streaming.

Usage: python3 openai_methods.py BASE_URL METHOD [METHOD ...]
For each method: a streaming chat request with `x-kv-cache-method` whose prompt is longer than
the fp16 window (so compressed codes are really attended), checking the echoed method header,
non-empty text, and `usage.kv_cache_bytes` (smaller than fp16's for compressed methods). Then
all methods at once, in threads: each concurrent stream must equal its solo output (greedy).
Prints one line per check and 'N passed, M failed'; exits non-zero on any failure.
"""

import concurrent.futures
import sys

from openai import OpenAI
from checks import check, finish

BASE = sys.argv[1].rstrip("/")
METHODS = sys.argv[2:]
client = OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=600)
MODEL = client.models.list().data[0].id
# About 150 prompt tokens: well past the 64-token fp16 window.
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him, one hundred and twelve of them, worn smooth in the middle by "
    "a century of boots. At the top he trimmed the wick, polished the great lens until it threw "
    "his own tired face back at him, and lit the lamp. Ships he would never meet turned away "
    "from the rocks because of that light. One night a storm came in from the west, and the "
    "keeper saw a small boat with a red sail fighting the waves near the northern reef. "
)
MESSAGES = [{"role": "user", "content": STORY + "Continue the story in two sentences."}]



def stream(method, max_tokens=24):
    """Streams one greedy chat completion; returns (text, usage, echoed method header)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-kv-cache-method": method},
    )
    echoed = raw.headers.get("x-kv-cache-method")
    parts, usage = [], None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
    return "".join(parts), usage, echoed


solo = {}


def kv_bytes(usage):
    return (usage.model_extra or {}).get("kv_cache_bytes", 0)


for method in METHODS:

    def one(method=method):
        text, usage, echoed = stream(method)
        assert echoed == method, (method, echoed)
        assert text.strip(), f"{method}: empty completion"
        assert usage is not None and usage.completion_tokens > 0, usage
        assert usage.prompt_tokens > 64, f"prompt of {usage.prompt_tokens} tokens fits the window"
        assert kv_bytes(usage) > 0, usage
        solo[method] = (text, kv_bytes(usage))
        print(f"     {method}: {kv_bytes(usage)} KV bytes: {text!r}")

    check(f"stream {method}", one)


def smaller_than_fp16():
    base = solo["fp16"][1]
    for method, (_, b) in solo.items():
        if method not in ("fp16", "f32"):
            assert b < base, f"{method} holds {b} bytes, fp16 {base}"


if "fp16" in solo:
    check("compressed methods hold fewer bytes than fp16", smaller_than_fp16)


def concurrent_equals_solo():
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(METHODS)) as pool:
        futures = {m: pool.submit(stream, m) for m in METHODS}
        for m, f in futures.items():
            text, _, echoed = f.result()
            assert echoed == m
            assert text == solo[m][0], (m, text, solo[m][0])


if len(solo) == len(METHODS):
    check("all methods at once equal their solo outputs", concurrent_equals_solo)

finish()
