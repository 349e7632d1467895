//! JSON text as Python's `json.dumps` writes it, so that the files match the hub's byte for
//! byte: `indent=2, sort_keys=True` for configs, the default separators (`", "`, `": "`) for
//! the one-line GPT-OSS index, and floats in Python's `repr` (`1e-05`, `32.0`).

use serde_json::Value;

/// `json.dumps(v, indent=2, sort_keys=True)`.
pub(crate) fn dumps_indented(v: &Value) -> String {
    let mut out = String::new();
    write_value(v, Some(0), &mut out);
    out
}

/// `json.dumps(v)` (keys in the map's order, which the caller sets).
pub(crate) fn dumps_line(pairs: &[(&str, Value)]) -> String {
    let mut out = String::from("{");
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        push_str_lit(k, &mut out);
        out.push_str(": ");
        write_value(v, None, &mut out);
    }
    out.push('}');
    out
}

/// An object written in the given key order, on one line (for the index's weight_map).
pub(crate) fn ordered_object_line<'a>(entries: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = String::from("{");
    for (i, (k, v)) in entries.enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        push_str_lit(k, &mut out);
        out.push_str(": ");
        push_str_lit(v, &mut out);
    }
    out.push('}');
    out
}

fn push_str_lit(s: &str, out: &mut String) {
    // Python escapes non-ASCII (ensure_ascii); serde_json does not, so do it here.
    let lit = serde_json::to_string(s).expect("a string serialises");
    for c in lit.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for u in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
}

fn newline(level: usize, out: &mut String) {
    out.push('\n');
    for _ in 0..level {
        out.push_str("  ");
    }
}

fn write_value(v: &Value, indent: Option<usize>, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                out.push_str(&py_float(f));
            } else {
                out.push_str(&n.to_string());
            }
        }
        Value::String(s) => push_str_lit(s, out),
        Value::Array(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    if indent.is_none() {
                        out.push(' ');
                    }
                }
                if let Some(l) = indent {
                    newline(l + 1, out);
                }
                write_value(x, indent.map(|l| l + 1), out);
            }
            if let Some(l) = indent {
                newline(l, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            if m.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    if indent.is_none() {
                        out.push(' ');
                    }
                }
                if let Some(l) = indent {
                    newline(l + 1, out);
                }
                push_str_lit(k, out);
                out.push_str(": ");
                write_value(&m[k], indent.map(|l| l + 1), out);
            }
            if let Some(l) = indent {
                newline(l, out);
            }
            out.push('}');
        }
    }
}

/// Python's `repr(float)`: the shortest round-trip digits, positional for decimal exponents
/// in [-4, 16), scientific with a signed two-digit exponent otherwise.
pub(crate) fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}"); // e.g. "1e-5", "1.702e0", "-3.5e16"
    let (mant, exp) = sci.split_once('e').expect("LowerExp has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent is an integer");
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mant}e{sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        for (x, want) in [
            (1e-5, "1e-05"),
            (1e-6, "1e-06"),
            (0.0, "0.0"),
            (32.0, "32.0"),
            (7.0, "7.0"),
            (1.702, "1.702"),
            (0.001, "0.001"),
            (0.0001, "0.0001"),
            (1_000_000.0, "1000000.0"),
            (1e16, "1e+16"),
            (-2.5e-7, "-2.5e-07"),
        ] {
            assert_eq!(py_float(x), want, "{x}");
        }
    }

    #[test]
    fn indented_form_matches_python() {
        let v = serde_json::json!({"b": [1, 2], "a": {"y": null, "x": 0.9}, "c": [], "d": "é"});
        let want = "{\n  \"a\": {\n    \"x\": 0.9,\n    \"y\": null\n  },\n  \"b\": [\n    1,\n    2\n  ],\n  \"c\": [],\n  \"d\": \"\\u00e9\"\n}";
        assert_eq!(dumps_indented(&v), want);
    }
}
