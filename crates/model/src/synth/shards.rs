//! The weights as safetensors, streamed block by block: one `model.safetensors`, or ~4 GB shards
//! and an index as transformers' `save_pretrained` writes them.

use crate::progress::Task;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::DType;
use serde_json::{json, Value};

use crate::error::{ModelError, Result};
use crate::gguf_export::write_floats;

use super::hub_config::pretty;
use super::weights::{fill_parallel, init_for, tensor_key};

/// Hugging Face's shard size for `save_pretrained`-style checkpoints (decimal GB, as HF counts).
pub const SHARD_BYTES: u64 = 4_000_000_000;

/// config.json's `torch_dtype` for `dtype`.
pub(super) fn torch_dtype_name(dtype: DType) -> Result<&'static str> {
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
pub(super) fn write_safetensors(
    dir: &Path,
    tensors: &[(String, Vec<usize>)],
    dtype: DType,
    seed: u64,
    shard_bytes: u64,
    progress: &Task,
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
        total += write_shard(&path, shard, dtype, st_dtype, seed, progress)?;
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
fn write_shard(
    path: &Path,
    tensors: &[&(String, Vec<usize>)],
    dtype: DType,
    st_dtype: &str,
    seed: u64,
    progress: &Task,
) -> Result<u64> {
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
        progress.inc(1);
    }
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(8 + header.len() as u64 + offset as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_export::model_tensors;
    use crate::source::Checkpoint;
    use crate::synth::{config_json, shape_config, shape_extras, synth_tensor};
    use candle_core::Device;

    #[test]
    fn sharded_output_has_an_index_and_loads() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = shape_config("tiny").unwrap();
        cfg.vocab_size = 1024;
        cfg.tie_word_embeddings = false;
        cfg.torch_dtype = Some("float32".into());
        let tensors = model_tensors(&cfg, true);
        std::fs::write(dir.path().join("config.json"), config_json(&cfg, &shape_extras("tiny").unwrap()).to_string())
            .unwrap();
        let (files, _) = write_safetensors(
            dir.path(),
            &tensors,
            DType::F32,
            3,
            100_000,
            &crate::progress::task("test", "tensors", 0),
        )
        .unwrap();
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
}
