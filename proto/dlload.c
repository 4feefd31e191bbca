/*
 * dlload.c — open a library and resolve a table of its symbols (dlload.h).
 */
#include "dlload.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

/* Function pointers and void * share one representation on every platform with dlsym (POSIX
 * requires it); the address is copied, not cast, into the table's function pointer. */
static void put(void *at, void *p) { memcpy(at, &p, sizeof p); }

int dep__dl_load(const char *path, const struct dep_dlsym *syms, size_t n, void **handle,
                char *why, size_t whylen) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    const char *e = dlerror();
    snprintf(why, whylen, "%s", e != NULL ? e : path);
    return DEP_DL_NO_LIBRARY;
  }
  for (size_t i = 0; i < n; i++) {
    const struct dep_dlsym *s = &syms[i];
    void *p = s->version != NULL ? dlvsym(h, s->name, s->version) : dlsym(h, s->name);
    put(s->at, p);
    if (p != NULL || s->optional)
      continue;
    snprintf(why, whylen, "%s lacks %s%s%s", path, s->name, s->version != NULL ? "@" : "",
             s->version != NULL ? s->version : "");
    /* Nothing of a library that failed stays reachable through the table. */
    for (size_t j = 0; j < n; j++)
      put(syms[j].at, NULL);
    dlclose(h);
    return DEP_DL_NO_SYMBOL;
  }
  *handle = h;
  return DEP_DL_OK;
}
