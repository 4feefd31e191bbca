/*
 * ctl_size.c — `deepepctl size`: what a job of a given shape is lent per
 * rank, before it starts, from the layout function the daemon lends by
 * (proto/slab.h): its slab (device memory on the cuda backend, shared host
 * memory on the host backend) and, where the job spans nodes, the pinned
 * host memory of its ring and exchange region.  No daemon is asked: the
 * answer is the layout's, for any world and node count.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"
#include "ctl.h"
#include "shape.h"
#include "slab.h"
#include "xring.h"

enum {
  SIZE_OPT_WORLD = 256,
  SIZE_OPT_RANKS_PER_NODE,
  SIZE_OPT_TOKENS,
  SIZE_OPT_HIDDEN,
  SIZE_OPT_EXPERTS,
  SIZE_OPT_TOPK,
  SIZE_OPT_LL_TOKENS,
  SIZE_OPT_FP8,
  SIZE_OPT_CHUNK_ROWS,
};

static const struct option size_longopts[] = {
    CTL_COMMON_LONGOPTS,
    {"world", required_argument, NULL, SIZE_OPT_WORLD},
    {"ranks-per-node", required_argument, NULL, SIZE_OPT_RANKS_PER_NODE},
    {"tokens", required_argument, NULL, SIZE_OPT_TOKENS},
    {"hidden", required_argument, NULL, SIZE_OPT_HIDDEN},
    {"experts", required_argument, NULL, SIZE_OPT_EXPERTS},
    {"topk", required_argument, NULL, SIZE_OPT_TOPK},
    {"ll-tokens", required_argument, NULL, SIZE_OPT_LL_TOKENS},
    {"fp8", no_argument, NULL, SIZE_OPT_FP8},
    {"chunk-rows", required_argument, NULL, SIZE_OPT_CHUNK_ROWS},
    {NULL, 0, NULL, 0},
};

/* The JSON keys are an interface: deepepctl(1) lists them; never rename. */
static const struct ctl_col size_fields[] = {
    {"world_size", "world", CTL_UINT, 0},
    {"ranks_per_node", "ranks per node", CTL_UINT, 0},
    {"max_tokens_per_rank", "tokens per rank", CTL_UINT, 0},
    {"hidden", "hidden", CTL_UINT, 0},
    {"num_experts", "experts", CTL_UINT, 0},
    {"topk", "top-k", CTL_UINT, 0},
    {"max_ll_tokens_per_rank", "low-latency tokens", CTL_UINT, 0},
    {"chunk_rows", "chunk rows", CTL_UINT, 0},
    {"channel_rows", "rows a channel holds", CTL_UINT, 0},
    {"slab_bytes", "slab per rank", CTL_BYTES, 0},
    {"pinned_host_bytes", "pinned host per rank", CTL_BYTES, 0},
    {"total_bytes", "total per rank", CTL_BYTES, 0},
};
#define SIZE_NFIELDS (sizeof size_fields / sizeof size_fields[0])

/* A whole number from 1 (0 where zero_ok) to max for option name. */
static int size_number(struct ctl *ctl, const char *name, const char *arg, uint32_t max,
                       bool zero_ok, uint32_t *out) {
  char *end = NULL;
  errno = 0;
  unsigned long v = strtoul(arg, &end, 10);
  if (arg[0] < '0' || arg[0] > '9' || end == arg || *end != '\0' || errno != 0 || v > max ||
      (v == 0 && !zero_ok))
    return ctl_usage_error(ctl, "--%s needs a number from %u to %u, not \"%s\"", name,
                           zero_ok ? 0u : 1u, max, arg);
  *out = (uint32_t)v;
  return -1;
}

int ctl_size(struct ctl *ctl, int argc, char **argv) {
  /* DeepSeek-V3's shape on one node of 8 unless told otherwise. */
  struct dep_job_shape s = {.max_tokens_per_rank = 4096, .hidden = 7168, .num_experts = 256,
                            .topk = 8, .dtype = DEP_DTYPE_BF16, .max_ll_tokens_per_rank = 0};
  uint32_t world = 8, per_node = 0, chunk = 0;
  ctl_getopt_begin();
  int ch, rc = -1;
  while (rc < 0 && (ch = getopt_long(argc, argv, CTL_COMMON_SHORTOPTS, size_longopts, NULL)) != -1) {
    const char *name = NULL;
    for (const struct option *o = size_longopts; o->name != NULL && name == NULL; o++)
      if (o->val == ch)
        name = o->name;
    switch (ch) {
    case SIZE_OPT_WORLD: rc = size_number(ctl, name, optarg, DEP_MAX_WORLD, false, &world); break;
    case SIZE_OPT_RANKS_PER_NODE:
      rc = size_number(ctl, name, optarg, DEP_MAX_LOCAL_RANKS, false, &per_node);
      break;
    case SIZE_OPT_TOKENS:
      rc = size_number(ctl, name, optarg, DEP_SHAPE_MAX_TOKENS, false, &s.max_tokens_per_rank);
      break;
    case SIZE_OPT_HIDDEN:
      rc = size_number(ctl, name, optarg, DEP_SHAPE_MAX_HIDDEN, false, &s.hidden);
      break;
    case SIZE_OPT_EXPERTS:
      rc = size_number(ctl, name, optarg, DEP_SHAPE_MAX_EXPERTS, false, &s.num_experts);
      break;
    case SIZE_OPT_TOPK: rc = size_number(ctl, name, optarg, DEP_SHAPE_MAX_TOPK, false, &s.topk); break;
    case SIZE_OPT_LL_TOKENS:
      rc = size_number(ctl, name, optarg, DEP_SHAPE_MAX_TOKENS, true, &s.max_ll_tokens_per_rank);
      break;
    case SIZE_OPT_FP8: s.dtype = DEP_DTYPE_FP8_E4M3; break;
    case SIZE_OPT_CHUNK_ROWS:
      rc = size_number(ctl, name, optarg, DEP_SHAPE_MAX_TOKENS, true, &chunk);
      break;
    default: rc = ctl_common_option(ctl, ch, argv); break;
    }
  }
  if (rc >= 0)
    return rc;
  if ((rc = ctl_common_end(ctl)) >= 0)
    return rc;
  if (optind < argc)
    return ctl_usage_error(ctl, "size takes no argument \"%s\"", argv[optind]);
  if (per_node == 0)
    per_node = world < DEP_MAX_LOCAL_RANKS ? world : DEP_MAX_LOCAL_RANKS;
  if (per_node > world)
    return ctl_usage_error(ctl, "--ranks-per-node %u is more than --world %u", per_node, world);
  struct dep_slab_layout l;
  char why[256] = "";
  if (dep__slab_layout_nodes(&s, world, per_node, chunk, &l, why, sizeof why) != 0)
    return ctl_usage_error(ctl, "%s", why);
  const uint64_t pinned = l.n_remote > 0 ? DEP_XRING_BYTES + l.xchg_bytes : 0;
  const struct ctl_val vals[SIZE_NFIELDS] = {
      {.u = world},          {.u = per_node},        {.u = s.max_tokens_per_rank},
      {.u = s.hidden},       {.u = s.num_experts},   {.u = s.topk},
      {.u = l.max_ll_tokens}, {.u = l.chan_rows < l.max_tokens ? l.chunk_rows : 0},
      {.u = l.chan_rows},    {.u = l.total_bytes},   {.u = pinned},
      {.u = l.total_bytes + pinned},
  };
  const struct ctl_doc doc = {size_fields, vals, SIZE_NFIELDS, NULL, 0};
  if (ctl_out_render(stdout, &doc, ctl->json) != 0)
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  return ctl_finish_output(CTL_EXIT_OK);
}
