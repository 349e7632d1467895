//! The fastest of many calls of one kernel on one thread: a timer for comparing two builds on a
//! busy machine, where criterion's means move with the load (preemption only ever adds time,
//! so the minimum is what the kernel costs). Run two builds' binaries alternately and compare
//! their minima, as `docs/performance.md` ("Same bits on every ISA") did:
//!
//! ```sh
//! cargo bench -p stormo-engine --bench kernel_min -- mxfp4 64 30 avx2
//! ```
//!
//! Arguments: the weights (`mxfp4`, `mxfp4-int8`, `bf16`, `bf16t`: a 2880 x 2880 matrix, GPT-OSS's
//! expert down projection, of random weights; `bf16t` input-major), the positions per call, the
//! calls, and the ISA (default: the best this CPU runs natively). `KERNEL_MIN_ROWS=46080` gives
//! the matrix that many rows (66 MB of MXFP4, more than the caches hold), so that each call
//! streams its weights from memory as a prefill's experts do. `kernel_min peak [ISA]` prints
//! one thread's f32 FMA peak and the `--int8-experts` kernel's integer dot-product peak.

use std::time::Instant;

use stormo_engine::kernels::{matmul, peak_flops, peak_int8_ops, with_isa, Float, Isa, Mat};

const USAGE: &str = "usage: kernel_min WEIGHTS POSITIONS CALLS [ISA]  \
                     (WEIGHTS: mxfp4, mxfp4-int8, bf16 or bf16t), or kernel_min peak [ISA]";

fn main() {
    // `cargo bench` passes `--bench` to every bench target.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if let Err(e) = run(&args) {
        eprintln!("kernel_min: {e}\n{USAGE}");
        std::process::exit(2);
    }
}

fn run(args: &[String]) -> Result<(), String> {
    if let [peak, rest @ ..] = args {
        if peak == "peak" {
            return peaks(rest.first().map(String::as_str));
        }
    }
    let [which, t, calls, rest @ ..] = args else {
        return Err("expected at least three arguments".into());
    };
    let parse = |s: &str, what: &str| {
        s.parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or(format!("{what} {s:?} is not a positive integer"))
    };
    let (t, calls) = (parse(t, "positions")?, parse(calls, "calls")?);
    let isa = match rest.first() {
        Some(name) => Isa::parse(name).ok_or(format!("unknown ISA {name:?}"))?,
        None => Isa::detected(),
    };
    if !isa.is_native() {
        return Err(format!("this CPU does not run {isa} natively"));
    }
    // `KERNEL_MIN_ROWS` (default 2880): more rows than the caches hold (46080 is 66 MB of
    // MXFP4) makes each call stream its weights from memory, as a prefill's experts do.
    let rows = match std::env::var("KERNEL_MIN_ROWS") {
        Ok(v) => parse(&v, "KERNEL_MIN_ROWS")?,
        Err(_) => 2880,
    };
    let cols = 2880;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| 120 + (next() % 8) as u8)
        .collect();
    // bf16 of magnitude 2^-8 to 1: no subnormals, infinities or NaNs.
    let bf16: Vec<u8> = (0..rows * cols)
        .flat_map(|_| {
            let r = next();
            (((r >> 8) as u16 & 0x807f) | ((119 + (r % 8) as u16) << 7)).to_le_bytes()
        })
        .collect();
    let (blocks, scales, bytes) = (&blocks[..], &scales[..], &bf16[..]);
    let fmt = Float::BF16;
    let w = match which.as_str() {
        "mxfp4" => Mat::Mxfp4 {
            blocks,
            scales,
            rows,
            cols,
        },
        "mxfp4-int8" => Mat::Mxfp4Int8 {
            blocks,
            scales,
            rows,
            cols,
        },
        "bf16" => Mat::Dense {
            fmt,
            bytes,
            rows,
            cols,
        },
        "bf16t" => Mat::DenseT {
            fmt,
            bytes,
            rows,
            cols,
        },
        other => return Err(format!("unknown weights {other:?}")),
    };
    let xs: Vec<f32> = (0..t * cols)
        .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let mut ys = vec![0f32; t * rows];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| format!("a one-thread pool: {e}"))?;
    let best = pool.install(|| {
        with_isa(isa, || {
            (0..calls)
                .map(|_| {
                    let start = Instant::now();
                    matmul(&w, &xs, &mut ys);
                    start.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        })
    });
    let flops = 2.0 * (rows * cols * t) as f64;
    println!(
        "{which} {rows}x{cols}, {t} positions, {isa}: fastest of {calls} calls {:.1} us, {:.2} GFLOP/s",
        best * 1e6,
        flops / best / 1e9
    );
    Ok(())
}

/// `kernel_min peak [ISA]`: one thread's peaks, against which the kernels' GFLOP/s compare:
/// fused multiply-adds on registers, and the `--int8-experts` path's dot-product step.
fn peaks(isa: Option<&str>) -> Result<(), String> {
    let isa = match isa {
        Some(name) => Isa::parse(name).ok_or(format!("unknown ISA {name:?}"))?,
        None => Isa::detected(),
    };
    if !isa.is_native() {
        return Err(format!("this CPU does not run {isa} natively"));
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| format!("a one-thread pool: {e}"))?;
    let (fma, int8) = pool.install(|| (peak_flops(isa, 1.5), peak_int8_ops(isa, 1.5)));
    println!(
        "{isa}, one thread: f32 fused multiply-adds {:.1} GFLOP/s",
        fma / 1e9
    );
    match int8 {
        Some(ops) => println!(
            "{isa}, one thread: int8 dot products (the --int8-experts kernel's step) {:.1} GOP/s, {:.2}x the f32 peak",
            ops / 1e9,
            ops / fma
        ),
        None => println!("{isa}: the int8 path has no SIMD kernel here"),
    }
    Ok(())
}
