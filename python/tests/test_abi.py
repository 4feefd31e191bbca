"""The ctypes structs of deepep/_lib.py are deepep.h's: a C program compiled here from the
header prints each struct's size and each field's offset, which must equal ctypes'."""
import ctypes
import os
import shutil
import subprocess

import pytest

from deepep import _lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER_DIR = os.path.join(ROOT, "include")
MAP = os.path.join(ROOT, "client", "libdeepep-client.map")


def test_every_struct_has_the_c_layout(tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc) to compile deepep.h with")
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "deepep.h"',
             "int main(void) {"]
    for cname, cls in _lib.STRUCTS.items():
        lines.append(f'  printf("{cname} size %zu\\n", sizeof(struct {cname}));')
        for field, _ in cls._fields_:
            lines.append(f'  printf("{cname}.{field} %zu\\n", offsetof(struct {cname}, {field}));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "abi.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "abi"
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", HEADER_DIR, "-o", str(exe),
                    str(src)], check=True)
    got = dict(line.rsplit(" ", 1) for line in
               subprocess.run([str(exe)], check=True, capture_output=True, text=True)
               .stdout.splitlines())
    want = {}
    for cname, cls in _lib.STRUCTS.items():
        want[f"{cname} size"] = str(ctypes.sizeof(cls))
        for field, _ in cls._fields_:
            want[f"{cname}.{field}"] = str(getattr(cls, field).offset)
    assert want == got


def test_every_c_struct_of_the_header_is_mirrored():
    text = open(os.path.join(HEADER_DIR, "deepep.h")).read()
    import re
    declared = set(re.findall(r"^struct (dep_\w+) \{", text, re.M))
    assert declared == set(_lib.STRUCTS), "deepep.h and deepep/_lib.py declare different structs"


def _map_globals():
    text = open(MAP).read()
    body = text.split("global:", 1)[1].split("local:", 1)[0]
    import re
    return sorted(re.findall(r"\b(dep_\w+);", body))


def test_the_version_script_exports_exactly_the_headers_functions():
    import re
    text = open(os.path.join(HEADER_DIR, "deepep.h")).read()
    declared = sorted(set(re.findall(r"DEP_EXPORT[^;(]*?\b(dep_\w+)\(", text, re.S)))
    assert declared and _map_globals() == declared, \
        "client/libdeepep-client.map's global list and deepep.h's DEP_EXPORT functions differ"


def test_the_library_exports_only_the_version_scripts_symbols():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) to list the library's dynamic symbols")
    lib = os.environ.get(_lib.LIB_ENV)
    if not lib or not os.path.exists(lib):
        pytest.skip(f"${_lib.LIB_ENV} names no built library")
    out = subprocess.run([nm, "-D", "--defined-only", lib], check=True, capture_output=True,
                         text=True).stdout.split("\n")
    names = sorted({line.split()[-1].split("@")[0] for line in out
                    if line.strip() and line.split()[1] in "TtDdBbRrWwVv"
                    and line.split()[-1] != "DEEPEP_0"})
    assert names == _map_globals()


def test_no_internal_symbol_is_in_the_public_namespace():
    """STYLE.md: dep_ is the public API's prefix; internal globals are dep__ (or static).
    Every global the static library defines with dep_ (not dep__) is one the map exports."""
    nm = shutil.which("nm")
    lib = os.environ.get(_lib.LIB_ENV)
    archive = os.path.join(os.path.dirname(lib or ""), "libdeepep-client.a")
    if nm is None or not os.path.exists(archive):
        pytest.skip("no nm (binutils), or no libdeepep-client.a beside $" + _lib.LIB_ENV)
    out = subprocess.run([nm, "-g", "--defined-only", archive], check=True,
                         capture_output=True, text=True).stdout.split("\n")
    names = {line.split()[-1] for line in out if len(line.split()) == 3}
    public = {n for n in names if n.startswith("dep_") and not n.startswith("dep__")}
    assert public == set(_map_globals())
