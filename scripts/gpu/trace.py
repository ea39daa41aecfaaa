#!/usr/bin/env python3
"""Summarizes an Nsight Compute CSV of `gpu__time_duration.sum` over every kernel of a run
(scripts/gpu-suite profile): the kernels launched between the last two timing spins (one timed
batch of calls), counted and timed per kernel name, and the mean GPU time per call."""
import csv
import sys
from collections import OrderedDict


def main(path: str) -> None:
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "ns")
        v = float(r["Metric Value"].replace(",", ""))
        ns = v * {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(unit, 1)
        rows.append((r["Kernel Name"], r.get("Grid Size", ""), r.get("Block Size", ""), ns))
    if not rows:
        print(f"{path}: no kernel rows")
        return
    spins = [i for i, r in enumerate(rows) if r[0].startswith("kvq_spin")]
    if len(spins) >= 2:
        lo, hi = spins[-2] + 1, spins[-1]
    elif spins:
        lo, hi = spins[-1] + 1, len(rows)
    else:
        lo, hi = max(0, len(rows) - 40), len(rows)
    window = rows[lo:hi]
    per = OrderedDict()
    for name, grid, block, ns in window:
        key = (name.split("(")[0], grid, block)
        n, t = per.get(key, (0, 0.0))
        per[key] = (n + 1, t + ns)
    calls = max((n for n, _ in per.values()), default=1)
    print(f"{len(rows)} kernels profiled; one timed batch: {len(window)} launches, ~{calls} calls")
    print(f"{'kernel':<40} {'grid':>16} {'block':>12} {'launches':>8} {'mean us':>9}")
    total = 0.0
    for (name, grid, block), (n, t) in per.items():
        total += t
        print(f"{name[:40]:<40} {grid:>16} {block:>12} {n:>8} {t / n / 1e3:>9.2f}")
    print(f"GPU time per call (sum of kernel durations / calls): {total / calls / 1e3:.2f} us")


if __name__ == "__main__":
    main(sys.argv[1])
