// The phase clock's hooks in C (agent/phase_hooks.py installs them, native.py loads the library):
// the model's forward wrapper (the forward phase, the batch's work), the optimizer's step pre-
// and post-hooks, which end the step and queue its row, and the torch.autograd.backward wrapper
// (backward, then DDP's exposed sync) with the C++ backward trigger's return or, where the
// trigger is a Python hook (a CudaPhaseClock's, a DTensor's parameters'), that hook and the
// callback A it queues; for a CudaPhaseClock, its events at the boundaries they see (its _mark,
// its StreamOf) and a quiet step's end. Each
// is the Python hook's common case, done on the clock's own slots: a hook entered from torch
// costs the training thread its Python frames on caches the step's kernels have flushed,
// several µs a step (docs/evaluation.md), and these do the same reads, sums and appends without
// a frame.
//
// Every hook is checked before it changes anything: anything but the common case (a quiet
// step, a pacer, a CUDA clock's timed step end, a wait for a collective to move into `comm`,
// the first step, a full queue, a missed trigger, another clock in the process, an attribute of
// an unexpected type) goes to the Python hook it stands for (`fallback`, or the clock's method),
// so that what the clock does is declared once, in agent/phases.py; tests/unit/test_hot_path.py
// runs the same steps through both and compares what they queue. Errors go to the clock's
// on_error, as in Python: nothing raises into the training loop but the backward's own error.
//
// Called through ctypes.PyDLL (the GIL held); CPython's C API, the clock's __slots__ read and
// written at the offsets its member descriptors give.

#include <Python.h>
#include <structmember.h>

#include "clock.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>  // placement new (the slots at install): C++17's other headers need not bring it

extern "C" {
// csrc/backward_trigger.cpp's: armed before a timed backward; when its callback last ran.
extern std::atomic<int64_t> syncscope_bwd_armed;
extern std::atomic<int64_t> syncscope_bwd_done;
}

namespace {

using syncscope::now_ns;

enum Kind {
  kPre = 0,
  kPost = 1,
  kBackward = 2,
  kForward = 3,
  kGrad = 4,
  kDone = 5,
  kFwdPre = 6,
  kFwdPost = 7
};
// How the optimizer's post-hook ends a step: the clock's own end_step and _quiet_end (a
// subclass's), the common step end here (a PhaseClock itself), or a CudaPhaseClock's quiet step's
// end here and the rest its own.
enum EndMode { kOwnEnd = 0, kInlineEnd = 1, kCudaQuietEnd = 2 };

// The slots a hook reads, by name; their offsets in an object of the type resolved.
#define CLOCK_SLOTS(X)                                                                   \
  X(acc) X(after_at) X(after_every) X(after_step) X(at_forward) X(blocked) X(blocked_seen) X(bwd_depth) \
  X(bwd_deferred) X(bwd_end) X(bwd_entry) X(bwd_pending) X(bwd_start) X(collectives) X(coll_max) X(ddp_bytes)          \
  X(ddp_group) X(ddp_model) X(detect_start) X(dropped) X(first_at) X(first_ddp_ns)        \
  X(first_step) X(fwd_since_bwd) X(fwd_start) X(grad_entry) X(idle_since) X(manual_steps) X(mark) X(opt_closure)     \
  X(opt_start) X(pacer) X(phase_every) X(queue_callback) X(quiet) X(shares) X(step) X(step_counter)         \
  X(step_start) X(steps) X(steps_max) X(sync_due) X(sync_ns) X(sync_share) X(syncs) X(triggers) X(work)
#define WORK_SLOTS(X)                                                                   \
  X(counted_samples) X(counted_tokens) X(inputs) X(on_batches) X(samples_per_step) X(seen_batches) \
  X(seen_samples) X(seen_tokens) X(tokens_per_step) X(unclear_samples) X(unclear_tokens)
#define BLOCKED_SLOTS(X) X(first_ns) X(ns)
#define TRIGGER_SLOTS(X) X(learned) X(native) X(native_calls) X(output_hooks)
// CudaPhaseClock's own (agent/cuda_timing.py), for its quiet step's end
#define CUDA_SLOTS(X)                                                                    \
  X(_due) X(capture_skips) X(chain_broken) X(event_factory) X(events_created) X(free)        \
  X(marks) X(max_events) X(max_pending) X(pending) X(resolve_every) X(stream_of) X(timeline)
// cuda_timing.StreamOf's, the model's device's stream
#define STREAM_SLOTS(X) X(capturing) X(current) X(last)
// nccl_trace.StepTimeline's, the step ends Flight Recorder's entries are placed by
#define TIMELINE_SLOTS(X) X(due) X(dump_every) X(ends)

#define DECLARE(name) Py_ssize_t name = -1;
struct ClockSlots { CLOCK_SLOTS(DECLARE) };
struct WorkSlots { WORK_SLOTS(DECLARE) };
struct BlockedSlots { BLOCKED_SLOTS(DECLARE) };
struct TriggerSlots { TRIGGER_SLOTS(DECLARE) };
struct CudaSlots { CUDA_SLOTS(DECLARE) };
struct StreamSlots { STREAM_SLOTS(DECLARE) };
struct TimelineSlots { TIMELINE_SLOTS(DECLARE) };
#undef DECLARE

// The offset of writable slot `name` of `type`; -1 with an exception set if it is not one.
Py_ssize_t slot_offset(PyTypeObject* type, const char* name) {
  PyObject* descr = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), name);
  if (descr == nullptr) {
    return -1;
  }
  Py_ssize_t offset = -1;
  if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
    PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
    if (member->type == T_OBJECT_EX && !(member->flags & READONLY)) {
      offset = member->offset;
    }
  }
  Py_DECREF(descr);
  if (offset < 0) {
    PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
  }
  return offset;
}

// A type's slot offsets, resolved once per type seen (the clock's, its work's, ...).
template <typename Slots>
struct Resolved {
  PyTypeObject* type = nullptr;  // borrowed: held by an object of it while in use
  Slots at;
  bool ok = false;
};

#define RESOLVE(name)                                        \
  if ((out.name = slot_offset(type, #name)) < 0) {           \
    return false;                                            \
  }
bool resolve(PyTypeObject* type, ClockSlots& out) { CLOCK_SLOTS(RESOLVE) return true; }
bool resolve(PyTypeObject* type, WorkSlots& out) { WORK_SLOTS(RESOLVE) return true; }
bool resolve(PyTypeObject* type, BlockedSlots& out) { BLOCKED_SLOTS(RESOLVE) return true; }
bool resolve(PyTypeObject* type, TriggerSlots& out) { TRIGGER_SLOTS(RESOLVE) return true; }
bool resolve(PyTypeObject* type, CudaSlots& out) { CUDA_SLOTS(RESOLVE) return true; }
bool resolve(PyTypeObject* type, StreamSlots& out) { STREAM_SLOTS(RESOLVE) return true; }
bool resolve(PyTypeObject* type, TimelineSlots& out) { TIMELINE_SLOTS(RESOLVE) return true; }
#undef RESOLVE

// The slots of `obj`'s type, resolving them if it is another type than last time; false (no
// exception) where they are not slots: the caller takes the Python path.
template <typename Slots>
bool slots_of(PyObject* obj, Resolved<Slots>& cache) {
  PyTypeObject* type = Py_TYPE(obj);
  if (type != cache.type) {
    cache.type = type;
    cache.ok = resolve(type, cache.at);
    if (!cache.ok) {
      PyErr_Clear();
    }
  }
  return cache.ok;
}

inline PyObject* get(PyObject* obj, Py_ssize_t offset) {  // borrowed; nullptr: unset
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
}

inline void put(PyObject* obj, Py_ssize_t offset, PyObject* value) {  // steals `value`
  PyObject** at = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
  PyObject* old = *at;
  *at = value;
  Py_XDECREF(old);
}

// An exact int that fits in 64 bits.
inline bool int_of(PyObject* value, int64_t& out) {
  if (value == nullptr || !PyLong_CheckExact(value)) {
    return false;
  }
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(value, &overflow);
  return overflow == 0 && !(out == -1 && PyErr_Occurred());
}

inline bool is_bool(PyObject* value) { return value == Py_True || value == Py_False; }

// Writes that allocate: a failure leaves the error set and the rest of the hook undone.
inline bool put_int(PyObject* obj, Py_ssize_t offset, int64_t value) {
  PyObject* v = PyLong_FromLongLong(value);
  if (v == nullptr) {
    return false;
  }
  put(obj, offset, v);
  return true;
}

inline void put_bool(PyObject* obj, Py_ssize_t offset, bool value) {
  PyObject* v = value ? Py_True : Py_False;
  Py_INCREF(v);
  put(obj, offset, v);
}

// acc[i] += ns, acc an exact list of exact ints (checked by the caller).
inline bool add_to(PyObject* acc, Py_ssize_t i, int64_t ns) {
  int64_t was = 0;
  if (!int_of(PyList_GET_ITEM(acc, i), was)) {
    return false;
  }
  PyObject* v = PyLong_FromLongLong(was + ns);
  if (v == nullptr) {
    return false;
  }
  PyObject* old = PyList_GET_ITEM(acc, i);
  PyList_SET_ITEM(acc, i, v);
  Py_DECREF(old);
  return true;
}

bool int_list(PyObject* acc, Py_ssize_t n) {
  if (acc == nullptr || !PyList_CheckExact(acc) || PyList_GET_SIZE(acc) != n) {
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_CheckExact(PyList_GET_ITEM(acc, i))) {
      return false;
    }
  }
  return true;
}

PyObject* s_append;  // interned method and attribute names
PyObject* s_value;
PyObject* s_clocks;
PyObject* s_sync;  // "require_backward_grad_sync"
PyObject* s_on_error;
PyObject* s_backward_returned;
PyObject* s_backward_exit;
PyObject* s_forward_pre_hooks;
PyObject* s_forward_hooks;
PyObject* s_shape;
PyObject* s_dtype;
PyObject* s_take_blocked;
PyObject* s_hook_output;
PyObject* s_set;
PyObject* s_pop;
PyObject* s_record;
PyObject* s_abandon_step;
PyObject* s_clear;
PyObject* s_started;
PyObject* s_handles;
PyObject* s_id;
PyObject* s_reversed;

struct Hook {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* dict;  // functools.wraps' attributes
  int kind;
  PyObject* clock;        // the clock, but kBackward's: nullptr
  PyObject* fallback;     // the Python hook it stands for, called for all but the common case
  PyObject* registered;   // kBackward: the phase_hooks.Clocks told
  PyObject* original;     // kBackward: torch.autograd.backward; kForward: the model's forward
  PyObject* clock_class;  // kBackward: the class whose clocks it times (phases.PhaseClock)
  PyObject* call_traced;  // kForward: phase_hooks._call_traced, which calls `original`
  PyObject* module;       // kForward: the module whose hooks send a call to Python, or None
  PyObject* global_post;  // kForward, kFwdPre: torch's global forward hooks (a dict), or None
  PyObject* pair;         // kForward, kFwdPre, kFwdPost: the module's ForwardHooks, or None
  int count;              // kForward: read the batch from the inputs (StepWork.inputs)
  PyObject* sync_kind;    // wire.DDP_GRAD_SYNC
  PyObject* end_step;     // kPost: the clock's end_step, called where not done here
  PyObject* quiet_end;    // kPost: the clock's _quiet_end, called where not done here
  int end_mode;           // kPost: kOwnEnd, kInlineEnd or kCudaQuietEnd (below)
  PyObject* callback;     // kGrad: callback A (a kDone hook, or the clock's _backward_done)
  // Positions and values phases.py declares: accumulator indices, boundaries, UNKNOWN_WORK.
  Py_ssize_t i_data, i_forward, i_backward, i_optimizer, i_comm, n_phases;
  int64_t fwd_pre, fwd_post, opt_pre, comm_end, step_end, bwd_end, bwd_start, unknown_work;
  int64_t look_every;  // step_work.LOOK_EVERY
  PyObject* cuda_mark;    // CudaPhaseClock._mark (the function), done in C where `mark` is it
  PyObject* stream_of_class;  // cuda_timing.StreamOf, whose call is done in C
  PyObject* timeline_class;   // nccl_trace.StepTimeline, whose mark is done in C
  PyObject* free_of;          // a CudaPhaseClock's free events (a deque) last seen, and
  PyObject* free_pop;         // its bound `pop`: looked up once, not at every mark
  Resolved<ClockSlots> clock_slots;
  Resolved<WorkSlots> work_slots;
  Resolved<BlockedSlots> blocked_slots;
  Resolved<TriggerSlots> trigger_slots;
  Resolved<CudaSlots> cuda_slots;
  Resolved<StreamSlots> stream_slots;
  Resolved<TimelineSlots> timeline_slots;
  PyTypeObject* kept_type;  // kBackward: the last clock type keeps_backward looked at
  bool kept;                // and whether it keeps PhaseClock's backward methods
};

// The error set now, handed to the clock's on_error (as the Python hooks' `except` does); never
// raises.
void note_error(PyObject* clock) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (value != nullptr && tb != nullptr) {
    PyException_SetTraceback(value, tb);
  }
  PyObject* result = nullptr;
  if (clock != nullptr && value != nullptr) {
    result = PyObject_CallMethodOneArg(clock, s_on_error, value);
  }
  Py_XDECREF(result);
  PyErr_Clear();  // on_error's own error: nothing may reach the training loop
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
}

// note_error, then what the hook returns: None.
PyObject* report(PyObject* clock) {
  note_error(clock);
  Py_RETURN_NONE;
}

// A new tuple of `items` (new references, each taken over): Py_BuildValue's without parsing a
// format at every call (~400 instructions a tuple, bench/bench_instructions.py). nullptr with
// an error set, every item released, where an item is nullptr or the tuple cannot be had.
PyObject* tuple_of(std::initializer_list<PyObject*> items) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(items.size()));
  bool ok = tuple != nullptr;
  Py_ssize_t i = 0;
  for (PyObject* item : items) {
    ok = ok && item != nullptr;
    if (ok) {
      PyTuple_SET_ITEM(tuple, i++, item);
    } else {
      Py_XDECREF(item);
    }
  }
  if (!ok) {
    Py_XDECREF(tuple);  // its items not set are NULL, which its deallocation skips
    return nullptr;
  }
  return tuple;
}

// A CudaPhaseClock's state changed by a step its events cannot time: its _abandon_step (the
// step's events back to the free list, no more marks this step); its own errors are dropped.
void abandon_step(PyObject* c) {
  PyObject* done = PyObject_CallMethodNoArgs(c, s_abandon_step);
  Py_XDECREF(done);
  PyErr_Clear();
}

// obj.<name>(), the callable in slot `offset`: a new reference, or nullptr with an error set.
PyObject* call_slot(PyObject* obj, Py_ssize_t offset, const char* name) {
  PyObject* fn = get(obj, offset);
  if (fn == nullptr) {
    PyErr_SetString(PyExc_AttributeError, name);
    return nullptr;
  }
  Py_INCREF(fn);  // held: the call may replace the slot
  PyObject* out = PyObject_CallNoArgs(fn);
  Py_DECREF(fn);
  return out;
}

// A CUDA clock's stream_of(fresh): a StreamOf's call done on its slots (whether the stream is
// capturing, then its stream, looked up when `fresh`), any other callable called. A new
// reference (None: capturing), or nullptr with an error set.
PyObject* stream_now(Hook* h, PyObject* stream_of, bool fresh) {
  if (Py_TYPE(stream_of) != reinterpret_cast<PyTypeObject*>(h->stream_of_class) ||
      !slots_of(stream_of, h->stream_slots)) {
    return PyObject_CallOneArg(stream_of, fresh ? Py_True : Py_False);
  }
  const StreamSlots& k = h->stream_slots.at;
  PyObject* answer = call_slot(stream_of, k.capturing, "capturing");
  const int truth = answer == nullptr ? -1 : PyObject_IsTrue(answer);
  Py_XDECREF(answer);
  if (truth != 0) {
    return truth < 0 ? nullptr : Py_NewRef(Py_None);
  }
  PyObject* last = get(stream_of, k.last);
  if (!fresh && last == nullptr) {
    PyErr_SetString(PyExc_AttributeError, "last");
    return nullptr;
  }
  if (!fresh && last != Py_None) {
    Py_INCREF(last);
    return last;
  }
  PyObject* stream = call_slot(stream_of, k.current, "current");
  if (stream != nullptr) {
    Py_INCREF(stream);
    put(stream_of, k.last, stream);
  }
  return stream;
}

// CudaPhaseClock._mark in C: an event from the free list (or a new one, up to max_events)
// recorded on stream_of's stream (None: the current one) and appended to the step's marks with
// `kind`. False, nothing done, where a slot is of an unexpected type: the method's to do.
bool cuda_mark(Hook* h, PyObject* c, int64_t kind) {
  const ClockSlots& s = h->clock_slots.at;
  const CudaSlots& k = h->cuda_slots.at;
  PyObject* marks = get(c, k.marks);
  PyObject* quiet = get(c, s.quiet);
  PyObject* stream_of = get(c, k.stream_of);
  if (!(marks != nullptr && (marks == Py_None || PyList_CheckExact(marks)) && is_bool(quiet) &&
        stream_of != nullptr && get(c, k.free) != nullptr && get(c, k.event_factory) != nullptr)) {
    return false;
  }
  if (marks == Py_None || (quiet == Py_True && kind != h->step_end)) {
    return true;
  }
  Py_INCREF(marks);  // held: the calls below may replace the slot; the event goes to this list
  PyObject *stream = nullptr, *event = nullptr, *recorded = nullptr, *entry = nullptr;
  bool ok = true;
  if (stream_of != Py_None) {
    // looked up at a timed step's first mark; a quiet step reuses it
    const bool fresh = PyList_GET_SIZE(marks) == 0 && quiet == Py_False;
    Py_INCREF(stream_of);  // held: the calls may replace the clock's slot
    stream = stream_now(h, stream_of, fresh);
    Py_DECREF(stream_of);
    ok = stream != nullptr;
    if (ok && stream == Py_None) {  // capturing: leave the graph alone, time this step on CPU
      int64_t skips = 0;
      if (!int_of(get(c, k.capture_skips), skips) || !put_int(c, k.capture_skips, skips + 1)) {
        PyErr_Clear();
      }
      abandon_step(c);
      Py_DECREF(stream);
      Py_DECREF(marks);
      return true;
    }
  }
  if (ok) {
    PyObject* free = get(c, k.free);
    if (free != h->free_of) {  // (the clock's deque for as long as it lives)
      PyObject* pop = PyObject_GetAttr(free, s_pop);
      if (pop == nullptr) {
        Py_XDECREF(stream);
        Py_DECREF(marks);
        PyErr_Clear();
        return false;
      }
      Py_INCREF(free);
      Py_XSETREF(h->free_of, free);
      Py_XSETREF(h->free_pop, pop);
    }
    PyObject* pop = Py_NewRef(h->free_pop);  // held: the call may run Python
    event = PyObject_CallNoArgs(pop);
    Py_DECREF(pop);
    if (event == nullptr && PyErr_ExceptionMatches(PyExc_IndexError)) {
      PyErr_Clear();
      int64_t created = 0, max_events = 0;
      if (!int_of(get(c, k.events_created), created) ||
          !int_of(get(c, k.max_events), max_events)) {
        if (!PyErr_Occurred()) {
          PyErr_SetString(PyExc_TypeError, "events_created and max_events must be ints");
        }
        ok = false;
      } else if (created >= max_events) {
        abandon_step(c);
        Py_XDECREF(stream);
        Py_DECREF(marks);
        return true;
      } else {
        PyObject* factory = get(c, k.event_factory);
        Py_INCREF(factory);
        event = PyObject_CallNoArgs(factory);
        Py_DECREF(factory);
        ok = event != nullptr && put_int(c, k.events_created, created + 1);
      }
    } else {
      ok = event != nullptr;
    }
  }
  if (ok) {
    recorded = stream == nullptr ? PyObject_CallMethodNoArgs(event, s_record)
                                 : PyObject_CallMethodOneArg(event, s_record, stream);
    ok = recorded != nullptr &&
        (entry = tuple_of({PyLong_FromLongLong(kind), Py_NewRef(event)})) != nullptr &&
        PyList_Append(marks, entry) == 0;
  }
  Py_XDECREF(stream);
  Py_XDECREF(event);
  Py_XDECREF(recorded);
  Py_XDECREF(entry);
  Py_DECREF(marks);
  if (!ok) {  // as _mark's `except`: the step's events back, the error to on_error
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    abandon_step(c);
    PyErr_Restore(type, value, tb);
    note_error(c);
  }
  return true;
}

// The clock's `mark` (a subclass's: CudaPhaseClock records a CUDA event) told of boundary
// `kind`, as the Python hooks do where `mark` is not None; its errors go to on_error. A
// CudaPhaseClock's own _mark is done in C (cuda_mark).
void mark_at(Hook* h, PyObject* c, int64_t kind) {
  PyObject* mark = get(c, h->clock_slots.at.mark);
  if (mark == nullptr || mark == Py_None) {
    return;
  }
  Py_INCREF(mark);  // held: the call may replace the slot
  if (h->cuda_mark != nullptr && PyMethod_Check(mark) && PyMethod_GET_SELF(mark) == c &&
      PyMethod_GET_FUNCTION(mark) == h->cuda_mark && slots_of(c, h->cuda_slots) &&
      cuda_mark(h, c, kind)) {
    Py_DECREF(mark);
    return;
  }
  PyObject* k = PyLong_FromLongLong(kind);
  PyObject* done = k == nullptr ? nullptr : PyObject_CallOneArg(mark, k);
  Py_XDECREF(k);
  Py_DECREF(mark);
  if (done == nullptr) {
    note_error(c);
  }
  Py_XDECREF(done);
}

// Blocked's state: whether no wait came since the clock last looked (blocked.ns ==
// blocked_seen), and its first_ns; false where `blocked` is not a Blocked of slots.
bool blocked_still(Hook* h, PyObject* c, PyObject* blocked, int64_t& first_ns) {
  first_ns = -1;
  if (blocked == Py_None) {
    return true;
  }
  if (!slots_of(blocked, h->blocked_slots)) {
    return false;
  }
  const BlockedSlots& b = h->blocked_slots.at;
  int64_t ns = 0, seen = 0;
  return int_of(get(blocked, b.ns), ns) && int_of(get(c, h->clock_slots.at.blocked_seen), seen) &&
      ns == seen && int_of(get(blocked, b.first_ns), first_ns);
}

// -- optimizer step pre-hook (PhaseClock.optimizer_pre) -----------------------------------------
PyObject* optimizer_pre(Hook* h, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* c = h->clock;
  const ClockSlots& s = h->clock_slots.at;
  PyObject* quiet = get(c, s.quiet);
  if (quiet == Py_True) {
    Py_RETURN_NONE;
  }
  if (quiet != Py_False || get(c, s.detect_start) != Py_None || get(c, s.mark) == nullptr) {
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  }
  if (!put_int(c, s.opt_start, now_ns())) {
    return report(c);
  }
  mark_at(h, c, h->opt_pre);
  Py_RETURN_NONE;
}

// -- optimizer step post-hook (PhaseClock.optimizer_post, end_step, _queue_row, _next_step,
// _quiet_end, StepWork.take): a step after the first, timed or quiet --------------------------

// A step's work as StepWork holds it, read before anything changes.
struct WorkSeen {
  int64_t counted_samples, counted_tokens, samples_per_step, tokens_per_step, seen, samples,
      tokens;
  PyObject* unclear_samples;
  PyObject* unclear_tokens;
};

bool read_work(Hook* h, PyObject* work, WorkSeen& v) {
  if (work == nullptr || !slots_of(work, h->work_slots)) {
    return false;
  }
  const WorkSlots& w = h->work_slots.at;
  v.unclear_samples = get(work, w.unclear_samples);
  v.unclear_tokens = get(work, w.unclear_tokens);
  return int_of(get(work, w.counted_samples), v.counted_samples) &&
      int_of(get(work, w.counted_tokens), v.counted_tokens) &&
      int_of(get(work, w.samples_per_step), v.samples_per_step) &&
      int_of(get(work, w.tokens_per_step), v.tokens_per_step) &&
      int_of(get(work, w.seen_batches), v.seen) && int_of(get(work, w.seen_samples), v.samples) &&
      int_of(get(work, w.seen_tokens), v.tokens) && is_bool(v.unclear_samples) &&
      is_bool(v.unclear_tokens);
}

// StepWork.take: the step's (samples, tokens), the counts reset. False with an error set.
bool take_work(Hook* h, PyObject* work, const WorkSeen& v, int64_t& samples, int64_t& tokens) {
  const WorkSlots& w = h->work_slots.at;
  samples = v.counted_samples;
  tokens = v.counted_tokens;
  if (samples < 0) {
    samples = v.samples_per_step;
    if (samples < 0 && v.seen && v.unclear_samples == Py_False) {
      samples = v.samples;
    }
  } else if (!put_int(work, w.counted_samples, h->unknown_work)) {
    return false;
  }
  if (tokens < 0) {
    tokens = v.tokens_per_step;
    if (tokens < 0 && v.seen && v.unclear_tokens == Py_False) {
      tokens = v.tokens;
    }
  } else if (!put_int(work, w.counted_tokens, h->unknown_work)) {
    return false;
  }
  if (v.seen || v.unclear_samples == Py_True) {
    if (!put_int(work, w.seen_batches, 0) || !put_int(work, w.seen_samples, 0) ||
        !put_int(work, w.seen_tokens, 0)) {
      return false;
    }
    put_bool(work, w.unclear_samples, false);
    put_bool(work, w.unclear_tokens, false);
  }
  return true;
}

// (step, end, total, *middle, samples, tokens): `middle` the phases (a timed step's
// accumulator), (shares, sync_share) (a quiet step's, phases.QUIET_ROW) or n zeros (a CUDA
// clock's quiet step, cuda_timing.NO_PHASES). A new reference, or nullptr with an error set.
PyObject* make_row(int64_t step, int64_t t, int64_t total, PyObject* const* middle, Py_ssize_t n,
                   int64_t samples, int64_t tokens) {
  PyObject* row = PyTuple_New(5 + n);
  if (row == nullptr) {
    return nullptr;
  }
  PyTuple_SET_ITEM(row, 0, PyLong_FromLongLong(step));
  PyTuple_SET_ITEM(row, 1, PyLong_FromLongLong(t));
  PyTuple_SET_ITEM(row, 2, PyLong_FromLongLong(total));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = middle != nullptr ? middle[i] : PyLong_FromLong(0);  // a cached small int
    if (middle != nullptr) {
      Py_INCREF(v);
    }
    PyTuple_SET_ITEM(row, 3 + i, v);
  }
  PyTuple_SET_ITEM(row, 3 + n, PyLong_FromLongLong(samples));
  PyTuple_SET_ITEM(row, 4 + n, PyLong_FromLongLong(tokens));
  for (Py_ssize_t i = 0; i < 5 + n; ++i) {
    if (PyTuple_GET_ITEM(row, i) == nullptr) {
      Py_DECREF(row);
      return nullptr;
    }
  }
  return row;
}

// `queue.append(item)`; false with an error set.
bool append_to(PyObject* queue, PyObject* item) {
  PyObject* appended = PyObject_CallMethodOneArg(queue, s_append, item);
  Py_XDECREF(appended);
  return appended != nullptr;
}

// steps.append(make_row(...)).
bool queue_row(PyObject* steps, int64_t step, int64_t t, int64_t total, PyObject* const* middle,
               Py_ssize_t n, int64_t samples, int64_t tokens) {
  PyObject* row = make_row(step, t, total, middle, n, samples, tokens);
  if (row == nullptr) {
    return false;
  }
  const bool ok = append_to(steps, row);
  Py_DECREF(row);
  return ok;
}

// The next step's number, in the clock and the C++ kernel's counter.
bool put_step(Hook* h, PyObject* c, int64_t step) {
  const ClockSlots& s = h->clock_slots.at;
  if (!put_int(c, s.step, step)) {
    return false;
  }
  PyObject* counter = get(c, s.step_counter);
  if (counter == nullptr || counter == Py_None) {
    return true;
  }
  PyObject* n = PyLong_FromLongLong(step);
  const bool ok = n != nullptr && PyObject_SetAttr(counter, s_value, n) == 0;
  Py_XDECREF(n);
  return ok;
}

// A new step, timed: no wait of it seen yet (_forget_first_wait).
bool forget_first_wait(Hook* h, PyObject* c, PyObject* blocked) {
  const ClockSlots& s = h->clock_slots.at;
  return put_int(c, s.first_ddp_ns, -1) && put_int(c, s.first_at, -1) &&
      (blocked == Py_None || put_int(blocked, h->blocked_slots.at.first_ns, -1));
}

// The transport's step hook, at the steps it asked for (optimizer_post's end).
PyObject* after_step(Hook* h, PyObject* c, int64_t t, int64_t step) {
  const ClockSlots& s = h->clock_slots.at;
  PyObject* after = get(c, s.after_step);
  if (after == nullptr || after == Py_None) {
    Py_RETURN_NONE;
  }
  int64_t after_at = 0, after_every = 1;
  if (!int_of(get(c, s.after_at), after_at) || !int_of(get(c, s.after_every), after_every) ||
      after_every <= 0) {
    PyErr_SetString(PyExc_TypeError, "after_at and after_every must be ints, after_every > 0");
    return report(c);
  }
  if (t < after_at || step % after_every != 0) {
    Py_RETURN_NONE;
  }
  PyObject* n = PyLong_FromLongLong(step);
  PyObject* next = n == nullptr ? nullptr : PyObject_CallOneArg(after, n);
  Py_XDECREF(n);
  const int truth = next == nullptr ? -1 : PyObject_IsTrue(next);
  if (truth < 0) {
    Py_XDECREF(next);
    return report(c);
  }
  if (truth) {
    put(c, s.after_at, next);  // `after(step) or 0`
  } else {
    Py_DECREF(next);
    if (!put_int(c, s.after_at, 0)) {
      return report(c);
    }
  }
  Py_RETURN_NONE;
}

// The optimizer's phase ends at `t`: from `opt_start` (0: it never started) into `acc`, checked
// an int list by the caller. False with an error set.
bool optimizer_ends(Hook* h, PyObject* c, PyObject* acc, int64_t opt_start, int64_t t) {
  if (!opt_start) {
    return true;
  }
  const int64_t ns = t - opt_start;
  return (ns <= 0 || add_to(acc, h->i_optimizer, ns)) && put_int(c, h->clock_slots.at.opt_start, 0);
}

// -- a CudaPhaseClock's quiet step end (CudaPhaseClock.end_step's quiet branch, _next_step) ------

// What a CUDA clock's quiet step end reads (borrowed), checked.
struct CudaQuiet {
  int64_t step, every, resolve_every;
  PyObject* shares;
  PyObject* sync_share;
  PyObject* work;
  WorkSeen work_seen;
};

// False (no error set) where it is not the common case: the resolver's queue full, a timeline
// that is not a StepTimeline, a slot of an unexpected type.
bool cuda_quiet(Hook* h, PyObject* c, CudaQuiet& v) {
  if (!slots_of(c, h->cuda_slots)) {
    return false;
  }
  const ClockSlots& s = h->clock_slots.at;
  const CudaSlots& k = h->cuda_slots.at;
  int64_t max_pending = 0;
  PyObject* marks = get(c, k.marks);
  PyObject* pending = get(c, k.pending);
  v.shares = get(c, s.shares);
  v.sync_share = get(c, s.sync_share);
  v.work = get(c, s.work);
  PyObject* timeline = get(c, k.timeline);
  int64_t dump_every = 0;
  bool ok = timeline != nullptr &&
      (timeline == Py_None ||
       (Py_TYPE(timeline) == reinterpret_cast<PyTypeObject*>(h->timeline_class) &&
        slots_of(timeline, h->timeline_slots) &&
        get(timeline, h->timeline_slots.at.ends) != nullptr &&
        get(timeline, h->timeline_slots.at.due) != nullptr &&
        int_of(get(timeline, h->timeline_slots.at.dump_every), dump_every) && dump_every >= 1)) &&
      get(c, k._due) != nullptr &&
      is_bool(get(c, k.chain_broken)) && marks != nullptr &&
      (marks == Py_None || PyList_CheckExact(marks)) && pending != nullptr &&
      int_of(get(c, k.max_pending), max_pending) &&
      int_of(get(c, k.resolve_every), v.resolve_every) && v.resolve_every >= 1 &&
      int_of(get(c, s.step), v.step) && v.step >= 0 && int_of(get(c, s.phase_every), v.every) &&
      get(c, s.pacer) != nullptr && v.shares != nullptr && v.sync_share != nullptr &&
      read_work(h, v.work, v.work_seen);
  if (ok) {
    const Py_ssize_t queued = PyObject_Length(pending);
    ok = queued >= 0 && queued < max_pending;
  }
  if (!ok) {
    PyErr_Clear();
  }
  return ok;
}

// Whether a step's marks end with its end's: `marks[-1][0] == STEP_END` (the step was timed on
// the GPU); `marks` a list or None.
bool ends_with_step_end(Hook* h, PyObject* marks) {
  if (marks == Py_None || PyList_GET_SIZE(marks) == 0) {
    return false;
  }
  PyObject* last = PyList_GET_ITEM(marks, PyList_GET_SIZE(marks) - 1);
  int64_t kind = 0;
  const bool ok = PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) > 0 &&
      int_of(PyTuple_GET_ITEM(last, 0), kind) && kind == h->step_end;
  PyErr_Clear();
  return ok;
}

// StepTimeline.mark(step), on a timeline cuda_quiet checked: the step's end on the wall clock
// appended, the reader woken at the steps it dumps after. False with an error set.
bool timeline_mark(Hook* h, PyObject* timeline, int64_t step) {
  const TimelineSlots& l = h->timeline_slots.at;
  int64_t dump_every = 0;
  PyObject* end = tuple_of({PyLong_FromLongLong(syncscope::wall_ns()), PyLong_FromLongLong(step)});
  if (end == nullptr || !append_to(get(timeline, l.ends), end)) {
    Py_XDECREF(end);
    return false;
  }
  Py_DECREF(end);
  if (!int_of(get(timeline, l.dump_every), dump_every) || dump_every < 1) {
    PyErr_SetString(PyExc_TypeError, "dump_every is not a positive int");
    return false;
  }
  if ((step + 1) % dump_every != 0) {
    return true;
  }
  PyObject* due = get(timeline, l.due);
  Py_INCREF(due);
  PyObject* set = PyObject_CallMethodNoArgs(due, s_set);
  Py_DECREF(due);
  Py_XDECREF(set);
  return set != nullptr;
}

// The clock's timeline, if any, marked at the end of `step`; false with an error set.
bool timeline_marked(Hook* h, PyObject* c, int64_t step) {
  PyObject* timeline = get(c, h->cuda_slots.at.timeline);
  if (timeline == Py_None) {
    return true;
  }
  Py_INCREF(timeline);  // held: the reader's wake-up may run Python
  const bool marked = timeline_mark(h, timeline, step);
  Py_DECREF(timeline);
  return marked;
}

// A CUDA clock's step end after its entry for the resolver (`ok`: appended, else an error is
// set): the chain goes on, the resolver is woken at every `resolve_every`-th step, then the
// transport's hook. What the optimizer's post-hook returns.
PyObject* queued(Hook* h, PyObject* c, bool ok, int64_t t, int64_t next, int64_t resolve_every) {
  if (!ok) {
    return report(c);
  }
  put_bool(c, h->cuda_slots.at.chain_broken, false);
  if (next % resolve_every == 0) {
    PyObject* due = get(c, h->cuda_slots.at._due);
    Py_INCREF(due);
    PyObject* set = PyObject_CallMethodNoArgs(due, s_set);
    Py_DECREF(due);
    if (set == nullptr) {
      return report(c);
    }
    Py_DECREF(set);
  }
  return after_step(h, c, t, next);
}

// CudaPhaseClock.end_step in a quiet step: its end's event (the clock's `mark`), then a row of
// its total and work with the last timed step's shares (the resolver estimates its phases from
// them), queued for the resolver, the next step (_next_step), the resolver woken at every
// resolve_every-th step. False, nothing changed, where cuda_quiet says it is not the common case;
// else true, `out` what the hook returns.
bool cuda_quiet_end(Hook* h, PyObject* c, int64_t t, int64_t step_start, PyObject** out) {
  CudaQuiet v{};
  if (!cuda_quiet(h, c, v)) {
    return false;
  }
  const ClockSlots& s = h->clock_slots.at;
  const CudaSlots& k = h->cuda_slots.at;
  mark_at(h, c, h->step_end);  // its own errors are on_error's, as in Python
  if (!cuda_quiet(h, c, v)) {  // the mark changed what it must not (or filled the queue)
    PyErr_SetString(PyExc_TypeError, "the CUDA clock's state changed in its step end's mark");
    *out = report(c);
    return true;
  }
  if (!timeline_marked(h, c, v.step)) {
    *out = report(c);
    return true;
  }
  PyObject* marks = get(c, k.marks);
  Py_INCREF(marks);  // held: a new list takes its slot below
  const bool timed = ends_with_step_end(h, marks);
  const int64_t next = v.step + 1;
  int64_t samples = 0, tokens = 0;
  PyObject *cpu = nullptr, *estimate = nullptr, *ddp = nullptr, *entry = nullptr, *fresh = nullptr;
  bool ok = take_work(h, v.work, v.work_seen, samples, tokens) &&
      (cpu = make_row(v.step, t, t - step_start, nullptr, h->n_phases, samples, tokens)) &&
      (estimate = PyTuple_Pack(2, v.shares, v.sync_share)) && put_step(h, c, next);
  if (ok) {  // _next_step
    put_bool(c, s.quiet,
             v.every > 1 && next % v.every != 0 && get(c, s.pacer) == Py_None &&
                 get(c, s.shares) != Py_None);
    ok = put_int(c, s.step_start, t) && put_int(c, s.idle_since, t) && (fresh = PyList_New(0));
  }
  if (ok) {
    put(c, k.marks, fresh);
    ok = (ddp = PyList_New(0)) &&
        (entry = PyTuple_Pack(5, cpu, timed ? marks : Py_None, ddp, get(c, k.chain_broken),
                              estimate)) &&
        append_to(get(c, k.pending), entry);
  }
  Py_XDECREF(cpu);
  Py_XDECREF(estimate);
  Py_XDECREF(ddp);
  Py_XDECREF(entry);
  Py_DECREF(marks);
  *out = queued(h, c, ok, t, next, v.resolve_every);
  return true;
}

// phase_shares(acc, total): a timed step's phases as shares of its total, pacing's (the
// accumulator's last: phases.py's ACC_LEN = PACING + 1) 0. A new list, or nullptr with an error.
PyObject* phase_shares(Hook* h, PyObject* acc, int64_t total) {
  PyObject* shares = PyList_New(h->n_phases);
  for (Py_ssize_t i = 0; shares != nullptr && i < h->n_phases; ++i) {
    int64_t ns = 0;
    int_of(PyList_GET_ITEM(acc, i), ns);  // (an int list, checked by the caller)
    const double share =
        total <= 0 || i == h->n_phases - 1 || ns <= 0 ? 0.0 : static_cast<double>(ns) / total;
    PyObject* v = PyFloat_FromDouble(share);
    if (v == nullptr) {
      Py_CLEAR(shares);
      break;
    }
    PyList_SET_ITEM(shares, i, v);
  }
  return shares;
}

// What phase sampling keeps of a timed step for its quiet steps' estimates (PhaseClock.end_step):
// its shares (phase_shares) and DDP's sync's share of its total (None: no sync). False with an
// error set.
bool keep_shares(Hook* h, PyObject* c, PyObject* acc, int64_t total, int64_t syncs,
                 int64_t sync_ns) {
  const ClockSlots& s = h->clock_slots.at;
  PyObject* shares = phase_shares(h, acc, total);
  if (shares == nullptr) {
    return false;
  }
  put(c, s.shares, shares);
  PyObject* sync_share = syncs && total > 0
      ? PyFloat_FromDouble(static_cast<double>(sync_ns) / static_cast<double>(total))
      : Py_NewRef(Py_None);
  if (sync_share == nullptr) {
    return false;
  }
  put(c, s.sync_share, sync_share);
  return true;
}

// A new accumulator, [0] * n_phases; nullptr with an error set.
PyObject* zeros(Hook* h) {
  PyObject* fresh = PyList_New(h->n_phases);
  for (Py_ssize_t i = 0; fresh != nullptr && i < h->n_phases; ++i) {
    PyList_SET_ITEM(fresh, i, PyLong_FromLong(0));  // a cached small int
  }
  return fresh;
}

// CudaPhaseClock.end_step in a timed step, its optimizer's phase ended by the caller: its end's
// event, the row of its phases (PhaseClock.end_step, the shares phase sampling keeps), queued
// with its events and DDP's sync records for the resolver, the next step. False, nothing changed,
// where it is not the common case (those of cuda_quiet, the first step, a pacer, a wait to move,
// a row already queued); else true, `out` what the hook returns.
bool cuda_timed_end(Hook* h, PyObject* c, int64_t t, int64_t step_start, PyObject** out) {
  const ClockSlots& s = h->clock_slots.at;
  const CudaSlots& k = h->cuda_slots.at;
  CudaQuiet v{};
  int64_t syncs = 0, sync_ns = 0, first_ns = 0, steps_max = 0;
  auto common = [&]() {
    PyObject* blocked = get(c, s.blocked);
    PyObject* steps = get(c, s.steps);
    const bool ok = cuda_quiet(h, c, v) && get(c, s.first_step) == Py_False &&
        get(c, s.pacer) == Py_None && blocked != nullptr &&
        blocked_still(h, c, blocked, first_ns) && int_of(get(c, s.syncs), syncs) &&
        int_of(get(c, s.sync_ns), sync_ns) && int_list(get(c, s.acc), h->n_phases) &&
        steps != nullptr && PyObject_Length(steps) == 0 && int_of(get(c, s.steps_max), steps_max) &&
        steps_max >= 1 && get(c, s.collectives) != nullptr;
    PyErr_Clear();
    return ok;
  };
  if (!common()) {
    return false;
  }
  mark_at(h, c, h->step_end);  // its own errors are on_error's, as in Python
  if (!common()) {  // the mark changed what it must not (or filled the queue)
    PyErr_SetString(PyExc_TypeError, "the CUDA clock's state changed in its step end's mark");
    *out = report(c);
    return true;
  }
  if (!timeline_marked(h, c, v.step)) {
    *out = report(c);
    return true;
  }
  const int64_t total = t - step_start;
  const int64_t next = v.step + 1;
  int64_t samples = 0, tokens = 0;
  PyObject* acc = get(c, s.acc);
  Py_INCREF(acc);  // held: a new accumulator takes its slot below
  PyObject* marks = get(c, k.marks);
  Py_INCREF(marks);  // held: a new list takes its slot below
  const bool timed = ends_with_step_end(h, marks);
  PyObject *cpu = nullptr, *ddp = nullptr, *cleared = nullptr, *entry = nullptr;
  PyObject *fresh = nullptr, *fresh_marks = nullptr;
  bool ok = true;
  if (v.every > 1) {
    ok = keep_shares(h, c, acc, total, syncs, sync_ns);
  }
  ok = ok && (!syncs || (put_int(c, s.sync_ns, 0) && put_int(c, s.syncs, 0))) &&
      take_work(h, v.work, v.work_seen, samples, tokens) &&
      (cpu = make_row(v.step, t, total, reinterpret_cast<PyListObject*>(acc)->ob_item,
                      h->n_phases, samples, tokens)) &&
      (ddp = PySequence_List(get(c, s.collectives))) &&
      (cleared = PyObject_CallMethodNoArgs(get(c, s.collectives), s_clear)) &&
      put_step(h, c, next);
  if (ok) {  // _next_step, a new accumulator, no wait of the next step seen yet
    put_bool(c, s.quiet,
             v.every > 1 && next % v.every != 0 && get(c, s.pacer) == Py_None &&
                 get(c, s.shares) != Py_None);
    ok = put_int(c, s.step_start, t) && put_int(c, s.idle_since, t) &&
        (fresh = zeros(h));
  }
  if (ok) {
    put(c, s.acc, fresh);
    ok = forget_first_wait(h, c, get(c, s.blocked)) && (fresh_marks = PyList_New(0));
  }
  if (ok) {
    put(c, k.marks, fresh_marks);
    ok = (entry = PyTuple_Pack(5, cpu, timed ? marks : Py_None, ddp, get(c, k.chain_broken),
                               Py_None)) &&
        append_to(get(c, k.pending), entry);
  }
  Py_XDECREF(cpu);
  Py_XDECREF(ddp);
  Py_XDECREF(cleared);
  Py_XDECREF(entry);
  Py_DECREF(marks);
  Py_DECREF(acc);
  *out = queued(h, c, ok, t, next, v.resolve_every);
  return true;
}

// A step end not done here: a subclass's (CudaPhaseClock's: its events, its resolver's queue),
// or a PhaseClock's that is not the common one (a pacer, the first step, a full queue). The
// optimizer's phase here, then the clock's own end_step, or its _quiet_end in a quiet step, then
// the transport's hook, as PhaseClock.optimizer_post does.
PyObject* own_end(Hook* h, int64_t t, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* c = h->clock;
  const ClockSlots& s = h->clock_slots.at;
  int64_t step_start = 0, opt_start = 0, first_ns, step;
  PyObject* quiet = get(c, s.quiet);
  PyObject* acc = get(c, s.acc);
  PyObject* blocked = get(c, s.blocked);
  bool common = get(c, s.manual_steps) == Py_False && int_of(get(c, s.step_start), step_start);
  if (common && quiet == Py_False) {
    common = int_of(get(c, s.opt_start), opt_start) && int_list(acc, h->n_phases) &&
        blocked != nullptr && blocked_still(h, c, blocked, first_ns);
  } else if (quiet != Py_True) {
    common = false;
  }
  if (!common) {
    PyErr_Clear();
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  }
  PyObject* done;
  if (quiet == Py_True) {
    if (h->end_mode == kCudaQuietEnd && cuda_quiet_end(h, c, t, step_start, &done)) {
      return done;
    }
    done = PyObject_CallFunction(h->quiet_end, "LL", static_cast<long long>(t),
                                 static_cast<long long>(t - step_start));
  } else {
    if (!optimizer_ends(h, c, acc, opt_start, t)) {
      return report(c);
    }
    if (h->end_mode == kCudaQuietEnd && cuda_timed_end(h, c, t, step_start, &done)) {
      return done;
    }
    done = PyObject_CallFunction(h->end_step, "L", static_cast<long long>(t));
  }
  if (done == nullptr) {
    return report(c);
  }
  Py_DECREF(done);
  if (!int_of(get(c, s.step), step)) {
    PyErr_SetString(PyExc_TypeError, "step is not an int");
    return report(c);
  }
  return after_step(h, c, t, step);
}

PyObject* optimizer_post(Hook* h, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const int64_t t = now_ns();
  if (h->end_mode != kInlineEnd) {
    return own_end(h, t, args, nargsf, kwnames);
  }
  PyObject* c = h->clock;
  const ClockSlots& s = h->clock_slots.at;
  int64_t opt_start = 0, step_start, step, syncs = 0, sync_ns = 0, every, steps_max, first_ns;
  PyObject* quiet = get(c, s.quiet);
  PyObject* acc = get(c, s.acc);
  PyObject* steps = get(c, s.steps);
  PyObject* work = get(c, s.work);
  PyObject* blocked = get(c, s.blocked);
  WorkSeen seen{};
  bool common = get(c, s.manual_steps) == Py_False && get(c, s.mark) == Py_None &&
      get(c, s.pacer) == Py_None && get(c, s.first_step) == Py_False &&
      int_of(get(c, s.phase_every), every) && every >= 1 &&
      int_of(get(c, s.step_start), step_start) && int_of(get(c, s.step), step) &&
      int_of(get(c, s.steps_max), steps_max) && steps != nullptr && blocked != nullptr &&
      read_work(h, work, seen);
  if (common && quiet == Py_False) {  // timed
    common = int_of(get(c, s.opt_start), opt_start) && int_of(get(c, s.syncs), syncs) &&
        int_of(get(c, s.sync_ns), sync_ns) && int_list(acc, h->n_phases) &&
        blocked_still(h, c, blocked, first_ns);
  } else if (common && quiet == Py_True) {  // quiet: only the row and the step's count
    common = blocked == Py_None ||
        (slots_of(blocked, h->blocked_slots) && get(blocked, h->blocked_slots.at.ns) != nullptr);
  } else {
    common = false;
  }
  if (common) {
    const Py_ssize_t queued = PyObject_Length(steps);
    common = queued >= 0 && queued < steps_max;
  }
  if (!common) {
    PyErr_Clear();
    return own_end(h, t, args, nargsf, kwnames);
  }
  const int64_t total = t - step_start;
  int64_t samples = 0, tokens = 0;
  if (quiet == Py_True) {  // _quiet_end: the last timed step's shares stand for its phases
    if (blocked != Py_None) {
      PyObject* waited = get(blocked, h->blocked_slots.at.ns);
      Py_INCREF(waited);
      put(c, s.blocked_seen, waited);  // its waits are not timed
    }
    PyObject* shares[] = {get(c, s.shares), get(c, s.sync_share)};
    if (shares[0] == nullptr || shares[1] == nullptr) {
      PyErr_SetString(PyExc_AttributeError, "shares");
      return report(c);
    }
    if (!take_work(h, work, seen, samples, tokens) ||
        !queue_row(steps, step, t, total, shares, 2, samples, tokens) || !put_step(h, c, ++step)) {
      return report(c);
    }
    if (step % every == 0) {  // the next step is timed
      put_bool(c, s.quiet, false);
      if (!forget_first_wait(h, c, blocked)) {
        return report(c);
      }
    }
    if (!put_int(c, s.step_start, t) || !put_int(c, s.idle_since, t)) {
      return report(c);
    }
    return after_step(h, c, t, step);
  }
  // The optimizer's phase, then the step's end.
  if (!optimizer_ends(h, c, acc, opt_start, t)) {
    return report(c);
  }
  if (every > 1 && !keep_shares(h, c, acc, total, syncs, sync_ns)) {
    return report(c);
  }
  if (syncs && (!put_int(c, s.sync_ns, 0) || !put_int(c, s.syncs, 0))) {
    return report(c);
  }
  if (!take_work(h, work, seen, samples, tokens) ||
      !queue_row(steps, step, t, total, reinterpret_cast<PyListObject*>(acc)->ob_item, h->n_phases,
                 samples, tokens) ||
      !put_step(h, c, ++step)) {
    return report(c);
  }
  if (every > 1) {  // _next_step: quiet until the next multiple (no pacer here)
    put_bool(c, s.quiet, step % every != 0 && get(c, s.shares) != Py_None);
  }
  // The next step (_next_step), a new accumulator, no wait of it seen yet.
  PyObject* fresh = zeros(h);
  if (fresh == nullptr) {
    return report(c);
  }
  put(c, s.acc, fresh);
  if (!put_int(c, s.step_start, t) || !put_int(c, s.idle_since, t) ||
      !forget_first_wait(h, c, blocked)) {
    return report(c);
  }
  return after_step(h, c, t, step);
}

// Whether DDP's sync is due: a DDP group to sync (ddp_group not None) and
// getattr(ddp_model, "require_backward_grad_sync", True). The lookup may run Python: callers
// read the slots they use after it. False (an error cleared) where it cannot be read.
bool sync_due(Hook* h, PyObject* c, bool& sync) {
  const ClockSlots& s = h->clock_slots.at;
  PyObject* model = get(c, s.ddp_model);
  PyObject* group = get(c, s.ddp_group);
  if (model == nullptr || group == nullptr) {
    PyErr_Clear();
    return false;
  }
  sync = group != Py_None;
  if (sync && model != Py_None) {
    Py_INCREF(model);
    PyObject* flag = PyObject_GetAttr(model, s_sync);
    Py_DECREF(model);
    if (flag == nullptr) {
      const bool missing = PyErr_ExceptionMatches(PyExc_AttributeError);
      PyErr_Clear();
      return missing;  // (getattr's default: True)
    }
    const int truth = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (truth < 0) {
      PyErr_Clear();
      return false;
    }
    sync = truth != 0;
  }
  return true;
}

// -- torch.autograd.backward (phase_hooks.timed_backward, BackwardPhases.backward_returned and
// _gradients_reduced): the one clock in the process, its trigger in C++ ------------------------

// What _gradients_reduced (B: DDP's finalize has waited for every bucket) reads, checked before
// anything changes: no wait to move into comm, no closure, its counts ints.
struct SyncSeen {
  int64_t first_ddp, first_ns, sync_ns, syncs, coll_max, step;
  Py_ssize_t queued;
  PyObject *coll, *bytes, *group;  // borrowed
};

bool sync_seen(Hook* h, PyObject* c, SyncSeen& v) {
  const ClockSlots& s = h->clock_slots.at;
  PyObject* blocked = get(c, s.blocked);
  v.coll = get(c, s.collectives);
  v.bytes = get(c, s.ddp_bytes);
  v.group = get(c, s.ddp_group);
  const bool ok = blocked != nullptr && blocked_still(h, c, blocked, v.first_ns) &&
      get(c, s.opt_closure) == Py_False && int_of(get(c, s.first_ddp_ns), v.first_ddp) &&
      int_of(get(c, s.sync_ns), v.sync_ns) && int_of(get(c, s.syncs), v.syncs) &&
      int_of(get(c, s.coll_max), v.coll_max) && int_of(get(c, s.step), v.step) &&
      v.coll != nullptr && v.bytes != nullptr && v.group != nullptr && v.group != Py_None &&
      (v.queued = PyObject_Length(v.coll)) >= 0;
  if (!ok) {
    PyErr_Clear();
  }
  return ok;
}

// _gradients_reduced's common case on what sync_seen read, the backward's autograd work done at
// `bwd_end`: DDP's exposed sync into comm and its record queued, the step idle from now. Its
// errors go to on_error.
void sync_reduced(Hook* h, PyObject* c, const SyncSeen& v, int64_t bwd_end) {
  const ClockSlots& s = h->clock_slots.at;
  const int64_t t = now_ns();
  const int64_t exposed = t - bwd_end;
  if (v.first_ddp < 0 && v.first_ns < 0 &&
      (!put_int(c, s.first_ddp_ns, exposed) || !put_int(c, s.first_at, h->comm_end))) {
    note_error(c);
    return;
  }
  if (!add_to(get(c, s.acc), h->i_comm, exposed)) {
    note_error(c);
    return;
  }
  put_bool(c, s.bwd_pending, false);
  if (!put_int(c, s.idle_since, t)) {
    note_error(c);
    return;
  }
  if (v.queued < v.coll_max) {
    PyObject* record =
        tuple_of({Py_NewRef(h->sync_kind), Py_NewRef(v.group), Py_NewRef(v.bytes),
                  PyLong_FromLongLong(exposed), PyLong_FromLongLong(v.step)});
    PyObject* appended =
        record == nullptr ? nullptr : PyObject_CallMethodOneArg(v.coll, s_append, record);
    Py_XDECREF(record);
    if (appended == nullptr) {
      note_error(c);
      return;
    }
    Py_DECREF(appended);
  } else {
    int64_t dropped = 0;
    if (!int_of(get(c, s.dropped), dropped) || !put_int(c, s.dropped, dropped + 1)) {
      PyErr_Clear();
    }
  }
  if (!put_int(c, s.sync_ns, v.sync_ns + exposed) || !put_int(c, s.syncs, v.syncs + 1)) {
    note_error(c);
    return;
  }
  mark_at(h, c, h->comm_end);
}

// The backward's return, the common case of backward_returned: the trigger's callback ran, no
// wait to move, DDP's sync due (or none to time); false, nothing changed, for the Python method.
bool returned(Hook* h, PyObject* c) {
  const ClockSlots& s = h->clock_slots.at;
  bool sync;
  if (!sync_due(h, c, sync)) {
    return false;
  }
  const int64_t done = syncscope_bwd_done.load(std::memory_order_relaxed);
  int64_t bwd_end, bwd_entry, first_ns;
  PyObject* acc = get(c, s.acc);
  PyObject* blocked = get(c, s.blocked);
  SyncSeen v{};
  if (!(int_of(get(c, s.bwd_end), bwd_end) && done != bwd_end &&
        int_of(get(c, s.bwd_entry), bwd_entry) && int_list(acc, h->n_phases) &&
        blocked != nullptr && blocked_still(h, c, blocked, first_ns) &&
        get(c, s.ddp_group) != nullptr && get(c, s.mark) == Py_None &&
        get(c, s.opt_closure) == Py_False && (!sync || sync_seen(h, c, v)))) {
    PyErr_Clear();
    return false;
  }
  // Changes from here; an allocation failing is reported, not handed to Python.
  if (!put_int(c, s.bwd_depth, 0)) {
    note_error(c);
    return true;
  }
  put_bool(c, s.fwd_since_bwd, false);
  const int64_t ns = done - bwd_entry;
  if ((ns > 0 && !add_to(acc, h->i_backward, ns)) || !put_int(c, s.bwd_entry, 0) ||
      !put_int(c, s.bwd_end, done)) {
    note_error(c);
    return true;
  }
  if (!sync) {
    if (!put_int(c, s.idle_since, done)) {
      note_error(c);
    }
    return true;
  }
  sync_reduced(h, c, v, done);  // DDP's finalize, queued after the trigger's callback, has waited
  return true;
}

// Whether the clock's GradTriggers are in native mode (`triggers.native is not None`) and its
// first watched gradient `calls` on_grad (`native_calls`) or not: then the backward's end comes
// from the C++ trigger's stamp.
bool native_mode(Hook* h, PyObject* triggers, bool calls) {
  if (!slots_of(triggers, h->trigger_slots)) {
    return false;
  }
  PyObject* native = get(triggers, h->trigger_slots.at.native);
  PyObject* native_calls = get(triggers, h->trigger_slots.at.native_calls);
  return native != nullptr && native != Py_None &&
      native_calls == (calls ? Py_True : Py_False);
}

bool in_native_mode(Hook* h, PyObject* triggers) { return native_mode(h, triggers, false); }

// Whether clock `c`'s C++ trigger calls its on_grad (native mode for a clock that marks).
bool calls_on_grad(Hook* h, PyObject* c) {
  PyObject* triggers = get(c, h->clock_slots.at.triggers);
  return triggers != nullptr && native_mode(h, triggers, true);
}

// The outermost backward's return where its trigger is Python's (the Python wrapper's branch
// for a backward a trigger started): its depth and entry back to 0 and, where callback A left
// DDP's sync due, _gradients_reduced. False, nothing changed, for backward_exit: a forward
// since the trigger (missed), a deferred A, a wait to move, a slot of an unexpected type.
bool reduced(Hook* h, PyObject* c) {
  const ClockSlots& s = h->clock_slots.at;
  PyObject* due = get(c, s.sync_due);
  int64_t bwd_end = 0;
  SyncSeen v{};
  if (!(get(c, s.fwd_since_bwd) == Py_False && get(c, s.bwd_deferred) == Py_False &&
        is_bool(due) &&
        (due == Py_False || (int_of(get(c, s.bwd_end), bwd_end) &&
                             int_list(get(c, s.acc), h->n_phases) && sync_seen(h, c, v))))) {
    PyErr_Clear();
    return false;
  }
  if (!put_int(c, s.bwd_depth, 0) || !put_int(c, s.bwd_entry, 0)) {
    note_error(c);
    return true;
  }
  if (due == Py_True) {
    put_bool(c, s.sync_due, false);
    sync_reduced(h, c, v, bwd_end);
  }
  return true;
}

// Whether `type` (a PhaseClock's) keeps PhaseClock's backward methods, whose common case the
// backward wrapper here does for a clock whose gradient trigger is Python's; looked up once per
// type.
bool keeps_backward(Hook* h, PyTypeObject* type) {
  if (type == h->kept_type) {
    return h->kept;
  }
  bool kept = true;
  for (const char* name : {"_gradients_reduced", "backward_exit", "_backward_done", "grad_ready"}) {
    PyObject* mine = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), name);
    PyObject* theirs = PyObject_GetAttrString(h->clock_class, name);
    kept = kept && mine != nullptr && mine == theirs;
    Py_XDECREF(mine);
    Py_XDECREF(theirs);
  }
  PyErr_Clear();
  h->kept_type = type;
  h->kept = kept;
  return kept;
}

// How `c` (the process's one clock) enters this backward: 1 the common way with its trigger in
// C++ (a PhaseClock itself, outermost, timed, no wait to move, no marks), 3 the common way with
// its trigger Python's or the C++ trigger calling it (a PhaseClock keeping its backward methods,
// a CudaPhaseClock's too: its marks in C), 2 outermost in a quiet step (only its depth counts;
// a subclass's too), 0 otherwise (the Python wrapper then).
int enters(Hook* h, PyObject* c) {
  PyTypeObject* type = Py_TYPE(c);
  const bool exact = reinterpret_cast<PyObject*>(type) == h->clock_class;
  if (!PyType_IsSubtype(type, reinterpret_cast<PyTypeObject*>(h->clock_class)) ||
      !slots_of(c, h->clock_slots)) {
    return 0;
  }
  const ClockSlots& s = h->clock_slots.at;
  int64_t depth, first_ns;
  PyObject* quiet = get(c, s.quiet);
  if (!int_of(get(c, s.bwd_depth), depth) || depth != 0) {
    PyErr_Clear();
    return 0;
  }
  if (quiet == Py_True) {
    return 2;
  }
  PyObject* triggers = get(c, s.triggers);
  PyObject* blocked = get(c, s.blocked);
  const bool common = quiet == Py_False && triggers != nullptr && blocked != nullptr &&
      blocked_still(h, c, blocked, first_ns) && slots_of(triggers, h->trigger_slots);
  PyErr_Clear();
  if (!common) {
    return 0;
  }
  if (in_native_mode(h, triggers)) {
    return exact && get(c, s.mark) == Py_None ? 1 : 0;
  }
  return keeps_backward(h, type) ? 3 : 0;
}

PyObject* call_method(PyObject* c, PyObject* name) {
  PyObject* result = PyObject_CallMethodNoArgs(c, name);
  if (result == nullptr) {
    return report(c);
  }
  return result;
}

PyObject* backward(Hook* h, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* clocks = PyObject_GetAttr(h->registered, s_clocks);
  if (clocks == nullptr) {
    PyErr_Clear();
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  }
  PyObject* c = PyTuple_CheckExact(clocks) && PyTuple_GET_SIZE(clocks) == 1
      ? PyTuple_GET_ITEM(clocks, 0)
      : nullptr;
  const int how = c == nullptr ? 0 : enters(h, c);
  if (how == 0) {
    Py_DECREF(clocks);
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  }
  Py_INCREF(c);
  Py_DECREF(clocks);
  const ClockSlots& s = h->clock_slots.at;
  bool calls = false;  // armed here for a trigger that calls on_grad: disarmed at the exit
  if (!put_int(c, s.bwd_depth, 1) || (how != 2 && !put_int(c, s.bwd_entry, now_ns()))) {
    note_error(c);
  } else if (how == 1) {
    syncscope_bwd_armed.store(1, std::memory_order_relaxed);
  } else if (how == 3) {
    mark_at(h, c, h->bwd_start);  // on the caller's stream, before any backward kernel
    calls = calls_on_grad(h, c);
    if (calls) {
      syncscope_bwd_armed.store(1, std::memory_order_relaxed);  // its gradient calls on_grad
    }
  }
  PyObject* result = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
  // As the Python wrapper's `finally`: the backward's own error passes through afterwards.
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  int64_t depth = 0;
  PyObject* triggers = get(c, s.triggers);
  PyObject* done = nullptr;
  if (calls) {  // armed no more, should no watched gradient have come (disarm)
    syncscope_bwd_armed.store(0, std::memory_order_relaxed);
  }
  if (!int_of(get(c, s.bwd_depth), depth)) {
    PyErr_Clear();
    done = call_method(c, s_backward_exit);
  } else if (get(c, s.quiet) == Py_True) {  // not timed after all: only the depth
    if (depth > 0 && !put_int(c, s.bwd_depth, depth - 1)) {
      note_error(c);
    }
  } else if (depth == 1 && triggers != nullptr && in_native_mode(h, triggers)) {
    if (!returned(h, c)) {
      done = call_method(c, s_backward_returned);
    }
  } else if (depth == 1 && keeps_backward(h, Py_TYPE(c)) && reduced(h, c)) {
    // (its Python trigger's backward, done: A ran, and B's work with it)
  } else {
    PyErr_Clear();
    done = call_method(c, s_backward_exit);  // what the Python wrapper's other branches do
  }
  Py_XDECREF(done);
  Py_DECREF(c);
  PyErr_Restore(type, value, tb);
  return result;
}

// -- a model's forward (phase_hooks.timed_forward): a quiet step, or a timed one of a module
// without forward hooks -------------------------------------------------------------------------

// Whether `module` (or torch's global forward hooks) has forward hooks: ForwardHooks times such a
// call, in Python. -1 with an error set where they cannot be read.
int has_hooks(Hook* h) {
  if (h->global_post != Py_None && PyDict_GET_SIZE(h->global_post) > 0) {
    return 1;
  }
  if (h->module == Py_None) {
    return 0;
  }
  PyObject* names[] = {s_forward_pre_hooks, s_forward_hooks};
  for (PyObject* name : names) {
    PyObject* hooks = PyObject_GetAttr(h->module, name);
    if (hooks == nullptr) {
      return -1;
    }
    const int truth = PyObject_IsTrue(hooks);
    Py_DECREF(hooks);
    if (truth != 0) {
      return truth;
    }
  }
  return 0;
}

// StepWork.take's inputs: the forward's batch (its first positional argument, else the keyword
// `inputs[2]`) counted into `work` (timed_forward's inline reading), `seen` the batches seen
// this step after it (0: not counted). False with an error set.
bool read_batch(Hook* h, PyObject* work, PyObject* const* args, Py_ssize_t nargs,
                PyObject* kwnames, int64_t& seen) {
  const WorkSlots& w = h->work_slots.at;
  PyObject* inputs = get(work, w.inputs);
  if (inputs == Py_None) {
    return true;
  }
  if (inputs == nullptr || !PyTuple_Check(inputs) || PyTuple_GET_SIZE(inputs) != 4) {
    // (not PyArg_ParseTuple: its format parsing was ~450 instructions a forward)
    PyErr_SetString(inputs == nullptr ? PyExc_AttributeError : PyExc_TypeError,
                    "StepWork.inputs is not a tuple of four");
    return false;
  }
  PyObject* tensor = PyTuple_GET_ITEM(inputs, 0);
  PyObject* dtypes = PyTuple_GET_ITEM(inputs, 1);
  PyObject* keyword = PyTuple_GET_ITEM(inputs, 2);
  PyObject* grad_enabled = PyTuple_GET_ITEM(inputs, 3);
  PyObject* enabled = PyObject_CallNoArgs(grad_enabled);
  if (enabled == nullptr) {
    return false;
  }
  const int counts = PyObject_IsTrue(enabled);
  Py_DECREF(enabled);
  if (counts <= 0) {
    return counts == 0;
  }
  PyObject* x = nargs > 0 ? args[0] : nullptr;
  if (x == nullptr && kwnames != nullptr) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); ++i) {
      const int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(kwnames, i), keyword, Py_EQ);
      if (same < 0) {
        return false;
      }
      if (same) {
        x = args[nargs + i];
        break;
      }
    }
  }
  PyObject* shape = nullptr;
  if (x != nullptr) {
    const int is_tensor = PyObject_IsInstance(x, tensor);
    if (is_tensor < 0) {
      return false;
    }
    if (is_tensor && (shape = PyObject_GetAttr(x, s_shape)) == nullptr) {
      return false;
    }
  }
  const Py_ssize_t dims = shape == nullptr ? 0 : PyObject_Length(shape);
  if (dims < 0) {
    Py_DECREF(shape);
    return false;
  }
  if (dims == 0) {
    Py_XDECREF(shape);
    put_bool(work, w.unclear_samples, true);
    put_bool(work, w.unclear_tokens, true);
    return true;
  }
  int64_t batch = 0, length = 0, samples = 0, tokens = 0;
  PyObject* first = PySequence_GetItem(shape, 0);
  PyObject* second = dims == 2 ? PySequence_GetItem(shape, 1) : nullptr;
  Py_DECREF(shape);
  const bool ints = int_of(first, batch) && (dims != 2 || int_of(second, length));
  Py_XDECREF(first);
  Py_XDECREF(second);
  if (!ints || !int_of(get(work, w.seen_batches), seen) ||
      !int_of(get(work, w.seen_samples), samples)) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_TypeError, "a batch dimension or a count that is not an int");
    }
    return false;
  }
  if (!put_int(work, w.seen_batches, ++seen) || !put_int(work, w.seen_samples, samples + batch)) {
    return false;
  }
  int token_tensor = 0;
  if (dims == 2) {
    PyObject* dtype = PyObject_GetAttr(x, s_dtype);
    if (dtype == nullptr) {
      return false;
    }
    token_tensor = PySequence_Contains(dtypes, dtype);
    Py_DECREF(dtype);
    if (token_tensor < 0) {
      return false;
    }
  }
  if (!token_tensor) {
    put_bool(work, w.unclear_tokens, true);
    return true;
  }
  if (!int_of(get(work, w.seen_tokens), tokens)) {
    PyErr_SetString(PyExc_TypeError, "seen_tokens is not an int");
    return false;
  }
  return put_int(work, w.seen_tokens, tokens + batch * length);
}

// read_batch, then StepWork.on_batches at every look_every-th batch of a step where it is set.
bool count_batch(Hook* h, PyObject* work, PyObject* const* args, Py_ssize_t nargs,
                 PyObject* kwnames) {
  int64_t seen = 0;
  if (!read_batch(h, work, args, nargs, kwnames, seen)) {
    return false;
  }
  if (seen == 0 || seen % h->look_every != 0) {
    return true;
  }
  PyObject* look = get(work, h->work_slots.at.on_batches);
  if (look == nullptr || look == Py_None) {
    return true;
  }
  PyObject* done = PyObject_CallNoArgs(look);
  Py_XDECREF(done);
  return done != nullptr;
}

// _call_traced(original, *args, **kwargs): the frame torch.compile starts tracing from.
PyObject* call_original(Hook* h, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t total = nargs + (kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames));
  if (nargsf & PY_VECTORCALL_ARGUMENTS_OFFSET) {  // the caller lent args[-1]
    PyObject** lent = const_cast<PyObject**>(args) - 1;
    PyObject* kept = lent[0];
    lent[0] = h->original;
    PyObject* out = PyObject_Vectorcall(h->call_traced, lent, nargs + 1, kwnames);
    lent[0] = kept;
    return out;
  }
  PyObject* small[16];
  PyObject** all = total + 1 <= 16
      ? small
      : static_cast<PyObject**>(PyMem_Malloc((total + 1) * sizeof(PyObject*)));
  if (all == nullptr) {
    return PyErr_NoMemory();
  }
  all[0] = h->original;
  for (Py_ssize_t i = 0; i < total; ++i) {
    all[i + 1] = args[i];
  }
  PyObject* out = PyObject_Vectorcall(h->call_traced, all, nargs + 1, kwnames);
  if (all != small) {
    PyMem_Free(all);
  }
  return out;
}

// Whether the clock is in the common state for the forward phase's start (the inline case of
// timed_forward and PhaseClock.forward_began): a timed step, its slots of the expected types.
// `idle`, `opt_start`: the clock's, read.
bool forward_common(Hook* h, PyObject* c, int64_t& idle, int64_t& opt_start) {
  const ClockSlots& s = h->clock_slots.at;
  PyObject* blocked = get(c, s.blocked);
  PyObject* work = get(c, s.work);
  return get(c, s.quiet) == Py_False && get(c, s.mark) != nullptr &&
      int_of(get(c, s.idle_since), idle) && int_of(get(c, s.opt_start), opt_start) &&
      int_list(get(c, s.acc), h->n_phases) && work != nullptr &&
      slots_of(work, h->work_slots) && blocked != nullptr &&
      (blocked == Py_None || slots_of(blocked, h->blocked_slots));
}

// The waits since the clock last looked, taken at boundary `at` (PhaseClock.take_blocked, in
// Python where there are any): false with an error set.
bool waits_since(Hook* h, PyObject* c, int64_t at, int64_t& waited) {
  waited = 0;
  int64_t first_ns;
  PyObject* blocked = get(c, h->clock_slots.at.blocked);
  if (blocked != nullptr && blocked_still(h, c, blocked, first_ns)) {
    return true;
  }
  PyErr_Clear();
  PyObject* kind = PyLong_FromLongLong(at);
  PyObject* ns = kind == nullptr ? nullptr : PyObject_CallMethodOneArg(c, s_take_blocked, kind);
  Py_XDECREF(kind);
  const bool ok = ns != nullptr && int_of(ns, waited);
  Py_XDECREF(ns);
  if (!ok && !PyErr_Occurred()) {
    PyErr_SetString(PyExc_TypeError, "take_blocked did not return an int");
  }
  return ok;
}

// The forward phase starts now (forward_common's state): data ends, less the waits since the
// clock last looked; inside optimizer.step(closure) (PhaseClock.forward_began) data ends at the
// step's start and the time since is the optimizer's. False with an error set.
bool forward_start(Hook* h, PyObject* c, int64_t idle, int64_t opt_start) {
  const ClockSlots& s = h->clock_slots.at;
  const int64_t t = now_ns();
  int64_t waited = 0;
  bool ok = waits_since(h, c, h->fwd_pre, waited);
  PyObject* acc = ok ? get(c, s.acc) : nullptr;
  if (ok && opt_start) {  // the waits as data's first, the rest the optimizer's (_data_ends)
    const int64_t data = idle && idle < opt_start ? opt_start - idle : 0;
    const int64_t ns = t - opt_start - (waited > data ? waited - data : 0);
    ok = (data - waited <= 0 || add_to(acc, h->i_data, data - waited)) &&
         (ns <= 0 || add_to(acc, h->i_optimizer, ns)) && put_int(c, s.opt_start, 0) &&
         put_int(c, s.idle_since, 0);
    put_bool(c, s.opt_closure, true);
  } else if (ok && idle) {
    const int64_t ns = t - idle - waited;
    ok = (ns <= 0 || add_to(acc, h->i_data, ns)) && put_int(c, s.idle_since, 0);
  }
  return ok && put_int(c, s.fwd_start, t);
}

// The forward phase ends with output `out` (PhaseClock.forward_ended): its time less the waits
// in it, the output's hooks where the trigger asks for them, the boundary marked. Errors go to
// the clock.
void forward_end(Hook* h, PyObject* c, PyObject* out) {
  const ClockSlots& s = h->clock_slots.at;
  const int64_t end = now_ns();
  int64_t start = 0;
  if (!int_of(get(c, s.fwd_start), start)) {
    PyErr_SetString(PyExc_TypeError, "fwd_start is not an int");
    note_error(c);
    return;
  }
  if (start) {
    int64_t waited = 0;
    if (!waits_since(h, c, h->fwd_post, waited)) {
      note_error(c);
      return;
    }
    PyObject* acc = get(c, s.acc);
    const int64_t ns = end - start - waited;
    if (!int_list(acc, h->n_phases) || (ns > 0 && !add_to(acc, h->i_forward, ns)) ||
        !put_int(c, s.fwd_start, 0)) {
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "acc is not a list of ints");
      }
      note_error(c);
      return;
    }
  }
  put_bool(c, s.fwd_since_bwd, true);
  PyObject* triggers = get(c, s.triggers);
  if (triggers != nullptr && slots_of(triggers, h->trigger_slots) &&
      get(triggers, h->trigger_slots.at.output_hooks) == Py_True &&
      get(c, s.bwd_pending) != Py_True) {  // rare: GradTriggers.missed
    PyObject* done = PyObject_CallMethodOneArg(triggers, s_hook_output, out);
    if (done == nullptr) {
      note_error(c);
      return;
    }
    Py_DECREF(done);
  }
  PyErr_Clear();
  mark_at(h, c, h->fwd_post);
}

// pair.started (ForwardHooks'): 1, 0, or -1 with an error set.
int pair_started(PyObject* pair) {
  PyObject* started = PyObject_GetAttr(pair, s_started);
  if (started == nullptr) {
    return -1;
  }
  const int truth = started == Py_True ? 1 : started == Py_False ? 0 : -1;
  Py_DECREF(started);
  if (truth < 0) {
    PyErr_SetString(PyExc_TypeError, "ForwardHooks.started is not a bool");
  }
  return truth;
}

// The forward called with nothing timed here, its batch read into `work` (a StepWork of slots).
PyObject* batch_only(Hook* h, PyObject* work, PyObject* const* args, size_t nargsf,
                     PyObject* kwnames) {
  if (h->count && !count_batch(h, work, args, PyVectorcall_NARGS(nargsf), kwnames)) {
    note_error(h->clock);
  }
  return call_original(h, args, nargsf, kwnames);
}

PyObject* forward(Hook* h, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* c = h->clock;
  const ClockSlots& s = h->clock_slots.at;
  if (get(c, s.at_forward) != Py_None) {  // asked from another thread: Python's to run
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  }
  PyObject* work = get(c, s.work);
  PyObject* quiet = get(c, s.quiet);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (quiet == Py_True && work != nullptr && slots_of(work, h->work_slots)) {
    return batch_only(h, work, args, nargsf, kwnames);  // a quiet step
  }
  // The module's hooks first: reading them may run Python, so the slots are read after it.
  const int hooked = quiet == Py_False ? has_hooks(h) : -1;
  work = get(c, s.work);
  if (hooked == 1 && h->pair != Py_None && work != nullptr && slots_of(work, h->work_slots) &&
      pair_started(h->pair) == 1) {
    // Our pre-hook on the module started the phase and our post-hook ends it
    // (ForwardHooks.entered's common case)
    return batch_only(h, work, args, nargsf, kwnames);
  }
  int64_t idle, opt_start;
  if (hooked != 0 || !forward_common(h, c, idle, opt_start)) {
    PyErr_Clear();
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  }
  // The forward phase starts: data ends here.
  if (!forward_start(h, c, idle, opt_start) ||
      (h->count && !count_batch(h, work, args, nargs, kwnames))) {
    note_error(c);
  }
  mark_at(h, c, h->fwd_pre);
  PyObject* out = call_original(h, args, nargsf, kwnames);
  if (out == nullptr) {
    return nullptr;  // the model's own error, as it came
  }
  forward_end(h, c, out);
  return out;
}

// -- ForwardHooks' pre- and post-hook on a module that has forward hooks (FSDP2's) --------------

// The first key of a mapping (`last`: its last), as iter() (reversed()) gives it: a new
// reference, or nullptr (an error set where the mapping could not be iterated).
PyObject* end_key(PyObject* mapping, bool last) {
  PyObject* keys =
      last ? PyObject_CallMethodNoArgs(mapping, s_reversed) : PyObject_GetIter(mapping);
  if (keys == nullptr) {
    return nullptr;
  }
  PyObject* key = PyIter_Next(keys);
  Py_DECREF(keys);
  return key;
}

// ForwardHooks._pre's common case: ours still first and last among the module's hooks, others
// still there, a quiet step (nothing to do) or a timed one in forward_common's state (the phase
// starts, `started` set). Everything else: the Python hook.
PyObject* forward_pre_hook(Hook* h, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* c = h->clock;
  PyObject* quiet = get(c, h->clock_slots.at.quiet);
  int64_t idle = 0, opt_start = 0;
  bool common = PyVectorcall_NARGS(nargsf) >= 1 && kwnames == nullptr && is_bool(quiet) &&
      (quiet == Py_True || forward_common(h, c, idle, opt_start));
  PyObject* handles = common ? PyObject_GetAttr(h->pair, s_handles) : nullptr;
  PyObject *pre_hooks = nullptr, *post_hooks = nullptr, *pre_id = nullptr, *post_id = nullptr;
  if (handles != nullptr && PyTuple_Check(handles) && PyTuple_GET_SIZE(handles) == 2) {
    pre_id = PyObject_GetAttr(PyTuple_GET_ITEM(handles, 0), s_id);
    post_id = pre_id == nullptr ? nullptr : PyObject_GetAttr(PyTuple_GET_ITEM(handles, 1), s_id);
    pre_hooks = post_id == nullptr ? nullptr : PyObject_GetAttr(args[0], s_forward_pre_hooks);
    post_hooks = pre_hooks == nullptr ? nullptr : PyObject_GetAttr(args[0], s_forward_hooks);
  }
  common = post_hooks != nullptr && PyDict_Check(pre_hooks) && PyDict_Check(post_hooks);
  if (common) {
    // Not ours alone (the Python hook then removes the pair), and ours first and last
    const bool alone = PyDict_GET_SIZE(pre_hooks) == 1 && PyDict_GET_SIZE(post_hooks) == 1 &&
        (h->global_post == Py_None || PyDict_GET_SIZE(h->global_post) == 0);
    // In the dicts' own order: torch's are OrderedDicts, which `prepend` reorders by
    // move_to_end, leaving the order PyDict_Next walks as it was.
    PyObject* first = alone ? nullptr : end_key(pre_hooks, false);
    PyObject* last = first == nullptr ? nullptr : end_key(post_hooks, true);
    common = last != nullptr && PyObject_RichCompareBool(first, pre_id, Py_EQ) == 1 &&
        PyObject_RichCompareBool(last, post_id, Py_EQ) == 1;
    Py_XDECREF(first);
    Py_XDECREF(last);
  }
  Py_XDECREF(handles);
  Py_XDECREF(pre_id);
  Py_XDECREF(post_id);
  Py_XDECREF(pre_hooks);
  Py_XDECREF(post_hooks);
  if (!common) {
    PyErr_Clear();
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  }
  if (quiet == Py_True) {
    Py_RETURN_NONE;
  }
  if (!forward_start(h, c, idle, opt_start)) {
    note_error(c);
  }
  if (PyObject_SetAttr(h->pair, s_started, Py_True) < 0) {
    note_error(c);
  }
  mark_at(h, c, h->fwd_pre);
  Py_RETURN_NONE;
}

// ForwardHooks._post: the phase our pre-hook started ends with the module's output.
PyObject* forward_post_hook(Hook* h, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* c = h->clock;
  const int started = pair_started(h->pair);
  if (started < 0 || PyVectorcall_NARGS(nargsf) < 3 || kwnames != nullptr) {
    PyErr_Clear();
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  }
  if (!started) {
    Py_RETURN_NONE;
  }
  if (PyObject_SetAttr(h->pair, s_started, Py_False) < 0) {
    return report(c);
  }
  forward_end(h, c, args[2]);
  Py_RETURN_NONE;
}

// -- a parameter's gradient (PhaseClock.grad_ready, GradTriggers' hooks in Python mode) ----------

// The trigger's common calls: a quiet step's or a split backward's (nothing to start), a later
// one of a backward already started, and the first of a wrapped backward (callback A queued,
// the backward's start its entry). Learning which gradients come first, a backward not entered
// through the wrapper, a nested one, a slot of an unexpected type: the Python hook.
PyObject* grad_ready(Hook* h, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* c = h->clock;
  const ClockSlots& s = h->clock_slots.at;
  PyObject* triggers = get(c, s.triggers);
  PyObject* quiet = get(c, s.quiet);
  PyObject* pending = get(c, s.bwd_pending);
  int64_t grad_entry = 0, depth = 0, entry = 0;
  const bool learnt = triggers != nullptr && slots_of(triggers, h->trigger_slots) &&
      get(triggers, h->trigger_slots.at.learned) == Py_None;
  if (learnt && is_bool(quiet) && is_bool(pending) && int_of(get(c, s.grad_entry), grad_entry)) {
    if (quiet == Py_True || grad_entry != 0 || pending == Py_True) {
      Py_RETURN_NONE;  // nothing to start
    }
    PyObject* queue = get(c, s.queue_callback);
    if (int_of(get(c, s.bwd_depth), depth) && depth <= 1 &&
        int_of(get(c, s.bwd_entry), entry) && entry != 0 && queue != nullptr && queue != Py_None) {
      Py_INCREF(queue);
      PyObject* queued = PyObject_CallOneArg(queue, h->callback);
      Py_DECREF(queue);
      if (queued == nullptr) {
        if (PyErr_ExceptionMatches(PyExc_RuntimeError)) {  // no graph task: a hook by hand
          PyErr_Clear();
          Py_RETURN_NONE;
        }
        return report(c);
      }
      Py_DECREF(queued);
      put_bool(c, s.bwd_pending, true);
      put_bool(c, s.fwd_since_bwd, false);
      PyObject* start = get(c, s.bwd_entry);  // an int, read above
      Py_INCREF(start);
      put(c, s.bwd_start, start);
      Py_RETURN_NONE;
    }
  }
  PyErr_Clear();
  return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
}

// -- callback A (BackwardPhases._backward_done), queued by the gradient trigger's hook in C ------

// All of the backward's autograd work is done: the backward phase ends here, and DDP's sync is
// due at the wrapped backward's return, or there is none and the step is idle. A wait to move
// into `comm`, learning, a nested backward's A, a closure, a slot of an unexpected type: the
// Python method.
PyObject* backward_done(Hook* h, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const int64_t t = now_ns();
  PyObject* c = h->clock;
  const ClockSlots& s = h->clock_slots.at;
  bool sync = false;
  int64_t start = 0, depth = 0, first_ns;
  bool common = sync_due(h, c, sync);  // (first: it may run Python)
  PyObject* acc = get(c, s.acc);
  PyObject* blocked = get(c, s.blocked);
  PyObject* triggers = get(c, s.triggers);
  common = common && int_of(get(c, s.bwd_start), start) && int_list(acc, h->n_phases) &&
      blocked != nullptr && blocked_still(h, c, blocked, first_ns) && triggers != nullptr &&
      slots_of(triggers, h->trigger_slots) &&
      get(triggers, h->trigger_slots.at.learned) == Py_None &&
      (sync ? int_of(get(c, s.bwd_depth), depth) && depth == 1
            : get(c, s.opt_closure) == Py_False);
  if (!common) {
    PyErr_Clear();
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  }
  const int64_t ns = t - start;
  if ((ns > 0 && !add_to(acc, h->i_backward, ns)) || !put_int(c, s.bwd_end, t)) {
    return report(c);
  }
  if (sync) {  // the wrapped backward's return is B's moment (_gradients_reduced)
    put_bool(c, s.sync_due, true);
  } else {
    put_bool(c, s.bwd_pending, false);
    if (!put_int(c, s.idle_since, t)) {
      return report(c);
    }
  }
  mark_at(h, c, h->bwd_end);
  Py_RETURN_NONE;
}

// -- the type -----------------------------------------------------------------------------------
PyObject* hook_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  Hook* h = reinterpret_cast<Hook*>(self);
  switch (h->kind) {
    case kPre:
      return optimizer_pre(h, args, nargsf, kwnames);
    case kPost:
      return optimizer_post(h, args, nargsf, kwnames);
    case kForward:
      return forward(h, args, nargsf, kwnames);
    case kGrad:
      return grad_ready(h, args, nargsf, kwnames);
    case kDone:
      return backward_done(h, args, nargsf, kwnames);
    case kFwdPre:
      return forward_pre_hook(h, args, nargsf, kwnames);
    case kFwdPost:
      return forward_post_hook(h, args, nargsf, kwnames);
    default:
      return backward(h, args, nargsf, kwnames);
  }
}

int hook_traverse(PyObject* self, visitproc visit, void* arg) {
  Hook* h = reinterpret_cast<Hook*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(h->dict);
  Py_VISIT(h->clock);
  Py_VISIT(h->fallback);
  Py_VISIT(h->registered);
  Py_VISIT(h->original);
  Py_VISIT(h->clock_class);
  Py_VISIT(h->call_traced);
  Py_VISIT(h->module);
  Py_VISIT(h->global_post);
  Py_VISIT(h->pair);
  Py_VISIT(h->sync_kind);
  Py_VISIT(h->end_step);
  Py_VISIT(h->quiet_end);
  Py_VISIT(h->cuda_mark);
  Py_VISIT(h->callback);
  Py_VISIT(h->stream_of_class);
  Py_VISIT(h->timeline_class);
  Py_VISIT(h->free_of);
  Py_VISIT(h->free_pop);
  return 0;
}

int hook_clear(PyObject* self) {
  Hook* h = reinterpret_cast<Hook*>(self);
  Py_CLEAR(h->dict);
  Py_CLEAR(h->clock);
  Py_CLEAR(h->fallback);
  Py_CLEAR(h->registered);
  Py_CLEAR(h->original);
  Py_CLEAR(h->clock_class);
  Py_CLEAR(h->call_traced);
  Py_CLEAR(h->module);
  Py_CLEAR(h->global_post);
  Py_CLEAR(h->pair);
  Py_CLEAR(h->sync_kind);
  Py_CLEAR(h->end_step);
  Py_CLEAR(h->quiet_end);
  Py_CLEAR(h->cuda_mark);
  Py_CLEAR(h->callback);
  Py_CLEAR(h->stream_of_class);
  Py_CLEAR(h->timeline_class);
  Py_CLEAR(h->free_of);
  Py_CLEAR(h->free_pop);
  return 0;
}

void hook_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  hook_clear(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyMemberDef hook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Hook, vectorcall), READONLY, nullptr},
    {"__dictoffset__", T_PYSSIZET, offsetof(Hook, dict), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyGetSetDef hook_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot hook_slots[] = {
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_traverse, reinterpret_cast<void*>(hook_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(hook_clear)},
    {Py_tp_dealloc, reinterpret_cast<void*>(hook_dealloc)},
    {Py_tp_members, hook_members},
    {Py_tp_getset, hook_getset},
    {Py_tp_doc, const_cast<char*>("A phase clock's hook in C (syncscope agent/hot_path.py).")},
    {0, nullptr},
};

PyType_Spec hook_spec = {
    "syncscope.HotHook",
    sizeof(Hook),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    hook_slots,
};

PyObject* hook_type = nullptr;

bool intern_names() {
  struct Name {
    PyObject** at;
    const char* text;
  } names[] = {
      {&s_append, "append"},
      {&s_value, "value"},
      {&s_clocks, "clocks"},
      {&s_sync, "require_backward_grad_sync"},
      {&s_on_error, "on_error"},
      {&s_backward_returned, "backward_returned"},
      {&s_backward_exit, "backward_exit"},
      {&s_forward_pre_hooks, "_forward_pre_hooks"},
      {&s_forward_hooks, "_forward_hooks"},
      {&s_shape, "shape"},
      {&s_dtype, "dtype"},
      {&s_take_blocked, "take_blocked"},
      {&s_hook_output, "hook_output"},
      {&s_set, "set"},
      {&s_pop, "pop"},
      {&s_record, "record"},
      {&s_abandon_step, "_abandon_step"},
      {&s_clear, "clear"},
      {&s_started, "started"},
      {&s_handles, "handles"},
      {&s_id, "id"},
      {&s_reversed, "__reversed__"},
  };
  for (const Name& name : names) {
    if (*name.at == nullptr && (*name.at = PyUnicode_InternFromString(name.text)) == nullptr) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" {

// A hook of `kind` (0: optimizer pre, 1: optimizer post, 2: torch.autograd.backward, 3: a
// model's forward, 4: a parameter's gradient, 5: callback A, 6 and 7: ForwardHooks' pre- and
// post-hook) standing for the Python callable `fallback`. `target`: the clock (0, 5); (the clock,
// its bound end_step and _quiet_end, EndMode: what of its step end is done here) (1);
// (phase_hooks.Clocks, torch.autograd.backward's original, the clock class it times) (2); (the
// clock, the original forward, phase_hooks._call_traced, the module or None, torch's global
// forward hooks or None, whether to read the batch, the module's ForwardHooks or None) (3); (the
// clock, callback A: a kDone hook or its bound _backward_done) (4); (the clock, the ForwardHooks,
// torch's global forward hooks) (6, 7).
// `constants`: phase_hooks.HOT_CONSTANTS, (the positions of DATA, FORWARD, BACKWARD, OPTIMIZER
// and COMM_EXPOSED in the accumulator, its length, FWD_PRE, FWD_POST, OPT_PRE, COMM_END,
// STEP_END, BWD_END, BWD_START, UNKNOWN_WORK, DDP_GRAD_SYNC, CudaPhaseClock._mark,
// cuda_timing.StreamOf, nccl_trace.StepTimeline).
// A new reference, or nullptr with an exception set (ctypes raises it).
PyObject* syncscope_hot_hook(int kind, PyObject* target, PyObject* fallback, PyObject* constants) {
  if (!intern_names()) {
    return nullptr;
  }
  if (hook_type == nullptr && (hook_type = PyType_FromSpec(&hook_spec)) == nullptr) {
    return nullptr;
  }
  long long at[6], fwd_pre, fwd_post, opt_pre, comm_end, step_end, bwd_end, bwd_start;
  long long unknown_work, look_every;
  PyObject *sync_kind, *cuda_mark, *stream_of_class, *timeline_class;
  if (!PyArg_ParseTuple(constants, "LLLLLLLLLLLLLLLOOOO", &at[0], &at[1], &at[2], &at[3], &at[4],
                        &at[5], &fwd_pre, &fwd_post, &opt_pre, &comm_end, &step_end, &bwd_end,
                        &bwd_start, &unknown_work, &look_every, &sync_kind, &cuda_mark,
                        &stream_of_class, &timeline_class)) {
    return nullptr;
  }
  if (!PyType_Check(stream_of_class) || !PyType_Check(timeline_class)) {
    PyErr_SetString(PyExc_TypeError, "StreamOf and StepTimeline must be classes");
    return nullptr;
  }
  if (look_every < 1) {
    PyErr_SetString(PyExc_ValueError, "LOOK_EVERY must be 1 or more");
    return nullptr;
  }
  for (int i = 0; i < 5; ++i) {
    if (at[5] < 1 || at[i] < 0 || at[i] >= at[5]) {
      PyErr_SetString(PyExc_ValueError, "phase positions out of the accumulator");
      return nullptr;
    }
  }
  if (kind < kPre || kind > kFwdPost || !PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_ValueError, "an unknown hook, or a fallback that is not callable");
    return nullptr;
  }
  PyObject *clock = nullptr, *registered = nullptr, *original = nullptr, *clock_class = nullptr;
  PyObject *call_traced = nullptr, *module = nullptr, *global_post = nullptr, *pair = nullptr;
  PyObject *end_step = nullptr, *quiet_end = nullptr, *callback = nullptr;
  int count = 0, end_mode = kOwnEnd;
  if (kind == kBackward) {
    if (!PyArg_ParseTuple(target, "OOO", &registered, &original, &clock_class)) {
      return nullptr;
    }
  } else if (kind == kForward) {
    if (!PyArg_ParseTuple(target, "OOOOOpO", &clock, &original, &call_traced, &module,
                          &global_post, &count, &pair)) {
      return nullptr;
    }
    if (global_post != Py_None && !PyDict_Check(global_post)) {
      PyErr_SetString(PyExc_TypeError, "torch's global forward hooks: a dict or None");
      return nullptr;
    }
  } else if (kind == kFwdPre || kind == kFwdPost) {
    if (!PyArg_ParseTuple(target, "OOO", &clock, &pair, &global_post)) {
      return nullptr;
    }
    if (global_post != Py_None && !PyDict_Check(global_post)) {
      PyErr_SetString(PyExc_TypeError, "torch's global forward hooks: a dict or None");
      return nullptr;
    }
  } else if (kind == kPost) {
    if (!PyArg_ParseTuple(target, "OOOi", &clock, &end_step, &quiet_end, &end_mode)) {
      return nullptr;
    }
    if (end_mode < kOwnEnd || end_mode > kCudaQuietEnd) {
      PyErr_SetString(PyExc_ValueError, "an unknown end mode");
      return nullptr;
    }
    if (!(PyCallable_Check(end_step) && PyCallable_Check(quiet_end))) {
      PyErr_SetString(PyExc_TypeError, "end_step and _quiet_end must be callable");
      return nullptr;
    }
  } else if (kind == kGrad) {
    if (!PyArg_ParseTuple(target, "OO", &clock, &callback)) {
      return nullptr;
    }
    if (!PyCallable_Check(callback)) {
      PyErr_SetString(PyExc_TypeError, "_backward_done must be callable");
      return nullptr;
    }
  } else {
    clock = target;
  }
  Hook* h = PyObject_GC_New(Hook, reinterpret_cast<PyTypeObject*>(hook_type));
  if (h == nullptr) {
    return nullptr;
  }
  // PyObject_GC_New leaves the fields after the header uninitialised.
  h->vectorcall = hook_call;
  h->dict = nullptr;
  h->kind = kind;
  h->clock = clock;
  h->fallback = fallback;
  h->registered = registered;
  h->original = original;
  h->clock_class = clock_class;
  h->call_traced = call_traced;
  h->module = module;
  h->global_post = global_post;
  h->pair = pair;
  h->count = count;
  h->sync_kind = sync_kind;
  h->end_step = end_step;
  h->quiet_end = quiet_end;
  h->end_mode = end_mode;
  h->callback = callback;
  h->free_of = h->free_pop = nullptr;
  Py_XINCREF(callback);
  Py_XINCREF(end_step);
  Py_XINCREF(quiet_end);
  Py_XINCREF(clock);
  Py_INCREF(fallback);
  Py_XINCREF(registered);
  Py_XINCREF(original);
  Py_XINCREF(clock_class);
  Py_XINCREF(call_traced);
  Py_XINCREF(module);
  Py_XINCREF(global_post);
  Py_XINCREF(pair);
  Py_INCREF(sync_kind);
  h->i_data = at[0];
  h->i_forward = at[1];
  h->i_backward = at[2];
  h->i_optimizer = at[3];
  h->i_comm = at[4];
  h->n_phases = at[5];
  h->fwd_pre = fwd_pre;
  h->fwd_post = fwd_post;
  h->opt_pre = opt_pre;
  h->comm_end = comm_end;
  h->step_end = step_end;
  h->bwd_end = bwd_end;
  h->bwd_start = bwd_start;
  h->kept_type = nullptr;
  h->kept = false;
  h->cuda_mark = cuda_mark;
  Py_INCREF(cuda_mark);
  h->stream_of_class = stream_of_class;
  Py_INCREF(stream_of_class);
  h->timeline_class = timeline_class;
  Py_INCREF(timeline_class);
  h->unknown_work = unknown_work;
  h->look_every = look_every;
  new (&h->clock_slots) Resolved<ClockSlots>();
  new (&h->work_slots) Resolved<WorkSlots>();
  new (&h->blocked_slots) Resolved<BlockedSlots>();
  new (&h->trigger_slots) Resolved<TriggerSlots>();
  new (&h->cuda_slots) Resolved<CudaSlots>();
  new (&h->stream_slots) Resolved<StreamSlots>();
  new (&h->timeline_slots) Resolved<TimelineSlots>();
  PyObject_GC_Track(reinterpret_cast<PyObject*>(h));
  // The clock's slots now, so that a clock without them is refused here, not every call.
  if (clock != nullptr) {
    h->clock_slots.type = Py_TYPE(clock);
    h->clock_slots.ok = resolve(Py_TYPE(clock), h->clock_slots.at);
    if (!h->clock_slots.ok) {
      Py_DECREF(h);
      return nullptr;
    }
  }
  return reinterpret_cast<PyObject*>(h);
}

}  // extern "C"
