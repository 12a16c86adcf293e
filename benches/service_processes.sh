#!/usr/bin/env bash
# Steadiness across processes (issue 12): runs the fan-out bench's service
# setting in N fresh processes (default 10) and prints, per figure, the
# median over processes, how far the farthest process is from it, and in
# how many processes a repetition ran over 1.3x slower than that process's
# fastest. The targets: no default-mode (worker_pool) figure more than 1.3x
# from its median, and no repetition more than 1.3x from its fastest.
# The raw_loop rows run the same closures with no bus (two publisher tasks
# for "2 publishers"): how often they dip is the machine's floor.
#
#   benches/service_processes.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
cargo bench --bench fanout --no-run >/dev/null 2>&1
for i in $(seq 1 "$runs"); do
  # The CPUs' cache-line round trips (`benches/common/cores.rs`) are shown,
  # not summed: about 32 ns means the host runs both CPUs on one core.
  FANOUT_SERVICE_ONLY=1 cargo bench --bench fanout -- --bench 2>/dev/null |
    grep -E '^(service|cpus)' | sed "s/^/process $i: /" |
    awk '/: cpus: / { trips = trips " " $(NF - 1); next } { print } END { if (trips != "") print "cpus: cache-line round trips (ns):" trips }' |
    sed "s/^cpus/process $i: cpus/" | tee -a "$out"
done
echo
echo "figure | median over $runs processes | lowest | highest | farthest / median | processes with a repetition over 1.3x its fastest"
# Each line: "process I: service, <shape> <setup...>: median <X> <unit>,
# repetitions <lo>–<hi> (...)"
grep -v ': cpus: ' "$out" | sed -E 's/^process [0-9]+: service, (shared counter|own counters) +(.*): median ([0-9.]+) ([^,]+), repetitions ([0-9.]+)–([0-9.]+).*/\1 \2|\3|\4|\5|\6/' |
  sort -t'|' -k1,1 -s |
  awk -F'|' '
    function report() {
      if (n == 0) return
      for (i = 2; i <= n; i++) {   # insertion sort: mawk has no asort
        x = v[i]
        for (j = i - 1; j > 0 && v[j] > x; j--) v[j + 1] = v[j]
        v[j + 1] = x
      }
      med = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
      far = (v[n] / med > med / v[1]) ? v[n] / med : med / v[1]
      printf "%s | %.0f %s | %.0f | %.0f | %.2fx | %d of %d\n", key, med, unit, v[1], v[n], far, spread, n
    }
    $1 != key { report(); key = $1; unit = $3; n = 0; spread = 0; delete v }
    { v[++n] = $2; if ($5 > 1.3 * $4) spread++ }
    END { report() }'
