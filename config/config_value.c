/*
 * config_value.c — text to value for deepepd.yaml's scalars (see
 * config_value.h).  Every parser is bounded by the length it is given and
 * refuses rather than guesses.
 */
#include "config_value.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

int config_value_int(const char *s, size_t n, int64_t *out) {
  size_t i = 0;
  bool neg = false;
  if (i < n && (s[i] == '+' || s[i] == '-'))
    neg = s[i++] == '-';
  if (i == n || (s[i] == '0' && n - i > 1))
    return CONFIG_VALUE_BAD;
  uint64_t v = 0;
  bool big = false;
  for (; i < n; i++) {
    if (s[i] < '0' || s[i] > '9')
      return CONFIG_VALUE_BAD;
    if (v > TiB) /* far past every range, and far from overflowing */
      big = true;
    else
      v = v * 10 + (uint64_t)(s[i] - '0');
  }
  if (big)
    return CONFIG_VALUE_TOO_BIG;
  *out = neg ? -(int64_t)v : (int64_t)v;
  return CONFIG_VALUE_OK;
}

int config_value_size(const char *s, size_t n, uint64_t *out, size_t *unit_at) {
  static const struct {
    const char *name;
    uint64_t mult;
  } units[] = {{"B", 1}, {"KiB", KiB}, {"MiB", MiB}, {"GiB", GiB}, {"TiB", TiB}};
  size_t i = 0;
  uint64_t v = 0;
  bool big = false;
  for (; i < n && s[i] >= '0' && s[i] <= '9'; i++) {
    if (v > (UINT64_C(1) << 50))
      big = true;
    else
      v = v * 10 + (uint64_t)(s[i] - '0');
  }
  if (i == 0)
    return CONFIG_VALUE_BAD;
  /* A fraction is refused, but read: frac / scale, to say what it comes to in bytes.  Six
   * digits (trailing zeros aside) keep frac * TiB within 64 bits. */
  bool fraction = false, exact = true;
  uint64_t frac = 0, scale = 1;
  if (i < n && s[i] == '.') {
    fraction = true;
    size_t from = ++i;
    while (i < n && s[i] >= '0' && s[i] <= '9')
      i++;
    if (i == from)
      return CONFIG_VALUE_BAD;
    size_t to = i;
    while (to > from && s[to - 1] == '0')
      to--;
    exact = to - from <= 6;
    for (size_t k = from; exact && k < to; k++) {
      frac = frac * 10 + (uint64_t)(s[k] - '0');
      scale *= 10;
    }
  }
  while (i < n && s[i] == ' ')
    i++;
  *unit_at = i;
  uint64_t mult = 1;
  if (i < n) {
    size_t k = 0, ulen = n - i;
    while (k < sizeof units / sizeof units[0] &&
           !(strlen(units[k].name) == ulen && strncasecmp(s + i, units[k].name, ulen) == 0))
      k++;
    if (k == sizeof units / sizeof units[0])
      return CONFIG_VALUE_UNIT;
    mult = units[k].mult;
  }
  if (fraction) {
    *out = 0;
    if (exact && !big && v <= (UINT64_MAX - mult) / mult && frac * mult % scale == 0)
      *out = v * mult + frac * mult / scale;
    return CONFIG_VALUE_FRACTION;
  }
  if (big || v > UINT64_MAX / mult)
    return CONFIG_VALUE_TOO_BIG;
  *out = v * mult;
  return CONFIG_VALUE_OK;
}

int config_value_mode(const char *s, size_t n, uint64_t *out) {
  size_t i = 0;
  if (n >= 2 && s[0] == '0' && (s[1] == 'o' || s[1] == 'O'))
    i = 2;
  if (i == n)
    return CONFIG_VALUE_BAD;
  uint64_t v = 0;
  bool big = false;
  for (; i < n; i++) {
    if (s[i] < '0' || s[i] > '7')
      return CONFIG_VALUE_BAD;
    if (v > 07777777)
      big = true;
    else
      v = v * 8 + (uint64_t)(s[i] - '0');
  }
  if (big)
    return CONFIG_VALUE_TOO_BIG;
  *out = v;
  return CONFIG_VALUE_OK;
}

int config_value_ratio(const char *s, size_t n, double *out) {
  char buf[40];
  if (n == 0 || n >= sizeof buf)
    return CONFIG_VALUE_BAD;
  memcpy(buf, s, n);
  buf[n] = '\0';
  if (strspn(buf, "0123456789.eE+-") != n)
    return CONFIG_VALUE_BAD;
  char *end;
  errno = 0;
  double d = strtod(buf, &end);
  if (end != buf + n || !isfinite(d))
    return CONFIG_VALUE_BAD;
  if (errno == ERANGE)
    return CONFIG_VALUE_TOO_BIG;
  *out = d;
  return CONFIG_VALUE_OK;
}

int config_value_bool(const char *s, size_t n, bool *out) {
  static const char *const yes[] = {"true", "yes", "on"}, *const no[] = {"false", "no", "off"};
  for (int i = 0; i < 3; i++) {
    if (strlen(yes[i]) == n && strncasecmp(s, yes[i], n) == 0)
      return *out = true, CONFIG_VALUE_OK;
    if (strlen(no[i]) == n && strncasecmp(s, no[i], n) == 0)
      return *out = false, CONFIG_VALUE_OK;
  }
  return CONFIG_VALUE_BAD;
}

bool config_value_gpu_uuid(const char *s) {
  if (strncmp(s, "GPU-", 4) == 0)
    s += 4;
  if (strlen(s) != 36)
    return false;
  for (int i = 0; i < 36; i++) {
    bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? s[i] != '-' : !isxdigit((unsigned char)s[i]))
      return false;
  }
  return true;
}

const char *config_value_size_text(uint64_t v, char *buf, size_t len) {
  static const char *const unit[] = {"TiB", "GiB", "MiB", "KiB"};
  for (int i = 0; i < 4; i++) {
    uint64_t u = UINT64_C(1) << (40 - 10 * i);
    if (v >= u && v % u == 0) {
      snprintf(buf, len, "%" PRIu64 " %s", v / u, unit[i]);
      return buf;
    }
  }
  snprintf(buf, len, "%" PRIu64 " bytes", v);
  return buf;
}
