// CPU emulation of cuda_bf16.h for tests/cuda_emu: everything is in cuda_emu.h.
#pragma once
#include "cuda_emu.h"
