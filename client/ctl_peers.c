/*
 * ctl_peers.c — `deepepctl peers`: the peer daemons deepepd is configured
 * with and how each is: state, transport (configured and settled),
 * connections up of the pool and of them those on RDMA queue pairs,
 * inbound connections, round trips of the last keep-alives (the TCP link's
 * and the queue pair's), bytes (the data path's over TCP and as RDMA
 * writes), reconnects and the last error; the RDMA
 * device and the bytes registered with it (the exchange regions of running
 * multi-node jobs); as a table or --json.
 */
#include <stdio.h>
#include <stdlib.h>

#include "client_internal.h"
#include "ctl.h"

static const struct ctl_col peers_fields[] = {
    {"node", "node", CTL_STR, 0},
    {"listen", "listen", CTL_STR, 0},
    {"auth", "auth", CTL_STR, 0},
    {"rdma", "rdma", CTL_STR, 0},
    {"nic_bytes", "registered", CTL_BYTES, 0},
    {"proxy_threads", "proxy threads", CTL_UINT, 0},
    {"proxy_busy_us", "proxy busy us", CTL_UINT, 0},
};
#define PEERS_NFIELDS (sizeof peers_fields / sizeof peers_fields[0])

static const struct ctl_col peer_cols[] = {
    {"address", "PEER", CTL_STR, 0},
    {"node", "NODE", CTL_STR, 0},
    {"state", "STATE", CTL_STR, 0},
    {"transport", "TRANSPORT", CTL_STR, 0},
    {"wanted", "WANTED", CTL_STR, 0},
    {"conns_up", "CONNS", CTL_UINT, 0},
    {"conns_total", "", CTL_UINT, CTL_COL_JOIN},
    {"qps_up", "QPS", CTL_UINT, 0},
    {"inbound_up", "IN", CTL_UINT, 0},
    {"rtt_us", "RTT_US", CTL_UINT, 0},
    {"rdma_rtt_us", "QP_RTT_US", CTL_UINT, 0},
    {"bytes_in", "RX", CTL_BYTES, 0},
    {"bytes_out", "TX", CTL_BYTES, 0},
    {"reconnects", "RECONNECTS", CTL_UINT, 0},
    {"backoff_ms", "BACKOFF", CTL_MS, 0},
    {"data_out", "DATA", CTL_UINT, 0},
    {"data_in", "", CTL_UINT, CTL_COL_JOIN},
    {"data_bytes_out", "DATA_TX", CTL_BYTES, 0},
    {"data_bytes_in", "DATA_RX", CTL_BYTES, 0},
    {"data_frames_out", "FRAMES_TX", CTL_UINT, 0},
    {"data_frames_in", "FRAMES_RX", CTL_UINT, 0},
    {"rdma_bytes_out", "RDMA_TX", CTL_BYTES, 0},
    {"rdma_blocks_out", "RDMA_BLOCKS", CTL_UINT, CTL_COL_NOTEXT},
    {"rdma_writes_out", "RDMA_WRITES", CTL_UINT, CTL_COL_NOTEXT},
    {"rdma_posts_out", "RDMA_POSTS", CTL_UINT, CTL_COL_NOTEXT},
    {"last_error", "LAST ERROR", CTL_STR, 0},
};
#define PEER_NCOLS (sizeof peer_cols / sizeof peer_cols[0])

/* How peers authenticate.  The daemon says only whether a key is in use; without one, peers
 * or a listener run only with peer_insecure (the daemon refuses to start otherwise), and a
 * daemon with neither has no peer links to authenticate at all. */
static const char *peers_auth(const struct dep_msg_peers *m) {
  if (m->auth)
    return "peer_key_file";
  if (m->n_peers == 0 && m->listen[0] == '\0')
    return "none (no peers or listener configured)";
  return "none (peer_insecure)";
}

static int peers_render(const struct ctl *ctl, const struct dep_msg_peers *m) {
  const struct ctl_val fields[PEERS_NFIELDS] = {
      {.s = m->node},
      {.s = m->listen, .none = m->listen[0] == '\0'},
      {.s = peers_auth(m)},
      {.s = m->rdma, .none = m->rdma[0] == '\0'},
      {.u = m->nic_bytes},
      {.u = m->proxy_threads},
      {.u = m->proxy_busy_us},
  };
  struct ctl_val *cells = calloc((size_t)m->n_peers * PEER_NCOLS + 1, sizeof *cells);
  if (cells == NULL)
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  for (uint32_t i = 0; i < m->n_peers; i++) {
    const struct dep_msg_peer_info *p = &m->peers[i];
    struct ctl_val *row = cells + (size_t)i * PEER_NCOLS;
    row[0].s = p->address;
    /* What a peer has not yet (a name, a transport, an error) is "-" in text, null in JSON. */
    row[1] = (struct ctl_val){.s = p->node, .none = p->node[0] == '\0'};
    row[2].s = p->state;
    row[3] = (struct ctl_val){.s = p->transport, .none = p->transport[0] == '\0'};
    row[4].s = p->wanted;
    row[5].u = p->conns_up;
    row[6].u = p->conns_total;
    row[7].u = p->qps_up;
    row[8].u = p->inbound_up;
    row[9].u = p->rtt_us;
    row[10].u = p->rdma_rtt_us;
    row[11].u = p->bytes_in;
    row[12].u = p->bytes_out;
    row[13].u = p->reconnects;
    row[14].u = p->backoff_ms;
    row[15].u = p->data_out;
    row[16].u = p->data_in;
    row[17].u = p->data_bytes_out;
    row[18].u = p->data_bytes_in;
    row[19].u = p->data_frames_out;
    row[20].u = p->data_frames_in;
    row[21].u = p->rdma_bytes_out;
    row[22].u = p->rdma_blocks_out;
    row[23].u = p->rdma_writes_out;
    row[24].u = p->rdma_posts_out;
    row[25] = (struct ctl_val){.s = p->last_error, .none = p->last_error[0] == '\0'};
  }
  const struct ctl_table tables[] = {
      {"peers", "no peers configured", peer_cols, PEER_NCOLS, m->n_peers, cells, 0},
  };
  const struct ctl_doc doc = {peers_fields, fields, PEERS_NFIELDS, tables, 1};
  int rc = ctl_out_render(stdout, &doc, ctl->json);
  free(cells);
  if (rc != 0)
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  return CTL_EXIT_OK;
}

int ctl_peers(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  dep_client_t *c = ctl_connect(ctl);
  if (c == NULL)
    return CTL_EXIT_FAIL;
  struct dep_msg_peers m = {0};
  rc = ctl_ask(c, DEP_MSG_PEERS, NULL, DEP_MSG_PEERS_OK, ctl_decode_peers, &m);
  if (rc != 0)
    return ctl_fail_client(ctl, c, rc, "peers");
  dep_client_free(c);
  rc = peers_render(ctl, &m);
  proto_peers_free(&m);
  return ctl_finish_output(rc);
}
