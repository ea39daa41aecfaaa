// Version-5 fused decode attention of VecInfer (the frame of common/fast.cuh): keys and values
// are one-byte centroid indices of sub-vectors (4 or 8 coordinates) of the rotated rows (keys
// smoothed by 1/lambda). The block copies both codebooks (f16, made once at upload) to shared
// memory; a key's centroid is then exactly one or two B registers of S = Q K^T (k step j of a
// lane covers 4 consecutive rotated coordinates: one sub-vector of 4, half of one of 8), a value's
// centroids give the A registers of O += P V after a byte permute per pair of tokens. Queries are
// multiplied by lambda and rotated once per block, the merged output rotated back once.
// Per-position books at d = 256 (128 KiB per codec) do not both fit: the `_vg` kernels keep only
// the keys' books in shared memory and read the values' centroids from global memory (L1/L2), each
// chunk's loads issued as soon as its codes are in, before its key scores, to hide their latency.
#include "../common/fast.cuh"
#include "params.cuh"

namespace kvq {

// Bytes of one codec's codebooks in f16.
__host__ __device__ inline int vq_book_bytes(int nb, int sub) { return nb * 256 * sub * 2; }

template <int D, int SUB, int NW, bool VG>
__device__ void vq_fast_attend(const AttendArgs& a, const VqParams& kp, const VqParams& vp,
                               const FastArgs& f, const FastLayout& L, uint8_t* smem) {
  static_assert(SUB == 4 || SUB == 8, "sub-vectors of 4 or 8");
  constexpr int NT = NW * 32;
  constexpr int KSPAN = D / 4, VSPAN = D / 8, KSTEPS = D / 16, MT = D / 16;
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const FastBlock k = fast_block(a);
  float* qs = reinterpret_cast<float*>(smem + L.qs);
  const int kb_at = L.table, vb_at = L.table + vq_book_bytes(kp.nb, SUB);

  // This block's rows (a split of the query row's code range); their copies start once the
  // prologue's own reads are back.
  const FastChunks<NW> ch(a, L, k);

  // Codebooks (16 bytes at a time; the values' only when they are read from shared memory),
  // queries times lambda.
  {
    const int kw = vq_book_bytes(kp.nb, SUB) / 16, vw = VG ? 0 : vq_book_bytes(vp.nb, SUB) / 16;
    uint4* dk = reinterpret_cast<uint4*>(smem + kb_at);
    uint4* dv = reinterpret_cast<uint4*>(smem + vb_at);
    const uint4* sk = reinterpret_cast<const uint4*>(kp.books16);
    const uint4* sv = reinterpret_cast<const uint4*>(vp.books16);
    for (int i = tid; i < kw; i += NT) dk[i] = __ldg(sk + i);
    for (int i = tid; i < vw; i += NT) dv[i] = __ldg(sv + i);
  }
  {
    // The queries times lambda and the rotation signs in one pass of reads (the same products).
    const float* lam = kp.lambda + (long long)k.kh * D;
    const float* sgn = kp.signs + (long long)k.kh * D;
    for (int i = tid; i < 8 * D; i += NT) {
      const int h = i / D;
      const float f = __ldg(lam + i % D) * __ldg(sgn + i % D);
      qs[i] = h < k.gb ? k.qrows[h * a.q_hstride + i % D] * f : 0.f;
    }
  }
  __syncthreads();
  fast_mark(f, 5);
  ch.start(smem);  // after the prologue's reads: they do not queue behind every block's copies
  {
    fast_butterflies_warp<D, NW>(qs, k.gb);
    fast_mark(f, 7);
    const float sc = rsqrtf((float)D);
    for (int i = tid; i < 8 * D; i += NT) qs[i] *= sc;
    __syncthreads();
  }
  const FastQueryFrags<D, NT> qfrag(qs, smem, L);
  // Sub-vector s's centroid c in a codec's books (shared, or one book per position).
  auto centroid = [&](int at, int nb, int s, unsigned c) {
    return at + ((nb == 1 ? 0 : s) * 256 + (int)c) * SUB * 2;
  };

  float m = -INFINITY, l = 0.f;
  float acc[MT][4];
  fast_zero<MT>(acc);
  fast_mark(f, 1);

  // Tokens u = 0..3 of a chunk (2t4, 2t4+1, 2t4+8, 2t4+9): their centroids over coordinates
  // g*D/8 .. +D/8 as D/16 words of f16 pairs, from shared memory or (VG) global memory.
  auto value_words = [&](int vt, unsigned (&vw)[4][D / 16]) {
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const uint8_t* row = smem + vt + ((u >> 1) * 8 + 2 * t4 + (u & 1)) * a.vcb;
#pragma unroll
      for (int q = 0; q < VSPAN / SUB; q++) {
        const int sv = (g * VSPAN) / SUB + q;
        unsigned* w = &vw[u][q * (SUB / 2)];
        if constexpr (VG) {
          const __half* c = vp.books16 + ((vp.nb == 1 ? 0 : sv) * 256 + (int)row[sv]) * SUB;
          if constexpr (SUB == 4) {
            const uint2 x = __ldg(reinterpret_cast<const uint2*>(c));
            w[0] = x.x;
            w[1] = x.y;
          } else {
            const uint4 x = __ldg(reinterpret_cast<const uint4*>(c));
            w[0] = x.x;
            w[1] = x.y;
            w[2] = x.z;
            w[3] = x.w;
          }
        } else {
          const int at = centroid(vb_at, vp.nb, sv, row[sv]);
#pragma unroll
          for (int j = 0; j < SUB / 2; j++) w[j] = lds32(smem, at + 4 * j);
        }
      }
    }
  };

  for (int i = 0; i < ch.count; i++) {
    int kt, vt;
    ch.next(smem, i, kt, vt);
    const int n = ch.rows(i);
    unsigned vw[4][D / 16];
    if constexpr (VG) value_words(vt, vw);  // in flight while the keys are scored
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
    if constexpr (!VG) value_words(vt, vw);
    fast_pv<MT>(acc, vw, pb0, pb1);
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  ch.stop(smem);
  fast_mark(f, 2);
  fast_finish<D, NW>(a, f, L, smem, acc, m, l, k, vp.signs + (long long)k.kh * D, 1.f);
}

template <int D, int SUB, int NW, bool VG>
__device__ inline void vq_fast_entry(const AttendArgs& a, const VqParams& kp, const VqParams& vp,
                                     const FastArgs& f, uint8_t* smem) {
  const int rows = (vq_book_bytes(kp.nb, SUB) + (VG ? 0 : vq_book_bytes(vp.nb, SUB)) + 255) / 256;
  const FastLayout L = fast_layout(D, rows, 0, 0, NW, a.kcb, a.vcb);
  fast_check_smem(L);
  fast_mark(f, 0);
  if (f.exact && blockIdx.x == gridDim.x - 1)
    fast_exact<D, NW>(a, f, L, smem, vp.signs + (long long)(blockIdx.y / a.hchunks) * D, 1.f);
  else
    vq_fast_attend<D, SUB, NW, VG>(a, kp, vp, f, L, smem);
}

}  // namespace kvq

// VG: the values' codebooks read from global memory (`_vg`, for books too large for both).
#define KVQ_FAST_VQ(D, SUB, VG, SUFFIX)                                                       \
  extern "C" __global__ void __launch_bounds__(KVQ_FAST_NW(D) * 32, 1)                        \
      kvq_fast_vq_d##D##_s##SUB##SUFFIX(kvq::AttendArgs a, kvq::VqParams kp,                 \
                                        kvq::VqParams vp, kvq::FastArgs f) {                  \
    extern __shared__ __align__(16) uint8_t kvq_smem[];                                       \
    kvq::vq_fast_entry<D, SUB, KVQ_FAST_NW(D), VG>(a, kp, vp, f, kvq_smem);                   \
  }

KVQ_FAST_VQ(64, 4, false, )
KVQ_FAST_VQ(64, 8, false, )
KVQ_FAST_VQ(128, 4, false, )
KVQ_FAST_VQ(128, 8, false, )
KVQ_FAST_VQ(256, 4, false, )
KVQ_FAST_VQ(256, 8, false, )
KVQ_FAST_VQ(256, 4, true, _vg)
KVQ_FAST_VQ(256, 8, true, _vg)
