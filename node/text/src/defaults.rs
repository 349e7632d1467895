//! The model folder's `generation_config.json`: the sampling its publisher recommends, used
//! as the default of `stormo chat`, `stormo run --prompt` and the HTTP API when the user or
//! the request gives no value of its own.
//!
//! Read: `temperature`, `top_p`, `top_k`, `repetition_penalty` (each when present and a
//! number in range), and `do_sample: false`, which means greedy (temperature 0) as in
//! Transformers. Everything else in the file (`eos_token_id`, `max_new_tokens`, ...) is
//! ignored here: stop ids come from config.json and the chat format. A missing file is no
//! error (defaults are then stormo's own); a file that is not JSON, or a value out of range,
//! is a warning naming the file and the field, and that value is left out, since a default
//! must never stop a model from loading.
//!
//! Non-goals: other generation settings of Transformers (beam search, `min_p`, length
//! penalties, `max_length`).

use std::path::Path;

use serde_json::Value;

/// Sampling defaults from a model's `generation_config.json` (a field is `None` when the file
/// does not give it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    /// Temperature (0 with `do_sample: false`).
    pub temperature: Option<f32>,
    /// Nucleus sampling mass, in (0, 1].
    pub top_p: Option<f32>,
    /// Most likely tokens kept (0: all).
    pub top_k: Option<usize>,
    /// Repetition penalty, positive.
    pub repetition_penalty: Option<f32>,
}

/// The file's name in a model folder.
pub const FILE: &str = "generation_config.json";

impl SamplingDefaults {
    /// Reads `dir/generation_config.json`; no file gives no defaults. Problems are logged as
    /// warnings (see the module docs), never returned.
    pub fn from_dir(dir: &Path) -> Self {
        let path = dir.join(FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Self::default(),
            Err(e) => {
                tracing::warn!(
                    "cannot read {} ({e}): sampling defaults are stormo's own",
                    path.display()
                );
                return Self::default();
            }
        };
        match serde_json::from_str::<Value>(&text) {
            Ok(v) => Self::from_json(&v, &path.display().to_string()),
            Err(e) => {
                tracing::warn!(
                    "{} is not JSON ({e}): sampling defaults are stormo's own",
                    path.display()
                );
                Self::default()
            }
        }
    }

    /// The defaults in a parsed file (`what` names it in warnings).
    pub fn from_json(v: &Value, what: &str) -> Self {
        let num = |key: &str, ok: &dyn Fn(f64) -> bool, range: &str| -> Option<f64> {
            let x = v.get(key)?;
            match x.as_f64() {
                Some(f) if ok(f) => Some(f),
                _ => {
                    tracing::warn!("{what}: {key} is {x}, not {range}: ignored");
                    None
                }
            }
        };
        let greedy = v.get("do_sample").and_then(Value::as_bool) == Some(false);
        let temperature = if greedy {
            Some(0.0)
        } else {
            num(
                "temperature",
                &|f| f >= 0.0 && f.is_finite() && f <= 100.0,
                "a number from 0 to 100",
            )
            .map(|f| f as f32)
        };
        Self {
            temperature,
            top_p: num("top_p", &|f| f > 0.0 && f <= 1.0, "in (0, 1]").map(|f| f as f32),
            top_k: num(
                "top_k",
                &|f| f >= 0.0 && f.fract() == 0.0 && f <= 1e9,
                "a whole number of at least 0",
            )
            .map(|f| f as usize),
            repetition_penalty: num(
                "repetition_penalty",
                &|f| f > 0.0 && f.is_finite() && f <= 100.0,
                "a positive number up to 100",
            )
            .map(|f| f as f32),
        }
    }

    /// Whether the file gave anything.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_qwen3s_recommended_sampling() {
        // Qwen3-30B-A3B's generation_config.json as published.
        let v = json!({
            "bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
            "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
            "transformers_version": "4.51.0"
        });
        let d = SamplingDefaults::from_json(&v, "test");
        assert_eq!(d.temperature, Some(0.6));
        assert_eq!(d.top_k, Some(20));
        assert_eq!(d.top_p, Some(0.95));
        assert_eq!(d.repetition_penalty, None);
    }

    #[test]
    fn do_sample_false_is_greedy_and_bad_values_are_left_out() {
        let v = json!({ "do_sample": false, "temperature": 0.7, "top_p": 1.5, "top_k": -1,
                        "repetition_penalty": "x" });
        let d = SamplingDefaults::from_json(&v, "test");
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: Some(0.0),
                ..Default::default()
            }
        );
        // GPT-OSS's file gives no sampling at all.
        let v = json!({ "bos_token_id": 199998, "do_sample": true, "eos_token_id": [200002] });
        assert!(SamplingDefaults::from_json(&v, "test").is_empty());
    }

    #[test]
    fn a_missing_or_broken_file_gives_no_defaults() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert!(SamplingDefaults::from_dir(dir.path()).is_empty());
        std::fs::write(dir.path().join(FILE), "{not json").expect("write");
        assert!(SamplingDefaults::from_dir(dir.path()).is_empty());
        std::fs::write(dir.path().join(FILE), r#"{"temperature": 1.1}"#).expect("write");
        assert_eq!(
            SamplingDefaults::from_dir(dir.path()).temperature,
            Some(1.1)
        );
    }
}
