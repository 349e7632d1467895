//! What `stormo bench` prints: one JSON object (`--json`, and what `--svg` draws) or a table,
//! both from the same measurements.
//!
//! Owns the report's fields and their arithmetic: rates from seconds, fractions of the
//! bounds, the decode's time and bytes phase by phase, the run from peers against the local
//! disk. Measures nothing, except the peak RSS at the moment it reports.

use stormo_engine::generate::DecodePair;
use stormo_engine::profile::{self, Phase};
use stormo_engine::tiers::ExpertStats;
use stormo_net::progress::human_bytes;

use super::ceilings::{cpu_identity, Ceilings, Spread};
use super::paired::{Knob, PairedCompletion, PairedKnob, Pairs};
use super::peers::DiskRun;
use super::timed::{Decoded, Prefill};
use super::{Args, Plan};

/// Everything a run measured.
#[derive(Debug)]
pub(super) struct Report<'a> {
    pub(super) a: &'a Args,
    pub(super) plan: &'a Plan,
    /// The ceilings (the floating-point peak measured again at the end).
    pub(super) ceilings: &'a Ceilings,
    /// Memory and the kernels during and after the decode.
    pub(super) spread: Spread,
    pub(super) prefills: Vec<Prefill>,
    pub(super) decoded: Decoded,
    /// Sampled and greedy tokens alternated after the decode.
    pub(super) sampled: DecodePair,
    pub(super) pairs: Pairs,
    /// The experts' statistics after the decode.
    pub(super) experts_after: Option<ExpertStats>,
    /// The experts' `--json` object.
    pub(super) experts_json: serde_json::Value,
    /// The experts' table.
    pub(super) experts_table: String,
    /// Whether the head is screened (through its 8-bit copy).
    pub(super) screened_head: bool,
    /// Whether every expert came from peers.
    pub(super) from_peers: bool,
    /// The same run from the local disk, beside the run from peers.
    pub(super) disk_run: Option<DiskRun>,
}

impl Report<'_> {
    /// Writes the chart (with `--svg`), then the JSON object (with `--json`) or the table on
    /// stdout.
    pub(super) fn write(&self) -> anyhow::Result<()> {
        let out = self.json();
        if let Some(svg) = &self.plan.svg {
            svg.write(&out)?;
        }
        if self.a.json {
            println!("{out}");
            return Ok(());
        }
        self.print_table(&out);
        Ok(())
    }

    /// Decoded tokens per second.
    fn decode_tok_s(&self) -> f64 {
        self.a.decode_tokens as f64 / self.decoded.secs
    }

    /// Bytes a tier of the experts has read by the decode's start (`before`) or end.
    fn tier_bytes(&self, before: bool, name: &str) -> u64 {
        let s = if before {
            &self.decoded.experts_before
        } else {
            &self.experts_after
        };
        s.as_ref()
            .and_then(|s| s.tiers.iter().find(|t| t.name == name).map(|t| t.bytes))
            .unwrap_or(0)
    }

    /// Bytes read from the local disk per decoded token.
    fn disk_per_tok(&self) -> f64 {
        (self.tier_bytes(false, "disk") - self.tier_bytes(true, "disk")) as f64
            / self.a.decode_tokens.max(1) as f64
    }

    /// Experts from peers per second the model waited for experts (prefill and decode), MB.
    fn fetch_mb_s(&self) -> Option<f64> {
        self.experts_after
            .as_ref()
            .filter(|_| self.from_peers)
            .map(|s| self.tier_bytes(false, "peer") as f64 / 1e6 / s.wait_s.max(1e-9))
    }

    /// Where the decode's time went, per phase: its name, milliseconds and bytes per decoded
    /// token, and the rate at which it read them (GB/s; `None` when it took no time).
    fn decode_phases(&self) -> Vec<(&'static str, f64, u64, Option<f64>)> {
        let a = self.a;
        let phase_nanos = &self.decoded.phase_nanos;
        let per_phase = &self.plan.costs.per_phase;
        let phases = Phase::ALL.iter().enumerate().map(|(i, ph)| {
            let ms = phase_nanos[i] as f64 / 1e6 / a.decode_tokens.max(1) as f64;
            let bytes = per_phase[i];
            let gb_s = (ms > 0.0).then(|| bytes as f64 / (ms / 1e3) / 1e9);
            (ph.name(), ms, bytes, gb_s)
        });
        phases.collect()
    }

    /// The `--json` object.
    fn json(&self) -> serde_json::Value {
        let a = self.a;
        let (c, s, d, costs) = (self.ceilings, &self.spread, &self.decoded, &self.plan.costs);
        let (bound, kernel_bound) = (s.memory_bound(costs), s.kernel_bound(costs));
        let decode_tok_s = self.decode_tok_s();
        let sampled = self.sampled;
        let knob = |k: Knob| self.pairs.knob.as_ref().filter(|p| p.knob == k);
        serde_json::json!({
            "model": a.model.display().to_string(),
            "threads": rayon::current_num_threads(),
            "simd": c.isa.name(),
            "prefetch_ahead_bytes": d.default_ahead,
            "int8_attn_head": a.int8_attn_head,
            "int8_experts": a.int8_experts,
            "cpu": cpu_identity(),
            "memory_bandwidth_gb_s": s.mem / 1e9,
            "memory_bandwidth_at_start_gb_s": c.mem_start / 1e9,
            "memory_bandwidth_at_end_gb_s": s.mem_end / 1e9,
            "memory_bandwidth_during_decode_gb_s": {"min": s.mem_min / 1e9, "max": s.mem_max / 1e9},
            "kernel_stream_gb_s": {
                "bf16": {
                    "start": c.kernels_start.bf16 / 1e9, "end": s.kernels_end.bf16 / 1e9,
                    "during_decode": {"min": s.kernels_during.bf16[0] / 1e9, "median": s.kernels_during.bf16[1] / 1e9, "max": s.kernels_during.bf16[2] / 1e9},
                },
                "mxfp4": {
                    "start": c.kernels_start.mxfp4 / 1e9, "end": s.kernels_end.mxfp4 / 1e9,
                    "during_decode": {"min": s.kernels_during.mxfp4[0] / 1e9, "median": s.kernels_during.mxfp4[1] / 1e9, "max": s.kernels_during.mxfp4[2] / 1e9},
                },
            },
            "decode_kernel_bound_tok_s": kernel_bound,
            "disk_bandwidth_gb_s": c.disk.map(|(rate, _)| rate / 1e9),
            "disk_direct_io": c.disk.map(|(_, direct)| direct),
            "bytes_per_decoded_token": costs.bpt,
            "bytes_per_decoded_token_full_head": costs.bpt_full_head,
            "screened_head": self.screened_head,
            "head_exact_rows_per_token": d.screen.rows_per_token(),
            "head_full_passes": d.screen.full,
            "paired_tok_s": self.pairs.head.map(|[s, f]| serde_json::json!({"screened_head": s, "full_head": f})),
            "paired_prefetch": knob(Knob::Prefetch).map(PairedKnob::json),
            "paired_tasks": knob(Knob::Tasks).map(PairedKnob::json),
            "paired_completion": self.pairs.completion.as_ref().map(PairedCompletion::json),
            "decode_bound_tok_s": bound,
            "peak_gflop_s": c.peak / 1e9,
            "prefill_gflop_per_token": costs.flops_tok / 1e9,
            "prefill": self.prefill_json(),
            "decode_sampled": {"temperature": 0.7, "tok_s": sampled.sampled_tok_s, "greedy_tok_s_alternated": sampled.greedy_tok_s, "vs_greedy": sampled.sampled_tok_s / sampled.greedy_tok_s},
            "decode": {"tokens": a.decode_tokens, "seconds": d.secs, "tok_s": decode_tok_s, "fraction_of_memory_bound": decode_tok_s / bound, "fraction_of_kernel_bound": decode_tok_s / kernel_bound, "disk_bytes_per_token": self.disk_per_tok(), "phases": self.decode_phases_json()},
            "experts": self.experts_json,
            "from_peers": self.from_peers,
            "fetch_mb_s": self.fetch_mb_s(),
            "disk": self.versus_disk_json(),
            "peer_vs_disk": self.disk_run.as_ref().map(|r| decode_tok_s / r.decode_tok_s),
            "late_disagreements": d.late_disagreements,
            "peak_rss_bytes": peak_rss(),
        })
    }

    /// The `prefill` list of `--json`: each prompt's speed against the peak, and where its
    /// time went (milliseconds per prompt token in each phase).
    fn prefill_json(&self) -> Vec<serde_json::Value> {
        let peak = self.ceilings.peak;
        self.prefills
            .iter()
            .map(|p| {
                // Milliseconds per prompt token in each phase.
                let phases: serde_json::Map<String, serde_json::Value> = Phase::ALL
                    .iter()
                    .map(|&ph| {
                        let ms =
                            p.phase_nanos[profile::index(ph)] as f64 / 1e6 / p.tokens.max(1) as f64;
                        (
                            ph.name().to_string(),
                            serde_json::json!({"ms_per_token": ms}),
                        )
                    })
                    .collect();
                serde_json::json!({
                    "tokens": p.tokens, "seconds": p.secs, "tok_s": p.tokens as f64 / p.secs,
                    "gflop_s": p.gflop_s, "fraction_of_peak": p.gflop_s * 1e9 / peak,
                    "phases": phases,
                })
            })
            .collect()
    }

    /// The `decode.phases` object of `--json`.
    fn decode_phases_json(&self) -> serde_json::Map<String, serde_json::Value> {
        self.decode_phases()
            .iter()
            .map(|&(name, ms, bytes, gb_s)| {
                (
                    name.to_string(),
                    serde_json::json!({"ms_per_token": ms, "bytes_per_token": bytes, "gb_s": gb_s}),
                )
            })
            .collect()
    }

    /// The `disk` object of `--json`: the run from the local disk beside the run from peers.
    fn versus_disk_json(&self) -> Option<serde_json::Value> {
        self.disk_run.as_ref().map(|d| {
            serde_json::json!({
                "prefill": d.prefill.iter().zip(&self.prefills).map(|(&(p, secs), peer)| {
                    serde_json::json!({"tokens": p, "tok_s": p as f64 / secs, "peer_vs_disk": secs / peer.secs})
                }).collect::<Vec<_>>(),
                "decode_tok_s": d.decode_tok_s,
            })
        })
    }

    /// The table: the machine, its ceilings, the speeds against them, the run from the local
    /// disk beside peers, the experts and the peak RSS. The CPU and the prefills are read from
    /// `out`, the `--json` object.
    fn print_table(&self, out: &serde_json::Value) {
        println!("model            {}", self.a.model.display());
        self.print_machine(&out["cpu"]);
        self.print_ceilings();
        self.print_speeds(&out["prefill"]);
        self.pairs.print_table();
        self.print_head();
        self.print_versus_disk();
        if let Some(f) = self.fetch_mb_s() {
            println!(
                "fetch            {f:.0} MB/s: MB of experts fetched from peers per second spent \
                 waiting for them (experts the peers computed are not fetched)"
            );
        }
        println!("{}", self.experts_table);
        if let Some(r) = peak_rss() {
            println!(
                "peak RSS         {} (with the {} bandwidth probe)",
                human_bytes(r),
                human_bytes(self.ceilings.probe.bytes())
            );
        }
    }

    /// The `threads` and `cpu` lines.
    fn print_machine(&self, cpu: &serde_json::Value) {
        let a = self.a;
        let isa = self.ceilings.isa;
        let default_ahead = self.decoded.default_ahead;
        let approx: Vec<&str> = [
            (a.int8_attn_head, "int8 attention/head"),
            (a.int8_experts, "int8 expert inputs"),
        ]
        .iter()
        .filter_map(|&(on, what)| on.then_some(what))
        .collect();
        println!(
            "threads          {} (kernels: {}; {})",
            rayon::current_num_threads(),
            if isa == stormo_engine::kernels::Isa::Avx512 {
                format!("{}, prefetching {default_ahead} B ahead", isa.name())
            } else {
                isa.name().to_string()
            },
            if approx.is_empty() {
                "exact".to_string()
            } else {
                format!("approximate: {}", approx.join(", "))
            }
        );
        println!(
            "cpu              {}{}",
            cpu["name"].as_str().unwrap_or("unknown"),
            match (cpu["family"].as_u64(), cpu["model"].as_u64()) {
                (Some(f), Some(m)) => format!(" (family {f}, model {m})"),
                _ => String::new(),
            }
        );
    }

    /// The `memory`, `kernels`, `disk`, `per decoded token` and `floating point` lines.
    fn print_ceilings(&self) {
        let (c, s, costs) = (self.ceilings, &self.spread, &self.plan.costs);
        let kernel_rates = s.kernels();
        let (kernels_before, kernels_during, kernels_after) =
            (c.kernels_start, s.kernels_during, s.kernels_end);
        println!(
            "memory           {:.1} GB/s read (median between decoded tokens, from {:.1} to {:.1}; {:.1} at start, {:.1} at the end)",
            s.mem / 1e9,
            s.mem_min / 1e9,
            s.mem_max / 1e9,
            c.mem_start / 1e9,
            s.mem_end / 1e9
        );
        println!(
            "kernels          stream {:.1} GB/s bf16, {:.1} GB/s MXFP4 through one position (median between decoded tokens, from {:.1}/{:.1} to {:.1}/{:.1}; start {:.1}/{:.1}, end {:.1}/{:.1})",
            kernel_rates.bf16 / 1e9,
            kernel_rates.mxfp4 / 1e9,
            kernels_during.bf16[0] / 1e9,
            kernels_during.mxfp4[0] / 1e9,
            kernels_during.bf16[2] / 1e9,
            kernels_during.mxfp4[2] / 1e9,
            kernels_before.bf16 / 1e9,
            kernels_before.mxfp4 / 1e9,
            kernels_after.bf16 / 1e9,
            kernels_after.mxfp4 / 1e9
        );
        match c.disk {
            Some((d, direct)) => println!(
                "disk             {:.2} GB/s read{}",
                d / 1e9,
                if direct {
                    " (O_DIRECT)"
                } else {
                    " (page cache may help)"
                }
            ),
            None if self.plan.disk_test > 0 => println!(
                "disk             not measured: it reads whole 4 MiB blocks, more than --disk-test \
                 or the largest checkpoint file holds"
            ),
            None => {}
        }
        println!(
            "per decoded token {} must be read{}: bound {:.2} tok/s at memory speed, {:.2} at the kernels' speed",
            human_bytes(costs.bpt),
            if self.screened_head {
                format!(
                    " (the head through its 8-bit screen; {} with --full-head)",
                    human_bytes(costs.bpt_full_head)
                )
            } else {
                String::new()
            },
            s.memory_bound(costs),
            s.kernel_bound(costs)
        );
        let flops_tok = costs.flops_tok;
        println!(
            "floating point   {:.1} GFLOP/s peak ({} fused multiply-adds on registers, all threads); prefill costs {} per token and one output-head pass per prompt",
            c.peak / 1e9,
            c.isa.name(),
            if flops_tok >= 1e9 {
                format!("{:.2} GFLOP", flops_tok / 1e9)
            } else {
                format!("{:.3} MFLOP", flops_tok / 1e6)
            }
        );
    }

    /// The `prefill` lines (from `prefill`, the `--json` object's list) with their phases, the
    /// `decode` line with its phases, and the `sampled` line.
    fn print_speeds(&self, prefill: &serde_json::Value) {
        let (s, costs) = (&self.spread, &self.plan.costs);
        // The first run's lines say where its experts came from when a second run follows.
        let from = if self.from_peers {
            "; experts from peers"
        } else {
            ""
        };
        for p in prefill.as_array().expect("list") {
            println!(
                "prefill {:>5} tok {:>8.2} tok/s = {:.1} GFLOP/s, {:.0}% of the peak{from}",
                p["tokens"].as_u64().unwrap_or(0),
                p["tok_s"].as_f64().unwrap_or(0.0),
                p["gflop_s"].as_f64().unwrap_or(0.0),
                100.0 * p["fraction_of_peak"].as_f64().unwrap_or(0.0)
            );
            let phases: Vec<String> = Phase::ALL
                .iter()
                .map(|ph| {
                    let ms = p["phases"][ph.name()]["ms_per_token"]
                        .as_f64()
                        .unwrap_or(0.0);
                    format!("{} {ms:.2}", ph.name())
                })
                .collect();
            println!(
                "  phases         ms per prompt token: {}",
                phases.join(", ")
            );
        }
        let decode_tok_s = self.decode_tok_s();
        println!(
            "decode  {:>5} tok {:>8.2} tok/s = {:.0}% of the memory bound, {:.0}% of the kernel bound; disk {} per token{from}",
            self.a.decode_tokens,
            decode_tok_s,
            100.0 * decode_tok_s / s.memory_bound(costs),
            100.0 * decode_tok_s / s.kernel_bound(costs),
            human_bytes(self.disk_per_tok() as u64)
        );
        let listed: Vec<String> = self
            .decode_phases()
            .iter()
            .map(|&(name, ms, _, gb_s)| match gb_s {
                Some(r) if r >= 0.05 => format!("{name} {ms:.1} ({r:.1} GB/s)"),
                _ => format!("{name} {ms:.1}"),
            })
            .collect();
        println!(
            "phases           ms per decoded token: {}",
            listed.join(", ")
        );
        let sampled_pair = self.sampled;
        println!(
            "sampled          temperature 0.7 {:.2} tok/s, greedy {:.2} tok/s (alternate decoded tokens): {:.3}x",
            sampled_pair.sampled_tok_s,
            sampled_pair.greedy_tok_s,
            sampled_pair.sampled_tok_s / sampled_pair.greedy_tok_s
        );
    }

    /// The `head` line, when the head is screened.
    fn print_head(&self) {
        if self.screened_head {
            let screen = self.decoded.screen;
            println!(
                "head             screened: {:.1} exact rows per decoded token on average (of {}); the whole head computed for {} of {} greedy tokens",
                screen.rows_per_token(),
                self.plan.vocab,
                screen.full,
                screen.screened + screen.full
            );
        }
    }

    /// The lines of the run from the local disk beside the run from peers.
    fn print_versus_disk(&self) {
        let Some(d) = &self.disk_run else {
            return;
        };
        for (&(p, secs), peer) in d.prefill.iter().zip(&self.prefills) {
            println!(
                "prefill {p:>5} tok {:>8.2} tok/s from the local disk: experts from peers {:.2}x that",
                p as f64 / secs,
                secs / peer.secs
            );
        }
        println!(
            "decode  {:>5} tok {:>8.2} tok/s from the local disk: experts from peers {:.2}x that",
            self.a.decode_tokens,
            d.decode_tok_s,
            self.decode_tok_s() / d.decode_tok_s
        );
    }
}

/// The process's peak resident memory (`VmHWM`), bytes.
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(l.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}
