/*
 * error.c — descriptions and names for the one error table (DEP_ERRNO_MAP
 * in deepep.h).  Both are generated from the table so a new code can never
 * be added without its text.  Linked into the client library (exported)
 * and into the daemon, which puts the same codes on the wire.
 */
#include "deepep.h"

DEP_EXPORT const char *dep_strerror(int err) {
  switch (err) {
#define DEP__ERR_DESC(name, val, desc) \
  case (val):                          \
    return desc;
    DEP_ERRNO_MAP(DEP__ERR_DESC)
#undef DEP__ERR_DESC
  default:
    return "unknown error";
  }
}

DEP_EXPORT const char *dep_errname(int err) {
  switch (err) {
#define DEP__ERR_NAME(name, val, desc) \
  case (val):                          \
    return "DEP_ERR_" #name;
    DEP_ERRNO_MAP(DEP__ERR_NAME)
#undef DEP__ERR_NAME
  default:
    return "DEP_ERR_UNKNOWN";
  }
}
