"""ceiling.py — what tools/longfuncs.py and tools/longfiles.py share: their
options, and the report of what is longer than a ceiling (or than the bound
an entry of HELD keeps it at), longest first.

Python 3 standard library only.
"""

import argparse
import sys


def options(doc, what, show, ceiling):
    """The command line both tools take: --root, --show and --max for `what` ("function")."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--root", default=".", help="the tree's top (default .)")
    ap.add_argument("--show", type=int, default=show,
                    help="print %ss longer than this (default %d)" % (what, show))
    ap.add_argument("--max", type=int, default=ceiling,
                    help="exit 1 when a %s is longer than this (default %d), "
                    "or one in HELD longer than its own bound" % (what, ceiling))
    return ap.parse_args()


def report(found, held, args, tool, advice):
    """Print found ((length, key, text), longest first) past args.show, each
    held one with its bound; 1 (saying advice) when one is over its bound."""
    over = 0
    for length, key, text in found:
        if length <= args.show:
            break
        bound = held.get(key, args.max)
        mark = ""
        if length > bound:
            mark = "  (over %d)" % bound
            over += 1
        elif bound != args.max:
            mark = "  (held at %d)" % bound
        print("%5d  %s%s" % (length, text, mark))
    if over:
        print("%s: %d over their bound: %s" % (tool, over, advice), file=sys.stderr)
        return 1
    return 0
