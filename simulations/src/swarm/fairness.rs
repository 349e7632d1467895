//! Fairness: two bulk stormo transfers that share one bottleneck, and each one's share of it.
//!
//! Two `stormo serve` nodes each hold the whole model, each behind its own relay (its own
//! delay and loss), and both relays' ways to the client pass one [`SharedLink`]: one rate and
//! one drop-tail queue, as two flows meeting at a congested router port. Each node paces its
//! answers with its own `--congestion`; a `stormo pull --with-experts` from each (one after
//! another into fresh folders, so neither flow runs dry) keeps both links busy. After a
//! warm-up (slow start, BBR's startup) the bytes each relay delivered over a fixed window give
//! each flow's throughput and share.
//!
//! What "fair" can mean here is the caller's to judge; the report gives the raw shares, the
//! link's utilisation and Jain's index, and the table compares what a CUBIC flow got beside
//! each competitor with what it got beside another CUBIC flow (the harm a newcomer does to the
//! traffic already there). Non-goals: TCP competitors (the relay carries UDP only), more than
//! two flows, flows of different round-trip times.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use super::cluster::{Cluster, NodeSpec, Reaper, RunningClient};
use super::relay::{LinkCounts, LinkSpec, SharedLink};
use super::{LinkJson, SwarmError, SwarmOptions};

/// How long both flows run before the window starts (slow start, BBR's startup and drain).
pub const WARMUP: Duration = Duration::from_secs(3);

/// The congestion control pairs measured, in order: the status quo (CUBIC beside CUBIC), then
/// each other controller beside CUBIC and beside itself.
pub const PAIRS: [[&str; 2]; 5] = [
    ["cubic", "cubic"],
    ["bbr", "cubic"],
    ["bbr", "bbr"],
    ["tolerant", "cubic"],
    ["tolerant", "tolerant"],
];

/// One flow's part of a pair's window.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FlowReport {
    /// The serving node's `--congestion`.
    pub congestion: String,
    /// Bytes its relay delivered to the client in the window (UDP payload).
    pub bytes: u64,
    /// Those bytes per second, in MB/s.
    pub mb_s: f64,
    /// Its part of both flows' bytes, in [0, 1].
    pub share: f64,
    /// Its part of what the link could carry in the window (`None`: no rate).
    pub link_share: Option<f64>,
    /// Datagrams of this flow dropped in the window by the loss probability.
    pub lost: u64,
    /// Datagrams of this flow dropped in the window because the shared queue was full.
    pub overflowed: u64,
    /// Pulls started for this flow (a finished pull is followed by another).
    pub pulls: u32,
}

/// One pair of flows sharing the link.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PairReport {
    /// The two flows.
    pub flows: [FlowReport; 2],
    /// The window's length in seconds.
    pub window_s: f64,
    /// Both flows' bytes over what the link could carry (`None`: no rate).
    pub utilization: Option<f64>,
    /// Jain's fairness index of the two throughputs: 1 when equal, 0.5 when one has it all.
    pub jain: f64,
}

/// The result of the fairness measurement.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FairnessReport {
    /// The scenario's name.
    pub scenario: String,
    /// Each flow's own link (its delay and loss; the rate and queue are the shared
    /// bottleneck's).
    pub link: LinkJson,
    /// The shared queue, bytes.
    pub queue_bytes: usize,
    /// The pairs, in the order of [`PAIRS`] (or as given).
    pub pairs: Vec<PairReport>,
}

/// Runs each of `pairs` over `link` (rate and queue shared, delay and loss per flow), with
/// `opts.model` pulled by both flows, for `WARMUP` and then `window`. Every process it starts
/// is gone when it returns.
pub fn run_fairness(
    name: &str,
    opts: &SwarmOptions,
    link: LinkSpec,
    pairs: &[[&str; 2]],
    window: Duration,
    log: &mut dyn FnMut(&str),
    reaper_out: Option<&dyn Fn(Reaper)>,
) -> Result<FairnessReport, SwarmError> {
    link.validate().map_err(SwarmError::Model)?;
    let work = opts.work.join(name);
    // Each flow's node gets its own `--congestion`; `opts.serve_args` would repeat it.
    let mut c = Cluster::prepare(&opts.exe, &opts.model, &work)?;
    if let Some(f) = reaper_out {
        f(c.reaper());
    }
    let mut reports = Vec::new();
    for (k, pair) in pairs.iter().enumerate() {
        log(&format!(
            "{name}: {} beside {} for {:.0} s after a {:.0} s warm-up",
            pair[0],
            pair[1],
            window.as_secs_f64(),
            WARMUP.as_secs_f64()
        ));
        let shared = SharedLink::new(&link).map_err(SwarmError::Model)?;
        let nodes = pair
            .iter()
            .map(|cc| {
                c.add_node_with(
                    NodeSpec {
                        args: vec!["--congestion".into(), (*cc).into()],
                        shared_down: Some(shared.clone()),
                        ..NodeSpec::default()
                    },
                    link,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let r = measure_pair(&c, k, pair, &nodes, &link, window);
        for &i in &nodes {
            c.stop(i);
        }
        let _ = std::fs::remove_dir_all(work.join(format!("pair{k}")));
        let r = r?;
        log(&format!(
            "{name}: {} {:.2} MB/s ({:.0}%), {} {:.2} MB/s ({:.0}%)",
            r.flows[0].congestion,
            r.flows[0].mb_s,
            r.flows[0].share * 100.0,
            r.flows[1].congestion,
            r.flows[1].mb_s,
            r.flows[1].share * 100.0
        ));
        reports.push(r);
    }
    Ok(FairnessReport {
        scenario: name.into(),
        link: link.into(),
        queue_bytes: link.queue_bytes,
        pairs: reports,
    })
}

/// One flow: its node and its current pull.
struct Flow {
    node: usize,
    pull: Option<RunningClient>,
    pulls: u32,
}

/// Runs pair `k` on `nodes` (already started): pulls from both, the warm-up, the window.
fn measure_pair(
    c: &Cluster,
    k: usize,
    pair: &[&str; 2],
    nodes: &[usize],
    link: &LinkSpec,
    window: Duration,
) -> Result<PairReport, SwarmError> {
    let dir = c.work.join(format!("pair{k}"));
    let mut flows: Vec<Flow> = nodes
        .iter()
        .map(|&node| Flow {
            node,
            pull: None,
            pulls: 0,
        })
        .collect();
    let start = Instant::now();
    let mut at_start: Option<[LinkCounts; 2]> = None;
    loop {
        for (f, flow) in flows.iter_mut().enumerate() {
            if let Some(p) = flow.pull.as_mut() {
                match p.outcome() {
                    None => continue,
                    Some(Ok(())) => flow.pull = None,
                    Some(Err(e)) => return Err(e),
                }
            }
            // A fresh folder per pull: a pull into a complete one would fetch nothing.
            let out = dir.join(format!("flow{f}-{}", flow.pulls));
            let _ = std::fs::remove_dir_all(
                dir.join(format!("flow{f}-{}", flow.pulls.wrapping_sub(1))),
            );
            let args = vec![
                "--peer".into(),
                c.nodes[flow.node].peer(),
                "--model-id".into(),
                c.model_id.clone(),
                "--key".into(),
                c.client_key.to_string_lossy().into_owned(),
                "--out".into(),
                out.to_string_lossy().into_owned(),
                "--with-experts".into(),
            ];
            flow.pull = Some(c.spawn_command(
                &format!("pair{k}-flow{f}-pull{}", flow.pulls),
                "pull",
                &args,
            )?);
            flow.pulls += 1;
        }
        let t = start.elapsed();
        let counts = [c.nodes[nodes[0]].link(), c.nodes[nodes[1]].link()];
        match at_start {
            None if t >= WARMUP => at_start = Some(counts),
            Some(s) if t >= WARMUP + window => {
                let measured = t - WARMUP;
                return Ok(pair_report(pair, s, counts, &flows, link, measured));
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pair_report(
    pair: &[&str; 2],
    from: [LinkCounts; 2],
    to: [LinkCounts; 2],
    flows: &[Flow],
    link: &LinkSpec,
    window: Duration,
) -> PairReport {
    let secs = window.as_secs_f64();
    let bytes = [0, 1].map(|i| to[i].down_bytes - from[i].down_bytes);
    let total = (bytes[0] + bytes[1]).max(1) as f64;
    let capacity = link.bandwidth.map(|bw| bw as f64 * secs);
    let flow = |i: usize| FlowReport {
        congestion: pair[i].into(),
        bytes: bytes[i],
        mb_s: bytes[i] as f64 / secs / 1e6,
        share: bytes[i] as f64 / total,
        link_share: capacity.map(|cap| bytes[i] as f64 / cap),
        lost: to[i].lost - from[i].lost,
        overflowed: to[i].overflowed - from[i].overflowed,
        pulls: flows[i].pulls,
    };
    let (x, y) = (bytes[0] as f64, bytes[1] as f64);
    PairReport {
        flows: [flow(0), flow(1)],
        window_s: secs,
        utilization: capacity.map(|cap| (x + y) / cap),
        jain: jain(x, y),
    }
}

/// Jain's fairness index of two throughputs (1 for equal shares, 0.5 when one has all; 1 when
/// both are zero).
pub fn jain(x: f64, y: f64) -> f64 {
    let sq = x * x + y * y;
    if sq == 0.0 {
        1.0
    } else {
        (x + y) * (x + y) / (2.0 * sq)
    }
}

impl FairnessReport {
    /// A table for people.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let l = &self.link;
        let _ = writeln!(
            o,
            "scenario {}: two flows share {} with a {:.0} KB drop-tail queue; each flow {:.2} ms \
             one way, loss {:.2}%",
            self.scenario,
            l.bandwidth_bytes_s.map_or_else(
                || "an unlimited link".into(),
                |b| format!("{:.0} Mbit/s", b as f64 * 8.0 / 1e6)
            ),
            self.queue_bytes as f64 / 1e3,
            l.delay_ms,
            l.loss * 100.0
        );
        let _ = writeln!(
            o,
            "  {:<20} {:>10} {:>10} {:>7} {:>6} {:>6} {:>11}",
            "pair", "flow A", "flow B", "A:B", "jain", "used", "drops A/B"
        );
        for p in &self.pairs {
            let [a, b] = &p.flows;
            let _ = writeln!(
                o,
                "  {:<20} {:>5.2} MB/s {:>5.2} MB/s {:>7.2} {:>6.3} {:>6} {:>11}",
                format!("{} + {}", a.congestion, b.congestion),
                a.mb_s,
                b.mb_s,
                a.mb_s / b.mb_s.max(f64::MIN_POSITIVE),
                p.jain,
                p.utilization
                    .map_or_else(|| "-".into(), |u| format!("{:.0}%", u * 100.0)),
                format!("{}/{}", a.lost + a.overflowed, b.lost + b.overflowed)
            );
        }
        // The harm a flow does to a CUBIC flow, against a CUBIC flow's own.
        let cubic_beside = |other: &str| {
            self.pairs.iter().find_map(|p| {
                let [a, b] = &p.flows;
                (a.congestion == other && b.congestion == "cubic").then_some(b.mb_s)
            })
        };
        if let Some(base) = cubic_beside("cubic") {
            for other in ["bbr", "tolerant"] {
                if let Some(got) = cubic_beside(other) {
                    let _ = writeln!(
                        o,
                        "  a CUBIC flow beside {other}: {got:.2} MB/s, beside CUBIC: {base:.2} MB/s \
                         ({:.2}x)",
                        got / base.max(f64::MIN_POSITIVE)
                    );
                }
            }
        }
        o.trim_end().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_index_of_two_flows() {
        assert_eq!(jain(5.0, 5.0), 1.0);
        assert_eq!(jain(5.0, 0.0), 0.5);
        assert_eq!(jain(0.0, 0.0), 1.0);
        assert!((jain(3.0, 1.0) - 0.8).abs() < 1e-12);
    }
}
