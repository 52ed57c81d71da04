#include "segments.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <numeric>

namespace tawpipe {
namespace {

bool kernel_dtype(at::ScalarType t, int32_t* out) {
  switch (t) {
    case at::kFloat: *out = TAWPIPE_DTYPE_F32; return true;
    case at::kBFloat16: *out = TAWPIPE_DTYPE_BF16; return true;
    case at::kHalf: *out = TAWPIPE_DTYPE_F16; return true;
    default: return false;
  }
}

struct ByteRange {
  uintptr_t begin;
  uintptr_t end;
  size_t index;
};

ByteRange bytes_of(const at::Tensor& t, size_t index) {
  const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return {begin, begin + static_cast<uintptr_t>(t.numel()) * t.element_size(), index};
}

}  // namespace

std::vector<tawpipe_segment> make_segments(const char* op, at::TensorList tensors,
                                           const at::Tensor& flat, at::IntArrayRef offsets,
                                           FlatRole flat_role) {
  const bool pack = flat_role == FlatRole::kDestination;
  const char* list = pack ? "srcs" : "dsts";
  const char* buf = pack ? "out" : "flat";
  TORCH_CHECK_VALUE(tensors.size() == offsets.size(), op, ": got ", tensors.size(), " ", list, " but ",
                    offsets.size(), " offsets; pass exactly one offset per tensor");
  int32_t flat_dtype = 0;
  TORCH_CHECK_VALUE(kernel_dtype(flat.scalar_type(), &flat_dtype), op, ": ", buf, " has dtype ",
                    flat.scalar_type(), "; supported dtypes are float32, bfloat16 and float16");
  TORCH_CHECK_VALUE(flat.dim() == 1, op, ": ", buf, " must be 1-D, got shape ", flat.sizes(),
                    "; pass a flat buffer, e.g. ", buf, ".view(-1)");
  TORCH_CHECK_VALUE(flat.is_contiguous(), op, ": ", buf, " must be contiguous (stride 1), got stride ",
                    flat.strides(), "; allocate it with torch.empty(n)");
  const int64_t capacity = flat.numel();

  std::vector<tawpipe_segment> segments;
  segments.reserve(tensors.size());
  std::vector<size_t> nonempty;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    int32_t dtype = 0;
    TORCH_CHECK_VALUE(kernel_dtype(t.scalar_type(), &dtype), op, ": ", list, "[", i, "] has dtype ",
                      t.scalar_type(), "; supported dtypes are float32, bfloat16 and float16");
    TORCH_CHECK_VALUE(t.device() == flat.device(), op, ": ", list, "[", i, "] is on ", t.device(),
                      " but ", buf, " is on ", flat.device(), "; move all tensors to one device");
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", list, "[", i, "] is not contiguous; ",
                      pack ? "pass srcs[i].contiguous()"
                           : "unpack into a contiguous tensor and copy it into the strided one");
    const int64_t numel = t.numel();
    const int64_t offset = offsets[i];
    TORCH_CHECK_VALUE(offset >= 0 && offset <= capacity - numel, op, ": segment ", i, " (offset ",
                      offset, ", numel ", numel, ") does not fit in ", buf, " of ", capacity,
                      " elements; need 0 <= offset and offset + numel <= ", buf,
                      ".numel(): fix the offsets or enlarge ", buf);
    if (numel == 0) continue;
    nonempty.push_back(i);
    tawpipe_segment seg;
    seg.numel = numel;
    if (pack) {
      seg.src = t.const_data_ptr();
      seg.dst = static_cast<char*>(flat.data_ptr()) + offset * flat.element_size();
      seg.src_dtype = dtype;
      seg.dst_dtype = flat_dtype;
    } else {
      seg.src = static_cast<const char*>(flat.const_data_ptr()) + offset * flat.element_size();
      seg.dst = t.data_ptr();
      seg.src_dtype = flat_dtype;
      seg.dst_dtype = dtype;
    }
    segments.push_back(seg);
  }

  // Segments must be disjoint ranges of the flat buffer: sort by offset, compare neighbours.
  std::vector<size_t> order(nonempty.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),  // stable: same message as Python
                   [&](size_t a, size_t b) { return offsets[nonempty[a]] < offsets[nonempty[b]]; });
  for (size_t k = 1; k < order.size(); ++k) {
    const size_t prev = nonempty[order[k - 1]];
    const size_t cur = nonempty[order[k]];
    const int64_t prev_end = offsets[prev] + tensors[prev].numel();
    TORCH_CHECK_VALUE(offsets[cur] >= prev_end, op, ": segments ", prev, " [", offsets[prev], ", ",
                      prev_end, ") and ", cur, " [", offsets[cur], ", ",
                      offsets[cur] + tensors[cur].numel(), ") overlap in ", buf,
                      "; give every tensor its own range (see ShardLayout)");
  }

  // Memory the kernel writes must not be read or written by another segment.
  if (capacity > 0 && !nonempty.empty()) {
    const ByteRange flat_bytes = bytes_of(flat, 0);
    for (size_t i : nonempty) {
      const ByteRange r = bytes_of(tensors[i], i);
      TORCH_CHECK_VALUE(r.end <= flat_bytes.begin || flat_bytes.end <= r.begin, op, ": ", buf,
                        " shares memory with ", list, "[", i, "]; ",
                        pack ? "pack into a separate buffer" : "unpack from a separate buffer");
    }
  }
  if (!pack) {
    std::vector<ByteRange> ranges;
    ranges.reserve(nonempty.size());
    for (size_t i : nonempty) ranges.push_back(bytes_of(tensors[i], i));
    std::sort(ranges.begin(), ranges.end(),
              [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
    for (size_t k = 1; k < ranges.size(); ++k) {
      TORCH_CHECK_VALUE(ranges[k - 1].end <= ranges[k].begin, op, ": dsts[",
                        std::min(ranges[k - 1].index, ranges[k].index), "] and dsts[",
                        std::max(ranges[k - 1].index, ranges[k].index),
                        "] share memory; every destination must be a distinct tensor");
    }
  }
  return segments;
}

void check_status(const char* op, int status, const char* detail) {
  TORCH_CHECK(status == TAWPIPE_OK, op, ": ", tawpipe_status_string(status),
              detail != nullptr ? " (" : "", detail != nullptr ? detail : "",
              detail != nullptr ? ")" : "");
}

}  // namespace tawpipe
