// What every entry point of the tawpipe ops checks and records around its kernel: the one
// validator of their arguments, and torch's in-place rules for the tensors they write.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/FunctionRef.h>

#include <string>
#include <vector>

#include "kernels/shard_ops.h"

namespace tawpipe {

// Which side of a segment the flat buffer is: pack writes it, unpack reads it.
enum class FlatRole { kDestination, kSource };

// The one validator of the ops' arguments (native kernels, their Meta kernels for torch.compile,
// the Triton backend through tawpipe::_prepare, ShardLayout.bind). Throws c10::ValueError
// (Python ValueError) naming the problem and the fix. On meta (and fake) tensors it checks
// shapes, dtypes and layout, symbolic sizes included; on real tensors also memory: every
// tensor within its storage, and no segment's memory written while another reads or writes it.
void check_segments(const char* op, at::TensorList tensors, const at::Tensor& flat,
                    at::IntArrayRef offsets, FlatRole flat_role);

// check_segments, then the kernels' segment table (tensors with no elements are left out).
std::vector<tawpipe_segment> make_segments(const char* op, at::TensorList tensors,
                                           const at::Tensor& flat, at::IntArrayRef offsets,
                                           FlatRole flat_role);

// Turns a non-zero kernel status into a RuntimeError; detail (may be null) is appended.
void check_status(const char* op, int status, const char* detail);

// Enqueues a validated table on the current stream of a CUDA device (defined in ops_cuda.cpp,
// which is built, with TAWPIPE_TORCH_CUDA defined, only when the CUDA kernels are).
void launch_cuda(const char* op, c10::Device device, const std::vector<tawpipe_segment>& segments,
                 bool accumulate, double alpha);

// Defined in inplace.cpp. Runs write() as torch runs an in-place op that has no derivative, for an op that overwrites
// `writes` with values computed from `reads` (and, when accumulating, from `writes`):
// - before, in grad mode: refuses to overwrite a leaf that requires grad or a view of one
//   (RuntimeError naming the tensor as name(i) and the fix), and what torch refuses for views;
// - after, in grad mode: every written tensor that requires grad, or whose reads do, gets a
//   history whose backward raises "derivative for <op> is not implemented" (never the stale
//   history, which would give silently wrong gradients);
// - after, if bump_versions: bumps every written tensor's version, so that backward through a
//   tensor saved before the write raises. (The public ops bump in their ADInplaceOrView kernel.)
void write_inplace(const char* op, at::TensorList reads, at::TensorList writes,
                   c10::function_ref<std::string(size_t)> name, c10::function_ref<void()> write,
                   bool bump_versions);

// Bumps t's version counter (see write_inplace).
void bump_version(const at::Tensor& t);

}  // namespace tawpipe
