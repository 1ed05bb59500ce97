/* mpext: the optimizer rules, listed once. Each row of MP_RULES is one rule:
 *   X(ID, name, MIN_MOMENTS, MAX_MOMENTS)
 * ID its enum suffix (MP_RULE_<ID>, the value of mp_step_options.rule: the row's position),
 * name the prefix of what its header (mpext/rules/<name>.h, included below) defines:
 *   mp_<name>_scalars                                 its fp32 per-step scalars
 *   int mp_<name>_options_ok(const mp_step_options*)  its hyperparameters' range checks
 *   int mp_<name>_moments(const mp_step_options*)     the moments it keeps (MIN..MAX of them)
 *   mp_<name>_scalars mp_<name>_scalars_of(const mp_step_options*, float lr, float step)
 *   float mp_<name>_element(float g, float p, float* m, float* v, const mp_<name>_scalars*)
 * and the moment counts every call of the rule keeps at least and at most (the engine's tile
 * loops are built for these only). Every tier's enum, dispatch and cases come from these rows:
 * the CPU tile stage (csrc/core/step.c), the CUDA kernel's cases (cuda/step.cu), the C++ ops'
 * registrations (csrc/torch/step.cpp, step_cuda.cpp) and what this header generates below.
 * Adding a rule: its header, its row and include here (docs/adding_a_rule.md).
 *
 * Included by mpext/step.h after its structs (the rule headers take mp_step_options). */
#ifndef MPEXT_RULES_RULES_H
#define MPEXT_RULES_RULES_H

#include <stdint.h>

#define MP_RULES(X)  \
  X(ADAM, adam, 2, 2) \
  X(LION, lion, 1, 1) \
  X(SGD, sgd, 0, 1) \
  X(MUON_MOMENTUM, muon_momentum, 1, 1) \
  X(MUON_UPDATE, muon_update, 0, 0)

#include "mpext/rules/adam.h"
#include "mpext/rules/lion.h"
#include "mpext/rules/sgd.h"
#include "mpext/rules/muon.h"

/* ---- generated from the rows ---- */

#define MP_RULE_ENUM_(ID, name, MIN, MAX) MP_RULE_##ID,
/* The rules of mp_step_options.rule. */
enum { MP_RULES(MP_RULE_ENUM_) MP_RULE_COUNT };
#undef MP_RULE_ENUM_

/* One rule's per-step scalars, whichever the rule: what the engine hands its rule stage. */
typedef struct mp_rule_scalars {
  int32_t rule; /* MP_RULE_* */
  int32_t nmom; /* the moments this call keeps (mp_rule_moments) */
  union {
#define MP_RULE_MEMBER_(ID, name, MIN, MAX) mp_##name##_scalars name;
    MP_RULES(MP_RULE_MEMBER_)
#undef MP_RULE_MEMBER_
  } u;
} mp_rule_scalars;

/* 1 if o->rule is a known rule and the rule accepts its hyperparameters. */
MP_HD int mp_rule_options_ok(const mp_step_options* o) {
  switch (o->rule) {
#define MP_RULE_CASE_(ID, name, MIN, MAX) \
  case MP_RULE_##ID: return mp_##name##_options_ok(o);
    MP_RULES(MP_RULE_CASE_)
#undef MP_RULE_CASE_
    default: return 0;
  }
}

/* The moments the options' rule keeps per element (0 for an unknown rule). */
MP_HD int mp_rule_moments(const mp_step_options* o) {
  switch (o->rule) {
#define MP_RULE_CASE_(ID, name, MIN, MAX) \
  case MP_RULE_##ID: return mp_##name##_moments(o);
    MP_RULES(MP_RULE_CASE_)
#undef MP_RULE_CASE_
    default: return 0;
  }
}

/* The rule's scalars of a step at learning rate lr of a param whose step count before it is
 * step (the options already checked). */
MP_HD mp_rule_scalars mp_rule_scalars_of(const mp_step_options* o, float lr, float step) {
  mp_rule_scalars r;
  r.rule = o->rule;
  r.nmom = mp_rule_moments(o);
  switch (o->rule) {
#define MP_RULE_CASE_(ID, name, MIN, MAX) \
  case MP_RULE_##ID: r.u.name = mp_##name##_scalars_of(o, lr, step); break;
    MP_RULES(MP_RULE_CASE_)
#undef MP_RULE_CASE_
    default: break;
  }
  return r;
}

#endif /* MPEXT_RULES_RULES_H */
