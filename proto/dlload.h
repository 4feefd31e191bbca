/*
 * dlload.h — the one shape of the run-time seams to shared libraries that
 * deepepd and libdeepep-client reach with dlopen rather than link (the CUDA
 * driver, cuda/cudadrv.c; libibverbs and librdmacm, daemon/rdmadrv.c):
 * a table of symbol names and where their addresses go, and one function
 * that opens the library, resolves every row and says which symbol is
 * missing.  Each seam keeps its own words around that (which package to
 * install, "driver too old?").
 */
#ifndef DEP_PROTO_DLLOAD_H
#define DEP_PROTO_DLLOAD_H

#include <stdbool.h>
#include <stddef.h>

struct dep_dlsym {
  const char *name;    /* the symbol */
  const char *version; /* its version (dlvsym), or NULL: the default one (dlsym) */
  void *at;            /* where its address is stored: the address of a function pointer */
  bool optional;       /* absent: NULL at `at`, and no failure */
};

enum dep_dl_rc {
  DEP_DL_OK = 0,
  DEP_DL_NO_LIBRARY = -1, /* dlopen failed: why is dlerror's text */
  DEP_DL_NO_SYMBOL = -2,  /* a required row is absent: why is "PATH lacks SYMBOL[@VERSION]" */
};

/*
 * dlopen(path, RTLD_NOW | RTLD_LOCAL), then resolve syms[0..n) into their `at`.  DEP_DL_OK with
 * *handle set (the library stays loaded for as long as its pointers are used: for good);
 * otherwise an enum dep_dl_rc with why (whylen bytes) saying what failed, every `at` of the
 * table NULL and the library closed again.
 */
int dep__dl_load(const char *path, const struct dep_dlsym *syms, size_t n, void **handle,
                char *why, size_t whylen);

#endif /* DEP_PROTO_DLLOAD_H */
