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

__device__ __forceinline__ void red_add_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One thread per peer: bump the peer's slot. Counting (not writing an epoch)
// keeps a captured CUDA graph correct on every replay.
__global__ void signal_kernel(uint32_t* const* slots, int n) {
  int i = threadIdx.x;
  if (i < n && slots[i] != nullptr) red_add_release_sys(slots[i], 1);
}

// One thread per peer p in `mask`: wait until slots[p] reaches expected[p] + 1,
// then advance expected[p]. Both counters live in device memory, so CUDA-graph
// replays keep counting. NOTE: it spins only on slots that peers bump and
// occupies one small block, so it never starves the signaller.
__global__ void wait_kernel(const uint32_t* slots, uint32_t* expected, int n, uint32_t mask,
                            uint64_t timeout_ns, int channel, int tag, ErrorRecord* err) {
  int i = threadIdx.x;
  if (i >= n || !((mask >> i) & 1u)) return;
  uint32_t target = expected[i] + 1;
  uint64_t start = globaltimer();
  uint32_t seen;
  // Signed difference so that counters may wrap around 2^32.
  while (static_cast<int32_t>((seen = ld_acquire_sys(slots + i)) - target) < 0) {
    if (*reinterpret_cast<volatile int32_t*>(&err->failed)) break;
    if (globaltimer() - start > timeout_ns) {
      if (atomicCAS(&err->failed, 0, 1) == 0) {
        err->channel = channel;
        err->peer = i;
        err->expected = target;
        err->seen = seen;
        err->tag = tag;
        __threadfence_system();
      }
      break;
    }
    __nanosleep(128);
  }
  expected[i] = target;
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

int signal(void* stream, uint32_t* const* slots_dev, int n) {
  MPTP_CHECK(n > 0 && n <= 32, "signal: n must be in [1, 32]");
  signal_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(slots_dev, n);
  MPTP_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int wait(void* stream, const uint32_t* slots, uint32_t* expected, int n, uint32_t mask,
         uint64_t timeout_ns, int channel, int tag) {
  MPTP_CHECK(n > 0 && n <= 32, "wait: n must be in [1, 32]");
  ErrorRecord *host, *dev;
  MPTP_TRY(error_record(&host, &dev));
  wait_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(slots, expected, n, mask,
                                                               timeout_ns, channel, tag, dev);
  MPTP_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int write_value(void* stream, uint32_t* addr, uint32_t value) {
  const Driver* drv = driver();
  if (drv == nullptr) return -1;
  int rc = drv->stream_write_value32(stream, reinterpret_cast<uint64_t>(addr), value, kWriteDefault);
  MPTP_CHECK(rc == 0, "cuStreamWriteValue32 failed with CUresult " + std::to_string(rc));
  return 0;
}

int pull_chunks(void* stream, void* const* dsts, const void* const* srcs, const size_t* bytes,
                uint32_t* const* flags, uint32_t value, int n) {
  const Driver* drv = driver();
  if (drv == nullptr) return -1;
  auto s = static_cast<cudaStream_t>(stream);
  for (int i = 0; i < n; ++i) {
    if (bytes[i] > 0) {
      MPTP_CUDA_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], bytes[i], cudaMemcpyDeviceToDevice, s));
    }
    if (flags[i] != nullptr) {
      int rc = drv->stream_write_value32(stream, reinterpret_cast<uint64_t>(flags[i]), value,
                                         kWriteDefault);
      MPTP_CHECK(rc == 0, "cuStreamWriteValue32 failed with CUresult " + std::to_string(rc));
    }
  }
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
