#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <string>

#include "../utils/check.h"
#include "../utils/driver.h"
#include "symm.h"

namespace mptp {

namespace {

// 2 MiB: the granularity of cudaMalloc's large allocations, so every buffer is
// its own allocation and an IPC handle names exactly one buffer at offset 0.
constexpr size_t kGranularity = size_t(2) << 20;

ErrorRecord* g_err_host = nullptr;
ErrorRecord* g_err_dev = nullptr;

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// One thread per flag. NOTE: this kernel spins only on flags that peers write
// with stream memory operations (put_signal), never on flags a kernel writes,
// and it occupies one tiny block, so it cannot starve the writer.
__global__ void wait_kernel(const uint32_t* flags, int n, int stride, int skip, uint32_t value,
                            uint64_t timeout_ns, int channel, int tag, ErrorRecord* err) {
  int i = threadIdx.x;
  if (i >= n || i == skip) return;
  const uint32_t* f = flags + static_cast<size_t>(i) * stride;
  uint64_t start = globaltimer();
  uint32_t seen;
  // Signed difference so that epochs may wrap around 2^32.
  while (static_cast<int32_t>((seen = ld_acquire_sys(f)) - value) < 0) {
    if (*reinterpret_cast<volatile int32_t*>(&err->failed)) return;
    if (globaltimer() - start > timeout_ns) {
      if (atomicCAS(&err->failed, 0, 1) == 0) {
        err->channel = channel;
        err->peer = i;
        err->expected = value;
        err->seen = seen;
        err->tag = tag;
        __threadfence_system();
      }
      return;
    }
    __nanosleep(128);
  }
}

}  // namespace

int alloc(size_t bytes, void** ptr, size_t* granted) {
  size_t rounded = (bytes + kGranularity - 1) / kGranularity * kGranularity;
  if (rounded == 0) rounded = kGranularity;
  MPTP_CUDA_CHECK(cudaMalloc(ptr, rounded));
  MPTP_CUDA_CHECK(cudaMemset(*ptr, 0, rounded));
  MPTP_CUDA_CHECK(cudaDeviceSynchronize());
  *granted = rounded;
  return 0;
}

int free_buffer(void* ptr) {
  MPTP_CUDA_CHECK(cudaDeviceSynchronize());
  MPTP_CUDA_CHECK(cudaFree(ptr));
  return 0;
}

int export_handle(void* ptr, void* handle_out) {
  static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "IPC handle size");
  cudaIpcMemHandle_t h;
  MPTP_CUDA_CHECK(cudaIpcGetMemHandle(&h, ptr));
  std::memcpy(handle_out, &h, sizeof(h));
  return 0;
}

int import_handle(const void* handle, void** ptr) {
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  MPTP_CUDA_CHECK(cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess));
  return 0;
}

int close_handle(void* ptr) {
  MPTP_CUDA_CHECK(cudaDeviceSynchronize());
  MPTP_CUDA_CHECK(cudaIpcCloseMemHandle(ptr));
  return 0;
}

int error_record(ErrorRecord** host, ErrorRecord** device) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_err_host == nullptr) {
    MPTP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&g_err_host), sizeof(ErrorRecord),
                                  cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(g_err_host, 0, sizeof(ErrorRecord));
    MPTP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&g_err_dev), g_err_host, 0));
  }
  *host = g_err_host;
  *device = g_err_dev;
  return 0;
}

int put_signal(void* stream, uint32_t* const* addrs, int n, uint32_t value) {
  const Driver* drv = driver();
  if (drv == nullptr) return -1;
  for (int i = 0; i < n; ++i) {
    if (addrs[i] == nullptr) continue;
    int rc = drv->stream_write_value32(stream, reinterpret_cast<uint64_t>(addrs[i]), value,
                                       kWriteDefault);
    MPTP_CHECK(rc == 0, "cuStreamWriteValue32 failed with CUresult " + std::to_string(rc));
  }
  return 0;
}

int wait_signal(void* stream, const uint32_t* flags, int n, int stride, int skip, uint32_t value,
                uint64_t timeout_ns, int channel, int tag) {
  MPTP_CHECK(n > 0 && n <= 1024, "wait_signal: n must be in [1, 1024]");
  ErrorRecord *host, *dev;
  MPTP_TRY(error_record(&host, &dev));
  wait_kernel<<<1, n, 0, static_cast<cudaStream_t>(stream)>>>(flags, n, stride, skip, value,
                                                              timeout_ns, channel, tag, dev);
  MPTP_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int stream_wait_value(void* stream, const uint32_t* addr, uint32_t value) {
  const Driver* drv = driver();
  if (drv == nullptr) return -1;
  int rc = drv->stream_wait_value32(stream, reinterpret_cast<uint64_t>(addr), value, kWaitGeq);
  MPTP_CHECK(rc == 0, "cuStreamWaitValue32 failed with CUresult " + std::to_string(rc));
  return 0;
}

}  // namespace mptp
