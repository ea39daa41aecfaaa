//! Where weights come from: GGUF (quantized, kept quantized) or safetensors (f32/f16/bf16, held as
//! f32 on the CPU and as f16 on a GPU, where the matmuls run in f16), behind one `WeightSource`
//! so a single model definition serves both.

use super::arch::Family;
use super::q4_1::Q41Weight;
use crate::{ModelError, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor, gguf_file};
use candle_core::{DType, Device, Module, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A linear layer `y = x W^T (+ b)` whose weight may be quantized.
#[derive(Debug, Clone)]
pub struct Linear {
    w: LinearWeight,
    b: Option<Tensor>,
}

/// How a linear layer holds its weight: exactly one copy.
#[derive(Debug, Clone)]
enum LinearWeight {
    /// Q4_1 on the CPU, repacked for the AVX2 kernel; the ggml blocks are not kept.
    Q41(Arc<Q41Weight>),
    /// Anything else, through candle's kernels.
    Candle(QMatMul),
}

/// Prompt chunks of at least this many tokens run their projections as one f32 GEMM against the
/// dequantized weight instead of quantizing every activation row: the dequantization is
/// amortized over the rows, and the GEMM is blocked and vectorized where the row-by-row q8 dot
/// products are not.
pub const DEQUANT_MIN_ROWS: usize = 32;

impl Linear {
    /// A layer from its weight and optional bias. A Q4_1 weight on the CPU is repacked and its
    /// ggml blocks dropped.
    pub fn new(w: QMatMul, b: Option<Tensor>) -> Result<Self> {
        let w = match &w {
            QMatMul::QTensor(q) => match Q41Weight::from_qtensor(q)? {
                Some(q41) => LinearWeight::Q41(Arc::new(q41)),
                None => LinearWeight::Candle(w),
            },
            _ => LinearWeight::Candle(w),
        };
        Ok(Self { w, b })
    }

    /// The quantized path (rows of decode and short chunks).
    fn forward_quantized(&self, x: &Tensor) -> Result<Tensor> {
        match &self.w {
            LinearWeight::Q41(q) if x.rank() == 2 && x.dtype() == DType::F32 => q.forward(x),
            LinearWeight::Q41(q) => Err(ModelError::Invalid(format!(
                "a Q4_1 layer takes [T, {}] f32 activations, got {:?} {:?}",
                q.cols(),
                x.dims(),
                x.dtype()
            ))),
            LinearWeight::Candle(w) => Ok(w.forward(x)?),
        }
    }

    /// Applies the layer to `[T, in]` with the weight's own kernel (q8 activations for a
    /// quantized weight).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_split(x, 0)
    }

    /// Applies the layer to `[T, in]`, where the first `dense_rows` rows belong to long prompt
    /// chunks and go through the dequantized f32 GEMM. Each row's result depends only on which
    /// of the two paths it takes, never on the other rows of the batch.
    pub fn forward_split(&self, x: &Tensor, dense_rows: usize) -> Result<Tensor> {
        let n = x.dim(0)?;
        let dequantized = match &self.w {
            _ if dense_rows == 0 => None,
            LinearWeight::Q41(q) => Some(q.dequantize(x.device())?),
            LinearWeight::Candle(QMatMul::QTensor(q)) => Some(q.dequantize(x.device())?),
            LinearWeight::Candle(_) => None,
        };
        let y = match dequantized {
            Some(w) => {
                let dense = x.narrow(0, 0, dense_rows)?.matmul(&w.t()?)?;
                if dense_rows == n {
                    dense
                } else {
                    let rest =
                        self.forward_quantized(&x.narrow(0, dense_rows, n - dense_rows)?)?;
                    Tensor::cat(&[dense, rest], 0)?
                }
            }
            None => self.forward_quantized(x)?,
        };
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// A token embedding table, quantized or dense.
#[derive(Debug, Clone)]
pub enum Embedding {
    Quantized(Arc<QTensor>),
    /// A Q4_1 table on the CPU, held once as tiles that also serve a tied output projection.
    Q41(Arc<Q41Weight>),
    Dense(Tensor),
}

impl Embedding {
    /// Rows for `ids`: `[n] -> [n, hidden]` in f32.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Embedding::Quantized(q) => q.embedding(ids)?.to_dtype(DType::F32)?,
            Embedding::Q41(q) => q.embedding(ids)?,
            Embedding::Dense(t) => t.index_select(ids, 0)?.to_dtype(DType::F32)?,
        })
    }

    /// The same table used as the output projection (tied embeddings), sharing its memory.
    pub fn as_linear(&self) -> Result<Linear> {
        let w = match self {
            Embedding::Quantized(q) => QMatMul::from_arc(q.clone())?,
            Embedding::Q41(q) => {
                return Ok(Linear {
                    w: LinearWeight::Q41(q.clone()),
                    b: None,
                });
            }
            Embedding::Dense(t) if t.dtype() == DType::F16 => QMatMul::TensorF16(t.clone()),
            Embedding::Dense(t) => QMatMul::Tensor(t.clone()),
        };
        Linear::new(w, None)
    }
}

/// `KVQ_GPU_WEIGHTS=f16`: a GGUF's projections on a GPU are held dequantized to f16 and run
/// as f16 GEMMs instead of candle's quantized kernels (which quantize the activations to 8 bits:
/// 1-3% error per projection on SmolLM2, against 0.5% between the CPU's own two paths).
fn gpu_weights_f16() -> bool {
    std::env::var("KVQ_GPU_WEIGHTS").is_ok_and(|v| v.eq_ignore_ascii_case("f16"))
}

/// Tensors by their GGUF names (`token_embd.weight`, `blk.3.attn_q.weight`, ...).
pub trait WeightSource {
    /// True when the tensor exists.
    fn contains(&self, name: &str) -> bool;
    /// A linear layer from `{prefix}.weight` and, when present, `{prefix}.bias`.
    fn linear(&mut self, prefix: &str) -> Result<Linear>;
    /// A tensor as dense f32 (norm weights, biases).
    fn dense(&mut self, name: &str) -> Result<Tensor>;
    /// The embedding table.
    fn embedding(&mut self, name: &str) -> Result<Embedding>;
    /// Number of tensors, for progress reports.
    fn len(&self) -> usize;
    /// True when the source holds no tensors.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Weights read from a GGUF file, or from every part of a split one; quantized tensors stay
/// quantized.
pub struct GgufWeights {
    /// The parts in order; the first holds the model's metadata.
    parts: Vec<GgufPart>,
    /// Which part holds each tensor.
    index: HashMap<String, usize>,
    device: Device,
}

struct GgufPart {
    content: gguf_file::Content,
    file: std::fs::File,
    path: PathBuf,
}

impl GgufWeights {
    /// Opens `path` and reads its header; for a part of a split GGUF
    /// (`Name-00001-of-00003.gguf`), every part's.
    pub fn open(path: &Path, device: &Device) -> Result<Self> {
        let paths = crate::files::gguf_shards(path)?;
        let mut parts = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (i, path) in paths.into_iter().enumerate() {
            let mut file = std::fs::File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            let content = gguf_file::Content::read(&mut file)
                .map_err(|e| ModelError::Invalid(format!("{}: {e}", path.display())))?;
            for name in content.tensor_infos.keys() {
                index.entry(name.clone()).or_insert(i);
            }
            parts.push(GgufPart {
                content,
                file,
                path,
            });
        }
        let weights = Self {
            parts,
            index,
            device: device.clone(),
        };
        weights.check_split()?;
        Ok(weights)
    }

    /// A split GGUF's first part says how many parts and tensors there are (`split.count`,
    /// `split.tensors.count`); what was opened must agree.
    fn check_split(&self) -> Result<()> {
        let meta = &self.content().metadata;
        // llama.cpp writes split.count as u16 and split.tensors.count as i32.
        let count = |key: &str| {
            meta.get(key).and_then(|v| match v {
                gguf_file::Value::I32(n) => u64::try_from(*n).ok(),
                gguf_file::Value::I64(n) => u64::try_from(*n).ok(),
                v => v.to_u64().ok(),
            })
        };
        let parts = count("split.count").unwrap_or(1);
        let first = &self.parts[0].path;
        if parts != self.parts.len() as u64 {
            return Err(ModelError::Invalid(format!(
                "{} says the model is split into {parts} parts, but {} {} found by name \
                 (parts are named Name-00001-of-{parts:05}.gguf and so on)",
                first.display(),
                self.parts.len(),
                if self.parts.len() == 1 { "was" } else { "were" },
            )));
        }
        if let Some(tensors) = count("split.tensors.count")
            && tensors != self.index.len() as u64
        {
            return Err(ModelError::Invalid(format!(
                "{}: the split GGUF names {tensors} tensors, its parts hold {}",
                first.display(),
                self.index.len()
            )));
        }
        Ok(())
    }

    /// The GGUF header of the (first) file: metadata and its tensor directory.
    pub fn content(&self) -> &gguf_file::Content {
        &self.parts[0].content
    }

    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        let Some(&i) = self.index.get(name) else {
            return Err(ModelError::Invalid(format!(
                "{} has no tensor '{name}'",
                self.parts[0].path.display()
            )));
        };
        let part = &mut self.parts[i];
        if let Some(info) = part.content.tensor_infos.get(name) {
            check_tensor_size(info).map_err(|why| {
                ModelError::Invalid(format!(
                    "{}: tensor '{name}' (shape {:?}) {why}",
                    part.path.display(),
                    info.shape.dims()
                ))
            })?;
        }
        Ok(part.content.tensor(&mut part.file, name, &self.device)?)
    }
}

/// What candle's GGUF reader assumes of a tensor's shape before it reads it (both found by the
/// model_file fuzz target): its element and byte counts do not overflow (candle multiplies
/// unchecked), and it is not empty (candle reads an empty tensor through a dangling,
/// misaligned pointer). No real weight is empty. candle itself checks the bytes fit the file.
fn check_tensor_size(info: &gguf_file::TensorInfo) -> std::result::Result<(), &'static str> {
    let elems = info
        .shape
        .dims()
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or("has more elements than memory can address")?;
    if elems == 0 {
        return Err("has no elements");
    }
    let block = info.ggml_dtype.block_size();
    (elems / block)
        .checked_mul(info.ggml_dtype.type_size())
        .ok_or("has more bytes than memory can address")?;
    Ok(())
}

impl WeightSource for GgufWeights {
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn linear(&mut self, prefix: &str) -> Result<Linear> {
        let q = self.qtensor(&format!("{prefix}.weight"))?;
        let w = match gpu_weights_f16() && !self.device.is_cpu() {
            // Four times the memory of 4-bit weights, no activation quantization.
            true => QMatMul::TensorF16(q.dequantize_f16(&self.device)?),
            false => QMatMul::from_qtensor(q)?,
        };
        let bias = format!("{prefix}.bias");
        let b = if self.contains(&bias) {
            Some(self.dense(&bias)?)
        } else {
            None
        };
        Linear::new(w, b)
    }

    fn dense(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(&self.device)?)
    }

    fn embedding(&mut self, name: &str) -> Result<Embedding> {
        let q = self.qtensor(name)?;
        Ok(match q.dtype() {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                Embedding::Dense(q.dequantize(&self.device)?)
            }
            _ => match Q41Weight::from_qtensor(&q)? {
                Some(q41) => Embedding::Q41(Arc::new(q41)),
                None => Embedding::Quantized(Arc::new(q)),
            },
        })
    }

    fn len(&self) -> usize {
        self.index.len()
    }
}

/// Weights read from Hugging Face safetensors files, converted to f32.
pub struct SafetensorsWeights {
    st: candle_core::safetensors::MmapedSafetensors,
    device: Device,
    count: usize,
    family: Family,
}

impl SafetensorsWeights {
    /// Memory-maps every `*.safetensors` file in `paths`, named as `family` names its tensors.
    pub fn open(paths: &[PathBuf], device: &Device, family: Family) -> Result<Self> {
        // SAFETY: the files are memory-mapped read-only; kvq never writes to model files while
        // serving, and the mapping lives as long as this struct.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(paths)? };
        let count = st.tensors().len();
        Ok(Self {
            st,
            device: device.clone(),
            count,
            family,
        })
    }

    /// The Hugging Face name under which the files hold `gguf_name`, if they do.
    fn find(&self, gguf_name: &str) -> Option<String> {
        self.family
            .hf_names(gguf_name)
            .into_iter()
            .find(|n| self.st.get(n).is_ok())
    }

    /// A matrix in the dtype its matmuls run in: f32 on the CPU, f16 on a GPU.
    fn matrix(&self, gguf_name: &str) -> Result<Tensor> {
        let t = self.get(gguf_name)?;
        Ok(match self.device.is_cpu() {
            true => t,
            false => t.to_dtype(DType::F16)?,
        })
    }

    fn get(&self, gguf_name: &str) -> Result<Tensor> {
        let hf = self.find(gguf_name).ok_or_else(|| {
            let names = self.family.hf_names(gguf_name);
            ModelError::Invalid(match names.is_empty() {
                true => format!("no Hugging Face name for tensor '{gguf_name}'"),
                false => format!("the safetensors lack '{}'", names.join("' or '")),
            })
        })?;
        let t = self
            .st
            .load(&hf, &self.device)
            .map_err(|e| ModelError::Invalid(format!("tensor '{hf}': {e}")))?;
        Ok(t.to_dtype(DType::F32)?)
    }
}

impl WeightSource for SafetensorsWeights {
    fn contains(&self, name: &str) -> bool {
        self.find(name).is_some()
    }

    fn linear(&mut self, prefix: &str) -> Result<Linear> {
        let w = self.matrix(&format!("{prefix}.weight"))?;
        let w = match w.dtype() {
            DType::F16 => QMatMul::TensorF16(w),
            _ => QMatMul::Tensor(w),
        };
        let bias = format!("{prefix}.bias");
        let b = if self.contains(&bias) {
            Some(self.get(&bias)?)
        } else {
            None
        };
        Linear::new(w, b)
    }

    fn dense(&mut self, name: &str) -> Result<Tensor> {
        self.get(name)
    }

    fn embedding(&mut self, name: &str) -> Result<Embedding> {
        Ok(Embedding::Dense(self.matrix(name)?))
    }

    fn len(&self) -> usize {
        self.count
    }
}
