//! Encoding keys at the shape that ran the seed out of memory (head_dim 256, 256 centroids,
//! sub_dim 4, 4096 tokens, 4 kv heads) allocates O(N): the nearest-centroid search never builds
//! the `[N, centroids, sub_dim]` distance intermediate (1 GiB of f32 here). A counting global
//! allocator measures the peak of the encode call alone; one test in this binary, so no other
//! thread allocates meanwhile.

use candle_core::{Device, Tensor};
use kvq_cache::CacheGeometry;
use kvq_cache::codec::rng::SplitMix;
use kvq_cache::compressed::{CodecFactory, KeyCodec};
use kvq_cache::methods::vecinfer::calibration::VecInferCalibration;
use kvq_cache::methods::vecinfer::{DEFAULT_SEED, VecInferFactory};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        NOW.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const D: usize = 256;
const KV_HEADS: usize = 4;
const SUB: usize = 4;
const CENTROIDS: usize = 256;

/// Peak bytes allocated while encoding `tokens` keys per kv head, above what was live before.
fn encode_peak(keys: &Arc<dyn KeyCodec>, tokens: usize) -> usize {
    let mut rng = SplitMix::new(tokens as u64);
    let k = Tensor::from_vec(
        rng.gauss_vec(KV_HEADS * tokens * D),
        (KV_HEADS, tokens, D),
        &Device::Cpu,
    )
    .expect("keys");
    let before = NOW.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let codes = kvq_kernels::encode_keys(keys, &k).expect("encode");
    let peak = PEAK.load(Ordering::Relaxed) - before;
    assert_eq!(codes.dims(), [KV_HEADS, tokens, D / SUB]);
    peak
}

#[test]
fn encoding_keys_at_the_seed_trigger_shape_allocates_linearly() {
    let cal = Arc::new(VecInferCalibration::random(1, KV_HEADS, D, 3));
    let f = VecInferFactory::new(cal, SUB, DEFAULT_SEED).expect("factory");
    let geom = CacheGeometry {
        n_heads: 8,
        n_kv_heads: KV_HEADS,
        head_dim: D,
        sliding_window: None,
        max_tokens: 4096,
    };
    let (keys, _) = f.codecs(0, &geom).expect("codecs");
    let keys: Arc<dyn KeyCodec> = Arc::new(keys);
    let small = encode_peak(&keys, 1024);
    let big = encode_peak(&keys, 4096);
    let vectors = KV_HEADS * 4096 * (D / SUB);
    let intermediate = vectors * CENTROIDS * SUB * 4;
    let codes = KV_HEADS * 4096 * (D / SUB);
    eprintln!(
        "encode peak: {small} bytes at 1024 tokens, {big} at 4096 (codes {codes} bytes; the \
         [N, centroids, sub_dim] f32 intermediate would be {intermediate})"
    );
    // O(N): the codes plus per-row scratch, a few times the output at most, and nowhere near
    // the intermediate.
    assert!(
        big < 8 * codes,
        "peak {big} bytes for {codes} bytes of codes"
    );
    assert!(
        big * 100 < intermediate,
        "peak {big} vs intermediate {intermediate}"
    );
    // Linear: four times the tokens, at most about four times the memory.
    assert!(big <= 5 * small.max(1), "1024 tokens: {small}, 4096: {big}");
}
