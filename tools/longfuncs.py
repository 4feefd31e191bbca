#!/usr/bin/env python3
"""longfuncs.py — the tree's longest functions, and a ceiling on their length.

STYLE: "a function is one step; past ~80 lines it is usually a sequence of
steps that want names".  This prints every function of the shipped C, CUDA
and Python code longer than --show lines (default 80), longest first, as
"LINES  FILE:LINE  NAME", and exits 1 when one is longer than --max (default
MAX_LINES), so CI holds the tree to the ceiling and a new long function is
seen when it lands rather than at the next review.  The few functions in
HELD are held to their length now instead (they may shrink, not grow): the
CUDA kernels, whose split needs a GPU to check the fatbin's behaviour.

A function's length is counted from the line that names it (the line of
"name(" in C, of "def" in Python; a C return type on the line above is not
counted) through the line of its closing brace or last statement, comments
and blank lines included: a reader has to get past those too.

C and CUDA are read with a brace counter rather than a parser: comments,
string and character literals and preprocessor lines are blanked first, then
a "{" at depth 0 whose header (the text since the last ";" or "}" at depth 0)
holds a "(" and is not a struct, union, enum or initialiser opens a function.
"extern "C" {" and "namespace {" are transparent.  Python is read with ast.

Python 3 standard library only, so CI needs nothing more than python3.
"""

import ast
import os
import re
import sys

import ceiling

C_DIRS = ["daemon", "client", "kernels", "proto", "config", "render", "cuda",
          "include"]
C_EXTS = (".c", ".h", ".cu", ".cuh")
PY_DIRS = ["python/deepep", "python/deep_ep_compat"]

# The ceiling: STYLE's "~80 lines", with room for a docstring that lists every
# argument (Buffer.dispatch's is 45 lines of its 87).
MAX_LINES = 90

# (file, function) -> the most lines it may have, for those over MAX_LINES
# that are not split yet, each with why.
HELD = {
    # Device code: a split must be checked on a GPU (the fatbin's behaviour and
    # registers), which this tree's checks cannot do without one.
    ("kernels/ops_ll.cuh", "ll_dispatch_recv"): 112,
    ("kernels/ops_tp.cuh", "dispatch_send"): 103,
    ("kernels/ops_tp.cuh", "dispatch_recv"): 96,
}

# Headers at depth 0 that open a block which is not a function body.
NOT_FUNCTION = re.compile(r"\b(struct|union|enum|class)\b[^()]*$|=\s*$")
TRANSPARENT = re.compile(r'^\s*(extern\s+"C"|namespace(\s+\w+)?)\s*$')
NAME_BEFORE_PAREN = re.compile(r"([A-Za-z_][\w:~]*)\s*$")


def blank_c(text):
    """Return text with comments, literals and preprocessor lines replaced
    by spaces, newlines kept, so braces inside them are not counted and
    line numbers stay those of the file."""
    out = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if at_line_start and c == "#":
            # A preprocessor line, with its backslash continuations.
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        at_line_start = False
        if c == "\n":
            out.append(c)
            at_line_start = True
            i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + re.sub(r"[^\n]", " ", text[i + 1:j - 1]) + c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def c_functions(path):
    """Yield (name, first line, last line) of each function defined in a
    C or CUDA file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = blank_c(f.read())
    depth = 0           # brace depth counting transparent blocks out
    header = []         # text since the last ";" or "}" at depth 0
    header_lines = []   # the line of each character of header
    open_fn = None      # (name, first line) of the function being read
    transparent = 0     # open transparent blocks
    line = 1
    for c in text:
        if c == "\n":
            line += 1
        if depth == 0 and open_fn is None:
            if c == "{":
                h = "".join(header)
                if TRANSPARENT.match(h):
                    transparent += 1
                elif "(" in h and not NOT_FUNCTION.search(h):
                    paren = h.index("(")
                    m = NAME_BEFORE_PAREN.search(h[:paren])
                    name = m.group(1) if m else "?"
                    first = header_lines[h.rfind(name, 0, paren)] if m else line
                    open_fn = (name, first)
                    depth = 1
                else:
                    depth = 1
                header, header_lines = [], []
            elif c == "}" and transparent:
                transparent -= 1
                header, header_lines = [], []
            elif c == ";":
                header, header_lines = [], []
            else:
                header.append(c)
                header_lines.append(line)
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                if open_fn is not None:
                    yield open_fn[0], open_fn[1], line
                    open_fn = None
                header, header_lines = [], []


def py_functions(path):
    """Yield (qualified name, first line, last line) of each function and
    method of a Python file, nested ones included."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield name, child.lineno, child.end_lineno
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def sources(root, dirs, exts):
    for d in dirs:
        top = os.path.join(root, d)
        for base, _, files in os.walk(top):
            for f in sorted(files):
                if f.endswith(exts):
                    yield os.path.join(base, f)


def main():
    args = ceiling.options(__doc__, "function", 80, MAX_LINES)

    found = []
    for path in sources(args.root, C_DIRS, C_EXTS):
        for name, first, last in c_functions(path):
            found.append((last - first + 1, os.path.relpath(path, args.root),
                          first, name))
    for path in sources(args.root, PY_DIRS, (".py",)):
        for name, first, last in py_functions(path):
            found.append((last - first + 1, os.path.relpath(path, args.root),
                          first, name))
    found.sort(key=lambda r: (-r[0], r[1], r[2]))
    return ceiling.report([(n, (path, name), "%s:%d  %s" % (path, first, name))
                           for n, path, first, name in found], HELD, args, "longfuncs",
                          "split them into named steps")


if __name__ == "__main__":
    sys.exit(main())
