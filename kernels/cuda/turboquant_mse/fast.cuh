// Version 5 of the fused decode attention over scalar-codebook rows (TurboQuant-MSE, -RVQ; with
// SKETCH, TurboQuant-Prod's keys: the stage plus the residual's sign sketch), built to read the
// codes at memory speed: one launch per layer and decode step does the code splits, the exact
// fp16 rows (sinks and window, two segments, read in place) as one more block, and the split
// merge (the last block of each kv head to finish merges every split, adds the key center's
// logit shift and applies the inverse rotation once).
//
// Per chunk of 16 code rows a warp runs S = Q K^T and O += P V as m16n8k16 mmas (the layout of
// mma.cuh, version 4), but dequantizes through per-lane lookup tables in shared memory: entry
// (pair index i, lane) holds the f16 levels of the two coordinates whose packed codes are i, so
// one byte permute (which forms the table address from the code byte and the lane's slot) and
// one shared load give a whole B (keys) or half an A (values) register, bank-conflict free (each
// lane reads its own bank). 64 KiB of tables at 4 bits: one block of 16 warps per
// multiprocessor, chunks copied by the bulk copy engine three deep per warp, every block started
// at once.
// Levels are scaled before rounding to f16 by a factor the host picks so they round nearly
// exactly (kvq-kernels cuda/fast.rs), and divided back out of the scores and the output.
#pragma once
#include "../common/fast.cuh"
#include "../common/sketch.cuh"
#include "mma.cuh"

namespace kvq {

// The key parameters' scalar stage, and the sketch when there is one.
template <bool SKETCH, class KP>
__device__ inline const ScalarParams& fast_scalar(const KP& p) {
  if constexpr (SKETCH)
    return p.scalar;
  else
    return p;
}

// One block of code rows: kv head chunk blockIdx.y, query row z = blockIdx.z, split blockIdx.x.
// Writes the block's partial state (unnormalized output in the rotated domain; max; sum) to its
// slot of `a.part`; the last block of the (z, y) pair merges all slots into f.out.
template <int D, int KB, int VB, bool SKETCH, int NW, class KP>
__device__ void fast_attend(const AttendArgs& a, const KP& kpar, const ScalarParams& vp,
                            const FastArgs& f, uint8_t* smem) {
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
  static_assert(KB >= 1 && KB <= 4 && VB >= 1 && VB <= 4, "code widths");
  constexpr int NT = NW * 32;
  constexpr int KSPAN = D / 4, KSB = KSPAN * KB / 8, KSW = (KSB + 3) / 4;
  constexpr int VSPAN = D / 8, VSB = VSPAN * VB / 8, VSW = (VSB + 3) / 4;
  constexpr int KSTEPS = D / 16, MT = D / 16;
  constexpr int SGB = D / 32, SGW = (SGB + 3) / 4, RNORM = 2 + D * KB / 8;
  const ScalarParams& kp = fast_scalar<SKETCH>(kpar);
  constexpr int TROWS = 1 << (2 * (KB > VB ? KB : VB));
  const FastLayout L = fast_layout(D, TROWS, SKETCH ? D / 16 : 0, SKETCH ? 4 * 8 * D : 0, NW,
                                   a.kcb, a.vcb);
  fast_check_smem(L);
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const FastBlock k = fast_block(a);
  const int kh = k.kh, gb = k.gb;
  float* qs = reinterpret_cast<float*>(smem + L.qs);

  // This block's rows (a split of the query row's code range); their copies start once the
  // prologue's own reads are back.
  const FastChunks<NW> ch(a, L, k);

  // Queries (rows gb..7 zero); tables; sketch projections.
  const float* qrows = k.qrows;
  // Every global read of the prologue issued at once (one latency, not three): the scaled
  // levels into the softmax-state words (free until the finish), the queries already times the
  // rotation signs (the same products as below).
  float* lvl = reinterpret_cast<float*>(smem + L.wm);  // [0, 16): keys, [16, 32): values
  if (tid < (1 << KB))
    lvl[tid] = kp.levels[tid] * kp.lev;
  else if (tid >= 32 && tid < 32 + (1 << VB))
    lvl[tid - 16] = vp.levels[tid - 32] * vp.lev;
  {
    const float* sgn = kp.signs + (long long)kh * D;
    for (int i = tid; i < 8 * D; i += NT) {
      const int h = i / D;
      qs[i] = h < k.gb ? qrows[h * a.q_hstride + i % D] * __ldg(sgn + i % D) : 0.f;
    }
  }
  __syncthreads();
  fast_mark(f, 5);
  ch.start(smem);  // after the prologue's reads: they do not queue behind every block's copies
  {
    // Pair tables: row i (256 bytes) holds 32 copies of the key entry, then 32 of the value
    // entry: (level[i & mask], level[i >> B]) * lev as f16.
    constexpr int KR = 1 << (2 * KB), VR = 1 << (2 * VB);
    constexpr int R = KR > VR ? KR : VR;
    fast_pair_tables<NT>(
        smem + L.table, R,
        [&](int row) {
          return row < KR ? pack_f2(lvl[row & ((1 << KB) - 1)], lvl[row >> KB]) : 0u;
        },
        [&](int row) {
          return row < VR ? pack_f2(lvl[16 + (row & ((1 << VB) - 1))], lvl[16 + (row >> VB)])
                          : 0u;
        });
    if constexpr (SKETCH) {
      // Sign nibbles: bits 0, 1 -> the first pair, bits 2, 3 -> the second (+1 set, -1 clear).
      uint2* sg = reinterpret_cast<uint2*>(smem + L.signs);
      for (int i = tid; i < 16 * 32; i += NT) {
        const unsigned n = i >> 5;
        sg[i] = make_uint2(signs_f16x2(n, 0), signs_f16x2(n, 2));
      }
    }
  }
  fast_mark(f, 6);
  {
    // Rotate the queries: x <- H diag(signs) x / sqrt(D) (the signs were applied at the load;
    // the butterflies' barrier also ends the table fill).
    fast_butterflies_warp<D, NW>(qs, gb);
    fast_mark(f, 7);
    const float sc = rsqrtf((float)D);
    for (int i = tid; i < 8 * D; i += NT) qs[i] *= sc;
    if constexpr (SKETCH) {
      // proj[h][i] = sqrt(pi/2)/m * sum_j S[i][j] q[h][j] (matrices stored [kvh][D][m], m = D),
      // from the unrotated queries: each thread sums a quarter of j for 4 coordinates into its
      // own partial row, the four partials are added in a fixed order.
      float* pj = reinterpret_cast<float*>(smem + L.proj);  // [4][8][D], then the sums [8][D]
      const float* S = kpar.sketch.mats + (long long)kh * D * D;
      for (int i = tid; i < 4 * 8 * D; i += NT) pj[i] = 0.f;
      __syncthreads();
      for (int w = tid; w < gb * D; w += NT) {
        const int h = w / D, r = w % D, i4 = r / 4, jq = r % 4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        const float* qh = qrows + h * a.q_hstride;
#pragma unroll 8
        for (int j = jq * (D / 4); j < (jq + 1) * (D / 4); j++) {
          const float4 s4 = __ldg(reinterpret_cast<const float4*>(S + (long long)j * D) + i4);
          const float qj = __ldg(qh + j);
          acc.x = fmaf(s4.x, qj, acc.x);
          acc.y = fmaf(s4.y, qj, acc.y);
          acc.z = fmaf(s4.z, qj, acc.z);
          acc.w = fmaf(s4.w, qj, acc.w);
        }
        *reinterpret_cast<float4*>(pj + (jq * 8 + h) * D + 4 * i4) = acc;
      }
      __syncthreads();
      const float c = QJL_CONST / (float)D;
      for (int i = tid; i < 8 * D; i += NT)
        pj[i] = (((pj[i] + pj[8 * D + i]) + pj[16 * D + i]) + pj[24 * D + i]) * c;
      __syncthreads();
      uint4* sf = reinterpret_cast<uint4*>(smem + L.sfrag);
      for (int i = tid; i < KSTEPS * 32; i += NT) {
        const int j = i / 32, ln = i % 32;
        sf[i] = fast_qfrag(pj, D, ln >> 2, ln & 3, j);
      }
    }
    __syncthreads();
  }
  const FastQueryFrags<D, NT> qfrag(qs, smem, L);

  const float ksc = kp.sigma * a.scale / kp.lev;
  const unsigned lk = lane * 4, lv = lane * 4 + 128, ls = lane * 8;
  float m = -INFINITY, l = 0.f;
  float acc[MT][4];
  fast_zero<MT>(acc);
  fast_mark(f, 1);

  for (int i = 0; i < ch.count; i++) {
    int kt, vt;
    ch.next(smem, i, kt, vt);
    const int n = ch.rows(i);
    float s[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
      float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
      float cs[4] = {0.f, 0.f, 0.f, 0.f};
      const int tk = nt * 8 + g;
      {
        const int krow = kt + tk * a.kcb;
        unsigned w[KSW];
        lds_words<KSW>(smem, krow + 2 + t4 * KSB, w);
#pragma unroll
        for (int j = 0; j < KSTEPS; j++) {
          const unsigned b0 = lds32(smem, L.table + pair_addr<KB>(w, 2 * j, lk));
          const unsigned b1 = lds32(smem, L.table + pair_addr<KB>(w, 2 * j + 1, lk));
          const uint4 q = qfrag(j);
          mma_16816(j & 1 ? c1 : c0, q.x, q.y, q.z, q.w, b0, b1);
        }
        if constexpr (SKETCH) {
          unsigned sw[SGW];
          lds_words<SGW>(smem, krow + RNORM + 2 + t4 * SGB, sw);
          const uint4* sf = reinterpret_cast<const uint4*>(smem + L.sfrag);
#pragma unroll
          for (int j = 0; j < KSTEPS; j++) {
            const uint2 bb = lds64(smem, L.signs + nibble_addr(sw, j, ls));
            const uint4 pf = sf[j * 32 + lane];
            mma_16816(cs, pf.x, pf.y, pf.z, pf.w, bb.x, bb.y);
          }
        }
      }
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int tok = nt * 8 + 2 * t4 + e;
        float sc = ((c0[e] + c1[e]) + (c0[2 + e] + c1[2 + e])) * ksc;
        {
          const uint8_t* r = smem + kt + tok * a.kcb;
          sc *= __half2float(*reinterpret_cast<const __half*>(r));
          if constexpr (SKETCH) {
            const float rn = __half2float(*reinterpret_cast<const __half*>(r + RNORM));
            sc = fmaf((cs[e] + cs[2 + e]) * rn, a.scale, sc);
          }
        }
        s[nt][e] = tok < n ? sc : -INFINITY;
      }
    }
    float p[2][2];
    fast_softmax<MT>(s, m, l, acc, p, t4);
    // Probabilities (times the value norms) as the B fragment of P V: tokens 2t4, 2t4+1 (b0)
    // and 2t4+8, 2t4+9 (b1) of head g.
    float pv[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int tok = nt * 8 + 2 * t4 + e;
        const float vn = __half2float(*reinterpret_cast<const __half*>(smem + vt + tok * a.vcb));
        pv[nt][e] = tok < n ? p[nt][e] * vn : 0.f;
      }
    const unsigned pb0 = pack_f2(pv[0][0], pv[0][1]), pb1 = pack_f2(pv[1][0], pv[1][1]);
    {
      unsigned vw[4][VSW];
#pragma unroll
      for (int u = 0; u < 4; u++)
        lds_words<VSW>(smem, vt + ((u >> 1) * 8 + 2 * t4 + (u & 1)) * a.vcb + 2 + g * VSB, vw[u]);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        const unsigned e0 = lds32(smem, L.table + pair_addr<VB>(vw[0], mt, lv));
        const unsigned e1 = lds32(smem, L.table + pair_addr<VB>(vw[1], mt, lv));
        const unsigned e2 = lds32(smem, L.table + pair_addr<VB>(vw[2], mt, lv));
        const unsigned e3 = lds32(smem, L.table + pair_addr<VB>(vw[3], mt, lv));
        mma_16816(acc[mt], __byte_perm(e0, e1, 0x5410), __byte_perm(e0, e1, 0x7632),
                  __byte_perm(e2, e3, 0x5410), __byte_perm(e2, e3, 0x7632), pb0, pb1);
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  ch.stop(smem);
  fast_mark(f, 2);
  fast_finish<D, NW>(a, f, L, smem, acc, m, l, k, vp.signs + (long long)kh * D,
                     vp.sigma / vp.lev);
}

// The kernel: the last x block of each (row, kv head) runs the exact rows when there are any;
// every block passes the values' rotation and scale to the merge (any may be the last).
template <int D, int KB, int VB, bool SKETCH, int NW, class KP>
__device__ inline void fast_entry(const AttendArgs& a, const KP& kp, const ScalarParams& vp,
                                  const FastArgs& f, uint8_t* smem) {
  fast_mark(f, 0);
  if (f.exact && blockIdx.x == gridDim.x - 1) {
    constexpr int TROWS = 1 << (2 * (KB > VB ? KB : VB));
    const FastLayout L = fast_layout(D, TROWS, SKETCH ? D / 16 : 0, SKETCH ? 4 * 8 * D : 0, NW,
                                     a.kcb, a.vcb);
    fast_check_smem(L);
    const int kh = blockIdx.y / a.hchunks;
    fast_exact<D, NW>(a, f, L, smem, vp.signs + (long long)kh * D, vp.sigma / vp.lev);
  } else {
    fast_attend<D, KB, VB, SKETCH, NW>(a, kp, vp, f, smem);
  }
}

}  // namespace kvq
