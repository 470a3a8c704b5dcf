#!/usr/bin/env bash
# The memory an idle vfiod holds (issue 20): `vfiod --simulate` started, left alone for 15 s,
# then its proportional set size (PSS) read from /proc/PID/smaps_rollup, and split by what it
# maps: vfiod's own binary, the shared libraries it links (libvirt and its chain, SQLite, ...),
# and its anonymous memory (heap, thread stacks, malloc arenas). Each figure is the median of
# RUNS runs (default 3) in this one invocation, so that they compare with each other.
#
#   benches/idle-memory.sh [VFIOD_BINARY ...]     default: target/release/vfiod
#
# Give several binaries (an older build, say) to compare them in the same run. A library's
# pages count wholly here when no other process maps it, and in part when one does (libvirtd on
# a real host shares libvirt's chain), and how many pages the kernel maps around each fault
# depends on the kernel: compare figures from one run on one machine. Nothing else may run the
# same binary meanwhile (its pages would be shared, and counted in part): the script refuses.
#
# The last column is the PSS of the libvirt helper (`vfiod-libvirt`, a child of vfiod), when
# one runs: vfiod starts it only when there is a libvirt to connect to, so on a machine without
# libvirtd running it is 0; set LIBVIRT_URI (added to conf/simulate.toml in a config given to
# each run) to measure it with a URI that needs no daemon, e.g. LIBVIRT_URI=test:///default.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
WAIT=${WAIT:-15}
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(target/release/vfiod)

measure() {
  local bin=$1 out pid
  out=$(mktemp)
  local args=(--simulate)
  if [ -n "${LIBVIRT_URI:-}" ]; then
    # The simulation's own config (conf/simulate.toml), with the URI first (a top-level key).
    { printf 'libvirt_uri = "%s"\n' "$LIBVIRT_URI"; cat conf/simulate.toml; } >"$out.toml"
    args+=(--config "$out.toml")
  fi
  "$bin" "${args[@]}" >"$out" 2>&1 &
  pid=$!
  sleep "$WAIT"
  python3 - "$pid" "$bin" <<'EOF'
import collections, os, re, sys
pid, binary = sys.argv[1], os.path.realpath(sys.argv[2])
part, kb = None, collections.Counter()
for line in open(f"/proc/{pid}/smaps"):
    m = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
    if m:
        name = m.group(1)
        part = ("binary" if name == binary else
                "libraries" if ".so" in name else
                "anonymous" if name in ("", "[heap]", "[stack]") else "other")
    elif line.startswith("Pss:"):
        kb[part] += int(line.split()[1])
total = sum(kb.values())
# The libvirt helper: a child of vfiod named vfiod-libvirt.
helper = 0
for child in open(f"/proc/{pid}/task/{pid}/children").read().split():
    try:
        if open(f"/proc/{child}/comm").read().strip() == "vfiod-libvirt":
            for line in open(f"/proc/{child}/smaps_rollup"):
                if line.startswith("Pss:"):
                    helper += int(line.split()[1])
    except OSError:
        pass
print(total, kb["binary"], kb["libraries"], kb["anonymous"], helper)
EOF
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  rm -f "$out" "$out.toml"
}

printf '%-40s %10s %10s %10s %10s %10s  (KiB, median of %d runs after %d s)\n' \
  binary PSS "its binary" libraries anonymous helper "$RUNS" "$WAIT"
for bin in "${bins[@]}"; do
  [ -x "$bin" ] || { echo "no executable $bin (cargo build --release first)" >&2; exit 1; }
  if find -L /proc/[0-9]*/exe -maxdepth 0 -samefile "$bin" 2>/dev/null | grep -q .; then
    echo "$bin already runs: its pages would be shared and counted in part; stop it first" >&2
    exit 1
  fi
  rows=()
  for _ in $(seq "$RUNS"); do rows+=("$(measure "$bin")"); done
  median() { printf '%s\n' "${rows[@]}" | awk -v c="$1" '{print $c}' | sort -n | sed -n "$(( (RUNS + 1) / 2 ))p"; }
  printf '%-40s %10s %10s %10s %10s %10s  (%s MiB; %s MiB without the libraries)\n' "$bin" \
    "$(median 1)" "$(median 2)" "$(median 3)" "$(median 4)" "$(median 5)" \
    "$(awk "BEGIN {printf \"%.1f\", $(median 1) / 1024}")" \
    "$(awk "BEGIN {printf \"%.1f\", ($(median 2) + $(median 4)) / 1024}")"
done
