// Torch binding of the prefetcher (csrc/kernels/prefetch.h), used by tawpipe.offload.HostOffload.
// Python holds a prefetcher as an integer handle into a registry of live prefetchers (as the
// bound tables of bound.cpp): nothing in Python can point it anywhere, and a wrong or stale handle
// is refused. The ops check every argument, pass the current stream of the device, and turn a
// failing status into an exception. Device-generic c10 APIs only (no CUDA headers), so this file
// builds in CPU builds too.
#include <ATen/core/Tensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/prefetch.h"

namespace tawpipe {
namespace {

struct Handle {
  Handle(tawpipe_prefetcher* p, c10::Device d) : prefetcher(p), device(d) {}
  Handle(const Handle&) = delete;  // it owns the prefetcher
  Handle& operator=(const Handle&) = delete;
  ~Handle() { tawpipe_prefetch_destroy(prefetcher); }
  tawpipe_prefetcher* prefetcher;
  c10::Device device;
};

// The live prefetchers by handle. A call holds its prefetcher (shared_ptr) while it runs, so a
// concurrent _prefetch_destroy cannot free it under the call.
struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<Handle>> handles;
  int64_t next = 1;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: no teardown-order hazards at exit
  return *r;
}

std::shared_ptr<Handle> handle_of(const char* op, int64_t handle, bool remove = false) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.handles.find(handle);
  TORCH_CHECK_VALUE(it != r.handles.end(), op, ": ", handle,
                    " is not a live prefetcher made by tawpipe::_prefetch_create; use tawpipe.offload.HostOffload");
  std::shared_ptr<Handle> h = it->second;
  if (remove) r.handles.erase(it);
  return h;
}

void check(const char* op, int status) {
  if (status == TAWPIPE_OK) return;
  const std::string detail = tawpipe_prefetch_last_error();
  if (status == TAWPIPE_ERR_INVALID_ARGUMENT) TORCH_CHECK_VALUE(false, op, ": ", detail);
  TORCH_CHECK(false, op, ": ", detail);
}

int dtype_code(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return TAWPIPE_DTYPE_F32;
    case at::kBFloat16: return TAWPIPE_DTYPE_BF16;
    case at::kHalf: return TAWPIPE_DTYPE_F16;
    default:
      TORCH_CHECK_VALUE(false, op, ": ", name, " has dtype ", t.scalar_type(),
                        "; supported are float32, bfloat16 and float16");
  }
  return -1;
}

// The host-side float32 buffer of a transfer.
void check_host(const char* op, const char* name, const at::Tensor& t, const Handle& h, int64_t numel) {
  TORCH_CHECK_VALUE(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name,
                    " must be a contiguous float32 CPU tensor, got ", t.scalar_type(), " on ", t.device(),
                    t.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK_VALUE(t.numel() == numel, op, ": ", name, " has ", t.numel(), " elements but the device buffer has ",
                    numel, "; pass equally long buffers (slice the longer one)");
  TORCH_CHECK_VALUE(h.device.is_cpu() || t.is_pinned(), op, ": ", name,
                    " is pageable host memory: asynchronous copies need pinned memory "
                    "(torch.empty(..., pin_memory=True))");
}

// The device-side buffer of a transfer.
int check_device(const char* op, const char* name, const at::Tensor& t, const Handle& h) {
  TORCH_CHECK_VALUE(t.device() == h.device, op, ": ", name, " is on ", t.device(), " but the prefetcher is on ",
                    h.device, "; move it, or create the prefetcher for that device");
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
  return dtype_code(op, name, t);
}

CUstream_st* current_stream(const Handle& h) {
  if (!h.device.is_cuda()) return nullptr;
  const c10::Stream s = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(h.device);
  return static_cast<CUstream_st*>(s.native_handle());
}

int64_t create(int64_t device, int64_t piece_numel, int64_t num_threads) {
  constexpr const char* op = "tawpipe::_prefetch_create";
  TORCH_CHECK_VALUE(piece_numel >= 1, op, ": piece_numel must be >= 1, got ", piece_numel);
  tawpipe_prefetcher* p = nullptr;
  if (device < 0) {
    check(op, tawpipe_prefetch_create_host(piece_numel, static_cast<int>(num_threads), &p));
  } else {
#ifdef TAWPIPE_TORCH_CUDA
    check(op, tawpipe_prefetch_create_cuda(static_cast<int>(device), piece_numel, static_cast<int>(num_threads), &p));
#else
    TORCH_CHECK(false, op, ": this build of tawpipe has no CUDA prefetcher (built without CUDA); "
                "rebuild with a CUDA build of torch and nvcc, or use device='cpu'");
#endif
  }
  auto h = std::make_shared<Handle>(p, device < 0 ? c10::Device(c10::kCPU)
                                                  : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const int64_t handle = r.next++;
  r.handles.emplace(handle, std::move(h));
  return handle;
}

// The prefetcher is destroyed (after its queued work) outside the registry's lock.
void destroy(int64_t handle) { handle_of("tawpipe::_prefetch_destroy", handle, /*remove=*/true); }

void load(int64_t handle, const at::Tensor& src, const at::Tensor& dst) {
  constexpr const char* op = "tawpipe::_prefetch_load";
  const std::shared_ptr<Handle> held = handle_of(op, handle);
  const Handle& h = *held;
  const int dtype = check_device(op, "dst", dst, h);
  check_host(op, "src", src, h, dst.numel());
  check(op, tawpipe_prefetch_load(h.prefetcher, src.const_data_ptr<float>(), dst.mutable_data_ptr(), dtype,
                                  dst.numel(), current_stream(h)));
}

// acc += alpha * src on the host; with squares, the sum of acc's squares after it (same pass)
void add_to_host(const char* op, int64_t handle, const at::Tensor& src, const at::Tensor& acc, double alpha,
                 double timeout, double* squares) {
  const std::shared_ptr<Handle> held = handle_of(op, handle);
  const Handle& h = *held;
  const int dtype = check_device(op, "src", src, h);
  check_host(op, "acc", acc, h, src.numel());
  const void* from = src.const_data_ptr();
  float* to = acc.mutable_data_ptr<float>();
  const auto a = static_cast<float>(alpha);
  check(op, squares == nullptr
                ? tawpipe_prefetch_accumulate(h.prefetcher, from, dtype, to, src.numel(), a, current_stream(h), timeout)
                : tawpipe_prefetch_accumulate_norm(h.prefetcher, from, dtype, to, src.numel(), a, current_stream(h),
                                                   timeout, squares));
}

void accumulate(int64_t handle, const at::Tensor& src, const at::Tensor& acc, double alpha, double timeout) {
  add_to_host("tawpipe::_prefetch_accumulate", handle, src, acc, alpha, timeout, nullptr);
}

double accumulate_norm(int64_t handle, const at::Tensor& src, const at::Tensor& acc, double alpha, double timeout) {
  double squares = 0.0;
  add_to_host("tawpipe::_prefetch_accumulate_norm", handle, src, acc, alpha, timeout, &squares);
  return squares;
}

void synchronize(int64_t handle, double timeout) {
  constexpr const char* op = "tawpipe::_prefetch_synchronize";
  check(op, tawpipe_prefetch_synchronize(handle_of(op, handle)->prefetcher, timeout));
}

std::vector<int64_t> info(int64_t handle) {
  const std::shared_ptr<Handle> held = handle_of("tawpipe::_prefetch_info", handle);
  const tawpipe_prefetcher* p = held->prefetcher;
  return {tawpipe_prefetch_piece_numel(p), static_cast<int64_t>(tawpipe_prefetch_device_bytes(p)),
          static_cast<int64_t>(tawpipe_prefetch_host_bytes(p))};
}

}  // namespace

// Private ops behind tawpipe.offload (eager only: they move data between devices by pointer).
// Handles are not tensors: the ops without a tensor argument are registered as plain functions,
// the three that move data dispatch on their tensors.
TORCH_LIBRARY_FRAGMENT(tawpipe, m) {
  m.def("_prefetch_create(int device, int piece_numel, int num_threads) -> int", &create);
  m.def("_prefetch_destroy(int handle) -> ()", &destroy);
  m.def("_prefetch_synchronize(int handle, float timeout) -> ()", &synchronize);
  m.def("_prefetch_info(int handle) -> int[]", &info);
  m.def("_prefetch_load(int handle, Tensor src, Tensor(a!) dst) -> ()");
  m.def("_prefetch_accumulate(int handle, Tensor src, Tensor(a!) acc, float alpha, float timeout) -> ()");
  m.def("_prefetch_accumulate_norm(int handle, Tensor src, Tensor(a!) acc, float alpha, float timeout) -> float");
}

TORCH_LIBRARY_IMPL(tawpipe, CompositeExplicitAutograd, m) {
  m.impl("_prefetch_load", &load);
  m.impl("_prefetch_accumulate", &accumulate);
  m.impl("_prefetch_accumulate_norm", &accumulate_norm);
}

}  // namespace tawpipe
