//! The two traits a compressed method implements so the generic ops can run it.

use crate::spec::{DeviceCache, KeySpec, ValueSpec};

/// A codec's spec for device kernels and the device copies of its arrays. Codecs build it on the
/// first call of `kernel_data` (the CPU path never asks for it) and keep it.
#[derive(Debug)]
pub struct KernelData<S> {
    pub spec: S,
    pub device: DeviceCache,
}

impl<S> KernelData<S> {
    pub fn new(spec: S) -> Self {
        Self {
            spec,
            device: DeviceCache::default(),
        }
    }
}

/// Which device kernel family a codec maps to. The CPU path runs the trait methods directly; a
/// GPU backend picks its kernel by this tag and reads the codec's parameters through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelKind {
    /// Rotated scalar codebook (TurboQuant MSE / RVQ stages).
    ScalarCodebook,
    /// Scalar codebook plus a sign-sketch residual (TurboQuant Prod).
    CodebookPlusSketch,
    /// Sign sketch plus norm (QJL keys).
    SignSketch,
    /// Groupwise uniform scalar quantization (QJL values).
    GroupScalar,
    /// Product vector quantization through a lookup table (VecInfer).
    ProductVq,
}

/// Encodes keys and scores queries against key codes, never reconstructing fp16 keys.
pub trait KeyCodec: Send + Sync {
    /// Dimension of one head.
    fn head_dim(&self) -> usize;
    /// Bytes of one token's code for one head.
    fn code_bytes(&self) -> usize;
    /// Encodes key `k` (head_dim values) of kv head `head` into `out` (`code_bytes` bytes).
    fn encode(&self, head: usize, k: &[f32], out: &mut [u8]);
    /// The key estimate whose inner product with a query `scores` computes. Only references and
    /// tests call this: the attention path never reconstructs keys.
    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]);
    /// Length of the per-query state `prepare` fills.
    fn state_len(&self) -> usize;
    /// Prepares query `q` of kv head `head` once (rotation, sketch, lookup table).
    fn prepare(&self, head: usize, q: &[f32], state: &mut [f32]);
    /// Estimates `q . k` for each of the `out.len()` consecutive token codes in `codes`.
    fn scores(&self, head: usize, state: &[f32], codes: &[u8], out: &mut [f32]);
    /// The kernel family, for device backends.
    fn kernel(&self) -> KernelKind;
    /// The layout and parameters a device kernel runs this codec from; `None`: CPU only.
    fn kernel_data(&self) -> Option<&KernelData<KeySpec>> {
        None
    }
}

/// Encodes values and accumulates probability-weighted values from codes.
pub trait ValueCodec: Send + Sync {
    /// Dimension of one head.
    fn head_dim(&self) -> usize;
    /// Bytes of one token's code for one head.
    fn code_bytes(&self) -> usize;
    /// Encodes value `v` of kv head `head` into `out`.
    fn encode(&self, head: usize, v: &[f32], out: &mut [u8]);
    /// The value estimate (references and tests only).
    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]);
    /// Length of the accumulator `accumulate` adds into (head_dim unless the codec keeps, say,
    /// per-code histograms).
    fn acc_len(&self) -> usize {
        self.head_dim()
    }
    /// `acc += sum_i probs[i] * value_i` for the `probs.len()` consecutive codes, in the codec's
    /// own domain (for example rotated).
    fn accumulate(&self, head: usize, probs: &[f32], codes: &[u8], acc: &mut [f32]);
    /// Maps `acc` from the codec's domain to values: `out` (head_dim) = the weighted sum.
    fn finish(&self, head: usize, acc: &[f32], out: &mut [f32]);
    /// The kernel family, for device backends.
    fn kernel(&self) -> KernelKind;
    /// The layout and parameters a device kernel runs this codec from; `None`: CPU only.
    fn kernel_data(&self) -> Option<&KernelData<ValueSpec>> {
        None
    }
}
