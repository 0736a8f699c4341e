// The one bindings file: a plain C ABI loaded with ctypes. NOTE: no torch
// headers, so the library is independent of the torch version it runs under
// (2.11 to 2.14) and compiles in seconds; torch tensors cross as pointers.
#include <cuda_runtime.h>

#include <cstddef>

#include "symm/symm.h"
#include "utils/check.h"
#include "utils/driver.h"

#define MPTP_API extern "C" __attribute__((visibility("default")))

MPTP_API int mptp_abi_version() { return 5; }
MPTP_API const char* mptp_last_error() { return mptp::last_error(); }
MPTP_API int mptp_ipc_handle_bytes() { return static_cast<int>(mptp::kIpcHandleBytes); }

MPTP_API int mptp_driver_available() { return mptp::driver() != nullptr ? 1 : 0; }

MPTP_API int mptp_alloc(size_t bytes, void** ptr, size_t* granted) {
  return mptp::alloc(bytes, ptr, granted);
}
MPTP_API int mptp_free(void* ptr) { return mptp::free_buffer(ptr); }
MPTP_API int mptp_export_handle(void* ptr, void* out) { return mptp::export_handle(ptr, out); }
MPTP_API int mptp_import_handle(const void* h, void** ptr) { return mptp::import_handle(h, ptr); }
MPTP_API int mptp_close_handle(void* ptr) { return mptp::close_handle(ptr); }

MPTP_API int mptp_error_record(void** host, void** device) {
  return mptp::error_record(reinterpret_cast<mptp::ErrorRecord**>(host),
                            reinterpret_cast<mptp::ErrorRecord**>(device));
}
MPTP_API int mptp_signal(void* stream, uint32_t* const* slots_dev, int n) {
  return mptp::signal(stream, slots_dev, n);
}
MPTP_API int mptp_wait(void* stream, const uint32_t* slots, uint32_t* expected, int n,
                       uint32_t mask, uint64_t timeout_ns, int channel, int tag) {
  return mptp::wait(stream, slots, expected, n, mask, timeout_ns, channel, tag);
}
MPTP_API int mptp_signal_wait(void* stream, uint32_t* const* sig_slots, const uint32_t* slots,
                              uint32_t* expected, int n, uint32_t mask, uint64_t timeout_ns,
                              int channel, int tag) {
  return mptp::signal_wait(stream, sig_slots, slots, expected, n, mask, timeout_ns, channel, tag);
}
MPTP_API int mptp_write_value(void* stream, uint32_t* addr, uint32_t value) {
  return mptp::write_value(stream, addr, value);
}
MPTP_API int mptp_pull_chunks(void* stream, void* const* dsts, const void* const* srcs,
                              const size_t* bytes, uint32_t* const* flags, uint32_t value, int n,
                              int use_ce) {
  return mptp::pull_chunks(stream, dsts, srcs, bytes, flags, value, n, use_ce);
}
MPTP_API int mptp_finish(void* stream, void* const* ptrs, const size_t* bytes, int n,
                         uint32_t* flags, int nflags, const void* err) {
  return mptp::finish(stream, ptrs, bytes, n, flags, nflags, err);
}
MPTP_API int mptp_copy_guarded(void* stream, void* const* dsts, const void* const* srcs,
                               const size_t* bytes, int n) {
  return mptp::copy_guarded(stream, dsts, srcs, bytes, n);
}
MPTP_API int mptp_fail_latch(void** latch) {
  return mptp::fail_latch(reinterpret_cast<int32_t**>(latch));
}
MPTP_API int mptp_ce_copies(void* stream) { return mptp::ce_copies(stream); }
MPTP_API int mptp_stream_wait_value(void* stream, const uint32_t* addr, uint32_t value) {
  return mptp::stream_wait_value(stream, addr, value);
}
MPTP_API int mptp_ag_begin(const mptp::AgBeginArgs* a) { return mptp::ag_begin(a); }
MPTP_API int mptp_ag_begin_args_bytes() { return static_cast<int>(sizeof(mptp::AgBeginArgs)); }
// The offset of every field of AgBeginArgs, in declaration order (mptp_kernels/symm/_C.py checks
// them against its ctypes mirror at load); returns the number of fields, or -1 if n is too small.
MPTP_API int mptp_ag_begin_args_layout(uint64_t* out, int n) {
  int i = 0;
#define MPTP_FIELD(f)                                   \
  do {                                                  \
    if (i >= n) return -1;                              \
    out[i++] = offsetof(mptp::AgBeginArgs, f);          \
  } while (0)
  MPTP_FIELD(main);
  MPTP_FIELD(side);
  MPTP_FIELD(fork);
  MPTP_FIELD(scales_in);
  MPTP_FIELD(done_slots);
  MPTP_FIELD(done_expected);
  MPTP_FIELD(done_sig);
  MPTP_FIELD(ready_slots);
  MPTP_FIELD(ready_expected);
  MPTP_FIELD(ready_sig);
  MPTP_FIELD(own_flag);
  MPTP_FIELD(timeout_ns);
  MPTP_FIELD(world_size);
  MPTP_FIELD(mask);
  MPTP_FIELD(tag);
  MPTP_FIELD(done_channel);
  MPTP_FIELD(ready_channel);
  MPTP_FIELD(ncopy);
  MPTP_FIELD(npull);
  MPTP_FIELD(nscale);
  MPTP_FIELD(use_ce);
  MPTP_FIELD(pad_);
  MPTP_FIELD(copy_dst);
  MPTP_FIELD(copy_src);
  MPTP_FIELD(copy_bytes);
  MPTP_FIELD(full_base);
  MPTP_FIELD(chunk_bytes);
  MPTP_FIELD(scale_base);
  MPTP_FIELD(scale_bytes);
  MPTP_FIELD(scale_src_off);
  MPTP_FIELD(pull_src);
  MPTP_FIELD(pull_flag);
  MPTP_FIELD(peers);
#undef MPTP_FIELD
  return i;
}
MPTP_API int mptp_ag_end(void* main, void* side, void* join, void* const* ptrs,
                         const size_t* bytes, int n, uint32_t* flags, int nflags,
                         const void* err) {
  return mptp::ag_end(main, side, join, ptrs, bytes, n, flags, nflags, err);
}
MPTP_API int mptp_finish_signal(void* stream, void* const* ptrs, const size_t* bytes, int n,
                                uint32_t* flags, int nflags, const void* err,
                                uint32_t* const* sig_slots, int nsig) {
  return mptp::finish_signal(stream, ptrs, bytes, n, flags, nflags, err, sig_slots, nsig);
}
MPTP_API int mptp_event_create(void** event) { return mptp::event_create(event); }
MPTP_API int mptp_event_destroy(void* event) { return mptp::event_destroy(event); }
MPTP_API int mptp_event_record(void* event, void* stream) {
  return mptp::event_record(event, stream);
}
MPTP_API int mptp_stream_wait_event(void* stream, void* event) {
  return mptp::stream_wait_event(stream, event);
}
MPTP_API int mptp_device_count(int* n) {
  cudaError_t err = cudaGetDeviceCount(n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    *n = 0;
  }
  return 0;
}
