// syncscope's dispatcher kernel for c10d ops, in C++ (agent/native.py builds and loads it).
//
// The same interception as agent/collectives.py's Python kernel, at a fraction of its cost per
// collective (~4 µs against ~35 µs: docs/parallelism.md): a boxed kernel at the BackendSelect
// key of every c10d op syncscope times redispatches the call, and for CPU tensors stamps its
// issue and its completion with CLOCK_MONOTONIC (Python's time.perf_counter_ns). Completion is
// the Work's future completing (gloo's thread runs the callback); a Work without a future
// (gloo's emulated reduce_scatter, send, recv) is handed back wrapped, and completes at the end
// of its first successful wait. Records wait in a bounded buffer that Python drains. DDP's
// gradient buckets (the ops Python names, issued inside autograd on the groups it names) are
// redispatched untimed: the phase clock times DDP's sync, and timing them cost a tiny model's
// step ~5 µs of its training thread (bench/bench_agent_overhead.py).
//
// Plain C entry points (ctypes): no pybind, no Python headers. Nothing here may throw into the
// caller's collective: every step of syncscope's own is guarded, the op's errors pass through.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/library.h>

#include "clock.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr int32_t kAbi = 8;
constexpr size_t kMaxRecords = 65536;  // undrained records; past that, new ones are dropped
constexpr int32_t kMaxGroups = 64;     // distinct process groups named; the rest are -1

struct Record {  // mirrored by agent/native.py's _Record
  int64_t t0;     // issued (ns, CLOCK_MONOTONIC)
  int64_t t1;     // completed
  int64_t bytes;  // the size argument's bytes (see collectives.C10D_OPS)
  int64_t step;   // syncscope_step at issue
  int32_t op;     // the index Python gave at install
  int32_t group;  // index into the group table, or -1
  int32_t in_autograd;  // issued inside an autograd graph task (DDP's bucket all-reduces)
  int32_t pad;
};

using syncscope::now_ns;

std::mutex mu;  // guards everything below
std::vector<Record> records;
std::unordered_map<std::string, int32_t> group_ids;  // by ProcessGroup name
std::vector<std::pair<std::string, std::string>> groups;  // (name, description)
std::unique_ptr<torch::Library> library;
std::string last_error;

// Left untimed inside autograd: the ops in skip_ops (a bit per op index) on the groups named
// in skip_groups (replaced whole by syncscope_skip; read with atomic_load on the hot path).
std::atomic<uint64_t> skip_ops{0};
std::shared_ptr<const std::vector<std::string>> skip_groups =
    std::make_shared<const std::vector<std::string>>();
// What was left untimed, in bytes: of step skip_step so far, and of the step before it that
// had any (skip_done_step, -1: none yet). Under mu.
int64_t skip_step = -1, skip_bytes = 0, skip_done_step = -1, skip_done_bytes = 0;

}  // namespace

extern "C" {
// Written by Python (the phase clock's step) and read at issue; counted drops read by Python.
std::atomic<int64_t> syncscope_step{0};
std::atomic<int64_t> syncscope_dropped{0};
}

namespace {

void push(const Record& r) {
  std::lock_guard<std::mutex> guard(mu);
  if (records.size() >= kMaxRecords) {
    syncscope_dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  records.push_back(r);
}

int32_t group_of(const c10::IValue& value) {
  if (!value.isCustomClass()) {
    return -1;
  }
  auto pg = value.toCustomClass<c10d::ProcessGroup>();
  const std::string& name = pg->getGroupName();
  std::lock_guard<std::mutex> guard(mu);
  auto it = group_ids.find(name);
  if (it != group_ids.end()) {
    return it->second;
  }
  if (static_cast<int32_t>(groups.size()) >= kMaxGroups) {
    return -1;
  }
  auto id = static_cast<int32_t>(groups.size());
  groups.emplace_back(name, pg->getGroupDesc());
  group_ids.emplace(name, id);
  return id;
}

bool skipped_group(const c10::IValue& value) {
  if (!value.isCustomClass()) {
    return false;
  }
  const auto names = std::atomic_load(&skip_groups);
  if (names->empty()) {
    return false;
  }
  const std::string& name = value.toCustomClass<c10d::ProcessGroup>()->getGroupName();
  for (const std::string& skipped : *names) {
    if (skipped == name) {
      return true;
    }
  }
  return false;
}

void count_skipped(int64_t step, int64_t bytes) {
  std::lock_guard<std::mutex> guard(mu);
  if (step != skip_step) {
    if (skip_step >= 0) {
      skip_done_step = skip_step;
      skip_done_bytes = skip_bytes;
    }
    skip_step = step;
    skip_bytes = 0;
  }
  skip_bytes += bytes;
}

bool first_tensor_is_cpu(const c10::IValue& value) {
  if (value.isTensor()) {
    return value.toTensor().is_cpu();
  }
  if (value.isTensorList()) {
    auto list = value.toTensorList();
    return list.size() > 0 && list.get(0).is_cpu();
  }
  if (value.isList()) {
    auto list = value.toList();
    return list.size() > 0 && first_tensor_is_cpu(list.get(0));
  }
  return false;
}

int64_t nbytes(const c10::IValue& value) {
  if (value.isTensor()) {
    return static_cast<int64_t>(value.toTensor().nbytes());
  }
  int64_t total = 0;
  if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList()) {
      total += static_cast<int64_t>(t.nbytes());
    }
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toList()) {
      total += nbytes(item);
    }
  }
  return total;
}

// A Work without a future, handed back in place of the backend's: every call goes to it, and
// the end of the first successful wait completes the record.
class TimedWork final : public c10d::Work {
 public:
  TimedWork(c10::intrusive_ptr<c10d::Work> inner, Record record)
      : Work(-1, inner->retrieveOpType()), inner_(std::move(inner)), record_(record) {}

  bool wait(std::chrono::milliseconds timeout) override {
    bool done = inner_->wait(timeout);
    if (done && !recorded_.exchange(true)) {
      record_.t1 = now_ns();
      push(record_);
    }
    return done;
  }
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  void blockCurrentStream() override { inner_->blockCurrentStream(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override {
    return inner_->getFutureResult();
  }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  Record record_;
  std::atomic<bool> recorded_{false};
};

class Timed final : public c10::OperatorKernel {
 public:
  Timed(int32_t op, int32_t group_at, int32_t size_at)
      : op_(op), group_at_(group_at), size_at_(size_at) {}

  void operator()(
      const c10::OperatorHandle& handle,
      c10::DispatchKeySet keys,
      torch::jit::Stack* stack) {
    const int64_t t0 = now_ns();
    Record record{t0, 0, 0, syncscope_step.load(std::memory_order_relaxed), op_, -1, 0, 0};
    bool timed = false;
    try {
      const size_t base = stack->size() - handle.schema().arguments().size();
      const bool in_autograd = torch::autograd::get_current_graph_task_id() != -1;
      const bool skipped = in_autograd && op_ < 64 &&
          (skip_ops.load(std::memory_order_relaxed) >> op_ & 1) != 0 &&
          skipped_group((*stack)[base + group_at_]);
      timed = !skipped && first_tensor_is_cpu((*stack)[base]);
      if (skipped && size_at_ >= 0) {
        count_skipped(record.step, nbytes((*stack)[base + size_at_]));
      }
      if (timed) {
        record.group = group_of((*stack)[base + group_at_]);
        record.bytes = size_at_ >= 0 ? nbytes((*stack)[base + size_at_]) : 0;
        record.in_autograd = in_autograd;
      }
    } catch (...) {
      timed = false;
      syncscope_dropped.fetch_add(1, std::memory_order_relaxed);
    }
    handle.redispatchBoxed(keys.remove(c10::DispatchKey::BackendSelect), stack);
    if (!timed) {
      return;
    }
    try {
      complete(handle, stack, record);
    } catch (...) {
      syncscope_dropped.fetch_add(1, std::memory_order_relaxed);
    }
  }

 private:
  static void complete(
      const c10::OperatorHandle& handle,
      torch::jit::Stack* stack,
      Record record) {
    if (handle.schema().returns().empty() || !stack->back().isCustomClass()) {
      record.t1 = now_ns();  // a blocking op (monitored_barrier_): done on return
      push(record);
      return;
    }
    auto work = stack->back().toCustomClass<c10d::Work>();
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = work->getFuture();
    } catch (...) {  // "getFuture not implemented": completes at its wait
    }
    if (future) {
      future->addCallback(
          [record](c10::ivalue::Future&) mutable {
            record.t1 = now_ns();
            push(record);
          },
          /*uses_future=*/false);
      return;
    }
    stack->back() = c10::IValue(
        c10::intrusive_ptr<c10d::Work>(c10::make_intrusive<TimedWork>(work, record)));
  }

  int32_t op_, group_at_, size_at_;
};

}  // namespace

extern "C" {

int32_t syncscope_abi() { return kAbi; }

// The bytes left untimed (syncscope_skip) in the last step that had any before the current
// one, that step in *step (-1, and 0 bytes: none yet).
int64_t syncscope_skipped(int64_t* step) {
  std::lock_guard<std::mutex> guard(mu);
  *step = skip_done_step;
  return skip_done_bytes;
}

const char* syncscope_error() { return last_error.c_str(); }

// Time c10d op `name` (as collectives.C10D_OPS: its ProcessGroup and size argument positions,
// size_at < 0 for none) as op index `op`. 0, or -1 with syncscope_error() saying why.
int32_t syncscope_install(const char* name, int32_t op, int32_t group_at, int32_t size_at) {
  try {
    if (!library) {
      {
        std::lock_guard<std::mutex> guard(mu);
        records.clear();  // completions that came in after an earlier uninstall
      }
      library = std::make_unique<torch::Library>(
          torch::Library::IMPL, "c10d", c10::DispatchKey::BackendSelect, __FILE__, __LINE__);
    }
    library->impl(
        name,
        torch::CppFunction::makeFromBoxedFunctor(
            std::make_unique<Timed>(op, group_at, size_at)));
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown error";
  }
  return -1;
}

// Leave untimed, inside autograd, ops whose index has its bit set in `ops` on the groups named
// in `names` (NUL-separated, `count` of them): DDP's bucket all-reduces. Replaces the last call's,
// and starts the count of what is left untimed (syncscope_skipped) afresh.
void syncscope_skip(uint64_t ops, const char* names, int32_t count) {
  auto list = std::make_shared<std::vector<std::string>>();
  for (int32_t i = 0; i < count; ++i) {
    list->emplace_back(names);
    names += list->back().size() + 1;
  }
  std::atomic_store(&skip_groups, std::shared_ptr<const std::vector<std::string>>(list));
  skip_ops.store(ops, std::memory_order_relaxed);
  std::lock_guard<std::mutex> guard(mu);  // what an earlier list left untimed is not this one's
  skip_step = skip_done_step = -1;
  skip_bytes = skip_done_bytes = 0;
}

// Remove every kernel installed (the dispatcher restores the backends' own), forget records.
void syncscope_uninstall() {
  library.reset();
  syncscope_skip(0, "", 0);
  std::lock_guard<std::mutex> guard(mu);
  records.clear();
}

// Move up to `capacity` records into `out`; how many.
int64_t syncscope_drain(Record* out, int64_t capacity) {
  std::lock_guard<std::mutex> guard(mu);
  const auto n = static_cast<int64_t>(std::min<size_t>(capacity, records.size()));
  std::memcpy(out, records.data(), n * sizeof(Record));
  records.erase(records.begin(), records.begin() + n);
  return n;
}

// The name and description of group `id` into the buffers (NUL-terminated, cut to fit);
// 0, or -1 for an unknown id.
int32_t syncscope_group(int32_t id, char* name, int64_t name_cap, char* desc, int64_t desc_cap) {
  std::lock_guard<std::mutex> guard(mu);
  if (id < 0 || id >= static_cast<int32_t>(groups.size()) || name_cap < 1 || desc_cap < 1) {
    return -1;
  }
  std::snprintf(name, name_cap, "%s", groups[id].first.c_str());
  std::snprintf(desc, desc_cap, "%s", groups[id].second.c_str());
  return 0;
}

}  // extern "C"
