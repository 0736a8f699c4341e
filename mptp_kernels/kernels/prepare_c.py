"""launch._prepare in C: the launch key's codes and the launcher's arguments in one pass.

Measured on the H100 host (py-spy of bench/spy_loop.py --op mm): the Python loop over a
launch's 16-43 arguments was a third of persistent_matmul's host time. This module computes
exactly what launch._prepare computes, for the arguments it fully understands, and returns
None for anything else (an int outside int64, a dtype not numbered yet or numbered >= 63, any
Python error on the way); the caller then runs the Python _prepare, which also numbers new
dtypes. tests/kernels/test_launch.py checks that both agree on every kind of argument.

It is compiled once per source and Python with the host C compiler through Triton's own
builder (triton.runtime.build.compile_module_from_src, cached in Triton's cache directory; the
machine that runs Triton's launcher compiles the same way). Where that fails, load() returns
None and launch keeps the Python path (logged once).
"""

SRC = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *s_dtype, *s_data_ptr, *s_is_cuda;

/* prepare(args, Tensor, dtypes, extra, ints) -> (codes: bytes, extras: tuple, call: list) or None */
static PyObject *prepare(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
  if (argc != 5) {
    PyErr_SetString(PyExc_TypeError, "prepare(args, Tensor, dtypes, extra, ints)");
    return NULL;
  }
  PyObject *Tensor = argv[1], *dtypes = argv[2], *extra = argv[3];
  int ints = PyObject_IsTrue(argv[4]);
  if (ints < 0) return NULL;
  /* A tuple of its own: the items stay alive, and in place, whatever a tensor's attribute does
     to the caller's list while we read it. */
  PyObject *seq = PySequence_Tuple(argv[0]);
  if (!seq) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(seq);
  PyObject **items = &PyTuple_GET_ITEM(seq, 0);
  PyObject *codes = PyBytes_FromStringAndSize(NULL, n);
  PyObject *call = PyList_New(n);
  PyObject *extras = PyList_New(0);
  if (!codes || !call || !extras) goto fail;
  unsigned char *c = (unsigned char *)PyBytes_AS_STRING(codes);
  enum { SEEN = 16 };
  PyObject *seen_obj[SEEN], *seen_item[SEEN];
  unsigned char seen_code[SEEN];
  Py_ssize_t nseen = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *x = items[i];
    PyObject *item = NULL;
    int tensor = Py_TYPE(x) == (PyTypeObject *)Tensor;
    if (!tensor && !PyLong_CheckExact(x)) {
      tensor = PyObject_IsInstance(x, Tensor);
      if (tensor < 0) goto giveup;
    }
    if (PyLong_CheckExact(x)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
      if (overflow || (v == -1 && PyErr_Occurred())) goto giveup;
      c[i] = (unsigned char)(16 | (v == 1) | (((v & 15) == 0) << 1) |
                             ((v >= -2147483648LL && v < 2147483648LL) << 2));
      Py_INCREF(x);
      item = x;
    } else if (tensor) {
      /* a tensor met earlier in this call (padding, dummies and scatter slots repeat a few) */
      Py_ssize_t j = 0;
      while (j < nseen && seen_obj[j] != x) j++;
      if (j < nseen) {
        c[i] = seen_code[j];
        item = seen_item[j];
        Py_INCREF(item);
        PyList_SET_ITEM(call, i, item);
        continue;
      }
      PyObject *dt = PyObject_GetAttr(x, s_dtype);
      if (!dt) goto giveup;
      PyObject *d = PyDict_GetItemWithError(dtypes, dt); /* borrowed */
      Py_DECREF(dt);
      if (!d) goto giveup;
      long dv = PyLong_AsLong(d);
      if (dv < 0 || dv >= 63) goto giveup;
      PyObject *p = PyObject_CallMethodNoArgs(x, s_data_ptr);
      if (!p) goto giveup;
      unsigned long long pv = PyLong_AsUnsignedLongLong(p);
      if (pv == (unsigned long long)-1 && PyErr_Occurred()) { Py_DECREF(p); goto giveup; }
      c[i] = (unsigned char)(128 | (dv << 1) | ((pv & 15) == 0));
      int cuda = 0;
      if (ints) {
        PyObject *ic = PyObject_GetAttr(x, s_is_cuda);
        if (!ic) { Py_DECREF(p); goto giveup; }
        cuda = PyObject_IsTrue(ic);
        Py_DECREF(ic);
        if (cuda < 0) { Py_DECREF(p); goto giveup; }
      }
      if (cuda) {
        item = p; /* the address, as the Python path passes it */
      } else {
        Py_DECREF(p);
        Py_INCREF(x);
        item = x;
      }
      if (nseen < SEEN) {
        seen_obj[nseen] = x; /* borrowed: seq holds them for the whole call */
        seen_code[nseen] = c[i];
        seen_item[nseen] = item; /* borrowed: call holds it */
        nseen++;
      }
    } else if (PyFloat_CheckExact(x)) {
      c[i] = 32;
      Py_INCREF(x);
      item = x;
    } else if (PyBool_Check(x)) {
      c[i] = (unsigned char)(33 + (x == Py_True));
      Py_INCREF(x);
      item = x;
    } else {
      c[i] = 255;
      PyObject *e = PyObject_CallOneArg(extra, x);
      if (!e) goto giveup;
      int r = PyList_Append(extras, e);
      Py_DECREF(e);
      if (r < 0) goto giveup;
      Py_INCREF(x);
      item = x;
    }
    PyList_SET_ITEM(call, i, item);
  }
  Py_DECREF(seq);
  PyObject *ex = PyList_AsTuple(extras);
  Py_DECREF(extras);
  if (!ex) { Py_DECREF(codes); Py_DECREF(call); return NULL; }
  PyObject *out = PyTuple_Pack(3, codes, ex, call);
  Py_DECREF(codes); Py_DECREF(ex); Py_DECREF(call);
  return out;
giveup:
  if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) goto fail; /* KeyboardInterrupt, ... */
  PyErr_Clear();
  Py_DECREF(seq);
  Py_XDECREF(codes); Py_XDECREF(call); Py_XDECREF(extras);
  Py_RETURN_NONE;
fail:
  Py_DECREF(seq);
  Py_XDECREF(codes); Py_XDECREF(call); Py_XDECREF(extras);
  return NULL;
}

static PyMethodDef methods[] = {
  {"prepare", (PyCFunction)(void (*)(void))prepare, METH_FASTCALL, "launch._prepare in C"},
  {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mptp_prepare", NULL, -1, methods};

PyMODINIT_FUNC PyInit_mptp_prepare(void) {
  s_dtype = PyUnicode_InternFromString("dtype");
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_is_cuda = PyUnicode_InternFromString("is_cuda");
  if (!s_dtype || !s_data_ptr || !s_is_cuda) return NULL;
  return PyModule_Create(&module);
}
"""


def load():
    """The compiled prepare function, or raises (no C compiler, no Python headers, ...)."""
    from triton.runtime.build import compile_module_from_src

    return compile_module_from_src(SRC, "mptp_prepare").prepare
