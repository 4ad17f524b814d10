//! The writer: the header with every tensor's offset first, then each tensor produced, converted
//! and written in turn (see the module docs of [`super`]).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

use crate::error::{ModelError, Result};
use crate::gguf::hf_to_gguf_name;

use super::metadata::write_str;
use super::types::{ggml_type_id, tensor_nbytes, tensor_storage_type};
use super::{GgufExport, ALIGNMENT};

fn padded(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
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

impl GgufExport<'_> {
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
                return Err(ModelError::Config(format!("tensor `{hf}` has no llama.cpp name")));
            }
            if shape.is_empty() || shape.len() > 4 {
                return Err(ModelError::Config(format!("tensor `{hf}`: GGUF needs 1 to 4 dims, got {shape:?}")));
            }
            let ty = tensor_storage_type(self.ty, hf, shape);
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
            let t = match *hf {
                super::ROPE_FREQS => {
                    let f = crate::rope::gguf_freq_factors(&self.config.rope, self.config.head_dim)
                        .ok_or_else(|| bad("the config has no per-frequency RoPE scaling".into()))?;
                    Tensor::from_vec(f, shape.to_vec(), &candle_core::Device::Cpu)?
                }
                _ => produce(hf)?,
            };
            let t = match self.permuted_heads(hf) {
                Some(heads) => permute_rows(&t, heads)?,
                None => t,
            };
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

impl GgufExport<'_> {
    /// Heads whose rows llama.cpp's converter interleaves in `hf` (q and k of the `llama` arch).
    fn permuted_heads(&self, hf: &str) -> Option<usize> {
        let c = self.config;
        if !c.family.gguf_permutes_qk() {
            return None;
        }
        if hf.ends_with(".self_attn.q_proj.weight") {
            Some(c.num_attention_heads)
        } else if hf.ends_with(".self_attn.k_proj.weight") {
            Some(c.num_key_value_heads)
        } else {
            None
        }
    }
}

/// `t`'s rows in llama.cpp's order for `heads` heads: GGUF row `llama_cpp_row(r)` holds row `r`.
fn permute_rows(t: &Tensor, heads: usize) -> Result<Tensor> {
    let rows = t.dim(0)?;
    let head_dim = rows / heads.max(1);
    let mut order = vec![0u32; rows];
    for r in 0..rows {
        order[crate::gguf::llama_cpp_row(r, head_dim)] = r as u32;
    }
    Ok(t.index_select(&Tensor::from_vec(order, rows, t.device())?, 0)?)
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
            // Merged experts: blocks never straddle rows, so `[n, out, in]` quantizes as
            // `[n·out, in]` to the same bytes.
            let cols = t.dims().last().copied().unwrap_or(1).max(1);
            let t = t.reshape((t.elem_count() / cols, cols))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_export::model_tensors;
    use crate::gguf_export::tests::golden_small;
    use crate::gguf_export::GgufType;
    use crate::source::Checkpoint;

    #[test]
    fn parallel_quantization_matches_whole() {
        let t = Tensor::randn(0f32, 1.0, (37, 512), &Device::Cpu).unwrap();
        for ty in [GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K] {
            let whole = QTensor::quantize(&t, ty).unwrap().data().unwrap().into_owned();
            assert_eq!(quantize_rows(&t, ty).unwrap().concat(), whole);
        }
    }

    #[test]
    fn wrong_produced_shape_is_an_error_and_leaves_no_file() {
        let ck = Checkpoint::open(&golden_small()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.gguf");
        let export = GgufExport { config: &ck.config, name: "x".into(), tokenizer: None, ty: GgufType::F32 };
        let tensors = model_tensors(&ck.config, true);
        let e = export
            .write_file(&path, &tensors, |_| Ok(Tensor::zeros(3, DType::F32, &Device::Cpu)?))
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.embed_tokens.weight"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
