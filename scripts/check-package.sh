#!/usr/bin/env bash
# Packages the crate as it would be published (`cargo package`), then, from the package unpacked,
# builds its docs as docs.rs does (every feature, `--cfg docsrs`, warnings denied) and checks it
# with every feature (the library and the admin tool). So a file the build needs but Cargo.toml's
# `include` leaves out (a module, a Lua script, a migration, a guide page: all read at compile
# time) fails here, not on crates.io, and so does a doc warning.
#
# Why not `cargo package` alone: it verifies by building the package with its default features,
# a tree of dependencies that no other step of CI builds (37 s of CI's 2 cores). The check below
# reuses the dependencies the docs were just built with (checked, not built), and covers every
# feature. docs.rs builds with `--cfg docsrs` on nightly; RUSTC_BOOTSTRAP=1 lets the stable
# toolchain (the crate's; nightly is there for the fuzzers alone) take the nightly-only `doc_cfg`
# that this cfg turns on. The check runs with it too: proc-macro2's build script watches that
# variable, so a check without it would build proc-macro2, syn and every proc macro again, and
# everything that uses them. (A target directory of their own would spare the later builds
# that, but cost more: the ~130 dependencies the other checks have built already, built again.)
set -euo pipefail
cd "$(dirname "$0")/.."

read -r name version target < <(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, sys; m = json.load(sys.stdin); p = m["packages"][0]; print(p["name"], p["version"], m["target_directory"])')
cargo package --locked --no-verify "$@"
unpacked="$target/package/$name-$version"
rm -rf "$unpacked"
tar -xzf "$target/package/$name-$version.crate" -C "$target/package"
export CARGO_TARGET_DIR="$target" RUSTC_BOOTSTRAP=1
echo "== the package's docs, as docs.rs builds them (in $unpacked)"
RUSTDOCFLAGS="--cfg docsrs -D warnings" cargo doc --locked --no-deps --all-features --manifest-path "$unpacked/Cargo.toml"
echo "== the links of the rendered guide pages (as docs.rs shows them)"
python3 scripts/check-rendered-links.py "$target/doc"
echo "== the package, checked with every feature"
cargo check --locked --all-features --manifest-path "$unpacked/Cargo.toml"
