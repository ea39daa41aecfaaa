// Version-5 fused decode attention of VecInfer (the frame of common/fast.cuh): keys and values
// are one-byte centroid indices of sub-vectors (4 or 8 coordinates) of the rotated rows (keys
// smoothed by 1/lambda). The block copies both codebooks (f16, made once at upload) to shared
// memory; a key's centroid is then exactly one or two B registers of S = Q K^T (k step j of a
// lane covers 4 consecutive rotated coordinates: one sub-vector of 4, half of one of 8), a value's
// centroids give the A registers of O += P V after a byte permute per pair of tokens. Queries are
// multiplied by lambda and rotated once per block, the merged output rotated back once.
#include "../common/fast.cuh"
#include "params.cuh"

namespace kvq {

// Bytes of one codec's codebooks in f16.
__host__ __device__ inline int vq_book_bytes(int nb, int sub) { return nb * 256 * sub * 2; }

template <int D, int SUB, int NW>
__device__ void vq_fast_attend(const AttendArgs& a, const VqParams& kp, const VqParams& vp,
                               const FastArgs& f, const FastLayout& L, uint8_t* smem) {
  static_assert(SUB == 4 || SUB == 8, "sub-vectors of 4 or 8");
  constexpr int NT = NW * 32, ST = KVQ_FAST_STAGES;
  constexpr int KSPAN = D / 4, VSPAN = D / 8, KSTEPS = D / 16, MT = D / 16;
  constexpr bool QREG = D <= 128;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const FastBlock k = fast_block(a);
  float* qs = reinterpret_cast<float*>(smem + L.qs);
  const int kb_at = L.table, vb_at = L.table + vq_book_bytes(kp.nb, SUB);

  long long r0, r1;
  code_rows(a, a.first_pos + k.t, r0, r1);
  r1 = min(r1, a.n_rows);
  const long long s0 = r0 + (long long)blockIdx.x * a.split_rows;
  const long long s1 = max(min(r1, s0 + a.split_rows), s0);
  const int kbuf = fast_stage_bytes(a.kcb), vbuf = fast_stage_bytes(a.vcb);
  const int mine = L.stages + warp * ST * (kbuf + vbuf);
  auto kstage = [&](int s) { return mine + s * kbuf; };
  auto vstage = [&](int s) { return mine + ST * kbuf + s * vbuf; };
  const uint8_t* kbase = a.kc + k.b * a.k_bstride + k.kh * a.k_hstride;
  const uint8_t* vbase = a.vc + k.b * a.v_bstride + k.kh * a.v_hstride;
  const uint8_t* kend = kbase + a.n_rows * a.kcb;
  const uint8_t* vend = vbase + a.n_rows * a.vcb;
  const int nchunks = (int)((s1 - s0 + 15) / 16);
  const int count = nchunks > warp ? (nchunks - warp + NW - 1) / NW : 0;
  auto chunk_base = [&](int i) { return s0 + (long long)(warp + i * NW) * 16; };
  auto issue = [&](int i) {
    if (i < count) {
      const long long base = chunk_base(i);
      const int n = (int)min(16ll, s1 - base);
      fast_load_rows(smem + kstage(i % ST), kbase, a.kcb, base, n, kend, lane);
      fast_load_rows(smem + vstage(i % ST), vbase, a.vcb, base, n, vend, lane);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < ST - 1; i++) issue(i);

  // Codebooks (16 bytes at a time), queries times lambda.
  {
    const int kw = vq_book_bytes(kp.nb, SUB) / 16, vw = vq_book_bytes(vp.nb, SUB) / 16;
    uint4* dk = reinterpret_cast<uint4*>(smem + kb_at);
    uint4* dv = reinterpret_cast<uint4*>(smem + vb_at);
    const uint4* sk = reinterpret_cast<const uint4*>(kp.books16);
    const uint4* sv = reinterpret_cast<const uint4*>(vp.books16);
    for (int i = tid; i < kw; i += NT) dk[i] = __ldg(sk + i);
    for (int i = tid; i < vw; i += NT) dv[i] = __ldg(sv + i);
  }
  fast_load_queries<D, NT>(a, k, qs);
  __syncthreads();
  {
    const float* lam = kp.lambda + (long long)k.kh * D;
    const float* sgn = kp.signs + (long long)k.kh * D;
    for (int i = tid; i < 8 * D; i += NT) qs[i] *= __ldg(lam + i % D) * __ldg(sgn + i % D);
    __syncthreads();
    fast_butterflies<NT>(qs, 8, D);
    const float sc = rsqrtf((float)D);
    for (int i = tid; i < 8 * D; i += NT) qs[i] *= sc;
    __syncthreads();
  }
  if constexpr (!QREG) {
    uint4* qf = reinterpret_cast<uint4*>(smem + L.qfrag);
    for (int i = tid; i < KSTEPS * 32; i += NT) qf[i] = fast_qfrag(qs, D, (i % 32) >> 2, i % 4, i / 32);
    __syncthreads();
  }
  uint4 qa[QREG ? KSTEPS : 1];
  if constexpr (QREG) {
#pragma unroll
    for (int j = 0; j < KSTEPS; j++) qa[j] = fast_qfrag(qs, D, g, t4, j);
  }
  auto qfrag = [&](int j) -> uint4 {
    if constexpr (QREG)
      return qa[j];
    else
      return reinterpret_cast<const uint4*>(smem + L.qfrag)[j * 32 + lane];
  };
  // Sub-vector s's centroid c in a codec's books (shared, or one book per position).
  auto centroid = [&](int at, int nb, int s, unsigned c) {
    return at + ((nb == 1 ? 0 : s) * 256 + (int)c) * SUB * 2;
  };

  float m = -INFINITY, l = 0.f;
  float acc[MT][4];
#pragma unroll
  for (int i = 0; i < MT; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) acc[i][e] = 0.f;

  for (int i = 0; i < count; i++) {
    issue(i + ST - 1);
    cp_async_wait<ST - 1>();
    __syncwarp();
    const long long base = chunk_base(i);
    const int n = (int)min(16ll, s1 - base);
    const int kt = kstage(i % ST) + rows_offset(kbase, a.kcb, base);
    const int vt = vstage(i % ST) + rows_offset(vbase, a.vcb, base);
    float s[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
      float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
      const uint8_t* row = smem + kt + (nt * 8 + g) * a.kcb;
#pragma unroll
      for (int j = 0; j < KSTEPS; j++) {
        // Coordinates t4*D/4 + 4j .. +3: sub-vector (t4*D/4 + 4j) / SUB.
        const int sv = (t4 * KSPAN + 4 * j) / SUB;
        const uint2 bb = lds64(smem, centroid(kb_at, kp.nb, sv, row[sv]) + (SUB == 8 ? (j & 1) * 8 : 0));
        const uint4 q = qfrag(j);
        mma_16816(j & 1 ? c1 : c0, q.x, q.y, q.z, q.w, bb.x, bb.y);
      }
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int tok = nt * 8 + 2 * t4 + e;
        const float sc = ((c0[e] + c1[e]) + (c0[2 + e] + c1[2 + e])) * a.scale;
        s[nt][e] = tok < n ? sc : -INFINITY;
      }
    }
    float p[2][2];
    fast_softmax<MT>(s, m, l, acc, p, t4);
    const unsigned pb0 = pack_f2(p[0][0], p[0][1]), pb1 = pack_f2(p[1][0], p[1][1]);
    // Tokens u = 0..3: 2t4, 2t4+1, 2t4+8, 2t4+9; their centroids over coordinates g*D/8 ..
    // +D/8 as D/16 words of f16 pairs.
    unsigned vw[4][D / 16];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const uint8_t* row = smem + vt + ((u >> 1) * 8 + 2 * t4 + (u & 1)) * a.vcb;
#pragma unroll
      for (int q = 0; q < VSPAN / SUB; q++) {
        const int sv = (g * VSPAN) / SUB + q;
        const int at = centroid(vb_at, vp.nb, sv, row[sv]);
#pragma unroll
        for (int w = 0; w < SUB / 2; w++) vw[u][q * (SUB / 2) + w] = lds32(smem, at + 4 * w);
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
      mma_16816(acc[mt], __byte_perm(vw[0][mt], vw[1][mt], 0x5410),
                __byte_perm(vw[0][mt], vw[1][mt], 0x7632), __byte_perm(vw[2][mt], vw[3][mt], 0x5410),
                __byte_perm(vw[2][mt], vw[3][mt], 0x7632), pb0, pb1);
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  fast_finish<D, NW>(a, f, L, smem, acc, m, l, k, vp.signs + (long long)k.kh * D, 1.f);
}

template <int D, int SUB, int NW>
__device__ inline void vq_fast_entry(const AttendArgs& a, const VqParams& kp, const VqParams& vp,
                                     const FastArgs& f, uint8_t* smem) {
  const int rows = (vq_book_bytes(kp.nb, SUB) + vq_book_bytes(vp.nb, SUB)) / 256;
  const FastLayout L = fast_layout(D, rows, 0, 0, D > 128, NW, a.kcb, a.vcb);
  fast_check_smem(L);
  if (f.exact && blockIdx.x == gridDim.x - 1)
    fast_exact<D, NW>(a, f, L, smem, vp.signs + (long long)(blockIdx.y / a.hchunks) * D, 1.f);
  else
    vq_fast_attend<D, SUB, NW>(a, kp, vp, f, L, smem);
}

}  // namespace kvq

#define KVQ_FAST_VQ(D, SUB)                                                                   \
  extern "C" __global__ void __launch_bounds__(KVQ_FAST_NW(D) * 32, 1)                        \
      kvq_fast_vq_d##D##_s##SUB(kvq::AttendArgs a, kvq::VqParams kp, kvq::VqParams vp,      \
                                kvq::FastArgs f) {                                            \
    extern __shared__ __align__(16) uint8_t kvq_smem[];                                       \
    kvq::vq_fast_entry<D, SUB, KVQ_FAST_NW(D)>(a, kp, vp, f, kvq_smem);                       \
  }

KVQ_FAST_VQ(64, 4)
KVQ_FAST_VQ(64, 8)
KVQ_FAST_VQ(128, 4)
KVQ_FAST_VQ(128, 8)
KVQ_FAST_VQ(256, 4)
KVQ_FAST_VQ(256, 8)
