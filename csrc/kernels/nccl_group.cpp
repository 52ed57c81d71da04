// See nccl_group.h.
#include "nccl_group.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <vector>
#include <thread>

namespace tawpipe::nccl {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// What failed: the operation, its peer (-1: none), its size (-1: not a transfer), its communicator.
struct Context {
  std::string op;
  int peer = -1;
  int64_t bytes = -1;
  const Communicator* comm = nullptr;
};

std::string describe(const Context& c) {
  std::vector<std::string> parts;
  if (c.peer >= 0) parts.push_back("peer " + std::to_string(c.peer));
  if (c.bytes >= 0) parts.push_back(std::to_string(c.bytes) + " bytes");
  if (c.comm != nullptr) {
    parts.push_back("rank " + std::to_string(c.comm->rank()) + " of " + std::to_string(c.comm->size()) +
                    " on device " + std::to_string(c.comm->device()));
  }
  std::string text = c.op;
  for (size_t i = 0; i < parts.size(); ++i) text += (i == 0 ? " (" : ", ") + parts[i];
  return parts.empty() ? text : text + ")";
}

std::string suffix(const char* file, int line) {
  const char* slash = std::strrchr(file, '/');
  std::ostringstream o;
  o << " [NCCL " << version_string() << ", " << (slash != nullptr ? slash + 1 : file) << ":" << line << "]";
  return o.str();
}

[[noreturn]] void raise_nccl(ncclResult_t result, const char* call, const Context& c, const char* file, int line) {
  std::ostringstream o;
  o << "tawpipe nccl " << describe(c) << ": " << call << " returned " << ncclGetErrorString(result);
  const char* last = ncclGetLastError(c.comm != nullptr && !c.comm->aborted() ? c.comm->handle() : nullptr);
  if (last != nullptr && *last != '\0') o << " (" << last << ")";
  throw Error(o.str() + suffix(file, line));
}

[[noreturn]] void raise_cuda(cudaError_t err, const char* call, const Context& c, const char* file, int line) {
  std::ostringstream o;
  o << "tawpipe nccl " << describe(c) << ": " << call << " returned " << cudaGetErrorName(err) << " ("
    << cudaGetErrorString(err) << ")";
  throw Error(o.str() + suffix(file, line));
}

// The one check of every NCCL and CUDA call: an exception with op, peer, bytes, NCCL version.
#define TAWPIPE_NCCL_CHECK(call, context)                                                   \
  do {                                                                                      \
    const ncclResult_t r_ = (call);                                                         \
    if (r_ != ncclSuccess && r_ != ncclInProgress) raise_nccl(r_, #call, context, __FILE__, __LINE__); \
  } while (0)
#define TAWPIPE_CUDA_CHECK(call, context)                                                   \
  do {                                                                                      \
    const cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) raise_cuda(e_, #call, context, __FILE__, __LINE__);              \
  } while (0)

// Makes a device current for a scope, restoring the caller's.
class DeviceScope {
 public:
  DeviceScope(int device, const Context& c) {
    TAWPIPE_CUDA_CHECK(cudaGetDevice(&previous_), c);
    if (previous_ != device) TAWPIPE_CUDA_CHECK(cudaSetDevice(device), c);
  }
  ~DeviceScope() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

void abort_all(const std::vector<Communicator*>& comms, const std::string& reason) {
  for (Communicator* c : comms) c->abort(reason);
}

// Polls until no communicator is in progress and, once none is, `event` (if any) has completed.
// On an asynchronous error or at the deadline, aborts every communicator and throws.
void wait_for(const std::vector<Communicator*>& comms, cudaEvent_t event, Clock::time_point deadline,
              double timeout_s, const Context& c) {
  const Clock::time_point spin_until = Clock::now() + std::chrono::microseconds(200);
  for (;;) {
    bool pending = false;
    for (Communicator* comm : comms) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t queried = ncclCommGetAsyncError(comm->handle(), &state);
      const ncclResult_t bad = queried != ncclSuccess ? queried : state;
      if (bad == ncclInProgress) {
        pending = true;
      } else if (bad != ncclSuccess) {
        std::ostringstream o;
        o << "tawpipe nccl " << describe(c) << ": asynchronous NCCL error " << ncclGetErrorString(bad);
        const char* last = ncclGetLastError(comm->handle());
        if (last != nullptr && *last != '\0') o << " (" << last << ")";
        o << "; aborted the communicators of this operation";
        abort_all(comms, o.str());
        throw Error(o.str() + suffix(__FILE__, __LINE__));
      }
    }
    if (!pending && event != nullptr) {
      const cudaError_t e = cudaEventQuery(event);
      if (e == cudaErrorNotReady) {
        pending = true;
      } else if (e != cudaSuccess) {
        abort_all(comms, "CUDA error while waiting");
        raise_cuda(e, "cudaEventQuery", c, __FILE__, __LINE__);
      }
    }
    if (!pending) return;
    const Clock::time_point now = Clock::now();
    if (now > deadline) {
      std::ostringstream o;
      o << "tawpipe nccl " << describe(c) << ": not complete after " << timeout_s
        << " s; aborted the communicators of this operation. A peer is missing or stuck, or posted a different "
           "operation, size or order (raise the timeout with TAWPIPE_TIMEOUT for slow links)";
      abort_all(comms, o.str());
      throw TimeoutError(o.str() + suffix(__FILE__, __LINE__));
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

void check_usable(const Communicator* comm, const Context& c) {
  if (comm->aborted()) {
    throw Error("tawpipe nccl " + describe(c) + ": the communicator was aborted earlier (" + comm->abort_reason() +
                "); create a new one");
  }
}

Context context_of(const Op& op) {
  Context c{kind_name(op.kind), -1, static_cast<int64_t>(op.count * dtype_size(op.dtype)), op.comm};
  if (op.kind == Kind::kSend || op.kind == Kind::kRecv) c.peer = op.peer;
  if (op.kind == Kind::kBroadcast || op.kind == Kind::kReduce) c.op += " root " + std::to_string(op.peer);
  return c;
}

void validate(const Op& op) {
  const Context c = context_of(op);
  if (op.comm == nullptr) throw Error("tawpipe nccl " + describe(c) + ": no communicator");
  check_usable(op.comm, c);
  if (dtype_size(op.dtype) == 0) {
    throw Error("tawpipe nccl " + describe(c) + ": unsupported NCCL data type " + std::to_string(op.dtype));
  }
  const bool rooted = op.kind == Kind::kBroadcast || op.kind == Kind::kReduce;
  if ((op.kind == Kind::kSend || op.kind == Kind::kRecv || rooted) && (op.peer < 0 || op.peer >= op.comm->size())) {
    throw Error("tawpipe nccl " + describe(c) + ": " + (rooted ? "root " : "peer ") + std::to_string(op.peer) +
                " is not a rank of this communicator of " + std::to_string(op.comm->size()));
  }
  if (op.count == 0) return;
  const bool root = rooted && op.peer == op.comm->rank();
  const bool needs_send = op.kind == Kind::kSend || op.kind == Kind::kAllReduce || op.kind == Kind::kAllGather ||
                          op.kind == Kind::kReduceScatter || (rooted && (root || op.kind == Kind::kReduce));
  const bool needs_recv = op.kind != Kind::kSend && !(op.kind == Kind::kReduce && !root);
  if ((needs_send && op.sendbuff == nullptr) || (needs_recv && op.recvbuff == nullptr)) {
    throw Error("tawpipe nccl " + describe(c) + ": null buffer");
  }
}

void issue(const Op& op, cudaStream_t stream) {
  const Context c = context_of(op);
  ncclComm_t comm = op.comm->handle();
  switch (op.kind) {
    case Kind::kSend:
      TAWPIPE_NCCL_CHECK(ncclSend(op.sendbuff, op.count, op.dtype, op.peer, comm, stream), c);
      break;
    case Kind::kRecv:
      TAWPIPE_NCCL_CHECK(ncclRecv(op.recvbuff, op.count, op.dtype, op.peer, comm, stream), c);
      break;
    case Kind::kBroadcast:
      TAWPIPE_NCCL_CHECK(ncclBroadcast(op.sendbuff, op.recvbuff, op.count, op.dtype, op.peer, comm, stream), c);
      break;
    case Kind::kReduce:
      TAWPIPE_NCCL_CHECK(ncclReduce(op.sendbuff, op.recvbuff, op.count, op.dtype, ncclSum, op.peer, comm, stream), c);
      break;
    case Kind::kAllReduce:
      TAWPIPE_NCCL_CHECK(ncclAllReduce(op.sendbuff, op.recvbuff, op.count, op.dtype, ncclSum, comm, stream), c);
      break;
    case Kind::kAllGather:
      TAWPIPE_NCCL_CHECK(ncclAllGather(op.sendbuff, op.recvbuff, op.count, op.dtype, comm, stream), c);
      break;
    case Kind::kReduceScatter:
      TAWPIPE_NCCL_CHECK(ncclReduceScatter(op.sendbuff, op.recvbuff, op.count, op.dtype, ncclSum, comm, stream), c);
      break;
  }
}

// An event freed when the scope ends (also when a wait throws).
class ScopedEvent {
 public:
  explicit ScopedEvent(const Context& c) { TAWPIPE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), c); }
  ~ScopedEvent() { cudaEventDestroy(event_); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

}  // namespace

int version() {
  int v = 0;
  TAWPIPE_NCCL_CHECK(ncclGetVersion(&v), (Context{"ncclGetVersion"}));
  return v;
}

std::string version_string() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // Codes since 2.9 are major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." + std::to_string(v % 100);
}

std::string unique_id() {
  ncclUniqueId id;
  TAWPIPE_NCCL_CHECK(ncclGetUniqueId(&id), (Context{"ncclGetUniqueId"}));
  return std::string(id.internal, sizeof id.internal);
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kSend: return "send";
    case Kind::kRecv: return "recv";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kReduce: return "reduce";
    case Kind::kAllReduce: return "all_reduce";
    case Kind::kAllGather: return "all_gather";
    case Kind::kReduceScatter: return "reduce_scatter";
  }
  return "unknown";
}

size_t dtype_size(ncclDataType_t dtype) {
  switch (dtype) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
#if defined(__CUDA_BF16_TYPES_EXIST__)
    case ncclBfloat16:
#endif
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}

std::unique_ptr<Communicator> Communicator::create(const std::string& id, int nranks, int rank, int device,
                                                   double timeout_s) {
  Context c{"init rank " + std::to_string(rank) + " of " + std::to_string(nranks) + " on device " + std::to_string(device)};
  if (id.size() != sizeof(ncclUniqueId)) {
    throw Error("tawpipe nccl " + describe(c) + ": the unique id has " + std::to_string(id.size()) + " bytes, not " +
                std::to_string(sizeof(ncclUniqueId)) + "; pass the bytes of unique_id() from one rank");
  }
  if (nranks < 1 || rank < 0 || rank >= nranks || device < 0) {
    throw Error("tawpipe nccl " + describe(c) + ": need 0 <= rank < nranks and device >= 0");
  }
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), sizeof uid.internal);
  const Clock::time_point deadline = deadline_after(timeout_s);
  DeviceScope scope(device, c);
  ncclConfig_t config = nonblocking_config();
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, uid, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    raise_nccl(r, "ncclCommInitRankConfig", c, __FILE__, __LINE__);
  }
  std::unique_ptr<Communicator> out(new Communicator(comm, rank, nranks, device));
  wait_for({out.get()}, nullptr, deadline, timeout_s, c);
  return out;
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, double timeout_s) {
  Context c{"split color " + std::to_string(color) + " key " + std::to_string(key), -1, -1, this};
  check_usable(this, c);
  const Clock::time_point deadline = deadline_after(timeout_s);
  DeviceScope scope(device_, c);
  ncclConfig_t config = nonblocking_config();
  ncclComm_t comm = nullptr;
  TAWPIPE_NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &comm, &config), c);
  wait_for({this}, nullptr, deadline, timeout_s, c);
  if (comm == nullptr) return nullptr;
  std::unique_ptr<Communicator> out(new Communicator(comm, -1, -1, device_));
  wait_for({out.get()}, nullptr, deadline, timeout_s, c);
  TAWPIPE_NCCL_CHECK(ncclCommUserRank(comm, &out->rank_), c);
  TAWPIPE_NCCL_CHECK(ncclCommCount(comm, &out->size_), c);
  return out;
}

Communicator::~Communicator() {
  if (comm_ == nullptr || aborted_) return;
  int previous = 0;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess;
  // Flush queued work (bounded), then free; abort if it does not finish.
  const ncclResult_t r = ncclCommFinalize(comm_);
  bool finalized = r == ncclSuccess || r == ncclInProgress;
  const Clock::time_point deadline = deadline_after(10.0);
  while (finalized) {
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      finalized = false;
      break;
    }
    if (state == ncclSuccess) break;
    if (Clock::now() > deadline) {
      finalized = false;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (finalized) {
    ncclCommDestroy(comm_);
  } else {
    ncclCommAbort(comm_);
  }
  if (switched) cudaSetDevice(previous);
}

void Communicator::abort(const std::string& reason) {
  if (aborted_) return;
  ncclCommAbort(comm_);
  aborted_ = true;
  abort_reason_ = reason;
}

void run_group(const std::vector<Op>& ops, cudaStream_t stream, double timeout_s, bool wait) {
  if (ops.empty()) return;
  for (const Op& op : ops) validate(op);
  Context c = context_of(ops.front());
  if (ops.size() > 1) c.op = "group of " + std::to_string(ops.size()) + " ops, first " + c.op;
  std::vector<Communicator*> comms;
  for (const Op& op : ops) {
    if (op.comm->device() != ops.front().comm->device()) {
      throw Error("tawpipe nccl " + describe(c) + ": the group mixes communicators of devices " +
                  std::to_string(ops.front().comm->device()) + " and " + std::to_string(op.comm->device()));
    }
    if (std::find(comms.begin(), comms.end(), op.comm) == comms.end()) comms.push_back(op.comm);
  }
  const Clock::time_point deadline = deadline_after(timeout_s);
  DeviceScope scope(ops.front().comm->device(), c);
  TAWPIPE_NCCL_CHECK(ncclGroupStart(), c);
  try {
    for (const Op& op : ops) issue(op, stream);
  } catch (const Error& e) {
    ncclGroupEnd();
    abort_all(comms, e.what());
    throw;
  }
  const ncclResult_t ended = ncclGroupEnd();
  if (ended != ncclSuccess && ended != ncclInProgress) {
    abort_all(comms, "ncclGroupEnd failed");
    raise_nccl(ended, "ncclGroupEnd", c, __FILE__, __LINE__);
  }
  // Non-blocking communicators may still be enqueuing: the event must follow their kernels.
  wait_for(comms, nullptr, deadline, timeout_s, c);
  if (!wait) return;
  ScopedEvent done(c);
  TAWPIPE_CUDA_CHECK(cudaEventRecord(done.get(), stream), c);
  wait_for(comms, done.get(), deadline, timeout_s, c);
}

void synchronize(const std::vector<Communicator*>& comms, cudaStream_t stream, double timeout_s) {
  if (comms.empty()) throw Error("tawpipe nccl synchronize: no communicators given");
  const Context c{"synchronize", -1, -1, comms.front()};
  for (const Communicator* comm : comms) check_usable(comm, c);
  const Clock::time_point deadline = deadline_after(timeout_s);
  DeviceScope scope(comms.front()->device(), c);
  ScopedEvent done(c);
  TAWPIPE_CUDA_CHECK(cudaEventRecord(done.get(), stream), c);
  wait_for(comms, done.get(), deadline, timeout_s, c);
}

}  // namespace tawpipe::nccl
