/*
 * config_accounts.c — whether the accounts deepepd.yaml names exist on this
 * host (config_check_accounts, config.h).
 */
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

/* 1 when the user (or group) exists or `name` is a numeric id, 0 when there is no such
 * account, else a negative errno: the lookup itself failed. */
static int account_exists(const char *name, bool group) {
  if (name[0] != '\0' && strspn(name, "0123456789") == strlen(name))
    return 1;
  int rc = ERANGE;
  bool found = false;
  /* A group with many members needs a large buffer: grow it as the lookup asks. */
  for (size_t size = 16384; rc == ERANGE && size <= 16u << 20; size *= 2) {
    char *buf = malloc(size);
    if (buf == NULL)
      return -ENOMEM;
    if (group) {
      struct group gr, *res = NULL;
      rc = getgrnam_r(name, &gr, buf, size, &res);
      found = rc == 0 && res != NULL;
    } else {
      struct passwd pw, *res = NULL;
      rc = getpwnam_r(name, &pw, buf, size, &res);
      found = rc == 0 && res != NULL;
    }
    free(buf);
  }
  if (found)
    return 1;
  /* getpwnam(3): these mean "not found" too. */
  if (rc == 0 || rc == ENOENT || rc == ESRCH || rc == EBADF || rc == EPERM)
    return 0;
  return -rc;
}

/* Look up one name of key `path`; a missing one is added to the problems. */
static void check_account(const char *path, const char *verb, const char *name, bool group,
                          char *out, size_t len, size_t *count) {
  int rc = account_exists(name, group);
  if (rc == 1)
    return;
  char entry[400];
  if (rc == 0)
    snprintf(entry, sizeof entry, "'%s' %s '%s': no such %s on this host (getent %s lists them)",
             path, verb, name, group ? "group" : "user", group ? "group" : "passwd");
  else
    snprintf(entry, sizeof entry, "'%s' %s '%s': cannot look it up: %s", path, verb, name,
             strerror(-rc));
  if (out != NULL && len > 0) {
    size_t used = strlen(out);
    if (used < len)
      snprintf(out + used, len - used, "%s%s", *count > 0 ? "; " : "", entry);
  }
  (*count)++;
}

size_t config_check_accounts(const struct config *c, unsigned which, char *problems,
                             size_t len) {
  size_t count = 0;
  if (problems != NULL && len > 0)
    problems[0] = '\0';
  if (c == NULL)
    return 0;
  if ((which & CONFIG_ACCOUNTS_SOCKET) && c->socket_group[0] != '\0')
    check_account("socket.group", "is", c->socket_group, true, problems, len, &count);
  if (which & CONFIG_ACCOUNTS_ALLOW) {
    for (size_t i = 0; i < c->n_allow_users && i < CONFIG_MAX_LIST; i++)
      check_account("allow.users", "lists", c->allow_users[i], false, problems, len, &count);
    for (size_t i = 0; i < c->n_allow_groups && i < CONFIG_MAX_LIST; i++)
      check_account("allow.groups", "lists", c->allow_groups[i], true, problems, len, &count);
  }
  return count;
}
