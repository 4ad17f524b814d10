//! How `flint serve --runner pooling` pools: `--pooler-config` (vLLM's JSON: `pooling_type`,
//! `normalize`), else the model directory's sentence-transformers files (`modules.json` naming a
//! `Pooling` module and perhaps `Normalize`), else the last token, normalised: what Qwen3-Embedding
//! and vLLM's default for decoder models use.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use flint_engine::pooling::{PoolerConfig, PoolingType};
use serde_json::Value;

/// `None` for a generation server.
pub fn resolve(runner: &str, pooler_config: Option<&str>, model: Option<&str>) -> Result<Option<PoolerConfig>> {
    match (runner, pooler_config) {
        ("generate", None) => Ok(None),
        ("generate", Some(_)) => bail!("--pooler-config applies with --runner pooling"),
        ("pooling", Some(json)) => parse_flag(json).map(Some),
        ("pooling", None) => match model.map(Path::new).filter(|p| p.join("modules.json").is_file()) {
            Some(dir) => from_sentence_transformers(dir).map(Some),
            None => Ok(Some(PoolerConfig::default())),
        },
        (other, _) => bail!("--runner {other:?}: expected generate or pooling"),
    }
}

fn parse_flag(json: &str) -> Result<PoolerConfig> {
    let v: Value = serde_json::from_str(json).map_err(|e| anyhow!("--pooler-config is not JSON: {e}"))?;
    let Value::Object(map) = v else { bail!("--pooler-config must be a JSON object") };
    let mut cfg = PoolerConfig::default();
    for (k, v) in map {
        match (k.as_str(), v) {
            ("pooling_type", Value::String(s)) => {
                cfg.pooling_type = PoolingType::parse(&s)
                    .ok_or_else(|| anyhow!("--pooler-config: pooling_type {s:?} is not LAST, MEAN or CLS"))?;
            }
            ("normalize", Value::Bool(b)) => cfg.normalize = b,
            (k, v) => bail!("--pooler-config: {k}={v} is not supported (pooling_type: LAST|MEAN|CLS, normalize: bool)"),
        }
    }
    Ok(cfg)
}

/// `modules.json` lists the modules in order; `Pooling`'s `config.json` sets the mode.
fn from_sentence_transformers(dir: &Path) -> Result<PoolerConfig> {
    let read = |p: &Path| -> Result<Value> {
        let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", p.display()))
    };
    let modules = read(&dir.join("modules.json"))?;
    let modules =
        modules.as_array().ok_or_else(|| anyhow!("{}: expected a list", dir.join("modules.json").display()))?;
    let kind =
        |m: &Value| m.get("type").and_then(Value::as_str).unwrap_or("").rsplit('.').next().unwrap_or("").to_string();
    let mut cfg = PoolerConfig { normalize: modules.iter().any(|m| kind(m) == "Normalize"), ..PoolerConfig::default() };
    if let Some(pooling) = modules.iter().find(|m| kind(m) == "Pooling") {
        let sub = pooling.get("path").and_then(Value::as_str).unwrap_or("");
        let path = dir.join(sub).join("config.json");
        let c = read(&path)?;
        let on = |k: &str| c.get(k).and_then(Value::as_bool).unwrap_or(false);
        for unsupported in
            ["pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"]
        {
            if on(unsupported) {
                bail!("{}: {unsupported} is not supported (last token, mean and CLS are)", path.display());
            }
        }
        cfg.pooling_type =
            match (on("pooling_mode_lasttoken"), on("pooling_mode_mean_tokens"), on("pooling_mode_cls_token")) {
                (true, false, false) => PoolingType::Last,
                (false, true, false) => PoolingType::Mean,
                (false, false, true) => PoolingType::Cls,
                _ => bail!("{}: expected exactly one of lasttoken, mean_tokens and cls_token", path.display()),
            };
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_files_and_default() {
        assert_eq!(resolve("generate", None, None).unwrap(), None);
        assert!(resolve("generate", Some("{}"), None).is_err());
        assert_eq!(resolve("pooling", None, None).unwrap(), Some(PoolerConfig::default()));
        let mean = resolve("pooling", Some(r#"{"pooling_type": "MEAN", "normalize": false}"#), None).unwrap().unwrap();
        assert_eq!((mean.pooling_type, mean.normalize), (PoolingType::Mean, false));
        assert!(resolve("pooling", Some(r#"{"pooling_type": "MAX"}"#), None).unwrap_err().to_string().contains("MAX"));
        assert!(resolve("pooling", Some(r#"{"dimensions": 3}"#), None).is_err());

        let dir = std::env::temp_dir().join(format!("flint-pooler-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
        std::fs::write(
            dir.join("modules.json"),
            r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
                {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"}]"#,
        )
        .unwrap();
        std::fs::write(
            dir.join("1_Pooling/config.json"),
            r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}"#,
        )
        .unwrap();
        let got = resolve("pooling", None, dir.to_str()).unwrap().unwrap();
        assert_eq!((got.pooling_type, got.normalize), (PoolingType::Cls, false), "no Normalize module");
        std::fs::write(dir.join("1_Pooling/config.json"), r#"{"pooling_mode_max_tokens": true}"#).unwrap();
        assert!(resolve("pooling", None, dir.to_str()).unwrap_err().to_string().contains("max_tokens"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
