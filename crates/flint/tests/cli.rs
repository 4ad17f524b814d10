//! The real `flint` binary, end to end: synth → inspect → generate on safetensors and GGUF, and
//! every kind of bad checkpoint ending in one clear line and a non-zero exit, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn flint(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flint"))
        .args(args)
        // Keep the demo model and hub lookups inside the test's sandbox.
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run flint")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit 1 (not clap's 2, not a panic's 101) and exactly one `error:` line that mentions `needles`.
fn assert_one_line_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "expected a clean failure, got {:?}: {err}", o.status);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for n in needles {
        assert!(lines[0].contains(n), "`{n}` missing from: {err}");
    }
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
}

#[test]
fn synth_inspect_generate_tiny_safetensors_and_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let st = tmp.path().join("tiny-st");
    let o = flint(&["synth", "--shape", "tiny", "--out", st.to_str().unwrap(), "--dtype", "f32"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = flint(&["inspect", "--model", st.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("layers:          2"), "{text}");
    assert!(text.contains("vocab size:      151936"), "{text}");

    let gg = tmp.path().join("tiny-gguf");
    let o = flint(&["synth", "--shape", "tiny", "--out", gg.to_str().unwrap(), "--gguf", "q8_0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The metadata llama.cpp's converter would write for a Qwen2.5 checkpoint.
    let g = flint_model::weights::GgufWeights::open(&gg.join("model-q8_0.gguf")).unwrap();
    let meta = flint_model::gguf::GgufTokenizerMeta::from_metadata(g.metadata()).unwrap();
    assert_eq!((meta.model.as_str(), meta.pre.as_deref()), ("gpt2", Some("qwen2")));
    assert_eq!(meta.tokens.len(), 151936, "tokens padded to the embedding's rows");
    assert_eq!((meta.eos_token_id, meta.padding_token_id), (Some(151645), Some(151643)));
    assert!(meta.chat_template.is_some_and(|t| t.contains("<|im_start|>")));

    // Same seed, same weights: greedy text from safetensors and from its Q8_0 GGUF both run.
    for model in [&st, &gg] {
        let o = flint(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "Hello world",
            "--max-tokens",
            "8",
            "--ignore-eos",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.contains("prefill: 2 tokens") && err.contains("decode: 7 tokens") && err.contains("generated 8 tokens"),
            "{err}"
        );
        let o =
            flint(&["generate", "--model", model.to_str().unwrap(), "--prompt", "Hi", "--chat", "--max-tokens", "4"]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
}

#[test]
fn generate_without_model_uses_builtin_demo_and_is_deterministic() {
    let run = || flint(&["generate", "--prompt", "Once upon a time", "--max-tokens", "6", "--ignore-eos"]);
    let (a, b) = (run(), run());
    assert!(a.status.success(), "{}", stderr(&a));
    assert!(stderr(&a).contains("generated 6 tokens"), "{}", stderr(&a));
    assert_eq!(a.stdout, b.stdout, "greedy output must not change between runs");
    let s = |seed: &str| {
        flint(&[
            "generate",
            "--prompt",
            "Once",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--temperature",
            "1.0",
            "--seed",
            seed,
        ])
    };
    assert_eq!(s("3").stdout, s("3").stdout, "a seed must reproduce sampled output");
}

#[test]
fn missing_model_path_is_one_line() {
    let o = flint(&["inspect", "--model", "/nonexistent/model-dir"]);
    assert_one_line_error(&o, &["/nonexistent/model-dir"]);
}

#[test]
fn offline_hub_id_is_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_flint"))
        .args(["inspect", "--model", "Qwen/Qwen2.5-0.5B-Instruct"])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", tmp.path())
        .output()
        .unwrap();
    assert_one_line_error(&o, &["Qwen/Qwen2.5-0.5B-Instruct", "HF_HUB_OFFLINE"]);
}

#[test]
fn truncated_safetensors_names_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&fixtures().join("small-f32"), tmp.path());
    let shard = tmp.path().join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len / 2).unwrap();
    let o = flint(&["inspect", "--model", tmp.path().to_str().unwrap()]);
    assert_one_line_error(&o, &["model-00002-of-00002.safetensors", "tensor `", "truncated"]);
}

#[test]
fn header_only_truncation_is_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&fixtures().join("small-f32"), tmp.path());
    let shard = tmp.path().join("model-00001-of-00002.safetensors");
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(20).unwrap();
    let o = flint(&["inspect", "--model", tmp.path().to_str().unwrap()]);
    assert_one_line_error(&o, &["model-00001-of-00002.safetensors", "not a valid safetensors file"]);
}

#[test]
fn corrupt_gguf_header_is_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("broken.gguf");
    let mut bytes = std::fs::read(fixtures().join("small-gguf/model-q8_0.gguf")).unwrap();
    bytes[0..4].copy_from_slice(b"GGXX");
    std::fs::write(&bad, &bytes).unwrap();
    let o = flint(&["inspect", "--model", bad.to_str().unwrap()]);
    assert_one_line_error(&o, &["broken.gguf", "not a valid GGUF file"]);

    // A valid magic with a header cut short.
    let cut = tmp.path().join("cut.gguf");
    let good = std::fs::read(fixtures().join("small-gguf/model-q8_0.gguf")).unwrap();
    std::fs::write(&cut, &good[..300]).unwrap();
    let o = flint(&["inspect", "--model", cut.to_str().unwrap()]);
    assert_one_line_error(&o, &["cut.gguf", "not a valid GGUF file"]);
}

#[test]
fn unknown_architecture_is_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&fixtures().join("small-f32"), tmp.path());
    let cfg_path = tmp.path().join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap().replace("Qwen2ForCausalLM", "GemmaForCausalLM");
    std::fs::write(&cfg_path, cfg).unwrap();
    let o = flint(&["inspect", "--model", tmp.path().to_str().unwrap()]);
    assert_one_line_error(&o, &["config.json", "GemmaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]);
}

#[test]
fn wrong_tensor_shape_names_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&fixtures().join("small-f32"), tmp.path());
    let cfg_path = tmp.path().join("config.json");
    let cfg =
        std::fs::read_to_string(&cfg_path).unwrap().replace("\"intermediate_size\": 512", "\"intermediate_size\": 384");
    std::fs::write(&cfg_path, cfg).unwrap();
    let tokenizer = flint_engine::tokenizer::Tokenizer::builtin_qwen_json().unwrap();
    std::fs::write(tmp.path().join("tokenizer.json"), tokenizer).unwrap();
    let o = flint(&["generate", "--model", tmp.path().to_str().unwrap(), "--prompt", "x"]);
    assert_one_line_error(&o, &["model-0000", "model.layers.0.mlp.gate_proj.weight", "[384, 256]", "[512, 256]"]);
}

#[test]
fn missing_tokenizer_is_one_line() {
    let o = flint(&["generate", "--model", fixtures().join("small-f32").to_str().unwrap(), "--prompt", "x"]);
    assert_one_line_error(&o, &["tokenizer.json"]);
}

#[test]
fn bad_cli_values_are_one_line() {
    let o = flint(&["generate", "--prompt", "x", "--temperature=-1"]);
    assert_one_line_error(&o, &["temperature"]);
    let o = flint(&["synth", "--shape", "gpt-5", "--out", "/tmp/never"]);
    assert_one_line_error(&o, &["gpt-5", "qwen2.5-0.5b"]);
    let o = flint(&[
        "generate",
        "--prompt",
        "x",
        "--speculative-config",
        r#"{"method": "eagle", "num_speculative_tokens": 2}"#,
    ]);
    assert_one_line_error(&o, &["unknown method \"eagle\"", "ngram"]);
    // A scripted model is a bigram table: a script that needs context is refused naming the
    // token (in text) and what to do, before anything is written.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("s");
    let two = r#"<tool_call>{"name":"f","arguments":{"city":"Paris","days":3}}</tool_call>"#;
    let o = flint(&["synth", "--shape", "scripted", "--script", two, "--out", out.to_str().unwrap()]);
    assert_one_line_error(&o, &["repeats the token \"\\\":\\\"\"", "two arguments", "rephrase"]);
    assert!(!out.exists());
}

/// `--device` names a device this build cannot use: one line saying what to do, before any model
/// loads. (CI builds without the cuda feature; `scripts/device_check.sh` runs the GPU path.)
#[test]
fn unavailable_devices_are_one_line() {
    let o = flint(&["generate", "--prompt", "x", "--device", "cuda:0"]);
    assert_one_line_error(&o, &["--device cuda:0", "built without CUDA", "--features cuda"]);
    let o = flint(&["bench", "latency", "--device", "metal", "--model", "/nonexistent"]);
    assert_one_line_error(&o, &["--device metal", "no Metal kernels"]);
    let o = flint(&["serve", "--device", "cuda:1", "--port", "1"]);
    assert_one_line_error(&o, &["--device cuda:1", "built without CUDA"]);
    let o = flint(&["generate", "--prompt", "x", "--device", "tpu"]);
    assert_eq!(o.status.code(), Some(2), "clap rejects the value: {}", stderr(&o));
    assert!(stderr(&o).contains("unknown device \"tpu\""), "{}", stderr(&o));
}

/// n-gram speculation in `flint generate`: the same greedy text, and its acceptance reported.
#[test]
fn generate_with_ngram_speculation_keeps_the_greedy_text() {
    let prompt = "one two three four five six seven eight one two three four five six seven eight one two";
    let base = ["generate", "--prompt", prompt, "--max-tokens", "48", "--ignore-eos"];
    let plain = flint(&base);
    let mut args = base.to_vec();
    args.extend([
        "--speculative-config",
        r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}"#,
    ]);
    let spec = flint(&args);
    assert!(spec.status.success(), "{}", stderr(&spec));
    assert_eq!(plain.stdout, spec.stdout, "speculation changed the greedy text");
    assert!(stderr(&spec).contains("SpecDecoding metrics: Mean acceptance length"), "{}", stderr(&spec));
}

/// `FLINT_CPU_ISA` caps the kernels' instruction set; every path computes the same bits, so the
/// greedy text of a quantized model is the same on each. A bad value is one line.
#[test]
fn every_cpu_isa_generates_the_same_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let gg = tmp.path().join("tiny-q4");
    let o = flint(&["synth", "--shape", "tiny", "--out", gg.to_str().unwrap(), "--gguf", "q4_0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let model = gg.join("model-q4_0.gguf");
    let run = |isa: &str| {
        Command::new(env!("CARGO_BIN_EXE_flint"))
            .args(["generate", "--model", model.to_str().unwrap(), "--prompt", "Hello world", "--max-tokens", "12"])
            .args(["--ignore-eos"])
            .env("HF_HUB_OFFLINE", "1")
            .env("FLINT_CPU_ISA", isa)
            .output()
            .expect("run flint")
    };
    let native = run("avx512");
    assert!(native.status.success(), "{}", stderr(&native));
    assert!(!native.stdout.is_empty());
    // `amx` runs the tiles where the CPU has them (whatever it has otherwise).
    for isa in ["amx", "amx-bf16", "avx512bf16", "avx2", "scalar"] {
        let o = run(isa);
        assert!(o.status.success(), "{isa}: {}", stderr(&o));
        assert_eq!(o.stdout, native.stdout, "{isa} must generate what the widest path does");
    }
    assert_one_line_error(&run("sse9"), &["FLINT_CPU_ISA", "sse9"]);
    let o = Command::new(env!("CARGO_BIN_EXE_flint"))
        .args(["inspect", "--model", model.to_str().unwrap()])
        .env("FLINT_THREADS", "lots")
        .output()
        .expect("run flint");
    assert_one_line_error(&o, &["FLINT_THREADS", "lots"]);
}

#[test]
fn offline_hub_id_resolves_from_the_local_cache() {
    // The layout hf-hub (and huggingface_hub) use: hub/models--Org--Name/{refs/main, snapshots/REV/}.
    let home = tempfile::tempdir().unwrap();
    let repo = home.path().join("hub/models--acme--tiny-qwen");
    let snap = repo.join("snapshots/0123456789abcdef");
    copy_dir(&fixtures().join("small-f32"), &snap);
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123456789abcdef").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_flint"))
        .args(["inspect", "--model", "acme/tiny-qwen"])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", home.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("vocab size:      512"));
}

#[test]
fn bench_throughput_and_sweep_on_the_demo_model() {
    let o = flint(&["bench", "throughput", "--num-prompts", "3", "--input-len", "8", "--output-len", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("3 requests") && out.contains("output tok/s"), "{out}");

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sweep");
    let o = flint(&[
        "bench",
        "throughput",
        "--sweep",
        "--input-len",
        "6",
        "--output-len",
        "3",
        "--out-dir",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("throughput-sweep.json")).unwrap()).unwrap();
    let levels = json["levels"].as_array().unwrap();
    let conc: Vec<u64> = levels.iter().map(|l| l["concurrency"].as_u64().unwrap()).collect();
    assert_eq!(conc, vec![1, 2, 4, 8, 16, 32]);
    for l in levels {
        assert_eq!(l["num_prompts"], l["concurrency"]);
        assert!(l["output_tokens_per_s"].as_f64().unwrap() > 0.0, "{l}");
    }
    let svg = std::fs::read_to_string(dir.join("throughput-sweep.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("decode-phase tok/s") && svg.contains("<polyline"), "{svg}");

    let o = flint(&["bench", "throughput", "--input-len", "0"]);
    assert_one_line_error(&o, &["--input-len"]);
}

/// `--kv-cache-dtype` on every command that builds an engine, `flint inspect`'s capacity table,
/// `bench latency --depth`, and vLLM's fp8 names refused with the values flint takes.
#[test]
fn kv_cache_dtype_flag_inspect_generate_and_bench_depth() {
    let tmp = tempfile::tempdir().unwrap();
    let st = tmp.path().join("tiny");
    let o = flint(&["synth", "--shape", "tiny", "--out", st.to_str().unwrap(), "--dtype", "f32"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = st.to_str().unwrap();
    let o = flint(&["inspect", "--model", m, "--kv-cache-dtype", "int8", "--kv-cache-memory", "1G"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = |dt: &str| text.lines().find(|l| l.trim_start().trim_start_matches('*').starts_with(dt)).unwrap_or("");
    assert!(line("int8").contains("*int8") && line("int8").contains("block  128"), "{text}");
    assert!(line("bf16").contains("(2.00x f32)"), "{text}");
    let ratio: f64 = line("int8").rsplit('(').next().unwrap().trim_end_matches("x f32)").parse().unwrap();
    // The tiny shape's 16-wide heads: (2·16 + 3·16/128 + 1) bytes against 128, 3.84×; the real
    // shapes' 64- and 128-wide heads reach 3.92× and 3.94× (`kv_dtype`'s unit test).
    assert!(ratio >= 3.8, "int8 holds {ratio}x f32's tokens: {text}");

    for kv in ["int8", "bf16", "f32", "auto"] {
        let o = flint(&[
            "generate",
            "--model",
            m,
            "--prompt",
            "Hello world",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--kv-cache-dtype",
            kv,
        ]);
        assert!(o.status.success(), "{kv}: {}", stderr(&o));
        assert!(stderr(&o).contains("generated 5 tokens"), "{}", stderr(&o));
    }
    let o = flint(&["generate", "--model", m, "--prompt", "Hi", "--kv-cache-dtype", "fp8_e4m3"]);
    assert_ne!(o.status.code(), Some(0));
    assert_ne!(o.status.code(), Some(101), "a panic: {}", stderr(&o));
    assert!(stderr(&o).contains("auto, f32, bf16, int8"), "{}", stderr(&o));

    let o = flint(&[
        "bench",
        "latency",
        "--model",
        m,
        "--kv-cache-dtype",
        "int8",
        "--depth",
        "0,300",
        "--prompt-len",
        "16",
        "--gen-len",
        "4",
        "--reps",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("pp16 @ d300") && out.contains("tg4 @ d300") && out.contains("KV int8"), "{out}");
    assert!(stderr(&o).contains("context prefill: 300 tokens"), "{}", stderr(&o));
}

/// `bench latency --bandwidth-probe`: each decode step's weight bytes as the kernels counted
/// them, for one sequence and for several decoding together. A dense model's step reads the same
/// weights whatever the batch, whatever the prompts' length; `--probe-seqs` needs the probe.
#[test]
fn bandwidth_probe_counts_each_steps_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let q4 = tmp.path().join("tiny-q4");
    assert!(flint(&["synth", "--shape", "tiny", "--out", q4.to_str().unwrap(), "--gguf", "q4_0"]).status.success());
    let model = q4.join("model-q4_0.gguf");
    let probe = |seqs: &str, prompt: &str| {
        let json = tmp.path().join(format!("probe-{seqs}-{prompt}.json"));
        let o = flint(&[
            "bench",
            "latency",
            "--model",
            model.to_str().unwrap(),
            "--prompt-len",
            "4",
            "--gen-len",
            "4",
            "--reps",
            "1",
            "--bandwidth-probe",
            "--probe-seqs",
            seqs,
            "--probe-prompt-len",
            prompt,
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let line = format!("{seqs} sequence(s) after {prompt}-token prompts: 3 decode steps");
        assert!(stderr(&o).contains(&line), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        v["depths"][0]["bandwidth_probe"].clone()
    };
    let (one, three, long) = (probe("1", "1"), probe("3", "1"), probe("3", "40"));
    assert_eq!(three["seqs"], 3, "{three}");
    let gb = |p: &serde_json::Value| p["step_gb_median"].as_f64().unwrap_or(0.0);
    assert!(gb(&one) > 0.0 && gb(&one) == gb(&three) && gb(&three) == gb(&long), "{one} {three} {long}");
    assert_eq!(three["share"].as_array().map(Vec::len), Some(3), "{three}");
    let o = flint(&["bench", "latency", "--model", model.to_str().unwrap(), "--probe-seqs", "2"]);
    assert_eq!(o.status.code(), Some(2), "clap wants --bandwidth-probe: {}", stderr(&o));
}

/// A draft model in `flint generate`: the tiny checkpoint proposed for by its own Q4_0 copy
/// gives the same greedy text, with the acceptance reported; a draft with another vocabulary is
/// refused in one line before anything runs.
#[test]
fn generate_with_a_quantized_self_draft_keeps_the_greedy_text() {
    let tmp = tempfile::tempdir().unwrap();
    let (st, q4) = (tmp.path().join("tiny"), tmp.path().join("tiny-q4"));
    assert!(flint(&["synth", "--shape", "tiny", "--out", st.to_str().unwrap(), "--dtype", "f32"]).status.success());
    assert!(flint(&["synth", "--shape", "tiny", "--out", q4.to_str().unwrap(), "--gguf", "q4_0"]).status.success());
    let draft = q4.join("model-q4_0.gguf");
    let base =
        ["generate", "--model", st.to_str().unwrap(), "--prompt", "Hello world", "--max-tokens", "40", "--ignore-eos"];
    let plain = flint(&base);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let cfg = format!(r#"{{"method": "draft_model", "model": "{}", "num_speculative_tokens": 3}}"#, draft.display());
    let mut args = base.to_vec();
    args.extend(["--speculative-config", &cfg]);
    let spec = flint(&args);
    assert!(spec.status.success(), "{}", stderr(&spec));
    assert_eq!(plain.stdout, spec.stdout, "the draft changed the greedy text");
    assert!(stderr(&spec).contains("SpecDecoding metrics: Mean acceptance length"), "{}", stderr(&spec));

    // The golden small checkpoint (512-token vocabulary) with a tokenizer beside it.
    let small = tmp.path().join("small");
    copy_dir(&fixtures().join("small-f32"), &small);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(st.join(f), small.join(f)).unwrap();
    }
    let cfg = format!(r#"{{"model": "{}", "num_speculative_tokens": 3}}"#, small.display());
    let mut args = base.to_vec();
    args.extend(["--speculative-config", &cfg]);
    // One error line, after the target's "loaded" line.
    let o = flint(&args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    for n in ["draft model", "512 vocabulary rows", "151936"] {
        assert!(errors[0].contains(n), "`{n}` missing from: {err}");
    }
}

/// A reader that has gone (`flint inspect | head -1`) ends the command quietly, not in a panic.
/// The pipe is closed before the command can print (it opens the checkpoint first).
#[test]
fn inspect_into_a_closed_pipe_does_not_panic() {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_flint"))
        .args(["inspect", "--model", fixtures().join("small-f32").to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut err = String::new();
    child.stderr.as_mut().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(status.code(), Some(101), "a panic's exit code: {err}");
}
