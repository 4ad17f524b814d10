//! How deep a grammar compile may recurse, bounded before it starts. llguidance compiles a Lark
//! grammar by a depth-first walk over its rules and terminals, and a JSON schema by a walk over
//! its subschemas that follows each `$ref` into its target: a chain of 800 rules or of 1,000
//! `$defs` took a 2 MiB stack past its end and aborted the process. The walks visit each rule
//! and each `$ref` target once, so a walk's depth is at most the sum of what every definition
//! can add to it; that sum is measured here (linear in the text) and refused past
//! [`MAX_LEVELS`]. The compile threads' stacks are sized with a wide margin over the bound
//! (measured: at most ~6.4 KB of stack per level, on any shape tried).

use std::collections::HashSet;

use serde_json::Value;

/// Most recursion levels a constraint may need: far beyond any hand-written grammar or generated
/// schema (a 300-rule Lark grammar nests a few levels per rule; Pydantic's schema for a model of
/// 50 nested models, a few hundred), far below what the compile threads' stacks hold.
pub const MAX_LEVELS: usize = 5_000;

/// The JSON nesting of `v`: 1 for a scalar, one more per enclosing array or object.
fn json_depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|c| (c, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|c| (c, d + 1))),
            _ => {}
        }
    }
    deepest
}

/// Every `$ref` string in `v` (in any position: a bound may count too much, never too little).
fn refs(v: &Value) -> HashSet<&str> {
    let mut out = HashSet::new();
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(a) => stack.extend(a),
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get("$ref") {
                    out.insert(r.as_str());
                }
                stack.extend(o.values());
            }
            _ => {}
        }
    }
    out
}

/// An upper bound on the recursion a JSON schema's compile needs: the nesting of the whole
/// document (the walk from the root), plus the nesting of each distinct `$ref` target (where a
/// walk may continue after following the reference). A target that is not a local JSON pointer
/// (an anchor, a relative URI) counts as deep as the whole document.
pub fn schema_levels(schema: &Value) -> usize {
    let whole = json_depth(schema);
    let targets = refs(schema);
    let mut levels = whole;
    for r in targets {
        let target = r.strip_prefix('#').filter(|p| p.is_empty() || p.starts_with('/')).and_then(|p| schema.pointer(p));
        levels = levels.saturating_add(target.map_or(whole, json_depth));
    }
    levels
}

/// Where a Lark scan is: in the grammar's own syntax, or inside a literal whose brackets do not
/// nest anything.
#[derive(Clone, Copy, PartialEq)]
enum Lexical {
    Code,
    Str,
    Regex,
    Comment,
}

/// Whether `line` (from its first non-blank character) starts a rule or terminal definition:
/// `[?!]name[{params}][.priority][[attributes]]:` with nothing but those before the colon.
fn defines(line: &str) -> bool {
    let s = line.trim_start().trim_start_matches(['?', '!']);
    let name_end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    if name_end == 0 || s.as_bytes()[0].is_ascii_digit() {
        return false;
    }
    let rest = &s[name_end..];
    let Some(colon) = rest.find(':') else { return false };
    // Between the name and the colon only parameters, a priority or attributes may stand.
    let head = &rest[..colon];
    head.trim().is_empty() || head.trim_start().starts_with(['{', '.', '['])
}

/// An upper bound on the recursion a Lark grammar's compile needs: for every rule and terminal
/// definition, one level, plus as many as its groups nest (`(…)`, `[…]`), plus what each
/// embedded `%json` schema needs. The walk from one definition into another goes through at most
/// that many frames per definition, and visits each definition once.
pub fn lark_levels(grammar: &str) -> usize {
    let mut levels = 0usize;
    let mut nesting = 0usize;
    let mut deepest_in_def = 0usize;
    let mut state = Lexical::Code;
    let mut at_line_start = true;
    let bytes = grammar.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if at_line_start && state != Lexical::Str && state != Lexical::Regex {
            let line_end = grammar[i..].find('\n').map_or(grammar.len(), |n| i + n);
            if defines(&grammar[i..line_end]) {
                levels = levels.saturating_add(1 + deepest_in_def);
                deepest_in_def = 0;
                nesting = 0;
            }
        }
        at_line_start = c == b'\n';
        match state {
            Lexical::Comment if c == b'\n' => state = Lexical::Code,
            Lexical::Comment => {}
            Lexical::Str | Lexical::Regex if c == b'\\' => i += 1,
            Lexical::Str if c == b'"' => state = Lexical::Code,
            Lexical::Regex if c == b'/' => state = Lexical::Code,
            // A literal ends at its line's end in Lark; a stray quote must not hide later lines.
            Lexical::Str | Lexical::Regex if c == b'\n' => state = Lexical::Code,
            Lexical::Str | Lexical::Regex => {}
            Lexical::Code => match c {
                b'"' => state = Lexical::Str,
                b'/' if bytes.get(i + 1) == Some(&b'/') => state = Lexical::Comment,
                b'/' => state = Lexical::Regex,
                b'(' | b'[' => {
                    nesting += 1;
                    deepest_in_def = deepest_in_def.max(nesting);
                }
                b')' | b']' => nesting = nesting.saturating_sub(1),
                b'%' if grammar[i..].starts_with("%json") => {
                    let start = i + "%json".len();
                    let mut values = serde_json::Deserializer::from_str(&grammar[start..]).into_iter::<Value>();
                    match values.next() {
                        Some(Ok(schema)) => {
                            levels = levels.saturating_add(schema_levels(&schema));
                            i = start + values.byte_offset();
                            continue;
                        }
                        // llguidance refuses it with its own message.
                        _ => i = start,
                    }
                    continue;
                }
                _ => {}
            },
        }
        i += 1;
    }
    levels.saturating_add(deepest_in_def)
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::json;

    use super::*;

    /// `start: r0`, `r{i}: r{i+1} | "x"`, …, `r{n}: "end"`: the shape that overflowed the stack.
    pub fn rule_chain(n: usize) -> String {
        let mut g = String::from("start: r0\n");
        for i in 0..n {
            g.push_str(&format!("r{i}: r{} | \"x\"\n", i + 1));
        }
        g.push_str(&format!("r{n}: \"end\"\n"));
        g
    }

    /// `$defs` d0 … dn, each a reference to the next.
    pub fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}));
        }
        defs.insert(format!("d{n}"), json!({"type": "string"}));
        json!({"$defs": defs, "$ref": "#/$defs/d0"})
    }

    #[test]
    fn chains_count_one_level_per_link() {
        let small = lark_levels(&rule_chain(10));
        assert!((12..=14).contains(&small), "{small}");
        assert!(lark_levels(&rule_chain(10_000)) > MAX_LEVELS);
        // The document is 4 deep (root, `$defs`, a def, its `$ref`); each of the 11 targets 2.
        assert_eq!(schema_levels(&ref_chain(10)), 4 + 11 * 2);
        assert!(schema_levels(&ref_chain(10_000)) > MAX_LEVELS);
    }

    #[test]
    fn groups_and_embedded_schemas_count_literals_do_not() {
        let flat = lark_levels("start: a\na: \"x\"\n");
        let nested = lark_levels("start: a\na: ((((\"x\"))))\n");
        assert_eq!(nested, flat + 4);
        // Brackets inside strings, regexes and comments nest nothing.
        assert_eq!(lark_levels("start: a\na: \"((((\" /[(]{3}/ // ((((\n"), flat);
        // A quote inside a regex does not open a string.
        assert_eq!(lark_levels("start: a\na: /\"/ (\"x\")\n"), flat + 1);
        let embedded = lark_levels(&format!("start: a\na: %json {}\n", ref_chain(20)));
        assert!(embedded >= flat + schema_levels(&ref_chain(20)), "{embedded}");
        // Continuation lines and directives are not definitions.
        assert_eq!(lark_levels("start: a\n    | b\n%ignore /\\s+/\na: \"x\"\nb: \"y\"\n"), 3);
        // Parameters, priorities and attributes before the colon still define (an attribute's
        // bracket counts as a group: too much, never too little).
        assert_eq!(lark_levels("start: a\n?a.2: \"x\"\nb{x}: x\n"), 3);
        assert_eq!(lark_levels("start: a\nb[lazy]: \"y\"\n"), 2 + 1);
    }

    #[test]
    fn refs_to_unknown_places_count_as_the_whole_document() {
        let s = json!({"properties": {"a": {"$ref": "#anchor"}, "b": {"$ref": "#/nowhere"}}});
        assert_eq!(schema_levels(&s), 4 * 3);
        let root = json!({"properties": {"next": {"$ref": "#"}}});
        assert_eq!(schema_levels(&root), 4 + 4);
    }
}
