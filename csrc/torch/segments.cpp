#include "segments.h"

#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

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

// Sizes are int64_t for real tensors and c10::SymInt for fake ones (torch.compile with dynamic
// shapes), whose comparisons are guards: one set of checks serves both.
int64_t numel_of(const at::Tensor& t, int64_t /*tag*/) { return t.numel(); }
c10::SymInt numel_of(const at::Tensor& t, const c10::SymInt& /*tag*/) { return t.sym_numel(); }

// Shapes, dtypes, devices, layout, offsets and overlap: everything that needs no memory.
template <class Int>
void check_shapes(const char* op, at::TensorList tensors, const at::Tensor& flat,
                  at::IntArrayRef offsets, bool pack) {
  const char* list = pack ? "srcs" : "dsts";
  const char* buf = pack ? "out" : "flat";
  TORCH_CHECK_VALUE(tensors.size() == offsets.size(), op, ": got ", tensors.size(), " ", list, " but ",
                    offsets.size(), " offsets; pass exactly one offset per tensor");
  int32_t dtype = 0;
  TORCH_CHECK_VALUE(kernel_dtype(flat.scalar_type(), &dtype), op, ": ", buf, " has dtype ",
                    flat.scalar_type(), "; supported dtypes are float32, bfloat16 and float16");
  TORCH_CHECK_VALUE(flat.layout() == at::kStrided, op, ": ", buf, " has layout ", flat.layout(),
                    "; pass a dense tensor (.to_dense())");
  TORCH_CHECK_VALUE(flat.dim() == 1, op, ": ", buf, " must be 1-D, got shape ", flat.sym_sizes(),
                    "; pass a flat buffer, e.g. ", buf, ".view(-1)");
  TORCH_CHECK_VALUE(flat.is_contiguous(), op, ": ", buf, " must be contiguous (stride 1), got stride ",
                    flat.sym_strides(), "; allocate it with torch.empty(n)");
  const Int capacity = numel_of(flat, Int());

  std::vector<Int> numels;
  numels.reserve(tensors.size());
  std::vector<size_t> nonempty;  // only tensors with elements occupy memory
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(kernel_dtype(t.scalar_type(), &dtype), op, ": ", list, "[", i, "] has dtype ",
                      t.scalar_type(), "; supported dtypes are float32, bfloat16 and float16");
    TORCH_CHECK_VALUE(t.device() == flat.device(), op, ": ", list, "[", i, "] is on ", t.device(),
                      " but ", buf, " is on ", flat.device(), "; move all tensors to one device");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", list, "[", i, "] has layout ", t.layout(),
                      "; pass a dense tensor (.to_dense())");
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", list, "[", i, "] is not contiguous; ",
                      pack ? "pass srcs[i].contiguous()"
                           : "unpack into a contiguous tensor and copy it into the strided one");
    numels.push_back(numel_of(t, Int()));
    const Int& numel = numels.back();
    const int64_t offset = offsets[i];
    TORCH_CHECK_VALUE(offset >= 0 && offset <= capacity - numel, op, ": segment ", i,
                      " (offset ", offset, ", numel ", numel, ") does not fit in ", buf, " of ",
                      capacity, " elements; need 0 <= offset and offset + numel <= ", buf,
                      ".numel(): fix the offsets or enlarge ", buf);
    if (numel != 0) nonempty.push_back(i);
  }

  // Segments must be disjoint ranges of the flat buffer: sort by offset, compare neighbours.
  std::vector<size_t> order(nonempty);
  std::stable_sort(order.begin(), order.end(),  // stable: ties report the lower indices
                   [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  for (size_t k = 1; k < order.size(); ++k) {
    const size_t prev = order[k - 1];
    const size_t cur = order[k];
    const Int prev_end = numels[prev] + offsets[prev];
    TORCH_CHECK_VALUE(prev_end <= offsets[cur], op, ": segments ", prev, " [", offsets[prev],
                      ", ", prev_end, ") and ", cur, " [", offsets[cur], ", ",
                      numels[cur] + offsets[cur], ") overlap in ", buf,
                      "; give every tensor its own range (see ShardLayout)");
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

// The kernels trust sizes: a tensor whose storage shrank (untyped_storage().resize_(...)) must
// not reach them. Contiguous, so its elements span numel items from its storage offset.
void check_extent(const char* op, const at::Tensor& t, const char* what, size_t index, bool in_list) {
  if (t.numel() == 0) return;
  const auto name = [&] {
    return in_list ? std::string(what) + "[" + std::to_string(index) + "]" : std::string(what);
  };
  TORCH_CHECK_VALUE(t.has_storage(), op, ": ", name(), " has no storage; pass a tensor that owns memory");
  const auto end = static_cast<uint64_t>(t.storage_offset() + t.numel()) * t.element_size();
  const size_t nbytes = t.storage().nbytes();
  TORCH_CHECK_VALUE(end <= nbytes, op, ": ", name(), " spans bytes [",
                    static_cast<uint64_t>(t.storage_offset()) * t.element_size(), ", ", end,
                    ") of its storage, which holds only ", nbytes,
                    " bytes (it was shrunk or freed, e.g. by untyped_storage().resize_()); pass a "
                    "tensor whose storage holds all its elements");
}

// Memory the kernels write must not be read or written by another segment, and every tensor
// must lie within its storage. Real tensors only (after check_shapes).
void check_memory(const char* op, at::TensorList tensors, const at::Tensor& flat, bool pack) {
  const char* list = pack ? "srcs" : "dsts";
  const char* buf = pack ? "out" : "flat";
  check_extent(op, flat, buf, 0, false);
  std::vector<ByteRange> ranges;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() == 0) continue;
    check_extent(op, tensors[i], list, i, true);
    ranges.push_back(bytes_of(tensors[i], i));
  }
  if (ranges.empty()) return;
  if (flat.numel() > 0) {
    const ByteRange flat_bytes = bytes_of(flat, 0);
    for (const ByteRange& r : ranges) {
      TORCH_CHECK_VALUE(r.end <= flat_bytes.begin || flat_bytes.end <= r.begin, op, ": ", buf,
                        " shares memory with ", list, "[", r.index, "]; ",
                        pack ? "pack into a separate buffer" : "unpack from a separate buffer");
    }
  }
  if (!pack) {
    std::sort(ranges.begin(), ranges.end(),
              [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
    for (size_t k = 1; k < ranges.size(); ++k) {
      TORCH_CHECK_VALUE(ranges[k - 1].end <= ranges[k].begin, op, ": dsts[",
                        std::min(ranges[k - 1].index, ranges[k].index), "] and dsts[",
                        std::max(ranges[k - 1].index, ranges[k].index),
                        "] share memory; every destination must be a distinct tensor");
    }
  }
}

}  // namespace

void check_segments(const char* op, at::TensorList tensors, const at::Tensor& flat,
                    at::IntArrayRef offsets, FlatRole flat_role) {
  const bool pack = flat_role == FlatRole::kDestination;
  if (flat.is_meta()) {  // also fake tensors, whose kernels run on meta (torch.compile)
    check_shapes<c10::SymInt>(op, tensors, flat, offsets, pack);
    return;
  }
  check_shapes<int64_t>(op, tensors, flat, offsets, pack);
  check_memory(op, tensors, flat, pack);
}

std::vector<tawpipe_segment> make_segments(const char* op, at::TensorList tensors,
                                           const at::Tensor& flat, at::IntArrayRef offsets,
                                           FlatRole flat_role) {
  check_segments(op, tensors, flat, offsets, flat_role);
  const bool pack = flat_role == FlatRole::kDestination;
  int32_t flat_dtype = 0;
  kernel_dtype(flat.scalar_type(), &flat_dtype);
  std::vector<tawpipe_segment> segments;
  segments.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    int32_t dtype = 0;
    kernel_dtype(t.scalar_type(), &dtype);
    const auto in_flat = offsets[i] * static_cast<int64_t>(flat.element_size());
    tawpipe_segment seg;
    seg.numel = t.numel();
    if (pack) {
      seg.src = t.const_data_ptr();
      seg.dst = static_cast<char*>(flat.data_ptr()) + in_flat;
      seg.src_dtype = dtype;
      seg.dst_dtype = flat_dtype;
    } else {
      seg.src = static_cast<const char*>(flat.const_data_ptr()) + in_flat;
      seg.dst = t.data_ptr();
      seg.src_dtype = flat_dtype;
      seg.dst_dtype = dtype;
    }
    segments.push_back(seg);
  }
  return segments;
}

void check_status(const char* op, int status, const char* detail) {
  TORCH_CHECK(status == TAWPIPE_OK, op, ": ", tawpipe_status_string(status),
              detail != nullptr ? " (" : "", detail != nullptr ? detail : "",
              detail != nullptr ? ")" : "");
}

}  // namespace tawpipe
