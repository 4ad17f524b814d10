//! `/v1/embeddings` through the real binary, on the demo model: a generation server refuses it
//! with the flag to use; a `--runner pooling` server answers every input shape, the same vector
//! whether an input comes as text or as its token ids, alone or in a list, or while generation
//! requests run beside it; `dimensions` is the renormalised prefix; base64 carries the same f32s;
//! and the same server still generates text.

mod common;

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};

fn vectors(r: &Value) -> Vec<Vec<f32>> {
    r["data"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!((d["object"].as_str(), d["index"].as_u64()), (Some("embedding"), Some(i as u64)), "{r}");
            d["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
        })
        .collect()
}

fn norm(v: &[f32]) -> f32 {
    v.iter().map(|x| x * x).sum::<f32>().sqrt()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_server_says_how_to_serve_embeddings() {
    let s = start(&[], None).await;
    let (st, r) = post(&s, "/v1/embeddings", json!({"input": "hi"})).await;
    assert_error(st, &r, 400, Some("model"));
    assert!(r["error"]["message"].as_str().unwrap().contains("--runner pooling"), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooling_server_embeds_every_input_shape() {
    let s = start(&["--runner", "pooling", "--pooler-config", r#"{"pooling_type": "MEAN"}"#], None).await;
    let texts = ["The quick brown fox", "jumps over the lazy dog, twice over"];
    let (st, r) = post(&s, "/v1/embeddings", json!({"input": texts, "model": "flint-demo"})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["object"], "list");
    let batch = vectors(&r);
    assert_eq!(batch.len(), 2);
    assert!(batch.iter().all(|v| v.len() == batch[0].len() && (norm(v) - 1.0).abs() < 1e-5));
    assert_ne!(batch[0], batch[1]);
    let (_, t) = post(&s, "/tokenize", json!({"prompt": texts[1]})).await;
    let ids = t["tokens"].clone();
    assert_eq!(
        r["usage"]["prompt_tokens"].as_u64().unwrap(),
        t["count"].as_u64().unwrap() + {
            let (_, t0) = post(&s, "/tokenize", json!({"prompt": texts[0]})).await;
            t0["count"].as_u64().unwrap()
        }
    );
    assert_eq!(r["usage"]["total_tokens"], r["usage"]["prompt_tokens"]);

    // One text alone, as token ids, as a list of id lists: the same numbers as in the batch.
    for input in [json!(texts[1]), ids.clone(), json!([ids.clone()])] {
        let (st, r) = post(&s, "/v1/embeddings", json!({"input": input})).await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(vectors(&r)[0], batch[1], "input {input}");
    }

    // While generation requests run on the same engine.
    let gen = |i: usize| {
        let base = s.base.clone();
        tokio::spawn(async move {
            let body = json!({"prompt": format!("Count to {i}:"), "max_tokens": 24, "ignore_eos": true});
            let r = reqwest::Client::new().post(format!("{base}/v1/completions")).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
        })
    };
    let running: Vec<_> = (0..4).map(gen).collect();
    let (st, r) = post(&s, "/v1/embeddings", json!({"input": texts})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(vectors(&r), batch, "generation traffic changed an embedding");
    for h in running {
        h.await.unwrap();
    }

    // dimensions: the first d numbers, renormalised; base64: the same f32 bits.
    let (st, r) = post(&s, "/v1/embeddings", json!({"input": texts[0], "dimensions": 8})).await;
    assert_eq!(st, 200, "{r}");
    let cut = vectors(&r).remove(0);
    let n = norm(&batch[0][..8]);
    assert_eq!(cut.len(), 8);
    assert!(cut.iter().zip(&batch[0][..8]).all(|(a, b)| (a - b / n).abs() < 1e-6), "{cut:?}");
    let (st, r) = post(&s, "/v1/embeddings", json!({"input": texts[0], "encoding_format": "base64"})).await;
    assert_eq!(st, 200, "{r}");
    let bytes = base64::engine::general_purpose::STANDARD.decode(r["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let decoded: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(decoded, batch[0]);

    // Bad inputs name their parameter.
    for (body, param) in [
        (json!({}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": [[]]}), "input"),
        (json!({"input": [1, -2]}), "input"),
        (json!({"input": {"text": "x"}}), "input"),
        (json!({"input": "x", "dimensions": 0}), "dimensions"),
        (json!({"input": "x", "dimensions": 100_000}), "dimensions"),
        (json!({"input": "x", "encoding_format": "hex"}), "encoding_format"),
        (json!({"input": [999_999_999]}), "input"),
    ] {
        let (st, r) = post(&s, "/v1/embeddings", body.clone()).await;
        assert_error(st, &r, 400, Some(param));
    }
    let (st, r) = post(&s, "/v1/embeddings", json!({"input": "x", "model": "other"})).await;
    assert_eq!(st, 404, "{r}");

    // The pooling server still generates.
    let (st, r) = post(&s, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 3, "ignore_eos": true})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 3);
}
