//! Every checked-in fuzz input (`fuzz/corpus/<target>/`: the seeds, and the input of each bug
//! fixed, named `fixed-*`) run through its target's check on stable, in every
//! `cargo test --all-features`, so each fixed bug stays fixed without the nightly toolchain.
//! The checks are the fuzz targets' own (`tower_idempotency::__fuzz`, crate feature
//! `fuzzing`); `scripts/fuzz.sh` runs the fuzzers (CI: each target 25 s), and runs each file of
//! `fuzz/fuzz_targets/`, which must be a binary of `fuzz/Cargo.toml` (checked here).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use tower_idempotency::__fuzz;

/// A target's check: panics where a property fails.
type Check = fn(&[u8]);

const TARGETS: [(&str, Check); 7] = [
    ("key", __fuzz::key),
    ("redis_record", __fuzz::redis_record),
    ("stored_response", __fuzz::stored_response),
    ("prefer", __fuzz::prefer),
    ("fingerprint", __fuzz::fingerprint),
    ("json_fingerprint", __fuzz::json_fingerprint),
    ("policy", __fuzz::policy),
];

#[test]
fn every_checked_in_fuzz_input_passes_its_target() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    // The published package leaves fuzz/ out (Cargo.toml's `include`): there this test fails,
    // saying so, rather than pass having run nothing. Run it from the repository.
    assert!(
        fuzz.join("Cargo.toml").exists(),
        "no fuzz/ beside this crate ({}): run this test from the repository, which has the corpora",
        fuzz.display()
    );
    let targets = std::fs::read_dir(fuzz.join("fuzz_targets"))
        .expect("fuzz/fuzz_targets")
        .map(|entry| entry.expect("a target").path())
        .filter_map(|path| Some(path.file_stem()?.to_str()?.to_owned()))
        .collect::<std::collections::BTreeSet<_>>();
    let named = TARGETS.iter().map(|(name, _)| name.to_string()).collect();
    assert_eq!(targets, named, "every fuzz target's corpus is run here");
    // `scripts/fuzz.sh` runs each file of fuzz_targets/ by its binary's name: one missing from
    // fuzz/Cargo.toml would fail there, on nightly; here it fails on stable too.
    let manifest = std::fs::read_to_string(fuzz.join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for target in &targets {
        let bin = format!("name = \"{target}\"\npath = \"fuzz_targets/{target}.rs\"");
        assert!(
            manifest.contains(&bin),
            "fuzz/Cargo.toml has no [[bin]] {target} at fuzz_targets/{target}.rs"
        );
    }
    let mut failed = Vec::new();
    for (target, check) in TARGETS {
        let dir = fuzz.join("corpus").join(target);
        let inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.expect("an input").path())
            .collect();
        assert!(!inputs.is_empty(), "{} holds no input", dir.display());
        for input in inputs {
            let data = std::fs::read(&input).expect("readable");
            if catch_unwind(AssertUnwindSafe(|| check(&data))).is_err() {
                failed.push(input.display().to_string());
            }
        }
    }
    assert!(failed.is_empty(), "inputs that fail their target: {failed:#?}");
}
