// Schemas of the tawpipe ops (public API), their CPU and Meta kernels, and the autograd layer
// that makes their writes visible: torch's in-place rules and version counter bumps.
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

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

// Meta kernels: the same validator on shapes only, which is what torch.compile traces with.
void pack_meta(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets) {
  check_segments("tawpipe::pack", srcs, out, offsets, FlatRole::kDestination);
}

void unpack_meta(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets) {
  check_segments("tawpipe::unpack", dsts, flat, offsets, FlatRole::kSource);
}

void pack_accumulate_meta(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets,
                          double /*alpha*/) {
  check_segments("tawpipe::pack_accumulate", srcs, out, offsets, FlatRole::kDestination);
}

void unpack_accumulate_meta(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets,
                            double /*alpha*/) {
  check_segments("tawpipe::unpack_accumulate", dsts, flat, offsets, FlatRole::kSource);
}

// Calls fn(tensor) for each tensor of a Tensor or Tensor[] argument.
template <class Fn>
void for_each_tensor(const c10::IValue& v, Fn&& fn) {
  if (v.isTensor()) {
    fn(v.toTensor());
  } else if (v.isTensorList()) {
    for (const c10::IValue& t : v.toListRef()) fn(t.toTensor());
  }
}

// Autograd kernel of the four public ops (boxed: one for all): write_inplace's rules for the
// tensors the schema marks as written (a!), around the op below autograd.
void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  const auto redispatch = [&] {
    at::AutoDispatchBelowAutograd guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  };
  bool any_requires_grad = false;  // the common case, with nothing to record, skips the rest
  for (size_t i = 0; i < num_args; ++i) {
    for_each_tensor((*stack)[first + i],
                    [&](const at::Tensor& t) { any_requires_grad |= t.requires_grad(); });
  }
  if (!any_requires_grad || !at::GradMode::is_enabled()) return redispatch();

  std::vector<at::Tensor> reads;
  std::vector<at::Tensor> writes;
  std::string written_arg;  // the schemas write exactly one argument (out or dsts)
  bool written_is_list = false;
  for (size_t i = 0; i < num_args; ++i) {
    const c10::IValue& v = (*stack)[first + i];
    const bool written = schema.is_mutable({c10::SchemaArgType::input, i});
    if (written) {
      written_arg = schema.arguments()[i].name();
      written_is_list = v.isTensorList();
    }
    for_each_tensor(v, [&](const at::Tensor& t) { (written ? writes : reads).push_back(t); });
  }
  const auto name = [&](size_t i) {
    return written_is_list ? written_arg + "[" + std::to_string(i) + "]" : written_arg;
  };
  write_inplace(schema.name().c_str(), reads, writes, name, redispatch, /*bump_versions=*/false);
}

// ADInplaceOrView kernel of the four public ops: bumps the version of every written tensor
// after the op, as torch's own in-place ops do (also in inference mode, on normal tensors).
void inplace_or_view_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                            torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  std::vector<c10::IValue> written;  // the call pops the arguments
  for (size_t i = 0; i < num_args; ++i) {
    if (schema.is_mutable({c10::SchemaArgType::input, i})) written.push_back((*stack)[first + i]);
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const c10::IValue& v : written) {
    for_each_tensor(v, [](const at::Tensor& t) { bump_version(t); });
  }
}

// Everything an op does except moving data, for the Triton backend (tawpipe/ops/__init__.py), whose
// kernels then move it: torch's in-place rules, the validation, the version bumps and history.
void prepare(c10::string_view op_view, at::TensorList tensors, const at::Tensor& flat,
             at::IntArrayRef offsets, bool flat_is_dst) {
  const std::string op(op_view);
  const at::TensorList flat_list(flat);
  const at::TensorList reads = flat_is_dst ? tensors : flat_list;
  const at::TensorList writes = flat_is_dst ? flat_list : tensors;
  const auto name = [&](size_t i) {
    return flat_is_dst ? std::string("out") : "dsts[" + std::to_string(i) + "]";
  };
  const auto validate = [&] {
    check_segments(op.c_str(), tensors, flat, offsets,
                   flat_is_dst ? FlatRole::kDestination : FlatRole::kSource);
  };
  write_inplace(op.c_str(), reads, writes, name, validate, /*bump_versions=*/true);
}

constexpr const char* kPublicOps[] = {"pack", "unpack", "pack_accumulate", "unpack_accumulate"};

}  // namespace

TORCH_LIBRARY(tawpipe, m) {
  m.def("pack(Tensor[] srcs, Tensor(a!) out, int[] offsets) -> ()");
  m.def("unpack(Tensor flat, Tensor(a!)[] dsts, int[] offsets) -> ()");
  m.def("pack_accumulate(Tensor[] srcs, Tensor(a!) out, int[] offsets, float alpha) -> ()");
  m.def("unpack_accumulate(Tensor flat, Tensor(a!)[] dsts, int[] offsets, float alpha) -> ()");
  // Private: the Triton backend's checks (see prepare). The bound fast path's private ops are
  // defined in bound.cpp.
  m.def("_prepare(str op, Tensor[] tensors, Tensor flat, int[] offsets, bool flat_is_dst) -> ()");
}

TORCH_LIBRARY_IMPL(tawpipe, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
  m.impl("pack_accumulate", &pack_accumulate_cpu);
  m.impl("unpack_accumulate", &unpack_accumulate_cpu);
}

TORCH_LIBRARY_IMPL(tawpipe, Meta, m) {
  m.impl("pack", &pack_meta);
  m.impl("unpack", &unpack_meta);
  m.impl("pack_accumulate", &pack_accumulate_meta);
  m.impl("unpack_accumulate", &unpack_accumulate_meta);
}

TORCH_LIBRARY_IMPL(tawpipe, Autograd, m) {
  for (const char* name : kPublicOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
  }
}

TORCH_LIBRARY_IMPL(tawpipe, ADInplaceOrView, m) {
  for (const char* name : kPublicOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&inplace_or_view_kernel>());
  }
}

TORCH_LIBRARY_IMPL(tawpipe, CompositeExplicitAutograd, m) { m.impl("_prepare", &prepare); }

}  // namespace tawpipe
