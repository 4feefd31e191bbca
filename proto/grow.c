/*
 * grow.c — the growable array (grow.h).
 */
#include "grow.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int dep__grow(void *arr, size_t *cap, size_t need, size_t size, size_t first) {
  if (need <= *cap)
    return 0;
  size_t c = *cap != 0 ? *cap : first != 0 ? first : 1;
  while (c < need) {
    if (c > SIZE_MAX / 2)
      return -1;
    c *= 2;
  }
  if (size != 0 && c > SIZE_MAX / size)
    return -1;
  /* The pointer is read and written as bytes: arr may point to a uint8_t * or a struct's. */
  void *old, *p;
  memcpy(&old, arr, sizeof old);
  p = realloc(old, c * size);
  if (p == NULL)
    return -1;
  memcpy(arr, &p, sizeof p);
  *cap = c;
  return 0;
}
