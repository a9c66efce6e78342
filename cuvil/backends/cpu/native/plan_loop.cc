// One loop over a prepared schedule: the CPU plan's steps for one input shape, run without the
// Python interpreter (cuvil/backends/cpu/native_plan.py builds the schedule and says why).
//
// A step is either a boxed call of a dispatcher operator (ATen's ops, oneDNN's mkldnn ops) on an
// argument template with slots filled in, or the execution of a oneDNN primitive kept by the
// Python side (kept_primitives.py), whose handles it is given. Values live in slots; a slot is
// cleared after its last reader, so tensors are freed when the Python plan would free them.
//
// Built as a TorchScript custom class and op: calls of its ``run`` method (and of the op) from
// Python release the GIL while they run, so a whole call runs with the GIL released and two
// Python threads run two calls at once.
#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <mutex>
#include <thread>
#include <unordered_map>

namespace {

using c10::IValue;

// libdnnl's C functions, by address (the library is loaded by Python's ctypes, RTLD_LOCAL)
struct ExecArg {
  int arg;
  void *memory;
};
using MemoryCreate = int (*)(void **, const void *, void *, void *);
using SetHandle = int (*)(void *, void *);
using Execute = int (*)(const void *, void *, int, const ExecArg *);
using StreamCreate = int (*)(void **, void *, unsigned);
using Destroy = int (*)(void *);

struct Dnnl {
  MemoryCreate memory_create = nullptr;
  SetHandle set_handle = nullptr;
  Execute execute = nullptr;
  StreamCreate stream_create = nullptr;
  Destroy memory_destroy = nullptr;
};
Dnnl dnnl;

constexpr int ARG_SRC = 1, ARG_DST = 17, ARG_WEIGHTS = 33, ARG_BIAS = 41, ARG_SCRATCHPAD = 80;
constexpr int POST_OP_0_SRC_1 = 32768 | 2;

void check(int status, const char *what) {
  TORCH_CHECK(status == 0, "oneDNN ", what, " failed with status ", status);
}

// this thread's stream on an engine (each loaded oneDNN object has its own engine)
void *stream(void *engine) {
  thread_local std::unordered_map<void *, void *> own;
  void *&found = own[engine];
  if (found == nullptr) check(dnnl.stream_create(&found, engine, 1), "stream_create");
  return found;
}

void *scratchpad(size_t bytes) {
  thread_local at::Tensor buffer;
  if (!buffer.defined() || static_cast<size_t>(buffer.numel()) < bytes)
    buffer = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
  return buffer.data_ptr();
}

// A kept primitive's run-time memory objects for one thread.
struct Bound {
  void *src = nullptr, *dst = nullptr, *extra = nullptr, *scratch = nullptr;
  std::vector<ExecArg> args;
};

struct Primitive {
  void *engine, *handle, *src_md, *dst_md, *scratch_md, *weight, *bias;
  int64_t scratch_bytes;
  bool binary_residual;  // post-op 0 reads the residual
  bool donated;          // the output is written over the residual (sum post-op)
  bool channels_last;
  std::vector<int64_t> in_sizes, out_sizes, out_strides, result_sizes;
  at::ScalarType out_dtype = at::kFloat;
  std::mutex lock;
  std::unordered_map<std::thread::id, Bound> bound;

  ~Primitive() {
    for (auto &entry : bound)
      for (void *memory : {entry.second.src, entry.second.dst, entry.second.extra,
                           entry.second.scratch})
        if (memory != nullptr) dnnl.memory_destroy(memory);
  }

  Bound &for_this_thread() {
    std::lock_guard<std::mutex> guard(lock);
    auto found = bound.find(std::this_thread::get_id());
    if (found != bound.end()) return found->second;
    Bound &b = bound[std::this_thread::get_id()];
    check(dnnl.memory_create(&b.src, src_md, engine, nullptr), "memory_create");
    check(dnnl.memory_create(&b.dst, dst_md, engine, nullptr), "memory_create");
    check(dnnl.memory_create(&b.scratch, scratch_md, engine, nullptr), "memory_create");
    b.args = {{ARG_SRC, b.src}, {ARG_WEIGHTS, weight}, {ARG_DST, b.dst},
              {ARG_SCRATCHPAD, b.scratch}};
    if (bias != nullptr) b.args.push_back({ARG_BIAS, bias});
    if (binary_residual) {
      check(dnnl.memory_create(&b.extra, dst_md, engine, nullptr), "memory_create");
      b.args.push_back({POST_OP_0_SRC_1, b.extra});
    }
    return b;
  }
};

struct Fill {
  int64_t position;
  int64_t element;  // -1: the whole argument
  int64_t slot;
};

struct Step {
  std::optional<c10::OperatorHandle> op;
  std::vector<IValue> args;
  std::vector<Fill> fills;
  std::shared_ptr<Primitive> primitive;  // set for kept-primitive steps
  std::vector<int64_t> reads;            // kept-primitive steps: input, residual (optional)
  std::vector<int64_t> outputs;
  std::vector<int64_t> release;
};

}  // namespace

struct Schedule : torch::CustomClassHolder {
  std::vector<Step> steps;
  std::vector<int64_t> input_slots, output_slots;
  int64_t slot_count = 0;

  Schedule(int64_t slots, std::vector<int64_t> inputs, std::vector<int64_t> outputs)
      : input_slots(std::move(inputs)), output_slots(std::move(outputs)), slot_count(slots) {}

  Step &last() {
    TORCH_CHECK(!steps.empty(), "no step to add to");
    return steps.back();
  }

  void op(const std::string &name, const std::string &overload) {
    Step step;
    step.op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    steps.push_back(std::move(step));
  }
  void arg(IValue value) { last().args.push_back(std::move(value)); }
  void arg_ints(std::vector<int64_t> values) { arg(values); }
  void arg_floats(std::vector<double> values) { arg(values); }
  // a Scalar?[] argument (oneDNN's post-op scalars)
  void arg_scalars(std::vector<double> values) {
    c10::List<std::optional<c10::Scalar>> items;
    for (double value : values) items.push_back(c10::Scalar(value));
    arg(items);
  }
  void arg_dtype(c10::ScalarType value) { arg(value); }
  void arg_memory_format(c10::MemoryFormat value) { arg(value); }
  void arg_layout(c10::Layout value) { arg(value); }
  void arg_device(c10::Device value) { arg(value); }
  // a Python number where the op takes a Tensor: a wrapped number, as Python's binding makes
  void arg_number(c10::Scalar value) {
    at::Tensor number = c10::scalar_to_tensor(value);
    number.unsafeGetTensorImpl()->set_wrapped_number(true);
    arg(number);
  }
  void arg_slot(int64_t slot) {
    last().fills.push_back({static_cast<int64_t>(last().args.size()), -1, slot});
    last().args.emplace_back();
  }
  void arg_tensors(std::vector<at::Tensor> items) { arg(c10::List<at::Tensor>(items)); }
  void arg_optional_tensors(int64_t count) {
    c10::List<std::optional<at::Tensor>> items;
    for (int64_t i = 0; i < count; i++) items.push_back(std::nullopt);
    arg(items);
  }
  void fill_element(int64_t element, int64_t slot) {
    last().fills.push_back({static_cast<int64_t>(last().args.size()) - 1, element, slot});
  }
  void set_element(int64_t element, at::Tensor tensor) {
    last().args.back().toList().set(element, tensor);
  }
  void outputs(std::vector<int64_t> slots) { last().outputs = std::move(slots); }
  void release(std::vector<int64_t> slots) { last().release = std::move(slots); }

  void primitive(std::vector<int64_t> handles, std::vector<int64_t> flags,
                 std::vector<int64_t> in_sizes, std::vector<int64_t> out_sizes,
                 std::vector<int64_t> out_strides, std::vector<int64_t> result_sizes,
                 std::vector<int64_t> reads) {
    TORCH_CHECK(dnnl.execute != nullptr, "libdnnl's functions were not given");
    auto p = std::make_shared<Primitive>();
    auto h = [&](size_t i) { return reinterpret_cast<void *>(handles.at(i)); };
    p->handle = h(0), p->src_md = h(1), p->dst_md = h(2), p->scratch_md = h(3);
    p->weight = h(4), p->bias = h(5), p->engine = h(6);
    p->scratch_bytes = flags.at(0), p->binary_residual = flags.at(1) != 0;
    p->donated = flags.at(2) != 0, p->channels_last = flags.at(3) != 0;
    p->out_dtype = flags.size() > 4 && flags.at(4) != 0 ? at::kBFloat16 : at::kFloat;
    p->in_sizes = std::move(in_sizes), p->out_sizes = std::move(out_sizes);
    p->out_strides = std::move(out_strides), p->result_sizes = std::move(result_sizes);
    Step step;
    step.primitive = std::move(p);
    step.reads = std::move(reads);
    steps.push_back(std::move(step));
  }

  at::Tensor layout(const at::Tensor &value, const Primitive &p) const {
    at::Tensor shaped = value.reshape(p.in_sizes);
    return p.channels_last ? shaped.contiguous(at::MemoryFormat::ChannelsLast)
                           : shaped.contiguous();
  }

  at::Tensor run_primitive(const Step &step, std::vector<IValue> &slots) const {
    Primitive &p = *step.primitive;
    at::Tensor x = layout(slots[step.reads[0]].toTensor(), p);
    at::Tensor residual;
    if (step.reads.size() > 1) {
      residual = slots[step.reads[1]].toTensor().reshape(p.out_sizes);
      residual = p.channels_last ? residual.contiguous(at::MemoryFormat::ChannelsLast)
                                 : residual.contiguous();
    }
    at::Tensor out;
    if (p.donated && residual.defined()) {
      out = residual;
    } else {
      out = at::empty_strided(p.out_sizes, p.out_strides, p.out_dtype);
    }
    Bound &b = p.for_this_thread();
    dnnl.set_handle(b.src, x.data_ptr());
    dnnl.set_handle(b.dst, out.data_ptr());
    if (b.extra != nullptr) dnnl.set_handle(b.extra, residual.data_ptr());
    if (p.scratch_bytes > 0) dnnl.set_handle(b.scratch, scratchpad(p.scratch_bytes));
    check(dnnl.execute(p.handle, stream(p.engine), static_cast<int>(b.args.size()), b.args.data()),
          "primitive_execute");
    return p.result_sizes.empty() ? out : out.view(p.result_sizes);
  }

  // in inference mode whatever the caller's (the Python plan runs its kernels in it too), so a
  // direct call from runtime/model.py needs no Python context manager around it
  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs) const {
    c10::InferenceMode inference;
    TORCH_CHECK(inputs.size() == input_slots.size(), "expected ", input_slots.size(),
                " inputs, got ", inputs.size());
    std::vector<IValue> slots(slot_count);
    for (size_t i = 0; i < inputs.size(); i++) slots[input_slots[i]] = std::move(inputs[i]);
    std::vector<IValue> stack;
    for (const Step &step : steps) {
      if (step.primitive) {
        slots[step.outputs.at(0)] = run_primitive(step, slots);
      } else {
        stack.assign(step.args.begin(), step.args.end());
        for (const Fill &fill : step.fills) {
          if (fill.element < 0) {
            stack[fill.position] = slots[fill.slot];
          } else {  // a list argument: a fresh copy per call, the template stays shared
            if (stack[fill.position].isAliasOf(step.args[fill.position])) {
              stack[fill.position] = stack[fill.position].toList().copy();
            }
            stack[fill.position].toList().set(fill.element, slots[fill.slot]);
          }
        }
        step.op->callBoxed(&stack);
        if (stack.size() == step.outputs.size()) {
          for (size_t i = 0; i < stack.size(); i++) slots[step.outputs[i]] = std::move(stack[i]);
        } else {
          TORCH_CHECK(stack.size() == 1 && stack[0].isList(), "unexpected results");
          auto items = stack[0].toList();
          TORCH_CHECK(items.size() == step.outputs.size(), "unexpected result count");
          for (size_t i = 0; i < items.size(); i++) slots[step.outputs[i]] = items.get(i);
        }
        stack.clear();
      }
      for (int64_t slot : step.release) slots[slot] = IValue();
    }
    std::vector<at::Tensor> results;
    results.reserve(output_slots.size());
    for (int64_t slot : output_slots) results.push_back(slots[slot].toTensor());
    return results;
  }

  int64_t size() const { return static_cast<int64_t>(steps.size()); }

  // the address fast_call.cc's callers hold (and count a reference on): the refcounted base
  int64_t address() {
    return reinterpret_cast<int64_t>(static_cast<c10::intrusive_ptr_target *>(this));
  }
};

// fast_call.cc's entry into a schedule, by the address ``Schedule.address()`` gave: C linkage,
// so that library finds it by name without this one's (anonymous) types
extern "C" void cuvil_schedule_run(const void *target, const std::vector<at::Tensor> *inputs,
                                   std::vector<at::Tensor> *outputs) {
  auto schedule = static_cast<const Schedule *>(static_cast<const c10::intrusive_ptr_target *>(target));
  *outputs = schedule->run(*inputs);
}

namespace {

std::vector<at::Tensor> run_schedule(const c10::intrusive_ptr<Schedule> &schedule,
                                     std::vector<at::Tensor> inputs) {
  return schedule->run(std::move(inputs));
}

void set_dnnl(std::vector<int64_t> addresses) {
  auto as = [&](size_t i) { return reinterpret_cast<void *>(addresses.at(i)); };
  dnnl.memory_create = reinterpret_cast<MemoryCreate>(as(0));
  dnnl.set_handle = reinterpret_cast<SetHandle>(as(1));
  dnnl.execute = reinterpret_cast<Execute>(as(2));
  dnnl.stream_create = reinterpret_cast<StreamCreate>(as(3));
  dnnl.memory_destroy = reinterpret_cast<Destroy>(as(4));
}

}  // namespace

TORCH_LIBRARY(cuvil_native, m) {
  m.class_<Schedule>("Schedule")
      .def(torch::init<int64_t, std::vector<int64_t>, std::vector<int64_t>>())
      .def("op", &Schedule::op)
      .def("arg", &Schedule::arg)
      .def("arg_ints", &Schedule::arg_ints)
      .def("arg_floats", &Schedule::arg_floats)
      .def("arg_scalars", &Schedule::arg_scalars)
      .def("arg_dtype", &Schedule::arg_dtype)
      .def("arg_memory_format", &Schedule::arg_memory_format)
      .def("arg_layout", &Schedule::arg_layout)
      .def("arg_device", &Schedule::arg_device)
      .def("arg_number", &Schedule::arg_number)
      .def("arg_slot", &Schedule::arg_slot)
      .def("arg_tensors", &Schedule::arg_tensors)
      .def("arg_optional_tensors", &Schedule::arg_optional_tensors)
      .def("fill_element", &Schedule::fill_element)
      .def("set_element", &Schedule::set_element)
      .def("outputs", &Schedule::outputs)
      .def("release", &Schedule::release)
      .def("primitive", &Schedule::primitive)
      .def("size", &Schedule::size)
      .def("address", &Schedule::address)
      .def("run", &Schedule::run);
  m.def("run(__torch__.torch.classes.cuvil_native.Schedule schedule, Tensor[] inputs) -> Tensor[]",
        run_schedule);
  m.def("set_dnnl(int[] addresses) -> ()", set_dnnl);
}
