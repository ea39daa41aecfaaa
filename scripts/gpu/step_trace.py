#!/usr/bin/env python3
"""Where a decode step's GPU time goes: two Nsight Compute CSVs (`gpu__time_duration.sum` of
every kernel) of the same `kvq bench` run with A and B generated tokens; per kernel name, the
launches and GPU time of the B - A extra decode steps, divided by STEPS (those steps times the
sequences), so prefill and warm-up cancel out.

    python3 scripts/gpu/step_trace.py A.csv B.csv STEPS [LABEL]
"""
import csv
import sys
from collections import defaultdict

UNITS = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}


def kernels(path):
    """{kernel name: (launches, total ns)} of one trace."""
    per = defaultdict(lambda: [0, 0.0])
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        ns = float(r["Metric Value"].replace(",", "")) * UNITS.get(r.get("Metric Unit", "ns"), 1)
        name = r["Kernel Name"].split("(")[0].split("<")[0].strip()
        per[name][0] += 1
        per[name][1] += ns
    return per


def main():
    a, b, steps = kernels(sys.argv[1]), kernels(sys.argv[2]), float(sys.argv[3])
    label = sys.argv[4] if len(sys.argv) > 4 else ""
    rows = []
    for name in set(a) | set(b):
        n = b.get(name, [0, 0.0])[0] - a.get(name, [0, 0.0])[0]
        t = b.get(name, [0, 0.0])[1] - a.get(name, [0, 0.0])[1]
        if n:
            rows.append((t / steps, n / steps, name))
    rows.sort(reverse=True)
    total_t = sum(r[0] for r in rows)
    total_n = sum(r[1] for r in rows)
    print(f"{label}: per decode step (one token of one sequence): {total_n:.1f} launches, "
          f"{total_t / 1e3:.1f} us of GPU time")
    print(f"  {'kernel':<52} {'launches':>9} {'us':>9}")
    for t, n, name in rows[:25]:
        print(f"  {name[:52]:<52} {n:>9.2f} {t / 1e3:>9.2f}")


if __name__ == "__main__":
    main()
