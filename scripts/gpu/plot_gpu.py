#!/usr/bin/env python3
# Plots kvq GPU decode-attention results: speedup over torch SDPA (flash/cuDNN) and achieved GB/s, per (shape, batch).
"""Draws kvq's GPU attention rows against the torch SDPA baselines.

    python3 scripts/gpu/plot_gpu.py --attention FILE.json --out SPEEDUP.png \
        [--bandwidth BW.png] [--copy-gbps 4300]

FILE.json is a list of objects with at least: shape, batch, positions, method ("fp16" or a
preset name such as "turboquant-mse-4bit"), us, torch_flash_us, torch_cudnn_us, kv_bytes, gbps.
A JSON object holding such a list under "attention" or "rows" is accepted too.

SPEEDUP.png: one subplot per (shape, batch); x = positions (log2), y = the faster of
torch_flash_us / torch_cudnn_us divided by us; one line per method; dashed line at 1.0.
BW.png (optional): the same grid with y = gbps, and a horizontal line at --copy-gbps.
"""

import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attention", required=True, help="JSON list of attention result rows")
    p.add_argument("--out", required=True, help="speedup PNG to write")
    p.add_argument("--bandwidth", help="optional second PNG: achieved GB/s per method")
    p.add_argument("--copy-gbps", type=float, help="device copy bandwidth (GB/s) drawn on the bandwidth plot")
    p.add_argument("--title", help="figure title (default: derived from the file name)")
    return p.parse_args(argv)


def load_rows(path):
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        for key in ("attention", "rows", "results"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            sys.exit(f"{path}: expected a JSON list of rows (or an object with an 'attention' list)")
    rows = []
    for r in data:
        if not isinstance(r, dict) or not all(k in r for k in ("shape", "batch", "positions", "method")):
            continue
        rows.append(r)
    if not rows:
        sys.exit(f"{path}: no rows with shape, batch, positions and method")
    return rows


def num(v):
    """A positive finite float, else None."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) and f > 0 else None


def speedup(r):
    us = num(r.get("us"))
    base = [b for b in (num(r.get("torch_flash_us")), num(r.get("torch_cudnn_us"))) if b is not None]
    if us is None or not base:
        return None
    return min(base) / us


def pos_label(n):
    n = int(n)
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def method_order(rows):
    """fp16 first, then the others in order of first appearance."""
    seen = []
    for r in rows:
        if r["method"] not in seen:
            seen.append(r["method"])
    return sorted(seen, key=lambda m: (m != "fp16", seen.index(m)))


def panel_keys(rows):
    shapes, batches = [], []
    for r in rows:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
        if int(r["batch"]) not in batches:
            batches.append(int(r["batch"]))
    keys = [(s, b) for s in shapes for b in sorted(batches)
            if any(r["shape"] == s and int(r["batch"]) == b for r in rows)]
    return keys


def styles(methods):
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    return {m: dict(color=cmap(i % cmap.N), marker=MARKERS[i % len(MARKERS)]) for i, m in enumerate(methods)}


def draw(rows, value, ylabel, out, title, hline=None, hline_label=None, log_y=False):
    methods = method_order(rows)
    sty = styles(methods)
    keys = panel_keys(rows)
    ncols = 2 if len(keys) > 1 else 1
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.2 * nrows), squeeze=False)
    all_pos = sorted({int(r["positions"]) for r in rows})
    plotted = set()
    for ax, (shape, batch) in zip(axes.flat, keys):
        top = hline or 0.0
        for m in methods:
            pts = {}
            for r in rows:  # a later row for the same point replaces an earlier one
                if r["shape"] == shape and int(r["batch"]) == batch and r["method"] == m:
                    y = value(r)
                    if y is not None:
                        pts[int(r["positions"])] = y
            if not pts:
                continue
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], label=m, linewidth=1.6, markersize=6, **sty[m])
            plotted.add(m)
            top = max(top, max(pts.values()))
        if hline is not None:
            ax.axhline(hline, color="0.3", linestyle="--", linewidth=1.1, zorder=1)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(all_pos))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(all_pos, [pos_label(p) for p in all_pos])
        if len(all_pos) > 1:
            ax.set_xlim(all_pos[0] / 1.25, all_pos[-1] * 1.25)
        if log_y:
            ax.set_yscale("log", base=2)
        ax.set_xlabel("positions (context length)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{shape}, batch {batch}")
        ax.grid(True, which="major", alpha=0.3)
        if not log_y:
            ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    handles = [Line2D([], [], linewidth=1.6, markersize=6, label=m, **sty[m]) for m in methods if m in plotted]
    if hline is not None and hline_label:
        handles.append(Line2D([], [], color="0.3", linestyle="--", linewidth=1.1, label=hline_label))
    ncol = min(len(handles), 2 * ncols) or 1
    legend_rows = math.ceil(len(handles) / ncol)
    fig.suptitle(title, fontsize=12)
    bottom = 0.04 + 0.045 * legend_rows / nrows
    fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    fig.savefig(out, dpi=150)
    plt.close(fig)
    print(f"wrote {out}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    rows = load_rows(args.attention)
    title = args.title or args.attention.rsplit("/", 1)[-1]
    draw(rows, speedup, "speedup vs faster of torch flash/cuDNN", args.out,
         f"Decode attention speedup vs torch SDPA ({title})", hline=1.0, hline_label="torch SDPA (1.0)")
    if args.bandwidth:
        copy_label = f"device copy {args.copy_gbps:.0f} GB/s" if args.copy_gbps else None
        draw(rows, lambda r: num(r.get("gbps")), "achieved GB/s", args.bandwidth,
             f"Decode attention bandwidth ({title})", hline=args.copy_gbps, hline_label=copy_label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
