/*
 * ctl_out.c — the one output table (ctl_out.h): a command builds its answer as
 * records (summary fields, then tables of rows) and this file renders them
 * either as aligned text for people or as one JSON object for machines, so
 * the two can never disagree about what the daemon said.  A failure is
 * rendered here too, as "deepepctl: message" or as a JSON error object.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl_out.h"
#include "deepep.h"

/* A number, size or duration as text fits here; a string cell is as long as its string. */
#define CTL_NUM_MAX 64

void ctl_out_bytes(char *buf, size_t len, uint64_t bytes) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) {
    snprintf(buf, len, "%" PRIu64 " B", bytes);
    return;
  }
  double v = (double)bytes;
  size_t i = 0;
  while (v >= 1024.0 && i + 1 < sizeof unit / sizeof unit[0]) {
    v /= 1024.0;
    i++;
  }
  snprintf(buf, len, "%.1f %s", v, unit[i]);
}

void ctl_out_duration(char *buf, size_t len, uint64_t ms) {
  uint64_t s = ms / 1000;
  uint64_t d = s / 86400, h = s / 3600 % 24, m = s / 60 % 60, sec = s % 60;
  if (d > 0)
    snprintf(buf, len, "%" PRIu64 "d %02" PRIu64 "h %02" PRIu64 "m %02" PRIu64 "s", d, h, m, sec);
  else if (h > 0)
    snprintf(buf, len, "%" PRIu64 "h %02" PRIu64 "m %02" PRIu64 "s", h, m, sec);
  else if (m > 0)
    snprintf(buf, len, "%" PRIu64 "m %02" PRIu64 "s", m, sec);
  else if (s > 0)
    snprintf(buf, len, "%" PRIu64 "s", sec);
  else
    snprintf(buf, len, "%" PRIu64 "ms", ms);
}

/* ---- text ------------------------------------------------------------------ */

/* One value as text, in a string of its own (the caller frees it), or NULL (ENOMEM).  Strings
 * come from the daemon: terminal control bytes are kept out of the text, and a string is never
 * cut, since a reload's or a drain's answer and a peer's last error run past any fixed width. */
static char *ctl_out_cell(const struct ctl_col *col, const struct ctl_val *v) {
  char buf[CTL_NUM_MAX];
  if (v->none)
    return strdup("-");
  switch (col->kind) {
  case CTL_STR: {
    const char *s = v->s != NULL && v->s[0] != '\0' ? v->s : "-";
    char *out = strdup(s);
    if (out != NULL)
      for (char *p = out; *p != '\0'; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
          *p = '?';
    return out;
  }
  case CTL_UINT:
    snprintf(buf, sizeof buf, "%" PRIu64, v->u);
    break;
  case CTL_BYTES:
    ctl_out_bytes(buf, sizeof buf, v->u);
    break;
  case CTL_MS:
    ctl_out_duration(buf, sizeof buf, v->u);
    break;
  case CTL_NS:
    if (v->u < 1000000)
      snprintf(buf, sizeof buf, "%.1f us", (double)v->u / 1e3);
    else
      snprintf(buf, sizeof buf, "%.2f ms", (double)v->u / 1e6);
    break;
  case CTL_MILLI:
    snprintf(buf, sizeof buf, "%.2f", (double)v->u / 1e3);
    break;
  case CTL_BOOL:
    snprintf(buf, sizeof buf, "%s", v->u != 0 ? "yes" : "no");
    break;
  case CTL_UINTS:
    snprintf(buf, sizeof buf, "%" PRIu64 " values", v->u);
    break;
  default:
    buf[0] = '\0';
  }
  return strdup(buf);
}

/* "a" + "/" + "b" in a new string; frees a.  NULL (and a freed) on ENOMEM. */
static char *ctl_out_join(char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  char *j = realloc(a, la + 1 + lb + 1);
  if (j == NULL) {
    free(a);
    return NULL;
  }
  j[la] = '/';
  memcpy(j + la + 1, b, lb + 1);
  return j;
}

static void ctl_out_free_cells(char **cell, size_t n) {
  for (size_t i = 0; cell != NULL && i < n; i++)
    free(cell[i]);
  free(cell);
}

static int ctl_out_text_table(FILE *f, const struct ctl_table *t) {
  fprintf(f, "\n%s:\n", t->key);
  if (t->nrows == 0) {
    fprintf(f, "  %s\n", t->empty);
    return 0;
  }
  /* Visible columns: a joined column folds into the one before it. */
  size_t nvis = 0;
  for (size_t c = 0; c < t->ncols; c++)
    if (((t->cols[c].flags & CTL_COL_JOIN) == 0 || c == 0) &&
        (t->cols[c].flags & CTL_COL_NOTEXT) == 0)
      nvis++;
  size_t ncells = (t->nrows + 1) * nvis;
  char **cell = calloc(ncells, sizeof *cell);
  size_t *width = calloc(nvis, sizeof *width);
  bool *right = calloc(nvis, sizeof *right);
  int rc = cell == NULL || width == NULL || right == NULL ? -1 : 0;
  for (size_t c = 0, v = 0; rc == 0 && c < t->ncols; c++) {
    if (((t->cols[c].flags & CTL_COL_JOIN) != 0 && c > 0) ||
        (t->cols[c].flags & CTL_COL_NOTEXT) != 0)
      continue;
    if ((cell[v] = strdup(t->cols[c].label)) == NULL)
      rc = -1;
    right[v] = t->cols[c].kind != CTL_STR;
    v++;
  }
  for (size_t r = 0; rc == 0 && r < t->nrows; r++) {
    char **row = cell + (r + 1) * nvis;
    size_t v = 0;
    for (size_t c = 0; rc == 0 && c < t->ncols; c++) {
      if ((t->cols[c].flags & CTL_COL_NOTEXT) != 0)
        continue;
      char *text = ctl_out_cell(&t->cols[c], &t->cells[r * t->ncols + c]);
      if (text == NULL) {
        rc = -1;
      } else if ((t->cols[c].flags & CTL_COL_JOIN) != 0 && v > 0) {
        row[v - 1] = ctl_out_join(row[v - 1], text);
        free(text);
        if (row[v - 1] == NULL)
          rc = -1;
      } else {
        row[v++] = text;
      }
    }
  }
  if (rc != 0) {
    ctl_out_free_cells(cell, ncells);
    free(width);
    free(right);
    return -1;
  }
  for (size_t i = 0; i < ncells; i++) {
    size_t w = strlen(cell[i]);
    if (w > width[i % nvis])
      width[i % nvis] = w;
  }
  for (size_t r = 0; r <= t->nrows; r++) {
    fputs(" ", f);
    for (size_t v = 0; v < nvis; v++) {
      const char *s = cell[r * nvis + v];
      bool last = v + 1 == nvis;
      if (right[v])
        fprintf(f, " %*s", (int)width[v], s);
      else if (last)
        fprintf(f, " %s", s);
      else
        fprintf(f, " %-*s", (int)width[v], s);
      if (!last)
        fputs(" ", f);
    }
    fputs("\n", f);
  }
  ctl_out_free_cells(cell, ncells);
  free(width);
  free(right);
  return 0;
}

static int ctl_out_text(FILE *f, const struct ctl_doc *d) {
  size_t w = 0;
  for (size_t i = 0; i < d->nfields; i++)
    if (strlen(d->fields[i].label) > w)
      w = strlen(d->fields[i].label);
  for (size_t i = 0; i < d->nfields; i++) {
    char *text = ctl_out_cell(&d->fields[i], &d->values[i]);
    if (text == NULL)
      return -1;
    fprintf(f, "%s:%*s %s\n", d->fields[i].label, (int)(w - strlen(d->fields[i].label)), "",
            text);
    free(text);
  }
  for (size_t i = 0; i < d->ntables; i++)
    if ((d->tables[i].flags & CTL_TABLE_NOTEXT) == 0 && ctl_out_text_table(f, &d->tables[i]) != 0)
      return -1;
  return 0;
}

/* ---- JSON ------------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at p (1..4), or 0 when it is not one. */
static size_t ctl_out_utf8_len(const unsigned char *p) {
  unsigned char b = p[0];
  if (b < 0x80)
    return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xbf;
  if (b >= 0xc2 && b <= 0xdf)
    n = 2;
  else if (b >= 0xe0 && b <= 0xef) {
    n = 3;
    if (b == 0xe0)
      lo = 0xa0; /* overlong */
    if (b == 0xed)
      hi = 0x9f; /* surrogates */
  } else if (b >= 0xf0 && b <= 0xf4) {
    n = 4;
    if (b == 0xf0)
      lo = 0x90;
    if (b == 0xf4)
      hi = 0x8f; /* beyond U+10FFFF */
  } else
    return 0;
  if (p[1] < lo || p[1] > hi)
    return 0;
  for (size_t i = 2; i < n; i++)
    if (p[i] < 0x80 || p[i] > 0xbf)
      return 0;
  return n;
}

/* A JSON string: escapes per RFC 8259; bytes that are not UTF-8 become U+FFFD. */
static void ctl_out_json_str(FILE *f, const char *s) {
  const unsigned char *p = (const unsigned char *)(s != NULL ? s : "");
  fputc('"', f);
  while (*p != '\0') {
    unsigned char b = *p;
    switch (b) {
    case '"':
      fputs("\\\"", f);
      break;
    case '\\':
      fputs("\\\\", f);
      break;
    case '\b':
      fputs("\\b", f);
      break;
    case '\f':
      fputs("\\f", f);
      break;
    case '\n':
      fputs("\\n", f);
      break;
    case '\r':
      fputs("\\r", f);
      break;
    case '\t':
      fputs("\\t", f);
      break;
    default:
      if (b < 0x20) {
        fprintf(f, "\\u%04x", b);
      } else {
        size_t n = ctl_out_utf8_len(p);
        if (n == 0) {
          fputs("\\ufffd", f);
        } else {
          fwrite(p, 1, n, f);
          p += n - 1;
        }
      }
    }
    p++;
  }
  fputc('"', f);
}

/* A value in its JSON type: a string, a number, true or false, or null where the row has none
 * (where the text shows "-"), never a number or a string standing in for one of the others. */
static void ctl_out_json_bare(FILE *f, const struct ctl_col *col, const struct ctl_val *v) {
  if (v->none)
    fputs("null", f);
  else if (col->kind == CTL_BOOL)
    fputs(v->u != 0 ? "true" : "false", f);
  else if (col->kind == CTL_STR)
    ctl_out_json_str(f, v->s);
  else if (col->kind == CTL_MILLI)
    fprintf(f, "%" PRIu64 ".%03" PRIu64, v->u / 1000, v->u % 1000);
  else if (col->kind == CTL_UINTS) {
    fputc('[', f);
    for (uint64_t k = 0; k < v->u; k++)
      fprintf(f, k == 0 ? "%" PRIu32 : ",%" PRIu32, v->list[k]);
    fputc(']', f);
  } else
    fprintf(f, "%" PRIu64, v->u);
}

/* "key":value. */
static void ctl_out_json_val(FILE *f, const struct ctl_col *col, const struct ctl_val *v) {
  ctl_out_json_str(f, col->key);
  fputc(':', f);
  ctl_out_json_bare(f, col, v);
}

static void ctl_out_json(FILE *f, const struct ctl_doc *d) {
  bool first = true;
  fputc('{', f);
  for (size_t i = 0; i < d->nfields; i++) {
    if (!first)
      fputc(',', f);
    first = false;
    ctl_out_json_val(f, &d->fields[i], &d->values[i]);
  }
  for (size_t i = 0; i < d->ntables; i++) {
    const struct ctl_table *t = &d->tables[i];
    if (!first)
      fputc(',', f);
    first = false;
    ctl_out_json_str(f, t->key);
    fputc(':', f);
    bool one = (t->flags & CTL_TABLE_ONE) != 0;
    if (one && t->nrows == 0) {
      fputs("null", f);
      continue;
    }
    if (!one)
      fputc('[', f);
    if ((t->flags & CTL_TABLE_LIST) != 0 && !one) {
      for (size_t r = 0; r < t->nrows; r++) {
        if (r > 0)
          fputc(',', f);
        ctl_out_json_bare(f, &t->cols[0], &t->cells[r * t->ncols]);
      }
      fputc(']', f);
      continue;
    }
    for (size_t r = 0; r < (one ? 1 : t->nrows); r++) {
      fputs(r == 0 ? "{" : ",{", f);
      for (size_t c = 0; c < t->ncols; c++) {
        if (c > 0)
          fputc(',', f);
        ctl_out_json_val(f, &t->cols[c], &t->cells[r * t->ncols + c]);
      }
      fputc('}', f);
    }
    if (!one)
      fputc(']', f);
  }
  fputs("}\n", f);
}

/* ---- Prometheus text exposition ----------------------------------------------- */

/* A label value: backslash, double quote and newline escaped, as the format wants. */
static void ctl_out_label_value(FILE *f, const char *s) {
  fputc('"', f);
  for (const char *p = s != NULL ? s : ""; *p != '\0'; p++) {
    if (*p == '\\' || *p == '"')
      fputc('\\', f), fputc(*p, f);
    else if (*p == '\n')
      fputs("\\n", f);
    else
      fputc(*p, f);
  }
  fputc('"', f);
}

/* A column's label name.  Prometheus gives every series it scrapes the labels `job` and
 * `instance` of its own (the scrape's) and renames a sample's labels of those names to
 * exported_*: ours take the prefix ep_ instead, so that a query names them as deepepctl(1)
 * does. */
static void ctl_out_label_name(FILE *f, const char *key) {
  if (strcmp(key, "job") == 0 || strcmp(key, "instance") == 0)
    fputs("ep_", f);
  fputs(key, f);
}

static void ctl_out_labels(FILE *f, const struct ctl_table *t, size_t r, const char *extra) {
  bool any = false;
  for (size_t c = 0; c < t->ncols; c++) {
    if ((t->cols[c].flags & CTL_COL_LABEL) == 0)
      continue;
    const struct ctl_val *v = &t->cells[r * t->ncols + c];
    fputs(any ? "," : "{", f);
    any = true;
    ctl_out_label_name(f, t->cols[c].key);
    fputc('=', f);
    if (t->cols[c].kind == CTL_STR) {
      ctl_out_label_value(f, v->s);
    } else {
      char num[32];
      snprintf(num, sizeof num, "%" PRIu64, v->u);
      ctl_out_label_value(f, num);
    }
  }
  if (extra != NULL) {
    fputs(any ? "," : "{", f);
    fputs(extra, f);
    any = true;
  }
  if (any)
    fputc('}', f);
}

/* v units of 10^-decimals as an exact decimal, trailing zeros left out: a counter or a byte
 * count is the integer it is (1073741824, never 1.07374182e+09), and 1500 ns is 0.0000015 s. */
static void ctl_out_decimal(FILE *f, uint64_t v, unsigned decimals) {
  uint64_t unit = 1;
  for (unsigned i = 0; i < decimals; i++)
    unit *= 10;
  fprintf(f, "%" PRIu64, v / unit);
  uint64_t frac = v % unit;
  if (frac == 0)
    return;
  while (frac % 10 == 0) {
    frac /= 10;
    decimals--;
  }
  fprintf(f, ".%0*" PRIu64, (int)decimals, frac);
}

int ctl_out_metrics(FILE *f, const struct ctl_mtable *mt, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const struct ctl_table *t = mt[i].table;
    for (size_t m = 0; m < mt[i].nmetrics; m++) {
      const struct ctl_metric *d = &mt[i].metrics[m];
      /* A family's HELP and TYPE once, before its first sample. */
      if (m == 0 || strcmp(mt[i].metrics[m - 1].family, d->family) != 0)
        fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", d->family, d->help, d->family, d->type);
      for (size_t r = 0; r < t->nrows; r++) {
        fprintf(f, "%s%s", d->family, d->suffix);
        ctl_out_labels(f, t, r, d->extra);
        const struct ctl_val *v = &t->cells[r * t->ncols + d->col];
        fputc(' ', f);
        /* A value the row has not (a quantile of no observation) is NaN, as the format and
         * Prometheus's own clients have it, not a 0 that reads as a measurement. */
        if (v->none)
          fputs("NaN", f);
        else
          ctl_out_decimal(f, v->u, d->decimals + (t->cols[d->col].kind == CTL_MILLI ? 3 : 0));
        fputc('\n', f);
      }
    }
  }
  return ferror(f) ? -1 : 0;
}

int ctl_out_render(FILE *f, const struct ctl_doc *d, bool json) {
  if (json) {
    ctl_out_json(f, d);
    return 0;
  }
  return ctl_out_text(f, d);
}

/* Errors are records too: with --json a script parses the failure from the
 * same stream as the answer, by its stable name rather than its wording. */
void ctl_out_error(FILE *f, int code, const char *message, bool json) {
  if (!json) {
    /* The message may quote the daemon: keep terminal control bytes out. */
    fputs("deepepctl: ", f);
    for (const char *p = message; *p != '\0'; p++)
      fputc(((unsigned char)*p < 0x20 || *p == 0x7f) ? '?' : *p, f);
    fputc('\n', f);
    return;
  }
  fprintf(f, "{\"error\":{\"code\":%d,\"name\":", code);
  ctl_out_json_str(f, dep_errname(code));
  fputs(",\"message\":", f);
  ctl_out_json_str(f, message);
  fputs("}}\n", f);
}
