// The backward phase's trigger in C++ (agent/grad_triggers.py's native mode; native.py loads it).
//
// The phase clock needs two moments inside torch.autograd.backward: the first parameter gradient
// (there it queues callback A on the autograd engine, ahead of DDP's finalize, which waits for
// the buckets) and A itself, when the autograd work is done. From Python that is a gradient hook
// and an engine callback, two entries into Python from the engine every step. Here they are C++
// gradient hooks on a few parameters: the first to fire while Python has armed the trigger
// disarms it and queues a C++ callback that stamps CLOCK_MONOTONIC (Python's
// time.perf_counter_ns). The backward wrapper arms it on entry and reads the stamp on return.
//
// The hooks are registered through the op syncscope::watch_grad (torch.ops, so the dispatcher
// hands over the parameter); a removed hook leaves an empty C++ slot, not a call into Python.
// Nothing here may throw into the user's backward.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/library.h>

#include "clock.h"

#include <atomic>
#include <memory>
#include <optional>
#include <string>

namespace {

std::unique_ptr<torch::Library> trigger_library;
std::string trigger_error;

}  // namespace

extern "C" {
// Set to 1 by Python before a timed backward; the first watched gradient takes it back to 0.
std::atomic<int64_t> syncscope_bwd_armed{0};
// When the callback queued by that gradient last ran (ns): Python compares it with the last it
// read to tell whether this backward's did.
std::atomic<int64_t> syncscope_bwd_done{0};
}

namespace {

void on_gradient() {
  if (syncscope_bwd_armed.exchange(0, std::memory_order_relaxed) == 0) {
    return;  // not armed, or a watched gradient already queued this backward's callback
  }
  try {
    torch::autograd::Engine::get_default_engine().queue_callback(
        [] { syncscope_bwd_done.store(syncscope::now_ns(), std::memory_order_relaxed); });
  } catch (...) {
    // Outside a graph task (a hook fired by hand): nothing queued, nothing stamped.
  }
}

int64_t watch_grad(const at::Tensor& param) {
  return param.register_hook([](const at::Tensor&) { on_gradient(); });
}

void unwatch_grad(const at::Tensor& param, int64_t hook) {
  param.remove_hook(static_cast<unsigned>(hook));
}

}  // namespace

extern "C" {

// Define syncscope::watch_grad(Tensor param) -> int (the hook's handle) and
// syncscope::unwatch_grad(Tensor param, int hook); 0, or -1 with syncscope_trigger_error().
int32_t syncscope_trigger_install() {
  try {
    if (!trigger_library) {
      auto library = std::make_unique<torch::Library>(
          torch::Library::DEF, "syncscope", std::nullopt, __FILE__, __LINE__);
      library->def("watch_grad(Tensor param) -> int", &watch_grad);
      library->def("unwatch_grad(Tensor param, int hook) -> ()", &unwatch_grad);
      trigger_library = std::move(library);
    }
    return 0;
  } catch (const std::exception& e) {
    trigger_error = e.what();
  } catch (...) {
    trigger_error = "unknown error";
  }
  return -1;
}

const char* syncscope_trigger_error() { return trigger_error.c_str(); }

}  // extern "C"
