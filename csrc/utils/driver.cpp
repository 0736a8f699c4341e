#include "driver.h"

#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "check.h"

namespace mptp {

namespace {
thread_local std::string g_last_error;

template <typename Fn>
bool resolve(const char* name, Fn* fn, unsigned version = 12000) {
  cudaDriverEntryPointQueryResult status;
  void* ptr = nullptr;
  // 12000: ask for the CUDA 12 ABI of each symbol (the _v2 memops).
  cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &ptr, version, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || ptr == nullptr) {
    (void)cudaGetLastError();
    set_last_error(std::string("cannot resolve driver function ") + name + ": " +
                   cudaGetErrorString(err));
    return false;
  }
  *fn = reinterpret_cast<Fn>(ptr);
  return true;
}
}  // namespace

void set_last_error(const std::string& msg) { g_last_error = msg; }
const char* last_error() { return g_last_error.c_str(); }

const Driver* driver() {
  static std::once_flag once;
  static Driver drv;
  static bool ok = false;
  static std::string error;
  std::call_once(once, [] {
    ok = resolve("cuStreamWriteValue32", &drv.stream_write_value32) &&
         resolve("cuStreamWaitValue32", &drv.stream_wait_value32) &&
         resolve("cuGetErrorString", &drv.get_error_string);
    if (!ok) error = g_last_error;
    // Optional: 13000 asks for the ABI without failIdx. NOTE: only from a CUDA 13+ driver; a
    // 12.8/12.9 driver has the older ABI (failIdx before the stream), which must never be called
    // through this signature.
    int version = 0;
    drv.memcpy_batch_async = nullptr;
    if (ok && cudaDriverGetVersion(&version) == cudaSuccess && version >= 13000 &&
        !resolve("cuMemcpyBatchAsync", &drv.memcpy_batch_async, 13000)) {
      drv.memcpy_batch_async = nullptr;
    }
    (void)cudaGetLastError();
  });
  if (!ok) {
    set_last_error(error);
    return nullptr;
  }
  return &drv;
}

}  // namespace mptp
