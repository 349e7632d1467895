//! `stormo chat`: an interactive conversation in the terminal, plus the pieces `run --prompt`
//! and the HTTP server share (loading a model with its tokenizer, sampling options).
//!
//! The conversation keeps one [`ChatSession`]: each turn renders the whole conversation again
//! and computes only what differs from the cache; a conversation that fills the context drops
//! its oldest exchanges ([`stormo_text::shift`]), before a turn or in the middle of a reply,
//! unless `--no-context-shift`. On a terminal it reads messages through a
//! line editor (history, multi-line, Ctrl-C stops a reply: [`crate::cmd::chat::editor`]); from a
//! pipe it reads one line per turn (`printf 'hi\nmore\n' | stormo chat --model DIR`).
//! `/save` and `/load` keep conversations in JSON files ([`stormo_text::transcript`]);
//! `--session FILE` keeps the conversation with its KV cache and resumes it in the next
//! process ([`persist`]). Ctrl-C during a long prompt stops it between layers.

pub mod editor;
pub mod persist;

use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use stormo_engine::sampling::SamplingParams;
use stormo_engine::LoadOptions;

use crate::args::{ExpertArgs, PeerArgs};
use stormo_node::config::{LocalExperts, NodeConfig};
use stormo_text::defaults::SamplingDefaults;
use stormo_text::harmony::ReasoningEffort;
use stormo_text::reply::ReplyStream;
use stormo_text::session::{ChatSession, FinishReason, GenerateOptions, Generation};
use stormo_text::{shift, transcript};
use stormo_text::{OutputDelta, PromptOptions, Turn, TurnRole};

/// Sampling options shared by `run` and `chat` (the HTTP API takes them per request). Each
/// one not given takes the model folder's `generation_config.json` value when it has one
/// (see [`SamplingDefaults`]), else stormo's default.
#[derive(Debug, Clone, clap::Args)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy (the most likely token every time). Default: the
    /// model's generation_config.json, else `run` is greedy and `chat` samples at 0.7 (greedy
    /// replies tend to loop); an HTTP request that gives none samples at the model's
    /// temperature, else 1.0 as OpenAI's API does.
    #[arg(long, allow_negative_numbers = true, value_name = "T", value_parser = temperature_arg)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass (0, 1].
    /// Default: the model's generation_config.json, else 1 (off).
    #[arg(long, allow_negative_numbers = true, value_name = "P", value_parser = top_p_arg)]
    pub top_p: Option<f32>,
    /// Keep only the K most likely tokens (0: all). Default: the model's
    /// generation_config.json, else 0.
    #[arg(long, allow_negative_numbers = true, value_name = "K", value_parser = crate::args::count_arg)]
    pub top_k: Option<usize>,
    /// Penalty (> 0) on tokens already in the conversation; 1 is none. Default: the model's
    /// generation_config.json, else 1.
    #[arg(long, allow_negative_numbers = true, value_name = "R", value_parser = penalty_arg)]
    pub repetition_penalty: Option<f32>,
    /// Seed of the sampler: the same seed gives the same tokens. Default: 0 (a chat resumed
    /// with --session: the seed it was saved with).
    #[arg(long, allow_negative_numbers = true, value_name = "N", value_parser = crate::args::u64_arg)]
    pub seed: Option<u64>,
}

/// A number for a sampling option, or an error that names the value.
fn sampling_number(s: &str) -> Result<f32, String> {
    s.trim()
        .parse::<f32>()
        .ok()
        .filter(|v| !v.is_nan())
        .ok_or_else(|| format!("{s:?} is not a number"))
}

/// `--temperature`: 0 (greedy) or a positive finite number.
fn temperature_arg(s: &str) -> Result<f32, String> {
    let v = sampling_number(s)?;
    if v >= 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(format!("{s} is not 0 (greedy) or a positive finite number"))
    }
}

/// `--top-p`: a probability mass in (0, 1].
fn top_p_arg(s: &str) -> Result<f32, String> {
    let v = sampling_number(s)?;
    if v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!(
            "{s} is outside (0, 1]: above 0, at most 1 (1 is off)"
        ))
    }
}

/// `--repetition-penalty`: a positive finite number.
fn penalty_arg(s: &str) -> Result<f32, String> {
    let v = sampling_number(s)?;
    if v > 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(format!(
            "{s} is not a positive finite number (1 is no penalty)"
        ))
    }
}

impl SamplingArgs {
    /// The engine's settings, ignoring the model's defaults; `default_temperature` when
    /// --temperature is not given.
    pub fn params(&self, default_temperature: f32) -> anyhow::Result<SamplingParams> {
        self.params_with(&SamplingDefaults::default(), default_temperature)
    }

    /// The engine's settings: each option given, else the model's default `d`, else stormo's
    /// (`default_temperature`, no top-p, no top-k, no penalty).
    pub fn params_with(
        &self,
        d: &SamplingDefaults,
        default_temperature: f32,
    ) -> anyhow::Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self
                .temperature
                .or(d.temperature)
                .unwrap_or(default_temperature),
            top_k: self.top_k.or(d.top_k).unwrap_or(0),
            top_p: self.top_p.or(d.top_p).unwrap_or(1.0),
            repetition_penalty: self
                .repetition_penalty
                .or(d.repetition_penalty)
                .unwrap_or(1.0),
            seed: self.seed.unwrap_or(0),
        };
        p.validate().context("sampling options")?;
        Ok(p)
    }

    /// Warns once about the options that `p` (from [`Self::params`]) leaves unused: greedy
    /// decoding takes no --top-p, --top-k or --seed.
    pub fn warn_unused(&self, p: &SamplingParams) {
        if p.temperature == 0.0 {
            let ignored: Vec<&str> = [
                (self.top_p.is_some_and(|v| v != 1.0), "--top-p"),
                (self.top_k.is_some_and(|v| v != 0), "--top-k"),
                (self.seed.is_some_and(|v| v != 0), "--seed"),
            ]
            .into_iter()
            .filter_map(|(given, name)| given.then_some(name))
            .collect();
            if !ignored.is_empty() {
                tracing::warn!(
                    "{} ignored: decoding is greedy (temperature 0); give --temperature to sample",
                    ignored.join(", ")
                );
            }
        }
    }
}

/// How reasoning (Harmony `analysis`, Qwen `<think>`) is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningDisplay {
    /// Dimmed on a terminal, left out otherwise.
    Auto,
    /// Dimmed (ANSI faint), even when not a terminal.
    Dim,
    /// As plain text.
    Show,
    /// Left out.
    Hide,
}

pub use stormo_node::text_model::{
    check_text_model, check_tokenizer_fits, load_text_model, load_tokenizer, text_model_on,
    TextModel,
};

/// Writes reasoning and answer text to a terminal or pipe as it arrives.
#[derive(Debug)]
pub struct Printer {
    dim: bool,
    show_reasoning: bool,
    in_reasoning: bool,
}

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

impl Printer {
    /// A printer with `display`, for a terminal if `tty`.
    pub fn new(display: ReasoningDisplay, tty: bool) -> Self {
        let (show_reasoning, dim) = match display {
            ReasoningDisplay::Auto => (tty, tty),
            ReasoningDisplay::Dim => (true, true),
            ReasoningDisplay::Show => (true, false),
            ReasoningDisplay::Hide => (false, false),
        };
        Self {
            dim,
            show_reasoning,
            in_reasoning: false,
        }
    }

    /// Prints one piece.
    pub fn print(&mut self, out: &mut dyn Write, d: &OutputDelta) -> std::io::Result<()> {
        match d {
            OutputDelta::Reasoning(t) if self.show_reasoning => {
                if !self.in_reasoning && self.dim {
                    out.write_all(DIM.as_bytes())?;
                }
                self.in_reasoning = true;
                out.write_all(t.as_bytes())?;
            }
            OutputDelta::Reasoning(_) => {}
            OutputDelta::Content(t) => {
                if self.in_reasoning {
                    if self.dim {
                        out.write_all(RESET.as_bytes())?;
                    }
                    out.write_all(b"\n\n")?;
                    self.in_reasoning = false;
                }
                out.write_all(t.as_bytes())?;
            }
        }
        out.flush()
    }

    /// Ends a reply.
    pub fn end(&mut self, out: &mut dyn Write) -> std::io::Result<()> {
        if self.in_reasoning && self.dim {
            out.write_all(RESET.as_bytes())?;
        }
        self.in_reasoning = false;
        out.write_all(b"\n")?;
        out.flush()
    }
}

/// Arguments of `stormo chat`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Type a message and press Enter; each line is one turn. On a terminal: \
                  Up/Down recall earlier messages (kept across sessions in the state \
                  directory), a line ending in \\ continues on the next, a paste keeps its \
                  lines in one message, and Ctrl-C stops a reply (the conversation keeps it; \
                  the next message continues it) or, while the prompt is read, the turn (the \
                  message is dropped). A conversation that fills --context drops \
                  its oldest turns (the system prompt kept; the status line says how many) \
                  unless --no-context-shift (then a message that does not fit is not added). \
                  Sampling defaults come from the model's \
                  generation_config.json. Commands:\n  \
                  /reset       forget the conversation\n  \
                  /save FILE   save the conversation (JSON: {\"format\": \"stormo-chat\", \
                  \"messages\": [...]}, the messages in OpenAI's shape)\n  \
                  /load FILE   continue a conversation: one /save wrote, an OpenAI chat request \
                  body ({\"messages\": [...]}) or a JSON array of messages\n  \
                  /quit        leave (also /exit, Ctrl-D, or end of input)\n  \
                  /help        this list\n\
                  A line that starts with a space is a message, even one that starts with /.\n\n\
                  Example: printf 'Hello\\nAnd again?\\n' | stormo chat --model DIR\n\n\
                  Resumable: stormo chat --model DIR --session chat.kv (saved after every \
                  turn; run it again to go on where it left off, the cache reused).\n\n\
                  A model bigger than this machine, its experts on a LAN node (`stormo serve \
                  --help`):\n  \
                  stormo pull --peer KEY@HOST:4433 --model-id ID --out ~/m   # dense weights\n  \
                  stormo chat --model ~/m --peer KEY@HOST:4433"
)]
pub struct Args {
    /// The model directory (config.json, safetensors and tokenizer.json).
    #[arg(short, long, value_name = "DIR")]
    pub model: PathBuf,
    /// A system prompt (Harmony: developer instructions).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// How prompts are rendered and reasoning shown.
    #[command(flatten)]
    pub render: RenderArgs,
    /// Positions the conversation may hold (prompt and replies); the KV cache is sized for it.
    #[arg(short, long, default_value_t = 4096, value_name = "N")]
    pub context: usize,
    /// At most this many tokens per reply.
    #[arg(short = 'n', long, default_value_t = 1024, value_name = "N",
          allow_negative_numbers = true, value_parser = crate::args::count_arg)]
    pub max_new_tokens: usize,
    /// When the conversation fills the context, do not shift it: a message that would not
    /// fit with the conversation is not added (send a shorter one, or /reset). By default the
    /// oldest turns are dropped, whole, the system prompt kept, and the status line says how
    /// many.
    #[arg(long)]
    pub no_context_shift: bool,
    /// Sampling (the chat default temperature is 0.7: greedy decoding tends to loop).
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Lab switch (hidden): positions per prefill block.
    #[arg(long, hide = true, default_value_t = 128, value_name = "N")]
    pub prefill_block: usize,
    /// Lab switch (hidden): run attention projections and the output head from 8-bit
    /// row-scaled copies (approximate, faster; docs/design.md).
    #[arg(long, hide = true)]
    pub int8_attn_head: bool,
    /// Lab switch (hidden): multiply MXFP4 experts by int8-rounded inputs (approximate;
    /// integer products, AVX-512 VNNI where the CPU has it: faster prefill where the expert
    /// kernel is the limit; docs/design.md).
    #[arg(long, hide = true)]
    pub int8_experts: bool,
    /// Compute the whole exact output head for every token instead of screening it with an
    /// 8-bit copy, greedy or sampled (the same tokens; docs/design.md). Lab switch (hidden).
    #[arg(long, hide = true)]
    pub full_head: bool,
    /// No statistics line on stderr after each reply (`run` prints them with --stats).
    #[arg(long, alias = "quiet")]
    pub no_stats: bool,
    /// Keep no history file (the Up arrow still recalls this session's messages).
    #[arg(long)]
    pub no_history: bool,
    /// Keep the conversation and its KV cache in FILE: saved after every turn (atomically),
    /// and resumed when FILE exists, the cache reused (about 2·layers·kv_dim·4 bytes per
    /// position: 96 KiB for gpt-oss-20b). FILE's folder must exist and be writable (checked at
    /// start). A resumed chat samples as it was saved; a sampling option given again
    /// (--temperature, --top-p, --top-k, --repetition-penalty, --seed) takes over, and the
    /// first status line says which. Give the same model and --context: a file from another
    /// model or settings, or a damaged one, is an error that names what differs, and the
    /// file is left untouched.
    #[arg(long, value_name = "FILE")]
    pub session: Option<PathBuf>,
    /// Where experts come from.
    #[command(flatten)]
    pub experts: ExpertArgs,
    /// Peers below the disk: chat with a model whose experts are elsewhere (a folder from
    /// `stormo pull` holds only the dense weights; its experts come from the peers).
    #[command(flatten)]
    pub net: PeerArgs,
    /// Swarm membership and discovery (peers found by themselves instead of --peer).
    #[command(flatten)]
    pub swarm: crate::swarm_args::SwarmArgs,
}

/// How a conversation is rendered and the reply's reasoning shown (`run --prompt`, `chat`).
#[derive(Debug, clap::Args)]
pub struct RenderArgs {
    /// How much the model reasons before it answers: low, medium or high (GPT-OSS's levels;
    /// Qwen3 thinks at any of them), or none (Qwen3: an empty think block; GPT-OSS always
    /// reasons and takes none as low).
    #[arg(long, default_value = "medium", value_name = "EFFORT",
          value_parser = ["low", "medium", "high", "none"])]
    pub reasoning_effort: String,
    /// The old spelling of `--reasoning-effort none` (hidden).
    #[arg(long, hide = true, conflicts_with = "reasoning_effort")]
    pub no_thinking: bool,
    /// How the model's reasoning is shown.
    #[arg(long, alias = "reasoning", value_name = "HOW", value_enum,
          default_value_t = ReasoningDisplay::Auto)]
    pub show_reasoning: ReasoningDisplay,
}

impl RenderArgs {
    /// The render options these arguments ask for.
    pub fn prompt_options(&self) -> anyhow::Result<PromptOptions> {
        prompt_options(&self.reasoning_effort, self.no_thinking)
    }

    /// Warns (on stderr) when `--reasoning-effort none` meets a model that always reasons
    /// (GPT-OSS, which takes it as `low`).
    pub fn warn_for(&self, family: stormo_engine::Family) {
        let none = self.no_thinking || self.reasoning_effort == "none";
        if none && family == stormo_engine::Family::GptOss {
            eprintln!(
                "warning: GPT-OSS always reasons: --reasoning-effort none runs at its lowest \
                 level, low"
            );
        }
    }
}

/// Options of a prompt render from the command line.
/// `effort` is low, medium, high or none; `none` (or `no_thinking`, its old spelling) turns
/// Qwen3's thinking off and gives GPT-OSS, which always reasons, its lowest level.
pub fn prompt_options(effort: &str, no_thinking: bool) -> anyhow::Result<PromptOptions> {
    let effort = if no_thinking { "none" } else { effort };
    let off = effort == "none";
    Ok(PromptOptions {
        reasoning_effort: if effort == "none" {
            ReasoningEffort::Low
        } else {
            ReasoningEffort::parse(effort)
                .with_context(|| format!("unknown reasoning effort {effort:?}"))?
        },
        date: None,
        enable_thinking: !off,
    })
}

/// A reply as far as it got: its ids and the reasoning and answer text they made.
#[derive(Debug, Default)]
pub struct Reply {
    /// The generated ids, stop token included.
    pub ids: Vec<u32>,
    /// The reasoning text.
    pub reasoning: String,
    /// The answer text.
    pub content: String,
}

/// Runs one reply: generates after `prompt`, printing as it goes and keeping it in `so_far`.
/// After an error partway (a generation error, or stdout failing), the text held back is
/// printed and the line ended before the error is returned, so the output and `so_far` hold
/// what was generated.
pub fn reply(
    sess: &mut ChatSession,
    stream: &mut ReplyStream,
    prompt: &[u32],
    opts: &GenerateOptions,
    printer: &mut Printer,
    out: &mut dyn Write,
    so_far: &mut Reply,
) -> anyhow::Result<Generation> {
    reply_until(sess, stream, prompt, opts, printer, out, so_far, None)
}

/// [`reply`], stopped (finish reason `Cancelled`) after the token during which `stop`, when
/// given, became set.
#[allow(clippy::too_many_arguments)]
pub fn reply_until(
    sess: &mut ChatSession,
    stream: &mut ReplyStream,
    prompt: &[u32],
    opts: &GenerateOptions,
    printer: &mut Printer,
    out: &mut dyn Write,
    so_far: &mut Reply,
    stop: Option<&AtomicBool>,
) -> anyhow::Result<Generation> {
    reply_refitting(
        sess,
        stream,
        prompt,
        opts,
        printer,
        out,
        so_far,
        stop,
        &mut |_| Ok(None),
    )
}

/// Given a reply's ids so far, a shorter prompt that ends with them, if the conversation
/// before the reply can shift ([`reply_refitting`]).
type Refit<'a> = dyn FnMut(&[u32]) -> anyhow::Result<Option<Vec<u32>>> + 'a;

/// [`reply_until`], and when the context fills before the reply ends, `refit` is given the
/// reply's ids so far and may return a shorter prompt that ends with them (the conversation
/// before the reply shifted): the reply then goes on after it, in the same stream. The
/// [`Generation`] returned covers the whole reply: the first prompt's size and reuse, the
/// times added up, the last part's finish.
#[allow(clippy::too_many_arguments)]
fn reply_refitting(
    sess: &mut ChatSession,
    stream: &mut ReplyStream,
    prompt: &[u32],
    opts: &GenerateOptions,
    printer: &mut Printer,
    out: &mut dyn Write,
    so_far: &mut Reply,
    stop: Option<&AtomicBool>,
    refit: &mut Refit<'_>,
) -> anyhow::Result<Generation> {
    let mut out = Noting {
        inner: out,
        wrote: false,
    };
    // The first write that failed; nothing more is printed after it.
    let mut failed = None;
    let mut take = |d: OutputDelta, so_far: &mut Reply, out: &mut Noting<'_>| {
        match &d {
            OutputDelta::Reasoning(t) => so_far.reasoning.push_str(t),
            OutputDelta::Content(t) => so_far.content.push_str(t),
        }
        if failed.is_some() {
            return ControlFlow::Break(());
        }
        if let Err(e) = printer.print(out, &d) {
            failed = Some(e);
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    };
    let mut prompt = prompt.to_vec();
    let mut part_opts = opts.clone();
    // The parts before the last, added up.
    let mut before: Option<Generation> = None;
    let generated = loop {
        let part = sess.generate(&prompt, &part_opts, |id| {
            so_far.ids.push(id);
            let flow = match stream.push(id) {
                Some(d) => take(d, so_far, &mut out),
                None => ControlFlow::Continue(()),
            };
            if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
                return ControlFlow::Break(());
            }
            flow
        });
        let part = match part {
            Ok(g) => g,
            Err(e) => break Err(anyhow::Error::from(e)),
        };
        let whole = match before.take() {
            None => part,
            Some(b) => Generation {
                ids: [b.ids, part.ids].concat(),
                finish: part.finish,
                prefill_s: b.prefill_s + part.prefill_s,
                decode_s: b.decode_s + part.decode_s,
                check_wait_s: b.check_wait_s + part.check_wait_s,
                ..b
            },
        };
        let left = opts.max_new_tokens.saturating_sub(whole.ids.len());
        // (A write that failed stopped the part: its finish is `Cancelled`.)
        if whole.finish != FinishReason::ContextFull || left == 0 {
            break Ok(whole);
        }
        match refit(&whole.ids) {
            Ok(Some(p)) => {
                prompt = p;
                part_opts.max_new_tokens = left;
                // Another stream of random numbers for the rest of the reply.
                part_opts.sampling.seed = opts.sampling.seed.wrapping_add(whole.ids.len() as u64);
                before = Some(whole);
            }
            Ok(None) => break Ok(whole),
            Err(e) => break Err(e),
        }
    };
    if let Some(d) = stream.finish() {
        let _ = take(d, so_far, &mut out);
    }
    let g = match generated {
        Ok(g) => g,
        Err(e) => {
            if out.wrote && failed.is_none() {
                let _ = printer.end(&mut out);
            }
            return Err(e);
        }
    };
    if let Some(e) = failed {
        return Err(e).context("writing the reply");
    }
    printer.end(&mut out).context("writing the reply")?;
    Ok(g)
}

/// A writer that notes whether anything went through it.
struct Noting<'a> {
    inner: &'a mut dyn Write,
    wrote: bool,
}

impl Write for Noting<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.wrote |= n > 0;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Runs `stormo chat`.
pub fn run(a: Args) -> anyhow::Result<()> {
    // First: the tokenizer and the probes use the pool whose size this sets.
    stormo_node::config::start_engine_threads(a.experts.threads)?;
    let sampling = sampling(&a)?;
    // Before the model loads: a session that could never be saved is refused at once.
    if let Some(path) = &a.session {
        persist::check_writable(path)?;
    }
    let load = LoadOptions {
        prefill_block: a.prefill_block,
        int8_attn_head: a.int8_attn_head,
        int8_experts: a.int8_experts,
        // Greedy and sampled replies alike go through the screen (the whole head's tokens).
        screened_head: !a.full_head,
    };
    // The key file is loaded once: for the certificate's check and for the node.
    let (swarm, host) =
        crate::swarm_args::resolve_identity(&a.swarm, a.net.key.as_deref())?.into_host()?;
    let cfg = NodeConfig {
        model: a.model.clone(),
        state_dir: a.experts.state_dir(),
        experts: a.experts.resolve()?,
        local: LocalExperts::All,
        context: a.context,
        peers: a.net.resolve(false)?,
        listen: None,
        swarm,
    };
    // The model's description, read once: the text checks and the node take it.
    let files = stormo_node::node::open_model(&a.model)?;
    let tm = stormo_node::text_model::load_text_model_on(cfg, host, files, &load)?;
    a.render.warn_for(tm.model.config().family);
    tm.node.wait_for_coverage(a.net.wait_coverage());
    let interactive = std::io::stdin().is_terminal();
    let tty = std::io::stdout().is_terminal();
    let chat = if interactive {
        let (out, notes) = (&mut std::io::stdout(), &mut std::io::stderr());
        converse_terminal(&a, &tm, sampling, out, notes, tty)
    } else {
        converse(
            &a,
            &tm,
            sampling,
            std::io::stdin().lock(),
            &mut std::io::stdout(),
            &mut std::io::stderr(),
            false,
            tty,
        )
    };
    // Also after an error (a --session save that failed ends the chat with one, its turns
    // run): the network closed, the usage counts kept.
    tm.node.finish_run();
    chat
}

/// The chat's sampling: each option given, else the model folder's generation_config.json
/// (read here, once a chat), else a temperature of 0.7; a warning for options it leaves unused.
pub fn sampling(a: &Args) -> anyhow::Result<SamplingParams> {
    let sampling = a
        .sampling
        .params_with(&SamplingDefaults::from_dir(&a.model), 0.7)?;
    a.sampling.warn_unused(&sampling);
    Ok(sampling)
}

/// What the loop does after a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Continue,
    Quit,
}

/// A chat command: a line that starts with `/` and a name (`/reset`, `/save FILE`), and what
/// follows the name, trimmed, if anything does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Command<'t> {
    name: &'t str,
    arg: Option<&'t str>,
}

impl<'t> Command<'t> {
    /// The command `line` gives, or `None` for a message: a line that starts with a space,
    /// or whose first word is no command name (`/` and letters, or `/?`), such as a path
    /// (`/etc/hosts is what?`), is a message; a path alone (`/etc/hosts`) is taken for a
    /// mistyped command, as it was before.
    fn of(line: &'t str) -> Option<Self> {
        if !line.starts_with('/') {
            return None;
        }
        let line = line.trim_end();
        let (name, arg) = match line.split_once(char::is_whitespace) {
            Some((name, rest)) => (name, Some(rest.trim()).filter(|r| !r.is_empty())),
            None => (line, None),
        };
        let word = name == "/?" || name[1..].chars().all(|c| c.is_ascii_alphabetic());
        (word || arg.is_none()).then_some(Self { name, arg })
    }
}

/// "1 message", "2 messages".
fn messages(n: usize) -> String {
    format!("{n} message{}", if n == 1 { "" } else { "s" })
}

/// A conversation in progress: its turns, its engine session, and how it is shown.
struct Conversation<'a> {
    a: &'a Args,
    tm: &'a TextModel,
    popts: PromptOptions,
    sampling: SamplingParams,
    sess: ChatSession,
    printer: Printer,
    turns: Vec<Turn>,
    /// Turns from --system at the start (kept by /reset).
    system_turns: usize,
    /// The first turn after the system turns that is still rendered: the context shifts
    /// left out `turns[system..start]` (they stay in `turns` for /save).
    start: usize,
    turn_no: u64,
    interactive: bool,
    /// Resumed from --session's file.
    resumed: bool,
    /// With --session: how many saves failed, and the last failure (the chat ends with an
    /// error when one did: [`Conversation::finish`]).
    save_failures: (usize, Option<anyhow::Error>),
    /// The sampling options the resumed file was saved with (a version 2 file).
    saved_sampling: Option<persist::SavedSampling>,
}

/// The sampling of a chat resumed from a file saved with `saved`: each option given on the
/// command line, else the saved one.
fn resumed_sampling(
    given: &SamplingArgs,
    saved: &persist::SavedSampling,
) -> anyhow::Result<SamplingParams> {
    let p = SamplingParams {
        temperature: given.temperature.unwrap_or(saved.temperature),
        top_k: given.top_k.unwrap_or(saved.top_k),
        top_p: given.top_p.unwrap_or(saved.top_p),
        repetition_penalty: given.repetition_penalty.unwrap_or(saved.repetition_penalty),
        seed: given.seed.unwrap_or(saved.seed),
    };
    p.validate()
        .context("sampling options (the saved ones with those given)")?;
    Ok(p)
}

impl<'a> Conversation<'a> {
    fn new(
        a: &'a Args,
        tm: &'a TextModel,
        sampling: SamplingParams,
        interactive: bool,
        tty: bool,
    ) -> anyhow::Result<Self> {
        let popts = a.render.prompt_options()?;
        anyhow::ensure!(a.max_new_tokens >= 1, "--max-new-tokens must be at least 1");
        // The chat format's own tokens around an empty message (and the system prompt) must
        // leave room for a message and a reply, or no turn could ever run.
        let mut empty = Vec::new();
        if let Some(s) = &a.system {
            empty.push(Turn::new(TurnRole::System, s.clone()));
        }
        empty.push(Turn::new(TurnRole::User, String::new()));
        let header = tm.format.render_prompt(&empty, &popts)?.len();
        anyhow::ensure!(
            header < a.context,
            "--context {}: the chat format takes {header} positions around an empty message{}, \
             leaving no room for a message and a reply",
            a.context,
            if a.system.is_some() {
                " (with --system)"
            } else {
                ""
            }
        );
        let mut turns = Vec::new();
        if let Some(s) = &a.system {
            turns.push(Turn::new(TurnRole::System, s.clone()));
        }
        let resumed = a.session.as_deref().filter(|p| p.exists()).is_some();
        let r = match a.session.as_deref().filter(|_| resumed) {
            Some(path) => persist::resume(tm.model.clone(), a.context, path)?,
            None => persist::Resumed {
                sampling: None,
                sess: ChatSession::new(tm.model.clone(), a.context)?,
                system_turns: turns.len(),
                start: turns.len(),
                turns,
                turn_no: 0,
            },
        };
        // A resumed chat samples as it was saved, each option given here taking over.
        let (sampling, saved_sampling) = match r.sampling {
            Some(saved) => (resumed_sampling(&a.sampling, &saved)?, Some(saved)),
            None => (sampling, None),
        };
        Ok(Self {
            a,
            tm,
            popts,
            sampling,
            saved_sampling,
            sess: r.sess,
            printer: Printer::new(a.render.show_reasoning, tty),
            system_turns: r.system_turns,
            start: r.start,
            turns: r.turns,
            turn_no: r.turn_no,
            interactive,
            resumed,
            save_failures: (0, None),
        })
    }

    /// With --session: a note on what was resumed, or that the file will be made.
    fn session_note(&self, notes: &mut dyn Write) -> std::io::Result<()> {
        let Some(path) = &self.a.session else {
            return Ok(());
        };
        if self.resumed {
            let g = &self.a.sampling;
            let p = &self.sampling;
            let given: Vec<&str> = [
                (g.temperature.is_some(), "--temperature"),
                (g.top_p.is_some(), "--top-p"),
                (g.top_k.is_some(), "--top-k"),
                (g.repetition_penalty.is_some(), "--repetition-penalty"),
                (g.seed.is_some(), "--seed"),
            ]
            .into_iter()
            .filter_map(|(on, flag)| on.then_some(flag))
            .collect();
            let now = format!(
                "temperature {}, top-p {}, top-k {}, repetition penalty {}, seed {}",
                p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.seed
            );
            let sampling = match (&self.saved_sampling, given.is_empty()) {
                (Some(_), true) => format!("sampling as saved: {now}"),
                (Some(_), false) => format!(
                    "sampling {now}: {} from the command line, the rest as saved",
                    given.join(", ")
                ),
                (None, _) => format!(
                    "sampling {now}: the file keeps no sampling options (an older stormo \
                     saved it), so the command line's and the defaults"
                ),
            };
            writeln!(
                notes,
                "(resumed {}: {}, {} positions of KV cache to reuse; {sampling})",
                path.display(),
                messages(self.turns.len()),
                self.sess.cached().len()
            )?;
            if self.a.system.is_some() {
                writeln!(
                    notes,
                    "(--system is ignored: the resumed conversation keeps its own)"
                )?;
            }
        } else {
            writeln!(
                notes,
                "(new session: saved to {} after every turn)",
                path.display()
            )?;
        }
        Ok(())
    }

    /// With --session: saves the conversation and its cache; a failure is a note, and the
    /// chat's error when it ends ([`Self::finish`]).
    fn save_session(&mut self, notes: &mut dyn Write) -> std::io::Result<()> {
        let Some(path) = &self.a.session else {
            return Ok(());
        };
        let state = persist::ChatState::now(
            &self.tm.name,
            &self.turns,
            self.system_turns,
            self.start,
            self.turn_no,
            &self.sampling,
        );
        let saved = persist::save(path, &self.sess, &state);
        if let Err(e) = saved {
            writeln!(notes, "cannot save the session: {e:#}")?;
            self.save_failures = (self.save_failures.0 + 1, Some(e));
        }
        Ok(())
    }

    /// The end of the chat: an error when a --session save failed, so a script sees that
    /// the file does not hold the conversation.
    fn finish(self) -> anyhow::Result<()> {
        match self.save_failures {
            (n, Some(e)) => {
                let path = self.a.session.as_deref().unwrap_or(Path::new("?"));
                Err(e.context(format!(
                    "--session {}: {} of the conversation failed (the last error follows), so \
                     the file does not hold the conversation as it ended",
                    path.display(),
                    if n == 1 {
                        "a save".to_string()
                    } else {
                        format!("{n} saves")
                    }
                )))
            }
            _ => Ok(()),
        }
    }

    fn banner(&self, notes: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            notes,
            "stormo chat with {} ({} positions). /help for commands, /quit to leave.",
            self.tm.name, self.a.context
        )
    }

    /// Handles one line (or multi-line message) of input. `interrupt`, when given, stops
    /// the reply when it is set (Ctrl-C).
    fn line(
        &mut self,
        text: &str,
        out: &mut dyn Write,
        notes: &mut dyn Write,
        interrupt: Option<&AtomicBool>,
    ) -> anyhow::Result<Flow> {
        let text = text.trim_end_matches(['\r', '\n']);
        let Some(Command { name, arg }) = Command::of(text) else {
            if text.trim().is_empty() {
                return Ok(Flow::Continue);
            }
            self.message(text, out, notes, interrupt)?;
            self.save_session(notes)?;
            return Ok(Flow::Continue);
        };
        match (name, arg) {
            ("/save", Some(file)) => {
                match transcript::save(Path::new(file), &self.tm.name, &self.turns) {
                    Ok(()) => writeln!(notes, "(saved {} to {file})", messages(self.turns.len()))?,
                    Err(e) => writeln!(notes, "cannot save the conversation: {e}")?,
                }
            }
            ("/load", Some(file)) => match transcript::load(Path::new(file)) {
                Ok(turns) => {
                    writeln!(notes, "(loaded {} from {file})", messages(turns.len()))?;
                    self.turns = turns;
                    self.system_turns = 0;
                    self.start = 0;
                    self.save_session(notes)?;
                }
                Err(e) => writeln!(
                    notes,
                    "cannot load the conversation: {e} (the conversation is unchanged)"
                )?,
            },
            ("/save" | "/load", None) => writeln!(notes, "{name} needs a file: {name} FILE")?,
            ("/quit" | "/exit" | "/q", None) => return Ok(Flow::Quit),
            ("/reset", None) => {
                self.turns.truncate(self.system_turns);
                self.start = self.system_turns;
                self.sess.reset();
                writeln!(notes, "(conversation reset)")?;
                self.save_session(notes)?;
            }
            ("/help" | "/?", None) => writeln!(notes, "{COMMANDS}")?,
            ("/quit" | "/exit" | "/q" | "/reset" | "/help" | "/?", Some(_)) => writeln!(
                notes,
                "{name} takes no argument (start the line with a space to send it as text)"
            )?,
            _ => writeln!(
                notes,
                "unknown command {name}: /help lists them (start the line with a space to send \
                 it as text)"
            )?,
        }
        Ok(Flow::Continue)
    }

    fn message(
        &mut self,
        text: &str,
        out: &mut dyn Write,
        notes: &mut dyn Write,
        interrupt: Option<&AtomicBool>,
    ) -> anyhow::Result<()> {
        let (a, tm) = (self.a, self.tm);
        self.turns.push(Turn::new(TurnRole::User, text));
        let keep = shift::system_turns(&self.turns);
        // Room kept for the reply when the conversation shifts: its --max-new-tokens, at most
        // half the context.
        let reserve = a.max_new_tokens.min(a.context / 2);
        let budget = if a.no_context_shift {
            usize::MAX
        } else {
            a.context - reserve
        };
        let w = shift::shift_to_fit(
            &tm.format,
            &self.turns,
            keep,
            self.start,
            &self.popts,
            budget,
        )?;
        if w.prompt.len() >= a.context {
            self.turns.pop();
            if a.no_context_shift {
                writeln!(
                    notes,
                    "with this message the conversation takes {} tokens, more than the context \
                     of {} positions holds (--no-context-shift): the message was not added; \
                     send a shorter one, /reset to start over, or give a larger --context",
                    w.prompt.len(),
                    a.context
                )?;
            } else {
                writeln!(
                    notes,
                    "this message takes {} tokens with the system prompt, more than the context of {} positions holds even without the earlier turns: send a shorter one, or give a larger --context",
                    w.prompt.len(),
                    a.context
                )?;
            }
            return Ok(());
        }
        // As it was before the turn, for a turn stopped in its prompt.
        let (start_before, turn_no_before) = (self.start, self.turn_no);
        self.start = w.start;
        let prompt = w.prompt;
        // Turns and tokens the context shifts dropped for this reply (before it and during).
        let mut shifted = (w.dropped_turns, w.dropped_tokens);
        let opts = GenerateOptions {
            max_new_tokens: a.max_new_tokens,
            stop: tm.format.stop_tokens(),
            sampling: SamplingParams {
                seed: self.sampling.seed.wrapping_add(self.turn_no),
                ..self.sampling
            },
        };
        self.turn_no += 1;
        let mut stream = ReplyStream::chat(&tm.format);
        let mut so_far = Reply::default();
        let (turns, popts, start) = (&self.turns, &self.popts, &mut self.start);
        // A reply that fills the context shifts it again and goes on, while there is an older
        // exchange to drop.
        let mut refit = |ids: &[u32]| -> anyhow::Result<Option<Vec<u32>>> {
            if a.no_context_shift {
                return Ok(None);
            }
            let reserve = a
                .max_new_tokens
                .saturating_sub(ids.len())
                .min(a.context / 2);
            let budget = a.context.saturating_sub(ids.len() + reserve);
            let w = shift::shift_to_fit(&tm.format, turns, keep, *start, popts, budget)?;
            if w.dropped_turns == 0 || w.prompt.len() + ids.len() >= a.context {
                return Ok(None);
            }
            *start = w.start;
            shifted.0 += w.dropped_turns;
            shifted.1 += w.dropped_tokens;
            Ok(Some([w.prompt, ids.to_vec()].concat()))
        };
        let g = reply_refitting(
            &mut self.sess,
            &mut stream,
            &prompt,
            &opts,
            &mut self.printer,
            out,
            &mut so_far,
            interrupt,
            &mut refit,
        )?;
        if g.finish == FinishReason::Cancelled && g.ids.is_empty() {
            // Ctrl-C while the prompt was computed: the turn never happened.
            self.turns.pop();
            (self.start, self.turn_no) = (start_before, turn_no_before);
            writeln!(
                notes,
                "(stopped while reading the prompt, after {:.1} s: the message is dropped, the \
                 conversation is as before it)",
                g.prefill_s
            )?;
            return Ok(());
        }
        let Reply {
            reasoning, content, ..
        } = so_far;
        let silent = content.is_empty() && reasoning.is_empty() && !g.ids.is_empty();
        // A reply stopped with Ctrl-C stays in the conversation as far as it got.
        self.turns.push(Turn {
            reasoning: (!reasoning.is_empty()).then_some(reasoning),
            ..Turn::new(TurnRole::Assistant, content)
        });
        let (dim, reset) = if self.interactive {
            (DIM, RESET)
        } else {
            ("", "")
        };
        if g.finish == FinishReason::Cancelled && interrupt.is_some() {
            writeln!(
                notes,
                "{dim}(stopped; the reply so far stays in the conversation){reset}"
            )?;
        }
        let shift_note = if shifted.0 > 0 {
            format!(
                "context full: dropped the {} oldest turn{} ({} tokens), the system prompt kept; ",
                shifted.0,
                if shifted.0 == 1 { "" } else { "s" },
                shifted.1
            )
        } else {
            String::new()
        };
        if a.no_stats && shifted.0 > 0 {
            writeln!(notes, "{dim}({}){reset}", shift_note.trim_end_matches("; "))?;
        }
        if !a.no_stats {
            let decode = g.ids.len().saturating_sub(1);
            writeln!(
                notes,
                "{dim}[{shift_note}prompt {} tokens, {} reused from the cache, {} computed; reply {} tokens ({}); {:.1} tok/s{}]{reset}",
                g.prompt_tokens,
                g.reused,
                g.prompt_tokens - g.reused,
                g.ids.len(),
                if g.finish == FinishReason::Cancelled { "stopped" } else { g.finish.openai() },
                if g.decode_s > 0.0 { decode as f64 / g.decode_s } else { 0.0 },
                if silent {
                    "; no message in the model's chat format (a random-weight model's rarely \
                     has one)"
                } else {
                    ""
                },
            )?;
        }
        Ok(())
    }
}

/// The commands, for /help.
const COMMANDS: &str = "/reset forgets the conversation; /save FILE and /load FILE keep and \
                        restore it (JSON; /load also reads OpenAI's messages; --session FILE \
                        keeps it with its KV cache); /quit leaves; anything else is a message \
                        (start a line with a space to send one that starts with /).";

/// The conversation loop, replying with `sampling` ([`sampling`]): reads turns from `input`
/// (one line each), writes replies to `out` and notes (prompts, statistics, command answers)
/// to `notes`. `interactive` shows a prompt and colours the notes; `tty` says whether `out`
/// is a terminal (dimmed reasoning). A terminal is read by [`converse_terminal`] instead.
#[allow(clippy::too_many_arguments)]
pub fn converse(
    a: &Args,
    tm: &TextModel,
    sampling: SamplingParams,
    input: impl BufRead,
    out: &mut dyn Write,
    notes: &mut dyn Write,
    interactive: bool,
    tty: bool,
) -> anyhow::Result<()> {
    let mut c = Conversation::new(a, tm, sampling, interactive, tty)?;
    if interactive {
        c.banner(notes)?;
    }
    c.session_note(notes)?;
    // Lines as bytes: one that is not UTF-8 is skipped with a note, not the end of the chat.
    let mut lines = input.split(b'\n');
    let mut line_no = 0usize;
    loop {
        if interactive {
            write!(notes, "> ")?;
            notes.flush()?;
        }
        let Some(line) = lines.next() else { break };
        line_no += 1;
        let line = line.context("reading standard input")?;
        let Ok(line) = String::from_utf8(line) else {
            writeln!(notes, "line {line_no} is not UTF-8 text: skipped")?;
            continue;
        };
        if c.line(&line, out, notes, None)? == Flow::Quit {
            break;
        }
    }
    c.finish()
}

/// The conversation on a terminal: a line editor with history in the state directory
/// (unless --no-history), multi-line messages, and Ctrl-C that stops a reply and keeps the
/// conversation (see [`crate::cmd::chat::editor`]).
pub fn converse_terminal(
    a: &Args,
    tm: &TextModel,
    sampling: SamplingParams,
    out: &mut dyn Write,
    notes: &mut dyn Write,
    tty: bool,
) -> anyhow::Result<()> {
    let mut c = Conversation::new(a, tm, sampling, true, tty)?;
    let history = if a.no_history {
        None
    } else {
        // The node's state directory (--state-dir) keeps the history too, as chat_history.
        let dir = editor::state_dir(a.experts.state_dir.as_deref());
        if dir.is_none() {
            tracing::warn!(
                "no state directory (neither HOME nor XDG_STATE_HOME is set): the chat history \
                 is kept for this session only; give --state-dir to keep it"
            );
        }
        dir.map(|d| d.join(editor::HISTORY_FILE))
    };
    let mut ed = editor::LineEditor::new(history)?;
    let interrupt = editor::Interrupt::install()?;
    // Ctrl-C also stops a prompt being computed, between layers.
    c.sess.set_interrupt(Some(interrupt.shared()));
    c.banner(notes)?;
    c.session_note(notes)?;
    writeln!(
        notes,
        "End a line with \\ to continue the message on the next; Ctrl-C stops a reply (or a \
         long prompt)."
    )?;
    loop {
        let line = match ed.read("> ")? {
            editor::Input::Eof => break,
            editor::Input::Interrupted => continue,
            editor::Input::Line(l) => l,
        };
        ed.remember(&line);
        interrupt.clear();
        let flow = c.line(&line, out, notes, Some(interrupt.flag()))?;
        interrupt.clear();
        if flow == Flow::Quit {
            break;
        }
    }
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn try_sampling(argv: &[&str]) -> Result<SamplingArgs, clap::Error> {
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            s: SamplingArgs,
        }
        let mut all = vec!["x"];
        all.extend_from_slice(argv);
        <Wrap as clap::Parser>::try_parse_from(all).map(|w| w.s)
    }

    fn sampling(argv: &[&str]) -> SamplingArgs {
        try_sampling(argv).expect("sampling options parse")
    }

    /// An option given wins over the model's generation_config.json, which wins over
    /// stormo's own default.
    #[test]
    fn options_then_the_models_defaults_then_stormos() {
        let qwen = SamplingDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            repetition_penalty: None,
        };
        let p = sampling(&[]).params_with(&qwen, 0.7).expect("valid");
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.repetition_penalty),
            (0.6, 0.95, 20, 1.0)
        );
        let p = sampling(&["--temperature", "0", "--top-k", "5"])
            .params_with(&qwen, 0.7)
            .expect("valid");
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.0, 0.95, 5));
        let p = sampling(&[])
            .params_with(&SamplingDefaults::default(), 0.7)
            .expect("valid");
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.7, 1.0, 0));
        // Out of range: refused when parsed, naming the flag; from the model's defaults,
        // refused when the settings are made.
        let e = try_sampling(&["--top-p", "2"]).unwrap_err().to_string();
        assert!(e.contains("--top-p") && e.contains("(0, 1]"), "{e}");
        let bad = SamplingDefaults {
            top_p: Some(2.0),
            ..qwen
        };
        assert!(sampling(&[]).params_with(&bad, 0.7).is_err());
    }

    /// Issue: `/quit now` and `/reset now` went to the model as messages. A command name
    /// with or without an argument is a command (the chat then says when it takes none); a
    /// line that starts with a space, or whose first word is a path, is a message.
    #[test]
    fn a_command_with_an_argument_is_still_a_command() {
        let cmd = |name, arg| Some(Command { name, arg });
        assert_eq!(Command::of("/quit"), cmd("/quit", None));
        assert_eq!(Command::of("/quit now "), cmd("/quit", Some("now")));
        assert_eq!(Command::of("/reset\tnow"), cmd("/reset", Some("now")));
        assert_eq!(
            Command::of("/save  a b.json"),
            cmd("/save", Some("a b.json"))
        );
        assert_eq!(Command::of("/bogus now"), cmd("/bogus", Some("now")));
        assert_eq!(Command::of("/? x"), cmd("/?", Some("x")));
        assert_eq!(Command::of("/etc/hosts"), cmd("/etc/hosts", None));
        assert_eq!(Command::of("/etc/hosts is what?"), None);
        assert_eq!(Command::of(" /quit now"), None);
        assert_eq!(Command::of("quit"), None);
        assert_eq!(Command::of(""), None);
    }

    /// A resumed chat samples as its file was saved; each option given again takes over,
    /// `--seed 0` included (not taken for "no seed given").
    #[test]
    fn a_resumed_chat_samples_as_saved_unless_told_otherwise() {
        let saved = persist::SavedSampling {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 7,
            repetition_penalty: 1.1,
            seed: 3,
        };
        let p = resumed_sampling(&sampling(&[]), &saved).expect("valid");
        assert_eq!(persist::SavedSampling::from(&p), saved);
        let p = resumed_sampling(&sampling(&["--seed", "0", "--temperature", "0"]), &saved)
            .expect("valid");
        assert_eq!((p.temperature, p.seed, p.top_k), (0.0, 0, 7));
        let damaged = persist::SavedSampling {
            top_p: 2.0,
            ..saved
        };
        assert!(resumed_sampling(&sampling(&[]), &damaged).is_err());
    }
}
