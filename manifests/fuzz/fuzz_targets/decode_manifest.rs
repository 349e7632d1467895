//! The manifest decoder on arbitrary bytes: it must never panic, and whatever it accepts must
//! be canonical (re-encoding gives the same bytes) and valid.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stormo_manifests::manifest::{Manifest, FORMAT_VERSION, MAGIC};

fuzz_target!(|data: &[u8]| {
    // Raw input, and input behind a valid prefix so the fuzzer reaches the body quickly.
    for bytes in [data.to_vec(), {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(data);
        b
    }] {
        if let Ok(m) = Manifest::decode(&bytes) {
            assert_eq!(m.encode(), bytes);
            m.validate().expect("a decoded manifest is valid");
            let _ = m.to_json();
        }
    }
});
