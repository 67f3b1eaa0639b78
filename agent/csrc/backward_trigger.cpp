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
//
// A clock that marks its boundaries (CudaPhaseClock: a CUDA event at callback A) needs its
// Python callback A, not a stamp: for it the armed gradient calls the trigger's `on_grad`
// (syncscope_trigger_calls; the gradient hook in C of hot_path.cpp, which queues A) under the
// GIL, as torch calls a Python gradient hook, but once a timed backward rather than at every
// backward: a quiet step's gradients find the trigger disarmed and never enter Python.

#include <Python.h>

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

// The trigger's on_grad where a clock that marks holds the trigger (a new reference held
// here), else nullptr; set and read under the GIL.
PyObject* python_on_grad = nullptr;
std::atomic<bool> calls_python{false};

void call_python() {
  if (!Py_IsInitialized()) {
    return;
  }
  const PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* on_grad = python_on_grad;
  if (on_grad != nullptr) {
    Py_INCREF(on_grad);  // held: the call may replace it
    PyObject* done = PyObject_CallOneArg(on_grad, Py_None);
    Py_XDECREF(done);
    Py_DECREF(on_grad);
    PyErr_Clear();  // on_grad tells the clock its own errors; nothing reaches the backward
  }
  PyGILState_Release(gil);
}

void on_gradient() {
  if (syncscope_bwd_armed.exchange(0, std::memory_order_relaxed) == 0) {
    return;  // not armed, or a watched gradient already queued this backward's callback
  }
  if (calls_python.load(std::memory_order_relaxed)) {
    call_python();
    return;
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

// The armed gradient calls `on_grad(None)` (a callable) instead of stamping, or stamps again
// (None). Called holding the GIL (ctypes.PyDLL).
void syncscope_trigger_calls(PyObject* on_grad) {
  PyObject* old = python_on_grad;
  python_on_grad = nullptr;
  if (on_grad != Py_None) {
    Py_INCREF(on_grad);
    python_on_grad = on_grad;
  }
  calls_python.store(python_on_grad != nullptr, std::memory_order_relaxed);
  Py_XDECREF(old);
}

}  // extern "C"
