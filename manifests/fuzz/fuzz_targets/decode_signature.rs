//! The signature file parser and checker on arbitrary bytes: never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stormo_manifests::ManifestSignature;

fuzz_target!(|data: &[u8]| {
    if let Ok(sig) = ManifestSignature::from_bytes(data) {
        let _ = sig.check(data);
        assert_eq!(&sig.to_bytes()[..], data);
    }
});
