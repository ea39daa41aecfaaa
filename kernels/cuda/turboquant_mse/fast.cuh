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
// multiprocessor, chunks copied with cp.async three deep per warp, every block started at once.
// Levels are scaled before rounding to f16 by a factor the host picks so they round nearly
// exactly (kvq-kernels cuda/fast.rs), and divided back out of the scores and the output.
#pragma once
#include "../common/sketch.cuh"
#include "mma.cuh"

namespace kvq {

#ifndef KVQ_FAST_STAGES
#define KVQ_FAST_STAGES 3
#endif
#define KVQ_FAST_MAX_SLOTS 256  // most splits (plus the exact rows' block) per kv head

struct FastArgs {
  // Exact rows: row r of segment s of (b, kh) at xk[s] + b*xb[s] + kh*xh[s] + r*D (halves).
  const __half* xk[2];
  const __half* xv[2];
  long long xb[2], xh[2];
  int xn[2];            // rows in segment s (the sinks, then the window)
  const float* mu;      // [kvh][D] key center (code logits get scale * q . mu), or null
  float* out;           // [B][nh][T][ostride]: the merged output (normalized or not), then max, sum
  unsigned* counters;   // [B*T][kvh*hchunks] blocks finished; zero between launches (reset here)
  int ostride;          // D (output only) or D + 2
  int normalize;
  int exact;            // 1: block x == gridDim.x - 1 runs the exact rows
  const float* shift;   // [B][nh][T] added to the code logits (used when mu is null), or null
};

// Bytes of one warp stage buffer of 16 rows of `cb` bytes (mma.cuh mma_stage_bytes).
__host__ __device__ inline int fast_stage_bytes(int cb) { return (16 * cb + 32 + 15) & ~15; }

// Shared-memory layout of the fast kernel (the Rust launcher mirrors `fast_smem`).
struct FastLayout {
  int table, signs, qs, qfrag, sfrag, proj, wm, wl, flag, stages, total;
};

__host__ __device__ inline FastLayout fast_layout(int D, int KB, int VB, bool sketch, int NW,
                                                  int kcb, int vcb) {
  FastLayout l;
  const int bmax = KB > VB ? KB : VB;
  int at = 0;
  l.table = at;
  at += (1 << (2 * bmax)) * 256;
  l.signs = at;
  at += sketch ? 16 * 256 : 0;
  l.qs = at;
  at += 8 * D * 4;
  l.qfrag = at;
  at += D > 128 ? (D / 16) * 32 * 16 : 0;
  l.sfrag = at;
  at += sketch ? (D / 16) * 32 * 16 : 0;
  l.proj = at;
  at += sketch ? 4 * 8 * D * 4 : 0;  // four partial sums of the projections
  l.wm = at;
  at += NW * 8 * 4;
  l.wl = at;
  at += NW * 8 * 4;
  l.flag = at;
  at += 16;
  l.stages = at;
  const int stages = NW * KVQ_FAST_STAGES * (fast_stage_bytes(kcb) + fast_stage_bytes(vcb));
  const int merge = NW * 8 * (D + D / 16 + 1) * 4;
  const int fin = 8 * (KVQ_FAST_MAX_SLOTS + 1) * 4 + 8 * D * 4;
  int rest = stages > merge ? stages : merge;
  rest = rest > fin ? rest : fin;
  l.total = at + rest;
  return l;
}

__device__ inline unsigned lds32(const uint8_t* smem, unsigned off) {
  return *reinterpret_cast<const unsigned*>(smem + off);
}

__device__ inline uint2 lds64(const uint8_t* smem, unsigned off) {
  return *reinterpret_cast<const uint2*>(smem + off);
}

// Table address of pair `p` (coordinates 2p, 2p+1) of a packed span of `B`-bit codes held in
// the words `w`: the pair's 2B-bit index times 256, plus `lane_off` (the lane's slot in a row).
template <int B>
__device__ inline unsigned pair_addr(const unsigned* w, int p, unsigned lane_off) {
  const int o = 2 * p * B, wi = o >> 5, bo = o & 31;
  if constexpr (B == 4) {
    // The index is byte bo/8 of the word: one permute puts it in byte 1 over the lane's slot.
    return __byte_perm(w[wi], lane_off, 0x7604 | ((bo >> 3) << 4));
  } else {
    unsigned v;
    int sh;
    if (bo + 2 * B <= 32) {
      v = w[wi];
      sh = bo;
    } else {
      v = __funnelshift_r(w[wi], w[wi + 1], bo);
      sh = 0;
    }
    const unsigned x = sh >= 8 ? v >> (sh - 8) : v << (8 - sh);
    return (x & (((1u << (2 * B)) - 1) << 8)) | lane_off;
  }
}

// Table address of the 4 sign bits 4j .. 4j+3 of a packed span (`lane_off` = lane * 8).
__device__ inline unsigned nibble_addr(const unsigned* w, int j, unsigned lane_off) {
  const int o = 4 * j, wi = o >> 5, bo = o & 31;
  const unsigned x = bo >= 8 ? w[wi] >> (bo - 8) : w[wi] << (8 - bo);
  return (x & 0xf00u) | lane_off;
}

// Walsh-Hadamard butterflies over `rows` rows of D floats in shared memory, by NT threads
// (range-based pairs, a barrier after each stage; attend.cuh `butterflies`).
template <int NT>
__device__ inline void fast_butterflies(float* x, int rows, int D) {
  for (int h = 1; h < D; h <<= 1) {
    for (int i = threadIdx.x; i < rows * D / 2; i += NT) {
      const int g = i / (D / 2), k = i % (D / 2);
      const int lo = (k / h) * 2 * h + (k % h);
      float* r = x + g * D;
      const float u = r[lo], v = r[lo + h];
      r[lo] = u + v;
      r[lo + h] = u - v;
    }
    __syncthreads();
  }
}

// Starts copying rows [row0, row0 + n) of one head's rows (`cb` bytes each, from `head`) into
// `dst` with one warp (mma.cuh warp_load_rows), copying the last 16-byte piece whole when it
// stays inside the head's `end` (the rows present), else its bytes one by one.
__device__ inline void fast_load_rows(uint8_t* dst, const uint8_t* head, int cb, long long row0,
                                      int n, const uint8_t* end, int lane) {
  const unsigned long long b0 = reinterpret_cast<unsigned long long>(head) + row0 * cb;
  const unsigned long long b1 = b0 + (unsigned long long)n * cb;
  const unsigned long long a0 = b0 & ~15ull;
  unsigned long long a1 = (b1 + 15) & ~15ull;
  if (a1 > reinterpret_cast<unsigned long long>(end)) a1 = b1 & ~15ull;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(a0);
  for (unsigned long long x = 16 * lane; a0 + x < a1; x += 16 * 32) cp_async16(dst + x, base + x);
  for (unsigned long long x = (a1 > a0 ? a1 : a0) + lane; x < b1; x += 32)
    dst[x - a0] = __ldg(reinterpret_cast<const uint8_t*>(x));
}

// The key parameters' scalar stage, and the sketch when there is one.
template <bool SKETCH, class KP>
__device__ inline const ScalarParams& fast_scalar(const KP& p) {
  if constexpr (SKETCH)
    return p.scalar;
  else
    return p;
}

// Query-side A fragments of k step j for this lane from a [8][D] float array (rows gb.. zero):
// head g's coordinates t4*D/4 + 4j .. +3 as f16, hi parts in rows 0-7, lo parts in rows 8-15.
__device__ inline uint4 fast_qfrag(const float* rows, int D, int g, int t4, int j) {
  const float4 x = *reinterpret_cast<const float4*>(rows + g * D + t4 * (D / 4) + 4 * j);
  unsigned short h[4], l[4];
  split_f16(x.x, h[0], l[0]);
  split_f16(x.y, h[1], l[1]);
  split_f16(x.z, h[2], l[2]);
  split_f16(x.w, h[3], l[3]);
  return make_uint4(pack_u16(h[0], h[1]), pack_u16(l[0], l[1]), pack_u16(h[2], h[3]),
                    pack_u16(l[2], l[3]));
}

// One block: kv head chunk blockIdx.y, query row z = blockIdx.z; x < n_splits a split of the
// code rows; X: the exact fp16 rows (block x == n_splits when f.exact). Writes the block's
// partial state (unnormalized output, rotated for codes; max; sum) to its slot of `a.part`; the
// last block of the (z, y) pair merges all slots into f.out.
template <int D, int KB, int VB, bool SKETCH, int NW, bool X, class KP>
__device__ void fast_attend(const AttendArgs& a, const KP& kpar, const ScalarParams& vp,
                            const FastArgs& f, uint8_t* smem) {
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
  static_assert(KB >= 1 && KB <= 4 && VB >= 1 && VB <= 4, "code widths");
  constexpr int NT = NW * 32;
  constexpr int ST = KVQ_FAST_STAGES;
  constexpr int KSPAN = D / 4, KSB = KSPAN * KB / 8, KSW = (KSB + 3) / 4;
  constexpr int VSPAN = D / 8, VSB = VSPAN * VB / 8, VSW = (VSB + 3) / 4;
  constexpr int KSTEPS = D / 16, MT = D / 16;
  constexpr int SGB = D / 32, SGW = (SGB + 3) / 4, RNORM = 2 + D * KB / 8;
  constexpr bool QREG = D <= 128;
  constexpr int WS = D + D / 16 + 1;
  const ScalarParams& kp = fast_scalar<SKETCH>(kpar);
  const FastLayout L = fast_layout(D, KB, VB, SKETCH, NW, a.kcb, a.vcb);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int kh = blockIdx.y / a.hchunks, hc = blockIdx.y % a.hchunks;
  const int z = blockIdx.z, b = z / a.T, t = z % a.T;
  const int h0 = kh * a.group + hc * a.gb;
  const int gb = min(a.gb, a.group - hc * a.gb);
  const int nslots = gridDim.x;
  constexpr bool exact = X;
  const int ncode = nslots - f.exact;
  float* qs = reinterpret_cast<float*>(smem + L.qs);
  float* wm = reinterpret_cast<float*>(smem + L.wm);
  float* wl = reinterpret_cast<float*>(smem + L.wl);
  uint8_t* stages = smem + L.stages;

  // This block's rows: a split of the query row's code range, or the exact rows.
  long long s0 = 0, s1 = 0;
  if constexpr (exact) {
    s1 = f.xn[0] + f.xn[1];
  } else {
    long long r0, r1;
    code_rows(a, a.first_pos + t, r0, r1);
    r1 = min(r1, a.n_rows);
    s0 = r0 + (long long)blockIdx.x * a.split_rows;
    s1 = min(r1, s0 + a.split_rows);
    s1 = max(s1, s0);
  }
  const int kbuf = fast_stage_bytes(a.kcb), vbuf = fast_stage_bytes(a.vcb);
  const int mine = L.stages + warp * ST * (kbuf + vbuf);
  auto kstage = [&](int s) { return mine + s * kbuf; };
  auto vstage = [&](int s) { return mine + ST * kbuf + s * vbuf; };
  const uint8_t* kbase = a.kc + b * a.k_bstride + kh * a.k_hstride;
  const uint8_t* vbase = a.vc + b * a.v_bstride + kh * a.v_hstride;
  const uint8_t* kend = kbase + a.n_rows * a.kcb;
  const uint8_t* vend = vbase + a.n_rows * a.vcb;
  const int nchunks = (int)((s1 - s0 + 15) / 16);
  const int count = nchunks > warp ? (nchunks - warp + NW - 1) / NW : 0;
  auto chunk_base = [&](int i) { return s0 + (long long)(warp + i * NW) * 16; };
  auto issue = [&](int i) {
    if (!exact && i < count) {
      const long long base = chunk_base(i);
      const int n = (int)min(16ll, s1 - base);
      fast_load_rows(smem + kstage(i % ST), kbase, a.kcb, base, n, kend, lane);
      fast_load_rows(smem + vstage(i % ST), vbase, a.vcb, base, n, vend, lane);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < ST - 1; i++) issue(i);

  // Queries (rows gb..7 zero); tables; sketch projections.
  const float* qrows = a.q + b * a.q_bstride + h0 * a.q_hstride + t * a.q_tstride;
  for (int i = tid; i < 8 * D; i += NT) {
    const int h = i / D;
    qs[i] = h < gb ? qrows[h * a.q_hstride + i % D] : 0.f;
  }
  if constexpr (!exact) {
    // Pair tables: row i (256 bytes) holds 32 copies of the key entry, then 32 of the value
    // entry: (level[i & mask], level[i >> B]) * lev as f16.
    constexpr int KR = 1 << (2 * KB), VR = 1 << (2 * VB);
    constexpr int R = KR > VR ? KR : VR;
    unsigned* tab = reinterpret_cast<unsigned*>(smem + L.table);
    for (int i = tid; i < R * 64; i += NT) {
      const int row = i >> 6, slot = i & 63;
      unsigned e = 0;
      if (slot < 32 && row < KR) {
        const float lo = kp.levels[row & ((1 << KB) - 1)], hi = kp.levels[row >> KB];
        e = pack_f2(lo * kp.lev, hi * kp.lev);
      } else if (slot >= 32 && row < VR) {
        const float lo = vp.levels[row & ((1 << VB) - 1)], hi = vp.levels[row >> VB];
        e = pack_f2(lo * vp.lev, hi * vp.lev);
      }
      tab[i] = e;
    }
    if constexpr (SKETCH) {
      // Sign nibbles: bits 0, 1 -> the first pair, bits 2, 3 -> the second (+1 set, -1 clear).
      uint2* sg = reinterpret_cast<uint2*>(smem + L.signs);
      for (int i = tid; i < 16 * 32; i += NT) {
        const unsigned n = i >> 5;
        sg[i] = make_uint2(signs_f16x2(n, 0), signs_f16x2(n, 2));
      }
    }
  }
  __syncthreads();
  if constexpr (!exact) {
    // Rotate the queries: x <- H diag(signs) x / sqrt(D).
    const float* sgn = kp.signs + (long long)kh * D;
    for (int i = tid; i < 8 * D; i += NT) qs[i] *= __ldg(sgn + i % D);
    __syncthreads();
    fast_butterflies<NT>(qs, 8, D);
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

  const float ksc = exact ? a.scale : kp.sigma * a.scale / kp.lev;
  const unsigned lk = lane * 4, lv = lane * 4 + 128, ls = lane * 8;
  float m = -INFINITY, l = 0.f;
  float acc[MT][4];
#pragma unroll
  for (int i = 0; i < MT; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) acc[i][e] = 0.f;

  // Exact rows: row r of the two segments, clamped to the last one.
  const long long nx = s1;
  // (Selects, not an index: a run-time index into the parameter arrays would copy them to
  // local memory.)
  auto xrow = [&](bool keys, long long r) -> const uint8_t* {
    r = min(r, nx - 1);
    const bool first = r < f.xn[0];
    const __half* seg = keys ? (first ? f.xk[0] : f.xk[1]) : (first ? f.xv[0] : f.xv[1]);
    const long long off = first ? b * f.xb[0] + kh * f.xh[0] + r * D
                                : b * f.xb[1] + kh * f.xh[1] + (r - f.xn[0]) * D;
    return reinterpret_cast<const uint8_t*>(seg + off);
  };

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
      float cs[4] = {0.f, 0.f, 0.f, 0.f};
      const int tk = nt * 8 + g;
      if constexpr (exact) {
        unsigned w[D / 8];
        ldg_words<D / 8>(xrow(true, base + tk) + t4 * KSPAN * 2, w);
#pragma unroll
        for (int j = 0; j < KSTEPS; j++) {
          const uint4 q = qfrag(j);
          mma_16816(j & 1 ? c1 : c0, q.x, q.y, q.z, q.w, w[2 * j], w[2 * j + 1]);
        }
      } else {
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
        if constexpr (!exact) {
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
    // Rescale only when some head's maximum moved (rare after the first chunks).
    if (!__all_sync(0xffffffffu, alpha == 1.f)) {
      const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * t4);
      const float al1 = __shfl_sync(0xffffffffu, alpha, 8 * t4 + 4);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        acc[mt][0] *= al0;
        acc[mt][1] *= al1;
        acc[mt][2] *= al0;
        acc[mt][3] *= al1;
      }
    }
    // Probabilities (times the value norms) as the B fragment of P V: tokens 2t4, 2t4+1 (b0)
    // and 2t4+8, 2t4+9 (b1) of head g.
    float pv[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int tok = nt * 8 + 2 * t4 + e;
        float vn = 1.f;
        if constexpr (!exact) vn = __half2float(*reinterpret_cast<const __half*>(smem + vt + tok * a.vcb));
        pv[nt][e] = tok < n ? p[nt][e] * vn : 0.f;
      }
    const unsigned pb0 = pack_f2(pv[0][0], pv[0][1]), pb1 = pack_f2(pv[1][0], pv[1][1]);
    if constexpr (exact) {
      // Tokens u = 0..3: 2t4, 2t4+1, 2t4+8, 2t4+9; coordinates g*D/8 .. +D/8 of each.
      unsigned vw[4][D / 16];
#pragma unroll
      for (int u = 0; u < 4; u++)
        ldg_words<D / 16>(xrow(false, base + (u >> 1) * 8 + 2 * t4 + (u & 1)) + g * VSPAN * 2, vw[u]);
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
        mma_16816(acc[mt], __byte_perm(vw[0][mt], vw[1][mt], 0x5410),
                  __byte_perm(vw[0][mt], vw[1][mt], 0x7632), __byte_perm(vw[2][mt], vw[3][mt], 0x5410),
                  __byte_perm(vw[2][mt], vw[3][mt], 0x7632), pb0, pb1);
    } else {
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
  cp_async_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // every warp is done with its stages: the space holds the merge

  // Merge the warps' states per head into the block's slot.
  float* wacc = reinterpret_cast<float*>(stages);  // [NW][8][WS]
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
  const long long rowbase = ((long long)b * a.nh + h0) * a.T + t;  // row of head h0
  auto slot_row = [&](int h, int s) {
    return a.part + ((rowbase + (long long)h * a.T) * nslots + s) * (D + 2);
  };
  for (int i = tid; i < gb * (D + 2); i += NT) {
    const int h = i / (D + 2), c = i % (D + 2);
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; w++) mm = fmaxf(mm, wm[w * 8 + h]);
    float v = 0.f;
#pragma unroll 4
    for (int w = 0; w < NW; w++) {
      const float mw = wm[w * 8 + h];
      if (mw == -INFINITY) continue;
      const float e = __expf(mw - mm);
      if (c < D)
        v = fmaf(e, wacc[(w * 8 + h) * WS + c + c / 16], v);
      else if (c == D + 1)
        v = fmaf(e, wl[w * 8 + h], v);
    }
    slot_row(h, blockIdx.x)[c] = c == D ? mm : v;
  }

  // The last block of this (row, kv head chunk) to finish merges every slot.
  __threadfence();
  __syncthreads();
  int* flag = reinterpret_cast<int*>(smem + L.flag);
  unsigned* counter = f.counters + (long long)z * gridDim.y + blockIdx.y;
  if (tid == 0) {
    const unsigned done = atomicAdd(counter, 1u);
    flag[0] = done == (unsigned)nslots - 1;
    if (done == (unsigned)nslots - 1) *counter = 0;  // ready for the next launch
  }
  __syncthreads();
  if (!flag[0]) return;
  __threadfence();
  float* wts = reinterpret_cast<float*>(stages);              // [8][slots + 1]: weights, then
  float* oc = wts + 8 * (KVQ_FAST_MAX_SLOTS + 1);             // [8][D] code part (rotated)
  float* hm = reinterpret_cast<float*>(smem + L.wm);          // [8] merged max
  float* hl = reinterpret_cast<float*>(smem + L.wl);          // [8] merged sum
  const int WST = KVQ_FAST_MAX_SLOTS + 1;
  // One warp per head: the shift scale * q . mu, the merged max and sum, each slot's weight.
  for (int h = warp; h < gb; h += NW) {
    float sh = 0.f;
    if (f.shift != nullptr) {
      sh = f.shift[rowbase + (long long)h * a.T];
    } else if (f.mu != nullptr) {
      const float* qh = qrows + h * a.q_hstride;
      const float* mu = f.mu + (long long)kh * D;
      for (int c = lane; c < D; c += 32) sh = fmaf(__ldg(qh + c), __ldg(mu + c), sh);
      sh = warp_sum(sh) * a.scale;
    }
    const float* r = slot_row(h, 0);
    float mm = -INFINITY;
    for (int s = lane; s < nslots; s += 32) {
      const float ms = __ldcg(r + (long long)s * (D + 2) + D) + (s < ncode ? sh : 0.f);
      wts[h * WST + s] = ms;
      mm = fmaxf(mm, ms);
    }
    mm = warp_max(mm);
    float ll = 0.f;
    for (int s = lane; s < nslots; s += 32) {
      const float ms = wts[h * WST + s];
      const float w = ms == -INFINITY ? 0.f : __expf(ms - mm);
      wts[h * WST + s] = w;
      ll = fmaf(w, __ldcg(r + (long long)s * (D + 2) + D + 1), ll);
    }
    ll = warp_sum(ll);
    if (lane == 0) {
      hm[h] = mm;
      hl[h] = ll;
    }
  }
  __syncthreads();
  for (int i = tid; i < 8 * D; i += NT) {
    const int h = i / D, c = i % D;
    float v = 0.f;
    if (h < gb) {
      const float* r = slot_row(h, 0) + c;
#pragma unroll 4
      for (int s = 0; s < ncode; s++) {
        const float w = wts[h * WST + s];
        if (w != 0.f) v = fmaf(w, __ldcg(r + (long long)s * (D + 2)), v);
      }
    }
    oc[i] = v * (vp.sigma / vp.lev);
  }
  __syncthreads();
  fast_butterflies<NT>(oc, gb, D);
  const float isq = rsqrtf((float)D);
  for (int i = tid; i < gb * D; i += NT) {
    const int h = i / D, c = i % D;
    float v = oc[i] * __ldg(vp.signs + (long long)kh * D + c) * isq;
    if (f.exact) {
      const float w = wts[h * WST + ncode];
      if (w != 0.f) v = fmaf(w, __ldcg(slot_row(h, ncode) + c), v);
    }
    const float ll = hl[h];
    if (f.normalize) v = ll > 0.f ? v / ll : 0.f;
    f.out[(rowbase + (long long)h * a.T) * f.ostride + c] = v;
  }
  if (f.ostride >= D + 2)
    for (int h = tid; h < gb; h += NT) {
      f.out[(rowbase + (long long)h * a.T) * f.ostride + D] = hm[h];
      f.out[(rowbase + (long long)h * a.T) * f.ostride + D + 1] = hl[h];
    }
}

// The kernel: the last x block of each (row, kv head) runs the exact rows when there are any.
template <int D, int KB, int VB, bool SKETCH, int NW, class KP>
__device__ inline void fast_entry(const AttendArgs& a, const KP& kp, const ScalarParams& vp,
                                  const FastArgs& f, uint8_t* smem) {
  if (f.exact && blockIdx.x == gridDim.x - 1)
    fast_attend<D, KB, VB, SKETCH, NW, true>(a, kp, vp, f, smem);
  else
    fast_attend<D, KB, VB, SKETCH, NW, false>(a, kp, vp, f, smem);
}

}  // namespace kvq

// Warps per block: 16 up to d = 128, 8 at 256 (its accumulators take twice the registers).
// The launcher (kvq-kernels cuda/fast.rs) reads the same values from KVQ_FAST_NW_SMALL /
// KVQ_FAST_NW_LARGE and KVQ_FAST_STAGES when PTX variants are loaded (KVQ_CUDA_PTX_DIR).
#ifndef KVQ_FAST_NW_SMALL
#define KVQ_FAST_NW_SMALL 16
#endif
#ifndef KVQ_FAST_NW_LARGE
#define KVQ_FAST_NW_LARGE 8
#endif
#define KVQ_FAST_NW(D) ((D) > 128 ? KVQ_FAST_NW_LARGE : KVQ_FAST_NW_SMALL)
