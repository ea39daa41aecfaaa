// The frame of the version-5 fused decode attention kernels (turboquant_mse/fast.cuh and the
// families built on it): their extra arguments, shared-memory layout, lookup-table addressing,
// the per-warp chunk copies, the query fragments, and the end of every block: the warps' states
// merged into the block's slot of the partial rows, and in the last block of each (query row,
// kv head) to finish, every slot merged (with the key center's logit shift, the inverse
// rotation of coded values, the exact rows' slot) into the output.
#pragma once
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

// Shared-memory layout of a fast kernel (kvq-kernels fast_geometry.rs `smem` mirrors it):
// `table_rows` rows of the per-lane pair tables (256 bytes each), the sign-nibble table and
// `sketch_steps` k steps of sketch-projection fragments when there is a sketch, the queries as
// floats, the query fragments when they do not fit registers (`qfrag`), `proj_floats` floats of
// projection scratch, the warps' softmax states, then the stages (later the merges).
struct FastLayout {
  int table, signs, qs, qfrag, sfrag, proj, wm, wl, flag, stages, total;
};

__host__ __device__ inline FastLayout fast_layout(int D, int table_rows, int sketch_steps,
                                                  int proj_floats, bool qfrag, int NW, int kcb,
                                                  int vcb) {
  FastLayout l;
  int at = 0;
  l.table = at;
  at += table_rows * 256;
  l.signs = at;
  at += sketch_steps > 0 ? 16 * 256 : 0;
  l.qs = at;
  at += 8 * D * 4;
  l.qfrag = at;
  at += qfrag ? (D / 16) * 32 * 16 : 0;
  l.sfrag = at;
  at += sketch_steps * 32 * 16;
  l.proj = at;
  at += proj_floats * 4;
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

// Stops the kernel (a launch error, never a silent overrun) when the launcher gave less dynamic
// shared memory than the layout takes: the Rust mirror of `fast_layout` and this one disagree.
__device__ inline void fast_check_smem(const FastLayout& L) {
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  if ((unsigned)L.total > dyn) __trap();
}

__device__ inline unsigned lds32(const uint8_t* smem, unsigned off) {
  return *reinterpret_cast<const unsigned*>(smem + off);
}

__device__ inline uint2 lds64(const uint8_t* smem, unsigned off) {
  return *reinterpret_cast<const uint2*>(smem + off);
}

// Fills `rows` rows of the per-lane pair tables (256 bytes each: 32 copies of the key entry, then
// 32 of the value entry) with 16-byte stores, consecutive threads writing consecutive pieces (no
// bank conflicts): `key(row)` and `value(row)` give a row's two entries (f16 pairs as words).
// Each thread computes the entries of the 8-piece halves it writes, a few per thread in all.
template <int NT, class K, class V>
__device__ inline void fast_pair_tables(uint8_t* smem, int rows, K key, V value) {
  uint4* tab = reinterpret_cast<uint4*>(smem);
  for (int i = threadIdx.x; i < rows * 16; i += NT) {
    const int row = i >> 4;
    const unsigned e = (i & 8) ? value(row) : key(row);
    tab[i] = make_uint4(e, e, e, e);
  }
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

// Query-side A fragments of k step j for this lane from a [8][stride] float array (rows gb..
// zero): head g's coordinates t4*span + 4j .. +3 as f16, hi parts in rows 0-7, lo parts in rows
// 8-15 (the k slots 2t4, 2t4+1, 2t4+8, 2t4+9 of the m16n8k16 A tile).
__device__ inline uint4 fast_qfrag_span(const float* rows, int stride, int span, int g, int t4,
                                        int j) {
  const float4 x = *reinterpret_cast<const float4*>(rows + g * stride + t4 * span + 4 * j);
  unsigned short h[4], l[4];
  split_f16(x.x, h[0], l[0]);
  split_f16(x.y, h[1], l[1]);
  split_f16(x.z, h[2], l[2]);
  split_f16(x.w, h[3], l[3]);
  return make_uint4(pack_u16(h[0], h[1]), pack_u16(l[0], l[1]), pack_u16(h[2], h[3]),
                    pack_u16(l[2], l[3]));
}

// The same over [8][D] rows with the lane's span D/4 (the queries).
__device__ inline uint4 fast_qfrag(const float* rows, int D, int g, int t4, int j) {
  return fast_qfrag_span(rows, D, D / 4, g, t4, j);
}

// Where a block sits: kv head kh (chunk hc of its query heads, gb heads from h0), query row
// z = b * T + t, and those heads' query rows.
struct FastBlock {
  int kh, hc, b, t, h0, gb;
  const float* qrows;
};

__device__ inline FastBlock fast_block(const AttendArgs& a) {
  FastBlock k;
  k.kh = blockIdx.y / a.hchunks;
  k.hc = blockIdx.y % a.hchunks;
  k.b = blockIdx.z / a.T;
  k.t = blockIdx.z % a.T;
  k.h0 = k.kh * a.group + k.hc * a.gb;
  k.gb = min(a.gb, a.group - k.hc * a.gb);
  k.qrows = a.q + k.b * a.q_bstride + k.h0 * a.q_hstride + k.t * a.q_tstride;
  return k;
}

// The block's queries into `qs` ([8][D] floats, rows gb.. zero), by NT threads.
template <int D, int NT>
__device__ inline void fast_load_queries(const AttendArgs& a, const FastBlock& k, float* qs) {
  for (int i = threadIdx.x; i < 8 * D; i += NT) {
    const int h = i / D;
    qs[i] = h < k.gb ? k.qrows[h * a.q_hstride + i % D] : 0.f;
  }
}

// The code rows of one block: a split of its query row's code range, copied per warp in chunks
// of 16 rows, KVQ_FAST_STAGES deep with cp.async, keys and values alike (every family's loop).
template <int NW>
struct FastChunks {
  long long s0, s1;
  int count, mine, kbuf, vbuf, kcb, vcb, warp, lane;
  const uint8_t *kbase, *vbase, *kend, *vend;

  __device__ FastChunks(const AttendArgs& a, const FastLayout& L, const FastBlock& k) {
    long long r0, r1;
    code_rows(a, a.first_pos + k.t, r0, r1);
    r1 = min(r1, a.n_rows);
    s0 = r0 + (long long)blockIdx.x * a.split_rows;
    s1 = max(min(r1, s0 + a.split_rows), s0);
    warp = threadIdx.x >> 5;
    lane = threadIdx.x & 31;
    kcb = a.kcb;
    vcb = a.vcb;
    kbuf = fast_stage_bytes(kcb);
    vbuf = fast_stage_bytes(vcb);
    mine = L.stages + warp * KVQ_FAST_STAGES * (kbuf + vbuf);
    kbase = a.kc + k.b * a.k_bstride + k.kh * a.k_hstride;
    vbase = a.vc + k.b * a.v_bstride + k.kh * a.v_hstride;
    kend = kbase + a.n_rows * kcb;
    vend = vbase + a.n_rows * vcb;
    const int nchunks = (int)((s1 - s0 + 15) / 16);
    count = nchunks > warp ? (nchunks - warp + NW - 1) / NW : 0;
  }
  // Chunk i's first row and the rows it holds.
  __device__ long long base(int i) const { return s0 + (long long)(warp + i * NW) * 16; }
  __device__ int rows(int i) const { return (int)min(16ll, s1 - base(i)); }
  // Starts copying chunk i (none past the last; the commit keeps the groups even).
  __device__ void issue(uint8_t* smem, int i) const {
    if (i < count) {
      const int s = i % KVQ_FAST_STAGES;
      fast_load_rows(smem + mine + s * kbuf, kbase, kcb, base(i), rows(i), kend, lane);
      fast_load_rows(smem + mine + KVQ_FAST_STAGES * kbuf + s * vbuf, vbase, vcb, base(i), rows(i),
                     vend, lane);
    }
    cp_async_commit();
  }
  // The first KVQ_FAST_STAGES - 1 chunks.
  __device__ void start(uint8_t* smem) const {
#pragma unroll
    for (int i = 0; i < KVQ_FAST_STAGES - 1; i++) issue(smem, i);
  }
  // Starts chunk i + KVQ_FAST_STAGES - 1, waits for chunk i: where its key and value rows sit.
  __device__ void next(uint8_t* smem, int i, int& kt, int& vt) const {
    issue(smem, i + KVQ_FAST_STAGES - 1);
    cp_async_wait<KVQ_FAST_STAGES - 1>();
    __syncwarp();
    const int s = i % KVQ_FAST_STAGES;
    kt = mine + s * kbuf + rows_offset(kbase, kcb, base(i));
    vt = mine + KVQ_FAST_STAGES * kbuf + s * vbuf + rows_offset(vbase, vcb, base(i));
  }
};

// This lane's query A fragments of every k step, from the [8][D] queries `qs`: in registers up to
// D = 128, else in shared memory (built there by all threads: a barrier).
template <int D, int NT>
struct FastQueryFrags {
  static constexpr bool REG = D <= 128;
  uint4 qa[REG ? D / 16 : 1];
  const uint4* sm;
  int lane;

  __device__ FastQueryFrags(const float* qs, uint8_t* smem, const FastLayout& L) {
    lane = threadIdx.x & 31;
    sm = reinterpret_cast<const uint4*>(smem + L.qfrag);
    if constexpr (REG) {
#pragma unroll
      for (int j = 0; j < D / 16; j++) qa[j] = fast_qfrag(qs, D, lane >> 2, lane & 3, j);
    } else {
      uint4* qf = reinterpret_cast<uint4*>(smem + L.qfrag);
      for (int i = threadIdx.x; i < D / 16 * 32; i += NT)
        qf[i] = fast_qfrag(qs, D, (i % 32) >> 2, i % 4, i / 32);
      __syncthreads();
    }
  }
  __device__ uint4 operator()(int j) const {
    if constexpr (REG)
      return qa[j];
    else
      return sm[j * 32 + lane];
  }
};

// O += P V over this lane's four tokens (2t4, 2t4+1, 2t4+8, 2t4+9), whose words `vw[u][mt]` hold
// the f16 pairs of coordinates 2mt, 2mt + 1 of the lane's span: a byte permute per token pair
// forms each A fragment; `pb0`, `pb1` the probabilities as the B fragment.
template <int MT>
__device__ inline void fast_pv(float (&acc)[MT][4], const unsigned (&vw)[4][MT], unsigned pb0,
                               unsigned pb1) {
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
    mma_16816(acc[mt], __byte_perm(vw[0][mt], vw[1][mt], 0x5410),
              __byte_perm(vw[0][mt], vw[1][mt], 0x7632), __byte_perm(vw[2][mt], vw[3][mt], 0x5410),
              __byte_perm(vw[2][mt], vw[3][mt], 0x7632), pb0, pb1);
}

// Zeroed accumulators.
template <int MT>
__device__ inline void fast_zero(float (&acc)[MT][4]) {
#pragma unroll
  for (int i = 0; i < MT; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) acc[i][e] = 0.f;
}

// One chunk's online-softmax step for head g of this lane: scores `s` of tokens nt*8 + 2t4 + e
// (-inf where masked) update the running max `m` and sum `l` (over this lane's tokens), rescale
// the accumulators when some head's maximum moved (rare after the first chunks), and give the
// probabilities `p`.
template <int MT>
__device__ inline void fast_softmax(const float (&s)[2][2], float& m, float& l,
                                    float (&acc)[MT][4], float (&p)[2][2], int t4) {
  float mx = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mnew = fmaxf(m, mx);
  float alpha = 1.f;
  p[0][0] = p[0][1] = p[1][0] = p[1][1] = 0.f;
  if (mnew != -INFINITY) {
    alpha = __expf(m - mnew);
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) p[nt][e] = __expf(s[nt][e] - mnew);
  }
  m = mnew;
  l = l * alpha + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
  if (!__all_sync(0xffffffffu, alpha == 1.f)) {
    // This lane's accumulators are heads 2t4 and 2t4 + 1: their factors.
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
}

// The end of a block: this warp's online-softmax state (`acc` in the m16n8k16 C layout of
// fast.cuh, `m` and `l` per head g over this lane's tokens) merged over the block's warps into
// its slot; then the last block of the pair merges every slot into f.out. `vsigns` (the values'
// rotation signs of kv head kh, or null when values are not rotated) and `vscale` (a factor on
// the coded slots' output) finish the coded part: every block of a launch passes the same, since
// any of them may be the last.
template <int D, int NW>
__device__ void fast_finish(const AttendArgs& a, const FastArgs& f, const FastLayout& L,
                            uint8_t* smem, float (&acc)[D / 16][4], float m, float l,
                            const FastBlock& k, const float* vsigns, float vscale) {
  const int kh = k.kh, h0 = k.h0, gb = k.gb, b = k.b, t = k.t;
  const float* qrows = k.qrows;
  constexpr int NT = NW * 32, MT = D / 16, VSPAN = D / 8;
  constexpr int WS = D + D / 16 + 1;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int nslots = gridDim.x;
  const int ncode = nslots - f.exact;
  float* wm = reinterpret_cast<float*>(smem + L.wm);
  float* wl = reinterpret_cast<float*>(smem + L.wl);
  uint8_t* stages = smem + L.stages;
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
  unsigned* counter = f.counters + (long long)blockIdx.z * gridDim.y + blockIdx.y;
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
    oc[i] = v * vscale;
  }
  __syncthreads();
  if (vsigns != nullptr) fast_butterflies<NT>(oc, gb, D);
  const float isq = rsqrtf((float)D);
  for (int i = tid; i < gb * D; i += NT) {
    const int h = i / D, c = i % D;
    float v = vsigns != nullptr ? oc[i] * __ldg(vsigns + c) * isq : oc[i];
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

// The exact fp16 rows' block (the last x block of each pair when f.exact): the sinks and the
// window, read in place (two segments), scored against the unrotated queries, then fast_finish
// with the family's `vsigns` and `vscale`.
template <int D, int NW>
__device__ void fast_exact(const AttendArgs& a, const FastArgs& f, const FastLayout& L,
                           uint8_t* smem, const float* vsigns, float vscale) {
  constexpr int NT = NW * 32, KSPAN = D / 4, VSPAN = D / 8, KSTEPS = D / 16, MT = D / 16;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const FastBlock k = fast_block(a);
  float* qs = reinterpret_cast<float*>(smem + L.qs);
  fast_load_queries<D, NT>(a, k, qs);
  __syncthreads();
  const FastQueryFrags<D, NT> qfrag(qs, smem, L);
  const long long nx = f.xn[0] + f.xn[1];
  // Row r of the two segments, clamped to the last one. (Selects, not an index: a run-time
  // index into the parameter arrays would copy them to local memory.)
  auto xrow = [&](bool keys, long long r) -> const uint8_t* {
    r = min(r, nx - 1);
    const bool first = r < f.xn[0];
    const __half* seg = keys ? (first ? f.xk[0] : f.xk[1]) : (first ? f.xv[0] : f.xv[1]);
    const long long off = first ? k.b * f.xb[0] + k.kh * f.xh[0] + r * D
                                : k.b * f.xb[1] + k.kh * f.xh[1] + (r - f.xn[0]) * D;
    return reinterpret_cast<const uint8_t*>(seg + off);
  };
  const int nchunks = (int)((nx + 15) / 16);
  const int count = nchunks > warp ? (nchunks - warp + NW - 1) / NW : 0;
  float m = -INFINITY, l = 0.f;
  float acc[MT][4];
  fast_zero<MT>(acc);
  for (int i = 0; i < count; i++) {
    const long long base = (long long)(warp + i * NW) * 16;
    const int n = (int)min(16ll, nx - base);
    float s[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
      float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
      unsigned w[D / 8];  // halves t4*D/4 .. +D/4 of token nt*8 + g's key
      ldg_words<D / 8>(xrow(true, base + nt * 8 + g) + t4 * KSPAN * 2, w);
#pragma unroll
      for (int j = 0; j < KSTEPS; j++) {
        const uint4 q = qfrag(j);
        mma_16816(j & 1 ? c1 : c0, q.x, q.y, q.z, q.w, w[2 * j], w[2 * j + 1]);
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
    const unsigned pb0 = pack_f2(2 * t4 < n ? p[0][0] : 0.f, 2 * t4 + 1 < n ? p[0][1] : 0.f);
    const unsigned pb1 = pack_f2(2 * t4 + 8 < n ? p[1][0] : 0.f, 2 * t4 + 9 < n ? p[1][1] : 0.f);
    // Tokens u = 0..3: 2t4, 2t4+1, 2t4+8, 2t4+9; coordinates g*D/8 .. +D/8 of each.
    unsigned vw[4][D / 16];
#pragma unroll
    for (int u = 0; u < 4; u++)
      ldg_words<D / 16>(xrow(false, base + (u >> 1) * 8 + 2 * t4 + (u & 1)) + g * VSPAN * 2, vw[u]);
    fast_pv<MT>(acc, vw, pb0, pb1);
  }
  fast_finish<D, NW>(a, f, L, smem, acc, m, l, k, vsigns, vscale);
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
