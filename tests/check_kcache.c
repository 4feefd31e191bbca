/*
 * check_kcache.c — the daemon's kernel cache (daemon/kcache.c, kcheck.c) and
 * the fatbin reader (cuda/kimage.c): entries keyed by architecture,
 * driver and build, their checksum, corrupt, refused and stale entries
 * rebuilt or removed, the directory's ownership and permissions, and the
 * sealed memfd an entry is lent as.  The compile and the driver's check are
 * a fake here (struct kcache_jit): it makes bytes that depend on the key
 * and counts its calls, and refuses cubins that begin with "OLD".  Tagged
 * "gpu": the real compile through the driver's JIT linker, lent to a rank
 * process at attach, with a library built PTX_ONLY=90 (make check-gpu).
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client_internal.h"
#include "clienttest.h"
#include "codec.h"
#include "cudaranks.h"
#include "deepep_daemon.h"
#include "kcache.h"
#include "kimage.h"
#include "testutil.h"

#define BUILD_A "aaaaaaaaaaaaaaaa1111111111111111aaaaaaaaaaaaaaaa1111111111111111"
#define BUILD_B "bbbbbbbbbbbbbbbb2222222222222222bbbbbbbbbbbbbbbb2222222222222222"

static int compiles;  /* calls of fake_compile */
static int fail_compile;

static int fake_compile(void *arg, const struct kcache_key *k, const uint8_t *image, size_t len,
                        uint8_t **out, size_t *out_len, char *why, size_t whylen) {
  compiles++;
  if (fail_compile) {
    snprintf(why, whylen, "ptxas died on purpose");
    return DEP_ERR_CUDA;
  }
  char text[160];
  int n = snprintf(text, sizeof text, "CUBIN for sm_%u driver %d build %.16s from %zu bytes",
                   k->arch, k->driver, k->build, len);
  *out = malloc((size_t)n);
  memcpy(*out, text, (size_t)n);
  *out_len = (size_t)n;
  return 0;
}

static int fake_verify(void *arg, const uint8_t *cubin, size_t len, char *why, size_t whylen) {
  if (len >= 3 && memcmp(cubin, "OLD", 3) == 0) {
    snprintf(why, whylen, "the driver does not load it");
    return DEP_ERR_CUDA;
  }
  return 0;
}

static const struct kcache_jit fake_jit = {fake_compile, fake_verify, NULL};
static const uint8_t image_bytes[64] = {1, 2, 3};
static const struct kimage image = {image_bytes, sizeof image_bytes, BUILD_A};

static struct kcache_key key(uint32_t arch, int32_t driver, const char *build) {
  struct kcache_key k;
  memset(&k, 0, sizeof k);
  k.arch = arch;
  k.driver = driver;
  snprintf(k.build, sizeof k.build, "%s", build);
  return k;
}

static void cache_dir(char *dir, size_t len) {
  tu_tmpdir(dir, len);
  ck_assert_int_eq(chmod(dir, 0755), 0);
}

/* The whole file (a real cubin is some 280 KB), in a buffer that lives until the next call. */
static uint8_t *slurp(const char *path, size_t *len) {
  static uint8_t *buf;
  FILE *f = fopen(path, "rb");
  ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
  struct stat st;
  ck_assert_int_eq(fstat(fileno(f), &st), 0);
  free(buf);
  buf = malloc((size_t)st.st_size + 1);
  ck_assert(buf != NULL);
  *len = fread(buf, 1, (size_t)st.st_size, f);
  ck_assert_uint_eq(*len, (size_t)st.st_size);
  fclose(f);
  return buf;
}

static void spit(const char *path, const uint8_t *p, size_t len) {
  FILE *f = fopen(path, "wb");
  ck_assert(f != NULL);
  ck_assert_uint_eq(fwrite(p, 1, len, f), len);
  fclose(f);
}

static void entry_path(const char *dir, const struct kcache_key *k, char *out, size_t len) {
  char name[128];
  kcache_entry_name(k, name, sizeof name);
  snprintf(out, len, "%s/%s", dir, name);
}

/* ---- keys and the entry format ----------------------------------------------------------- */

START_TEST(an_entry_is_named_and_checked_by_architecture_driver_and_build) {
  struct kcache_key a = key(90, 13000, BUILD_A), drv = key(90, 13010, BUILD_A),
                    arch = key(100, 13000, BUILD_A), build = key(90, 13000, BUILD_B);
  char na[128], nb[128];
  kcache_entry_name(&a, na, sizeof na);
  ck_assert_str_eq(na, "sm_90-drv13000-aaaaaaaaaaaaaaaa.kcache");
  const struct kcache_key *others[] = {&drv, &arch, &build};
  uint8_t *f;
  size_t flen;
  const uint8_t *cubin;
  size_t clen;
  char why[256];
  ck_assert_int_eq(kcache_encode(&a, (const uint8_t *)"CUBIN", 5, &f, &flen), 0);
  ck_assert_uint_eq(flen, KCACHE_HDR_LEN + 5);
  ck_assert_int_eq(kcache_decode(&a, f, flen, &cubin, &clen, why, sizeof why), 0);
  ck_assert_uint_eq(clen, 5);
  ck_assert_int_eq(memcmp(cubin, "CUBIN", 5), 0);
  for (size_t i = 0; i < 3; i++) {
    kcache_entry_name(others[i], nb, sizeof nb);
    ck_assert_str_ne(na, nb);
    ck_assert_int_eq(kcache_decode(others[i], f, flen, &cubin, &clen, why, sizeof why),
                     DEP_ERR_PROTOCOL);
    ck_assert_msg(strstr(why, "not the sm_") != NULL, "said: %s", why);
  }
  free(f);
}
END_TEST

START_TEST(a_damaged_entry_fails_its_checksum_or_its_length) {
  struct kcache_key a = key(90, 13000, BUILD_A);
  uint8_t *f;
  size_t flen, clen;
  const uint8_t *cubin;
  char why[256];
  ck_assert_int_eq(kcache_encode(&a, (const uint8_t *)"CUBIN-BYTES", 11, &f, &flen), 0);
  f[KCACHE_HDR_LEN + 3] ^= 0x40; /* one bit of the cubin */
  ck_assert_int_eq(kcache_decode(&a, f, flen, &cubin, &clen, why, sizeof why), DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "checksum") != NULL, "said: %s", why);
  f[KCACHE_HDR_LEN + 3] ^= 0x40;
  f[20] = 1; /* the reserved word, covered by the checksum too */
  ck_assert_int_eq(kcache_decode(&a, f, flen, &cubin, &clen, why, sizeof why), DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "checksum") != NULL, "said: %s", why);
  f[20] = 0;
  ck_assert_int_eq(kcache_decode(&a, f, flen - 1, &cubin, &clen, why, sizeof why),
                   DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "the file holds 10") != NULL, "said: %s", why);
  ck_assert_int_eq(kcache_decode(&a, f, 40, &cubin, &clen, why, sizeof why), DEP_ERR_PROTOCOL);
  ck_assert_msg(strstr(why, "no header") != NULL, "said: %s", why);
  ck_assert_int_eq(kcache_decode(&a, f, flen, &cubin, &clen, why, sizeof why), 0);
  free(f);
}
END_TEST

/* ---- getting an entry: compiled once, then read back ------------------------------------ */

static void assert_lent(const struct kcache_entry *e, const struct kcache_key *k) {
  char want[160];
  int n = snprintf(want, sizeof want, "CUBIN for sm_%u driver %d build %.16s from %zu bytes",
                   k->arch, k->driver, k->build, sizeof image_bytes);
  ck_assert_uint_eq(e->bytes, (uint64_t)n);
  struct stat st;
  ck_assert_int_eq(fstat(e->fd, &st), 0);
  ck_assert_int_eq(st.st_size, n);
  char got[160] = "";
  ck_assert_int_eq(pread(e->fd, got, sizeof got, 0), n);
  ck_assert_int_eq(memcmp(got, want, (size_t)n), 0);
  /* Sealed: a client cannot change what the next one loads. */
  int seals = fcntl(e->fd, F_GET_SEALS);
  ck_assert_int_eq(seals & (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
                   F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  ck_assert_int_lt(pwrite(e->fd, "X", 1, 0), 0);
  ck_assert(mmap(NULL, (size_t)n, PROT_READ | PROT_WRITE, MAP_SHARED, e->fd, 0) == MAP_FAILED);
}

START_TEST(the_cubin_is_compiled_once_then_read_from_the_cache) {
  char dir[256], why[256] = "";
  cache_dir(dir, sizeof dir);
  struct kcache_key k = key(90, 13000, BUILD_A);
  struct kcache_entry e;
  compiles = 0;
  ck_assert_int_eq(kcache_get(dir, &k, &image, &fake_jit, &e, why, sizeof why), 0);
  ck_assert_int_eq(e.how, KCACHE_BUILT);
  ck_assert_int_eq(compiles, 1);
  assert_lent(&e, &k);
  kcache_entry_close(&e);
  char path[512];
  entry_path(dir, &k, path, sizeof path);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0644);
  /* A restart: read back, checked, not compiled. */
  ck_assert_int_eq(kcache_get(dir, &k, &image, &fake_jit, &e, why, sizeof why), 0);
  ck_assert_int_eq(e.how, KCACHE_HIT);
  ck_assert_int_eq(compiles, 1);
  assert_lent(&e, &k);
  kcache_entry_close(&e);
  /* No directory: compiled at every start, lent all the same. */
  ck_assert_int_eq(kcache_get("", &k, &image, &fake_jit, &e, why, sizeof why), 0);
  ck_assert_int_eq(e.how, KCACHE_NOSTORE);
  ck_assert_int_eq(compiles, 2);
  assert_lent(&e, &k);
  kcache_entry_close(&e);
  tu_rmtree(dir);
}
END_TEST

START_TEST(a_corrupt_or_refused_entry_is_rebuilt) {
  char dir[256], why[256] = "", path[512];
  cache_dir(dir, sizeof dir);
  struct kcache_key k = key(90, 13000, BUILD_A);
  struct kcache_entry e;
  compiles = 0;
  ck_assert_int_eq(kcache_get(dir, &k, &image, &fake_jit, &e, why, sizeof why), 0);
  kcache_entry_close(&e);
  entry_path(dir, &k, path, sizeof path);
  size_t len;
  uint8_t *f = slurp(path, &len);
  f[len - 1] ^= 1; /* the cubin's last byte */
  spit(path, f, len);
  ck_assert_int_eq(kcache_get(dir, &k, &image, &fake_jit, &e, why, sizeof why), 0);
  ck_assert_int_eq(e.how, KCACHE_REBUILT);
  ck_assert_msg(strstr(e.why, "checksum") != NULL, "said: %s", e.why);
  ck_assert_int_eq(compiles, 2);
  assert_lent(&e, &k);
  kcache_entry_close(&e);
  /* The file is whole again: the next start reads it. */
  const uint8_t *cubin;
  size_t clen;
  f = slurp(path, &len);
  ck_assert_int_eq(kcache_decode(&k, f, len, &cubin, &clen, why, sizeof why), 0);
  /* Cut short: rebuilt. */
  spit(path, f, len / 2);
  ck_assert_int_eq(kcache_get(dir, &k, &image, &fake_jit, &e, why, sizeof why), 0);
  ck_assert_int_eq(e.how, KCACHE_REBUILT);
  kcache_entry_close(&e);
  /* Whole and checksummed, but the driver refuses it: rebuilt. */
  uint8_t *old;
  size_t olen;
  ck_assert_int_eq(kcache_encode(&k, (const uint8_t *)"OLD cubin", 9, &old, &olen), 0);
  spit(path, old, olen);
  free(old);
  ck_assert_int_eq(kcache_get(dir, &k, &image, &fake_jit, &e, why, sizeof why), 0);
  ck_assert_int_eq(e.how, KCACHE_REBUILT);
  ck_assert_msg(strstr(e.why, "does not load") != NULL, "said: %s", e.why);
  ck_assert_int_eq(compiles, 4);
  assert_lent(&e, &k);
  kcache_entry_close(&e);
  tu_rmtree(dir);
}
END_TEST

static bool exists(const char *dir, const struct kcache_key *k) {
  char path[512];
  entry_path(dir, k, path, sizeof path);
  return access(path, F_OK) == 0;
}

START_TEST(entries_of_another_driver_or_build_are_removed_as_stale) {
  char dir[256], why[256] = "";
  cache_dir(dir, sizeof dir);
  struct kcache_key old_drv = key(90, 12080, BUILD_A), old_build = key(90, 13000, BUILD_B),
                    other_arch = key(100, 12080, BUILD_A), now = key(90, 13000, BUILD_A);
  const struct kcache_key *made[] = {&old_drv, &old_build, &other_arch};
  struct kcache_entry e;
  for (size_t i = 0; i < 3; i++) {
    ck_assert_int_eq(kcache_get(dir, made[i], &image, &fake_jit, &e, why, sizeof why), 0);
    kcache_entry_close(&e);
  }
  /* Each start keeps only its own key of an architecture. */
  ck_assert(!exists(dir, &old_drv));
  ck_assert(exists(dir, &old_build) && exists(dir, &other_arch));
  compiles = 0;
  ck_assert_int_eq(kcache_get(dir, &now, &image, &fake_jit, &e, why, sizeof why), 0);
  ck_assert_int_eq(e.how, KCACHE_BUILT);
  ck_assert_int_eq(compiles, 1);
  kcache_entry_close(&e);
  ck_assert(exists(dir, &now) && exists(dir, &other_arch));
  ck_assert(!exists(dir, &old_build) && !exists(dir, &old_drv));
  tu_rmtree(dir);
}
END_TEST

START_TEST(a_failed_compile_is_an_error_and_stores_nothing) {
  char dir[256], why[256] = "";
  cache_dir(dir, sizeof dir);
  struct kcache_key k = key(90, 13000, BUILD_A);
  struct kcache_entry e;
  fail_compile = 1;
  ck_assert_int_eq(kcache_get(dir, &k, &image, &fake_jit, &e, why, sizeof why), DEP_ERR_CUDA);
  fail_compile = 0;
  ck_assert_msg(strstr(why, "ptxas died") != NULL, "said: %s", why);
  ck_assert_int_eq(e.fd, -1);
  ck_assert(!exists(dir, &k));
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *de; (de = readdir(d)) != NULL;)
    n += de->d_name[0] != '.' || (strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0);
  closedir(d);
  ck_assert_int_eq(n, 0); /* no temporary file left either */
  tu_rmtree(dir);
}
END_TEST

/* ---- the directory ----------------------------------------------------------------------- */

START_TEST(the_cache_directory_is_made_and_must_be_writable_by_deepepd_alone) {
  char top[256], dir[300], why[512] = "";
  tu_tmpdir(top, sizeof top);
  snprintf(dir, sizeof dir, "%s/cache", top);
  ck_assert_int_eq(kcache_check_dir(dir, geteuid(), why, sizeof why), 0);
  struct stat st;
  ck_assert_int_eq(stat(dir, &st), 0);
  ck_assert(S_ISDIR(st.st_mode));
  ck_assert_int_eq(chmod(dir, 0777), 0);
  ck_assert_int_eq(kcache_check_dir(dir, geteuid(), why, sizeof why), DEP_ERR_CONFIG);
  ck_assert_msg(strstr(why, "writable by every user (mode 0777)") != NULL &&
                    strstr(why, "chmod go-w") != NULL, "said: %s", why);
  ck_assert_int_eq(chmod(dir, 0775), 0);
  ck_assert_int_eq(kcache_check_dir(dir, geteuid(), why, sizeof why), DEP_ERR_CONFIG);
  ck_assert_msg(strstr(why, "writable by its group") != NULL, "said: %s", why);
  ck_assert_int_eq(chmod(dir, 0700), 0);
  ck_assert_int_eq(kcache_check_dir(dir, geteuid(), why, sizeof why), 0);
  /* Another owner: deepepd's user is told apart from the directory's. */
  if (geteuid() == 0) {
    ck_assert_int_eq(chown(dir, 65534, 65534), 0);
    ck_assert_int_eq(kcache_check_dir(dir, 65534, why, sizeof why), 0);
    ck_assert_int_eq(kcache_check_dir(dir, 0, why, sizeof why), DEP_ERR_CONFIG);
    ck_assert_msg(strstr(why, "owned by uid 65534") != NULL && strstr(why, "chown 0") != NULL,
                  "said: %s", why);
    ck_assert_int_eq(chown(dir, 0, 0), 0); /* root's is fine for any deepepd user */
    ck_assert_int_eq(kcache_check_dir(dir, 65534, why, sizeof why), 0);
  } else {
    ck_assert_int_eq(kcache_check_dir(dir, geteuid() + 1, why, sizeof why), DEP_ERR_CONFIG);
    ck_assert_msg(strstr(why, "neither deepepd's user") != NULL, "said: %s", why);
  }
  char file[320];
  snprintf(file, sizeof file, "%s/plain", top);
  ck_assert_int_eq(tu_write_file(file, "x"), 0);
  ck_assert_int_eq(kcache_check_dir(file, geteuid(), why, sizeof why), DEP_ERR_CONFIG);
  ck_assert_msg(strstr(why, "is not a directory") != NULL, "said: %s", why);
  snprintf(file, sizeof file, "%s/no/such", top);
  ck_assert_int_eq(kcache_check_dir(file, geteuid(), why, sizeof why), DEP_ERR_CONFIG);
  ck_assert_msg(strstr(why, "cannot be made") != NULL, "said: %s", why);
  tu_rmtree(top);
}
END_TEST

/* ---- what a fatbin holds ----------------------------------------------------------------- */

/* A fatbin of entries {kind, arch} as nvcc lays it out (kimage.c). */
static size_t fatbin(uint8_t *out, const int (*e)[2], int n) {
  size_t off = 16;
  for (int i = 0; i < n; i++) {
    uint8_t *h = out + off;
    memset(h, 0, 64 + 8);
    codec_put_u16(h, (uint16_t)e[i][0]);
    codec_put_u16(h + 2, 0x101);
    codec_put_u32(h + 4, 64);
    codec_put_u64(h + 8, 8);
    codec_put_u32(h + 28, (uint32_t)e[i][1]);
    off += 64 + 8;
  }
  codec_put_u32(out, 0xBA55ED50u);
  codec_put_u16(out + 4, 1);
  codec_put_u16(out + 6, 16);
  codec_put_u64(out + 8, off - 16);
  return off;
}

START_TEST(the_fatbin_reader_tells_sass_from_ptx_only) {
  uint8_t img[1024];
  const int entries[][2] = {{2, 80}, {2, 90}, {1, 100}};
  size_t len = fatbin(img, entries, 3);
  ck_assert_int_eq(kimage_fit(img, len, 8, 0), KIMAGE_SASS);
  ck_assert_int_eq(kimage_fit(img, len, 8, 6), KIMAGE_SASS);   /* sm_80 runs on 8.6 */
  ck_assert_int_eq(kimage_fit(img, len, 9, 0), KIMAGE_SASS);
  ck_assert_int_eq(kimage_fit(img, len, 10, 0), KIMAGE_PTX_ONLY);
  ck_assert_int_eq(kimage_fit(img, len, 12, 0), KIMAGE_PTX_ONLY); /* newer than the build */
  ck_assert_int_eq(kimage_fit(img, len, 7, 5), KIMAGE_NONE);
  const int ptx90[][2] = {{1, 90}};
  len = fatbin(img, ptx90, 1);
  ck_assert_int_eq(kimage_fit(img, len, 9, 0), KIMAGE_PTX_ONLY);
  ck_assert_int_eq(kimage_fit(img, len, 8, 0), KIMAGE_NONE);
  /* Whatever it cannot read is left to the driver, never read past. */
  ck_assert_int_eq(kimage_fit(img, len - 1, 9, 0), KIMAGE_UNKNOWN);
  ck_assert_int_eq(kimage_fit(img, 10, 9, 0), KIMAGE_UNKNOWN);
  img[0] ^= 1;
  ck_assert_int_eq(kimage_fit(img, len, 9, 0), KIMAGE_UNKNOWN);
  img[0] ^= 1;
  codec_put_u64(img + 16 + 8, 1u << 30); /* an entry longer than the image */
  ck_assert_int_eq(kimage_fit(img, len, 9, 0), KIMAGE_UNKNOWN);
  /* This build's own image, where it has one: a build id, and readable. */
  struct kimage own;
  if (!kimage_embedded(&own)) {
    tu_skip_part(__func__, "built without nvcc: no embedded image to read");
    return;
  }
  ck_assert_uint_eq(strlen(own.id), KIMAGE_ID_LEN);
  ck_assert_uint_eq(strspn(own.id, "0123456789abcdef"), KIMAGE_ID_LEN);
  ck_assert_int_ne(kimage_fit(own.data, own.len, 9, 0), KIMAGE_UNKNOWN);
}
END_TEST

/*
 * Every kernel the library and the daemon's check look up by name (kabi.h
 * CUOPS_KERNELS) is in this build's image under that name: the four a
 * profiler times by their mangled C++ names (deepepd::dispatch, ...), which
 * a change of their argument types would change, the rest by their C names.
 * No GPU needed: the names are in the image's bytes.
 */
START_TEST(every_kernel_the_library_looks_up_is_named_in_the_image) {
  struct kimage own;
  if (!kimage_embedded(&own)) {
    tu_skip(__func__, "built without nvcc: no embedded image to read");
    return;
  }
#define KCT_NAME(id, name) name,
  static const char *const names[] = {CUOPS_KERNELS(KCT_NAME)};
#undef KCT_NAME
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    ck_assert_msg(memmem(own.data, own.len, names[i], strlen(names[i]) + 1) != NULL,
                  "kernel %s is not in the image", names[i]);
  /* The timed ones hold DeepEP's "::dispatch" / "::combine" when demangled: namespaced. */
  ck_assert_ptr_nonnull(strstr(names[1], "_ZN7deepepd8dispatch"));
  ck_assert_ptr_nonnull(strstr(names[4], "_ZN7deepepd2ll7combine"));
}
END_TEST

/* ---- KERNELS against a real daemon -------------------------------------------------------- */

START_TEST(a_daemon_with_no_compile_to_lend_says_so_and_keeps_the_connection) {
  if (cr_on_cuda()) {
    tu_skip(__func__, "the host daemon's answer; on cuda the gpu case covers KERNELS");
    return;
  }
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  dep_client_t *c = cl_connect(d.sock);
  struct dep_msg_kernels m = {{0}};
  struct client_frame f;
  ck_assert_int_eq(client_request(c, DEP_MSG_KERNELS, &m, DEP_MSG_KERNELS_OK, 5000, &f),
                   DEP_ERR_NOT_FOUND);
  ck_assert_msg(strstr(dep_errmsg(c), "no kernels to lend") != NULL, "said: %s", dep_errmsg(c));
  struct dep_status *st = NULL;
  ck_assert_int_eq(dep_status(c, &st), 0); /* the connection is still served */
  dep_status_free(st);
  dep_client_free(c);
  ck_assert_int_eq(tu_daemon_stop(&d), 0);
  tu_daemon_cleanup(&d);
}
END_TEST

/* The warm-up's child (daemon/warmup.c) run by hand: its exit status and what it logs. */
static int run_child(const char *sock, const char *uuid, const char *log) {
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execl(tu_bin("deepepd"), "deepepd", "--warmup-child", sock, uuid, (char *)NULL);
    _exit(127);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

START_TEST(the_warm_up_child_attaches_a_rank_per_device_and_says_why_it_fails) {
  if (cr_on_cuda()) {
    tu_skip(__func__, "the host daemon's case; on cuda every daemon start runs it (gpu case)");
    return;
  }
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  char log[300], bad[300];
  snprintf(log, sizeof log, "%s/child.log", d.dir);
  snprintf(bad, sizeof bad, "%s/none.sock", d.dir);
  const char *host = "00000000-0000-0000-0000-000000000000";
  ck_assert_int_eq(run_child(d.sock, host, log), 0);
  char *text = tu_daemon_log(&d);
  ck_assert_msg(strstr(text, "job deepepd-warmup-") != NULL, "the daemon saw no warm-up job:\n%s",
                text);
  free(text);
  ck_assert_int_eq(run_child(bad, host, log), 1);
  FILE *f = fopen(log, "r");
  char line[1024] = "";
  ck_assert(f != NULL && fgets(line, sizeof line, f) != NULL);
  fclose(f);
  ck_assert_msg(strstr(line, "deepepd not running") != NULL, "said: %s", line);
  ck_assert_int_eq(run_child(d.sock, "GPU-zz", log), 1);
  ck_assert_int_eq(tu_daemon_stop(&d), 0);
  tu_daemon_cleanup(&d);
}
END_TEST

/* ---- gpu: the driver's compile, lent at attach -------------------------------------------- */

/* In a child (the test process never initialises CUDA): what this build's fatbin holds for GPU 0. */
static int gpu0_fit(void) {
  pid_t pid = fork();
  if (pid == 0) {
    const struct cudadrv *cu = cudadrv_load(NULL, 0);
    struct kimage img;
    int major = 0, minor = 0;
    if (cu == NULL || !kimage_embedded(&img) ||
        cu->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0) != 0 ||
        cu->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0) != 0)
      _exit(100);
    _exit((int)kimage_fit(img.data, img.len, major, minor));
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 100;
}

/* A trainer process: attach one rank on GPU 0; exit 0 if its kernels are the daemon's compile. */
static int gpu_rank_lent(const char *sock) {
  pid_t pid = fork();
  if (pid == 0) {
    const struct cudadrv *cu = cudadrv_load(NULL, 0);
    CUuuid u;
    if (cu == NULL || cu->cuDeviceGetUuid(&u, 0) != CUDA_SUCCESS)
      _exit(10);
    struct dep_attach_args a = {.size = sizeof a,
                                .job_id = "kcache-rank", .world_size = 1, .local_world_size = 1,
                                .shape = {.max_tokens_per_rank = 16, .hidden = 256,
                                          .num_experts = 4, .topk = 2, .dtype = DEP_DTYPE_BF16}};
    memcpy(a.device_uuid, u.bytes, 16);
    dep_client_t *c = NULL;
    if (dep_client_new(&c) != 0 || dep_connect(c, sock) != 0 || dep_attach(c, &a) != 0) {
      fprintf(stderr, "kcache rank: %s\n", c ? dep_errmsg(c) : "no client");
      _exit(11);
    }
    /* The query the daemon's warm-up reports with (deepep_daemon.h). */
    bool lent = dep__client_kernels_lent(c);
    dep_detach(c);
    dep_client_free(c);
    _exit(lent ? 0 : 12);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 100;
}

static void assert_log_has(const struct tu_daemon *d, const char *what) {
  char *log = tu_daemon_log(d);
  ck_assert_msg(log != NULL && strstr(log, what) != NULL, "the daemon's log lacks \"%s\":\n%s",
                what, log ? log : "(none)");
  free(log);
}

START_TEST(a_ptx_only_library_is_lent_the_daemons_compile_and_a_corrupt_entry_is_rebuilt) {
  CR_NEEDS_GPU();
  int fit = gpu0_fit();
  if (fit == KIMAGE_SASS) {
    tu_skip(__func__, "this build's fatbin has SASS for GPU 0, so the daemon compiles nothing: "
            "build the library PTX-only (make BUILD=build-ptx PTX_ONLY=90) to test the cache");
    return;
  }
  ck_assert_msg(fit == KIMAGE_PTX_ONLY, "the fatbin holds %d for GPU 0", fit);
  char top[256], cache[300], yaml[400];
  tu_tmpdir(top, sizeof top);
  snprintf(cache, sizeof cache, "%s/cache", top);
  snprintf(yaml, sizeof yaml, "kernel_cache_dir: %s\nkernel_warmup: true\n", cache);
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  /* An empty cache: compiled at start; the warm-up and a trainer run the compile. */
  ck_assert_int_eq(tu_daemon_start_in(&d, top, yaml), 0);
  assert_log_has(&d, "compiled the library's PTX");
  assert_log_has(&d, "kernels (the daemon's compile) loaded");
  ck_assert_int_eq(gpu_rank_lent(d.sock), 0);
  ck_assert_int_eq(tu_daemon_stop(&d), 0);
  /* Damaged on disk: found at the next start, compiled again, lent. */
  DIR *dir = opendir(cache);
  ck_assert(dir != NULL);
  char entry[600] = "";
  for (struct dirent *e; (e = readdir(dir)) != NULL;)
    if (strstr(e->d_name, ".kcache") != NULL && e->d_name[0] != '.')
      snprintf(entry, sizeof entry, "%s/%s", cache, e->d_name);
  closedir(dir);
  ck_assert_msg(entry[0] != '\0', "no entry in %s", cache);
  size_t len;
  uint8_t *f = slurp(entry, &len);
  ck_assert_uint_gt(len, 300);
  f[300] ^= 0xff;
  spit(entry, f, len);
  ck_assert_int_eq(truncate(d.log, 0), 0);
  ck_assert_int_eq(tu_daemon_start_in(&d, top, yaml), 0);
  assert_log_has(&d, "checksum mismatch");
  assert_log_has(&d, "compiled the library's PTX");
  ck_assert_int_eq(gpu_rank_lent(d.sock), 0);
  ck_assert_int_eq(tu_daemon_stop(&d), 0);
  /* Whole again: the next start reads it without compiling. */
  ck_assert_int_eq(truncate(d.log, 0), 0);
  ck_assert_int_eq(tu_daemon_start_in(&d, top, yaml), 0);
  assert_log_has(&d, "-byte cubin from");
  ck_assert_int_eq(gpu_rank_lent(d.sock), 0);
  ck_assert_int_eq(tu_daemon_stop(&d), 0);
  tu_daemon_cleanup(&d);
}
END_TEST

Suite *kcache_suite(void);
Suite *kcache_suite(void) {
  Suite *s = suite_create("kcache");
  TCase *tc = tcase_create("cache");
  tcase_add_test(tc, an_entry_is_named_and_checked_by_architecture_driver_and_build);
  tcase_add_test(tc, a_damaged_entry_fails_its_checksum_or_its_length);
  tcase_add_test(tc, the_cubin_is_compiled_once_then_read_from_the_cache);
  tcase_add_test(tc, a_corrupt_or_refused_entry_is_rebuilt);
  tcase_add_test(tc, entries_of_another_driver_or_build_are_removed_as_stale);
  tcase_add_test(tc, a_failed_compile_is_an_error_and_stores_nothing);
  tcase_add_test(tc, the_cache_directory_is_made_and_must_be_writable_by_deepepd_alone);
  tcase_add_test(tc, the_fatbin_reader_tells_sass_from_ptx_only);
  tcase_add_test(tc, every_kernel_the_library_looks_up_is_named_in_the_image);
  tcase_add_test(tc, a_daemon_with_no_compile_to_lend_says_so_and_keeps_the_connection);
  tcase_add_test(tc, the_warm_up_child_attaches_a_rank_per_device_and_says_why_it_fails);
  suite_add_tcase(s, tc);
  TCase *gpu = tcase_create("gpu");
  tcase_set_tags(gpu, "gpu");
  tcase_set_timeout(gpu, 120); /* three starts, each compiling or warming up on the GPU */
  tcase_add_test(gpu, a_ptx_only_library_is_lent_the_daemons_compile_and_a_corrupt_entry_is_rebuilt);
  suite_add_tcase(s, gpu);
  return s;
}
