#!/usr/bin/env bash
# Fetches the newest Redis and Valkey that Debian's package registry has (Debian 13 "trixie":
# Redis 8.0 and Valkey 8.1) into a folder of the build tree, and prints, one per line, the path of
# a `redis-server`-like launcher for each. The test suite runs its Redis tests once more with each
# (`REDIS_SERVER_BIN=<launcher>`, scripts/test.sh).
#
# Nothing is installed on the system and no service is started: the packages, and trixie's C
# library with the few libraries the servers need from it, are unpacked into
# ${CARGO_TARGET_DIR:-target}/servers/, and each launcher runs its server through trixie's own
# dynamic loader, since trixie's binaries need a newer C library than Debian 12's. apt-get
# downloads with a package list of its own there, so the system's apt sources are left alone.
# Run again, it reuses what it fetched.
set -euo pipefail
cd "$(dirname "$0")/.."

suite=trixie
dir="$(realpath -m "${CARGO_TARGET_DIR:-target}")/servers"
# The servers, and what their binaries link that Debian 12's libraries are too old for.
servers=(redis valkey)
libraries=(libc6 libstdc++6 libgcc-s1 libatomic1 libssl3t64 libjemalloc2 liblzf1 libsystemd0 libcap2)

launcher() { echo "$dir/$1/redis-server"; }

fetched=1
for server in "${servers[@]}"; do
  "$(launcher "$server")" --version >/dev/null 2>&1 || fetched=0
done

if [ "$fetched" -eq 0 ]; then
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
    echo "scripts/newer-servers.sh needs apt-get and dpkg-deb (Debian)" >&2
    exit 1
  }
  apt="$dir/apt"
  rm -rf "$apt"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs"
  cat >"$apt/debian.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  options=(-qq -o "Dir::Etc::SourceList=$apt/debian.sources" -o Dir::Etc::SourceParts=-
    -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o Debug::NoLocking=1
    -o APT::Sandbox::User="$(id -un)")
  echo "fetching Redis and Valkey from Debian $suite into $dir" >&2
  apt-get "${options[@]}" update >&2
  packages=("${libraries[@]/%//$suite}")
  for server in "${servers[@]}"; do
    packages+=("$server-server/$suite" "$server-tools/$suite")
  done
  (cd "$apt/debs" && apt-get "${options[@]}" download "${packages[@]}" >&2)
  for server in "${servers[@]}"; do
    root="$dir/$server/root"
    rm -rf "$root"
    mkdir -p "$root"
    for deb in "$apt/debs"/*.deb; do
      case "$(basename "$deb")" in
        redis-* | valkey-*) [[ "$(basename "$deb")" == "$server"-* ]] || continue ;;
      esac
      dpkg-deb -x "$deb" "$root"
    done
    lib="$root/usr/lib/x86_64-linux-gnu"
    # The server binary is `<server>-check-rdb` (Debian links `<server>-server` to it); it picks
    # its mode from its name, hence `--argv0`. `exec` keeps the process id the tests signal.
    cat >"$(launcher "$server")" <<EOF
#!/bin/sh
exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" --argv0 $server-server \\
  "$root/usr/bin/$server-check-rdb" "\$@"
EOF
    chmod +x "$(launcher "$server")"
  done
  rm -rf "$apt"
fi

for server in "${servers[@]}"; do
  "$(launcher "$server")" --version >&2
  launcher "$server"
done
