//! `stormo completions SHELL`: a completion script for bash, zsh, fish, elvish or PowerShell,
//! generated from the same clap definitions that parse the command line (clap_complete), so it
//! never lags behind a renamed or added option.

use std::io::Write;

/// Arguments of `stormo completions`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Install, for example:\n  \
    stormo completions bash > ~/.local/share/bash-completion/completions/stormo\n  \
    stormo completions zsh > \"${fpath[1]}/_stormo\"\n  \
    stormo completions fish > ~/.config/fish/completions/stormo.fish")]
pub struct Args {
    /// The shell to write the script for.
    #[arg(value_enum, value_name = "SHELL")]
    pub shell: clap_complete::Shell,
}

/// Writes the script to standard output.
pub fn run(a: Args) -> anyhow::Result<()> {
    let mut out = Vec::new();
    write(a.shell, &mut out);
    std::io::stdout().lock().write_all(&out)?;
    Ok(())
}

/// Writes the completion script for `shell` to `out`.
pub fn write(shell: clap_complete::Shell, out: &mut dyn Write) {
    let mut cmd = crate::cli::Cli::command_line();
    clap_complete::generate(shell, &mut cmd, "stormo", out);
}

#[cfg(test)]
mod tests {
    use clap_complete::Shell;

    /// Each shell's script names the program, the subcommands and a subcommand's options.
    #[test]
    fn every_shell_gets_a_script_with_the_commands_and_options() {
        for shell in [
            Shell::Bash,
            Shell::Zsh,
            Shell::Fish,
            Shell::Elvish,
            Shell::PowerShell,
        ] {
            let mut out = Vec::new();
            super::write(shell, &mut out);
            let s = String::from_utf8(out).expect("UTF-8");
            for want in ["stormo", "completions", "bench", "decode-tokens"] {
                assert!(s.contains(want), "{shell}: {want:?} missing");
            }
        }
    }
}
