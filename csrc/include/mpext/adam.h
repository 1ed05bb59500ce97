/* mpext C API, the names of the step before it was named for its engine: kept for one release
 * so that callers of the mp_adam_* symbols still build and link. New code uses mpext/step.h
 * (mp_step_tensor, mp_step_options, mp_step, mp_step_advance_steps), whose rule is the options'
 * (MP_RULE_ADAM: mpext/rules/adam.h). */
#ifndef MPEXT_ADAM_H
#define MPEXT_ADAM_H

#include "mpext/step.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef mp_step_tensor mp_adam_tensor;
typedef mp_step_options mp_adam_options;

/* mp_step and mp_step_advance_steps under their old names (the same functions). */
mp_status mp_adam_step(const mp_adam_tensor* t, int64_t start, int64_t count,
                       const mp_adam_options* o);
mp_status mp_adam_advance_steps(const mp_adam_tensor* ts, int64_t ntensors,
                                const mp_adam_options* o);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_ADAM_H */
