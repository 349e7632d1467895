//! `stormo swarm`: a swarm's owner key and the membership certificates it signs.
//!
//! A swarm is named by its owner's public key (the swarm key). `create` makes the owner's
//! secret key; `admit` signs a [`Membership`] for one node key with an expiry; `show` prints
//! what a certificate says. Nodes then run with `--swarm SWARMKEY --cert CERT` and admit any
//! peer with a valid certificate of that swarm (see `net::tls`).
//!
//! (The swarm-scenario simulator that was `stormo swarm --scenario` is now `stormo sim`.)

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use stormo_manifests::{Membership, PublicKey, SecretKey};
pub use stormo_net::identity::{read_cert, unix_now, utc_date_time};

/// How far before "now" a new certificate starts: room for peers whose clocks run a little
/// behind the owner's.
pub const CLOCK_SKEW_SECS: u64 = 300;
/// The default lifetime of a certificate.
pub const DEFAULT_EXPIRES: &str = "30d";

/// Swarm subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Make a swarm: write its owner's secret key (mode 0600) and print the swarm key.
    ///
    /// The swarm key (64 hex) is what every member passes as `--swarm`; the secret key stays
    /// with the owner, who signs members in with `stormo swarm admit`.
    Create {
        /// Where to write the owner's secret key (must not exist): the file `swarm admit
        /// --owner` then names.
        #[arg(long, alias = "out", value_name = "FILE")]
        owner: PathBuf,
    },
    /// Sign a membership certificate admitting one node key into the swarm until an expiry.
    ///
    /// Example: `stormo key generate --key node.key | ssh owner-host stormo swarm admit
    /// --owner owner.key --node - --out - > node.cert` (the node's key never leaves it).
    Admit {
        /// The owner's secret key file (from `stormo swarm create --owner`).
        #[arg(long, alias = "swarm", value_name = "FILE")]
        owner: PathBuf,
        /// The node to admit: its public key (64 hex), its secret key file, or `-` to read the
        /// public key from the first line of standard input (what `stormo key generate`
        /// prints).
        #[arg(long, value_name = "NODEPUB|FILE|-")]
        node: String,
        /// How long the certificate is valid: a duration (`90m`, `12h`, `30d`, `8w`; `s` for
        /// seconds) or the UTC date it expires (`2027-06-30`). It starts 5 minutes before now.
        #[arg(long, default_value = DEFAULT_EXPIRES, value_name = "DURATION|DATE")]
        expires: String,
        /// Where to write the certificate (154 bytes; must not exist), or `-` for standard
        /// output.
        #[arg(long, value_name = "CERT")]
        out: PathBuf,
    },
    /// Print what a membership certificate says (its swarm, node, validity), and check its
    /// signature.
    ///
    /// Exits 1 when the certificate is not valid now: expired, not yet valid, forged or edited
    /// (its signature fails), or not a certificate at all.
    Show {
        /// The certificate file.
        #[arg(long, value_name = "CERT")]
        cert: PathBuf,
    },
    /// Show which experts the swarm holds, in how many copies, and which node holds what.
    ///
    /// Connects to the peers (--peer, or found with --discover) as `run` does, reads their
    /// inventories and placement, and prints per layer the experts' copies (min/median/max
    /// of the copies held for good: model folders' own experts and kept ones), the uncovered
    /// experts (no reachable holder: generation would fail on them) and per node what it
    /// holds. The model folder (-m, a folder from `stormo pull` is enough) gives the model's
    /// shape and manifest; its own experts are not counted. Exits with an error, after the
    /// report, when no peer answered within --wait, and with --min-kept N when an expert has
    /// fewer than N kept copies or none reachable.
    // The fetching node's options that a status never uses stay accepted but out of --help.
    #[command(
        mut_arg("expert_dir", |a| a.hide(true)),
        mut_arg("expert_dir_limit", |a| a.hide(true)),
        mut_arg("no_keep", |a| a.hide(true)),
        mut_arg("peers_first", |a| a.hide(true)),
        mut_arg("remote_exec", |a| a.hide(true)),
        mut_arg("exec_trust", |a| a.hide(true)),
        mut_arg("spot_check", |a| a.hide(true)),
        mut_arg("spot_check_inline", |a| a.hide(true)),
        mut_arg("verify_exec", |a| a.hide(true)),
        mut_arg("wait_coverage", |a| a.hide(true))
    )]
    Status(Box<StatusArgs>),
}

/// `stormo swarm status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The model folder (its manifest and shape; its experts are not counted).
    #[arg(short, long, value_name = "DIR")]
    pub model: PathBuf,
    #[command(flatten)]
    pub net: crate::args::PeerArgs,
    #[command(flatten)]
    pub swarm: crate::swarm_args::SwarmArgs,
    /// Print JSON: `experts`, `min_copies`, `min_kept_copies` (copies in expert directories:
    /// the seeders' folders left out), `uncovered` (a list of "layer:expert"), per-layer
    /// `layers` and the `nodes` (a node given with --peer that is down is listed with
    /// `"connected": false`, holding nothing), as a node's `GET /v1/swarm` answers.
    #[arg(long)]
    pub json: bool,
    /// Seconds to wait for the peers to answer (each connected peer's inventory arrives with
    /// its first answer; discovery may take longer). A dial gives up within it too (at
    /// least 0.5 s).
    #[arg(long, default_value_t = 5.0, value_name = "SECS", value_parser = stormo_net::progress::secs_arg)]
    pub wait: f64,
    /// Exit with an error, after the report, unless every expert has at least N kept copies
    /// (in expert directories: the seeders' folders left out) and none is uncovered: a
    /// script's check that a seeder can go (`--min-kept 2` for `--replicas 2`).
    #[arg(long, value_name = "N")]
    pub min_kept: Option<u32>,
}

/// Runs a swarm subcommand.
pub fn run(c: Command) -> anyhow::Result<()> {
    match c {
        Command::Create { owner: out } => {
            let key = SecretKey::generate();
            key.write_new(&out)
                .context("cannot write the swarm owner's key")?;
            eprintln!(
                "wrote the swarm owner's secret key {} (mode 0600); keep it safe: it admits \
                 nodes with `stormo swarm admit --owner {} --node NODEPUB --out CERT`",
                out.display(),
                out.display()
            );
            eprintln!("the swarm key (pass it as --swarm to every member):");
            println!("{}", key.public());
        }
        Command::Admit {
            owner: swarm,
            node,
            expires,
            out,
        } => {
            let owner = stormo_net::identity::load_secret_key(&swarm)
                .with_context(|| format!("--owner {}: the swarm owner's key", swarm.display()))?;
            let node = node_key(&node)?;
            let now = unix_now()?;
            let expires = parse_expiry(&expires, now).context("--expires")?;
            let not_before = now.saturating_sub(CLOCK_SKEW_SECS);
            let cert = Membership::issue(&owner, node, not_before, expires)?;
            write_cert(&out, &cert)?;
            eprintln!(
                "admitted node {node} into swarm {} until {} UTC{}",
                owner.public(),
                utc_date_time(expires),
                if out == Path::new("-") {
                    String::new()
                } else {
                    format!(" ({})", out.display())
                }
            );
        }
        Command::Show { cert } => {
            let m = read_cert(&cert)?;
            println!("swarm      {}", m.swarm);
            println!("node       {}", m.node);
            println!("not before {} UTC", utc_date_time(m.not_before));
            println!("expires    {} UTC", utc_date_time(m.expires));
            // Its own swarm and node: what is checked is the owner's signature (a forged or
            // edited file fails it) and the validity period. Anything but valid exits 1.
            let now = unix_now()?;
            let verdict = m.verify(&m.swarm, &m.node, now, &Default::default());
            match &verdict {
                Ok(()) => println!("state      valid now"),
                Err(e) => println!("state      NOT VALID: {e}"),
            }
            verdict.with_context(|| format!("{}: not a valid certificate now", cert.display()))?;
        }
        Command::Status(a) => status(*a)?,
    }
    Ok(())
}

/// `stormo swarm status`: a node that uses no expert of its own dials the peers and the
/// serving nodes they name (peer exchange), waits (at most `--wait`) for each to answer, and
/// prints the coverage.
fn status(a: StatusArgs) -> anyhow::Result<()> {
    use stormo_node::config::{CacheBudget, ExpertsConfig, LocalExperts, NodeConfig};
    let mut peers = a.net.resolve(false)?;
    // A dial gives up within --wait too (at least half a second: a handshake on a LAN takes
    // milliseconds), so a dead peer does not hold the report for the whole connect timeout.
    let wait = std::time::Duration::from_secs_f64(a.wait.max(0.5));
    peers.timeouts.connect_timeout = peers.timeouts.connect_timeout.min(wait);
    // The key file is loaded once: for the certificate's check and for the node.
    let (mut swarm, host) =
        crate::swarm_args::resolve_identity(&a.swarm, a.net.key.as_deref())?.into_host()?;
    // Discovery at start waits within --wait too, not the node's own 15 s.
    if let Some(sw) = swarm.as_mut() {
        sw.discover.wait = Some(wait);
    }
    anyhow::ensure!(
        !peers.peers.is_empty() || swarm.as_ref().is_some_and(|s| s.discover.is_on()),
        "swarm status needs peers to ask: --peer KEY@HOST:PORT, or --discover lan|dht (with \
         --swarm and --cert in a swarm)"
    );
    let files = stormo_node::node::open_model(&a.model)?;
    // --wait bounds the whole report, discovery's first look included.
    let until = std::time::Instant::now() + std::time::Duration::from_secs_f64(a.wait);
    let node = stormo_node::node::Node::start_on(
        NodeConfig {
            model: a.model.clone(),
            state_dir: stormo_node::config::default_state_dir(),
            experts: ExpertsConfig {
                cache: CacheBudget::Bytes(0),
                hot_store: false,
                ..ExpertsConfig::default()
            },
            local: LocalExperts::None,
            context: 1,
            peers,
            listen: None,
            swarm,
        },
        host,
        files,
    )?;
    let answered = || {
        node.peer_tier().is_some_and(|t| {
            let v = t.swarm_view();
            !v.is_empty() && v.iter().all(|p| p.connected && p.inventory.is_some())
        })
    };
    loop {
        while std::time::Instant::now() < until && !answered() {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        // Placement and the list of the peer's own peers follow its inventory on the same
        // stream: give them a moment.
        std::thread::sleep(std::time::Duration::from_millis(200));
        // The nodes the peers name (peer exchange) are asked too, within --wait: given one
        // node of a swarm, the report covers every node that one knows.
        match node.peer_tier() {
            Some(t) if std::time::Instant::now() < until && !t.told_peers().is_empty() => {
                stormo_node::node::add_told_peers(t);
            }
            _ => break,
        }
    }
    let c = node
        .coverage()
        .context("no manifest to read the swarm's coverage against")?;
    let (kept, uncovered) = (c.min_kept_copies(), c.uncovered().len());
    if a.json {
        println!("{}", serde_json::to_string_pretty(&c.json())?);
    } else {
        print!("{}", c.table());
    }
    // Peers that answered with what they hold: with none, the table counts nobody, and a
    // script must not read "0 copies" as the swarm's state.
    let (known, answered) = node.peer_tier().map_or((0, 0), |t| {
        let v = t.swarm_view();
        let answered = v
            .iter()
            .filter(|p| p.connected && p.inventory.is_some())
            .count();
        (v.len(), answered)
    });
    node.close(std::time::Duration::ZERO);
    anyhow::ensure!(
        answered > 0,
        "no peer answered within --wait {} s ({known} known; see the warnings above for why: \
         a refused key or certificate, a wrong address, a node not running): the coverage \
         above counts no node",
        a.wait
    );
    if let Some(n) = a.min_kept {
        anyhow::ensure!(
            uncovered == 0,
            "--min-kept {n}: {uncovered} experts have no reachable holder"
        );
        anyhow::ensure!(
            kept >= n,
            "--min-kept {n}: some expert has only {kept} kept copies (the seeders' folders \
             left out); keep the seeders until placement has made {n}"
        );
    }
    Ok(())
}

/// The node key `--node` names: 64 hex, a secret key file, or `-` (standard input).
fn node_key(arg: &str) -> anyhow::Result<PublicKey> {
    if arg == "-" {
        let mut text = String::new();
        std::io::stdin()
            .take(4096)
            .read_to_string(&mut text)
            .context("--node -: reading standard input")?;
        let line = text.lines().map(str::trim).find(|l| !l.is_empty());
        let line = line.context("--node -: standard input is empty (expected a node key)")?;
        return line
            .parse()
            .map_err(|e| anyhow::anyhow!("--node -: standard input is not a node key: {e}"));
    }
    let looks_like_hex = arg.len() == 64 && arg.bytes().all(|b| b.is_ascii_hexdigit());
    if looks_like_hex || !Path::new(arg).exists() {
        return arg.parse().map_err(|e| {
            anyhow::anyhow!(
                "--node {arg:?}: not a node key ({e}) nor an existing key file; give the \
                 node's public key (64 hex, as `stormo key show` prints)"
            )
        });
    }
    Ok(stormo_net::identity::load_secret_key(Path::new(arg))
        .with_context(|| format!("--node {arg}"))?
        .public())
}

/// The expiry `--expires` names, in Unix seconds: `now` plus a duration, or a UTC date.
/// Refuses a zero duration and a date that is not after `now`.
pub fn parse_expiry(s: &str, now: u64) -> anyhow::Result<u64> {
    let s = s.trim();
    if let Some((y, m, d)) = parse_date(s) {
        let at = days_from_civil(y, m, d)
            .checked_mul(86_400)
            .and_then(|x| u64::try_from(x).ok())
            .with_context(|| format!("{s:?}: a date before 1970"))?;
        anyhow::ensure!(
            at > now,
            "{s:?} is in the past (it is {} UTC now)",
            utc_date_time(now)
        );
        return Ok(at);
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let unit_secs: u64 = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        "" => anyhow::bail!("{s:?} has no unit: say 30d (days), 12h, 90m, 8w or 3600s"),
        _ => anyhow::bail!(
            "{s:?}: expected a duration such as 30d, 12h, 90m, 8w or 3600s, or a date \
             YYYY-MM-DD"
        ),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("{s:?}: {num:?} is not a whole number"))?;
    anyhow::ensure!(n > 0, "{s:?}: a certificate must be valid for some time");
    n.checked_mul(unit_secs)
        .and_then(|d| d.checked_add(now))
        .filter(|&t| t < 1 << 40)
        .with_context(|| format!("{s:?} is too far in the future"))
}

/// `YYYY-MM-DD`, if `s` is one (with a month 1-12 and a day 1-31).
fn parse_date(s: &str) -> Option<(i64, u32, u32)> {
    let mut it = s.split('-');
    let (y, m, d) = (it.next()?, it.next()?, it.next()?);
    if it.next().is_some() || y.len() != 4 || m.len() != 2 || d.len() != 2 {
        return None;
    }
    let (y, m, d) = (y.parse().ok()?, m.parse().ok()?, d.parse().ok()?);
    ((1..=12).contains(&m) && (1..=31).contains(&d)).then_some((y, m, d))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn write_cert(out: &Path, cert: &Membership) -> anyhow::Result<()> {
    let bytes = cert.to_bytes();
    if out == Path::new("-") {
        let mut stdout = std::io::stdout().lock();
        stdout
            .write_all(&bytes)
            .context("writing to standard output")?;
        return stdout.flush().context("writing to standard output");
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)
        .with_context(|| format!("--out {}", out.display()))?;
    f.write_all(&bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("--out {}", out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000; // 2027-01-15 08:00 UTC

    #[test]
    fn expiries_parse_as_durations_and_dates() {
        assert_eq!(parse_expiry("30d", NOW).unwrap(), NOW + 30 * 86_400);
        assert_eq!(parse_expiry("12h", NOW).unwrap(), NOW + 12 * 3600);
        assert_eq!(parse_expiry("90m", NOW).unwrap(), NOW + 90 * 60);
        assert_eq!(parse_expiry("2w", NOW).unwrap(), NOW + 14 * 86_400);
        assert_eq!(parse_expiry("3600s", NOW).unwrap(), NOW + 3600);
        assert_eq!(utc_date_time(NOW), "2027-01-15 08:00");
        let at = parse_expiry("2027-06-30", NOW).unwrap();
        assert_eq!(utc_date_time(at), "2027-06-30 00:00");
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    #[test]
    fn zero_past_and_malformed_expiries_are_refused_with_the_reason() {
        let err = |s: &str| parse_expiry(s, NOW).unwrap_err().to_string();
        assert!(err("0d").contains("valid for some time"), "{}", err("0d"));
        assert!(
            err("2026-01-01").contains("in the past"),
            "{}",
            err("2026-01-01")
        );
        assert!(err("30").contains("no unit"), "{}", err("30"));
        assert!(err("30y").contains("expected a duration"), "{}", err("30y"));
        assert!(err("-5d").contains("expected a duration"), "{}", err("-5d"));
        assert!(err("99999999999999999999d").contains("whole number"));
        assert!(
            err("999999999w").contains("too far"),
            "{}",
            err("999999999w")
        );
    }
}
