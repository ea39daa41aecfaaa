#!/usr/bin/env python3
"""Streams one chat answer (or, with --completion, one text completion) per KV cache method
through the official openai client and checks that each contains every expected substring.

Usage: chat_check.py [--completion] [--ends] BASE_URL PROMPT EXPECT[|EXPECT...] METHOD [METHOD...]
With --ends an answer must also end by itself (finish_reason "stop"), not at max_tokens.
Prints each answer, then "N passed, M failed"; exits non-zero on any failure.
"""
import sys

from openai import OpenAI


def main() -> int:
    args = sys.argv[1:]
    flags = set()
    while args and args[0].startswith("--"):
        flags.add(args.pop(0))
    completion, ends = "--completion" in flags, "--ends" in flags
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
            chunks = [c.choices[0] for c in stream if c.choices]
            text = "".join(c.text or "" for c in chunks)
        else:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=96,
                temperature=0,
                stream=True,
                extra_headers=headers,
            )
            chunks = [c.choices[0] for c in stream if c.choices]
            text = "".join(c.delta.content or "" for c in chunks)
        finish = next((c.finish_reason for c in chunks if c.finish_reason), None)
        missing = [e for e in expect if e not in text]
        print(f"--- {method} (finish_reason {finish}):\n{text}\n")
        if missing or (ends and finish != "stop"):
            print(f"FAIL {method}: missing {missing}, finish_reason {finish}")
            failed += 1
        else:
            passed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
