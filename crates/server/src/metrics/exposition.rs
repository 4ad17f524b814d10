//! A small reader of the Prometheus text exposition, for the tests: what a scraper keeps of one
//! scrape (each family's type and help, each sample's name, labels and value), as sets that compare
//! regardless of line order and of how a number is spelled (`1` or `1.0`, `le="0.000025"` or
//! `le="2.5e-05"`, which Prometheus reads as the same bound). It reads the classic format and
//! OpenMetrics' (`# EOF`, counter families named without `_total`) alike.

use std::collections::{BTreeMap, BTreeSet};

/// A sample's labels: (name, value) pairs.
type Labels = Vec<(String, String)>;

/// One sample as a scraper stores it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Sample {
    /// The family's name as the classic format spells it (a counter's ends in `_total`).
    pub family: String,
    pub kind: String,
    pub name: String,
    /// Sorted by name, values unescaped.
    pub labels: Labels,
    /// The value, spelled one way (`{:?}` of the parsed number).
    pub value: String,
}

#[derive(Debug, Default, PartialEq)]
pub(super) struct Exposition {
    /// Family name to (type, help).
    pub families: BTreeMap<String, (String, String)>,
    pub samples: BTreeSet<Sample>,
}

/// A number as Prometheus reads it, spelled one way.
fn number(s: &str) -> Result<String, String> {
    s.parse::<f64>().map(|v| format!("{v:?}")).map_err(|e| format!("{s:?}: {e}"))
}

/// A counter family's name as the classic format has it.
fn family_name(name: &str, kind: &str) -> String {
    if kind == "counter" && !name.ends_with("_total") {
        format!("{name}_total")
    } else {
        name.to_string()
    }
}

/// `k="v",...}` after a sample's `{`: the labels and the rest of the line.
fn labels(mut s: &str) -> Result<(Labels, &str), String> {
    let mut out = Vec::new();
    loop {
        s = s.trim_start_matches(',');
        if let Some(rest) = s.strip_prefix('}') {
            return Ok((out, rest));
        }
        let (key, rest) = s.split_once("=\"").ok_or_else(|| format!("no label value in {s:?}"))?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err(format!("dangling escape in {s:?}")),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => return Err(format!("unterminated label value in {s:?}")),
            }
        };
        if key == "le" || key == "quantile" {
            value = number(&value)?;
        }
        out.push((key.to_string(), value));
        s = &rest[end + 1..];
    }
}

pub(super) fn parse(text: &str) -> Result<Exposition, String> {
    let mut exp = Exposition::default();
    let mut help: BTreeMap<String, String> = BTreeMap::new();
    // The family the samples that follow belong to.
    let mut current: Option<(String, String)> = None;
    let mut seen = BTreeSet::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if line == "# EOF" {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help.insert(name.to_string(), text.replace("\\n", "\n").replace("\\\\", "\\"));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or_else(|| format!("TYPE without a type: {line}"))?;
            let text = help.remove(name).ok_or_else(|| format!("TYPE without its HELP: {line}"))?;
            let family = family_name(name, kind);
            if exp.families.insert(family.clone(), (kind.to_string(), text)).is_some() {
                return Err(format!("family {family} described twice"));
            }
            current = Some((family, kind.to_string()));
            continue;
        }
        if line.starts_with('#') {
            return Err(format!("unexpected comment: {line}"));
        }
        let (family, kind) = current.clone().ok_or_else(|| format!("sample before any TYPE: {line}"))?;
        let name_end = line.find(['{', ' ']).ok_or_else(|| format!("no value: {line}"))?;
        let name = &line[..name_end];
        let (mut labels, rest) = match line[name_end..].strip_prefix('{') {
            Some(l) => labels(l)?,
            None => (Vec::new(), &line[name_end..]),
        };
        let suffix = name.strip_prefix(family.as_str()).ok_or_else(|| format!("{name} outside {family}"))?;
        let allowed: &[&str] = if kind == "histogram" { &["_bucket", "_sum", "_count"] } else { &[""] };
        if !allowed.contains(&suffix) {
            return Err(format!("{name} is not a sample of the {kind} {family}"));
        }
        labels.sort();
        let value = number(rest.split_whitespace().next().ok_or_else(|| format!("no value: {line}"))?)?;
        if !seen.insert((name.to_string(), labels.clone())) {
            return Err(format!("{name} {labels:?} twice"));
        }
        exp.samples.insert(Sample { family, kind, name: name.to_string(), labels, value });
    }
    if let Some(name) = help.keys().next() {
        return Err(format!("HELP without TYPE: {name}"));
    }
    Ok(exp)
}
