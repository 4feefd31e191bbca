/*
 * check_ctl_json.c — suite ctl_json: deepepctl against a real deepepd,
 * every command's --json object held to its types (a schema checked by
 * python3), and `deepepctl clients` naming each connection's program (a
 * Python trainer through ctypes among them).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctl.h"
#include "ctl_view.h"
#include "ctlrun.h"
#include "daemonwire.h"
#include "mnrank.h"
#include "deepep.h"
#include "proto.h"
#include "slab.h"
#include "stats_page.h"
#include "statsranks.h"
#include "testutil.h"
#include "xring.h"

/* A sanitized build's library loads into python3 only after the sanitizer's runtime, and
 * python3's own allocations are no leak of ours. */
#if defined(__SANITIZE_ADDRESS__)
#define CTL_PY_ENV "LD_PRELOAD=$(cc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 "
#else
#define CTL_PY_ENV ""
#endif

/* ---- the programs of the clients -------------------------------------------------- */

/* A Python trainer in miniature: the library through ctypes, connected, until stdin closes. */
static const char ctl_trainer_py[] =
    "import ctypes, sys\n"
    "lib = ctypes.CDLL(sys.argv[1])\n"
    "c = ctypes.c_void_p()\n"
    "assert lib.dep_client_new(ctypes.byref(c)) == 0\n"
    "assert lib.dep_connect(c, sys.argv[2].encode()) == 0\n"
    "sys.stdin.read()\n";

/* Whether `deepepctl --json clients` names a connection `name`, within timeout_ms. */
static bool clients_show(const char *sock, const char *name, int timeout_ms) {
  char want[200];
  dw_sfmt(want, sizeof want, "\"name\":\"%s\"", name);
  int64_t deadline = dw_now_ms() + timeout_ms;
  do {
    char *out, *err;
    ck_assert_int_eq(ctl_run(DW_ARGS("-s", sock, "--json", "clients"), &out, &err), 0);
    bool found = strstr(out, want) != NULL;
    free(out);
    free(err);
    if (found)
      return true;
    dw_sleep_ms(50);
  } while (dw_now_ms() < deadline);
  return false;
}

/* A connection of the library is named by its program and the library's version: a C program
 * by its own name, a Python script by the script, not the interpreter (every Python rank was
 * "libdeepep-client 0.4.1"). */
START_TEST(clients_name_each_connections_program) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  /* A C program: this test's process, forked. */
  struct dw_child c;
  dw_child_fork(&c);
  if (c.pid == 0) {
    dep_client_t *h = NULL;
    int rc = dep_client_new(&h);
    if (rc == 0)
      rc = dep_connect(h, d.sock);
    if (write(c.rep, rc == 0 ? "k" : "x", 1) != 1)
      _exit(3);
    char g;
    if (read(c.go, &g, 1) < 0)
      _exit(4);
    dep_client_free(h);
    _exit(rc == 0 ? 0 : 1);
  }
  char got;
  ck_assert_int_eq(read(c.rep, &got, 1), 1);
  ck_assert_int_eq(got, 'k');
  char want[200];
  dw_sfmt(want, sizeof want, "%s (libdeepep-client %s)", program_invocation_short_name,
          DEP_VERSION_STRING);
  ck_assert_msg(clients_show(d.sock, want, 0), "no connection named \"%s\"", want);
  /* A Python script, run as torchrun runs one (python3 -u SCRIPT ARGS). */
  char py[300], cmd[1200];
  dw_sfmt(py, sizeof py, "%s/my_trainer.py", d.dir);
  ck_assert_int_eq(tu_write_file(py, ctl_trainer_py), 0);
  dw_sfmt(cmd, sizeof cmd, CTL_PY_ENV "/usr/bin/python3 -u %s %s %s", py,
          tu_bin("libdeepep-client.so"), d.sock);
  FILE *trainer = popen(cmd, "w");
  ck_assert_ptr_nonnull(trainer);
  /* The script connects once python3 has started: 10 s is a ceiling for a loaded machine. */
  dw_sfmt(want, sizeof want, "my_trainer.py (libdeepep-client %s)", DEP_VERSION_STRING);
  ck_assert_msg(clients_show(d.sock, want, 10000),
                "no connection named \"%s\" (is %s built? make all builds it)", want,
                tu_bin("libdeepep-client.so"));
  ck_assert_int_eq(pclose(trainer), 0);
  ck_assert_int_eq(write(c.go, "g", 1), 1);
  int st;
  ck_assert_int_eq(waitpid(c.pid, &st, 0), c.pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
  close(c.rep);
  close(c.go);
  dw_stop_ok(&d);
}
END_TEST

/* ---- the JSON of every command, held to its types ---------------------------------- */

/*
 * A schema of each command's --json object (and of the error object): every key it has, no
 * other, each of its type (a string, an integer, a number, true or false; "?" where null stands
 * for what the text shows as "-"), and each table a list of at least one row of its own.
 * python3's json module parses; argv: NAME=FILE of each output.
 */
static const char ctl_json_schema_py[] =
    "import json, sys\n"
    "S, I, N, B, INTS = 'str', 'int', 'num', 'bool', 'ints'\n"
    "def opt(t): return ('?', t)\n"
    "DEV = {'uuid': S, 'name': S, 'backend': S, 'pool_total_bytes': I, 'pool_used_bytes': I,\n"
    "       'pool_cached_bytes': I, 'pool_held_bytes': I}\n"
    "JOB = {'job_id': S, 'owner_uid': I, 'ranks_attached': I, 'ranks_expected': I, 'world_size': I,\n"
    "       'slab_bytes': I, 'chunk_rows': I, 'age_ms': I, 'host_bytes': I, 'nodes': I, 'remote_ranks': I, 'bytes_out': I,\n"
    "       'bytes_in': I, 'ring_peak': I, 'payload_out': I, 'elastic': B, 'epoch': I,\n"
    "       'masked_ranks': S}\n"
    "EVENT = {'job_id': S, 'age_ms': I, 'rank': I, 'event': S, 'pid': I, 'epoch': I}\n"
    "OP = {'job': S, 'rank': I, 'op': S, 'device': S, 'state': S, 'calls': I, 'first_ns': opt(I),\n"
    "      'median_ns': opt(I), 'p99_ns': opt(I), 'first_over_median': opt(N),\n"
    "      'gbytes_per_s': opt(N), 'errors': I, 'timeouts': I, 'bytes': I, 'steady_calls': I,\n"
    "      'steady_sum_ns': I}\n"
    "RANK = {'job': S, 'rank': I, 'device': S, 'local_rank': I, 'pid': I, 'state': S, 'age_ms': I,\n"
    "        'ended_ms': opt(I), 'timer': S, 'attach_ns': opt(I), 'attach_wait_ns': opt(I),\n"
    "        'attach_map_ns': opt(I), 'attach_setup_ns': opt(I), 'attach_warmup_ns': opt(I),\n"
    "        'layouts': I, 'dropped': I, 'kernel_ctas': I, 'kernel_ctas_from': S,\n"
    "        'tokens_to': opt(INTS)}\n"
    "BALANCE = {'job': S, 'ranks': I, 'world': I, 'tokens': I, 'to_min': I, 'to_median': I,\n"
    "           'to_max': I, 'max_over_mean': opt(N), 'top': S, 'top_ranks': INTS}\n"
    "POOL = {'uuid': S, 'pool_total_bytes': I, 'pool_used_bytes': I, 'pool_cached_bytes': I,\n"
    "        'pool_held_bytes': I}\n"
    "CONN = {'address': S, 'state': S, 'transport': opt(S), 'conns_up': I, 'conns_total': I,\n"
    "        'bytes_in': I, 'bytes_out': I}\n"
    "PEER = {'address': S, 'node': opt(S), 'state': S, 'transport': opt(S), 'wanted': S,\n"
    "        'conns_up': I, 'conns_total': I, 'qps_up': I, 'inbound_up': I, 'rtt_us': I,\n"
    "        'rdma_rtt_us': I, 'bytes_in': I, 'bytes_out': I, 'reconnects': I, 'backoff_ms': I,\n"
    "        'data_out': I, 'data_in': I, 'data_bytes_out': I, 'data_bytes_in': I,\n"
    "        'data_frames_out': I, 'data_frames_in': I, 'rdma_bytes_out': I,\n"
    "        'rdma_blocks_out': I, 'rdma_writes_out': I, 'rdma_posts_out': I, 'last_error': opt(S)}\n"
    "CLIENT = {'pid': I, 'uid': I, 'name': S, 'job': opt(S), 'rank': opt(I), 'local_rank': opt(I),\n"
    "          'device': opt(S), 'connected_ms': I, 'attached_ms': opt(I), 'attached': opt(S)}\n"
    "CHECK = {'check': S, 'result': S, 'detail': S, 'action': S}\n"
    "# A list is [row]: at least one row, each of the row's schema.\n"
    "SCHEMAS = {\n"
    "    'status': {'version': S, 'state': S, 'pid': I, 'uptime_ms': I, 'backend': S,\n"
    "               'proto_version': I, 'clients': I, 'devices': [DEV], 'jobs': [JOB],\n"
    "               'job_events': [EVENT]},\n"
    "    'reload': {'message': S, 'applied': [S], 'restart': [S]},\n"
    "    'drain': {'result': S},\n"
    "    'drain_wait': {'result': S, 'waited_ms': I},\n"
    "    'peers': {'node': S, 'listen': opt(S), 'auth': S, 'rdma': opt(S), 'nic_bytes': I,\n"
    "              'proxy_threads': I, 'proxy_busy_us': I, 'peers': [PEER]},\n"
    "    'clients': {'left_out': I, 'clients': [CLIENT]},\n"
    "    'stats': {'warn_first_call_ratio': N, 'first_call_warnings': I, 'ended_jobs_kept': I,\n"
    "              'keep_jobs': I, 'keep_ms': I, 'tokens_left_out': I, 'ops': [OP],\n"
    "              'ranks': [RANK], 'balance': [BALANCE], 'pools': [POOL], 'peers': [CONN]},\n"
    "    'doctor': {'ok': B, 'checks': [CHECK]},\n"
    "    'version': {'version': S, 'proto_version': I,\n"
    "                'daemon': opt({'version': S, 'proto_version': I, 'backend': S})},\n"
    "    'genkey': {'key': S},\n"
    "    'error': {'error': {'code': I, 'name': S, 'message': S}},\n"
    "}\n"
    "def check(v, t, where):\n"
    "    if isinstance(t, tuple):\n"
    "        if v is None:\n"
    "            return\n"
    "        t = t[1]\n"
    "    if t == S:\n"
    "        assert isinstance(v, str), (where, 'not a string', v)\n"
    "    elif t == I:\n"
    "        assert isinstance(v, int) and not isinstance(v, bool), (where, 'not an integer', v)\n"
    "    elif t == N:\n"
    "        assert isinstance(v, (int, float)) and not isinstance(v, bool), (where, 'not a number', v)\n"
    "    elif t == B:\n"
    "        assert isinstance(v, bool), (where, 'not true or false', v)\n"
    "    elif t == INTS:\n"
    "        assert isinstance(v, list), (where, 'not a list of integers', v)\n"
    "        for i, x in enumerate(v):\n"
    "            check(x, I, '%s[%d]' % (where, i))\n"
    "    elif isinstance(t, list):\n"
    "        assert isinstance(v, list) and len(v) > 0, (where, 'not a list of rows', v)\n"
    "        for i, row in enumerate(v):\n"
    "            check(row, t[0], '%s[%d]' % (where, i))\n"
    "    else:\n"
    "        assert isinstance(v, dict), (where, 'not an object', v)\n"
    "        assert set(v) == set(t), (where, 'keys', sorted(set(v) ^ set(t)))\n"
    "        for k in t:\n"
    "            check(v[k], t[k], where + '.' + k)\n"
    "try:\n"
    "    for arg in sys.argv[1:]:\n"
    "        name, path = arg.split('=', 1)\n"
    "        text = open(path).read()\n"
    "        assert text.endswith('}\\n') and text.count('\\n') == 1, (name, 'not one line', text)\n"
    "        check(json.loads(text), SCHEMAS[name], name)\n"
    "except AssertionError as e:\n"
    "    sys.exit('%s' % (e,))\n"
    "print('held', len(sys.argv) - 1)\n";

/* deepepctl's --json output of args into dir/name.json, its exit code one of ok0 and ok1. */
static void json_output(const char *dir, const char *name, const char *const *args, int ok0,
                        int ok1, char *list, size_t len) {
  char *out, *err;
  int rc = ctl_run(args, &out, &err);
  ck_assert_msg(rc == ok0 || rc == ok1, "%s: exit %d: %s%s", name, rc, out, err);
  static unsigned n; /* each output a file of its own, a name's schema held by each */
  char path[300];
  dw_sfmt(path, sizeof path, "%s/%u-%s.json", dir, n++, name);
  ck_assert_int_eq(tu_write_file(path, out), 0);
  size_t used = strlen(list);
  dw_sfmt(list + used, len - used, " %s=%s", name, path);
  free(out);
  free(err);
}

/* Every command's --json holds its schema: a daemon with a peer that never answers and a job
 * whose ranks made one call of each op (no steady call: no median), and deepepctl's own
 * connection, which is no rank; a reload that changes a live key and one that needs a restart.
 * It once said "ok":"true", "rank":0 for no rank, "median_ns":0 for none, "listen":"-", and
 * reload's answer was one string ({"result": text}) naming no key a script could read. */
START_TEST(every_json_output_holds_its_types) {
  struct tu_daemon d;
  dw_start(&d, "peers: [{host: 127.0.0.1, port: 1}]\npeer_insecure: true\npeer_wait_ms: 0\n");
  struct st_rank r[ST_W];
  const struct st_plan plan = {.pairs = 1, .layouts = 1};
  st_job_start(r, &d, "json-types", &plan);
  /* An elastic job whose rank 1 left: its history has a row. */
  struct dep_attach_args e0 = job_args("json-elastic", 0, 2, 0, 2);
  struct dep_attach_args e1 = job_args("json-elastic", 1, 2, 1, 2);
  e0.flags = e1.flags = DEP_ATTACH_ELASTIC;
  int ef0 = attach_args(&d, &e0), ef1 = attach_args(&d, &e1);
  expect_ready(ef0, 2);
  expect_ready(ef1, 2);
  close(ef1);
  ck_assert(dw_log_has(&d, "it is masked", 5000));
  char list[4096] = "";
  const char *s = d.sock;
  json_output(d.dir, "status", DW_ARGS("-s", s, "--json", "status"), 0, 0, list, sizeof list);
  json_output(d.dir, "peers", DW_ARGS("-s", s, "--json", "peers"), 0, 0, list, sizeof list);
  json_output(d.dir, "clients", DW_ARGS("-s", s, "--json", "clients"), 0, 0, list, sizeof list);
  json_output(d.dir, "stats", DW_ARGS("-s", s, "--json", "stats"), 0, 0, list, sizeof list);
  /* The peer that never answers fails the connections check: exit 1, the object all the same. */
  json_output(d.dir, "doctor", DW_ARGS("-s", s, "--json", "doctor"), 0, 1, list, sizeof list);
  json_output(d.dir, "version", DW_ARGS("-s", s, "--json", "version"), 0, 0, list, sizeof list);
  /* A file that changes a live key and one that needs a restart: both lists have a key. */
  char *conf = dw_slurp(d.conf), *more = malloc(strlen(conf) + 64);
  ck_assert_ptr_nonnull(more);
  sprintf(more, "%slog_level: debug\nconnection_pool_size: 3\n", conf);
  ck_assert_int_eq(tu_write_file(d.conf, more), 0);
  free(conf);
  free(more);
  json_output(d.dir, "reload", DW_ARGS("-s", s, "--json", "reload"), 0, 0, list, sizeof list);
  json_output(d.dir, "drain", DW_ARGS("-s", s, "--json", "drain"), 0, 0, list, sizeof list);
  json_output(d.dir, "drain", DW_ARGS("-s", s, "--json", "drain", "--cancel"), 0, 0, list,
              sizeof list);
  json_output(d.dir, "genkey", DW_ARGS("--json", "genkey"), 0, 0, list, sizeof list);
  json_output(d.dir, "error", DW_ARGS("-s", s, "--json", "stats", "no-such-job"), 1, 1, list,
              sizeof list);
  /* Once the job has ended, a drain that waits says how long it waited. */
  st_job_end(r, false);
  close(ef0);
  json_output(d.dir, "drain_wait", DW_ARGS("-s", s, "--json", "drain", "--wait"), 0, 0, list,
              sizeof list);
  json_output(d.dir, "drain", DW_ARGS("-s", s, "--json", "drain", "--cancel"), 0, 0, list,
              sizeof list);
  char py[300], res[300], cmd[4600];
  dw_sfmt(py, sizeof py, "%s/schema.py", d.dir);
  dw_sfmt(res, sizeof res, "%s/schema.out", d.dir);
  ck_assert_int_eq(tu_write_file(py, ctl_json_schema_py), 0);
  dw_sfmt(cmd, sizeof cmd, "/usr/bin/python3 %s%s > %s 2>&1", py, list, res);
  int rc = system(cmd);
  char *said = dw_slurp(res);
  ck_assert_msg(rc == 0, "a --json output does not hold its schema: %.2000s", said);
  free(said);
  dw_stop_ok(&d);
}
END_TEST

Suite *ctl_json_suite(void);
Suite *ctl_json_suite(void) {
  Suite *s = suite_create("ctl_json");
  TCase *daemon = tcase_create("daemon");
  tcase_add_test(daemon, every_json_output_holds_its_types);
  tcase_add_test(daemon, clients_name_each_connections_program);
  tcase_set_timeout(daemon, 60);
  suite_add_tcase(s, daemon);
  return s;
}
