#!/usr/bin/env python3
"""longfiles.py — the tree's longest source files, and a ceiling on their length.

STYLE: "a file past ~800 lines is usually two modules".  This prints every
source file of the tree (C, CUDA, Python and shell, shipped code, tests,
benchmarks and tools alike) longer than --show lines (default 800), longest
first, as "LINES  FILE", and exits 1 when one is longer than --max (default
MAX_LINES), so CI holds the tree to the ceiling and a file that outgrows it
is split when it lands.  A daemon module splits into files that share its
daemon/<m>_internal.h (as job.c, job_members.c and job_failed.c do); a test
file splits by theme into suites of their own, listed in tests/suites.h.
The few files in HELD are held to their length now instead (they may
shrink, not grow).

A file's length is its number of lines, comments and blank lines included:
a reader has to get past those too.

Python 3 standard library only, so CI needs nothing more than python3.
"""

import os
import sys

import ceiling

DIRS = ["daemon", "client", "kernels", "proto", "config", "render", "cuda",
        "include", "tests", "bench", "tools", "python"]
EXTS = (".c", ".h", ".cu", ".cuh", ".py", ".sh")

# The ceiling: STYLE's "~800 lines", with room for a file that has just
# grown past it to be split at a topic's edge rather than mid-topic.
MAX_LINES = 900

# file -> the most lines it may have, for one over MAX_LINES that is not
# split yet, with why (none today).
HELD = {}


def sources(root):
    for d in DIRS:
        top = os.path.join(root, d)
        for base, dirs, files in os.walk(top):
            dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__")))
            for f in sorted(files):
                if f.endswith(EXTS):
                    yield os.path.join(base, f)


def count_lines(path):
    with open(path, "rb") as f:
        data = f.read()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def main():
    args = ceiling.options(__doc__, "file", 800, MAX_LINES)
    found = sorted(((count_lines(p), os.path.relpath(p, args.root))
                    for p in sources(args.root)), key=lambda r: (-r[0], r[1]))
    return ceiling.report([(n, path, path) for n, path in found], HELD, args, "longfiles",
                          "split them by topic (a module's files share its <m>_internal.h; "
                          "a test file's themes become suites of their own)")


if __name__ == "__main__":
    sys.exit(main())
