// The bound fast path (tawpipe.ops.BoundShards): the segment table of a fixed group of tensors
// and one flat buffer, validated once and kept in C++. A step's pack or unpack then passes three
// numbers through the dispatcher instead of thousands of tensors, which for many small tensors
// costs about as much as the copy itself.
//
// The table holds raw pointers, so Python must not be able to change it: Python holds only an
// integer handle into a registry of live tables, looked up (under a lock) on every call, and
// never reused, so a wrong or stale handle is refused instead of addressing anything. A table
// keeps its tensors alive until tawpipe::_unbind (BoundShards calls it when it is collected).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "segments.h"

namespace tawpipe {
namespace {

// What a bound tensor's memory was at bind time: while all of it still holds, the table's
// pointers address that tensor's elements (bind checked they lie within its storage), so the
// kernels may use them.
struct Snapshot {
  const void* storage;
  size_t storage_nbytes;
  int64_t storage_offset;
  int64_t numel;
  caffe2::TypeMeta dtype;
  bool contiguous;

  bool operator==(const Snapshot& o) const {
    return storage == o.storage && storage_nbytes == o.storage_nbytes &&
           storage_offset == o.storage_offset && numel == o.numel && dtype == o.dtype &&
           contiguous == o.contiguous;
  }
};

Snapshot snapshot_of(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const c10::Storage& storage = impl->storage();
  return {storage.data(),         storage.nbytes(), impl->storage_offset(),
          impl->numel(),          impl->dtype(),    impl->is_contiguous()};
}

struct BoundTable {
  c10::Device device;
  std::vector<at::Tensor> tensors;      // the bound tensors, then the flat buffer (kept alive)
  std::vector<Snapshot> snapshots;      // of tensors, at bind time
  std::vector<tawpipe_segment> pack;    // tensors -> flat
  std::vector<tawpipe_segment> unpack;  // flat -> tensors
};

// The live tables by handle. A call holds its table (shared_ptr) while it runs, so a concurrent
// _unbind cannot free it under the kernels.
struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<const BoundTable>> tables;
  int64_t next_handle = 1;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: no teardown-order hazards at exit
  return *r;
}

// The table of a handle; with remove, also takes it out of the registry.
std::shared_ptr<const BoundTable> lookup(const char* op, int64_t handle, bool remove = false) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.tables.find(handle);
  TORCH_CHECK_VALUE(it != r.tables.end(), op, ": ", handle,
                    " is not the handle of a live table made by tawpipe::_bind (it was never bound, "
                    "or was unbound); use ShardLayout.bind");
  std::shared_ptr<const BoundTable> table = it->second;
  if (remove) r.tables.erase(it);
  return table;
}

// Modes of _run_bound; tawpipe/ops/__init__.py (_BOUND_MODES) mirrors them.
enum Mode : int64_t { kPack = 0, kUnpack = 1, kPackAccumulate = 2, kUnpackAccumulate = 3 };

int64_t bind(at::TensorList tensors, const at::Tensor& flat, at::IntArrayRef offsets) {
  constexpr const char* op = "ShardLayout.bind";
  // Unpack writes every bound tensor; its checks include pack's, so they cover all four modes.
  std::vector<tawpipe_segment> unpack = make_segments(op, tensors, flat, offsets, FlatRole::kSource);
#ifdef TAWPIPE_TORCH_CUDA
  constexpr bool cuda = true;
#else
  constexpr bool cuda = false;
#endif
  TORCH_CHECK_VALUE(flat.is_cpu() || (cuda && flat.is_cuda()), op, ": tensors on ", flat.device(),
                    " cannot be bound (this build of tawpipe binds ", cuda ? "CPU and CUDA" : "CPU",
                    " tensors); use ShardLayout.pack / unpack");
  auto table = std::make_shared<BoundTable>(BoundTable{flat.device(), tensors.vec(), {}, {}, {}});
  table->tensors.push_back(flat);
  for (const at::Tensor& t : table->tensors) table->snapshots.push_back(snapshot_of(t));
  table->pack = unpack;
  for (tawpipe_segment& seg : table->pack) {
    std::swap(seg.src_dtype, seg.dst_dtype);
    const void* tensor = seg.dst;
    seg.dst = const_cast<void*>(seg.src);  // the flat buffer, which pack writes
    seg.src = tensor;
  }
  table->unpack = std::move(unpack);
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const int64_t handle = r.next_handle++;
  r.tables.emplace(handle, std::move(table));
  return handle;
}

// The table, and with it the references to its tensors, is freed outside the registry's lock.
void unbind(int64_t handle) { lookup("tawpipe::_unbind", handle, /*remove=*/true); }

void run_bound(int64_t handle, int64_t mode, double alpha) {
  TORCH_CHECK_VALUE(mode >= kPack && mode <= kUnpackAccumulate,
                    "tawpipe::_run_bound: mode must be 0-3, got ", mode);
  const std::shared_ptr<const BoundTable> table = lookup("tawpipe::_run_bound", handle);
  constexpr const char* kNames[] = {"BoundShards.pack", "BoundShards.unpack",
                                    "BoundShards.pack_accumulate", "BoundShards.unpack_accumulate"};
  const char* op = kNames[mode];  // what the user called
  const size_t count = table->tensors.size() - 1;
  for (size_t i = 0; i <= count; ++i) {
    TORCH_CHECK(snapshot_of(table->tensors[i]) == table->snapshots[i], op, ": ",
                i == count ? std::string("the flat buffer") : "bound tensor " + std::to_string(i),
                " no longer has the storage, numel, dtype or layout it had when bound (it was "
                "resized, or its data replaced, e.g. param.data = ...); bind again");
  }
  const bool unpack = mode == kUnpack || mode == kUnpackAccumulate;
  const bool accumulate = mode == kPackAccumulate || mode == kUnpackAccumulate;
  const std::vector<tawpipe_segment>& segments = unpack ? table->unpack : table->pack;
  const at::TensorList bound = at::TensorList(table->tensors).slice(0, count);
  const at::TensorList flat = at::TensorList(table->tensors).slice(count);
  const auto name = [&](size_t i) {
    return unpack ? "bound tensor " + std::to_string(i) : std::string("the flat buffer");
  };
  const auto write = [&] {
#ifdef TAWPIPE_TORCH_CUDA
    if (table->device.is_cuda()) {
      launch_cuda(op, table->device, segments, accumulate, alpha);
      return;
    }
#endif  // without it, bind made CPU tables only
    const int status =
        tawpipe_shard_segments_cpu(segments.data(), static_cast<int64_t>(segments.size()),
                                   accumulate ? 1 : 0, static_cast<float>(alpha), at::get_num_threads());
    check_status(op, status, nullptr);
  };
  write_inplace(op, unpack ? flat : bound, unpack ? bound : flat, name, write, /*bump_versions=*/true);
}

}  // namespace

// The bound path's private ops. Their handles are not tensors, so the dispatcher runs the kernels
// given with the schemas (CompositeImplicitAutograd) whatever the bound tensors' device.
TORCH_LIBRARY_FRAGMENT(tawpipe, m) {
  m.def("_bind(Tensor[] tensors, Tensor flat, int[] offsets) -> int", &bind);
  m.def("_run_bound(int table, int mode, float alpha) -> ()", &run_bound);
  m.def("_unbind(int table) -> ()", &unbind);
}

}  // namespace tawpipe
