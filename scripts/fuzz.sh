#!/usr/bin/env bash
# Runs every fuzz target of fuzz/fuzz_targets/ (cargo-fuzz, libFuzzer; nightly) for SECONDS each
# (default 60): `scripts/fuzz.sh [seconds] [target...]`. A libFuzzer process uses one core, so
# the targets run as many at a time as there are cores (FUZZ_PARALLEL; no -jobs, which would
# fork workers), each one's output printed once it is done. CI runs `FUZZ_SANITIZER=none scripts/fuzz.sh 20`
# (.ci/run: the build first, with FUZZ_BUILD_ONLY=1, the runs once the test binaries are built).
# Needs the nightly toolchain (`rustup toolchain install nightly`; it fails saying so when it is
# missing; FUZZ_TOOLCHAIN names another, a dated nightly say) and cargo-fuzz, which it installs
# (`cargo install cargo-fuzz --locked`) when missing.
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
toolchain=${FUZZ_TOOLCHAIN:-nightly}
if ! cargo "+$toolchain" --version >/dev/null 2>&1; then
  echo "scripts/fuzz.sh: the fuzzers need a nightly toolchain (cargo-fuzz's sanitizer and" \
    "coverage flags), and '$toolchain' is not installed: rustup toolchain install $toolchain" >&2
  exit 1
fi
echo "using $(cargo "+$toolchain" --version)"
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== fuzz: installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi
echo "using $(cargo fuzz --version)"
# FUZZ_SANITIZER: cargo-fuzz's -s (default address). CI passes none: the crate forbids unsafe
# code, so AddressSanitizer finds little here, and without it the build takes a quarter less.
sanitizer=${FUZZ_SANITIZER:-address}
cargo "+$toolchain" fuzz build -s "$sanitizer"
# FUZZ_BUILD_ONLY=1: the build alone (.ci/run builds early, at idle priority, and runs later).
[ -z "${FUZZ_BUILD_ONLY:-}" ] || exit 0
parallel=${FUZZ_PARALLEL:-$(nproc)}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
failed=()
for ((first = 0; first < ${#targets[@]}; first += parallel)); do
  batch=("${targets[@]:first:parallel}")
  pids=()
  for target in "${batch[@]}"; do
    mkdir -p "work/$target"
    cargo "+$toolchain" fuzz run -s "$sanitizer" "$target" "work/$target" "corpus/$target" -- \
      -max_total_time="$seconds" -print_final_stats=1 >"$logs/$target" 2>&1 &
    pids+=("$!")
  done
  for n in "${!batch[@]}"; do
    target=${batch[$n]}
    status=0
    wait "${pids[$n]}" || status=$?
    echo "== fuzz: $target for $seconds s"
    cat "$logs/$target"
    [ "$status" -eq 0 ] || failed+=("$target")
  done
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "scripts/fuzz.sh: failed: ${failed[*]} (each crash is in fuzz/artifacts/<target>/)" >&2
  exit 1
fi
echo "== fuzz: ${#targets[@]} targets, $seconds s each, none failed"
