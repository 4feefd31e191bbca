#!/usr/bin/env python3
"""callgraph.py — the daemon's file-level call graph, and the loops in it.

Reads the daemon's object files (BUILD/obj/daemon/*.o, as `make` leaves
them) with nm: each object's undefined symbols are resolved to the object of
daemon/ that defines them, which gives one arrow "a -> b" per pair of files
where a calls (or reads) something b defines.  Symbols from outside daemon/
(proto/, config/, kernels/, libc, libuv) are no arrows: the question is how
the daemon's own files lean on each other.

The files of one module count as one: a module whose files share a
header of their own, daemon/<m>_internal.h, is <m>.c and every <m>_*.c
(job.c, job_members.c and job_failed.c are the job module); the arrows
inside a module are its own business, and those between modules are what
must point one way.

Prints every strongly connected component of more than one file (a set of
files each of which reaches every other through the arrows), with the
symbols that make each arrow inside it, and exits 1 when a component has
more files than --max (default 2: two files may call each other, as a module
and its private half do; three or more in a loop cannot be read alone).

Python 3 standard library only, so CI needs nothing more than binutils.
"""

import argparse
import os
import subprocess
import sys

# nm's letters for a symbol an object defines and another may link to, and
# for one it needs from elsewhere (w and v: a weak reference with no value here).
DEFINED = set("TDBRCGSVWiu")
UNDEFINED = set("Uwv")


def nm_symbols(path):
    """Return (defined, undefined) external symbol names of one object."""
    out = subprocess.run(["nm", "-P", "-g", path], check=True,
                         capture_output=True, text=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[0], parts[1]
        if kind in UNDEFINED:
            undefined.add(name)
        elif kind in DEFINED:
            defined.add(name)
    return defined, undefined


def modules(srcdir):
    """The prefixes m of daemon/m_internal.h: the modules split over files."""
    try:
        return sorted((f[:-len("_internal.h")] for f in os.listdir(srcdir)
                       if f.endswith("_internal.h")), key=len, reverse=True)
    except OSError:
        return []


def module_of(name, mods):
    """The module a file belongs to: its m where it is m.c or m_*.c, else itself."""
    for m in mods:
        if name == m or name.startswith(m + "_"):
            return m
    return name


def graph(objdir, mods):
    """Arrows module -> {module: sorted symbols} among the objects in objdir."""
    try:
        objs = sorted(f for f in os.listdir(objdir) if f.endswith(".o"))
    except OSError as e:
        sys.exit(f"callgraph: cannot list {objdir} ({e.strerror}): build the daemon first (make)")
    if not objs:
        sys.exit(f"callgraph: no object files in {objdir}: build the daemon first (make)")
    owner, uses = {}, {}
    for o in objs:
        name = module_of(o[:-2], mods)
        defined, undefined = nm_symbols(os.path.join(objdir, o))
        for s in defined:
            owner.setdefault(s, name)
        uses.setdefault(name, set()).update(undefined)
    arrows = {name: {} for name in uses}
    for name, undefined in uses.items():
        for s in undefined:
            to = owner.get(s)
            if to is not None and to != name:
                arrows[name].setdefault(to, []).append(s)
    for name in arrows:
        for to in arrows[name]:
            arrows[name][to].sort()
    return arrows


def components(arrows):
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(arrows):
        if root in index:
            continue
        work = [(root, iter(sorted(arrows[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            pushed = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(arrows[w]))))
                    pushed = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if pushed:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build",
                    help="the build directory whose obj/daemon/*.o to read (default: build)")
    ap.add_argument("--max", type=int, default=2,
                    help="the most files a loop may hold before the exit status is 1 (default: 2)")
    args = ap.parse_args()

    srcdir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "daemon")
    mods = modules(srcdir)
    arrows = graph(os.path.join(args.build, "obj", "daemon"), mods)
    loops = sorted((c for c in components(arrows) if len(c) > 1),
                   key=lambda c: (-len(c), c))
    largest = max((len(c) for c in loops), default=1)
    for c in loops:
        members = set(c)
        print(f"loop of {len(c)}: {' '.join(c)}")
        for a in c:
            for b in sorted(arrows[a]):
                if b in members:
                    print(f"  {a} -> {b}: {' '.join(arrows[a][b])}")
    files = len(arrows)
    nloops = len(loops)
    print(f"callgraph: {files} modules in daemon/ ({', '.join(mods) or 'none'} of several "
          f"files each), {nloops} loop(s), the largest of {largest} (limit {args.max})")
    if largest > args.max:
        sys.stdout.flush()
        print(f"callgraph: FAIL: a loop of {largest} exceeds the limit of {args.max}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
