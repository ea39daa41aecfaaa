// Fused decode attention over code rows (the Metal twin of kernels/cuda/turboquant_mse/attend.cu
// with kernels/cuda/common/attend.cuh's skeleton), written once as `attend_codes<KIND>` for the
// code layouts: KVQ_SCALAR (TurboQuant-MSE and -RVQ, kvq_attend_scalar below), KVQ_PROD
// (TurboQuant-Prod's scalar stage plus residual sketch, kernels/metal/turboquant_prod), and
// KVQ_VQ / KVQ_VQ_LUT (VecInfer, centroids gathered or a per-query table of 16-bit scores,
// kernels/metal/vecinfer), whose files are compiled after this one. One
// threadgroup of 128 threads per (split of the code rows, kv head and chunk of its query heads,
// query row). Code rows are an f16 norm then d indices of `bits` bits packed LSB first (kvq-kernels
// spec.rs ScalarSpec). Keys are scored against the query rotated once per threadgroup and scaled
// by sigma (`q . k = norm * sum_c (R q)_c sigma level[idx_c]`); values are summed in the rotated
// domain with an online softmax and rotated back once at the end. Each threadgroup writes one
// partial row [d unnormalized outputs, max, sum] per query head (kvq-kernels attend.rs
// `Partial`); with `merge` the last split threadgroup of a row merges the splits into `out`
// (kernels/metal/common/combine.metal's `merge_if_last`, compiled before this file), else
// kvq_combine does in a second dispatch. Dispatch:
// kvq_kernels::metal::dispatch::attend_scalar (a 1-D grid of threadgroups, index
// (t * kv_heads * hchunks + kh * hchunks + hc) * n_splits + split).
#include <metal_stdlib>
using namespace metal;

#define KVQ_ATTEND_THREADS 128  // threads per threadgroup: 4 simdgroups
#define KVQ_ATTEND_GB 4         // most query heads per threadgroup
#define KVQ_ATTEND_MAX_D 256

#define KVQ_SCALAR 0
#define KVQ_PROD 1
#define KVQ_VQ 2
#define KVQ_VQ_LUT 3

#define KVQ_LUT_GB 2          // most query heads of a KVQ_VQ_LUT threadgroup
#define KVQ_LUT_ENTRIES 8192  // its table: [gb][d / ksub][256] ushorts, 16 KiB
#define KVQ_LUT_MAX_SP 64     // most sub-positions (d / ksub)

// The parameters of all three layouts (the fields of the others are zero).
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
  uint m;             // KVQ_PROD: the residual sketch's dimension (<= KVQ_ATTEND_MAX_D)
  uint ksub;          // KVQ_VQ: key sub-vector length (4 or 8); kcb = d / ksub
  uint vsub;          // KVQ_VQ: value sub-vector length; vcb = d / vsub
  uint kbooks;        // KVQ_VQ: key codebooks, 1 (shared) or d / ksub (one per sub-position)
  uint vbooks;        // KVQ_VQ: value codebooks
  uint merge;         // 1: the last split threadgroup merges into `out` (MSL 3.2 libraries only)
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

// The attention of one threadgroup, for code layout KIND. Buffers by layout:
//   KVQ_SCALAR: ka = key levels, kb = key signs, kx unused, va = value levels, vb = value signs;
//   KVQ_PROD:   the same, kx = the sketch matrices transposed [kvh][d][m];
//   KVQ_VQ:     ka = key codebooks [kbooks][256][ksub], kb = key signs, kx = smoothing factors
//               [kvh][d], va = value codebooks, vb = value signs;
//   KVQ_VQ_LUT: the same, kn = each key codebook's largest centroid norm [kbooks].
// The threadgroup arrays are the kernel's (MSL declares them in kernel scope): qs [GB][MAX_D],
// sq [GB][MAX_D] (KVQ_PROD; KVQ_VQ_LUT: the table's steps and bounds, [2][LUT_GB][LUT_MAX_SP]
// then the offsets [LUT_GB]), klv / vlv [64], sc [GB][THREADS], the softmax states [GB], red
// [GB][8 * THREADS] and lut [LUT_ENTRIES] (KVQ_VQ_LUT; the other kinds pass an array they never
// index through it). KVQ_VQ_LUT's arrays hold LUT_GB heads, not GB.
template <uint KIND, class TG, class TGU>
inline void attend_codes(device const float* q, device const uchar* kc, device const uchar* vc,
                         device const float* ka, device const float* kb, device const float* kx,
                         device const float* kn, device const float* va, device const float* vb,
                         KVQ_COHERENT device float* part, device float* out,
                         device atomic_uint* counters, constant ScalarAttendParams& p, TG qs,
                         TG sq, TG klv, TG vlv, TG sc, TG mstate, TG lstate, TG alpha, TG red,
                         TGU lut, uint tid, uint tg, uint lane, uint sg) {
  const uint d = p.d;
  const uint per_t = p.kvh * p.hchunks * p.n_splits;
  // Shapes past the threadgroup arrays write nothing (the host's plan never makes them).
  if (tg >= per_t * p.t || d > KVQ_ATTEND_MAX_D || p.gb > KVQ_ATTEND_GB) return;
  if (KIND == KVQ_PROD && (p.m > KVQ_ATTEND_MAX_D || p.m % 8 != 0)) return;
  const bool vq = KIND == KVQ_VQ || KIND == KVQ_VQ_LUT;
  if (vq && (p.ksub == 0 || p.vsub == 0 || d % p.ksub != 0 || d % p.vsub != 0)) return;
  if (KIND == KVQ_VQ_LUT && (p.gb > KVQ_LUT_GB || d / p.ksub > KVQ_LUT_MAX_SP ||
                             p.gb * (d / p.ksub) * 256 > KVQ_LUT_ENTRIES))
    return;
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
    if (p.merge != 0)
      merge_if_last(part, out, counters + tg / p.n_splits, h0, gb, t, p.t, p.n_splits, d, tid,
                    lane, sg, red, sc, alpha);
    return;
  }

  // The query rotated: qs = H diag(signs) q' / sqrt(d), q' = q (scaled by sigma after the
  // rotation) or q * lambda (KVQ_VQ).
  device const float* ks = kb + kh * d;
  for (uint i = tid; i < gb * d; i += KVQ_ATTEND_THREADS) {
    const uint g = i / d, c = i % d;
    const float lam = vq ? kx[kh * d + c] : 1.0f;
    qs[i] = q[((h0 + g) * p.t + t) * d + c] * lam * ks[c];
  }
  if (!vq) {
    if (tid < (1u << p.kbits)) klv[tid] = ka[tid];
    if (tid < (1u << p.vbits)) vlv[tid] = va[tid] * p.vsigma;
  }
  if (tid < KVQ_ATTEND_GB) {
    mstate[tid] = -INFINITY;
    lstate[tid] = 0.0f;
  }
  if (KIND == KVQ_PROD) {
    // a = sqrt(pi/2)/m S q from the unrotated query: kx is S transposed, [kvh][d][m].
    device const float* S = kx + ulong(kh) * d * p.m;
    const float cq = 1.2533141f / float(p.m);
    for (uint i = tid; i < p.m; i += KVQ_ATTEND_THREADS) {
      float a[KVQ_ATTEND_GB];
      for (uint g = 0; g < KVQ_ATTEND_GB; g++) a[g] = 0.0f;
      for (uint j = 0; j < d; j++) {
        const float sv = S[j * p.m + i];
        for (uint g = 0; g < gb; g++) a[g] = fma(sv, q[((h0 + g) * p.t + t) * d + j], a[g]);
      }
      for (uint g = 0; g < gb; g++) sq[g * p.m + i] = a[g] * cq;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  butterflies(qs, gb, d, tid);
  const float post = rsqrt(float(d)) * (vq ? 1.0f : p.ksigma);
  for (uint i = tid; i < gb * d; i += KVQ_ATTEND_THREADS) qs[i] *= post;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // KVQ_VQ_LUT: the query's table. Entry (g, sp, c) is L = qs_g[sp] . centroid c of sp's book,
  // stored as 16-bit fixed point over [-B, B], B = |qs_g[sp]| * the book's largest centroid norm
  // (Cauchy-Schwarz bounds every L by it): L = u * step - B, step = 2 B / 65535, so a key's
  // score is sum_sp u * step - sum_sp B, within sum_sp step / 2 of the exact one.
  const uint nsp = vq ? d / p.ksub : 0u;
  if (KIND == KVQ_VQ_LUT) {
    const uint bounds = KVQ_LUT_GB * KVQ_LUT_MAX_SP;
    for (uint i = tid; i < gb * nsp; i += KVQ_ATTEND_THREADS) {
      const uint g = i / nsp, sp = i % nsp;
      float qq = 0.0f;
      for (uint k = 0; k < p.ksub; k++) {
        const float x = qs[g * d + sp * p.ksub + k];
        qq = fma(x, x, qq);
      }
      const float b = sqrt(qq) * kn[p.kbooks == 1 ? 0u : sp];
      sq[i] = b * (2.0f / 65535.0f);
      sq[bounds + i] = b;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < gb) {
      float off = 0.0f;
      for (uint sp = 0; sp < nsp; sp++) off += sq[bounds + tid * nsp + sp];
      sq[2 * bounds + tid] = off;
    }
    for (uint i = tid; i < gb * nsp * 256; i += KVQ_ATTEND_THREADS) {
      const uint g = i / (nsp * 256), sp = (i / 256) % nsp, c = i % 256;
      device const float* cen = ka + (ulong(p.kbooks == 1 ? 0u : sp) * 256 + c) * p.ksub;
      float l = 0.0f;
      for (uint k = 0; k < p.ksub; k++) l = fma(qs[g * d + sp * p.ksub + k], cen[k], l);
      const float step = sq[g * nsp + sp];
      const float u = step > 0.0f ? rint((l + sq[bounds + g * nsp + sp]) / step) : 0.0f;
      lut[i] = ushort(clamp(u, 0.0f, 65535.0f));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

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
      if (KIND == KVQ_VQ_LUT) {
        // sum over sub-positions of the table's entry for the row's index there.
        for (uint sp = 0; sp < nsp; sp++) {
          const uint c = row[sp];
          for (uint g = 0; g < gb; g++)
            s[g] = fma(float(lut[(g * nsp + sp) * 256 + c]), sq[g * nsp + sp], s[g]);
        }
        for (uint g = 0; g < gb; g++) s[g] -= sq[2 * KVQ_LUT_GB * KVQ_LUT_MAX_SP + g];
      } else if (KIND == KVQ_VQ) {
        // sum over sub-positions of the rotated query's slice . the row's centroid there.
        for (uint sp = 0; sp < d / p.ksub; sp++) {
          const uint book = p.kbooks == 1 ? 0u : sp;
          device const float* cen = ka + (ulong(book) * 256 + row[sp]) * p.ksub;
          for (uint k = 0; k < p.ksub; k++) {
            const float cv = cen[k];
            for (uint g = 0; g < gb; g++) s[g] = fma(qs[g * d + sp * p.ksub + k], cv, s[g]);
          }
        }
      } else {
        for (uint grp = 0; grp < d / 8; grp++) {
          const ulong v = index_group(row + 2, grp, p.kbits);
          for (uint j = 0; j < 8; j++) {
            const float L = klv[(v >> (j * p.kbits)) & kmask];
            for (uint g = 0; g < gb; g++) s[g] = fma(qs[g * d + grp * 8 + j], L, s[g]);
          }
        }
        const float kn = f16_at(row);
        for (uint g = 0; g < gb; g++) s[g] *= kn;
      }
      if (KIND == KVQ_PROD) {
        // + ||r|| sqrt(pi/2)/m <S q, sign(S r)>: the residual's f16 norm, then m/8 sign bytes.
        device const uchar* at = row + 2 + d * p.kbits / 8;
        const float rn = f16_at(at);
        for (uint b = 0; b < p.m / 8; b++) {
          const uint bits = at[2 + b];
          for (uint k = 0; k < 8; k++) {
            const bool plus = ((bits >> k) & 1u) != 0;
            for (uint g = 0; g < gb; g++) {
              const float a = sq[g * p.m + 8 * b + k] * rn;
              s[g] += plus ? a : -a;
            }
          }
        }
      }
      const float norm = p.scale;
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
      float x[8];
      if (vq) {
        // The thread's 8 coordinates: two sub-vectors of 4 or one of 8.
        for (uint j = 0; j < 8; j++) {
          const uint c = cg * 8 + j, sp = c / p.vsub;
          const uint book = p.vbooks == 1 ? 0u : sp;
          x[j] = va[(ulong(book) * 256 + row[sp]) * p.vsub + c % p.vsub];
        }
      } else {
        const float norm = f16_at(row);
        const ulong v = index_group(row + 2, cg, p.vbits);
        for (uint j = 0; j < 8; j++) x[j] = vlv[(v >> (j * p.vbits)) & vmask] * norm;
      }
      for (uint j = 0; j < 8; j++)
        for (uint g = 0; g < gb; g++)
          acc[g][j] = fma(sc[g * KVQ_ATTEND_THREADS + i], x[j], acc[g][j]);
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
  device const float* vs = vb + kh * d;
  const float inv = rsqrt(float(d));
  for (uint i = tid; i < gb * width; i += KVQ_ATTEND_THREADS) {
    const uint g = i / width, c = i % width;
    const float x = c < d ? qs[g * d + c] * vs[c] * inv : (c == d ? mstate[g] : lstate[g]);
    part[((h0 + g) * p.t + t) * p.n_splits * width + split * width + c] = x;
  }
  if (p.merge != 0)
    merge_if_last(part, out, counters + tg / p.n_splits, h0, gb, t, p.t, p.n_splits, d, tid, lane,
                  sg, red, sc, alpha);
}

// The threadgroup arrays of one attention threadgroup, declared in the kernel's scope.
#define KVQ_ATTEND_ARRAYS                                                                   \
  threadgroup float qs[KVQ_ATTEND_GB * KVQ_ATTEND_MAX_D];                                   \
  threadgroup float klv[64];                                                                \
  threadgroup float vlv[64];                                                                \
  threadgroup float sc[KVQ_ATTEND_GB * KVQ_ATTEND_THREADS];                                 \
  threadgroup float mstate[KVQ_ATTEND_GB];                                                  \
  threadgroup float lstate[KVQ_ATTEND_GB];                                                  \
  threadgroup float alpha[KVQ_ATTEND_GB];                                                   \
  threadgroup float red[KVQ_ATTEND_GB * 8 * KVQ_ATTEND_THREADS]

kernel void kvq_attend_scalar(device const float* q [[buffer(0)]],
                              device const uchar* kc [[buffer(1)]],
                              device const uchar* vc [[buffer(2)]],
                              device const float* klevels [[buffer(3)]],
                              device const float* ksigns [[buffer(4)]],
                              device const float* vlevels [[buffer(5)]],
                              device const float* vsigns [[buffer(6)]],
                              KVQ_COHERENT device float* part [[buffer(7)]],
                              device float* out [[buffer(8)]],
                              device atomic_uint* counters [[buffer(9)]],
                              constant ScalarAttendParams& p [[buffer(10)]],
                              uint tid [[thread_position_in_threadgroup]],
                              uint tg [[threadgroup_position_in_grid]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]]) {
  KVQ_ATTEND_ARRAYS;
  // (klevels stands in for the arrays this kind never reads, sc for the table.)
  attend_codes<KVQ_SCALAR>(q, kc, vc, klevels, ksigns, klevels, klevels, vlevels, vsigns, part, out,
                           counters, p, qs, qs, klv, vlv, sc, mstate, lstate, alpha, red, sc, tid,
                           tg, lane, sg);
}
