//! Request-JSON decoding under random bytes: valid chat, completions, tokenize and detokenize
//! bodies mutated (bytes flipped, inserted, deleted, cut, spliced between bodies, values swapped
//! for hostile ones) go through everything the server does to a body before it reaches the
//! engine: strict parsing, field parsing, parameter validation, limits, message normalisation.
//! Each must end in Ok or a 4xx `ApiError` — never a panic or a 5xx. Seeded: a failure names its
//! seed and case. `FLINT_FUZZ_CASES` sets the number of cases (scripts/fuzz.sh runs many more).

use std::panic::{catch_unwind, AssertUnwindSafe};

use flint_server::chat::normalize_messages;
use flint_server::error::ApiError;
use flint_server::limits::check_tools;
use flint_server::protocol::{chat_logprobs, completion_logprobs, parse_body, parse_request, prompt_logprobs};
use flint_server::protocol::{ChatRequest, CompletionRequest};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const SEEDS: [&str; 8] = [
    r#"{"model": "demo", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}, {"role": "tool", "content": "42"}], "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "n": 2, "stop": ["x", "y"], "logit_bias": {"7": -100}, "logprobs": true, "top_logprobs": 3, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "auto", "stream": true, "stream_options": {"include_usage": true}, "seed": 3}"#,
    r#"{"model": "demo", "prompt": ["a", "b"], "max_tokens": 4, "logprobs": 2, "echo": true, "n": 1, "stop": "z", "min_tokens": 1, "stop_token_ids": [1, 2], "ignore_eos": true, "presence_penalty": 0.5, "repetition_penalty": 1.1}"#,
    r#"{"prompt": [[1, 2, 3], [4, 5]], "max_completion_tokens": 3, "min_p": 0.05, "best_of": 1}"#,
    r#"{"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": true, "return_token_strs": true, "chat_template_kwargs": {"enable_thinking": false}}"#,
    r#"{"tokens": [1, 2, 3, 151643], "model": "demo"}"#,
    r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {"a": {"enum": [1, "b"]}}, "required": ["a"]}, "strict": true}}, "prompt_logprobs": 2}"#,
    r#"{"prompt": "p", "structured_outputs": {"choice": ["a", "b"], "regex": null}, "guided_decoding_backend": "auto", "echo": true, "max_tokens": 0}"#,
    r##"{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "continue_final_message": true, "add_generation_prompt": false, "tools": [{"type": "function", "function": {"name": "f", "strict": true, "parameters": {"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/A"}}}}, "properties": {"a": {"$ref": "#/$defs/A"}}}}}], "tool_choice": "required", "response_format": {"type": "json_object"}, "logit_bias": {"5": 1}}"##,
];

const HOSTILE: [&str; 16] = [
    "null",
    "-1",
    "1e308",
    "-1e308",
    "18446744073709551616",
    "0.0000001",
    "\"\"",
    "\"\\u0000\\ud800\"",
    "[]",
    "{}",
    "[[[[[[[[[[]]]]]]]]]]",
    "true",
    "\"x\"",
    "[-1, 99999999999]",
    "{\"type\": \"text\"}",
    "9007199254740993",
];

fn mutate(rng: &mut StdRng, body: &[u8]) -> Vec<u8> {
    let mut b = body.to_vec();
    for _ in 0..rng.random_range(1..4) {
        if b.is_empty() {
            b.push(b'{');
        }
        let at = rng.random_range(0..b.len());
        match rng.random_range(0..6) {
            0 => b[at] ^= 1 << rng.random_range(0..8),
            1 => b.insert(at, rng.random()),
            2 => {
                b.remove(at);
            }
            3 => b.truncate(at),
            4 => {
                // Splice in a piece of another seed body.
                let other = SEEDS[rng.random_range(0..SEEDS.len())].as_bytes();
                let from = rng.random_range(0..other.len());
                let to = rng.random_range(from..other.len());
                b.splice(at..at, other[from..to].iter().copied());
            }
            _ => {
                // Replace a JSON value after a colon with a hostile one.
                if let Some(colon) = b[at..].iter().position(|&c| c == b':').map(|p| p + at + 1) {
                    let end = b[colon..].iter().position(|&c| c == b',' || c == b'}').map_or(b.len(), |p| p + colon);
                    let v = HOSTILE[rng.random_range(0..HOSTILE.len())].as_bytes();
                    b.splice(colon..end, v.iter().copied());
                }
            }
        }
    }
    b
}

fn info() -> flint_engine::ModelInfo {
    flint_engine::ModelInfo { vocab_size: 151_936, valid_vocab: 151_643, eos_token_ids: vec![151_643] }
}

/// Everything the chat handler does to a body before rendering it.
fn chat(body: &[u8]) -> Result<(), ApiError> {
    let req: ChatRequest = parse_request(body)?;
    let p = req.common.to_params(&info(), "messages")?;
    req.common.max_tokens(10, 4096, false)?;
    chat_logprobs(req.logprobs, req.top_logprobs, 20)?;
    prompt_logprobs(&req.common, 20)?;
    flint_server::structured::requested(&req.common)?;
    check_tools(req.tools.as_deref().unwrap_or_default())?;
    normalize_messages(&req.messages)?;
    assert!(p.n >= 1 && p.stop.len() <= flint_server::limits::MAX_STOP_STRINGS);
    Ok(())
}

/// Everything the completions handler does to a body before tokenizing it.
fn completion(body: &[u8]) -> Result<(), ApiError> {
    let req: CompletionRequest = parse_request(body)?;
    req.common.to_params(&info(), "prompt")?;
    req.common.max_tokens(10, 4096, req.echo.unwrap_or(false))?;
    completion_logprobs(req.logprobs, 20)?;
    prompt_logprobs(&req.common, 20)?;
    flint_server::structured::requested(&req.common)?;
    Ok(())
}

/// The tokenize/detokenize routes' first step.
fn plain(body: &[u8]) -> Result<(), ApiError> {
    parse_body::<Value>(body).map(|_| ())
}

#[test]
fn mutated_request_bodies_never_panic() {
    let cases: u64 = std::env::var("FLINT_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let seed: u64 = std::env::var("FLINT_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(18);
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut ok, mut refused) = (0, 0);
    for case in 0..cases {
        let body = mutate(&mut rng, SEEDS[(case % SEEDS.len() as u64) as usize].as_bytes());
        for decode in [chat, completion, plain] {
            match catch_unwind(AssertUnwindSafe(|| decode(&body))) {
                Ok(Ok(())) => ok += 1,
                Ok(Err(e)) => {
                    let text = String::from_utf8_lossy(&body);
                    assert!(e.status.is_client_error(), "seed {seed} case {case}: {} for {text:?}", e.status);
                    assert!(!e.message.is_empty(), "seed {seed} case {case}: empty message for {text:?}");
                    refused += 1;
                }
                Err(_) => panic!("seed {seed} case {case}: panicked on {:?}", String::from_utf8_lossy(&body)),
            }
        }
    }
    // The mutations must exercise both outcomes, or the test proves nothing.
    assert!(ok > cases / 50 && refused > cases / 50, "ok {ok}, refused {refused}");
}

#[test]
fn the_seed_bodies_are_valid() {
    for s in [SEEDS[0], SEEDS[3], SEEDS[7]] {
        chat(s.as_bytes()).unwrap_or_else(|e| panic!("{s}: {e:?}"));
    }
    for s in [SEEDS[1], SEEDS[2]] {
        completion(s.as_bytes()).unwrap_or_else(|e| panic!("{s}: {e:?}"));
    }
    plain(SEEDS[4].as_bytes()).unwrap();
}
