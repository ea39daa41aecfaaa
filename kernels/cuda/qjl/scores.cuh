// QJL's key scores in the fused decode attention (qjl/fast.cu): the sign sketch against the
// query's projection by s8 tensor-core mmas, times the key norm, plus the exact outlier channels.
//
// The keys are the A operand (16 tokens of a chunk as rows), their sign bits turned into s8 +-1
// four at a time by a 16-word table; the projection is the B operand, each query head as two s8
// columns (hi and lo parts: p ~ hi * s_hi + lo * s_lo, about 15 significant bits), so one
// m16n8k32 mma scores 16 tokens against 4 heads over 32 sketch bits and its s32 sums are exact.
// The sketch's k order is free (a dot product): lane quarter t4 takes bits t4 * span + 8j .. +7
// of k step j, which is byte j of its quarter of the row (low nibble to a0/a1, high to a2/a3).
#pragma once
#include "../common/fast.cuh"
#include "params.cuh"

namespace kvq {

// A 16-bit little-endian field at any byte offset: key rows may have odd lengths (their
// outliers take 3 bytes each), so their fields are read byte by byte.
__device__ inline unsigned lds16(const uint8_t* smem, int off) {
  return (unsigned)smem[off] | ((unsigned)smem[off + 1] << 8);
}

// `sc` plus a key row's OC exact outlier channels against head g's query `qg`: the row's
// outlier bytes at `at` (OC channel indices, then OC f16 values) read as words, the fields taken
// out of registers at offsets known at compile time (the presets have 0, 1 or 4 outliers). The
// same products and order as the generic loop.
template <int D, int OC>
__device__ inline float qjl_outliers(const uint8_t* smem, int at, const float* qg, float sc) {
  constexpr int NW = (3 * OC + 3) / 4;
  unsigned w[NW + 1];
  lds_words<NW>(smem, at, w);
  w[NW] = 0u;
#pragma unroll
  for (int o = 0; o < OC; o++) {
    const unsigned ch = (w[o >> 2] >> (8 * (o & 3))) & 0xffu;
    constexpr int VB0 = OC;  // first value byte
    const int vb = VB0 + 2 * o;
    const unsigned bits = (vb & 3) == 3 ? __funnelshift_r(w[vb >> 2], w[(vb >> 2) + 1], 24)
                                        : w[vb >> 2] >> (8 * (vb & 3));
    const float v = __half2float(__ushort_as_half((unsigned short)(bits & 0xffffu)));
    if (ch < (unsigned)D) sc = fmaf(qg[ch], v, sc);
  }
  return sc;
}

// `sc` plus the outliers of the key row at `row` (channels from byte `at`) against `qg`.
template <int D>
__device__ inline float qjl_row_outliers(const uint8_t* smem, int row, int at, int O,
                                         const float* qg, float sc) {
  if (O == 4) return qjl_outliers<D, 4>(smem, row + at, qg, sc);
  if (O == 1) return qjl_outliers<D, 1>(smem, row + at, qg, sc);
  for (int o = 0; o < O; o++) {
    const int ch = smem[row + at + o];
    const float v =
        __half2float(__ushort_as_half((unsigned short)lds16(smem, row + at + O + 2 * o)));
    if (ch < D) sc = fmaf(qg[ch], v, sc);
  }
  return sc;
}

// The sign table: entry n holds bits 0-3 of n as four s8 (+1 where set, -1 where clear).
__device__ inline unsigned qjl_sign_bytes(unsigned n) {
  unsigned w = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) w |= ((n >> i) & 1u ? 0x01u : 0xffu) << (8 * i);
  return w;
}

// Shared memory of the s8 path inside the fast layout's sign area (4 KiB): the 16-word sign
// table, then each head's (s_hi, s_lo).
constexpr int QJL_I8_SCALES = 64;

// The prologue's part, after the projections are in `pj` ([8][mpad] floats, zero past m and
// gb) and a barrier: the sign table and the heads' scales, a barrier, then the B fragments of
// `ht_count` tiles of 4 heads (`sq[(ht * S32 + j) * 32 + lane]`, S32 = mpad / 32 k steps), and
// a barrier. A head's hi part rounds p / s_hi with s_hi = max|p| / 127; its lo part rounds the
// remainder by s_lo = s_hi / 254 (the remainder is at most s_hi / 2).
template <int NT>
__device__ inline void qjl_i8_prologue(uint8_t* smem, const FastLayout& L, const float* pj,
                                       int mpad, int ht_count) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  unsigned* stab = reinterpret_cast<unsigned*>(smem + L.signs);
  float* scl = reinterpret_cast<float*>(smem + L.signs + QJL_I8_SCALES);
  if (tid < 16) stab[tid] = qjl_sign_bytes(tid);
  for (int h = warp; h < 8; h += NT / 32) {
    float mx = 0.f;
    for (int c = lane; c < mpad; c += 32) mx = fmaxf(mx, fabsf(pj[h * mpad + c]));
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, s));
    if (lane == 0) {
      scl[2 * h] = mx / 127.f;
      scl[2 * h + 1] = mx / (127.f * 254.f);
    }
  }
  __syncthreads();
  const int S32 = mpad / 32, span = mpad / 4;
  uint2* sq = reinterpret_cast<uint2*>(smem + L.sfrag);
  for (int i = tid; i < ht_count * S32 * 32; i += NT) {
    const int ln = i & 31, j = (i >> 5) % S32, ht = (i >> 5) / S32;
    const int h = 4 * ht + (ln >> 3), lo = (ln >> 2) & 1;
    const float* src = pj + h * mpad + (ln & 3) * span + 8 * j;
    const float4 x0 = *reinterpret_cast<const float4*>(src);
    const float4 x1 = *reinterpret_cast<const float4*>(src + 4);
    const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    const float s_hi = scl[2 * h], s_lo = scl[2 * h + 1];
    const float inv_hi = s_hi > 0.f ? 1.f / s_hi : 0.f, inv_lo = s_lo > 0.f ? 1.f / s_lo : 0.f;
    unsigned b[2] = {0u, 0u};
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const float hi = fminf(fmaxf(rintf(x[e] * inv_hi), -127.f), 127.f);
      const float v = lo ? fminf(fmaxf(rintf((x[e] - hi * s_hi) * inv_lo), -127.f), 127.f) : hi;
      b[e >> 2] |= ((unsigned)(int)v & 0xffu) << (8 * (e & 3));
    }
    sq[i] = make_uint2(b[0], b[1]);
  }
  __syncthreads();
}

// One k step of a chunk: sign bytes `x0` (row g) and `x1` (row g + 8), their byte `b`, against
// every tile's B fragment of step j; accumulators alternate by step (chains of half the length).
template <int HT>
__device__ inline void qjl_i8_step(const uint8_t* smem, int stab, const uint2* sq, int S32,
                                   int lane, unsigned x0, unsigned x1, int b, int j,
                                   int (&c)[HT][2][4]) {
  const unsigned a0 = lds32(smem, stab + 4 * ((x0 >> (8 * b)) & 15u));
  const unsigned a2 = lds32(smem, stab + 4 * ((x0 >> (8 * b + 4)) & 15u));
  const unsigned a1 = lds32(smem, stab + 4 * ((x1 >> (8 * b)) & 15u));
  const unsigned a3 = lds32(smem, stab + 4 * ((x1 >> (8 * b + 4)) & 15u));
#pragma unroll
  for (int ht = 0; ht < HT; ht++) {
    const uint2 q = sq[(ht * S32 + j) * 32 + lane];
    mma_16832_s8(c[ht][j & 1], a0, a1, a2, a3, q.x, q.y);
  }
}

// The scores of one chunk in the softmax's layout (lane (g, t4): head g, tokens 2t4 + e and
// 8 + 2t4 + e in s[0][e], s[1][e]), masked past the chunk's `n` rows, times `scale`. `kt` is
// the chunk's first key row, `kcb` the row bytes, `out_at` the outliers' first byte.
template <int D, int HT>
__device__ inline void qjl_i8_scores(const uint8_t* smem, const FastLayout& L, const float* qs,
                                     int kt, int kcb, int mpad, int out_at, int O, int n,
                                     float scale, float (&s)[2][2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int S32 = mpad / 32;
  const uint2* sq = reinterpret_cast<const uint2*>(smem + L.sfrag);
  // This lane's quarter of rows g and g + 8 (after the 2-byte norm).
  const int r0 = kt + g * kcb + 2 + t4 * S32, r1 = r0 + 8 * kcb;
  int c[HT][2][4];
#pragma unroll
  for (int ht = 0; ht < HT; ht++)
#pragma unroll
    for (int u = 0; u < 2; u++)
#pragma unroll
      for (int e = 0; e < 4; e++) c[ht][u][e] = 0;
  const int words = S32 >> 2;
#pragma unroll 1
  for (int w = 0; w < words; w++) {
    unsigned x0, x1;
    lds_words<1>(smem, r0 + 4 * w, &x0);
    lds_words<1>(smem, r1 + 4 * w, &x1);
#pragma unroll
    for (int b = 0; b < 4; b++) qjl_i8_step<HT>(smem, L.signs, sq, S32, lane, x0, x1, b, 4 * w + b, c);
  }
  if (S32 & 2) {  // the last two steps: 16 bits, read by bytes (never past the quarter)
    const unsigned x0 = lds16(smem, r0 + 4 * words), x1 = lds16(smem, r1 + 4 * words);
    qjl_i8_step<HT>(smem, L.signs, sq, S32, lane, x0, x1, 0, 4 * words, c);
    qjl_i8_step<HT>(smem, L.signs, sq, S32, lane, x0, x1, 1, 4 * words + 1, c);
  }
  // This lane holds head 4ht + t4 (columns 2t4: hi, 2t4 + 1: lo) for tokens g and g + 8.
  const float* scl = reinterpret_cast<const float*>(smem + L.signs + QJL_I8_SCALES);
  float v[HT][2];
#pragma unroll
  for (int ht = 0; ht < HT; ht++) {
    const int h = 4 * ht + t4;
    const float s_hi = scl[2 * h], s_lo = scl[2 * h + 1];
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const int row = kt + (g + 8 * e) * kcb;
      const float dot = s_hi * (float)(c[ht][0][2 * e] + c[ht][1][2 * e]) +
                        s_lo * (float)(c[ht][0][2 * e + 1] + c[ht][1][2 * e + 1]);
      const float norm = __half2float(__ushort_as_half((unsigned short)lds16(smem, row)));
      v[ht][e] = qjl_row_outliers<D>(smem, row, out_at, O, qs + h * D, dot * norm);
    }
  }
  // Into the softmax's layout: (head g, token tok) sits in lane (tok & 7) * 4 + (g & 3), tile
  // g >> 2, element tok >> 3. Heads past the tiles score 0 (their outputs are not kept).
#pragma unroll
  for (int nt = 0; nt < 2; nt++)
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const int src = (2 * t4 + e) * 4 + (g & 3);
      float x = __shfl_sync(0xffffffffu, v[0][nt], src);
      if constexpr (HT == 2) {
        const float x1 = __shfl_sync(0xffffffffu, v[1][nt], src);
        x = g >= 4 ? x1 : x;
      } else {
        x = g >= 4 ? 0.f : x;
      }
      const int tok = nt * 8 + 2 * t4 + e;
      s[nt][e] = tok < n ? x * scale : -INFINITY;
    }
}

}  // namespace kvq
