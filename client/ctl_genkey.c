/*
 * ctl_genkey.c — `deepepctl genkey [FILE]`: write a key for peer_key_file,
 * 32 random bytes from getrandom(2) as 64 hex digits and a newline, with
 * mode 0600.  Without FILE (or with "-") the key goes to stdout.  An
 * existing FILE is not overwritten: a cluster's key changes on purpose only.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ctl.h"

#define GENKEY_BYTES 32

/* The FILE argument, into *path (NULL when none): -1 to go on, else the exit status
 * (--help, or a usage error).  No options of its own; a single optional FILE argument. */
static int genkey_args(struct ctl *ctl, int argc, char **argv, const char **path) {
  for (int i = 1; i < argc; i++) {
    if (argv[i][0] == '-' && argv[i][1] != '\0') {
      if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
        printf("usage: deepepctl genkey [FILE]\n"
               "  write a new peer key (%d random bytes, hex) to FILE with mode 0600, or to "
               "stdout\n",
               GENKEY_BYTES);
        return CTL_EXIT_OK;
      }
      return ctl_usage_error(ctl, "genkey takes no option \"%s\"", argv[i]);
    }
    if (*path != NULL)
      return ctl_usage_error(ctl, "genkey takes one FILE, not also \"%s\"", argv[i]);
    if (argv[i][0] == '\0')
      return ctl_usage_error(ctl, "genkey needs a FILE name, not an empty string (none, or -, "
                                  "for standard output)");
    *path = argv[i];
  }
  return -1;
}

/* A new key into hex (2 * GENKEY_BYTES + 2 bytes): 64 hex digits and a newline.  Returns
 * -1 to go on, else the exit status of getrandom's failure.  The raw bytes are wiped once
 * written out. */
static int genkey_make(struct ctl *ctl, char *hex) {
  unsigned char key[GENKEY_BYTES];
  size_t got = 0;
  while (got < sizeof key) {
    ssize_t n = getrandom(key + got, sizeof key - got, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return ctl_fail(ctl, DEP_ERR_IO, "genkey: getrandom: %s", strerror(errno));
    got += (size_t)n;
  }
  for (size_t i = 0; i < sizeof key; i++)
    snprintf(hex + 2 * i, 3, "%02x", key[i]);
  hex[2 * GENKEY_BYTES] = '\n';
  hex[2 * GENKEY_BYTES + 1] = '\0';
  memset(key, 0, sizeof key);
  return -1;
}

/* The key into a new FILE of mode 0600 (never over an existing one; a failed write
 * leaves no file), then what was done: on stderr, or with --json as one object. */
static int genkey_to_file(struct ctl *ctl, const char *path, char *hex, size_t hexlen) {
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0)
    return ctl_fail(ctl, errno == EEXIST ? DEP_ERR_EXISTS : DEP_ERR_IO,
                    "genkey: cannot create %s: %s%s", path, strerror(errno),
                    errno == EEXIST ? " (remove it first to replace the key)" : "");
  /* The umask may only take bits away; make sure of 0600 anyway. */
  (void)fchmod(fd, 0600);
  size_t len = strlen(hex), off = 0;
  while (off < len) {
    ssize_t n = write(fd, hex + off, len - off);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0) {
      int rc = ctl_fail(ctl, DEP_ERR_IO, "genkey: writing %s: %s", path, strerror(errno));
      close(fd);
      unlink(path);
      return rc;
    }
    off += (size_t)n;
  }
  if (fsync(fd) != 0 || close(fd) != 0)
    return ctl_fail(ctl, DEP_ERR_IO, "genkey: writing %s: %s", path, strerror(errno));
  memset(hex, 0, hexlen);
  char said[PATH_MAX + 96];
  snprintf(said, sizeof said, "wrote a new peer key to %s (mode 0600); copy it to every node",
           path);
  if (!ctl->json) {
    fprintf(stderr, "deepepctl: %s\n", said);
    return CTL_EXIT_OK;
  }
  /* --json: the answer on stdout as one object, nothing on stderr (deepepctl(1)). */
  static const struct ctl_col cols[] = {{"result", "genkey", CTL_STR, 0},
                                        {"file", "file", CTL_STR, 0}};
  const struct ctl_val vals[] = {{.s = said}, {.s = path}};
  const struct ctl_doc doc = {cols, vals, 2, NULL, 0};
  ctl_out_render(stdout, &doc, true);
  return ctl_finish_output(CTL_EXIT_OK);
}

int ctl_genkey(struct ctl *ctl, int argc, char **argv) {
  const char *path = NULL;
  int rc = genkey_args(ctl, argc, argv, &path);
  if (rc >= 0)
    return rc;
  char hex[2 * GENKEY_BYTES + 2];
  if ((rc = genkey_make(ctl, hex)) >= 0)
    return rc;
  if (path != NULL && strcmp(path, "-") != 0)
    return genkey_to_file(ctl, path, hex, sizeof hex);
  if (ctl->json) {
    /* --json: one object, as every command prints ({"key": "64 hex digits"}). */
    hex[2 * GENKEY_BYTES] = '\0';
    static const struct ctl_col cols[] = {{"key", "key", CTL_STR, 0}};
    const struct ctl_val vals[] = {{.s = hex}};
    const struct ctl_doc doc = {cols, vals, 1, NULL, 0};
    ctl_out_render(stdout, &doc, true);
  } else {
    fputs(hex, stdout);
  }
  memset(hex, 0, sizeof hex);
  return ctl_finish_output(CTL_EXIT_OK);
}
