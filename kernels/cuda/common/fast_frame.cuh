// The frame of the version-6 fused decode attention kernels (fast.cuh gathers it): their extra
// arguments and phase marks, shared-memory layout, lookup-table addressing, the queries' rotation
// and fragments, and the per-chunk online softmax and P V step.
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
  unsigned long long* trace;  // [blocks][32] phase marks (fast_mark), or null: KVQ_FAST_TRACE
};

// A phase mark for the launcher's KVQ_FAST_TRACE (kvq-kernels cuda/trace.rs): thread 0 of the
// block records the global timer (ns) in slot `ph` and its multiprocessor's clock in slot
// 16 + ph of the block's 32; phase 0 also records the multiprocessor's id in slot 15. Phases:
// 0 start, 1 before the chunk loop, 2 after it, 3 slot written and arrival counted, 4 the last
// block's merge done; 5-14 finer marks inside those (fast_trace.py names them). A branch on a
// null pointer when not tracing.
#define KVQ_TRACE_SLOTS 32
__device__ inline void fast_mark(const FastArgs& f, int ph) {
  if (f.trace == nullptr || threadIdx.x != 0) return;
  unsigned long long t;
  unsigned sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  const long long c = clock64();
  asm("mov.u32 %0, %%smid;" : "=r"(sm));
  const long long blk =
      blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
  unsigned long long* r = f.trace + blk * KVQ_TRACE_SLOTS;
  r[ph] = t;
  r[16 + ph] = (unsigned long long)c;
  if (ph == 0) r[15] = sm;
}

// Bytes of one warp stage buffer of 16 rows of `cb` bytes: a copy takes at most 16 * cb + 16 of
// them (its start rounded down to 16 bytes, its end up), the word loads of a row's fields reach
// a few bytes past the last row, and the last 16 hold the stage's transaction barrier
// (fast_chunks.cuh), which no load or copy touches.
__host__ __device__ inline int fast_stage_bytes(int cb) { return (16 * cb + 48 + 15) & ~15; }

// Shared-memory layout of a fast kernel (kvq-kernels fast_geometry.rs `smem` mirrors it):
// `table_rows` rows of the per-lane pair tables (256 bytes each), the sign-nibble table and
// `sketch_steps` k steps of sketch-projection fragments when there is a sketch, the queries as
// floats, the query fragments, `proj_floats` floats of projection scratch, the warps' softmax
// states, then the stages (later the merges).
struct FastLayout {
  int table, signs, qs, qfrag, sfrag, proj, wm, wl, flag, stages, total;
};

__host__ __device__ inline FastLayout fast_layout(int D, int table_rows, int sketch_steps,
                                                  int proj_floats, int NW, int kcb,
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
  at += (D / 16) * 32 * 16;
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

// Walsh-Hadamard butterflies (attend.cuh `butterflies`: range-based pairs, stage h adding and
// subtracting coordinates h apart) over `rows` rows of D floats in shared memory, one warp per
// row, D / 32 values per lane in registers: the stages below D / 32 inside a lane, the others by
// shuffles, one barrier at the end (not one per stage).
template <int D, int NW>
__device__ inline void fast_butterflies_warp(float* x, int rows) {
  constexpr int PER = D / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < rows; r += NW) {
    float* row = x + r * D + lane * PER;
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) v[j] = row[j];
#pragma unroll
    for (int h = 1; h < PER; h <<= 1)
#pragma unroll
      for (int j = 0; j < PER; j++)
        if ((j & h) == 0) {
          const float u = v[j], w = v[j + h];
          v[j] = u + w;
          v[j + h] = u - w;
        }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1)
#pragma unroll
      for (int j = 0; j < PER; j++) {
        const float o = __shfl_xor_sync(0xffffffffu, v[j], m);
        v[j] = (lane & m) ? o - v[j] : v[j] + o;
      }
#pragma unroll
    for (int j = 0; j < PER; j++) row[j] = v[j];
  }
  __syncthreads();
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

// This lane's query A fragments of every k step, from the [8][D] queries `qs`: built once per
// block in shared memory by all threads (a barrier), then up to D = 128 copied to registers. A
// lane's fragments read from `qs` directly would hit one bank group 8 times over (its rows and
// quarters are multiples of 32 words apart), for every warp: 16 x 8 such loads per block, where
// building them once takes 8.
template <int D, int NT>
struct FastQueryFrags {
  static constexpr bool REG = D <= 128;
  uint4 qa[REG ? D / 16 : 1];
  const uint4* sm;
  int lane;

  __device__ FastQueryFrags(const float* qs, uint8_t* smem, const FastLayout& L) {
    lane = threadIdx.x & 31;
    sm = reinterpret_cast<const uint4*>(smem + L.qfrag);
    uint4* qf = reinterpret_cast<uint4*>(smem + L.qfrag);
    for (int i = threadIdx.x; i < D / 16 * 32; i += NT)
      qf[i] = fast_qfrag(qs, D, (i % 32) >> 2, i % 4, i / 32);
    __syncthreads();
    if constexpr (REG) {
#pragma unroll
      for (int j = 0; j < D / 16; j++) qa[j] = sm[j * 32 + lane];
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

}  // namespace kvq
