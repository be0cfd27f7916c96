#!/usr/bin/env bash
# End-to-end checks of `redlite serve` with real clients, for CI after `cargo test --release`
# (which builds target/release/redlite): the openai/anthropic Python SDKs, the web page in
# headless Chromium, the pi coding agent, and kill -9 during state-file writes. Installs what
# they need (pip, apt chromium, npm).
# Usage: bash crates/server/tests/e2e.sh [path/to/redlite]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
bin="${1:-$root/target/release/redlite}"
[ -x "$bin" ] || (cd "$root" && cargo build --release -p redlite)
if ! command -v chromium > /dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) > /dev/null
  fi
fi
status=0
echo "== server e2e: openai + anthropic Python SDKs"
bash "$here/sdk/run.sh" "$bin" || status=1
echo "== server e2e: web page in headless Chromium"
bash "$here/web/run.sh" "$bin" || status=1
echo "== server e2e: pi coding agent"
bash "$here/pi/run.sh" "$bin" || status=1
echo "== server e2e: kill -9 during state-file writes"
bash "$here/killstate/run.sh" "$bin" || status=1
exit $status
