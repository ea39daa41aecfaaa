// The end of every version-6 block (fast.cuh): the warps' states merged into the block's slot
// of the partial rows, and in the last block of each (query row, kv head) to finish, every slot
// merged (with the key center's logit shift, the inverse rotation of coded values, the exact
// rows' slot) into the output; and the exact fp16 rows' block.
#pragma once
#include "fast_frame.cuh"

namespace kvq {

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
  // Each head's maximum over the warps and each warp's factor exp(m_w - max) once (one thread
  // per head), then every output coordinate is a sum of products: the same factors and the
  // same order as computing them per coordinate. Factors replace the maxima in wm; the head's
  // maximum and merged sum go to wl's first two rows (only this thread reads column h).
  if (tid < gb) {
    const int h = tid;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; w++) mm = fmaxf(mm, wm[w * 8 + h]);
    float ls = 0.f;
#pragma unroll
    for (int w = 0; w < NW; w++) {
      const float mw = wm[w * 8 + h];
      const float e = mw == -INFINITY ? 0.f : __expf(mw - mm);
      wm[w * 8 + h] = e;
      if (e != 0.f) ls = fmaf(e, wl[w * 8 + h], ls);
    }
    wl[h] = mm;
    wl[8 + h] = ls;
  }
  __syncthreads();
  for (int i = tid; i < gb * (D + 2); i += NT) {
    const int h = i / (D + 2), c = i % (D + 2);
    float v;
    if (c < D) {
      v = 0.f;
#pragma unroll
      for (int w = 0; w < NW; w++) {
        const float e = wm[w * 8 + h];
        if (e != 0.f) v = fmaf(e, wacc[(w * 8 + h) * WS + c + c / 16], v);
      }
    } else {
      v = wl[(c - D) * 8 + h];
    }
    slot_row(h, blockIdx.x)[c] = v;
  }
  fast_mark(f, 8);

  // The last block of this (row, kv head chunk) to finish merges every slot. The barrier
  // orders every thread's slot stores before thread 0's fence and arrival (the pattern of a
  // cooperative grid barrier).
  __syncthreads();
  int* flag = reinterpret_cast<int*>(smem + L.flag);
  unsigned* counter = f.counters + (long long)blockIdx.z * gridDim.y + blockIdx.y;
  if (tid == 0) {
    __threadfence();
    const unsigned done = atomicAdd(counter, 1u);
    flag[0] = done == (unsigned)nslots - 1;
    if (done == (unsigned)nslots - 1) *counter = 0;  // ready for the next launch
    __threadfence();
  }
  fast_mark(f, 9);
  __syncthreads();
  fast_mark(f, 3);
  if (!flag[0]) return;
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
    // Each lane's slots' (max, sum) pairs in one 8-byte load each, all issued at once.
    constexpr int PER = (KVQ_FAST_MAX_SLOTS + 31) / 32;
    float ms[PER], ls[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {
      const int s = lane + 32 * j;
      ms[j] = -INFINITY;
      ls[j] = 0.f;
      if (s < nslots) {
        const float2 v = __ldcg(reinterpret_cast<const float2*>(r + (long long)s * (D + 2) + D));
        ms[j] = v.x + (s < ncode ? sh : 0.f);
        ls[j] = v.y;
      }
      mm = fmaxf(mm, ms[j]);
    }
    mm = warp_max(mm);
    float ll = 0.f;
#pragma unroll
    for (int j = 0; j < PER; j++) {
      const int s = lane + 32 * j;
      const float w = ms[j] == -INFINITY ? 0.f : __expf(ms[j] - mm);
      if (s < nslots) wts[h * WST + s] = w;
      ll = fmaf(w, ls[j], ll);
    }
    ll = warp_sum(ll);
    if (lane == 0) {
      hm[h] = mm;
      hl[h] = ll;
    }
  }
  __syncthreads();
  fast_mark(f, 10);
  for (int i = tid; i < 8 * D; i += NT) {
    const int h = i / D, c = i % D;
    float v = 0.f;
    if (h < gb) {
      const float* r = slot_row(h, 0) + c;
      // 16 slots' loads in flight at a time, not behind the weight test (every code slot is
      // written, an empty one with zeros; the sum keeps the slots' order).
      for (int s = 0; s < ncode; s += 16) {
        float x[16];
#pragma unroll
        for (int j = 0; j < 16; j++)
          x[j] = s + j < ncode ? __ldcg(r + (long long)(s + j) * (D + 2)) : 0.f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
          const float w = s + j < ncode ? wts[h * WST + s + j] : 0.f;
          if (w != 0.f) v = fmaf(w, x[j], v);
        }
      }
    }
    oc[i] = v * vscale;
  }
  __syncthreads();
  fast_mark(f, 11);
  if (vsigns != nullptr) fast_butterflies_warp<D, NW>(oc, gb);
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
  fast_mark(f, 4);
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
  fast_mark(f, 1);
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
  fast_mark(f, 2);
  fast_finish<D, NW>(a, f, L, smem, acc, m, l, k, vsigns, vscale);
}

}  // namespace kvq
