//! The physical ceilings `stormo bench` judges the model's speed against: memory read
//! bandwidth (a plain parallel sum over a large buffer, [`MemoryProbe`]), the rate at which the
//! decode kernels stream weights through one position (over the same buffer), disk read
//! bandwidth and the floating-point peak.
//!
//! Owns the probes and when they run: at the start ([`Ceilings::measure`]), between decoded
//! tokens (the decode samples [`Ceilings::probe`]), and at the end ([`Ceilings::after_decode`],
//! [`Ceilings::measure_peak_again`]), turned into decode bounds by [`Spread`]. Not what a
//! token costs (`costs`), nor the timed runs (`timed`).

use std::io::Read;
use std::time::Instant;

use anyhow::Context;
use rayon::prelude::*;
use stormo_engine::kernels::Isa;
use stormo_engine::ModelFiles;
use stormo_net::progress::human_bytes;

use super::costs::Costs;
use super::Progress;

/// The ceilings measured before the timed runs, and the probe that samples memory and the
/// kernels between decoded tokens.
#[derive(Debug)]
pub(super) struct Ceilings {
    /// The bandwidth and kernel probe (it stays allocated: it counts in the peak RSS).
    pub(super) probe: MemoryProbe,
    /// Memory read rate at the start, bytes/s (the median of five samples).
    pub(super) mem_start: f64,
    /// The kernels' streaming rates at the start.
    pub(super) kernels_start: KernelRates,
    /// Disk read rate in bytes/s and whether O_DIRECT was used; `None` when not measured.
    pub(super) disk: Option<(f64, bool)>,
    /// The instruction set the kernels run.
    pub(super) isa: Isa,
    /// Floating-point operations per second at the peak.
    pub(super) peak: f64,
}

impl Ceilings {
    /// Measures them, saying what it measures: memory over a probe of `mem_test` bytes, the
    /// kernels over the same buffer, the disk over `files`' largest file (`disk_test` bytes
    /// of it; 0 skips it) and the floating-point peak.
    pub(super) fn measure(
        mem_test: u64,
        disk_test: u64,
        files: &ModelFiles,
        say: Progress,
    ) -> anyhow::Result<Self> {
        say.say("measuring memory bandwidth...");
        let mut probe = MemoryProbe::new(mem_test as usize)?;
        for _ in 0..5 {
            probe.sample();
        }
        let mem_start = probe.take().expect("five samples");
        say.say("measuring the kernels' streaming rate...");
        let kernels_start = probe.kernel_rates();
        let disk = if disk_test > 0 {
            say.say("measuring disk bandwidth...");
            disk_bandwidth(files, disk_test)?
        } else {
            None
        };
        say.say("measuring the floating-point peak...");
        let isa = Isa::process();
        let peak = stormo_engine::kernels::peak_flops(isa, 0.6);
        Ok(Self {
            probe,
            mem_start,
            kernels_start,
            disk,
            isa,
            peak,
        })
    }

    /// After the decode: the medians and ranges of the samples taken between decoded tokens,
    /// then memory and the kernels measured again at the end.
    pub(super) fn after_decode(&mut self) -> Spread {
        let probe = &mut self.probe;
        let (mem_min, mem_max) = probe.range().unwrap_or((self.mem_start, self.mem_start));
        let mem = probe.take().unwrap_or(self.mem_start);
        // The bounds again at the end: the noise of a shared machine shows as their spread.
        for _ in 0..5 {
            probe.sample();
        }
        let mem_end = probe.take().unwrap_or(mem);
        let kernels_end = probe.kernel_rates();
        // The kernels' rates as the memory's: the medians of the samples between decoded tokens.
        let kernels_during = probe.take_kernels().expect("at least one decoded token");
        Spread {
            mem,
            mem_min,
            mem_max,
            mem_end,
            kernels_during,
            kernels_end,
        }
    }

    /// The floating-point peak measured again, keeping the higher: on a shared VM another
    /// tenant (or the kernel reclaiming memory after a previous run) can hold a core for a
    /// moment, which halved the first measurement in some runs.
    pub(super) fn measure_peak_again(&mut self, say: Progress) {
        say.say("measuring the floating-point peak again...");
        self.peak = self
            .peak
            .max(stormo_engine::kernels::peak_flops(self.isa, 0.6));
    }
}

/// Memory and the kernels over the decode (the samples between decoded tokens: the host's
/// bandwidth drifts with other tenants, so the bounds are measured over the same minutes as
/// the decode they judge) and at its end.
#[derive(Debug)]
pub(super) struct Spread {
    /// Memory read rate, bytes/s: the median between decoded tokens.
    pub(super) mem: f64,
    /// The lowest memory sample between decoded tokens.
    pub(super) mem_min: f64,
    /// The highest memory sample between decoded tokens.
    pub(super) mem_max: f64,
    /// Memory read rate at the end (the median of five samples).
    pub(super) mem_end: f64,
    /// The kernels' rates between decoded tokens.
    pub(super) kernels_during: KernelSamples,
    /// The kernels' rates at the end.
    pub(super) kernels_end: KernelRates,
}

impl Spread {
    /// The kernels' rates as the memory's: the medians of the samples between decoded tokens.
    pub(super) fn kernels(&self) -> KernelRates {
        KernelRates {
            bf16: self.kernels_during.bf16[1],
            mxfp4: self.kernels_during.mxfp4[1],
        }
    }

    /// The decode bound at memory speed, tokens/s: the bytes a token reads at [`Self::mem`].
    pub(super) fn memory_bound(&self, costs: &Costs) -> f64 {
        self.mem / costs.bpt as f64
    }

    /// The decode bound at the kernels' speed, tokens/s: the dense bytes at the bf16 kernel's
    /// rate, the experts' at their own (the MXFP4 kernel's for GPT-OSS); int8 copies (the
    /// screened head) are counted at the bf16 rate, a little pessimistic for them.
    pub(super) fn kernel_bound(&self, costs: &Costs) -> f64 {
        let kernel_rates = self.kernels();
        let expert_rate = if costs.experts_mxfp4 {
            kernel_rates.mxfp4
        } else {
            kernel_rates.bf16
        };
        1.0 / (costs.bpt.saturating_sub(costs.expert_bpt) as f64 / kernel_rates.bf16
            + costs.expert_bpt as f64 / expert_rate)
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
}
