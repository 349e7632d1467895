//! The network tier's benchmark (a perf-style binary, `harness = false`): in one run,
//!
//! 1. one 13 MB expert record over plain TCP loopback (the bound for moving those bytes),
//! 2. the same bytes over one QUIC stream with stormo's endpoint settings (socket buffers,
//!    raw-key TLS 1.3), sent as `Bytes` without a copy and read up to 32 received chunks at a
//!    time into a buffer allocated once (the fewest copies and wake-ups quinn allows: the
//!    ceiling for 3),
//! 3. whole verified expert fetches through the network tier (`PeerTier`: request, chunked
//!    stream into the record's buffer, a BLAKE3 check of each chunk), latency p50/p99 and
//!    throughput, after one untimed fetch of every expert so that the serving node answers
//!    from its RAM cache as the bare QUIC stream does (not from its disk),
//! 4. decode tokens/s of a small model whose experts all come from a peer against the same run
//!    with its experts from the local disk (both at the smallest RAM budget, so every layer
//!    streams its experts).
//!
//! The model is a synthetic checkpoint with gpt-oss-20b's expert geometry (2880×2880 MXFP4, a
//! 13.2 MB record), a few layers and experts, written to a scratch folder and removed after.
//!
//! ```sh
//! cargo bench -p stormo-cli --bench net            # STORMO_BENCH_REPS=20 by default
//! STORMO_BENCH_DIR=/tmp/scratch cargo bench -p stormo-cli --bench net
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use stormo_engine::generate::{greedy, Timings};
use stormo_engine::moe::{ExpertData, ExpertProvider};
use stormo_engine::tiers::{ExpertId, Priority, Tier};
use stormo_engine::{LoadOptions, Model, ModelFiles};
use stormo_manifests::{build, BuildOptions, SecretKey};
use stormo_net::serve::{self, ServeConfig};
use stormo_net::tier::{PeerConfig, PeerTier};
use stormo_net::tls::{self, Admission};
use stormo_net::{self as net, PeerAddr};
use stormo_node::config::{CacheBudget, ExpertsConfig};
use stormo_node::experts::Experts;
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

/// Prints the p50 and p99 of `secs` and returns the p50.
fn report(what: &str, bytes: usize, secs: &mut [f64]) -> f64 {
    let p50 = quantile(secs, 0.5);
    let p99 = quantile(secs, 0.99);
    println!(
        "{what:<44} p50 {:>8.2} ms  p99 {:>8.2} ms  {:>8.0} MB/s (at p50)",
        p50 * 1e3,
        p99 * 1e3,
        bytes as f64 / p50 / 1e6
    );
    p50
}

fn tcp(buf: &Arc<Vec<u8>>, reps: usize) -> anyhow::Result<Vec<f64>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let b = buf.clone();
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut one = [0u8; 1];
        for _ in 0..reps {
            s.read_exact(&mut one)?;
            s.write_all(&b)?;
        }
        Ok(())
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut out = vec![0u8; buf.len()];
    let mut secs = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        c.write_all(&[1])?;
        c.read_exact(&mut out)?;
        secs.push(t.elapsed().as_secs_f64());
    }
    server.join().expect("tcp server thread")?;
    anyhow::ensure!(out == **buf, "tcp bytes differ");
    Ok(secs)
}

/// A bare QUIC server that answers every stream with `record`, and a client connected to it.
async fn bare_quic(record: bytes::Bytes) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    let server_key = SecretKey::from_seed(&[1; 32]);
    let client_key = SecretKey::from_seed(&[2; 32]);
    let sc = tls::server_config(&server_key, Admission::Any, 8, tls::Congestion::Cubic)?;
    let server = net::bind("127.0.0.1:0".parse()?, Some(sc))?;
    let addr = server.local_addr()?;
    tokio::spawn(async move {
        while let Some(inc) = server.accept().await {
            let Ok(conn) = inc.await else { continue };
            let b = record.clone();
            tokio::spawn(async move {
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let _ = recv.read_to_end(16).await;
                    let _ = send.write_all_chunks(&mut [b.clone()]).await;
                    let _ = send.finish();
                }
            });
        }
    });
    let client = net::bind("127.0.0.1:0".parse()?, None)?;
    let cc = tls::client_config(&client_key, &server_key.public())?;
    let conn = tokio::time::timeout(
        Duration::from_secs(5),
        client.connect_with(cc, addr, "stormo")?,
    )
    .await
    .context("QUIC connect timed out")??;
    Ok((client, conn))
}

/// One record over a new stream of `conn` into `out`: its time.
async fn bare_quic_one(conn: &quinn::Connection, out: &mut [u8]) -> anyhow::Result<f64> {
    let t = Instant::now();
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(&[1]).await?;
    send.finish()?;
    let mut at = 0;
    let mut chunks: [bytes::Bytes; 32] = Default::default();
    while let Some(n) = recv.read_chunks(&mut chunks).await? {
        for c in &chunks[..n] {
            anyhow::ensure!(at + c.len() <= out.len(), "quic: more bytes than sent");
            out[at..at + c.len()].copy_from_slice(c);
            at += c.len();
        }
    }
    anyhow::ensure!(at == out.len(), "quic: {at} of {} bytes", out.len());
    Ok(t.elapsed().as_secs_f64())
}

fn expert_args(cache: CacheBudget) -> ExpertsConfig {
    ExpertsConfig {
        cache,
        prefetch: true,
        io_threads: 2,
        hot_store: false,
        ..ExpertsConfig::default()
    }
}

/// Decode tokens/s of `new` tokens after a short prompt, with experts from `tiers`.
fn decode_rate(
    dir: &Path,
    tiers: Vec<Arc<dyn Tier>>,
    new: usize,
) -> anyhow::Result<(f64, Vec<u32>)> {
    let files = ModelFiles::open(dir)?;
    let experts = Experts::build(&files, &expert_args(CacheBudget::Bytes(0)), 64, tiers, None)?;
    let model = Model::new(files, experts.provider.clone(), &LoadOptions::default())?;
    let prompt = [1u32, 2, 3, 4];
    let mut sess = model.session(prompt.len() + new)?;
    let mut t = Timings::default();
    let ids = greedy(&model, &mut sess, &prompt, new, &[], |_, _| {}, &mut t)?;
    Ok(((ids.len() - 1) as f64 / t.decode_s, ids))
}

fn main() -> anyhow::Result<()> {
    // `cargo test --benches` runs this with --bench absent: do nothing heavy then.
    if !std::env::args().any(|a| a == "--bench") {
        println!("net bench: run with `cargo bench -p stormo-cli --bench net`");
        return Ok(());
    }
    let reps = env("STORMO_BENCH_REPS", 20).max(2);
    let layers = env("STORMO_BENCH_LAYERS", 2);
    let experts = env("STORMO_BENCH_EXPERTS", 8);
    let base = std::env::var("STORMO_BENCH_DIR")
        .unwrap_or_else(|_| std::env::temp_dir().display().to_string());
    let scratch = tempfile::tempdir_in(&base).context("scratch folder")?;
    let dir = scratch.path().join("model");
    let geometry = Preset::GptOss20b.geometry().with(&Overrides {
        layers: Some(layers),
        experts: Some(experts),
        top_k: Some(4.min(experts)),
        vocab: Some(4096),
        ..Overrides::default()
    });
    let plan = synth::plan(&SynthOptions::new(geometry, 7))?;
    synth::write(&plan, &dir, false, &mut |_| {})?;
    let m = build(&dir, &BuildOptions::default())?;
    std::fs::write(dir.join("stormo-manifest.bin"), m.encode())?;
    let rec_len = m.experts[0].len as usize;
    println!(
        "model: {layers} layers x {experts} experts of {:.1} MB (gpt-oss-20b expert geometry), {reps} reps",
        rec_len as f64 / 1e6
    );

    let record = {
        let files = ModelFiles::open(&dir)?;
        let mut out = Vec::new();
        files
            .mapped_experts()?
            .fetch(0, &[0], &mut out)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let d: &ExpertData = &out[0];
        Arc::new(
            d.parts()
                .flat_map(|p| p.iter().copied())
                .collect::<Vec<u8>>(),
        )
    };

    let mut secs = tcp(&record, reps)?;
    let _ = report("TCP loopback, one record", rec_len, &mut secs);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (bare_client, bare) = rt.block_on(bare_quic(bytes::Bytes::from(record.to_vec())))?;
    let mut out = vec![0u8; record.len()];

    // A serving node with every expert, and the network tier of a client.
    let server_key = SecretKey::from_seed(&[3; 32]);
    let client_key = SecretKey::from_seed(&[4; 32]);
    let (holdings, _experts) =
        stormo_node::experts::open_holdings(&dir, None, &expert_args(CacheBudget::Auto), None)?;
    let handle = rt.block_on(async {
        serve::start(
            &server_key,
            "127.0.0.1:0".parse().expect("address"),
            Arc::new(holdings),
            ServeConfig {
                admission: Admission::Any,
                ..ServeConfig::default()
            },
        )
    })?;
    let peer = PeerAddr {
        key: server_key.public(),
        addr: handle.local_addr(),
    };
    let files = ModelFiles::open(&dir)?;
    let tier = Arc::new(PeerTier::connect(
        &client_key,
        std::slice::from_ref(&peer),
        Arc::new(m.clone()),
        m.model_id(),
        files.layout.schemas.clone(),
        PeerConfig::default(),
        Some(rt.handle().clone()),
    )?);
    let fetch_one = |i: usize| -> anyhow::Result<f64> {
        let key = ExpertId::from_indices(i % layers, (i / layers) % experts);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = Instant::now();
        tier.load(
            &[key],
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
        Ok(t.elapsed().as_secs_f64())
    };
    // Untimed: every expert once, so that the server's cache holds them all, and as many bare
    // records.
    for i in 0..layers * experts {
        fetch_one(i)?;
        rt.block_on(bare_quic_one(&bare, &mut out))?;
    }
    anyhow::ensure!(out == *record, "quic bytes differ");
    // Timed, alternating: the two see the same moments of a noisy machine.
    let (mut bare_secs, mut secs, mut pairs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..reps {
        let b = rt.block_on(bare_quic_one(&bare, &mut out))?;
        let f = fetch_one(i)?;
        bare_secs.push(b);
        secs.push(f);
        pairs.push(b / f);
    }
    bare_client.close(0u32.into(), b"done");
    let quic_p50 = report(
        "QUIC loopback, one record on one stream",
        rec_len,
        &mut bare_secs,
    );
    let fetch_p50 = report(
        "stormo verified fetch (PeerTier), one record",
        rec_len,
        &mut secs,
    );
    println!(
        "verified fetch / bare QUIC throughput at p50: {:.2} (alternated; median of the {reps} pairs' ratios: {:.2})",
        quic_p50 / fetch_p50,
        quantile(&mut pairs, 0.5)
    );

    let new = env("STORMO_BENCH_TOKENS", 16);
    let disk: Arc<dyn Tier> = Arc::new(files.disk_tier(2, None)?);
    let (disk_rate, disk_ids) = decode_rate(&dir, vec![disk], new)?;
    let (peer_rate, peer_ids) = decode_rate(&dir, vec![tier.clone()], new)?;
    anyhow::ensure!(disk_ids == peer_ids, "ids differ between disk and peers");
    println!(
        "decode at the smallest RAM budget: local disk {disk_rate:.2} tok/s, all experts from a peer {peer_rate:.2} tok/s ({:.0}%)",
        100.0 * peer_rate / disk_rate
    );
    tier.close();
    handle.close();
    drop(scratch);
    Ok(())
}
