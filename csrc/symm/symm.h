// Symmetric memory: device buffers every rank of a group can map, signal pads,
// stream-ordered signal and bounded wait. See mptp_kernels/symm/ for the
// group-level logic (handle exchange, counting signals, workspaces).
#pragma once

#include <cstddef>
#include <cstdint>

namespace mptp {

// What a timed-out wait leaves behind, in host-mapped memory so that Python can
// read it without synchronizing the device. `failed` is 0 until the first
// timeout of this process; later waits see it and return at once so that one
// missing peer costs one timeout, not one per wait.
struct ErrorRecord {
  int32_t failed;
  int32_t channel;
  int32_t peer;
  uint32_t expected;
  uint32_t seen;
  int32_t tag;
};

constexpr size_t kIpcHandleBytes = 64;

int alloc(size_t bytes, void** ptr, size_t* granted);
int free_buffer(void* ptr);
int export_handle(void* ptr, void* handle_out);
int import_handle(const void* handle, void** ptr);
int close_handle(void* ptr);

int error_record(ErrorRecord** host, ErrorRecord** device);

// Adds 1 (release, system scope) to each slot in the device array slots_dev[n]
// (null entries skipped). One small kernel.
int signal(void* stream, uint32_t* const* slots_dev, int n);

// Blocks `stream` until slots[p] >= expected[p] + 1 for every p in `mask`, then
// advances expected[p]; bounded by timeout_ns, after which the error record is
// filled in and the stream goes on. One small kernel.
int wait(void* stream, const uint32_t* slots, uint32_t* expected, int n, uint32_t mask,
         uint64_t timeout_ns, int channel, int tag);

// signal(sig_slots) then wait(slots, ...) in one small kernel: a barrier on one channel.
int signal_wait(void* stream, uint32_t* const* sig_slots, const uint32_t* slots,
                uint32_t* expected, int n, uint32_t mask, uint64_t timeout_ns, int channel,
                int tag);

// cuStreamWriteValue32: no SM involved. Used for chunk-arrival flags that a
// persistent kernel spins on while it may hold every SM.
int write_value(void* stream, uint32_t* addr, uint32_t value);

// For each i: copy bytes[i] from srcs[i] to dsts[i], then write `value` into
// flags[i] (memop; null skipped). One call instead of 2n from Python. With use_ce
// and ce_copies(stream), the copies ask for a copy engine (a hint: the driver may
// still run them on SMs).
int pull_chunks(void* stream, void* const* dsts, const void* const* srcs, const size_t* bytes,
                uint32_t* const* flags, uint32_t value, int n, int use_ce);

// 1 when pull_chunks on `stream` asks for copy-engine copies (the driver has
// cuMemcpyBatchAsync, has not refused it, and the stream is neither the legacy default
// stream nor capturing), else 0; -1 on a CUDA error.
int ce_copies(void* stream);

// The end of a fused call, one small kernel on `stream`: if the error record `err` (null: this
// process's) says a wait timed out, every byte of the n tensors (ptrs[i], bytes[i]; n <= kMaxFinish) becomes 0xFF
// (NaN in every float dtype); then the nflags (<= 32) int32 flags at `flags` are set to 0 (flags
// may be null). The host-mapped record is read once, by one thread.
constexpr int kMaxFinish = 8;
int finish(void* stream, void* const* ptrs, const size_t* bytes, int n, uint32_t* flags,
           int nflags, const void* err);

// Device copies on `stream` (dsts[i] <- srcs[i], bytes[i]; n <= kMaxGuardedCopies) that write
// nothing once this process's error record is set: its writes into symmetric memory after a
// timed-out wait (a slow peer may still read the buffer, or reduce what lands in its own).
constexpr int kMaxGuardedCopies = 32;
// This device's fail latch (current device; int32, device memory, zero until a wait of this
// process fails): set by a failed wait and by finish when the record is set; read by the
// guarded writes and the signals (fail-stop) instead of the host-mapped record, whose reads
// queue over PCIe. Allocated on first use (outside capture: at workspace creation), never freed.
int fail_latch(int32_t** latch);
int copy_guarded(void* stream, void* const* dsts, const void* const* srcs, const size_t* bytes,
                 int n);

// The communication half of a fused all-gather-matmul's start, in one call (one ctypes call from
// Python instead of about ten). On `main`: wait DONE (one small kernel), the guarded copies
// (this rank's shard into its symmetric buffer and into its chunk of A_full), then one small
// kernel that sets this rank's chunk flag and runs the READY barrier. Then `side` waits for
// `main` (event `fork`); on `side`: the row-scale pulls, if any (then `main` waits for them:
// event `scales_in`), the chunk pulls, each followed by its chunk flag (memop), and DONE's
// signal. Every address is a device address; peers[i] is the i-th peer pulled.
constexpr int kMaxPeers = 32;
struct AgBeginArgs {
  void* main;
  void* side;
  void* fork;       // cudaEvent_t
  void* scales_in;  // cudaEvent_t, used where nscale > 0
  // DONE and READY: counters in this rank's pad, expected counts, signal slot tables (device
  // arrays of W pointers, this rank's entry null), as wait() and signal_wait() take them.
  const uint32_t* done_slots;
  uint32_t* done_expected;
  uint32_t* const* done_sig;
  const uint32_t* ready_slots;
  uint32_t* ready_expected;
  uint32_t* const* ready_sig;
  uint32_t* own_flag;  // set to 1 before the READY barrier (the consumer reads it)
  uint64_t timeout_ns;
  int32_t world_size;
  uint32_t mask;  // every peer
  int32_t tag;
  int32_t done_channel;
  int32_t ready_channel;
  int32_t ncopy;  // guarded copies on main, <= 4
  int32_t npull;  // peers pulled, <= kMaxPeers - 1
  int32_t nscale;  // 0, or 1: pull the peers' row scales first
  int32_t use_ce;
  int32_t pad_;
  void* copy_dst[4];
  const void* copy_src[4];
  uint64_t copy_bytes[4];
  // Peer i's chunk: from pull_src[i] (its buffer as mapped here) to full_base + peers[i] *
  // chunk_bytes, then pull_flag[i] = 1; its scales from pull_src[i] + scale_src_off to
  // scale_base + peers[i] * scale_bytes.
  uint64_t full_base;
  uint64_t chunk_bytes;
  uint64_t scale_base;
  uint64_t scale_bytes;
  uint64_t scale_src_off;
  const void* pull_src[kMaxPeers];
  uint32_t* pull_flag[kMaxPeers];
  int32_t peers[kMaxPeers];
};
int ag_begin(const AgBeginArgs* a);

// The end of a fused all-gather-matmul: `main` waits for `side` (event `join`), then finish().
int ag_end(void* main, void* side, void* join, void* const* ptrs, const size_t* bytes, int n,
           uint32_t* flags, int nflags, const void* err);

// finish(), then signal(sig_slots) from the same small kernel (fail-stop: no signal once the
// error record is set): a reduce-scatter's end and its DONE in one launch.
int finish_signal(void* stream, void* const* ptrs, const size_t* bytes, int n, uint32_t* flags,
                  int nflags, const void* err, uint32_t* const* sig_slots, int nsig);

int event_create(void** event);
int event_destroy(void* event);
// cudaEventRecord(event, stream); cudaStreamWaitEvent(stream, event): a call's order after the
// previous one of its group (ops/dispatch.py _guard), without a torch Event per call.
int event_record(void* event, void* stream);
int stream_wait_event(void* stream, void* event);

// Stream memory-op wait (cuStreamWaitValue32): no SM, but unbounded; used only
// where the flag is written by this process's own copy stream.
int stream_wait_value(void* stream, const uint32_t* addr, uint32_t value);

}  // namespace mptp
