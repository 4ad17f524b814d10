//! Everything needed to serve a checkpoint, loaded together: the model, its tokenizer and chat
//! template, and the ids that end generation. With no `--model`, a built-in demo (random weights
//! with the real Qwen tokenizer) is synthesized once into the temp directory, so flint runs
//! offline out of the box.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};
use flint_model::source::Checkpoint;
use flint_model::synth::{synth, SynthOptions};
use flint_model::DecoderModel;

use crate::chat_template::{ChatTemplate, ChatTemplateError};
use crate::tokenizer::Tokenizer;
use crate::EngineError;

/// The Qwen `tokenizer_config.json` shipped with the repository (chat template, special tokens).
pub const QWEN_TOKENIZER_CONFIG: &str =
    include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/qwen-tokenizer/tokenizer_config.json"));

/// Token texts that end generation in Qwen-family vocabularies when the checkpoint cannot say
/// (GGUF carries one eos id only).
const END_OF_GENERATION_TOKENS: &[&str] = &["<|im_end|>", "<|endoftext|>"];

/// The shape the built-in demo model is synthesized with.
pub const DEMO_SHAPE: &str = "tiny";

pub struct LoadedModel {
    /// Shared with the engine's model runner.
    pub model: Arc<DecoderModel>,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    /// Every id that ends generation (generation_config.json's list, then config.json's).
    pub eos_token_ids: Vec<u32>,
    /// What `--model` resolved to, for logs and the API's model name.
    pub source: String,
}

impl LoadedModel {
    /// Load `spec` (a directory, `.gguf` file or hub id), or the built-in demo when `None`.
    /// `dtype` is the compute dtype of dense weights; `None` picks [`auto_dtype`].
    pub fn load(spec: Option<&str>, device: &Device, dtype: Option<DType>) -> Result<Self, EngineError> {
        let spec = match spec {
            Some(s) => s.to_string(),
            None => demo_dir()?.to_string_lossy().into_owned(),
        };
        let ck = Checkpoint::open(&spec)?;
        let dtype = dtype.unwrap_or_else(|| if device.is_cpu() { auto_dtype(&ck) } else { auto_gpu_dtype(&ck) });
        // The tokenizer first: a missing one should not cost a full weight load to discover.
        let (tokenizer, chat_template) = tokenizer_and_template(&ck)?;
        let model = DecoderModel::load(&ck.config, &ck.weights, dtype, device)?;
        let mut eos_token_ids = ck.eos_token_ids().to_vec();
        let extra: Vec<u32> = if ck.gguf().is_some() {
            // GGUF stores a single eos id; like llama.cpp, also end on the end-of-turn and
            // end-of-text tokens the vocabulary defines (generation_config.json lists both).
            END_OF_GENERATION_TOKENS.iter().filter_map(|t| tokenizer.token_to_id(t)).collect()
        } else {
            chat_template_eos(&tokenizer, &ck.dir).into_iter().collect()
        };
        for id in extra {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        Ok(Self { model: Arc::new(model), tokenizer: Arc::new(tokenizer), chat_template, eos_token_ids, source: spec })
    }

    /// The ordinary (non-special) token ids `0..n` that random benchmark prompts draw from:
    /// special ids would change how a prompt behaves.
    pub fn ordinary_vocab(&self) -> u32 {
        (0..self.valid_vocab() as u32).take_while(|&t| !self.tokenizer.is_special(t)).count().max(1) as u32
    }

    /// How bf16 weights are computed, for the start-up lines (`None` without bf16 weights).
    pub fn bf16_note(&self) -> Option<String> {
        let c = self.model.bf16_compute()?;
        let speed = flint_model::kernels::matmul_bf16::dot_speedup()
            .map_or(String::new(), |s| format!("; vdpbf16ps measured at {s:.2}x the f32 FMA rate"));
        Some(format!("bf16 weights: {c}{speed}"))
    }

    /// Ids the sampler may choose: the tokenizer's, never the embedding's padding rows.
    pub fn valid_vocab(&self) -> usize {
        self.tokenizer.len().min(self.model.config().vocab_size)
    }
}

/// f32 (exact, and candle's fastest CPU path) unless the weights as f32 compute holds them would
/// not fit in 80% of available memory; then the checkpoint's own 16-bit dtype, slower but it
/// runs. In f32 compute, bf16 and f16 matrices stay 16-bit (the CPU kernels widen them as they
/// read, or take bf16 as it is), so a 7B bf16 checkpoint needs its 15 GB, not 30.
pub fn auto_dtype(ck: &Checkpoint) -> DType {
    let f32_bytes: usize = ck
        .weights
        .tensors()
        .iter()
        .map(|t| match t.dtype.as_str() {
            "F32" => t.shape.iter().product::<usize>() * 4,
            "F16" | "BF16" => t.shape.iter().product::<usize>() * 2,
            _ => t.bytes, // block-quantized weights stay quantized
        })
        .sum();
    let budget = available_memory().map_or(usize::MAX, |m| m / 10 * 8);
    if f32_bytes <= budget {
        return DType::F32;
    }
    match ck.config.torch_dtype.as_deref() {
        Some("float16") => DType::F16,
        _ => DType::BF16,
    }
}

/// On a GPU, as vLLM's `auto`: the checkpoint's own dtype (bf16 when it does not say, as for a
/// GGUF), so a bf16 model computes in bf16 on the tensor cores.
pub fn auto_gpu_dtype(ck: &Checkpoint) -> DType {
    match ck.config.torch_dtype.as_deref() {
        Some("float16") => DType::F16,
        Some("float32") => DType::F32,
        _ => DType::BF16,
    }
}

/// `MemAvailable` from /proc/meminfo, where there is one.
pub fn available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// tokenizer.json (+ tokenizer_config.json's template) beside the weights, else the GGUF's own.
fn tokenizer_and_template(ck: &Checkpoint) -> Result<(Tokenizer, Option<ChatTemplate>), EngineError> {
    if let Some(g) = ck.gguf() {
        let meta = flint_model::gguf::GgufTokenizerMeta::from_metadata(g.metadata()).ok_or_else(|| {
            EngineError::Load(format!(
                "{}: the GGUF file carries no tokenizer (tokenizer.ggml.tokens)",
                g.path.display()
            ))
        })?;
        let in_file = |e: &dyn std::fmt::Display| EngineError::Load(format!("{}: {e}", g.path.display()));
        let tok = Tokenizer::from_gguf(&meta).map_err(|e| in_file(&e))?;
        let template = match &meta.chat_template {
            Some(src) => {
                let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i));
                Some(
                    ChatTemplate::new(src, name(meta.bos_token_id), name(meta.eos_token_id))
                        .map_err(|e| in_file(&e))?,
                )
            }
            None => None,
        };
        return Ok((tok, template));
    }
    let tok_path = ck.dir.join("tokenizer.json");
    if !tok_path.exists() {
        return Err(EngineError::Load(format!("{}: no tokenizer.json beside the weights", tok_path.display())));
    }
    let tok = Tokenizer::from_file(&tok_path)?;
    let cfg_path = ck.dir.join("tokenizer_config.json");
    // No template is fine (base models); a broken one is an error the user must see.
    let template = match ChatTemplate::from_tokenizer_config(&cfg_path) {
        Ok(t) => Some(t),
        Err(ChatTemplateError::MissingTemplate { .. }) => None,
        Err(_) if !cfg_path.exists() => None,
        Err(e) => return Err(EngineError::Load(format!("{}: {e}", cfg_path.display()))),
    };
    Ok((tok, template))
}

/// Chat models end a turn with the template's eos token (`<|im_end|>` for Qwen) even when
/// generation_config.json is missing: stop on it too.
fn chat_template_eos(tok: &Tokenizer, dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let eos = v.get("eos_token")?;
    let s = eos.as_str().or_else(|| eos.get("content").and_then(|c| c.as_str()))?;
    tok.token_to_id(s)
}

/// The demo checkpoint's directory, synthesized on first use. Written to a scratch directory
/// and renamed into place, so a concurrent or interrupted first run never leaves half a model.
fn demo_dir() -> Result<PathBuf, EngineError> {
    let dir = std::env::temp_dir().join(format!("flint-demo-{DEMO_SHAPE}-{}", env!("CARGO_PKG_VERSION")));
    if dir.join("config.json").exists() && dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    let scratch = std::env::temp_dir().join(format!("flint-demo-{}-{}", std::process::id(), DEMO_SHAPE));
    let tokenizer_json = Tokenizer::builtin_qwen_json()?;
    synth(&SynthOptions {
        shape: DEMO_SHAPE.to_string(),
        out: scratch.clone(),
        dtype: DType::F32,
        gguf: None,
        seed: 0,
        tokenizer_json: Some(tokenizer_json),
        tokenizer_config_json: Some(QWEN_TOKENIZER_CONFIG.as_bytes().to_vec()),
        gguf_tokenizer: None,
    })?;
    match std::fs::rename(&scratch, &dir) {
        Ok(()) => Ok(dir),
        // Another process won the race: use its copy.
        Err(_) if dir.join("model.safetensors").exists() => {
            let _ = std::fs::remove_dir_all(&scratch);
            Ok(dir)
        }
        Err(e) => Err(EngineError::Load(format!("cannot place the demo model at {}: {e}", dir.display()))),
    }
}
