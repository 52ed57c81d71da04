// tawpipe NCCL group layer: communicators and grouped launches over NCCL and the CUDA runtime,
// without torch (raw pointers and streams).
//
// Every communicator is non-blocking (ncclConfig_t.blocking = 0): no NCCL call blocks the host.
// Initialisation, splits and group launches are followed by polling ncclCommGetAsyncError (and,
// for a completion wait, a CUDA event) against a deadline; on an asynchronous error or at the
// deadline every communicator involved is aborted (ncclCommAbort) and an exception names the
// operation, peer, bytes and the NCCL version. An aborted communicator refuses further work.
//
// One call of run_group issues all its operations inside one ncclGroupStart/ncclGroupEnd on
// one stream, so a slot's sends, receives and collectives (which may belong to different
// communicators of the same device) progress together. The caller guarantees that every rank
// issues matching groups in the same order, and that one communicator is used by one thread
// at a time.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "tawpipe's NCCL layer needs NCCL >= 2.18 (non-blocking communicators, ncclCommSplit)"
#endif

namespace tawpipe::nccl {

// An NCCL or CUDA failure; the message names the operation, peer, bytes and NCCL version.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A deadline passed; the communicators involved have been aborted.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// NCCL_VERSION_CODE of the loaded library, and as text ("2.27.3").
int version();
std::string version_string();

// A fresh ncclUniqueId as NCCL_UNIQUE_ID_BYTES bytes, to be shared with every rank.
std::string unique_id();

enum class Kind { kSend, kRecv, kBroadcast, kReduce, kAllReduce, kAllGather, kReduceScatter };

const char* kind_name(Kind kind);

// Bytes per element of an NCCL data type (0 for an unknown one).
size_t dtype_size(ncclDataType_t dtype);

class Communicator {
 public:
  // Joins the communicator of `nranks` ranks identified by `id` (a unique_id() of one rank,
  // shared by all): collective over those ranks.
  static std::unique_ptr<Communicator> create(const std::string& id, int nranks, int rank, int device,
                                              double timeout_s);

  // ncclCommSplit: collective over this communicator. Ranks passing the same color >= 0 form a
  // new communicator ordered by key; color < 0 joins none and returns null.
  std::unique_ptr<Communicator> split(int color, int key, double timeout_s);

  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  ~Communicator();  // destroys (or, if aborted, has already freed) the NCCL communicator

  // Aborts: queued and future operations fail; further calls raise with `reason`.
  void abort(const std::string& reason);

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  bool aborted() const { return aborted_; }
  const std::string& abort_reason() const { return abort_reason_; }
  ncclComm_t handle() const { return comm_; }

 private:
  Communicator(ncclComm_t comm, int rank, int size, int device) : comm_(comm), rank_(rank), size_(size), device_(device) {}

  ncclComm_t comm_;
  int rank_;
  int size_;
  int device_;
  bool aborted_ = false;
  std::string abort_reason_;
};

// One operation of a group. Ranks, peers and roots are ranks of `comm`.
struct Op {
  Kind kind;
  Communicator* comm;
  const void* sendbuff;  // send, broadcast (root), reduce, all_reduce, all_gather, reduce_scatter input
  void* recvbuff;        // recv, broadcast, reduce (root), all_reduce, all_gather, reduce_scatter output
  size_t count;          // elements; per rank for all_gather (input) and reduce_scatter (output)
  ncclDataType_t dtype;
  int peer;              // send/recv peer, broadcast/reduce root; ignored otherwise
};

// Issues `ops` in one ncclGroupStart/End on `stream` and waits until NCCL has issued them; with
// `wait`, also until they have completed on the device. All ops must use communicators of one
// device. Throws Error on bad input (before any NCCL call) or failure, TimeoutError after
// timeout_s seconds; either way after aborting every communicator of the group.
void run_group(const std::vector<Op>& ops, cudaStream_t stream, double timeout_s, bool wait);

// Waits until the work queued on `stream` has completed, watching `comms` for asynchronous
// errors; aborts them at the deadline (the way to bound a run of run_group(..., wait=false)).
void synchronize(const std::vector<Communicator*>& comms, cudaStream_t stream, double timeout_s);

}  // namespace tawpipe::nccl
