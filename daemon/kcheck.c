/*
 * kcheck.c — the kernel check at start, the driver's compile and load check
 * of the kernel cache, and what is lent at attach (kcheck.h).
 */
#include "kcheck.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cudadrv.h"
#include "kabi.h"
#include "kcache.h"
#include "kimage.h"
#include "log.h"

#define KCHECK_MAX_DEVS 64
#define KCHECK_MAX_ARCHS 8

/* Written by kcheck_run on the devices' worker thread, read on the loop after it. */
static struct {
  size_t n_devs;
  struct {
    uint8_t uuid[16];
    int entry; /* index into entries, -1: the fatbin's SASS serves it */
  } devs[KCHECK_MAX_DEVS];
  size_t n_entries;
  struct kcache_entry entries[KCHECK_MAX_ARCHS];
} kc;

static const char *const kcheck_kernels[] = {
#define KCHECK__NAME(name, sym) sym,
    CUOPS_KERNELS(KCHECK__NAME)
#undef KCHECK__NAME
};

/* The driver's JIT linker: the fatbin in, for the current context's GPU, a cubin out. */
static int kcheck_compile(void *arg, const struct kcache_key *k, const uint8_t *image, size_t len,
                          uint8_t **out, size_t *out_len, char *why, size_t whylen) {
  const struct cudadrv *cu = cudadrv_load(NULL, 0);
  const struct backend_dev *d = arg;
  char log[2048] = "";
  int opts[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void *vals[2] = {log, (void *)(uintptr_t)sizeof log};
  CUlinkState ls = NULL;
  void *cubin = NULL;
  size_t n = 0;
  CUresult r = cu->cuCtxSetCurrent((CUcontext)d->ctx);
  const char *step = "cuCtxSetCurrent";
  if (r == CUDA_SUCCESS && (r = cu->cuLinkCreate(2, opts, vals, &ls)) != CUDA_SUCCESS)
    step = "cuLinkCreate";
  if (r == CUDA_SUCCESS &&
      (r = cu->cuLinkAddData(ls, CU_JIT_INPUT_FATBINARY, (void *)(uintptr_t)image, len,
                             "deepep_kernels", 0, NULL, NULL)) != CUDA_SUCCESS)
    step = "cuLinkAddData";
  if (r == CUDA_SUCCESS && (r = cu->cuLinkComplete(ls, &cubin, &n)) != CUDA_SUCCESS)
    step = "cuLinkComplete";
  int rc = 0;
  if (r != CUDA_SUCCESS) {
    snprintf(why, whylen, "compiling the kernels' PTX for sm_%u: %s: %s%s%.900s", k->arch, step,
             cudadrv_errstr(r), log[0] ? ": " : "", log);
    rc = DEP_ERR_CUDA;
  } else if (n == 0 || n > DEP_KERNELS_MAX_BYTES || (*out = malloc(n)) == NULL) {
    snprintf(why, whylen, "the compiled kernels (%zu bytes) cannot be kept", n);
    rc = n == 0 || n > DEP_KERNELS_MAX_BYTES ? DEP_ERR_CUDA : DEP_ERR_NO_MEMORY;
  } else {
    memcpy(*out, cubin, n); /* the linker's buffer lives until cuLinkDestroy */
    *out_len = n;
  }
  if (ls != NULL)
    cu->cuLinkDestroy(ls);
  return rc;
}

/* The driver loads the cubin and finds every kernel of the library in it. */
static int kcheck_verify(void *arg, const uint8_t *cubin, size_t len, char *why, size_t whylen) {
  const struct cudadrv *cu = cudadrv_load(NULL, 0);
  const struct backend_dev *d = arg;
  CUmodule m = NULL;
  CUresult r = cu->cuCtxSetCurrent((CUcontext)d->ctx);
  if (r == CUDA_SUCCESS)
    r = cu->cuModuleLoadData(&m, cubin);
  if (r != CUDA_SUCCESS) {
    snprintf(why, whylen, "the driver does not load it (%zu bytes): %s", len, cudadrv_errstr(r));
    return DEP_ERR_CUDA;
  }
  int rc = 0;
  for (size_t i = 0; i < sizeof kcheck_kernels / sizeof kcheck_kernels[0] && rc == 0; i++) {
    CUfunction f;
    if ((r = cu->cuModuleGetFunction(&f, m, kcheck_kernels[i])) != CUDA_SUCCESS) {
      snprintf(why, whylen, "it lacks kernel %s: %s", kcheck_kernels[i], cudadrv_errstr(r));
      rc = DEP_ERR_CUDA;
    }
  }
  cu->cuModuleUnload(m);
  return rc;
}

/* The entry for one GPU needing a compile: an architecture's first GPU makes it. */
static int kcheck_entry(const struct config *c, const struct kimage *img, struct pool *p,
                        const struct kcache_key *k, bool *dir_ok, char *why, size_t whylen) {
  for (size_t i = 0; i < kc.n_entries; i++)
    if (kc.entries[i].key.arch == k->arch)
      return (int)i;
  if (kc.n_entries >= KCHECK_MAX_ARCHS) {
    snprintf(why, whylen, "more than %d GPU architectures to compile for", KCHECK_MAX_ARCHS);
    return DEP_ERR_INTERNAL;
  }
  const char *dir = c->kernel_cache_dir;
  if (dir[0] != '\0' && !*dir_ok) {
    int rc = kcache_check_dir(dir, geteuid(), why, whylen);
    if (rc != 0)
      return rc;
    *dir_ok = true;
  }
  struct kcache_jit jit = {.compile = kcheck_compile, .verify = kcheck_verify, .arg = &p->dev};
  struct kcache_entry *e = &kc.entries[kc.n_entries];
  char w[900] = "";
  int rc = kcache_get(dir, k, img, &jit, e, w, sizeof w);
  if (rc != 0) {
    snprintf(why, whylen, "device %s (%s, sm_%u): %s; the driver could not compile the library's "
             "kernels for it: check the driver (nvidia-smi) or rebuild the library with SASS "
             "for sm_%u in NVCC_GENCODE", p->dev.uuid_str, p->dev.name, k->arch, w, k->arch);
    return rc;
  }
  if (e->how == KCACHE_HIT)
    log_info("kernel cache: sm_%u: %llu-byte cubin from %s (driver %d, build %.16s)", k->arch,
             (unsigned long long)e->bytes, dir, (int)k->driver, k->build);
  else
    log_info("kernel cache: sm_%u: compiled the library's PTX in %.0f ms (%llu bytes; %s%s%s)",
             k->arch, e->compile_ms, (unsigned long long)e->bytes, kcache_how_name(e->how),
             dir[0] ? " in " : "", dir);
  return (int)kc.n_entries++;
}

int kcheck_run(const struct config *c, struct pool *pools, size_t n, char *why, size_t whylen) {
  struct kimage img;
  kc.n_devs = 0;
  if (!kimage_embedded(&img)) {
    log_info("kernels: this deepepd was built without nvcc: it has no kernels to check or "
             "cache (nor has the library built with it)");
    return 0;
  }
  const struct cudadrv *cu = cudadrv_load(why, whylen);
  if (cu == NULL)
    return DEP_ERR_CUDA;
  struct kcache_key k;
  memset(&k, 0, sizeof k);
  snprintf(k.build, sizeof k.build, "%s", img.id);
  CUresult r = cu->cuDriverGetVersion(&k.driver);
  if (r != CUDA_SUCCESS) {
    snprintf(why, whylen, "cuDriverGetVersion: %s", cudadrv_errstr(r));
    return DEP_ERR_CUDA;
  }
  bool dir_ok = false;
  for (size_t i = 0; i < n && i < KCHECK_MAX_DEVS; i++) {
    struct pool *p = &pools[i];
    int major = 0, minor = 0;
    if ((r = cu->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                      p->dev.ordinal)) != CUDA_SUCCESS ||
        (r = cu->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                      p->dev.ordinal)) != CUDA_SUCCESS) {
      snprintf(why, whylen, "device %s: its compute capability: %s", p->dev.uuid_str,
               cudadrv_errstr(r));
      return DEP_ERR_CUDA;
    }
    k.arch = (uint32_t)(major * 10 + minor);
    enum kimage_fit fit = kimage_fit(img.data, img.len, major, minor);
    memcpy(kc.devs[i].uuid, p->dev.uuid, 16);
    kc.devs[i].entry = -1;
    kc.n_devs = i + 1;
    if (fit == KIMAGE_SASS) {
      log_info("kernels: device %s (%s, sm_%u): the library's fatbin has SASS for it",
               p->dev.uuid_str, p->dev.name, k.arch);
      continue;
    }
    if (fit == KIMAGE_NONE) {
      snprintf(why, whylen, "device %s (%s, sm_%u): the library's kernels have no code for it "
               "(no SASS of its architecture, no PTX at or below it); rebuild with it in "
               "NVCC_GENCODE, or leave the GPU out of devices:", p->dev.uuid_str, p->dev.name,
               k.arch);
      return DEP_ERR_CONFIG;
    }
    int e = kcheck_entry(c, &img, p, &k, &dir_ok, why, whylen);
    if (e < 0)
      return e;
    kc.devs[i].entry = e;
    log_info("kernels: device %s (%s, sm_%u): the library's fatbin has %s for it; its "
             "processes are lent the daemon's compile", p->dev.uuid_str, p->dev.name, k.arch,
             kimage_fit_name(fit));
  }
  return 0;
}

int kcheck_lend(const uint8_t uuid[16], struct dep_msg_kernels_ok *m, int *fd, char *why,
                size_t whylen) {
  for (size_t i = 0; i < kc.n_devs; i++) {
    if (memcmp(kc.devs[i].uuid, uuid, 16) != 0)
      continue;
    if (kc.devs[i].entry < 0) {
      snprintf(why, whylen, "deepepd has no kernels to lend for this GPU: the library's fatbin has "
               "SASS for it");
      return DEP_ERR_NOT_FOUND;
    }
    const struct kcache_entry *e = &kc.entries[kc.devs[i].entry];
    memset(m, 0, sizeof *m);
    m->arch = e->key.arch;
    m->driver = e->key.driver;
    snprintf(m->build, sizeof m->build, "%s", e->key.build);
    m->bytes = e->bytes;
    *fd = e->fd;
    return 0;
  }
  snprintf(why, whylen, "deepepd has no kernels to lend for this GPU (it does not serve it on the "
           "cuda backend); load the library's own");
  return DEP_ERR_NOT_FOUND;
}

void kcheck_fini(void) {
  for (size_t i = 0; i < kc.n_entries; i++)
    kcache_entry_close(&kc.entries[i]);
  kc.n_entries = 0;
  kc.n_devs = 0;
}
