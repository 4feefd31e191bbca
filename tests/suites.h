/*
 * suites.h — every Check suite the runner knows, one line each.
 * A suite lives in tests/check_<name>.c as `Suite *<name>_suite(void)`.
 */
#ifndef DEP_TEST_SUITES_H
#define DEP_TEST_SUITES_H
#define DEP_TEST_SUITES(XX) \
  XX(proto)                 \
  XX(proto_fuzz)            \
  XX(shape)                 \
  XX(fdpass)                \
  XX(config)                \
  XX(config_defaults)       \
  XX(config_bounds)         \
  XX(config_reload)         \
  XX(daemon)                \
  XX(reload)                \
  XX(server)                \
  XX(server_proto)          \
  XX(link)                  \
  XX(job)                   \
  XX(client)                \
  XX(client_daemon)         \
  XX(ctl)                   \
  XX(ctl_render)            \
  XX(ctl_json)              \
  XX(ops)                   \
  XX(ops_ext)               \
  XX(ops_mask)              \
  XX(ops_args)              \
  XX(ops_split)             \
  XX(handles)               \
  XX(memory)                \
  XX(pool)                  \
  XX(pool_batch)            \
  XX(lifecycle)             \
  XX(cuda_ops)              \
  XX(kcache)                \
  XX(tune)                  \
  XX(rdma)                  \
  XX(peers)                 \
  XX(peer_strangers)        \
  XX(peer_data)             \
  XX(multinode)             \
  XX(multinode_fail)        \
  XX(elastic)               \
  XX(elastic_ops)           \
  XX(bigworld)              \
  XX(stream)                \
  XX(stream_auto)           \
  XX(xnode)                 \
  XX(xnode_faults)          \
  XX(xnode_ring)            \
  XX(xnode_split)           \
  XX(xnode_stream)          \
  XX(xfer)                  \
  XX(xfer_fair)             \
  XX(stats)                 \
  XX(stats_forged)          \
  XX(stats_world)           \
  XX(metrics)               \
  XX(doctor)                \
  XX(runner)                \
  XX(bench)                 \
  XX(man)                   \
  XX(readme)
#endif
