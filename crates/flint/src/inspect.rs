//! `flint inspect`: what a checkpoint is and what it will cost to serve, read from its config and
//! tensor directory without loading the weights.

use std::collections::BTreeMap;

use anyhow::Result;
use flint_model::source::Checkpoint;
use flint_model::weights::WeightSource;
use flint_model::RopeScaling;

pub fn run(spec: &str) -> Result<()> {
    let ck = Checkpoint::open(spec)?;
    let c = &ck.config;
    let tensors = ck.weights.tensors();
    let format = match &ck.weights {
        WeightSource::Safetensors(_) => "safetensors",
        WeightSource::Gguf(_) => "gguf",
    };
    println!("model:           {spec}");
    println!("format:          {format}");
    println!("architecture:    Qwen2ForCausalLM (qwen2)");
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
    println!("vocab size:      {}", c.vocab_size);
    println!("max positions:   {} (serves up to {} tokens)", c.max_position_embeddings, c.max_context_len());
    println!("tied embeddings: {}", if c.tie_word_embeddings { "yes" } else { "no" });
    let rope = match &c.rope.scaling {
        RopeScaling::None => "none".to_string(),
        RopeScaling::Linear { factor } => format!("linear x{factor}"),
        RopeScaling::Yarn { factor, original_max_position_embeddings, .. } => {
            format!("yarn x{factor} (original context {original_max_position_embeddings})")
        }
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
    Ok(())
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
    fn grouping() {
        assert_eq!(super::group(28672), "28,672");
        assert_eq!(super::group(999), "999");
        assert_eq!(super::group(1_000_000), "1,000,000");
    }
}
