#!/usr/bin/env python3
"""Where two greedy runs of `kvq generate --logprobs-out` part, and whether it is a near-tie.

    e2e_diverge.py A.jsonl B.jsonl   prints one line: `equal N` when every token agrees, else
    `token I: A picks X (lp) over Y (lp), gap G; B picks ... gap G` (the gap of the top two
    logprobs is the gap of their logits: the softmax's normalizer cancels)."""
import json
import sys


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pick(row):
    top = row["top"]
    first = f"{top[0]['token']!r} ({top[0]['logprob']:.4f})"
    if len(top) < 2:
        return first, float("nan")
    second = f"{top[1]['token']!r} ({top[1]['logprob']:.4f})"
    return f"{first} over {second}", top[0]["logprob"] - top[1]["logprob"]


def main():
    a, b = load(sys.argv[1]), load(sys.argv[2])
    for i, (x, y) in enumerate(zip(a, b)):
        if x["id"] != y["id"]:
            pa, ga = pick(x)
            pb, gb = pick(y)
            print(f"token {i}: A picks {pa}, gap {ga:.4f}; B picks {pb}, gap {gb:.4f}")
            return
    if len(a) != len(b):
        print(f"equal for {min(len(a), len(b))} tokens, then one run stopped ({len(a)} vs {len(b)})")
    else:
        print(f"equal {len(a)}")


if __name__ == "__main__":
    main()
