/*
 * check_config_defaults.c — each configuration default is written once, in
 * the key table (config/config_keys.c): the table's defaults load as a file
 * and are config_defaults()'s, and the shipped file, the man page and
 * the table of docs/configuration.md state each default as the table does.  Run from the
 * repository root (make check does).
 */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "config.h"
#include "config_keys.h"
#include "configtest.h"
#include "deepep.h"

#define SHIPPED "config/deepepd.yaml"

/* ---- the defaults: one column of the key table ---------------------------------- */

/*
 * Each default is written once, in the key table (config_keys.c).  The shipped file, the man
 * page and docs/configuration.md's table are checked against it here rather than generated from it: each is
 * prose around the values, written by hand, and generated copies would need a build step and
 * still a check that the committed copy is current.  A failure names the key, the document and
 * both values.
 */

/* Calls f for every leaf key of table ("pool.chunk_size"), and for each key of a list of
 * mappings ("peers[].port"). */
static void each_key(const struct key *table, const char *prefix,
                     void (*f)(const struct key *k, const char *path)) {
  for (const struct key *k = table; k->name != NULL; k++) {
    char path[96];
    snprintf(path, sizeof path, "%s%s%s", prefix, prefix[0] != '\0' ? "." : "", k->name);
    if (k->kind == K_SECTION) {
      each_key(k->sub, path, f);
      continue;
    }
    f(k, path);
    if (k->kind == K_PEERS) {
      char sub[100];
      snprintf(sub, sizeof sub, "%s[]", path);
      each_key(k->sub, sub, f);
    }
  }
}

static bool is_list(const struct key *k) {
  return k->kind == K_NAMES || k->kind == K_DEVICES || k->kind == K_PEERS;
}

/* The default as docs/configuration.md's table writes it, in backquotes: "" and [] as such. */
static const char *doc_form(const struct key *k) {
  return k->kind == K_STR && k->dflt[0] == '\0' ? "\"\"" : k->dflt;
}

static void has_a_default(const struct key *k, const char *path) {
  /* Only a peer's host (required) and transport (the top-level one) have none. */
  bool none = strcmp(path, "peers[].host") == 0 || strcmp(path, "peers[].transport") == 0;
  ck_assert_msg((k->dflt == NULL) == none, "'%s' %s a default in the key table", path,
                none ? "has" : "lacks");
}

START_TEST(every_key_has_its_default_in_the_table) {
  each_key(config__root_keys, "", has_a_default);
}
END_TEST

/* The table's defaults, written out as a file in the shipped spellings and loaded over garbage,
 * give what config_defaults() gives: each default passes the loader's own checks (type, range,
 * granule, the pool sizes against each other) and lands where the key says. */
static char table_yaml[8192], table_section[64];
static void write_default(const struct key *k, const char *path) {
  if (k->dflt == NULL || strchr(path, '[') != NULL)
    return;
  size_t o = strlen(table_yaml);
  const char *dot = strchr(path, '.'), *q = k->kind == K_STR ? "\"" : "";
  if (dot != NULL && strncmp(table_section, path, (size_t)(dot - path + 1)) != 0) {
    snprintf(table_section, sizeof table_section, "%.*s", (int)(dot - path + 1), path);
    o += (size_t)snprintf(table_yaml + o, sizeof table_yaml - o, "%.*s:\n", (int)(dot - path), path);
  } else if (dot == NULL) {
    table_section[0] = '\0';
  }
  snprintf(table_yaml + o, sizeof table_yaml - o, "%s%s: %s%s%s\n", dot != NULL ? "  " : "",
           dot != NULL ? dot + 1 : path, q, k->dflt, q);
}

START_TEST(the_tables_defaults_load_as_a_file_and_are_the_defaults) {
  table_yaml[0] = table_section[0] = '\0';
  each_key(config__root_keys, "", write_default);
  struct config *c = malloc(sizeof *c), want;
  memset(c, 0xa5, sizeof *c);
  int rc = ct_load(c, table_yaml);
  ck_assert_msg(rc == 0, "%s\n--- yaml:\n%s", ct_err, table_yaml);
  config_defaults(&want);
  ct_assert_same_config(c, &want);
  /* A peer that names only its host gets the table's port and the top-level transport. */
  ct_load_ok(c, "peers: [{host: a}]\npeer_insecure: true\n");
  ck_assert_uint_eq(c->peers[0].port, want.listen_port);
  ck_assert_int_eq(c->peers[0].transport, CONFIG_TRANSPORT_DEFAULT);
  free(c);
}
END_TEST

/* The shipped file: each value, as written, is the table's text (so "8 GiB" for "8GiB" fails
 * too, which loading alone would not see). */
static yaml_document_t shipped_doc;
static void shipped_matches(const struct key *k, const char *path) {
  if (k->dflt == NULL || strchr(path, '[') != NULL)
    return;
  yaml_node_t *n = yaml_document_get_root_node(&shipped_doc);
  char rest[96];
  snprintf(rest, sizeof rest, "%s", path);
  for (char *part = strtok(rest, "."); part != NULL && n != NULL; part = strtok(NULL, ".")) {
    yaml_node_t *found = NULL;
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start;
         n->type == YAML_MAPPING_NODE && p < n->data.mapping.pairs.top; p++)
      if (strcmp((char *)yaml_document_get_node(&shipped_doc, p->key)->data.scalar.value, part) == 0)
        found = yaml_document_get_node(&shipped_doc, p->value);
    n = found;
  }
  ck_assert_msg(n != NULL, SHIPPED " has no '%s'", path);
  if (is_list(k)) {
    ck_assert_msg(n->type == YAML_SEQUENCE_NODE &&
                      n->data.sequence.items.top == n->data.sequence.items.start,
                  SHIPPED ": '%s' is not the table's default, []", path);
    return;
  }
  ck_assert_msg(n->type == YAML_SCALAR_NODE && strcmp((char *)n->data.scalar.value, k->dflt) == 0,
                SHIPPED ": '%s' is '%s', the key table's default is '%s'", path,
                n->type == YAML_SCALAR_NODE ? (char *)n->data.scalar.value : "(not a value)",
                k->dflt);
}

START_TEST(shipped_file_writes_each_default_as_the_table_does) {
  const char *text = ct_read_text(SHIPPED);
  yaml_parser_t p;
  ck_assert(yaml_parser_initialize(&p));
  yaml_parser_set_input_string(&p, (const unsigned char *)text, strlen(text));
  ck_assert(yaml_parser_load(&p, &shipped_doc));
  each_key(config__root_keys, "", shipped_matches);
  yaml_document_delete(&shipped_doc);
  yaml_parser_delete(&p);
}
END_TEST

/* deepepd.yaml(5): a key's entry (".TP", ".B key", up to the next entry or section) says
 * "default" and then the value in bold (".BR 8GiB ,") or "empty" ("" and []).  A key of a list
 * of mappings is in its list's entry: ".B port" and then "default 7470". */
static const char *man_text;

/* The words after "default" at `at` in the form the man page writes them, or "" when none. */
static void man_word(const char *at, char *word, size_t len) {
  size_t n;
  if (strncmp(at, "\n.BR ", 5) == 0 || strncmp(at, "\n.B ", 4) == 0)
    at = strchr(at + 1, ' ') + 1;
  else if (at[0] == ' ')
    at++;
  else
    at = "";
  n = strcspn(at, " \n),;");
  if (n > 0 && at[n - 1] == '.') /* a sentence's end: "default empty." */
    n--;
  snprintf(word, len, "%.*s", (int)n, at);
}

static void man_matches(const struct key *k, const char *path) {
  if (k->dflt == NULL)
    return;
  char head[128], word[128] = "";
  const char *sub = strstr(path, "[].");
  snprintf(head, sizeof head, ".TP\n.B %.*s\n",
           sub != NULL ? (int)(sub - path) : (int)strlen(path), path);
  const char *at = strstr(man_text, head);
  ck_assert_msg(at != NULL, "man/deepepd.yaml.5 has no entry '.B %s'", path);
  at += strlen(head);
  /* The entry ends where the next one (or a section) starts. */
  size_t len = strlen(at);
  static const char *const ends[] = {"\n.TP\n", "\n.SS ", "\n.SH "};
  for (size_t i = 0; i < sizeof ends / sizeof ends[0]; i++) {
    const char *e = strstr(at, ends[i]);
    if (e != NULL && (size_t)(e - at) < len)
      len = (size_t)(e - at);
  }
  char entry[8192];
  snprintf(entry, sizeof entry, "%.*s", (int)len, at);
  const char *from = entry;
  if (sub != NULL) { /* ".B port" within the list's entry */
    char key[64];
    snprintf(key, sizeof key, "\n.B %s\n", sub + 3);
    from = strstr(entry, key);
    ck_assert_msg(from != NULL, "man/deepepd.yaml.5: the entry of '%.*s' names no '%s'",
                  (int)(sub - path), path, sub + 3);
  }
  /* The first "default" followed by a value: "default: the top-level transport" is none. */
  for (const char *d = strstr(from, "default"); d != NULL && word[0] == '\0';
       d = strstr(d + 1, "default")) {
    man_word(d + strlen("default"), word, sizeof word);
    /* In a list's own entry a key of its entries comes first ("port (1 to 65535; default
     * 7470)"): the list's default is the "default empty" after them. */
    if (sub == NULL && is_list(k) && strcmp(word, "empty") != 0)
      word[0] = '\0';
  }
  const char *want = is_list(k) || (k->kind == K_STR && k->dflt[0] == '\0') ? "empty" : k->dflt;
  ck_assert_msg(strcmp(word, want) == 0,
                "man/deepepd.yaml.5 gives '%s' the default '%s', the key table '%s'", path, word,
                want);
}

START_TEST(man_page_states_each_default_as_the_table_does) {
  man_text = ct_read_text("man/deepepd.yaml.5");
  each_key(config__root_keys, "", man_matches);
}
END_TEST

/* docs/configuration.md's key table: "| `key` | `default` |", "" and [] as written in the file. */
#define CONFIG_DOC "docs/configuration.md"
static const char *doc_text;
static void doc_matches(const struct key *k, const char *path) {
  if (k->dflt == NULL)
    return;
  char row[128], word[128];
  snprintf(row, sizeof row, "\n| `%s` | ", path);
  const char *at = strstr(doc_text, row);
  ck_assert_msg(at != NULL, CONFIG_DOC "'s key table has no row for '%s'", path);
  at += strlen(row);
  ck_assert_msg(at[0] == '`', CONFIG_DOC " gives '%s' no default in backquotes", path);
  snprintf(word, sizeof word, "%.*s", (int)strcspn(at + 1, "`"), at + 1);
  ck_assert_msg(strcmp(word, doc_form(k)) == 0,
                CONFIG_DOC " gives '%s' the default '%s', the key table '%s'", path, word,
                doc_form(k));
}

START_TEST(configuration_doc_states_each_default_as_the_table_does) {
  doc_text = ct_read_text(CONFIG_DOC);
  each_key(config__root_keys, "", doc_matches);
}
END_TEST

/* stream_chunk_rows takes auto (its default) besides a number, in any case; anything else is
 * refused naming both.  On the old code the default was 0, auto was refused as not a decimal integer, and the
 * messages said only "a decimal integer" / "between 0 and 65536". */
START_TEST(stream_chunk_rows_takes_auto_besides_a_number) {
  struct config c;
  config_defaults(&c);
  ck_assert_uint_eq(c.stream_chunk_rows, CONFIG_CHUNK_ROWS_AUTO);
  ct_load_ok(&c, "stream_chunk_rows: 64\n");
  ck_assert_uint_eq(c.stream_chunk_rows, 64);
  ct_load_ok(&c, "stream_chunk_rows: 0\n");
  ck_assert_uint_eq(c.stream_chunk_rows, 0);
  ct_load_ok(&c, "stream_chunk_rows: AUTO\n");
  ck_assert_uint_eq(c.stream_chunk_rows, CONFIG_CHUNK_ROWS_AUTO);
  ck_assert_int_eq(ct_load(&c, "stream_chunk_rows: foo\n"), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err, "t.yaml:1:20: expected auto or a decimal integer for "
                           "'stream_chunk_rows', got 'foo'");
  ck_assert_int_eq(ct_load(&c, "stream_chunk_rows: -1\n"), DEP_ERR_CONFIG);
  ck_assert_str_eq(ct_err, "t.yaml:1:20: 'stream_chunk_rows' must be auto or between 0 and "
                           "65536, got -1");
  ck_assert_int_eq(ct_load(&c, "stream_chunk_rows: 4294967295\n"), DEP_ERR_CONFIG);
  ck_assert_int_eq(ct_load(&c, "stream_chunk_rows: autox\n"), DEP_ERR_CONFIG);
  ck_assert_uint_eq(c.stream_chunk_rows, CONFIG_CHUNK_ROWS_AUTO); /* refused files change nothing */
  ck_assert_int_eq(ct_load(&c, "proxy_threads: auto\n"), DEP_ERR_CONFIG); /* no word elsewhere */
}
END_TEST

Suite *config_defaults_suite(void);
Suite *config_defaults_suite(void) {
  Suite *s = suite_create("config_defaults");
  TCase *t = tcase_create("defaults");
  tcase_add_test(t, every_key_has_its_default_in_the_table);
  tcase_add_test(t, the_tables_defaults_load_as_a_file_and_are_the_defaults);
  tcase_add_test(t, shipped_file_writes_each_default_as_the_table_does);
  tcase_add_test(t, man_page_states_each_default_as_the_table_does);
  tcase_add_test(t, configuration_doc_states_each_default_as_the_table_does);
  tcase_add_test(t, stream_chunk_rows_takes_auto_besides_a_number);
  suite_add_tcase(s, t);
  return s;
}
