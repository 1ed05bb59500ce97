// Helpers of the CUDA binding (included only by *_cuda.cpp files).
#pragma once

#include <cuda_runtime.h>

#include "common.h"

namespace mpext {

// Like check_status, but a failed launch reports (and clears) the CUDA error behind it.
inline void check_cuda_status(mp_status s, const char* op) {
  if (s == MP_ERR_CUDA) {
    const cudaError_t err = cudaGetLastError();
    TORCH_CHECK(false, "mpext.", op, ": CUDA kernel launch failed: ", cudaGetErrorName(err), ": ",
                cudaGetErrorString(err));
  }
  check_status(s, op);
}

}  // namespace mpext
