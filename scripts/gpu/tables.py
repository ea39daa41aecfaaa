#!/usr/bin/env python3
"""Markdown tables of gpu-attention.json (the kernel benchmark's rows), as docs/benchmarks/gpu.md
shows them: per shape and batch, one row per method, for each context length the microseconds
per layer call, the speed-up over the faster torch fp16 kernel and the GB/s of the bytes the
kernel must read.

    python3 scripts/gpu/tables.py docs/benchmarks/gpu-attention.json [--compare OTHER.json]

With --compare, a second table per shape and batch gives this file's speed-up over OTHER's
times (same configurations), e.g. a kernel version against the previous one.
"""

import argparse
import json
from collections import OrderedDict


def num(v):
    return v if isinstance(v, (int, float)) else None


def key(r):
    return (r["shape"], r["batch"], r["positions"], r["method"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("attention")
    p.add_argument("--compare", help="an earlier gpu-attention.json to compare times with")
    a = p.parse_args()
    rows = json.load(open(a.attention))
    old = {key(r): r for r in json.load(open(a.compare))} if a.compare else {}
    groups = OrderedDict()
    for r in rows:
        groups.setdefault((r["shape"], r["batch"]), []).append(r)
    for (shape, batch), rs in groups.items():
        positions = sorted({r["positions"] for r in rs})
        methods = list(OrderedDict.fromkeys(r["method"] for r in rs))
        at = {(r["method"], r["positions"]): r for r in rs}
        print(f"\n**{shape}, batch {batch}** (us per layer call; x = faster torch fp16 kernel / kvq;"
              " GB/s = bytes the kernel must read / time)\n")
        head = "| method | " + " | ".join(f"{n // 1024}k us | x | GB/s" for n in positions) + " |"
        print(head)
        print("|" + "---|" * (1 + 3 * len(positions)))
        torch = []
        for n in positions:
            r = next((x for x in rs if x["positions"] == n), {})
            f, c = num(r.get("torch_flash_us")), num(r.get("torch_cudnn_us"))
            torch.append(f"{f:.1f} / {c:.1f}" if f and c else (f"{f:.1f} / -" if f else "-"))
        print("| torch flash / cuDNN | " + " | ".join(f"{t} | | " for t in torch) + " |")
        for m in methods:
            cells = []
            for n in positions:
                r = at.get((m, n))
                if r is None:
                    cells.append("- | - | -")
                    continue
                best = [v for v in (num(r.get("torch_flash_us")), num(r.get("torch_cudnn_us"))) if v]
                x = f"{min(best) / r['us']:.2f}" if best else "-"
                cells.append(f"{r['us']:.1f} | {x} | {r['gbps']:.0f}")
            print(f"| {m} | " + " | ".join(cells) + " |")
        if old:
            print(f"\n{shape}, batch {batch}: speed-up over the compared file (its us / these us)\n")
            print("| method | " + " | ".join(f"{n // 1024}k" for n in positions) + " |")
            print("|" + "---|" * (1 + len(positions)))
            for m in methods:
                cells = []
                for n in positions:
                    r, o = at.get((m, n)), old.get((shape, batch, n, m))
                    cells.append(f"{o['us'] / r['us']:.2f}" if r and o else "-")
                print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
