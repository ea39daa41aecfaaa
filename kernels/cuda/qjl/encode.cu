// Encode of QJL keys and values, blocks of D threads: keys ceil(m / 32) per row (blockIdx.y), each
// finding the row's outliers and norm and packing 32 of its signs (block y = 0 writes the
// outliers and the norm); values one per row.
// Keys (kvq-cache qjl/keys.rs): the `outliers` largest-magnitude channels kept exactly (u8 index,
// f16 value; the sketch takes what the f16 value leaves out), the f16 norm of the rest, and the
// signs of S rest packed with warp ballots.
// Values (qjl/values.rs): per group an f16 scale and minimum from the same range search `fit`
// runs (one warp per group, each candidate on a lane, the CPU's operations in the CPU's order),
// then each coordinate's code rounded half up, packed LSB first.
#include "../common/encode.cuh"

struct QjlKeyEncodeParams {
  const float* mats;  // [kvh][D][m]
  int m, outliers;
};

template <int D>
__device__ void qjl_key_encode(const kvq::EncodeArgs& a, const QjlKeyEncodeParams& p) {
  __shared__ float u[D];
  __shared__ float red[32];
  __shared__ int taken[D];
  __shared__ float bestv[32];
  __shared__ int besti[32];
  const long long i = blockIdx.x;
  const int head = (int)(i / a.t), c = threadIdx.x;
  uint8_t* out = kvq::enc_out(a, i);
  const float xv = kvq::enc_in(a, i, c, D);
  float rest = xv;
  taken[c] = 0;
  const int at = 2 + p.m / 8;
  for (int o = 0; o < p.outliers; o++) {
    __syncthreads();
    // Block argmax of |x| over channels not taken yet (ties: the lowest channel).
    float v = taken[c] ? -1.f : fabsf(xv);
    int k = c;
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, s);
      const int ok = __shfl_xor_sync(0xffffffffu, k, s);
      if (ov > v || (ov == v && ok < k)) {
        v = ov;
        k = ok;
      }
    }
    if ((c & 31) == 0) {
      bestv[c / 32] = v;
      besti[c / 32] = k;
    }
    __syncthreads();
    if (c == 0) {
      float bv = bestv[0];
      int bk = besti[0];
      for (int w = 1; w < D / 32; w++)
        if (bestv[w] > bv || (bestv[w] == bv && besti[w] < bk)) {
          bv = bestv[w];
          bk = besti[w];
        }
      besti[0] = bk;
    }
    __syncthreads();
    const int pick = besti[0];
    if (c == pick) {
      // Every block of the row takes the same channel; block y = 0 stores it.
      taken[c] = 1;
      const __half h = __float2half_rn(xv);
      if (blockIdx.y == 0) {
        out[at + o] = (uint8_t)c;
        kvq::store_f16(out + at + p.outliers + 2 * o, xv);
      }
      rest = xv - __half2float(h);
    }
  }
  const float norm = sqrtf(kvq::block_sum(rest * rest, red));
  u[c] = rest;
  if (blockIdx.y == 0 && c == 0) kvq::store_f16(out, norm);
  kvq::sketch_signs(p.mats + (long long)head * D * p.m, u, D, p.m, out + 2);
}

struct GroupEncodeParams {
  int bits, group;
};

__constant__ float kTrims[5] = {0.f, 0.05f, 0.1f, 0.15f, 0.2f};

// (scale, min) as kvq-cache values.rs `fit` computes them, over x[0..n) in shared memory, by
// one whole warp: the range by shuffles (min and max are exact in any order), then the
// candidates' squared errors each on a lane of its own (lanes 0-4 the five trims, then lanes 0-3
// the four steps around the best), each summed in the CPU's order, and lane 0 choosing among
// them in the CPU's order: the same result as one thread trying them one after another, in
// about a fifth of the serial time (a decode step codes one token: its latency is the cost).
__device__ void group_fit(const float* x, int n, float levels, float& s_out, float& m_out) {
  const int lane = threadIdx.x & 31;
  float lo = INFINITY, hi = -INFINITY;
  for (int i = lane; i < n; i += 32) {
    lo = fminf(lo, x[i]);
    hi = fmaxf(hi, x[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  const float r = hi - lo;
  auto params = [&](float a, float b, float& s, float& m) {
    const float l = lo + a * r, h = hi - b * r;
    s = __half2float(__float2half_rn(fminf((h - l) / levels, 65504.f)));
    m = __half2float(__float2half_rn(l));
  };
  auto sse = [&](float s, float m) {
    const float inv = s > 0.f ? 1.f / s : 0.f;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int full = n / 8 * 8;
    for (int i = 0; i < full; i++) {
      const float c = fminf(fmaxf(floorf((x[i] - m) * inv + 0.5f), 0.f), levels);
      const float e = m + s * c - x[i];
      acc[i % 8] += e * e;
    }
    float tot = 0.f;
    for (int k = 0; k < 8; k++) tot += acc[k];
    float rest = 0.f;
    for (int i = full; i < n; i++) {
      const float c = fminf(fmaxf(floorf((x[i] - m) * inv + 0.5f), 0.f), levels);
      const float e = m + s * c - x[i];
      rest += e * e;
    }
    return tot + rest;
  };
  float bs, bm, best = INFINITY;
  params(0.f, 0.f, bs, bm);
  if (levels > 3.f) {
    s_out = bs;
    m_out = bm;
    return;
  }
  // This lane's candidate (a, b): its scale, minimum and squared error (lanes past the
  // candidates compute nothing).
  auto mine = [&](bool live, float a, float b, float& s, float& m) {
    s = m = 0.f;
    if (!live) return INFINITY;
    params(a, b, s, m);
    return sse(s, m);
  };
  // The CPU's `consider`: candidate k of this round, taken from its lane.
  auto take = [&](float e, float s, float m, int k) {
    const float ek = __shfl_sync(0xffffffffu, e, k);
    const float sk = __shfl_sync(0xffffffffu, s, k);
    const float mk = __shfl_sync(0xffffffffu, m, k);
    if (ek < best) {
      best = ek;
      bs = sk;
      bm = mk;
    }
    return ek;
  };
  float s1, m1;
  const float e1 = mine(lane < 5, kTrims[min(lane, 4)], kTrims[min(lane, 4)], s1, m1);
  float t = 0.f, least = INFINITY;
  for (int k = 0; k < 5; k++) {
    const float e = take(e1, s1, m1, k);
    if (e < least) {
      t = kTrims[k];
      least = e;
    }
  }
  const float st = 0.05f;
  const float cand[4][2] = {{t - st, t}, {t + st, t}, {t, t - st}, {t, t + st}};
  const int q = min(lane, 3);
  const bool ok = cand[q][0] >= 0.f && cand[q][1] >= 0.f;
  float s2, m2;
  const float e2 = mine(lane < 4 && ok, cand[q][0], cand[q][1], s2, m2);
  for (int k = 0; k < 4; k++)
    if (cand[k][0] >= 0.f && cand[k][1] >= 0.f) take(e2, s2, m2, k);
  s_out = bs;
  m_out = bm;
}

template <int D>
__device__ void group_encode(const kvq::EncodeArgs& a, const GroupEncodeParams& p) {
  __shared__ float x[D];
  __shared__ float sc[D], mn[D];
  __shared__ uint8_t idx[D];
  const long long i = blockIdx.x;
  const int c = threadIdx.x, groups = D / p.group;
  uint8_t* out = kvq::enc_out(a, i);
  x[c] = kvq::enc_in(a, i, c, D);
  __syncthreads();
  const float levels = (float)((1 << p.bits) - 1);
  // Warp w fits groups w, w + D/32, ...
  for (int gw = c / 32; gw < groups; gw += D / 32) {
    float s, m;
    group_fit(x + gw * p.group, p.group, levels, s, m);
    if ((c & 31) == 0) {
      sc[gw] = s;
      mn[gw] = m;
      kvq::store_f16(out + 4 * gw, s);
      kvq::store_f16(out + 4 * gw + 2, m);
    }
  }
  __syncthreads();
  const int g = c / p.group;
  const float s = sc[g], m = mn[g];
  const float inv = s > 0.f ? 1.f / s : 0.f;
  idx[c] = (uint8_t)fminf(fmaxf(floorf((x[c] - m) * inv + 0.5f), 0.f), levels);
  kvq::pack_codes(idx, p.bits, D, out + 4 * groups);
}

#define KVQ_QJL_ENCODE(D)                                                                    \
  extern "C" __global__ void kvq_encode_qjl_keys_d##D(kvq::EncodeArgs a,                      \
                                                       QjlKeyEncodeParams p) {                \
    qjl_key_encode<D>(a, p);                                                                  \
  }                                                                                           \
  extern "C" __global__ void kvq_encode_group_d##D(kvq::EncodeArgs a, GroupEncodeParams p) {  \
    group_encode<D>(a, p);                                                                    \
  }

KVQ_QJL_ENCODE(64)
KVQ_QJL_ENCODE(128)
KVQ_QJL_ENCODE(256)
