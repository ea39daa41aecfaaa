// Version-7 fused decode attention of QJL (the frame of common/fast.cuh): one launch per layer
// and decode step after the sketch projection. Keys (scores.cuh): s8 m16n8k32 mmas of the key's
// sign bits (16 tokens as the A rows, +-1 bytes from a 16-word nibble table) against the query's
// projection sqrt(pi/2)/m S q as two s8 columns per head (hi and lo parts, the k dimension padded
// to a multiple of 64 with zeros), times the key norm, plus the exact outlier channels; values:
// groupwise codes through a per-lane pair table of the codes as f16 integers, scaled and shifted
// by the token's group scale and minimum in one f16x2 fma, summed by P V mmas. No rotation: the
// merge adds the slots as they are. KVQ_QJL_F16 keeps version 6's keys for comparison (f16
// m16n8k16 mmas, the projection split hi + lo as the A rows, two mmas per k step and chunk).
#include "../common/fast.cuh"
#include "../turboquant_mse/mma.cuh"
#include "params.cuh"
#include "scores.cuh"

namespace kvq {

// x * s + m on f16 pairs held as 32-bit words.
__device__ inline unsigned hfma2_bits(unsigned x, unsigned s, unsigned m) {
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&x),
                            *reinterpret_cast<const __half2*>(&s),
                            *reinterpret_cast<const __half2*>(&m));
  return *reinterpret_cast<const unsigned*>(&r);
}

// The sketch padded to a multiple of 64 (a whole number of k steps in each lane's quarter).
__host__ __device__ inline int qjl_mpad(int m) { return (m + 63) & ~63; }

template <int D, int VB, int NW>
__device__ void qjl_fast_attend(const AttendArgs& a, const QjlKeyParams& kp,
                                const GroupParams& vp, const FastArgs& f,
                                const FastLayout& L, uint8_t* smem) {
  static_assert(VB == 2 || VB == 4, "value codes of 2 or 4 bits");
  constexpr int NT = NW * 32;
  constexpr int VSPAN = D / 8, VSB = VSPAN * VB / 8, VSW = (VSB + 3) / 4, MT = D / 16;
  const int m = kp.sketch.m, mpad = qjl_mpad(m);
#ifdef KVQ_QJL_F16
  const int SK = mpad / 16, span = mpad / 4;
#endif
  const int O = kp.outliers, groups = D / vp.group;
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const FastBlock k = fast_block(a);
  float* qs = reinterpret_cast<float*>(smem + L.qs);

  // This block's rows (a split of the query row's code range); their copies start once the
  // prologue's own reads are back.
  const FastChunks<NW> ch(a, L, k);

  // Queries (the outliers' exact products); the value pair table (codes as f16 integers, in
  // each row's value slots); the sign table; the projections padded with zeros.
  fast_load_queries<D, NT>(a, k, qs);
  {
    constexpr int VR = 1 << (2 * VB);
    fast_pair_tables<NT>(
        smem + L.table, VR, [](int) { return 0u; },
        [](int row) { return pack_f2((float)(row & ((1 << VB) - 1)), (float)(row >> VB)); });
#ifdef KVQ_QJL_F16
    uint2* sg = reinterpret_cast<uint2*>(smem + L.signs);
    for (int i = tid; i < 16 * 32; i += NT) {
      const unsigned n = i >> 5;
      sg[i] = make_uint2(signs_f16x2(n, 0), signs_f16x2(n, 2));
    }
#endif
    float* pj = reinterpret_cast<float*>(smem + L.proj);  // [8][mpad]
    const long long prow = ((long long)k.b * a.nh + k.h0) * a.T + k.t;
    // 16 bytes at a time, four in flight per thread (m is a multiple of 8: rows stay aligned).
    float4* pj4 = reinterpret_cast<float4*>(pj);
#pragma unroll 4
    for (int i = tid; i < 2 * mpad; i += NT) {
      const int h = i / (mpad / 4), c = 4 * (i % (mpad / 4));
      pj4[i] = h < k.gb && c < m ? __ldg(reinterpret_cast<const float4*>(
                                       kp.sketch.proj + (prow + (long long)h * a.T) * m + c))
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  __syncthreads();
  fast_mark(f, 5);
  ch.start(smem);  // after the prologue's reads: they do not queue behind every block's copies
#ifdef KVQ_QJL_F16
  {
    const float* pj = reinterpret_cast<const float*>(smem + L.proj);
    uint4* sf = reinterpret_cast<uint4*>(smem + L.sfrag);
    for (int i = tid; i < SK * 32; i += NT) {
      const int j = i / 32, ln = i % 32;
      sf[i] = fast_qfrag_span(pj, mpad, span, ln >> 2, ln & 3, j);
    }
  }
  __syncthreads();
#else
  const int ht_count = k.gb > 4 ? 2 : 1;  // tiles of 4 heads in the B operand
  qjl_i8_prologue<NT>(smem, L, reinterpret_cast<const float*>(smem + L.proj), mpad, ht_count);
#endif

#ifdef KVQ_QJL_F16
  const uint4* sf = reinterpret_cast<const uint4*>(smem + L.sfrag);
  const unsigned ls = lane * 8;
  const int signs_at = 2 + t4 * span / 8;
#endif
  const unsigned lv = lane * 4 + 128;
  const int out_at = 2 + m / 8;
  const int gi = (g * VSPAN) / vp.group;  // this lane's value group
  float m_run = -INFINITY, l = 0.f;
  float acc[MT][4];
  fast_zero<MT>(acc);
  fast_mark(f, 1);

  for (int i = 0; i < ch.count; i++) {
    int kt, vt;
    ch.next(smem, i, kt, vt);
    const int n = ch.rows(i);
    float s[2][2];
#ifdef KVQ_QJL_F16
    // Both token groups (nt: tokens 0-7, 8-15) per k step, so each projection fragment is read
    // from shared memory once per chunk (the kernel is bound by shared-memory traffic).
    float c[2][2][4];
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int u = 0; u < 2; u++)
#pragma unroll
        for (int e = 0; e < 4; e++) c[nt][u][e] = 0.f;
    // Sign bits t4*span + 4j .. +3 of the key, four k steps per 16-bit load.
#pragma unroll 2
    for (int j4 = 0; j4 < SK / 4; j4++) {
      unsigned hw[2];
#pragma unroll
      for (int nt = 0; nt < 2; nt++) hw[nt] = lds16(smem, kt + (nt * 8 + g) * a.kcb + signs_at + 2 * j4);
#pragma unroll
      for (int jj = 0; jj < 4; jj++) {
        const uint4 pf = sf[(4 * j4 + jj) * 32 + lane];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
          const unsigned addr = (((hw[nt] >> (4 * jj)) & 15u) << 8) | ls;
          const uint2 bb = lds64(smem, L.signs + addr);
          mma_16816(c[nt][jj & 1], pf.x, pf.y, pf.z, pf.w, bb.x, bb.y);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int tok = nt * 8 + 2 * t4 + e;
        const int row = kt + tok * a.kcb;
        float sc = ((c[nt][0][e] + c[nt][1][e]) + (c[nt][0][2 + e] + c[nt][1][2 + e])) *
                   __half2float(__ushort_as_half((unsigned short)lds16(smem, row)));
        sc = qjl_row_outliers<D>(smem, row, out_at, O, qs + g * D, sc);
        s[nt][e] = tok < n ? sc * a.scale : -INFINITY;
      }
    }
#else
    if (ht_count == 2)
      qjl_i8_scores<D, 2>(smem, L, qs, kt, a.kcb, mpad, out_at, O, n, a.scale, s);
    else
      qjl_i8_scores<D, 1>(smem, L, qs, kt, a.kcb, mpad, out_at, O, n, a.scale, s);
#endif
    float p[2][2];
    fast_softmax<MT>(s, m_run, l, acc, p, t4);
    const unsigned pb0 = pack_f2(p[0][0], p[0][1]), pb1 = pack_f2(p[1][0], p[1][1]);
    // Tokens u = 0..3: 2t4, 2t4+1, 2t4+8, 2t4+9: their group's scale and minimum as f16 pairs
    // (tokens 0, 1 and 2, 3), and this lane's codes of each.
    unsigned vw[4][VSW];
    unsigned sc[4], mn[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int tok = (u >> 1) * 8 + 2 * t4 + (u & 1);
      const int row = vt + tok * a.vcb;
      // Rows past the chunk's end hold stale bytes: their scale and minimum are zeroed so the
      // values they give are 0, not NaN (a zero probability times NaN is NaN).
      sc[u] = tok < n ? lds16(smem, row + 4 * gi) : 0u;
      mn[u] = tok < n ? lds16(smem, row + 4 * gi + 2) : 0u;
      lds_words<VSW>(smem, row + 4 * groups + g * VSB, vw[u]);
    }
    const unsigned s01 = pack_u16(sc[0], sc[1]), s23 = pack_u16(sc[2], sc[3]);
    const unsigned m01 = pack_u16(mn[0], mn[1]), m23 = pack_u16(mn[2], mn[3]);
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      const unsigned e0 = lds32(smem, L.table + pair_addr<VB>(vw[0], mt, lv));
      const unsigned e1 = lds32(smem, L.table + pair_addr<VB>(vw[1], mt, lv));
      const unsigned e2 = lds32(smem, L.table + pair_addr<VB>(vw[2], mt, lv));
      const unsigned e3 = lds32(smem, L.table + pair_addr<VB>(vw[3], mt, lv));
      mma_16816(acc[mt], hfma2_bits(__byte_perm(e0, e1, 0x5410), s01, m01),
                hfma2_bits(__byte_perm(e0, e1, 0x7632), s01, m01),
                hfma2_bits(__byte_perm(e2, e3, 0x5410), s23, m23),
                hfma2_bits(__byte_perm(e2, e3, 0x7632), s23, m23), pb0, pb1);
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  ch.stop(smem);
  fast_mark(f, 2);
  fast_finish<D, NW>(a, f, L, smem, acc, m_run, l, k, nullptr, 1.f);
}

template <int D, int VB, int NW>
__device__ inline void qjl_fast_entry(const AttendArgs& a, const QjlKeyParams& kp,
                                      const GroupParams& vp, const FastArgs& f, uint8_t* smem) {
  const int mpad = qjl_mpad(kp.sketch.m);
  const FastLayout L = fast_layout(D, 1 << (2 * VB), mpad / 16, 8 * mpad, NW, a.kcb, a.vcb);
  fast_check_smem(L);
  fast_mark(f, 0);
  if (f.exact && blockIdx.x == gridDim.x - 1)
    fast_exact<D, NW>(a, f, L, smem, nullptr, 1.f);
  else
    qjl_fast_attend<D, VB, NW>(a, kp, vp, f, L, smem);
}

}  // namespace kvq

#define KVQ_FAST_QJL(D, VB)                                                                   \
  extern "C" __global__ void __launch_bounds__(KVQ_FAST_NW(D) * 32, 1)                        \
      kvq_fast_qjl_d##D##_v##VB(kvq::AttendArgs a, kvq::QjlKeyParams kp, kvq::GroupParams vp, \
                                kvq::FastArgs f) {                                            \
    extern __shared__ __align__(16) uint8_t kvq_smem[];                                       \
    kvq::qjl_fast_entry<D, VB, KVQ_FAST_NW(D)>(a, kp, vp, f, kvq_smem);                       \
  }

KVQ_FAST_QJL(64, 2)
KVQ_FAST_QJL(64, 4)
KVQ_FAST_QJL(128, 2)
KVQ_FAST_QJL(128, 4)
KVQ_FAST_QJL(256, 2)
KVQ_FAST_QJL(256, 4)
