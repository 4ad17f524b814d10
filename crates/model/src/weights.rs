//! Where a checkpoint's tensors come from: memory-mapped safetensors (one file or shards listed by
//! `model.safetensors.index.json`) or a GGUF file. Callers ask by the Hugging Face name and the
//! shape the config implies; a missing tensor, a wrong shape or a truncated file is an error that
//! names the file and the tensor.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, Metadata};

use crate::error::{ModelError, Result};
use crate::file_pages;
use crate::gguf::hf_to_gguf_name;

/// A loaded weight: dense (in the compute dtype) or still in a GGUF block-quantized format.
// With the cuda feature a QTensor carries its device handles (~230 bytes); a Weight only lives
// between reading a tensor and building its Linear, so boxing would buy nothing.
#[cfg_attr(feature = "cuda", allow(clippy::large_enum_variant))]
pub enum Weight {
    Dense(Tensor),
    Quantized(QTensor),
}

impl Weight {
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Weight::Dense(t) => t.dims().to_vec(),
            Weight::Quantized(q) => q.shape().dims().to_vec(),
        }
    }
}

/// The stored dtype and shape of a tensor, without loading it (for `flint inspect`).
#[derive(Debug, Clone)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: usize,
}

pub enum WeightSource {
    Safetensors(SafetensorsFiles),
    Gguf(GgufWeights),
}

impl WeightSource {
    /// Load `name` (a Hugging Face tensor name), check it has `shape`, and convert dense weights to
    /// `dtype`.
    pub fn get(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Weight> {
        self.get_with(name, shape, dtype, device, false)
    }

    /// [`get`](Self::get) for a matrix flint's CPU kernel will pack: one stored in bf16 or f16
    /// stays so when the compute dtype is f32 on the CPU (the kernel widens it exactly as it
    /// reads, so decode streams half the bytes).
    pub fn get_matrix(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Weight> {
        self.get_with(name, shape, dtype, device, dtype == DType::F32 && device.is_cpu())
    }

    fn get_with(&self, name: &str, shape: &[usize], dtype: DType, device: &Device, keep_half: bool) -> Result<Weight> {
        let w = match self {
            WeightSource::Safetensors(s) => Weight::Dense(s.load(name, dtype, device, keep_half)?),
            WeightSource::Gguf(g) => g.load(name, dtype, device, keep_half)?,
        };
        let found = w.dims();
        // A one-row matrix stored as a vector (Qwen2-MoE's `shared_expert_gate` in some GGUFs).
        let w = match w {
            Weight::Dense(t) if found != shape && without_leading_ones(&found) == without_leading_ones(shape) => {
                Weight::Dense(t.reshape(shape)?)
            }
            w => w,
        };
        let found = w.dims();
        if found != shape {
            return Err(ModelError::ShapeMismatch {
                file: self.file_of(name),
                name: name.to_string(),
                expected: shape.to_vec(),
                found,
            });
        }
        Ok(w)
    }

    /// The `n` experts' `proj` matrices (`gate_proj`, `up_proj`, `down_proj`), each of `shape`
    /// (`[out, in]`), of the mixture of experts at `mlp` (`model.layers.N.mlp`). Safetensors hold
    /// one tensor per expert (`{mlp}.experts.{e}.{proj}.weight`); a GGUF one `[n, out, in]`
    /// tensor (`blk.N.ffn_{gate,up,down}_exps.weight`), split here as it loads, so each expert's
    /// weights are held once, as their own matrix.
    pub fn get_experts(
        &self,
        mlp: &str,
        proj: &str,
        n: usize,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Vec<Weight>> {
        match self {
            WeightSource::Gguf(g) => {
                let keep_half = dtype == DType::F32 && device.is_cpu();
                g.load_experts(&format!("{mlp}.experts.{proj}.weight"), n, shape, dtype, device, keep_half)
            }
            WeightSource::Safetensors(_) => (0..n)
                .map(|e| self.get_matrix(&format!("{mlp}.experts.{e}.{proj}.weight"), shape, dtype, device))
                .collect(),
        }
    }

    /// A GGUF's merged experts `{mlp}.experts.{proj}.weight` as stored (`[n, out, in]` for
    /// `shape` `[out, in]`): one buffer whose rows are the experts' rows in order, for a kernel
    /// that packs them whole. `None` for safetensors, which hold the experts apart.
    pub fn get_merged_experts(&self, mlp: &str, proj: &str, n: usize, shape: &[usize]) -> Result<Option<QTensor>> {
        match self {
            WeightSource::Gguf(g) => Ok(Some(g.read_merged(&format!("{mlp}.experts.{proj}.weight"), n, shape)?)),
            WeightSource::Safetensors(_) => Ok(None),
        }
    }

    /// Load a weight that must be dense (norms, biases): dequantize if the file quantized it.
    pub fn get_dense(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        match self.get(name, shape, dtype, device)? {
            Weight::Dense(t) => Ok(t),
            Weight::Quantized(q) => Ok(q.dequantize(device)?.to_dtype(dtype)?),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        match self {
            WeightSource::Safetensors(s) => s.index.contains_key(s.stored_name(name)),
            WeightSource::Gguf(g) => g.content.tensor_infos.contains_key(&hf_to_gguf_name(name)),
        }
    }

    pub fn file_of(&self, name: &str) -> PathBuf {
        match self {
            WeightSource::Safetensors(s) => {
                s.index.get(s.stored_name(name)).map(|&f| s.files[f].path.clone()).unwrap_or_else(|| s.dir.clone())
            }
            WeightSource::Gguf(g) => g.path.clone(),
        }
    }

    /// Every tensor in the checkpoint, in name order.
    pub fn tensors(&self) -> Vec<TensorMeta> {
        match self {
            WeightSource::Safetensors(s) => s.tensors(),
            WeightSource::Gguf(g) => g.tensors(),
        }
    }
}

struct MappedFile {
    path: PathBuf,
    /// Kept open to drop what has been read from the page cache (see [`file_pages`]).
    file: File,
    mmap: Mmap,
    /// Byte offset of the tensor data (after the 8-byte length and the JSON header).
    data_start: usize,
    metadata: Metadata,
}

pub struct SafetensorsFiles {
    dir: PathBuf,
    files: Vec<MappedFile>,
    /// Tensor name → index of the file holding it.
    index: BTreeMap<String, usize>,
    /// Saved from the base model (`Qwen3Model.save_pretrained`, as embedding checkpoints such as
    /// Qwen3-Embedding are): its names lack the `model.` every causal-LM name starts with.
    bare: bool,
}

impl SafetensorsFiles {
    /// Open `dir/model.safetensors`, or the shards named in `dir/model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let paths: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Safetensors {
                file: index_path.clone(),
                msg: format!("invalid index JSON: {e}"),
            })?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::Safetensors {
                file: index_path.clone(),
                msg: "no `weight_map` object".into(),
            })?;
            let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            // Shards live beside the index: a path that leaves the directory is refused.
            if let Some(bad) = names.iter().find(|n| !is_plain_file_name(n)) {
                return Err(ModelError::Safetensors {
                    file: index_path.clone(),
                    msg: format!("weight_map names `{bad}`, which is not a file in the model directory"),
                });
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            return Err(ModelError::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors or model.safetensors.index.json",
                ),
            ));
        };
        Self::open_files(dir, &paths)
    }

    pub fn open_files(dir: &Path, paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut index = BTreeMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
            // SAFETY: the file is opened read-only; a checkpoint modified while serving is outside
            // what any inference server can defend against, as with every mmap-based loader.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
            let (header_len, metadata) =
                safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| explain_bad_header(path, &mmap, e))?;
            let data_start = 8 + header_len;
            let data_len = mmap.len().saturating_sub(data_start);
            for (name, info) in metadata.tensors() {
                let (start, end) = info.data_offsets;
                if end > data_len || start > end {
                    return Err(ModelError::BadTensor {
                        file: path.clone(),
                        name,
                        msg: format!(
                            "data {start}..{end} lies beyond the file's {data_len} data bytes (truncated file)"
                        ),
                    });
                }
                if index.insert(name.clone(), i).is_some() {
                    return Err(ModelError::BadTensor {
                        file: path.clone(),
                        name,
                        msg: "appears in more than one shard".into(),
                    });
                }
            }
            files.push(MappedFile { path: path.clone(), file, mmap, data_start, metadata });
        }
        let bare = !index.keys().any(|k| k.starts_with("model.")) && index.contains_key("embed_tokens.weight");
        Ok(Self { dir: dir.to_path_buf(), files, index, bare })
    }

    /// The name a Hugging Face causal-LM name `name` has in these files.
    fn stored_name<'a>(&self, name: &'a str) -> &'a str {
        if self.bare {
            name.strip_prefix("model.").unwrap_or(name)
        } else {
            name
        }
    }

    fn load(&self, name: &str, dtype: DType, device: &Device, keep_half: bool) -> Result<Tensor> {
        let name = self.stored_name(name);
        let &fi = self.index.get(name).ok_or_else(|| ModelError::MissingTensor {
            file: if self.files.len() == 1 { self.files[0].path.clone() } else { self.dir.clone() },
            name: name.to_string(),
        })?;
        let f = &self.files[fi];
        let info = f
            .metadata
            .info(name)
            .ok_or_else(|| ModelError::MissingTensor { file: f.path.clone(), name: name.to_string() })?;
        let bad = |msg: String| ModelError::BadTensor { file: f.path.clone(), name: name.to_string(), msg };
        let src_dtype = match info.dtype {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => return Err(bad(format!("dtype {other:?} is not supported (f32, f16, bf16)"))),
        };
        let (start, end) = info.data_offsets;
        let bytes = &f.mmap[f.data_start + start..f.data_start + end];
        let expected = info.shape.iter().product::<usize>() * src_dtype.size_in_bytes();
        if bytes.len() != expected {
            return Err(bad(format!("holds {} bytes, its shape needs {expected}", bytes.len())));
        }
        let t = Tensor::from_raw_buffer(bytes, src_dtype, &info.shape, device).map_err(|e| bad(e.to_string()))?;
        file_pages::unmap(&f.mmap, f.data_start + start, end - start);
        file_pages::uncache(&f.file);
        let keep = keep_half && matches!(src_dtype, DType::BF16 | DType::F16);
        Ok(if src_dtype == dtype || keep { t } else { t.to_dtype(dtype)? })
    }

    fn tensors(&self) -> Vec<TensorMeta> {
        let mut out = Vec::new();
        for f in &self.files {
            for (name, info) in f.metadata.tensors() {
                let (s, e) = info.data_offsets;
                out.push(TensorMeta {
                    name,
                    dtype: format!("{:?}", info.dtype),
                    shape: info.shape.clone(),
                    bytes: e - s,
                });
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }
}

/// A GGUF file: its metadata and tensor directory are read at open; tensors on demand.
pub struct GgufWeights {
    pub path: PathBuf,
    pub content: gguf_file::Content,
    file: std::sync::Mutex<File>,
    /// (query heads, KV heads) when llama.cpp permuted the rows of `attn_q`/`attn_k`
    /// (the `llama` arch): they are put back in the checkpoint's order as they load.
    permuted_qk: Option<(usize, usize)>,
}

impl GgufWeights {
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // The bounded pre-scan first: candle's reader trusts some counts and sizes in the file.
        let content = crate::gguf_scan::read_content(&mut file)
            .map_err(|msg| ModelError::Gguf { file: path.to_path_buf(), msg })?;
        Ok(Self { path: path.to_path_buf(), content, file: std::sync::Mutex::new(file), permuted_qk: None })
    }

    /// Say that `attn_q`/`attn_k` rows were permuted by llama.cpp's converter for `heads` query
    /// and `kv_heads` KV heads; [`load`](Self::load) then undoes it.
    pub fn set_permuted_qk(&mut self, heads: usize, kv_heads: usize) {
        self.permuted_qk = Some((heads, kv_heads));
    }

    /// A small f32 tensor by its GGUF name (`rope_freqs.weight`), `None` when the file lacks it.
    pub fn read_f32(&self, gguf_name: &str) -> Result<Option<Vec<f32>>> {
        if !self.content.tensor_infos.contains_key(gguf_name) {
            return Ok(None);
        }
        let q = self.read(gguf_name)?;
        Ok(Some(q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?))
    }

    fn read(&self, name: &str) -> Result<QTensor> {
        let mut file = self.file.lock().map_err(|_| ModelError::Gguf {
            file: self.path.clone(),
            msg: "file handle poisoned by an earlier failure".into(),
        })?;
        let tensor = self.content.tensor(&mut *file, name, &Device::Cpu).map_err(|e| ModelError::BadTensor {
            file: self.path.clone(),
            name: name.to_string(),
            msg: first_line(&e.to_string()),
        })?;
        file_pages::uncache(&file);
        Ok(tensor)
    }

    /// Heads whose rows llama.cpp interleaved in this tensor, if it is a permuted q or k.
    fn permuted_heads(&self, gguf_name: &str) -> Option<usize> {
        let (heads, kv_heads) = self.permuted_qk?;
        let suffix = gguf_name.strip_prefix("blk.")?.split_once('.')?.1;
        match suffix {
            "attn_q.weight" => Some(heads),
            "attn_k.weight" => Some(kv_heads),
            _ => None,
        }
    }

    pub fn metadata(&self) -> &HashMap<String, gguf_file::Value> {
        &self.content.metadata
    }

    fn load(&self, hf_name: &str, dtype: DType, device: &Device, keep_half: bool) -> Result<Weight> {
        let name = hf_to_gguf_name(hf_name);
        if !self.content.tensor_infos.contains_key(&name) {
            return Err(ModelError::MissingTensor { file: self.path.clone(), name });
        }
        let mut q = self.read(&name)?;
        if let Some(heads) = self.permuted_heads(&name) {
            q = unpermute_rows(&q, heads).map_err(|msg| ModelError::BadTensor {
                file: self.path.clone(),
                name: name.clone(),
                msg,
            })?;
        }
        self.convert(&name, q, dtype, device, keep_half)
    }

    /// The merged experts `hf_name` (`[n, out, in]`, see [`WeightSource::get_experts`]) as `n`
    /// weights of `shape`. Each expert's rows are whole blocks and contiguous in the file, so an
    /// expert is a byte range; the merged tensor is dropped once every expert is converted.
    fn load_experts(
        &self,
        hf_name: &str,
        n: usize,
        shape: &[usize],
        dtype: DType,
        device: &Device,
        keep_half: bool,
    ) -> Result<Vec<Weight>> {
        let merged = self.read_merged(hf_name, n, shape)?;
        let name = hf_to_gguf_name(hf_name);
        let bad = |e: candle_core::Error| ModelError::BadTensor {
            file: self.path.clone(),
            name: name.clone(),
            msg: first_line(&e.to_string()),
        };
        let data = merged.data().map_err(bad)?;
        let per = data.len() / n.max(1);
        (0..n)
            .map(|e| {
                let bytes = std::borrow::Cow::Borrowed(&data[e * per..(e + 1) * per]);
                let storage = QStorage::from_data(bytes, &Device::Cpu, merged.dtype()).map_err(bad)?;
                let expert = QTensor::new(storage, shape.to_vec()).map_err(bad)?;
                self.convert(&name, expert, dtype, device, keep_half)
            })
            .collect()
    }

    /// The merged experts `hf_name`, checked to be `[n, shape…]`.
    fn read_merged(&self, hf_name: &str, n: usize, shape: &[usize]) -> Result<QTensor> {
        let name = hf_to_gguf_name(hf_name);
        if !self.content.tensor_infos.contains_key(&name) {
            return Err(ModelError::MissingTensor { file: self.path.clone(), name });
        }
        let merged = self.read(&name)?;
        let expected: Vec<usize> = [n].iter().chain(shape).copied().collect();
        if merged.shape().dims() != expected {
            return Err(ModelError::ShapeMismatch {
                file: self.path.clone(),
                name,
                expected,
                found: merged.shape().dims().to_vec(),
            });
        }
        Ok(merged)
    }

    /// A tensor as read from the file, as the weight flint computes with.
    fn convert(&self, name: &str, q: QTensor, dtype: DType, device: &Device, keep_half: bool) -> Result<Weight> {
        // Read on the CPU whatever the device: a GPU takes only the block types it has a
        // validated matmul for, and every other tensor (norms, biases, f16/f32 matrices) arrives
        // there dense in the compute dtype, so no kernel table sees a type it rejects.
        let host = Device::Cpu;
        // candle's Q4_1/Q5_0/Q5_1 dot products assert (in debug builds) an even number of blocks
        // per row. No real checkpoint has an odd one; such a matrix is widened (exactly) instead.
        let odd_rows = matches!(q.dtype(), GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1)
            && !(q.shape().dims().last().copied().unwrap_or(0) / q.dtype().block_size()).is_multiple_of(2);
        let dense =
            |dt: DType| -> Result<Weight> { Ok(Weight::Dense(q.dequantize(&host)?.to_dtype(dt)?.to_device(device)?)) };
        Ok(match q.dtype() {
            // Widened to f32 and narrowed back: exact for values that were bf16.
            GgmlDType::BF16 if keep_half => dense(DType::BF16)?,
            GgmlDType::F16 if keep_half => dense(DType::F16)?,
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => dense(dtype)?,
            _ if odd_rows => dense(dtype)?,
            _ if device.is_cpu() => Weight::Quantized(q),
            t if crate::device::GPU_QUANT_TYPES.contains(&t) => {
                let storage = QStorage::from_data(q.data()?, device, t)?;
                Weight::Quantized(QTensor::new(storage, q.shape().clone())?)
            }
            t => {
                return Err(ModelError::Device(format!(
                    "{}: tensor `{name}` is {t:?}, which flint has not validated on {}: use a Q8_0, Q4_0, Q4_K or Q6_K \
                     GGUF there, or run on the CPU",
                    self.path.display(),
                    crate::device::DeviceSpec::of(device)
                )))
            }
        })
    }

    fn tensors(&self) -> Vec<TensorMeta> {
        let mut out: Vec<TensorMeta> = self
            .content
            .tensor_infos
            .iter()
            .map(|(name, info)| {
                let n = info.shape.elem_count();
                let bytes = n / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
                TensorMeta {
                    name: name.clone(),
                    dtype: format!("{:?}", info.ggml_dtype),
                    shape: info.shape.dims().to_vec(),
                    bytes,
                }
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }
}

/// `q` with its rows in the checkpoint's order again: llama.cpp's converter stores row
/// `h·d + 2i + half` what the checkpoint has at row `h·d + half·d/2 + i` ([`crate::gguf::llama_cpp_row`]).
/// Each row of a block-quantized matrix is whole blocks, so rows move as bytes.
fn unpermute_rows(q: &QTensor, heads: usize) -> std::result::Result<QTensor, String> {
    let dims = q.shape().dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(format!("{rows} rows cannot hold {heads} heads of an even size"));
    }
    let data = q.data().map_err(|e| first_line(&e.to_string()))?;
    let row_bytes = data.len() / rows;
    let mut out = Vec::with_capacity(data.len());
    for r in 0..rows {
        let src = crate::gguf::llama_cpp_row(r, rows / heads);
        out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(out), &Device::Cpu, q.dtype())
        .map_err(|e| first_line(&e.to_string()))?;
    QTensor::new(storage, q.shape().clone()).map_err(|e| first_line(&e.to_string()))
}

fn without_leading_ones(dims: &[usize]) -> &[usize] {
    let ones = dims.iter().take_while(|&&d| d == 1).count();
    &dims[ones..]
}

fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\'])
}

/// The safetensors crate's own limit on the JSON header.
const MAX_SAFETENSORS_HEADER: usize = 100_000_000;

/// Turn the safetensors crate's terse header error into one that names the first tensor whose
/// bytes are missing when the file was cut short, the usual failure (an interrupted download).
fn explain_bad_header(path: &Path, bytes: &[u8], e: safetensors::SafeTensorError) -> ModelError {
    let generic = || ModelError::Safetensors { file: path.to_path_buf(), msg: format!("{e:?}") };
    let Some(n) = bytes.get(..8).map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as usize)
    else {
        return ModelError::Safetensors { file: path.to_path_buf(), msg: format!("only {} bytes long", bytes.len()) };
    };
    // The safetensors crate refuses headers over 100 MB; so does this (it would parse them).
    if n > MAX_SAFETENSORS_HEADER {
        return ModelError::Safetensors {
            file: path.to_path_buf(),
            msg: format!("header declares {n} bytes (limit {MAX_SAFETENSORS_HEADER})"),
        };
    }
    let Some(header) = bytes.get(8..8usize.saturating_add(n)) else {
        return ModelError::Safetensors {
            file: path.to_path_buf(),
            msg: format!("header of {n} bytes but the file has {} (truncated)", bytes.len()),
        };
    };
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(header) else {
        return generic();
    };
    let data_len = bytes.len() - 8 - n;
    let mut missing: Vec<(u64, &String)> = map
        .iter()
        .filter_map(|(name, info)| {
            let end = info.get("data_offsets")?.get(1)?.as_u64()?;
            (end as usize > data_len).then_some((end, name))
        })
        .collect();
    missing.sort();
    match missing.first() {
        Some((end, name)) => ModelError::BadTensor {
            file: path.to_path_buf(),
            name: name.to_string(),
            msg: format!("data ends at byte {end} but the file holds {data_len} data bytes (truncated file)"),
        },
        None => generic(),
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}
