//! Decode speed of sampling through the screened head beside greedy decoding and beside
//! sampling from the whole head (what `stormo run --temperature T` did before screened
//! sampling), runs alternated, medians printed as JSON.
//!
//! `cargo run --release -p stormo-engine --example sampled_decode -- DIR [DECODE_TOKENS]
//! [RUNS] [TEMPERATURE]`, e.g. on `stormo synth --preset gpt-oss-20b --layers 2 --out DIR`.

use std::path::PathBuf;

use stormo_engine::generate::{greedy_ids, sampled, sampled_ids, Timings};
use stormo_engine::sampling::{Sampler, SamplingParams};
use stormo_engine::{LoadOptions, Model};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .ok_or("usage: sampled_decode DIR [TOKENS] [RUNS] [T]")?,
    );
    let tokens: usize = args.next().map_or(Ok(32), |s| s.parse())?;
    let runs: usize = args.next().map_or(Ok(5), |s| s.parse())?;
    let temperature: f32 = args.next().map_or(Ok(0.7), |s| s.parse())?;
    let screened = Model::load(
        &dir,
        &LoadOptions {
            screened_head: true,
            ..LoadOptions::default()
        },
    )?;
    let whole = Model::load(&dir, &LoadOptions::default())?;
    let prompt: Vec<u32> = (0..16).map(|i| 1000 + 37 * i).collect();
    let params = |seed| SamplingParams {
        temperature,
        seed,
        ..SamplingParams::default()
    };
    // Tokens per second after the first, one generation.
    let rate = |t: &Timings| (tokens - 1) as f64 / t.decode_s;
    let (mut greedy, mut screened_s, mut whole_s) = (Vec::new(), Vec::new(), Vec::new());
    let mut rows = (0u64, 0u64, 0u64);
    for run in 0..runs + 1 {
        let mut t = Timings::default();
        let mut sess = screened.session(prompt.len() + tokens)?;
        greedy_ids(&screened, &mut sess, &prompt, tokens, &[], |_| {}, &mut t)?;
        let g = rate(&t);
        let mut t = Timings::default();
        let mut sess = screened.session(prompt.len() + tokens)?;
        let mut s = Sampler::new(params(run as u64))?;
        let ids = sampled_ids(
            &screened,
            &mut sess,
            &prompt,
            tokens,
            &[],
            &mut s,
            |_| {},
            &mut t,
        )?;
        let sc = rate(&t);
        let st = sess.screen_stats();
        let mut t = Timings::default();
        let mut sess = whole.session(prompt.len() + tokens)?;
        let mut s = Sampler::new(params(run as u64))?;
        let want = sampled(
            &whole,
            &mut sess,
            &prompt,
            tokens,
            &[],
            &mut s,
            |_, _| {},
            &mut t,
        )?;
        assert_eq!(ids, want, "screened and whole-head sampling differ");
        let wh = rate(&t);
        eprintln!("run {run}: greedy {g:.2} tok/s, sampled screened {sc:.2}, sampled whole head {wh:.2}; screen {st:?}");
        // The first run warms the page cache and is not counted.
        if run > 0 {
            greedy.push(g);
            screened_s.push(sc);
            whole_s.push(wh);
            rows.0 += st.screened;
            rows.1 += st.exact_rows;
            rows.2 += st.full;
        }
    }
    let (g, sc, wh) = (median(greedy), median(screened_s), median(whole_s));
    println!(
        "{{\"decode_greedy_tok_s\": {g:.3}, \"decode_sampled_tok_s\": {sc:.3}, \"decode_sampled_whole_head_tok_s\": {wh:.3}, \"sampled_vs_greedy\": {:.3}, \"whole_head_sampled_vs_greedy\": {:.3}, \"temperature\": {temperature}, \"tokens\": {tokens}, \"runs\": {runs}, \"screened_tokens\": {}, \"exact_rows_per_screened_token\": {:.1}, \"whole_head_tokens\": {}}}",
        sc / g,
        wh / g,
        rows.0,
        rows.1 as f64 / rows.0.max(1) as f64,
        rows.2
    );
    Ok(())
}
