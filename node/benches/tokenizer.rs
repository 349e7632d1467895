//! Loading a `tokenizer.json` (a perf-style binary, `harness = false`).
//!
//! Times, over several rounds, the whole [`Tokenizer::from_file`] for the o200k_harmony
//! fixture (28 MB, 199,998 vocab entries, 446,189 merges) beside two bounds measured in the
//! same run: reading the file, and parsing it with `serde_json` into nothing
//! (`IgnoredAny`), the least any loader that validates the JSON must do. Prints the median
//! and best of each, and an encode of a short text so a load that broke the tokenizer shows.
//!
//! ```sh
//! cargo bench -p stormo-cli --bench tokenizer                  # 9 rounds
//! STORMO_BENCH_REPS=20 cargo bench -p stormo-cli --bench tokenizer
//! STORMO_TOKENIZER=/path/to/tokenizer.json cargo bench -p stormo-cli --bench tokenizer
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use stormo_text::tokenizer::Tokenizer;

fn stats(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[0])
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; ignore arguments.
    let path = std::env::var_os("STORMO_TOKENIZER").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../fixtures/o200k-harmony/tokenizer.json")
        },
        PathBuf::from,
    );
    let reps: usize = match std::env::var("STORMO_BENCH_REPS") {
        Ok(s) => s
            .parse()
            .map_err(|e| anyhow::anyhow!("STORMO_BENCH_REPS={s:?}: {e}"))?,
        Err(_) => 9,
    };
    anyhow::ensure!(reps > 0, "STORMO_BENCH_REPS must be at least 1");
    println!(
        "tokenizer load: {} ({} rounds, {} rayon threads)",
        path.display(),
        reps,
        rayon::current_num_threads()
    );

    let (mut read, mut parse, mut load) = (Vec::new(), Vec::new(), Vec::new());
    let mut size = 0;
    let mut tok = None;
    for _ in 0..reps {
        let t = Instant::now();
        let bytes = std::fs::read(&path)?;
        read.push(t.elapsed());
        size = bytes.len();

        let t = Instant::now();
        let _: serde::de::IgnoredAny = serde_json::from_slice(&bytes)?;
        parse.push(t.elapsed());
        drop(bytes);

        let t = Instant::now();
        let tk = Tokenizer::from_file(&path)?;
        load.push(t.elapsed());
        // Drop outside the timed region, but keep the last one to check it works.
        tok = Some(tk);
    }
    let tok = tok.expect("reps > 0");
    let (r, rb) = stats(read);
    let (p, pb) = stats(parse);
    let (l, lb) = stats(load);
    println!("  file size          {:.1} MB", size as f64 / 1e6);
    println!(
        "  read file          median {:8.1} ms   best {:8.1} ms",
        ms(r),
        ms(rb)
    );
    println!(
        "  serde_json skim    median {:8.1} ms   best {:8.1} ms",
        ms(p),
        ms(pb)
    );
    println!(
        "  Tokenizer::from_file median {:6.1} ms   best {:8.1} ms   ({:.2}x read+skim)",
        ms(l),
        ms(lb),
        l.as_secs_f64() / (r + p).as_secs_f64()
    );
    let ids = tok.encode("Hello, world! Ünïcödé 😀 code: fn main() {}", false)?;
    println!("  {tok:?}; sample encode: {} ids", ids.len());
    Ok(())
}
