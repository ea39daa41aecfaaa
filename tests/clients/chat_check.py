#!/usr/bin/env python3
"""Streams one chat answer (or, with --completion, one text completion) per KV cache method
through the official openai client and checks that each contains every expected substring.

Usage: chat_check.py [--completion] BASE_URL PROMPT EXPECT[|EXPECT...] METHOD [METHOD...]
Prints each answer, then "N passed, M failed"; exits non-zero on any failure.
"""
import sys

from openai import OpenAI


def main() -> int:
    args = sys.argv[1:]
    completion = bool(args) and args[0] == "--completion"
    if completion:
        args = args[1:]
    base, prompt, expect, methods = args[0], args[1], args[2].split("|"), args[3:]
    client = OpenAI(base_url=base + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    passed = failed = 0
    for method in methods:
        headers = {"x-kv-cache-method": method}
        if completion:
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                extra_headers=headers,
            )
            text = "".join(c.choices[0].text or "" for c in stream if c.choices)
        else:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=96,
                temperature=0,
                stream=True,
                extra_headers=headers,
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
