//! `stormo sim`: real serve processes behind shaping relays, a node killed mid-run, and the
//! token-exactness verdict. `stormo swarm`: what `show` says of a certificate, and a serving
//! node cutting off a member revoked or expired while connected (loopback only; every process
//! is killed when its guard drops).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use stormo_manifests::{Membership, PublicKey, SecretKey};
use stormo_testing::Member;

use crate::demo::stormo_exe;
use crate::node::{model_with_manifest, s, state, stormo, stormo_output, Proc};

/// Churn: a holder is killed (SIGKILL) mid-run and restarted; with every expert held twice
/// the run finishes with the local run's ids, and the failures are counted.
#[test]
fn churn_kills_a_holder_mid_run_and_the_output_stays_exact() {
    let out = Command::new(stormo_exe())
        .args([
            "sim",
            "--scenario",
            "churn",
            "--json",
            "--max-new-tokens",
            "32",
        ])
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stormo sim failed: {err}");
    let v: Value = serde_json::from_slice(&out.stdout).expect("swarm --json is JSON");
    let r = &v[0];
    assert_eq!(r["scenario"], "churn");
    assert_eq!(r["swarm"]["ids"], r["local"]["ids"], "{r}");
    assert_eq!(r["token_exact"], true);
    assert!(r["swarm"]["peer_loads"].as_u64().unwrap_or(0) > 0, "{r}");
    let victim = &r["nodes"][1];
    assert_eq!(victim["kills"], 1, "{victim}");
    assert_eq!(victim["starts"], 2, "{victim}");
    assert!(r["events"].as_array().is_some_and(|e| e.len() == 2), "{r}");
    // Killed mid-run: after it had sent expert data, before the run ended.
    assert!(
        victim["link"]["down_bytes"].as_u64().unwrap_or(0) > 0,
        "{victim}"
    );
}

/// Through the simulator's old spelling `stormo swarm --scenario`, kept as an alias of
/// `stormo sim`.
#[test]
fn unknown_scenario_is_a_clear_error() {
    let out = Command::new(stormo_exe())
        .args(["swarm", "--scenario", "lan5"])
        .output()
        .expect("run stormo swarm");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("lan4") && !err.contains("panicked"), "{err}");
}

/// `stormo sim --scenario faults` at a tiny size: every case of the fault matrix against real
/// processes ends as it should (the ids of the local run, or for the refused key an error
/// naming the peer), and the table lists each with its time.
#[test]
fn the_fault_matrix_against_real_processes_ends_as_expected() {
    let started = std::time::Instant::now();
    let out = Command::new(stormo_exe())
        .args([
            "sim",
            "--scenario",
            "faults",
            "--json",
            "--max-new-tokens",
            "24",
            "--fault-clients",
            "3",
            "--timeout",
            "120",
        ])
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("sim --json is not JSON ({e}); stderr: {err}"));
    let rows = v["rows"].as_array().expect("rows");
    let cases: Vec<&str> = rows.iter().filter_map(|r| r["case"].as_str()).collect();
    assert_eq!(rows.len(), 10, "{cases:?}");
    for r in rows {
        assert_eq!(r["ok"], true, "{r}\nstderr: {err}");
        let want = if r["expect"] == "exact" {
            "exact"
        } else {
            "clear error"
        };
        assert_eq!(r["outcome"], want, "{r}");
        assert!(r["secs"].as_f64().is_some_and(|s| s > 0.0), "{r}");
    }
    assert!(
        rows.iter().any(|r| r["expect"] == "clear-error"),
        "no case expects an error: {cases:?}"
    );
    assert!(out.status.success(), "{err}");
    eprintln!("the fault matrix took {:?}", started.elapsed());
}

/// `stormo sim --scenario fair-wan` at a tiny size (the small model, a slow shared link, a
/// 2 s window): every pair of congestion controls runs to the end through one shared
/// bottleneck and both flows of each are reported with their bytes and shares. What the shares
/// are is measured, never asserted.
#[test]
fn the_fairness_scenario_reports_both_flows_of_each_pair() {
    let out = Command::new(stormo_exe())
        .args([
            "sim",
            "--scenario",
            "fair-wan",
            "--json",
            "--bandwidth-mbit",
            "20",
            "--fair-secs",
            "2",
        ])
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stormo sim failed: {err}");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("sim --json is not JSON ({e}); stderr: {err}"));
    assert_eq!(v["scenario"], "fair-wan");
    let pairs = v["pairs"].as_array().expect("pairs");
    let names: Vec<String> = pairs
        .iter()
        .map(|p| {
            format!(
                "{}+{}",
                p["flows"][0]["congestion"], p["flows"][1]["congestion"]
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            "\"cubic\"+\"cubic\"",
            "\"bbr\"+\"cubic\"",
            "\"bbr\"+\"bbr\"",
            "\"tolerant\"+\"cubic\"",
            "\"tolerant\"+\"tolerant\""
        ],
        "{v}"
    );
    for p in pairs {
        let flows = p["flows"].as_array().expect("two flows");
        assert_eq!(flows.len(), 2, "{p}");
        let shares: f64 = flows.iter().filter_map(|f| f["share"].as_f64()).sum();
        assert!((shares - 1.0).abs() < 1e-9, "shares do not add up: {p}");
        let bytes: Vec<u64> = flows.iter().filter_map(|f| f["bytes"].as_u64()).collect();
        assert_eq!(bytes.len(), 2, "{p}");
        assert!(
            bytes.iter().sum::<u64>() > 0,
            "the link carried nothing: {p}"
        );
        for f in flows {
            assert!(f["pulls"].as_u64().is_some_and(|n| n >= 1), "{p}");
        }
    }
}

/// `stormo sim --scenario stripe` on a one-layer model whose experts (3.2 MiB) are large
/// enough to stripe: an empty node generates from one holder, then from two, both times with
/// the local run's ids, and with two holders every expert it fetched came striped, with
/// bytes from both holders. Which run is faster is measured (docs), never asserted. A model
/// whose experts are too small to stripe is refused by name before anything starts.
#[test]
fn the_stripe_scenario_fetches_from_both_holders_and_stays_exact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    let synth = Command::new(stormo_exe())
        .args([
            "synth",
            "--preset",
            "gpt-oss-20b",
            "--layers",
            "1",
            "--hidden",
            "1024",
        ])
        .args([
            "--intermediate",
            "2048",
            "--experts",
            "8",
            "--top-k",
            "4",
            "--vocab",
            "4096",
        ])
        .args([
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--out",
        ])
        .arg(&model)
        .output()
        .expect("run stormo synth");
    assert!(
        synth.status.success(),
        "{}",
        String::from_utf8_lossy(&synth.stderr)
    );
    let out = Command::new(stormo_exe())
        .args([
            "sim",
            "--scenario",
            "stripe",
            "--json",
            "-n",
            "4",
            "--model",
        ])
        .arg(&model)
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stormo sim failed: {err}");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("sim --json is not JSON ({e}); stderr: {err}"));
    let r = &v[0];
    assert_eq!(r["scenario"], "stripe");
    assert_eq!(r["token_exact"], true, "{r}");
    assert_eq!(r["one_holder"]["ids"], r["local"]["ids"], "{r}");
    assert_eq!(r["swarm"]["ids"], r["local"]["ids"], "{r}");
    let (one, both) = (&r["one_holder"], &r["swarm"]);
    let loads = |x: &Value, k: &str| x[k].as_u64().unwrap_or(0);
    assert!(loads(one, "peer_loads") > 0, "{r}");
    assert_eq!(loads(one, "peer_striped_loads"), 0, "one holder: {r}");
    assert!(loads(both, "peer_loads") > 0, "{r}");
    // Most loads are striped, not necessarily all: the stripe plan takes only holders ready
    // at that moment (connected, not backed off after a slow try), and a load with one ready
    // holder comes whole from it. Seen once in the full suite on the loaded 2-core machine:
    // 6 of 9 striped (which holder was not ready, and why, was not looked into). Without
    // striping none would be.
    let striped = loads(both, "peer_striped_loads");
    assert!(
        striped > 0 && 2 * striped >= loads(both, "peer_loads"),
        "most experts striped: {r}"
    );
    // n1 is a peer of the second run only, so everything it sent went to that run.
    let sent = |i: usize| r["nodes"][i]["link"]["down_bytes"].as_u64().unwrap_or(0);
    assert!(sent(0) > 0 && sent(1) > 0, "{r}");

    // The small model's experts are far below 2 MiB.
    let out = Command::new(stormo_exe())
        .args(["sim", "--scenario", "stripe", "-n", "1"])
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("needs experts of at least 2 MiB") && !err.contains("panicked"),
        "{err}"
    );
}

/// A swarm whose owner's key is `dir/owner.key`: its swarm key.
pub(crate) fn create_swarm(dir: &Path) -> String {
    let owner = dir.join("owner.key");
    stormo(&["swarm", "create", "--owner", s(&owner)])
        .trim()
        .to_string()
}

/// `stormo swarm admit` of `node` (a public key or a key file) by the owner in `dir`, for
/// `expires` (`None`: the default period), into `dir/NAME.cert`.
pub(crate) fn admit_for(
    dir: &Path,
    node: &str,
    expires: Option<&str>,
    name: &str,
) -> std::path::PathBuf {
    let cert = dir.join(format!("{name}.cert"));
    let owner = dir.join("owner.key");
    let mut args = vec!["swarm", "admit", "--owner", s(&owner), "--node", node];
    if let Some(e) = expires {
        args.extend(["--expires", e]);
    }
    args.extend(["--out", s(&cert)]);
    stormo(&args);
    cert
}

fn unix_now() -> u64 {
    std::time::UNIX_EPOCH
        .elapsed()
        .expect("a clock after 1970")
        .as_secs()
}

/// Issue 58 (5): `stormo swarm show` exits 0 on a valid certificate only; on an expired one,
/// one not yet valid, one edited after signing, a forgery (signed by another key under this
/// swarm's name) and a file that is no certificate it prints why and exits 1.
#[test]
fn swarm_show_exits_non_zero_on_an_expired_forged_or_invalid_certificate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let swarm: PublicKey = create_swarm(dir.path()).parse().expect("a swarm key");
    let owner = SecretKey::load(&dir.path().join("owner.key")).expect("the owner's key");
    let node = SecretKey::from_seed(&[31; 32]).public();
    let valid = admit_for(dir.path(), &node.to_hex(), Some("30d"), "valid");
    let out = stormo_output(&["swarm", "show", "--cert", s(&valid)], None);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("valid now") && text.contains(&node.to_hex()),
        "a valid certificate: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let now = unix_now();
    let issued = |not_before: u64, expires: u64| {
        Membership::issue(&owner, node, not_before, expires)
            .expect("a valid period")
            .to_bytes()
    };
    let mut edited = issued(now - 60, now + 3600);
    edited[82..90].copy_from_slice(&(now + 10 * 365 * 86_400).to_le_bytes());
    let stranger = SecretKey::from_seed(&[32; 32]);
    let mut forged = Membership::issue(&stranger, node, now - 60, now + 3600)
        .expect("a valid period")
        .to_bytes();
    forged[10..42].copy_from_slice(swarm.as_bytes());
    let mut not_a_cert = issued(now - 60, now + 3600);
    not_a_cert[..8].copy_from_slice(b"NOTACERT");
    let cases: [(&str, Vec<u8>, &str); 5] = [
        (
            "expired",
            issued(now - 7200, now - 3600).to_vec(),
            "expired at",
        ),
        (
            "not yet valid",
            issued(now + 3600, now + 7200).to_vec(),
            "not valid before",
        ),
        ("edited", edited.to_vec(), "signature is invalid"),
        ("forged", forged.to_vec(), "signature is invalid"),
        (
            "not a certificate",
            not_a_cert.to_vec(),
            "not a membership certificate",
        ),
    ];
    for (what, bytes, reason) in cases {
        let path = dir.path().join(format!("{}.cert", what.replace(' ', "-")));
        std::fs::write(&path, bytes).expect("write the certificate");
        let out = stormo_output(&["swarm", "show", "--cert", s(&path)], None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {err}");
        assert!(
            err.contains(reason) && err.contains(s(&path)) && !err.contains("panicked"),
            "{what}: the error does not say {reason:?} of {}: {err}",
            path.display()
        );
    }
}

/// Issue 58 (5) through the CLI: `stormo serve --swarm --revoked FILE` serving two members
/// over open connections closes the first within 5 s of its key being written into FILE
/// (beside a malformed line, which is warned about), with `forbidden` and the reason, and the
/// second within 5 s of the expiry of its certificate (`swarm admit --expires 8s`); it logs
/// which member and why.
#[test]
fn serve_cuts_off_a_member_within_5_s_of_its_revocation_or_its_expiry() {
    let (m, _id) = model_with_manifest();
    let keys = tempfile::tempdir().expect("key dir");
    let swarm = create_swarm(keys.path());
    let server_key = keys.path().join("server.key");
    stormo(&["key", "generate", "--key", s(&server_key)]);
    let server_cert = admit_for(keys.path(), s(&server_key), Some("30d"), "server");
    let revoked = keys.path().join("revoked.txt");
    std::fs::write(&revoked, "# nobody yet\n").expect("revoked file");
    let st = state();
    let server = Proc::start_logging(
        &[
            "serve",
            "--model",
            s(m.path()),
            "--listen",
            "127.0.0.1:0",
            "--key",
            s(&server_key),
            "--swarm",
            &swarm,
            "--cert",
            s(&server_cert),
            "--revoked",
            s(&revoked),
            "--state-dir",
            s(st.path()),
            "--expert-cache",
            "0",
        ],
        Some("warn"),
    );
    let (cut, expiring) = (
        SecretKey::from_seed(&[33; 32]),
        SecretKey::from_seed(&[34; 32]),
    );
    let cut_cert = admit_for(keys.path(), &cut.public().to_hex(), Some("30d"), "cut");
    // Expires 8 s from now: time to connect first, on a busy machine too.
    let expiring_cert = admit_for(
        keys.path(),
        &expiring.public().to_hex(),
        Some("8s"),
        "expiring",
    );
    let read = |cert: &Path| stormo_net::identity::read_cert(cert).expect("the certificate");
    let (cut_cert, expiring_cert) = (read(&cut_cert), read(&expiring_cert));
    let expiry = expiring_cert.expires;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let exp = Member::connect_to(&server.line, &expiring, &expiring_cert).await;
        let rev = Member::connect_to(&server.line, &cut, &cut_cert).await;
        std::fs::write(&revoked, format!("{}x\n{}\n", cut.public(), cut.public())).expect("revoke");
        let within = tokio::time::Instant::now() + Duration::from_secs(5);
        let (code, reason) = rev.closed_by(within).await.unwrap_or_else(|e| {
            panic!("the revoked member's connection, 5 s after the revocation: {e}")
        });
        assert_eq!(code, 8, "not closed `forbidden`: {reason}");
        assert!(reason.contains("is revoked"), "{reason}");
        assert!(
            exp.close_reason().is_none(),
            "the other member was cut off too: {:?}",
            exp.close_reason()
        );

        let left = Duration::from_secs(expiry)
            .saturating_sub(std::time::UNIX_EPOCH.elapsed().expect("a clock after 1970"));
        let within = tokio::time::Instant::now() + left + Duration::from_secs(5);
        let (code, reason) = exp.closed_by(within).await.unwrap_or_else(|e| {
            panic!("the expired member's connection, 5 s after its expiry: {e}")
        });
        assert_eq!(code, 8, "not closed `forbidden`: {reason}");
        assert!(reason.contains("expired at"), "{reason}");
        for m in [rev, exp] {
            m.close();
        }
    });
    let log = server.stderr.lock().expect("stderr lock").clone();
    for (who, why) in [
        (cut.public(), "is revoked"),
        (expiring.public(), "expired at"),
    ] {
        assert!(
            log.lines()
                .any(|l| l.contains(&format!("closing the connection of {who}")) && l.contains(why)),
            "the server's log does not say it cut off {who} ({why}):\n{log}"
        );
    }
    assert!(
        log.contains(&format!("{} line 1: not a node key", revoked.display())),
        "no warning for the malformed line:\n{log}"
    );
    drop(server);
}
