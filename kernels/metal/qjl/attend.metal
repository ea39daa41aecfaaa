// Fused decode attention of QJL (the Metal twin of kernels/cuda/qjl/attend.cu): one threadgroup of
// 128 threads per (split of the code rows, kv head and chunk of its query heads, query row), the
// skeleton of kernels/metal/turboquant_mse/attend.metal. Key rows are `||k_rest||` (f16), m/8
// sign bytes (bit i of byte j: the sign of projection 8j + i, set = +) and `outliers` exact
// channels (u8 indices, then f16 values), scored as
// `||k_rest|| <a, sign(S k)> + sum_outliers q_c k_c` with a = sqrt(pi/2)/m S q, the projection
// computed once per threadgroup; value rows are groupwise (f16 scale, f16 min per group of
// `vgroup` coordinates, all groups first, then `vbits`-bit codes LSB first), decoded to
// `min + scale * code` before weighting (as the CPU codec sums). Writes one partial row
// [d unnormalized outputs, max, sum] per query head; with `merge` the last split threadgroup of a
// row merges the splits into `out` (kernels/metal/common/combine.metal's `merge_if_last`,
// compiled before this file), else kvq_combine does in a second dispatch. Dispatch:
// kvq_kernels::metal::dispatch::attend_qjl (the same geometry as the scalar kernel's).
#include <metal_stdlib>
using namespace metal;

#define KVQ_QJL_THREADS 128
#define KVQ_QJL_GB 4
#define KVQ_QJL_MAX_D 256
#define KVQ_QJL_MAX_M 1088  // sketch dimension: 4 d + 64 at d = 256

struct QjlAttendParams {
  uint nh;            // query heads
  uint kvh;           // kv heads
  uint t;             // query rows
  uint group;         // query heads per kv head
  uint gb;            // query heads per threadgroup (<= KVQ_QJL_GB)
  uint hchunks;       // ceil(group / gb)
  uint d;             // head dim: 64, 128 or 256
  uint n_rows;        // code rows present per kv head
  uint split_rows;    // rows per split (a multiple of KVQ_QJL_THREADS)
  uint n_splits;
  uint first_pos;     // position of query row 0
  uint window;        // fp16 recent window
  uint sinks;         // fp16 sink positions
  uint sliding;       // sliding attention window, 0: none
  uint code_first;    // position of code row 0
  uint exact_before;  // queries below this read no codes
  uint m;             // sketch dimension, a multiple of 8, <= KVQ_QJL_MAX_M
  uint outliers;      // exact channels per key row
  uint kcb;           // bytes of a key code row: 2 + m / 8 + 3 outliers
  uint vbits;         // value code bits: 2, 4 or 8
  uint vgroup;        // coordinates per value group
  uint vcb;           // bytes of a value code row: 4 d / vgroup + d vbits / 8
  float scale;        // softmax scale
  uint merge;         // 1: the last split threadgroup merges into `out` (MSL 3.2 libraries only)
};

struct QjlRowRange {
  uint r0, r1;
};

// The code rows [r0, r1) the query at `pos` reads (kvq-kernels AttendParams::code_rows).
inline QjlRowRange qjl_code_rows(constant QjlAttendParams& p, uint pos) {
  const uint start = (p.sliding > 0 && pos + 1 > p.sliding) ? pos + 1 - p.sliding : 0u;
  uint c1;
  if (pos < p.exact_before) {
    c1 = min(max(p.sinks, start), pos + 1);
  } else {
    const uint w = max(p.window, 1u);
    c1 = max(pos + 1 > w ? pos + 1 - w : 0u, start);
  }
  const uint c0 = min(max(p.sinks, start), c1);
  QjlRowRange r;
  r.r0 = 0;
  r.r1 = 0;
  if (c1 <= c0) return r;
  r.r0 = c0 > p.code_first ? c0 - p.code_first : 0u;
  r.r1 = c1 > p.code_first ? c1 - p.code_first : 0u;
  return r;
}

inline float qjl_f16(device const uchar* p) {
  return float(as_type<half>(ushort(ushort(p[0]) | (ushort(p[1]) << 8))));
}

kernel void kvq_attend_qjl(device const float* q [[buffer(0)]],
                           device const uchar* kc [[buffer(1)]],
                           device const uchar* vc [[buffer(2)]],
                           device const float* mats [[buffer(3)]],
                           KVQ_COHERENT device float* part [[buffer(4)]],
                           device float* out [[buffer(5)]],
                           device atomic_uint* counters [[buffer(6)]],
                           constant QjlAttendParams& p [[buffer(7)]],
                           uint tid [[thread_position_in_threadgroup]],
                           uint tg [[threadgroup_position_in_grid]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]]) {
  // The query [gb][d] (outlier channels); the projections [gb][m] while scoring, then the token
  // lanes' accumulators [lanes][gb][d] (lanes * d = 8 * KVQ_QJL_THREADS) and the sums [gb][d].
  threadgroup float qs[KVQ_QJL_GB * KVQ_QJL_MAX_D];
  threadgroup float big[KVQ_QJL_GB * KVQ_QJL_MAX_M];
  threadgroup float sc[KVQ_QJL_GB * KVQ_QJL_THREADS];
  threadgroup float mstate[KVQ_QJL_GB];
  threadgroup float lstate[KVQ_QJL_GB];
  threadgroup float alpha[KVQ_QJL_GB];

  const uint d = p.d, m = p.m;
  const uint per_t = p.kvh * p.hchunks * p.n_splits;
  // Shapes past the threadgroup arrays write nothing (the host's plan never makes them).
  if (tg >= per_t * p.t || d > KVQ_QJL_MAX_D || m > KVQ_QJL_MAX_M || p.gb > KVQ_QJL_GB) return;
  const uint t = tg / per_t;
  const uint y = (tg % per_t) / p.n_splits;
  const uint split = tg % p.n_splits;
  const uint kh = y / p.hchunks, hc = y % p.hchunks;
  const uint h0 = kh * p.group + hc * p.gb;
  const uint gb = min(p.gb, p.group - hc * p.gb);
  const QjlRowRange rr = qjl_code_rows(p, p.first_pos + t);
  const uint r1 = min(rr.r1, p.n_rows);
  const uint s0 = rr.r0 + split * p.split_rows;
  const uint s1 = min(r1, s0 + p.split_rows);

  const uint width = d + 2;
  if (s1 <= s0) {
    for (uint i = tid; i < gb * width; i += KVQ_QJL_THREADS) {
      const uint g = i / width, c = i % width;
      part[((h0 + g) * p.t + t) * p.n_splits * width + split * width + c] =
          c == d ? -INFINITY : 0.0f;
    }
    if (p.merge != 0)
      merge_if_last(part, out, counters + tg / p.n_splits, h0, gb, t, p.t, p.n_splits, d, tid,
                    lane, sg, big, sc, alpha);
    return;
  }

  for (uint i = tid; i < gb * d; i += KVQ_QJL_THREADS)
    qs[i] = q[((h0 + i / d) * p.t + t) * d + i % d];
  if (tid < KVQ_QJL_GB) {
    mstate[tid] = -INFINITY;
    lstate[tid] = 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // a = sqrt(pi/2)/m S q: mats is S transposed, [kvh][d][m].
  device const float* S = mats + ulong(kh) * d * m;
  const float cq = 1.2533141f / float(m);
  for (uint i = tid; i < m; i += KVQ_QJL_THREADS) {
    float a[KVQ_QJL_GB];
    for (uint g = 0; g < KVQ_QJL_GB; g++) a[g] = 0.0f;
    for (uint j = 0; j < d; j++) {
      const float s = S[j * m + i];
      for (uint g = 0; g < gb; g++) a[g] = fma(s, qs[g * d + j], a[g]);
    }
    for (uint g = 0; g < gb; g++) big[g * m + i] = a[g] * cq;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint cgs = d / 8;
  const uint lanes = KVQ_QJL_THREADS / cgs;
  const uint tl = tid / cgs, cg = tid % cgs;
  float acc[KVQ_QJL_GB][8];
  for (uint g = 0; g < KVQ_QJL_GB; g++)
    for (uint j = 0; j < 8; j++) acc[g][j] = 0.0f;

  device const uchar* kbase = kc + ulong(kh) * p.n_rows * p.kcb;
  device const uchar* vbase = vc + ulong(kh) * p.n_rows * p.vcb;
  const uint vgroups = d / p.vgroup;
  const ulong vmask = (1ul << p.vbits) - 1ul;
  for (uint base = s0; base < s1; base += KVQ_QJL_THREADS) {
    const uint n = min(uint(KVQ_QJL_THREADS), s1 - base);
    if (tid < n) {
      device const uchar* row = kbase + ulong(base + tid) * p.kcb;
      float s[KVQ_QJL_GB];
      for (uint g = 0; g < KVQ_QJL_GB; g++) s[g] = 0.0f;
      for (uint b = 0; b < m / 8; b++) {
        const uint bits = row[2 + b];
        for (uint k = 0; k < 8; k++) {
          const bool plus = ((bits >> k) & 1u) != 0;
          for (uint g = 0; g < gb; g++) {
            const float a = big[g * m + 8 * b + k];
            s[g] += plus ? a : -a;
          }
        }
      }
      const float norm = qjl_f16(row);
      for (uint g = 0; g < gb; g++) s[g] *= norm;
      device const uchar* idx = row + 2 + m / 8;
      for (uint o = 0; o < p.outliers; o++) {
        const uint c = idx[o];
        const float v = qjl_f16(idx + p.outliers + 2 * o);
        if (c < d)
          for (uint g = 0; g < gb; g++) s[g] = fma(qs[g * d + c], v, s[g]);
      }
      for (uint g = 0; g < gb; g++) sc[g * KVQ_QJL_THREADS + tid] = s[g] * p.scale;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Online softmax: simdgroup g handles head g.
    if (sg < gb) {
      const uint g = sg;
      float mx = -INFINITY;
      for (uint i = lane; i < n; i += 32) mx = max(mx, sc[g * KVQ_QJL_THREADS + i]);
      mx = simd_max(mx);
      const float mold = mstate[g];
      const float mnew = max(mold, mx);
      float sum = 0.0f;
      for (uint i = lane; i < n; i += 32) {
        const float e = exp(sc[g * KVQ_QJL_THREADS + i] - mnew);
        sc[g * KVQ_QJL_THREADS + i] = e;
        sum += e;
      }
      // Every lane has read mstate[g] before this exchange; lane 0 replaces it after.
      sum = simd_sum(sum);
      if (lane == 0) {
        const float al = mold == -INFINITY ? 0.0f : exp(mold - mnew);
        alpha[g] = al;
        lstate[g] = lstate[g] * al + sum;
        mstate[g] = mnew;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint g = 0; g < gb; g++) {
      const float al = alpha[g];
      for (uint j = 0; j < 8; j++) acc[g][j] *= al;
    }
    for (uint i = tl; i < n; i += lanes) {
      device const uchar* row = vbase + ulong(base + i) * p.vcb;
      ulong v = 0;
      for (uint b = 0; b < p.vbits; b++) v |= ulong(row[4 * vgroups + cg * p.vbits + b]) << (8 * b);
      for (uint j = 0; j < 8; j++) {
        const uint gi = (cg * 8 + j) / p.vgroup;
        const float x = fma(qjl_f16(row + 4 * gi), float(uint((v >> (j * p.vbits)) & vmask)),
                            qjl_f16(row + 4 * gi + 2));
        for (uint g = 0; g < gb; g++) acc[g][j] = fma(sc[g * KVQ_QJL_THREADS + i], x, acc[g][j]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Reduce the token lanes (the projections are no longer needed) and write.
  for (uint g = 0; g < gb; g++)
    for (uint j = 0; j < 8; j++) big[(tl * gb + g) * d + cg * 8 + j] = acc[g][j];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < gb * width; i += KVQ_QJL_THREADS) {
    const uint g = i / width, c = i % width;
    float x = c == d ? mstate[g] : lstate[g];
    if (c < d) {
      x = 0.0f;
      for (uint l = 0; l < lanes; l++) x += big[(l * gb + g) * d + c];
    }
    part[((h0 + g) * p.t + t) * p.n_splits * width + split * width + c] = x;
  }
  if (p.merge != 0)
    merge_if_last(part, out, counters + tg / p.n_splits, h0, gb, t, p.t, p.n_splits, d, tid, lane,
                  sg, big, sc, alpha);
}
