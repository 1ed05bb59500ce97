/* Internal to the C core's hand-fused Adam rows (adam_fused.c and its SIMD loops): the scalars
 * those loops read, the storage's (mpext/step_storage.h) beside Adam's (mpext/rules/adam.h), in
 * one struct that each loop copies into registers. */
#ifndef MPEXT_CORE_ADAM_FUSED_H
#define MPEXT_CORE_ADAM_FUSED_H

#include "mpext/rules/adam.h"
#include "mpext/step_storage.h"

typedef struct mp_fused_scalars {
  mp_step_scalars st; /* the storage's */
  mp_adam_scalars a;  /* the rule's */
} mp_fused_scalars;

#endif /* MPEXT_CORE_ADAM_FUSED_H */
