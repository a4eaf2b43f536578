// Copyright 2025 The jaxmem Authors.
//
// RaisePyError (bindings.h): a Status as the matching Python exception.

#include "bindings/bindings.h"
#include "nanobind/nanobind.h"
#include "status.h"

namespace jaxmem {

[[noreturn]] void RaisePyError(const Status& status, PyObject* type) {
  if (type == nullptr) {
    switch (status.code()) {
      case StatusCode::kInvalidArgument:
      case StatusCode::kFailedPrecondition:
        type = PyExc_ValueError;
        break;
      case StatusCode::kResourceExhausted:
        type = PyExc_MemoryError;
        break;
      case StatusCode::kUnavailable:
        type = PyExc_OSError;
        break;
      case StatusCode::kUnimplemented:
        type = PyExc_TypeError;
        break;
      case StatusCode::kOk:  // a caller bug: raising success
      case StatusCode::kInternal:
        type = PyExc_RuntimeError;
        break;
    }
  }
  PyErr_SetString(type, status.message().c_str());
  throw nanobind::python_error();
}

}  // namespace jaxmem
