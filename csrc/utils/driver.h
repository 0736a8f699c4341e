// The few CUDA driver functions we need, resolved at run time through the
// runtime's cudaGetDriverEntryPointByVersion. NOTE: the extension never links
// libcuda, so it builds and loads on machines without a GPU driver.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mptp {

struct Driver {
  // CUresult is an int-sized enum; the CUstream / CUdeviceptr types are ABI
  // compatible with cudaStream_t and uintptr_t.
  int (*stream_write_value32)(void* stream, uint64_t addr, uint32_t value, unsigned flags);
  int (*stream_wait_value32)(void* stream, uint64_t addr, uint32_t value, unsigned flags);
  int (*get_error_string)(int result, const char** str);
  // cuMemcpyBatchAsync (CUDA 13 ABI); nullptr where the driver lacks it (optional).
  int (*memcpy_batch_async)(uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count,
                            void* attrs, size_t* attrs_idxs, size_t num_attrs, void* stream);
};

// Resolves the functions once; returns nullptr (and sets the last error) when
// no driver is present.
const Driver* driver();

// Flags of cuStreamWaitValue32 / cuStreamWriteValue32 (from cuda.h, which we
// deliberately do not include).
constexpr unsigned kWaitGeq = 0x0;
constexpr unsigned kWaitEq = 0x1;
constexpr unsigned kWriteDefault = 0x0;

}  // namespace mptp
