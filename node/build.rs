//! Embeds the o200k_harmony tokenizer for `stormo demo`, zlib-compressed (28 MB -> ~4.5 MB).
//! A build without the repository's fixture embeds an empty file and the demo does without.

use std::path::PathBuf;

fn main() {
    let src =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/o200k-harmony/tokenizer.json");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("o200k-harmony.json.zlib");
    println!("cargo:rerun-if-changed={}", src.display());
    let packed = match std::fs::read(&src) {
        Ok(json) => miniz_oxide::deflate::compress_to_vec_zlib(&json, 6),
        Err(e) => {
            println!(
                "cargo:warning=no {} ({e}): `stormo demo` will run without a tokenizer",
                src.display()
            );
            Vec::new()
        }
    };
    std::fs::write(&out, packed).expect("OUT_DIR is writable");
}
