//! Fuzzing on stable Rust as ordinary `cargo test` tests: a bounded, deterministic,
//! corpus-driven mutation fuzzer over every decoder that reads bytes from outside: wire
//! frames and message bodies, manifests, manifest signatures, safetensors headers,
//! config.json, tokenizer.json and HTTP request bodies.
//!
//! Each target starts from the seed files in `tests/fuzz/corpus/<target>/` (kept in the
//! repository; `cargo test -p stormo-tests --test fuzz -- --ignored write_seed_corpus`
//! rewrites them from the code that makes them), and feeds the decoder the seeds and then
//! `STORMO_FUZZ_ITERS` (default 50 000, a few seconds per target) mutants drawn from a fixed seed (`STORMO_FUZZ_SEED`,
//! default 40): bit flips, byte sets, interesting integers (0, 0xff, lengths near 2^32 and
//! 2^64 as LEB128 or little-endian), insertions, deletions, truncation and splices of two
//! inputs. Every target must hold two properties on every input: no panic (checked with
//! `catch_unwind`; the failing input is written to `target/fuzz-failures/`) and no unbounded
//! allocation (a counting global allocator in this test binary fails the target when one
//! allocation exceeds [`MAX_ALLOCATION`] while the decoder runs).
//!
//! Why hand-made: `cargo fuzz` (libFuzzer) needs nightly, and the nightly targets in
//! `wire/fuzz` stay for long coverage-guided runs. `bolero` on stable runs its `cargo test`
//! mode from its own random generator, with no mutation of a corpus kept in the repository
//! and no allocation bound, and `arbitrary` only shapes inputs; proptest (already a
//! dependency) generates structured values and shrinks them, not byte mutations of real
//! files. A mutator over real seed files is the part that finds decoder bugs, it is about a
//! hundred lines, and it runs with no extra crate or toolchain. It is not coverage-guided:
//! what it explores is bounded by its seeds and its count, which is why it runs in CI.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The largest single allocation a decoder may make on a fuzzed input (inputs are at most a
/// few hundred KiB; every decoder checks its lengths against limits before allocating).
const MAX_ALLOCATION: usize = 64 << 20;

thread_local! {
    /// Whether this thread is running a decoder under test.
    static WATCHING: Cell<bool> = const { Cell::new(false) };
    /// The largest allocation made on this thread while watching.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, noting the largest allocation of a watched thread.
struct Counting;

// SAFETY: every call is passed on to the system allocator unchanged; the thread-locals it
// touches are const-initialized `Cell`s, which neither allocate nor re-enter the allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's layout is passed on as given.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as for `dealloc`; `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn note(size: usize) {
    let _ = WATCHING.try_with(|w| {
        if w.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn repo_root() -> PathBuf {
    stormo_tests::repo_root()
}

fn corpus_dir(target: &str) -> PathBuf {
    repo_root().join("tests/fuzz/corpus").join(target)
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Values that tend to sit on a decoder's boundaries.
const INTERESTING: &[u64] = &[
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x100,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0xffff_ffff,
    0x1_0000_0000,
    u64::MAX >> 1,
    u64::MAX,
];

/// One mutant of `input` (with `other`, another corpus input, for splices).
fn mutate(rng: &mut StdRng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    let rounds = 1 + rng.gen_range(0..4);
    for _ in 0..rounds {
        let len = v.len();
        match rng.gen_range(0..9) {
            0 if len > 0 => {
                let i = rng.gen_range(0..len);
                v[i] ^= 1 << rng.gen_range(0..8);
            }
            1 if len > 0 => {
                let i = rng.gen_range(0..len);
                v[i] = rng.gen();
            }
            2 if len > 0 => {
                // an interesting integer, little-endian, over bytes already there
                let x = INTERESTING[rng.gen_range(0..INTERESTING.len())];
                let w = [1usize, 2, 4, 8][rng.gen_range(0..4)].min(len);
                let i = rng.gen_range(0..=len - w);
                v[i..i + w].copy_from_slice(&x.to_le_bytes()[..w]);
            }
            3 => {
                // an interesting integer as a LEB128 varint (postcard's integers), inserted
                let mut x = INTERESTING[rng.gen_range(0..INTERESTING.len())];
                let mut enc = Vec::new();
                while x >= 0x80 {
                    enc.push((x as u8) | 0x80);
                    x >>= 7;
                }
                enc.push(x as u8);
                let i = rng.gen_range(0..=len);
                v.splice(i..i, enc);
            }
            4 if len > 0 => {
                let i = rng.gen_range(0..len);
                let n = rng.gen_range(1..=(len - i).min(64));
                v.drain(i..i + n);
            }
            5 => {
                let i = rng.gen_range(0..=len);
                let n = rng.gen_range(1..=16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                v.splice(i..i, bytes);
            }
            6 if len > 0 => v.truncate(rng.gen_range(0..len)),
            7 if len > 0 => {
                // duplicate a slice in place
                let i = rng.gen_range(0..len);
                let n = rng.gen_range(1..=(len - i).min(256));
                let piece = v[i..i + n].to_vec();
                let at = rng.gen_range(0..=len);
                v.splice(at..at, piece);
            }
            8 if !other.is_empty() => {
                // splice: a prefix of this input and a suffix of the other
                let i = rng.gen_range(0..=len);
                let j = rng.gen_range(0..other.len());
                v.truncate(i);
                v.extend_from_slice(&other[j..]);
            }
            _ => {}
        }
    }
    v
}

/// Runs `decode` on every seed of `target` and on its mutants: no panic, no allocation over
/// [`MAX_ALLOCATION`]. Returns how many inputs were decoded without error (so a target whose
/// seeds all fail to decode, which would fuzz nothing past the first check, is caught).
fn fuzz(target: &str, decode: impl Fn(&[u8]) -> bool) -> usize {
    let dir = corpus_dir(target);
    let mut seeds: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading the corpus {}: {e}", dir.display()))
        .map(|e| {
            let p = e.expect("corpus entry").path();
            let name = p.file_name().expect("name").to_string_lossy().into_owned();
            (name, std::fs::read(&p).expect("corpus file"))
        })
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    let iters = env_u64("STORMO_FUZZ_ITERS", 50_000);
    let seed = env_u64("STORMO_FUZZ_SEED", 40);
    let mut rng = StdRng::seed_from_u64(seed ^ hash_name(target));
    let mut ok = 0;
    let total = seeds.len() as u64 + iters;
    for n in 0..total {
        let input = if (n as usize) < seeds.len() {
            seeds[n as usize].1.clone()
        } else {
            let a = &seeds[rng.gen_range(0..seeds.len())].1;
            let b = &seeds[rng.gen_range(0..seeds.len())].1;
            mutate(&mut rng, a, b)
        };
        LARGEST.with(|l| l.set(0));
        WATCHING.with(|w| w.set(true));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode(&input)));
        WATCHING.with(|w| w.set(false));
        let largest = LARGEST.with(Cell::get);
        match r {
            Ok(true) => ok += 1,
            Ok(false) => {}
            Err(_) => fail(target, n, &input, "panicked"),
        }
        if largest > MAX_ALLOCATION {
            fail(
                target,
                n,
                &input,
                &format!(
                    "allocated {largest} bytes at once from {} bytes",
                    input.len()
                ),
            );
        }
    }
    eprintln!("fuzz {target}: {total} inputs, {ok} decoded (seed {seed})");
    ok
}

fn hash_name(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn fail(target: &str, n: u64, input: &[u8], what: &str) -> ! {
    let dir = repo_root().join("target/fuzz-failures");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("{target}-{n}.bin"));
    let _ = std::fs::write(&path, input);
    panic!(
        "fuzz {target}: input {n} {what}; it is in {} (add it to tests/fuzz/corpus/{target}/ \
         once fixed)",
        path.display()
    );
}

/// The allocation bound can fail: an allocation past it on a watched thread is seen.
#[test]
fn the_allocation_watch_sees_an_allocation_past_the_bound() {
    LARGEST.with(|l| l.set(0));
    WATCHING.with(|w| w.set(true));
    // zeroed pages are not touched, so this costs no memory
    let big = vec![0u8; MAX_ALLOCATION + 1];
    WATCHING.with(|w| w.set(false));
    assert_eq!(big.len(), MAX_ALLOCATION + 1);
    assert!(LARGEST.with(Cell::get) > MAX_ALLOCATION);
}

// ---- Targets ----

#[test]
fn fuzz_wire_frames() {
    use stormo_wire::FrameDecoder;
    let ok = fuzz("wire", |b| {
        // the whole input at once, then the same bytes split in two at every 7th byte
        let mut out = Vec::new();
        let whole = FrameDecoder::with_max(1 << 20)
            .decode_all(b, &mut out)
            .is_ok();
        let mut dec = FrameDecoder::with_max(1 << 20);
        let mut out2 = Vec::new();
        for piece in b.chunks(7) {
            if dec.decode_all(piece, &mut out2).is_err() {
                break;
            }
        }
        // the streaming decoder on the same bytes in 7-byte pieces, its Data payloads written
        // into a caller's buffer by a requester with two experts in flight
        let now = std::time::Instant::now();
        let mut reqs = stormo_wire::Requests::new(stormo_wire::RequestsConfig::default());
        for e in 0..2 {
            let id = stormo_manifests::ExpertId {
                layer: 0,
                expert: e,
            };
            let fetch = stormo_wire::Fetch::expert(stormo_manifests::Hash::of(b"fuzz"), id, 4096)
                .into_buffer(Box::new(vec![0u8; 4096]));
            let _ = reqs.start(now, fetch);
        }
        let mut dec = FrameDecoder::with_max(1 << 20);
        'pieces: for piece in b.chunks(7) {
            let mut input = piece;
            while !input.is_empty() {
                match dec.decode_streaming(&mut input) {
                    Ok(Some(p)) => {
                        let _ = reqs.handle_piece(now, p);
                    }
                    Ok(None) => {}
                    Err(_) => break 'pieces,
                }
            }
        }
        while reqs.poll_event().is_some() {}
        whole && !out.is_empty()
    });
    assert!(ok > 0, "no seed frame decodes");
}

#[test]
fn fuzz_wire_message_bodies() {
    let ok = fuzz("wire", |b| {
        // a frame's tag and body as the decoder hands them to `decode_body`
        let body = b.get(4..).unwrap_or_default();
        stormo_wire::Message::decode_body(bytes::Bytes::copy_from_slice(body)).is_ok()
    });
    assert!(ok > 0, "no seed body decodes");
}

#[test]
fn fuzz_manifests() {
    let ok = fuzz("manifest", |b| {
        stormo_manifests::Manifest::decode(b).is_ok()
    });
    assert!(ok > 0, "no seed manifest decodes");
}

#[test]
fn fuzz_manifest_signatures() {
    let manifest =
        std::fs::read(corpus_dir("manifest").join("qwen3moe-tiny.bin")).expect("the manifest seed");
    let ok = fuzz("signature", |b| {
        let Ok(sig) = stormo_manifests::ManifestSignature::from_bytes(b) else {
            return false;
        };
        sig.check(&manifest).is_ok()
    });
    assert!(ok > 0, "no seed signature verifies");
}

/// The swarm, node and time of the membership seed (`write_seed_corpus`).
fn membership_parties() -> (
    stormo_manifests::SecretKey,
    stormo_manifests::SecretKey,
    u64,
) {
    (
        stormo_manifests::SecretKey::from_seed(&[41; 32]),
        stormo_manifests::SecretKey::from_seed(&[42; 32]),
        1_750_000_000,
    )
}

#[test]
fn fuzz_membership_certificates() {
    let (swarm, node, now) = membership_parties();
    let (swarm, node) = (swarm.public(), node.public());
    let revoked = std::collections::HashSet::new();
    let ok = fuzz("membership", |b| {
        let Ok(cert) = stormo_manifests::Membership::from_bytes(b) else {
            return false;
        };
        cert.verify(&swarm, &node, now, &revoked).is_ok()
    });
    assert!(ok > 0, "no seed certificate verifies");
}

#[test]
fn fuzz_safetensors_headers() {
    let ok = fuzz("safetensors", |b| {
        stormo_engine::safetensors::parse_header(Path::new("fuzz"), b, b.len() as u64, 0).is_ok()
    });
    assert!(ok > 0, "no seed header parses");
}

#[test]
fn fuzz_config_json() {
    let ok = fuzz("config", |b| {
        let Ok(text) = std::str::from_utf8(b) else {
            return false;
        };
        stormo_engine::ModelConfig::from_json_str(text, Path::new("config.json")).is_ok()
    });
    assert!(ok > 0, "no seed config parses");
}

#[test]
fn fuzz_tokenizer_json() {
    let ok = fuzz("tokenizer", |b| {
        stormo_text::tokenizer::Tokenizer::from_json(b).is_ok()
    });
    assert!(ok > 0, "no seed tokenizer loads");
}

#[test]
fn fuzz_http_request_bodies() {
    let ok = fuzz("http", |b| {
        // the first line names the endpoint, the rest is the body
        let (path, body) = match b.iter().position(|&c| c == b'\n') {
            Some(i) => (std::str::from_utf8(&b[..i]).unwrap_or(""), &b[i + 1..]),
            None => ("", b),
        };
        stormo_node::http::parse_request_body(path, body).is_ok()
    });
    assert!(ok > 0, "no seed request parses");
}

// ---- The seed corpus ----

/// Rewrites the seed corpus from the code that makes it (run by hand; the files are kept in
/// the repository).
#[test]
#[ignore = "rewrites tests/fuzz/corpus; run by hand"]
fn write_seed_corpus() {
    use stormo_wire::*;
    let put = |target: &str, name: &str, bytes: &[u8]| {
        let d = corpus_dir(target);
        std::fs::create_dir_all(&d).expect("corpus dir");
        std::fs::write(d.join(name), bytes).expect("seed");
    };
    // wire: one frame of each message
    let model = stormo_manifests::Hash([7; 32]);
    let expert = stormo_manifests::ExpertId {
        layer: 1,
        expert: 2,
    };
    let mut set = ExpertSet::new(2, 4).expect("set");
    set.insert(expert).expect("insert");
    let msgs = vec![
        (
            "hello",
            Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                node: NodeId([1; 32]),
                models: vec![model],
                limits: Limits {
                    max_concurrent_requests: 8,
                },
            }),
        ),
        (
            "inventory",
            Message::Inventory(Inventory {
                model,
                experts: set,
            }),
        ),
        (
            "get",
            Message::Get(Get {
                request_id: RequestId(5),
                model,
                expert,
                range: Some(ByteRange {
                    offset: 16,
                    len: 32,
                }),
                priority: Priority::Now,
            }),
        ),
        (
            "data",
            Message::Data(Data {
                request_id: RequestId(5),
                offset: 16,
                bytes: vec![9; 32].into(),
            }),
        ),
        (
            "end",
            Message::End(End {
                request_id: RequestId(5),
            }),
        ),
        (
            "get-manifest",
            Message::GetManifest(GetManifest {
                request_id: RequestId(6),
                model,
            }),
        ),
        (
            "get-file",
            Message::GetFile(GetFile {
                request_id: RequestId(7),
                model,
                name: "config.json".into(),
                offset: 0,
                len: 100,
            }),
        ),
        (
            "error",
            Message::Error(ErrorMessage::new(
                Some(RequestId(5)),
                ErrorCode::BUSY,
                "busy",
            )),
        ),
        ("ping", Message::Ping(Ping { nonce: 3 })),
        (
            "exec",
            Message::Exec(Exec::new(
                RequestId(8),
                model,
                expert,
                1,
                &[1.0, -2.0, 0.5, f32::NAN],
            )),
        ),
        (
            "exec-result",
            Message::ExecResult(ExecResult::new(RequestId(8), &[0.25, 3.0, -0.0, 0.125])),
        ),
    ];
    for (name, m) in msgs {
        put(
            "wire",
            &format!("{name}.bin"),
            &encode_frame(&m).expect("encodes"),
        );
    }
    // manifest and signature of a fixture
    let dir = tempfile::tempdir().expect("tempdir");
    stormo_tests::copy_model("qwen3moe-tiny", dir.path());
    let m = stormo_manifests::build(dir.path(), &stormo_manifests::BuildOptions::default())
        .expect("manifest");
    put("manifest", "qwen3moe-tiny.bin", &m.encode());
    let key = stormo_manifests::SecretKey::from_seed(&[40; 32]);
    put(
        "signature",
        "qwen3moe-tiny.sig",
        &stormo_manifests::ManifestSignature::sign(&key, &m).to_bytes(),
    );
    // a membership certificate, valid at the target's time
    let (swarm, node, now) = membership_parties();
    put(
        "membership",
        "member.cert",
        &stormo_manifests::Membership::issue(&swarm, node.public(), now - 3600, now + 3600)
            .expect("certificate")
            .to_bytes(),
    );
    // a small safetensors file
    let st = dir.path().join("small.safetensors");
    let t: Vec<u8> = (0..24u8).collect();
    stormo_engine::safetensors::write(
        &st,
        &[
            (
                "a.weight",
                stormo_engine::safetensors::Dtype::F32,
                &[2, 3],
                &t,
            ),
            ("b", stormo_engine::safetensors::Dtype::U8, &[4], &t[..4]),
        ],
        None,
    )
    .expect("safetensors");
    put(
        "safetensors",
        "small.safetensors",
        &std::fs::read(&st).expect("read"),
    );
    // tokenizers: GPT-2 byte-level BPE with a few merges and an added token
    let mut vocab = serde_json::Map::new();
    let mut shifted = 0;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let c = if printable {
            b
        } else {
            shifted += 1;
            255 + shifted
        };
        vocab.insert(char::from_u32(c).expect("char").to_string(), b.into());
    }
    for (i, t) in ["he", "ll", "hell", "hello"].iter().enumerate() {
        vocab.insert((*t).into(), (256 + i as u32).into());
    }
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": false, "use_regex": true});
    let tok = serde_json::json!({
        "version": "1.0",
        "added_tokens": [{"id": 300, "content": "<|end|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab,
            "merges": ["h e", "l l", "he ll", "hell o"]},
    });
    put("tokenizer", "byte-level.json", tok.to_string().as_bytes());
    // HTTP request bodies: the endpoint on the first line, then the body
    let bodies = [
        (
            "chat",
            "/v1/chat/completions",
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":8,"temperature":0.5,"stream":true,"stream_options":{"include_usage":true},"stop":["
"]}"#,
        ),
        (
            "chat-tools",
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"weather?"},{"role":"assistant","content":null},{"role":"tool","content":"sunny"}],"max_tokens":4,"seed":3,"top_p":0.9}"#,
        ),
        (
            "completion-text",
            "/v1/completions",
            r#"{"model":"m","prompt":"Once","max_tokens":4,"logprobs":null,"echo":false}"#,
        ),
        (
            "completion-ids",
            "/v1/completions",
            r#"{"prompt":[[1,2,3]],"max_tokens":2,"n":1}"#,
        ),
    ];
    for (name, path, body) in bodies {
        put(
            "http",
            &format!("{name}.txt"),
            format!("{path}\n{body}").as_bytes(),
        );
    }
    // configs of the fixtures
    for name in stormo_tests::MODEL_FIXTURES {
        let c = std::fs::read(stormo_tests::fixture(name).join("config.json")).expect("config");
        put("config", &format!("{name}.json"), &c);
    }
}
