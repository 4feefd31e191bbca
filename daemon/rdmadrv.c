/*
 * rdmadrv.c — dlopen seam to libibverbs and librdmacm, and the probe of the
 * RDMA devices at start (see rdmadrv.h).
 */
#include "rdmadrv.h"

#include <endian.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dlload.h"
#include "log.h"

/* Every required row's type is the header's prototype of its symbol.  (The optional
 * row is not checked: headers older than the symbol do not declare it.) */
#define RDMADRV_TYPECHECK(field, sym, ver, ret, params)                                 \
  _Static_assert(__builtin_types_compatible_p(ret(*) params, __typeof__(&sym)),          \
                 #sym ": the table's type is not the header's");
RDMADRV_IBV(RDMADRV_TYPECHECK)
RDMADRV_CM(RDMADRV_TYPECHECK)

static struct rdmadrv drv;
static const struct rdmadrv *drv_ok;
static char drv_why[256];
/* What to install, when the reason is that a library is not installed. */
static const char *drv_hint;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

/* Every row of the X-macro tables, at its version, into the field of its part. */
#define RDMADRV_SYM(part, field, sym, ver, opt)                                           \
  {.name = #sym, .version = ver, .at = &drv.part.field, .optional = opt},
#define RDMADRV_SYM_IBV(field, sym, ver, ret, params) RDMADRV_SYM(ibv, field, sym, ver, false)
#define RDMADRV_SYM_CM(field, sym, ver, ret, params) RDMADRV_SYM(cm, field, sym, ver, false)
static const struct dep_dlsym ibv_syms[] = {RDMADRV_IBV(RDMADRV_SYM_IBV)};
static const struct dep_dlsym cm_syms[] = {RDMADRV_CM(RDMADRV_SYM_CM)};

/* Load the library named by $env, else `name`, and resolve syms; false with drv_why (and
 * drv_hint) set. */
static bool drv_open(const char *env, const char *name, const char *package,
                     const struct dep_dlsym *syms, size_t n) {
  const char *override = getenv(env);
  if (override != NULL && override[0] != '\0')
    name = override;
  void *h;
  char e[sizeof drv_why - 40]; /* room in drv_why for the words around it */
  int rc = dep__dl_load(name, syms, n, &h, e, sizeof e);
  if (rc == DEP_DL_OK)
    return true;
  if (rc == DEP_DL_NO_SYMBOL) {
    snprintf(drv_why, sizeof drv_why, "%s (rdma-core too old?)", e);
    return false;
  }
  bool absent = strstr(e, "No such file or directory") != NULL;
  if (name == override) {
    snprintf(drv_why, sizeof drv_why, "%s (from $%s) %s", name, env, absent ? "not found" : e);
  } else if (absent) {
    snprintf(drv_why, sizeof drv_why, "%s not installed", name);
    drv_hint = package;
  } else {
    snprintf(drv_why, sizeof drv_why, "%s", e);
  }
  return false;
}

static void drv_load_once(void) {
  /* librdmacm needs libibverbs (it is linked against it): verbs first. */
  if (drv_open(RDMADRV_ENV_IBVERBS, "libibverbs.so.1", "rdma-core / libibverbs1", ibv_syms,
               sizeof ibv_syms / sizeof ibv_syms[0]) &&
      drv_open(RDMADRV_ENV_RDMACM, "librdmacm.so.1", "rdma-core / librdmacm1", cm_syms,
               sizeof cm_syms / sizeof cm_syms[0]))
    drv_ok = &drv;
}

const struct rdmadrv *rdmadrv_load(char *why, size_t whylen) {
  pthread_once(&drv_once, drv_load_once);
  if (drv_ok == NULL && why != NULL && whylen > 0)
    snprintf(why, whylen, "%s", drv_why);
  return drv_ok;
}

int rdmadrv_query_port(const struct rdmadrv *rd, struct ibv_context *ctx, uint8_t port,
                       struct ibv_port_attr *attr) {
  memset(attr, 0, sizeof *attr);
  return rd->ibv.query_port(ctx, port, (struct _compat_ibv_port_attr *)attr);
}

/* ---- the probe at start -------------------------------------------------- */

#define PROBE_LINES_MAX 16

static struct {
  int ndev;
  char text[256];
  int nlines;
  struct {
    int prio;
    char msg[384];
  } line[PROBE_LINES_MAX];
} probe;
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static pthread_once_t probe_log_once = PTHREAD_ONCE_INIT;

static void probe_line(int prio, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void probe_line(int prio, const char *fmt, ...) {
  if (probe.nlines == PROBE_LINES_MAX)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(probe.line[probe.nlines].msg, sizeof probe.line[0].msg, fmt, ap);
  va_end(ap);
  probe.line[probe.nlines++].prio = prio;
}

/* No device: the one line that says why, and the text for status. */
static void probe_none(int prio, const char *why, const char *hint) {
  snprintf(probe.text, sizeof probe.text, "%s", why);
  probe_line(prio, "rdma: %s: peer daemons will use TCP%s%s%s", why, hint ? " (install " : "",
             hint ? hint : "", hint ? ")" : "");
}

static const char *port_state_name(enum ibv_port_state s) {
  switch (s) {
  case IBV_PORT_DOWN:
    return "DOWN";
  case IBV_PORT_INIT:
    return "INIT";
  case IBV_PORT_ARMED:
    return "ARMED";
  case IBV_PORT_ACTIVE:
    return "ACTIVE";
  case IBV_PORT_ACTIVE_DEFER:
    return "ACTIVE_DEFER";
  default:
    return "NOP";
  }
}

/* As ibv_devinfo names it: an unspecified link layer is InfiniBand's (older kernels). */
static const char *link_layer_name(uint8_t ll) {
  return ll == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand";
}

/* One device opened, described in a log line and closed again; 0, or -1 (logged). */
static int probe_device(const struct rdmadrv *rd, struct ibv_device *dev, char *denied,
                        size_t deniedlen) {
  const char *name = rd->ibv.get_device_name(dev);
  struct ibv_context *ctx = rd->ibv.open_device(dev);
  if (ctx == NULL) {
    int e = errno;
    if (e == EACCES || e == EPERM)
      snprintf(denied, deniedlen, "permission denied on /dev/infiniband/%s", dev->dev_name);
    probe_line(LOG_PRIO_WARNING, "rdma: %s: ibv_open_device (/dev/infiniband/%s): %s", name,
               dev->dev_name, strerror(e));
    return -1;
  }
  struct ibv_device_attr da;
  int rc = rd->ibv.query_device(ctx, &da);
  if (rc != 0) {
    probe_line(LOG_PRIO_WARNING, "rdma: %s: ibv_query_device: %s", name, strerror(rc));
    rd->ibv.close_device(ctx);
    return -1;
  }
  uint64_t g = be64toh(rd->ibv.get_device_guid(dev));
  char ports[256] = "";
  size_t off = 0;
  for (unsigned p = 1; p <= da.phys_port_cnt && off < sizeof ports; p++) {
    struct ibv_port_attr pa;
    if ((rc = rdmadrv_query_port(rd, ctx, (uint8_t)p, &pa)) != 0)
      off += (size_t)snprintf(ports + off, sizeof ports - off, ", port %u: ibv_query_port: %s",
                              p, strerror(rc));
    else
      off += (size_t)snprintf(ports + off, sizeof ports - off, ", port %u %s %s", p,
                              port_state_name(pa.state), link_layer_name(pa.link_layer));
  }
  probe_line(LOG_PRIO_INFO, "rdma: %s: node GUID %04x:%04x:%04x:%04x%s", name,
             (unsigned)(g >> 48) & 0xffff, (unsigned)(g >> 32) & 0xffff,
             (unsigned)(g >> 16) & 0xffff, (unsigned)g & 0xffff, ports);
  size_t t = strlen(probe.text);
  snprintf(probe.text + t, sizeof probe.text - t, "%s%s", t > 0 ? ", " : "", name);
  rd->ibv.close_device(ctx);
  return 0;
}

static void probe_run(void) {
  char why[256];
  const struct rdmadrv *rd = rdmadrv_load(why, sizeof why);
  if (rd == NULL) {
    probe_none(LOG_PRIO_INFO, why, drv_hint);
    return;
  }
  int n = 0;
  errno = 0;
  struct ibv_device **list = rd->ibv.get_device_list(&n);
  if (list == NULL) {
    int e = errno;
    if (e == EACCES || e == EPERM)
      probe_none(LOG_PRIO_WARNING, "permission denied on /dev/infiniband", NULL);
    else if (e == ENOSYS)
      probe_none(LOG_PRIO_INFO, "no RDMA devices (no kernel support: ib_uverbs not loaded?)", NULL);
    else {
      snprintf(why, sizeof why, "ibv_get_device_list: %s", strerror(e));
      probe_none(LOG_PRIO_WARNING, why, NULL);
    }
    return;
  }
  char denied[128] = "";
  for (int i = 0; i < n; i++)
    if (probe_device(rd, list[i], denied, sizeof denied) == 0)
      probe.ndev++;
  rd->ibv.free_device_list(list);
  if (n == 0)
    probe_none(LOG_PRIO_INFO, "no RDMA devices", NULL);
  else if (probe.ndev == 0)
    probe_none(LOG_PRIO_WARNING, denied[0] != '\0' ? denied : "no RDMA device could be opened",
               NULL);
}

int rdmadrv_probe(char *text, size_t len) {
  pthread_once(&probe_once, probe_run);
  if (text != NULL && len > 0)
    snprintf(text, len, "%s", probe.text);
  return probe.ndev;
}

static void probe_log_run(void) {
  rdmadrv_probe(NULL, 0);
  for (int i = 0; i < probe.nlines; i++) {
    if (probe.line[i].prio == LOG_PRIO_WARNING)
      log_warnx("%s", probe.line[i].msg);
    else
      log_info("%s", probe.line[i].msg);
  }
}

void rdmadrv_probe_log(void) {
  pthread_once(&probe_log_once, probe_log_run);
}
