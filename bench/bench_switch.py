"""What one wake-up of another process costs on this machine: a pipe ping-pong.

Two processes pass one byte back and forth over two pipes; each round trip is two
wake-ups of a sleeping process (and, on one CPU, two context switches). Half a round
trip is the price of every hand-off to a process that sleeps, which is what a FIFO
queue does on each release once processes outnumber the limit. Measured in C (compiled
here with ``cc`` when there is one: the kernel's part alone) and in Python (``os.read`` /
``os.write``, what a Python process pays), each with both processes pinned to CPU 0
(``taskset``: a switch, no cross-CPU wake) and free to run on any CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from bench_common import Cleanup

C_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    long n = atol(argv[1]);
    int a[2], b[2];
    char c = 'x';
    if (pipe(a) || pipe(b))
        return 1;
    pid_t pid = fork();
    if (pid == 0) {
        for (long i = 0; i < n; i++)
            if (read(a[0], &c, 1) != 1 || write(b[1], &c, 1) != 1)
                _exit(1);
        _exit(0);
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++)
        if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1)
            return 1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    waitpid(pid, NULL, 0);
    printf("%.1f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n);
    return 0;
}
"""

PY_SOURCE = r"""
import os, sys, time
n = int(sys.argv[1])
a, b = os.pipe(), os.pipe()
pid = os.fork()
if pid == 0:
    r, w = a[0], b[1]
    for _ in range(n):
        os.write(w, os.read(r, 1))
    os._exit(0)
r, w = b[0], a[1]
t0 = time.perf_counter_ns()
for _ in range(n):
    os.write(w, b"x")
    os.read(r, 1)
t1 = time.perf_counter_ns()
os.waitpid(pid, 0)
print((t1 - t0) / n)
"""


@dataclass
class SwitchResult:
    label: str
    pinned_ns: list[float]  # per round trip, one per round
    free_ns: list[float]


def _run(cmd: list[str], pinned: bool) -> float:
    if pinned:
        cmd = ["taskset", "-c", "0", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def run_switch(cleanup: Cleanup, rounds: int = 3, n: int = 20000) -> list[SwitchResult]:
    commands: list[tuple[str, list[str]]] = []
    cc = shutil.which("cc")
    if cc is not None:
        directory = cleanup.tempdir()
        source = os.path.join(directory, "pingpong.c")
        exe = os.path.join(directory, "pingpong")
        with open(source, "w", encoding="ascii") as f:
            f.write(C_SOURCE)
        subprocess.run([cc, "-O2", "-o", exe, source], check=True, capture_output=True)
        commands.append(("C (read/write)", [exe, str(n)]))
    commands.append(("Python (os.read/os.write)", [sys.executable, "-c", PY_SOURCE, str(n)]))
    can_pin = shutil.which("taskset") is not None
    results = {label: SwitchResult(label, [], []) for label, _ in commands}
    for _ in range(rounds):
        for label, cmd in commands:
            if can_pin:
                results[label].pinned_ns.append(_run(cmd, True))
            results[label].free_ns.append(_run(cmd, False))
    return list(results.values())
