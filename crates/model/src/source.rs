//! `--model` resolution: a local directory (safetensors or a single GGUF inside), a `.gguf` file,
//! or a Hugging Face hub id fetched through `hf-hub` (honouring `HF_HOME`, and `HF_HUB_OFFLINE`
//! by reading only the local cache).

use std::path::{Path, PathBuf};

use crate::config::{GenerationConfig, ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::gguf::config_from_gguf;
use crate::weights::{GgufWeights, SafetensorsFiles, WeightSource};

/// An opened checkpoint: its config and its weights, not yet turned into a model.
pub struct Checkpoint {
    /// Directory of a safetensors checkpoint (or the one holding the GGUF file).
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub generation: GenerationConfig,
    pub weights: WeightSource,
}

impl Checkpoint {
    /// Open `spec`: a directory, a `.gguf` file, or a hub id such as `Qwen/Qwen2.5-0.5B-Instruct`.
    pub fn open(spec: &str) -> Result<Self> {
        let path = Path::new(spec);
        if path.is_dir() {
            return Self::open_dir(path);
        }
        if path.is_file() {
            return Self::open_gguf(path);
        }
        if looks_like_hub_id(spec) && !spec.ends_with(".gguf") {
            let dir = fetch_from_hub(spec)?;
            return Self::open_dir(&dir);
        }
        Err(ModelError::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory")))
    }

    pub fn open_dir(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            // A directory holding exactly one GGUF file is that file.
            let ggufs = gguf_files(dir)?;
            return match ggufs.as_slice() {
                [one] => Self::open_gguf(one),
                [] => Err(ModelError::io(
                    &config_path,
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "no config.json (and no .gguf file) in the model directory",
                    ),
                )),
                _ => Err(ModelError::Config(format!(
                    "{}: several .gguf files and no config.json; pass the .gguf file itself",
                    dir.display()
                ))),
            };
        }
        let config = ModelConfig::from_file(&config_path)?;
        let gen_path = dir.join("generation_config.json");
        let mut generation =
            if gen_path.exists() { GenerationConfig::from_file(&gen_path)? } else { GenerationConfig::default() };
        merge_eos(&mut generation, &config);
        let weights = WeightSource::Safetensors(SafetensorsFiles::open_dir(dir)?);
        Ok(Self { dir: dir.to_path_buf(), config, generation, weights })
    }

    pub fn open_gguf(path: &Path) -> Result<Self> {
        let mut g = GgufWeights::open(path)?;
        let mut config = config_from_gguf(&g.content).map_err(|e| e.in_file(path))?;
        if config.family.gguf_permutes_qk() {
            g.set_permuted_qk(config.num_attention_heads, config.num_key_value_heads);
        }
        // llama.cpp stores Llama 3's RoPE scaling as per-frequency divisors, not metadata.
        if let Some(factors) = g.read_f32("rope_freqs.weight")? {
            config.rope.scaling = RopeScaling::FreqFactors(factors);
            config.check_numbers().map_err(|e| e.in_file(path))?;
        }
        let mut generation = GenerationConfig::default();
        merge_eos(&mut generation, &config);
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(Self { dir, config, generation, weights: WeightSource::Gguf(g) })
    }

    pub fn gguf(&self) -> Option<&GgufWeights> {
        match &self.weights {
            WeightSource::Gguf(g) => Some(g),
            WeightSource::Safetensors(_) => None,
        }
    }

    /// Every id that ends generation: generation_config.json's `eos_token_id` (all of them),
    /// then config.json's.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.generation.eos_token_ids
    }
}

fn merge_eos(generation: &mut GenerationConfig, config: &ModelConfig) {
    for &id in &config.eos_token_ids {
        if !generation.eos_token_ids.contains(&id) {
            generation.eos_token_ids.push(id);
        }
    }
}

fn gguf_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))? {
        let p = entry.map_err(|e| ModelError::io(dir, e))?.path();
        if p.extension().is_some_and(|e| e == "gguf") {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

/// `owner/name` with the characters the hub allows.
fn looks_like_hub_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty() && !p.starts_with('.') && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

fn hub_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// Files a Qwen2 safetensors checkpoint needs; the optional ones are skipped when absent.
const HUB_FILES: &[(&str, bool)] = &[
    ("config.json", true),
    ("generation_config.json", false),
    ("tokenizer.json", true),
    ("tokenizer_config.json", false),
];

/// Download (or, offline, find in the cache) a hub checkpoint; returns its snapshot directory.
fn fetch_from_hub(id: &str) -> Result<PathBuf> {
    let cache = hf_hub::Cache::from_env();
    if hub_offline() {
        let repo = cache.model(id.to_string());
        let config = repo.get("config.json").ok_or_else(|| {
            ModelError::Hub(format!(
                "model `{id}` is not in the local cache ({}) and HF_HUB_OFFLINE is set; download it first or pass a local directory",
                cache.path().display()
            ))
        })?;
        let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
        return Ok(dir);
    }
    let api = hf_hub::api::sync::ApiBuilder::from_cache(cache)
        .with_progress(false)
        .build()
        .map_err(|e| ModelError::Hub(format!("model `{id}`: cannot set up the hub client: {e}")))?;
    let repo = api.model(id.to_string());
    let unreachable = |e: hf_hub::api::sync::ApiError| {
        ModelError::Hub(format!(
            "model `{id}` could not be fetched from the Hugging Face hub ({e}); without network, set HF_HUB_OFFLINE=1 to use the local cache or pass a local directory"
        ))
    };
    let mut dir = None;
    for (file, required) in HUB_FILES {
        match repo.get(file) {
            Ok(p) => dir = dir.or_else(|| p.parent().map(Path::to_path_buf)),
            Err(e) if *required => return Err(unreachable(e)),
            Err(_) => {}
        }
    }
    let dir = dir.ok_or_else(|| ModelError::Hub(format!("model `{id}`: no files")))?;
    // Weights: the sharded index if there is one, else the single file.
    match repo.get("model.safetensors.index.json") {
        Ok(index) => {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Safetensors { file: index.clone(), msg: e.to_string() })?;
            let mut shards: Vec<String> = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| m.values().filter_map(|f| f.as_str().map(String::from)).collect())
                .unwrap_or_default();
            shards.sort();
            shards.dedup();
            if let Some(bad) = shards.iter().find(|s| s.contains("..") || s.starts_with('/') || s.contains('\\')) {
                return Err(ModelError::Hub(format!("model `{id}`: weight_map names an unsafe path `{bad}`")));
            }
            for s in shards {
                repo.get(&s).map_err(unreachable)?;
            }
        }
        Err(_) => {
            repo.get("model.safetensors").map_err(unreachable)?;
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids() {
        assert!(looks_like_hub_id("Qwen/Qwen2.5-0.5B-Instruct"));
        assert!(!looks_like_hub_id("./model"));
        assert!(!looks_like_hub_id("a/b/c"));
        assert!(!looks_like_hub_id("model.gguf"));
    }

    #[test]
    fn offline_hub_miss_is_one_clear_line() {
        let tmp = tempfile::tempdir().unwrap();
        std::env::set_var("HF_HOME", tmp.path());
        std::env::set_var("HF_HUB_OFFLINE", "1");
        let err = Checkpoint::open("Qwen/Qwen2.5-0.5B").err().unwrap().to_string();
        assert!(err.contains("HF_HUB_OFFLINE") && err.contains("Qwen/Qwen2.5-0.5B"), "{err}");
        assert!(!err.contains('\n'));
    }
}
