/*
 * held.c — the held file (held.h).
 */
#include "held.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "devices.h"
#include "log.h"
#include "pool.h"

#define HELD_MAGIC "# deepepd held memory 1"
#define HELD_LINE_MAX 8192 /* POOL_MAX_HOLDERS x "PID:START " fits */

static uv_loop_t *held_loop;
static uv_timer_t held_timer;
static bool held_open;
static char held_file[PATH_MAX];
static bool held_frozen; /* the daemon is stopping: the last write is done */

void held_path(const char *socket_path, char *out, size_t len) {
  snprintf(out, len, "%s.held", socket_path);
}

/* One line: a block's, a region's or a ghost's charge. */
static void held_line(FILE *f, const struct pool *p, uid_t uid, uint64_t bytes,
                      const struct proc_id *h, uint32_t n) {
  if (n == 0)
    return;
  for (int i = 0; i < 16; i++)
    fprintf(f, "%02x", p->dev.uuid[i]);
  fprintf(f, " %" PRIu64 " %u %u", bytes, (unsigned)uid, n);
  for (uint32_t i = 0; i < n; i++)
    fprintf(f, " %d:%" PRIu64, (int)h[i].pid, h[i].start);
  fputc('\n', f);
}

static void held_write(void) {
  if (held_file[0] == '\0' || held_frozen)
    return;
  char tmp[PATH_MAX + 8];
  snprintf(tmp, sizeof tmp, "%s.tmp", held_file);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  FILE *f = fd < 0 ? NULL : fdopen(fd, "w");
  if (f == NULL) {
    log_warn("cannot write %s (a daemon started after this one will not know what its ranks "
             "still hold)", tmp);
    if (fd >= 0)
      close(fd);
    return;
  }
  fprintf(f, "%s\n", HELD_MAGIC);
  uint32_t lines = 0;
  for (size_t i = 0; i < devices_count(); i++) {
    const struct pool *p = devices_at(i);
    for (const struct pool_block *b = p->blocks; b != NULL; b = b->next) {
      held_line(f, p, b->last_uid, pool_block_bytes(b), b->holders, b->n_holders);
      lines += b->n_holders > 0;
    }
    for (const struct pool_region *r = p->regions; r != NULL; r = r->next) {
      held_line(f, p, r->uid, r->bytes, r->holders, r->n_holders);
      lines += r->n_holders > 0;
    }
    for (const struct pool_ghost *g = p->ghosts; g != NULL; g = g->next) {
      held_line(f, p, g->uid, g->bytes, g->holders, g->n_holders);
      lines++;
    }
  }
  bool ok = fflush(f) == 0 && ferror(f) == 0;
  ok = fclose(f) == 0 && ok;
  if (!ok || rename(tmp, held_file) != 0) {
    log_warn("cannot write %s", held_file);
    unlink(tmp);
    return;
  }
  log_debug("held file %s: %u entr%s", held_file, lines, lines == 1 ? "y" : "ies");
}

void held_save(void) {
  held_write();
  held_frozen = true;
}

static void held_on_timer(uv_timer_t *t) { held_write(); }

void held_init(uv_loop_t *loop, const char *socket_path) {
  held_loop = loop;
  held_path(socket_path, held_file, sizeof held_file);
  uv_timer_init(loop, &held_timer);
  held_open = true;
}

void held_changed(void) {
  if (held_open && !uv_is_active((uv_handle_t *)&held_timer))
    uv_timer_start(&held_timer, held_on_timer, 0, 0);
}

void held_fini(void) {
  if (!held_open)
    return;
  uv_timer_stop(&held_timer);
  uv_close((uv_handle_t *)&held_timer, NULL);
  held_open = false;
}

/* Parse one line into the preloaded ghosts; false when it is malformed. */
static bool held_parse(char *line) {
  uint8_t uuid[16];
  char *p = line;
  for (int i = 0; i < 32; i++, p++) {
    int v = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 : -1;
    if (v < 0)
      return false;
    uuid[i / 2] = (uint8_t)(i % 2 == 0 ? v << 4 : uuid[i / 2] | v);
  }
  char *end;
  errno = 0;
  uint64_t bytes = strtoull(p, &end, 10);
  if (errno != 0 || end == p || *end != ' ' || bytes == 0)
    return false;
  p = end;
  unsigned long uid = strtoul(p, &end, 10);
  if (errno != 0 || end == p || *end != ' ' || uid > (uid_t)-2)
    return false;
  p = end;
  unsigned long n = strtoul(p, &end, 10);
  if (errno != 0 || end == p || n == 0 || n > POOL_MAX_HOLDERS)
    return false;
  p = end;
  struct proc_id h[POOL_MAX_HOLDERS];
  for (unsigned long i = 0; i < n; i++) {
    long pid = strtol(p, &end, 10);
    if (errno != 0 || end == p || *end != ':' || pid <= 0 || pid > INT32_MAX)
      return false;
    p = end + 1;
    uint64_t start = strtoull(p, &end, 10);
    if (errno != 0 || end == p)
      return false;
    p = end;
    h[i] = (struct proc_id){.pid = (pid_t)pid, .start = start};
  }
  if (*p != '\0' && *p != '\n')
    return false;
  pool_preload_ghost(uuid, (uid_t)uid, bytes, h, (uint32_t)n);
  return true;
}

void held_load(const char *socket_path) {
  char path[PATH_MAX];
  held_path(socket_path, path, sizeof path);
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno != ENOENT)
      log_warn("cannot read %s; memory an earlier deepepd lent is not accounted for", path);
    return;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & 022) != 0) {
    log_warnx("%s is not a file of deepepd's own user that only it may write; ignored (remove "
              "it)", path);
    close(fd);
    return;
  }
  FILE *f = fdopen(fd, "r");
  if (f == NULL) {
    close(fd);
    return;
  }
  char *line = malloc(HELD_LINE_MAX);
  unsigned lineno = 0, bad = 0, read = 0;
  while (line != NULL && fgets(line, HELD_LINE_MAX, f) != NULL) {
    lineno++;
    if (lineno == 1) {
      if (strncmp(line, HELD_MAGIC, strlen(HELD_MAGIC)) != 0) {
        log_warnx("%s:1: not a held file of this deepepd version; ignored", path);
        break;
      }
      continue;
    }
    if (held_parse(line))
      read++;
    else if (bad++ == 0)
      log_warnx("%s:%u: malformed entry skipped", path, lineno);
  }
  free(line);
  fclose(f);
  if (read > 0 || bad > 0)
    log_info("%s: %u entr%s of memory an earlier deepepd lent (%u malformed)", path, read,
             read == 1 ? "y" : "ies", bad);
}
