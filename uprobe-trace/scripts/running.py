#!/usr/bin/env python3
"""The running-process case of compare.sh: `uprobe-trace -p` (and
`bpftrace -p` where it runs) on a live multi-threaded program
(`target.c`), measured from the outside and by the program itself.

    python3 running.py TRACE TARGET [--threads 8] [--cycles 100]

Prints Markdown tables:
  * probes live: from the command to the probes attached (uprobe-trace:
    its "tracing process" line, printed once the agent's first round of
    attaches is done; bpftrace: the first hit of the probes, timed by
    bpftrace's own clock, CLOCK_MONOTONIC, as ours);
  * the program's longest stall while the tool attaches, traces and
    detaches (its threads time every batch of 1000 calls and every 1 ms
    heartbeat), against its longest stall untraced;
  * added time per traced call: CPU time per call traced minus untraced;
  * after the detach: bytes of the executable's and libc's code that
    differ from their files, RSS against before;
  * N attach/detach cycles: crashes, descriptors and RSS after;
  * counts over a window the script controls, uprobe-trace and bpftrace
    on the same process, one after the other;
  * stacks (`--stacks` against bpftrace's `ustack`): added time per call.
"""

import argparse
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

FUNCS = [f"f{i}" for i in range(10)]


class Target:
    """The program, its periodic lines (t_ns, calls, max_gap_us) and cues."""

    def __init__(self, path, threads):
        self.p = subprocess.Popen(
            [path, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines = []
        self.done = queue.Queue()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        time.sleep(0.5)

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("done"):
                self.done.put(int(line.split()[1]))
                continue
            parts = line.split()
            if len(parts) == 5:
                with self.lock:
                    self.lines.append(tuple(int(x) for x in parts))

    def window(self, t0, t1):
        with self.lock:
            return [l for l in self.lines if t0 <= l[0] <= t1]

    def ns_per_call(self, t0, t1):
        """Mean time of a call inside the batches of the window."""
        w = self.window(t0, t1)
        ns, n = sum(l[3] for l in w), sum(l[4] for l in w)
        return ns / (n * 1000) if n else None

    def max_gap_us(self, t0, t1):
        return max((l[2] for l in self.window(t0, t1)), default=None)

    def cue(self, k):
        self.p.stdin.write(f"{k}\n")
        self.p.stdin.flush()
        return self.done.get(timeout=60)

    def alive(self):
        return self.p.poll() is None

    def rss_kib(self):
        with open(f"/proc/{self.p.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))

    def fds(self):
        return len(os.listdir(f"/proc/{self.p.pid}/fd"))

    def code_differs(self):
        """Bytes of every executable file mapping that differ from the file."""
        differ = 0
        with open(f"/proc/{self.p.pid}/maps") as maps, open(f"/proc/{self.p.pid}/mem", "rb") as mem:
            for line in maps:
                f = line.split()
                if len(f) < 6 or "x" not in f[1] or not f[5].startswith("/"):
                    continue
                start, end = (int(x, 16) for x in f[0].split("-"))
                offset = int(f[2], 16)
                mem.seek(start)
                live = mem.read(end - start)
                with open(f[5], "rb") as file:
                    file.seek(offset)
                    disk = file.read(end - start)
                differ += sum(a != b for a, b in zip(live, disk))
        return differ

    def stop(self):
        self.p.kill()
        self.p.wait()


def now():
    return time.monotonic_ns()


def uprobe_trace(trace, pid, args, duration):
    """Runs uprobe-trace -p; returns (t_start, t_live, t_end, stderr)."""
    t0 = now()
    p = subprocess.Popen(
        [trace, "-p", str(pid), *args, "-d", str(duration)],
        stderr=subprocess.PIPE,
        text=True,
    )
    live = None
    out = []
    for line in p.stderr:
        out.append(line)
        if live is None and "tracing process" in line:
            live = now()
    p.wait()
    return t0, live, now(), "".join(out), p.returncode


def bpftrace(pid, exe, probes, action, duration):
    """Runs bpftrace -p; returns (t_start, t_first_hit, t_end, stdout)."""
    attach = ",".join(f"uprobe:{exe}:{f}" for f in probes)
    prog = (
        f"{attach} /@first == 0/ {{ @first = 1; printf(\"first %lld\\n\", nsecs); }} "
        f"{attach} {{ {action} }} "
        f"interval:ms:{int(duration * 1000)} {{ exit(); }}"
    )
    t0 = now()
    p = subprocess.run(
        ["bpftrace", "-p", str(pid), "-e", prog],
        capture_output=True,
        text=True,
    )
    m = re.search(r"^first (\d+)$", p.stdout, re.M)
    return t0, int(m.group(1)) if m else None, now(), p.stdout + p.stderr


def count_on_cue(target, k, cmd, stream, ready, pattern):
    """Runs tracer `cmd`, waits until `ready(its output stream)` returns,
    has `target` make exactly `k` calls, stops the tracer with SIGINT and
    returns the count `pattern` finds in its output."""
    p = subprocess.Popen(cmd, text=True, **{stream: subprocess.PIPE})
    out = getattr(p, stream)
    ready(out)
    target.cue(k)
    p.send_signal(signal.SIGINT)
    text = out.read()
    p.wait()
    m = re.search(pattern, text, re.M)
    return int(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("target")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=100)
    a = ap.parse_args()
    have_bpftrace = shutil.which("bpftrace") and os.geteuid() == 0
    exe = os.path.realpath(a.target)

    t = Target(a.target, a.threads)
    rss0, fds0 = t.rss_kib(), t.fds()
    base_t0 = now()
    time.sleep(2)
    base_ns = t.ns_per_call(base_t0, now())
    base_gap = t.max_gap_us(base_t0, now())
    rows = []

    # uprobe-trace -p: 10 functions, 2 s.
    funcs = ["-f", ",".join(FUNCS)]
    t0, live, t1, err, rc = uprobe_trace(a.trace, t.p.pid, funcs, 2)
    traced = t.ns_per_call(live + 200_000_000, live + 1_800_000_000) if live else None
    stall = t.max_gap_us(t0, t1 + 100_000_000)
    calls = sum(int(m) for m in re.findall(r"^f\d: (\d+) calls", err, re.M))
    time.sleep(0.5)
    rows.append(("uprobe-trace", live and (live - t0) / 1e6, stall, traced, calls, rc))

    # RSS first: reading the code through /proc/PID/mem faults its pages
    # into the program.
    rss1 = t.rss_kib()
    differ = t.code_differs()

    if have_bpftrace:
        t0, first, t1, out = bpftrace(t.p.pid, exe, FUNCS, "@c = count();", 2)
        traced = t.ns_per_call(first + 200_000_000, first + 1_800_000_000) if first else None
        stall_b = t.max_gap_us(t0, t1 + 100_000_000)
        m = re.search(r"^@c: (\d+)", out, re.M)
        rows.append(("bpftrace", first and (first - t0) / 1e6, stall_b, traced, int(m.group(1)) if m else 0, 0))
        time.sleep(0.5)

    print(f"Target: {a.threads} worker threads calling f0..f9 in turn, in batches of 1000 with a 200 us "
          f"sleep after each, on {os.cpu_count()} CPUs; untraced {base_ns:.1f} ns a call, "
          f"longest stall untraced {base_gap} us.\n")
    print("| tool | probes live after (ms) | longest stall attach..detach (us) | ns a call traced | added ns a call | calls counted | exit |")
    print("|---|---|---|---|---|---|---|")
    for name, live_ms, stall, ns, n, rc in rows:
        added = ns - base_ns if ns else float("nan")
        live_s = f"{live_ms:.0f}" if live_ms else "-"
        ns_s = f"{ns:.1f}" if ns else "-"
        print(f"| {name} | {live_s} | {stall} | {ns_s} | {added:.1f} | {n} | {rc} |")
    print()
    print(f"After uprobe-trace's detach: {differ} bytes of code differ from the files; "
          f"RSS {rss1 - rss0:+d} KiB against before.\n")

    # Cycles, against the RSS before them (after the checks above, whose
    # reads of the code through /proc/PID/mem fault pages in).
    rss_c0 = t.rss_kib()
    crashes = 0
    for i in range(a.cycles):
        _, _, _, err, rc = uprobe_trace(a.trace, t.p.pid, funcs, 0.05)
        if rc != 0 or not t.alive():
            crashes += 1
            print(f"cycle {i}: exit {rc}: {err}", file=sys.stderr)
            if not t.alive():
                break
    time.sleep(1.5)
    if t.alive():
        print(f"{a.cycles} attach/detach cycles: {crashes} failed, target alive; "
              f"descriptors {t.fds() - fds0:+d}, RSS {t.rss_kib() - rss_c0:+d} KiB against before them, "
              f"{t.code_differs()} bytes of code differ from the files.\n")
    else:
        print(f"{a.cycles} attach/detach cycles: the target died\n")
        return

    # Counts over a window we control: exactly K calls of f0, in a process
    # of its own whose only caller of f0 is the cue.
    k = 100_000
    counted = []
    quiet = Target(a.target, 0)
    counted.append(("uprobe-trace -p", count_on_cue(
        quiet, k, [a.trace, "-p", str(quiet.p.pid), "-f", "f0"], "stderr",
        lambda out: any("tracing process" in line for line in out), r"^f0: (\d+) calls")))
    if have_bpftrace:
        # A uprobe on a file fires in every process that maps it; its
        # "Attaching" line is buffered in the pipe: give it time.
        counted.append(("bpftrace -p", count_on_cue(
            quiet, k,
            ["bpftrace", "-p", str(quiet.p.pid), "-e",
             f"uprobe:{exe}:f0 /pid == {quiet.p.pid}/ {{ @c = count(); }}"],
            "stdout", lambda out: time.sleep(3.0), r"^@c: (\d+)")))
    quiet.stop()
    print(f"Exactly {k} calls of f0 while traced (a process whose only caller is the cue):")
    for name, n in counted:
        print(f"- {name}: {n}")
    print()

    # Stacks.
    srows = []
    with tempfile.TemporaryDirectory() as d:
        folded = os.path.join(d, "folded")
        t0, live, t1, err, rc = uprobe_trace(a.trace, t.p.pid, ["-f", "f0", "--stacks", folded], 2)
        rate = t.ns_per_call(live + 200_000_000, live + 1_800_000_000) if live else None
        n = int(re.search(r"^f0: (\d+) calls", err, re.M).group(1)) if live else 0
        with open(folded) as f:
            stacks = [l for l in f.read().splitlines() if l]
        srows.append(("uprobe-trace --stacks", rate, n, len(stacks), stacks[:2]))
    if have_bpftrace:
        t0, first, t1, out = bpftrace(t.p.pid, exe, ["f0"], "@s[ustack] = count(); @c = count();", 2)
        rate = t.ns_per_call(first + 200_000_000, first + 1_800_000_000) if first else None
        m = re.search(r"^@c: (\d+)", out, re.M)
        srows.append(("bpftrace @[ustack]", rate, int(m.group(1)) if m else 0, out.count("]: "), []))
    print("| stacks of f0 (a tenth of the calls) | ns a call traced | added ns a traced call | calls | distinct stacks |")
    print("|---|---|---|---|---|")
    for name, ns, n, distinct, _ in srows:
        # f0 is one call in ten: the added time is all f0's.
        added = (ns - base_ns) * 10 if ns else float("nan")
        print(f"| {name} | {ns or 0:.1f} | {added:.0f} | {n} | {distinct} |")
    print()
    for line in srows[0][4]:
        print(f"    {line}")
    t.stop()


if __name__ == "__main__":
    main()
