/*
 * xfer_rdma.c — blocks between nodes as RDMA writes (xfer_rdma.h): the
 * data queue pairs per peer, each job's targets, and the proxy threads'
 * chains of work requests.
 */
#include "xfer_rdma.h"

#include <errno.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "job.h"
#include "kabi.h"
#include "log.h"
#include "peer.h"
#include "peerauth.h"
#include "rdmaxp.h"
#include "testhooks.h"
#include "xfer.h"
#include "xfer_rdma_internal.h"

/* The state is xfer_rdma_internal.h's. */
struct xfer_rdma_state xfer_rdma__state;

static _Thread_local struct xr_thread *XT;

static void nap_us(long us) {
  struct timespec ts = {0, us * 1000l};
  nanosleep(&ts, NULL);
}

static uint64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000ull + (uint64_t)ts.tv_nsec / 1000000ull;
}

/* ---- the data queue pairs (the loop) ---------------------------------------------- */

/*
 * A connection request that names no link's offer: its token must be one
 * the data path offered, and its proof must hold (a MAC with the key
 * derived for this direction, peer_data_key) before the offer is spent.
 * A request that names an offer but fails the proof takes nothing: the
 * offer stays open for the peer, whose own request may come after.
 */
static void *on_accept(const struct dep_xfer_rdma_req *req, bool *said) {
  const int k = XR.offers->peer(req->token);
  if (k < 0 || k >= CONFIG_MAX_LIST)
    return NULL;
  struct xr_peer *p = &XR.p[k];
  uint64_t n;
  *said = true;
  if (req->version != DEP_XFER_VERSION) {
    /* Before version 3 a request had zeros where the version is. */
    if (xfer_say_now(&p->bad_versions, &n))
      log_warnx("peer %s: %llu RDMA data queue pair request(s) of data stream version %u%s (this "
                "deepepd speaks %u) are rejected: run the same deepepd on every node",
                peer_name(k), (unsigned long long)n, (unsigned)req->version,
                req->version == 0 ? " (1 or 2: they carry none)" : "", DEP_XFER_VERSION);
    return NULL;
  }
  uint8_t dkey[DEP_PEER_MAC_LEN];
  peer_data_key(k, false, dkey);
  const bool proven = peerauth_rdma_check(dkey, req->version, req->token, req->proof);
  sodium_memzero(dkey, sizeof dkey);
  if (!proven) {
    if (xfer_say_now(&p->bad_proofs, &n))
      log_warnx("peer %s: %llu RDMA data queue pair request(s) that named a token offered to it "
                "but did not prove the peer key are rejected: a different peer_key_file there, "
                "or someone who saw the token on the wire", peer_name(k), (unsigned long long)n);
    return NULL;
  }
  if (XR.offers->spend(req->token) != k) {
    *said = false; /* spent or withdrawn meanwhile: it names no open offer now */
    return NULL;
  }
  return &XR.ends[0][k];
}

/* Open our data queue pair to peer k with token (its proof made here);
 * NULL with why. */
static struct rdmaxp_qp *open_out(int k, const uint8_t token[DEP_PEER_TOKEN_LEN], bool wrong,
                                  char *why, size_t whylen) {
  struct sockaddr_storage dst;
  socklen_t dl = sizeof dst;
  if (peer_data_address(k, &dst, &dl) != 0) {
    snprintf(why, whylen, "the peer has no address here");
    return NULL;
  }
  /* The test's wrong proof is one made for the other direction: with the
   * key we hold, but not the one this direction's requests prove. */
  uint8_t dkey[DEP_PEER_MAC_LEN], proof[DEP_XFER_RDMA_PROOF_LEN];
  peer_data_key(k, !wrong, dkey);
  peerauth_rdma_proof(dkey, DEP_XFER_VERSION, token, proof);
  sodium_memzero(dkey, sizeof dkey);
  return rdmaxp_data_connect(&XR.ends[wrong ? 2 : 1][k], (struct sockaddr *)&dst, token, proof,
                             why, whylen);
}

/* Peer k's token is spent on no queue pair of ours after all: a TCP data
 * connection spends it, in case the peer offered no extra one for us. */
static void token_to_tcp(int k, const uint8_t token[DEP_PEER_TOKEN_LEN]) {
  struct dep_peer_data_offer o;
  memcpy(o.token, token, sizeof o.token);
  XR.offers->to_tcp(k, &o);
}

/* The test's request with a wrong proof was rejected (or failed): our own
 * queue pair is opened now with the same token, which must still be open. */
static void wrong_done(int k, const char *why) {
  struct xr_peer *p = &XR.p[k];
  p->wrong = NULL;
  log_info("peer %s: the RDMA data queue pair with a wrong proof ($" TESTHOOK_RDMA_BAD_PROOFS_ENV
           ") did not connect (%s); opening ours with the same token", peer_name(k), why);
  char w[256];
  struct rdmaxp_qp *q = open_out(k, p->token, false, w, sizeof w);
  if (q == NULL) {
    p->no_rdma = true;
    log_warnx("peer %s: data path over TCP: no queue pair can be opened (%s)", peer_name(k), w);
    token_to_tcp(k, p->token);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->out = q;
  pthread_mutex_unlock(&p->mu);
}

static void on_up(void *owner, struct rdmaxp_qp *q, const uint8_t *priv, size_t privlen) {
  struct xr_end *e = owner;
  struct xr_peer *p = &XR.p[e->peer];
  if (e->wrong) {
    log_warnx("peer %s: the RDMA data queue pair with a wrong proof ($" TESTHOOK_RDMA_BAD_PROOFS_ENV
              ") was accepted: the peer opened it on the token alone", peer_name(e->peer));
    return; /* it stays, unused, until the peer goes down */
  }
  if (!e->out) {
    if (p->in != NULL && p->in != q)
      rdmaxp_close(p->in); /* the peer opened a new one: its old one is gone there */
    p->in = q;
    log_debug("peer %s: its blocks for us come by RDMA writes", peer_name(e->peer));
    return;
  }
  struct dep_xfer_rdma_stage st;
  const bool staged = xfer_rdma__stage_far(e->peer, priv, privlen, &st);
  pthread_mutex_lock(&p->mu);
  bool ours = p->out == q;
  if (ours) {
    p->broken = false;
    p->posted = p->done = 0;
    atomic_store(&p->ready, true);
    p->far = st;
    p->far_known = staged;
    p->staged = 0;
    xfer_rdma__stage_credit_now(e->peer, p);
  }
  pthread_mutex_unlock(&p->mu);
  p->was_up |= ours;
  if (ours)
    log_info("peer %s: data path over RDMA (a queue pair of its own on %s): blocks for its "
             "ranks are written into their exchange regions", peer_name(e->peer), rdmaxp_device());
}

static void on_down(void *owner, struct rdmaxp_qp *q, const char *why) {
  struct xr_end *e = owner;
  struct xr_peer *p = &XR.p[e->peer];
  if (e->wrong) {
    if (p->wrong == q)
      wrong_done(e->peer, why);
    return;
  }
  if (!e->out) {
    if (p->in == q)
      p->in = NULL;
    return;
  }
  pthread_mutex_lock(&p->mu);
  bool ours = p->out == q, inflight = ours && p->posted != p->done;
  if (ours) {
    p->out = NULL;
    atomic_store(&p->ready, false);
    p->far_known = false;
  }
  pthread_mutex_unlock(&p->mu);
  if (!ours)
    return;
  if (!p->was_up) {
    /* It never connected (the peer has no RDMA, or no route to it): the
     * token it carried was never spent there, so a TCP data connection
     * spends it, in case the peer offered no extra one for us. */
    p->no_rdma = true;
    log_warnx("peer %s: data path over TCP: its queue pair did not connect (%s)",
              peer_name(e->peer), why);
    token_to_tcp(e->peer, p->token);
    return;
  }
  if (inflight)
    atomic_fetch_or(&XR.lost, 1ull << e->peer);
  log_warnx("peer %s: the data path's queue pair closed (%s): blocks go over TCP%s",
            peer_name(e->peer), why, inflight ? "; the jobs whose writes were in flight fail" : "");
}

static const struct rdmaxp_data_events xr_events = {
    .accept = on_accept, .reply = xfer_rdma__stage_reply, .up = on_up, .down = on_down};

void xfer_rdma_init(const struct config *cfg, const struct xfer_rdma_offers *offers) {
  memset(&XR, 0, sizeof XR);
  XR.cfg = cfg;
  XR.offers = offers;
  for (int k = 0; k < CONFIG_MAX_LIST; k++) {
    pthread_mutex_init(&XR.p[k].mu, NULL);
    pthread_mutex_init(&XR.p[k].in_mu, NULL);
    XR.ends[0][k] = (struct xr_end){.peer = k, .out = false};
    XR.ends[1][k] = (struct xr_end){.peer = k, .out = true};
    XR.ends[2][k] = (struct xr_end){.peer = k, .out = true, .wrong = true};
  }
  XR.test_bad_proofs = testhook_value(TESTHOOK_RDMA_BAD_PROOFS);
  rdmaxp_set_data_events(&xr_events);
  XR.active = true;
}

void xfer_rdma_fini(void) {
  if (!XR.active)
    return;
  for (int k = 0; k < CONFIG_MAX_LIST; k++) {
    xfer_rdma_peer_down(k);
    xfer_rdma__stage_free(&XR.p[k]);
  }
  atomic_store(&XR.staging, 0);
  rdmaxp_set_data_events(NULL);
  XR.active = false;
}

void xfer_rdma_peer_stats(int k, struct xfer_rdma_stats *out) {
  memset(out, 0, sizeof *out);
  if (!XR.active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  const struct xr_count *c = &XR.sent[k];
  out->blocks = atomic_load_explicit(&c->blocks, memory_order_relaxed);
  out->writes = atomic_load_explicit(&c->writes, memory_order_relaxed);
  out->posts = atomic_load_explicit(&c->posts, memory_order_relaxed);
  out->bytes = atomic_load_explicit(&c->bytes, memory_order_relaxed);
}

bool xfer_rdma_wanted(int k) {
  return XR.active && k >= 0 && (size_t)k < XR.cfg->n_peers && rdmaxp_active() &&
         config_peer_transport(XR.cfg, &XR.cfg->peers[k]) != CONFIG_TRANSPORT_TCP;
}

bool xfer_rdma_on_offer(int k, const uint8_t token[DEP_PEER_TOKEN_LEN]) {
  if (!xfer_rdma_wanted(k) || XR.p[k].no_rdma)
    return false;
  struct xr_peer *p = &XR.p[k];
  pthread_mutex_lock(&p->mu);
  bool have = p->out != NULL;
  pthread_mutex_unlock(&p->mu);
  if (have || p->wrong != NULL)
    return false;
  char why[256];
  /* The test's request with a wrong proof goes first; ours follows once it is rejected. */
  const bool wrong = XR.test_bad_proofs > 0;
  struct rdmaxp_qp *q = open_out(k, token, wrong, why, sizeof why);
  if (q == NULL) {
    log_warnx("peer %s: data path over TCP: no queue pair can be opened (%s)", peer_name(k), why);
    return false; /* the token is still good: a TCP data connection spends it */
  }
  memcpy(p->token, token, sizeof p->token);
  p->was_up = false;
  if (wrong) {
    XR.test_bad_proofs--;
    p->wrong = q;
    return true;
  }
  pthread_mutex_lock(&p->mu);
  p->out = q;
  pthread_mutex_unlock(&p->mu);
  return true;
}

void xfer_rdma_peer_down(int k) {
  if (!XR.active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  struct xr_peer *p = &XR.p[k];
  pthread_mutex_lock(&p->mu);
  struct rdmaxp_qp *q = p->out;
  p->out = NULL;
  atomic_store(&p->ready, false);
  p->broken = false;
  p->posted = p->done = 0;
  p->far_known = false;
  p->staged = 0;
  xfer_rdma__stage_reset(p); /* the peer's credits for our frames start anew */
  pthread_mutex_unlock(&p->mu);
  rdmaxp_close(q); /* no proxy thread holds it: they take mu first */
  rdmaxp_close(p->in);
  p->in = NULL;
  rdmaxp_close(p->wrong);
  p->wrong = NULL;
  p->was_up = p->no_rdma = false; /* the next time it is up, RDMA is tried again */
}

/* ---- completions (mu held) ----------------------------------------------------------- */

/* Retire what completed on p's queue pair; false when a request failed. */
static bool reap(int k, struct xr_peer *p) {
  if (p->broken)
    return false;
  struct ibv_wc wc[16];
  int n;
  while (p->posted != p->done && (n = ibv_poll_cq(rdmaxp_qp_cq(p->out), 16, wc)) != 0) {
    if (n < 0) {
      log_warnx("peer %s: ibv_poll_cq on the data queue pair failed", peer_name(k));
      p->broken = true;
      break;
    }
    for (int i = 0; i < n && !p->broken; i++) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        log_warnx("peer %s: an RDMA write of the data path failed: %s; its jobs fail, and "
                  "later ones send over TCP", peer_name(k), rdmaxp_wc_status(wc[i].status));
        p->broken = true;
      } else if (wc[i].wr_id > p->done) {
        p->done = wc[i].wr_id; /* a signalled request retires those before it */
      }
    }
  }
  if (p->broken)
    atomic_store(&p->ready, false);
  return !p->broken;
}

/* ---- routes (the loop) --------------------------------------------------------------- */

/* Number the ranks held here and fill ri_at: on node k, a rank held here is
 * remote rank number g - (the ranks below g that node k holds).  false: no
 * memory. */
static bool remote_numbers(struct xfer_rdma_route *xr) {
  uint32_t n_local = 0, seen[CONFIG_MAX_LIST] = {0};
  for (uint32_t g = 0; g < xr->world; g++)
    if (xr->dest[g].peer < 0)
      xr->dest[g].local = n_local++;
  xr->ri_at = calloc((size_t)n_local * CONFIG_MAX_LIST + 1, sizeof *xr->ri_at);
  if (xr->ri_at == NULL)
    return false;
  for (uint32_t g = 0; g < xr->world; g++) {
    const struct xr_dest *d = &xr->dest[g];
    if (d->peer >= 0) {
      if (d->peer < CONFIG_MAX_LIST)
        seen[d->peer]++;
      continue;
    }
    for (int k = 0; k < CONFIG_MAX_LIST; k++)
      xr->ri_at[(size_t)d->local * CONFIG_MAX_LIST + k] = g - seen[k];
  }
  return true;
}

struct xfer_rdma_route *xfer_rdma_route_new(const struct job *j, const int16_t *who,
                                            xfer_membership_fn *membership) {
  if (!XR.active || !rdmaxp_active())
    return NULL;
  struct xfer_rdma_route *xr = calloc(1, sizeof *xr + j->world_size * sizeof xr->dest[0]);
  if (xr == NULL)
    return NULL;
  snprintf(xr->id, sizeof xr->id, "%s", j->id);
  xr->world = j->world_size;
  uint32_t keyed[CONFIG_MAX_LIST] = {0}, ranks[CONFIG_MAX_LIST] = {0};
  int64_t bare[CONFIG_MAX_LIST];
  bool laid[CONFIG_MAX_LIST] = {false}, unlaid[CONFIG_MAX_LIST] = {false};
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    bare[k] = -1;
  for (uint32_t g = 0; g < xr->world; g++) {
    struct xr_dest *d = &xr->dest[g];
    d->peer = who[g] >= 0 ? who[g] : -1;
    if (d->peer < 0 || d->peer >= CONFIG_MAX_LIST)
      continue;
    xr->peers |= 1ull << d->peer;
    ranks[d->peer]++;
    const struct dep_peer_membership *m = membership(j, d->peer);
    char why[256];
    /* A node's exchange regions are laid out for its own count of remote ranks. */
    if (m != NULL && !laid[d->peer]) {
      laid[d->peer] = true;
      /* Its chunk is the job's (job_members.c checks that every node's is). */
      if (dep__slab_layout_nodes(&j->shape, j->world_size, m->local_world_size, j->chunk_rows,
                                &xr->lay_of[d->peer], why, sizeof why) != 0) {
        log_warnx("job %s: node %s: %s", xr->id, peer_name(d->peer), why);
        unlaid[d->peer] = true;
      }
    }
    if (m != NULL && unlaid[d->peer])
      m = NULL;
    uint32_t idx = UINT32_MAX;
    for (uint32_t i = 0; m != NULL && i < m->n_ranks; i++)
      if (m->ranks[i] == g)
        idx = i;
    bool ok = idx != UINT32_MAX;
    /* job_members.c checked that a rank's windows cover its exchange region in order. */
    for (uint32_t w = 0; ok && w < m->n_windows; w++) {
      const struct dep_peer_window *v = &m->windows[w];
      if (v->rank_index != idx)
        continue;
      if (v->rkey == 0 || d->n == XR_WIN_MAX) {
        ok = false;
        break;
      }
      d->w[d->n++] = (struct xr_win){v->slab_off, v->len, v->addr, v->rkey};
    }
    if (!ok || d->n == 0) {
      d->n = 0;
      if (bare[d->peer] < 0)
        bare[d->peer] = g;
    } else {
      keyed[d->peer]++;
    }
  }
  if (!remote_numbers(xr)) {
    free(xr);
    return NULL;
  }
  for (int k = 0; k < CONFIG_MAX_LIST; k++) {
    if (!(xr->peers >> k & 1))
      continue;
    if (bare[k] >= 0)
      log_info("job %s: blocks for rank %lld on node %s go over TCP: its exchange region is not "
               "registered with that node's NIC (%u of its %u ranks there are)", xr->id,
               (long long)bare[k], peer_name(k), keyed[k], ranks[k]);
    if (keyed[k] > 0)
      log_info("job %s: blocks for %u rank(s) on node %s go by RDMA writes%s", xr->id, keyed[k],
               peer_name(k), atomic_load(&XR.p[k].ready)
                                 ? ""
                                 : " once the data queue pair is up (over TCP until then)");
  }
  return xr;
}

void xfer_rdma_route_free(struct xfer_rdma_route *xr) {
  if (xr == NULL)
    return;
  /* A write in flight reads our exchange region and lands in the peer's:
   * both must still be this job's when it does. */
  for (int k = 0; k < CONFIG_MAX_LIST; k++) {
    if (!(xr->peers >> k & 1))
      continue;
    struct xr_peer *p = &XR.p[k];
    uint64_t until = mono_ms() + XR_QUIESCE_MS;
    pthread_mutex_lock(&p->mu);
    while (p->out != NULL && p->posted != p->done && reap(k, p) && mono_ms() < until) {
      pthread_mutex_unlock(&p->mu);
      nap_us(20);
      pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    struct xr_count *c = &xr->by_peer[k];
    uint64_t blocks = atomic_load(&c->blocks), writes = atomic_load(&c->writes),
             posts = atomic_load(&c->posts), bytes = atomic_load(&c->bytes);
    if (blocks > 0)
      log_info("job %s: to node %s by RDMA: %llu blocks in %llu writes over %llu posts, %llu "
               "bytes (%.0f bytes per write, %.1f writes per post)", xr->id, peer_name(k),
               (unsigned long long)blocks, (unsigned long long)writes, (unsigned long long)posts,
               (unsigned long long)bytes, writes ? (double)bytes / (double)writes : 0.0,
               posts ? (double)writes / (double)posts : 0.0);
  }
  free(xr->ri_at);
  free(xr);
}

/* ---- the proxy threads' chains ----------------------------------------------------- */

/* Post thread chain c to peer k (its requests already linked); false when they are lost. */
static bool chain_post(int k, struct xr_chain *c) {
  struct xr_peer *p = &XR.p[k];
  const uint32_t depth = rdmaxp_data_depth(), every = depth / 4;
  bool ok = false;
  pthread_mutex_lock(&p->mu);
  if (p->out == NULL || !atomic_load(&p->ready) || p->broken)
    goto out;
  /* Room first: never more than the send queue outstanding. */
  uint64_t until = 0;
  while (p->posted + c->n - p->done > depth) {
    if (!reap(k, p))
      goto out;
    if (p->posted + c->n - p->done <= depth)
      break;
    if (until == 0)
      until = mono_ms() + XR_ROOM_MS;
    if (mono_ms() > until) {
      log_warnx("peer %s: the data queue pair completed nothing for %llu ms; its jobs fail",
                peer_name(k), (unsigned long long)XR_ROOM_MS);
      p->broken = true;
      atomic_store(&p->ready, false);
      goto out;
    }
    nap_us(1); /* rxe moves nothing while its poller holds the CPU (shared/rdma-vm) */
  }
  for (uint32_t i = 0; i < c->n; i++) {
    uint64_t id = p->posted + i + 1;
    c->wr[i].wr_id = id;
    c->wr[i].next = i + 1 < c->n ? &c->wr[i + 1] : NULL;
    c->wr[i].send_flags = i + 1 == c->n || id % every == 0 ? IBV_SEND_SIGNALED : 0;
  }
  struct ibv_send_wr *bad = NULL;
  int rc = ibv_post_send(rdmaxp_qp_verbs(p->out), &c->wr[0], &bad);
  if (rc != 0) {
    log_warnx("peer %s: ibv_post_send of %u RDMA writes failed: %s; its jobs fail",
              peer_name(k), c->n, strerror(rc));
    p->broken = true;
    atomic_store(&p->ready, false);
    goto out;
  }
  p->posted += c->n;
  for (uint32_t i = 0; i < c->n_routes; i++)
    atomic_fetch_add_explicit(&c->routes[i]->by_peer[k].posts, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&XR.sent[k].posts, 1, memory_order_relaxed);
  (void)reap(k, p);
  ok = true;
out:
  pthread_mutex_unlock(&p->mu);
  c->n = 0;
  c->n_routes = 0;
  return ok;
}

uint64_t xfer_rdma_flush(void) {
  uint64_t failed = atomic_exchange(&XR.lost, 0);
  if (XT == NULL)
    return failed;
  for (int k = 0; k < CONFIG_MAX_LIST; k++) {
    if (XT->queued >> k & 1) {
      if (!chain_post(k, XT->chain[k]))
        failed |= 1ull << k;
      XT->outstanding |= 1ull << k;
    } else if (XT->outstanding >> k & 1) {
      /* Retire what the last chains left, so that the route's end finds them done. */
      struct xr_peer *p = &XR.p[k];
      if (pthread_mutex_trylock(&p->mu) == 0) {
        if (p->out == NULL || p->posted == p->done || !reap(k, p) || p->posted == p->done)
          XT->outstanding &= ~(1ull << k);
        pthread_mutex_unlock(&p->mu);
      }
    }
  }
  XT->queued = 0;
  return failed;
}

void xfer_rdma_thread_end(void) {
  if (XT == NULL)
    return;
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    free(XT->chain[k]);
  free(XT);
  XT = NULL;
}

bool xfer_rdma__chain_add(int k, struct xfer_rdma_route *xr, const struct ibv_send_wr *wr,
                          const struct ibv_sge *sge, uint32_t n, uint64_t bytes) {
  if (XT == NULL && (XT = calloc(1, sizeof *XT)) == NULL)
    return false;
  struct xr_chain *c = XT->chain[k];
  if (c == NULL && (c = XT->chain[k] = calloc(1, sizeof *c)) == NULL)
    return false;
  if (c->n + n > XR_CHAIN) {
    if (!chain_post(k, c)) {
      /* What the chain held is lost: its routes fail at the sweep's end. */
      atomic_fetch_or(&XR.lost, 1ull << k);
      XT->queued &= ~(1ull << k);
      return false;
    }
    XT->outstanding |= 1ull << k;
  }
  for (uint32_t i = 0; i < n; i++) {
    c->wr[c->n + i] = wr[i];
    c->sge[c->n + i] = sge[i];
    c->wr[c->n + i].sg_list = &c->sge[c->n + i];
  }
  c->n += n;
  XT->queued |= 1ull << k;
  bool seen = xr == NULL;
  for (uint32_t i = 0; i < c->n_routes && !seen; i++)
    seen = c->routes[i] == xr;
  if (!seen && c->n_routes < 8)
    c->routes[c->n_routes++] = xr;
  struct xr_count *counts[] = {&XR.sent[k], xr != NULL ? &xr->by_peer[k] : NULL};
  for (int i = 0; i < 2 && counts[i] != NULL; i++) {
    atomic_fetch_add_explicit(&counts[i]->blocks, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&counts[i]->writes, n, memory_order_relaxed);
    atomic_fetch_add_explicit(&counts[i]->bytes, bytes, memory_order_relaxed);
  }
  return true;
}

/* The segments of bytes [src, src + len) of an exchange region here
 * (registered as mr) written to dst_off of the target's exchange region,
 * split where a target window ends.  Returns how many, or 0 when they do
 * not fit in max (or the target has no window there). */
static uint32_t segments(const struct ibv_mr *mr, const uint8_t *src, const struct xr_dest *d,
                         uint64_t dst_off, uint64_t len, struct ibv_send_wr *wr,
                         struct ibv_sge *sge, uint32_t max) {
  uint32_t n = 0;
  while (len > 0) {
    const struct xr_win *w = NULL;
    for (uint32_t x = 0; x < d->n && w == NULL; x++)
      if (dst_off >= d->w[x].slab_off && dst_off < d->w[x].slab_off + d->w[x].len)
        w = &d->w[x];
    if (w == NULL || n == max)
      return 0;
    uint64_t room = w->slab_off + w->len - dst_off, take = len < room ? len : room;
    if (take > UINT32_MAX)
      take = UINT32_MAX & ~4095u;
    sge[n] = (struct ibv_sge){.addr = (uint64_t)(uintptr_t)src, .length = (uint32_t)take,
                              .lkey = rdmaxp_mr_lkey(mr)};
    wr[n] = (struct ibv_send_wr){.sg_list = &sge[n], .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE};
    wr[n].wr.rdma.remote_addr = w->addr + (dst_off - w->slab_off);
    wr[n].wr.rdma.rkey = w->rkey;
    n++;
    src += take;
    dst_off += take;
    len -= take;
  }
  return n;
}

/* Source rank src's number among the ranks that peer k does not hold: where
 * its blocks land in the exchange regions of k's ranks (slab.h). */
bool xfer_rdma_take(struct xfer_rdma_route *xr, int k, const struct ibv_mr *mr, uint32_t src,
                    const struct dep_xring_desc *d, const struct xfer_src *s) {
  if (xr == NULL || mr == NULL || d->dest >= xr->world || xr->dest[d->dest].n == 0 || k < 0 ||
      k >= CONFIG_MAX_LIST || src >= xr->world || xr->dest[src].peer >= 0 ||
      !atomic_load_explicit(&XR.p[k].ready, memory_order_acquire))
    return false;
  const struct xr_dest *t = &xr->dest[d->dest];
  const struct dep_slab_layout *tl = &xr->lay_of[k];
  const unsigned par = d->parity;
  const uint32_t ri = xr->ri_at[(size_t)xr->dest[src].local * CONFIG_MAX_LIST + k];
  /* Payload, then the chunk's mark, then the slot's fields, then its flag
   * (or a credit word alone): the same queue pair places them in that
   * order, so a reader that sees a mark or the flag sees what came before. */
  struct ibv_send_wr wr[XR_SEGS + 3];
  struct ibv_sge sge[XR_SEGS + 3];
  uint32_t n = 0, m;
  if (s->payload != NULL && d->bytes > 0) {
    if ((n = segments(mr, s->payload, t, dep_slab_in_block(tl, par, ri) + s->at, d->bytes, wr,
                      sge, XR_SEGS)) == 0)
      return false;
  }
  if (s->mark != NULL) {
    if ((m = segments(mr, s->mark, t, dep_slab_in_mark(tl, par, ri, s->chunk), sizeof(uint64_t),
                      wr + n, sge + n, 1)) == 0)
      return false;
    n += m;
  }
  if (s->slot != NULL) {
    const uint64_t slot_dst = dep_slab_in_slot(tl, par, ri);
    const uint64_t fields = offsetof(struct ops_slot, tail) - 8;
    if (segments(mr, s->slot + 8, t, slot_dst + 8, fields, wr + n, sge + n, 1) == 0 ||
        segments(mr, s->slot, t, slot_dst, 8, wr + n + 1, sge + n + 1, 1) == 0)
      return false;
    n += 2;
  }
  if (s->credit != NULL) {
    /* Into the destination's out slot for its channel to src, or its taken
     * word (one queue pair: a later word lands after an earlier one). */
    const uint64_t at = dep_slab_out_slot(tl, par, ri) +
                        (d->kind == DEP_XRING_TAKEN ? offsetof(struct ops_slot, taken)
                                                    : offsetof(struct ops_slot, credit));
    if (segments(mr, s->credit, t, at, sizeof(uint64_t), wr + n, sge + n, 1) == 0)
      return false;
    n += 1;
  }
  uint64_t bytes = (s->payload != NULL ? d->bytes : 0) + (s->slot != NULL ? DEP_SLAB_CTRL_SLOT : 0) +
                   (s->mark != NULL || s->credit != NULL ? sizeof(uint64_t) : 0);
  return xfer_rdma__chain_add(k, xr, wr, sge, n, bytes);
}
