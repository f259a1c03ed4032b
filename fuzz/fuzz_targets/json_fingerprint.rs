#![no_main]
// The check is the crate's own (tower_idempotency::__fuzz::json_fingerprint), shared with tests/fuzz_corpora.rs.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_idempotency::__fuzz::json_fingerprint(data));
