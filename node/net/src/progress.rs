//! Progress on stderr for long work: a line redrawn in place on a terminal, an occasional plain
//! line otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Reports `done` of `total` bytes with rate and ETA, or `done` of `total` items of a kind
/// and the bytes they came to ([`Progress::update_items`]).
#[derive(Debug)]
pub struct Progress {
    what: String,
    /// What [`Progress::update_items`] counts ("experts").
    items: String,
    start: Instant,
    last: Option<Instant>,
    tty: bool,
    quiet: bool,
}

impl Progress {
    /// A progress line for `what` (e.g. "converting").
    pub fn new(what: &str) -> Self {
        Self {
            what: what.to_string(),
            items: String::new(),
            start: Instant::now(),
            last: None,
            tty: std::io::stderr().is_terminal(),
            quiet: false,
        }
    }

    /// Silences it.
    pub fn quiet(mut self, q: bool) -> Self {
        self.quiet = q;
        self
    }

    /// A progress line for `what` counting `items` ("experts"): see [`Progress::update_items`].
    pub fn counting(what: &str, items: &str) -> Self {
        Self {
            items: items.to_string(),
            ..Self::new(what)
        }
    }

    /// Updates the line with `done` of `total` items, which came to `bytes` bytes so far
    /// (rate-limited): "pull: experts: 4 of 16 experts, 3.4 MiB, 1.1 MiB/s, ETA 3s".
    pub fn update_items(&mut self, done: u64, total: u64, bytes: u64) {
        let Some(secs) = self.due(done, total) else {
            return;
        };
        let eta = if done > 0 {
            total.saturating_sub(done) as f64 * secs / done as f64
        } else {
            0.0
        };
        let line = format!(
            "{}: {done} of {total} {}, {}, {}/s, ETA {eta:.0}s",
            self.what,
            self.items,
            human_bytes(bytes),
            human_bytes((bytes as f64 / secs) as u64)
        );
        self.draw(&line);
    }

    /// The seconds since the start when a line is due (at most one per 200 ms on a
    /// terminal, per 5 s otherwise, and always the last).
    fn due(&mut self, done: u64, total: u64) -> Option<f64> {
        if self.quiet {
            return None;
        }
        let every = if self.tty {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(5)
        };
        let now = Instant::now();
        if self.last.is_some_and(|l| now - l < every) && done < total {
            return None;
        }
        self.last = Some(now);
        Some((now - self.start).as_secs_f64().max(1e-9))
    }

    fn draw(&self, line: &str) {
        let mut e = std::io::stderr().lock();
        if self.tty {
            let _ = write!(e, "\r\x1b[2K{line}");
        } else {
            let _ = writeln!(e, "{line}");
        }
        let _ = e.flush();
    }

    /// Updates the line with `done` of `total` bytes (rate-limited).
    pub fn update(&mut self, done: u64, total: u64) {
        let Some(secs) = self.due(done, total) else {
            return;
        };
        let rate = done as f64 / secs;
        let eta = if rate > 0.0 {
            (total.saturating_sub(done)) as f64 / rate
        } else {
            0.0
        };
        let pct = if total > 0 {
            100.0 * done as f64 / total as f64
        } else {
            100.0
        };
        let line = format!(
            "{}: {} / {} ({pct:.0}%), {}/s, ETA {eta:.0}s",
            self.what,
            human_bytes(done),
            human_bytes(total),
            human_bytes(rate as u64)
        );
        self.draw(&line);
    }

    /// Ends the line.
    pub fn finish(&mut self) {
        if !self.quiet && self.tty && self.last.is_some() {
            eprintln!();
        }
    }
}

/// Bytes in binary units ("1.5 GiB").
pub fn human_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// A size argument as given, if [`parse_size`] reads it: for clap's `value_parser`, so a bad
/// size is a usage error reported before any work starts.
pub fn size_arg(s: &str) -> Result<String, String> {
    parse_size(s).map(|_| s.to_owned())
}

/// The longest a timeout option takes, in seconds (about 11.6 days): far beyond any wait
/// worth setting, and small enough that the multiples the network tier derives from a
/// timeout (up to 32 times it) stay within what `Duration` and `Instant` hold.
pub const MAX_SECS: f64 = 1e6;

/// A timeout in seconds, checked: positive, finite and at most [`MAX_SECS`]. The one rule
/// behind every timeout option, whether clap parsed it ([`secs_arg`]) or a caller built the
/// arguments itself.
pub fn check_secs(v: f64) -> Result<f64, String> {
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("{v} is not a positive number of seconds"));
    }
    if v > MAX_SECS {
        return Err(format!(
            "{v} seconds is more than the most allowed, {MAX_SECS}"
        ));
    }
    Ok(v)
}

/// A clap value parser for a timeout in seconds ([`check_secs`]).
pub fn secs_arg(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    check_secs(v).map_err(|e| format!("{s:?}: {e}"))
}

/// Parses a size: a number with an optional unit. `KiB`/`MiB`/`GiB`/`TiB` and bare `K`/`M`/`G`/`T`
/// are binary; `KB`/`MB`/`GB`/`TB` are decimal; `B` or no unit is bytes. Decimals are allowed.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (examples: 0, 512MiB, 6GiB, 1.5G)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        u => {
            return Err(format!(
                "{s:?}: unknown size unit {u:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ))
        }
    };
    let v = n * mult;
    // 2^64 itself rounds to `u64::MAX as f64`, so the bound is exclusive.
    if !(0.0..18_446_744_073_709_551_616.0).contains(&v) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds() {
        assert_eq!(secs_arg("30"), Ok(30.0));
        assert_eq!(secs_arg("0.25"), Ok(0.25));
        assert_eq!(secs_arg("1e6"), Ok(MAX_SECS));
        for bad in ["0", "-1", "nan", "inf", "1e20", "1e6.5", "", "ten"] {
            assert!(secs_arg(bad).is_err(), "{bad:?} accepted");
        }
        // The largest accepted timeout, times the network tier's largest multiple, still
        // fits what the clock arithmetic takes.
        let d = Duration::from_secs_f64(MAX_SECS * 32.0);
        assert!(Instant::now().checked_add(d).is_some());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("6GiB"), Ok(6 << 30));
        assert!(parse_size("18446744073709551616").is_err());
        assert!(parse_size("16EiB").is_err());
        assert!(parse_size("16777216TiB").is_err());
        assert!(parse_size("16777215TiB").is_ok());
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size(" 10 k "), Ok(10240));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("-1G").is_err());
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }
}
