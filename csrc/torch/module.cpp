// `import tawpipe._C` loads this library, whose static initialisers register the tawpipe ops
// with the torch dispatcher. The Python module itself is empty (no pybind11 needed).
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "tawpipe._C",
                               "Registers the torch.ops.tawpipe operators.", -1, nullptr};
  return PyModule_Create(&module);
}
