#!/usr/bin/env python3
# PyTorch baselines on one NVIDIA GPU for kvq: copy bandwidth, fp16 SDPA decode attention (flash/cuDNN/efficient), nearest-centroid encode.
"""Measures the torch numbers that kvq's CUDA kernels are compared against.

    python3 scripts/gpu/torch_baselines.py --out DIR [--quick] [--dry-run]

Writes DIR/torch_baselines.json:
  {"device", "torch", "cudnn", "copy_gbps", "attention": [...], "encode": [...], "checks": [...], ...}
and ends its output with plain-text tables of the attention and encode rows.

Timing: every timed call sits between two CUDA events; the median of the per-call times is
reported. Before each chunk of timed calls a `torch.cuda._sleep` kernel keeps the GPU busy
while the CPU queues the chunk, so the events measure GPU time, not Python launch latency.
Attention inputs rotate among independent (q, k, v) sets larger than L2 in total.

--dry-run prints the plan (shapes, rotation sets) without importing torch.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

GIB = 1 << 30
MIB = 1 << 20

ATTN_SHAPES = [
    # name, q_heads, kv_heads, head_dim
    ("llama3-8b", 32, 8, 128),
    ("falcon3-7b", 12, 4, 256),
]
POSITIONS_FULL = [4096, 16384, 32768, 131072]
BATCHES_FULL = [1, 8]
POSITIONS_QUICK = [4096, 32768]
BATCHES_QUICK = [1]

ROTATION_MIN_BYTES = 512 * MIB   # rotation sets together exceed this (L2 is 60 MB)
ROTATION_MAX_BYTES = 24 * GIB    # ... and stay under this
ROTATION_MAX_SETS = 64
ROTATION_MIN_SETS = 2
LARGE_KV_BYTES = 2 * GIB         # at or above this, fewer reps (each call is ~1 ms)

ENCODE_N = 1 << 20
ENCODE_CENTROIDS = 256
ENCODE_SUB_DIMS = [4, 8]
ENCODE_AGREE_MIN = 0.999

CHECK_POSITIONS = 4096
CHECK_TOL = 1e-2                 # relative L2 error vs the fp32 reference; fp16 gives ~1e-3

COPY_BYTES = 4 * GIB
ASSUMED_MAX_CLOCK_HZ = 2.0e9     # H200 boost is 1.98 GHz: sleeping this many cycles per second lasts >= 1 s

BACKEND_KEYS = ["flash", "cudnn", "efficient"]

torch = None  # imported lazily in main() so --dry-run and --help work without torch
F = None


def log(*args):
    print(*args, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (created); torch_baselines.json goes there")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: positions 4096 and 32768, batch 1, fewer reps")
    p.add_argument("--only", default=None,
                   help="SHAPE:BATCH:POSITIONS[:METHOD][,...] patterns (`*` for any part, METHOD "
                        "ignored): time only the attention rows that match (kvq's benchmark takes "
                        "the same patterns)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and exit without importing torch")
    return p.parse_args(argv)


def reps_config(quick):
    """Timing knobs. Attention: warm-up, min reps, min seconds per timed run, max reps, chunk size."""
    if quick:
        return dict(copy_warmup=2, copy_reps=5,
                    attn_warmup=3, attn_min_reps=10, attn_min_s=0.02, attn_max_reps=200,
                    attn_large_min_reps=5, attn_large_min_s=0.01, attn_chunk=10,
                    enc_warmup=1, enc_reps=5)
    return dict(copy_warmup=3, copy_reps=20,
                attn_warmup=5, attn_min_reps=50, attn_min_s=0.2, attn_max_reps=3000,
                attn_large_min_reps=20, attn_large_min_s=0.1, attn_chunk=50,
                enc_warmup=3, enc_reps=20)


def kv_bytes_of(batch, kv_heads, positions, head_dim):
    return 2 * batch * kv_heads * positions * head_dim * 2


def set_bytes_of(batch, q_heads, kv_heads, positions, head_dim):
    return kv_bytes_of(batch, kv_heads, positions, head_dim) + batch * q_heads * head_dim * 2


def rotation_sets(one_set_bytes):
    """How many independent input sets to cycle through: total > 512 MiB, 2..64 sets, total < 24 GiB."""
    n = ROTATION_MIN_BYTES // one_set_bytes + 1
    n = max(ROTATION_MIN_SETS, min(ROTATION_MAX_SETS, n))
    n = min(n, max(1, (ROTATION_MAX_BYTES - 1) // one_set_bytes))
    return int(n)


def wanted(only, name, b, n):
    """Whether (shape, batch, positions) matches one of the --only patterns (all when None)."""
    if not only:
        return True
    for pat in only.split(","):
        f = pat.split(":")
        ok = lambda i, v: i >= len(f) or f[i] in ("*", str(v))
        if ok(0, name) and ok(1, b) and ok(2, n):
            return True
    return False


def attention_plan(quick, only=None):
    positions = POSITIONS_QUICK if quick else POSITIONS_FULL
    batches = BATCHES_QUICK if quick else BATCHES_FULL
    plan = []
    for name, hq, hkv, d in ATTN_SHAPES:
        for b in batches:
            for n in positions:
                if not wanted(only, name, b, n):
                    continue
                sb = set_bytes_of(b, hq, hkv, n, d)
                plan.append(dict(shape=name, batch=b, positions=n, q_heads=hq, kv_heads=hkv, head_dim=d,
                                 kv_bytes=kv_bytes_of(b, hkv, n, d), sets=rotation_sets(sb), set_bytes=sb))
    return plan


def gbps(nbytes, us):
    return None if us is None else nbytes / us / 1e3


def fmt(v, spec, width):
    s = "-" if v is None else format(v, spec)
    return s.rjust(width)


def sanitize(obj):
    """JSON-safe: non-finite floats become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return obj


def short_error(exc, caught):
    msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    reasons = [str(w.message).strip().replace("\n", " ") for w in caught]
    if reasons:
        msg += " | " + " | ".join(reasons)
    return msg[:600]


# ----------------------------------------------------------------------------- timing

def gpu_sleep(seconds):
    """Queue a spin kernel that keeps the GPU busy for at least `seconds` (if torch has one)."""
    sleeper = getattr(torch.cuda, "_sleep", None)
    if sleeper is None or seconds <= 0:
        return
    sleeper(int(min(seconds, 0.2) * ASSUMED_MAX_CLOCK_HZ))


def time_calls(fn, n_sets, warmup, min_reps, min_s, max_reps, chunk):
    """Median GPU time (us) of fn(i) over calls cycling i through n_sets; returns (median_us, reps)."""
    k = 0
    for _ in range(warmup):
        fn(k % n_sets)
        k += 1
    torch.cuda.synchronize()
    times = []
    enqueue_per_call = 200e-6  # first guess; measured after the first chunk
    t0 = time.perf_counter()
    while len(times) < max_reps:
        m = min(chunk, max_reps - len(times))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(m)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(m)]
        gpu_sleep(1.5 * enqueue_per_call * m + 1e-3)
        te = time.perf_counter()
        for j in range(m):
            starts[j].record()
            fn(k % n_sets)
            ends[j].record()
            k += 1
        enqueue_per_call = (time.perf_counter() - te) / m
        torch.cuda.synchronize()
        times.extend(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        elapsed = time.perf_counter() - t0
        if len(times) >= min_reps and elapsed >= min_s:
            break
        if len(times) >= max(min_reps, 10) and elapsed >= 10.0:  # safety valve for pathological kernels
            break
    return statistics.median(times), len(times)


def time_simple(fn, warmup, reps):
    """Median GPU time (us) of fn() for long-running calls (launch latency irrelevant)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- 1. copy

def measure_copy(cfg):
    n = COPY_BYTES // 2
    src = torch.randn(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    us = time_simple(lambda: dst.copy_(src), cfg["copy_warmup"], cfg["copy_reps"])
    ok = bool(torch.equal(dst[:1 << 20], src[:1 << 20]))
    del src, dst
    free()
    bw = 2 * COPY_BYTES / us / 1e3
    log(f"copy: {COPY_BYTES / GIB:.0f} GiB fp16 d2d, median {us:.1f} us, {bw:.1f} GB/s (read+write){'' if ok else '  [COPY MISMATCH]'}")
    return bw, us, ok


# ----------------------------------------------------------------------------- 2. attention

def backend_enum(key):
    B = torch.nn.attention.SDPBackend
    return {"flash": B.FLASH_ATTENTION, "cudnn": B.CUDNN_ATTENTION, "efficient": B.EFFICIENT_ATTENTION}[key]


def sdpa(key, q, k, v, expanded):
    """One SDPA call restricted to one backend. expanded: k/v already have Hq heads."""
    with torch.nn.attention.sdpa_kernel(backend_enum(key)):
        if expanded:
            return F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def try_sdpa(key, q, k, v, expanded):
    """(output, None) or (None, error string)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = sdpa(key, q, k, v, expanded)
            torch.cuda.synchronize()
            return out, None
        except Exception as e:  # RuntimeError "No available kernel", torch.OutOfMemoryError, ...
            return None, short_error(e, caught)


def expand_kv(t, q_heads):
    g = q_heads // t.shape[1]
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def reference_attention(q, k, v):
    """float32 math reference with GQA expansion: softmax(q k^T * scale) v."""
    hq = q.shape[1]
    qf = q.float()
    kf = expand_kv(k, hq).float()
    vf = expand_kv(v, hq).float()
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (qf @ kf.transpose(-2, -1)) * scale
    return torch.softmax(s, dim=-1) @ vf


def rel_l2(out, ref):
    if out is None:
        return None
    return float(torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref))


def randn_h(*shape):
    return torch.randn(*shape, dtype=torch.float16, device="cuda")


def attention_check(name, hq, hkv, d):
    """Correctness at batch 1, 4096 positions; decides per backend whether native GQA is usable."""
    torch.manual_seed(1234)
    q = randn_h(1, hq, 1, d)
    k = randn_h(1, hkv, CHECK_POSITIONS, d)
    v = randn_h(1, hkv, CHECK_POSITIONS, d)
    ref = reference_attention(q, k, v)
    kx, vx = expand_kv(k, hq), expand_kv(v, hq)
    rec = {"check": "attention", "shape": name, "batch": 1, "positions": CHECK_POSITIONS,
           "q_heads": hq, "kv_heads": hkv, "head_dim": d, "tol": CHECK_TOL}
    modes, outs = {}, {}
    for key in BACKEND_KEYS:
        out, err = try_sdpa(key, q, k, v, expanded=False)
        e_native = rel_l2(out, ref)
        mode = "gqa"
        if out is None or e_native is None or not e_native <= CHECK_TOL:
            # refused GQA, or ran but disagrees: try again with k/v expanded to Hq heads
            out_x, err_x = try_sdpa(key, q, kx, vx, expanded=True)
            e_x = rel_l2(out_x, ref)
            if out_x is not None and e_x is not None and e_x <= CHECK_TOL:
                if out is not None:
                    rec[f"{key}_gqa_rel_l2"] = e_native  # native GQA ran but was wrong: keep the evidence
                else:
                    rec[f"{key}_gqa_error"] = err  # why native GQA was refused
                out, mode, err = out_x, "expanded", None
            elif out is not None:
                pass  # both disagree (or expanded refused): report native GQA, the check fails
            elif out_x is not None:
                rec[f"{key}_gqa_error"] = err
                out, mode, err = out_x, "expanded", None
            else:
                mode, err = None, f"gqa: {err}; expanded: {err_x}"
        rec[f"{key}_rel_l2"] = rel_l2(out, ref)
        rec[f"{key}_mode"] = mode
        if err:
            rec[f"{key}_error"] = err
        modes[key] = mode
        outs[key] = out
    if outs["flash"] is not None and outs["cudnn"] is not None:
        rec["flash_vs_cudnn_rel_l2"] = float(
            torch.linalg.vector_norm(outs["flash"].float() - outs["cudnn"].float())
            / torch.linalg.vector_norm(outs["cudnn"].float()))
    else:
        rec["flash_vs_cudnn_rel_l2"] = None
    errs = [rec[f"{k}_rel_l2"] for k in BACKEND_KEYS if rec[f"{k}_rel_l2"] is not None]
    rec["ok"] = bool(errs) and all(e <= CHECK_TOL for e in errs)
    log(f"check {name}: " + ", ".join(
        f"{k} {fmt(rec[f'{k}_rel_l2'], '.2e', 0).strip()} ({rec[f'{k}_mode']})" for k in BACKEND_KEYS)
        + f", flash-vs-cudnn {fmt(rec['flash_vs_cudnn_rel_l2'], '.2e', 0).strip()}"
        + ("" if rec["ok"] else "  [CHECK FAILED]"))
    for k in BACKEND_KEYS:
        for what in ("error", "gqa_error"):
            if rec.get(f"{k}_{what}"):
                log(f"  {k} {what}: {rec[f'{k}_{what}']}")
    del q, k, v, kx, vx, ref, outs
    free()
    return rec, modes


def attention_row(p, cfg, modes):
    b, n, hq, hkv, d = p["batch"], p["positions"], p["q_heads"], p["kv_heads"], p["head_dim"]
    n_sets = p["sets"]
    large = p["kv_bytes"] >= LARGE_KV_BYTES
    min_reps = cfg["attn_large_min_reps"] if large else cfg["attn_min_reps"]
    min_s = cfg["attn_large_min_s"] if large else cfg["attn_min_s"]
    torch.manual_seed(b * 1_000_003 + n)
    sets = [(randn_h(b, hq, 1, d), randn_h(b, hkv, n, d), randn_h(b, hkv, n, d)) for _ in range(n_sets)]
    xsets = None  # expanded sets, built only if a backend needs them
    row = {"shape": p["shape"], "batch": b, "positions": n, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
           "torch_flash_us": None, "torch_cudnn_us": None, "torch_efficient_us": None,
           "kv_bytes": p["kv_bytes"], "flash_gbps": None, "cudnn_gbps": None, "efficient_gbps": None,
           "expanded": False, "expanded_backends": [], "rotation_sets": n_sets, "reps": {}, "errors": {}}

    def run(key, use_sets, expanded):
        def fn(i):
            q, k, v = use_sets[i]
            if expanded:
                return F.scaled_dot_product_attention(q, k, v)
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with torch.nn.attention.sdpa_kernel(backend_enum(key)):
            return time_calls(fn, len(use_sets), cfg["attn_warmup"], min_reps, min_s,
                              cfg["attn_max_reps"], cfg["attn_chunk"])

    for key in BACKEND_KEYS:
        mode = modes.get(key) or "gqa"   # a backend that failed the check is still tried here
        us, err = None, None
        if mode == "gqa":
            q, k, v = sets[0]
            out, err = try_sdpa(key, q, k, v, expanded=False)
            if out is not None:
                del out
                us, reps = run(key, sets, expanded=False)
            else:
                mode = "expanded"
        if mode == "expanded":
            if xsets is None:
                xset_bytes = p["set_bytes"] * hq // hkv
                n_x = min(n_sets, max(1, (ROTATION_MAX_BYTES - 1) // xset_bytes))
                try:
                    xsets = [(q, expand_kv(k, hq), expand_kv(v, hq)) for q, k, v in sets[:n_x]]
                except RuntimeError as e:
                    xsets = []
                    err = (err + "; " if err else "") + f"expand: {type(e).__name__}: {str(e)[:200]}"
                    free()
            if xsets:
                q, k, v = xsets[0]
                out, err_x = try_sdpa(key, q, k, v, expanded=True)
                if out is not None:
                    del out
                    us, reps = run(key, xsets, expanded=True)
                    row["expanded"] = True
                    row["expanded_backends"].append(key)
                    err = None
                else:
                    err = f"gqa: {err}; expanded: {err_x}" if err else err_x
        row[f"torch_{key}_us"] = us
        row[f"{key}_gbps"] = gbps(p["kv_bytes"], us)
        if us is not None:
            row["reps"][key] = reps
        if err:
            row["errors"][key] = err
    if row["expanded"]:
        row["note"] = ("k/v expanded to q_heads with repeat_interleave outside the timed region for "
                       + ",".join(row["expanded_backends"]) + "; kv_bytes and gbps count the unexpanded KV")
    if not row["errors"]:
        del row["errors"]
    del sets, xsets
    free()
    return row


# ----------------------------------------------------------------------------- 3. encode

def encode_variants():
    def materializing(x, c):
        return ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1).argmin(-1)

    def matmul(x, c):
        return (x.square().sum(1, keepdim=True) - 2 * x @ c.T + c.square().sum(1)[None]).argmin(-1)

    def cdist(x, c):
        return torch.cdist(x, c).argmin(-1)

    return [("materializing", materializing), ("matmul", matmul), ("cdist", cdist)]


def measure_encode(cfg):
    rows, checks = [], []
    for sub in ENCODE_SUB_DIMS:
        torch.manual_seed(sub)
        x = torch.randn(ENCODE_N, sub, dtype=torch.float32, device="cuda")
        c = torch.randn(ENCODE_CENTROIDS, sub, dtype=torch.float32, device="cuda")
        idx = {}
        for name, fn in encode_variants():
            row = {"kernel": "nearest_centroid", "variant": name, "n": ENCODE_N, "centroids": ENCODE_CENTROIDS,
                   "sub_dim": sub, "us": None, "peak_bytes": None}
            try:
                free()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out = fn(x, c)
                torch.cuda.synchronize()
                row["peak_bytes"] = int(torch.cuda.max_memory_allocated() - base)
                idx[name] = out
                row["us"] = time_simple(lambda: fn(x, c), cfg["enc_warmup"], cfg["enc_reps"])
            except RuntimeError as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            free()
            log(f"encode sub_dim {sub} {name:14s}: {fmt(row['us'], '.1f', 10)} us, "
                f"peak {fmt(None if row['peak_bytes'] is None else row['peak_bytes'] / MIB, '.1f', 9)} MiB"
                + (f"  [{row['error']}]" if "error" in row else ""))
            rows.append(row)
        ref = idx.get("materializing")
        for name in ("matmul", "cdist"):
            rec = {"check": "nearest_centroid_agreement", "variant": name, "vs": "materializing",
                   "n": ENCODE_N, "centroids": ENCODE_CENTROIDS, "sub_dim": sub, "min_agree": ENCODE_AGREE_MIN,
                   "agree": None, "ok": False}
            if ref is not None and name in idx:
                rec["agree"] = float((idx[name] == ref).float().mean())
                rec["ok"] = rec["agree"] >= ENCODE_AGREE_MIN
            log(f"check encode sub_dim {sub} {name} vs materializing: agree "
                f"{fmt(rec['agree'], '.6f', 0).strip()}" + ("" if rec["ok"] else "  [CHECK FAILED]"))
            checks.append(rec)
        del x, c, idx, ref
        free()
    return rows, checks


# ----------------------------------------------------------------------------- output

def attention_table(rows):
    hdr = (f"{'shape':<11} {'B':>2} {'pos':>7} {'flash_us':>9} {'cudnn_us':>9} {'effic_us':>9} "
           f"{'flash_GB/s':>10} {'cudnn_GB/s':>10} {'effic_GB/s':>10} {'kv_MiB':>8} expanded")
    lines = [hdr]
    for r in rows:
        lines.append(
            f"{r['shape']:<11} {r['batch']:>2} {r['positions']:>7} "
            f"{fmt(r['torch_flash_us'], '.1f', 9)} {fmt(r['torch_cudnn_us'], '.1f', 9)} "
            f"{fmt(r['torch_efficient_us'], '.1f', 9)} {fmt(r['flash_gbps'], '.0f', 10)} "
            f"{fmt(r['cudnn_gbps'], '.0f', 10)} {fmt(r.get('efficient_gbps'), '.0f', 10)} "
            f"{r['kv_bytes'] / MIB:>8.0f} {','.join(r.get('expanded_backends') or []) or '-'}")
    return lines


def encode_table(rows):
    lines = [f"{'variant':<14} {'sub':>3} {'n':>8} {'cents':>5} {'us':>10} {'peak_MiB':>9}"]
    for r in rows:
        lines.append(f"{r['variant']:<14} {r['sub_dim']:>3} {r['n']:>8} {r['centroids']:>5} "
                     f"{fmt(r['us'], '.1f', 10)} "
                     f"{fmt(None if r['peak_bytes'] is None else r['peak_bytes'] / MIB, '.1f', 9)}")
    return lines


def write_json(path, result):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(sanitize(result), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def dry_run(args):
    cfg = reps_config(args.quick)
    log(f"plan ({'quick' if args.quick else 'full'}): out {os.path.join(args.out, 'torch_baselines.json')}")
    log(f"copy: {COPY_BYTES / GIB:.0f} GiB fp16, warm-up {cfg['copy_warmup']}, reps {cfg['copy_reps']}")
    for p in attention_plan(args.quick, args.only):
        log(f"attention {p['shape']:<11} B={p['batch']} N={p['positions']:>6} Hq={p['q_heads']} "
            f"Hkv={p['kv_heads']} D={p['head_dim']} kv {p['kv_bytes'] / MIB:8.0f} MiB, "
            f"{p['sets']:2d} sets = {p['sets'] * p['set_bytes'] / MIB:7.0f} MiB")
    for sub in ENCODE_SUB_DIMS:
        log(f"encode n={ENCODE_N} centroids={ENCODE_CENTROIDS} sub_dim={sub}: materializing, matmul, cdist; "
            f"warm-up {cfg['enc_warmup']}, reps {cfg['enc_reps']}")


def main(argv=None):
    global torch, F
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    import torch as _torch
    import torch.nn.functional as _F
    import torch.nn.attention  # noqa: F401  (sdpa_kernel, SDPBackend)
    torch, F = _torch, _F
    if not torch.cuda.is_available():
        log("error: no CUDA device")
        return 2
    cfg = reps_config(args.quick)
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "torch_baselines.json")
    t_start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
              "sm": f"{props.major}.{props.minor}", "gpu_memory_bytes": props.total_memory,
              "flash_impl": (torch.nn.attention.current_flash_attention_impl()
                             if hasattr(torch.nn.attention, "current_flash_attention_impl") else None),
              "quick": args.quick, "copy_gbps": None, "copy_us": None,
              "attention": [], "encode": [], "checks": [],
              "timing": ("CUDA events around each call, median; attention: warm-up "
                         f"{cfg['attn_warmup']}, >= {cfg['attn_min_reps']} reps and >= {cfg['attn_min_s']} s "
                         f"(>= {cfg['attn_large_min_reps']} reps, {cfg['attn_large_min_s']} s at kv >= 2 GiB), "
                         "inputs rotated over sets > 512 MiB in total, GPU kept busy by a sleep kernel while "
                         "each chunk is queued")}
    log(f"device {result['device']} (sm {result['sm']}), torch {result['torch']}, cuda {result['cuda']}, "
        f"cudnn {result['cudnn']}, {'quick' if args.quick else 'full'} run")
    if getattr(torch.cuda, "_sleep", None) is None:
        log("warning: torch.cuda._sleep missing; small attention timings include launch latency")

    # 1. copy bandwidth
    bw, us, ok = measure_copy(cfg)
    result["copy_gbps"], result["copy_us"] = bw, us
    result["checks"].append({"check": "copy", "ok": ok})
    write_json(out_path, result)

    # 2. attention: check per shape, then time every (batch, positions)
    plan = attention_plan(args.quick, args.only)
    for name, hq, hkv, d in ATTN_SHAPES:
        if not any(p["shape"] == name for p in plan):
            continue
        rec, modes = attention_check(name, hq, hkv, d)
        result["checks"].append(rec)
        for p in plan:
            if p["shape"] != name:
                continue
            t0 = time.perf_counter()
            row = attention_row(p, cfg, modes)
            result["attention"].append(row)
            log(f"attention {name:<11} B={p['batch']} N={p['positions']:>6}: "
                f"flash {fmt(row['torch_flash_us'], '.1f', 0).strip()} us, "
                f"cudnn {fmt(row['torch_cudnn_us'], '.1f', 0).strip()} us, "
                f"efficient {fmt(row['torch_efficient_us'], '.1f', 0).strip()} us "
                f"({p['sets']} sets, {time.perf_counter() - t0:.1f} s)"
                + (f"  expanded: {','.join(row['expanded_backends'])}" if row["expanded"] else ""))
            for k, e in row.get("errors", {}).items():
                log(f"  {k}: {e}")
            write_json(out_path, result)

    # 3. nearest-centroid encode
    rows, checks = measure_encode(cfg)
    result["encode"] = rows
    result["checks"].extend(checks)
    result["elapsed_s"] = time.perf_counter() - t_start
    write_json(out_path, result)

    # 4. summary tables (the last lines are what the caller reads)
    n_fail = sum(1 for c in result["checks"] if not c.get("ok"))
    log("")
    log(f"== {result['device']}, torch {result['torch']}: copy {bw:.0f} GB/s (read+write), "
        f"{result['elapsed_s']:.0f} s, checks {len(result['checks']) - n_fail}/{len(result['checks'])} ok")
    for line in attention_table(result["attention"]):
        log(line)
    log("")
    for line in encode_table(result["encode"]):
        log(line)
    for c in result["checks"]:
        if not c.get("ok"):
            log(f"FAILED check: {json.dumps(sanitize(c))[:400]}")
    log(f"wrote {out_path}")
    return 0 if n_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
