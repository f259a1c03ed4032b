#!/usr/bin/env bash
# Builds the library with no feature and with each feature alone, under clippy with warnings
# denied (all of them together: .ci/run's clippy over every target): a feature that fails to
# build alone, or leaves an unused import behind when another is off, fails here. The features are read from Cargo.toml, so a new one is
# checked without editing this script.
set -euo pipefail
cd "$(dirname "$0")/.."

features=$(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, sys; print(" ".join(sorted(f for f in json.load(sys.stdin)["packages"][0]["features"] if f != "default")))')

check() {
  echo "== features: ${1:-none}"
  cargo clippy --locked --lib --no-default-features --features "$1" -- -D warnings
}

check ""
for feature in $features; do
  check "$feature"
done
# All features together: .ci/run's clippy over every target covers them.
