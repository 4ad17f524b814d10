//! Writing GGUF v3 files in llama.cpp's Qwen2 conventions, so what flint exports loads in
//! llama.cpp, gguf-py and flint's own reader alike.
//!
//! The writer streams: tensor sizes are known from shapes and types alone, so the header (with
//! every tensor's offset) is written first and each tensor is then produced, converted and written
//! one at a time. A 7B checkpoint is exported holding only its largest tensor in memory.
//!
//! Type rules (what llama.cpp does, simplified where candle lacks llama.cpp's type ladder):
//! - 1-D tensors (norms, biases) stay F32 whatever was asked: they are tiny and precision-critical.
//! - 2-D tensors take the requested type when their row length (last dim) is a multiple of its
//!   block size; otherwise Q8_0 when the row is a multiple of 32, else F16. llama.cpp falls back
//!   to a nearer type (Q5_0 for Q4_K, …); Q8_0 is the one fallback every reader handles and it
//!   never loses more precision than the type that was asked for.

use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

use crate::config::{Qwen2Config, RopeScaling};
use crate::error::{ModelError, Result};
use crate::gguf::{hf_to_gguf_name, GgufTokenizerMeta};
use crate::weights::WeightSource;

/// Tensor data alignment; 32 is GGUF's default and what llama.cpp writes.
pub const ALIGNMENT: u64 = 32;

/// The storage type asked for a GGUF export (`--gguf q8_0` and friends).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_K,
    Q6_K,
}

impl GgufType {
    pub const ALL: [GgufType; 7] =
        [GgufType::F32, GgufType::F16, GgufType::BF16, GgufType::Q8_0, GgufType::Q4_0, GgufType::Q4_K, GgufType::Q6_K];

    /// The name used on the command line and in file names (`model-q4_k.gguf`).
    pub fn as_str(self) -> &'static str {
        match self {
            GgufType::F32 => "f32",
            GgufType::F16 => "f16",
            GgufType::BF16 => "bf16",
            GgufType::Q8_0 => "q8_0",
            GgufType::Q4_0 => "q4_0",
            GgufType::Q4_K => "q4_k",
            GgufType::Q6_K => "q6_k",
        }
    }

    pub fn ggml(self) -> GgmlDType {
        match self {
            GgufType::F32 => GgmlDType::F32,
            GgufType::F16 => GgmlDType::F16,
            GgufType::BF16 => GgmlDType::BF16,
            GgufType::Q8_0 => GgmlDType::Q8_0,
            GgufType::Q4_0 => GgmlDType::Q4_0,
            GgufType::Q4_K => GgmlDType::Q4K,
            GgufType::Q6_K => GgmlDType::Q6K,
        }
    }

    /// llama.cpp's `LLAMA_FTYPE_*` for `general.file_type`. Uniform Q4_K is reported as
    /// Q4_K_M (15), the Q4_K variant llama.cpp users know; the file says per tensor what it holds.
    pub fn file_type(self) -> u32 {
        match self {
            GgufType::F32 => 0,
            GgufType::F16 => 1,
            GgufType::Q4_0 => 2,
            GgufType::Q8_0 => 7,
            GgufType::Q4_K => 15,
            GgufType::Q6_K => 18,
            GgufType::BF16 => 32,
        }
    }
}

impl fmt::Display for GgufType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for GgufType {
    type Err = ModelError;

    /// Case-insensitive; `q4_k_m` is accepted as an alias of `q4_k` since that is the name
    /// llama.cpp users type.
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        let lower = if lower == "q4_k_m" { "q4_k".to_string() } else { lower };
        GgufType::ALL.into_iter().find(|t| t.as_str() == lower).ok_or_else(|| {
            let known: Vec<&str> = GgufType::ALL.iter().map(|t| t.as_str()).collect();
            ModelError::Config(format!("unknown GGUF type {s:?} (known: {})", known.join(", ")))
        })
    }
}

/// The GGML type a tensor of `shape` is stored as when `ty` is requested (see the module docs).
pub fn storage_type(ty: GgufType, shape: &[usize]) -> GgmlDType {
    if shape.len() != 2 {
        return GgmlDType::F32;
    }
    let cols = shape[1];
    let wanted = ty.ggml();
    if cols.is_multiple_of(wanted.block_size()) {
        wanted
    } else if cols.is_multiple_of(GgmlDType::Q8_0.block_size()) {
        GgmlDType::Q8_0
    } else {
        GgmlDType::F16
    }
}

/// GGML's on-disk type id (candle keeps its own mapping crate-private).
fn ggml_type_id(t: GgmlDType) -> u32 {
    match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

/// Bytes a tensor of `shape` occupies as `t` (unpadded).
fn tensor_nbytes(t: GgmlDType, shape: &[usize]) -> u64 {
    let elems: usize = shape.iter().product();
    (elems / t.block_size() * t.type_size()) as u64
}

fn padded(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}

/// The tensors of a Qwen2 checkpoint by Hugging Face name, with their shapes, in llama.cpp's
/// order (embedding, blocks in layer order, final norm, output). `lm_head` is listed only when
/// `with_lm_head`: tied checkpoints normally ship without one.
pub fn qwen2_tensors(cfg: &Qwen2Config, with_lm_head: bool) -> Vec<(String, Vec<usize>)> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let nq = cfg.num_attention_heads * cfg.head_dim;
    let nkv = cfg.num_key_value_heads * cfg.head_dim;
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let layer: [(&str, Vec<usize>); 12] = [
            ("input_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![nq, h]),
            ("self_attn.q_proj.bias", vec![nq]),
            ("self_attn.k_proj.weight", vec![nkv, h]),
            ("self_attn.k_proj.bias", vec![nkv]),
            ("self_attn.v_proj.weight", vec![nkv, h]),
            ("self_attn.v_proj.bias", vec![nkv]),
            ("self_attn.o_proj.weight", vec![h, nq]),
            ("post_attention_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ];
        out.extend(layer.into_iter().map(|(s, shape)| (format!("{p}.{s}"), shape)));
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if with_lm_head {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// A metadata value, limited to the types llama.cpp's Qwen2 converter writes.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    I32Array(Vec<i32>),
    StrArray(Vec<String>),
}

const GGUF_TYPE_U32: u32 = 4;
const GGUF_TYPE_I32: u32 = 5;
const GGUF_TYPE_F32: u32 = 6;
const GGUF_TYPE_BOOL: u32 = 7;
const GGUF_TYPE_STRING: u32 = 8;
const GGUF_TYPE_ARRAY: u32 = 9;

impl GgufValue {
    fn type_id(&self) -> u32 {
        match self {
            GgufValue::U32(_) => GGUF_TYPE_U32,
            GgufValue::F32(_) => GGUF_TYPE_F32,
            GgufValue::Bool(_) => GGUF_TYPE_BOOL,
            GgufValue::Str(_) => GGUF_TYPE_STRING,
            GgufValue::I32Array(_) | GgufValue::StrArray(_) => GGUF_TYPE_ARRAY,
        }
    }

    fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        match self {
            GgufValue::U32(v) => w.write_all(&v.to_le_bytes()),
            GgufValue::F32(v) => w.write_all(&v.to_le_bytes()),
            GgufValue::Bool(v) => w.write_all(&[u8::from(*v)]),
            GgufValue::Str(s) => write_str(w, s),
            GgufValue::I32Array(v) => {
                w.write_all(&GGUF_TYPE_I32.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
            }
            GgufValue::StrArray(v) => {
                w.write_all(&GGUF_TYPE_STRING.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|s| write_str(w, s))
            }
        }
    }
}

fn write_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// A `Write` that counts what passed through, for offsets and padding without `Seek`.
struct Counting<W> {
    inner: W,
    written: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<W: Write> Counting<W> {
    fn pad_to_alignment(&mut self) -> std::io::Result<()> {
        let pad = padded(self.written) - self.written;
        self.write_all(&[0u8; ALIGNMENT as usize][..pad as usize])
    }
}

/// What to write besides the tensors: the model's config, its name, optionally its tokenizer,
/// and the requested storage type.
pub struct GgufExport<'a> {
    pub config: &'a Qwen2Config,
    pub name: String,
    pub tokenizer: Option<&'a GgufTokenizerMeta>,
    pub ty: GgufType,
}

impl GgufExport<'_> {
    /// The metadata key/values in the order llama.cpp's `convert_hf_to_gguf.py` writes them.
    pub fn metadata(&self) -> Result<Vec<(String, GgufValue)>> {
        let c = self.config;
        let u32_of = |what: &str, v: usize| {
            u32::try_from(v).map_err(|_| ModelError::Config(format!("{what} {v} does not fit GGUF's u32")))
        };
        let mut m: Vec<(String, GgufValue)> = Vec::new();
        let mut put = |k: &str, v: GgufValue| m.push((k.to_string(), v));
        put("general.architecture", GgufValue::Str("qwen2".into()));
        put("general.name", GgufValue::Str(self.name.clone()));
        put("general.alignment", GgufValue::U32(ALIGNMENT as u32));
        put("qwen2.block_count", GgufValue::U32(u32_of("num_hidden_layers", c.num_hidden_layers)?));
        put("qwen2.context_length", GgufValue::U32(u32_of("max_position_embeddings", c.max_position_embeddings)?));
        put("qwen2.embedding_length", GgufValue::U32(u32_of("hidden_size", c.hidden_size)?));
        put("qwen2.feed_forward_length", GgufValue::U32(u32_of("intermediate_size", c.intermediate_size)?));
        put("qwen2.attention.head_count", GgufValue::U32(u32_of("num_attention_heads", c.num_attention_heads)?));
        put("qwen2.attention.head_count_kv", GgufValue::U32(u32_of("num_key_value_heads", c.num_key_value_heads)?));
        // Readers derive head_dim as hidden / heads; say it only when that would be wrong, as
        // llama.cpp does.
        if c.num_attention_heads == 0 || c.hidden_size / c.num_attention_heads != c.head_dim {
            let hd = GgufValue::U32(u32_of("head_dim", c.head_dim)?);
            put("qwen2.attention.key_length", hd.clone());
            put("qwen2.attention.value_length", hd);
        }
        put("qwen2.rope.freq_base", GgufValue::F32(c.rope.theta as f32));
        put("qwen2.attention.layer_norm_rms_epsilon", GgufValue::F32(c.rms_norm_eps as f32));
        match &c.rope.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                put("qwen2.rope.scaling.type", GgufValue::Str("linear".into()));
                put("qwen2.rope.scaling.factor", GgufValue::F32(*factor as f32));
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                put("qwen2.rope.scaling.type", GgufValue::Str("yarn".into()));
                put("qwen2.rope.scaling.factor", GgufValue::F32(*factor as f32));
                put(
                    "qwen2.rope.scaling.original_context_length",
                    GgufValue::U32(u32_of("original_max_position_embeddings", *original_max_position_embeddings)?),
                );
                // Only non-default betas are written, so readers that predate the keys agree.
                if *beta_fast != 32.0 {
                    put("qwen2.rope.scaling.yarn_beta_fast", GgufValue::F32(*beta_fast as f32));
                }
                if *beta_slow != 1.0 {
                    put("qwen2.rope.scaling.yarn_beta_slow", GgufValue::F32(*beta_slow as f32));
                }
                if let Some(a) = attention_factor {
                    put("qwen2.rope.scaling.attn_factor", GgufValue::F32(*a as f32));
                }
            }
        }
        // GGUF has one window for all layers; a per-layer pattern cannot be expressed, and
        // silently dropping or widening it would change the model.
        match c.sliding_window_layers.first().copied().flatten() {
            _ if c.sliding_window_layers.iter().all(Option::is_none) => {}
            Some(w) if c.sliding_window_layers.iter().all(|l| *l == Some(w)) => {
                put("qwen2.attention.sliding_window", GgufValue::U32(u32_of("sliding_window", w)?));
            }
            _ => {
                return Err(ModelError::Config(
                    "GGUF cannot express a sliding window on only some layers (max_window_layers); \
                     export with use_sliding_window false or on every layer"
                        .into(),
                ))
            }
        }
        put("general.file_type", GgufValue::U32(self.ty.file_type()));
        put("general.quantization_version", GgufValue::U32(2));

        let bos = self.tokenizer.and_then(|t| t.bos_token_id).or(c.bos_token_id);
        let eos = self.tokenizer.and_then(|t| t.eos_token_id).or_else(|| c.eos_token_ids.first().copied());
        if let Some(t) = self.tokenizer {
            if t.token_types.len() != t.tokens.len() {
                return Err(ModelError::Config(format!(
                    "tokenizer has {} tokens but {} token types",
                    t.tokens.len(),
                    t.token_types.len()
                )));
            }
            put("tokenizer.ggml.model", GgufValue::Str(t.model.clone()));
            if let Some(pre) = &t.pre {
                put("tokenizer.ggml.pre", GgufValue::Str(pre.clone()));
            }
            put("tokenizer.ggml.tokens", GgufValue::StrArray(t.tokens.clone()));
            put("tokenizer.ggml.token_type", GgufValue::I32Array(t.token_types.clone()));
            put("tokenizer.ggml.merges", GgufValue::StrArray(t.merges.clone()));
        }
        // Written even without a tokenizer: they are the only place GGUF keeps the stop ids, and
        // flint reads its eos from here.
        if let Some(b) = bos {
            put("tokenizer.ggml.bos_token_id", GgufValue::U32(b));
        }
        if let Some(e) = eos {
            put("tokenizer.ggml.eos_token_id", GgufValue::U32(e));
        }
        if let Some(t) = self.tokenizer {
            // tokenizer_config.json's pad token when known (Qwen: <|endoftext|>), else eos.
            if let Some(p) = t.padding_token_id.or(eos) {
                put("tokenizer.ggml.padding_token_id", GgufValue::U32(p));
            }
            put("tokenizer.ggml.add_bos_token", GgufValue::Bool(false));
            if let Some(tpl) = &t.chat_template {
                put("tokenizer.chat_template", GgufValue::Str(tpl.clone()));
            }
        }
        Ok(m)
    }

    /// Write the GGUF file at `path`. `tensors` lists Hugging Face names and shapes in file order;
    /// `produce` is called once per tensor, in that order, for its data (any float dtype). Returns
    /// the bytes written.
    ///
    /// The file is written as `<path>.partial` and renamed when complete, so an interrupted export
    /// never leaves a truncated `.gguf` that a later `--model` would pick up.
    pub fn write_file(
        &self,
        path: &Path,
        tensors: &[(String, Vec<usize>)],
        produce: impl FnMut(&str) -> Result<Tensor>,
    ) -> Result<u64> {
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let result = (|| {
            let file = File::create(&partial).map_err(|e| ModelError::io(&partial, e))?;
            let mut w = BufWriter::with_capacity(1 << 20, file);
            let n = self.write(&mut w, tensors, produce).map_err(|e| e.in_file(path))?;
            let file = w.into_inner().map_err(|e| ModelError::io(&partial, e.into_error()))?;
            file.sync_all().map_err(|e| ModelError::io(&partial, e))?;
            std::fs::rename(&partial, path).map_err(|e| ModelError::io(path, e))?;
            Ok(n)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        result
    }

    /// Write the GGUF stream to `w` (see [`GgufExport::write_file`]).
    pub fn write<W: Write>(
        &self,
        w: W,
        tensors: &[(String, Vec<usize>)],
        mut produce: impl FnMut(&str) -> Result<Tensor>,
    ) -> Result<u64> {
        let metadata = self.metadata()?;
        let mut w = Counting { inner: w, written: 0 };
        let io = |e: std::io::Error| ModelError::Config(format!("writing GGUF: {e}"));

        // Plan every tensor's name, type and offset before writing a byte of data.
        let mut plan = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for (hf, shape) in tensors {
            let name = hf_to_gguf_name(hf);
            if name == *hf {
                return Err(ModelError::Config(format!("tensor `{hf}` has no llama.cpp Qwen2 name")));
            }
            if shape.is_empty() || shape.len() > 4 {
                return Err(ModelError::Config(format!("tensor `{hf}`: GGUF needs 1 to 4 dims, got {shape:?}")));
            }
            let ty = storage_type(self.ty, shape);
            let nbytes = tensor_nbytes(ty, shape);
            plan.push((hf.as_str(), name, shape.as_slice(), ty, offset, nbytes));
            offset += padded(nbytes);
        }

        w.write_all(b"GGUF").map_err(io)?;
        w.write_all(&3u32.to_le_bytes()).map_err(io)?;
        w.write_all(&(plan.len() as u64).to_le_bytes()).map_err(io)?;
        w.write_all(&(metadata.len() as u64).to_le_bytes()).map_err(io)?;
        for (key, value) in &metadata {
            write_str(&mut w, key).map_err(io)?;
            w.write_all(&value.type_id().to_le_bytes()).map_err(io)?;
            value.write(&mut w).map_err(io)?;
        }
        for (_, name, shape, ty, offset, _) in &plan {
            write_str(&mut w, name).map_err(io)?;
            w.write_all(&(shape.len() as u32).to_le_bytes()).map_err(io)?;
            // GGML orders dims innermost first.
            for &d in shape.iter().rev() {
                w.write_all(&(d as u64).to_le_bytes()).map_err(io)?;
            }
            w.write_all(&ggml_type_id(*ty).to_le_bytes()).map_err(io)?;
            w.write_all(&offset.to_le_bytes()).map_err(io)?;
        }
        w.pad_to_alignment().map_err(io)?;

        let data_start = w.written;
        for (hf, _, shape, ty, offset, nbytes) in &plan {
            let bad = |msg: String| ModelError::Config(format!("tensor `{hf}`: {msg}"));
            let t = produce(hf)?;
            if t.dims() != *shape {
                return Err(bad(format!("produced shape {:?}, expected {shape:?}", t.dims())));
            }
            debug_assert_eq!(w.written - data_start, *offset);
            let before = w.written;
            write_tensor(&mut w, &t, *ty).map_err(|e| bad(e.to_string()))?;
            if w.written - before != *nbytes {
                return Err(bad(format!("wrote {} bytes, expected {nbytes}", w.written - before)));
            }
            w.pad_to_alignment().map_err(io)?;
        }
        w.flush().map_err(io)?;
        Ok(w.written)
    }
}

/// Convert `t` to `ty` and write its bytes (unpadded).
fn write_tensor<W: Write>(w: &mut W, t: &Tensor, ty: GgmlDType) -> Result<()> {
    let io = |e: std::io::Error| ModelError::Config(format!("write failed: {e}"));
    let t = t.to_dtype(DType::F32)?;
    match ty {
        GgmlDType::F32 => write_floats(w, &t.flatten_all()?.to_vec1::<f32>()?, |x| x.to_le_bytes()).map_err(io),
        GgmlDType::F16 => {
            write_floats(w, &t.flatten_all()?.to_vec1::<f32>()?, |x| f16::from_f32(x).to_le_bytes()).map_err(io)
        }
        GgmlDType::BF16 => {
            write_floats(w, &t.flatten_all()?.to_vec1::<f32>()?, |x| bf16::from_f32(x).to_le_bytes()).map_err(io)
        }
        q => {
            for part in quantize_rows(&t, q)? {
                w.write_all(&part).map_err(io)?;
            }
            Ok(())
        }
    }
}

/// Write `xs` converted element-wise to little-endian bytes, through a fixed-size buffer.
pub(crate) fn write_floats<W: Write, const N: usize>(
    w: &mut W,
    xs: &[f32],
    conv: impl Fn(f32) -> [u8; N],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(N * 16384);
    for chunk in xs.chunks(16384) {
        buf.clear();
        buf.extend(chunk.iter().flat_map(|&x| conv(x)));
        w.write_all(&buf)?;
    }
    Ok(())
}

/// Quantize a 2-D tensor on every core: blocks never straddle rows, so quantizing row ranges
/// separately and concatenating yields exactly the bytes of quantizing the whole (candle's
/// quantizer is single-threaded, and Q4_K of a 7B model would otherwise take many minutes).
fn quantize_rows(t: &Tensor, ty: GgmlDType) -> Result<Vec<Vec<u8>>> {
    let (rows, cols) = t.dims2()?;
    // Owned row-major data: candle's quantizer reads a tensor's whole storage, ignoring any
    // view offset, so each thread gets a fresh tensor of exactly its rows.
    let data = t.flatten_all()?.to_vec1::<f32>()?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(rows).max(1);
    let per = rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = data
            .chunks(per * cols.max(1))
            .map(|chunk| {
                s.spawn(move || -> Result<Vec<u8>> {
                    let part = Tensor::from_slice(chunk, (chunk.len() / cols.max(1), cols), &Device::Cpu)?;
                    Ok(QTensor::quantize(&part, ty)?.data()?.into_owned())
                })
            })
            .collect();
        // Join every thread before looking at any result, so one failure cannot leave others
        // unjoined (which would turn an error into a panic of the scope).
        let joined: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        joined.into_iter().map(|r| r.map_err(|_| ModelError::Config("quantization thread panicked".into()))?).collect()
    })
}

/// Convert an opened checkpoint to a GGUF file at `out`, tensor by tensor (each is loaded as
/// f32 only when it is written). A tied checkpoint that nevertheless ships `lm_head.weight`
/// keeps it as `output.weight`, matching what flint's loader would use. Returns the bytes written.
pub fn export_checkpoint(
    src: &WeightSource,
    cfg: &Qwen2Config,
    out: &Path,
    ty: GgufType,
    tokenizer: Option<&GgufTokenizerMeta>,
    name: &str,
) -> Result<u64> {
    let with_head = !cfg.tie_word_embeddings || src.contains("lm_head.weight");
    let tensors = qwen2_tensors(cfg, with_head);
    let export = GgufExport { config: cfg, name: name.to_string(), tokenizer, ty };
    let shapes: std::collections::HashMap<&str, &[usize]> =
        tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    export.write_file(out, &tensors, |hf| {
        let shape = shapes.get(hf).copied().unwrap_or(&[]);
        src.get_dense(hf, shape, DType::F32, &Device::Cpu)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::config_from_gguf;
    use crate::source::Checkpoint;
    use crate::weights::Weight;

    fn golden_small() -> String {
        format!("{}/../../fixtures/golden/small-f32", env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn type_names_round_trip() {
        for t in GgufType::ALL {
            assert_eq!(t.to_string().parse::<GgufType>().unwrap(), t);
        }
        assert_eq!("Q4_K_M".parse::<GgufType>().unwrap(), GgufType::Q4_K);
        let e = "q3_k".parse::<GgufType>().unwrap_err().to_string();
        assert!(e.contains("q3_k") && e.contains("q8_0"), "{e}");
    }

    #[test]
    fn fallback_rules() {
        // 1-D stays F32 whatever was asked.
        assert_eq!(storage_type(GgufType::Q4_K, &[896]), GgmlDType::F32);
        assert_eq!(storage_type(GgufType::F16, &[896]), GgmlDType::F32);
        // Qwen2.5-0.5B's hidden 896 is not a multiple of 256: Q4_K rows fall back to Q8_0.
        assert_eq!(storage_type(GgufType::Q4_K, &[4864, 896]), GgmlDType::Q8_0);
        assert_eq!(storage_type(GgufType::Q6_K, &[896, 4864]), GgmlDType::Q6K);
        assert_eq!(storage_type(GgufType::Q4_0, &[64, 48]), GgmlDType::F16);
        assert_eq!(storage_type(GgufType::BF16, &[64, 48]), GgmlDType::BF16);
    }

    #[test]
    fn parallel_quantization_matches_whole() {
        let t = Tensor::randn(0f32, 1.0, (37, 512), &Device::Cpu).unwrap();
        for ty in [GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K] {
            let whole = QTensor::quantize(&t, ty).unwrap().data().unwrap().into_owned();
            assert_eq!(quantize_rows(&t, ty).unwrap().concat(), whole);
        }
    }

    #[test]
    fn metadata_for_yarn_and_tokenizer() {
        let mut cfg = Checkpoint::open(&golden_small()).unwrap().config;
        cfg.rope.scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 256,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        };
        let tok = GgufTokenizerMeta {
            model: "gpt2".into(),
            pre: Some("qwen2".into()),
            tokens: vec!["a".into(), "b".into()],
            token_types: vec![1, 3],
            merges: vec!["a b".into()],
            bos_token_id: None,
            eos_token_id: Some(1),
            padding_token_id: None,
            chat_template: Some("{{ x }}".into()),
        };
        let export = GgufExport { config: &cfg, name: "t".into(), tokenizer: Some(&tok), ty: GgufType::Q8_0 };
        let m: std::collections::HashMap<String, GgufValue> = export.metadata().unwrap().into_iter().collect();
        assert_eq!(m["qwen2.rope.scaling.type"], GgufValue::Str("yarn".into()));
        assert_eq!(m["qwen2.rope.scaling.original_context_length"], GgufValue::U32(256));
        assert_eq!(m["general.file_type"], GgufValue::U32(7));
        assert_eq!(m["tokenizer.ggml.eos_token_id"], GgufValue::U32(1));
        assert_eq!(m["tokenizer.ggml.padding_token_id"], GgufValue::U32(1));
        assert_eq!(m["tokenizer.ggml.bos_token_id"], GgufValue::U32(1), "falls back to config.json's bos");
        assert_eq!(m["tokenizer.ggml.add_bos_token"], GgufValue::Bool(false));
        assert!(!m.contains_key("qwen2.attention.key_length"));

        cfg.sliding_window_layers[1] = Some(64);
        let export = GgufExport { config: &cfg, name: "t".into(), tokenizer: None, ty: GgufType::F32 };
        assert!(export.metadata().is_err(), "a per-layer window cannot be expressed");
    }

    /// Every export type of the golden small model reopens with the same geometry and the
    /// requested tensor types; F32 is bit-identical to the safetensors, F16/BF16 are its rounding.
    #[test]
    fn golden_small_round_trips_every_type() {
        let ck = Checkpoint::open(&golden_small()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let dev = Device::Cpu;
        for ty in GgufType::ALL {
            let path = dir.path().join(format!("model-{ty}.gguf"));
            let n = export_checkpoint(&ck.weights, &ck.config, &path, ty, None, "golden-small").unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().len(), n);
            let g = Checkpoint::open(path.to_str().unwrap()).unwrap();
            let gw = g.gguf().unwrap();
            let mut got = config_from_gguf(&gw.content).unwrap();
            assert!((got.rms_norm_eps - ck.config.rms_norm_eps).abs() < 1e-12, "{}", got.rms_norm_eps);
            got.rms_norm_eps = ck.config.rms_norm_eps;
            got.torch_dtype = ck.config.torch_dtype.clone();
            assert_eq!(got, ck.config, "{ty}");

            for (name, shape) in qwen2_tensors(&ck.config, true) {
                let info = &gw.content.tensor_infos[&hf_to_gguf_name(&name)];
                assert_eq!(info.shape.dims(), shape.as_slice(), "{name}");
                let want = if shape.len() == 1 { GgmlDType::F32 } else { ty.ggml() };
                assert_eq!(info.ggml_dtype, want, "{ty} {name}");
                let orig = ck.weights.get_dense(&name, &shape, DType::F32, &dev).unwrap();
                let orig = orig.flatten_all().unwrap();
                let back = match g.weights.get(&name, &shape, DType::F32, &dev).unwrap() {
                    Weight::Dense(t) => t,
                    Weight::Quantized(q) => q.dequantize(&dev).unwrap(),
                };
                let back = back.flatten_all().unwrap();
                let expect = match (ty, shape.len()) {
                    (_, 1) | (GgufType::F32, _) => orig.clone(),
                    (GgufType::F16, _) => orig.to_dtype(DType::F16).unwrap().to_dtype(DType::F32).unwrap(),
                    (GgufType::BF16, _) => orig.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap(),
                    _ => {
                        let err = (&back - &orig).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                        let scale = orig.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                        assert!(err <= 0.2 * scale, "{ty} {name}: max error {err} vs max {scale}");
                        continue;
                    }
                };
                let (a, b) = (expect.to_vec1::<f32>().unwrap(), back.to_vec1::<f32>().unwrap());
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{ty} {name} differs");
            }
        }
    }

    #[test]
    fn wrong_produced_shape_is_an_error_and_leaves_no_file() {
        let ck = Checkpoint::open(&golden_small()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.gguf");
        let export = GgufExport { config: &ck.config, name: "x".into(), tokenizer: None, ty: GgufType::F32 };
        let tensors = qwen2_tensors(&ck.config, true);
        let e = export
            .write_file(&path, &tensors, |_| Ok(Tensor::zeros(3, DType::F32, &Device::Cpu)?))
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.embed_tokens.weight"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
