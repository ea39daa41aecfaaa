// Fused decode attention of TurboQuant-MSE and -RVQ (the Metal twin of
// kernels/cuda/turboquant_mse/attend.cu with kernels/cuda/common/attend.cuh's skeleton): one
// threadgroup of 128 threads per (split of the code rows, kv head and chunk of its query heads,
// query row). Code rows are an f16 norm then d indices of `bits` bits packed LSB first (kvq-kernels
// spec.rs ScalarSpec). Keys are scored against the query rotated once per threadgroup and scaled
// by sigma (`q . k = norm * sum_c (R q)_c sigma level[idx_c]`); values are summed in the rotated
// domain with an online softmax and rotated back once at the end. Each threadgroup writes one
// partial row [d unnormalized outputs, max, sum] per query head (kvq-kernels attend.rs
// `Partial`); kernels/metal/common/combine.metal merges the splits. Dispatch:
// kvq_kernels::metal::dispatch::attend_scalar (a 1-D grid of threadgroups, index
// (t * kv_heads * hchunks + kh * hchunks + hc) * n_splits + split).
#include <metal_stdlib>
using namespace metal;

#define KVQ_ATTEND_THREADS 128  // threads per threadgroup: 4 simdgroups
#define KVQ_ATTEND_GB 4         // most query heads per threadgroup
#define KVQ_ATTEND_MAX_D 256

struct ScalarAttendParams {
  uint nh;            // query heads
  uint kvh;           // kv heads (nh / group)
  uint t;             // query rows
  uint group;         // query heads per kv head
  uint gb;            // query heads per threadgroup (<= KVQ_ATTEND_GB)
  uint hchunks;       // ceil(group / gb)
  uint d;             // head dim: 64, 128 or 256
  uint n_rows;        // code rows present per kv head
  uint split_rows;    // rows per split (a multiple of KVQ_ATTEND_THREADS)
  uint n_splits;
  uint first_pos;     // position of query row 0
  uint window;        // fp16 recent window
  uint sinks;         // fp16 sink positions
  uint sliding;       // sliding attention window, 0: none
  uint code_first;    // position of code row 0
  uint exact_before;  // queries below this read no codes
  uint kbits;         // key index bits, 1..6
  uint vbits;         // value index bits, 1..6
  uint kcb;           // bytes of a key code row: 2 + d * kbits / 8
  uint vcb;           // bytes of a value code row
  float scale;        // softmax scale
  float ksigma;       // 1 / sqrt(d)
  float vsigma;
};

// The code rows [r0, r1) the query at `pos` reads (kvq-kernels AttendParams::code_rows).
struct RowRange {
  uint r0, r1;
};

inline RowRange code_rows(constant ScalarAttendParams& p, uint pos) {
  const uint start = (p.sliding > 0 && pos + 1 > p.sliding) ? pos + 1 - p.sliding : 0u;
  uint c1;
  if (pos < p.exact_before) {
    c1 = min(max(p.sinks, start), pos + 1);
  } else {
    const uint w = max(p.window, 1u);
    c1 = max(pos + 1 > w ? pos + 1 - w : 0u, start);
  }
  const uint c0 = min(max(p.sinks, start), c1);
  RowRange r;
  r.r0 = 0;
  r.r1 = 0;
  if (c1 <= c0) return r;
  r.r0 = c0 > p.code_first ? c0 - p.code_first : 0u;
  r.r1 = c1 > p.code_first ? c1 - p.code_first : 0u;
  return r;
}

// The 8 indices of coordinate group `grp` (bits <= 6: at most 6 bytes) as one word.
inline ulong index_group(device const uchar* idx, uint grp, uint bits) {
  ulong v = 0;
  for (uint b = 0; b < bits; b++) v |= ulong(idx[grp * bits + b]) << (8 * b);
  return v;
}

inline float f16_at(device const uchar* p) {
  return float(as_type<half>(ushort(ushort(p[0]) | (ushort(p[1]) << 8))));
}

// The unnormalized Walsh-Hadamard transform of `gb` rows of d floats in threadgroup memory, by
// all threads: range-based butterflies (the pair (lo, lo + h) formed from the index's bits), a
// barrier after each stage. The caller has a barrier between writing `rows` and this call.
template <class TG>
inline void butterflies(TG rows, uint gb, uint d, uint tid) {
  for (uint h = 1; h < d; h <<= 1) {
    for (uint i = tid; i < gb * d / 2; i += KVQ_ATTEND_THREADS) {
      const uint g = i / (d / 2), k = i % (d / 2);
      const uint lo = (k / h) * 2 * h + (k % h);
      const float u = rows[g * d + lo];
      const float v = rows[g * d + lo + h];
      rows[g * d + lo] = u + v;
      rows[g * d + lo + h] = u - v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

kernel void kvq_attend_scalar(device const float* q [[buffer(0)]],
                              device const uchar* kc [[buffer(1)]],
                              device const uchar* vc [[buffer(2)]],
                              device const float* klevels [[buffer(3)]],
                              device const float* ksigns [[buffer(4)]],
                              device const float* vlevels [[buffer(5)]],
                              device const float* vsigns [[buffer(6)]],
                              device float* part [[buffer(7)]],
                              constant ScalarAttendParams& p [[buffer(8)]],
                              uint tid [[thread_position_in_threadgroup]],
                              uint tg [[threadgroup_position_in_grid]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]]) {
  // The rotated query [gb][d]; after the last tile, the reduced outputs [gb][d].
  threadgroup float qs[KVQ_ATTEND_GB * KVQ_ATTEND_MAX_D];
  threadgroup float klv[64];
  threadgroup float vlv[64];
  threadgroup float sc[KVQ_ATTEND_GB * KVQ_ATTEND_THREADS];  // one tile's scores, then weights
  threadgroup float mstate[KVQ_ATTEND_GB];                    // running max
  threadgroup float lstate[KVQ_ATTEND_GB];                    // running sum
  threadgroup float alpha[KVQ_ATTEND_GB];                     // this tile's rescale
  // The token lanes' accumulators: [lanes][gb][d], lanes * d = 8 * KVQ_ATTEND_THREADS.
  threadgroup float red[KVQ_ATTEND_GB * 8 * KVQ_ATTEND_THREADS];

  const uint d = p.d;
  const uint per_t = p.kvh * p.hchunks * p.n_splits;
  // Shapes past the threadgroup arrays write nothing (the host's plan never makes them).
  if (tg >= per_t * p.t || d > KVQ_ATTEND_MAX_D || p.gb > KVQ_ATTEND_GB) return;
  const uint t = tg / per_t;
  const uint y = (tg % per_t) / p.n_splits;
  const uint split = tg % p.n_splits;
  const uint kh = y / p.hchunks, hc = y % p.hchunks;
  const uint h0 = kh * p.group + hc * p.gb;
  const uint gb = min(p.gb, p.group - hc * p.gb);
  const RowRange rr = code_rows(p, p.first_pos + t);
  const uint r1 = min(rr.r1, p.n_rows);
  const uint s0 = rr.r0 + split * p.split_rows;
  const uint s1 = min(r1, s0 + p.split_rows);

  // Row (h, split) of query row t: part is [nh][t][n_splits][d + 2].
  const uint width = d + 2;
  if (s1 <= s0) {
    for (uint i = tid; i < gb * width; i += KVQ_ATTEND_THREADS) {
      const uint g = i / width, c = i % width;
      part[((h0 + g) * p.t + t) * p.n_splits * width + split * width + c] =
          c == d ? -INFINITY : 0.0f;
    }
    return;
  }

  // The query rotated and scaled: qs = H diag(signs) q / sqrt(d) * sigma.
  device const float* ks = ksigns + kh * d;
  for (uint i = tid; i < gb * d; i += KVQ_ATTEND_THREADS) {
    const uint g = i / d, c = i % d;
    qs[i] = q[((h0 + g) * p.t + t) * d + c] * ks[c];
  }
  if (tid < (1u << p.kbits)) klv[tid] = klevels[tid];
  if (tid < (1u << p.vbits)) vlv[tid] = vlevels[tid] * p.vsigma;
  if (tid < KVQ_ATTEND_GB) {
    mstate[tid] = -INFINITY;
    lstate[tid] = 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  butterflies(qs, gb, d, tid);
  const float post = rsqrt(float(d)) * p.ksigma;
  for (uint i = tid; i < gb * d; i += KVQ_ATTEND_THREADS) qs[i] *= post;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Value accumulation: d / 8 coordinate groups, the threads' other index a token lane.
  const uint cgs = d / 8;
  const uint lanes = KVQ_ATTEND_THREADS / cgs;
  const uint tl = tid / cgs, cg = tid % cgs;
  float acc[KVQ_ATTEND_GB][8];
  for (uint g = 0; g < KVQ_ATTEND_GB; g++)
    for (uint j = 0; j < 8; j++) acc[g][j] = 0.0f;

  device const uchar* kbase = kc + ulong(kh) * p.n_rows * p.kcb;
  device const uchar* vbase = vc + ulong(kh) * p.n_rows * p.vcb;
  const ulong kmask = (1ul << p.kbits) - 1ul, vmask = (1ul << p.vbits) - 1ul;
  for (uint base = s0; base < s1; base += KVQ_ATTEND_THREADS) {
    const uint n = min(uint(KVQ_ATTEND_THREADS), s1 - base);
    // Scores: one thread per row of the tile, every head of the chunk.
    if (tid < n) {
      device const uchar* row = kbase + ulong(base + tid) * p.kcb;
      float s[KVQ_ATTEND_GB];
      for (uint g = 0; g < KVQ_ATTEND_GB; g++) s[g] = 0.0f;
      for (uint grp = 0; grp < d / 8; grp++) {
        const ulong v = index_group(row + 2, grp, p.kbits);
        for (uint j = 0; j < 8; j++) {
          const float L = klv[(v >> (j * p.kbits)) & kmask];
          for (uint g = 0; g < gb; g++) s[g] = fma(qs[g * d + grp * 8 + j], L, s[g]);
        }
      }
      const float norm = f16_at(row) * p.scale;
      for (uint g = 0; g < gb; g++) sc[g * KVQ_ATTEND_THREADS + tid] = s[g] * norm;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Online softmax: simdgroup g handles head g.
    if (sg < gb) {
      const uint g = sg;
      float mx = -INFINITY;
      for (uint i = lane; i < n; i += 32) mx = max(mx, sc[g * KVQ_ATTEND_THREADS + i]);
      mx = simd_max(mx);
      const float mold = mstate[g];
      const float mnew = max(mold, mx);
      float sum = 0.0f;
      for (uint i = lane; i < n; i += 32) {
        const float e = exp(sc[g * KVQ_ATTEND_THREADS + i] - mnew);
        sc[g * KVQ_ATTEND_THREADS + i] = e;
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
      const float norm = f16_at(row);
      const ulong v = index_group(row + 2, cg, p.vbits);
      for (uint j = 0; j < 8; j++) {
        const float L = vlv[(v >> (j * p.vbits)) & vmask];
        for (uint g = 0; g < gb; g++)
          acc[g][j] = fma(sc[g * KVQ_ATTEND_THREADS + i] * norm, L, acc[g][j]);
      }
    }
    // Every thread is done with this tile's weights before the next tile's scores.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Reduce the token lanes into qs (the query is no longer needed), rotate back, write.
  for (uint g = 0; g < gb; g++)
    for (uint j = 0; j < 8; j++) red[(tl * gb + g) * d + cg * 8 + j] = acc[g][j];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < gb * d; i += KVQ_ATTEND_THREADS) {
    float s = 0.0f;
    for (uint l = 0; l < lanes; l++) s += red[l * gb * d + i];
    qs[i] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Inverse rotation: x <- diag(signs) H x / sqrt(d).
  butterflies(qs, gb, d, tid);
  device const float* vs = vsigns + kh * d;
  const float inv = rsqrt(float(d));
  for (uint i = tid; i < gb * width; i += KVQ_ATTEND_THREADS) {
    const uint g = i / width, c = i % width;
    const float x = c < d ? qs[g * d + c] * vs[c] * inv : (c == d ? mstate[g] : lstate[g]);
    part[((h0 + g) * p.t + t) * p.n_splits * width + split * width + c] = x;
  }
}
