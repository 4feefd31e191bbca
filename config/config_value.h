/*
 * config_value.h — the spellings of scalar values that deepepd.yaml accepts
 * (sizes with binary units, octal modes, booleans, decimal integers, plain
 * real numbers, GPU UUIDs), apart from the YAML walk in config.c so that the
 * rules can be read, and changed, in one place.  Internal to config/.
 *
 * Parsers take the text and its length (YAML scalars may hold NUL bytes)
 * and return CONFIG_VALUE_OK or why the text was refused.
 */
#ifndef DEP_CONFIG_VALUE_H
#define DEP_CONFIG_VALUE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KiB (UINT64_C(1) << 10)
#define MiB (UINT64_C(1) << 20)
#define GiB (UINT64_C(1) << 30)
#define TiB (UINT64_C(1) << 40)

enum config_value_rc {
  CONFIG_VALUE_OK = 0,
  CONFIG_VALUE_BAD = -1,     /* not this kind of value at all */
  CONFIG_VALUE_TOO_BIG = -2, /* the right kind, but beyond anything a key accepts */
  CONFIG_VALUE_UNIT = -3,    /* a size with a unit that is not B, KiB, MiB, GiB or TiB */
  CONFIG_VALUE_FRACTION = -4, /* a size with a fractional part ("1.5GiB"): sizes are whole */
};

/* [+-]digits, no leading zeros (YAML 1.1 reads 010 as octal; guessing is worse than asking). */
int config_value_int(const char *s, size_t n, int64_t *out);
/*
 * Digits, optional spaces, optional unit (any case); *unit_at is where the unit starts.
 * A fractional number ("1.5GiB") is CONFIG_VALUE_FRACTION, with *out set to the bytes it
 * stands for when they are a whole number (1.5GiB: 1610612736), else 0, so that the
 * message can say how to write it.
 */
int config_value_size(const char *s, size_t n, uint64_t *out, size_t *unit_at);
/* Octal digits as chmod(1) reads them: 0660, 660 and 0o660 are one mode. */
int config_value_mode(const char *s, size_t n, uint64_t *out);
/* A finite real number written plainly (no nan, inf or hex). */
int config_value_ratio(const char *s, size_t n, double *out);
/* true/false, yes/no, on/off in any case. */
int config_value_bool(const char *s, size_t n, bool *out);
/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", or the same without "GPU-". */
bool config_value_gpu_uuid(const char *s);
/* "64 MiB", "3 GiB", or "N bytes" when no unit divides v; returns buf. */
const char *config_value_size_text(uint64_t v, char *buf, size_t len);

#endif /* DEP_CONFIG_VALUE_H */
