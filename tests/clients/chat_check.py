#!/usr/bin/env python3
"""Streams one chat answer per KV cache method through the official openai client and checks
that each contains every expected substring.

Usage: chat_check.py BASE_URL PROMPT EXPECT[|EXPECT...] METHOD [METHOD...]
Prints each answer, then "N passed, M failed"; exits non-zero on any failure.
"""
import sys

from openai import OpenAI


def main() -> int:
    base, prompt, expect, methods = sys.argv[1], sys.argv[2], sys.argv[3].split("|"), sys.argv[4:]
    client = OpenAI(base_url=base + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    passed = failed = 0
    for method in methods:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=96,
            temperature=0,
            stream=True,
            extra_headers={"x-kv-cache-method": method},
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        missing = [e for e in expect if e not in text]
        print(f"--- {method}:\n{text}\n")
        if missing:
            print(f"FAIL {method}: missing {missing}")
            failed += 1
        else:
            passed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
