//! Fuzz targets for the files a checkpoint is made of, run as bounded property tests: GGUF
//! (header, metadata, tensor directory), safetensors (header length and JSON) and config.json.
//!
//! Valid files come from the project's own writers (the GGUF exporter, the safetensors crate with
//! the synthesiser's weights, `synth::config_json`) and are then mutated: truncated, bit-flipped,
//! fields overwritten with huge or bogus values, JSON fields retyped. Every case must end in `Ok`
//! or `Err` (never a panic, an abort or an allocation over the harness's limit), and the mutations
//! with a known answer (a truncated file, a header length past the end) must be errors.
//!
//! `FLINT_FUZZ_CASES`, `FLINT_FUZZ_SEED`, `FLINT_FUZZ_CASE`: see `fuzz_common`; `scripts/fuzz.sh`
//! runs these longer in release.

mod fuzz_common;

use std::collections::HashMap;
use std::io::Cursor;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device};
use flint_model::config::{ModelConfig, RopeConfig, RopeScaling};
use flint_model::gguf::{config_from_gguf, GgufTokenizerMeta};
use flint_model::gguf_export::{model_tensors, GgufExport, GgufType};
use flint_model::gguf_scan;
use flint_model::source::Checkpoint;
use flint_model::synth::{config_json, synth_tensor, HubExtras};
use flint_model::{ContiguousKvCache, DecoderModel, ForwardBatch, LogitsRows};
use fuzz_common::{run_case, run_target, Outcome};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;
use serde_json::{json, Value};

#[global_allocator]
static GUARD: fuzz_common::Guard = fuzz_common::Guard;

// ---------------------------------------------------------------------------------------------
// Valid inputs

fn tiny_config(hidden: usize, head_dim: usize, tied: bool, scaling: RopeScaling) -> ModelConfig {
    ModelConfig {
        family: flint_model::config::Family::Qwen2,
        qkv_bias: true,
        o_bias: false,
        qk_norm: false,
        vocab_size: 32,
        hidden_size: hidden,
        intermediate_size: hidden * 2,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim,
        max_position_embeddings: 128,
        rms_norm_eps: 1e-6,
        rope: RopeConfig { theta: 10000.0, scaling },
        tie_word_embeddings: tied,
        sliding_window_layers: vec![None],
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        torch_dtype: Some("float32".into()),
        moe: None,
    }
}

fn tiny_tokenizer() -> GgufTokenizerMeta {
    let mut tokens: Vec<String> = (b'a'..=b'z').map(|c| (c as char).to_string()).collect();
    tokens.extend(["ab", "<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from));
    tokens.extend((tokens.len()..32).map(|i| format!("[PAD{i}]")));
    let mut types = vec![1; 27];
    types.extend([3, 3, 3]);
    types.extend(vec![5; 32 - types.len()]);
    GgufTokenizerMeta {
        model: "gpt2".into(),
        pre: Some("qwen2".into()),
        tokens,
        token_types: types,
        merges: vec!["a b".into()],
        bos_token_id: None,
        eos_token_id: Some(29),
        padding_token_id: Some(27),
        add_bos_token: None,
        chat_template: Some(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}".into(),
        ),
        ..Default::default()
    }
}

/// A GGUF file as the exporter writes it, with its field map.
struct GgufBase {
    label: String,
    bytes: Vec<u8>,
    fields: Vec<Field>,
    /// End of the last tensor's data: any truncation before it must be refused.
    data_end: usize,
}

fn export_gguf(cfg: &ModelConfig, ty: GgufType, tokenizer: Option<&GgufTokenizerMeta>) -> Vec<u8> {
    let tensors = model_tensors(cfg, !cfg.tie_word_embeddings);
    let shapes: HashMap<String, Vec<usize>> = tensors.iter().cloned().collect();
    let export = GgufExport { config: cfg, name: "fuzz".into(), tokenizer, ty };
    let mut out = Vec::new();
    export
        .write(&mut out, &tensors, |name| synth_tensor(name, &shapes[name], 7))
        .unwrap_or_else(|e| panic!("exporting the {ty} base file: {e}"));
    out
}

fn gguf_bases() -> &'static [GgufBase] {
    static BASES: OnceLock<Vec<GgufBase>> = OnceLock::new();
    BASES.get_or_init(|| {
        let tok = tiny_tokenizer();
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32,
            beta_fast: 16.0,
            beta_slow: 2.0,
            attention_factor: Some(1.1),
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        };
        let small = tiny_config(32, 16, true, RopeScaling::None);
        // Rows of 256 so the K-quants are really used (not the Q8_0 fallback).
        let wide = tiny_config(256, 128, false, yarn);
        let mut out = Vec::new();
        for ty in [GgufType::F32, GgufType::F16, GgufType::BF16, GgufType::Q8_0, GgufType::Q4_0] {
            out.push((format!("small-{ty}"), export_gguf(&small, ty, Some(&tok))));
        }
        out.push(("small-f32-no-tokenizer".into(), export_gguf(&small, GgufType::F32, None)));
        for ty in [GgufType::Q4_K, GgufType::Q6_K] {
            out.push((format!("wide-{ty}"), export_gguf(&wide, ty, Some(&tok))));
        }
        out.into_iter()
            .map(|(label, bytes)| {
                let (fields, data_end) = index_gguf(&bytes);
                GgufBase { label, bytes, fields, data_end }
            })
            .collect()
    })
}

// ---------------------------------------------------------------------------------------------
// A map of a valid GGUF v3 file's fields, so mutations can aim at them

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Magic,
    Version,
    Count,
    StrLen,
    StrBytes,
    ValueType,
    ArrayType,
    ArrayLen,
    Scalar,
    NDims,
    Dim,
    TensorType,
    Offset,
}

#[derive(Debug, Clone, Copy)]
struct Field {
    at: usize,
    size: usize,
    kind: Kind,
}

struct Indexer<'a> {
    b: &'a [u8],
    pos: usize,
    fields: Vec<Field>,
}

impl Indexer<'_> {
    fn take(&mut self, size: usize, kind: Kind) -> u64 {
        self.fields.push(Field { at: self.pos, size, kind });
        let mut v = [0u8; 8];
        if size <= 8 {
            v[..size].copy_from_slice(&self.b[self.pos..self.pos + size]);
        }
        self.pos += size;
        u64::from_le_bytes(v)
    }
    fn string(&mut self) {
        let n = self.take(8, Kind::StrLen) as usize;
        if n > 0 {
            self.take(n, Kind::StrBytes);
        }
    }
    fn value(&mut self, ty: u64) {
        match ty {
            0 | 1 | 7 => drop(self.take(1, Kind::Scalar)),
            2 | 3 => drop(self.take(2, Kind::Scalar)),
            4..=6 => drop(self.take(4, Kind::Scalar)),
            10..=12 => drop(self.take(8, Kind::Scalar)),
            8 => self.string(),
            9 => {
                let elem = self.take(4, Kind::ArrayType);
                let n = self.take(8, Kind::ArrayLen);
                for _ in 0..n {
                    self.value(elem);
                }
            }
            other => panic!("the exporter wrote value type {other}"),
        }
    }
}

/// Fields of the header, and the end of the tensor data.
fn index_gguf(b: &[u8]) -> (Vec<Field>, usize) {
    let mut ix = Indexer { b, pos: 0, fields: Vec::new() };
    ix.take(4, Kind::Magic);
    ix.take(4, Kind::Version);
    let n_tensors = ix.take(8, Kind::Count);
    let n_kv = ix.take(8, Kind::Count);
    for _ in 0..n_kv {
        ix.string();
        let ty = ix.take(4, Kind::ValueType);
        ix.value(ty);
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        ix.string();
        let n_dims = ix.take(4, Kind::NDims);
        let dims: Vec<u64> = (0..n_dims).map(|_| ix.take(8, Kind::Dim)).collect();
        let ty = ix.take(4, Kind::TensorType);
        let offset = ix.take(8, Kind::Offset);
        tensors.push((dims, ty, offset));
    }
    let data_start = ix.pos.div_ceil(32) * 32;
    let data_end = tensors
        .iter()
        .map(|(dims, ty, offset)| {
            let elems: u64 = dims.iter().product();
            let dt = gguf_scan::ggml_type_from_id(*ty as u32).expect("exporter type");
            data_start + (offset + elems / dt.block_size() as u64 * dt.type_size() as u64) as usize
        })
        .max()
        .unwrap_or(data_start);
    (ix.fields, data_end)
}

// ---------------------------------------------------------------------------------------------
// Mutations

/// Values that break length, count and offset fields.
fn interesting_u64(rng: &mut StdRng, orig: u64, file_len: u64) -> u64 {
    let picks = [
        0,
        1,
        2,
        3,
        7,
        31,
        32,
        33,
        255,
        4096,
        u64::from(u32::MAX),
        1 << 32,
        (1 << 32) + 1,
        1 << 40,
        1 << 48,
        1 << 62,
        1 << 63,
        i64::MAX as u64,
        u64::MAX,
        u64::MAX - 1,
        u64::MAX - 31,
        file_len,
        file_len + 1,
        file_len.saturating_sub(1),
        orig.wrapping_add(1),
        orig.wrapping_sub(1),
        orig.wrapping_mul(2),
        orig.wrapping_mul(1 << 32),
        orig ^ (1 << rng.random_range(0..64)),
    ];
    *picks.choose(rng).unwrap_or(&0)
}

/// Values that break type ids and dim counts.
fn interesting_u32(rng: &mut StdRng) -> u32 {
    let picks = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 29, 30, 31, 100, 1 << 31, u32::MAX];
    *picks.choose(rng).unwrap_or(&0)
}

fn overwrite(bytes: &mut [u8], f: &Field, value: u64) {
    let n = f.size.min(8);
    bytes[f.at..f.at + n].copy_from_slice(&value.to_le_bytes()[..n]);
}

/// One mutation of a GGUF file; returns a description (for failure messages) and whether the
/// result must be refused.
fn mutate_gguf(rng: &mut StdRng, base: &GgufBase, bytes: &mut Vec<u8>) -> (String, bool) {
    if bytes.len() < 2 {
        bytes.push(rng.random());
        return ("append a byte".into(), false);
    }
    // An earlier mutation may have cut or shifted the file: aim only inside what is left.
    let header_end = base.fields.last().map_or(24, |f| f.at + f.size).min(bytes.len() - 1).max(1);
    let file_len = bytes.len() as u64;
    match rng.random_range(0..12) {
        10 | 11 if header_end + 1 < bytes.len() => {
            // Weights and block scales of NaN, infinity or garbage: the file stays loadable.
            let n = rng.random_range(1..=64);
            for _ in 0..n {
                let i = rng.random_range(header_end + 1..bytes.len());
                bytes[i] = *[0xff, 0x7f, 0x7c, 0x80, 0x00, rng.random()].choose(rng).unwrap_or(&0);
            }
            (format!("{n} data bytes"), false)
        }
        0 | 1 => {
            let cut =
                if rng.random_bool(0.6) { rng.random_range(0..header_end) } else { rng.random_range(0..bytes.len()) };
            bytes.truncate(cut);
            (format!("truncate at {cut}"), cut < base.data_end)
        }
        2 | 3 => {
            let n = rng.random_range(1..=8);
            let mut at = Vec::new();
            for _ in 0..n {
                let i = if rng.random_bool(0.8) {
                    rng.random_range(0..header_end)
                } else {
                    rng.random_range(0..bytes.len())
                };
                bytes[i] ^= 1 << rng.random_range(0..8);
                at.push(i);
            }
            (format!("bit flips at {at:?}"), false)
        }
        4..=7 => {
            let mut what = Vec::new();
            let mut must_fail = false;
            for _ in 0..rng.random_range(1..=2) {
                let Some(f) = base.fields.choose(rng).copied().filter(|f| f.at + f.size.max(8) <= bytes.len()) else {
                    break;
                };
                let v = match f.kind {
                    Kind::ValueType | Kind::ArrayType | Kind::TensorType | Kind::NDims | Kind::Version => {
                        u64::from(interesting_u32(rng))
                    }
                    Kind::Magic => u64::from(rng.random::<u32>()),
                    Kind::StrBytes => {
                        let i = f.at + rng.random_range(0..f.size);
                        bytes[i] = *[0u8, 0xff, 0xc3, b'.', 0x80].choose(rng).unwrap_or(&0);
                        what.push(format!("string byte {i}"));
                        continue;
                    }
                    Kind::Scalar => rng.random(),
                    _ => {
                        let orig = {
                            let mut v = [0u8; 8];
                            v.copy_from_slice(&bytes[f.at..f.at + 8]);
                            u64::from_le_bytes(v)
                        };
                        let v = interesting_u64(rng, orig, file_len);
                        // A count, length or dim of 2^40 or more cannot fit any tiny file.
                        must_fail |=
                            matches!(f.kind, Kind::Count | Kind::StrLen | Kind::ArrayLen | Kind::Dim) && v >= 1 << 40;
                        v
                    }
                };
                overwrite(bytes, &f, v);
                what.push(format!("{:?}@{} := {v:#x}", f.kind, f.at));
            }
            (what.join(", "), must_fail)
        }
        8 => {
            let at = rng.random_range(0..header_end);
            let n = rng.random_range(1..=16);
            let noise: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            bytes.splice(at..at, noise);
            (format!("insert {n} bytes at {at}"), false)
        }
        _ => {
            let at = rng.random_range(0..header_end);
            let n = rng.random_range(1..=16).min(bytes.len() - at);
            bytes.drain(at..at + n);
            (format!("delete {n} bytes at {at}"), false)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The code under test, end to end

/// Everything flint does with a GGUF file: scan and read the header (in memory and from a file),
/// build the config and tokenizer metadata, list tensors, load the model, run one token.
fn load_gguf_bytes(bytes: &[u8]) -> Result<(), String> {
    let mem = gguf_scan::read_content(&mut Cursor::new(bytes));
    let dir = tempfile::tempdir().map_err(|e| format!("HARNESS: tempdir: {e}"))?;
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, bytes).map_err(|e| format!("HARNESS: write: {e}"))?;
    let opened = Checkpoint::open(path.to_str().unwrap_or_default());
    let content = match (mem, opened) {
        (Err(e), Err(_)) => return Err(e),
        (Ok(c), Ok(ck)) => (c, ck),
        (Ok(_), Err(e)) => {
            // Only the config can fail past the header.
            let msg = e.to_string();
            if msg.contains("not a valid GGUF") {
                return Err(format!("PROPERTY: in-memory read succeeded but the file failed: {msg}"));
            }
            return Err(msg);
        }
        (Err(e), Ok(_)) => return Err(format!("PROPERTY: the file opened but the in-memory read failed: {e}")),
    };
    let (content, ck) = content;
    let _ = GgufTokenizerMeta::from_metadata(&content.metadata);
    let cfg = config_from_gguf(&content).map_err(|e| e.to_string())?;
    if cfg != ck.config {
        return Err("PROPERTY: two reads of one file disagree".into());
    }
    let listed = ck.weights.tensors();
    if listed.len() != content.tensor_infos.len() {
        return Err("PROPERTY: tensors() lost a tensor".into());
    }
    let model = DecoderModel::load(&ck.config, &ck.weights, DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    forward_one(&model)
}

fn forward_one(model: &DecoderModel) -> Result<(), String> {
    let mut cache = ContiguousKvCache::for_config(model.config(), DType::F32, &Device::Cpu);
    let mut batch = ForwardBatch::new();
    batch.push(0, 0, &[0, 1], LogitsRows::Last);
    model.forward_logits(&batch, &mut cache).map_err(|e| e.to_string())?;
    Ok(())
}

/// Turn a load result into a case outcome: harness failures and broken properties fail the
/// case; an error must be one line; a must-fail mutation must not load.
fn judge(result: Result<(), String>, must_fail: bool, what: &str) -> Outcome {
    if result.is_ok() {
        fuzz_common::accepted();
    }
    match result {
        Err(e) if e.starts_with("HARNESS") || e.starts_with("PROPERTY") => Err(format!("{what}: {e}")),
        Err(e) if e.contains('\n') => Err(format!("{what}: error is not one line: {e:?}")),
        Err(_) => Ok(()),
        Ok(()) if must_fail => Err(format!("{what}: loaded although it must be refused")),
        Ok(()) => Ok(()),
    }
}

#[test]
fn fuzz_gguf() {
    let bases = gguf_bases();
    for b in bases {
        load_gguf_bytes(&b.bytes).unwrap_or_else(|e| panic!("base file {} must load: {e}", b.label));
    }
    run_target("gguf", 3000, |mut rng, _| {
        let base = &gguf_bases()[rng.random_range(0..gguf_bases().len())];
        let mut bytes = base.bytes.clone();
        let mut what = vec![base.label.clone()];
        let mut must_fail = false;
        for _ in 0..rng.random_range(1..=3) {
            let (w, f) = mutate_gguf(&mut rng, base, &mut bytes);
            what.push(w);
            // Only a lone mutation keeps its verdict (a later one may shift what it hit).
            must_fail = f && what.len() == 2;
        }
        move || judge(load_gguf_bytes(&bytes), must_fail, &what.join("; "))
    });
}

/// Deterministic sweep: the smallest base file cut at the start, middle and end of every header
/// field, and every count, length, dim and offset set to each huge value.
#[test]
fn gguf_every_field_truncated_or_huge_is_refused() {
    let base = &gguf_bases()[0];
    let seed = fuzz_common::base_seed();
    let fields = base.fields.clone();
    let bytes = Arc::new(base.bytes.clone());
    let data_end = base.data_end;
    run_case("gguf-sweep", seed, 0, move || {
        let mut cuts: Vec<usize> = fields.iter().flat_map(|f| [f.at, f.at + f.size / 2]).collect();
        cuts.extend([data_end - 1, data_end / 2]);
        for cut in cuts {
            if load_gguf_bytes(&bytes[..cut]).is_ok() {
                return Err(format!("truncated at {cut} it still loads"));
            }
        }
        for f in fields.iter().filter(|f| matches!(f.kind, Kind::Count | Kind::StrLen | Kind::ArrayLen | Kind::Dim)) {
            for v in [1u64 << 40, 1 << 62, u64::MAX, u64::MAX / 2 + 1] {
                let mut b = bytes.to_vec();
                overwrite(&mut b, f, v);
                match load_gguf_bytes(&b) {
                    Ok(()) => return Err(format!("{:?}@{} := {v:#x} still loads", f.kind, f.at)),
                    Err(e) if e.contains('\n') || e.starts_with("PROPERTY") => return Err(e),
                    Err(_) => {}
                }
            }
        }
        for f in fields.iter().filter(|f| matches!(f.kind, Kind::Offset)) {
            for v in [1u64, bytes.len() as u64, u64::MAX - 31, 1 << 63] {
                let mut b = bytes.to_vec();
                overwrite(&mut b, f, v);
                if load_gguf_bytes(&b).is_ok() {
                    return Err(format!("tensor offset@{} := {v:#x} still loads", f.at));
                }
            }
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// Hand-made GGUF files, each refused with a message naming the problem

struct Gguf(Vec<u8>);

impl Gguf {
    fn new(n_tensors: u64, n_kv: u64) -> Self {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        Self(b)
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn str(self, s: &str) -> Self {
        let mut g = self.u64(s.len() as u64);
        g.0.extend(s.as_bytes());
        g
    }
    fn pad(mut self, n: usize) -> Self {
        self.0.extend(vec![0u8; n]);
        self
    }
    /// A tensor directory entry.
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut g = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            g = g.u64(d);
        }
        g.u32(ty).u64(offset)
    }
}

fn refused(bytes: &[u8], expect: &str) {
    let err = match gguf_scan::read_content(&mut Cursor::new(bytes)) {
        Ok(_) => panic!("loaded; expected an error containing {expect:?}"),
        Err(e) => e,
    };
    assert!(err.contains(expect), "expected {expect:?} in: {err}");
    assert!(!err.contains('\n'), "one line: {err}");
}

#[test]
fn gguf_hostile_headers_are_refused_by_name() {
    // candle divides by the alignment: 0 panicked.
    refused(&Gguf::new(0, 1).str("general.alignment").u32(4).u32(0).pad(64).0, "general.alignment 0");
    refused(&Gguf::new(0, 1).str("general.alignment").u32(4).u32(48).pad(64).0, "power of two");
    // Dims whose product overflows usize panicked (debug) or wrapped (release) at load.
    refused(&Gguf::new(1, 0).tensor("t", &[1 << 40, 1 << 40], 0, 0).pad(64).0, "overflow");
    refused(&Gguf::new(1, 0).tensor("t", &[u64::MAX, 2], 0, 0).pad(64).0, "overflow");
    // A zero dim built a slice from a dangling, misaligned pointer (an abort in debug builds).
    refused(&Gguf::new(1, 0).tensor("t", &[0, 4], 0, 0).pad(64).0, "zero dim");
    refused(&Gguf::new(1, 0).tensor("t", &[4, 4], 0, 1 << 20).pad(64).0, "beyond the file");
    refused(&Gguf::new(1, 0).tensor("t", &[4], 0, u64::MAX - 31).pad(64).0, "beyond the file");
    refused(&Gguf::new(1, 0).tensor("t", &[4], 0, 4).pad(96).0, "not a multiple of the alignment");
    refused(&Gguf::new(1, 0).tensor("t", &[33], 8, 0).pad(96).0, "block of 32");
    refused(&Gguf::new(1, 0).tensor("t", &[4], 77, 0).pad(64).0, "unknown type id 77");
    refused(&Gguf::new(1, 0).tensor("t", &[4, 4, 4, 4, 4], 0, 0).pad(64).0, "5 dims");
    refused(&Gguf::new(2, 0).tensor("t", &[4], 0, 0).tensor("t", &[4], 0, 32).pad(96).0, "more than once");
    refused(&Gguf::new(u64::MAX, 0).0, "limit");
    refused(&Gguf::new(0, 1 << 40).0, "limit");
    refused(&Gguf::new(0, 1000).pad(100).0, "need at least");
    refused(&Gguf::new(0, 1).u64(u64::MAX).0, "declares");
    refused(&Gguf::new(0, 1).str("k").u32(8).u64(1 << 40).pad(64).0, "declares 1099511627776 bytes");
    refused(&Gguf::new(0, 1).str("k").u32(9).u32(0).u64(u64::MAX).pad(64).0, "array");
    refused(&Gguf::new(0, 1).str("k").u32(13).pad(64).0, "unknown value type 13");
    refused(&Gguf::new(0, 2).str("k").u32(0).pad(1).str("k").u32(0).pad(64).0, "appears more than once");
    let mut nested = Gguf::new(0, 1).str("k").u32(9);
    for _ in 0..12 {
        nested = nested.u32(9).u64(1);
    }
    refused(&nested.u32(0).u64(0).pad(64).0, "nested deeper");
    // 17M one-byte elements: candle would hold them as 32-byte values (half a GiB).
    let n = gguf_scan::MAX_ARRAY_ELEMENTS + 1;
    let big = Gguf::new(0, 1).str("k").u32(9).u32(0).u64(n).pad(n as usize);
    refused(&big.0, "may hold");
    // Names from the file are shown escaped and cut short: an error stays one short line.
    let mut key = "k\n".repeat(5000);
    key.push('\0');
    let long = Gguf::new(0, 1).str(&key).u32(77).pad(64).0;
    refused(&long, "k\\nk\\n");
    assert!(!gguf_scan::shown("a\"b\\c").contains("\\\""), "quotes stay as they are");
    let e = gguf_scan::read_content(&mut Cursor::new(&long)).err().unwrap_or_default();
    assert!(e.len() < 300, "{e}");
    refused(b"GGUF", "file ends");
    refused(b"GGML\x03\0\0\0", "bad magic");
    refused(&Gguf::new(0, 0).0[..8].iter().copied().chain([9, 9, 9, 9]).collect::<Vec<u8>>(), "file ends");
    let mut v4 = Gguf::new(0, 0).0;
    v4[4] = 4;
    refused(&v4, "version 4");
}

// ---------------------------------------------------------------------------------------------
// safetensors

struct StBase {
    label: String,
    config: String,
    bytes: Vec<u8>,
}

fn safetensors_file(cfg: &ModelConfig, dtype: safetensors::Dtype) -> Vec<u8> {
    let tensors = model_tensors(cfg, !cfg.tie_word_embeddings);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape)| {
            let t = synth_tensor(name, shape, 3).unwrap_or_else(|e| panic!("{name}: {e}"));
            let v = t.flatten_all().and_then(|t| t.to_vec1::<f32>()).unwrap_or_else(|e| panic!("{name}: {e}"));
            let bytes: Vec<u8> = match dtype {
                safetensors::Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                safetensors::Dtype::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                _ => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
            };
            (name.clone(), shape.clone(), bytes)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(dtype, s.clone(), b).unwrap_or_else(|e| panic!("{n}: {e}"));
            (n.clone(), view)
        })
        .collect();
    safetensors::tensor::serialize(views, None).unwrap_or_else(|e| panic!("serialize: {e}"))
}

fn config_text(cfg: &ModelConfig) -> String {
    config_json(cfg, &HubExtras { sliding_window: 64, max_window_layers: 1 }).to_string()
}

fn st_bases() -> &'static [StBase] {
    static BASES: OnceLock<Vec<StBase>> = OnceLock::new();
    BASES.get_or_init(|| {
        let tied = tiny_config(32, 16, true, RopeScaling::None);
        let untied = tiny_config(32, 16, false, RopeScaling::Linear { factor: 2.0 });
        vec![
            StBase {
                label: "f32-tied".into(),
                config: config_text(&tied),
                bytes: safetensors_file(&tied, safetensors::Dtype::F32),
            },
            StBase {
                label: "bf16-untied".into(),
                config: config_text(&untied),
                bytes: safetensors_file(&untied, safetensors::Dtype::BF16),
            },
            StBase {
                label: "f16-tied".into(),
                config: config_text(&tied),
                bytes: safetensors_file(&tied, safetensors::Dtype::F16),
            },
        ]
    })
}

/// Write a checkpoint directory and load it the way the server does.
fn load_dir(config: &str, files: &[(&str, &[u8])]) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| format!("HARNESS: tempdir: {e}"))?;
    std::fs::write(dir.path().join("config.json"), config).map_err(|e| format!("HARNESS: {e}"))?;
    for (name, bytes) in files {
        std::fs::write(dir.path().join(name), bytes).map_err(|e| format!("HARNESS: {e}"))?;
    }
    load_checkpoint(dir.path())
}

fn load_checkpoint(dir: &Path) -> Result<(), String> {
    let ck = Checkpoint::open(dir.to_str().unwrap_or_default()).map_err(|e| e.to_string())?;
    let _ = ck.weights.tensors();
    let model = DecoderModel::load(&ck.config, &ck.weights, DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    forward_one(&model)
}

fn split_st(bytes: &[u8]) -> (u64, Value, &[u8]) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
    let header = serde_json::from_slice(&bytes[8..8 + n as usize]).unwrap_or(Value::Null);
    (n, header, &bytes[8 + n as usize..])
}

fn join_st(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

/// A JSON value of a wrong or extreme kind.
fn odd_json(rng: &mut StdRng) -> Value {
    let picks = [
        json!(null),
        json!(-1),
        json!(0),
        json!(1),
        json!(1.5),
        json!(-0.0),
        json!(1e300),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(1u64 << 32),
        json!(1u64 << 40),
        json!(1u64 << 63),
        json!("12"),
        json!(""),
        json!("NaN"),
        json!(true),
        json!([]),
        json!([1]),
        json!([u64::MAX, u64::MAX]),
        json!([[1, 2]]),
        json!({}),
        json!({"a": 1}),
    ];
    picks.choose(rng).cloned().unwrap_or(Value::Null)
}

fn mutate_st_header(rng: &mut StdRng, header: &mut Value) -> String {
    let Some(map) = header.as_object_mut() else { return "not an object".into() };
    let names: Vec<String> = map.keys().filter(|k| *k != "__metadata__").cloned().collect();
    let Some(name) = names.choose(rng).cloned() else { return "empty".into() };
    match rng.random_range(0..8) {
        0 => {
            let d =
                *["F64", "I8", "U8", "BOOL", "F8_E4M3", "F4", "I64", "C64", "Q4", "f32", ""].choose(rng).unwrap_or(&"");
            map[&name]["dtype"] = json!(d);
            format!("{name}.dtype = {d}")
        }
        1 => {
            let s = [
                json!([]),
                json!([0]),
                json!([0, 32]),
                json!([1u64 << 32, 1u64 << 32]),
                json!([u64::MAX, 2]),
                json!([-1, 32]),
                json!([32, 32, 32, 32, 32]),
                json!([1.5]),
                json!("32"),
            ]
            .choose(rng)
            .cloned()
            .unwrap_or(Value::Null);
            map[&name]["shape"] = s.clone();
            format!("{name}.shape = {s}")
        }
        2 => {
            let (a, b) = (rng.random_range(0..5000u64), rng.random_range(0..5000u64));
            let o = [
                json!([b, a]),
                json!([a, u64::MAX]),
                json!([u64::MAX, 0]),
                json!([a]),
                json!([a, b, 1]),
                json!([-1, 4]),
            ]
            .choose(rng)
            .cloned()
            .unwrap_or(Value::Null);
            map[&name]["data_offsets"] = o.clone();
            format!("{name}.data_offsets = {o}")
        }
        3 => {
            let v = odd_json(rng);
            let field = *["dtype", "shape", "data_offsets"].choose(rng).unwrap_or(&"dtype");
            map[&name][field] = v.clone();
            format!("{name}.{field} = {v}")
        }
        4 => {
            map.remove(&name);
            format!("remove {name}")
        }
        5 => {
            let v = odd_json(rng);
            map.insert("__metadata__".into(), json!({"format": v}));
            "odd __metadata__".into()
        }
        6 => {
            map[&name] = odd_json(rng);
            format!("{name} = odd")
        }
        _ => {
            let other = names.choose(rng).cloned().unwrap_or_default();
            let swapped = map[&other].clone();
            map[&name]["shape"] = swapped["shape"].clone();
            format!("{name}.shape = {other}.shape")
        }
    }
}

#[test]
fn fuzz_safetensors() {
    for b in st_bases() {
        load_dir(&b.config, &[("model.safetensors", &b.bytes)])
            .unwrap_or_else(|e| panic!("base checkpoint {} must load: {e}", b.label));
    }
    run_target("safetensors", 3000, |mut rng, _| {
        let base = &st_bases()[rng.random_range(0..st_bases().len())];
        let (n, mut header, data) = split_st(&base.bytes);
        let file_len = base.bytes.len() as u64;
        let (bytes, what, must_fail) = match rng.random_range(0..7) {
            6 => {
                // NaN, infinity and garbage weights: still a loadable file.
                let mut b = base.bytes.clone();
                for _ in 0..rng.random_range(1..=64) {
                    let i = rng.random_range(8 + n as usize..b.len());
                    b[i] = *[0xff, 0x7f, 0x80, 0x00, rng.random()].choose(&mut rng).unwrap_or(&0);
                }
                (b, "data bytes".into(), false)
            }
            0 | 1 => {
                let what = mutate_st_header(&mut rng, &mut header);
                (join_st(&header.to_string(), data), what, false)
            }
            2 => {
                let mut b = base.bytes.clone();
                let v = interesting_u64(&mut rng, n, file_len);
                b[..8].copy_from_slice(&v.to_le_bytes());
                // A header longer than what follows the length can never be read.
                (b, format!("header length := {v:#x}"), v > file_len - 8)
            }
            3 => {
                let mut b = base.bytes.clone();
                let cut = rng.random_range(0..b.len());
                b.truncate(cut);
                (b, format!("truncate at {cut}"), true)
            }
            4 => {
                let mut b = base.bytes.clone();
                let end = if rng.random_bool(0.8) { 8 + n as usize } else { b.len() };
                for _ in 0..rng.random_range(1..=6) {
                    let i = rng.random_range(0..end);
                    b[i] ^= 1 << rng.random_range(0..8);
                }
                (b, "bit flips".into(), false)
            }
            _ => {
                // Raw text surgery on the header: drop or duplicate a span.
                let text = header.to_string();
                let a = rng.random_range(0..text.len());
                let z = rng.random_range(a..=text.len().min(a + 40));
                let t = if rng.random_bool(0.5) {
                    format!("{}{}", &text[..a], &text[z..])
                } else {
                    format!("{}{}", &text[..z], &text[a..])
                };
                (join_st(&t, data), format!("header text splice {a}..{z}"), false)
            }
        };
        let config = base.config.clone();
        let label = base.label.clone();
        move || judge(load_dir(&config, &[("model.safetensors", &bytes)]), must_fail, &format!("{label}: {what}"))
    });
}

#[test]
fn safetensors_bad_headers_are_refused_by_name() {
    let base = &st_bases()[0];
    let len = base.bytes.len() as u64;
    let load = |bytes: &[u8]| load_dir(&base.config, &[("model.safetensors", bytes)]);
    let mut b = base.bytes.clone();
    b[..8].copy_from_slice(&(len * 2).to_le_bytes());
    let e = load(&b).unwrap_err();
    assert!(e.contains("truncated"), "{e}");
    // Over the safetensors crate's 100 MB limit: the explanation must not parse it either.
    b[..8].copy_from_slice(&200_000_000u64.to_le_bytes());
    let e = load(&b).unwrap_err();
    assert!(e.contains("limit"), "{e}");
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(load(&b).is_err());
    let e = load(&base.bytes[..base.bytes.len() - 3]).unwrap_err();
    assert!(e.contains("truncated"), "{e}");
    let e = load(&base.bytes[..5]).unwrap_err();
    assert!(e.contains("only 5 bytes"), "{e}");
    let (_, mut header, data) = split_st(&base.bytes);
    header["model.norm.weight"]["dtype"] = json!("I32");
    let e = load(&join_st(&header.to_string(), data)).unwrap_err();
    assert!(e.contains("model.norm.weight") && e.contains("not supported"), "{e}");
    // Shards named outside the directory are refused before anything is opened.
    let index = json!({"weight_map": {"model.norm.weight": "../model.safetensors"}}).to_string();
    let e = load_dir(&base.config, &[("model.safetensors.index.json", index.as_bytes())]).unwrap_err();
    assert!(e.contains("not a file in the model directory"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// config.json

const CONFIG_KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "original_max_position_embeddings",
    "tie_word_embeddings",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
    "bos_token_id",
    "eos_token_id",
    "torch_dtype",
    "hidden_act",
    "architectures",
    "model_type",
];

fn odd_rope(rng: &mut StdRng) -> Value {
    let kind = *["yarn", "linear", "default", "dynamic", "longrope", ""].choose(rng).unwrap_or(&"yarn");
    let mut m = serde_json::Map::new();
    m.insert(if rng.random_bool(0.5) { "type" } else { "rope_type" }.into(), json!(kind));
    for k in [
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "rope_theta",
    ] {
        if rng.random_bool(0.5) {
            let v = if rng.random_bool(0.5) { odd_json(rng) } else { json!(rng.random_range(-4.0..64.0)) };
            m.insert(k.into(), v);
        }
    }
    Value::Object(m)
}

fn mutate_config(rng: &mut StdRng, cfg: &mut serde_json::Map<String, Value>) -> String {
    let key = *CONFIG_KEYS.choose(rng).unwrap_or(&"vocab_size");
    match rng.random_range(0..5) {
        0 => {
            cfg.remove(key);
            format!("remove {key}")
        }
        1 if key.starts_with("rope_") => {
            let v = odd_rope(rng);
            cfg.insert(key.into(), v.clone());
            format!("{key} = {v}")
        }
        2 => {
            // A plausible but absurd geometry.
            let v =
                json!(*[0u64, 1, 3, 7, 1000, 1025, 1 << 17, (1 << 17) + 1, 1 << 20, 1 << 24, (1 << 24) + 1, 1 << 32]
                    .choose(rng)
                    .unwrap_or(&0));
            cfg.insert(key.into(), v.clone());
            format!("{key} = {v}")
        }
        3 if key == "layer_types" => {
            let v = json!(vec!["sliding_attention"; rng.random_range(0..4)]);
            cfg.insert(key.into(), v.clone());
            cfg.insert("use_sliding_window".into(), json!(true));
            format!("{key} = {v}")
        }
        _ => {
            let v = odd_json(rng);
            cfg.insert(key.into(), v.clone());
            format!("{key} = {v}")
        }
    }
}

/// What an accepted config must satisfy before anything is sized from it.
fn config_sane(c: &ModelConfig) -> Result<(), String> {
    let ok = (1..=1024).contains(&c.num_hidden_layers)
        && (1..=1 << 17).contains(&c.hidden_size)
        && (1..=1024).contains(&c.num_attention_heads)
        && (1..=c.num_attention_heads).contains(&c.num_key_value_heads)
        && c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
        && (2..=1024).contains(&c.head_dim)
        && (1..=1 << 20).contains(&c.intermediate_size)
        && (1..=1 << 24).contains(&c.vocab_size)
        && c.rope.theta.is_finite()
        && c.rope.theta > 0.0
        && c.rms_norm_eps.is_finite()
        && c.max_position_embeddings > 0
        && c.sliding_window_layers.len() == c.num_hidden_layers;
    if !ok {
        return Err(format!("PROPERTY: accepted an out-of-range config {c:?}"));
    }
    // What the engine derives from it must not panic.
    let _ = (c.max_context_len(), c.kv_bytes_per_token(4));
    let rope = flint_model::rope::Rope::new(&c.rope, c.head_dim);
    rope.cos_sin(&[0, 1, u32::MAX], &Device::Cpu).map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn fuzz_config_json() {
    let tied = tiny_config(32, 16, true, RopeScaling::None);
    let base_text = config_text(&tied);
    let base: serde_json::Map<String, Value> = match serde_json::from_str(&base_text) {
        Ok(Value::Object(m)) => m,
        other => panic!("config_json wrote {other:?}"),
    };
    let weights = Arc::new(st_bases()[0].bytes.clone());
    load_dir(&base_text, &[("model.safetensors", &weights)]).unwrap_or_else(|e| panic!("base config: {e}"));
    run_target("config", 10000, move |mut rng, case| {
        let mut cfg = base.clone();
        let mut what = Vec::new();
        for _ in 0..rng.random_range(1..=4) {
            what.push(mutate_config(&mut rng, &mut cfg));
        }
        let mut text = Value::Object(cfg).to_string();
        if rng.random_bool(0.1) {
            // Raw text damage: a cut, or numbers JSON cannot hold.
            text = match rng.random_range(0..3) {
                0 => text[..rng.random_range(0..text.len())].to_string(),
                1 => text.replacen(
                    "10000.0",
                    ["NaN", "Infinity", "-1e400", "1e999"].choose(&mut rng).unwrap_or(&"NaN"),
                    1,
                ),
                _ => text.replacen("32,", "32.0000000000000000001e2,", 1),
            };
            what.push("text damage".into());
        }
        let weights = weights.clone();
        // Every eighth case also loads the checkpoint with the tiny weights.
        let full = case % 8 == 0;
        move || {
            let what = what.join("; ");
            let parsed = ModelConfig::from_json_str(&text);
            let result = match parsed {
                Ok(c) => config_sane(&c).and_then(|()| {
                    if full {
                        load_dir(&text, &[("model.safetensors", &weights)])
                    } else {
                        Ok(())
                    }
                }),
                Err(e) => Err(e.to_string()),
            };
            judge(result, false, &what)
        }
    });
}

#[test]
fn config_json_absurd_values_are_refused_by_name() {
    let tied = tiny_config(32, 16, true, RopeScaling::None);
    let base: Value = serde_json::from_str(&config_text(&tied)).unwrap_or(Value::Null);
    let with = |k: &str, v: Value| {
        let mut c = base.clone();
        c[k] = v;
        ModelConfig::from_json_str(&c.to_string()).map(|_| ()).map_err(|e| e.to_string())
    };
    let err = |k: &str, v: Value, expect: &str| {
        let e = with(k, v.clone()).expect_err(&format!("{k} = {v} must be refused"));
        assert!(e.contains(expect), "{k} = {v}: expected {expect:?} in {e}");
    };
    err("vocab_size", json!(-1), "invalid config.json");
    err("vocab_size", json!(1u64 << 40), "vocab_size");
    err("hidden_size", json!("32"), "invalid config.json");
    err("num_hidden_layers", json!(0), "num_hidden_layers 0");
    err("num_attention_heads", json!(0), "num_attention_heads");
    err("head_dim", json!(15), "even");
    err("rope_theta", json!(0.0), "rope_theta");
    err("rope_theta", json!(-5.0), "rope_theta");
    err("rms_norm_eps", json!(-1e-6), "rms_norm_eps");
    err("max_position_embeddings", json!(0), "max_position_embeddings");
    err("rope_scaling", json!({"type": "linear", "factor": 0.0}), "rope_scaling.factor");
    err("rope_scaling", json!({"type": "yarn", "factor": -2.0}), "rope_scaling.factor");
    err("rope_scaling", json!({"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}), "original");
    err("rope_scaling", json!([1]), "rope_scaling");
    let mut c = base.clone();
    c["use_sliding_window"] = json!(true);
    c["sliding_window"] = json!(0);
    let e = ModelConfig::from_json_str(&c.to_string()).unwrap_err().to_string();
    assert!(e.contains("sliding_window"), "{e}");
    assert!(ModelConfig::from_json_str("{\"vocab_size\": NaN}").is_err());
    assert!(with("rope_theta", json!(1e6)).is_ok());
}
