// Encode of QJL keys and values, one block of D threads per row.
// Keys (kvq-cache qjl/keys.rs): the `outliers` largest-magnitude channels kept exactly (u8 index,
// f16 value; the sketch takes what the f16 value leaves out), the f16 norm of the rest, and the
// signs of S rest packed with warp ballots.
// Values (qjl/values.rs): per group an f16 scale and minimum from the same range search `fit`
// runs (one thread per group, the CPU's operations in the CPU's order), then each coordinate's
// code rounded half up, packed LSB first.
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
      taken[c] = 1;
      const __half h = __float2half_rn(xv);
      out[at + o] = (uint8_t)c;
      kvq::store_f16(out + at + p.outliers + 2 * o, xv);
      rest = xv - __half2float(h);
    }
  }
  const float norm = sqrtf(kvq::block_sum(rest * rest, red));
  u[c] = rest;
  if (c == 0) kvq::store_f16(out, norm);
  kvq::sketch_signs(p.mats + (long long)head * D * p.m, u, D, p.m, out + 2);
}

struct GroupEncodeParams {
  int bits, group;
};

__constant__ float kTrims[5] = {0.f, 0.05f, 0.1f, 0.15f, 0.2f};

// (scale, min) as kvq-cache values.rs `fit` computes them, over x[0..n) in shared memory.
__device__ void group_fit(const float* x, int n, float levels, float& s_out, float& m_out) {
  float lo = INFINITY, hi = -INFINITY;
  for (int i = 0; i < n; i++) {
    lo = fminf(lo, x[i]);
    hi = fmaxf(hi, x[i]);
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
  auto consider = [&](float a, float b) {
    float s, m;
    params(a, b, s, m);
    const float e = sse(s, m);
    if (e < best) {
      best = e;
      bs = s;
      bm = m;
    }
    return e;
  };
  float t = 0.f, least = INFINITY;
  for (int k = 0; k < 5; k++) {
    const float e = consider(kTrims[k], kTrims[k]);
    if (e < least) {
      t = kTrims[k];
      least = e;
    }
  }
  const float st = 0.05f;
  const float cand[4][2] = {{t - st, t}, {t + st, t}, {t, t - st}, {t, t + st}};
  for (int k = 0; k < 4; k++)
    if (cand[k][0] >= 0.f && cand[k][1] >= 0.f) consider(cand[k][0], cand[k][1]);
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
  if (c < groups) {
    float s, m;
    group_fit(x + c * p.group, p.group, levels, s, m);
    sc[c] = s;
    mn[c] = m;
    kvq::store_f16(out + 4 * c, s);
    kvq::store_f16(out + 4 * c + 2, m);
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
