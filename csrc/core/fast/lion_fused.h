/* Internal to the C core's fast paths: the Lion rows (lion_fused.c), which adam_fused.c's
 * mp_k_fast_step hands Lion's modes to. */
#ifndef MPEXT_CORE_LION_FUSED_H
#define MPEXT_CORE_LION_FUSED_H

#include "isa.h"
#include "mpext/step.h"
#include "mpext/step_storage.h"

/* Steps a piece (positions sharing their high 32 bits) of t, whose rule is Lion, through the
 * Lion row kept for its mode, kind its param storage (formats/tiles.h MP_PV_*); returns 0,
 * having done nothing, where no row is kept. */
int MP_ISA_FN(mp_k_lion_fast_step)(const mp_step_tensor* t, int64_t start, int64_t n,
                                   const mp_step_scalars* s, const mp_rule_scalars* r, int kind);

#endif /* MPEXT_CORE_LION_FUSED_H */
