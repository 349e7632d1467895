//! Manifest benchmarks.
//!
//! - `record`: [`Manifest::verify_record`] on one GPT-OSS-20B-sized expert (13.2 MB) and
//!   [`Manifest::verify_chunk`] on one 256 KiB chunk: the check the node runs on every expert
//!   that arrives from a peer.
//! - `build`: manifest build throughput against a raw sequential read of the same files in
//!   the same run. By default on a scratch Qwen3-MoE-layout checkpoint written to a temporary
//!   folder under /tmp (about 550 MB, `STORMO_BENCH_MB` to change) and deleted afterwards;
//!   `STORMO_BENCH_MODEL=DIR` benchmarks a real checkpoint instead. Both passes read the
//!   same way (`STORMO_BENCH_IO=buffered`, the default: the scratch files are in the page
//!   cache, so both figures are CPU-bound; `STORMO_BENCH_IO=direct`: both read from the disk
//!   with O_DIRECT). For a multi-GB checkpoint `stormo manifest bench` does the same in fewer
//!   passes.
//!
//! Run: `cargo bench -p stormo-manifests --bench manifest`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use stormo_engine::safetensors::{write, Dtype};
use stormo_manifests::manifest::{
    chunk_count, ExpertEntry, ExpertPart, Manifest, MetaFile, ModelIdentity, Quant, Sha256,
    TensorDtype, TensorEntry, WeightFile, DEFAULT_CHUNK_SIZE,
};
use stormo_manifests::{build, read_files, BuildOptions, ExpertId, Hash, IoMode};

fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.extend_from_slice(&s.to_le_bytes());
    }
    v.truncate(n);
    v
}

/// A manifest with one expert whose record is `record`.
fn one_expert(record: &[u8]) -> Manifest {
    let len = record.len() as u64;
    let chunks = record
        .chunks(DEFAULT_CHUNK_SIZE as usize)
        .map(Hash::of)
        .collect::<Vec<_>>();
    assert_eq!(chunks.len() as u64, chunk_count(len, DEFAULT_CHUNK_SIZE));
    Manifest {
        identity: ModelIdentity {
            family: "gpt_oss".into(),
            meta: vec![MetaFile {
                name: "config.json".into(),
                len: 0,
                hash: Hash::of(b""),
            }],
        },
        chunk_size: DEFAULT_CHUNK_SIZE,
        files: vec![WeightFile {
            name: "model.safetensors".into(),
            len: 8 + len,
            sha256: Sha256::default(),
        }],
        tensors: vec![TensorEntry {
            name: "experts".into(),
            dtype: TensorDtype::U8,
            shape: vec![len],
            quant: Quant::None,
            file: 0,
            offset: 8,
            len,
            hash: Hash::of(record),
        }],
        experts: vec![ExpertEntry {
            id: ExpertId {
                layer: 0,
                expert: 0,
            },
            parts: vec![ExpertPart {
                tensor: 0,
                offset: 8,
                len,
            }],
            len,
            hash: Hash::of(record),
            chunks,
        }],
    }
}

fn record(c: &mut Criterion) {
    // GPT-OSS-20B: MXFP4 gate_up + down blocks, scales and biases = 13,271,040 bytes.
    let record = noise(13_271_040, 7);
    let m = one_expert(&record);
    let id = ExpertId {
        layer: 0,
        expert: 0,
    };
    let mut g = c.benchmark_group("record");
    g.throughput(Throughput::Bytes(record.len() as u64));
    g.bench_function("verify_record_13.2MB", |b| {
        b.iter(|| m.verify_record(id, &record).expect("valid"))
    });
    let cs = DEFAULT_CHUNK_SIZE as usize;
    g.throughput(Throughput::Bytes(cs as u64));
    g.bench_function("verify_chunk_256KiB", |b| {
        b.iter(|| {
            m.verify_chunk(id, 3, &record[3 * cs..4 * cs])
                .expect("valid")
        })
    });
    g.finish();
}

/// Writes a Qwen3-MoE-layout checkpoint of about `mb` MB (expert tensors only, which is all
/// the manifest builder needs beside the config).
fn scratch_checkpoint(dir: &Path, mb: usize) {
    let (layers, h, i) = (4usize, 1024usize, 704usize);
    let per_expert = 3 * h * i * 2;
    let experts = (mb * 1_000_000 / (layers * per_expert)).max(1);
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen3moe-tiny");
    let cfg = std::fs::read_to_string(fixture.join("config.json")).expect("fixture config");
    let mut cfg: serde_json::Value = serde_json::from_str(&cfg).expect("json");
    cfg["hidden_size"] = h.into();
    cfg["moe_intermediate_size"] = i.into();
    cfg["num_experts"] = experts.into();
    cfg["num_hidden_layers"] = layers.into();
    cfg["num_experts_per_tok"] = experts.min(4).into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("write config");
    let mut names = Vec::new();
    let mut shapes = Vec::new();
    for l in 0..layers {
        for e in 0..experts {
            for (p, s) in [
                ("gate_proj", [i, h]),
                ("up_proj", [i, h]),
                ("down_proj", [h, i]),
            ] {
                names.push(format!("model.layers.{l}.mlp.experts.{e}.{p}.weight"));
                shapes.push(s);
            }
        }
    }
    let data: Vec<Vec<u8>> = (0..names.len())
        .map(|k| noise(h * i * 2, k as u64 + 1))
        .collect();
    let tensors: Vec<(&str, Dtype, &[usize], &[u8])> = names
        .iter()
        .zip(&shapes)
        .zip(&data)
        .map(|((n, s), d)| (n.as_str(), Dtype::BF16, &s[..], &d[..]))
        .collect();
    write(&dir.join("model.safetensors"), &tensors, None).expect("write scratch checkpoint");
}

fn safetensors_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("model dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("reference"))
        })
        .collect();
    v.sort();
    v
}

fn build_vs_read(c: &mut Criterion) {
    let scratch;
    let dir = match std::env::var_os("STORMO_BENCH_MODEL") {
        Some(d) => PathBuf::from(d),
        None => {
            let mb = std::env::var("STORMO_BENCH_MB")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(550);
            scratch = tempfile::Builder::new()
                .prefix("stormo-manifest-bench")
                .tempdir_in("/tmp")
                .expect("scratch dir");
            scratch_checkpoint(scratch.path(), mb);
            scratch.path().to_path_buf()
        }
    };
    let files = safetensors_files(&dir);
    let bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).expect("metadata").len())
        .sum();
    let names: Vec<String> = files
        .iter()
        .map(|f| {
            f.file_name()
                .and_then(|n| n.to_str())
                .expect("UTF-8 file name")
                .to_string()
        })
        .collect();
    let io: IoMode = std::env::var("STORMO_BENCH_IO")
        .unwrap_or_else(|_| "buffered".into())
        .parse()
        .expect("STORMO_BENCH_IO is direct or buffered");
    let opts = BuildOptions {
        io,
        ..BuildOptions::default()
    };
    let mut g = c.benchmark_group("build");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(20));
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function("raw_read", |b| {
        b.iter(|| read_files(&dir, &names, io, None).expect("read"))
    });
    g.bench_function("manifest_build", |b| {
        b.iter(|| build(&dir, &opts).expect("build"))
    });
    g.finish();
    // `scratch` (if any) is deleted here.
}

criterion_group!(benches, record, build_vs_read);
criterion_main!(benches);
