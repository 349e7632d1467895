//! `stormo tokenize`: text to token ids with a model's `tokenizer.json`, or ids back to text.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};

use stormo_text::Tokenizer;

/// Arguments of `stormo tokenize`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  stormo tokenize --model DIR 'Hello, world!'\n  \
                  stormo tokenize --model DIR --special '<|start|>user<|message|>hi<|end|>'\n  \
                  stormo tokenize --model DIR --decode '13225,11,2375,0'\n  \
                  echo 'from stdin' | stormo tokenize --model DIR -"
)]
pub struct Args {
    /// The model directory (its tokenizer.json is used).
    #[arg(short, long, value_name = "DIR")]
    pub model: PathBuf,
    /// Recognize special tokens written in the text (e.g. `<|start|>`) as their ids; without
    /// it they are tokenized as ordinary text.
    #[arg(long)]
    pub special: bool,
    /// Decode: TEXT is token ids (separated by commas and/or whitespace); print their text.
    #[arg(long)]
    pub decode: bool,
    /// With --decode, leave special tokens out of the text.
    #[arg(long, requires = "decode")]
    pub skip_special: bool,
    /// Print one JSON object (ids and count, or text) instead of bare output.
    #[arg(long)]
    pub json: bool,
    /// The text to encode (or ids to decode); `-` reads standard input.
    #[arg(value_name = "TEXT", allow_hyphen_values = true)]
    pub text: String,
}

/// Runs `stormo tokenize`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let path = a.model.join("tokenizer.json");
    if !path.is_file() {
        bail!(
            "no tokenizer at {}: --model must be a model folder with a tokenizer.json",
            path.display()
        );
    }
    let tok = Tokenizer::from_file(&path)
        .with_context(|| format!("loading the tokenizer {}", path.display()))?;
    let input = if a.text == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading standard input")?
    } else {
        a.text.clone()
    };
    execute(&a, &tok, &input, &mut std::io::stdout().lock())
}

/// Encodes or decodes `input` as `a` says, writing the result to `out`.
fn execute(a: &Args, tok: &Tokenizer, input: &str, out: &mut dyn Write) -> anyhow::Result<()> {
    if a.decode {
        let ids = super::run::parse_ids(input, "--decode")?;
        let text = tok.decode(&ids, a.skip_special)?;
        if a.json {
            writeln!(out, "{}", serde_json::json!({ "text": text }))?;
        } else {
            writeln!(out, "{text}")?;
        }
    } else {
        let ids = tok.encode(input, a.special)?;
        if a.json {
            writeln!(
                out,
                "{}",
                serde_json::json!({ "ids": ids, "count": ids.len() })
            )?;
        } else {
            let line: Vec<String> = ids.iter().map(u32::to_string).collect();
            writeln!(out, "{}", line.join(" "))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/o200k-harmony")
    }

    fn args(text: &str, special: bool, decode: bool) -> Args {
        Args {
            model: fixture(),
            special,
            decode,
            skip_special: false,
            json: false,
            text: text.into(),
        }
    }

    fn exec(tok: &Tokenizer, a: &Args) -> anyhow::Result<String> {
        let mut out = Vec::new();
        execute(a, tok, &a.text, &mut out)?;
        Ok(String::from_utf8(out).expect("utf-8 output"))
    }

    #[test]
    fn encodes_decodes_and_reports_bad_input() {
        let tok = Tokenizer::from_model_dir(&fixture()).expect("fixture tokenizer");
        let ids = exec(&tok, &args("<|start|>user", true, false)).expect("encode");
        assert_eq!(ids, "200006 1428\n");
        // Without --special the marker is text.
        let plain = exec(&tok, &args("<|start|>user", false, false)).expect("encode");
        assert_ne!(plain, ids);
        let text = exec(&tok, &args("13225, 11 2375,0", false, true)).expect("decode");
        assert_eq!(text, "Hello, world!\n");
        let err = exec(&tok, &args("1,x", false, true)).expect_err("bad id");
        assert!(format!("{err:#}").contains("\"x\""), "{err:#}");
        let err = exec(&tok, &args("999999999", false, true)).expect_err("unknown id");
        assert!(format!("{err:#}").contains("999999999"), "{err:#}");
    }

    #[test]
    fn missing_tokenizer_names_the_path() {
        let dir = std::env::temp_dir().join("stormo-tokenize-test-missing");
        let err = run(Args {
            model: dir.clone(),
            ..args("hi", false, false)
        })
        .expect_err("no tokenizer.json");
        let msg = format!("{err:#}");
        assert!(
            msg.contains(&dir.join("tokenizer.json").display().to_string()),
            "{msg}"
        );
    }
}
