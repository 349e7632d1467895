//! Manifests on the oracle fixtures: build, golden model id, every-byte verification, records
//! and chunks, signatures, and the `stormo manifest` / `stormo key` commands.

use std::collections::BTreeSet;
use std::path::Path;

use stormo_engine::layout::ExpertLayout;
use stormo_engine::safetensors::Checkpoint;
use stormo_engine::ModelConfig;
use stormo_manifests::{
    build, build_reference, verify, BuildOptions, ExpertId, Hash, IoMode, Manifest,
    ManifestSignature, Problem, Progress, SecretKey, SignatureError, VerifyOptions,
};
use stormo_simulations::synth::{self, Overrides, Preset, SynthOptions};
use stormo_tests::{fixture, MODEL_FIXTURES};

/// The model id of `gptoss-tiny-mxfp4` with the default 256 KiB chunks. It depends only on
/// the fixture's bytes and the format: not on paths, times, machines or hash-map order.
const GOLDEN_MXFP4_MODEL_ID: &str =
    "9699d34bb95ca3490d1e7904013eb44cccbff7eb1d378edb3af4dc62e80ce026";

/// A copy of fixture `name`'s model in a temporary folder.
pub(crate) fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    stormo_tests::copy_model(name, tmp.path());
    tmp
}

fn build_default(dir: &Path) -> Manifest {
    build(dir, &BuildOptions::default()).expect("manifest builds")
}

fn check(dir: &Path, m: &Manifest) -> Vec<Problem> {
    verify(dir, m, &VerifyOptions::default())
        .expect("verify runs")
        .problems
}

#[test]
fn golden_model_id_is_stable_across_paths_and_runs() {
    let a = build_default(&fixture("gptoss-tiny-mxfp4"));
    let copy = copy_fixture("gptoss-tiny-mxfp4");
    let b = build_default(copy.path());
    assert_eq!(a.encode(), b.encode(), "the manifest depends on the path");
    assert_eq!(a.model_id().to_hex(), GOLDEN_MXFP4_MODEL_ID);
    // The decoder gives back the same manifest and id.
    let back = Manifest::decode(&a.encode()).expect("decodes");
    assert_eq!(back.model_id(), a.model_id());
}

/// The pipelined builder (both I/O modes) writes byte for byte the manifest of the plain
/// reference builder, on every fixture and on synthesised checkpoints of both families with
/// many small shards (expert records whose parts lie in different files).
#[test]
fn pipelined_build_is_byte_identical_to_the_reference() {
    let chunk = 16 * 1024;
    let both = |dir: &Path, what: &str| {
        let want = build_reference(dir, chunk)
            .expect("reference build")
            .encode();
        for io in [IoMode::Buffered, IoMode::Direct] {
            let progress = Progress::new();
            let got = build(
                dir,
                &BuildOptions {
                    chunk_size: chunk,
                    io,
                    progress: Some(&progress),
                },
            )
            .expect("build");
            assert!(
                got.encode() == want,
                "{what}, {io:?}: differs from reference"
            );
            // Every byte read exactly once: no expert record was read a second time.
            let files = got.total_file_bytes();
            assert_eq!(progress.get(), (files, files), "{what}, {io:?}");
        }
        want
    };
    for name in MODEL_FIXTURES {
        both(&fixture(name), name);
    }
    // On disk (not tmpfs), so that O_DIRECT is really used where Linux allows it.
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"));
    for preset in [Preset::GptOss20b, Preset::Qwen3_30bA3b] {
        let o = Overrides {
            layers: Some(3),
            hidden: Some(128),
            intermediate: Some(256),
            experts: Some(8),
            top_k: Some(2),
            vocab: Some(256),
            heads: Some(4),
            kv_heads: Some(2),
            head_dim: Some(32),
        };
        let mut opts = SynthOptions::new(preset.geometry().with(&o), 7);
        opts.shard_bytes = Some(96 << 10);
        let plan = synth::plan(&opts).expect("plan");
        let tmp = tempfile::tempdir_in(root).expect("tempdir");
        synth::write(&plan, tmp.path(), false, &mut |_| {}).expect("synth");
        let shards = std::fs::read_dir(tmp.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".safetensors")
            })
            .count();
        assert!(shards >= 4, "{preset:?}: only {shards} shards");
        let bytes = both(tmp.path(), preset.name());
        let m = Manifest::decode(&bytes).unwrap();
        let spans_files = m.experts.iter().any(|e| {
            let files: BTreeSet<u32> = e
                .parts
                .iter()
                .map(|p| m.tensors[p.tensor as usize].file)
                .collect();
            files.len() > 1
        });
        assert!(spans_files, "{preset:?}: no expert spans two shards");
        assert!(m.experts.iter().any(|e| e.chunks.len() > 1));
        let report = verify(
            tmp.path(),
            &m,
            &VerifyOptions {
                io: IoMode::Direct,
                ..VerifyOptions::default()
            },
        )
        .unwrap();
        assert!(report.is_ok(), "{:?}", report.problems);
    }
}

/// Each fixture builds, verifies clean, lists every tensor and expert the engine sees, and
/// each expert record assembled from the engine's layout passes `verify_record` and every
/// chunk passes `verify_chunk`.
#[test]
fn manifests_cover_every_tensor_and_expert_and_records_verify() {
    for name in MODEL_FIXTURES {
        let dir = fixture(name);
        let m = build_default(&dir);
        assert!(check(&dir, &m).is_empty(), "{name}: clean fixture flagged");
        let ckpt = Checkpoint::open(&dir).unwrap();
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let layout = ExpertLayout::from_checkpoint(&ckpt, &cfg).unwrap();
        let names: Vec<&str> = m.tensors.iter().map(|t| t.name.as_str()).collect();
        let want: Vec<&str> = ckpt.tensors.keys().map(String::as_str).collect();
        assert_eq!(names, want, "{name}");
        assert_eq!(m.identity.family, cfg.family.model_type());
        assert!(m.identity.meta.iter().any(|f| f.name == "config.json"));
        let config = std::fs::read(dir.join("config.json")).unwrap();
        assert_eq!(m.identity.meta[0].hash, Hash::of(&config));
        for t in &m.tensors {
            let bytes = ckpt.get(&t.name).unwrap().bytes;
            assert_eq!(t.hash, Hash::of(bytes), "{name}: tensor {}", t.name);
        }
        let mut n = 0;
        for (l, per_layer) in layout.parts.iter().enumerate() {
            for (e, parts) in per_layer.iter().enumerate() {
                n += 1;
                let id = ExpertId {
                    layer: l as u16,
                    expert: e as u16,
                };
                let mut record = Vec::new();
                for p in parts {
                    let f = &ckpt.files[p.loc.file].map;
                    record.extend_from_slice(
                        &f[p.loc.offset as usize..(p.loc.offset + p.loc.len) as usize],
                    );
                }
                let schema = layout.schemas[l].as_ref().unwrap();
                assert_eq!(record.len(), schema.expert_len());
                m.verify_record(id, &record).unwrap();
                for (i, c) in record.chunks(m.chunk_size as usize).enumerate() {
                    m.verify_chunk(id, i as u32, c).unwrap();
                }
                let last = record.len() - 1;
                record[last] ^= 1;
                assert!(m.verify_record(id, &record).is_err());
            }
        }
        assert_eq!(m.experts.len(), n, "{name}");
        // The MXFP4 fixture's expert blocks and scales carry their quantization scheme.
        if *name == "gptoss-tiny-mxfp4" {
            let q: BTreeSet<String> = m.tensors.iter().map(|t| format!("{:?}", t.quant)).collect();
            assert!(q.contains("Mxfp4Blocks { block: 32 }"), "{q:?}");
            assert!(q.contains("Mxfp4Scales { block: 32 }"), "{q:?}");
        }
    }
}

/// A small deterministic sampler.
struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n.max(1)
    }
}

/// Flips single bytes at sampled positions in every tensor (first, last and random bytes: so
/// expert weights, MXFP4 blocks and scales, biases, norms, embeddings) and in the header, and
/// checks each is detected and named: the tensor, and the expert(s) whose record holds the
/// byte (as the engine's layout says, independently of the manifest).
#[test]
fn every_sampled_single_byte_flip_is_detected_and_named() {
    for name in MODEL_FIXTURES {
        let tmp = copy_fixture(name);
        let dir = tmp.path();
        let m = build_default(dir);
        let ckpt = Checkpoint::open(dir).unwrap();
        let cfg = ModelConfig::from_dir(dir).unwrap();
        let layout = ExpertLayout::from_checkpoint(&ckpt, &cfg).unwrap();
        let tensors: Vec<(String, u64, u64)> = ckpt
            .tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.offset, t.len))
            .collect();
        let header_end = tensors.iter().map(|t| t.1).min().unwrap();
        drop(ckpt);
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let mut rng = Lcg(0x5eed);
        let mut flips = 0;
        let mut experts_named = 0;
        for (tname, off, len) in &tensors {
            // Two positions per tensor: a random byte, and the first or the last byte.
            let edge = if rng.below(2) == 0 { 0 } else { len - 1 };
            for p in [edge, rng.below(*len)] {
                let pos = (off + p) as usize;
                bytes[pos] ^= 0x10;
                std::fs::write(&path, &bytes).unwrap();
                let problems = check(dir, &m);
                bytes[pos] ^= 0x10;
                flips += 1;
                assert!(
                    problems.contains(&Problem::TensorDiffers {
                        name: tname.clone(),
                        file: "model.safetensors".into()
                    }),
                    "{name}: flip at byte {pos} in {tname} not named: {problems:?}"
                );
                for (l, per_layer) in layout.parts.iter().enumerate() {
                    for (e, parts) in per_layer.iter().enumerate() {
                        let holds = parts.iter().any(|p| {
                            (p.loc.offset..p.loc.offset + p.loc.len).contains(&(pos as u64))
                        });
                        let named = problems.iter().any(|q| {
                            matches!(q,
                            Problem::ExpertDiffers { id, tensors, .. }
                                if *id == ExpertId { layer: l as u16, expert: e as u16 }
                                    && tensors.contains(tname))
                        });
                        assert_eq!(holds, named, "{name}: expert {l}:{e}, flip in {tname}");
                        experts_named += usize::from(named);
                    }
                }
            }
        }
        // Header bytes: some flips break the JSON, others change a number or a name; all are
        // caught (as a header, layout or whole-file mismatch).
        for _ in 0..24 {
            let pos = 8 + rng.below(header_end - 8) as usize;
            bytes[pos] ^= 0x01;
            std::fs::write(&path, &bytes).unwrap();
            let problems = check(dir, &m);
            bytes[pos] ^= 0x01;
            assert!(!problems.is_empty(), "{name}: header flip at {pos} missed");
        }
        std::fs::write(&path, &bytes).unwrap();
        assert!(check(dir, &m).is_empty(), "{name}: restored copy flagged");
        assert!(
            flips > 100 && experts_named > 20,
            "{name}: {flips} {experts_named}"
        );
    }
}

#[test]
fn truncation_missing_tensor_and_missing_files_are_reported() {
    let tmp = copy_fixture("gptoss-tiny-mxfp4");
    let dir = tmp.path();
    let m = build_default(dir);
    let path = dir.join("model.safetensors");
    let orig = std::fs::read(&path).unwrap();

    // Truncated by one byte: the file is named with both lengths; the last tensor is cut off.
    std::fs::write(&path, &orig[..orig.len() - 1]).unwrap();
    let p = check(dir, &m);
    assert!(p.contains(&Problem::FileTruncated {
        file: "model.safetensors".into(),
        expected: orig.len() as u64,
        found: orig.len() as u64 - 1
    }));
    let last = m.tensors.iter().max_by_key(|t| t.offset).unwrap();
    assert!(p
        .iter()
        .any(|q| matches!(q, Problem::TensorUnreadable { name, .. } if *name == last.name)));

    // A tensor removed from the file (the rest rewritten): named as missing.
    let ckpt = Checkpoint::open(&fixture("gptoss-tiny-mxfp4")).unwrap();
    let victim = "model.layers.1.mlp.experts.down_proj_scales";
    assert!(ckpt.tensors.contains_key(victim));
    let keep: Vec<(&str, _, &[usize], &[u8])> = ckpt
        .tensors
        .keys()
        .filter(|n| *n != victim)
        .map(|n| {
            let t = ckpt.get(n).unwrap();
            (n.as_str(), t.dtype, t.shape, t.bytes)
        })
        .collect();
    stormo_engine::safetensors::write(&path, &keep, None).unwrap();
    let p = check(dir, &m);
    assert!(
        p.contains(&Problem::TensorMissing {
            name: victim.into(),
            file: "model.safetensors".into()
        }),
        "{p:?}"
    );

    // Files gone.
    std::fs::remove_file(&path).unwrap();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let p = check(dir, &m);
    assert!(p
        .iter()
        .any(|q| matches!(q, Problem::FileMissing { file, .. } if file == "model.safetensors")));
    assert!(p.contains(&Problem::MetaMissing {
        name: "config.json".into()
    }));
}

/// In a folder without an index or `model.safetensors` the engine loads every
/// `*.safetensors`: one the manifest does not list is reported (and is harmless elsewhere).
#[test]
fn an_unlisted_file_the_engine_would_load_is_reported() {
    let tmp = copy_fixture("gptoss-tiny-mxfp4");
    let dir = tmp.path();
    std::fs::rename(
        dir.join("model.safetensors"),
        dir.join("model-a.safetensors"),
    )
    .unwrap();
    let m = build_default(dir);
    assert!(check(dir, &m).is_empty());
    std::fs::copy(
        dir.join("model-a.safetensors"),
        dir.join("model-b.safetensors"),
    )
    .unwrap();
    assert_eq!(
        check(dir, &m),
        vec![Problem::FileUnexpected {
            file: "model-b.safetensors".into()
        }]
    );
    // With model.safetensors present only that file is loaded: then it is the stranger.
    std::fs::rename(
        dir.join("model-b.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    assert_eq!(
        check(dir, &m),
        vec![Problem::FileUnexpected {
            file: "model.safetensors".into()
        }]
    );
}

#[test]
fn signature_failures_on_real_manifests_are_distinct() {
    let key = SecretKey::from_seed(&[42; 32]);
    let a = build_default(&fixture("gptoss-tiny-mxfp4"));
    let b = build_default(&fixture("gptoss-tiny-bf16"));
    let sig = ManifestSignature::sign(&key, &a);
    sig.verify(&a.encode(), &[key.public()]).unwrap();

    let untrusted = sig
        .verify(&a.encode(), &[SecretKey::from_seed(&[1; 32]).public()])
        .unwrap_err();
    let mut altered = a.clone();
    altered.tensors[3].hash = Hash([0; 32]);
    let altered = sig.verify(&altered.encode(), &[key.public()]).unwrap_err();
    let other = sig.verify(&b.encode(), &[key.public()]).unwrap_err();
    assert!(matches!(untrusted, SignatureError::UntrustedKey { .. }));
    assert!(matches!(altered, SignatureError::ManifestAltered { .. }));
    assert!(matches!(other, SignatureError::OtherManifest { .. }));
    let msgs: BTreeSet<String> = [&untrusted, &altered, &other]
        .iter()
        .map(|e| e.to_string())
        .collect();
    assert_eq!(msgs.len(), 3);
}

fn stormo(args: &[&str]) -> anyhow::Result<()> {
    let cli = stormo_cli::cli::Cli::try_parse_args(
        std::iter::once("stormo").chain(args.iter().copied()),
    )?;
    stormo_cli::cli::dispatch(cli)
}

/// The commands end to end, in process: key generate/show, manifest build (beside the model
/// and at --out), sign, verify with --trust, and the failures a user must see.
#[test]
fn cli_build_sign_verify_round_trip_and_failures() {
    let tmp = copy_fixture("qwen3moe-tiny");
    let dir = tmp.path();
    let d = dir.to_str().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let k = keys.path().join("publisher.key");
    let k = k.to_str().unwrap();
    stormo(&["key", "generate", "--key", k]).unwrap();
    assert!(
        stormo(&["key", "generate", "--key", k]).is_err(),
        "overwrote a key"
    );
    stormo(&["key", "show", "--key", k]).unwrap();
    let public = SecretKey::load(Path::new(k)).unwrap().public().to_string();
    #[cfg(unix)]
    {
        // A secret key others may read is refused by every command that loads it.
        use std::os::unix::fs::PermissionsExt;
        let loose = keys.path().join("loose.key");
        std::fs::copy(k, &loose).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
        let l = loose.to_str().unwrap();
        let e = stormo(&["key", "show", "--key", l]).unwrap_err();
        assert!(format!("{e:#}").contains("too open"), "{e:#}");
        let e = stormo(&["manifest", "sign", "--model", d, "--key", l]).unwrap_err();
        assert!(format!("{e:#}").contains("too open"), "{e:#}");
    }

    stormo(&["manifest", "build", "--model", d]).unwrap();
    assert!(dir.join("stormo-manifest.bin").is_file());
    assert!(dir.join("stormo-manifest.json").is_file());
    stormo(&["manifest", "sign", "--model", d, "--key", k]).unwrap();
    stormo(&["manifest", "verify", "--model", d, "--trust", &public]).unwrap();
    stormo(&["manifest", "verify", "--model", d]).unwrap();

    let stranger = SecretKey::from_seed(&[5; 32]).public().to_string();
    let e = stormo(&["manifest", "verify", "--model", d, "--trust", &stranger]).unwrap_err();
    assert!(format!("{e:#}").contains("not a trusted key"), "{e:#}");

    // The manifest changed after signing (rebuilt with other chunks): the CLI says so, in
    // words distinct from the untrusted key's; building it back restores the signed bytes.
    stormo(&["manifest", "build", "--model", d, "--chunk-kib", "32"]).unwrap();
    let e = stormo(&["manifest", "verify", "--model", d, "--trust", &public]).unwrap_err();
    let altered = format!("{e:#}");
    assert!(!altered.contains("not a trusted key"), "{altered}");
    assert!(altered.contains("altered"), "{altered}");
    stormo(&["manifest", "build", "--model", d]).unwrap();
    stormo(&[
        "manifest", "verify", "--model", d, "--trust", &public, "--io", "buffered",
    ])
    .unwrap();

    // One byte of an expert weight flipped: non-zero exit.
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 5] ^= 0x80;
    std::fs::write(&path, &bytes).unwrap();
    let e = stormo(&["manifest", "verify", "--model", d, "--trust", &public]).unwrap_err();
    assert!(
        format!("{e:#}").contains("does not match its manifest"),
        "{e:#}"
    );

    // --out for a read-only model folder, and a manifest from elsewhere is checked too.
    let out = keys.path().join("elsewhere.bin");
    let o = out.to_str().unwrap();
    stormo(&["manifest", "build", "--model", d, "--out", o]).unwrap();
    assert!(keys.path().join("elsewhere.json").is_file());
    stormo(&["manifest", "verify", "--model", d, "--manifest", o]).unwrap();
    assert!(stormo(&[
        "manifest",
        "verify",
        "--model",
        d,
        "--manifest",
        o,
        "--trust",
        &public
    ])
    .is_err());
}

/// A manifest or signature "file" that is a device or reports no length (`/dev/zero`) is
/// refused without reading it, and a file longer than the limit is refused after reading at
/// most one byte past the limit.
#[test]
fn small_files_are_read_with_a_bound() {
    let e = stormo_manifests::read_small_file(Path::new("/dev/zero"), 4096).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
    let e = stormo_manifests::read_manifest(Path::new("/dev/zero")).unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("f");
    std::fs::write(&p, [7u8; 100]).unwrap();
    assert_eq!(
        stormo_manifests::read_small_file(&p, 100).unwrap().len(),
        100
    );
    let e = stormo_manifests::read_small_file(&p, 99).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::FileTooLarge, "{e}");
}
