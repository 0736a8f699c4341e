#include <cuda_runtime.h>

#include <atomic>
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
// Per device: a copy of "a wait of this process has failed" in device memory (fail_latch).
constexpr int kMaxDevices = 64;
int32_t* g_latch[kMaxDevices] = {};

__device__ __forceinline__ bool latched(const int32_t* latch) {
  return *reinterpret_cast<const volatile int32_t*>(latch) != 0;
}

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
// NOTE: fail-stop. Once a wait of this process has timed out (the error record is set), it
// signals no peer again: a peer then times out too, instead of pairing this signal with data
// this process did not write (its guarded writes are skipped as well: copy_guarded, and the
// producer matmul's guarded stores).
__device__ __forceinline__ void signal_one(uint32_t* const* slots, int n, const int32_t* latch) {
  int i = threadIdx.x;
  if (latched(latch)) return;
  if (i < n && slots[i] != nullptr) red_add_release_sys(slots[i], 1);
}

__global__ void signal_kernel(uint32_t* const* slots, int n, const int32_t* latch) {
  signal_one(slots, n, latch);
}

// One thread per peer p in `mask`: wait until slots[p] reaches expected[p] + 1,
// then advance expected[p]. Both counters live in device memory, so CUDA-graph
// replays keep counting. NOTE: it spins only on slots that peers bump and
// occupies one small block, so it never starves the signaller.
__device__ __forceinline__ void wait_one(const uint32_t* slots, uint32_t* expected, int n,
                                         uint32_t mask, uint64_t timeout_ns, int channel, int tag,
                                         ErrorRecord* err, int32_t* latch) {
  int i = threadIdx.x;
  if (i >= n || !((mask >> i) & 1u)) return;
  uint32_t target = expected[i] + 1;
  uint64_t start = globaltimer();
  uint32_t seen;
  // Signed difference so that counters may wrap around 2^32.
  while (static_cast<int32_t>((seen = ld_acquire_sys(slots + i)) - target) < 0) {
    if (*reinterpret_cast<volatile int32_t*>(&err->failed)) {
      *reinterpret_cast<volatile int32_t*>(latch) = 1;  // failed elsewhere: latched here too
      break;
    }
    if (globaltimer() - start > timeout_ns) {
      if (atomicCAS(&err->failed, 0, 1) == 0) {
        err->channel = channel;
        err->peer = i;
        err->expected = target;
        err->seen = seen;
        err->tag = tag;
        __threadfence_system();
      }
      *reinterpret_cast<volatile int32_t*>(latch) = 1;
      break;
    }
    __nanosleep(128);
  }
  expected[i] = target;
}

__global__ void wait_kernel(const uint32_t* slots, uint32_t* expected, int n, uint32_t mask,
                            uint64_t timeout_ns, int channel, int tag, ErrorRecord* err,
                            int32_t* latch) {
  wait_one(slots, expected, n, mask, timeout_ns, channel, tag, err, latch);
}

// signal_kernel then wait_kernel in one launch (a barrier on one channel): thread i signals
// peer i, then waits for peer i's signal. One warp; n <= 32.
// own_flag (may be null): set to 1 first (an all-gather's chunk flag, read by a later kernel).
__global__ void signal_wait_kernel(uint32_t* const* sig_slots, int nsig, const uint32_t* slots,
                                   uint32_t* expected, int n, uint32_t mask, uint64_t timeout_ns,
                                   int channel, int tag, ErrorRecord* err, int32_t* latch,
                                   uint32_t* own_flag) {
  if (own_flag != nullptr && threadIdx.x == 0) *own_flag = 1;
  signal_one(sig_slots, nsig, latch);
  wait_one(slots, expected, n, mask, timeout_ns, channel, tag, err, latch);
}

struct FinishArgs {
  unsigned char* ptrs[kMaxFinish];
  size_t bytes[kMaxFinish];
  int n;
  uint32_t* flags;
  int nflags;
  const ErrorRecord* err;
  int32_t* latch;
  uint32_t* const* sig;  // signalled last (finish_signal); may be null
  int nsig;
};

// One block: thread 0 reads the host-mapped record once (reads of it from many warps queue over
// PCIe); the tensors are written only when it is set, 16 bytes per store where aligned.
__global__ void finish_kernel(FinishArgs a) {
  __shared__ int failed;
  if (threadIdx.x == 0) {
    failed = *reinterpret_cast<const volatile int32_t*>(&a.err->failed);
    // A consumer wait (Triton) fills the record only: latch it for the guarded writes that follow.
    if (failed) *reinterpret_cast<volatile int32_t*>(a.latch) = 1;
  }
  __syncthreads();
  if (failed) {
    for (int i = 0; i < a.n; ++i) {
      unsigned char* p = a.ptrs[i];
      size_t nb = a.bytes[i];
      size_t head = (16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15;
      if (head > nb) head = nb;
      for (size_t j = threadIdx.x; j < head; j += blockDim.x) p[j] = 0xFF;
      size_t vec = (nb - head) / 16;
      uint4* q = reinterpret_cast<uint4*>(p + head);
      const uint4 ones = make_uint4(~0u, ~0u, ~0u, ~0u);
      for (size_t j = threadIdx.x; j < vec; j += blockDim.x) q[j] = ones;
      for (size_t j = head + vec * 16 + threadIdx.x; j < nb; j += blockDim.x) p[j] = 0xFF;
    }
  }
  if (threadIdx.x < a.nflags) a.flags[threadIdx.x] = 0;
  // After the latch (set above where the record is): fail-stop, as signal_kernel.
  if (a.sig != nullptr && threadIdx.x < 32) signal_one(a.sig, a.nsig, a.latch);
}

struct CopyArgs {
  unsigned char* dsts[kMaxGuardedCopies];
  const unsigned char* srcs[kMaxGuardedCopies];
  size_t bytes[kMaxGuardedCopies];
  const int32_t* latch;
};

template <typename T>
__device__ __forceinline__ void copy_words(unsigned char* d, const unsigned char* s, size_t nb,
                                           size_t first, size_t step) {
  // d and s equally misaligned for T: bytes up to T's alignment, then T words, then the tail.
  size_t head = (sizeof(T) - (reinterpret_cast<uintptr_t>(d) & (sizeof(T) - 1))) & (sizeof(T) - 1);
  if (head > nb) head = nb;
  for (size_t j = first; j < head; j += step) d[j] = s[j];
  size_t words = (nb - head) / sizeof(T);
  T* dw = reinterpret_cast<T*>(d + head);
  const T* sw = reinterpret_cast<const T*>(s + head);
  for (size_t j = first; j < words; j += step) dw[j] = sw[j];
  for (size_t j = head + words * sizeof(T) + first; j < nb; j += step) d[j] = s[j];
}

// blockIdx.y picks the copy; the blocks of x share it. Each block reads the device latch
// (device memory: not the host-mapped record, whose reads queue over PCIe, ~1 us each);
// nothing is written if it is set. 16-byte words where d and s are equally aligned mod 16,
// 4-byte words where mod 4, else bytes.
__global__ void copy_guarded_kernel(CopyArgs a) {
  if (latched(a.latch)) return;
  unsigned char* d = a.dsts[blockIdx.y];
  const unsigned char* s = a.srcs[blockIdx.y];
  size_t nb = a.bytes[blockIdx.y];
  size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  uintptr_t diff = reinterpret_cast<uintptr_t>(d) ^ reinterpret_cast<uintptr_t>(s);
  if ((diff & 15) == 0) {
    copy_words<uint4>(d, s, nb, first, step);
  } else if ((diff & 3) == 0) {
    copy_words<uint32_t>(d, s, nb, first, step);
  } else {
    for (size_t j = first; j < nb; j += step) d[j] = s[j];
  }
}

}  // namespace

int copy_guarded(void* stream, void* const* dsts, const void* const* srcs, const size_t* bytes,
                 int n) {
  MPTP_CHECK(n >= 0 && n <= kMaxGuardedCopies, "copy_guarded: n must be in [0, 32]");
  if (n == 0) return 0;
  int32_t* latch;
  MPTP_TRY(fail_latch(&latch));
  CopyArgs a{};
  size_t most = 0;
  for (int i = 0; i < n; ++i) {
    a.dsts[i] = static_cast<unsigned char*>(dsts[i]);
    a.srcs[i] = static_cast<const unsigned char*>(srcs[i]);
    a.bytes[i] = bytes[i];
    if (bytes[i] > most) most = bytes[i];
  }
  a.latch = latch;
  // About 64 KiB per block, at most 4 blocks per SM of an H100/H200-sized GPU per copy.
  size_t blocks = (most + 65535) / 65536;
  unsigned gx = static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 528 ? 528 : blocks));
  copy_guarded_kernel<<<dim3(gx, n), 256, 0, static_cast<cudaStream_t>(stream)>>>(a);
  MPTP_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int finish(void* stream, void* const* ptrs, const size_t* bytes, int n, uint32_t* flags,
           int nflags, const void* err) {
  return finish_signal(stream, ptrs, bytes, n, flags, nflags, err, nullptr, 0);
}

int finish_signal(void* stream, void* const* ptrs, const size_t* bytes, int n, uint32_t* flags,
                  int nflags, const void* err, uint32_t* const* sig_slots, int nsig) {
  MPTP_CHECK(n >= 0 && n <= kMaxFinish, "finish: n must be in [0, 8]");
  MPTP_CHECK(sig_slots == nullptr || (nsig > 0 && nsig <= 32), "finish: nsig must be in [1, 32]");
  MPTP_CHECK(nflags >= 0 && nflags <= 32 && (nflags == 0 || flags != nullptr),
             "finish: nflags must be in [0, 32], with flags");
  ErrorRecord *host, *dev;
  MPTP_TRY(error_record(&host, &dev));
  FinishArgs a{};
  for (int i = 0; i < n; ++i) {
    a.ptrs[i] = static_cast<unsigned char*>(ptrs[i]);
    a.bytes[i] = bytes[i];
  }
  a.n = n;
  a.flags = flags;
  a.nflags = nflags;
  a.err = err != nullptr ? static_cast<const ErrorRecord*>(err) : dev;
  a.sig = sig_slots;
  a.nsig = nsig;
  MPTP_TRY(fail_latch(&a.latch));
  finish_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(a);
  MPTP_CUDA_CHECK(cudaGetLastError());
  return 0;
}

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

int fail_latch(int32_t** latch) {
  static std::mutex mu;
  int device = 0;
  MPTP_CUDA_CHECK(cudaGetDevice(&device));
  MPTP_CHECK(device >= 0 && device < kMaxDevices, "fail_latch: device ordinal out of range");
  std::lock_guard<std::mutex> lock(mu);
  if (g_latch[device] == nullptr) {
    // NOTE: allocated once per device, never freed (as the error record); first asked for where
    // a workspace is made, so never inside a CUDA-graph capture.
    int32_t* p = nullptr;
    MPTP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), 256));
    MPTP_CUDA_CHECK(cudaMemset(p, 0, 256));
    MPTP_CUDA_CHECK(cudaDeviceSynchronize());
    g_latch[device] = p;
  }
  *latch = g_latch[device];
  return 0;
}

int signal(void* stream, uint32_t* const* slots_dev, int n) {
  MPTP_CHECK(n > 0 && n <= 32, "signal: n must be in [1, 32]");
  int32_t* latch;
  MPTP_TRY(fail_latch(&latch));
  signal_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(slots_dev, n, latch);
  MPTP_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int wait(void* stream, const uint32_t* slots, uint32_t* expected, int n, uint32_t mask,
         uint64_t timeout_ns, int channel, int tag) {
  MPTP_CHECK(n > 0 && n <= 32, "wait: n must be in [1, 32]");
  ErrorRecord *host, *dev;
  MPTP_TRY(error_record(&host, &dev));
  int32_t* latch;
  MPTP_TRY(fail_latch(&latch));
  wait_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(slots, expected, n, mask,
                                                               timeout_ns, channel, tag, dev, latch);
  MPTP_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int signal_wait(void* stream, uint32_t* const* sig_slots, const uint32_t* slots,
                uint32_t* expected, int n, uint32_t mask, uint64_t timeout_ns, int channel,
                int tag) {
  MPTP_CHECK(n > 0 && n <= 32, "signal_wait: n must be in [1, 32]");
  ErrorRecord *host, *dev;
  MPTP_TRY(error_record(&host, &dev));
  int32_t* latch;
  MPTP_TRY(fail_latch(&latch));
  signal_wait_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(
      sig_slots, n, slots, expected, n, mask, timeout_ns, channel, tag, dev, latch, nullptr);
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

namespace {

// CUmemcpyAttributes of cuda.h (CUDA 12.8+), which we deliberately do not include.
struct MemcpyAttributes {
  int src_access_order;  // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
  int src_loc_type, src_loc_id;
  int dst_loc_type, dst_loc_id;
  unsigned flags;  // CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
};
static_assert(sizeof(MemcpyAttributes) == 24, "CUmemcpyAttributes layout");

// One device-to-device copy that should not need an SM. NOTE: a plain cudaMemcpyAsync between
// two buffers of one device may run as a kernel, which a persistent consumer holding every SM
// would starve (a peer on the same GPU, or a loopback group); the batch API with the
// prefer-overlap-with-compute hint asks for a copy engine (a hint, so the consumer still leaves
// a few SMs free on a shared GPU). It is not used under stream capture (where the driver may not
// accept it), nor where the driver lacks it: the caller then leaves more SMs free.
// Set for good once the driver refuses a batch copy (seen: CUDA_ERROR_INVALID_VALUE for a source
// mapped from another process with cudaIpcOpenMemHandle); later copies are plain, and
// ce_copies() says so, so the consumer then leaves SMs free.
std::atomic<bool> g_ce_refused{false};

int copy(const Driver* drv, cudaStream_t s, void* dst, const void* src, size_t bytes, bool ce) {
  if (ce && !g_ce_refused.load()) {
    int dev = 0;
    MPTP_CUDA_CHECK(cudaGetDevice(&dev));
    MemcpyAttributes attr{1, 1, dev, 1, dev, 1u};  // CU_MEM_LOCATION_TYPE_DEVICE = 1
    uint64_t d = reinterpret_cast<uint64_t>(dst), sp = reinterpret_cast<uint64_t>(src);
    size_t n = bytes, idx = 0;
    if (drv->memcpy_batch_async(&d, &sp, &n, 1, &attr, &idx, 1, s) == 0) return 0;
    g_ce_refused.store(true);
  }
  MPTP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
  return 0;
}

// A flag write ordered after the stream's earlier work (a memop: no kernel, no SM).
int write_flag(const Driver* drv, void* stream, uint32_t* flag, uint32_t value) {
  int rc = drv->stream_write_value32(stream, reinterpret_cast<uint64_t>(flag), value, kWriteDefault);
  MPTP_CHECK(rc == 0, "cuStreamWriteValue32 failed with CUresult " + std::to_string(rc));
  return 0;
}

// `to` waits for everything queued on `from` so far, through `event`.
int join_streams(void* event, void* from, void* to) {
  auto e = static_cast<cudaEvent_t>(event);
  MPTP_CUDA_CHECK(cudaEventRecord(e, static_cast<cudaStream_t>(from)));
  MPTP_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(to), e, 0));
  return 0;
}

}  // namespace

int ce_copies(void* stream) {
  const Driver* drv = driver();
  if (drv == nullptr || drv->memcpy_batch_async == nullptr || g_ce_refused.load()) return 0;
  // The batch API refuses the legacy default stream (handles 0 and cudaStreamLegacy).
  if (stream == nullptr || stream == reinterpret_cast<void*>(0x1)) return 0;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  MPTP_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st));
  return st == cudaStreamCaptureStatusNone ? 1 : 0;
}

int pull_chunks(void* stream, void* const* dsts, const void* const* srcs, const size_t* bytes,
                uint32_t* const* flags, uint32_t value, int n, int use_ce) {
  const Driver* drv = driver();
  if (drv == nullptr) return -1;
  auto s = static_cast<cudaStream_t>(stream);
  bool ce = use_ce != 0 && ce_copies(stream) == 1;
  for (int i = 0; i < n; ++i) {
    if (bytes[i] > 0) MPTP_TRY(copy(drv, s, dsts[i], srcs[i], bytes[i], ce));
    if (flags[i] != nullptr) MPTP_TRY(write_flag(drv, stream, flags[i], value));
  }
  return 0;
}

int ag_begin(const AgBeginArgs* a) {
  const Driver* drv = driver();
  if (drv == nullptr) return -1;
  const int W = a->world_size;
  MPTP_CHECK(W > 1 && W <= kMaxPeers, "ag_begin: world_size must be in [2, 32]");
  MPTP_CHECK(a->ncopy >= 1 && a->ncopy <= 4, "ag_begin: ncopy must be in [1, 4]");
  MPTP_CHECK(a->npull >= 0 && a->npull < W, "ag_begin: npull must be in [0, world_size)");
  MPTP_CHECK(a->nscale == 0 || a->nscale == 1, "ag_begin: nscale must be 0 or 1");
  for (int i = 0; i < a->npull; ++i)
    MPTP_CHECK(a->peers[i] >= 0 && a->peers[i] < W, "ag_begin: a peer out of range");
  ErrorRecord *host, *dev;
  MPTP_TRY(error_record(&host, &dev));
  int32_t* latch;
  MPTP_TRY(fail_latch(&latch));
  auto m = static_cast<cudaStream_t>(a->main);
  auto s = static_cast<cudaStream_t>(a->side);
  // main: every peer finished reading this rank's buffer in the previous op; this rank's shard
  // into it (and into A_full); the chunk flag; READY.
  wait_kernel<<<1, 32, 0, m>>>(a->done_slots, a->done_expected, W, a->mask, a->timeout_ns,
                               a->done_channel, a->tag, dev, latch);
  MPTP_CUDA_CHECK(cudaGetLastError());
  size_t bytes[4];
  for (int i = 0; i < a->ncopy; ++i) bytes[i] = static_cast<size_t>(a->copy_bytes[i]);
  MPTP_TRY(copy_guarded(a->main, const_cast<void* const*>(a->copy_dst), a->copy_src, bytes,
                        a->ncopy));
  signal_wait_kernel<<<1, 32, 0, m>>>(a->ready_sig, W, a->ready_slots, a->ready_expected, W,
                                      a->mask, a->timeout_ns, a->ready_channel, a->tag, dev,
                                      latch, a->own_flag);
  MPTP_CUDA_CHECK(cudaGetLastError());
  // side: after main's READY, pull every peer's chunk (its scales first), then DONE.
  MPTP_TRY(join_streams(a->fork, a->main, a->side));
  bool ce = a->use_ce != 0 && ce_copies(a->side) == 1;
  auto at = [](uint64_t p) { return reinterpret_cast<void*>(p); };
  if (a->nscale) {
    // NOTE: the consumer waits for the scales (an event) before it is launched: it holds every
    // SM and spins on chunk flags only, so nothing it waits for may queue behind it.
    for (int i = 0; i < a->npull; ++i) {
      const auto* src = static_cast<const unsigned char*>(a->pull_src[i]) + a->scale_src_off;
      MPTP_TRY(copy(drv, s, at(a->scale_base + a->peers[i] * a->scale_bytes), src,
                    a->scale_bytes, ce));
    }
    MPTP_TRY(join_streams(a->scales_in, a->side, a->main));
  }
  for (int i = 0; i < a->npull; ++i) {
    MPTP_TRY(copy(drv, s, at(a->full_base + a->peers[i] * a->chunk_bytes), a->pull_src[i],
                  a->chunk_bytes, ce));
    MPTP_TRY(write_flag(drv, a->side, a->pull_flag[i], 1));
  }
  signal_kernel<<<1, 32, 0, s>>>(a->done_sig, W, latch);
  MPTP_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int ag_end(void* main, void* side, void* join, void* const* ptrs, const size_t* bytes, int n,
           uint32_t* flags, int nflags, const void* err) {
  MPTP_TRY(join_streams(join, side, main));
  return finish(main, ptrs, bytes, n, flags, nflags, err);
}

int event_create(void** event) {
  cudaEvent_t e = nullptr;
  MPTP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  *event = e;
  return 0;
}

int event_destroy(void* event) {
  MPTP_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  return 0;
}

int event_record(void* event, void* stream) {
  MPTP_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
  return 0;
}

int stream_wait_event(void* stream, void* event) {
  MPTP_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
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
