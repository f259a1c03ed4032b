#!/usr/bin/env bash
# Runs every fuzz target in fuzz/ (cargo-fuzz, libFuzzer; nightly) for SECONDS each (default 60),
# one after another, one libFuzzer process at a time (no -jobs: it would fork workers): `scripts/fuzz.sh [seconds] [target...]`.
# Needs `rustup toolchain install nightly` and `cargo install cargo-fuzz`. Each target starts from
# its checked-in inputs (fuzz/corpus/<target>/) and keeps what it finds in fuzz/work/<target>/
# (not checked in); a crash is saved in fuzz/artifacts/<target>/ and stops the run with an error.
# Keep a crash, once fixed, as fuzz/corpus/<target>/fixed-<what>: tests/fuzz_corpora.rs runs every
# checked-in input through its target's check on stable, in every `cargo test --all-features`.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi
cargo +nightly fuzz build
for target in "${targets[@]}"; do
  echo "== fuzz: $target for $seconds s"
  mkdir -p "work/$target"
  cargo +nightly fuzz run "$target" "work/$target" "corpus/$target" -- \
    -max_total_time="$seconds" -print_final_stats=1
done
