// The ops' entries of the rules (one header per row of mpext/rules/rules.h: <name>.h defines
// the template <class Backend> <name>_step, the op's function, which step.cpp and step_cuda.cpp
// register as "<name>_step_" for their backend from the rows).
#pragma once

#include "adam.h"
#include "lion.h"
#include "sgd.h"
#include "muon.h"
