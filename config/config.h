/*
 * config.h — deepepd's configuration (DESIGN §9): one typed struct, filled
 * with the defaults and then from a YAML file through libyaml.
 *
 * Each key's default is written once, in the key table (config_keys.c); the
 * comments below say what a value means, not what it defaults to.  The
 * shipped config/deepepd.yaml, deepepd.yaml(5) and docs/configuration.md's table state
 * the same defaults (tests/check_config.c holds them to the table).
 * Errors name the place: "FILE:LINE:COLUMN: what is wrong".
 */
#ifndef DEP_CONFIG_H
#define DEP_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define CONFIG_DEFAULT_PATH "/etc/deepepd/deepepd.yaml"
#define CONFIG_MAX_LIST 64   /* users, groups, devices, peers */
#define CONFIG_NAME_MAX 64
#define CONFIG_PATH_MAX 108  /* sun_path; longer socket paths are rejected */
#define CONFIG_LISTEN_MAX 64 /* "[IPv6 address]:port" fits */
#define CONFIG_MAX_PROXY_THREADS 64 /* proxy_threads' bound: the daemon's table of them */
/* stream_chunk_rows: auto, the value the key's word stores (no number of rows is this
 * large): whole blocks for a job whose whole blocks fit its device's pool, else the largest
 * chunk that does (daemon/lend.c, lend_check). */
#define CONFIG_CHUNK_ROWS_AUTO UINT32_MAX
/* Where the unit's CacheDirectory=deepepd puts it (systemd/deepepd.service.in). */
#define CONFIG_DEFAULT_KERNEL_CACHE_DIR "/var/cache/deepepd"
/*
 * Bounds on the file itself, so that no file can keep libyaml busy (config.c says how):
 * lists and mappings nested at most this deep (a valid file nests 3), and at most this many
 * YAML tokens (keys, values, brackets), which a valid file never nears: every key at most
 * once and every list full (CONFIG_MAX_LIST entries) come to about 1500.
 */
#define CONFIG_MAX_DEPTH 32
#define CONFIG_MAX_TOKENS 8192

enum config_backend { CONFIG_BACKEND_AUTO = 0, CONFIG_BACKEND_CUDA, CONFIG_BACKEND_HOST };
enum config_log_level { CONFIG_LOG_ERR = 3, CONFIG_LOG_WARNING = 4, CONFIG_LOG_NOTICE = 5,
                        CONFIG_LOG_INFO = 6, CONFIG_LOG_DEBUG = 7 };

/* How peer daemons move bytes (DESIGN §7).  A peer's own `transport`
 * left out (DEFAULT) means the daemon's top-level one. */
enum config_transport { CONFIG_TRANSPORT_DEFAULT = 0, CONFIG_TRANSPORT_AUTO, CONFIG_TRANSPORT_RDMA,
                        CONFIG_TRANSPORT_TCP };

struct config_peer {
  char host[256];
  uint16_t port;
  enum config_transport transport; /* peers[i].transport; DEFAULT: the top-level one */
};

struct config {
  /* socket: */
  char socket_path[CONFIG_PATH_MAX];  /* socket.path */
  uint32_t socket_mode;               /* socket.mode (YAML int, e.g. 0660 or "0660") */
  char socket_group[CONFIG_NAME_MAX]; /* socket.group; "": the daemon's group */

  /* allow: who may connect besides root and the daemon's own uid */
  size_t n_allow_users;
  char allow_users[CONFIG_MAX_LIST][CONFIG_NAME_MAX]; /* names or numeric uids */
  size_t n_allow_groups;
  char allow_groups[CONFIG_MAX_LIST][CONFIG_NAME_MAX];
  bool allow_any_user;                /* allow.any_user */

  /* memory */
  enum config_backend backend;        /* backend: auto|cuda|host */
  size_t n_devices;                   /* devices: [] = every GPU; else UUIDs ("GPU-..."/plain) */
  char devices[CONFIG_MAX_LIST][48];
  uint64_t pool_size_per_device;      /* pool.size_per_device */
  uint64_t pool_chunk_size;           /* pool.chunk_size */
  uint64_t pool_max_allocation;       /* pool.max_allocation (an arena's pieces); 0: the
                                         daemon chooses (job.c) */
  uint64_t host_pool_size;            /* pool.host_size, host backend pool */
  bool preallocation;
  bool buffer_cache_enabled;

  /* kernels */
  bool kernel_warmup;                 /* at start in the daemon, and at attach */
  char kernel_cache_dir[256];         /* "" for none */
  bool adaptive_optimization;         /* SM budgets chosen by measurement (tune.h) */
  double warn_first_call_ratio;       /* 1.0..100: log a first call slower than this x its
                                         op's steady median (daemon/stats.c) */

  /* peers */
  uint32_t connection_pool_size;      /* 1..1024 */
  uint32_t proxy_threads;             /* inter-node proxy threads; 0: xfer_proxy_threads_default */
  uint32_t stream_chunk_rows;         /* 0: whole blocks; N: the throughput ops stream through
                                         rings of chunks of N rows (proto/slab.h);
                                         CONFIG_CHUNK_ROWS_AUTO: chosen per job (below) */
  char listen_address[256];           /* listen.address; "": no peer listener */
  uint16_t listen_port;               /* listen.port */
  size_t n_peers;
  struct config_peer peers[CONFIG_MAX_LIST];
  char peer_key_file[256];
  enum config_transport transport;    /* transport: auto (RDMA where a device and route exist, else TCP), rdma, tcp */
  bool peer_insecure;                 /* false: peers without a key are refused */
  uint32_t peer_wait_ms;              /* READY=1 waits this long for the peers */

  /* metrics */
  char metrics_listen[CONFIG_LISTEN_MAX]; /* metrics.listen "ADDRESS:PORT" (numeric), ""
                                         for none; config_listen_split reads it */

  /* limits */
  uint32_t max_clients;               /* limits.max_clients */
  uint32_t max_jobs;                  /* limits.max_jobs */
  uint32_t attach_timeout_ms;         /* limits.attach_timeout_ms */
  uint32_t op_timeout_ms;             /* limits.op_timeout_ms */
  uint32_t client_queue_bytes;        /* limits.client_queue_bytes */
  uint32_t hello_timeout_ms;          /* limits.hello_timeout_ms: HELLO must come this soon */
  uint32_t reserved_clients;          /* limits.reserved_clients: connections past max_clients
                                         that only root and deepepd's user may open */
  uint32_t max_clients_per_uid;       /* limits.max_clients_per_uid */
  uint32_t max_jobs_per_uid;          /* limits.max_jobs_per_uid */
  uint64_t memory_per_uid;            /* limits.memory_per_uid: lent and still held, on each
                                         device; 0: no bound but the pool's */

  enum config_log_level log_level;    /* log_level: err|warning|notice|info|debug */
};

/* Fill c with every key's default (the key table's, config_keys.c). */
void config_defaults(struct config *c);

/*
 * Load a YAML file over the defaults already in c.  Returns 0, or
 * DEP_ERR_CONFIG with err (errlen bytes) set to "FILE:LINE:COL: message"
 * (or "FILE: strerror" when unreadable).  On error c is unchanged.
 */
int config_load_file(struct config *c, const char *path, char *err, size_t errlen);

/* The same from a buffer; `name` stands for the file in messages. */
int config_load_buffer(struct config *c, const char *name, const char *data, size_t len,
                       char *err, size_t errlen);

/*
 * The keys whose change takes effect on SIGHUP without a restart, and the
 * ones that need a restart: fills `restart_keys` with a comma-separated list
 * of keys that differ between old and new and cannot change live.  Returns
 * the number of such keys.
 */
size_t config_diff_restart(const struct config *old_c, const struct config *new_c,
                           char *restart_keys, size_t len);

/*
 * The live keys whose values differ between old and new, as "key old -> new" joined by ", "
 * ("limits.max_clients 1024 -> 512, log_level info -> debug"), cut after a whole entry with
 * "..." when len is short.  Returns the number of such keys.
 */
size_t config_diff_live(const struct config *old_c, const struct config *new_c, char *changes,
                        size_t len);

/*
 * The keys of one kind (live, or needing a restart) whose values differ between old and new,
 * by their dotted names ("limits.max_clients"), in the file's order: the first max into
 * names, an array of max names of name_size bytes each (a name cut to fit).  Returns how many
 * differ, which may exceed max.
 */
size_t config_diff_names(const struct config *old_c, const struct config *new_c, bool live,
                         char *names, size_t name_size, size_t max);

/* Copy every live key from src to dst: what a reload applies to the running configuration. */
void config_copy_live(struct config *dst, const struct config *src);

/* Which names config_check_accounts looks up. */
#define CONFIG_ACCOUNTS_SOCKET 1u /* socket.group */
#define CONFIG_ACCOUNTS_ALLOW 2u  /* allow.users, allow.groups */
#define CONFIG_ACCOUNTS_ALL (CONFIG_ACCOUNTS_SOCKET | CONFIG_ACCOUNTS_ALLOW)

/*
 * Whether every user and group that c names (of those `which` selects) exists on this host;
 * numeric ids stand as they are.  Returns the number that do not, with `problems` listing them
 * "; "-separated, each naming the key and the value: "'allow.users' lists 'nosuchuser': no such
 * user on this host (getent passwd lists them)".  Safe on any thread (getpwnam_r).
 */
size_t config_check_accounts(const struct config *c, unsigned which, char *problems,
                             size_t len);

const char *config_backend_name(enum config_backend b);
/* "auto", "rdma", "tcp" ("default" for a peer that names none). */
const char *config_transport_name(enum config_transport t);
/* The transport for peer p: its own, else the daemon's. */
enum config_transport config_peer_transport(const struct config *c, const struct config_peer *p);
const char *config_log_level_name(enum config_log_level l);

/*
 * An "ADDRESS:PORT" listen value (metrics.listen) split: a numeric IPv4
 * address, or an IPv6 one in brackets ("[::1]:9464"), and a port 1..65535.
 * 0 with host (the address without brackets, INET6_ADDRSTRLEN bytes fit)
 * and *port, or -1 with why saying what is wrong and what to write.
 */
int config_listen_split(const char *s, char *host, size_t hostlen, uint16_t *port, char *why,
                        size_t whylen);

#endif /* DEP_CONFIG_H */
