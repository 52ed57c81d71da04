// CUDA implementation of the tawpipe ops. Uses only device-generic c10 APIs (no CUDA headers),
// so it compiles against any torch; it is built only when the CUDA kernels are.
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "segments.h"

namespace tawpipe {
namespace {

void check_cuda_status(const char* op, int status) {
  check_status(op, status, status == TAWPIPE_ERR_CUDA ? tawpipe_cuda_last_error() : nullptr);
}

}  // namespace

void launch_cuda(const char* op, c10::Device device, const std::vector<tawpipe_segment>& segments,
                 bool accumulate, double alpha) {
  if (segments.empty()) return;
  const c10::DeviceGuard guard(device);
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
  auto* const cuda_stream = static_cast<CUstream_st*>(stream.native_handle());
  check_cuda_status(op, tawpipe_shard_cuda_check_stream(cuda_stream));  // before allocating
  const auto count = static_cast<int64_t>(segments.size());
  const size_t bytes = tawpipe_shard_cuda_workspace_bytes(count);
  // A small table travels in the kernel's parameters (bytes == 0). A larger one travels pinned
  // host -> device on the stream; the device copy comes from the stream-ordered caching
  // allocator, so freeing it when this function returns is safe.
  at::Tensor staging, table;
  if (bytes > 0) {
    staging = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    table = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().device(device).dtype(at::kByte));
  }
  const int status = tawpipe_shard_segments_cuda(
      segments.data(), count, accumulate ? 1 : 0, static_cast<float>(alpha),
      bytes > 0 ? table.mutable_data_ptr() : nullptr, bytes > 0 ? staging.mutable_data_ptr() : nullptr, bytes,
      cuda_stream);
  if (bytes > 0) {  // the copy out of the pinned block runs later on the stream: keep the block till then
    at::getHostAllocator(at::kCUDA)->record_event(staging.mutable_data_ptr(),
                                                  staging.storage().data_ptr().get_context(), stream);
  }
  check_cuda_status(op, status);
}

namespace {

void run_cuda(const char* op, at::TensorList tensors, const at::Tensor& flat, at::IntArrayRef offsets,
              FlatRole role, bool accumulate, double alpha) {
  launch_cuda(op, flat.device(), make_segments(op, tensors, flat, offsets, role), accumulate, alpha);
}

void pack_cuda(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets) {
  run_cuda("tawpipe::pack", srcs, out, offsets, FlatRole::kDestination, false, 1.0);
}

void unpack_cuda(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets) {
  run_cuda("tawpipe::unpack", dsts, flat, offsets, FlatRole::kSource, false, 1.0);
}

void pack_accumulate_cuda(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets,
                          double alpha) {
  run_cuda("tawpipe::pack_accumulate", srcs, out, offsets, FlatRole::kDestination, true, alpha);
}

void unpack_accumulate_cuda(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets,
                            double alpha) {
  run_cuda("tawpipe::unpack_accumulate", dsts, flat, offsets, FlatRole::kSource, true, alpha);
}

}  // namespace

TORCH_LIBRARY_IMPL(tawpipe, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack", &unpack_cuda);
  m.impl("pack_accumulate", &pack_accumulate_cuda);
  m.impl("unpack_accumulate", &unpack_accumulate_cuda);
}

}  // namespace tawpipe
