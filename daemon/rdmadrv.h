/*
 * rdmadrv.h — the daemon's narrow seam to libibverbs and librdmacm, reached
 * with dlopen("libibverbs.so.1") and dlopen("librdmacm.so.1") beside the
 * CUDA one (cuda/cudadrv.h), so that deepepd builds against rdma-core's
 * headers but links neither library and runs where they are not installed:
 * its peers then use TCP (DESIGN §7).
 *
 * Usage: rdmadrv_load() once (cheap after the first time, thread-safe);
 * then call through the table it returns, rd->ibv.open_device(dev),
 * rd->cm.create_id(...).  The fields drop the ibv_ and rdma_ prefixes
 * because verbs.h defines some of those names as function-like macros
 * (ibv_reg_mr, ibv_query_port), which would rewrite rd->ibv_reg_mr(...).
 *
 * Not in the table, on purpose: ibv_post_send, ibv_post_recv, ibv_poll_cq
 * and ibv_req_notify_cq are static inline functions in verbs.h that call
 * through the context's ops table (qp->context->ops.post_send...), so they
 * are used straight from the header and need no symbol.
 */
#ifndef DEP_DAEMON_RDMADRV_H
#define DEP_DAEMON_RDMADRV_H

#include <stdbool.h>
#include <stddef.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/*
 * The entry points, one table each: X(field, symbol, version, return type,
 * parameters).  Each is resolved with dlvsym at the version whose ABI the
 * header describes (libibverbs keeps IBVERBS_1.0 compat versions with other
 * struct layouts beside the 1.1 ones).  rdmadrv.c checks at compile time
 * that every row's type is the header's prototype of its symbol.
 */
#define RDMADRV_IBV(X)                                                                        \
  X(get_device_list, ibv_get_device_list, "IBVERBS_1.1", struct ibv_device **, (int *))       \
  X(free_device_list, ibv_free_device_list, "IBVERBS_1.1", void, (struct ibv_device **))      \
  X(get_device_name, ibv_get_device_name, "IBVERBS_1.1", const char *, (struct ibv_device *)) \
  X(get_device_guid, ibv_get_device_guid, "IBVERBS_1.1", __be64, (struct ibv_device *))       \
  X(open_device, ibv_open_device, "IBVERBS_1.1", struct ibv_context *, (struct ibv_device *)) \
  X(close_device, ibv_close_device, "IBVERBS_1.1", int, (struct ibv_context *))               \
  X(query_device, ibv_query_device, "IBVERBS_1.1", int,                                       \
    (struct ibv_context *, struct ibv_device_attr *))                                         \
  /* The library's own query_port fills the older, shorter struct: call rdmadrv_query_port. */ \
  X(query_port, ibv_query_port, "IBVERBS_1.1", int,                                           \
    (struct ibv_context *, uint8_t, struct _compat_ibv_port_attr *))                          \
  X(query_gid, ibv_query_gid, "IBVERBS_1.1", int,                                             \
    (struct ibv_context *, uint8_t, int, union ibv_gid *))                                    \
  X(alloc_pd, ibv_alloc_pd, "IBVERBS_1.1", struct ibv_pd *, (struct ibv_context *))           \
  X(dealloc_pd, ibv_dealloc_pd, "IBVERBS_1.1", int, (struct ibv_pd *))                        \
  X(reg_mr, ibv_reg_mr, "IBVERBS_1.1", struct ibv_mr *, (struct ibv_pd *, void *, size_t, int)) \
  X(dereg_mr, ibv_dereg_mr, "IBVERBS_1.1", int, (struct ibv_mr *))                            \
  X(create_comp_channel, ibv_create_comp_channel, "IBVERBS_1.0", struct ibv_comp_channel *,   \
    (struct ibv_context *))                                                                   \
  X(destroy_comp_channel, ibv_destroy_comp_channel, "IBVERBS_1.0", int,                       \
    (struct ibv_comp_channel *))                                                              \
  X(create_cq, ibv_create_cq, "IBVERBS_1.1", struct ibv_cq *,                                 \
    (struct ibv_context *, int, void *, struct ibv_comp_channel *, int))                      \
  X(destroy_cq, ibv_destroy_cq, "IBVERBS_1.1", int, (struct ibv_cq *))                        \
  /* A completion channel is waited on, not spun on: these two read and ack its events. */    \
  X(get_cq_event, ibv_get_cq_event, "IBVERBS_1.1", int,                                       \
    (struct ibv_comp_channel *, struct ibv_cq **, void **))                                   \
  X(ack_cq_events, ibv_ack_cq_events, "IBVERBS_1.1", void, (struct ibv_cq *, unsigned int))   \
  X(create_qp, ibv_create_qp, "IBVERBS_1.1", struct ibv_qp *,                                 \
    (struct ibv_pd *, struct ibv_qp_init_attr *))                                             \
  X(destroy_qp, ibv_destroy_qp, "IBVERBS_1.1", int, (struct ibv_qp *))                        \
  X(modify_qp, ibv_modify_qp, "IBVERBS_1.1", int, (struct ibv_qp *, struct ibv_qp_attr *, int)) \
  /* A failed completion is logged by its name. */                                           \
  X(wc_status_str, ibv_wc_status_str, "IBVERBS_1.1", const char *, (enum ibv_wc_status))

/* The connection manager.  bind_addr (a listener binds before rdma_listen), reject (an
 * unconfigured peer is refused), disconnect and event_str go beyond connect and accept. */
#define RDMADRV_CM(X)                                                                         \
  X(create_event_channel, rdma_create_event_channel, "RDMACM_1.0",                            \
    struct rdma_event_channel *, (void))                                                      \
  X(destroy_event_channel, rdma_destroy_event_channel, "RDMACM_1.0", void,                    \
    (struct rdma_event_channel *))                                                            \
  X(create_id, rdma_create_id, "RDMACM_1.0", int,                                             \
    (struct rdma_event_channel *, struct rdma_cm_id **, void *, enum rdma_port_space))        \
  X(destroy_id, rdma_destroy_id, "RDMACM_1.0", int, (struct rdma_cm_id *))                    \
  X(bind_addr, rdma_bind_addr, "RDMACM_1.0", int, (struct rdma_cm_id *, struct sockaddr *))   \
  X(resolve_addr, rdma_resolve_addr, "RDMACM_1.0", int,                                       \
    (struct rdma_cm_id *, struct sockaddr *, struct sockaddr *, int))                         \
  X(resolve_route, rdma_resolve_route, "RDMACM_1.0", int, (struct rdma_cm_id *, int))         \
  X(connect, rdma_connect, "RDMACM_1.0", int, (struct rdma_cm_id *, struct rdma_conn_param *)) \
  X(listen, rdma_listen, "RDMACM_1.0", int, (struct rdma_cm_id *, int))                       \
  X(accept, rdma_accept, "RDMACM_1.0", int, (struct rdma_cm_id *, struct rdma_conn_param *))  \
  X(reject, rdma_reject, "RDMACM_1.0", int, (struct rdma_cm_id *, const void *, uint8_t))     \
  X(disconnect, rdma_disconnect, "RDMACM_1.0", int, (struct rdma_cm_id *))                    \
  X(get_cm_event, rdma_get_cm_event, "RDMACM_1.0", int,                                       \
    (struct rdma_event_channel *, struct rdma_cm_event **))                                   \
  X(ack_cm_event, rdma_ack_cm_event, "RDMACM_1.0", int, (struct rdma_cm_event *))             \
  X(create_qp, rdma_create_qp, "RDMACM_1.0", int,                                             \
    (struct rdma_cm_id *, struct ibv_pd *, struct ibv_qp_init_attr *))                        \
  X(destroy_qp, rdma_destroy_qp, "RDMACM_1.0", void, (struct rdma_cm_id *))                   \
  X(event_str, rdma_event_str, "RDMACM_1.0", const char *, (enum rdma_cm_event_type))      \
  /* The verbs contexts the connection manager uses: memory is registered on their PD. */    \
  X(get_devices, rdma_get_devices, "RDMACM_1.0", struct ibv_context **, (int *))              \
  X(free_devices, rdma_free_devices, "RDMACM_1.0", void, (struct ibv_context **))

#define RDMADRV_FIELD(field, sym, ver, ret, params) ret(*field) params;

struct rdmadrv {
  struct {
    RDMADRV_IBV(RDMADRV_FIELD)
  } ibv;
  struct {
    RDMADRV_CM(RDMADRV_FIELD)
  } cm;
};

/* The environment variables that name the libraries instead (testing, unusual installs). */
#define RDMADRV_ENV_IBVERBS "DEEPEPD_LIBIBVERBS"
#define RDMADRV_ENV_RDMACM "DEEPEPD_LIBRDMACM"

/*
 * Load both libraries and resolve the tables (once per process; the
 * libraries stay loaded).  Returns the table, or NULL with `why` set, in
 * words for a log line: "libibverbs.so.1 not installed", "librdmacm.so.1
 * lacks rdma_listen".  An absent optional entry point is not a failure.
 */
const struct rdmadrv *rdmadrv_load(char *why, size_t whylen);

/* ibv_query_port as verbs.h's inline does it: the whole struct zeroed, then the library's. */
int rdmadrv_query_port(const struct rdmadrv *rd, struct ibv_context *ctx, uint8_t port,
                       struct ibv_port_attr *attr);

/*
 * What the RDMA devices are, probed once per process (each device opened,
 * queried and closed again).  Returns the number of devices the daemon
 * could open (0 or more), and in `text` (may be NULL) their names
 * ("mlx5_0, mlx5_1") or, with none, why ("libibverbs.so.1 not installed",
 * "no RDMA devices", "permission denied on /dev/infiniband/uverbs0"), for
 * status.
 */
int rdmadrv_probe(char *text, size_t len);

/*
 * Log the probe at start, once per process however often called: a line
 * per device at info (name, node GUID, each port's state and link layer),
 * or one line saying why peer daemons will use TCP.  Call it after the
 * configuration is loaded (the log level is set) and before the devices.
 */
void rdmadrv_probe_log(void);

#endif /* DEP_DAEMON_RDMADRV_H */
