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

use std::io::Read;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use rayon::prelude::*;
use stormo_engine::generate::argmax;
use stormo_engine::profile::{self, Phase};
use stormo_engine::{LoadOptions, Logits, Model, ModelFiles, Session};

use crate::args::{ExpertArgs, PeerArgs};
use stormo_net::progress::{human_bytes, parse_size};
use stormo_node::config::{LocalExperts, NodeConfig};
use stormo_node::node::Node;

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
    /// (integer products; fewer instructions per weight than the exact path on AVX2 CPUs,
    /// which matters where the expert kernel, not memory, is the limit; on AVX-512 CPUs the
    /// exact kernel is the faster one). Approximate (the exact path is the default;
    /// docs/design.md gives the measured agreement and speeds).
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

/// Measures memory read bandwidth: parallel sums over an anonymous mapping much larger than
/// the caches (advised to use transparent huge pages where the system allows), read in
/// 512 KiB pieces per task: the best this simple stream reaches, the ceiling decode is judged
/// against.
#[derive(Debug)]
pub struct MemoryProbe {
    buf: memmap2::MmapMut,
    samples: Vec<f64>,
    /// Whether the buffer holds the kernel probe's matrices yet.
    kernels_laid_out: bool,
    kernel_samples: Vec<KernelRates>,
}

impl MemoryProbe {
    /// The smallest probe buffer, in bytes (smaller sizes are raised to it).
    pub const MIN: usize = 512 << 10;

    /// A probe over `bytes` of memory (at least [`Self::MIN`]).
    pub fn new(bytes: usize) -> anyhow::Result<Self> {
        let len = bytes.max(Self::MIN) / 8 * 8;
        let mut buf = memmap2::MmapMut::map_anon(len).with_context(|| {
            format!(
                "mapping {} for the bandwidth probe",
                human_bytes(len as u64)
            )
        })?;
        #[cfg(target_os = "linux")]
        {
            // Advice only: without huge pages the probe reads a little slower.
            let _ = buf.advise(memmap2::Advice::HugePage);
        }
        for (i, w) in buf.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(i as u64).to_le_bytes());
        }
        Ok(Self {
            buf,
            samples: Vec::new(),
            kernels_laid_out: false,
            kernel_samples: Vec::new(),
        })
    }

    /// Bytes the probe reads.
    pub fn bytes(&self) -> u64 {
        self.buf.len() as u64
    }

    /// Reads the whole buffer once on every thread of the pool (the kernels' helpers parked
    /// first: see [`stormo_engine::kernels::park_helpers`]); records and returns the rate
    /// in bytes/s.
    pub fn sample(&mut self) -> f64 {
        // The kernels' helper threads spin for a while after a token; the probe wants the cores.
        stormo_engine::kernels::park_helpers();
        let t = Instant::now();
        let s: u64 = self
            .buf
            .par_chunks(1 << 19)
            .map(|c| {
                c.chunks_exact(8)
                    .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                    .fold(0u64, u64::wrapping_add)
            })
            // Wrapping, as within a piece: the bytes are whatever the buffer holds, and an
            // overflow check (debug builds) would panic on them.
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
        let rate = self.buf.len() as f64 / t.elapsed().as_secs_f64();
        self.samples.push(rate);
        rate
    }

    /// The lowest and highest of the samples taken since the last [`take`](Self::take).
    pub fn range(&self) -> Option<(f64, f64)> {
        let lo = self.samples.iter().copied().reduce(f64::min)?;
        let hi = self.samples.iter().copied().reduce(f64::max)?;
        Some((lo, hi))
    }

    /// The median of the samples taken since the last [`take`](Self::take), and clears them.
    pub fn take(&mut self) -> Option<f64> {
        let mut s = std::mem::take(&mut self.samples);
        s.sort_by(f64::total_cmp);
        s.get(s.len() / 2).copied()
    }
}

/// The CPU: its vendor, family and model (x86's CPUID, as `/proc/cpuinfo` counts them) and
/// its name, so a figure says what machine kind it came from.
pub fn cpu_identity() -> serde_json::Value {
    let name = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| {
        t.lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    });
    match stormo_engine::kernels::CpuId::get() {
        Some(c) => serde_json::json!({
            "vendor": c.vendor,
            "family": c.family,
            "model": c.model,
            "name": name,
        }),
        None => serde_json::json!({ "arch": std::env::consts::ARCH, "name": name }),
    }
}

/// Bytes/s of the bf16 and the MXFP4 decode kernels.
#[derive(Clone, Copy, Debug)]
pub struct KernelRates {
    /// bf16 (the dense weights: attention, head).
    pub bf16: f64,
    /// MXFP4 (GPT-OSS's experts).
    pub mxfp4: f64,
}

impl MemoryProbe {
    /// The input width of the kernel probe's matrices (GPT-OSS's hidden size; a multiple of
    /// 32).
    const COLS: usize = 2880;

    /// The rate at which the decode kernels stream weights through one position, over the
    /// probe's own buffer (no more memory): its first half as one bf16 matrix, its second as
    /// one MXFP4 matrix at GPT-OSS's hidden width, each with normal values only (no
    /// subnormals to slow a core down), each timed as the median of five passes after a
    /// warm-up. The first call rewrites the buffer's bytes (the bandwidth probe reads any
    /// bytes).
    pub fn kernel_rates(&mut self) -> KernelRates {
        let (bf16, mxfp4) = self.kernel_passes(time_rate);
        KernelRates { bf16, mxfp4 }
    }

    /// One timed pass of each kernel, as [`kernel_rates`](Self::kernel_rates) times five,
    /// recorded for [`take_kernels`](Self::take_kernels): sampled between decoded tokens, so
    /// the kernel bound is measured over the same minutes as the decode it judges.
    pub fn sample_kernels(&mut self) {
        let (bf16, mxfp4) = self.kernel_passes(|bytes, f| {
            let t = Instant::now();
            f();
            bytes / t.elapsed().as_secs_f64()
        });
        self.kernel_samples.push(KernelRates { bf16, mxfp4 });
    }

    /// The median and the range of each kernel's samples since the last call, and clears
    /// them; `None` without samples.
    pub fn take_kernels(&mut self) -> Option<KernelSamples> {
        let s = std::mem::take(&mut self.kernel_samples);
        let stats = |f: fn(&KernelRates) -> f64| {
            let mut v: Vec<f64> = s.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            Some([*v.first()?, v[v.len() / 2], *v.last()?])
        };
        Some(KernelSamples {
            bf16: stats(|r| r.bf16)?,
            mxfp4: stats(|r| r.mxfp4)?,
        })
    }

    /// Times the bf16 and the MXFP4 kernel over the buffer with `time` (given the bytes and
    /// one pass), laying the buffer out for them first if not done yet.
    fn kernel_passes(&mut self, time: impl Fn(f64, &mut dyn FnMut()) -> f64) -> (f64, f64) {
        use stormo_engine::kernels::{matvec, Float, Mat};
        let cols = Self::COLS;
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let mut y = Vec::new();
        let half = self.buf.len() / 2;
        let (first, second) = self.buf.split_at_mut(half);
        let rows = first.len() / (2 * cols);
        let dense = &mut first[..rows * cols * 2];
        let row_bytes = cols / 2 + cols / 32;
        let mx_rows = second.len() / row_bytes;
        let (blocks, scales) = second[..mx_rows * row_bytes].split_at_mut(mx_rows * cols / 2);
        if !self.kernels_laid_out {
            // bf16: exponents forced into [2^-8, 2^8).
            for e in dense.chunks_exact_mut(2) {
                let v = u16::from_le_bytes([e[0], e[1]]);
                let v = (v & 0x807f) | ((((v >> 7) & 0xf) + 0x77) << 7);
                e.copy_from_slice(&v.to_le_bytes());
            }
            // MXFP4: any nibbles, scales from 2^-7 to 2^8.
            for b in scales.iter_mut() {
                *b = 120 + *b % 16;
            }
            self.kernels_laid_out = true;
        }
        let bf16 = {
            let w = Mat::Dense {
                fmt: Float::BF16,
                bytes: dense,
                rows,
                cols,
            };
            y.resize(rows, 0.0);
            time((rows * cols * 2) as f64, &mut || matvec(&w, &x, &mut y))
        };
        let mxfp4 = {
            let w = Mat::Mxfp4 {
                blocks,
                scales,
                rows: mx_rows,
                cols,
            };
            y.resize(mx_rows, 0.0);
            time((mx_rows * row_bytes) as f64, &mut || matvec(&w, &x, &mut y))
        };
        (bf16, mxfp4)
    }
}

/// Each kernel's rate sampled between decoded tokens, as `[min, median, max]` bytes/s.
#[derive(Clone, Copy, Debug)]
pub struct KernelSamples {
    /// bf16 (the dense weights).
    pub bf16: [f64; 3],
    /// MXFP4 (GPT-OSS's experts).
    pub mxfp4: [f64; 3],
}

/// `bytes` over the median time of five runs of `f` after one untimed run.
fn time_rate(bytes: f64, f: &mut dyn FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..5)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    bytes / t[2]
}

/// Tokens of the untimed forward pass `--warm` runs when every expert is resident.
const WARM_TOKENS: usize = 8;

/// Floating-point operations of the matrix products one prompt token costs (two per weight
/// it multiplies: attention projections, router, top-k experts or the dense MLP), and those of
/// the head, paid once per prefill. Attention over the cache is left out (a few percent at
/// these prompt lengths).
pub fn prefill_flops(cfg: &stormo_engine::ModelConfig) -> (f64, f64) {
    let h = cfg.hidden_size as f64;
    let attn = h * cfg.head_dim as f64 * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) as f64;
    let per_layer = |moe: bool| {
        if moe {
            attn + h * cfg.num_experts as f64
                + 3.0 * h * (cfg.expert_intermediate * cfg.top_k) as f64
        } else {
            attn + 3.0 * h * cfg.dense_intermediate as f64
        }
    };
    let weights: f64 = (0..cfg.num_layers)
        .map(|l| per_layer(cfg.layer_moe.get(l).copied().unwrap_or(true)))
        .sum();
    (2.0 * weights, 2.0 * h * cfg.vocab_size as f64)
}

/// Disk read bandwidth in bytes/s over the largest checkpoint file (O_DIRECT where allowed, so
/// the page cache does not flatter it). Returns the rate and whether O_DIRECT was used.
fn disk_bandwidth(files: &ModelFiles, limit: u64) -> anyhow::Result<Option<(f64, bool)>> {
    use std::os::unix::fs::OpenOptionsExt;
    let Some((path, len)) = files.layout.files.iter().max_by_key(|f| f.1).cloned() else {
        return Ok(None);
    };
    let want = limit.min(len) as usize / (4 << 20) * (4 << 20);
    if want == 0 {
        return Ok(None);
    }
    let (mut f, direct) = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_o_direct())
        .open(&path)
    {
        Ok(f) => (f, true),
        Err(_) => (
            std::fs::File::open(&path).with_context(|| path.display().to_string())?,
            false,
        ),
    };
    // a 4 KiB-aligned window of a larger buffer (O_DIRECT needs aligned memory)
    let mut raw = vec![0u8; (4 << 20) + 4096];
    let skew = raw.as_ptr() as usize % 4096;
    let off = if skew == 0 { 0 } else { 4096 - skew };
    let buf = &mut raw[off..off + (4 << 20)];
    let t = Instant::now();
    let mut done = 0;
    while done < want {
        let n = f.read(buf).with_context(|| path.display().to_string())?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(Some((done as f64 / t.elapsed().as_secs_f64(), direct)))
}

fn libc_o_direct() -> i32 {
    // O_DIRECT differs by architecture; the engine links libc for it.
    #[cfg(any(target_arch = "aarch64", target_arch = "arm"))]
    {
        0o200000
    }
    #[cfg(not(any(target_arch = "aarch64", target_arch = "arm")))]
    {
        0o40000
    }
}

fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(l.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Bytes each decoded token must read: every dense weight except the embedding table (one row),
/// the head, and top-k experts in every MoE layer.
pub fn bytes_per_token(files: &ModelFiles, int8_attn_head: bool, screened_head: bool) -> u64 {
    phase_bytes(files, int8_attn_head, screened_head)
        .iter()
        .sum()
}

/// [`bytes_per_token`] by the phase of the forward pass that reads them, in
/// [`Phase::ALL`]'s order: the attention's norm and q/k/v, its sinks, its output projection,
/// the MLP's norm and router, the experts (or dense MLP), and the embedding row, final norm
/// and head.
pub fn phase_bytes(
    files: &ModelFiles,
    int8_attn_head: bool,
    screened_head: bool,
) -> [u64; profile::N] {
    let cfg = &files.cfg;
    let expert_names = files.layout.expert_tensor_names();
    let mut bytes = [0u64; profile::N];
    let mut add = |p: Phase, n: u64| bytes[profile::index(p)] += n;
    // With 8-bit copies, a matrix of `n` elements reads `n` bytes and one f32 per row.
    let int8 = |t: &stormo_engine::safetensors::TensorInfo| -> u64 {
        let elems: u64 = t.shape.iter().map(|&d| d as u64).product();
        elems + 4 * t.shape.first().copied().unwrap_or(0) as u64
    };
    let is_attn = |name: &str| {
        ["q_proj", "k_proj", "v_proj", "o_proj"]
            .iter()
            .any(|p| name.ends_with(&format!("self_attn.{p}.weight")))
    };
    let phase_of = |name: &str| {
        let has = |parts: &[&str]| parts.iter().any(|p| name.contains(p));
        if has(&[
            "q_proj",
            "k_proj",
            "v_proj",
            "q_norm",
            "k_norm",
            "input_layernorm",
        ]) {
            Phase::Qkv
        } else if has(&["o_proj"]) {
            Phase::OProj
        } else if has(&["sinks"]) {
            Phase::Attend
        } else if has(&["post_attention_layernorm", "router", "mlp.gate.weight"]) {
            Phase::Router
        } else if has(&["lm_head", "embed_tokens", "model.norm"]) {
            Phase::Head
        } else {
            Phase::Experts
        }
    };
    for (name, t) in &files.ckpt.tensors {
        if expert_names.contains(name.as_str()) {
            continue;
        }
        let head = name == "lm_head.weight";
        if name == "model.embed_tokens.weight" {
            // One row looked up per token; when tied it is also the head.
            add(Phase::Head, t.len / cfg.vocab_size.max(1) as u64);
            if cfg.tie_word_embeddings && !files.ckpt.tensors.contains_key("lm_head.weight") {
                add(
                    Phase::Head,
                    if int8_attn_head || screened_head {
                        int8(t)
                    } else {
                        t.len
                    },
                );
            }
        } else if (int8_attn_head && (head || is_attn(name))) || (screened_head && head) {
            add(phase_of(name), int8(t));
        } else {
            add(phase_of(name), t.len);
        }
    }
    add(Phase::Experts, expert_bytes_per_token(files).0);
    bytes
}

/// The experts' share of [`bytes_per_token`], and whether they are MXFP4 (else as wide as
/// the dense weights).
pub fn expert_bytes_per_token(files: &ModelFiles) -> (u64, bool) {
    let bytes = files
        .layout
        .sizes()
        .iter()
        .filter(|l| !l.is_empty())
        .map(|l| l[0] * files.cfg.top_k as u64)
        .sum();
    let mxfp4 = files.layout.schemas.iter().flatten().any(|s| {
        s.parts
            .iter()
            .any(|p| p.format == stormo_engine::moe::PartFormat::Mxfp4Blocks)
    });
    (bytes, mxfp4)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
}

/// Loads every expert when the RAM budget holds them all (so decode and prefill run
/// resident), else runs one prompt of `max_p` tokens; then the dense weights are in memory.
fn warm(
    model: &Model,
    experts: &stormo_node::experts::Experts,
    sizes: &[Vec<u64>],
    max_p: usize,
    prompt: &mut impl FnMut(usize) -> Vec<u32>,
) -> anyhow::Result<()> {
    let all: u64 = sizes.iter().flatten().sum();
    match &experts.tiered {
        Some(t) if t.budget() >= all => {
            let mut out = Vec::new();
            for (layer, l) in sizes.iter().enumerate() {
                let ids: Vec<usize> = (0..l.len()).collect();
                let batch = experts.provider.max_batch(layer).max(1);
                for chunk in ids.chunks(batch) {
                    experts.provider.fetch(layer, chunk, &mut out)?;
                    out.clear();
                }
            }
            // And a short forward pass, so the dense weights (mapped from the checkpoint) are
            // in memory too: otherwise the first prefill pays for reading them from disk
            // whenever the page cache has dropped them (after another program read a large
            // file, say), and measures the disk rather than the kernels.
            let n = WARM_TOKENS.min(max_p);
            let mut s = model.session(n)?;
            model.forward_greedy(&mut s, &prompt(n), None)?;
        }
        _ => {
            let mut s = model.session(max_p)?;
            model.forward_greedy(&mut s, &prompt(max_p), None)?;
        }
    }
    Ok(())
}

/// A prefill of `tokens` in a new session of `context` positions: the session, the next
/// token and the seconds it took.
fn prefill_once(
    model: &Model,
    context: usize,
    tokens: &[u32],
) -> anyhow::Result<(Session, u32, f64)> {
    let mut s = model.session(context)?;
    let t = Instant::now();
    let next = model.forward_greedy(&mut s, tokens, None)?.token;
    Ok((s, next, t.elapsed().as_secs_f64()))
}

/// What `bench --peer` measures from the local disk beside the run from peers.
struct DiskRun {
    /// (prompt tokens, seconds) per prompt.
    prefill: Vec<(usize, f64)>,
    /// Decode tokens per second.
    decode_tok_s: f64,
}

/// The run of `a` again with every expert from the local disk and no peers: the same prompts
/// (the same seed), the same warming and the same number of decoded tokens, at the same RAM
/// budget.
fn disk_run(
    a: &Args,
    context: usize,
    load: &LoadOptions,
    sizes: &[Vec<u64>],
    max_p: usize,
    vocab: u64,
) -> anyhow::Result<DiskRun> {
    let node = Node::start(NodeConfig {
        model: a.model.clone(),
        state_dir: a.experts.state_dir(),
        experts: a.experts.resolve()?,
        local: LocalExperts::All,
        context,
        peers: stormo_node::config::PeersConfig::default(),
        listen: None,
        swarm: None,
    })?;
    let experts = node.experts().clone();
    let model = node.load_model(load)?;
    let mut rng = Rng(a.seed);
    let mut prompt =
        |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next() % vocab) as u32).collect() };
    if a.warm {
        warm(&model, &experts, sizes, max_p, &mut prompt)?;
    }
    let mut prefill = Vec::new();
    let mut last = None;
    for &p in &a.prompt_tokens {
        let (s, next, secs) = prefill_once(&model, context, &prompt(p))?;
        prefill.push((p, secs));
        last = Some((s, next));
    }
    let (mut sess, mut tok) = last.expect("at least one prompt");
    let t = Instant::now();
    for _ in 0..a.decode_tokens {
        tok = model.forward_greedy(&mut sess, &[tok], None)?.token;
    }
    let decode_tok_s = a.decode_tokens as f64 / t.elapsed().as_secs_f64();
    node.finish_run();
    Ok(DiskRun {
        prefill,
        decode_tok_s,
    })
}

/// Runs `stormo bench`.
pub fn run(a: Args) -> anyhow::Result<()> {
    // First: the tokenizer and the probes use the pool whose size this sets.
    stormo_node::config::start_engine_threads(a.experts.threads)?;
    anyhow::ensure!(
        !a.prompt_tokens.is_empty() && a.prompt_tokens.iter().all(|&p| p > 0),
        "--prompt-tokens needs positive lengths"
    );
    let mem_test = parse_size(&a.mem_test).map_err(|e| anyhow::anyhow!("--mem-test: {e}"))?;
    let disk_test = parse_size(&a.disk_test).map_err(|e| anyhow::anyhow!("--disk-test: {e}"))?;
    let files = ModelFiles::open(&a.model)
        .with_context(|| format!("loading the model in {}", a.model.display()))?;
    let svg = crate::plot::BenchSvg::resolve(
        a.svg.as_deref(),
        a.svg_llama.as_deref(),
        &a.model,
        &files.cfg,
    )?;
    let max_p = *a.prompt_tokens.iter().max().expect("non-empty");
    // The greedy decode, then as many tokens alternated greedy and sampled (decode_sampled).
    let context = max_p.saturating_add(2 * a.decode_tokens);
    anyhow::ensure!(
        context <= files.cfg.max_position_embeddings,
        "the longest prompt ({max_p} tokens) and {} decoded tokens need {context} positions, more than the model's context of {} (max_position_embeddings)",
        a.decode_tokens,
        files.cfg.max_position_embeddings
    );
    let say = |m: String| {
        if !a.json {
            eprintln!("{m}");
        }
    };
    say("measuring memory bandwidth...".into());
    let mut probe = MemoryProbe::new(mem_test as usize)?;
    for _ in 0..5 {
        probe.sample();
    }
    let mem_before = probe.take().expect("five samples");
    say("measuring the kernels' streaming rate...".into());
    let kernels_before = probe.kernel_rates();
    let disk = if disk_test > 0 {
        say("measuring disk bandwidth...".into());
        disk_bandwidth(&files, disk_test)?
    } else {
        None
    };
    say("measuring the floating-point peak...".into());
    let isa = stormo_engine::kernels::Isa::process();
    let peak = stormo_engine::kernels::peak_flops(isa, 0.6);
    let (flops_tok, flops_head) = prefill_flops(&files.cfg);
    let bpt = bytes_per_token(&files, a.int8_attn_head, !a.full_head);
    let bpt_full_head = bytes_per_token(&files, a.int8_attn_head, false);
    let (expert_bpt, experts_mxfp4) = expert_bytes_per_token(&files);
    let per_phase = phase_bytes(&files, a.int8_attn_head, !a.full_head);
    let vocab = files.cfg.vocab_size as u64;
    let sizes = files.layout.sizes();
    drop(files);
    let peers = a.net.resolve(false)?;
    // With --peer every expert comes from peers, measured beside the same run from the local
    // disk when the folder holds the experts.
    let from_peers = !peers.peers.is_empty();
    let beside_disk = from_peers && !stormo_net::pull::Pulled::dense_only(&a.model)?;
    if from_peers && !beside_disk {
        say(format!(
            "{} holds no experts (pulled without them): measuring from peers only, with no \
             local-disk run beside it",
            a.model.display()
        ));
    }
    let load = LoadOptions {
        prefill_block: a.prefill_block,
        int8_attn_head: a.int8_attn_head,
        int8_experts: a.int8_experts,
        screened_head: !a.full_head,
    };
    let node = Node::start(NodeConfig {
        model: a.model.clone(),
        state_dir: a.experts.state_dir(),
        experts: a.experts.resolve()?,
        local: if from_peers {
            LocalExperts::None
        } else {
            LocalExperts::All
        },
        context,
        peers,
        listen: None,
        swarm: None,
    })?;
    let experts = node.experts().clone();
    let model = node.load_model(&load)?;
    let mut rng = Rng(a.seed);
    let mut prompt =
        |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next() % vocab) as u32).collect() };
    if a.warm {
        say("warming the expert cache...".into());
        warm(&model, &experts, &sizes, max_p, &mut prompt)?;
    }
    // (tokens, seconds, GFLOP/s) per prompt; reported against the peak once it is final;
    // and where each prefill's time went, phase by phase (nanoseconds).
    let mut prefill = Vec::new();
    let mut prefill_phases = Vec::new();
    let mut last = None;
    for &p in &a.prompt_tokens {
        say(format!("prefill of {p} tokens..."));
        profile::take();
        profile::enable(true);
        let r = prefill_once(&model, context, &prompt(p));
        profile::enable(false);
        let (s, next, secs) = r?;
        prefill_phases.push(profile::take());
        prefill.push((p, secs, (flops_tok * p as f64 + flops_head) / secs / 1e9));
        last = Some((s, next));
    }
    let (mut sess, mut tok) = last.expect("at least one prompt");
    let completion_default = stormo_engine::moe::completion_driven();
    let paired_prefill = if a.pair_completion {
        let mut runs = Vec::new();
        for &p in &a.prompt_tokens {
            say(format!(
                "prefill of {p} tokens, fetch-then-compute and completion-driven alternated..."
            ));
            let tokens = prompt(p);
            // seconds per mode (off, on) and the next tokens
            let mut secs = [0.0; 2];
            let mut next = Vec::new();
            for on in [false, true, true, false] {
                stormo_engine::moe::set_completion_driven(on);
                let (_, n, s) = prefill_once(&model, context, &tokens)?;
                secs[on as usize] += s / 2.0;
                next.push(n);
            }
            let same = next.iter().all(|&n| n == next[0]);
            runs.push((p, secs, same));
        }
        stormo_engine::moe::set_completion_driven(completion_default);
        Some(runs)
    } else {
        None
    };
    say(format!("decoding {} tokens...", a.decode_tokens));
    let before = experts.stats();
    let screen_before = sess.screen_stats();
    // The host's memory bandwidth drifts (other tenants): sample it between decoded tokens so
    // the bound is measured over the same minutes as the decode it judges.
    let mut dsecs = 0.0;
    // Seconds and tokens decoded through the screen and through the whole head when paired.
    let mut paired = [(0.0, 0u32); 2];
    // Seconds of the even and of the odd decoded tokens (the two settings when paired).
    let mut by_parity: [Vec<f64>; 2] = Default::default();
    let default_ahead = stormo_engine::kernels::prefetch_ahead();
    let default_tasks = stormo_engine::kernels::tasks_per_thread();
    if a.pair_prefetch.is_some() && isa != stormo_engine::kernels::Isa::Avx512 {
        eprintln!(
            "warning: the {isa} kernels do not use the prefetch distance; both sides of --pair-prefetch run the same kernels"
        );
    }
    // Where the decoded tokens' time goes, phase by phase (the probe's samples between tokens
    // are outside the spans).
    profile::take();
    profile::enable(true);
    // Spot-checks of peers' answers in the background, as `run` makes them (unless
    // --spot-check-inline): each token is a step, and the checks still running at the end
    // are waited for within the decode's time. A check that disagrees is counted, not rolled
    // back: the bench's tokens are never shown.
    let deferred = model
        .executor()
        .filter(|x| x.defer_checks(true))
        .map(|x| &**x);
    let mut late_disagreements = 0u64;
    // Whether a check was found to disagree.
    let mut settle = |wait: bool| match deferred.map(|x| (x, x.settle(wait))) {
        Some((x, stormo_engine::moe::Settled::Failed(step))) => {
            late_disagreements += 1;
            x.forget(step);
            true
        }
        _ => false,
    };
    for i in 0..a.decode_tokens {
        if let Some(x) = deferred {
            x.begin_step();
        }
        if let Some(d) = a.pair_prefetch {
            stormo_engine::kernels::set_prefetch_ahead(d[i % 2]);
        }
        if let Some(n) = a.pair_tasks {
            stormo_engine::kernels::set_tasks_per_thread(n[i % 2]);
        }
        if a.pair_completion {
            stormo_engine::moe::set_completion_driven(i % 2 == 1);
        }
        let t = Instant::now();
        let whole = a.pair_full_head && i % 2 == 1;
        tok = if whole {
            argmax(model.forward(&mut sess, &[tok], Logits::Last, None)?)
        } else {
            model.forward_greedy(&mut sess, &[tok], None)?.token
        };
        settle(false);
        let secs = t.elapsed().as_secs_f64();
        dsecs += secs;
        paired[whole as usize].0 += secs;
        paired[whole as usize].1 += 1;
        by_parity[i % 2].push(secs);
        probe.sample();
        probe.sample_kernels();
    }
    let t = Instant::now();
    // A disagreement ends a wait (and forgets its step): wait again for the rest.
    while settle(true) {}
    dsecs += t.elapsed().as_secs_f64();
    if let Some(x) = deferred {
        x.defer_checks(false);
    }
    profile::enable(false);
    let phase_nanos = profile::take();
    stormo_engine::kernels::set_prefetch_ahead(default_ahead);
    stormo_engine::kernels::set_tasks_per_thread(default_tasks);
    stormo_engine::moe::set_completion_driven(completion_default);
    let paired = a.pair_full_head.then(|| paired.map(|(s, n)| n as f64 / s));
    let paired_knob = a
        .pair_prefetch
        .map(|d| PairedKnob::new(Knob::Prefetch, d, &by_parity))
        .or_else(|| {
            a.pair_tasks
                .map(|n| PairedKnob::new(Knob::Tasks, n, &by_parity))
        });
    let paired_completion = a.pair_completion.then(|| PairedCompletion {
        decode: Paired::new(&by_parity),
        prefill: paired_prefill.unwrap_or_default(),
    });
    let (mem_min, mem_max) = probe.range().unwrap_or((mem_before, mem_before));
    let mem_bw = probe.take().unwrap_or(mem_before);
    // The bounds again at the end: the noise of a shared machine shows as their spread.
    for _ in 0..5 {
        probe.sample();
    }
    let mem_after = probe.take().unwrap_or(mem_bw);
    let kernels_after = probe.kernel_rates();
    // The kernels' rates as the memory's: the medians of the samples between decoded tokens.
    let kernels_during = probe.take_kernels().expect("at least one decoded token");
    let kernel_rates = KernelRates {
        bf16: kernels_during.bf16[1],
        mxfp4: kernels_during.mxfp4[1],
    };
    // The kernel bound: the dense bytes at the bf16 kernel's rate, the experts' at their own
    // (the MXFP4 kernel's for GPT-OSS); int8 copies (the screened head) are counted at the
    // bf16 rate, a little pessimistic for them.
    let expert_rate = if experts_mxfp4 {
        kernel_rates.mxfp4
    } else {
        kernel_rates.bf16
    };
    let kernel_bound = 1.0
        / (bpt.saturating_sub(expert_bpt) as f64 / kernel_rates.bf16
            + expert_bpt as f64 / expert_rate);
    let after = experts.stats();
    let screen = sess.screen_stats().since(screen_before);
    let decode_tok_s = a.decode_tokens as f64 / dsecs;
    // What users see: chat and the API sample (temperature 0.7 here), measured alternated
    // with greedy tokens so both see the same machine.
    say("decoding sampled (temperature 0.7) and greedy tokens alternated...".into());
    let sampled_pair = stormo_engine::generate::decode_greedy_and_sampled(
        &model,
        &mut sess,
        tok,
        a.decode_tokens,
        stormo_engine::sampling::SamplingParams {
            temperature: 0.7,
            ..Default::default()
        },
    )?;
    // Measured again at the end, keeping the higher: on a shared VM another tenant (or the
    // kernel reclaiming memory after a previous run) can hold a core for a moment, which
    // halved the first measurement in some runs.
    say("measuring the floating-point peak again...".into());
    let peak = peak.max(stormo_engine::kernels::peak_flops(isa, 0.6));
    let prefill_secs = prefill.clone();
    let prefill: Vec<_> = prefill
        .iter()
        .zip(&prefill_phases)
        .map(|(&(p, secs, gflop_s), nanos)| {
            // Milliseconds per prompt token in each phase.
            let phases: serde_json::Map<String, serde_json::Value> = Phase::ALL
                .iter()
                .map(|&ph| {
                    let ms = nanos[profile::index(ph)] as f64 / 1e6 / p.max(1) as f64;
                    (
                        ph.name().to_string(),
                        serde_json::json!({"ms_per_token": ms}),
                    )
                })
                .collect();
            serde_json::json!({
                "tokens": p, "seconds": secs, "tok_s": p as f64 / secs,
                "gflop_s": gflop_s, "fraction_of_peak": gflop_s * 1e9 / peak,
                "phases": phases,
            })
        })
        .collect();
    let bound = mem_bw / bpt as f64;
    let tier_bytes = |s: &Option<stormo_engine::tiers::ExpertStats>, name: &str| {
        s.as_ref()
            .and_then(|s| s.tiers.iter().find(|t| t.name == name).map(|t| t.bytes))
            .unwrap_or(0)
    };
    let disk_per_tok = (tier_bytes(&after, "disk") - tier_bytes(&before, "disk")) as f64
        / a.decode_tokens.max(1) as f64;
    let screened_head = model.has_screened_head();
    let experts_json = node.json(sess.prediction());
    let experts_table = node.table(sess.prediction());
    // Experts from peers per second the model waited for experts (prefill and decode).
    let fetch_mb_s = after
        .as_ref()
        .filter(|_| from_peers)
        .map(|s| tier_bytes(&after, "peer") as f64 / 1e6 / s.wait_s.max(1e-9));
    node.finish_run();
    drop((sess, model, experts, node));
    let disk_run = if beside_disk {
        say("the same prompts and decode from the local disk, without peers...".into());
        Some(disk_run(&a, context, &load, &sizes, max_p, vocab)?)
    } else {
        None
    };
    let versus_disk = disk_run.as_ref().map(|d| {
        serde_json::json!({
            "prefill": d.prefill.iter().zip(&prefill_secs).map(|(&(p, secs), &(_, peer_secs, _))| {
                serde_json::json!({"tokens": p, "tok_s": p as f64 / secs, "peer_vs_disk": secs / peer_secs})
            }).collect::<Vec<_>>(),
            "decode_tok_s": d.decode_tok_s,
        })
    });
    let peer_vs_disk = disk_run.as_ref().map(|d| decode_tok_s / d.decode_tok_s);
    let cpu = cpu_identity();
    let phases = Phase::ALL.iter().enumerate().map(|(i, ph)| {
        let ms = phase_nanos[i] as f64 / 1e6 / a.decode_tokens.max(1) as f64;
        let bytes = per_phase[i];
        let gb_s = (ms > 0.0).then(|| bytes as f64 / (ms / 1e3) / 1e9);
        (ph.name(), ms, bytes, gb_s)
    });
    let phases: Vec<_> = phases.collect();
    let phases_json: serde_json::Map<String, serde_json::Value> = phases
        .iter()
        .map(|&(name, ms, bytes, gb_s)| {
            (
                name.to_string(),
                serde_json::json!({"ms_per_token": ms, "bytes_per_token": bytes, "gb_s": gb_s}),
            )
        })
        .collect();
    let out = serde_json::json!({
        "model": a.model.display().to_string(),
        "threads": rayon::current_num_threads(),
        "simd": isa.name(),
        "prefetch_ahead_bytes": default_ahead,
        "int8_attn_head": a.int8_attn_head,
        "int8_experts": a.int8_experts,
        "cpu": cpu,
        "memory_bandwidth_gb_s": mem_bw / 1e9,
        "memory_bandwidth_at_start_gb_s": mem_before / 1e9,
        "memory_bandwidth_at_end_gb_s": mem_after / 1e9,
        "memory_bandwidth_during_decode_gb_s": {"min": mem_min / 1e9, "max": mem_max / 1e9},
        "kernel_stream_gb_s": {
            "bf16": {
                "start": kernels_before.bf16 / 1e9, "end": kernels_after.bf16 / 1e9,
                "during_decode": {"min": kernels_during.bf16[0] / 1e9, "median": kernels_during.bf16[1] / 1e9, "max": kernels_during.bf16[2] / 1e9},
            },
            "mxfp4": {
                "start": kernels_before.mxfp4 / 1e9, "end": kernels_after.mxfp4 / 1e9,
                "during_decode": {"min": kernels_during.mxfp4[0] / 1e9, "median": kernels_during.mxfp4[1] / 1e9, "max": kernels_during.mxfp4[2] / 1e9},
            },
        },
        "decode_kernel_bound_tok_s": kernel_bound,
        "disk_bandwidth_gb_s": disk.map(|d| d.0 / 1e9),
        "disk_direct_io": disk.map(|d| d.1),
        "bytes_per_decoded_token": bpt,
        "bytes_per_decoded_token_full_head": bpt_full_head,
        "screened_head": screened_head,
        "head_exact_rows_per_token": screen.rows_per_token(),
        "head_full_passes": screen.full,
        "paired_tok_s": paired.map(|[s, f]| serde_json::json!({"screened_head": s, "full_head": f})),
        "paired_prefetch": paired_knob.as_ref().filter(|p| p.knob == Knob::Prefetch).map(PairedKnob::json),
        "paired_tasks": paired_knob.as_ref().filter(|p| p.knob == Knob::Tasks).map(PairedKnob::json),
        "paired_completion": paired_completion.as_ref().map(PairedCompletion::json),
        "decode_bound_tok_s": bound,
        "peak_gflop_s": peak / 1e9,
        "prefill_gflop_per_token": flops_tok / 1e9,
        "prefill": prefill,
        "decode_sampled": {"temperature": 0.7, "tok_s": sampled_pair.sampled_tok_s, "greedy_tok_s_alternated": sampled_pair.greedy_tok_s, "vs_greedy": sampled_pair.sampled_tok_s / sampled_pair.greedy_tok_s},
        "decode": {"tokens": a.decode_tokens, "seconds": dsecs, "tok_s": decode_tok_s, "fraction_of_memory_bound": decode_tok_s / bound, "fraction_of_kernel_bound": decode_tok_s / kernel_bound, "disk_bytes_per_token": disk_per_tok, "phases": phases_json},
        "experts": experts_json,
        "from_peers": from_peers,
        "fetch_mb_s": fetch_mb_s,
        "disk": versus_disk,
        "peer_vs_disk": peer_vs_disk,
        "late_disagreements": late_disagreements,
        "peak_rss_bytes": peak_rss(),
    });
    if let Some(svg) = &svg {
        svg.write(&out)?;
    }
    if a.json {
        println!("{out}");
        return Ok(());
    }
    println!("model            {}", a.model.display());
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
    let cpu = &out["cpu"];
    println!(
        "cpu              {}{}",
        cpu["name"].as_str().unwrap_or("unknown"),
        match (cpu["family"].as_u64(), cpu["model"].as_u64()) {
            (Some(f), Some(m)) => format!(" (family {f}, model {m})"),
            _ => String::new(),
        }
    );
    println!(
        "memory           {:.1} GB/s read (median between decoded tokens, from {:.1} to {:.1}; {:.1} at start, {:.1} at the end)",
        mem_bw / 1e9,
        mem_min / 1e9,
        mem_max / 1e9,
        mem_before / 1e9,
        mem_after / 1e9
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
    match disk {
        Some((d, direct)) => println!(
            "disk             {:.2} GB/s read{}",
            d / 1e9,
            if direct {
                " (O_DIRECT)"
            } else {
                " (page cache may help)"
            }
        ),
        None if disk_test > 0 => println!(
            "disk             not measured: it reads whole 4 MiB blocks, more than --disk-test \
             or the largest checkpoint file holds"
        ),
        None => {}
    }
    println!(
        "per decoded token {} must be read{}: bound {:.2} tok/s at memory speed, {:.2} at the kernels' speed",
        human_bytes(bpt),
        if screened_head {
            format!(
                " (the head through its 8-bit screen; {} with --full-head)",
                human_bytes(bpt_full_head)
            )
        } else {
            String::new()
        },
        bound,
        kernel_bound
    );
    println!(
        "floating point   {:.1} GFLOP/s peak ({} fused multiply-adds on registers, all threads); prefill costs {} per token and one output-head pass per prompt",
        peak / 1e9,
        isa.name(),
        if flops_tok >= 1e9 {
            format!("{:.2} GFLOP", flops_tok / 1e9)
        } else {
            format!("{:.3} MFLOP", flops_tok / 1e6)
        }
    );
    // The first run's lines say where its experts came from when a second run follows.
    let from = if from_peers {
        "; experts from peers"
    } else {
        ""
    };
    for p in out["prefill"].as_array().expect("list") {
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
    println!(
        "decode  {:>5} tok {:>8.2} tok/s = {:.0}% of the memory bound, {:.0}% of the kernel bound; disk {} per token{from}",
        a.decode_tokens,
        decode_tok_s,
        100.0 * decode_tok_s / bound,
        100.0 * decode_tok_s / kernel_bound,
        human_bytes(disk_per_tok as u64)
    );
    let listed: Vec<String> = phases
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
    println!(
        "sampled          temperature 0.7 {:.2} tok/s, greedy {:.2} tok/s (alternate decoded tokens): {:.3}x",
        sampled_pair.sampled_tok_s,
        sampled_pair.greedy_tok_s,
        sampled_pair.sampled_tok_s / sampled_pair.greedy_tok_s
    );
    if let Some([s, f]) = paired {
        println!(
            "paired           screened head {s:.2} tok/s, whole exact head {f:.2} tok/s (alternate decoded tokens): {:.3}x",
            s / f
        );
    }
    if let Some(p) = &paired_knob {
        println!("{p}");
    }
    if let Some(p) = &paired_completion {
        println!("{p}");
    }
    if screened_head {
        println!(
            "head             screened: {:.1} exact rows per decoded token on average (of {}); the whole head computed for {} of {} greedy tokens",
            screen.rows_per_token(),
            vocab,
            screen.full,
            screen.screened + screen.full
        );
    }
    if let Some(d) = &disk_run {
        for (&(p, secs), &(_, peer_secs, _)) in d.prefill.iter().zip(&prefill_secs) {
            println!(
                "prefill {p:>5} tok {:>8.2} tok/s from the local disk: experts from peers {:.2}x that",
                p as f64 / secs,
                secs / peer_secs
            );
        }
        println!(
            "decode  {:>5} tok {:>8.2} tok/s from the local disk: experts from peers {:.2}x that",
            a.decode_tokens,
            d.decode_tok_s,
            decode_tok_s / d.decode_tok_s
        );
    }
    if let Some(f) = fetch_mb_s {
        println!(
            "fetch            {f:.0} MB/s: MB of experts fetched from peers per second spent \
             waiting for them (experts the peers computed are not fetched)"
        );
    }
    println!("{experts_table}");
    if let Some(r) = peak_rss() {
        println!(
            "peak RSS         {} (with the {} bandwidth probe)",
            human_bytes(r),
            human_bytes(probe.bytes())
        );
    }
    Ok(())
}

/// Decode speeds of two settings, decoded tokens alternated between them (token `2j` at the
/// first, `2j + 1` at the second).
struct Paired {
    /// Tokens per second at each (`None` for a setting no token was decoded at).
    tok_s: [Option<f64>; 2],
    /// The median over neighbouring pairs of the second's speed over the first's; `None`
    /// without a whole pair.
    median_ratio: Option<f64>,
}

impl Paired {
    /// From the seconds of each token at each setting.
    fn new(secs: &[Vec<f64>; 2]) -> Self {
        let tok_s = [0, 1].map(|k| {
            (!secs[k].is_empty()).then(|| secs[k].len() as f64 / secs[k].iter().sum::<f64>())
        });
        let mut ratios: Vec<f64> = secs[0].iter().zip(&secs[1]).map(|(a, b)| a / b).collect();
        ratios.sort_by(f64::total_cmp);
        let median_ratio = (!ratios.is_empty()).then(|| ratios[ratios.len() / 2]);
        Self {
            tok_s,
            median_ratio,
        }
    }

    /// The two speeds as printed (`-` for a setting no token was decoded at).
    fn speeds(&self) -> [String; 2] {
        self.tok_s
            .map(|s| s.map_or_else(|| "-".to_owned(), |s| format!("{s:.2}")))
    }

    /// The median pair ratio as printed after the speeds.
    fn ratio_note(&self) -> String {
        match self.median_ratio {
            Some(r) => format!("; median of neighbouring pairs {r:.3}x"),
            None => "; decode at least 2 tokens for a pair".to_owned(),
        }
    }
}

/// What a paired decode alternates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Knob {
    /// The AVX-512 kernels' prefetch distance (`--pair-prefetch`).
    Prefetch,
    /// Tasks per thread (`--pair-tasks`).
    Tasks,
}

/// Decode speeds at two settings of a [`Knob`], tokens alternated (`--pair-prefetch`,
/// `--pair-tasks`).
struct PairedKnob {
    knob: Knob,
    /// The two settings (bytes ahead, or tasks per thread).
    values: [usize; 2],
    /// The speeds at each.
    speeds: Paired,
}

impl PairedKnob {
    fn new(knob: Knob, values: [usize; 2], secs: &[Vec<f64>; 2]) -> Self {
        Self {
            knob,
            values,
            speeds: Paired::new(secs),
        }
    }

    fn json(&self) -> serde_json::Value {
        let key = match self.knob {
            Knob::Prefetch => "bytes",
            Knob::Tasks => "tasks_per_thread",
        };
        serde_json::json!({
            key: self.values, "tok_s": self.speeds.tok_s, "median_pair_ratio": self.speeds.median_ratio,
        })
    }
}

/// Fetch-then-compute against completion-driven MoE (`--pair-completion`).
struct PairedCompletion {
    /// Decoded tokens alternated: fetch-then-compute first.
    decode: Paired,
    /// Per prompt length: its tokens, the mean seconds of its prefills fetch-then-compute and
    /// completion-driven, and whether all four prefills chose the same next token.
    prefill: Vec<(usize, [f64; 2], bool)>,
}

impl PairedCompletion {
    fn json(&self) -> serde_json::Value {
        let [off, on] = self.decode.tok_s;
        serde_json::json!({
            "decode": {
                "fetch_then_compute_tok_s": off,
                "completion_driven_tok_s": on,
                "median_pair_ratio": self.decode.median_ratio,
            },
            "prefill": self.prefill.iter().map(|&(p, [off, on], same)| serde_json::json!({
                "tokens": p,
                "fetch_then_compute_tok_s": p as f64 / off,
                "completion_driven_tok_s": p as f64 / on,
                "ratio": off / on,
                "same_next_token": same,
            })).collect::<Vec<_>>(),
        })
    }
}

impl std::fmt::Display for PairedCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [off, on] = self.decode.speeds();
        write!(
            f,
            "paired           decode completion-driven {on} tok/s, fetch-then-compute {off} tok/s (alternate decoded tokens){}",
            self.decode.ratio_note()
        )?;
        for &(p, [off, on], same) in &self.prefill {
            write!(
                f,
                "\npaired           prefill {p:>5} tok completion-driven {:.2} tok/s, fetch-then-compute {:.2} tok/s (two prefills each, alternated): {:.3}x{}",
                p as f64 / on,
                p as f64 / off,
                off / on,
                if same { "" } else { "; THE NEXT TOKENS DIFFER" }
            )?;
        }
        Ok(())
    }
}

impl std::fmt::Display for PairedKnob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b] = self.values;
        let [sa, sb] = self.speeds.speeds();
        match self.knob {
            Knob::Prefetch => write!(
                f,
                "paired           prefetch {a} B ahead {sa} tok/s, {b} B ahead {sb} tok/s (alternate decoded tokens)"
            )?,
            Knob::Tasks => write!(
                f,
                "paired           {a} tasks per thread {sa} tok/s, {b} tasks per thread {sb} tok/s (alternate decoded tokens)"
            )?,
        }
        f.write_str(&self.speeds.ratio_note())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bandwidth_probe_reads_any_bytes() {
        // After the kernel probe the buffer holds weights, whose sum overflows a u64: the probe
        // must wrap, not panic (overflow checks are on in debug builds).
        let mut probe = MemoryProbe::new(MemoryProbe::MIN).unwrap();
        probe.buf.fill(0xff);
        assert!(probe.sample() > 0.0);
    }

    #[test]
    fn the_kernel_probe_times_both_kernels_over_the_probes_buffer() {
        let mut p = MemoryProbe::new(MemoryProbe::MIN).unwrap();
        let r = p.kernel_rates();
        for (what, v) in [("bf16", r.bf16), ("mxfp4", r.mxfp4)] {
            assert!(v.is_finite() && v > 0.0, "{what}: {v}");
        }
        // The bandwidth probe still reads the rewritten buffer.
        assert!(p.sample() > 0.0);
        // Samples between tokens: one pass each, summed up as min, median and max, then gone.
        assert!(p.take_kernels().is_none());
        for _ in 0..3 {
            p.sample_kernels();
        }
        let s = p.take_kernels().expect("three samples");
        for (what, [min, median, max]) in [("bf16", s.bf16), ("mxfp4", s.mxfp4)] {
            assert!(
                0.0 < min && min <= median && median <= max && max.is_finite(),
                "{what}: {min} {median} {max}"
            );
        }
        assert!(p.take_kernels().is_none());
    }

    #[test]
    fn the_cpu_is_named() {
        let c = cpu_identity();
        #[cfg(target_arch = "x86_64")]
        {
            let v = c["vendor"].as_str().unwrap();
            assert_eq!(v.len(), 12, "{c}");
            assert!(c["family"].as_u64().unwrap() > 0, "{c}");
        }
        #[cfg(not(target_arch = "x86_64"))]
        assert!(c["arch"].is_string(), "{c}");
    }

    /// gpt-oss-20b's prefill cost, counted by hand from its published geometry: attention
    /// 2880 x 64 x (2 x 64 + 2 x 8) weights, router 32 x 2880, four experts of 3 x 2880 x 2880,
    /// over 24 layers, two FLOPs per weight; the head 2 x 2880 x 201088 once.
    #[test]
    fn prefill_flops_at_gpt_oss_20b_geometry() {
        let text = r#"{"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "vocab_size": 201088, "num_local_experts": 32, "num_experts_per_tok": 4,
            "intermediate_size": 2880, "rms_norm_eps": 1e-5, "rope_theta": 150000,
            "sliding_window": 128, "max_position_embeddings": 131072}"#;
        let cfg =
            stormo_engine::ModelConfig::from_json_str(text, std::path::Path::new("config.json"))
                .expect("a gpt-oss config");
        let (tok, head) = prefill_flops(&cfg);
        let per_layer = 2880 * 64 * (128 + 16) + 32 * 2880 + 4 * 3 * 2880 * 2880;
        assert_eq!(tok, 2.0 * 24.0 * per_layer as f64);
        assert!((tok / 1e9 - 6.056).abs() < 1e-3, "{tok}");
        assert_eq!(head, 2.0 * 2880.0 * 201_088.0);
    }

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
