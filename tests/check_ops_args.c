/*
 * check_ops_args.c — suite ops_args: what the host backend's operations
 * refuse before they write anything (DESIGN §6): bad arguments to each
 * call are DEP_ERR_INVALID naming the argument with nothing written to any
 * slab and no sequence number used, handles of the wrong kind are refused,
 * and a context with a bad world, rank, shape, timeout or slab is
 * DEP_ERR_INVALID naming it.  The calls themselves are check_ops.c's.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host_ops.h"
#include "opsworld.h"
#include "ref.h"

START_TEST(bad_arguments_are_refused_before_any_write) {
  struct ow_rank0 *r = ow_rank0_open(&ow_small, 200);
  struct ops_ctx *c = &r->c;
  struct ow_case *d = &r->d;
  struct ow_outs *o = &r->o;
  int64_t *idx = d->idx[0];
  const struct ref_rank_in *in = &d->in[0];
  const struct dep_dispatch_args da = {.size = sizeof(struct dep_dispatch_args), .x = in->x,
                                       .topk_idx = idx, .index_type = DEP_INDEX_I64,
                                       .topk_weights = in->topk_weights, .num_tokens = 4,
                                       .recv_x = o->rx,
                                       .recv_topk_idx = o->ridx, .recv_topk_weights = o->rw, .recv_count_per_expert = o->cnt, .num_recv = &o->num_recv};
  struct dep_dispatch_args b = da;
  OW_REFUSED(host_ops_dispatch(c, NULL, &o->h), "args");
  OW_REFUSED(host_ops_dispatch(c, &da, NULL), "handle is NULL");
#define BAD(field, value) (b = da, b.field = value, host_ops_dispatch(c, &b, &o->h))
  OW_REFUSED(BAD(index_type, 0), "index_type");
  OW_REFUSED(BAD(num_tokens, 5), "num_tokens 5 exceeds max_tokens_per_rank 4");
  OW_REFUSED(BAD(x, NULL), "x is NULL");
  OW_REFUSED(BAD(x, (const char *)in->x + 1), "x is not 2-byte aligned");
  OW_REFUSED(BAD(topk_idx, NULL), "topk_idx is NULL");
  OW_REFUSED(BAD(topk_idx, (const char *)idx + 4), "topk_idx is not 8-byte aligned");
  OW_REFUSED(BAD(topk_weights, NULL), "topk_weights is NULL");
  OW_REFUSED(BAD(recv_x, NULL), "recv_x is NULL");
  OW_REFUSED(BAD(recv_topk_idx, NULL), "recv_topk_idx is NULL");
  OW_REFUSED(BAD(recv_topk_weights, NULL), "recv_topk_weights is NULL");
  OW_REFUSED(BAD(recv_count_per_expert, NULL), "recv_count_per_expert is NULL");
  OW_REFUSED(BAD(num_recv, NULL), "num_recv is NULL");
#undef BAD
  int64_t saved = idx[7];
  idx[7] = 4;
  OW_REFUSED(host_ops_dispatch(c, &da, &o->h), "topk_idx[3][1] = 4 outside [-1, 4)");
  idx[7] = -2;
  OW_REFUSED(host_ops_dispatch(c, &da, &o->h), "topk_idx[3][1] = -2");
  struct dep_layout_args la = {sizeof(struct dep_layout_args), idx, DEP_INDEX_I64, 4, o->tpr,
                               o->tpe, o->tir}, lb = la;
  OW_REFUSED(host_ops_layout(c, &la), "layout: topk_idx[3][1] = -2");
  idx[7] = saved;
  OW_REFUSED(host_ops_layout(c, NULL), "args");
  OW_REFUSED((lb = la, lb.index_type = 9, host_ops_layout(c, &lb)), "index_type 9");
  OW_REFUSED((lb = la, lb.num_tokens = 5, host_ops_layout(c, &lb)), "num_tokens");
  OW_REFUSED((lb = la, lb.tokens_per_rank = NULL, host_ops_layout(c, &lb)), "tokens_per_rank");
  OW_REFUSED((lb = la, lb.tokens_per_expert = NULL, host_ops_layout(c, &lb)), "tokens_per_expert");
  OW_REFUSED((lb = la, lb.token_in_rank = NULL, host_ops_layout(c, &lb)), "token_in_rank");
  OW_REFUSED((lb = la, lb.topk_idx = NULL, host_ops_layout(c, &lb)), "topk_idx is NULL");
  /* Empty calls may pass NULL inputs; layout is local, so it runs. */
  lb = la, lb.num_tokens = 0, lb.topk_idx = NULL, lb.token_in_rank = NULL;
  ck_assert_int_eq(host_ops_layout(c, &lb), 0);
  ck_assert_int_eq(o->tpr[0] + o->tpr[1], 0);

  const struct dep_ll_dispatch_args lda = {sizeof(struct dep_ll_dispatch_args), in->x, idx,
                                           DEP_INDEX_I64, 4, 1, o->lx, o->lscales,
                                           o->lcnt, 0, NULL};
  struct dep_ll_dispatch_args lb2 = lda;
#define BAD(field, value) (lb2 = lda, lb2.field = value, host_ops_ll_dispatch(c, &lb2, &o->h))
  OW_REFUSED(host_ops_ll_dispatch(c, NULL, &o->h), "args");
  OW_REFUSED(host_ops_ll_dispatch(c, &lda, NULL), "handle");
  OW_REFUSED(BAD(num_tokens, 5), "num_tokens 5 exceeds max_ll_tokens_per_rank 4");
  OW_REFUSED(BAD(use_fp8, 2), "use_fp8");
  OW_REFUSED(BAD(recv_scales, NULL), "recv_scales");
  OW_REFUSED(BAD(recv_count, NULL), "recv_count");
  OW_REFUSED(BAD(recv_x, NULL), "recv_x");
  OW_REFUSED(BAD(x, NULL), "x is NULL");
  OW_REFUSED(BAD(index_type, -1), "index_type");
  OW_REFUSED(BAD(topk_idx, NULL), "topk_idx");
#undef BAD
  int32_t idx32[8] = {0, 1, 2, 3, 3, 2, 1, 104};
  OW_REFUSED((lb2 = lda, lb2.index_type = DEP_INDEX_I32, lb2.topk_idx = idx32,
           host_ops_ll_dispatch(c, &lb2, &o->h)), "topk_idx[3][1] = 104");

  struct dep_combine_args ca = {.size = sizeof(struct dep_combine_args), .x = d->cx[0],
                                .out = o->out};
  OW_REFUSED(host_ops_combine(c, &ca, NULL), "handle is NULL");
  OW_REFUSED(host_ops_combine(c, &ca, &o->h), "holds no dispatch");
  OW_REFUSED(host_ops_combine(c, NULL, &o->h), "args");
  struct dep_ll_combine_args lc = {sizeof(struct dep_ll_combine_args), d->lx[0], idx, DEP_INDEX_I64,
                                   in->topk_weights, o->lout, 0, NULL};
  OW_REFUSED(host_ops_ll_combine(c, &lc, NULL), "handle is NULL");
  OW_REFUSED(host_ops_ll_combine(c, &lc, &o->h), "holds no dispatch");
  ck_assert_int_eq(host_ops_dispatch(NULL, &da, &o->h), DEP_ERR_INVALID);
  ck_assert(ow_all_zero(r->w.map, r->w.map_bytes));
  ow_rank0_close(r);
}
END_TEST

/* Combines refuse a handle of the other mode, of another shape, or other ids. */
START_TEST(handles_of_the_wrong_kind_are_refused) {
  struct ow_scenario sc = ow_small;
  sc.world = 1;
  struct ow_rank0 *r = ow_rank0_open(&sc, 200);
  struct ops_ctx *c = &r->c;
  struct ow_case *d = &r->d;
  struct ow_outs *o = &r->o;
  struct dep_handle tp;
  host_ops_handle_init(&tp);
  ck_assert_int_eq(ow_dispatch(c, d, o, &tp), 0);
  ck_assert_int_eq(ow_ll_dispatch(c, d, o, 0), 0);
  uint8_t *snap = malloc(r->w.map_bytes);
  memcpy(snap, r->w.map, r->w.map_bytes);
  struct dep_combine_args ca = {.size = sizeof(struct dep_combine_args), .x = d->cx[0],
                                .out = o->out};
  struct dep_ll_combine_args lc = {sizeof(struct dep_ll_combine_args), d->lx[0], d->idx[0],
                                   DEP_INDEX_I64, d->in[0].topk_weights,
                                   o->lout, 0, NULL};
#define REFUSED_H(call, name)                                                                      \
  do {                                                                                             \
    int rc_ = (call);                                                                              \
    ck_assert_msg(rc_ == DEP_ERR_INVALID, "%s: %s (%s)", #call, dep_errname(rc_), c->why);         \
    ck_assert_msg(strstr(c->why, name), "%s: \"%s\" lacks \"%s\"", #call, c->why, name);           \
    ck_assert_msg(memcmp(snap, r->w.map, r->w.map_bytes) == 0, "%s wrote to the slab", #call);     \
    ck_assert_uint_eq(c->seq, 2);                                                                  \
  } while (0)
  REFUSED_H(host_ops_combine(c, &ca, &o->h), "holds a dep_ll_dispatch, not a dep_dispatch");
  REFUSED_H(host_ops_ll_combine(c, &lc, &tp), "holds a dep_dispatch, not a dep_ll_dispatch");
  struct dep_handle other = tp;
  other.hidden = 256;
  REFUSED_H(host_ops_combine(c, &ca, &other), "another job shape");
  int64_t *idx = d->idx[0];
  int64_t saved = idx[2];
  idx[2] = idx[2] == 3 ? 2 : 3;
  REFUSED_H(host_ops_ll_combine(c, &lc, &o->h), "differs from the one given");
  idx[2] = saved;
  /* The right handles still work, in either order. */
  ck_assert_int_eq(host_ops_ll_combine(c, &lc, &o->h), 0);
  ck_assert_int_eq(host_ops_combine(c, &ca, &tp), 0);
  free(snap);
  host_ops_handle_fini(&tp);
  ow_rank0_close(r);
}
END_TEST

START_TEST(init_refuses_bad_contexts) {
  struct dep_job_shape s = {4, 128, 4, 2, DEP_DTYPE_BF16, 0};
  struct ow_world w;
  ow_world_open(&w, &s, 2, 0);
  struct ops_ctx c;
  char why[256];
  uint8_t *sl[DEP_MAX_LOCAL_RANKS] = {w.slabs[0], w.slabs[1]};
#define BAD_INIT(expr, name)                                                               \
  do {                                                                                     \
    why[0] = 0;                                                                            \
    ck_assert_int_eq((expr), DEP_ERR_INVALID);                                             \
    ck_assert_msg(strstr(why, name), "%s: \"%s\" lacks \"%s\"", #expr, why, name);          \
  } while (0)
  BAD_INIT(host_ops_init(&c, &s, 0, 0, sl, 100, why, sizeof why), "world 0");
  BAD_INIT(host_ops_init(&c, &s, DEP_MAX_WORLD + 1, 0, sl, 100, why, sizeof why), "world 4097");
  BAD_INIT(host_ops_init(&c, &s, 2, 2, sl, 100, why, sizeof why), "rank 2 of world 2");
  BAD_INIT(host_ops_init(&c, &s, 3, 0, sl, 100, why, sizeof why), "num_experts 4");
  BAD_INIT(host_ops_init(&c, &s, 2, 0, sl, 0, why, sizeof why), "timeout");
  BAD_INIT(host_ops_init(&c, NULL, 2, 0, sl, 100, why, sizeof why), "NULL");
  sl[1] = w.slabs[1] + 8;
  BAD_INIT(host_ops_init(&c, &s, 2, 0, sl, 100, why, sizeof why), "slab of rank 1");
  sl[1] = NULL;
  BAD_INIT(host_ops_init(&c, &s, 2, 0, sl, 100, why, sizeof why), "slab of rank 1");
  sl[1] = w.slabs[1];
  s.hidden = 100;
  BAD_INIT(host_ops_init(&c, &s, 2, 0, sl, 100, why, sizeof why), "hidden 100");
  s.hidden = 128;
  ck_assert_int_eq(host_ops_init(&c, &s, 2, 1, sl, 100, why, sizeof why), 0);
  host_ops_fini(&c);
  ow_world_close(&w);
}
END_TEST

Suite *ops_args_suite(void);
Suite *ops_args_suite(void) {
  Suite *s = suite_create("ops_args");
  TCase *refused = tcase_create("refused");
  tcase_set_timeout(refused, 30);
  tcase_add_test(refused, bad_arguments_are_refused_before_any_write);
  tcase_add_test(refused, handles_of_the_wrong_kind_are_refused);
  tcase_add_test(refused, init_refuses_bad_contexts);
  suite_add_tcase(s, refused);
  return s;
}
