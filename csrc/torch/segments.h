// Argument validation shared by the CPU and CUDA implementations of the tawpipe ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <vector>

#include "kernels/shard_ops.h"

namespace tawpipe {

// Which side of a segment the flat buffer is: pack writes it, unpack reads it.
enum class FlatRole { kDestination, kSource };

// Checks every argument of a tawpipe op before any work is done and returns the kernel's
// segment table. Throws c10::ValueError (Python ValueError) naming the problem and the fix.
std::vector<tawpipe_segment> make_segments(const char* op, at::TensorList tensors,
                                           const at::Tensor& flat, at::IntArrayRef offsets,
                                           FlatRole flat_role);

// Turns a non-zero kernel status into a RuntimeError; detail (may be null) is appended.
void check_status(const char* op, int status, const char* detail);

// Enqueues a validated table on the current stream of a CUDA device (defined in ops_cuda.cpp,
// which is built, with TAWPIPE_TORCH_CUDA defined, only when the CUDA kernels are).
void launch_cuda(const char* op, c10::Device device, const std::vector<tawpipe_segment>& segments,
                 bool accumulate, double alpha);

}  // namespace tawpipe
