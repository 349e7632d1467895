#!/usr/bin/env bash
# Runs the engine's tests on AArch64 under QEMU user-mode emulation, so the NEON kernel tier
# (engine/src/kernels/neon.rs) is exercised on an x86-64 machine. `.ci/run` runs it (the
# kernel tests) after `cargo test --workspace`.
#
#   bash .ci/neon-emulated.sh            # the kernel tests (about 2 min to build, 15 s to run)
#   bash .ci/neon-emulated.sh ''         # every engine unit test (about 30 s to run)
#   bash .ci/neon-emulated.sh --oracle   # every oracle fixture token-exact with each tier
#                                        # (about 7 min to build the integration tests)
#
# Needs (Debian): qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross, installed with
# apt-get if missing, and the Rust target aarch64-unknown-linux-gnu (rustup target add).
# Under QEMU every tier the emulated CPU reports runs: scalar and neon.
#
# Exits 3, after a line "NEON bit test: NOT RUN (reason)", when those cannot be had (so a
# caller can tell "not run" from "failed"); otherwise with the tests' status.
set -euo pipefail
cd "$(dirname "$0")/.."
filter="${1-kernels}"

not_run() {
  echo "NEON bit test: NOT RUN ($1)" >&2
  exit 3
}

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
  command -v apt-get >/dev/null || not_run "no qemu-aarch64 or aarch64-linux-gnu-gcc, and no apt-get to install them"
  { apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross; } ||
    not_run "installing qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross with apt-get failed"
fi
if ! rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu; then
  rustup target add aarch64-unknown-linux-gnu ||
    not_run "rustup target add aarch64-unknown-linux-gnu failed"
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
if [ "$filter" = --oracle ]; then
  # ring and other C dependencies of the node build with the cross compiler.
  export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
  export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
  cargo test --target aarch64-unknown-linux-gnu -p stormo-tests --test integration -- \
    --test-threads 2 --nocapture oracle::
else
  cargo test --target aarch64-unknown-linux-gnu -p stormo-engine --lib -- --test-threads 2 $filter
fi
