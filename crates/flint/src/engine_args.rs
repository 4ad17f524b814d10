//! The engine flags shared by `flint bench` and (later) `flint serve`, with vLLM's names.

use anyhow::{bail, Result};
use flint_engine::{EngineConfig, SpeculativeConfig};
use flint_model::device::DeviceSpec;
use flint_model::KvCacheDtype;

#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    #[command(flatten)]
    pub device: DeviceArg,
    /// Tokens per KV-cache block; default 16, or 128 with --kv-cache-dtype int8.
    #[arg(long)]
    pub block_size: Option<usize>,
    #[command(flatten)]
    pub kv: KvDtypeArg,
    /// Bytes for the paged KV cache (suffixes K, M, G, KiB, MiB, GiB); default: a quarter of
    /// the memory available after loading the model (on a GPU: 90% of its free memory).
    #[arg(long, value_parser = parse_bytes)]
    pub kv_cache_memory: Option<usize>,
    /// Token budget of one engine step (decodes plus prefill chunks).
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Longest prompt + output accepted; default: the model's context length.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Turn off prefix caching (on by default).
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    #[command(flatten)]
    pub spec: SpeculativeArg,
}

impl EngineArgs {
    /// The engine's configuration; a bad `--speculative-config` is an error naming its key.
    pub fn config(&self) -> Result<EngineConfig> {
        Ok(EngineConfig {
            block_size: self.block_size,
            kv_cache_dtype: self.kv.get(),
            kv_cache_memory: self.kv_cache_memory,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            speculative: self.spec.get()?,
        })
    }
}

/// `--device`, shared by every command that loads a model.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DeviceArg {
    /// Where the model runs: cpu, cuda (= cuda:0) or cuda:N. CUDA needs a build with
    /// `--features cuda`; there the KV cache and attention live in GPU memory.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceSpec,
}

impl DeviceArg {
    /// The opened device, or one line saying why it cannot be opened.
    pub fn open(&self) -> Result<candle_core::Device> {
        Ok(self.device.open()?)
    }
}

fn parse_device(s: &str) -> std::result::Result<DeviceSpec, String> {
    s.parse()
}

/// `--speculative-config`, shared by every command that builds an engine.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SpeculativeArg {
    /// Speculative decoding, as vLLM's JSON: e.g. '{"method": "ngram", "num_speculative_tokens": 4,
    /// "prompt_lookup_min": 2, "prompt_lookup_max": 5, "disable_by_batch_size": 8}'. Off when omitted.
    #[arg(long = "speculative-config")]
    speculative_config: Option<String>,
}

impl SpeculativeArg {
    /// Parsed here rather than by clap, so a bad config is the CLI's usual one-line error.
    pub fn get(&self) -> Result<Option<SpeculativeConfig>> {
        Ok(self.speculative_config.as_deref().map(SpeculativeConfig::parse).transpose()?)
    }
}

/// `--kv-cache-dtype`, shared by every command that builds an engine.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct KvDtypeArg {
    /// How the KV cache stores keys and values: auto (= f32), f32, bf16 (half the bytes) or int8
    /// (about a quarter: keys per channel, values per token, the block being filled at f32).
    #[arg(long = "kv-cache-dtype", default_value = "auto", value_parser = parse_kv_dtype)]
    kv_cache_dtype: KvChoice,
}

impl KvDtypeArg {
    /// `None` for auto.
    pub fn get(&self) -> Option<KvCacheDtype> {
        self.kv_cache_dtype.0
    }
}

/// `--kv-cache-dtype`'s value: `None` is `auto`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvChoice(Option<KvCacheDtype>);

/// `auto`; f32, bf16, int8; vLLM's fp8 names get an error that lists what flint takes.
pub fn parse_kv_dtype(s: &str) -> std::result::Result<KvChoice, String> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Ok(KvChoice(None));
    }
    s.parse().map(|d| KvChoice(Some(d)))
}

/// `--dtype`'s value (auto, f32, bf16, f16) as a candle dtype; `None`: auto.
pub fn parse_dtype(s: &str) -> Option<candle_core::DType> {
    match s {
        "f32" => Some(candle_core::DType::F32),
        "bf16" => Some(candle_core::DType::BF16),
        "f16" => Some(candle_core::DType::F16),
        _ => None,
    }
}

/// `4G`, `512MiB`, `1000000` → bytes (K/M/G are powers of 1024, like vLLM's `--kv-cache-memory`).
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = match num.parse() {
        Ok(n) => n,
        Err(_) => bail!("{s:?} is not a byte count (e.g. 4G, 512MiB, 1000000)"),
    };
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => bail!("{s:?}: unknown unit {unit:?} (use K, M or G)"),
    };
    Ok((n * mult) as usize)
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_kv_dtype};
    use flint_model::KvCacheDtype;

    #[test]
    fn kv_dtypes() {
        assert_eq!(parse_kv_dtype("auto").map(|c| c.0), Ok(None));
        assert_eq!(parse_kv_dtype("int8").map(|c| c.0), Ok(Some(KvCacheDtype::Int8)));
        assert!(parse_kv_dtype("fp8").unwrap_err().contains("auto, f32, bf16, int8"));
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert_eq!(parse_bytes("4G").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5k").unwrap(), 1536);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("4X").is_err());
    }
}
