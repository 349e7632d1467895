//! `stormo man`: the manual page, in roff, generated from the clap definitions that parse the
//! command line (clap_mangen): `stormo.1` to standard output, or with `--out DIR` one page per
//! command (`stormo.1`, `stormo-run.1`, `stormo-key-generate.1`, ...).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;

/// Arguments of `stormo man`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Read it with `stormo man | man -l -`; install the pages with \
    `stormo man --out /usr/local/share/man/man1`."
)]
pub struct Args {
    /// Write one page per command into this folder (which must exist) instead of printing
    /// `stormo.1`.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// Prints the page, or writes every page into `--out`.
pub fn run(a: Args) -> anyhow::Result<()> {
    // Without clap's `help` subcommand, which has no page of its own: SEE ALSO lists only
    // the pages `--out` writes.
    let cmd = crate::cli::Cli::command_line().disable_help_subcommand(true);
    match a.out {
        Some(dir) => {
            anyhow::ensure!(
                dir.is_dir(),
                "--out {}: not a folder (create it first)",
                dir.display()
            );
            clap_mangen::generate_to(cmd, &dir)
                .with_context(|| format!("writing the pages into {}", dir.display()))?;
        }
        None => {
            let mut out = Vec::new();
            clap_mangen::Man::new(cmd).render(&mut out)?;
            std::io::stdout().lock().write_all(&out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The page is roff with the program's title and every command in it; `--out` writes a
    /// page per command.
    #[test]
    fn the_page_lists_the_commands_and_out_writes_one_per_command() {
        let mut out = Vec::new();
        clap_mangen::Man::new(crate::cli::Cli::command_line())
            .render(&mut out)
            .unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(
            s.starts_with(".ie") || s.contains(".TH stormo"),
            "{}",
            &s[..80]
        );
        for want in ["stormo\\-run", "stormo\\-bench", "stormo\\-man"] {
            assert!(s.contains(want), "{want:?} missing");
        }
        let dir = tempfile::tempdir().unwrap();
        super::run(super::Args {
            out: Some(dir.path().to_path_buf()),
        })
        .unwrap();
        for page in ["stormo.1", "stormo-run.1", "stormo-key-generate.1"] {
            assert!(dir.path().join(page).is_file(), "{page} missing");
        }
        let e = super::run(super::Args {
            out: Some(dir.path().join("missing")),
        })
        .unwrap_err();
        assert!(e.to_string().contains("not a folder"), "{e}");
    }
}
