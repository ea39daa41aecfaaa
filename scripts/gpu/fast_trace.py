#!/usr/bin/env python3
"""Summarizes KVQ_FAST_TRACE's phase marks (kvq-kernels cuda/trace.rs): for each traced launch of
a version-5 attention kernel, where its time went. Every block's thread 0 marked the global timer
(ns) at start (0), chunk loop start (1) and end (2), slot written (3) and, in the last block of each
kv head, merge done (4), and finer marks between (MARKS). Times are microseconds; (median, max)
over the code-split blocks (every x but the grid's last, which runs the exact rows when the
launch has any); the timeline gives each mark's median time from the block's start (code blocks)
or from its slot mark (merging blocks).

    fast_trace.py TRACE.jsonl [--csv OUT.csv]
"""
import json
import statistics
import sys


# fast.cuh's finer marks.
MARKS = {
    5: "prologue loads done",
    6: "tables built",
    7: "queries rotated",
    8: "warps merged",
    9: "slot stored, fenced",
    10: "merge weights",
    11: "merge sums",
}
SLOTS_TIMER = 15  # slots 0..14 hold timers, 15 the SM id, 16 + ph the clocks


def us(a, b):
    return (b - a) / 1e3


def summarize(rec):
    parts = rec["launch"].split()
    name, gx, gy, gz = parts[:4]
    rows = parts[4] if len(parts) > 4 else "-"
    gx, gy, gz = int(gx), int(gy), int(gz)
    s = rec["slots"]
    m = rec["marks"]
    blocks = []
    for i in range(gx * gy * gz):
        r = m[i * s:(i + 1) * s]
        if r[0] == 0:
            continue  # never marked (should not happen: every block marks its start)
        if s == 12:  # the first layout: five phases, SM id, five clocks
            blocks.append({"x": i % gx, "t": r[0:5] + [0] * 10, "sm": r[5],
                           "c": r[6:11] + [0] * 10})
        else:
            blocks.append({"x": i % gx, "t": r[0:SLOTS_TIMER], "sm": r[SLOTS_TIMER],
                           "c": r[16:16 + SLOTS_TIMER]})
    t0 = min(b["t"][0] for b in blocks)
    end = max(max(b["t"][3], b["t"][4]) for b in blocks)
    code = [b for b in blocks if b["x"] != gx - 1] or blocks
    last_x = [b for b in blocks if b["x"] == gx - 1]

    def stat(bs, a, z):
        v = [us(b["t"][a], b["t"][z]) for b in bs if b["t"][a] and b["t"][z]]
        if not v:
            return "-", "-"
        return f"{statistics.median(v):.2f}", f"{max(v):.2f}"

    merges = [b for b in blocks if b["t"][4]]
    clk = []
    for b in code:
        dt = b["t"][2] - b["t"][1]
        if dt > 2000:
            clk.append((b["c"][2] - b["c"][1]) / dt)
    row = {
        "launch": name,
        "grid": f"{gx}x{gy}x{gz}",
        "rows": rows,
        "span": f"{us(t0, end):.2f}",
        "start_skew": f"{us(t0, max(b['t'][0] for b in blocks)):.2f}",
        "prologue": stat(code, 0, 1),
        "loop": stat(code, 1, 2),
        "to_slot": stat(code, 2, 3),
        "last_x_total": stat(last_x, 0, 3),
        "slots_done": f"{us(t0, max(b['t'][3] for b in blocks)):.2f}",
        "merge": f"{max(us(b['t'][3], b['t'][4]) for b in merges):.2f}" if merges else "-",
        "ghz": f"{statistics.median(clk):.2f}" if clk else "-",
        "sms": len({b["sm"] for b in blocks}),
    }
    line = []
    for ph in [5, 6, 7, 1, 2, 8, 9, 3]:
        v = [us(b["t"][0], b["t"][ph]) for b in code if b["t"][ph]]
        if v:
            line.append(f"{ph}:{statistics.median(v):.2f}")
    mline = []
    for ph in [10, 11, 4]:
        v = [us(b["t"][3], b["t"][ph]) for b in merges if b["t"][ph]]
        if v:
            mline.append(f"{ph}:{statistics.median(v):.2f}")
    row["timeline"] = "code " + " ".join(line) + " | merging " + " ".join(mline)
    return row


def cell(v):
    """A summary value as printed: (median, max) pairs as median/max."""
    return f"{v[0]}/{v[1]}" if isinstance(v, tuple) else str(v)


def main():
    path = sys.argv[1]
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(summarize(json.loads(line)))
    cols = ["launch", "grid", "rows", "span", "start_skew", "prologue", "loop", "to_slot",
            "last_x_total", "slots_done", "merge", "ghz", "sms"]
    print("us from the first block's start; (median, max) over code-split blocks; last_x: the "
          "grid's last x blocks (the exact rows when the launch had any); slots_done: the last "
          "block's slot written; merge: the longest last-block merge")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(cell(r[c]) for c in cols))
        print("   timeline (us):", r["timeline"])
    print("marks:", ", ".join(f"{k} {v}" for k, v in MARKS.items()))
    if "--csv" in sys.argv:
        out = sys.argv[sys.argv.index("--csv") + 1]
        with open(out, "w") as f:
            f.write(",".join(cols) + "\n")
            for r in rows:
                f.write(",".join(cell(r[c]) for c in cols) + "\n")


if __name__ == "__main__":
    main()
