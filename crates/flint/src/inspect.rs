//! `flint inspect`: what a checkpoint is and what it will cost to serve, read from its config and
//! tensor directory without loading the weights.

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use flint_model::source::Checkpoint;
use flint_model::weights::WeightSource;
use flint_model::{KvCacheDtype, ModelConfig, RopeScaling};

use crate::engine_args::{parse_bytes, KvDtypeArg};

#[derive(clap::Args)]
pub struct InspectArgs {
    /// Local directory, .gguf file, or Hugging Face hub id.
    #[arg(long)]
    model: String,
    /// The cache dtype to size (the others are listed for comparison).
    #[command(flatten)]
    kv: KvDtypeArg,
    /// Tokens per KV block (default: the dtype's).
    #[arg(long)]
    block_size: Option<usize>,
    /// Pool size to state capacities for (default 1 GiB).
    #[arg(long, value_parser = parse_bytes)]
    kv_cache_memory: Option<usize>,
}

pub fn run(a: InspectArgs) -> Result<()> {
    // `flint inspect | head` closes stdout early: end quietly, as Unix tools do, rather than
    // panic in `println!`. Only this command resets SIGPIPE; the server keeps Rust's ignored one.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal, before any thread of this
    // command starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    if a.block_size.is_some_and(|b| b == 0 || b > 1024) {
        bail!("--block-size must be between 1 and 1024");
    }
    let spec = a.model.as_str();
    let ck = Checkpoint::open(spec)?;
    let c = &ck.config;
    let tensors = ck.weights.tensors();
    let format = match &ck.weights {
        WeightSource::Safetensors(_) => "safetensors",
        WeightSource::Gguf(_) => "gguf",
    };
    println!("model:           {spec}");
    println!("format:          {format}");
    let (architecture, model_type) = c.architecture();
    println!("architecture:    {architecture} ({model_type})");
    let mut switches = Vec::new();
    if c.qkv_bias {
        switches.push(if c.o_bias { "q/k/v/o bias" } else { "q/k/v bias" });
    }
    if c.qk_norm {
        switches.push("q/k head norm");
    }
    println!("attention:       {}", if switches.is_empty() { "no bias".to_string() } else { switches.join(", ") });
    println!("layers:          {}", c.num_hidden_layers);
    println!("hidden size:     {}", c.hidden_size);
    println!(
        "attention heads: {} query / {} key-value (GQA group {}), head_dim {}",
        c.num_attention_heads,
        c.num_key_value_heads,
        c.num_attention_heads / c.num_key_value_heads,
        c.head_dim
    );
    println!("mlp size:        {}", c.intermediate_size);
    if let Some(m) = &c.moe {
        let sparse = m.sparse_layers.iter().filter(|&&s| s).count();
        let shared = m.shared_expert_intermediate_size.map(|s| format!(", a shared expert of {s}")).unwrap_or_default();
        println!(
            "experts:         {} of size {}, {} per token{}{shared}; {sparse} of {} layers sparse",
            m.num_experts,
            m.moe_intermediate_size,
            m.num_experts_per_tok,
            if m.norm_topk_prob { " (renormalised)" } else { "" },
            c.num_hidden_layers
        );
    }
    println!("vocab size:      {}", c.vocab_size);
    println!("max positions:   {} (serves up to {} tokens)", c.max_position_embeddings, c.max_context_len());
    println!("tied embeddings: {}", if c.tie_word_embeddings { "yes" } else { "no" });
    let rope = match &c.rope.scaling {
        RopeScaling::None => "none".to_string(),
        RopeScaling::Linear { factor } => format!("linear x{factor}"),
        RopeScaling::Yarn { factor, original_max_position_embeddings, .. } => {
            format!("yarn x{factor} (original context {original_max_position_embeddings})")
        }
        RopeScaling::Llama3 { factor, original_max_position_embeddings, .. } => {
            format!("llama3 x{factor} (original context {original_max_position_embeddings})")
        }
        RopeScaling::FreqFactors(f) => format!("per-frequency divisors (rope_freqs, {} entries)", f.len()),
    };
    println!("rope:            theta {}, scaling {rope}", c.rope.theta);
    let windows: Vec<usize> = c.sliding_window_layers.iter().flatten().copied().collect();
    match windows.first() {
        Some(w) => println!("sliding window:  {w} tokens on {} of {} layers", windows.len(), c.num_hidden_layers),
        None => println!("sliding window:  off"),
    }
    println!("eos token ids:   {:?}", ck.eos_token_ids());
    println!("tensors:         {}", tensors.len());
    let mut by_dtype: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut params = 0usize;
    for t in &tensors {
        let n: usize = t.shape.iter().product();
        params += n;
        let e = by_dtype.entry(t.dtype.clone()).or_default();
        e.0 += n;
        e.1 += t.bytes;
    }
    println!("parameters:      {}", group(params));
    for (dtype, (n, bytes)) in &by_dtype {
        println!("  {dtype:<6} {} parameters, {} bytes", group(*n), group(*bytes));
    }
    let (active, read) = read_per_token(&ck);
    println!(
        "per token:       {} parameters read ({:.1}%), {} bytes of weights",
        group(active.round() as usize),
        100.0 * active / params.max(1) as f64,
        group(read.round() as usize)
    );
    // KV bytes at the checkpoint's own precision (what GPU servers store), and at f32, the cache
    // dtype flint's CPU path uses when weights are computed in f32 (the default that fits).
    let native = match c.torch_dtype.as_deref() {
        Some("float32") => 4,
        _ => 2,
    };
    println!(
        "kv cache:        {} bytes per token at {} ({} at f32)",
        group(c.kv_bytes_per_token(native)),
        if native == 4 { "f32" } else { "16-bit" },
        group(c.kv_bytes_per_token(4))
    );
    // What flint's paged pool stores per token for each `--kv-cache-dtype`, and how many tokens
    // the given memory holds (full blocks; int8 adds f32 staging for blocks being filled).
    let memory = a.kv_cache_memory.unwrap_or(1 << 30);
    let chosen = a.kv.get().unwrap_or(KvCacheDtype::F32);
    let f32_per_token = KvCacheDtype::F32.bytes_per_token(c, a.block_size.unwrap_or(16));
    println!("kv cache pool:   per token and tokens in {} bytes (--kv-cache-memory), * = chosen", group(memory));
    for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16, KvCacheDtype::Int8] {
        let bs = a.block_size.unwrap_or_else(|| dtype.default_block_size());
        let per_block = dtype.bytes_per_block(c, bs);
        let tokens = memory / per_block * bs;
        let per_token = dtype.bytes_per_token(c, bs);
        println!(
            "  {}{dtype:<5} block {bs:>4}: {:>9.1} bytes per token, {:>11} tokens ({:.2}x f32)",
            if dtype == chosen { "*" } else { " " },
            per_token,
            group(tokens),
            f32_per_token / per_token
        );
    }
    Ok(())
}

/// What decoding one token of one sequence reads, as (parameters, bytes as stored): every weight
/// except the idle experts and all but one embedding row (the whole matrix when it doubles as the
/// head).
fn read_per_token(ck: &Checkpoint) -> (f64, f64) {
    let (mut active, mut read) = (0f64, 0f64);
    for t in &ck.weights.tensors() {
        let share = per_token_share(&t.name, &ck.config);
        active += share * t.shape.iter().product::<usize>() as f64;
        read += share * t.bytes as f64;
    }
    (active, read)
}

/// The share of tensor `name` (a checkpoint's or a GGUF's name) one decoded token reads: a
/// mixture's experts `k / n` (routing spreads tokens over them; one token reads its `k`), an
/// untied embedding one row, everything else all of it.
fn per_token_share(name: &str, c: &ModelConfig) -> f64 {
    let expert = name.contains(".experts.") || name.contains("_exps.");
    match &c.moe {
        Some(m) if expert => m.num_experts_per_tok as f64 / m.num_experts as f64,
        _ if !c.tie_word_embeddings && matches!(name, "model.embed_tokens.weight" | "token_embd.weight") => {
            1.0 / c.vocab_size.max(1) as f64
        }
        _ => 1.0,
    }
}

/// 28672 → "28,672".
fn group(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_token_reads_its_experts_and_one_embedding_row() {
        let moe = flint_model::synth::shape_config("qwen3-30b-a3b").unwrap();
        let share = |n: &str| super::per_token_share(n, &moe);
        assert_eq!(share("blk.3.ffn_up_exps.weight"), 8.0 / 128.0);
        assert_eq!(share("model.layers.3.mlp.experts.17.down_proj.weight"), 8.0 / 128.0);
        assert_eq!(share("blk.3.ffn_gate_inp.weight"), 1.0, "the router reads every expert's row");
        assert_eq!(share("token_embd.weight"), 1.0 / 151936.0);
        assert_eq!(share("output.weight"), 1.0);
        let tied = flint_model::synth::shape_config("qwen2.5-0.5b").unwrap();
        assert_eq!(super::per_token_share("model.embed_tokens.weight", &tied), 1.0, "a tied head reads it all");
        assert_eq!(super::per_token_share("model.layers.0.mlp.experts.0.up_proj.weight", &tied), 1.0);
    }

    #[test]
    fn grouping() {
        assert_eq!(super::group(28672), "28,672");
        assert_eq!(super::group(999), "999");
        assert_eq!(super::group(1_000_000), "1,000,000");
    }
}
