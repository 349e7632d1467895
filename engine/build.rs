//! Generates the software-emulated copy of the AVX-512 ISA that tests run on CPUs without
//! AVX-512 (`src/kernels/avx512_emulated.rs` includes it).
//!
//! The copy is `src/kernels/avx512.rs` with two mechanical changes, so the tested code is the
//! shipped code: its functions enable AVX2 instead of AVX-512 (the compiler must not emit
//! AVX-512 instructions of its own in them), and its inner doc comments are dropped (an
//! included file cannot carry them). Its AVX-512 intrinsics resolve to software versions there.
//! The build fails, rather than produce a copy that could run AVX-512 instructions, if the
//! ISA's source has a target-feature attribute of another form, mentions AVX-512 in any other
//! attribute, or calls an AVX-512 intrinsic the software versions do not define.

use std::collections::BTreeSet;
use std::{env, fs, path::Path};

const SOURCE: &str = "src/kernels/avx512.rs";
const SOFT: &str = "src/kernels/avx512_emulated.rs";
const FEATURES: &str = r#"#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]"#;
const EMULATED: &str = r#"#[target_feature(enable = "avx2,fma,f16c")]"#;

fn read(rel: &str) -> String {
    let dir = env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let path = Path::new(&dir).join(rel);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The identifier (letters, digits and underscores) that `text` starts with.
fn ident(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The identifiers in `text` that start with `prefix`.
fn names<'a>(text: &'a str, prefix: &str) -> BTreeSet<&'a str> {
    text.match_indices(prefix)
        .map(|(at, _)| ident(&text[at..]))
        .collect()
}

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-changed={SOFT}");
    println!("cargo:rerun-if-changed=build.rs");
    let text = read(SOURCE);
    let mut out = String::with_capacity(text.len());
    let mut switched = 0;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("//!") {
            continue;
        }
        if t.contains("target_feature") && !t.starts_with("//") {
            // Every function of the ISA must be switched: one left with AVX-512 enabled could
            // run AVX-512 instructions on a CPU without them.
            assert_eq!(t, FEATURES, "{SOURCE}: unexpected target_feature line: {t}");
            out.push_str(&line.replace(FEATURES, EMULATED));
            switched += 1;
        } else {
            assert!(
                !(t.starts_with("#[") && t.contains("avx512")),
                "{SOURCE}: an attribute mentions AVX-512: {t}"
            );
            out.push_str(line);
        }
        out.push('\n');
    }
    assert!(switched > 0, "{SOURCE}: no target_feature attributes found");
    // Every AVX-512 intrinsic the ISA calls must have a software version; masked forms (which
    // AVX-512 VL/BW add to 128- and 256-bit intrinsics) have none.
    let soft = read(SOFT);
    let defined: BTreeSet<&str> = soft
        .match_indices("fn _mm512_")
        .map(|(at, _)| ident(&soft[at + "fn ".len()..]))
        .collect();
    for name in names(&text, "_mm512_") {
        assert!(
            defined.contains(name),
            "{SOURCE} calls {name}, which {SOFT} does not define in software"
        );
    }
    for prefix in ["_mm_mask", "_mm256_mask", "_mm_maskz", "_mm256_maskz"] {
        let masked = names(&text, prefix);
        assert!(
            masked.is_empty(),
            "{SOURCE} calls {masked:?}: no software versions"
        );
    }
    let dir = env::var("OUT_DIR").expect("cargo sets OUT_DIR for build scripts");
    let dest = Path::new(&dir).join("avx512_emulated.rs");
    fs::write(&dest, out).unwrap_or_else(|e| panic!("writing {}: {e}", dest.display()));
}
