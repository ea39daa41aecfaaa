// Encode of TurboQuant-Prod keys: the (b-1)-bit scalar stage, its reconstruction (levels times
// the f16 norm, rotated back), the residual's norm (f16) and the sign sketch of the residual
// packed with warp ballots (kvq-cache turboquant_prod `encode`). Blocks of D threads: ceil(m / 32)
// per row (blockIdx.y), each computing the row's stage and residual and 32 of its signs; block
// y = 0 also writes the stage's codes and both norms.
#include "../turboquant_mse/encode.cu"

struct ProdEncodeParams {
  kvq::ScalarEncodeParams scalar;
  const float* levels;  // the stage's 2^(b-1) levels, code order
  const float* mats;    // [kvh][D][m]
  int m;
};

template <int D>
__device__ void prod_encode(const kvq::EncodeArgs& a, const ProdEncodeParams& p) {
  __shared__ float u[D];
  __shared__ uint8_t idx[D];
  __shared__ float red[32];
  const long long i = blockIdx.x;
  const int head = (int)(i / a.t), c = threadIdx.x;
  uint8_t* out = kvq::enc_out(a, i);
  const float xv = kvq::enc_in(a, i, c, D);
  const bool first = blockIdx.y == 0;
  const float norm = kvq::scalar_encode_row(p.scalar, head, xv, u, idx, red, out, D, first);
  // Decode the stage: w * levels[idx], then x <- D H x / sqrt(D).
  __syncthreads();
  u[c] = norm * p.scalar.sigma * __ldg(p.levels + idx[c]);
  kvq::fwht_row(u, D);
  const float kmse = u[c] * __ldg(p.scalar.signs + (long long)head * D + c) * rsqrtf((float)D);
  const float r = xv - kmse;
  const float rn = sqrtf(kvq::block_sum(r * r, red));
  __syncthreads();
  u[c] = r;
  const int at = 2 + D * p.scalar.bits / 8;
  if (first && c == 0) kvq::store_f16(out + at, rn);
  kvq::sketch_signs(p.mats + (long long)head * D * p.m, u, D, p.m, out + at + 2);
}

#define KVQ_PROD_ENCODE(D)                                                                   \
  extern "C" __global__ void kvq_encode_prod_d##D(kvq::EncodeArgs a, ProdEncodeParams p) {    \
    prod_encode<D>(a, p);                                                                     \
  }

KVQ_PROD_ENCODE(64)
KVQ_PROD_ENCODE(128)
KVQ_PROD_ENCODE(256)
