// tawpipe._nccl: the Python binding of the NCCL group layer (csrc/kernels/nccl_group.h).
// Buffers and streams cross as integers (data_ptr(), cuda_stream): tawpipe.comm.nccl_native
// checks tensors, devices and sizes before anything reaches this module. Every blocking call
// releases the GIL, so channel threads communicate while the compute thread runs Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/nccl_group.h"

namespace py = pybind11;
using tawpipe::nccl::Communicator;
using tawpipe::nccl::Kind;

namespace {

cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

std::vector<tawpipe::nccl::Op> parse_ops(const py::list& ops) {
  std::vector<tawpipe::nccl::Op> out;
  out.reserve(ops.size());
  for (const py::handle item : ops) {
    const auto t = item.cast<py::tuple>();
    if (t.size() != 7) throw py::value_error("an op is (kind, comm, send_ptr, recv_ptr, count, dtype, peer)");
    const int kind = t[0].cast<int>();
    if (kind < 0 || kind > static_cast<int>(Kind::kReduceScatter)) throw py::value_error("unknown op kind");
    out.push_back({static_cast<Kind>(kind), t[1].cast<Communicator*>(),
                   reinterpret_cast<const void*>(t[2].cast<uintptr_t>()), reinterpret_cast<void*>(t[3].cast<uintptr_t>()),
                   t[4].cast<size_t>(), static_cast<ncclDataType_t>(t[5].cast<int>()), t[6].cast<int>()});
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_nccl, m) {
  m.doc() = "NCCL communicators and grouped launches for tawpipe (see tawpipe.comm.nccl_native).";
  auto& error = py::register_exception<tawpipe::nccl::Error>(m, "NcclError", PyExc_RuntimeError);
  py::register_exception<tawpipe::nccl::TimeoutError>(m, "NcclTimeout", error.ptr());

  m.def("version", &tawpipe::nccl::version, "NCCL_VERSION_CODE of the loaded libnccl");
  m.def("version_string", &tawpipe::nccl::version_string);
  m.def("unique_id", [] { return py::bytes(tawpipe::nccl::unique_id()); }, "a fresh ncclUniqueId (bytes)");
  m.attr("NCCL_HEADER_VERSION") = NCCL_VERSION_CODE;

  py::dict kinds;
  for (Kind k : {Kind::kSend, Kind::kRecv, Kind::kBroadcast, Kind::kReduce, Kind::kAllReduce, Kind::kAllGather,
                 Kind::kReduceScatter}) {
    kinds[tawpipe::nccl::kind_name(k)] = static_cast<int>(k);
  }
  m.attr("kinds") = kinds;
  py::dict dtypes;
  dtypes["float32"] = static_cast<int>(ncclFloat32);
  dtypes["float64"] = static_cast<int>(ncclFloat64);
  dtypes["float16"] = static_cast<int>(ncclFloat16);
#if defined(__CUDA_BF16_TYPES_EXIST__)
  dtypes["bfloat16"] = static_cast<int>(ncclBfloat16);
#endif
  dtypes["int8"] = static_cast<int>(ncclInt8);
  dtypes["uint8"] = static_cast<int>(ncclUint8);
  dtypes["int32"] = static_cast<int>(ncclInt32);
  dtypes["int64"] = static_cast<int>(ncclInt64);
  m.attr("dtypes") = dtypes;

  py::class_<Communicator>(m, "Communicator")
      .def_static("create", &Communicator::create, py::arg("unique_id"), py::arg("nranks"), py::arg("rank"),
                  py::arg("device"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("split", &Communicator::split, py::arg("color"), py::arg("key"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("abort", &Communicator::abort, py::arg("reason"))
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("device", &Communicator::device)
      .def_property_readonly("aborted", &Communicator::aborted);

  m.def(
      "run_group",
      [](const py::list& ops, uintptr_t stream, double timeout, bool wait) {
        const std::vector<tawpipe::nccl::Op> parsed = parse_ops(ops);
        py::gil_scoped_release release;
        tawpipe::nccl::run_group(parsed, as_stream(stream), timeout, wait);
      },
      py::arg("ops"), py::arg("stream"), py::arg("timeout"), py::arg("wait"),
      "issue ops (kind, comm, send_ptr, recv_ptr, count, dtype, peer) in one NCCL group on stream");
  m.def(
      "synchronize",
      [](const std::vector<Communicator*>& comms, uintptr_t stream, double timeout) {
        py::gil_scoped_release release;
        tawpipe::nccl::synchronize(comms, as_stream(stream), timeout);
      },
      py::arg("comms"), py::arg("stream"), py::arg("timeout"));
}
