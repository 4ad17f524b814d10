//! Python's view of template values, for byte-identical chat templates: `str()`/`repr()`,
//! `json.dumps` (transformers' `tojson`) and `strftime_now`. minijinja's own forms differ
//! (`none`, `true`, HTML-escaped compact JSON), and the model was trained on Python's.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

// ---------------------------------------------------------------------------------------
// Python-compatible stringification
// ---------------------------------------------------------------------------------------

/// Python's `str(value)`: strings as-is, undefined as empty, everything else `repr`
/// (a value nested too deep to print shows as `[...]`).
pub(super) fn py_str(value: &Value) -> String {
    py_str_checked(value).unwrap_or_else(|_| "[...]".into())
}

/// [`py_str`], failing on values nested deeper than [`MAX_VALUE_DEPTH`](super::MAX_VALUE_DEPTH)
/// (which a template can build in a loop) rather than recursing without bound.
pub(super) fn py_str_checked(value: &Value) -> Result<String, Error> {
    match value.kind() {
        ValueKind::Undefined => Ok(String::new()),
        ValueKind::String => Ok(value.as_str().unwrap_or_default().to_string()),
        _ => py_repr_at(value, 0),
    }
}

fn too_deep() -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("value nests deeper than {} levels", super::MAX_VALUE_DEPTH))
}

/// Python's `repr(value)` for the value kinds JSON data can produce.
pub(super) fn py_repr(value: &Value) -> String {
    py_repr_at(value, 0).unwrap_or_else(|_| "[...]".into())
}

fn py_repr_at(value: &Value, depth: usize) -> Result<String, Error> {
    if depth > super::MAX_VALUE_DEPTH {
        return Err(too_deep());
    }
    Ok(match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => {
            if value.is_integer() {
                value.to_string()
            } else {
                match f64::try_from(value.clone()) {
                    Ok(f) if f.is_nan() => "nan".into(),
                    Ok(f) if f.is_infinite() => if f > 0.0 { "inf" } else { "-inf" }.into(),
                    Ok(f) => py_float_repr(f),
                    Err(_) => value.to_string(),
                }
            }
        }
        ValueKind::String => py_str_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => match value.try_iter() {
            Ok(iter) => {
                let items = iter.map(|v| py_repr_at(&v, depth + 1)).collect::<Result<Vec<String>, Error>>()?;
                format!("[{}]", items.join(", "))
            }
            Err(_) => value.to_string(),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                let items = keys
                    .map(|k| {
                        let v = value.get_item(&k).unwrap_or(Value::UNDEFINED);
                        Ok(format!("{}: {}", py_repr_at(&k, depth + 1)?, py_repr_at(&v, depth + 1)?))
                    })
                    .collect::<Result<Vec<String>, Error>>()?;
                format!("{{{}}}", items.join(", "))
            }
            Err(_) => value.to_string(),
        },
        _ => value.to_string(),
    })
}

/// Python's string `repr`: single quotes unless the text contains `'` but no `"`;
/// backslash, quote and non-printable characters escaped.
pub(super) fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_is_printable(c) => {
                let cp = c as u32;
                let _ = if cp <= 0xff {
                    write!(out, "\\x{cp:02x}")
                } else if cp <= 0xffff {
                    write!(out, "\\u{cp:04x}")
                } else {
                    write!(out, "\\U{cp:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Approximates Python's `str.isprintable`: control characters, separators other than
/// the ASCII space and common format characters are not printable.
pub(super) fn py_is_printable(c: char) -> bool {
    !(c.is_control()
        || matches!(
            c,
            '\u{a0}'
                | '\u{ad}'
                | '\u{1680}'
                | '\u{2000}'..='\u{200f}'
                | '\u{2028}'..='\u{202f}'
                | '\u{205f}'..='\u{2064}'
                | '\u{3000}'
                | '\u{feff}'
        ))
}

/// Python's `repr(float)` for finite values: shortest round-trip digits, fixed notation
/// for exponents in [-4, 16), otherwise `d.ddde+XX`.
pub(super) fn py_float_repr(f: f64) -> String {
    // `{:e}` gives the shortest round-trip digits, e.g. "-1.25e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                format!("{sign}{digits}{}.0", "0".repeat(int_len - digits.len()))
            } else {
                format!("{sign}{}.{}", &digits[..int_len], &digits[int_len..])
            }
        } else {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{exp_sign}{:02}", exp.abs())
    }
}

// ---------------------------------------------------------------------------------------
// json.dumps-compatible tojson
// ---------------------------------------------------------------------------------------

/// Options of Python's `json.dumps` that transformers' `tojson` exposes.
pub(super) struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// The longest `tojson` indent accepted (Python has no limit; real templates use 2 or 4).
const MAX_INDENT: usize = 64;

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, i.e. `json.dumps` without HTML escaping. Arguments may be given
/// positionally (in that order, as in Python) or by keyword, except that `sort_keys` is
/// keyword-only (minijinja functions take at most five parameters).
pub(super) fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let pick = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        Ok(kw.or(positional).filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    // Python accepts any indent; a huge one only multiplies the output, so it is capped.
    let indent_too_long =
        || Error::new(ErrorKind::InvalidOperation, format!("tojson indent longer than {MAX_INDENT} characters"));
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.kind() == ValueKind::String => {
            let s = v.as_str().unwrap_or("");
            if s.chars().count() > MAX_INDENT {
                return Err(indent_too_long());
            }
            Some(s.to_string())
        }
        Some(v) => {
            let n = i64::try_from(v)
                .map_err(|_| Error::new(ErrorKind::InvalidOperation, "tojson indent must be an int"))?;
            if n > MAX_INDENT as i64 {
                return Err(indent_too_long());
            }
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let (item_sep, key_sep) = match pick(separators, "separators")? {
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.as_str().unwrap_or_default().to_string(), b.as_str().unwrap_or_default().to_string())
                }
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson separators must be two strings")),
            }
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let sort_keys = pick(None, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let opts = JsonOptions { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(out)
}

pub(super) fn not_serializable(value: &Value) -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("Object of type {} is not JSON serializable", value.kind()))
}

/// Writes the newline + indentation that precedes an item at `level` (pretty mode only).
pub(super) fn write_indent(out: &mut String, opts: &JsonOptions, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

/// Python's JSON rendering of a mapping key (json.dumps coerces scalars to strings).
pub(super) fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Number => Ok(py_repr(key)),
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("keys must be str, int, float, bool or None, not {}", key.kind()),
        )),
    }
}

pub(super) fn write_json(out: &mut String, value: &Value, opts: &JsonOptions, level: usize) -> Result<(), Error> {
    if level > super::MAX_VALUE_DEPTH {
        return Err(too_deep());
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone()).map_err(|_| not_serializable(value))?;
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&py_float_repr(f));
                }
            }
        }
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), opts),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                write_indent(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            write_indent(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                write_indent(out, opts, level + 1);
                write_json_string(out, key, opts);
                out.push_str(&opts.key_sep);
                write_json(out, item, opts, level + 1)?;
            }
            write_indent(out, opts, level);
            out.push('}');
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

/// A JSON string literal escaped exactly like Python's `json` module.
pub(super) fn write_json_string(out: &mut String, s: &str, opts: &JsonOptions) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if opts.ensure_ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------
// strftime_now
// ---------------------------------------------------------------------------------------

/// `strftime_now(format)`: the current time formatted like Python's `strftime`. Uses UTC
/// (see module docs).
pub(super) fn strftime_now(format: String) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime_utc(&format, secs)
}

/// Converts days since 1970-01-01 to (year, month, day) in the proleptic Gregorian
/// calendar (Howard Hinnant's civil-from-days algorithm).
pub(super) fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Formats a Unix timestamp (UTC) with the common C `strftime` directives, including
/// glibc's `%-d`-style unpadded variants. Unknown directives are copied through.
pub(super) fn strftime_utc(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, (secs_of_day / 60) % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month as usize - 1] + day + u32::from(is_leap && month > 2);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let month_name = MONTHS[month as usize - 1];
    let day_name = DAYS[weekday];

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |v: i64, width: usize| {
            if unpadded {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(i64::from(month), 2)),
            Some('d') => out.push_str(&num(i64::from(day), 2)),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&num(i64::from(yday), 3)),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(hour12, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('u') => out.push_str(&(weekday + 1).to_string()),
            Some('w') => out.push_str(&((weekday + 1) % 7).to_string()),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            Some('T') => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}
