//! A bounded pre-scan of a GGUF header, run before candle's reader sees the file.
//!
//! candle's `gguf_file::Content::read` checks string and array lengths against the bytes left in
//! the file, but still trusts a file in ways that end in a panic or an outsized allocation:
//! `general.alignment` 0 divides by zero, tensor dims whose product overflows `usize` panic (or
//! wrap, in release builds) when the tensor is read, a zero-sized dim builds a slice from a
//! misaligned dangling pointer, and an array of a million one-byte elements becomes a million
//! 32-byte values. This scan walks the same structure without building it and refuses, with a
//! message naming the field, anything outside limits no real checkpoint comes near:
//!
//! - counts: at most [`MAX_TENSORS`] tensors and [`MAX_KV`] metadata entries, every declared
//!   length and count fitting in the bytes left in the file;
//! - sizes: keys and tensor names up to [`MAX_NAME_LEN`] bytes, string values up to
//!   [`MAX_STRING_LEN`], arrays up to [`MAX_ARRAY_ELEMENTS`] elements in all (a 256K-entry
//!   vocabulary with scores, types and merges is about 1M), nested at most [`MAX_DEPTH`] deep;
//! - tensors: 1 to 4 non-zero dims, a known type whose block size divides the element count, and
//!   data (at an aligned offset) that lies inside the file; no name or key twice.
//!
//! Only key and tensor names are held in memory (to find duplicates), so the scan costs at most
//! the size of the header.

use std::collections::HashSet;
use std::io::{BufReader, Read, Seek, SeekFrom};

use candle_core::quantized::GgmlDType;

/// Tensors in one file; a Qwen2 model of the largest geometry flint accepts has about 12K.
pub const MAX_TENSORS: u64 = 1 << 16;
/// Metadata entries in one file; llama.cpp writes a few dozen.
pub const MAX_KV: u64 = 1 << 16;
/// Bytes of one metadata key or tensor name (llama.cpp caps tensor names at 64).
pub const MAX_NAME_LEN: u64 = 1 << 16;
/// Bytes of one string value (chat templates are tens of KB).
pub const MAX_STRING_LEN: u64 = 1 << 28;
/// Array elements in the whole file, nested arrays included.
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 24;
/// Nesting depth of arrays of arrays.
pub const MAX_DEPTH: usize = 8;

const DEFAULT_ALIGNMENT: u64 = 32;

/// How much of a name from a file an error message shows.
pub const SHOWN_CHARS: usize = 160;

/// A name from the file as an error shows it: control characters escaped (no newlines) and
/// cut to [`SHOWN_CHARS`] characters, so a hostile name cannot flood or split the message.
pub fn shown(name: &str) -> String {
    shown_up_to(name, SHOWN_CHARS)
}

/// [`shown`] with a limit of `max` characters.
pub fn shown_up_to(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars().take(max) {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

const TYPE_STRING: u32 = 8;
const TYPE_ARRAY: u32 = 9;

/// GGML's on-disk type id, for the types candle can read.
pub fn ggml_type_from_id(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// What the scan learned, for callers that want it (the tests do).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufSummary {
    pub version: u32,
    pub n_tensors: u64,
    pub n_kv: u64,
    /// Where tensor data starts (after the header, aligned).
    pub data_offset: u64,
}

/// Scan the GGUF file in `reader` (from its start, `file_len` bytes long). On success the reader
/// is left at the start again. Errors are one line naming what is wrong.
pub fn scan<R: Read + Seek>(reader: &mut R, file_len: u64) -> Result<GgufSummary, String> {
    reader.seek(SeekFrom::Start(0)).map_err(|e| format!("cannot seek: {e}"))?;
    let summary = {
        let mut s = Scanner { r: BufReader::with_capacity(1 << 16, &mut *reader), pos: 0, len: file_len, v1: false };
        s.run()?
    };
    reader.seek(SeekFrom::Start(0)).map_err(|e| format!("cannot seek: {e}"))?;
    Ok(summary)
}

struct Scanner<R> {
    r: BufReader<R>,
    pos: u64,
    len: u64,
    /// GGUF v1 writes lengths and dims as u32.
    v1: bool,
}

/// A metadata value the scan keeps: the integer `general.alignment` needs.
enum Kept {
    Int(i128),
    Other,
}

impl<R: Read + Seek> Scanner<R> {
    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|_| format!("file ends inside {what} at byte {}", self.pos))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.bytes::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }

    /// A length or count: u32 in v1, u64 after.
    fn length(&mut self, what: &str) -> Result<u64, String> {
        if self.v1 {
            self.u32(what).map(u64::from)
        } else {
            self.u64(what)
        }
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<(), String> {
        if n > self.remaining() {
            return Err(format!("{what} needs {n} bytes at byte {}, only {} remain", self.pos, self.remaining()));
        }
        let step = i64::try_from(n).map_err(|_| format!("{what} of {n} bytes is too large"))?;
        self.r.seek_relative(step).map_err(|e| format!("cannot skip {what}: {e}"))?;
        self.pos += n;
        Ok(())
    }

    /// A length-prefixed string of at most `max` bytes, returned as candle will see it.
    fn string(&mut self, max: u64, what: &str) -> Result<String, String> {
        let n = self.string_len(max, what)?;
        let mut v = vec![0u8; n as usize];
        self.r.read_exact(&mut v).map_err(|_| format!("file ends inside {what} at byte {}", self.pos))?;
        self.pos += n;
        while v.last() == Some(&0) {
            v.pop();
        }
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    fn string_len(&mut self, max: u64, what: &str) -> Result<u64, String> {
        let at = self.pos;
        let n = self.length(what)?;
        if n > max {
            return Err(format!("{what} at byte {at} declares {n} bytes (limit {max})"));
        }
        if n > self.remaining() {
            return Err(format!(
                "{what} at byte {at} declares {n} bytes, only {} remain in the file",
                self.remaining()
            ));
        }
        Ok(n)
    }

    fn run(&mut self) -> Result<GgufSummary, String> {
        let magic = self.bytes::<4>("the magic")?;
        // candle accepts the magic in either byte order.
        if &magic != b"GGUF" && &magic != b"FUGG" {
            return Err(format!("bad magic {magic:02x?} (expected \"GGUF\")"));
        }
        let version = self.u32("the version")?;
        if !(1..=3).contains(&version) {
            return Err(format!("unsupported GGUF version {version} (1 to 3)"));
        }
        self.v1 = version == 1;
        let n_tensors = self.length("the tensor count")?;
        let n_kv = self.length("the metadata count")?;
        if n_tensors > MAX_TENSORS {
            return Err(format!("header declares {n_tensors} tensors (limit {MAX_TENSORS})"));
        }
        if n_kv > MAX_KV {
            return Err(format!("header declares {n_kv} metadata entries (limit {MAX_KV})"));
        }
        let prefix = if self.v1 { 4 } else { 8 };
        // Smallest possible entries: key + type + one byte; name + n_dims + type + offset.
        let least = n_kv * (prefix + 5) + n_tensors * (prefix + 16);
        if least > self.remaining() {
            return Err(format!(
                "header declares {n_tensors} tensors and {n_kv} metadata entries, which need at least {least} bytes; \
                 only {} remain",
                self.remaining()
            ));
        }

        let mut budget = MAX_ARRAY_ELEMENTS;
        let mut keys = HashSet::new();
        let mut alignment = DEFAULT_ALIGNMENT;
        for i in 0..n_kv {
            let key = self.string(MAX_NAME_LEN, &format!("metadata key #{i}"))?;
            let ty = self.u32("a metadata type")?;
            let kept = self.value(ty, 0, &mut budget).map_err(|e| format!("metadata `{}`: {e}", shown(&key)))?;
            if key == "general.alignment" {
                // candle reads the alignment from 8/16/32-bit integers and ignores other types.
                alignment = match (ty, kept) {
                    (0..=5, Kept::Int(a)) if a > 0 && (a as u64).is_power_of_two() => a as u64,
                    (0..=5, Kept::Int(a)) => {
                        return Err(format!("general.alignment {a} is not a positive power of two"));
                    }
                    _ => return Err(format!("general.alignment has type {ty}; expected an integer")),
                };
            }
            if !keys.insert(key.clone()) {
                return Err(format!("metadata key `{}` appears more than once", shown(&key)));
            }
        }

        let mut names = HashSet::new();
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let raw_name = self.string(MAX_NAME_LEN, &format!("tensor name #{i}"))?;
            let name = shown(&raw_name);
            let n_dims = self.u32("a tensor's dim count")?;
            if !(1..=4).contains(&n_dims) {
                return Err(format!("tensor `{name}` has {n_dims} dims (1 to 4)"));
            }
            let mut dims = [0u64; 4];
            for d in dims.iter_mut().take(n_dims as usize) {
                *d = self.length("a tensor dim")?;
            }
            let dims = &dims[..n_dims as usize];
            let type_id = self.u32("a tensor type")?;
            let offset = self.u64("a tensor offset")?;
            let ty =
                ggml_type_from_id(type_id).ok_or_else(|| format!("tensor `{name}` has unknown type id {type_id}"))?;
            if dims.contains(&0) {
                return Err(format!("tensor `{name}` has a zero dim {dims:?}"));
            }
            let elems = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&e| usize::try_from(e).is_ok())
                .ok_or_else(|| format!("tensor `{name}` dims {dims:?} overflow"))?;
            // GGUF lists the innermost dim (the row) first; blocks never straddle rows.
            let block = ty.block_size() as u64;
            if !dims[0].is_multiple_of(block) {
                return Err(format!(
                    "tensor `{name}` has rows of {}, not a multiple of {ty:?}'s block of {block}",
                    dims[0]
                ));
            }
            let bytes = (elems / block)
                .checked_mul(ty.type_size() as u64)
                .ok_or_else(|| format!("tensor `{name}` dims {dims:?} overflow"))?;
            if !names.insert(raw_name) {
                return Err(format!("tensor `{name}` appears more than once"));
            }
            tensors.push((name, offset, bytes));
        }

        let data_offset = self
            .pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| "the header end overflows when aligned".to_string())?;
        let data_len = self.len.saturating_sub(data_offset);
        for (name, offset, bytes) in &tensors {
            if !offset.is_multiple_of(alignment) {
                return Err(format!("tensor `{name}` offset {offset} is not a multiple of the alignment {alignment}"));
            }
            match offset.checked_add(*bytes) {
                Some(end) if end <= data_len => {}
                _ => {
                    return Err(format!(
                        "tensor `{name}` data {offset}..+{bytes} lies beyond the file's {data_len} data bytes \
                         (truncated file?)"
                    ))
                }
            }
        }
        Ok(GgufSummary { version, n_tensors, n_kv, data_offset })
    }

    /// Walk one value of type `ty`; `budget` counts the array elements still allowed.
    fn value(&mut self, ty: u32, depth: usize, budget: &mut u64) -> Result<Kept, String> {
        let fixed = |ty: u32| -> Option<u64> {
            match ty {
                0 | 1 | 7 => Some(1),
                2 | 3 => Some(2),
                4..=6 => Some(4),
                10..=12 => Some(8),
                _ => None,
            }
        };
        match ty {
            0 => Ok(Kept::Int(self.bytes::<1>("a u8")?[0].into())),
            1 => Ok(Kept::Int(i8::from_le_bytes(self.bytes::<1>("an i8")?).into())),
            2 => Ok(Kept::Int(u16::from_le_bytes(self.bytes::<2>("a u16")?).into())),
            3 => Ok(Kept::Int(i16::from_le_bytes(self.bytes::<2>("an i16")?).into())),
            4 => Ok(Kept::Int(self.u32("a u32")?.into())),
            5 => Ok(Kept::Int(i32::from_le_bytes(self.bytes::<4>("an i32")?).into())),
            7 => match self.bytes::<1>("a bool")?[0] {
                0 | 1 => Ok(Kept::Other),
                b => Err(format!("bool byte {b} (0 or 1)")),
            },
            TYPE_STRING => {
                let n = self.string_len(MAX_STRING_LEN, "a string value")?;
                self.skip(n, "a string value")?;
                Ok(Kept::Other)
            }
            TYPE_ARRAY => {
                if depth >= MAX_DEPTH {
                    return Err(format!("arrays nested deeper than {MAX_DEPTH}"));
                }
                let elem_ty = self.u32("an array element type")?;
                let at = self.pos;
                let n = self.length("an array length")?;
                if n > *budget {
                    return Err(format!(
                        "array at byte {at} declares {n} elements; the file may hold {MAX_ARRAY_ELEMENTS} in all"
                    ));
                }
                *budget -= n;
                match (elem_ty, fixed(elem_ty)) {
                    // Booleans are checked one by one, as candle reads them.
                    (7, _) => {
                        if n > self.remaining() {
                            return Err(format!("array at byte {at} of {n} bools exceeds the file"));
                        }
                        for _ in 0..n {
                            self.value(7, depth + 1, budget)?;
                        }
                    }
                    (_, Some(size)) => self.skip(n * size, "an array")?,
                    (TYPE_STRING | TYPE_ARRAY, _) => {
                        let least = n * if self.v1 { 4 } else { 8 };
                        if least > self.remaining() {
                            return Err(format!(
                                "array at byte {at} of {n} elements needs at least {least} bytes, only {} remain",
                                self.remaining()
                            ));
                        }
                        for _ in 0..n {
                            self.value(elem_ty, depth + 1, budget)?;
                        }
                    }
                    _ => return Err(format!("array of unknown element type {elem_ty}")),
                }
                Ok(Kept::Other)
            }
            _ => match fixed(ty) {
                Some(size) => {
                    self.skip(size, "a value")?;
                    Ok(Kept::Other)
                }
                None => Err(format!("unknown value type {ty}")),
            },
        }
    }
}

/// [`scan`] the file, then read its metadata and tensor directory with candle (buffered).
pub fn read_content<R: Read + Seek>(reader: &mut R) -> Result<candle_core::quantized::gguf_file::Content, String> {
    let len = reader.seek(SeekFrom::End(0)).map_err(|e| format!("cannot seek: {e}"))?;
    scan(reader, len)?;
    let mut buffered = BufReader::with_capacity(1 << 16, reader);
    candle_core::quantized::gguf_file::Content::read(&mut buffered)
        .map_err(|e| e.to_string().lines().next().unwrap_or("unreadable header").to_string())
}
