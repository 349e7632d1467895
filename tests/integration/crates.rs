//! The crate map's arrows (docs/design.md): the network crate knows no CLI or HTTP, the text
//! crate no async runtime or QUIC. Read from Cargo itself (`cargo tree`, offline), so a
//! dependency that sneaks in through another crate is caught too.

use std::process::Command;

/// The names of every normal (non-dev, non-build) dependency of `package`, transitively.
fn normal_deps(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-p",
            package,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree -p {package} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("cargo tree prints UTF-8");
    let deps: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    assert!(
        deps.iter().any(|d| d == package),
        "cargo tree printed no {package}: {text}"
    );
    deps
}

#[test]
fn the_network_crate_has_no_cli_and_no_http() {
    let deps = normal_deps("stormo-net");
    assert!(
        deps.iter().any(|d| d == "quinn"),
        "stormo-net without quinn?"
    );
    for banned in ["clap", "hyper", "stormo-node", "stormo-cli", "stormo-text"] {
        assert!(
            !deps.iter().any(|d| d == banned),
            "stormo-net depends on {banned}"
        );
    }
}

#[test]
fn the_text_crate_has_no_runtime_and_no_network() {
    let deps = normal_deps("stormo-text");
    assert!(deps.iter().any(|d| d == "stormo-engine"));
    for banned in [
        "tokio",
        "quinn",
        "hyper",
        "clap",
        "stormo-net",
        "stormo-node",
    ] {
        assert!(
            !deps.iter().any(|d| d == banned),
            "stormo-text depends on {banned}"
        );
    }
}

#[test]
fn the_node_library_has_no_cli() {
    let deps = normal_deps("stormo-node");
    for banned in ["clap", "rustyline", "stormo-cli"] {
        assert!(
            !deps.iter().any(|d| d == banned),
            "stormo-node depends on {banned}"
        );
    }
}

#[test]
fn the_test_support_crate_is_in_no_build_of_stormo() {
    for package in ["stormo-cli", "stormo-node", "stormo-net", "stormo-text"] {
        let deps = normal_deps(package);
        assert!(
            !deps.iter().any(|d| d == "stormo-testing"),
            "{package} depends on stormo-testing (a dev-dependency only)"
        );
    }
}
