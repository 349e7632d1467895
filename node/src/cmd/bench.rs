//! `stormo bench`: prefill and decode speed of a model on this machine, beside the physical
//! bounds measured by the same command (memory and disk bandwidth).
//!
//! Two decode bounds are measured, and both are reported: the **memory bound** (the bytes a
//! token must read over the rate at which a plain sum of a large buffer reads memory, the
//! probe) and the **kernel bound** (the same bytes over the rate at which the decode kernels
//! themselves stream a matrix larger than the caches through one position: a bf16 matrix
//! for the dense weights, an MXFP4 one for GPT-OSS's experts). The second is what a core
//! that also computes can reach; the gap between the two is the kernels' cost beyond reading.
//! `fraction_of_memory_bound` uses the first, `fraction_of_kernel_bound` the second. Both
//! probes are sampled at the start, between decoded tokens and at the end, and each bound
//! uses the median of its samples between decoded tokens: it is measured over the same
//! minutes as the decode it judges, and the noise of a shared machine shows in the report
//! (the memory probe's rate moved 15-65 GB/s within one run on the 2-vCPU Zen 4 VM).
//!
//! [`run`] is the list of steps; each phase lives in its own module: `costs` (what a token
//! costs, counted from the checkpoint), `ceilings` (the probes and the bounds), `peers`
//! (`--peer`, and the same run from the local disk beside it), `timed` (the node, warming,
//! prefill, decode), `paired` (the `--pair-*` comparisons) and `report` (`--json` and the
//! table).

mod ceilings;
mod costs;
mod paired;
mod peers;
mod report;
mod timed;

use std::path::PathBuf;

use stormo_engine::{LoadOptions, ModelFiles};

use crate::args::{ExpertArgs, PeerArgs};
use stormo_net::progress::parse_size;

pub use ceilings::{cpu_identity, KernelRates, KernelSamples, MemoryProbe};
pub use costs::{bytes_per_token, expert_bytes_per_token, phase_bytes, prefill_flops};

/// Arguments of `stormo bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model directory.
    #[arg(short, long, value_name = "DIR")]
    pub model: PathBuf,
    /// Prompt lengths to time prefill at (comma separated).
    #[arg(
        long,
        default_value = "64,128",
        value_delimiter = ',',
        value_name = "N,.."
    )]
    pub prompt_tokens: Vec<usize>,
    /// Tokens to decode after the last prompt (at least 1).
    #[arg(long, default_value_t = 32, value_name = "N", value_parser = positive)]
    pub decode_tokens: usize,
    /// Seed of the random prompt tokens.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub seed: u64,
    /// Warm the expert cache before timing, as in a long-running server: load every expert
    /// when the cache budget holds them all (experts resident) and run one untimed forward
    /// pass of a few tokens (so the dense weights are in memory too), else run one untimed
    /// prefill of the longest prompt. Without it, timing starts from a cold cache.
    #[arg(long)]
    pub warm: bool,
    /// Size of the buffer read to measure memory bandwidth, at start, between decoded tokens
    /// and at the end, and streamed by the decode kernels (as a bf16 and an MXFP4 matrix) at
    /// start and end for the kernel bound (it stays allocated, so it counts in the peak RSS
    /// reported). At least 512 KiB; a buffer that fits the last-level cache measures the
    /// cache, not memory.
    #[arg(long, default_value = "256MiB", value_name = "SIZE", value_parser = mem_test_size)]
    pub mem_test: String,
    /// Bytes to read from the checkpoint to measure disk bandwidth (0 skips it).
    #[arg(long, default_value = "1GiB", value_name = "SIZE", value_parser = stormo_net::progress::size_arg)]
    pub disk_test: String,
    /// Lab switch (hidden): positions per prefill block (at least 1).
    #[arg(long, hide = true, default_value_t = 128, value_name = "N", value_parser = positive)]
    pub prefill_block: usize,
    /// Lab switch (hidden): run attention projections and the output head from 8-bit
    /// row-scaled copies made at load: about a third fewer bytes per decoded token on GPT-OSS,
    /// approximate (the exact path is the default; docs/design.md gives the measured
    /// agreement).
    #[arg(long, hide = true)]
    pub int8_attn_head: bool,
    /// Lab switch (hidden): multiply MXFP4 experts by inputs rounded to int8 in blocks of 32
    /// (integer products, AVX-512 VNNI where the CPU has it; fewer instructions per weight
    /// than the exact path, which matters where the expert kernel, not memory, is the limit,
    /// as in prefill; the same bits on every CPU). Approximate (the exact path is the
    /// default; docs/design.md gives the measured agreement, docs/performance.md the speeds).
    #[arg(long, hide = true)]
    pub int8_experts: bool,
    /// Compute every row of the exact output head for each token (the decode and each
    /// prompt's last position are greedy). By default an 8-bit copy of the head finds the
    /// few rows that can hold the largest logit and only those are computed exactly: the same
    /// tokens, about half the head's bytes read per token. Lab switch (hidden).
    #[arg(long, hide = true)]
    pub full_head: bool,
    /// Alternate decoded tokens between the screened head and the whole exact head, and
    /// report both speeds: a paired comparison, fair on a machine whose memory speed drifts
    /// between runs (the decode line then mixes the two). Lab switch (hidden).
    #[arg(long, hide = true, conflicts_with_all = ["full_head", "int8_attn_head"])]
    pub pair_full_head: bool,
    /// Alternate decoded tokens between two distances (bytes, as A,B, e.g. 512,2048) at which
    /// the AVX-512 decode kernels prefetch each weight stream, and report both speeds and the
    /// median ratio of neighbouring tokens: a paired comparison, for tuning a CPU (the
    /// default distance is 512 bytes on Zen 4, 2 KiB elsewhere; other ISAs prefetch by rows
    /// and ignore it). Lab switch (hidden).
    #[arg(long, hide = true, value_name = "A,B", value_parser = prefetch_pair, conflicts_with = "pair_full_head")]
    pub pair_prefetch: Option<[usize; 2]>,
    /// Alternate decoded tokens between two numbers of tasks per thread (as A,B, e.g. 6,2)
    /// that the kernels split a parallel product into, and report both speeds and the median
    /// ratio of neighbouring tokens: a paired comparison of the balance between threads
    /// against the cost of each task's start (the default is 6). Lab switch (hidden).
    #[arg(long, hide = true, value_name = "A,B", value_parser = tasks_pair, conflicts_with_all = ["pair_full_head", "pair_prefetch"])]
    pub pair_tasks: Option<[usize; 2]>,
    /// Alternate completion-driven MoE (each group's experts computed as they land, the next
    /// group of the layer loaded meanwhile; the default) with fetching each group whole, then
    /// computing it: decoded tokens alternate, and after the timed prefills each prompt length
    /// is prefilled four more times on a new prompt (fetch-then-compute, completion-driven,
    /// completion-driven, fetch-then-compute). Both speeds, their ratios and whether the
    /// prefills' next tokens agree are reported. Meant for a RAM budget below the experts
    /// (`--expert-cache`, `--no-hot-store`). Lab switch (hidden).
    #[arg(long, hide = true, conflicts_with_all = ["pair_full_head", "pair_prefetch", "pair_tasks"])]
    pub pair_completion: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw the figures as an SVG chart: prefill and decode speed beside the decode
    /// bound at memory speed (and llama.cpp's figures, with --svg-llama).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// llama.cpp's figures for the chart: the JSON `llama-bench -o json` prints (as
    /// `.ci/llamacpp-side-by-side.sh` keeps it).
    #[arg(long, value_name = "FILE", requires = "svg")]
    pub svg_llama: Option<PathBuf>,
    /// The name the chart gives the figures of --svg-llama (e.g. ik_llama.cpp, whose
    /// `llama-bench` prints the same JSON).
    #[arg(
        long,
        value_name = "NAME",
        default_value = "llama.cpp",
        requires = "svg_llama"
    )]
    pub svg_llama_name: String,
    /// Where experts come from.
    #[command(flatten)]
    pub experts: ExpertArgs,
    /// Peers: with --peer every expert comes from peers (none from the local disk), and when
    /// the folder holds the experts the same prompts and decode run again from the local disk
    /// at the same RAM budget, side by side (`peer_vs_disk`, the decode ratio, and
    /// `fetch_mb_s`, MB from peers per second the model waited for experts, in --json). A
    /// folder from `stormo pull` holds only the dense weights: then only the peers' run.
    #[command(flatten)]
    pub net: PeerArgs,
}

/// A `--mem-test` size: a size of at least 512 KiB (a smaller probe would only time the cache).
fn mem_test_size(s: &str) -> Result<String, String> {
    let n = parse_size(s)?;
    if n < MemoryProbe::MIN as u64 {
        return Err(format!(
            "{s:?} is smaller than the probe's minimum of 512 KiB"
        ));
    }
    Ok(s.to_owned())
}

/// A `--pair-tasks` pair: two numbers of tasks per thread, from 1 to 64.
fn tasks_pair(s: &str) -> Result<[usize; 2], String> {
    let parse = |v: &str| -> Result<usize, String> {
        match v.trim().parse::<usize>() {
            Ok(n) if (1..=64).contains(&n) => Ok(n),
            _ => Err(format!(
                "{v:?} is not a number of tasks per thread from 1 to 64"
            )),
        }
    };
    match s.split(',').collect::<Vec<_>>()[..] {
        [a, b] => Ok([parse(a)?, parse(b)?]),
        _ => Err(format!(
            "{s:?} is not two numbers A,B (tasks per thread, e.g. 6,2)"
        )),
    }
}

/// A `--pair-prefetch` pair: two distances in bytes of at most 1 MiB (a prefetch further
/// ahead than that would only evict what the kernels are about to read).
fn prefetch_pair(s: &str) -> Result<[usize; 2], String> {
    let parse = |v: &str| -> Result<usize, String> {
        let n = parse_size(v.trim())?;
        if n > 1 << 20 {
            return Err(format!("{v:?} is more than 1 MiB ahead"));
        }
        Ok(n as usize)
    };
    match s.split(',').collect::<Vec<_>>()[..] {
        [a, b] => Ok([parse(a)?, parse(b)?]),
        _ => Err(format!(
            "{s:?} is not two distances A,B (bytes, e.g. 512,2048)"
        )),
    }
}

/// A count of at least 1.
fn positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

/// Runs `stormo bench`.
pub fn run(a: Args) -> anyhow::Result<()> {
    // First: the tokenizer and the probes use the pool whose size this sets.
    stormo_node::config::start_engine_threads(a.experts.threads)?;
    let (plan, files) = Plan::resolve(&a)?;
    let say = Progress { quiet: a.json };
    let mut ceilings = ceilings::Ceilings::measure(plan.mem_test, plan.disk_test, &files, say)?;
    let source = peers::Source::resolve(&a, say)?;
    let mut rig = timed::Rig::start(&a, &plan, source.local(), source.peers, files)?;
    if a.warm {
        say.say("warming the expert cache...");
        rig.warm(&plan)?;
    }
    let (prefills, mut sess, next) = rig.prefill(&a, &plan, say)?;
    let paired_prefill = if a.pair_completion {
        Some(rig.paired_prefill(&a, &plan, say)?)
    } else {
        None
    };
    let decoded = rig.decode(&a, &mut sess, next, &mut ceilings, say)?;
    let spread = ceilings.after_decode();
    let experts_after = rig.experts.stats();
    let sampled = rig.decode_sampled(&mut sess, decoded.last, a.decode_tokens, say)?;
    ceilings.measure_peak_again(say);
    let screened_head = rig.model.has_screened_head();
    let (experts_json, experts_table) = rig.finish(sess);
    let disk_run = if source.beside_disk {
        say.say("the same prompts and decode from the local disk, without peers...");
        Some(peers::disk_run(&a, &plan)?)
    } else {
        None
    };
    report::Report {
        pairs: paired::Pairs::new(
            &a,
            decoded.full_head_pair,
            &decoded.by_parity,
            paired_prefill,
        ),
        a: &a,
        plan: &plan,
        ceilings: &ceilings,
        spread,
        prefills,
        decoded,
        sampled,
        experts_after,
        experts_json,
        experts_table,
        screened_head,
        from_peers: source.from_peers,
        disk_run,
    }
    .write()
}

/// Progress lines on stderr, none with `--json`.
#[derive(Clone, Copy, Debug)]
struct Progress {
    quiet: bool,
}

impl Progress {
    fn say(self, m: impl std::fmt::Display) {
        if !self.quiet {
            eprintln!("{m}");
        }
    }
}

/// What a run measures, resolved from its arguments and the model's files before anything is
/// measured: the probes' sizes, the sessions' context, how the model loads, what its tokens
/// cost, and the chart to draw.
#[derive(Debug)]
struct Plan {
    /// Bytes of the bandwidth probe (`--mem-test`).
    mem_test: u64,
    /// Bytes of the checkpoint to read for the disk's rate (`--disk-test`; 0: none).
    disk_test: u64,
    /// The longest prompt, in tokens.
    max_p: usize,
    /// Positions of every session: the longest prompt, the greedy decode, then as many tokens
    /// alternated greedy and sampled.
    context: usize,
    /// How the model loads.
    load: LoadOptions,
    /// What a token costs.
    costs: costs::Costs,
    /// The vocabulary's size (prompts are random tokens below it).
    vocab: u64,
    /// Bytes of every expert, by layer.
    sizes: Vec<Vec<u64>>,
    /// The chart, with `--svg`.
    svg: Option<crate::plot::BenchSvg>,
}

impl Plan {
    /// The plan for `a`, and the model's files (opened once: for the disk's rate, then for
    /// the node the run starts on).
    fn resolve(a: &Args) -> anyhow::Result<(Self, ModelFiles)> {
        anyhow::ensure!(
            !a.prompt_tokens.is_empty() && a.prompt_tokens.iter().all(|&p| p > 0),
            "--prompt-tokens needs positive lengths"
        );
        let mem_test = parse_size(&a.mem_test).map_err(|e| anyhow::anyhow!("--mem-test: {e}"))?;
        let disk_test =
            parse_size(&a.disk_test).map_err(|e| anyhow::anyhow!("--disk-test: {e}"))?;
        let files = stormo_node::node::open_model(&a.model)?;
        let svg = crate::plot::BenchSvg::resolve(
            a.svg.as_deref(),
            a.svg_llama
                .as_deref()
                .map(|l| (l, a.svg_llama_name.as_str())),
            &a.model,
            &files.cfg,
        )?;
        let max_p = *a.prompt_tokens.iter().max().expect("non-empty");
        // The greedy decode, then as many tokens alternated greedy and sampled (decode_sampled).
        let context = max_p.saturating_add(a.decode_tokens.saturating_mul(2));
        anyhow::ensure!(
            context <= files.cfg.max_position_embeddings,
            "the longest prompt ({}) and twice --decode-tokens {} (a greedy decode, then as many \
             tokens greedy and sampled alternated) need {context} positions ({max_p} + 2 × {}), \
             more than the model's context of {} (max_position_embeddings)",
            crate::cmd::run::count(max_p, "token"),
            a.decode_tokens,
            a.decode_tokens,
            files.cfg.max_position_embeddings
        );
        let plan = Self {
            mem_test,
            disk_test,
            max_p,
            context,
            load: LoadOptions {
                prefill_block: a.prefill_block,
                int8_attn_head: a.int8_attn_head,
                int8_experts: a.int8_experts,
                screened_head: !a.full_head,
            },
            costs: costs::Costs::of(&files, a.int8_attn_head, !a.full_head),
            vocab: files.cfg.vocab_size as u64,
            sizes: files.layout.sizes(),
            svg,
        };
        Ok((plan, files))
    }
}

#[cfg(test)]
mod tests {
    /// Sizes and counts the run could not use are usage errors naming the argument, before
    /// any work starts (they were once raised or used silently).
    #[test]
    fn bad_arguments_are_refused_at_parse_time() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["stormo", "bench", "--model", "m"];
            argv.extend_from_slice(extra);
            crate::cli::Cli::try_parse_args(argv).map_err(|e| e.to_string())
        };
        for (args, needle) in [
            (&["--prefill-block", "0"][..], "--prefill-block"),
            (&["--prefill-block", "x"], "--prefill-block"),
            (&["--mem-test", "1KiB"], "minimum of 512 KiB"),
            (&["--mem-test", "lots"], "--mem-test"),
            (&["--disk-test", "1 parsec"], "--disk-test"),
            (&["--pair-prefetch", "512"], "not two distances"),
            (&["--pair-prefetch", "1,2,3"], "not two distances"),
            (&["--pair-prefetch", "0,2MiB"], "more than 1 MiB ahead"),
            (&["--pair-prefetch", "0,far"], "--pair-prefetch"),
            (
                &["--pair-prefetch", "0,64", "--pair-full-head"],
                "cannot be used with",
            ),
            (&["--pair-tasks", "6"], "not two numbers"),
            (&["--pair-tasks", "0,6"], "from 1 to 64"),
            (&["--pair-tasks", "6,65"], "from 1 to 64"),
            (&["--pair-tasks", "6,x"], "from 1 to 64"),
            (
                &["--pair-tasks", "6,2", "--pair-prefetch", "0,64"],
                "cannot be used with",
            ),
        ] {
            let err = parse(args).expect_err(&format!("{args:?} must be refused"));
            assert!(err.contains(needle), "{args:?}: {err}");
        }
        for args in [
            &["--prefill-block", "1"][..],
            &["--mem-test", "512KiB"],
            &["--disk-test", "0"],
            &["--pair-prefetch", "0, 1MiB"],
            &["--pair-tasks", "1, 64"],
        ] {
            parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        }
    }
}
