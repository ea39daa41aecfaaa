// Gaussian sign sketches on CUDA (kvq-kernels spec.rs SketchSpec): the query's projection
// a = sqrt(pi/2)/m * S q, turned into one 16-entry table per nibble of a sign row and head, so a
// packed sign row is scored with one shared-memory load and one add per 4 signs and head
// (entries of a nibble's table sit in 16 distinct banks: lanes never conflict). Bit set = +a_i.
#pragma once
#include "attend.cuh"

namespace kvq {

constexpr float QJL_CONST = 1.2533141f;  // sqrt(pi / 2)

struct SketchParams {
  const float* mats;  // [kvh][D][m]: S transposed
  int m;
  const float* proj;  // [B][nh][T][m]: sqrt(pi/2)/m * S q of every query row (sketch_project)
};

// State layout: tables [m/4][GB][16] | a [GB][m].
__host__ __device__ inline int sketch_floats(int m, int, int GB) {
  return (m / 4) * GB * 16 + GB * m;
}

// The nibble tables of the block's GB heads from their projections (query rows prow,
// prow + pstride, ... of `proj`).
__device__ inline void sketch_prepare(const SketchParams& p, long long prow, int pstride, int gb,
                                      float* st, int, int GB) {
  const int m = p.m;
  float* tab = st;
  float* a = tab + (m / 4) * GB * 16;
  for (int i = threadIdx.x; i < gb * m; i += KVQ_THREADS)
    a[i] = p.proj[(prow + (long long)(i / m) * pstride) * m + i % m];
  __syncthreads();
  for (int i = threadIdx.x; i < (m / 4) * GB * 16; i += KVQ_THREADS) {
    const int n = i / (GB * 16), g = (i / 16) % GB, e = i % 16;
    float x = 0.f;
    if (g < gb) {
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float v = a[g * m + 4 * n + k];
        x += (e >> k) & 1 ? v : -v;
      }
    }
    tab[i] = x;
  }
  __syncthreads();
}

// Before the attention: proj[(b, h, t)] = sqrt(pi/2)/m * S_kh q for every query row, once (each
// attend block would otherwise re-read S, m x D floats, from L2). Block (x, y): up to 8 query
// heads of one kv head (x = ((b * T + t) * kvh + kh) * hchunks + hc) and sketch rows
// 64y .. 64y + 63, so S is read once per kv head; its 256 threads are 64 rows times 4 quarters
// of the D coordinates, the quarters' sums added in a fixed order.
struct ProjectArgs {
  const float* q;  // as AttendArgs
  long long q_bstride, q_hstride, q_tstride;
  const float* mats;
  int m, nh, T, group;
  float* proj;
};

constexpr int KVQ_PROJECT_THREADS = 256;
constexpr int KVQ_PROJECT_HEADS = 8;

template <int D>
__device__ void sketch_project(const ProjectArgs& a) {
  constexpr int GH = KVQ_PROJECT_HEADS;
  __shared__ float qs[GH][D];
  __shared__ float part[4][GH][64];
  const int kvh = a.nh / a.group, hchunks = (a.group + GH - 1) / GH;
  int x = blockIdx.x;
  const int hc = x % hchunks;
  x /= hchunks;
  const int kh = x % kvh;
  x /= kvh;
  const int t = x % a.T, b = x / a.T;
  const int h0 = kh * a.group + hc * GH, gn = min(GH, a.group - hc * GH);
  for (int i = threadIdx.x; i < GH * D; i += KVQ_PROJECT_THREADS) {
    const int g = i / D, j = i % D;
    qs[g][j] = g < gn ? a.q[b * a.q_bstride + (h0 + g) * a.q_hstride + t * a.q_tstride + j] : 0.f;
  }
  __syncthreads();
  const int i = threadIdx.x & 63, jq = threadIdx.x >> 6, c = blockIdx.y * 64 + i;
  const float* S = a.mats + (long long)kh * D * a.m;
  float acc[GH];
#pragma unroll
  for (int g = 0; g < GH; g++) acc[g] = 0.f;
  if (c < a.m) {
    // Every load of this thread's quarter first (one memory latency, not D / 32 of them), then
    // the same sums in the same order.
    float sv[D / 4];
#pragma unroll
    for (int jj = 0; jj < D / 4; jj++) sv[jj] = __ldg(S + (long long)(jq * (D / 4) + jj) * a.m + c);
#pragma unroll
    for (int jj = 0; jj < D / 4; jj++)
#pragma unroll
      for (int g = 0; g < GH; g++) acc[g] = fmaf(sv[jj], qs[g][jq * (D / 4) + jj], acc[g]);
  }
#pragma unroll
  for (int g = 0; g < GH; g++) part[jq][g][i] = acc[g];
  __syncthreads();
  const float cst = QJL_CONST / (float)a.m;
  for (int w = threadIdx.x; w < gn * 64; w += KVQ_PROJECT_THREADS) {
    const int g = w >> 6, r = w & 63, col = blockIdx.y * 64 + r;
    if (col < a.m) {
      const float v = ((part[0][g][r] + part[1][g][r]) + part[2][g][r]) + part[3][g][r];
      const long long row = ((long long)b * a.nh + h0 + g) * a.T + t;
      a.proj[row * a.m + col] = v * cst;
    }
  }
}

}  // namespace kvq

#define KVQ_SKETCH_PROJECT(D)                                                    \
  extern "C" __global__ void __launch_bounds__(kvq::KVQ_PROJECT_THREADS)        \
      kvq_sketch_project_d##D(kvq::ProjectArgs a) {                             \
    kvq::sketch_project<D>(a);                                                   \
  }

namespace kvq {

// s[g] = sqrt(pi/2)/m <S q_g, sign row>.
// `part` 0 or 1: the first or second half of the sign bytes.
template <int GB>
__device__ inline void sketch_dot(const float* tab, const uint8_t* signs, int m, float s[GB],
                                  int part) {
#pragma unroll
  for (int g = 0; g < GB; g++) s[g] = 0.f;
  const int nb = m / 8, half = (nb + 1) / 2;
  for (int j = part * half; j < min(nb, (part + 1) * half); j++) {
    const unsigned b = signs[j];
    const float* lo = tab + (2 * j) * GB * 16 + (b & 15);
    const float* hi = tab + (2 * j + 1) * GB * 16 + (b >> 4);
#pragma unroll
    for (int g = 0; g < GB; g++) s[g] += lo[g * 16] + hi[g * 16];
  }
}

}  // namespace kvq
