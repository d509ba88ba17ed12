#!/usr/bin/env bash
# Wall time of real workloads untraced and traced by uprobe-trace, ltrace,
# uftrace and bpftrace, each counting every malloc and free; prints a
# Markdown table. Tools that are not installed (or cannot run here:
# bpftrace needs root) are left out with a note. Then the running-process
# case (running.py on target.c): uprobe-trace -p against bpftrace -p.
#
#   bash uprobe-trace/scripts/compare.sh [RUNS]
#
# RUNS (default 3): runs per cell, interleaved; the median is shown.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${1:-3}
LIMIT=${LIMIT:-600} # seconds a traced run may take before it is given up
cargo build --release -q -p uprobe-trace
TRACE=$PWD/target/release/uprobe-trace
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LIBC=$(ldconfig -p | awk '/libc\.so\.6 \(/ {print $NF; exit}')
LIBC=$(readlink -f "$LIBC")
PYTHON=/usr/bin/python3

# Workloads.
cat > "$WORK/sort.py" <<'PY'
import random
random.seed(1)
xs = [(random.random(), str(i), [i]) for i in range(1_000_000)]
xs.sort()
PY
# A 64 MiB text file with some redundancy, for gzip -9.
"$PYTHON" - "$WORK/big.txt" <<'PY'
import random, sys
random.seed(2)
words = [''.join(random.choice('abcdefghij') for _ in range(random.randint(2, 9))) for _ in range(5000)]
with open(sys.argv[1], 'w') as f:
    n = 0
    while n < 64 << 20:
        line = ' '.join(random.choice(words) for _ in range(12)) + '\n'
        f.write(line)
        n += len(line)
PY
cat > "$WORK/sql.txt" <<'SQL'
CREATE TABLE t(a INTEGER PRIMARY KEY, b TEXT, c REAL);
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
INSERT INTO t SELECT i, hex(randomblob(16)), random() FROM n;
CREATE INDEX tb ON t(b);
SELECT count(*), sum(length(b)) FROM t WHERE c > 0;
SELECT b FROM t ORDER BY c LIMIT 5;
SQL
# Each workload: its command line (no shell between the tracer and the
# program), its standard input, and its process name (bpftrace's filter).
declare -A CMD IN COMM
CMD[python]="$PYTHON $WORK/sort.py"; IN[python]=/dev/null; COMM[python]=python3
# Full paths: bpftrace -c wants one binary.
GZIP=$(readlink -f "$(command -v gzip)")
SQLITE=$(readlink -f "$(command -v sqlite3)")
CMD[gzip]="$GZIP -9 -f -k $WORK/big.txt"; IN[gzip]=/dev/null; COMM[gzip]=gzip
# The script through -init: bpftrace -c gives the program no stdin.
CMD[sqlite3]="$SQLITE -init $WORK/sql.txt :memory: .quit"; IN[sqlite3]=/dev/null; COMM[sqlite3]=sqlite3
ORDER=(python gzip sqlite3)

have() { command -v "$1" >/dev/null 2>&1; }
TOOLS=(none uprobe-trace)
have ltrace && TOOLS+=(ltrace)
have uftrace && TOOLS+=(uftrace)
have bpftrace && [ "$(id -u)" = 0 ] && TOOLS+=(bpftrace)

# Runs workload $1 under tool $2; prints "seconds counts".
run() {
    local w=$1 tool=$2 out=$WORK/out start end counts=""
    local -a cmd
    read -r -a cmd <<<"${CMD[$1]}"
    start=$(date +%s.%N)
    case $tool in
    none) timeout $LIMIT "${cmd[@]}" <"${IN[$w]}" >/dev/null 2>"$out" || true ;;
    uprobe-trace)
        timeout $LIMIT "$TRACE" -f malloc,free -- "${cmd[@]}" <"${IN[$w]}" >/dev/null 2>"$out" || true
        counts=$(awk '/^malloc:/ {m=$2} /^free:/ {f=$2} END {print m "/" f}' "$out") ;;
    ltrace)
        timeout $LIMIT ltrace -c -e malloc+free -o "$out" "${cmd[@]}" <"${IN[$w]}" >/dev/null 2>&1 || true
        counts=$(awk '$NF=="malloc" {m=$4} $NF=="free" {f=$4} END {print m "/" f}' "$out") ;;
    uftrace)
        rm -rf "$WORK/uftrace.data"
        timeout $LIMIT uftrace record --force -F malloc -F free -d "$WORK/uftrace.data" "${cmd[@]}" <"${IN[$w]}" >/dev/null 2>"$out" || true
        counts=$(uftrace report -d "$WORK/uftrace.data" 2>/dev/null | awk '$NF=="malloc" {m=$(NF-1)} $NF=="free" {f=$(NF-1)} END {print m "/" f}') ;;
    bpftrace)
        timeout $LIMIT bpftrace -q -e "uprobe:$LIBC:malloc /comm == \"${COMM[$w]}\"/ { @m = count(); } uprobe:$LIBC:free /comm == \"${COMM[$w]}\"/ { @f = count(); }" \
            -c "${CMD[$w]}" <"${IN[$w]}" >"$out" 2>&1 || true
        counts=$(awk '/^@m:/ {m=$2} /^@f:/ {f=$2} END {print m "/" f}' "$out") ;;
    esac
    end=$(date +%s.%N)
    echo "$(echo "$end - $start" | bc) ${counts:--}"
}

declare -A TIMES COUNTS
for r in $(seq "$RUNS"); do
    for w in "${ORDER[@]}"; do
        for t in "${TOOLS[@]}"; do
            read -r secs counts < <(run "$w" "$t")
            TIMES[$w,$t]="${TIMES[$w,$t]:-} $secs"
            COUNTS[$w,$t]=$counts
            echo "run $r: $w / $t: $secs s, malloc/free $counts" >&2
        done
    done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo
echo "| workload | tool | wall (s) | x untraced | added (s) | malloc/free counted |"
echo "|---|---|---|---|---|---|"
for w in "${ORDER[@]}"; do
    base=$(echo "${TIMES[$w,none]}" | median)
    for t in "${TOOLS[@]}"; do
        m=$(echo "${TIMES[$w,$t]}" | median)
        if [ "$(echo "$m >= $LIMIT - 1" | bc)" = 1 ]; then
            printf "| %s | %s | > %d (given up) | > %.0fx | > %.0f | %s (when given up) |\n" "$w" "$t" "$LIMIT" \
                "$(echo "$LIMIT / $base" | bc -l)" "$(echo "$LIMIT - $base" | bc -l)" "${COUNTS[$w,$t]}"
            continue
        fi
        printf "| %s | %s | %.2f | %.2fx | %.2f | %s |\n" "$w" "$t" "$m" \
            "$(echo "$m / $base" | bc -l)" "$(echo "$m - $base" | bc -l)" "${COUNTS[$w,$t]}"
    done
done
echo
echo "Medians of $RUNS interleaved runs; a traced run is given up after $LIMIT s."
echo "uftrace sees calls through the traced executable's PLT only (not a library's"
echo "own calls to malloc); bpftrace's -c output goes to the terminal, not /dev/null."

# A running process: uprobe-trace -p against bpftrace -p (probes live,
# stalls, added time per call, the detach, counts over a controlled
# window, and stacks against bpftrace's ustack): scripts/running.py.
echo
cc -O2 -fomit-frame-pointer -o "$WORK/target" uprobe-trace/scripts/target.c -lpthread
python3 uprobe-trace/scripts/running.py "$TRACE" "$WORK/target" --threads 8 --cycles 100
