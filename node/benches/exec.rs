//! Remote expert execution on loopback (a perf-style binary, `harness = false`): in one run,
//! side by side,
//!
//! 1. one expert computed here for one position, on a one-thread pool like the server's
//!    default exec pool (the compute alone);
//! 2. the same expert run by a peer over QUIC loopback (`PeerTier::exec`: `Exec` out,
//!    `ExecResult` back, 11,520 bytes each way at hidden 2,880), one position and 8 positions,
//!    latency p50/p99; the p50 less the compute's p50 is the call's own cost (network, framing,
//!    dispatch to the exec pool), the figure issue 39's goal of 200 µs is about;
//! 3. a verified fetch of the same expert's record (13.2 MB) from the same peer, the
//!    alternative remote execution replaces.
//!
//! The model is a synthetic checkpoint with gpt-oss-20b's expert geometry (2880×2880 MXFP4) by
//! default. The figures need a quiet machine: on a shared one, read only the ratios of one run.
//!
//! ```sh
//! cargo bench -p stormo-cli --bench exec                   # STORMO_BENCH_REPS=200
//! STORMO_BENCH_HIDDEN=256 STORMO_BENCH_REPS=20 cargo bench -p stormo-cli --bench exec  # smoke
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use stormo_engine::moe::{expert_forward, ExpertData, ExpertProvider, ExpertScratch};
use stormo_engine::tiers::{Priority, Tier};
use stormo_engine::ModelFiles;
use stormo_manifests::{build, BuildOptions, ExpertId, SecretKey};
use stormo_net::exec::ExecConfig;
use stormo_net::serve::{self, ServeConfig};
use stormo_net::tier::{PeerConfig, PeerTier};
use stormo_net::tls::Admission;
use stormo_net::PeerAddr;
use stormo_node::config::{CacheBudget, ExpertsConfig};
use stormo_simulations::synth::{self, Overrides, Preset, SynthOptions};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Prints p50 and p99 of `secs` and returns the p50.
fn report(what: &str, secs: &mut [f64]) -> f64 {
    let p50 = quantile(secs, 0.5);
    let p99 = quantile(secs, 0.99);
    println!(
        "{what:<52} p50 {:>9.1} us  p99 {:>9.1} us",
        p50 * 1e6,
        p99 * 1e6
    );
    p50
}

fn rows(n: usize, hidden: usize) -> Vec<f32> {
    (0..n * hidden)
        .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 2.0)
        .collect()
}

fn main() -> anyhow::Result<()> {
    // `cargo test --benches` runs this with --bench absent: do nothing heavy then.
    if !std::env::args().any(|a| a == "--bench") {
        println!("exec bench: run with `cargo bench -p stormo-cli --bench exec`");
        return Ok(());
    }
    let reps = env("STORMO_BENCH_REPS", 200).max(2);
    let threads = env("STORMO_BENCH_EXEC_THREADS", 1).max(1);
    let base = std::env::var("STORMO_BENCH_DIR")
        .unwrap_or_else(|_| std::env::temp_dir().display().to_string());
    let scratch = tempfile::tempdir_in(&base).context("scratch folder")?;
    let dir = scratch.path().join("model");
    let mut over = Overrides {
        layers: Some(1),
        experts: Some(4),
        top_k: Some(4),
        vocab: Some(1024),
        ..Overrides::default()
    };
    if let Ok(h) = std::env::var("STORMO_BENCH_HIDDEN") {
        let h: usize = h.parse().context("STORMO_BENCH_HIDDEN")?;
        over.hidden = Some(h);
        over.intermediate = Some(h);
        over.heads = Some(4);
        over.kv_heads = Some(2);
        over.head_dim = Some(h / 4);
    }
    let geometry = Preset::GptOss20b.geometry().with(&over);
    let plan = synth::plan(&SynthOptions::new(geometry, 7))?;
    synth::write(&plan, &dir, false, &mut |_| {})?;
    let m = build(&dir, &BuildOptions::default())?;
    std::fs::write(dir.join("stormo-manifest.bin"), m.encode())?;
    let files = ModelFiles::open(&dir)?;
    let layer = files
        .layout
        .schemas
        .iter()
        .position(Option::is_some)
        .context("no expert layer")?;
    let schema = files.layout.schemas[layer].clone().context("schema")?;
    let hidden = schema.hidden;
    let expert = ExpertId::new(layer as u16, 0);
    let rec_len = m.experts[0].len;
    println!(
        "expert: hidden {hidden}, intermediate {}, record {:.1} MB; {reps} reps; exec pool of {threads} thread(s); {} bytes of rows each way per position",
        schema.intermediate,
        rec_len as f64 / 1e6,
        4 * hidden
    );

    // 1. The compute alone, on a pool like the server's.
    let data: Arc<ExpertData> = {
        let mut out = Vec::new();
        files
            .mapped_experts()?
            .fetch(layer, &[0], &mut out)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        out.pop().context("no expert")?
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let one = rows(1, hidden);
    let mut secs = Vec::with_capacity(reps);
    let mut local = Vec::new();
    pool.install(|| {
        let mut s = ExpertScratch::default();
        for _ in 0..reps {
            let t = Instant::now();
            expert_forward(
                &schema.view(&data),
                &one,
                hidden,
                schema.intermediate,
                &mut s,
            );
            secs.push(t.elapsed().as_secs_f64());
        }
        local = s.output().to_vec();
    });
    let compute = report("compute here, one position", &mut secs);

    // 2. The same at a peer.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let server_key = SecretKey::from_seed(&[3; 32]);
    let client_key = SecretKey::from_seed(&[4; 32]);
    let experts = ExpertsConfig {
        cache: CacheBudget::Auto,
        io_threads: 1,
        hot_store: false,
        ..ExpertsConfig::default()
    };
    let (holdings, _experts) = stormo_node::experts::open_holdings(&dir, None, &experts, None)?;
    let handle = rt.block_on(async {
        serve::start(
            &server_key,
            "127.0.0.1:0".parse().expect("address"),
            Arc::new(holdings),
            ServeConfig {
                admission: Admission::Any,
                exec: ExecConfig {
                    threads,
                    ..ExecConfig::default()
                },
                ..ServeConfig::default()
            },
        )
    })?;
    let peer = PeerAddr {
        key: server_key.public(),
        addr: handle.local_addr(),
    };
    let tier = PeerTier::connect(
        &client_key,
        std::slice::from_ref(&peer),
        Arc::new(m.clone()),
        m.model_id(),
        files.layout.schemas.clone(),
        PeerConfig::default(),
        Some(rt.handle().clone()),
    )?;
    let deadline = Duration::from_secs(10);
    // Warm: the connection, the server's cache of the record.
    let got = tier.exec_blocking(&peer.key, expert, &one, deadline)?;
    anyhow::ensure!(
        got.iter()
            .map(|x| x.to_bits())
            .eq(local.iter().map(|x| x.to_bits())),
        "the peer's rows differ from the local ones"
    );
    let mut remote_p50 = 0.0;
    for n in [1usize, 8] {
        let xs = rows(n, hidden);
        let mut secs = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            tier.exec_blocking(&peer.key, expert, &xs, deadline)?;
            secs.push(t.elapsed().as_secs_f64());
        }
        let p50 = report(
            &format!("remote exec on loopback, {n} position(s)"),
            &mut secs,
        );
        if n == 1 {
            remote_p50 = p50;
        }
    }
    println!(
        "{:<52} p50 {:>9.1} us  (goal: at most 200 us)",
        "  of which the call itself (remote - compute)",
        (remote_p50 - compute) * 1e6
    );

    // 3. Fetching the record instead.
    let fetches = reps.min(20);
    let mut secs = Vec::with_capacity(fetches);
    for _ in 0..fetches {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = Instant::now();
        tier.load(
            &[expert],
            Priority::Demand,
            Arc::new(
                move |_: ExpertId, r: stormo_engine::Result<Arc<ExpertData>>| {
                    let _ = tx.send(r.map(|_| ()));
                },
            ),
        );
        rx.recv_timeout(Duration::from_secs(60))
            .context("fetch hung")?
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        secs.push(t.elapsed().as_secs_f64());
    }
    let fetch = report("verified fetch of the record instead", &mut secs);
    println!(
        "fetch / remote exec (one position), p50: {:.1}x",
        fetch / remote_p50
    );
    let st = &handle.exec_stats;
    println!(
        "server: {} calls answered, {} busy",
        st.answered.load(std::sync::atomic::Ordering::Relaxed),
        st.busy.load(std::sync::atomic::Ordering::Relaxed)
    );
    tier.close();
    handle.close();
    drop(scratch);
    Ok(())
}
