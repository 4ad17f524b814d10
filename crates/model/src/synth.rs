//! Random-weight checkpoints with the exact geometry of real Qwen2 models, for load, memory and
//! throughput testing without downloading gigabytes (and for machines that cannot reach the hub).
//!
//! Weights are a pure function of (seed, tensor name, element index): a counter-based generator
//! (SplitMix64) is evaluated at each index, so any slice of any tensor can be generated
//! independently, in parallel, in any chunking, and the safetensors and GGUF outputs of one shape
//! and seed hold the same numbers. Checkpoints are streamed to disk; memory stays around one
//! generation block (safetensors) or one tensor (GGUF, whose quantizer needs whole rows).
//!
//! Scales were chosen so activations stay O(1) through 28 layers and the logits are a spread-out
//! distribution rather than a one-hot, which keeps sampling code paths meaningful:
//! - every matrix (embedding and `lm_head` included) ~ N(0, 1/fan_in), fan_in = its row length,
//!   so a unit-RMS input gives unit-variance outputs and tied or untied logits have std ≈ 1
//!   (an embedding of std 1 would give tied logits of std √hidden ≈ 30–60);
//! - q/k/v biases ~ N(0, 0.5²), so the bias path visibly matters;
//! - RMSNorm weights 1 + N(0, 0.05²).
//!
//! Normal deviates are approximated by a sum of four 16-bit uniforms (Irwin–Hall, rescaled to unit
//! variance, bounded at ±3.46σ): one 64-bit hash per value, fast enough for 7.6e9 values.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::config::{Qwen2Config, RopeConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::gguf::GgufTokenizerMeta;
use crate::gguf_export::{qwen2_tensors, write_floats, GgufExport, GgufType};
use crate::kernels::pool;

/// The shapes [`shape_config`] knows.
pub const SHAPES: &[&str] = &["tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "deepseek-r1-distill-qwen-1.5b"];

/// Hugging Face's shard size for `save_pretrained`-style checkpoints (decimal GB, as HF counts).
pub const SHARD_BYTES: u64 = 4_000_000_000;

/// One real model's geometry, plus what its hub files say beyond [`Qwen2Config`].
struct ShapeSpec {
    name: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
    tied: bool,
    theta: f64,
    max_position: usize,
    bos: u32,
    eos: u32,
    /// generation_config.json's `eos_token_id` list.
    generation_eos: &'static [u32],
    extras: HubExtras,
}

const QWEN25_GEN_EOS: &[u32] = &[151645, 151643];

const SPECS: &[ShapeSpec] = &[
    ShapeSpec {
        name: "tiny",
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 128,
        vocab: 151936,
        tied: true,
        theta: 1e6,
        max_position: 4096,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: HubExtras { sliding_window: 4096, max_window_layers: 2 },
    },
    ShapeSpec {
        name: "qwen2.5-0.5b",
        layers: 24,
        hidden: 896,
        heads: 14,
        kv_heads: 2,
        head_dim: 64,
        ffn: 4864,
        vocab: 151936,
        tied: true,
        theta: 1e6,
        max_position: 32768,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: HubExtras { sliding_window: 32768, max_window_layers: 21 },
    },
    ShapeSpec {
        name: "qwen2.5-1.5b",
        layers: 28,
        hidden: 1536,
        heads: 12,
        kv_heads: 2,
        head_dim: 128,
        ffn: 8960,
        vocab: 151936,
        tied: true,
        theta: 1e6,
        max_position: 32768,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: HubExtras { sliding_window: 32768, max_window_layers: 21 },
    },
    ShapeSpec {
        name: "qwen2.5-7b",
        layers: 28,
        hidden: 3584,
        heads: 28,
        kv_heads: 4,
        head_dim: 128,
        ffn: 18944,
        vocab: 152064,
        tied: false,
        theta: 1e6,
        max_position: 32768,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: HubExtras { sliding_window: 131072, max_window_layers: 28 },
    },
    ShapeSpec {
        name: "deepseek-r1-distill-qwen-1.5b",
        layers: 28,
        hidden: 1536,
        heads: 12,
        kv_heads: 2,
        head_dim: 128,
        ffn: 8960,
        vocab: 151936,
        tied: false,
        theta: 1e4,
        max_position: 131072,
        bos: 151646,
        eos: 151643,
        generation_eos: &[151643],
        extras: HubExtras { sliding_window: 4096, max_window_layers: 21 },
    },
];

fn spec(name: &str) -> Result<&'static ShapeSpec> {
    SPECS
        .iter()
        .find(|s| s.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| ModelError::Config(format!("unknown model shape {name:?} (known: {})", SHAPES.join(", "))))
}

/// The config of a known shape (see [`SHAPES`]); `torch_dtype` is "bfloat16" as the real ones.
pub fn shape_config(name: &str) -> Result<Qwen2Config> {
    let s = spec(name)?;
    Ok(Qwen2Config {
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        intermediate_size: s.ffn,
        num_hidden_layers: s.layers,
        num_attention_heads: s.heads,
        num_key_value_heads: s.kv_heads,
        head_dim: s.head_dim,
        max_position_embeddings: s.max_position,
        rms_norm_eps: 1e-6,
        rope: RopeConfig { theta: s.theta, scaling: RopeScaling::None },
        tie_word_embeddings: s.tied,
        // Every shape ships `use_sliding_window: false`: no layer slides.
        sliding_window_layers: vec![None; s.layers],
        bos_token_id: Some(s.bos),
        eos_token_ids: vec![s.eos],
        torch_dtype: Some("bfloat16".into()),
    })
}

/// What a hub config.json carries that [`Qwen2Config`] normalises away: the window a model
/// declares even when `use_sliding_window` is false (DeepSeek-R1-Distill's 4096, for instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HubExtras {
    pub sliding_window: usize,
    pub max_window_layers: usize,
}

/// The [`HubExtras`] of a known shape.
pub fn shape_extras(name: &str) -> Result<HubExtras> {
    Ok(spec(name)?.extras)
}

/// `config.json` in the classic hub layout (what `save_pretrained` of transformers 4.x writes for
/// Qwen2), readable by both flint and transformers. When `cfg` has sliding layers they override
/// `extras`; a pattern that is not "every layer from k on" is spelled out as `layer_types`.
pub fn config_json(cfg: &Qwen2Config, extras: &HubExtras) -> Value {
    let first_sliding = cfg.sliding_window_layers.iter().position(Option::is_some);
    let window = cfg.sliding_window_layers.iter().flatten().next().copied();
    let mut v = json!({
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": match cfg.eos_token_ids.as_slice() {
            [one] => json!(one),
            many => json!(many),
        },
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": first_sliding.unwrap_or(extras.max_window_layers),
        "model_type": "qwen2",
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": rope_scaling_json(&cfg.rope.scaling),
        "rope_theta": cfg.rope.theta,
        "sliding_window": window.unwrap_or(extras.sliding_window),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.torch_dtype.as_deref().unwrap_or("float32"),
        "use_cache": true,
        "use_sliding_window": window.is_some(),
        "vocab_size": cfg.vocab_size,
    });
    if let Value::Object(m) = &mut v {
        if cfg.num_attention_heads == 0 || cfg.hidden_size / cfg.num_attention_heads != cfg.head_dim {
            m.insert("head_dim".into(), json!(cfg.head_dim));
        }
        let is_suffix = first_sliding.is_some_and(|k| cfg.sliding_window_layers[k..].iter().all(|l| *l == window));
        if window.is_some() && !is_suffix {
            let types: Vec<&str> = cfg
                .sliding_window_layers
                .iter()
                .map(|l| if l.is_some() { "sliding_attention" } else { "full_attention" })
                .collect();
            m.insert("layer_types".into(), json!(types));
        }
    }
    v
}

fn rope_scaling_json(s: &RopeScaling) -> Value {
    match s {
        RopeScaling::None => Value::Null,
        RopeScaling::Linear { factor } => json!({"type": "linear", "rope_type": "linear", "factor": factor}),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            mscale,
            mscale_all_dim,
            truncate,
        } => {
            let mut v = json!({
                "type": "yarn",
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": original_max_position_embeddings,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
            });
            if let Value::Object(m) = &mut v {
                let optional =
                    [("attention_factor", attention_factor), ("mscale", mscale), ("mscale_all_dim", mscale_all_dim)];
                for (k, x) in optional {
                    if let Some(x) = x {
                        m.insert(k.into(), json!(x));
                    }
                }
                if !truncate {
                    m.insert("truncate".into(), json!(false));
                }
            }
            v
        }
    }
}

fn generation_config_json(cfg: &Qwen2Config, eos: &[u32]) -> Value {
    json!({
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.eos_token_ids.last().copied().or(cfg.bos_token_id),
    })
}

// ---------------------------------------------------------------------------------------------
// Deterministic weights

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser: a bijective 64-bit mix with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of the tensor name: spelled out because std's hashers may change between Rust
/// releases, and the weights of a seed must not.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3))
}

fn tensor_key(name: &str, seed: u64) -> u64 {
    mix64(seed ^ mix64(name_hash(name)))
}

/// Mean and standard deviation of a tensor's values (see the module docs for why).
fn init_for(name: &str, shape: &[usize]) -> (f32, f32) {
    if name.ends_with("layernorm.weight") || name.ends_with("norm.weight") {
        (1.0, 0.05)
    } else if name.ends_with(".bias") {
        (0.0, 0.5)
    } else if shape.len() >= 2 {
        let fan_in = shape.last().copied().unwrap_or(1).max(1);
        (0.0, 1.0 / (fan_in as f32).sqrt())
    } else {
        (0.0, 0.02)
    }
}

/// Fill `out` with elements `start..start + out.len()` of the tensor keyed `key`.
fn fill(out: &mut [f32], key: u64, start: u64, (mean, std): (f32, f32)) {
    // Sum of four U[0,1) has mean 2 and variance 1/3.
    let scale = std * 3f32.sqrt() / 65536.0;
    let offset = mean - 2.0 * std * 3f32.sqrt();
    let mut ctr = key.wrapping_add(start.wrapping_mul(GOLDEN_GAMMA));
    for x in out {
        ctr = ctr.wrapping_add(GOLDEN_GAMMA);
        let r = mix64(ctr);
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        *x = s as f32 * scale + offset;
    }
}

/// [`fill`] on the kernel threads; the result does not depend on how the work is split.
fn fill_parallel(out: &mut [f32], key: u64, start: u64, init: (f32, f32)) {
    let per = out.len().div_ceil(pool::threads()).max(1 << 16);
    pool::run_chunks(out, per, |i, chunk| fill(chunk, key, start + (i * per) as u64, init));
}

/// The f32 weights of tensor `name` (a Hugging Face name) for `seed`, as [`synth`] writes them.
pub fn synth_tensor(name: &str, shape: &[usize], seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut data = vec![0f32; n];
    fill_parallel(&mut data, tensor_key(name, seed), 0, init_for(name, shape));
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

// ---------------------------------------------------------------------------------------------
// Writing checkpoints

/// What to synthesise and where.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// One of [`SHAPES`].
    pub shape: String,
    /// Output directory; must be absent or empty.
    pub out: PathBuf,
    /// Safetensors dtype: F32, BF16 or F16 (ignored for GGUF).
    pub dtype: DType,
    /// Write `out/model-<type>.gguf` instead of a safetensors checkpoint.
    pub gguf: Option<GgufType>,
    pub seed: u64,
    /// Copied verbatim beside a safetensors checkpoint.
    pub tokenizer_json: Option<Vec<u8>>,
    pub tokenizer_config_json: Option<Vec<u8>>,
    /// Tokenizer metadata embedded in a GGUF output.
    pub gguf_tokenizer: Option<GgufTokenizerMeta>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthReport {
    pub files: Vec<PathBuf>,
    pub total_bytes: u64,
    pub parameters: u64,
}

/// Write a random-weight checkpoint of `opts.shape` into `opts.out`.
///
/// Safetensors output is a hub-style directory (config.json, generation_config.json, the
/// tokenizer files when given, and `model.safetensors` or ~4 GB shards plus an index). GGUF
/// output is a directory holding only `model-<type>.gguf`: a config.json beside it would make the
/// loader treat the directory as safetensors.
///
/// `out` must be absent or empty, so leftovers of an earlier run (stale shards, a config.json
/// beside a GGUF) can never mix into what the loader then reads.
pub fn synth(opts: &SynthOptions) -> Result<SynthReport> {
    let mut cfg = shape_config(&opts.shape)?;
    let s = spec(&opts.shape)?;
    let out = opts.out.as_path();
    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
    if std::fs::read_dir(out).map_err(|e| ModelError::io(out, e))?.next().is_some() {
        return Err(ModelError::Config(format!("{}: output directory is not empty", out.display())));
    }
    let tensors = qwen2_tensors(&cfg, !cfg.tie_word_embeddings);
    let parameters: u64 = tensors.iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum();

    if let Some(ty) = opts.gguf {
        let path = out.join(format!("model-{ty}.gguf"));
        let export = GgufExport { config: &cfg, name: s.name.to_string(), tokenizer: opts.gguf_tokenizer.as_ref(), ty };
        let shapes: HashMap<&str, &[usize]> = tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
        let bytes = export.write_file(&path, &tensors, |name| {
            synth_tensor(name, shapes.get(name).copied().unwrap_or(&[]), opts.seed)
        })?;
        return Ok(SynthReport { files: vec![path], total_bytes: bytes, parameters });
    }

    cfg.torch_dtype = Some(torch_dtype_name(opts.dtype)?.to_string());
    let mut files = Vec::new();
    let mut total_bytes = 0;
    let mut put = |name: &str, bytes: &[u8]| -> Result<()> {
        let path = out.join(name);
        std::fs::write(&path, bytes).map_err(|e| ModelError::io(&path, e))?;
        total_bytes += bytes.len() as u64;
        files.push(path);
        Ok(())
    };
    put("config.json", pretty(&config_json(&cfg, &s.extras)).as_bytes())?;
    put("generation_config.json", pretty(&generation_config_json(&cfg, s.generation_eos)).as_bytes())?;
    if let Some(t) = &opts.tokenizer_json {
        put("tokenizer.json", t)?;
    }
    if let Some(t) = &opts.tokenizer_config_json {
        put("tokenizer_config.json", t)?;
    }
    let (weight_files, weight_bytes) = write_safetensors(out, &tensors, opts.dtype, opts.seed, SHARD_BYTES)?;
    files.extend(weight_files);
    Ok(SynthReport { files, total_bytes: total_bytes + weight_bytes, parameters })
}

fn pretty(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    s.push('\n');
    s
}

fn torch_dtype_name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("float32"),
        DType::BF16 => Ok("bfloat16"),
        DType::F16 => Ok("float16"),
        other => Err(ModelError::Config(format!("safetensors dtype {other:?} is not supported (f32, bf16, f16)"))),
    }
}

fn safetensors_dtype(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("F32"),
        DType::BF16 => Ok("BF16"),
        DType::F16 => Ok("F16"),
        other => Err(ModelError::Config(format!("safetensors dtype {other:?} is not supported (f32, bf16, f16)"))),
    }
}

/// Write `tensors` as one `model.safetensors`, or as `model-0000i-of-0000N.safetensors` shards of
/// at most `shard_bytes` (a larger tensor gets a shard of its own) plus
/// `model.safetensors.index.json`, as transformers' `save_pretrained` does. Returns the files
/// written and their total size.
fn write_safetensors(
    dir: &Path,
    tensors: &[(String, Vec<usize>)],
    dtype: DType,
    seed: u64,
    shard_bytes: u64,
) -> Result<(Vec<PathBuf>, u64)> {
    let st_dtype = safetensors_dtype(dtype)?;
    let elem = dtype.size_in_bytes() as u64;
    let size = |shape: &[usize]| shape.iter().product::<usize>() as u64 * elem;

    let mut shards: Vec<Vec<&(String, Vec<usize>)>> = Vec::new();
    let (mut shard, mut current) = (Vec::new(), 0u64);
    for t in tensors {
        let n = size(&t.1);
        if !shard.is_empty() && current + n > shard_bytes {
            shards.push(std::mem::take(&mut shard));
            current = 0;
        }
        shard.push(t);
        current += n;
    }
    shards.push(shard);

    let count = shards.len();
    let names: Vec<String> = if count == 1 {
        vec!["model.safetensors".to_string()]
    } else {
        (1..=count).map(|i| format!("model-{i:05}-of-{count:05}.safetensors")).collect()
    };
    let mut files = Vec::new();
    let mut total = 0u64;
    let mut weight_map = serde_json::Map::new();
    for (shard, file_name) in shards.iter().zip(&names) {
        let path = dir.join(file_name);
        total += write_shard(&path, shard, dtype, st_dtype, seed)?;
        files.push(path);
        for (name, _) in shard.iter() {
            weight_map.insert(name.clone(), json!(file_name));
        }
    }
    if count > 1 {
        let tensor_bytes: u64 = tensors.iter().map(|(_, s)| size(s)).sum();
        let index = pretty(&json!({"metadata": {"total_size": tensor_bytes}, "weight_map": weight_map}));
        let path = dir.join("model.safetensors.index.json");
        std::fs::write(&path, &index).map_err(|e| ModelError::io(&path, e))?;
        total += index.len() as u64;
        files.push(path);
    }
    Ok((files, total))
}

/// Elements generated per step when streaming a tensor: big enough to keep every core busy,
/// small enough (16 MiB) that memory does not grow with the model.
const STREAM_BLOCK: usize = 1 << 22;

/// One safetensors file, header first, then each tensor generated block by block.
fn write_shard(path: &Path, tensors: &[&(String, Vec<usize>)], dtype: DType, st_dtype: &str, seed: u64) -> Result<u64> {
    let elem = dtype.size_in_bytes();
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, shape) in tensors {
        let n = shape.iter().product::<usize>() * elem;
        header.insert(name.clone(), json!({"dtype": st_dtype, "shape": shape, "data_offsets": [offset, offset + n]}));
        offset += n;
    }
    let mut header = Value::Object(header).to_string().into_bytes();
    // safetensors pads the header with spaces so the data starts 8-byte aligned.
    header.resize(header.len().div_ceil(8) * 8, b' ');

    let io = |e: std::io::Error| ModelError::io(path, e);
    let file = File::create(path).map_err(io)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&header).map_err(io)?;
    let mut buf = vec![0f32; STREAM_BLOCK];
    for (name, shape) in tensors {
        let n: usize = shape.iter().product();
        let (key, init) = (tensor_key(name, seed), init_for(name, shape));
        let mut start = 0;
        while start < n {
            let len = STREAM_BLOCK.min(n - start);
            let block = &mut buf[..len];
            fill_parallel(block, key, start as u64, init);
            match dtype {
                DType::BF16 => write_floats(&mut w, block, |x| half::bf16::from_f32(x).to_le_bytes()),
                DType::F16 => write_floats(&mut w, block, |x| half::f16::from_f32(x).to_le_bytes()),
                _ => write_floats(&mut w, block, |x| x.to_le_bytes()),
            }
            .map_err(io)?;
            start += len;
        }
    }
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(8 + header.len() as u64 + offset as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{ForwardBatch, LogitsRows};
    use crate::kv_cache::ContiguousKvCache;
    use crate::qwen2::Qwen2Model;
    use crate::source::Checkpoint;

    fn opts(out: &Path, dtype: DType, gguf: Option<GgufType>, seed: u64) -> SynthOptions {
        SynthOptions {
            shape: "tiny".into(),
            out: out.to_path_buf(),
            dtype,
            gguf,
            seed,
            tokenizer_json: None,
            tokenizer_config_json: None,
            gguf_tokenizer: None,
        }
    }

    /// Load and run one 3-token prefill; logits must be finite and `[3, vocab]`.
    fn forward_is_finite(spec: &str) -> Qwen2Config {
        let ck = Checkpoint::open(spec).unwrap();
        let cfg = ck.config.clone();
        let model = Qwen2Model::load(&cfg, &ck.weights, DType::F32, &Device::Cpu).unwrap();
        let mut cache = ContiguousKvCache::for_config(&cfg, DType::F32, &Device::Cpu);
        let mut batch = ForwardBatch::new();
        batch.push(0, 0, &[9707, 11, 151643], LogitsRows::All);
        let logits = model.forward(&batch, &mut cache).unwrap().unwrap();
        assert_eq!(logits.dims(), &[3, cfg.vocab_size]);
        let v = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{spec}: non-finite logits");
        let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!(std > 0.1 && std < 20.0, "{spec}: logit rms {std}");
        cfg
    }

    #[test]
    fn shapes_round_trip_through_config_json() {
        for name in SHAPES {
            let cfg = shape_config(name).unwrap();
            let text = config_json(&cfg, &shape_extras(name).unwrap()).to_string();
            assert_eq!(Qwen2Config::from_json_str(&text).unwrap(), cfg, "{name}");
        }
        let mut cfg = shape_config("qwen2.5-7b").unwrap();
        let extras = shape_extras("qwen2.5-7b").unwrap();
        cfg.rope.scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: Some(1.1),
            mscale: None,
            mscale_all_dim: None,
            truncate: false,
        };
        cfg.sliding_window_layers = (0..28).map(|l| (l >= 20).then_some(4096)).collect();
        let text = config_json(&cfg, &extras).to_string();
        assert_eq!(Qwen2Config::from_json_str(&text).unwrap(), cfg);
        cfg.rope.scaling = RopeScaling::Linear { factor: 2.0 };
        cfg.sliding_window_layers = (0..28).map(|l| (l % 2 == 0).then_some(512)).collect();
        cfg.head_dim = 64;
        let text = config_json(&cfg, &extras).to_string();
        assert_eq!(Qwen2Config::from_json_str(&text).unwrap(), cfg);
    }

    #[test]
    fn r1_distill_keeps_its_unused_window() {
        let cfg = shape_config("DeepSeek-R1-Distill-Qwen-1.5B").unwrap();
        let v = config_json(&cfg, &shape_extras("deepseek-r1-distill-qwen-1.5b").unwrap());
        assert_eq!(v["sliding_window"], 4096);
        assert_eq!(v["max_window_layers"], 21);
        assert_eq!(v["use_sliding_window"], false);
        assert_eq!(v["rope_theta"], 10000.0);
    }

    #[test]
    fn unknown_shape_lists_the_known_ones() {
        let e = shape_config("llama-7b").unwrap_err().to_string();
        assert!(e.contains("llama-7b") && SHAPES.iter().all(|s| e.contains(s)), "{e}");
    }

    #[test]
    fn synth_tensor_is_deterministic_and_scaled() {
        let shape = [256, 1024];
        let a = synth_tensor("model.layers.0.mlp.up_proj.weight", &shape, 7).unwrap();
        let b = synth_tensor("model.layers.0.mlp.up_proj.weight", &shape, 7).unwrap();
        let c = synth_tensor("model.layers.1.mlp.up_proj.weight", &shape, 7).unwrap();
        let d = synth_tensor("model.layers.0.mlp.up_proj.weight", &shape, 8).unwrap();
        let (a, b, c, d) = [a, b, c, d].map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).into();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
        let std = (a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(mean.abs() < 1e-3, "{mean}");
        assert!((std - 1.0 / 32.0).abs() < 1e-3, "{std}");
        // A slice generated on its own equals the same slice of the whole.
        let mut part = vec![0f32; 1000];
        fill(&mut part, tensor_key("model.layers.0.mlp.up_proj.weight", 7), 5000, init_for("x.weight", &shape));
        assert_eq!(part, a[5000..6000]);
        let norm = synth_tensor("model.norm.weight", &[64], 7).unwrap().to_vec1::<f32>().unwrap();
        assert!(norm.iter().all(|x| (x - 1.0).abs() < 0.2));
    }

    #[test]
    fn tiny_safetensors_load_and_run() {
        let dir = tempfile::tempdir().unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let out = dir.path().join(format!("{dtype:?}"));
            let mut o = opts(&out, dtype, None, 1);
            o.tokenizer_json = Some(b"{}".to_vec());
            let report = synth(&o).unwrap();
            let names: Vec<String> =
                report.files.iter().filter_map(|p| p.file_name()?.to_str().map(String::from)).collect();
            assert_eq!(names, ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors"]);
            let on_disk: u64 = report.files.iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
            assert_eq!(on_disk, report.total_bytes);
            // tiny: tied embedding 151936×64 + 2 layers + final norm.
            assert_eq!(
                report.parameters,
                151936 * 64 + 2 * (2 * 64 + 64 * 64 + 64 + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 64 * 128) + 64
            );

            let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let emb = st.tensor("model.embed_tokens.weight").unwrap();
            assert_eq!(emb.shape(), &[151936, 64]);
            let want = if dtype == DType::F32 { safetensors::Dtype::F32 } else { safetensors::Dtype::BF16 };
            assert_eq!(emb.dtype(), want);
            assert!(st.tensor("lm_head.weight").is_err(), "tied shapes ship no lm_head");
            let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));

            let cfg = forward_is_finite(out.to_str().unwrap());
            let mut want_cfg = shape_config("tiny").unwrap();
            want_cfg.torch_dtype = cfg.torch_dtype.clone();
            assert_eq!(cfg, want_cfg);
            let ck = Checkpoint::open(out.to_str().unwrap()).unwrap();
            assert_eq!(ck.eos_token_ids(), &[151645, 151643]);
        }
    }

    #[test]
    fn tiny_gguf_loads_runs_and_matches_safetensors() {
        let dir = tempfile::tempdir().unwrap();
        let q8 = dir.path().join("q8");
        let report = synth(&opts(&q8, DType::F32, Some(GgufType::Q8_0), 1)).unwrap();
        assert_eq!(report.files, vec![q8.join("model-q8_0.gguf")]);
        let cfg = forward_is_finite(q8.to_str().unwrap());
        assert_eq!(cfg.num_hidden_layers, 2);
        assert!(cfg.tie_word_embeddings);
        assert_eq!(cfg.eos_token_ids, vec![151645]);

        // An F32 GGUF holds exactly the safetensors weights of the same seed.
        let (f32_gguf, st) = (dir.path().join("f32"), dir.path().join("st"));
        synth(&opts(&f32_gguf, DType::F32, Some(GgufType::F32), 1)).unwrap();
        synth(&opts(&st, DType::F32, None, 1)).unwrap();
        let (g, s) =
            (Checkpoint::open(f32_gguf.to_str().unwrap()).unwrap(), Checkpoint::open(st.to_str().unwrap()).unwrap());
        for (name, shape) in qwen2_tensors(&g.config, false) {
            let a = g.weights.get_dense(&name, &shape, DType::F32, &Device::Cpu).unwrap();
            let b = s.weights.get_dense(&name, &shape, DType::F32, &Device::Cpu).unwrap();
            let diff =
                (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(diff, 0.0, "{name}");
        }
    }

    #[test]
    fn same_seed_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let read_all = |d: &Path| -> Vec<(String, Vec<u8>)> {
            let mut v: Vec<_> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| {
                    let p = e.unwrap().path();
                    (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
                })
                .collect();
            v.sort();
            v
        };
        let [a, b, c] = ["a", "b", "c"].map(|n| dir.path().join(n));
        synth(&opts(&a, DType::BF16, None, 42)).unwrap();
        synth(&opts(&b, DType::BF16, None, 42)).unwrap();
        synth(&opts(&c, DType::BF16, None, 43)).unwrap();
        assert_eq!(read_all(&a), read_all(&b));
        assert_ne!(read_all(&a), read_all(&c));
        // A non-empty output directory is refused.
        let e = synth(&opts(&a, DType::BF16, None, 42)).unwrap_err().to_string();
        assert!(e.contains("not empty"), "{e}");
    }

    #[test]
    fn sharded_output_has_an_index_and_loads() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = shape_config("tiny").unwrap();
        cfg.vocab_size = 1024;
        cfg.tie_word_embeddings = false;
        cfg.torch_dtype = Some("float32".into());
        let tensors = qwen2_tensors(&cfg, true);
        std::fs::write(dir.path().join("config.json"), config_json(&cfg, &shape_extras("tiny").unwrap()).to_string())
            .unwrap();
        let (files, _) = write_safetensors(dir.path(), &tensors, DType::F32, 3, 100_000).unwrap();
        assert!(files.len() > 3, "{files:?}");
        assert_eq!(files.last().unwrap().file_name().unwrap(), "model.safetensors.index.json");
        assert!(files[0].ends_with(format!("model-00001-of-{:05}.safetensors", files.len() - 1)));
        let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
        assert_eq!(ck.weights.tensors().len(), tensors.len());
        for (name, shape) in &tensors {
            let got = ck.weights.get_dense(name, shape, DType::F32, &Device::Cpu).unwrap().flatten_all().unwrap();
            let want = synth_tensor(name, shape, 3).unwrap().flatten_all().unwrap();
            assert_eq!(got.to_vec1::<f32>().unwrap(), want.to_vec1::<f32>().unwrap(), "{name}");
        }
    }

    /// Manual: `FLINT_SYNTH_OUT=/tmp/q05 cargo test --release -p flint-model synth_qwen05_timed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn synth_qwen05_timed() {
        let out = std::env::var("FLINT_SYNTH_OUT").unwrap_or_else(|_| "/tmp/flint-synth-qwen2.5-0.5b".into());
        let shape = std::env::var("FLINT_SYNTH_SHAPE").unwrap_or_else(|_| "qwen2.5-0.5b".into());
        let gguf = std::env::var("FLINT_SYNTH_GGUF").ok().map(|t| t.parse::<GgufType>().unwrap());
        let t0 = std::time::Instant::now();
        let mut o = opts(Path::new(&out), DType::F32, gguf, 0);
        o.shape = shape;
        let r = synth(&o).unwrap();
        eprintln!("{} params, {} bytes, {:.1}s", r.parameters, r.total_bytes, t0.elapsed().as_secs_f64());
    }
}
