//! `stormo run`: generation from a text prompt (rendered through the model's chat format,
//! streamed as text) or from prompt token ids (printing ids); greedy unless sampling options
//! are given (or, for a text prompt, the model's generation_config.json recommends them).
//!
//! Text and ids go to stdout as each token is made, flushed, so an error partway (a peer gone
//! mid-generation) leaves what was generated on stdout; with --json the one object comes at
//! the end, and after such an error it holds the ids so far and the error.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use stormo_engine::generate::{greedy, greedy_ids, sampled, sampled_ids, Timings};
use stormo_engine::safetensors::{self, Dtype};
use stormo_engine::sampling::{Sampler, SamplingParams};
use stormo_engine::{LoadOptions, Model, ModelFiles};

use crate::args::{ExpertArgs, PeerArgs};
use crate::cmd::chat::{
    load_tokenizer, reply, Printer, ReasoningDisplay, RenderArgs, Reply, SamplingArgs,
};
use stormo_node::config::{LocalExperts, NodeConfig};
use stormo_node::node::Node;
use stormo_text::reply::ReplyStream;
use stormo_text::session::{ChatSession, FinishReason, GenerateOptions};
use stormo_text::{ChatFormat, Tokenizer, Turn, TurnRole};

/// Arguments of `stormo run`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_ids", "prompt_ids_file"])))]
pub struct Args {
    /// The model directory (config.json and safetensors, as published on Hugging Face).
    #[arg(short, long, value_name = "DIR")]
    pub model: PathBuf,
    /// The prompt as text: sent as one user turn through the model's chat format (Harmony
    /// for GPT-OSS, ChatML for Qwen3), the reply streamed to stdout. Needs DIR/tokenizer.json.
    #[arg(short, long, value_name = "TEXT", allow_hyphen_values = true)]
    pub prompt: Option<String>,
    /// With --prompt: use the text as it is, without the chat template.
    #[arg(long, requires = "prompt")]
    pub raw: bool,
    /// With --prompt: how it is rendered and the reasoning shown.
    #[command(flatten)]
    pub render: RenderArgs,
    /// Sampling, for text and token-id prompts alike (greedy unless --temperature is given).
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Prompt token ids, separated by commas or whitespace (e.g. "1,2,3").
    #[arg(long, value_name = "IDS", allow_hyphen_values = true)]
    pub prompt_ids: Option<String>,
    /// Read the prompt token ids from a file (separated by commas or whitespace).
    #[arg(long, value_name = "FILE")]
    pub prompt_ids_file: Option<PathBuf>,
    /// How many tokens to generate.
    #[arg(short = 'n', long, default_value_t = 16, value_name = "N",
          allow_negative_numbers = true, value_parser = crate::args::count_arg)]
    pub max_new_tokens: usize,
    /// Stop early when the model emits one of config.json's eos_token_id (with --prompt the
    /// chat format's stop tokens always stop; with --raw these ids do).
    #[arg(long)]
    pub stop_at_eos: bool,
    /// Print one JSON object on stdout instead of bare ids or streamed text: generated_ids,
    /// prompt_ids, prompt_tokens, finish_reason ("stop": a stop or end-of-sequence id ended
    /// it, the last id; "length": --max-new-tokens), timings and experts, and with --prompt
    /// text and reasoning. After an error partway: what was made, finish_reason "error" and
    /// the error; after one before generation began: finish_reason "error" and the error.
    #[arg(long)]
    pub json: bool,
    /// Lab switch (hidden; docs/performance.md): write the logits that chose each generated
    /// token to this safetensors file, as one f32 tensor "logits" of shape [generated, vocab].
    #[arg(long, hide = true, value_name = "FILE", conflicts_with = "prompt")]
    pub logits_out: Option<PathBuf>,
    /// Lab switch (hidden): positions per prefill block: the prompt runs through each layer in
    /// blocks this long, every expert once per block for all positions that chose it.
    #[arg(long, hide = true, default_value_t = 128, value_name = "N")]
    pub prefill_block: usize,
    /// Lab switch (hidden): run attention projections and the output head from 8-bit
    /// row-scaled copies made at load: about a third fewer bytes per decoded token on GPT-OSS,
    /// approximate (the exact path is the default; docs/design.md gives the measured
    /// agreement).
    #[arg(long, hide = true)]
    pub int8_attn_head: bool,
    /// Lab switch (hidden): multiply MXFP4 experts by inputs rounded to int8 in blocks of 32 (integer products,
    /// AVX-512 VNNI where the CPU has it; fewer instructions per weight than the exact path,
    /// which matters where the expert kernel, not memory, is the limit, as in prefill; the
    /// same bits on every CPU). Lab switch (hidden); approximate (the exact path is the
    /// default; docs/design.md gives the measured agreement, docs/performance.md the speeds).
    #[arg(long, hide = true)]
    pub int8_experts: bool,
    /// Compute every row of the exact output head for each token. By default an 8-bit copy
    /// of the head made at load finds the few rows that can hold the largest logit (or, when
    /// sampling, that can matter to the draw) and only those are computed exactly: the same
    /// tokens, bit for bit, with about half the head's bytes read per token (the copy
    /// replaces the bf16 head in memory). Lab switch (hidden).
    #[arg(long, hide = true)]
    pub full_head: bool,
    /// Print expert statistics (hits, loads, waits, prefetch) on stderr.
    #[arg(long)]
    pub stats: bool,
    /// Where experts come from.
    #[command(flatten)]
    pub experts: ExpertArgs,
    /// Peers below the disk (the network tier).
    #[command(flatten)]
    pub net: PeerArgs,
    /// Swarm membership and discovery (peers found by themselves instead of --peer).
    #[command(flatten)]
    pub swarm: crate::swarm_args::SwarmArgs,
    /// Use no local experts: every expert comes from peers (--peer, or found with
    /// --discover; the node holds only the dense weights, routers and the manifest).
    #[arg(long)]
    pub no_local_experts: bool,
    /// Use only these local experts: `0-15` (the same experts in every layer), per layer
    /// `0:0-7,1:8-15` (layers not named: none), or `all`; the others come from peers.
    #[arg(long, value_name = "SPEC", conflicts_with = "no_local_experts")]
    pub only_experts: Option<String>,
}

/// Parses token ids separated by commas and/or whitespace. An empty item between commas
/// (`1,,2`, or a comma first) is refused, as `bench --prompt-tokens` refuses one; a comma
/// at the end is allowed.
pub fn parse_ids(text: &str, what: &str) -> anyhow::Result<Vec<u32>> {
    if text
        .split(|c: char| c == ',' || c.is_whitespace())
        .all(str::is_empty)
    {
        bail!("{what}: no token ids given");
    }
    let mut out = Vec::new();
    let parts: Vec<&str> = text.split(',').collect();
    for (k, part) in parts.iter().enumerate() {
        let last = k + 1 == parts.len();
        if part.trim().is_empty() && parts.len() > 1 && !last {
            bail!(
                "{what}: an empty item {} (two commas in a row, or a comma first)",
                if out.is_empty() {
                    "at the start".to_string()
                } else {
                    format!("after item {}", out.len())
                }
            );
        }
        for tok in part.split_whitespace() {
            let id: u32 = tok.parse().with_context(|| {
                format!(
                    "{what}: item {} ({tok:?}) is not a token id (a non-negative integer)",
                    out.len() + 1
                )
            })?;
            out.push(id);
        }
    }
    if out.is_empty() {
        bail!("{what}: no token ids given");
    }
    Ok(out)
}

/// A text prompt, tokenized: the ids and how to read the reply.
struct TextPrompt {
    tokenizer: Arc<Tokenizer>,
    format: Option<ChatFormat>,
}

/// Whether `stormo run` keeps a screen of the head: unless --full-head or logits are
/// written. Greedy and sampled tokens alike go through it (sampling draws exactly the whole
/// head's token, see `stormo_engine::sampling`).
fn screened_head(a: &Args) -> bool {
    !a.full_head && a.logits_out.is_none()
}

/// Refuses an output file that would overwrite part of the model in `model_dir` (the
/// folder itself, a file in it, or a file one of its entries links to), or that is a
/// folder; checked before the model runs, so a mistyped path costs neither the generation
/// nor the checkpoint.
pub(crate) fn check_output_file(out: &Path, model_dir: &Path, flag: &str) -> anyhow::Result<()> {
    if out.is_dir() {
        bail!("{flag} {} is a folder; give a file name", out.display());
    }
    let Ok(model) = model_dir.canonicalize() else {
        // The model's own loading reports a missing folder.
        return Ok(());
    };
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = parent
        .canonicalize()
        .with_context(|| format!("{flag} {}: its folder", out.display()))?;
    if parent.starts_with(&model) {
        bail!(
            "{flag} {} is inside the model folder {}: write it elsewhere (it could overwrite the checkpoint)",
            out.display(),
            model_dir.display()
        );
    }
    if let Ok(target) = out.canonicalize() {
        let entries = std::fs::read_dir(&model)
            .with_context(|| format!("listing {}", model_dir.display()))?;
        for e in entries.flatten() {
            if e.path().canonicalize().is_ok_and(|p| p == target) {
                bail!(
                    "{flag} {} is the model's file {}: write it elsewhere",
                    out.display(),
                    e.path().display()
                );
            }
        }
    }
    Ok(())
}

/// Runs `stormo run`: the prompt read and checked, a node started, the model loaded, then a
/// text reply (`run_text`) or bare ids (`run_ids`).
pub fn run(a: Args) -> anyhow::Result<()> {
    let json = a.json;
    let r = run_args(a);
    if let Err(e) = &r {
        // With --json a failure is one object too: the partial one once generation began
        // (printed where it failed), else the error alone.
        if json && !PARTIAL_PRINTED.load(std::sync::atomic::Ordering::Relaxed) {
            print_partial_json(serde_json::json!({ "finish_reason": "error" }), e);
        }
    }
    r
}

/// Whether [`print_partial_json`] has printed the run's object.
static PARTIAL_PRINTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn run_args(a: Args) -> anyhow::Result<()> {
    let _ = STARTED.set(std::time::Instant::now());
    // First: the tokenizer and the probes use the pool whose size this sets.
    stormo_node::config::start_engine_threads(a.experts.threads)?;
    // The model's description, read once: the prompt's checks, the context's and the node
    // take it.
    let files = stormo_node::node::open_model(&a.model)?;
    let (prompt, text) = read_prompt(&a, &files.cfg)?;
    check_args(&a)?;
    // Checked before the model loads, so a bad setting costs no time.
    // A text prompt takes the model's recommended sampling (its generation_config.json) for
    // the options not given; token ids stay greedy unless asked (they are for exact runs).
    let defaults = if a.prompt.is_some() {
        stormo_text::defaults::SamplingDefaults::from_dir(&a.model)
    } else {
        Default::default()
    };
    let sampling = a.sampling.params_with(&defaults, 0.0)?;
    a.sampling.warn_unused(&sampling);
    let context = context_for(&a, &files.cfg, prompt.len())?;
    let node = start_node(&a, context, files)?;
    node.wait_for_coverage(a.net.wait_coverage());
    let model = node.load_model(&LoadOptions {
        prefill_block: a.prefill_block,
        int8_attn_head: a.int8_attn_head,
        int8_experts: a.int8_experts,
        screened_head: screened_head(&a),
    })?;
    match text {
        Some(tp) => run_text(&a, &node, model, &tp, &prompt, context, sampling),
        None => run_ids(&a, &node, &model, &prompt, context, sampling),
    }
}

/// Warns when a render option was given with a prompt of token ids, which are used as they
/// are (no chat format to render them through).
fn warn_render_unused(a: &Args) {
    if a.render.reasoning_effort != "medium" || a.render.no_thinking {
        eprintln!(
            "warning: --reasoning-effort applies to --prompt (rendered through the chat \
             format); token ids are used as given"
        );
    }
}

/// The prompt's ids, from --prompt (through the chat format of the model configured by `cfg`
/// unless --raw; then also how to read the reply), --prompt-ids or --prompt-ids-file.
fn read_prompt(
    a: &Args,
    cfg: &stormo_engine::ModelConfig,
) -> anyhow::Result<(Vec<u32>, Option<TextPrompt>)> {
    match (&a.prompt, &a.prompt_ids, &a.prompt_ids_file) {
        (Some(t), _, _) => {
            // With the chat format an empty message still renders to tokens; refused the same
            // way in both modes (an unset shell variable is the usual cause).
            if t.is_empty() {
                bail!("--prompt is empty: give the text to answer (or --prompt-ids)");
            }
            let tokenizer = load_tokenizer(&a.model)?;
            crate::cmd::chat::check_tokenizer_fits(&tokenizer, cfg.vocab_size, &a.model)?;
            let (ids, format) = if a.raw {
                (tokenizer.encode(t, false)?, None)
            } else {
                let format =
                    ChatFormat::for_family(cfg.family, tokenizer.clone()).with_context(|| {
                        format!(
                            "the tokenizer in {} does not fit the model",
                            a.model.display()
                        )
                    })?;
                a.render.warn_for(cfg.family);
                let popts = a.render.prompt_options()?;
                let ids = format.render_prompt(&[Turn::new(TurnRole::User, t.clone())], &popts)?;
                (ids, Some(format))
            };
            if ids.is_empty() {
                bail!("--prompt: the text has no tokens");
            }
            Ok((ids, Some(TextPrompt { tokenizer, format })))
        }
        (None, Some(s), _) => {
            warn_render_unused(a);
            Ok((parse_ids(s, "--prompt-ids")?, None))
        }
        (None, None, Some(f)) => {
            // Token ids of any context that fits a model are far below 16 MiB of text; the
            // cap keeps a device or a runaway file from filling memory.
            warn_render_unused(a);
            let text = safetensors::read_small_text(f, 16 << 20)
                .with_context(|| format!("--prompt-ids-file {}", f.display()))?;
            Ok((parse_ids(&text, &f.display().to_string())?, None))
        }
        (None, None, None) => bail!("give --prompt, --prompt-ids or --prompt-ids-file"),
    }
}

/// The checks of the other options that cost no loading.
fn check_args(a: &Args) -> anyhow::Result<()> {
    if a.prefill_block == 0 {
        bail!("--prefill-block must be at least 1");
    }
    if a.raw && a.prompt.is_none() {
        bail!("--raw applies only to a text --prompt (token ids are used as they are)");
    }
    if a.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    if let Some(out) = &a.logits_out {
        check_output_file(out, &a.model, "--logits-out")?;
    }
    Ok(())
}

/// The positions the run needs (the prompt's and the new tokens'), checked against the
/// context of the model configured by `cfg`.
fn context_for(a: &Args, cfg: &stormo_engine::ModelConfig, prompt: usize) -> anyhow::Result<usize> {
    // Every token but the last new one is fed through the model and takes a position.
    // Saturating: an absurd --max-new-tokens must meet the context check below, not wrap.
    let new = a.max_new_tokens.max(1);
    let context = prompt.saturating_add(new - 1);
    if context > cfg.max_position_embeddings {
        bail!(
            "the prompt ({}) and {} need {context} positions (the prompt's and those of every \
             new token but the last, which is not fed back: {prompt} + {new} - 1), more than \
             the model's context of {} (max_position_embeddings)",
            count(prompt, "token"),
            count(new, "new token"),
            cfg.max_position_embeddings
        );
    }
    Ok(context)
}

/// The node the run's model (`files`) runs on: its tiers from the options, serving nothing.
fn start_node(a: &Args, context: usize, files: ModelFiles) -> anyhow::Result<Node> {
    // The key file is loaded once: for the certificate's check and for the node.
    let (swarm, host) =
        crate::swarm_args::resolve_identity(&a.swarm, a.net.key.as_deref())?.into_host()?;
    let cfg = NodeConfig {
        model: a.model.clone(),
        state_dir: a.experts.state_dir(),
        experts: a.experts.resolve()?,
        local: if a.no_local_experts {
            LocalExperts::None
        } else if let Some(spec) = &a.only_experts {
            LocalExperts::Only(spec.clone())
        } else {
            LocalExperts::All
        },
        context,
        peers: a.net.resolve(false)?,
        listen: None,
        swarm,
    };
    Node::start_on(cfg, host, files)
}

/// A text prompt's reply, streamed as text (or, with --json, one object at the end).
fn run_text(
    a: &Args,
    node: &Node,
    model: Model,
    tp: &TextPrompt,
    prompt: &[u32],
    context: usize,
    sampling: SamplingParams,
) -> anyhow::Result<()> {
    let cfg = model.config();
    let mut stop = match &tp.format {
        Some(f) => f.stop_tokens(),
        None => cfg.eos_token_ids.clone(),
    };
    if a.stop_at_eos {
        stop.extend_from_slice(&cfg.eos_token_ids);
    }
    let mut stream = match &tp.format {
        Some(f) => ReplyStream::chat(f),
        None => ReplyStream::plain(tp.tokenizer.clone()),
    };
    let mut sess = ChatSession::new(Arc::new(model), context)?;
    let opts = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        stop,
        sampling,
    };
    let mut printer = Printer::new(
        if a.json {
            ReasoningDisplay::Hide
        } else {
            a.render.show_reasoning
        },
        std::io::IsTerminal::is_terminal(&std::io::stdout()),
    );
    let mut out: Box<dyn Write> = if a.json {
        Box::new(std::io::sink())
    } else {
        Box::new(std::io::stdout())
    };
    let mut so_far = Reply::default();
    let generated = reply(
        &mut sess,
        &mut stream,
        prompt,
        &opts,
        &mut printer,
        &mut out,
        &mut so_far,
    );
    let g = match generated {
        Ok(g) => g,
        Err(e) => {
            if a.json {
                print_partial_json(
                    serde_json::json!({
                        "text": so_far.content,
                        "reasoning": so_far.reasoning,
                        "generated_ids": so_far.ids,
                        "prompt_ids": prompt,
                        "prompt_tokens": prompt.len(),
                        "finish_reason": "error",
                    }),
                    &e,
                );
            }
            return Err(e);
        }
    };
    let Reply {
        reasoning, content, ..
    } = so_far;
    if !a.json && content.is_empty() && reasoning.is_empty() && !g.ids.is_empty() {
        eprintln!(
            "note: the {} generated ids hold no message in the model's chat format (a \
             random-weight model's rarely do); --raw prints them as plain text, --json \
             lists them",
            g.ids.len()
        );
    }
    node.finish_run();
    let prediction = sess.engine_session().prediction();
    if a.stats {
        let t = Timings {
            prefill_s: g.prefill_s,
            decode_s: g.decode_s,
            check_wait_s: g.check_wait_s,
        };
        eprintln!("{}", speed_line(&t, prompt.len(), g.ids.len(), started()));
        eprint!("{}", node.table(prediction));
    }
    if a.json {
        let timings = Timings {
            prefill_s: g.prefill_s,
            decode_s: g.decode_s,
            check_wait_s: g.check_wait_s,
        };
        let mut out = serde_json::json!({
            "text": content,
            "reasoning": reasoning,
            "generated_ids": g.ids,
            "prompt_ids": prompt,
            "prompt_tokens": prompt.len(),
            "finish_reason": g.finish.openai(),
        });
        out["timings"] = timings_json(&timings, prompt.len(), g.ids.len());
        out["experts"] = node.json(prediction);
        println!("{out}");
    }
    Ok(())
}

/// Token-id generation: bare ids on stdout as they come (or, with --json, one object at the
/// end), greedy through the screened head unless sampling or --logits-out asks otherwise.
fn run_ids(
    a: &Args,
    node: &Node,
    model: &Model,
    prompt: &[u32],
    context: usize,
    sampling: SamplingParams,
) -> anyhow::Result<()> {
    let cfg = model.config();
    let mut sess = model.session(context)?;
    let vocab = cfg.vocab_size;
    let stop: Vec<u32> = if a.stop_at_eos {
        cfg.eos_token_ids.clone()
    } else {
        Vec::new()
    };
    let mut timings = Timings::default();
    // Bare ids are printed as they come; --json prints them at the end.
    let mut line = IdLine::new(std::io::stdout(), !a.json);
    let mut logits = a.logits_out.as_ref().map(|_| Vec::new());
    let generated = generate_ids(
        model,
        &mut sess,
        prompt,
        a.max_new_tokens,
        &stop,
        sampling,
        &mut line,
        logits.as_mut(),
        &mut timings,
    );
    let ids = match generated {
        Ok(ids) => ids,
        Err(e) => {
            // The ids made before the error are on stdout already: end their line.
            let _ = line.end();
            if a.json {
                print_partial_json(
                    serde_json::json!({
                        "generated_ids": line.ids,
                        "prompt_ids": prompt,
                        "prompt_tokens": prompt.len(),
                        "finish_reason": "error",
                    }),
                    &e,
                );
            }
            return Err(e);
        }
    };
    line.end().context("writing the generated ids to stdout")?;
    if let (Some(path), Some(logits)) = (&a.logits_out, &logits) {
        let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        safetensors::write(
            path,
            &[("logits", Dtype::F32, &[ids.len(), vocab], &bytes)],
            None,
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    node.finish_run();
    let prediction = sess.prediction();
    if a.stats {
        eprintln!(
            "{}",
            speed_line(&timings, prompt.len(), ids.len(), started())
        );
        eprint!("{}", node.table(prediction));
    }
    if a.json {
        let out = serde_json::json!({
            "generated_ids": ids,
            "prompt_ids": prompt,
            "prompt_tokens": prompt.len(),
            "finish_reason": ids_finish(&ids, &stop).openai(),
            "timings": timings_json(&timings, prompt.len(), ids.len()),
            "experts": node.json(prediction),
        });
        println!("{out}");
    }
    Ok(())
}

/// Why a token-id generation that made `ids` with `stop` ended: at a stop id (the last one),
/// or at --max-new-tokens (its context holds all of them: [`context_for`]).
fn ids_finish(ids: &[u32], stop: &[u32]) -> FinishReason {
    match ids.last() {
        Some(last) if stop.contains(last) => FinishReason::Stop,
        _ => FinishReason::Length,
    }
}

/// Generates after `prompt`, each id pushed to `line` as it comes and, when `logits` is given,
/// the logits that chose it appended there: sampled, or greedy through the whole head (logits
/// kept) or the screened one (the same ids).
#[allow(clippy::too_many_arguments)]
fn generate_ids<W: Write>(
    model: &Model,
    sess: &mut stormo_engine::Session,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    sampling: SamplingParams,
    line: &mut IdLine<W>,
    mut logits: Option<&mut Vec<f32>>,
    timings: &mut Timings,
) -> anyhow::Result<Vec<u32>> {
    if !sampling.is_plain_argmax() && logits.is_none() {
        // Through the screened head when the model keeps one: the whole head's draws
        // (stormo_engine::sampling), reading only the rows that can matter.
        let mut sampler = Sampler::new(sampling)?;
        sampled_ids(
            model,
            sess,
            prompt,
            max_new,
            stop,
            &mut sampler,
            |id| line.push(id),
            timings,
        )
    } else if !sampling.is_plain_argmax() {
        let mut sampler = Sampler::new(sampling)?;
        sampled(
            model,
            sess,
            prompt,
            max_new,
            stop,
            &mut sampler,
            |id, l| {
                line.push(id);
                if let Some(keep) = logits.as_deref_mut() {
                    keep.extend_from_slice(l)
                }
            },
            timings,
        )
    } else if let Some(keep) = logits {
        greedy(
            model,
            sess,
            prompt,
            max_new,
            stop,
            |id, l| {
                line.push(id);
                keep.extend_from_slice(l)
            },
            timings,
        )
    } else {
        // Through the screened head when the model keeps one: the same ids.
        greedy_ids(
            model,
            sess,
            prompt,
            max_new,
            stop,
            |id| line.push(id),
            timings,
        )
    }
    .map_err(anyhow::Error::from)
}

/// --json's timings of a run that made `generated` tokens after `prompt` (the first of them
/// at the end of the prefill, the others decoded).
/// When the command started (for `--stats`' wall time).
static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

fn started() -> std::time::Instant {
    *STARTED.get_or_init(std::time::Instant::now)
}

/// `--stats`' speed line, as llama-cli prints one: the prompt's and the generated tokens'
/// rates and the run's wall time (from the start of the command, loading included).
fn speed_line(t: &Timings, prompt: usize, generated: usize, started: std::time::Instant) -> String {
    let decoded = generated.saturating_sub(1);
    let tok_s = |n: usize, s: f64| format!("{:.2}", rate(n, s));
    let tokens = |n: usize| if n == 1 { "token" } else { "tokens" };
    format!(
        "prompt: {prompt} {} in {:.2} s ({} tok/s); generation: {decoded} {} after the \
         first in {:.2} s ({} tok/s); wall time {:.2} s",
        tokens(prompt),
        t.prefill_s,
        tok_s(prompt, t.prefill_s),
        tokens(decoded),
        t.decode_s,
        tok_s(decoded, t.decode_s),
        started.elapsed().as_secs_f64()
    )
}

fn timings_json(t: &Timings, prompt: usize, generated: usize) -> serde_json::Value {
    serde_json::json!({
        "prefill_s": t.prefill_s,
        "prefill_tok_s": rate(prompt, t.prefill_s),
        "decode_s": t.decode_s,
        "decode_tok_s": rate(generated.saturating_sub(1), t.decode_s),
        "check_wait_s": t.check_wait_s,
    })
}

/// Generated ids on one line of `out` as they are made: separated by spaces, flushed after
/// each, so the ids made before an error are out when it comes. With `print` false it only
/// keeps them.
struct IdLine<W: Write> {
    out: W,
    print: bool,
    /// Every id pushed.
    ids: Vec<u32>,
    /// The first write that failed; nothing more is written after it.
    failed: Option<std::io::Error>,
}

impl<W: Write> IdLine<W> {
    fn new(out: W, print: bool) -> Self {
        Self {
            out,
            print,
            ids: Vec::new(),
            failed: None,
        }
    }

    fn push(&mut self, id: u32) {
        self.ids.push(id);
        if !self.print || self.failed.is_some() {
            return;
        }
        let sep = if self.ids.len() > 1 { " " } else { "" };
        if let Err(e) = write!(self.out, "{sep}{id}").and_then(|()| self.out.flush()) {
            self.failed = Some(e);
        }
    }

    /// Ends the line, if an id was printed; returns the first write that failed.
    fn end(&mut self) -> std::io::Result<()> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        if self.print && !self.ids.is_empty() {
            writeln!(self.out)?;
            self.out.flush()?;
        }
        Ok(())
    }
}

/// Prints --json's object after an error partway (some tokens made; an error before the
/// first prints nothing, as every other error): `partial`, what was generated, with the
/// error added. Best effort: the error itself goes to stderr either way.
fn print_partial_json(mut partial: serde_json::Value, e: &anyhow::Error) {
    PARTIAL_PRINTED.store(true, std::sync::atomic::Ordering::Relaxed);
    partial["error"] = crate::cli::error_message(e).into();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{partial}").and_then(|()| out.flush());
}

/// "1 token", "2 tokens".
pub(crate) fn count(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_read_by_commas_and_whitespace_and_an_empty_item_is_refused() {
        for ok in ["1,2,3", "1, 2, 3", "1 2\n3\n", "1,2,3,", " 1 ,2 , 3 "] {
            assert_eq!(parse_ids(ok, "ids").expect(ok), [1, 2, 3], "{ok:?}");
        }
        let err = |t: &str| format!("{:#}", parse_ids(t, "--prompt-ids").expect_err(t));
        assert!(
            err("1,,2").contains("empty item after item 1"),
            "{}",
            err("1,,2")
        );
        assert!(err(",1").contains("at the start"), "{}", err(",1"));
        assert!(err("1, ,2").contains("empty item"), "{}", err("1, ,2"));
        assert!(err("1,x").contains("item 2 (\"x\")"), "{}", err("1,x"));
        assert!(err(" ").contains("no token ids"), "{}", err(" "));
        assert!(err("-1").contains("non-negative"), "{}", err("-1"));
    }

    #[test]
    fn id_line_is_the_ids_joined_by_spaces_as_they_come() {
        let mut line = IdLine::new(Vec::new(), true);
        line.end().unwrap();
        assert!(line.out.is_empty(), "no ids, no line");
        for id in [7, 0, 2047] {
            line.push(id);
        }
        assert_eq!(line.out, b"7 0 2047", "printed before the end");
        line.end().unwrap();
        assert_eq!(line.out, b"7 0 2047\n");
        let mut kept = IdLine::new(Vec::new(), false);
        kept.push(3);
        kept.end().unwrap();
        assert!(kept.out.is_empty());
        assert_eq!(kept.ids, [3]);
    }

    /// `run --json` with token ids says why it ended, as a text prompt does.
    #[test]
    fn id_runs_finish_at_a_stop_id_or_the_length() {
        assert_eq!(ids_finish(&[5, 9], &[9]), FinishReason::Stop);
        assert_eq!(ids_finish(&[9, 5], &[9]), FinishReason::Length);
        assert_eq!(ids_finish(&[5, 9], &[]), FinishReason::Length);
        assert_eq!(count(1, "token"), "1 token");
        assert_eq!(count(2, "new token"), "2 new tokens");
    }

    #[test]
    fn output_file_may_not_overwrite_the_model() {
        let root = tempfile::tempdir().unwrap();
        let model = root.path().join("model");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(model.join("model.safetensors"), b"weights").unwrap();
        let elsewhere = root.path().join("logits.safetensors");
        check_output_file(&elsewhere, &model, "--logits-out").unwrap();
        // Existing outputs elsewhere may be replaced.
        std::fs::write(&elsewhere, b"old logits").unwrap();
        check_output_file(&elsewhere, &model, "--logits-out").unwrap();
        for bad in [
            model.join("model.safetensors"),
            model.join("new.safetensors"),
            model.join("sub/../x.bin"),
            model.clone(),
            root.path().to_path_buf(),
        ] {
            let e = check_output_file(&bad, &model, "--logits-out").unwrap_err();
            assert!(e.to_string().contains("--logits-out"), "{e}");
        }
        // A link elsewhere that points at a model file is the model file.
        #[cfg(unix)]
        {
            let link = root.path().join("link.safetensors");
            std::os::unix::fs::symlink(model.join("model.safetensors"), &link).unwrap();
            let e = check_output_file(&link, &model, "--logits-out").unwrap_err();
            assert!(e.to_string().contains("model's file"), "{e}");
        }
        assert_eq!(
            std::fs::read(model.join("model.safetensors")).unwrap(),
            b"weights"
        );
    }
}
