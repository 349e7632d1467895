//! A model loaded for text: the weights on a [`Node`], its tokenizer and chat format. What
//! `run`, `chat` and the HTTP API share; the checks that cost no loading come first, on the
//! model folder opened once ([`crate::node::open_model`]: config.json is parsed there only).

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use stormo_engine::{LoadOptions, Model, ModelFiles};
use stormo_text::{ChatFormat, Tokenizer};

use crate::config::NodeConfig;
use crate::experts::Experts;
use crate::node::{Host, Node};

/// Refuses a tokenizer that can give ids the model has no embedding for (`vocab`, the
/// model's vocab_size): caught at load instead of failing every request that meets one.
pub fn check_tokenizer_fits(tok: &Tokenizer, vocab: usize, dir: &Path) -> anyhow::Result<()> {
    let ids = tok.vocab_size();
    if ids > vocab {
        bail!(
            "the tokenizer in {} has token ids up to {}, beyond the model's vocabulary of \
             {vocab} (vocab_size in config.json): it is not this model's tokenizer",
            dir.display(),
            ids - 1
        );
    }
    Ok(())
}

/// Loads `dir/tokenizer.json`, naming the file when it is missing.
pub fn load_tokenizer(dir: &Path) -> anyhow::Result<Arc<Tokenizer>> {
    // A wrong model folder is the likelier mistake than a missing tokenizer: name it first.
    if !dir.join("config.json").is_file() {
        stormo_engine::ModelConfig::from_dir(dir).map_err(|e| crate::node::in_model(e, dir))?;
    }
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        bail!(
            "no tokenizer at {}: text prompts need the model folder's tokenizer.json (as \
             published with the model); without it, only `stormo run --prompt-ids` works \
             (prompts as token ids)",
            path.display()
        );
    }
    let t0 = std::time::Instant::now();
    let tok = Tokenizer::from_file(&path)
        .with_context(|| format!("loading the tokenizer {}", path.display()))?;
    tracing::info!(
        "tokenizer {} loaded in {:.2} s",
        path.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(Arc::new(tok))
}

/// A model loaded for text: weights, tokenizer, chat format, and the node serving its experts.
#[derive(Debug)]
pub struct TextModel {
    /// The model.
    pub model: Arc<Model>,
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Its chat format.
    pub format: ChatFormat,
    /// Where its experts come from (the node's cache and tiers).
    pub experts: Arc<Experts>,
    /// The node the model runs on (its runtime, tiers and peers).
    pub node: Arc<Node>,
    /// A name for it (the folder's name).
    pub name: String,
}

/// Loads the model of `cfg` for text on a new node built from `cfg`, on a host of its own:
/// see [`load_text_model_on`].
pub fn load_text_model(cfg: NodeConfig, load: &LoadOptions) -> anyhow::Result<TextModel> {
    let files = crate::node::open_model(&cfg.model)?;
    load_text_model_on(cfg, Host::new()?, files, load)
}

/// Loads the model `files` (opened once from `cfg.model`, [`crate::node::open_model`]) for
/// text: the tokenizer first (a missing one is the quickest error), then the node built from
/// `cfg` on `host`, then the weights.
pub fn load_text_model_on(
    cfg: NodeConfig,
    host: Host,
    files: ModelFiles,
    load: &LoadOptions,
) -> anyhow::Result<TextModel> {
    let (tokenizer, format) = check_text_model(&files, cfg.context, load)?;
    let node = Arc::new(Node::start_on(cfg, host, files)?);
    text_model_on(node, tokenizer, format, load)
}

/// The checks of a model folder for text that cost no loading: the tokenizer (it must fit the
/// model's vocabulary), the chat format, the context. `files`: the model, opened
/// ([`crate::node::open_model`]). Returns the tokenizer and the format.
pub fn check_text_model(
    files: &ModelFiles,
    context: usize,
    load: &LoadOptions,
) -> anyhow::Result<(Arc<Tokenizer>, ChatFormat)> {
    anyhow::ensure!(
        load.prefill_block >= 1,
        "--prefill-block must be at least 1"
    );
    // --context in chat and serve; a library caller has no option, so it is said in words.
    anyhow::ensure!(context >= 1, "the context must be at least 1 position");
    let dir = &files.dir;
    let tokenizer = load_tokenizer(dir)?;
    // Before the weights: a tokenizer from another model is the likelier mistake to name.
    let cfg = &files.cfg;
    check_tokenizer_fits(&tokenizer, cfg.vocab_size, dir)?;
    let max = cfg.max_position_embeddings;
    if context > max {
        bail!("a context of {context} positions is more than the model's context of {max} (max_position_embeddings)");
    }
    let format = ChatFormat::for_family(cfg.family, tokenizer.clone())
        .with_context(|| format!("the tokenizer in {} does not fit the model", dir.display()))?;
    Ok((tokenizer, format))
}

/// The text model over `node`'s experts, with `tokenizer` and `format` from
/// [`check_text_model`].
pub fn text_model_on(
    node: Arc<Node>,
    tokenizer: Arc<Tokenizer>,
    format: ChatFormat,
    load: &LoadOptions,
) -> anyhow::Result<TextModel> {
    let model = node.load_model(load)?;
    let dir = &node.config().model;
    let name = std::fs::canonicalize(dir)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "stormo".into());
    Ok(TextModel {
        model: Arc::new(model),
        tokenizer,
        format,
        experts: node.experts().clone(),
        node,
        name,
    })
}
