//! Decode speed of sampling through the screened head beside greedy decoding and beside
//! sampling from the whole head (what `stormo run --temperature T` did before screened
//! sampling), runs alternated, medians printed as JSON.
//!
//! `cargo run --release -p stormo-engine --example sampled_decode -- DIR [DECODE_TOKENS]
//! [RUNS] [TEMPERATURE]`, e.g. on `stormo synth --preset gpt-oss-20b --layers 2 --out DIR`;
//! `-` for DIR times the sampler alone.

use std::path::PathBuf;

use stormo_engine::generate::{
    decode_greedy_and_sampled, greedy_ids, sampled, sampled_ids, Timings,
};
use stormo_engine::sampling::{Sampler, SamplingParams};
use stormo_engine::{LoadOptions, Model};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Milliseconds per token of the sampler alone on flat logits of gpt-oss's vocabulary
/// (N(0, 1), as a random-weight model's), bounds of radius 0.25: through the screen, and from
/// the whole logits.
fn sampler_alone(temperature: f32) -> (f64, f64) {
    let n = 201_088;
    let mut z = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = || {
        z ^= z << 13;
        z ^= z >> 7;
        z ^= z << 17;
        (z >> 11) as f32 / (1u64 << 53) as f32
    };
    let logits: Vec<f32> = (0..n)
        .map(|_| (0..4).map(|_| uniform() * 2.0 - 1.0).sum::<f32>() * 0.87)
        .collect();
    let approx: Vec<f32> = logits.iter().map(|x| x + (uniform() - 0.5) * 0.4).collect();
    let params = SamplingParams {
        temperature,
        ..SamplingParams::default()
    };
    let reps = 40;
    let mut s = Sampler::new(params).expect("valid");
    let t = std::time::Instant::now();
    for _ in 0..reps {
        let mut exact = |rows: &[usize], out: &mut [f32]| -> Result<(), ()> {
            for (&r, o) in rows.iter().zip(out.iter_mut()) {
                *o = logits[r];
            }
            Ok(())
        };
        let got = s.sample_screened(&approx, |_| 0.25, &mut exact, &[]);
        assert!(matches!(got, Ok(Some(_))));
    }
    let screened = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
    let t = std::time::Instant::now();
    for _ in 0..reps {
        s.sample(&logits, &[]).expect("valid");
    }
    (screened, t.elapsed().as_secs_f64() * 1e3 / reps as f64)
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
    let (alone, alone_full) = sampler_alone(temperature);
    eprintln!("the sampler alone: {alone:.2} ms a token through the screen, {alone_full:.2} ms from the whole logits");
    if dir.as_os_str() == "-" {
        // The sampler alone (for a profiler): more of the same.
        for _ in 0..20 {
            sampler_alone(temperature);
        }
        return Ok(());
    }
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
    let mut ratios = Vec::new();
    for run in 0..runs + 1 {
        let mut t = Timings::default();
        let mut sess = screened.session(prompt.len() + tokens)?;
        greedy_ids(&screened, &mut sess, &prompt, tokens, &[], |_| {}, &mut t)?;
        let g = rate(&t);
        let gst = sess.screen_stats();
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
        eprintln!(
            "run {run}: greedy {g:.2} tok/s ({:.0} exact rows a token), sampled screened {sc:.2} ({:.0}), sampled whole head {wh:.2}",
            gst.rows_per_token(),
            st.rows_per_token()
        );
        // The first run warms the page cache and is not counted.
        if run > 0 {
            ratios.push((sc / g, wh / g));
            greedy.push(g);
            screened_s.push(sc);
            whole_s.push(wh);
            rows.0 += st.screened;
            rows.1 += st.exact_rows;
            rows.2 += st.full;
        }
    }
    // As `stormo bench` would measure it: greedy and sampled tokens alternated one by one.
    let mut sess = screened.session(prompt.len() + 2 * tokens)?;
    let first = screened.forward_greedy(&mut sess, &prompt, None)?.token;
    let pair = decode_greedy_and_sampled(&screened, &mut sess, first, 2 * tokens, params(99))?;
    eprintln!("alternated token by token: {pair:?}");
    let (g, sc, wh) = (median(greedy), median(screened_s), median(whole_s));
    let ratio = median(ratios.iter().map(|r| r.0).collect());
    let ratio_whole = median(ratios.iter().map(|r| r.1).collect());
    println!(
        "{{\"decode_greedy_tok_s\": {g:.3}, \"decode_sampled_tok_s\": {sc:.3}, \"decode_sampled_whole_head_tok_s\": {wh:.3}, \"sampled_vs_greedy\": {ratio:.3}, \"whole_head_sampled_vs_greedy\": {ratio_whole:.3}, \"sampler_alone_ms\": {{\"screened\": {alone:.3}, \"whole_logits\": {alone_full:.3}}}, \"alternated_tokens\": {{\"greedy_tok_s\": {:.3}, \"sampled_tok_s\": {:.3}, \"sampled_vs_greedy\": {:.3}}}, \"temperature\": {temperature}, \"tokens\": {tokens}, \"runs\": {runs}, \"screened_tokens\": {}, \"exact_rows_per_screened_token\": {:.1}, \"whole_head_tokens\": {}}}",
        pair.greedy_tok_s,
        pair.sampled_tok_s,
        pair.sampled_tok_s / pair.greedy_tok_s,
        rows.0,
        rows.1 as f64 / rows.0.max(1) as f64,
        rows.2
    );
    Ok(())
}
