// torch's in-place rules for the tensors the tawpipe ops write (see segments.h: write_inplace).
#include <torch/csrc/autograd/VariableTypeUtils.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <utility>

#include "segments.h"

namespace tawpipe {
namespace {

// Autograd nodes are held by std::shared_ptr up to torch 2.11 and by c10::intrusive_ptr since;
// both arms are templates, so only the one that matches this torch is compiled.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename Ptr, typename T, typename... Args>
Ptr make_node(Args&&... args) {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

}  // namespace

void write_inplace(const char* op, at::TensorList reads, at::TensorList writes,
                   c10::function_ref<std::string(size_t)> name, c10::function_ref<void()> write,
                   bool bump_versions) {
  const auto requires_grad = [](const at::Tensor& t) { return t.requires_grad(); };
  const bool grad_mode = at::GradMode::is_enabled();
  const bool reads_require_grad =
      grad_mode && std::any_of(reads.begin(), reads.end(), requires_grad);
  const bool history =
      reads_require_grad || (grad_mode && std::any_of(writes.begin(), writes.end(), requires_grad));
  if (history) {
    using torch::autograd::can_mutate_inplace_result;
    for (size_t i = 0; i < writes.size(); ++i) {
      const at::Tensor& t = writes[i];
      switch (torch::autograd::can_mutate_inplace(t, reads_require_grad || t.requires_grad())) {
        case can_mutate_inplace_result::success: break;
        case can_mutate_inplace_result::non_default_backward_view:  // torch's own message
          torch::autograd::handle_view_on_rebase(torch::autograd::impl::get_view_autograd_meta(t));
          break;
        case can_mutate_inplace_result::view_of_leaf:
        case can_mutate_inplace_result::is_leaf: {
          const std::string n = name(i);
          TORCH_CHECK(false, op, ": ", n, " is ", t.is_leaf() ? "" : "a view of ",
                      "a leaf tensor that requires grad (e.g. a parameter), which an in-place op "
                      "may not overwrite while autograd records (as in torch); write through a "
                      "detached alias (t.detach() shares t's memory), or run under torch.no_grad()");
        }
      }
    }
  }
  write();
  if (bump_versions) {
    for (const at::Tensor& t : writes) bump_version(t);
  }
  if (history) {
    for (const at::Tensor& t : writes) {
      if (!reads_require_grad && !t.requires_grad()) continue;
      torch::autograd::rebase_history(t, make_node<NodePtr, torch::autograd::NotImplemented>(
                                             op, torch::autograd::collect_next_edges(t, reads)));
    }
  }
}

void bump_version(const at::Tensor& t) { torch::autograd::increment_version(t); }

}  // namespace tawpipe
