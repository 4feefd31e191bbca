#!/usr/bin/env python3
"""includes.py — the parts of the tree meet only on neutral ground.

DESIGN §2: the daemon (daemon/), the library (client/), deepepctl
(client/ctl*.c) and the kernels (kernels/) share definitions only through
headers outside each other's folders: include/, proto/, config/, render/
and cuda/.  The Makefile gives each part its own include path (INC_<part>),
so that a part which includes another's header fails to compile; this holds
that from two sides, and exits 1 with what is wrong:

  - no part's include path (the Makefile's INC_<part>, asked of make) names
    a folder FORBIDDEN to it, so the path cannot be widened to let a header
    in unseen;
  - no #include "..." of a part's files reaches a header in such a folder,
    resolved as the compiler does (the file's own folder first, then the
    part's include path), so "../client/x.h" is caught as well.

The one folder of client/ that the daemon may reach is client/daemon_api/,
the library's internal interface for the daemon (deepep_daemon.h).

Python 3 standard library only, so CI needs nothing more than python3 and
make.
"""

import argparse
import os
import re
import subprocess
import sys

# Folders each part must never include from: another part's own.  A folder
# names itself alone, not the folders below it (client/ forbids client/*.h,
# not client/daemon_api/).
FORBIDDEN = {
    "daemon": ["client", "kernels"],
    "client": ["daemon"],
    "ctl": ["daemon"],
    "kernels": ["client", "daemon"],
    "proto": ["client", "daemon", "kernels"],
    "config": ["client", "daemon", "kernels"],
    "render": ["client", "daemon", "kernels"],
    "cuda": ["client", "daemon", "kernels"],
    "include": ["client", "daemon", "kernels"],
}

INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)


def part_of(path):
    """The part a source file belongs to, as the Makefile's part_inc says."""
    top = path.split("/", 1)[0]
    if top == "client" and os.path.basename(path).startswith("ctl"):
        return "ctl"
    return top


def include_path(root, part):
    """The part's -I folders, from the Makefile (make prints INC_<part>)."""
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "-C", root, "--eval",
         "print-inc-%: ; @echo INC: $(INC_$*)", "print-inc-" + part],
        check=True, capture_output=True, text=True).stdout
    lines = [l for l in out.splitlines() if l.startswith("INC:")]
    if not lines:
        sys.exit(f"includes: make printed no INC_{part}")
    return [w[2:].rstrip("/") for w in lines[-1].split()[1:] if w.startswith("-I")]


def resolve(root, src, name, path):
    """The header `name` that src's #include "name" reaches, relative to root, or None.
    One the part's path does not reach is looked for in every part's folder,
    so that a tree whose path is too wide or missing still shows where the
    include leads."""
    for d in [os.path.dirname(src)] + path + list(FORBIDDEN):
        cand = os.path.normpath(os.path.join(d, name))
        if os.path.isfile(os.path.join(root, cand)):
            return cand
    return None


def sources(root, part):
    top = "client" if part == "ctl" else part
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        for f in sorted(files):
            if not f.endswith((".c", ".h", ".cu", ".cuh")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if part_of(rel) == part:
                yield rel


def check(root):
    bad = []
    for part, forbidden in FORBIDDEN.items():
        path = include_path(root, part) if part != "include" else ["include"]
        if not path:
            bad.append(f"Makefile: no INC_{part}: give {part}/ an include path of its own")
        for d in path:
            if d in forbidden:
                bad.append(f"Makefile: INC_{part} names -I{d}: {part}/ must not reach {d}/'s "
                           f"headers (DESIGN §2); move what it needs to neutral ground")
        for src in sources(root, part):
            with open(os.path.join(root, src), encoding="utf-8", errors="replace") as f:
                text = f.read()
            for m in INCLUDE_RE.finditer(text):
                hdr = resolve(root, src, m.group(1), path)
                if hdr is not None and os.path.dirname(hdr) in forbidden:
                    line = text.count("\n", 0, m.start()) + 1
                    bad.append(f"{src}:{line}: includes {hdr}: {part}/ must not reach "
                               f"{os.path.dirname(hdr)}/'s headers (DESIGN §2); move what it "
                               f"needs to neutral ground (include/, proto/, config/, render/, cuda/)")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."),
                    help="the tree (default: this script's)")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    bad = check(root)
    for b in bad:
        print(b)
    print(f"includes: {len(FORBIDDEN)} parts checked, {len(bad)} include(s) across parts")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
