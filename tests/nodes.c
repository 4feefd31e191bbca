/*
 * nodes.c — several real daemons as the nodes of one cluster (nodes.h).
 */
#include "nodes.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemonwire.h"

/* Ports of this test process's daemons: apart from other runs' and check_peers'
 * (20000-35999), and below the kernel's ephemeral range (32768 up on Linux by
 * default), where an outbound connection of another test could hold one. */
static int port_base(void) { return 4000 + (int)(getpid() % 2000) * 8; }

void nodes_config(struct nodes *ns, int n, int attach_timeout_ms) {
  nodes_config_with(ns, n, attach_timeout_ms, "", "");
}

void nodes_config_with(struct nodes *ns, int n, int attach_timeout_ms, const char *limits,
                       const char *extra) {
  memset(ns, 0, sizeof *ns);
  ns->n = n;
  tu_tmpdir(ns->dir, sizeof ns->dir);
  dw_sfmt(ns->key, sizeof ns->key, "%s/key", ns->dir);
  char cmd[700];
  dw_sfmt(cmd, sizeof cmd, "%s genkey %s 2>/dev/null", tu_bin("deepepctl"), ns->key);
  ck_assert_int_eq(system(cmd), 0);
  for (int i = 0; i < n; i++)
    ns->port[i] = port_base() + i;
  for (int i = 0; i < n; i++) {
    char peers[512] = "";
    size_t o = 0;
    for (int k = 0; k < n; k++)
      if (k != i)
        o += (size_t)snprintf(peers + o, sizeof peers - o, "%s{host: 127.0.0.1, port: %d}",
                              o ? ", " : "", ns->port[k]);
    dw_sfmt(ns->yaml[i], sizeof ns->yaml[i],
            "connection_pool_size: 2\nlisten: {address: 127.0.0.1, port: %d}\n"
            "peers: [%s]\npeer_key_file: %s\npeer_wait_ms: 0\n"
            "limits: {attach_timeout_ms: %d%s}\n%s",
            ns->port[i], peers, ns->key, attach_timeout_ms, limits, extra);
  }
}

void node_start(struct nodes *ns, int i) {
  char sub[300];
  dw_sfmt(sub, sizeof sub, "%s/n%d", ns->dir, i);
  mkdir(sub, 0700);
  ck_assert_int_eq(tu_daemon_start_in(&ns->d[i], sub, ns->yaml[i]), 0);
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
}

