//! Generates the software-emulated copy of the AVX-512 tier that tests run on CPUs without
//! AVX-512 (`src/kernels/avx512_emulated.rs` includes it).
//!
//! The copy is `src/kernels/avx512.rs` with two mechanical changes, so the tested code is the
//! shipped code: its functions enable AVX2 instead of AVX-512 (the compiler must not emit
//! AVX-512 instructions of its own in them), and its inner doc comments are dropped (an
//! included file cannot carry them). Its AVX-512 intrinsics resolve to software versions there.

use std::{env, fs, path::Path};

const SOURCE: &str = "src/kernels/avx512.rs";
const FEATURES: &str = r#"#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]"#;
const EMULATED: &str = r#"#[target_feature(enable = "avx2,fma,f16c")]"#;

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-changed=build.rs");
    let text = fs::read_to_string(SOURCE).unwrap_or_else(|e| panic!("reading {SOURCE}: {e}"));
    let mut out = String::with_capacity(text.len());
    let mut switched = 0;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("//!") {
            continue;
        }
        if t.starts_with("#[target_feature") {
            // Every function of the tier must be switched: one left with AVX-512 enabled could
            // run AVX-512 instructions on a CPU without them.
            assert_eq!(t, FEATURES, "{SOURCE}: unexpected target_feature line: {t}");
            out.push_str(&line.replace(FEATURES, EMULATED));
            switched += 1;
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    assert!(switched > 0, "{SOURCE}: no target_feature attributes found");
    let dir = env::var("OUT_DIR").expect("cargo sets OUT_DIR for build scripts");
    let dest = Path::new(&dir).join("avx512_emulated.rs");
    fs::write(&dest, out).unwrap_or_else(|e| panic!("writing {}: {e}", dest.display()));
}
