//! `--config FILE`: a node's options in a TOML file, keyed by their long names.
//!
//! The file gives the *defaults* of the options it names, so flags and `STORMO_*` variables
//! override it (clap's order: a flag, then its variable, then its default). A key no command
//! knows is an error that names it (a typo must not be silently ignored); a key that only
//! another command takes is left for that command, so one file serves `serve`, `run` and `chat`
//! alike.
//!
//! ```toml
//! model = "/models/gpt-oss-20b"
//! listen = "0.0.0.0:4433"
//! key = "/etc/stormo/node.key"
//! peer = ["KEY@10.0.0.2:4433", "KEY@10.0.0.3:4433"]
//! allow-file = "/etc/stormo/allowed"
//! expert-cache = "8GiB"
//! ```

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The config file named on the command line (`--config FILE` or `--config=FILE`), else by
/// `STORMO_CONFIG`.
pub fn named(args: &[OsString]) -> Option<PathBuf> {
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--" {
            break;
        }
        if s == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = s.strip_prefix("--config=") {
            return Some(PathBuf::from(v));
        }
    }
    std::env::var_os("STORMO_CONFIG")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// A config file's settings: each option's long name and its values as text.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ConfigFile {
    path: PathBuf,
    entries: Vec<(String, Vec<String>)>,
}

impl ConfigFile {
    /// Reads and parses `path` (at most 1 MiB of TOML: keys whose values are strings, numbers,
    /// booleans or arrays of those).
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text =
            stormo_engine::safetensors::read_small_text(path, 1 << 20).context("--config")?;
        Self::parse(path, &text)
    }

    /// Parses `text` (read from `path`, named in errors).
    pub fn parse(path: &Path, text: &str) -> anyhow::Result<Self> {
        let table: toml::Table = toml::from_str(text)
            .with_context(|| format!("--config {}: not valid TOML", path.display()))?;
        let mut entries = Vec::new();
        for (key, value) in table {
            let scalar = |v: &toml::Value| -> anyhow::Result<String> {
                Ok(match v {
                    toml::Value::String(s) => s.clone(),
                    toml::Value::Integer(i) => i.to_string(),
                    toml::Value::Float(f) => f.to_string(),
                    toml::Value::Boolean(b) => b.to_string(),
                    other => anyhow::bail!(
                        "--config {}: {key} is a {}, not a string, number or boolean",
                        path.display(),
                        other.type_str()
                    ),
                })
            };
            let values = match &value {
                toml::Value::Array(a) => a.iter().map(scalar).collect::<anyhow::Result<_>>()?,
                v => vec![scalar(v)?],
            };
            entries.push((key.replace('_', "-"), values));
        }
        Ok(Self {
            path: path.to_path_buf(),
            entries,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file gives the option of long name (or alias) `long`.
    pub fn has(&self, long: &str) -> bool {
        self.entries.iter().any(|(k, _)| k == long)
    }

    /// `cmd` with the file's values as the defaults of the options they name, in every
    /// subcommand that has them. Fails naming a key that no command takes.
    pub fn apply(&self, cmd: clap::Command) -> anyhow::Result<clap::Command> {
        let mut known = std::collections::HashSet::new();
        collect_longs(&cmd, &mut known);
        for (key, _) in &self.entries {
            anyhow::ensure!(
                known.contains(key.as_str()),
                "--config {}: no command takes an option --{key}",
                self.path.display()
            );
        }
        Ok(with_defaults(cmd, &self.entries))
    }
}

fn collect_longs(c: &clap::Command, out: &mut std::collections::HashSet<String>) {
    for a in c.get_arguments() {
        out.extend(names(a).map(str::to_string));
    }
    for s in c.get_subcommands() {
        collect_longs(s, out);
    }
}

/// The names a key may give `a` by: its long name, then its aliases (a renamed option's old
/// spellings, so an old file keeps working).
pub fn names(a: &clap::Arg) -> impl Iterator<Item = &str> {
    a.get_long()
        .into_iter()
        .chain(a.get_all_aliases().into_iter().flatten())
}

fn with_defaults(c: clap::Command, entries: &[(String, Vec<String>)]) -> clap::Command {
    // A required group that the file gives a member of (serve's --listen/--http) is satisfied
    // by the file: clap counts only the command line there, so it is no longer required.
    let given: Vec<clap::Id> = c
        .get_arguments()
        .filter(|a| names(a).any(|l| entries.iter().any(|(k, _)| k == l)))
        .map(|a| a.get_id().clone())
        .collect();
    let relax: Vec<clap::Id> = c
        .get_groups()
        .filter(|g| g.is_required_set() && g.get_args().any(|a| given.contains(a)))
        .map(|g| g.get_id().clone())
        .collect();
    let mut c = c;
    for id in relax {
        c = c.mut_group(id, |g| g.required(false));
    }
    let c = c.mut_args(|a| {
        // The long name wins over an alias when a file gives both.
        let Some(values) = names(&a)
            .find_map(|n| entries.iter().find(|(k, _)| k == n))
            .map(|(_, v)| v.clone())
        else {
            return a;
        };
        let values: Vec<clap::builder::OsStr> = values
            .iter()
            .map(|v| clap::builder::OsStr::from(v.clone()))
            .collect();
        // A required option the file gives is no longer required on the command line.
        a.required(false).default_values(values)
    });
    c.mut_subcommands(|s| with_defaults(s, entries))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;

    fn parse(argv: &[&str]) -> Result<Cli, String> {
        Cli::try_parse_args(argv.iter().copied()).map_err(|e| e.to_string())
    }

    /// Issue 34 (d): a config file and the equivalent flags give the same node; flags
    /// override the file; a key no command takes is an error naming it.
    #[test]
    fn a_config_file_and_the_equivalent_flags_give_the_same_node() {
        let dir = tempfile::tempdir().expect("temp dir");
        let key = "a".repeat(64);
        let peer = format!("{key}@127.0.0.1:4433");
        let file = dir.path().join("node.toml");
        std::fs::write(
            &file,
            format!(
                "model = \"/m\"\nlisten = \"127.0.0.1:4433\"\nallow = [\"{key}\"]\n\
                 peer = [\"{peer}\"]\nexpert-cache = \"64MiB\"\nno-hot-store = true\n\
                 per-peer = 3\nhttp = \"127.0.0.1:8080\"\n"
            ),
        )
        .expect("write config");
        let cfg = file.to_str().expect("utf-8");
        let from_file = parse(&["stormo", "serve", "--config", cfg]).expect("file parses");
        let from_flags = parse(&[
            "stormo",
            "serve",
            "--model",
            "/m",
            "--listen",
            "127.0.0.1:4433",
            "--allow",
            &key,
            "--peer",
            &peer,
            "--expert-cache",
            "64MiB",
            "--no-hot-store",
            "--per-peer",
            "3",
            "--http",
            "127.0.0.1:8080",
        ])
        .expect("flags parse");
        assert_eq!(
            format!("{:?}", from_file.command),
            format!("{:?}", from_flags.command)
        );
        // A flag overrides the file.
        let over =
            parse(&["stormo", "serve", "--config", cfg, "--expert-cache", "1GiB"]).expect("parses");
        let crate::cli::Command::Serve(a) = over.command else {
            panic!("serve")
        };
        assert_eq!(a.experts.expert_cache, "1GiB");
        // The same file serves `run` (its serve-only keys are left alone).
        let run = parse(&["stormo", "run", "--config", cfg, "--prompt-ids", "1"]);
        let crate::cli::Command::Run(r) = run.expect("run takes the file").command else {
            panic!("run")
        };
        assert_eq!(r.model, PathBuf::from("/m"));
        assert_eq!(r.net.peers.len(), 1);
        // A renamed option's old name still works as a key (serve's --http-context is now
        // --context), and the new name wins when both are given.
        std::fs::write(
            &file,
            "model = \"/m\"\nhttp = \"127.0.0.1:8080\"\nhttp-context = 64\n",
        )
        .expect("write");
        let old = parse(&["stormo", "serve", "--config", cfg]).expect("old key parses");
        let new = parse(&[
            "stormo",
            "serve",
            "--model",
            "/m",
            "--http",
            "127.0.0.1:8080",
            "--context",
            "64",
        ])
        .expect("flags parse");
        assert_eq!(format!("{:?}", old.command), format!("{:?}", new.command));
        std::fs::write(
            &file,
            "model = \"/m\"\nhttp = \"127.0.0.1:8080\"\nhttp-context = 64\ncontext = 99\n",
        )
        .expect("write");
        let both = parse(&["stormo", "serve", "--config", cfg]).expect("both parse");
        assert!(format!("{:?}", both.command).contains("http_context: 99"));
        // A typo is named.
        std::fs::write(&file, "modle = \"/m\"\n").expect("write");
        let e = parse(&["stormo", "serve", "--config", cfg]).expect_err("typo");
        assert!(e.contains("--modle"), "{e}");
        // Bad TOML is named, with the file.
        std::fs::write(&file, "model = \n").expect("write");
        let e = parse(&["stormo", "serve", "--config", cfg]).expect_err("bad toml");
        assert!(
            e.contains("not valid TOML") && e.contains("node.toml"),
            "{e}"
        );
    }
}
