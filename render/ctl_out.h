/*
 * ctl_out.h — the one output table (ctl_out.c): an answer is records,
 * summary fields then tables of rows, rendered as aligned text for people,
 * as one JSON object for machines, or as the Prometheus text exposition,
 * so that none of them can disagree about what the daemon said.  deepepctl
 * renders every answer with it, and deepepd its metrics listener's page
 * (ctl_view.h): neither program's folder holds it.
 */
#ifndef DEP_CTL_OUT_H
#define DEP_CTL_OUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum ctl_kind {
  CTL_STR,   /* text */
  CTL_UINT,  /* a plain number */
  CTL_BYTES, /* a byte count: "1.5 GiB" in text, a number in JSON */
  CTL_MS,    /* a duration in ms: "3h 02m 11s" in text, a number in JSON */
  CTL_NS,    /* a duration in ns: "12.3 us" in text, a number of ns in JSON */
  CTL_MILLI, /* a real number held x 1000: "1.25" in text, 1.250 in JSON */
  CTL_BOOL,  /* u != 0: "yes" or "no" in text, true or false in JSON */
  CTL_UINTS, /* u numbers at list: an array in JSON; in text only their count ("1024 values"),
                so a column of them is one for JSON (CTL_COL_NOTEXT) */
};

/* In text, show this column as "/value" after the previous one ("1/2"). */
#define CTL_COL_JOIN 0x1u
/* Only in JSON (and metrics): too much for the text table. */
#define CTL_COL_NOTEXT 0x2u
/* A label of every metric of its table (ctl_out_metrics), named by its key; job and instance,
 * the names Prometheus keeps for its own, become ep_job and ep_instance. */
#define CTL_COL_LABEL 0x4u

struct ctl_col {
  const char *key;   /* JSON key: stable, documented in deepepctl(1) */
  const char *label; /* text label or column heading */
  enum ctl_kind kind;
  unsigned flags;
};

struct ctl_val {
  const char *s; /* CTL_STR */
  uint64_t u;    /* the numeric kinds; CTL_UINTS: how many */
  const uint32_t *list; /* CTL_UINTS */
  bool none;     /* no such value for this row: "-" in text, null in JSON, NaN in metrics */
};

/* A table of at most one row: in JSON an object, or null without a row. */
#define CTL_TABLE_ONE 0x1u
/* A table of one column: in JSON an array of its values (["a","b"]), not of objects. */
#define CTL_TABLE_LIST 0x2u
/* Only in JSON: the text says the same otherwise (in a field's words). */
#define CTL_TABLE_NOTEXT 0x4u

struct ctl_table {
  const char *key;   /* JSON key of the array; text section title */
  const char *empty; /* text shown for no rows, e.g. "no jobs" */
  const struct ctl_col *cols;
  size_t ncols;
  size_t nrows;
  const struct ctl_val *cells; /* nrows * ncols, row by row */
  unsigned flags;              /* CTL_TABLE_* */
};

/* One answer: summary fields, then tables. */
struct ctl_doc {
  const struct ctl_col *fields;
  const struct ctl_val *values;
  size_t nfields;
  const struct ctl_table *tables;
  size_t ntables;
};

/*
 * The Prometheus text exposition of tables (deepepctl metrics): a column
 * of a table that is also a metric, by the column's index.  Samples of one
 * family are printed together, after its HELP and TYPE, with the table's
 * CTL_COL_LABEL columns as labels, in the order the metrics are listed.
 */
struct ctl_metric {
  size_t col;         /* the column the value comes from */
  const char *family; /* "deepep_op_latency_seconds": HELP and TYPE name it */
  const char *suffix; /* after the family in the sample's name ("_sum"), or "" */
  const char *type;   /* counter, gauge or summary */
  const char *help;
  unsigned decimals;  /* the value is in units of 10^-decimals of the family's (9: ns to s) */
  const char *extra;  /* one more label ("quantile=\"0.5\""), or NULL */
};
struct ctl_mtable {
  const struct ctl_table *table;
  const struct ctl_metric *metrics;
  size_t nmetrics;
};
int ctl_out_metrics(FILE *f, const struct ctl_mtable *t, size_t n);

/* Render d as text or as one JSON object, to f.  Returns 0 or -1 (ENOMEM). */
int ctl_out_render(FILE *f, const struct ctl_doc *d, bool json);
/* A failure as "deepepctl: message" or as one JSON object,
 * {"error": {"code": n, "name": "DEP_ERR_...", "message": string}}. */
void ctl_out_error(FILE *f, int code, const char *message, bool json);

/* Human units, exposed for the tests of the renderer through deepepctl. */
void ctl_out_bytes(char *buf, size_t len, uint64_t bytes);
void ctl_out_duration(char *buf, size_t len, uint64_t ms);

#endif /* DEP_CTL_OUT_H */
