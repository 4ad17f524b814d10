//! JSON Schemas made ready for the grammar compiler: objects that list their properties are
//! closed unless they say otherwise, and a tool's schema keeps its `$ref`s working when it is
//! embedded in the grammar of a tool call.

use serde_json::{Map, Value};

/// Keywords whose value is one subschema (`items` may also be a list of them).
const ONE: [&str; 12] = [
    "items",
    "additionalProperties",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contentSchema",
];
/// Keywords whose value is a list of subschemas.
const LISTS: [&str; 4] = ["anyOf", "oneOf", "allOf", "prefixItems"];
/// Keywords whose value maps names to subschemas.
const MAPS: [&str; 5] = ["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"];

/// Most properties in a row that an object may leave out. llguidance lets any subset of a run of
/// optional properties appear (in order), and puts about four Earley items per property of the
/// run into one row: past ~500 the row passes its limit of 2,000 items and generation fails at
/// that point (or, for thousands, the compile itself takes seconds: 6.7 s for 8,000).
pub const MAX_OPTIONAL_RUN: usize = 480;

/// Call `f` on every (sub)schema object of `root`, with whether it is a member of an `allOf`.
/// Only schema positions are visited: a `const`, `enum`, `default` or `examples` value is data,
/// and is never changed. Iterative, so the depth of a client's schema costs no stack.
fn walk_schemas(root: &mut Value, mut f: impl FnMut(&mut Map<String, Value>, bool)) {
    let mut stack: Vec<(&mut Value, bool)> = vec![(root, false)];
    while let Some((v, in_all_of)) = stack.pop() {
        let Value::Object(o) = v else { continue };
        f(o, in_all_of);
        for (k, child) in o {
            let k = k.as_str();
            if ONE.contains(&k) {
                if let Value::Array(a) = child {
                    stack.extend(a.iter_mut().map(|c| (c, false)));
                } else {
                    stack.push((child, false));
                }
            } else if LISTS.contains(&k) {
                if let Value::Array(a) = child {
                    stack.extend(a.iter_mut().map(|c| (c, k == "allOf")));
                }
            } else if MAPS.contains(&k) {
                if let Value::Object(m) = child {
                    stack.extend(m.values_mut().map(|c| (c, false)));
                }
            }
        }
    }
}

/// The longest run of consecutive optional properties (in `properties` order, between required
/// ones) of any object in `schema`.
pub fn longest_optional_run(schema: &Value) -> usize {
    // The walk takes the schema mutably (it is the one walk there is); a copy costs microseconds
    // against the compile it guards.
    let mut copy = schema.clone();
    let mut longest = 0;
    walk_schemas(&mut copy, |o, _| {
        let Some(Value::Object(props)) = o.get("properties") else { return };
        let required: Vec<&str> = match o.get("required") {
            Some(Value::Array(r)) => r.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let mut run = 0;
        for name in props.keys() {
            run = if required.contains(&name.as_str()) { 0 } else { run + 1 };
            longest = longest.max(run);
        }
    });
    longest
}

/// Objects that list `properties` (or `patternProperties`) and say nothing of other keys allow
/// none: `additionalProperties: false` is added. This is what vLLM's default backend (xgrammar)
/// does, and what OpenAI's strict mode requires of a schema; a model left free to add keys
/// writes keys the client's parser then refuses. A schema that wants them says
/// `"additionalProperties": true` (or gives their schema). Members of an `allOf` are left open:
/// each lists only part of the properties, and closing them would refuse the others'.
pub fn close_objects(schema: &mut Value) {
    walk_schemas(schema, |o, in_all_of| {
        let lists = ["properties", "patternProperties"].iter().any(|k| o.get(*k).is_some_and(Value::is_object));
        let says = o.contains_key("additionalProperties") || o.contains_key("unevaluatedProperties");
        if lists && !says && !in_all_of {
            o.insert("additionalProperties".into(), Value::Bool(false));
        }
    });
}

/// Rewrite `schema`'s local references (`#`, `#/…`) as if the schema stood at `at` (a JSON
/// pointer, e.g. `/$defs/tool_0`) inside a larger document. A schema with its own `$id` is a
/// resource of its own, whose references resolve against it wherever it stands: left as is.
pub fn rebase_refs(schema: &mut Value, at: &str) {
    if schema.get("$id").is_some() {
        return;
    }
    walk_schemas(schema, |o, _| {
        if let Some(Value::String(r)) = o.get_mut("$ref") {
            if r == "#" || r.starts_with("#/") {
                r.insert_str(1, at);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn objects_with_properties_are_closed_unless_they_say_otherwise() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "inner": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "open": {"type": "object", "properties": {}, "additionalProperties": true},
                "free": {"type": "object"},
                "both": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]},
                "data": {"const": {"properties": {"k": 1}}}
            },
            "$defs": {"D": {"properties": {"d": {"type": "string"}}}}
        });
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["inner"]["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["open"]["additionalProperties"], json!(true));
        assert!(s["properties"]["free"].get("additionalProperties").is_none(), "no properties listed: any object");
        assert!(s["properties"]["both"]["allOf"][0].get("additionalProperties").is_none());
        assert_eq!(s["properties"]["data"]["const"], json!({"properties": {"k": 1}}), "data is never changed");
        assert_eq!(s["$defs"]["D"]["additionalProperties"], json!(false));
    }

    #[test]
    fn optional_runs_are_counted_between_required_properties() {
        let props = |n: usize| (0..n).map(|i| (format!("p{i}"), json!({"type": "integer"}))).collect::<Map<_, _>>();
        assert_eq!(longest_optional_run(&json!({"properties": props(10)})), 10);
        assert_eq!(longest_optional_run(&json!({"properties": props(10), "required": ["p3"]})), 6);
        let all: Vec<String> = (0..10).map(|i| format!("p{i}")).collect();
        assert_eq!(longest_optional_run(&json!({"properties": props(10), "required": all})), 0);
        let nested =
            json!({"type": "array", "items": {"properties": props(7)}, "$defs": {"D": {"properties": props(9)}}});
        assert_eq!(longest_optional_run(&nested), 9);
    }

    #[test]
    fn local_references_follow_the_schema_to_its_new_place() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "a": {"$ref": "#/$defs/A"},
                "self": {"$ref": "#"},
                "list": {"type": "array", "items": {"$ref": "#/definitions/B"}},
                "remote": {"$ref": "https://example.com/s.json"},
                "anchor": {"$ref": "#frag"},
                "data": {"default": {"$ref": "#/x"}}
            },
            "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}}
        });
        rebase_refs(&mut s, "/$defs/tool_0");
        let p = &s["properties"];
        assert_eq!(p["a"]["$ref"], "#/$defs/tool_0/$defs/A");
        assert_eq!(p["self"]["$ref"], "#/$defs/tool_0");
        assert_eq!(p["list"]["items"]["$ref"], "#/$defs/tool_0/definitions/B");
        assert_eq!(p["remote"]["$ref"], "https://example.com/s.json");
        assert_eq!(p["anchor"]["$ref"], "#frag");
        assert_eq!(p["data"]["default"]["$ref"], "#/x");
        assert_eq!(s["$defs"]["A"]["anyOf"][0]["$ref"], "#/$defs/tool_0/$defs/A");
        let mut own = json!({"$id": "urn:x", "properties": {"a": {"$ref": "#/$defs/A"}}});
        rebase_refs(&mut own, "/$defs/tool_0");
        assert_eq!(own["properties"]["a"]["$ref"], "#/$defs/A");
    }
}
