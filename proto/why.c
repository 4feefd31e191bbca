/*
 * why.c — failure messages of checks (why.h).
 */
#include "why.h"

#include <stdarg.h>
#include <stdio.h>

void why_set(char *why, size_t whylen, const char *fmt, ...) {
  if (why != NULL && whylen > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, whylen, fmt, ap);
    va_end(ap);
  }
}

int why_fail(char *why, size_t whylen, int code, const char *fmt, ...) {
  if (why != NULL && whylen > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, whylen, fmt, ap);
    va_end(ap);
  }
  return code;
}
