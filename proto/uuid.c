/*
 * uuid.c — a GPU's UUID as text and back (uuid.h).
 */
#include "uuid.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

void dep__uuid_str(const uint8_t u[16], char out[DEP_UUID_STR_LEN]) {
  snprintf(out, DEP_UUID_STR_LEN,
           "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
           u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

int dep__uuid_parse(const char *s, uint8_t out[16]) {
  if (strncmp(s, "GPU-", 4) == 0)
    s += 4;
  int n = 0;
  for (; *s != '\0'; s++) {
    if (*s == '-')
      continue;
    if (!isxdigit((unsigned char)*s) || n >= 32 || !isxdigit((unsigned char)s[1]))
      return -1;
    unsigned v;
    if (sscanf(s, "%2x", &v) != 1)
      return -1;
    out[n / 2] = (uint8_t)v;
    n += 2;
    s++;
  }
  return n == 32 ? 0 : -1;
}
