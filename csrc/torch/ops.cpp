// Schemas of the tawpipe ops (public API) and their CPU implementation.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "segments.h"

namespace tawpipe {
namespace {

void run_cpu(const char* op, at::TensorList tensors, const at::Tensor& flat, at::IntArrayRef offsets,
             FlatRole role, bool accumulate, double alpha) {
  const std::vector<tawpipe_segment> segments = make_segments(op, tensors, flat, offsets, role);
  const int status =
      tawpipe_shard_segments_cpu(segments.data(), static_cast<int64_t>(segments.size()),
                                 accumulate ? 1 : 0, static_cast<float>(alpha), at::get_num_threads());
  check_status(op, status, nullptr);
}

void pack_cpu(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets) {
  run_cpu("tawpipe::pack", srcs, out, offsets, FlatRole::kDestination, false, 1.0);
}

void unpack_cpu(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets) {
  run_cpu("tawpipe::unpack", dsts, flat, offsets, FlatRole::kSource, false, 1.0);
}

void pack_accumulate_cpu(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets,
                         double alpha) {
  run_cpu("tawpipe::pack_accumulate", srcs, out, offsets, FlatRole::kDestination, true, alpha);
}

void unpack_accumulate_cpu(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets,
                           double alpha) {
  run_cpu("tawpipe::unpack_accumulate", dsts, flat, offsets, FlatRole::kSource, true, alpha);
}

}  // namespace

TORCH_LIBRARY(tawpipe, m) {
  m.def("pack(Tensor[] srcs, Tensor(a!) out, int[] offsets) -> ()");
  m.def("unpack(Tensor flat, Tensor(a!)[] dsts, int[] offsets) -> ()");
  m.def("pack_accumulate(Tensor[] srcs, Tensor(a!) out, int[] offsets, float alpha) -> ()");
  m.def("unpack_accumulate(Tensor flat, Tensor(a!)[] dsts, int[] offsets, float alpha) -> ()");
  // Private: the bound fast path behind tawpipe.ops.BoundShards (eager only; see bound.cpp).
  m.def("_bind(Tensor[] tensors, Tensor flat, int[] offsets) -> Tensor");
  m.def("_run_bound(Tensor table, int mode, float alpha) -> ()");
}

TORCH_LIBRARY_IMPL(tawpipe, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
  m.impl("pack_accumulate", &pack_accumulate_cpu);
  m.impl("unpack_accumulate", &unpack_accumulate_cpu);
}

}  // namespace tawpipe
