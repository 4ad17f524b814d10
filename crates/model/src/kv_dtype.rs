//! The KV cache's storage type (`--kv-cache-dtype`) and what it costs per token.

use crate::config::ModelConfig;

/// How the paged pool stores keys and values. Attention always computes in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvCacheDtype {
    /// Exactly what the model computed.
    F32,
    /// Rounded to bf16 (nearest even): half the bytes.
    Bf16,
    /// KIVI layout (see [`crate::kernels::kv_quant`]): keys per channel, values per token, the
    /// block being filled kept at f32 until it is full. About a quarter of the bytes.
    Int8,
}

/// The names `--kv-cache-dtype` takes besides `auto`.
pub const KV_CACHE_DTYPES: &str = "auto, f32, bf16, int8";

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "int8" | "i8" => Ok(Self::Int8),
            fp8 if fp8.starts_with("fp8") => Err(format!(
                "--kv-cache-dtype {s:?}: fp8 KV caches are a GPU format flint does not support; \
                 choose one of {KV_CACHE_DTYPES} (int8 is the compact one)"
            )),
            other => Err(format!("--kv-cache-dtype {other:?} is not supported; choose one of {KV_CACHE_DTYPES}")),
        }
    }
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
        })
    }
}

impl KvCacheDtype {
    /// The block size when `--block-size` is not given. int8 stores each key channel's scale and
    /// minimum once per block (3 bytes): over 128 tokens that is 1.2% of the codes for head size
    /// 64, over 16 it would be 9%. 128 is also KIVI's full-precision window and the default of
    /// several of vLLM's non-CUDA backends. bf16 takes 128 too: attention pays a fixed cost per
    /// block and row (the online-softmax step, the block's own fetch), and with 16-token blocks
    /// decode attention at 16k tokens took 1.6× as long (`examples/attention_cost.rs`, 32 against
    /// 20 ms). f32 (`auto`) keeps 16, today's behaviour (finer prefix caching).
    pub fn default_block_size(self) -> usize {
        match self {
            Self::Int8 | Self::Bf16 => 128,
            Self::F32 => 16,
        }
    }

    /// Bytes one (block, layer, KV head) takes: keys and values with their statistics.
    pub fn bytes_per_block_head(self, head_dim: usize, block_size: usize) -> usize {
        let (d, bs) = (head_dim, block_size);
        match self {
            Self::F32 => 2 * d * bs * 4,
            Self::Bf16 => 2 * d * bs * 2,
            // Codes, then per channel an f16 minimum and a scale code, per token a scale code.
            Self::Int8 => 2 * d * bs + 3 * d + bs,
        }
    }

    /// Bytes one block takes across all layers and KV heads.
    pub fn bytes_per_block(self, cfg: &ModelConfig, block_size: usize) -> usize {
        cfg.num_hidden_layers * cfg.num_key_value_heads * self.bytes_per_block_head(cfg.head_dim, block_size)
    }

    /// Average bytes per token in full blocks.
    pub fn bytes_per_token(self, cfg: &ModelConfig, block_size: usize) -> f64 {
        self.bytes_per_block(cfg, block_size) as f64 / block_size.max(1) as f64
    }

    /// f32 scratch an int8 cache keeps for one block being filled (every layer's keys and
    /// values); zero for the other types, which store each token as it comes.
    pub fn staging_bytes_per_block(self, cfg: &ModelConfig, block_size: usize) -> usize {
        match self {
            Self::Int8 => Self::F32.bytes_per_block(cfg, block_size),
            Self::F32 | Self::Bf16 => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(heads: usize, kv: usize, hidden: usize, layers: usize) -> ModelConfig {
        ModelConfig::from_json_str(&format!(
            r#"{{"architectures":["Qwen2ForCausalLM"],"hidden_size":{hidden},"intermediate_size":128,
                "num_hidden_layers":{layers},"num_attention_heads":{heads},"num_key_value_heads":{kv},
                "vocab_size":10,"max_position_embeddings":512,"rms_norm_eps":1e-6,"rope_theta":10000.0}}"#
        ))
        .unwrap()
    }

    #[test]
    fn parses_names_and_refuses_fp8_clearly() {
        assert_eq!("int8".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Int8));
        assert_eq!("BF16".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Bf16));
        assert_eq!("float32".parse::<KvCacheDtype>(), Ok(KvCacheDtype::F32));
        let e = "fp8_e4m3".parse::<KvCacheDtype>().unwrap_err();
        assert!(e.contains("fp8") && e.contains("int8") && e.contains("auto"), "{e}");
        assert!("q4".parse::<KvCacheDtype>().unwrap_err().contains("auto, f32, bf16, int8"));
        assert_eq!(KvCacheDtype::Int8.to_string(), "int8");
    }

    /// The capacities the README quotes: bf16 2×, int8 ≥ 3.9× the tokens of f32 per byte at the
    /// default block sizes (qwen2.5-0.5b: head size 64; 1.5b/7b: 128).
    #[test]
    fn capacity_ratios() {
        for (c, want) in [(cfg(14, 2, 896, 24), 3.92), (cfg(12, 2, 1536, 28), 3.93)] {
            let f32_tok = KvCacheDtype::F32.bytes_per_token(&c, 16);
            let bf16_tok = KvCacheDtype::Bf16.bytes_per_token(&c, 16);
            let i8_tok = KvCacheDtype::Int8.bytes_per_token(&c, KvCacheDtype::Int8.default_block_size());
            assert_eq!(f32_tok / bf16_tok, 2.0);
            let ratio = f32_tok / i8_tok;
            assert!(ratio >= 3.9 && ratio >= want - 0.01, "int8 holds {ratio:.3}× f32");
        }
        // qwen2.5-0.5b: 24 layers × 2 heads × (2·64·128 + 3·64 + 128) bytes per 128-token block.
        let c = cfg(14, 2, 896, 24);
        assert_eq!(KvCacheDtype::Int8.bytes_per_block(&c, 128), 24 * 2 * (16384 + 192 + 128));
        assert_eq!(KvCacheDtype::F32.bytes_per_token(&c, 16), 24576.0);
        assert_eq!(KvCacheDtype::Int8.staging_bytes_per_block(&c, 128), 24 * 2 * 2 * 64 * 128 * 4);
    }
}
