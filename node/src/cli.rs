//! The command line: one subcommand per file in `cmd/`.

use clap::{Parser, Subcommand};

use crate::cmd;

/// Mixture-of-Experts models (GPT-OSS, Qwen3-MoE) on CPUs, experts from RAM, disk or verified
/// peers.
#[derive(Debug, Parser)]
#[command(name = "stormo", version, propagate_version = true)]
pub struct Cli {
    /// More logging on stderr (-v info, -vv debug). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// A node config file (TOML) holding what the flags hold.
    ///
    /// Keys are the long option names (`model = "/m"`, `peer = ["KEY@HOST:PORT"]`,
    /// `allow-any = true`). Every option can also come from a `STORMO_<OPTION>` variable (lists
    /// comma-separated); flags override variables, which override the file.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The command line as clap sees it: every option that takes a value accepts a negative
    /// number as that value (`--max-new-tokens -1` is then refused for its value, "invalid
    /// digit", rather than as an unknown argument `-1` that leaves the user guessing), and
    /// every long option can come from a `STORMO_*` variable.
    pub fn command_line() -> clap::Command {
        fn adjust(c: clap::Command) -> clap::Command {
            c.mut_args(|a| {
                let a = if a.get_action().takes_values() && !a.is_positional() {
                    a.allow_negative_numbers(true)
                } else {
                    a
                };
                env_for(a)
            })
            .mut_subcommands(adjust)
        }
        adjust(<Self as clap::CommandFactory>::command())
    }

    /// Parses the process's arguments with [`Cli::command_line`]; exits with clap's message
    /// (and usage error code) on a bad one, as `Parser::parse` does.
    pub fn parse_args() -> Self {
        Self::try_parse_args(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// [`Cli::parse_args`] over `args` (the program name first), returning clap's error. A
    /// config file (`--config FILE` or `STORMO_CONFIG`) gives the defaults of the options it
    /// names.
    pub fn try_parse_args<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
        let mut cmd = Self::command_line();
        let mut file = None;
        if let Some(path) = crate::config_file::named(&args) {
            let f = crate::config_file::ConfigFile::read(&path)
                .map_err(|e| clap::Error::raw(clap::error::ErrorKind::Io, format!("{e:#}\n")))?;
            cmd = f.apply(cmd).map_err(|e| {
                clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!("{e:#}\n"))
            })?;
            file = Some(f);
        }
        if let Some(flag) = gpu_layers_flag(&args) {
            return Err(cmd.error(
                clap::error::ErrorKind::UnknownArgument,
                format!(
                    "{flag} (llama.cpp's GPU layers) is not a stormo option: stormo runs on \
                     CPUs and has no layers to offload to a GPU; leave it out (stormo's -n is \
                     --max-new-tokens, so -ngl would read as `-n gl`)"
                ),
            ));
        }
        let m = cmd
            .try_get_matches_from_mut(old_sim_spelling(args.clone()))
            .map_err(|e| {
                attribute(e, &cmd, &args, file.as_ref(), |n| {
                    std::env::var_os(n).is_some_and(|v| !v.is_empty())
                })
            })?;
        if let Some(e) = no_keep_with_a_limit(&mut cmd, &m) {
            return Err(e);
        }
        <Self as clap::FromArgMatches>::from_arg_matches(&m).map_err(|e| e.format(&mut cmd))
    }
}

/// A usage error when `--no-keep` and `--expert-dir-limit` are both on the command line:
/// keeping nothing and bounding what is kept contradict each other, as `--no-keep` and
/// `--expert-dir` do (a clap conflict). `--no-keep` still wins, silently, over a limit from a
/// `STORMO_*` variable or the config file (its help says so), so this is checked here, on
/// where the values came from, rather than declared as a conflict, which clap would also
/// raise for a variable.
fn no_keep_with_a_limit(cmd: &mut clap::Command, m: &clap::ArgMatches) -> Option<clap::Error> {
    use clap::parser::ValueSource;
    let (name, sub) = m.subcommand()?;
    let on_line = |id: &str| {
        sub.ids().any(|i| i == id) && sub.value_source(id) == Some(ValueSource::CommandLine)
    };
    if !(on_line("no_keep") && on_line("expert_dir_limit")) {
        return no_keep_with_a_limit(cmd.find_subcommand_mut(name)?, sub);
    }
    let sub_cmd = cmd.find_subcommand_mut(name)?;
    Some(sub_cmd.error(
        clap::error::ErrorKind::ArgumentConflict,
        "--no-keep and --expert-dir-limit are both given: --no-keep keeps no experts, so there \
         is nothing for a limit to bound; give one of them (--no-keep wins over a limit from \
         STORMO_EXPERT_DIR_LIMIT or a config file)",
    ))
}

/// `e` saying where the value it refuses came from, when that is not the command line
/// (`args`): the option's `STORMO_*` variable (`is_set` says which are set), else the config
/// file. clap names only the option, so without this a bad `threads = 0` in a file reads as a
/// bad `--threads` that is nowhere on the command line.
fn attribute(
    e: clap::Error,
    cmd: &clap::Command,
    args: &[std::ffi::OsString],
    file: Option<&crate::config_file::ConfigFile>,
    is_set: impl Fn(&str) -> bool,
) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        e.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return e;
    }
    let Some(ContextValue::String(shown)) = e.get(ContextKind::InvalidArg) else {
        return e;
    };
    // clap shows the option as "--threads <N>".
    let Some(long) = shown
        .strip_prefix("--")
        .and_then(|a| a.split([' ', '=']).next())
    else {
        return e;
    };
    let Some(a) = find_arg(cmd, long) else {
        return e;
    };
    let on_line = args
        .iter()
        .skip(1)
        .map(|x| x.to_string_lossy())
        .take_while(|x| x != "--")
        .any(|x| {
            let long = crate::config_file::names(a)
                .any(|n| x == format!("--{n}") || x.starts_with(&format!("--{n}=")));
            let short = a
                .get_short()
                .is_some_and(|c| x.starts_with('-') && !x.starts_with("--") && x[1..].contains(c));
            long || short
        });
    if on_line {
        return e;
    }
    let env = a
        .get_env()
        .map(|v| v.to_string_lossy().into_owned())
        .filter(|n| is_set(n));
    let from = match (env, file) {
        (Some(env), _) => env,
        (None, Some(f)) if crate::config_file::names(a).any(|n| f.has(n)) => {
            format!("--config {}", f.path().display())
        }
        _ => return e,
    };
    let text = e.to_string().replacen(
        &format!("'{shown}'"),
        &format!("'{shown}' (from {from})"),
        1,
    );
    clap::Error::raw(e.kind(), text.strip_prefix("error: ").unwrap_or(&text))
}

/// The option of long name `long` in `c` or its subcommands.
fn find_arg<'a>(c: &'a clap::Command, long: &str) -> Option<&'a clap::Arg> {
    c.get_arguments()
        .find(|a| a.get_long() == Some(long))
        .or_else(|| c.get_subcommands().find_map(|s| find_arg(s, long)))
}

/// The variable an option of this long name is read from: `STORMO_<LONG NAME>`, dashes as
/// underscores.
fn env_name(long: &str) -> String {
    format!("STORMO_{}", long.to_uppercase().replace('-', "_"))
}

/// `a` also read from `STORMO_<LONG NAME>` (dashes as underscores), lists split at commas;
/// help, version and counted flags excepted. A renamed option is also read from its old
/// name's variable (its hidden alias's) when the new one is not set.
fn env_for(a: clap::Arg) -> clap::Arg {
    let Some(long) = a.get_long() else {
        return a;
    };
    if matches!(
        a.get_action(),
        clap::ArgAction::Help
            | clap::ArgAction::HelpShort
            | clap::ArgAction::HelpLong
            | clap::ArgAction::Version
            | clap::ArgAction::Count
    ) || a.get_env().is_some()
        || long == "config"
    {
        return a;
    }
    let name = env_var_of(&a, long, |n| std::env::var_os(n).is_some());
    let list =
        matches!(a.get_action(), clap::ArgAction::Append) && a.get_value_delimiter().is_none();
    let a = a.env(name).hide_env(true);
    if list {
        a.value_delimiter(',')
    } else {
        a
    }
}

/// The variable `a` (long name `long`) is read from: its own, unless that is not set and the
/// variable of one of its aliases is (`is_set` says which are).
fn env_var_of(a: &clap::Arg, long: &str, is_set: impl Fn(&str) -> bool) -> String {
    let name = env_name(long);
    if is_set(&name) {
        return name;
    }
    a.get_all_aliases()
        .into_iter()
        .flatten()
        .map(env_name)
        .find(|n| is_set(n))
        .unwrap_or(name)
}

/// llama.cpp's GPU-layer flag among `args`, if one is there (before any `--`): `-ngl`,
/// `--n-gpu-layers` or `--gpu-layers`, alone or with `=N`. clap would read `-ngl 99` as
/// `-n gl` and complain about the value, which helps nobody.
fn gpu_layers_flag(args: &[std::ffi::OsString]) -> Option<String> {
    args.iter()
        .skip(1)
        .map(|a| a.to_string_lossy())
        .take_while(|a| a != "--")
        .find_map(|a| {
            let flag = a.split('=').next().unwrap_or_default();
            let gpu = flag == "-ngl"
                || flag == "--n-gpu-layers"
                || flag == "--gpu-layers"
                || (flag.starts_with("-ngl") && flag[4..].bytes().all(|b| b.is_ascii_digit()));
            gpu.then(|| flag.to_string())
        })
}

/// The arguments with the simulator's old spelling `stormo swarm --scenario ...` (from before
/// `swarm` named the membership commands) turned into `stormo sim --scenario ...`: a hidden
/// alias, so scripts written for it keep working without `swarm --help` listing the
/// simulator's options.
fn old_sim_spelling<I, T>(args: I) -> Vec<std::ffi::OsString>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let mut args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    // The subcommand is the first word after the program name that is neither a flag nor
    // the value of the one global flag that takes one (--config FILE).
    let mut at = None;
    let mut i = 1;
    while i < args.len() {
        let a = args[i].to_string_lossy();
        if a == "--config" {
            i += 2;
            continue;
        }
        if !a.starts_with('-') {
            at = Some(i);
            break;
        }
        i += 1;
    }
    let Some(at) = at else {
        return args;
    };
    let scenario = args[at + 1..].iter().any(|a| {
        let a = a.to_string_lossy();
        a == "--scenario" || a.starts_with("--scenario=")
    });
    if args[at] == "swarm" && scenario {
        args[at] = "sim".into();
    }
    args
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate from a text prompt (through the model's chat format) or from token ids.
    Run(cmd::run::Args),
    /// Build, sign and verify a checkpoint's manifest (tensor and per-expert hashes).
    #[command(subcommand)]
    Manifest(cmd::manifest::Command),
    /// Serve experts to peers over QUIC (--listen) and/or an OpenAI-compatible HTTP API (--http).
    Serve(cmd::serve::Args),
    /// Fetch a model folder from peers, every byte verified against the manifest.
    ///
    /// The manifest, config, tokenizer and dense weights; with --with-experts, the experts too.
    Pull(cmd::pull::Args),
    /// Create and show Ed25519 node and publisher keys.
    #[command(subcommand)]
    Key(cmd::key::Command),
    /// Measure prefill and decode speed beside the machine's memory, kernel and disk bounds.
    ///
    /// With --peer, the experts come from the peers (fetched, or computed there by remote
    /// execution), then the same prompts and decode run again from the local disk at the same
    /// RAM budget and both are printed side by side (`peer_vs_disk` in --json). A peer that
    /// cannot be reached fails the run: the first run never falls back to the local experts.
    Bench(cmd::bench::Args),
    /// Write a checkpoint's experts as a flat store of 4 KiB-aligned records (one read each).
    Convert(cmd::convert::Args),
    /// Turn text into token ids with the model's tokenizer, or ids back into text.
    Tokenize(cmd::tokenize::Args),
    /// Write a random-weight checkpoint with a real model's geometry and layout.
    #[cfg(feature = "lab")]
    Synth(cmd::synth::Args),
    /// Talk with a model in the terminal (streams tokens, keeps the session between turns).
    Chat(cmd::chat::Args),
    #[cfg(feature = "lab")]
    Sim(cmd::sim::Args),
    /// Make a swarm (its owner key) and admit nodes into it (membership certificates).
    #[command(subcommand)]
    Swarm(cmd::swarm::Command),
    /// Show the whole idea in a minute: nodes on 127.0.0.1 serving a small model's experts.
    ///
    /// A small model, nodes on 127.0.0.1, a generation on a node with no experts, every
    /// expert verified.
    #[cfg(feature = "lab")]
    Demo(cmd::demo::Args),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(cmd::completions::Args),
    /// Print the manual page (roff), or write one page per command with --out.
    Man(cmd::man::Args),
}

pub use stormo_net::error_message;

/// The whole process: parses the arguments, sets up logging, runs the subcommand and prints
/// its error, if any, on one line (the `stormo` binary's `main`).
pub fn main() -> std::process::ExitCode {
    let cli = Cli::parse_args();
    crate::logging::init(cli.verbose);
    match dispatch(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader of the output went away (`stormo man | head`): done, as for any filter.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}", error_message(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Runs the chosen subcommand.
pub fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Manifest(c) => cmd::manifest::run(c),
        Command::Key(c) => cmd::key::run(c),
        Command::Pull(a) => cmd::pull::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Tokenize(a) => cmd::tokenize::run(a),
        Command::Convert(a) => cmd::convert::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        #[cfg(feature = "lab")]
        Command::Synth(a) => cmd::synth::run(a),
        Command::Chat(a) => cmd::chat::run(a),
        #[cfg(feature = "lab")]
        Command::Sim(a) => cmd::sim::run(a),
        Command::Swarm(c) => cmd::swarm::run(c),
        #[cfg(feature = "lab")]
        Command::Demo(a) => cmd::demo::run(a),
        Command::Completions(a) => cmd::completions::run(a),
        Command::Man(a) => cmd::man::run(a),
    }
}

#[cfg(test)]
mod tests {
    /// clap's own consistency checks over every subcommand (conflicting names, groups that
    /// name missing arguments, ...), which otherwise fire only when that command runs.
    #[test]
    fn command_line_definition_is_consistent() {
        super::Cli::command_line().debug_assert();
    }

    /// A negative number given to an option that takes a number is refused for its value,
    /// naming the option; a negative temperature still reaches the sampling checks.
    #[test]
    fn negative_numbers_are_values_not_unknown_arguments() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["stormo", "run", "--model", "m", "--prompt-ids", "1"];
            argv.extend_from_slice(extra);
            super::Cli::try_parse_args(argv).map_err(|e| e.to_string())
        };
        let e = parse(&["--max-new-tokens", "-1"]).unwrap_err();
        assert!(
            e.contains("invalid value '-1' for '--max-new-tokens"),
            "{e}"
        );
        let e = super::Cli::try_parse_args(["stormo", "serve", "--http-timeout", "-5"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("'--http-timeout"), "{e}");
        assert!(parse(&["--temperature", "0.5"]).is_ok());
        let e = parse(&["--temperature", "-1"]).unwrap_err();
        assert!(e.contains("invalid value '-1' for '--temperature"), "{e}");
        // Flags and words that start with a dash are still arguments.
        assert!(parse(&["--stats"]).is_ok());
        let e = parse(&["-x"]).unwrap_err();
        assert!(e.contains("unexpected argument '-x'"), "{e}");
    }

    /// A bad value that came from a `STORMO_*` variable or the config file says so; one on
    /// the command line reads as clap's own message.
    #[test]
    fn a_bad_value_names_where_it_came_from() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("node.toml");
        std::fs::write(&file, "threads = 0\nhttp-context = \"many\"\n").expect("write");
        let cfg = file.to_str().expect("utf-8");
        let e = super::Cli::try_parse_args(["stormo", "run", "--config", cfg, "--prompt-ids", "1"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "'--threads <N>' (from --config {cfg}): 0 is not in"
            )),
            "{e}"
        );
        // An alias (a renamed option's old name) is found too.
        let e = super::Cli::try_parse_args(["stormo", "serve", "--config", cfg, "--threads", "2"])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("(from --config {cfg})")), "{e}");
        assert!(e.contains("'many'"), "{e}");
        // On the command line, the file's value is overridden and the flag's is the bad one.
        for bad in [&["--threads", "x"][..], &["-t", "x"], &["--threads=x"]] {
            let mut argv = vec!["stormo", "run", "--config", cfg, "--prompt-ids", "1"];
            argv.extend_from_slice(bad);
            let e = super::Cli::try_parse_args(argv).unwrap_err().to_string();
            assert!(e.contains("invalid value 'x' for '--threads <N>':"), "{e}");
        }
        // A variable: the error is clap's for the value (here from the command line), told
        // that the line does not hold it and the variable is set.
        let cmd = super::Cli::command_line();
        let e = cmd
            .clone()
            .try_get_matches_from(["stormo", "run", "--model", "m", "--threads", "x"])
            .unwrap_err();
        let argv: Vec<std::ffi::OsString> = ["stormo", "run"].iter().map(Into::into).collect();
        let e = super::attribute(e, &cmd, &argv, None, |n| n == "STORMO_THREADS").to_string();
        assert!(e.contains("'--threads <N>' (from STORMO_THREADS)"), "{e}");
    }

    /// `stormo --help` fits a screen: at most 40 lines, none wider than 120 columns (clap
    /// does not wrap without a terminal width; the longer text is in each command's --help).
    #[test]
    fn top_level_help_fits_a_screen() {
        let help = super::Cli::command_line().render_help().to_string();
        let lines: Vec<&str> = help.lines().collect();
        assert!(lines.len() <= 40, "{} lines:\n{help}", lines.len());
        for l in &lines {
            assert!(l.chars().count() <= 120, "too wide: {l}");
        }
        for c in ["run", "serve", "completions", "man"] {
            assert!(help.contains(&format!("\n  {c} ")), "{c} missing:\n{help}");
        }
    }

    /// The congestion control a serving node uses unless told otherwise is `tolerant`, as
    /// docs/network.md and docs/performance.md say (change them with it); `--congestion cubic`
    /// opts out; the simulator's nodes follow `serve`'s default.
    #[test]
    fn serve_paces_with_the_tolerant_controller_unless_told_otherwise() {
        use super::{Cli, Command};
        use stormo_net::tls::Congestion;
        assert_eq!(Congestion::default(), Congestion::Tolerant);
        let serve = |extra: &[&str]| {
            let mut argv = vec!["stormo", "serve", "--model", "m", "--listen", "127.0.0.1:0"];
            argv.extend_from_slice(extra);
            match Cli::try_parse_args(argv).expect("parses").command {
                Command::Serve(a) => a.congestion,
                _ => panic!("not serve"),
            }
        };
        assert_eq!(serve(&[]), Congestion::Tolerant);
        assert_eq!(serve(&["--congestion", "cubic"]), Congestion::Cubic);
        assert_eq!(serve(&["--congestion", "bbr"]), Congestion::Bbr);
        assert_eq!(
            stormo_net::serve::ServeConfig::default().congestion,
            Congestion::Tolerant
        );
        #[cfg(feature = "lab")]
        match Cli::try_parse_args(["stormo", "sim", "--scenario", "wan"])
            .expect("parses")
            .command
        {
            Command::Sim(a) => assert_eq!(a.congestion, Congestion::Tolerant),
            _ => panic!("not sim"),
        }
    }

    /// `stormo swarm --scenario NAME` (the simulator's old spelling) still runs the
    /// simulator; `stormo swarm create` is the membership command.
    #[cfg(feature = "lab")]
    #[test]
    fn old_simulator_spelling_is_an_alias_of_sim() {
        use super::{Cli, Command};
        for argv in [
            &["stormo", "swarm", "--scenario", "lan4"][..],
            &["stormo", "-v", "swarm", "--json", "--scenario=churn"][..],
            &["stormo", "sim", "--scenario", "lan4"][..],
        ] {
            let c = Cli::try_parse_args(argv).expect("parses");
            assert!(matches!(c.command, Command::Sim(_)), "{argv:?}");
        }
        let c = Cli::try_parse_args(["stormo", "swarm", "create", "--out", "k"]).expect("parses");
        assert!(matches!(c.command, Command::Swarm(_)));
        let help = Cli::command_line()
            .find_subcommand_mut("swarm")
            .expect("swarm")
            .render_long_help()
            .to_string();
        assert!(!help.contains("--scenario"), "{help}");
    }

    /// Every renamed option, as (old spelling, new spelling) of one command line: the old
    /// spellings stay accepted as hidden aliases and mean what the new ones do.
    const RENAMED: &[(&[&str], &[&str])] = &[
        (
            &["key", "generate", "--out", "k"],
            &["key", "generate", "--key", "k"],
        ),
        (
            &["swarm", "create", "--out", "o"],
            &["swarm", "create", "--owner", "o"],
        ),
        (
            &[
                "swarm", "admit", "--swarm", "o", "--node", "-", "--out", "c",
            ],
            &[
                "swarm", "admit", "--owner", "o", "--node", "-", "--out", "c",
            ],
        ),
        (
            &[
                "serve",
                "--model",
                "m",
                "--http",
                "127.0.0.1:0",
                "--http-context",
                "64",
            ],
            &[
                "serve",
                "--model",
                "m",
                "--http",
                "127.0.0.1:0",
                "--context",
                "64",
            ],
        ),
        (
            &["chat", "--model", "m", "--quiet"],
            &["chat", "--model", "m", "--no-stats"],
        ),
        (
            &[
                "run",
                "--model",
                "m",
                "--prompt",
                "hi",
                "--reasoning",
                "show",
            ],
            &[
                "run",
                "--model",
                "m",
                "--prompt",
                "hi",
                "--show-reasoning",
                "show",
            ],
        ),
        (
            &["chat", "--model", "m", "--reasoning", "hide"],
            &["chat", "--model", "m", "--show-reasoning", "hide"],
        ),
    ];

    fn parsed(argv: &[&str]) -> String {
        let full: Vec<&str> = std::iter::once("stormo")
            .chain(argv.iter().copied())
            .collect();
        match super::Cli::try_parse_args(full) {
            Ok(c) => format!("{:?}", c.command),
            Err(e) => panic!("{argv:?} is refused: {e}"),
        }
    }

    /// Issue 37: each old spelling in [`RENAMED`] is accepted and parses to what its new
    /// spelling does; every alias the command line defines is listed there (so a rename
    /// cannot drop one unnoticed), and none shows in any `--help`.
    #[test]
    fn renamed_options_keep_their_old_spelling() {
        for (old, new) in RENAMED {
            assert_eq!(parsed(old), parsed(new), "{old:?} vs {new:?}");
        }
        let mut aliases = Vec::new();
        fn walk(c: &clap::Command, path: String, out: &mut Vec<(String, String)>) {
            for a in c.get_arguments() {
                // Visible aliases are second spellings on purpose (`--served-model-name`,
                // vLLM's, beside `--alias`), shown in --help; hidden ones are old spellings.
                let visible: Vec<&str> = a.get_visible_aliases().unwrap_or_default();
                for al in a.get_all_aliases().into_iter().flatten() {
                    if !visible.contains(&al) {
                        out.push((path.clone(), al.to_string()));
                    }
                }
            }
            for s in c.get_subcommands() {
                walk(s, format!("{path} {}", s.get_name()), out);
            }
        }
        let cmd = super::Cli::command_line();
        walk(&cmd, String::new(), &mut aliases);
        assert!(!aliases.is_empty());
        for (path, alias) in &aliases {
            let words: Vec<&str> = path.split_whitespace().collect();
            let listed = RENAMED.iter().any(|(old, _)| {
                old.starts_with(&words) && old.contains(&format!("--{alias}").as_str())
            });
            assert!(listed, "`stormo{path} --{alias}` is not in RENAMED");
            let mut c = super::Cli::command_line();
            let mut sub = &mut c;
            for w in &words {
                sub = sub.find_subcommand_mut(w).expect("subcommand");
            }
            let help = sub.render_long_help().to_string();
            assert!(
                !help.contains(&format!("--{alias} ")),
                "{path}: --{alias} shown:\n{help}"
            );
        }
        // The old flag for thinking off is the new value `none`.
        let popts = |argv: &[&str]| {
            let full: Vec<&str> = std::iter::once("stormo")
                .chain(argv.iter().copied())
                .collect();
            let c = super::Cli::try_parse_args(full).expect("parses");
            let super::Command::Chat(a) = c.command else {
                panic!("chat")
            };
            a.render.prompt_options().expect("options")
        };
        let old = popts(&["chat", "--model", "m", "--no-thinking"]);
        let new = popts(&["chat", "--model", "m", "--reasoning-effort", "none"]);
        assert!(!old.enable_thinking && !new.enable_thinking);
        assert_eq!(old.reasoning_effort, new.reasoning_effort);
        assert!(popts(&["chat", "--model", "m"]).enable_thinking);
    }

    /// The common options have the same short flags on every command that takes them.
    #[test]
    fn short_flags_are_their_long_options() {
        let same = [
            (
                &[
                    "run",
                    "--model",
                    "m",
                    "--prompt",
                    "x",
                    "--max-new-tokens",
                    "3",
                    "--threads",
                    "2",
                ][..],
                &["run", "-m", "m", "-p", "x", "-n", "3", "-t", "2"][..],
            ),
            (
                &[
                    "chat",
                    "--model",
                    "m",
                    "--context",
                    "64",
                    "--max-new-tokens",
                    "3",
                    "--threads",
                    "1",
                ],
                &["chat", "-m", "m", "-c", "64", "-n", "3", "-t", "1"],
            ),
            (
                &[
                    "serve",
                    "--model",
                    "m",
                    "--http",
                    "127.0.0.1:0",
                    "--context",
                    "64",
                    "--threads",
                    "2",
                ],
                &[
                    "serve",
                    "-m",
                    "m",
                    "--http",
                    "127.0.0.1:0",
                    "-c",
                    "64",
                    "-t",
                    "2",
                ],
            ),
            (
                &["bench", "--model", "m", "--threads", "2"],
                &["bench", "-m", "m", "-t", "2"],
            ),
            (
                &["tokenize", "--model", "m", "x"],
                &["tokenize", "-m", "m", "x"],
            ),
            (
                &["convert", "--model", "m", "--out", "o"],
                &["convert", "-m", "m", "--out", "o"],
            ),
            (
                &["manifest", "build", "--model", "m"],
                &["manifest", "build", "-m", "m"],
            ),
            (
                &["manifest", "show", "--model", "m"],
                &["manifest", "show", "-m", "m"],
            ),
        ];
        #[cfg(feature = "lab")]
        let lab: [(&[&str], &[&str]); 2] = [
            (
                &["demo", "--prompt", "x", "--max-new-tokens", "3"],
                &["demo", "-p", "x", "-n", "3"],
            ),
            (
                &[
                    "sim",
                    "--scenario",
                    "lan4",
                    "--model",
                    "m",
                    "--max-new-tokens",
                    "3",
                ],
                &["sim", "--scenario", "lan4", "-m", "m", "-n", "3"],
            ),
        ];
        #[cfg(not(feature = "lab"))]
        let lab: [(&[&str], &[&str]); 0] = [];
        for (long, short) in same.into_iter().chain(lab) {
            assert_eq!(parsed(long), parsed(short), "{short:?}");
        }
        // Every command that runs the model takes --threads, into its typed settings.
        for cmd in ["run", "chat", "serve", "bench"] {
            let help = super::Cli::command_line()
                .find_subcommand_mut(cmd)
                .expect(cmd)
                .render_help()
                .to_string();
            assert!(help.contains("-t, --threads <N>"), "{cmd}:\n{help}");
        }
        let c = super::Cli::try_parse_args(["stormo", "run", "-m", "m", "-p", "x", "-t", "3"])
            .expect("parses");
        let super::Command::Run(a) = c.command else {
            panic!("run")
        };
        assert_eq!(a.experts.resolve().expect("resolves").threads, Some(3));
        for bad in ["0", "-2", "many"] {
            let e = super::Cli::try_parse_args(["stormo", "run", "-m", "m", "-p", "x", "-t", bad])
                .expect_err(bad)
                .to_string();
            assert!(e.contains("--threads"), "{bad}: {e}");
        }
    }

    /// A renamed option's old variable still works (`STORMO_HTTP_CONTEXT` for `--context`),
    /// and its own variable wins when both are set.
    #[test]
    fn old_variables_of_renamed_options_are_read() {
        let arg = clap::Arg::new("c").long("context").alias("http-context");
        let set = |names: &'static [&'static str]| move |n: &str| names.contains(&n);
        assert_eq!(
            super::env_var_of(&arg, "context", set(&[])),
            "STORMO_CONTEXT"
        );
        assert_eq!(
            super::env_var_of(&arg, "context", set(&["STORMO_HTTP_CONTEXT"])),
            "STORMO_HTTP_CONTEXT"
        );
        assert_eq!(
            super::env_var_of(
                &arg,
                "context",
                set(&["STORMO_HTTP_CONTEXT", "STORMO_CONTEXT"])
            ),
            "STORMO_CONTEXT"
        );
    }

    /// Lab switches are not in the everyday help (docs/performance.md lists them) but still
    /// parse.
    #[test]
    fn lab_switches_are_hidden_but_accepted() {
        let lab: &[(&str, &[&str])] = &[
            (
                "run",
                &[
                    "--int8-attn-head",
                    "--int8-experts",
                    "--full-head",
                    "--prefetch",
                ],
            ),
            (
                "chat",
                &[
                    "--int8-attn-head",
                    "--int8-experts",
                    "--full-head",
                    "--prefetch",
                ],
            ),
            ("serve", &["--prefetch", "--full-head"]),
            (
                "bench",
                &[
                    "--int8-attn-head",
                    "--int8-experts",
                    "--full-head",
                    "--prefetch",
                ],
            ),
        ];
        for (cmd, flags) in lab {
            let help = super::Cli::command_line()
                .find_subcommand_mut(cmd)
                .expect(cmd)
                .render_long_help()
                .to_string();
            for f in *flags {
                assert!(
                    !help.contains(&format!("{f}\n")) && !help.contains(&format!("{f} ")),
                    "{cmd} shows {f}"
                );
                let mut argv = vec![*cmd, "--model", "m"];
                match *cmd {
                    "run" => argv.extend(["--prompt-ids", "1"]),
                    "serve" => argv.extend(["--http", "127.0.0.1:0"]),
                    _ => {}
                }
                argv.push(f);
                parsed(&argv);
            }
        }
        for (cmd, flags) in [
            ("run", &["--prefill-block", "--logits-out"][..]),
            (
                "bench",
                &[
                    "--pair-full-head",
                    "--pair-prefetch",
                    "--pair-tasks",
                    "--pair-completion",
                    "--prefill-block",
                ],
            ),
        ] {
            let help = super::Cli::command_line()
                .find_subcommand_mut(cmd)
                .expect(cmd)
                .render_long_help()
                .to_string();
            for f in flags {
                assert!(!help.contains(f), "{cmd} shows {f}");
            }
        }
    }

    /// A cause already at the end of the message is not repeated; others follow their context.
    /// `-ngl 99`, a llama.cpp habit, is refused with a hint that stormo runs on CPUs, not
    /// parsed as `-n gl`; a prompt that merely contains the text is left alone.
    #[test]
    fn llama_cpp_gpu_layers_get_a_hint() {
        for argv in [
            &["stormo", "run", "-m", "m", "-ngl", "99"][..],
            &["stormo", "chat", "-m", "m", "-ngl99"],
            &["stormo", "serve", "--n-gpu-layers=99", "-m", "m"],
        ] {
            let e = super::Cli::try_parse_args(argv)
                .expect_err("refused")
                .to_string();
            assert!(
                e.contains("stormo runs on CPUs") && e.contains("GPU layers"),
                "{argv:?}: {e}"
            );
        }
        let ok = super::Cli::try_parse_args(["stormo", "run", "-m", "m", "-p", "say -ngl"]);
        assert!(ok.is_ok(), "{:?}", ok.err());
        assert!(super::gpu_layers_flag(&["x".into(), "--".into(), "-ngl".into()]).is_none());
    }

    /// `--no-keep` with `--expert-dir-limit`, both on the command line, is a usage error
    /// naming both (it was accepted silently, --no-keep winning); `--no-keep` still wins over
    /// a limit from the config file, as its help says.
    #[test]
    fn no_keep_with_a_limit_on_the_command_line_is_refused() {
        use super::{Cli, Command};
        let serve = ["stormo", "serve", "--model", "m", "--listen", "127.0.0.1:0"];
        for extra in [
            &["--no-keep", "--expert-dir-limit", "1GiB"][..],
            &["--expert-dir-limit=auto", "--no-keep"],
        ] {
            let argv: Vec<&str> = serve.iter().chain(extra).copied().collect();
            let e = Cli::try_parse_args(argv).expect_err("accepted").to_string();
            assert!(
                e.contains("--no-keep and --expert-dir-limit are both given"),
                "{extra:?}: {e}"
            );
        }
        let e = Cli::try_parse_args([
            "stormo",
            "run",
            "-m",
            "m",
            "-p",
            "hi",
            "--no-keep",
            "--expert-dir-limit",
            "1GiB",
        ])
        .expect_err("accepted")
        .to_string();
        assert!(e.contains("--expert-dir-limit are both given"), "{e}");
        // Each alone is fine, and a limit from the config file gives way to --no-keep.
        for extra in [&["--no-keep"][..], &["--expert-dir-limit", "1GiB"]] {
            let argv: Vec<&str> = serve.iter().chain(extra).copied().collect();
            assert!(Cli::try_parse_args(argv).is_ok(), "{extra:?}");
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("node.toml");
        std::fs::write(&file, "expert-dir-limit = \"1GiB\"\n").expect("write");
        let cfg = file.to_str().expect("utf-8");
        let argv: Vec<&str> = serve
            .iter()
            .copied()
            .chain(["--config", cfg, "--no-keep"])
            .collect();
        match Cli::try_parse_args(argv).expect("parses").command {
            Command::Serve(a) => {
                assert_eq!(a.net.expert_dir_limit.as_deref(), Some("1GiB"));
                assert_eq!(a.net.resolve(true).expect("resolves").keep, None);
            }
            _ => panic!("not serve"),
        }
    }

    #[test]
    fn error_message_names_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("/k: {source}")]
        struct WithPath {
            source: std::io::Error,
        }
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "not found");
        let e = anyhow::Error::new(WithPath { source: io }).context("reading the key");
        assert_eq!(super::error_message(&e), "reading the key: /k: not found");
        let e = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(super::error_message(&e), "outer: middle: inner");
    }
}
