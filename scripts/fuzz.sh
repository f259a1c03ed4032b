#!/usr/bin/env bash
# Runs every fuzz target of fuzz/fuzz_targets/ (cargo-fuzz, libFuzzer; nightly) for SECONDS each
# (default 60), one after another, one libFuzzer process at a time (no -jobs: it would fork
# workers): `scripts/fuzz.sh [seconds] [target...]`. CI runs `scripts/fuzz.sh 25` (.ci/run).
# Needs the nightly toolchain (`rustup toolchain install nightly`; it fails saying so when it is
# missing) and cargo-fuzz, which it installs (`cargo install cargo-fuzz --locked`) when missing.
# Each target starts from its checked-in inputs (fuzz/corpus/<target>/) and keeps what it finds
# in fuzz/work/<target>/ (not checked in); a crash is saved in fuzz/artifacts/<target>/ and
# stops the run with an error. Keep a crash, once fixed, as fuzz/corpus/<target>/fixed-<what>:
# tests/fuzz_corpora.rs runs every checked-in input through its target's check on stable, in
# every `cargo test --all-features`.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  # Every file of fuzz_targets/, not `cargo fuzz list`: a target left out of fuzz/Cargo.toml
  # then fails here (no such binary) instead of never running.
  for file in fuzz_targets/*.rs; do
    target=${file#fuzz_targets/}
    targets+=("${target%.rs}")
  done
fi
[ ${#targets[@]} -gt 0 ] || { echo "scripts/fuzz.sh: no fuzz target in fuzz/fuzz_targets/" >&2; exit 1; }
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "scripts/fuzz.sh: the fuzzers need the nightly toolchain (libFuzzer's sanitizer flags);" \
    "install it with: rustup toolchain install nightly" >&2
  exit 1
fi
echo "using $(cargo +nightly --version)"
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== fuzz: installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi
echo "using $(cargo fuzz --version)"
cargo +nightly fuzz build
for target in "${targets[@]}"; do
  echo "== fuzz: $target for $seconds s"
  mkdir -p "work/$target"
  cargo +nightly fuzz run "$target" "work/$target" "corpus/$target" -- \
    -max_total_time="$seconds" -print_final_stats=1
done
