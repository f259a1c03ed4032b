#!/usr/bin/env bash
# Fetches newer Redis and Valkey servers from Debian's package registry into a folder of the build
# tree, and prints, one per line, the path of a `redis-server`-like launcher for each:
#
#   redis-8.0    Redis 8.0    Debian 13 "trixie"
#   valkey-8.1   Valkey 8.1   Debian 13 "trixie"
#   redis-8.6    Redis 8.6    Debian "experimental"
#   valkey-9.1   Valkey 9.1   Debian "sid" (unstable)
#
# The test suite runs its Redis tests once more with each (`REDIS_SERVER_BIN=<launcher>`,
# scripts/test.sh): the servers differ in what the store and its durability option rely on
# (`SET … NX GET`, the scripts' commands, `WAIT` and `WAITAOF`, replication, Sentinel, Cluster).
#
# Nothing is installed on the system and no service is started: each server's packages, with the
# C library and the few libraries it needs from its own Debian suite, are unpacked into
# ${CARGO_TARGET_DIR:-target}/servers/<name>/, and its launcher runs it through that suite's own
# dynamic loader, since these binaries need a newer C library than Debian 12's. apt-get
# downloads with package lists of its own there, so the system's apt sources are left alone.
# Run again, it reuses what it fetched. With names as arguments, only those servers.
set -euo pipefail
cd "$(dirname "$0")/.."

dir="$(realpath -m "${CARGO_TARGET_DIR:-target}")/servers"
# name -> "<package> <suite> <suites its dependencies come from>"
declare -A sources=(
  [redis-8.0]="redis trixie trixie"
  [valkey-8.1]="valkey trixie trixie"
  [redis-8.6]="redis experimental sid"
  [valkey-9.1]="valkey sid sid"
)
order=(redis-8.0 valkey-8.1 redis-8.6 valkey-9.1)
[ "$#" -gt 0 ] && order=("$@")
# What the servers' binaries link that Debian 12's libraries are too old for.
libraries=(libc6 libstdc++6 libgcc-s1 libatomic1 libssl3t64 libjemalloc2 liblzf1 libsystemd0 libcap2)

launcher() { echo "$dir/$1/redis-server"; }

fetch() {
  local name=$1 package suite libsuite
  read -r package suite libsuite <<<"${sources[$name]:?unknown server $name (known: ${!sources[*]})}"
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
    echo "scripts/newer-servers.sh needs apt-get and dpkg-deb (Debian)" >&2
    exit 1
  }
  local apt="$dir/$name/apt" root="$dir/$name/root"
  rm -rf "$apt"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs"
  local suites=$suite
  [ "$libsuite" = "$suite" ] || suites="$suite $libsuite"
  cat >"$apt/debian.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suites
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  local options=(-qq -o "Dir::Etc::SourceList=$apt/debian.sources" -o Dir::Etc::SourceParts=-
    -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o Debug::NoLocking=1
    -o APT::Sandbox::User="$(id -un)")
  echo "fetching $package from Debian $suite into $dir/$name" >&2
  apt-get "${options[@]}" update >&2
  local packages=("${libraries[@]/%//$libsuite}" "$package-server/$suite" "$package-tools/$suite")
  (cd "$apt/debs" && apt-get "${options[@]}" download "${packages[@]}" >&2)
  rm -rf "$root"
  mkdir -p "$root"
  for deb in "$apt/debs"/*.deb; do
    dpkg-deb -x "$deb" "$root"
  done
  local lib="$root/usr/lib/x86_64-linux-gnu"
  # The server binary is `<package>-check-rdb` (Debian links `<package>-server` to it); it picks
  # its mode from its name, hence `--argv0`. `exec` keeps the process id the tests signal.
  cat >"$(launcher "$name")" <<EOF
#!/bin/sh
exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" --argv0 $package-server \\
  "$root/usr/bin/$package-check-rdb" "\$@"
EOF
  chmod +x "$(launcher "$name")"
  rm -rf "$apt"
}

for name in "${order[@]}"; do
  "$(launcher "$name")" --version >/dev/null 2>&1 || fetch "$name"
  "$(launcher "$name")" --version >&2
  launcher "$name"
done
