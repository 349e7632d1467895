//! Kernel throughput per ISA at GPT-OSS shapes, beside the machine's read bound.
//!
//! `cargo bench -p stormo-engine --bench kernels` (filter with e.g. `-- avx2/matvec`).
//! Decode (`matvec`) groups report GB/s of weights read, once on a 1-thread pool and once on
//! the global pool; `bound` reads a 1 GiB buffer the same two ways, so each result can be read
//! as a fraction of what the memory delivers in the same run. Prefill (`matmul`, 64
//! positions) groups report elements as floating-point operations (2 per weight per
//! position), so criterion's "Gelem/s" is GFLOP/s. `STORMO_BENCH_HEAD=0` skips the 1.16 GB
//! lm_head-like matrix.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rayon::prelude::*;
use stormo_engine::kernels::{matmul, matvec, with_isa, Float, Isa, Mat};

/// A cheap deterministic byte stream (xorshift64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// bf16 weights of magnitude 2^-8 .. 1 (no subnormals, infs or NaNs), little-endian.
fn bf16_weights(n: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; 2 * n];
    out.par_chunks_mut(1 << 20)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut rng = Rng(seed ^ (c as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            for pair in chunk.chunks_exact_mut(2) {
                let r = rng.next();
                let exp = 119 + (r % 8) as u16;
                let bits = ((r >> 8) as u16 & 0x807f) | (exp << 7);
                pair.copy_from_slice(&bits.to_le_bytes());
            }
        });
    out
}

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    (0..n).map(|_| rng.next() as u8).collect()
}

fn input(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

struct Mxfp4Data {
    blocks: Vec<u8>,
    scales: Vec<u8>,
    rows: usize,
    cols: usize,
}
impl Mxfp4Data {
    fn new(rows: usize, cols: usize, seed: u64) -> Self {
        let scales = bytes(rows * cols / 32, seed + 1)
            .into_iter()
            .map(|s| 120 + s % 8)
            .collect();
        Self {
            blocks: bytes(rows * cols / 2, seed),
            scales,
            rows,
            cols,
        }
    }
    fn mat(&self) -> Mat<'_> {
        Mat::Mxfp4 {
            blocks: &self.blocks,
            scales: &self.scales,
            rows: self.rows,
            cols: self.cols,
        }
    }
    /// The same weights on int8-quantized inputs (`--int8-experts`).
    fn int8(&self) -> Mat<'_> {
        Mat::Mxfp4Int8 {
            blocks: &self.blocks,
            scales: &self.scales,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

fn dense(bytes: &[u8], rows: usize, cols: usize) -> Mat<'_> {
    Mat::Dense {
        fmt: Float::BF16,
        bytes,
        rows,
        cols,
    }
}

fn one_thread() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a 1-thread pool")
}

/// Reading a buffer as fast as the machine allows: the ceiling for decode.
fn bound(c: &mut Criterion) {
    let buf: Vec<u64> = (0..(1usize << 27))
        .into_par_iter()
        .map(|i| i as u64)
        .collect();
    let mut g = c.benchmark_group("bound");
    g.sample_size(10);
    g.throughput(Throughput::Bytes((buf.len() * 8) as u64));
    let sum = |b: &[u64]| {
        b.chunks(1 << 16)
            .map(|c| {
                let mut acc = [0u64; 8];
                for w in c.chunks_exact(8) {
                    for l in 0..8 {
                        acc[l] = acc[l].wrapping_add(w[l]);
                    }
                }
                acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
            })
            .fold(0u64, u64::wrapping_add)
    };
    g.bench_function("read_1GiB/1t", |b| b.iter(|| black_box(sum(&buf))));
    g.bench_function(
        BenchmarkId::new("read_1GiB", format!("{}t", rayon::current_num_threads())),
        |b| {
            b.iter(|| {
                black_box(
                    buf.par_chunks(1 << 20)
                        .map(sum)
                        .reduce(|| 0, u64::wrapping_add),
                )
            })
        },
    );
    g.finish();
}

fn decode(c: &mut Criterion) {
    let gate_up = Mxfp4Data::new(5760, 2880, 1);
    let down = Mxfp4Data::new(2880, 2880, 2);
    let q = bf16_weights(4096 * 2880, 3);
    let o = bf16_weights(2880 * 4096, 4);
    let expert_t = bf16_weights(2880 * 5760, 5);
    let head = (std::env::var("STORMO_BENCH_HEAD").as_deref() != Ok("0"))
        .then(|| bf16_weights(201_088 * 2880, 6));
    let mut mats: Vec<(&str, Mat<'_>)> = vec![
        ("mxfp4_gate_up_5760x2880", gate_up.mat()),
        ("mxfp4_down_2880x2880", down.mat()),
        ("mxfp4_int8_in_gate_up_5760x2880", gate_up.int8()),
        ("bf16_q_proj_4096x2880", dense(&q, 4096, 2880)),
        ("bf16_o_proj_2880x4096", dense(&o, 2880, 4096)),
        (
            "bf16T_gate_up_5760x2880",
            Mat::DenseT {
                fmt: Float::BF16,
                bytes: &expert_t,
                rows: 5760,
                cols: 2880,
            },
        ),
    ];
    let q8_head = head.as_ref().map(|h| {
        // Row-scaled 8-bit copy of the head (the --int8-attn-head format); the bytes of the
        // bf16 head serve as its integers: the kernel's speed does not depend on the values.
        let scales = vec![1e-3f32; 201_088];
        (h[..201_088 * 2880].to_vec(), scales)
    });
    if let Some(h) = &head {
        mats.push(("bf16_lm_head_201088x2880", dense(h, 201_088, 2880)));
    }
    if let Some((q, scales)) = &q8_head {
        mats.push((
            "q8_lm_head_201088x2880",
            Mat::Q8 {
                q,
                scales,
                rows: 201_088,
                cols: 2880,
            },
        ));
    }
    let pool = one_thread();
    let all = format!("{}t", rayon::current_num_threads());
    // Native ISAs only: with the integration tests' `emulated-avx512` feature unified into the
    // build (`cargo bench --workspace`), the AVX-512 ISA would otherwise be timed in software.
    for isa in Isa::native() {
        let mut g = c.benchmark_group(format!("{isa}/matvec"));
        g.sample_size(10);
        g.warm_up_time(std::time::Duration::from_millis(500));
        g.measurement_time(std::time::Duration::from_secs(2));
        for (name, w) in &mats {
            let x = input(w.cols(), 7);
            let mut y = vec![0f32; w.rows()];
            g.throughput(Throughput::Bytes(w.byte_len() as u64));
            g.bench_function(BenchmarkId::new(*name, "1t"), |b| {
                pool.install(|| with_isa(isa, || b.iter(|| matvec(w, &x, &mut y))))
            });
            g.bench_function(BenchmarkId::new(*name, &all), |b| {
                with_isa(isa, || b.iter(|| matvec(w, &x, &mut y)))
            });
        }
        g.finish();
    }
}

fn prefill(c: &mut Criterion) {
    let t = 64;
    let gate_up = Mxfp4Data::new(5760, 2880, 1);
    let down = Mxfp4Data::new(2880, 2880, 2);
    let q = bf16_weights(4096 * 2880, 3);
    let expert_t = bf16_weights(2880 * 5760, 5);
    let mats: Vec<(&str, Mat<'_>)> = vec![
        ("mxfp4_gate_up_5760x2880", gate_up.mat()),
        ("mxfp4_down_2880x2880", down.mat()),
        ("mxfp4_int8_in_gate_up_5760x2880", gate_up.int8()),
        ("bf16_q_proj_4096x2880", dense(&q, 4096, 2880)),
        (
            "bf16T_gate_up_5760x2880",
            Mat::DenseT {
                fmt: Float::BF16,
                bytes: &expert_t,
                rows: 5760,
                cols: 2880,
            },
        ),
    ];
    for isa in Isa::native() {
        let mut g = c.benchmark_group(format!("{isa}/matmul64"));
        g.sample_size(10);
        g.warm_up_time(std::time::Duration::from_millis(500));
        g.measurement_time(std::time::Duration::from_secs(3));
        for (name, w) in &mats {
            let xs = input(t * w.cols(), 8);
            let mut ys = vec![0f32; t * w.rows()];
            g.throughput(Throughput::Elements((2 * w.rows() * w.cols() * t) as u64));
            g.bench_function(*name, |b| {
                with_isa(isa, || b.iter(|| matmul(w, &xs, &mut ys)))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bound, decode, prefill);
criterion_main!(benches);
