// QJL's encode kernels: `kvq_encode_qjl_keys` (below) and `kvq_encode_group`, its values (after
// it).
//
// Encode of QJL keys (the Metal twin of kernels/cuda/qjl/encode.cu; the CPU definition is
// crates/kvq-cache qjl/keys.rs): one threadgroup of d threads per code row. The `outliers`
// largest-magnitude channels are kept exactly (u8 index, f16 value; the sketch takes what the
// f16 value leaves out), picked one at a time by a simdgroup argmax over `simd_shuffle_xor` and
// a pass over the simdgroups' winners; the f16 norm of the rest by `simd_sum`; then the signs of
// S rest, each simdgroup taking 32 projections at a time, lane j projection j, packed 8 to a
// byte with `simd_shuffle`. Row layout: norm, m / 8 sign bytes, outlier indices, outlier values.
// Dispatch: kvq_kernels::metal::dispatch::encode_qjl_keys.
#include <metal_stdlib>
using namespace metal;

struct QjlKeyEncodeParams {
  uint rows;      // code rows; row i belongs to kv head i / t
  uint t;         // rows per head
  uint d;         // head dim (64, 128 or 256), the threads of a threadgroup
  uint m;         // sketch dimension, a multiple of 8
  uint outliers;  // exact channels per row
  uint cb;        // bytes per code row: 2 + m / 8 + 3 * outliers
};

inline void store_f16(device uchar* at, float v) {
  const ushort h = as_type<ushort>(half(v));
  at[0] = uchar(h & 0xff);
  at[1] = uchar(h >> 8);
}

kernel void kvq_encode_qjl_keys(device const float* x [[buffer(0)]],
                                device const float* mats [[buffer(1)]],
                                device uchar* out [[buffer(2)]],
                                constant QjlKeyEncodeParams& p [[buffer(3)]],
                                uint c [[thread_position_in_threadgroup]],
                                uint row [[threadgroup_position_in_grid]],
                                uint lane [[thread_index_in_simdgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float u[256];
  threadgroup float red[8];
  threadgroup uint taken[256];
  threadgroup float best_v[8];
  threadgroup uint best_i[8];
  if (row >= p.rows) return;
  const uint d = p.d, nsg = d / 32, head = row / p.t;
  device uchar* o = out + row * p.cb;
  const float xv = x[row * d + c];
  float rest = xv;
  taken[c] = 0;
  const uint at = 2 + p.m / 8;
  for (uint k = 0; k < p.outliers; k++) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // The largest |x| of the channels not taken yet (ties: the lowest channel).
    float v = taken[c] != 0 ? -1.0f : abs(xv);
    uint ch = c;
    for (ushort s = 16; s > 0; s >>= 1) {
      const float ov = simd_shuffle_xor(v, s);
      const uint oc = simd_shuffle_xor(ch, s);
      if (ov > v || (ov == v && oc < ch)) {
        v = ov;
        ch = oc;
      }
    }
    if (lane == 0) {
      best_v[sg] = v;
      best_i[sg] = ch;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (c == 0) {
      float bv = best_v[0];
      uint bi = best_i[0];
      for (uint w = 1; w < nsg; w++)
        if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) {
          bv = best_v[w];
          bi = best_i[w];
        }
      best_i[0] = bi;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (c == best_i[0]) {
      taken[c] = 1;
      o[at + k] = uchar(c);
      store_f16(o + at + p.outliers + 2 * k, xv);
      rest = xv - float(half(xv));
    }
  }
  // The norm of the rest: simdgroup sums, then the simdgroups' through `red`.
  const float s = simd_sum(rest * rest);
  if (lane == 0) red[sg] = s;
  u[c] = rest;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c == 0) {
    float total = 0.0f;
    for (uint w = 0; w < nsg; w++) total += red[w];
    store_f16(o, sqrt(total));
  }
  // Signs of S rest (S stored transposed: mats[head][j][i] = S_head[i][j]).
  device const float* S = mats + head * d * p.m;
  for (uint base = sg * 32; base < p.m; base += nsg * 32) {
    const uint i = base + lane;
    float pr = 0.0f;
    if (i < p.m)
      for (uint j = 0; j < d; j++) pr = fma(S[j * p.m + i], u[j], pr);
    const uint bit = (i < p.m && pr >= 0.0f) ? 1u : 0u;
    uint byte = 0;
    for (ushort b = 0; b < 8; b++) byte |= simd_shuffle(bit, ushort((lane / 8) * 8 + b)) << b;
    if (lane % 8 == 0 && i < p.m) o[2 + i / 8] = uchar(byte);
  }
}

// Encode of QJL's group-quantized values (the Metal twin of kernels/cuda/qjl/encode.cu
// `group_encode`; the CPU definition is crates/kvq-cache qjl/values.rs `fit` and `encode`): one
// threadgroup of d threads per row. One thread per group of `group` coordinates fits its f16
// (scale, min) as `fit` does (at 2 bits the best of the trimmed ranges by squared error once
// rounded to f16, min-max otherwise); then every thread rounds its coordinate to a code and
// one thread per output byte packs 8 / bits codes LSB first. Row layout: (scale, min) f16 of
// every group, then the codes. Dispatch: kvq_kernels::metal::dispatch::encode_group.
struct GroupEncodeParams {
  uint rows;   // code rows
  uint d;      // head dim (64, 128 or 256), the threads of a threadgroup
  uint bits;   // 2, 4 or 8
  uint group;  // coordinates per group; d % group == 0 and group * bits % 8 == 0
  uint cb;     // bytes per code row: 4 d / group + d bits / 8
};

constant float kvq_group_trims[5] = {0.0f, 0.05f, 0.1f, 0.15f, 0.2f};

// The f16-rounded (scale, min) of the range [lo + a r, hi - b r].
inline float2 group_params(float lo, float hi, float a, float b, float levels) {
  const float r = hi - lo;
  const float l = lo + a * r, h = hi - b * r;
  return float2(float(half(min((h - l) / levels, 65504.0f))), float(half(l)));
}

// The squared error of coding x[0..n) with (scale, min) `sm`, clipping included.
template <class TG>
inline float group_sse(TG x, uint n, float2 sm, float levels) {
  const float inv = sm.x > 0.0f ? 1.0f / sm.x : 0.0f;
  float e = 0.0f;
  for (uint i = 0; i < n; i++) {
    const float c = clamp(floor((x[i] - sm.y) * inv + 0.5f), 0.0f, levels);
    const float r = sm.y + sm.x * c - x[i];
    e = fma(r, r, e);
  }
  return e;
}

template <class TG>
inline float2 group_fit(TG x, uint n, float levels) {
  float lo = INFINITY, hi = -INFINITY;
  for (uint i = 0; i < n; i++) {
    lo = min(lo, x[i]);
    hi = max(hi, x[i]);
  }
  float2 best = group_params(lo, hi, 0.0f, 0.0f, levels);
  if (levels > 3.0f) return best;
  float least = INFINITY, trim = 0.0f, best_e = INFINITY;
  // The best symmetric trim, then one step of each end on its own.
  for (uint k = 0; k < 5; k++) {
    const float a = kvq_group_trims[k];
    const float2 sm = group_params(lo, hi, a, a, levels);
    const float e = group_sse(x, n, sm, levels);
    if (e < best_e) {
      best_e = e;
      best = sm;
    }
    if (e < least) {
      least = e;
      trim = a;
    }
  }
  const float st = 0.05f;
  const float cand[4][2] = {{trim - st, trim}, {trim + st, trim}, {trim, trim - st},
                            {trim, trim + st}};
  for (uint k = 0; k < 4; k++) {
    if (cand[k][0] < 0.0f || cand[k][1] < 0.0f) continue;
    const float2 sm = group_params(lo, hi, cand[k][0], cand[k][1], levels);
    const float e = group_sse(x, n, sm, levels);
    if (e < best_e) {
      best_e = e;
      best = sm;
    }
  }
  return best;
}

kernel void kvq_encode_group(device const float* x [[buffer(0)]],
                             device uchar* out [[buffer(1)]],
                             constant GroupEncodeParams& p [[buffer(2)]],
                             uint c [[thread_position_in_threadgroup]],
                             uint row [[threadgroup_position_in_grid]]) {
  threadgroup float xs[256];
  threadgroup float2 sm[256];
  threadgroup uchar code[256];
  if (row >= p.rows) return;
  const uint d = p.d, groups = d / p.group;
  device uchar* o = out + row * p.cb;
  xs[c] = x[row * d + c];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float levels = float((1u << p.bits) - 1u);
  if (c < groups) {
    const float2 f = group_fit(xs + c * p.group, p.group, levels);
    sm[c] = f;
    store_f16(o + 4 * c, f.x);
    store_f16(o + 4 * c + 2, f.y);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float2 f = sm[c / p.group];
  const float inv = f.x > 0.0f ? 1.0f / f.x : 0.0f;
  code[c] = uchar(clamp(floor((xs[c] - f.y) * inv + 0.5f), 0.0f, levels));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint per = 8 / p.bits;
  if (c < d / per) {
    uint byte = 0;
    for (uint i = 0; i < per; i++) byte |= uint(code[c * per + i]) << (i * p.bits);
    o[4 * groups + c] = uchar(byte);
  }
}
