#!/usr/bin/env python3
"""Writes docs/benchmarks/cpu-decode-vs-llamacpp.md from a scripts/bench-vs-llamacpp run: the
fp16 baseline's bars with their ratios, the depth table (fp16 and presets against llama.cpp's
f16 and q4_0: prompt, decode, peak RSS) and the short-context table.

Reads DIR/merged.json (the `kvq bench --from-json ... --compare-llama-bench ...` rows),
DIR/commands.txt and DIR/load-{before,after}.txt; describes the machine from lscpu. Stdlib only.
The hand-written "## What limits decode" section (a profile) of an existing doc is kept as is.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys

KEEP_FROM = "## What limits decode"
FLAGS = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
         "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile"]


def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine():
    fields = {}
    for line in sh("lscpu").splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("Flags", "").split())
    have = [f for f in FLAGS if f in flags]
    lacks = [f for f in ("avx2", "avx512f", "avx512_vnni") if f not in flags]
    mem = ""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kb = int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1))
            mem = f"{kb / 1024 / 1024:.0f} GiB"
    except (OSError, AttributeError, ValueError):
        pass
    return {
        "model": fields.get("Model name", "unknown"),
        "cpus": fields.get("CPU(s)", str(os.cpu_count())),
        "arch": fields.get("Architecture", ""),
        "flags": have,
        "lacks": lacks,
        "mem": mem,
    }


def read(path, default=""):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return default


def med(stats):
    return None if not stats else stats["median"]


def fmt(stats):
    if not stats:
        return "-"
    return f"{stats['median']:.1f} ({stats['min']:.1f}–{stats['max']:.1f})"


def ratio(r):
    return "-" if r is None else f"**{r:.2f}×**"


# The depth rows: decoded tokens after the deep prompts, and the shallowest depth.
DEEP_GEN = 64
DEEP_FROM = 2048
# Bars of the fp16 baseline (issue: the fp16 baseline at depth).
DECODE_BAR_DEPTHS = (2048, 4096, 8000)
PROMPT_BAR_LENGTHS = (128, 512)
RSS_BAR_DEPTH = 8000


def order(method):
    """fp16 first, then the presets by name."""
    return (method != "fp16", method)


def mib(b):
    return "-" if not b else f"{b / 2**20:.1f}"


def bars(rows):
    """The fp16 baseline's bars, each with its measured ratio and whether it holds."""
    out = []
    fp16 = [r for r in rows if r["method"] == "fp16" and r.get("llama_cpp")]
    widest = max((r["threads"] for r in fp16), default=0)

    def find(n, deep):
        for r in fp16:
            if r["threads"] == widest and r["prompt_tokens"] == n and (r["gen_tokens"] == DEEP_GEN) == deep:
                return r
        return None

    def verdict(x, ok):
        if x is None:
            return "not measured"
        return f"{x:.2f}×, " + ("holds" if ok(x) else "**missed**")

    for d in DECODE_BAR_DEPTHS:
        r = find(d, True)
        x = r and r["llama_cpp"].get("tg_ratio")
        out.append(f"fp16 decode at depth {d} ≥ llama.cpp f16: {verdict(x, lambda v: v >= 1.0)}")
    for n in PROMPT_BAR_LENGTHS:
        r = find(n, False)
        x = r and r["llama_cpp"].get("pp_ratio")
        out.append(f"fp16 prompt of {n} tokens ≥ llama.cpp f16: {verdict(x, lambda v: v >= 1.0)}")
    r = find(RSS_BAR_DEPTH, True)
    x = r and r["llama_cpp"].get("rss_ratio")
    detail = ""
    if r and r["llama_cpp"].get("peak_rss_bytes"):
        detail = (f" (kvq {mib(r.get('peak_rss_bytes'))} MiB, llama.cpp"
                  f" {mib(r['llama_cpp']['peak_rss_bytes'])} MiB)")
    out.append(f"fp16 peak RSS at {RSS_BAR_DEPTH} + {DEEP_GEN} tokens ≤ llama.cpp f16 (llama-bench):"
               f" {verdict(x, lambda v: v <= 1.0)}{detail}. llama-bench keeps a copy of the"
               " depth's KV state to restore between repetitions, so its peak overstates what"
               " llama.cpp needs; the section below compares with `llama-server` too")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", required=True, help="the run's output folder")
    ap.add_argument("--doc", required=True, help="the Markdown file to write")
    ap.add_argument("--png", required=True, help="the plot's file name, beside the doc")
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--llama-source", default="llama.cpp")
    args = ap.parse_args()

    with open(os.path.join(args.dir, "merged.json"), encoding="utf-8") as f:
        rows = json.load(f)
    if not rows:
        sys.exit("merged.json has no rows")
    m = machine()
    commit = sh("git", "rev-parse", "--short", "HEAD") or "unknown"
    if sh("git", "status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    measured = os.path.getmtime(os.path.join(args.dir, "merged.json"))
    now = datetime.datetime.fromtimestamp(measured, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC")
    first = rows[0]
    ll = next((r["llama_cpp"] for r in rows if r.get("llama_cpp")), {})

    out = []
    w = out.append
    short = [r for r in rows if r["gen_tokens"] != DEEP_GEN or r["prompt_tokens"] < DEEP_FROM]
    deep = [r for r in rows if r not in short]
    w("# CPU speed and memory: kvq vs llama.cpp (decode and prompt tokens/s, peak RSS)")
    w("")
    w("<!-- Generated by scripts/bench-vs-llamacpp (scripts/bench_report.py); the"
      f" \"{KEEP_FROM[3:]}\" section is written by hand and kept on regeneration. -->")
    w("")
    w(f"Model **{first['model']}** (the default model), greedy decode after a prompt of random"
      " tokens. Both run on the same GGUF with the same thread count (kvq: `RAYON_NUM_THREADS`,"
      " candle's pool; llama.cpp: `-t`) and llama.cpp with flash attention (`-fa 1`),"
      f" interleaved in one run: {args.rounds} round(s) of kvq then llama.cpp, every sample"
      " pooled; each speed cell is the median (min–max) in tokens/s. Ratio = kvq / llama.cpp;"
      " for speed above 1 kvq is faster, for RSS below 1 kvq holds less. kvq's fp16 cache is"
      " compared with llama.cpp's f16 cache, its compressed presets with q4_0 (llama.cpp's"
      " smallest CPU KV type; it has no 3-bit one).")
    w("")
    w("## Bars")
    w("")
    for line in bars(rows):
        w(f"- {line}")
    w("")
    if deep:
        t = deep[0]["threads"]
        w(f"## At depth ({t} threads, {DEEP_GEN} decoded tokens)")
        w("")
        w("| method | depth | llama.cpp KV | kvq pp t/s | llama.cpp pp t/s | pp ratio |"
          " kvq tg t/s | llama.cpp tg t/s | tg ratio | kvq KV MiB | kvq peak RSS MiB |"
          " llama.cpp peak RSS MiB | RSS ratio |")
        w("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sorted(deep, key=lambda r: (order(r["method"]), r["prompt_tokens"])):
            lc = r.get("llama_cpp") or {}
            w(f"| {r['method']} | {r['prompt_tokens']} | {lc.get('cache_type', '-')} |"
              f" {fmt(r['pp_tps'])} | {fmt(lc.get('pp_tps'))} | {ratio(lc.get('pp_ratio'))} |"
              f" {fmt(r['tg_tps'])} | {fmt(lc.get('tg_tps'))} | {ratio(lc.get('tg_ratio'))} |"
              f" {r['kv_resident_bytes'] / 2**20:.1f} | {mib(r.get('peak_rss_bytes'))} |"
              f" {mib(lc.get('peak_rss_bytes'))} | {ratio(lc.get('rss_ratio'))} |")
        w("")
        w(f"- **pp**: a prompt of `depth` tokens from an empty cache (`llama-bench -p D -n 0`);"
          f" **tg**: {DEEP_GEN} tokens decoded one at a time after it (`-p 0 -n {DEEP_GEN} -d D`:"
          " D tokens already in the KV cache).")
        w("- **peak RSS**: the whole process, model included, for the depth's prompt plus"
          f" {DEEP_GEN} tokens: kvq measures each (method, depth) in a child process of its own"
          " (VmHWM); each llama-bench `-d D` run is its own process under `/usr/bin/time`"
          " (its context is D + 64 positions, like kvq's). Median over rounds.")
        w("")
    w(f"## Short contexts (fp16 against f16, {short[0]['gen_tokens'] if short else 0} decoded tokens)")
    w("")
    w("| threads | prompt tokens | kvq pp t/s | llama.cpp pp t/s | pp ratio | kvq tg t/s |"
      " llama.cpp tg t/s | tg ratio | llama.cpp tg t/s, empty context |")
    w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(short, key=lambda r: (-r["threads"], order(r["method"]), r["prompt_tokens"])):
        lc = r.get("llama_cpp") or {}
        depth = lc.get("tg_depth", 0)
        w(f"| {r['threads']} | {r['prompt_tokens']} | {fmt(r['pp_tps'])} | {fmt(lc.get('pp_tps'))} |"
          f" {ratio(lc.get('pp_ratio'))} | {fmt(r['tg_tps'])} |"
          f" {fmt(lc.get('tg_tps'))}{' @ d' + str(depth) if depth else ''} |"
          f" {ratio(lc.get('tg_ratio'))} | {fmt(lc.get('tg_tps_depth0'))} |")
    w("")
    w("- **pp** (prompt processing): N prompt tokens / time of one batched forward over them"
      " (`llama-bench` test `ppN`).")
    w("- **tg** (decode): tokens / time to generate them one at a time after the N-token"
      " prompt. llama.cpp's matching test is `tg128 @ dN` (`-d N`: N tokens already in the KV"
      " cache); its default `tg128` from an empty context is the last column. kvq's decode time"
      " includes reading the logits back and the greedy pick.")
    kv = {}
    for r in short:
        kv[(r["prompt_tokens"], r["gen_tokens"])] = r["kv_resident_bytes"]
    kv = ", ".join(f"{p}+{g} tokens: {b / 2**20:.1f} MiB" for (p, g), b in sorted(kv.items()))
    rss = max((r.get("peak_rss_bytes") or 0) for r in short) if short else 0
    w(f"- kvq's resident KV cache (fp16, block-allocated): {kv}; kvq's peak RSS"
      f" {rss / 2**20:.0f} MiB.")
    w("")
    w(f"![kvq vs llama.cpp tokens/s]({args.png})")
    w("")
    w(f"![kvq's KV cache and peak RSS, llama.cpp's peak RSS]({args.png[:-4]}-memory.png)")
    w("")
    w("## Machine and run")
    w("")
    w(f"- CPU: {m['model']}, {m['cpus']} CPUs ({m['arch']}), {m['mem']} RAM; SIMD flags:"
      f" {', '.join(m['flags']) or 'none'}"
      + (f"; no {', '.join(m['lacks'])}" if m['lacks'] else "") + ".")
    w("- A shared machine: other work may run beside the benchmark, hence the interleaved"
      " rounds and pooled medians. Load average before: "
      f"`{read(os.path.join(args.dir, 'load-before.txt'))}`; after: "
      f"`{read(os.path.join(args.dir, 'load-after.txt'))}`.")
    w(f"- Date: {now}; kvq commit {commit}; {args.llama_source}"
      f" (its build_commit reads `{ll.get('build_commit') or 'unknown'}`).")
    w("")
    w("Commands (from the repository root; `scripts/bench-vs-llamacpp` runs all of them):")
    w("")
    w("```sh")
    w("cargo build --release --bin kvq")
    w(read(os.path.join(args.dir, "commands.txt")))
    w("```")
    w("")

    kept = ""
    try:
        with open(args.doc, encoding="utf-8") as f:
            old = f.read()
        at = old.find(KEEP_FROM)
        if at >= 0:
            kept = old[at:].rstrip() + "\n"
    except OSError:
        pass
    text = "\n".join(out) + "\n" + kept
    with open(args.doc, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
