//! Budgets from the disk (issue 57, item 1): `--expert-dir-limit SIZE` on its own bounds the
//! kept experts (in the state directory's `experts/`), as a flag, a `STORMO_` variable or a
//! config key; by default the budget follows the free disk and is printed at start; a full
//! disk stops the storing with one warning while what is held is still served. The full disk
//! is a fake one (an injected free-space reader), never a real disk filled up.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stormo_engine::tiers::ExpertId;
use stormo_net::expert_dir::budget::{self, KeepLimit};
use stormo_net::expert_dir::ExpertDir;
use stormo_net::progress::human_bytes;

use crate::demo::stormo_exe;
use crate::node::{model_with_manifest, s, state};

/// Every expert record of the model in `model`, the manifest, and the layout's schemas.
fn records(
    model: &Path,
) -> (
    Vec<(ExpertId, Vec<u8>)>,
    stormo_manifests::Manifest,
    Schemas,
) {
    let manifest = stormo_manifests::read_manifest(&model.join("stormo-manifest.bin"))
        .expect("manifest")
        .0;
    let ckpt = stormo_engine::safetensors::Checkpoint::open(model).expect("checkpoint");
    let cfg = stormo_engine::ModelConfig::from_dir(model).expect("config");
    let layout = stormo_engine::layout::ExpertLayout::from_checkpoint(&ckpt, &cfg).expect("layout");
    let mut out = Vec::new();
    for (l, per_layer) in layout.parts.iter().enumerate() {
        for (e, parts) in per_layer.iter().enumerate() {
            let mut record = Vec::new();
            for p in parts {
                let f = &ckpt.files[p.loc.file].map;
                record.extend_from_slice(
                    &f[p.loc.offset as usize..(p.loc.offset + p.loc.len) as usize],
                );
            }
            out.push((ExpertId::from_indices(l, e), record));
        }
    }
    (out, manifest, layout.schemas.clone())
}

/// The expert layout's schemas, per layer.
type Schemas = Vec<Option<stormo_engine::moe::ExpertSchema>>;

/// [`crate::node::serve_args`] with no RAM cache, not warmed, then `extra`.
fn serve_args<'a>(model: &'a Path, st: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = crate::node::serve_args(model, st, "0");
    args.push("--no-warm");
    args.extend_from_slice(extra);
    args
}

/// Bytes of the records in `dir` (the kept experts of one model).
fn held_bytes(dir: &Path) -> (usize, u64) {
    let mut n = 0;
    let mut bytes = 0;
    for e in std::fs::read_dir(dir).expect("kept experts folder") {
        let m = e.expect("entry").metadata().expect("metadata");
        n += 1;
        bytes += m.len();
    }
    (n, bytes)
}

/// Starts `stormo serve ARGS` (with `env`), waits (bounded) for the line that says what it
/// keeps, stops it, and returns that line.
fn keep_line(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut child = Command::new(stormo_exe())
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start stormo serve");
    let err = child.stderr.take().expect("stderr");
    let seen = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let seen = seen.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::new(err);
            let mut line = String::new();
            while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                seen.lock().expect("stderr lock").push_str(&line);
                if line.starts_with("keeping up to ") {
                    let _ = tx.send(line.trim().to_string());
                }
                line.clear();
            }
        });
    }
    let got = rx.recv_timeout(Duration::from_secs(60));
    let _ = child.kill();
    let _ = child.wait();
    got.unwrap_or_else(|_| {
        panic!(
            "stormo {args:?} printed no 'keeping up to' line within 60 s: {}",
            seen.lock().expect("stderr lock")
        )
    })
}

/// `stormo serve --model DIR --listen ADDR --expert-dir-limit SIZE`, no `--expert-dir`: the
/// limit is accepted and bounds the kept experts in the state directory (what was held beyond
/// it is evicted at start); the same from `STORMO_EXPERT_DIR_LIMIT` and from a config file;
/// without it, the start line says the budget follows the free disk.
#[test]
fn the_expert_dir_limit_alone_bounds_the_kept_experts_and_the_default_follows_the_disk() {
    let (m, id) = model_with_manifest();
    let (recs, manifest, schemas) = records(m.path());
    let total: u64 = recs.iter().map(|(_, r)| r.len() as u64).sum();
    let st = state();
    let kept = st.path().join("experts").join(&id);
    let fill = || {
        let dir = ExpertDir::open(
            &st.path().join("experts"),
            manifest.model_id(),
            u64::MAX,
            Arc::new(manifest.clone()),
            schemas.clone(),
        )
        .expect("expert dir");
        for (id, r) in &recs {
            dir.store(*id, r);
        }
        assert_eq!(dir.len(), recs.len(), "every record kept");
    };
    fill();
    let serve = |extra: &[&str], env: &[(&str, &str)]| -> String {
        // No replica placement: the directory itself cuts down to the limit at start (a
        // placing node leaves that to placement, tested below).
        let mut args = serve_args(m.path(), st.path(), &["--replicas", "0"]);
        args.extend_from_slice(extra);
        keep_line(&args, env)
    };

    // The spelling: accepted alone, printed in human units.
    let line = serve(&["--expert-dir-limit", "100MiB"], &[]);
    assert_eq!(
        line,
        format!(
            "keeping up to 100.0 MiB of experts in {} (--expert-dir-limit)",
            kept.display()
        )
    );
    assert_eq!(
        held_bytes(&kept).1,
        total,
        "100 MiB holds the whole small model"
    );

    // A limit below what is held: cut down to it at start, from the flag.
    let half = total / 2;
    let line = serve(&["--expert-dir-limit", &half.to_string()], &[]);
    assert!(
        line.starts_with(&format!("keeping up to {} ", human_bytes(half))),
        "{line}"
    );
    let (n, bytes) = held_bytes(&kept);
    assert!(
        bytes <= half && n > 0 && n < recs.len(),
        "{n} records, {bytes} bytes > {half}"
    );

    // From the variable, and from a config file: the same bound.
    fill();
    let quarter = (total / 4).to_string();
    serve(&[], &[("STORMO_EXPERT_DIR_LIMIT", &quarter)]);
    assert!(
        held_bytes(&kept).1 <= total / 4,
        "STORMO_EXPERT_DIR_LIMIT ignored"
    );
    fill();
    let cfg = st.path().join("node.toml");
    std::fs::write(&cfg, format!("expert-dir-limit = \"{}\"\n", total / 3)).expect("config");
    serve(&["--config", s(&cfg)], &[]);
    assert!(held_bytes(&kept).1 <= total / 3, "the config key ignored");

    // The default follows the free disk: this small model fits whole in half of it.
    fill();
    let line = serve(&[], &[]);
    assert_eq!(
        line,
        format!(
            "keeping up to {} of experts in {} (all of the model's experts, within half the \
             free disk)",
            human_bytes(total),
            kept.display()
        )
    );
    assert_eq!(held_bytes(&kept).1, total, "the default evicted what fits");
}

/// A writer that keeps what the test subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log lock").extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A full disk (a fake free space, for a given limit and for the default) stops the storing
/// with one warning, however many records come, and when it fills again; what was held is
/// still read back; once there is room, storing goes on.
#[test]
fn a_full_disk_stops_storing_with_one_warning_and_what_is_held_is_still_served() {
    let (m, _) = model_with_manifest();
    let (recs, manifest, schemas) = records(m.path());
    assert!(recs.len() >= 4, "{} records", recs.len());
    for limit in [KeepLimit::Bytes(1 << 30), KeepLimit::Auto] {
        let st = state();
        let free = Arc::new(AtomicU64::new(u64::MAX / 4));
        let log = Captured::default();
        let sub = tracing_subscriber::fmt()
            .with_writer({
                let log = log.clone();
                move || log.clone()
            })
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        tracing::subscriber::with_default(sub, || {
            let dir = ExpertDir::open_with(
                st.path(),
                manifest.model_id(),
                limit,
                Arc::new(manifest.clone()),
                schemas.clone(),
                {
                    let free = free.clone();
                    Arc::new(move |_: &Path| Some(free.load(Ordering::Relaxed)))
                },
            )
            .expect("expert dir");
            // Room: two records kept.
            for (id, r) in &recs[..2] {
                dir.store(*id, r);
            }
            assert_eq!(dir.len(), 2);
            // The disk fills (less than the reserve free): nothing more is written, once said.
            free.store(budget::RESERVE / 2, Ordering::Relaxed);
            let started = Instant::now();
            for (id, r) in &recs[2..] {
                dir.store(*id, r);
            }
            assert!(started.elapsed() < Duration::from_secs(10));
            assert!(dir.disk_full(), "{limit:?}");
            assert_eq!(dir.len(), 2, "{limit:?}: stored on a full disk");
            // Serving goes on from what is held.
            for (id, r) in &recs[..2] {
                assert_eq!(&dir.read(*id).expect("a kept record reads back"), r);
            }
            // Room again: storing goes on; full again: no second warning.
            free.store(u64::MAX / 4, Ordering::Relaxed);
            dir.store(recs[2].0, &recs[2].1);
            assert!(!dir.disk_full() && dir.contains(recs[2].0), "{limit:?}");
            free.store(0, Ordering::Relaxed);
            for (id, r) in &recs[3..] {
                dir.store(*id, r);
            }
            assert!(dir.disk_full());
            assert_eq!(dir.len(), 3);
        });
        let text = String::from_utf8(log.0.lock().expect("log lock").clone()).expect("utf-8");
        let warnings: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(warnings.len(), 1, "{limit:?}: {text}");
        assert!(
            warnings[0].contains("the disk is full") && warnings[0].contains("serving goes on"),
            "{}",
            warnings[0]
        );
    }
}

/// One process owns a model's kept-experts folder (an OS lock beside it). A second opener
/// shares it: it reads the records (verified), but stores, evicts and deletes nothing, even
/// with a limit below what is held, so it cannot take away copies the owner keeps and
/// announces; once the owner is gone the next opener owns it. A second serving node that
/// places replicas, started on the same state directory, is refused by name; one that holds
/// every expert in its folder (places nothing) starts and only reads; the first one's copies
/// stay. Before,
/// the second node deleted most of the first's experts at start while the first went on
/// announcing them.
#[test]
fn a_second_process_on_a_kept_experts_folder_shares_it_and_deletes_nothing() {
    let (m, id) = model_with_manifest();
    let (recs, manifest, schemas) = records(m.path());
    let st = state();
    let root = st.path().join("experts");
    let kept = root.join(&id);
    let open = |limit: u64| {
        ExpertDir::open(
            &root,
            manifest.model_id(),
            limit,
            Arc::new(manifest.clone()),
            schemas.clone(),
        )
        .expect("expert dir")
    };
    let owner = open(u64::MAX);
    assert!(!owner.is_shared());
    for (id, r) in &recs {
        owner.store(*id, r);
    }
    let all = held_bytes(&kept);
    assert_eq!(all.0, recs.len());

    // A limit of one byte: an owner would delete every record at open.
    let second = open(1);
    assert!(second.is_shared(), "the folder's owner is alive");
    assert_eq!(
        second.len(),
        recs.len(),
        "the shared opener sees the records"
    );
    let (id0, r0) = &recs[0];
    assert_eq!(&second.read(*id0).expect("a shared read"), r0);
    assert!(!second.remove(*id0), "a shared opener deletes nothing");
    assert_eq!(held_bytes(&kept), all, "nothing deleted");
    drop(second);

    // The owner gone: the next opener owns the folder and applies its limit.
    drop(owner);
    let next = open(recs[0].1.len() as u64);
    assert!(!next.is_shared());
    assert_eq!(held_bytes(&kept).0, 1, "cut to its limit");
    drop(next);

    // Two serving nodes on one state directory: the second, placing (it holds one expert of
    // its folder), is refused by name.
    for (id, r) in &recs {
        open(u64::MAX).store(*id, r);
    }
    let first = crate::node::Proc::start(&serve_args(m.path(), st.path(), &[]));
    let whole = crate::node::Proc::start(&serve_args(
        m.path(),
        st.path(),
        &["--expert-dir-limit", "1"],
    ));
    drop(whole);
    assert_eq!(
        held_bytes(&kept),
        all,
        "a node of the whole folder deletes nothing"
    );
    let out = Command::new(stormo_exe())
        .args(serve_args(
            m.path(),
            st.path(),
            &["--only-experts", "0", "--expert-dir-limit", "1"],
        ))
        .stdin(Stdio::null())
        .output()
        .expect("a second serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("is in use by another stormo process") && err.contains(&id),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(held_bytes(&kept), all, "the first node's copies stay");
    drop(first);
}

/// A placing node's expert directory (`ExpertDir::open_placed`) found over its limit at open
/// deletes nothing there: placement chooses what goes once it has seen the swarm (the copies
/// the swarm has most of; `placement::tests::over_its_budget_at_start_a_node_evicts_the_most_
/// copied_never_its_only_copy`), where a plain open deletes the least recently used, which
/// could be an expert's last copy.
#[test]
fn a_placing_node_over_its_limit_at_start_leaves_the_choice_to_placement() {
    let (m, id) = model_with_manifest();
    let (recs, manifest, schemas) = records(m.path());
    let st = state();
    let root = st.path().join("experts");
    let kept = root.join(&id);
    {
        let dir = ExpertDir::open(
            &root,
            manifest.model_id(),
            u64::MAX,
            Arc::new(manifest.clone()),
            schemas.clone(),
        )
        .expect("expert dir");
        for (id, r) in &recs {
            dir.store(*id, r);
        }
    }
    let all = held_bytes(&kept);
    let one = recs[0].1.len() as u64;
    let placed = ExpertDir::open_placed(
        &root,
        manifest.model_id(),
        one,
        Arc::new(manifest.clone()),
        schemas.clone(),
    )
    .expect("expert dir");
    assert_eq!(held_bytes(&kept), all, "nothing deleted at open");
    assert_eq!(placed.len(), recs.len());
    assert!(placed.used() > placed.limit());
    // Placement evicts: the record goes, file and all.
    assert!(placed.remove(recs[0].0));
    assert_eq!(held_bytes(&kept).0, recs.len() - 1);
    drop(placed);
    // A plain open cuts down to the limit itself.
    let plain = ExpertDir::open(
        &root,
        manifest.model_id(),
        one,
        Arc::new(manifest.clone()),
        schemas,
    )
    .expect("expert dir");
    assert_eq!(held_bytes(&kept).0, 1);
    drop(plain);

    // In a node: a serving node placing replicas, over its limit at start, is cut down to it
    // by placement once its view settles (alone here: its first 1.5 s).
    for (id, r) in &recs {
        ExpertDir::open(
            &root,
            manifest.model_id(),
            u64::MAX,
            Arc::new(manifest.clone()),
            Vec::new(),
        )
        .expect("expert dir")
        .store(*id, r);
    }
    assert_eq!(held_bytes(&kept), all);
    let limit = (all.1 / 2).to_string();
    let node = crate::node::Proc::start(&serve_args(
        m.path(),
        st.path(),
        &["--replicas", "2", "--expert-dir-limit", &limit],
    ));
    let until = Instant::now() + Duration::from_secs(30);
    while held_bytes(&kept).1 > all.1 / 2 {
        assert!(
            Instant::now() < until,
            "still {:?} held over a limit of {limit} after 30 s",
            held_bytes(&kept)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(held_bytes(&kept).0 > 0, "cut to the limit, not emptied");
    drop(node);
}
