// Error handling shared by every C++ file. The C API never throws across the
// boundary: each entry point returns 0 or -1 and leaves a message (with
// file:line) in a thread-local buffer that Python reads with mptp_last_error().
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

namespace mptp {

void set_last_error(const std::string& msg);
const char* last_error();

}  // namespace mptp

#define MPTP_FAIL(msg)                                                              \
  do {                                                                              \
    ::mptp::set_last_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                           ": " + (msg));                                           \
    return -1;                                                                      \
  } while (0)

#define MPTP_CUDA_CHECK(expr)                                                      \
  do {                                                                             \
    cudaError_t err_ = (expr);                                                     \
    if (err_ != cudaSuccess) {                                                     \
      (void)cudaGetLastError();                                                    \
      MPTP_FAIL(std::string(#expr) + " failed: " + cudaGetErrorString(err_));      \
    }                                                                              \
  } while (0)

#define MPTP_CHECK(cond, msg)                      \
  do {                                             \
    if (!(cond)) MPTP_FAIL(std::string(msg));      \
  } while (0)

// Propagates a failure from a call that already set the message.
#define MPTP_TRY(expr)            \
  do {                            \
    if ((expr) != 0) return -1;   \
  } while (0)
