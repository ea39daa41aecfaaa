// Encode of TurboQuant-Prod keys (the Metal twin of kernels/cuda/turboquant_prod/encode.cu; the
// CPU definition is crates/kvq-cache turboquant_prod `encode`): one threadgroup of d threads per
// row. The (b-1)-bit scalar stage by kernels/metal/turboquant_mse/encode.metal's
// `scalar_encode_row` (this file is compiled after that one, as one library), its reconstruction
// (levels times the f16 norm, rotated back with the range-based butterfly), the residual's norm
// (f16, by a threadgroup sum) and the signs of S r, each simdgroup taking 32 projections at a
// time, lane j projection j, packed 8 to a byte with `simd_shuffle`. Row layout: the stage's row,
// `||r||`, m/8 sign bytes. Dispatch: kvq_kernels::metal::dispatch::encode_prod.

struct ProdEncodeParams {
  uint rows;    // code rows; row i belongs to kv head i / t
  uint t;       // rows per head
  uint d;       // head dim (64, 128 or 256), the threads of a threadgroup
  uint bits;    // the stage's index bits, 1..6
  uint cb;      // bytes per code row: 2 + d * bits / 8 + 2 + m / 8
  float sigma;  // 1 / sqrt(d)
  uint m;       // sketch dimension, a multiple of 8
};

kernel void kvq_encode_prod(device const float* x [[buffer(0)]],
                            device const float* signs [[buffer(1)]],
                            device const float* thresholds [[buffer(2)]],
                            device const uchar* code_of [[buffer(3)]],
                            device const float* levels [[buffer(4)]],
                            device const float* mats [[buffer(5)]],
                            device uchar* out [[buffer(6)]],
                            constant ProdEncodeParams& p [[buffer(7)]],
                            uint c [[thread_position_in_threadgroup]],
                            uint row [[threadgroup_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float u[256];
  threadgroup uchar idx[256];
  threadgroup float red[8];
  if (row >= p.rows) return;
  const uint d = p.d, nsg = d / 32, head = row / p.t;
  device const float* hs = signs + head * d;
  device uchar* o = out + row * p.cb;
  const float xv = x[row * d + c];
  const float norm =
      scalar_encode_row(xv, hs, thresholds, code_of, o, d, p.bits, p.sigma, c, lane, sg, u, idx, red);
  // The stage decoded as the CPU decodes it: the f16 norm times sigma times the level, then
  // x <- diag(signs) H x / sqrt(d). Each thread reads back only its own u[c] before this.
  u[c] = float(half(norm)) * p.sigma * levels[idx[c]];
  fwht_row(u, c, d);
  const float r = xv - u[c] * hs[c] * rsqrt(float(d));
  const float rn = sqrt(group_sum(r * r, red, lane, sg, nsg));
  u[c] = r;
  const uint at = 2 + d * p.bits / 8;
  if (c == 0) {
    const ushort h = as_type<ushort>(half(rn));
    o[at] = uchar(h & 0xff);
    o[at + 1] = uchar(h >> 8);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Signs of S r (S stored transposed: mats[head][j][i] = S_head[i][j]).
  device const float* S = mats + head * d * p.m;
  for (uint base = sg * 32; base < p.m; base += nsg * 32) {
    const uint i = base + lane;
    float pr = 0.0f;
    if (i < p.m)
      for (uint j = 0; j < d; j++) pr = fma(S[j * p.m + i], u[j], pr);
    const uint bit = (i < p.m && pr >= 0.0f) ? 1u : 0u;
    uint byte = 0;
    for (ushort b = 0; b < 8; b++) byte |= simd_shuffle(bit, ushort((lane / 8) * 8 + b)) << b;
    if (lane % 8 == 0 && i < p.m) o[at + 2 + i / 8] = uchar(byte);
  }
}
