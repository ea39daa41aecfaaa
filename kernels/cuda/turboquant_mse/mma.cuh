// Tensor-core decode attention over scalar-codebook rows (TurboQuant-MSE, -RVQ; kvq-kernels
// spec.rs ScalarSpec; with SKETCH, TurboQuant-Prod's keys: the scalar stage plus the residual's
// sign sketch, scored by one more mma per k step): each warp takes chunks of 16 code rows of one
// kv head, dequantizes them to f16 in registers once for every query head of the group (a
// shared-memory lookup per coordinate, a byte permute for 4-bit keys, a lookup per pair of
// coordinates for <= 2-bit codes) and runs Q K^T and P V as m16n8k16 mmas.
//
// Scores: S^T (16 x 8 tokens) = Qs (16 x D) K^T. Rows 0-7 of Qs are the rotated query heads in
// f16, rows 8-15 what f16 rounding left of them, so the two halves of the C tile summed give the
// score at nearly f32 precision. Thread (g, t) holds the keys of token g of each 8-token tile,
// coordinates [t D/4, (t+1) D/4) of it (the dot product does not care which coordinate goes to
// which k slot, so each thread reads one contiguous span; the query fragments follow the same
// assignment). Its C values are head g's scores of tokens 2t, 2t+1 (+8): exactly the B fragment
// of P V, so the probabilities never leave registers.
// Values: O^T (D x 8 heads) += V^T (D x 16 tokens) P^T. Thread (g, t) dequantizes coordinates
// [g D/8, (g+1) D/8) of tokens 2t, 2t+1, 2t+8, 2t+9. Norms scale the scores and the
// probabilities (the value codebook is unit variance), sigma and the inverse rotation are applied
// once per block to the merged output.
// Each warp keeps its own online softmax over its chunks, copies its chunks with cp.async three
// deep, and synchronizes with the other warps only at the start and at the final merge.
#pragma once
#include "../common/mma.cuh"
#include "scalar.cuh"

namespace kvq {

#define KVQ_MMA_STAGES 3
// Independent accumulator chains of the score mmas (latency: each mma waits for the last).
#ifndef KVQ_MMA_CHAINS
#define KVQ_MMA_CHAINS 2
#endif
// 4-bit keys: dequantize with register permutes (1) or shared-memory lookups (0).
#ifndef KVQ_MMA_KEY_PRMT
#define KVQ_MMA_KEY_PRMT 1
#endif
// Blocks per multiprocessor the d = 128 kernels are compiled for (4: 128 registers a thread).
#ifndef KVQ_MMA_MINB128
#define KVQ_MMA_MINB128 4
#endif

// Bytes of one warp stage buffer holding 16 rows of `cb` bytes (slack for the offset of an
// unaligned first row and for word reads past the last row).
__host__ __device__ inline int mma_stage_bytes(int cb) { return (16 * cb + 32 + 15) & ~15; }

// Row stride (floats) of the warps' outputs in the final merge: a skew of one float per 16
// coordinates and an odd stride keep the lanes' stores in distinct banks.
__host__ __device__ inline int mma_merge_stride(int D) { return D + D / 16 + 1; }

// Shared-memory bytes the kernel needs (the Rust launcher mirrors it: cuda/attend.rs).
__host__ __device__ inline size_t scalar_mma_smem(int D, int kcb, int vcb) {
  const int NW = KVQ_THREADS / 32;
  const size_t head = (size_t)8 * D * 4 + 512 + 2 * NW * 8 * 4 + (size_t)D / 16 * 32 * 16 +
                      (size_t)32 * (D / 16 + 1) * 16;
  const size_t stages = (size_t)NW * KVQ_MMA_STAGES * (mma_stage_bytes(kcb) + mma_stage_bytes(vcb));
  const size_t merge = (size_t)NW * 8 * mma_merge_stride(D) * 4;
  return head + (stages > merge ? stages : merge);
}

// The scalar stage of the key parameters.
__device__ inline const ScalarParams& key_scalar(const ScalarParams& p) { return p; }
template <class P>
__device__ inline const ScalarParams& key_scalar(const P& p) {
  return p.scalar;
}

// A sign sketch's 2 bits as the f16 pair (+1 where set, -1 where clear).
__device__ inline unsigned signs_f16x2(unsigned w, int bit) {
  return 0xBC00BC00u ^ (((w >> bit) & 1u) << 15) ^ (((w >> (bit + 1)) & 1u) << 31);
}

// One block of the tensor-core attention: kv head `kh`, heads [hc*gb, hc*gb + gb) of its group,
// split `split` of query row z = b*T + t. FP16: the block runs over the exact fp16 rows (sinks,
// window: `[B][kvh][n][D]` f16, read straight from global memory, the query unrotated) instead
// of the codes; the launch gives it the slot after the code splits.
template <int D, int KB, int VB, bool SKETCH, bool FP16, class KP>
__device__ void attend_scalar_mma(const AttendArgs& a, const KP& kpar, const ScalarParams& vp,
                                  uint8_t* smem, int split) {
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
  constexpr int NW = KVQ_THREADS / 32;
  constexpr int ST = KVQ_MMA_STAGES;
  constexpr int KSPAN = D / 4, KSB = KSPAN * KB / 8, KSW = (KSB + 3) / 4;
  constexpr int VSPAN = D / 8, VSB = VSPAN * VB / 8, VSW = (VSB + 3) / 4;
  constexpr int KSTEPS = D / 16, MT = D / 16;
  // Sketch: D signs after the stage's codes and ||r||; this thread's D/4 of them.
  constexpr int SGB = D / 32, SGW = (SGB + 3) / 4, RNORM = 2 + D * KB / 8;
  // 2 coordinates per lookup when 2^(2 bits) <= 16 entries.
  constexpr bool KPAIRS = KB <= 2, VPAIRS = VB <= 2;
  const ScalarParams& kp = key_scalar(kpar);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int kh = blockIdx.y / a.hchunks, hc = blockIdx.y % a.hchunks;
  const int z = blockIdx.z, b = z / a.T, t = z % a.T;
  const int h0 = kh * a.group + hc * a.gb;
  const int gb = min(a.gb, a.group - hc * a.gb);
  const long long pos = a.first_pos + t;
  long long r0, r1;
  code_rows(a, pos, r0, r1);
  r1 = min(r1, a.n_rows);
  const long long s0 = r0 + (long long)split * a.split_rows;
  const long long s1 = min(r1, s0 + a.split_rows);
  auto out_row = [&](int h, int s) {
    return a.part + ((((long long)b * a.nh + h) * a.T + t) * a.n_splits + s) * (D + 2);
  };
  if (s1 <= s0) {
    for (int i = tid; i < gb * (D + 2); i += KVQ_THREADS) {
      int h = i / (D + 2), c = i % (D + 2);
      out_row(h0 + h, a.split_base + split)[c] = c == D ? -INFINITY : 0.f;
    }
    return;
  }

  // Shared memory: queries [8][D] (later the merged output) | level tables | per-warp max and
  // sum [NW][8] each | sketch query fragments | per-warp stages (later the warps' outputs).
  float* qs = reinterpret_cast<float*>(smem);
  unsigned short* klv = reinterpret_cast<unsigned short*>(qs + 8 * D);  // 64 f16 levels
  unsigned short* vlv = klv + 64;
  unsigned* kpair = reinterpret_cast<unsigned*>(vlv + 64);  // 16 f16 pairs, then what f16
  unsigned* vpair = kpair + 16;                              // rounding left of them
  unsigned* kplo = vpair + 16;
  unsigned* vplo = kplo + 16;
  float* wm = reinterpret_cast<float*>(smem + 8 * D * 4 + 512);
  float* wl = wm + NW * 8;
  uint4* sfrag = reinterpret_cast<uint4*>(wl + NW * 8);  // [KSTEPS][32 lanes]
  uint4* qfrag = sfrag + KSTEPS * 32;                     // [32 lanes][KSTEPS + 1]
  uint8_t* stages = reinterpret_cast<uint8_t*>(qfrag + 32 * (KSTEPS + 1));
  const int kbuf = mma_stage_bytes(a.kcb), vbuf = mma_stage_bytes(a.vcb);
  // This warp's stages, as offsets from `smem` (word loads stay in the shared space).
  const int mine = (int)(stages - smem) + warp * ST * (kbuf + vbuf);
  auto kstage = [&](int s) { return mine + s * kbuf; };
  auto vstage = [&](int s) { return mine + ST * kbuf + s * vbuf; };

  const uint8_t* kbase = a.kc + b * a.k_bstride + kh * a.k_hstride;
  const uint8_t* vbase = a.vc + b * a.v_bstride + kh * a.v_hstride;
  const int nchunks = (int)((s1 - s0 + 15) / 16);
  const int count = nchunks > warp ? (nchunks - warp + NW - 1) / NW : 0;
  auto chunk_base = [&](int i) { return s0 + (long long)(warp + i * NW) * 16; };
  auto issue = [&](int i) {
    if (!FP16 && i < count) {
      const long long base = chunk_base(i);
      const int n = (int)min(16ll, s1 - base);
      warp_load_rows(smem + kstage(i % ST), kbase, a.kcb, base, n, lane);
      warp_load_rows(smem + vstage(i % ST), vbase, a.vcb, base, n, lane);
    }
    cp_async_commit();  // empty groups keep the count of pending groups uniform
  };
#pragma unroll
  for (int i = 0; i < ST - 1; i++) issue(i);  // the first copies overlap the query rotation

  // Queries (rows gb..7 zero), rotated for codes; level tables; sketch fragments.
  const float* qrows = a.q + b * a.q_bstride + h0 * a.q_hstride + t * a.q_tstride;
  for (int i = tid; i < 8 * D; i += KVQ_THREADS) {
    const int h = i / D;
    qs[i] = h < gb ? qrows[h * a.q_hstride + i % D] : 0.f;
  }
  if constexpr (!FP16) {
    constexpr int KL = 1 << KB, VL = 1 << VB;
    for (int i = tid; i < KL; i += KVQ_THREADS)
      klv[i] = __half_as_ushort(__float2half_rn(kp.levels[i]));
    for (int i = tid; i < VL; i += KVQ_THREADS)
      vlv[i] = __half_as_ushort(__float2half_rn(vp.levels[i]));
    // Pair tables (2 coordinates per lookup) hold each level as f16 plus what rounding left:
    // the coarse codes are read twice for f32-like precision at little cost.
    auto hi_lo = [](float x, float y, unsigned& hi, unsigned& lo) {
      unsigned short xh, xl, yh, yl;
      split_f16(x, xh, xl);
      split_f16(y, yh, yl);
      hi = pack_u16(xh, yh);
      lo = pack_u16(xl, yl);
    };
    if (KPAIRS)
      for (int i = tid; i < KL * KL; i += KVQ_THREADS)
        hi_lo(kp.levels[i & (KL - 1)], kp.levels[i >> KB], kpair[i], kplo[i]);
    if (VPAIRS)
      for (int i = tid; i < VL * VL; i += KVQ_THREADS)
        hi_lo(vp.levels[i & (VL - 1)], vp.levels[i >> VB], vpair[i], vplo[i]);
  }
  if constexpr (SKETCH && !FP16) {
    // Fragments of the projections sqrt(pi/2)/m S q (one row per query row, computed before
    // the launch), laid out per lane for one 16-byte load per k step.
    const long long prow = ((long long)b * a.nh + h0) * a.T + t;
    for (int i = tid; i < KSTEPS * 32; i += KVQ_THREADS) {
      const int j = i / 32, ln = i % 32, hg = ln >> 2, tt = ln & 3;
      unsigned short h[4], l[4];
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const long long at = (prow + (long long)hg * a.T) * D + tt * KSPAN + 4 * j + e;
        split_f16(hg < gb ? kpar.sketch.proj[at] : 0.f, h[e], l[e]);
      }
      sfrag[i] = make_uint4(pack_u16(h[0], h[1]), pack_u16(l[0], l[1]), pack_u16(h[2], h[3]),
                            pack_u16(l[2], l[3]));
    }
  }
  __syncthreads();
  if constexpr (!FP16) forward_hadamard(qs, gb, D, kp.signs + (long long)kh * D, 1.f);

  // Query fragments: k step j covers coordinates t4*KSPAN + 4j .. +3 of head g (hi, lo), built
  // once per block into a padded array (lane-major, one 16-byte entry per k step) so that
  // neither the build nor the warps' loads conflict in banks.
  for (int i = tid; i < 32 * KSTEPS; i += KVQ_THREADS) {
    const int ln = i / KSTEPS, j = i % KSTEPS, hg = ln >> 2, tt = ln & 3;
    const float4 x = *reinterpret_cast<const float4*>(qs + hg * D + tt * KSPAN + 4 * j);
    unsigned short h[4], l[4];
    split_f16(x.x, h[0], l[0]);
    split_f16(x.y, h[1], l[1]);
    split_f16(x.z, h[2], l[2]);
    split_f16(x.w, h[3], l[3]);
    qfrag[ln * (KSTEPS + 1) + j] = make_uint4(pack_u16(h[0], h[1]), pack_u16(l[0], l[1]),
                                              pack_u16(h[2], h[3]), pack_u16(l[2], l[3]));
  }
  __syncthreads();
  unsigned qa[KSTEPS][4];
#pragma unroll
  for (int j = 0; j < KSTEPS; j++) {
    const uint4 f = qfrag[lane * (KSTEPS + 1) + j];
    qa[j][0] = f.x;
    qa[j][1] = f.y;
    qa[j][2] = f.z;
    qa[j][3] = f.w;
  }
  const float ksc = FP16 ? a.scale : kp.sigma * a.scale;
  Lut16 klut{};
  if constexpr (KB == 4 && !FP16) klut = lut16_make(klv);
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
    // fp16 rows: row `tk` of the chunk, clamped to the last one present (its score is masked).
    auto xrow = [&](const uint8_t* head, int tk) {
      return head + (base + min(tk, n - 1)) * (long long)(2 * D);
    };
    // Scores of tokens nt*8 + 2*t4 + e for head g.
    float s[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
      constexpr int NC = KVQ_MMA_CHAINS;
      float cc[NC][4], cs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < NC; q++)
#pragma unroll
        for (int e = 0; e < 4; e++) cc[q][e] = 0.f;
      if constexpr (FP16) {
        unsigned w[D / 8];  // halves t4*KSPAN .. +KSPAN of the token's key
        ldg_words<D / 8>(xrow(kbase, nt * 8 + g) + t4 * KSPAN * 2, w);
#pragma unroll
        for (int j = 0; j < KSTEPS; j++)
          mma_16816(cc[j % NC], qa[j][0], qa[j][1], qa[j][2], qa[j][3], w[2 * j], w[2 * j + 1]);
      } else {
        const int krow = kt + (nt * 8 + g) * a.kcb;
        unsigned w[KSW];
        lds_words<KSW>(smem, krow + 2 + t4 * KSB, w);
#pragma unroll
        for (int j = 0; j < KSTEPS; j++) {
          unsigned b0, b1;
          if constexpr (KB == 4 && KVQ_MMA_KEY_PRMT) {
            lut16(klut, w[j >> 1] >> (16 * (j & 1)), b0, b1);
          } else if constexpr (KPAIRS) {
            const unsigned i0 = field_at<2 * KB>(w, (4 * j) * KB);
            const unsigned i1 = field_at<2 * KB>(w, (4 * j + 2) * KB);
            b0 = kpair[i0];
            b1 = kpair[i1];
            mma_16816(cc[(j + 1) % NC], qa[j][0], qa[j][1], qa[j][2], qa[j][3], kplo[i0], kplo[i1]);
          } else {
            b0 = pack_u16(klv[field_at<KB>(w, (4 * j) * KB)],
                          klv[field_at<KB>(w, (4 * j + 1) * KB)]);
            b1 = pack_u16(klv[field_at<KB>(w, (4 * j + 2) * KB)],
                          klv[field_at<KB>(w, (4 * j + 3) * KB)]);
          }
          mma_16816(cc[j % NC], qa[j][0], qa[j][1], qa[j][2], qa[j][3], b0, b1);
        }
        if constexpr (SKETCH) {
          unsigned sw[SGW];
          lds_words<SGW>(smem, krow + RNORM + 2 + t4 * SGB, sw);
#pragma unroll
          for (int j = 0; j < KSTEPS; j++) {
            const uint4 f = sfrag[j * 32 + lane];
            const int bit = 4 * j;  // this thread's signs 4j .. 4j+3 (k slots 2t4.., 2t4+8..)
            mma_16816(cs, f.x, f.y, f.z, f.w, signs_f16x2(sw[bit >> 5], bit & 31),
                      signs_f16x2(sw[bit >> 5], (bit + 2) & 31));
          }
        }
      }
      float c[4];
#pragma unroll
      for (int e = 0; e < 4; e++) {
        c[e] = cc[0][e];
#pragma unroll
        for (int q = 1; q < NC; q++) c[e] += cc[q][e];
      }
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int tk = nt * 8 + 2 * t4 + e;
        float sc = (c[e] + c[2 + e]) * ksc;
        if constexpr (!FP16) {
          const uint8_t* r = smem + kt + tk * a.kcb;
          sc *= __half2float(*reinterpret_cast<const __half*>(r));
          if constexpr (SKETCH) {
            const float rn = __half2float(*reinterpret_cast<const __half*>(r + RNORM));
            sc = fmaf((cs[e] + cs[2 + e]) * rn, a.scale, sc);
          }
        }
        s[nt][e] = tk < n ? sc : -INFINITY;
      }
    }
    // Online softmax of head g over the chunk (the 4 lanes of a group share a head).
    float mx = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = fmaxf(m, mx);
    float alpha = 1.f, p[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    if (mnew != -INFINITY) {
      alpha = __expf(m - mnew);
#pragma unroll
      for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) p[nt][e] = __expf(s[nt][e] - mnew);
    }
    m = mnew;
    l = l * alpha + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
    // Probabilities (times the value norms), as the B fragment of P V.
    float pv[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int tk = nt * 8 + 2 * t4 + e;
        float vn = 1.f;
        if constexpr (!FP16)
          vn = __half2float(*reinterpret_cast<const __half*>(smem + vt + tk * a.vcb));
        pv[nt][e] = tk < n ? p[nt][e] * vn : 0.f;
      }
    const unsigned pb0 = pack_f2(pv[0][0], pv[0][1]), pb1 = pack_f2(pv[1][0], pv[1][1]);
    // This thread's accumulators are heads 2*t4 and 2*t4 + 1: their rescale factors.
    const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * t4);
    const float al1 = __shfl_sync(0xffffffffu, alpha, 8 * t4 + 4);
    // Tokens u = 0..3: 2*t4, 2*t4 + 1, 2*t4 + 8, 2*t4 + 9.
    constexpr int VW = FP16 ? D / 16 : VSW;
    unsigned vw[4][VW];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int tk = (u >> 1) * 8 + 2 * t4 + (u & 1);
      if constexpr (FP16)
        ldg_words<VW>(xrow(vbase, tk) + g * VSPAN * 2, vw[u]);
      else
        lds_words<VW>(smem, vt + tk * a.vcb + 2 + g * VSB, vw[u]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      unsigned a0, a1, a2, a3;
      acc[mt][0] *= al0;
      acc[mt][1] *= al1;
      acc[mt][2] *= al0;
      acc[mt][3] *= al1;
      if constexpr (FP16) {
        // Coordinates 2mt, 2mt + 1 of the span: word mt of each token.
        a0 = __byte_perm(vw[0][mt], vw[1][mt], 0x5410);
        a1 = __byte_perm(vw[0][mt], vw[1][mt], 0x7632);
        a2 = __byte_perm(vw[2][mt], vw[3][mt], 0x5410);
        a3 = __byte_perm(vw[2][mt], vw[3][mt], 0x7632);
      } else if constexpr (VPAIRS) {
        const unsigned i0 = field_at<2 * VB>(vw[0], 2 * mt * VB);
        const unsigned i1 = field_at<2 * VB>(vw[1], 2 * mt * VB);
        const unsigned i2 = field_at<2 * VB>(vw[2], 2 * mt * VB);
        const unsigned i3 = field_at<2 * VB>(vw[3], 2 * mt * VB);
        const unsigned q0 = vpair[i0], q1 = vpair[i1], q2 = vpair[i2], q3 = vpair[i3];
        const unsigned l0 = vplo[i0], l1 = vplo[i1], l2 = vplo[i2], l3 = vplo[i3];
        mma_16816(acc[mt], __byte_perm(l0, l1, 0x5410), __byte_perm(l0, l1, 0x7632),
                  __byte_perm(l2, l3, 0x5410), __byte_perm(l2, l3, 0x7632), pb0, pb1);
        a0 = __byte_perm(q0, q1, 0x5410);
        a1 = __byte_perm(q0, q1, 0x7632);
        a2 = __byte_perm(q2, q3, 0x5410);
        a3 = __byte_perm(q2, q3, 0x7632);
      } else {
        a0 = pack_u16(vlv[field_at<VB>(vw[0], 2 * mt * VB)], vlv[field_at<VB>(vw[1], 2 * mt * VB)]);
        a1 = pack_u16(vlv[field_at<VB>(vw[0], (2 * mt + 1) * VB)],
                      vlv[field_at<VB>(vw[1], (2 * mt + 1) * VB)]);
        a2 = pack_u16(vlv[field_at<VB>(vw[2], 2 * mt * VB)], vlv[field_at<VB>(vw[3], 2 * mt * VB)]);
        a3 = pack_u16(vlv[field_at<VB>(vw[2], (2 * mt + 1) * VB)],
                      vlv[field_at<VB>(vw[3], (2 * mt + 1) * VB)]);
      }
      mma_16816(acc[mt], a0, a1, a2, a3, pb0, pb1);
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // all warps are done with their stages: the space holds the merge
  constexpr int WS = D + D / 16 + 1;  // mma_merge_stride
  float* wacc = reinterpret_cast<float*>(stages);  // [NW][8][WS], coordinate c at c + c / 16
  if (t4 == 0) {
    wm[warp * 8 + g] = m;
    wl[warp * 8 + g] = l;
  }
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    const int c = g * VSPAN + 2 * mt + (g * VSPAN + 2 * mt) / 16;
    float* w0 = wacc + (warp * 8 + 2 * t4) * WS;
    float* w1 = w0 + WS;
    w0[c] = acc[mt][0];
    w1[c] = acc[mt][1];
    w0[c + 1] = acc[mt][2];
    w1[c + 1] = acc[mt][3];
  }
  __syncthreads();
  // Merge the warps' states per head into qs (codes: the rotated domain, times sigma).
  float* fin = qs;
  for (int i = tid; i < gb * D; i += KVQ_THREADS) {
    const int h = i / D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; w++) mm = fmaxf(mm, wm[w * 8 + h]);
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < NW; w++) {
      const float mw = wm[w * 8 + h];
      const int c = i % D;
      if (mw != -INFINITY) o = fmaf(__expf(mw - mm), wacc[(w * 8 + h) * WS + c + c / 16], o);
    }
    fin[i] = FP16 ? o : o * vp.sigma;
  }
  __syncthreads();
  if constexpr (!FP16) inverse_hadamard(fin, gb, D, vp.signs + (long long)kh * D);
  for (int i = tid; i < gb * (D + 2); i += KVQ_THREADS) {
    const int h = i / (D + 2), c = i % (D + 2);
    float v;
    if (c < D) {
      v = fin[h * D + c];
    } else {
      float mm = -INFINITY, ll = 0.f;
      for (int w = 0; w < NW; w++) mm = fmaxf(mm, wm[w * 8 + h]);
      for (int w = 0; w < NW; w++) {
        const float mw = wm[w * 8 + h];
        if (mw != -INFINITY) ll = fmaf(__expf(mw - mm), wl[w * 8 + h], ll);
      }
      v = c == D ? mm : ll;
    }
    out_row(h0 + h, a.split_base + split)[c] = v;
  }
}

// The kernel: blocks 0 .. gridDim.x - 1 - extra run the code splits; with `extra`, the last
// one of each row runs the exact fp16 rows (`xa`: their view and slot), so the sinks and the
// window cost no launch of their own.
template <int D, int KB, int VB, bool SKETCH, class KP>
__device__ inline void attend_scalar_mma_entry(const AttendArgs& a, const KP& kp,
                                               const ScalarParams& vp, const AttendArgs& xa,
                                               int extra, uint8_t* smem) {
  if (extra && blockIdx.x == gridDim.x - 1)
    attend_scalar_mma<D, KB, VB, SKETCH, true>(xa, kp, vp, smem, 0);
  else
    attend_scalar_mma<D, KB, VB, SKETCH, false>(a, kp, vp, smem, blockIdx.x);
}

}  // namespace kvq

#define KVQ_SCALAR_MMA_ENTRY(D, BITS, MINB)                                                   \
  extern "C" __global__ void __launch_bounds__(KVQ_THREADS, MINB)                             \
      kvq_attend_scalar_mma_d##D##_b##BITS(kvq::AttendArgs a, kvq::ScalarParams kp,          \
                                           kvq::ScalarParams vp, kvq::AttendArgs xa,         \
                                           int extra) {                                      \
    extern __shared__ __align__(16) uint8_t kvq_smem[];                                       \
    kvq::attend_scalar_mma_entry<D, BITS, BITS, false>(a, kp, vp, xa, extra, kvq_smem);       \
  }

#define KVQ_SCALAR_MMA_ALL(D, MINB)  \
  KVQ_SCALAR_MMA_ENTRY(D, 1, MINB)   \
  KVQ_SCALAR_MMA_ENTRY(D, 2, MINB)   \
  KVQ_SCALAR_MMA_ENTRY(D, 3, MINB)   \
  KVQ_SCALAR_MMA_ENTRY(D, 4, MINB)   \
  KVQ_SCALAR_MMA_ENTRY(D, 5, MINB)   \
  KVQ_SCALAR_MMA_ENTRY(D, 6, MINB)
