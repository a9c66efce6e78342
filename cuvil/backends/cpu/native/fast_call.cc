// A Python callable per native schedule, called with CPython's vectorcall convention: the inputs
// unpacked to tensors, the schedule run with the GIL released, the outputs wrapped, and nothing
// else (a TorchScript method call builds a stack and matches a schema first, some microseconds a
// tiny model's whole call notices). cuvil/backends/cpu/fast_call.py builds and loads it.
//
// ``cuvil_schedule_caller(run, target)`` returns a new builtin function bound to one schedule
// (``target``: the address ``Schedule.address()`` gave, ``run``: plan_loop's
// ``cuvil_schedule_run``); the function holds a reference on the schedule, so the schedule lives
// as long as any caller of it.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <string>
#include <vector>

namespace {

using Run = void (*)(const void *, const std::vector<at::Tensor> *, std::vector<at::Tensor> *);

struct Bound {
  Run run;
  c10::intrusive_ptr_target *schedule;
};

const char *const CAPSULE = "cuvil.schedule";

void release(PyObject *capsule) {
  auto bound = static_cast<Bound *>(PyCapsule_GetPointer(capsule, CAPSULE));
  if (bound == nullptr) return;
  c10::raw::intrusive_ptr::decref(bound->schedule);
  delete bound;
}

// the exception's Python class, as torch's own bindings map c10's errors
PyObject *python_error(const std::exception_ptr &thrown, std::string &message) {
  try {
    std::rethrow_exception(thrown);
  } catch (const c10::IndexError &error) {
    message = error.what_without_backtrace();
    return PyExc_IndexError;
  } catch (const c10::ValueError &error) {
    message = error.what_without_backtrace();
    return PyExc_ValueError;
  } catch (const c10::TypeError &error) {
    message = error.what_without_backtrace();
    return PyExc_TypeError;
  } catch (const c10::NotImplementedError &error) {
    message = error.what_without_backtrace();
    return PyExc_NotImplementedError;
  } catch (const c10::Error &error) {
    message = error.what_without_backtrace();
    return PyExc_RuntimeError;
  } catch (const std::exception &error) {
    message = error.what();
    return PyExc_RuntimeError;
  }
}

PyObject *call(PyObject *capsule, PyObject *const *args, Py_ssize_t count) {
  if (count != 1) {
    PyErr_SetString(PyExc_TypeError, "a schedule takes one sequence of tensors");
    return nullptr;
  }
  auto bound = static_cast<Bound *>(PyCapsule_GetPointer(capsule, CAPSULE));
  if (bound == nullptr) return nullptr;
  PyObject *items = PySequence_Fast(args[0], "a schedule takes one sequence of tensors");
  if (items == nullptr) return nullptr;
  const Py_ssize_t size = PySequence_Fast_GET_SIZE(items);
  std::vector<at::Tensor> inputs;
  inputs.reserve(size);
  for (Py_ssize_t i = 0; i < size; i++) {
    PyObject *item = PySequence_Fast_GET_ITEM(items, i);
    if (!THPVariable_Check(item)) {
      Py_DECREF(items);
      PyErr_Format(PyExc_TypeError, "input %zd is not a tensor", i);
      return nullptr;
    }
    inputs.push_back(THPVariable_Unpack(item));
  }
  Py_DECREF(items);
  std::vector<at::Tensor> outputs;
  std::exception_ptr thrown;
  Py_BEGIN_ALLOW_THREADS;
  try {
    bound->run(bound->schedule, &inputs, &outputs);
  } catch (...) {
    thrown = std::current_exception();
  }
  inputs.clear();  // the references the call took, dropped before the GIL comes back
  Py_END_ALLOW_THREADS;
  if (thrown) {
    std::string message;
    PyObject *kind = python_error(thrown, message);
    PyErr_SetString(kind, message.c_str());
    return nullptr;
  }
  PyObject *results = PyList_New(static_cast<Py_ssize_t>(outputs.size()));
  if (results == nullptr) return nullptr;
  for (size_t i = 0; i < outputs.size(); i++) {
    PyObject *wrapped = THPVariable_Wrap(std::move(outputs[i]));
    if (wrapped == nullptr) {
      Py_DECREF(results);
      return nullptr;
    }
    PyList_SET_ITEM(results, static_cast<Py_ssize_t>(i), wrapped);
  }
  return results;
}

PyMethodDef method = {"schedule", reinterpret_cast<PyCFunction>(reinterpret_cast<void *>(call)),
                      METH_FASTCALL, "Run the native schedule on a sequence of tensors."};

}  // namespace

extern "C" PyObject *cuvil_schedule_caller(void *run, void *target) {
  auto schedule = static_cast<c10::intrusive_ptr_target *>(target);
  c10::raw::intrusive_ptr::incref(schedule);
  auto bound = new Bound{reinterpret_cast<Run>(run), schedule};
  PyObject *capsule = PyCapsule_New(bound, CAPSULE, release);
  if (capsule == nullptr) {
    c10::raw::intrusive_ptr::decref(schedule);
    delete bound;
    return nullptr;
  }
  PyObject *function = PyCFunction_New(&method, capsule);
  Py_DECREF(capsule);
  return function;
}
