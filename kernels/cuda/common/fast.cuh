// The version-6 fused decode attention kernels' common parts (turboquant_mse/fast.cuh and the
// families built on it): the frame (arguments, layout, tables, query fragments, softmax step),
// the per-warp chunk copies, and the end of every block (the split merge, the exact rows).
#pragma once
#include "fast_chunks.cuh"
#include "fast_frame.cuh"
#include "fast_merge.cuh"

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
