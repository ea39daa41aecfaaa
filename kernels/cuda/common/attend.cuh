// The fused decode-attention skeleton every method's CUDA kernel instantiates: flash-decoding
// over the compressed code rows of one kv head, GQA-aware (one pass over the codes serves all
// query heads of the group), split over the sequence, online softmax per split, and the combine
// kernel that merges the splits (exact fp16 rows, sinks and window, arrive as one more split from
// the fp16 kernel).
//
// A method supplies two policies:
//   Keys::prepare(p, q rows, head stride, heads, kv head, smem, D, query row, row stride)
//     per-query state (rotated query, sketch tables, LUT)
//   Keys::score(p, smem state, code row, out[GB], D, part)  this thread's half (part 0 or 1) of
//     q . k for GB heads from one code row; the two halves are summed by a shuffle
//   Vals::accumulate(p, smem, code row, w[GB], acc[GB][8], am[GB], coordinate group)  acc += w v;
//     `am` is one more sum per head that the skeleton adds to all 8 coordinates at the end
//   Vals::finish(p, smem, kv head, acc row of D, D threads)  rotated domain -> values
// Partial states match the CPU op (kvq-kernels attend.rs): per row D unnormalized outputs, the
// running max and the sum of exponentials.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef KVQ_THREADS
#define KVQ_THREADS 128
#endif
#define KVQ_TILE 64  // most tokens per tile: two scoring threads per token

namespace kvq {

struct AttendArgs {
  const float* q;  // query row (b, h, t) at q + b*q_bstride + h*q_hstride + t*q_tstride
  long long q_bstride, q_hstride, q_tstride;
  const uint8_t* kc;  // key code row (b, kh, r) at kc + b*k_bstride + kh*k_hstride + r*kcb
  long long k_bstride, k_hstride;
  const uint8_t* vc;
  long long v_bstride, v_hstride;
  int kcb, vcb;       // bytes of one key / value code row
  int nh, kvh, T;     // query heads, kv heads, query rows per sequence
  int group;          // nh / kvh
  int gb;             // heads handled per block (<= GB)
  int hchunks;        // ceil(group / gb)
  float scale;
  long long first_pos, window, sinks, sliding, code_first, exact_before;
  long long n_rows;   // code rows present
  int split_rows;     // rows per split (a multiple of `tile`)
  int n_splits;
  int kstride, vstride;  // shared-memory stride of one code row (bytes)
  int aligned;           // head bases and strides 16-byte aligned: asynchronous tile copies
  int tile;              // rows per tile (<= KVQ_TILE): smaller for wide rows, for occupancy
  int split_base;        // this launch's first slot among the n_splits of `part`
  float* part;           // [B][nh][T][n_splits][D+2]
};

// The compressed rows [r0, r1) of the query at `pos` (kvq-kernels AttendParams::code_rows).
__device__ inline void code_rows(const AttendArgs& a, long long pos, long long& r0, long long& r1) {
  long long start = a.sliding > 0 ? max(0ll, pos + 1 - a.sliding) : 0;
  long long c1;
  if (pos < a.exact_before) {
    c1 = min(max(a.sinks, start), pos + 1);
  } else {
    c1 = max(pos + 1 - max(a.window, 1ll), 0ll);
    c1 = max(c1, start);
  }
  long long c0 = min(max(a.sinks, start), c1);
  if (c1 <= c0) {
    r0 = r1 = 0;
    return;
  }
  r0 = max(c0 - a.code_first, 0ll);
  r1 = max(c1 - a.code_first, 0ll);
}

__device__ inline float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ inline float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// s[g] += qs[g] * x for the GB heads of one coordinate (qs: GB floats in shared memory, 16-byte
// aligned when GB is a multiple of 4: one vector load per 4 heads).
template <int GB>
__device__ inline void fma_heads(const float* qs, float x, float s[GB]) {
  if constexpr (GB % 4 == 0) {
    const float4* q4 = reinterpret_cast<const float4*>(qs);
#pragma unroll
    for (int g4 = 0; g4 < GB / 4; g4++) {
      const float4 v = q4[g4];
      s[4 * g4] = fmaf(v.x, x, s[4 * g4]);
      s[4 * g4 + 1] = fmaf(v.y, x, s[4 * g4 + 1]);
      s[4 * g4 + 2] = fmaf(v.z, x, s[4 * g4 + 2]);
      s[4 * g4 + 3] = fmaf(v.w, x, s[4 * g4 + 3]);
    }
  } else {
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] = fmaf(qs[g], x, s[g]);
  }
}

__device__ inline float f16_at(const uint8_t* p) {
  return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

// `n` bytes (n <= 4) from p as a little-endian u32.
__device__ inline unsigned bytes_le32(const uint8_t* p, int n) {
  unsigned v = 0;
#pragma unroll
  for (int i = 0; i < 4; i++)
    if (i < n) v |= (unsigned)p[i] << (8 * i);
  return v;
}

// `n` bytes (n <= 8) from p as a little-endian u64.
__device__ inline unsigned long long bytes_le(const uint8_t* p, int n) {
  unsigned long long v = 0;
#pragma unroll
  for (int i = 0; i < 8; i++)
    if (i < n) v |= (unsigned long long)p[i] << (8 * i);
  return v;
}

// Asynchronous 16-byte global -> shared copies (cp.async, sm_80+): many in flight per thread,
// no registers held, completed by cp_async_wait + __syncthreads.
__device__ inline void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Starts copying rows [row0, row0 + n) of one head's code rows (`cb` bytes each, contiguous from
// `head`) into `dst`. Returns the offset of row row0 in `dst`; row t then sits at
// offset + t * stride. Modes (chosen on the host, see cuda/attend.rs):
//   stride != cb: rows re-laid at `stride` in 16-byte pieces (cb and stride multiples of 16);
//   stride == cb (code rows, any alignment): the tile's bytes copied as they are, from the
//     16-byte boundary at or below row0's address, the last partial 16 bytes by plain loads
//     (never past the last row);
//   unaligned fp16 heads: plain byte loads (`aligned` false; the host refuses them).
__device__ inline int load_tile(uint8_t* dst, int stride, const uint8_t* head, int cb,
                                long long row0, int n, bool aligned) {
  const int tid = threadIdx.x;
  if (!aligned) {
    const uint8_t* src = head + row0 * cb;
    for (int i = tid; i < n * cb; i += KVQ_THREADS) {
      const int r = i / cb, c = i - r * cb;
      dst[r * stride + c] = __ldg(src + i);
    }
    return 0;
  }
  if (stride != cb) {
    const int per = cb / 16;
    const uint8_t* src = head + row0 * cb;
    for (int i = tid; i < n * per; i += KVQ_THREADS) {
      const int r = i / per, c = i - r * per;
      cp_async16(dst + r * stride + c * 16, src + (long long)r * cb + c * 16);
    }
    return 0;
  }
  // From the 16-byte boundary at or below the first row's address (inside the allocation,
  // which starts 256-byte aligned), whatever the head's own alignment.
  const unsigned long long b0 = reinterpret_cast<unsigned long long>(head) + row0 * cb;
  const unsigned long long b1 = b0 + (unsigned long long)n * cb;
  const unsigned long long a0 = b0 & ~15ull, a1 = b1 & ~15ull;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(a0);
  for (unsigned long long x = 16 * tid; a0 + x < a1; x += 16 * KVQ_THREADS) cp_async16(dst + x, base + x);
  for (unsigned long long x = (a1 > a0 ? a1 : a0) + tid; x < b1; x += KVQ_THREADS)
    dst[x - a0] = __ldg(reinterpret_cast<const uint8_t*>(x));
  return (int)(b0 - a0);
}

// One block: kv head `kh`, heads [hc*gb, hc*gb + gb) of its group, split `split` of the rows of
// query row z = b*T + t.
template <class K, class V, int D, int GB>
__device__ void attend_block(const AttendArgs& a, const typename K::Params& kp,
                             const typename V::Params& vp, uint8_t* smem) {
  static_assert(D % 8 == 0 && D <= 256, "head dim");
  constexpr int CG = D / 8;                 // coordinate groups of 8 (threads per token lane)
  constexpr int NL = KVQ_THREADS / CG;      // token lanes for value accumulation
  static_assert(KVQ_THREADS % CG == 0 && NL >= 1, "threads");
  const int tid = threadIdx.x;
  const int split = blockIdx.x;
  const int kh = blockIdx.y / a.hchunks, hc = blockIdx.y % a.hchunks;
  const int z = blockIdx.z, b = z / a.T, t = z % a.T;
  const int h0 = kh * a.group + hc * a.gb;
  const int gb = min(a.gb, a.group - hc * a.gb);
  const long long pos = a.first_pos + t;
  long long r0, r1;
  code_rows(a, pos, r0, r1);
  r1 = min(r1, a.n_rows);
  const long long s0 = r0 + (long long)split * a.split_rows;
  const long long s1 = min(r1, s0 + a.split_rows);

  // Shared memory: method state | scores [GB][TILE] | per-head state | lane reduction |
  // two key tiles | two value tiles (double buffered).
  float* kstate = reinterpret_cast<float*>(smem);
  float* vstate = kstate + K::state_floats(kp, D, GB);
  float* sc = vstate + V::state_floats(vp, D, GB);
  float* mstate = sc + GB * KVQ_TILE;     // [GB] running max
  float* lstate = mstate + GB;            // [GB] running sum
  float* alpha = lstate + GB;             // [GB] rescale of this tile
  const int nfloats = (int)(alpha + GB - kstate);
  uint8_t* tiles = reinterpret_cast<uint8_t*>(kstate + ((nfloats + 3) & ~3));  // 16-byte aligned
  // After the last tile the tiles' space holds the lane reduction [NL][GB][D] and the result.
  float* red = reinterpret_cast<float*>(tiles);
  float* fin = red + (NL > 1 ? NL * GB * D : 0);
  const int TL = a.tile;
  const int kbuf = TL * a.kstride + 32, vbuf = TL * a.vstride + 32;
  // Buffer i of the keys at tiles + i*kbuf, of the values at tiles + 2*kbuf + i*vbuf.
  uint8_t* const vtiles = tiles + 2 * kbuf;

  // Row (h, split) of this query row z = b*T + t.
  auto out_row = [&](int h, int s) {
    return a.part + ((((long long)b * a.nh + h) * a.T + t) * a.n_splits + s) * (D + 2);
  };
  if (s1 <= s0) {
    for (int i = tid; i < gb * (D + 2); i += KVQ_THREADS) {
      int g = i / (D + 2), c = i % (D + 2);
      out_row(h0 + g, a.split_base + split)[c] = c == D ? -INFINITY : 0.f;
    }
    return;
  }

  const uint8_t* kbase = a.kc + b * a.k_bstride + kh * a.k_hstride;
  const uint8_t* vbase = a.vc + b * a.v_bstride + kh * a.v_hstride;
  const int ntiles = (int)((s1 - s0 + TL - 1) / TL);
  // Offsets of the first row in each buffer (scalars: a register array indexed at run time
  // would go to local memory).
  int koff0 = 0, koff1 = 0, voff0 = 0, voff1 = 0;
  auto issue = [&](int it) {
    const long long base = s0 + (long long)it * TL;
    const int n = (int)min((long long)TL, s1 - base);
    const int i = it & 1;
    const int ko = load_tile(tiles + i * kbuf, a.kstride, kbase, a.kcb, base, n, a.aligned);
    const int vo = load_tile(vtiles + i * vbuf, a.vstride, vbase, a.vcb, base, n, a.aligned);
    if (i) {
      koff1 = ko;
      voff1 = vo;
    } else {
      koff0 = ko;
      voff0 = vo;
    }
    cp_async_commit();
  };
  issue(0);  // the first tile's copies overlap the query preparation

  const float* qrows = a.q + b * a.q_bstride + h0 * a.q_hstride + t * a.q_tstride;
  // Row of (b, h0, t) in [B][nh][T] order, for per-query data computed before the launch.
  const long long prow = ((long long)b * a.nh + h0) * a.T + t;
  K::template prepare<GB>(kp, qrows, a.q_hstride, gb, kh, kstate, D, prow, a.T);
  V::prepare(vp, kh, vstate, D);
  if (tid < GB) {
    mstate[tid] = -INFINITY;
    lstate[tid] = 0.f;
  }

  const int lane = tid / CG, cg = tid % CG;
  float acc[GB][8], am[GB];
#pragma unroll
  for (int g = 0; g < GB; g++) {
    am[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) acc[g][j] = 0.f;
  }

  for (int it = 0; it < ntiles; it++) {
    const long long base = s0 + (long long)it * TL;
    const int n = (int)min((long long)TL, s1 - base);
    if (it + 1 < ntiles) {
      issue(it + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile `it` has landed; the state is prepared
    const int cur = it & 1;
    const uint8_t* kt = tiles + cur * kbuf + (cur ? koff1 : koff0);
    const uint8_t* vt = vtiles + cur * vbuf + (cur ? voff1 : voff0);
    {
      // Two threads per row, each half of the coordinates; every lane takes part in the
      // shuffle that sums the halves.
      const int tok = tid >> 1, part = tid & 1;
      float s[GB];
      if (tok < n) {
        K::template score<GB>(kp, kstate, kt + tok * a.kstride, s, D, part);
      } else {
#pragma unroll
        for (int g = 0; g < GB; g++) s[g] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < GB; g++) s[g] += __shfl_xor_sync(0xffffffffu, s[g], 1);
      if (tok < n && part == 0) {
#pragma unroll
        for (int g = 0; g < GB; g++) sc[g * KVQ_TILE + tok] = s[g] * a.scale;
      }
    }
    __syncthreads();
    // Online softmax: warp w handles heads w, w + 4, ...
    const int warp = tid / 32, wl = tid % 32;
    for (int g = warp; g < gb; g += KVQ_THREADS / 32) {
      float mx = -INFINITY;
      for (int i = wl; i < n; i += 32) mx = fmaxf(mx, sc[g * KVQ_TILE + i]);
      mx = warp_max(mx);
      const float mold = mstate[g];
      const float mnew = fmaxf(mold, mx);
      float sum = 0.f;
      for (int i = wl; i < n; i += 32) {
        float p = __expf(sc[g * KVQ_TILE + i] - mnew);
        sc[g * KVQ_TILE + i] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      __syncwarp();  // every lane has read mstate[g] before lane 0 replaces it
      if (wl == 0) {
        const float al = mold == -INFINITY ? 0.f : __expf(mold - mnew);
        alpha[g] = al;
        lstate[g] = lstate[g] * al + sum;
        mstate[g] = mnew;
      }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GB; g++) {
      if (g < gb) {
        const float al = alpha[g];
        if (al != 1.f) {
          am[g] *= al;
#pragma unroll
          for (int j = 0; j < 8; j++) acc[g][j] *= al;
        }
      }
    }
    for (int i = lane; i < n; i += NL) {
      float w[GB];
#pragma unroll
      for (int g = 0; g < GB; g++) w[g] = g < gb ? sc[g * KVQ_TILE + i] : 0.f;
      V::template accumulate<GB>(vp, vstate, vt + i * a.vstride, w, acc, am, cg, D);
    }
    __syncthreads();  // everyone is done with this tile's buffers before they are refilled
  }
#pragma unroll
  for (int g = 0; g < GB; g++)
#pragma unroll
    for (int j = 0; j < 8; j++) acc[g][j] += am[g];
  // Reduce the token lanes, let the codec finish (rotate back), write the partial state.
  __syncthreads();
  if (NL > 1) {
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
      for (int j = 0; j < 8; j++) red[(lane * GB + g) * D + cg * 8 + j] = acc[g][j];
    __syncthreads();
    for (int i = tid; i < GB * D; i += KVQ_THREADS) {
      float s = 0.f;
      for (int l = 0; l < NL; l++) s += red[l * GB * D + i];
      fin[i] = s;
    }
  } else {
#pragma unroll
    for (int g = 0; g < GB; g++)
#pragma unroll
      for (int j = 0; j < 8; j++) fin[g * D + cg * 8 + j] = acc[g][j];
  }
  __syncthreads();
  V::finish(vp, vstate, kh, fin, gb, D);
  __syncthreads();
  for (int i = tid; i < gb * (D + 2); i += KVQ_THREADS) {
    int g = i / (D + 2), c = i % (D + 2);
    out_row(h0 + g, a.split_base + split)[c] =
        c < D ? fin[g * D + c] : (c == D ? mstate[g] : lstate[g]);
  }
}

// Shared-memory bytes attend_block needs.
template <class K, class V, int D, int GB>
__host__ __device__ inline size_t attend_smem(const AttendArgs& a, const typename K::Params& kp,
                                              const typename V::Params& vp) {
  constexpr int CG = D / 8, NL = KVQ_THREADS / CG;
  size_t floats = K::state_floats(kp, D, GB) + V::state_floats(vp, D, GB) + GB * KVQ_TILE +
                  3 * GB;
  floats = (floats + 3) & ~(size_t)3;
  size_t tiles = 2 * ((size_t)a.tile * (a.kstride + a.vstride) + 64);
  size_t fin = ((size_t)(NL > 1 ? NL * GB * D : 0) + GB * D) * 4;
  return floats * 4 + (tiles > fin ? tiles : fin);
}

// Merges the n_splits partial states of each (query row, head) into one: [B][nh][T][D+2]
// partial states, or with `normalize` the attention output (divided by the sum) in the first D
// slots. Exact fp16 rows (sinks, window) arrive as one more split, from the fp16 kernel. One
// block of KVQ_THREADS per (row, head): its 4 warps take every 4th split, each lane 4 or 8
// coordinates, so all loads of a block are in flight at once.
struct CombineArgs {
  const float* part;  // [B][nh][T][n_splits][D+2]
  int n_splits, nh, T;
  float* out;  // [B][nh][T][D+2]
  int normalize;
  // Added to the max of splits [0, shift_splits) of row r when non-null: the compressed
  // splits of a centered cache scored `q . (k - mu)`, the softmax needs `q . k`.
  const float* shift;  // [B][nh][T]
  int shift_splits;
};

// Most splits the combine takes (attend.rs keeps n_splits under it).
#define KVQ_MAX_SPLITS 1024

template <int D>
__device__ void combine_block(const CombineArgs& a) {
  constexpr int NW = KVQ_THREADS / 32;
  constexpr int PER = D / 32;  // coordinates per lane: 2, 4 or 8
  const long long row = blockIdx.x;  // (b*nh + h)*T + t
  const int c = threadIdx.x, w = c / 32, lane = c % 32;
  const float* p = a.part + row * a.n_splits * (D + 2);
  __shared__ float ms[KVQ_MAX_SPLITS], ls[KVQ_MAX_SPLITS];
  __shared__ float red[NW][D + 1];
  __shared__ float mred[NW];
  float m = -INFINITY;
  const float sh = a.shift != nullptr ? a.shift[row] : 0.f;
  for (int s = c; s < a.n_splits; s += KVQ_THREADS) {
    ms[s] = p[s * (D + 2) + D] + (s < a.shift_splits ? sh : 0.f);
    ls[s] = p[s * (D + 2) + D + 1];
    m = fmaxf(m, ms[s]);
  }
  m = warp_max(m);
  if (lane == 0) mred[w] = m;
  __syncthreads();
  m = mred[0];
#pragma unroll
  for (int i = 1; i < NW; i++) m = fmaxf(m, mred[i]);
  float o[PER];
#pragma unroll
  for (int k = 0; k < PER; k++) o[k] = 0.f;
  float l = 0.f;
#pragma unroll 4
  for (int s = w; s < a.n_splits; s += NW) {
    const float wgt = ms[s] == -INFINITY ? 0.f : __expf(ms[s] - m);
    l = fmaf(wgt, ls[s], l);
    const float* ps = p + s * (D + 2) + lane * PER;
#pragma unroll
    for (int k = 0; k < PER; k++) o[k] = fmaf(wgt, ps[k], o[k]);
  }
#pragma unroll
  for (int k = 0; k < PER; k++) red[w][lane * PER + k] = o[k];
  if (lane == 0) red[w][D] = l;
  __syncthreads();
  float* out = a.out + row * (D + 2);
  float lt = 0.f;
#pragma unroll
  for (int i = 0; i < NW; i++) lt += red[i][D];
  for (int j = c; j < D; j += KVQ_THREADS) {
    float x = 0.f;
#pragma unroll
    for (int i = 0; i < NW; i++) x += red[i][j];
    out[j] = a.normalize ? (lt > 0.f ? x / lt : 0.f) : x;
  }
  if (c == 0) {
    out[D] = m;
    out[D + 1] = lt;
  }
}

// The unnormalized Walsh-Hadamard transform of `gb` rows of D floats in shared memory, by all
// threads: range-based butterflies (each pair (i, i + h) is formed from the index i's bits,
// never an XOR partner), a barrier after each stage.
__device__ inline void butterflies(float* rows, int gb, int D) {
  for (int h = 1; h < D; h <<= 1) {
    for (int i = threadIdx.x; i < gb * D / 2; i += KVQ_THREADS) {
      int g = i / (D / 2), k = i % (D / 2);
      int lo = (k / h) * 2 * h + (k % h);
      float* r = rows + g * D;
      float u = r[lo], v = r[lo + h];
      r[lo] = u + v;
      r[lo + h] = u - v;
    }
    __syncthreads();
  }
}

// In-place inverse randomized Hadamard of `gb` rows of D floats in shared memory (x <- D H x /
// sqrt(D), kvq-cache hadamard.rs `invert`).
__device__ inline void inverse_hadamard(float* rows, int gb, int D, const float* signs) {
  const float sc = rsqrtf((float)D);
  butterflies(rows, gb, D);
  for (int i = threadIdx.x; i < gb * D; i += KVQ_THREADS) rows[i] *= signs[i % D] * sc;
  __syncthreads();
}

}  // namespace kvq

#define KVQ_ATTEND_ENTRY(NAME, K, V, D, GB)                                                     \
  extern "C" __global__ void __launch_bounds__(KVQ_THREADS, 6)                                    \
      NAME##_d##D##_g##GB(kvq::AttendArgs a, typename K::Params kp, typename V::Params vp) {   \
    extern __shared__ __align__(16) uint8_t kvq_smem[];                                        \
    kvq::attend_block<K, V, D, GB>(a, kp, vp, kvq_smem);                                       \
  }

#define KVQ_ATTEND_ALL(NAME, K, V, D)  \
  KVQ_ATTEND_ENTRY(NAME, K, V, D, 1)   \
  KVQ_ATTEND_ENTRY(NAME, K, V, D, 2)   \
  KVQ_ATTEND_ENTRY(NAME, K, V, D, 4)   \
  KVQ_ATTEND_ENTRY(NAME, K, V, D, 8)
