/*
 * nodes.c — several real daemons as the nodes of one cluster (nodes.h).
 */
#include "nodes.h"

#include <check.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemonwire.h"

/* Ports of this test process's daemons: apart from other runs' and the peer suites'
 * (peerlab.c, 20000-35999), and below the kernel's ephemeral range (32768 up on Linux by
 * default), where an outbound connection of another test could hold one. */
static int port_base(void) { return 4000 + (int)(getpid() % 2000) * 8; }

void nodes_config(struct nodes *ns, int n, int attach_timeout_ms) {
  nodes_config_with(ns, n, attach_timeout_ms, "", "");
}

/* n daemons, node i on address addr(i), each listing the others. */
static void nodes_config_at(struct nodes *ns, int n, int attach_timeout_ms, const char *limits,
                            const char *extra, bool in_netns) {
  char dir[256];
  tu_tmpdir(dir, sizeof dir);
  struct netns net = ns->net;
  memset(ns, 0, sizeof *ns);
  ns->net = net;
  ns->in_netns = in_netns;
  ns->n = n;
  snprintf(ns->dir, sizeof ns->dir, "%s", dir);
  dw_sfmt(ns->key, sizeof ns->key, "%s/key", ns->dir);
  char cmd[700];
  dw_sfmt(cmd, sizeof cmd, "%s genkey %s 2>/dev/null", tu_bin("deepepctl"), ns->key);
  ck_assert_int_eq(system(cmd), 0);
  char addr[NODES_MAX][32];
  for (int i = 0; i < n; i++) {
    ns->port[i] = port_base() + i;
    snprintf(addr[i], sizeof addr[i], in_netns ? "10.77.0.%d" : "127.0.0.1", i + 1);
  }
  for (int i = 0; i < n; i++) {
    char peers[512] = "";
    size_t o = 0;
    for (int k = 0; k < n; k++)
      if (k != i)
        o += (size_t)snprintf(peers + o, sizeof peers - o, "%s{host: %s, port: %d}",
                              o ? ", " : "", addr[k], ns->port[k]);
    dw_sfmt(ns->yaml[i], sizeof ns->yaml[i],
            "connection_pool_size: 2\nlisten: {address: %s, port: %d}\n"
            "peers: [%s]\npeer_key_file: %s\npeer_wait_ms: 0\n"
            "limits: {attach_timeout_ms: %d%s}\n%s",
            addr[i], ns->port[i], peers, ns->key, attach_timeout_ms, limits, extra);
  }
}

void nodes_config_with(struct nodes *ns, int n, int attach_timeout_ms, const char *limits,
                       const char *extra) {
  nodes_config_at(ns, n, attach_timeout_ms, limits, extra, false);
}

const char *nodes_config_netns(struct nodes *ns, int attach_timeout_ms, const char *limits,
                               const char *extra) {
  const char *why = netns_up(&ns->net);
  if (why != NULL) {
    netns_down(&ns->net);
    return why;
  }
  nodes_config_at(ns, 2, attach_timeout_ms, limits, extra, true);
  return NULL;
}

void node_start(struct nodes *ns, int i) {
  char sub[300];
  dw_sfmt(sub, sizeof sub, "%s/n%d", ns->dir, i);
  mkdir(sub, 0700);
  struct tu_daemon_opts o = {.netns = ns->in_netns ? ns->net.ns[i] : NULL};
  ck_assert_int_eq(tu_daemon_start_opts(&ns->d[i], sub, ns->yaml[i], &o), 0);
}

bool node_sees_all(const struct nodes *ns, int i) {
  char cmd[700], out[16384];
  dw_sfmt(cmd, sizeof cmd, "%s -s %s peers --json", tu_bin("deepepctl"), ns->d[i].sock);
  FILE *f = popen(cmd, "r");
  if (f == NULL)
    return false;
  size_t got = fread(out, 1, sizeof out - 1, f);
  out[got] = '\0';
  if (pclose(f) != 0)
    return false;
  int up = 0;
  for (const char *p = out; (p = strstr(p, "\"state\":\"up\"")) != NULL; p++)
    up++;
  return up == ns->n - 1;
}

void nodes_wait_up(const struct nodes *ns) {
  for (int i = 0; i < ns->n; i++) {
    bool ok = false;
    for (int t = 0; t < 5000 && !(ok = node_sees_all(ns, i)); t += 50)
      dw_sleep_ms(50);
    ck_assert_msg(ok, "node %d does not see its peers up", i);
  }
}

void nodes_start(struct nodes *ns, int n, int attach_timeout_ms) {
  nodes_config(ns, n, attach_timeout_ms);
  nodes_start_all(ns);
}

void nodes_start_all(struct nodes *ns) {
  int n = ns->n;
  for (int i = 0; i < n; i++)
    node_start(ns, i);
  nodes_wait_up(ns);
}

void nodes_stop(struct nodes *ns) {
  for (int i = 0; i < ns->n; i++) {
    if (ns->d[i].pid > 0)
      tu_daemon_stop(&ns->d[i]);
    tu_daemon_cleanup(&ns->d[i]);
  }
  tu_rmtree(ns->dir);
  if (ns->in_netns)
    netns_down(&ns->net);
}


/* ---- network namespaces ---- */

int nodes_sh(const char *fmt, ...) {
  char cmd[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  char quiet[600];
  snprintf(quiet, sizeof quiet, "%s >/dev/null 2>&1", cmd);
  return system(quiet);
}

void netns_down(struct netns *n) {
  for (int i = 0; i < 2; i++)
    if (n->made[i])
      nodes_sh("ip netns delete %s", n->ns[i]);
}

const char *netns_up(struct netns *n) {
  memset(n, 0, sizeof *n);
  if (geteuid() != 0)
    return "not root (ip netns needs CAP_SYS_ADMIN)";
  if (nodes_sh("ip netns list") != 0)
    return "ip netns is not available";
  for (int i = 0; i < 2; i++) {
    snprintf(n->ns[i], sizeof n->ns[i], "dep%d_%d", (int)getpid(), i);
    if (nodes_sh("ip netns add %s", n->ns[i]) != 0)
      return "ip netns add failed (no network namespaces here?)";
    n->made[i] = true;
    nodes_sh("ip -n %s link set lo up", n->ns[i]);
  }
  if (nodes_sh("ip link add dv%da netns %s type veth peer name dv%db netns %s", (int)getpid(),
         n->ns[0], (int)getpid(), n->ns[1]) != 0)
    return "ip link add type veth failed (no veth module?)";
  for (int i = 0; i < 2; i++) {
    if (nodes_sh("ip -n %s addr add 10.77.0.%d/24 dev dv%d%c", n->ns[i], i + 1, (int)getpid(),
           "ab"[i]) != 0 ||
        nodes_sh("ip -n %s link set dv%d%c up", n->ns[i], (int)getpid(), "ab"[i]) != 0)
      return "cannot configure the veth pair";
  }
  return NULL;
}

