/*
 * why.h — the one way a check says why it failed: a printf-style message
 * into the caller's buffer (which may be NULL), and the DEP_ERR_* code
 * returned, so that a check reads `return why_fail(why, len, code, ...)`.
 * Shared by the protocol, shape and operation checks of every part.
 */
#ifndef DEP_WHY_H
#define DEP_WHY_H

#include <stddef.h>

/* Write the message, when why is not NULL and whylen > 0. */
void why_set(char *why, size_t whylen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* The same, and return code. */
int why_fail(char *why, size_t whylen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif /* DEP_WHY_H */
