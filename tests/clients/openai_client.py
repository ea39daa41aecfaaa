"""Drives a running `kvq serve` with the official `openai` Python package.

Usage: python3 openai_client.py BASE_URL   (e.g. http://127.0.0.1:8080)
Prints one line per check and a closing 'N passed, M failed'; exits non-zero on any failure.
"""

import sys
import traceback

import openai
from openai import OpenAI

BASE = sys.argv[1].rstrip("/")
client = OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=120)
MODEL = client.models.list().data[0].id
HEADERS = {"x-kv-cache-method": "fp16"}
MESSAGES = [{"role": "user", "content": "Name a primary color."}]
results = []


def check(fn):
    try:
        fn()
        results.append(True)
        print(f"ok   {fn.__name__}")
    except Exception:  # noqa: BLE001 - report every failure and keep going
        results.append(False)
        print(f"FAIL {fn.__name__}")
        traceback.print_exc()
    return fn


@check
def chat_non_streaming():
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16, extra_headers=HEADERS
    )
    assert raw.headers.get("x-kv-cache-method") == "fp16", raw.headers
    r = raw.parse()
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content, r
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert (r.usage.model_extra or {}).get("kv_cache_bytes", 0) > 0, r.usage


@check
def chat_streaming_matches_non_streaming():
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16, extra_headers=HEADERS
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=HEADERS,
    )
    parts, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert roles == ["assistant"], roles
    assert "".join(parts) == full.choices[0].message.content, (parts, full)
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


@check
def completions_endpoint():
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"


@check
def unknown_cache_method_is_a_400_listing_valid_names():
    try:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-kv-cache-method": "bogus"}
        )
    except openai.BadRequestError as e:
        assert e.status_code == 400
        err = e.body if isinstance(e.body, dict) else {}
        assert err.get("type") == "invalid_request_error", e.body
        assert "fp16" in err.get("message", ""), e.body
    else:
        raise AssertionError("expected a 400")


@check
def unknown_model_is_a_404():
    try:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    except openai.NotFoundError as e:
        assert e.status_code == 404
    else:
        raise AssertionError("expected a 404")


passed = sum(results)
failed = len(results) - passed
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
