//! Strict JSON for request bodies, one policy on every route: the body is exactly one JSON value
//! (nothing but whitespace after it) and no object repeats a key, at any depth. serde_json alone
//! keeps the last of two duplicate keys when it builds a `Value` but refuses them for a struct,
//! so two routes could read the same body differently; here both see the same refusal.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Parse `bytes` as one JSON value without duplicate keys. The error is serde_json's, with its
/// line and column (the recursion limit of 128 levels stays on).
pub fn parse_strict(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let v = StrictValue.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

struct StrictValue;

impl<'de> DeserializeSeed<'de> for StrictValue {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom("a number out of range"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(StrictValue)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate key `{key}`")));
            }
            let v = map.next_value_seed(StrictValue)?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_what_serde_json_accepts() {
        let text = r#" {"a": [1, -2, 3.5, 1e300, true, null, "é\u00e9"], "b": {"c": {}}, "d": 18446744073709551615} "#;
        assert_eq!(parse_strict(text.as_bytes()).unwrap(), serde_json::from_str::<Value>(text).unwrap());
    }

    #[test]
    fn refuses_duplicates_at_any_depth_and_trailing_data() {
        for bad in [
            r#"{"a": 1, "a": 2}"#,
            r#"{"m": [{"role": "user", "role": "system"}]}"#,
            r#"{"a": 1} x"#,
            r#"{"a": 1}{"a": 1}"#,
            r#"[1] 2"#,
            "",
            "nul",
        ] {
            assert!(parse_strict(bad.as_bytes()).is_err(), "accepted {bad:?}");
        }
        let e = parse_strict(br#"{"x": {"k": 1, "k": 1}}"#).unwrap_err().to_string();
        assert!(e.contains("duplicate key `k`"), "{e}");
        // The same key in sibling objects is fine.
        assert!(parse_strict(br#"[{"k": 1}, {"k": 2}]"#).is_ok());
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        let deep = "[".repeat(100_000);
        assert!(parse_strict(deep.as_bytes()).is_err());
    }
}
