#!/usr/bin/env bash
# Run README.md's "Running it for real" block (between the readme-run markers) exactly as
# written, in a fresh clone in an empty temp dir: nothing beside the clone, a new venv, a new
# install. Usage: scripts/readme_fresh_clone.sh [REPO]   (default: this repository; committed
# files only, as a user's clone gets them). Uses the README's fixed ports (8000, 50051, 18000,
# 19000, 10000, 9901): they must be free. Exit status: the block's. Every process it starts is
# in its own process group and is killed at the end; the temp dir is removed.
set -u
repo="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
git clone -q "$repo" "$tmp/xds-sentinel" || exit 1
cd "$tmp/xds-sentinel" || exit 1
sed -n '/<!-- readme-run:begin -->/,/<!-- readme-run:end -->/p' README.md | sed '1,2d' | head -n -2 > "$tmp/run.sh"
echo "--- running $(wc -l < "$tmp/run.sh") lines from README.md in $PWD"
setsid bash -e "$tmp/run.sh" &
pid=$!
( sleep 600; kill -KILL -- "-$pid" 2>/dev/null ) &
watchdog=$!
wait "$pid"
rc=$?
kill "$watchdog" 2>/dev/null
kill -KILL -- "-$pid" 2>/dev/null
echo "--- README block exited with $rc"
exit "$rc"
