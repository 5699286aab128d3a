/* The compiled commit core's Python objects: what core_setup() hands it, the public names it
 * reads, writes and calls, and the helpers that read and write them. */
#include "core_objects.h"

/* The Python objects the core makes or passes, set once by core_setup(). */
PyObject *apply_stats_type, *receipt_type, *gradient_kind;

#define DEFINE(name) PyObject *s_##name;
NAMES(DEFINE)
#undef DEFINE

int
intern_names(void)
{
#define INTERN(name)                                                                                                \
    if (s_##name == NULL && (s_##name = PyUnicode_InternFromString(#name)) == NULL) {                              \
        return -1;                                                                                                  \
    }
    NAMES(INTERN)
#undef INTERN
    return 0;
}

PyObject *
core_setup(PyObject *self, PyObject *args)
{
    PyObject *stats, *receipt, *gradient;
    if (!PyArg_ParseTuple(args, "OOO", &stats, &receipt, &gradient) || intern_names() < 0) {
        return NULL;
    }
    Py_XSETREF(apply_stats_type, Py_NewRef(stats));
    Py_XSETREF(receipt_type, Py_NewRef(receipt));
    Py_XSETREF(gradient_kind, Py_NewRef(gradient));
    Py_RETURN_NONE;
}

void
release(Commit *c)
{
    Py_buffer *views[] = {&c->theta_view,   &c->payload_view, &c->proxy_view, &c->seen_view,
                          &c->samples_view, &c->out_view,     &c->total_view};
    const int held[] = {c->have_theta,   c->have_payload, c->have_proxy, c->have_seen,
                        c->have_samples, c->have_out,     c->have_total};
    for (size_t i = 0; i < sizeof held / sizeof held[0]; i++) {
        if (held[i]) {
            PyBuffer_Release(views[i]);
        }
    }
    Py_XDECREF(c->landed);
    Py_XDECREF(c->rule);
    Py_XDECREF(c->theta);
    Py_XDECREF(c->registry);
    Py_XDECREF(c->ledger);
    Py_XDECREF(c->noise);
    Py_XDECREF(c->worker_id);
    Py_XDECREF(c->request_id);
    Py_XDECREF(c->payload_data);
    Py_XDECREF(c->record);
    Py_XDECREF(c->scope);
    Py_XDECREF(c->state);
    Py_XDECREF(c->window);
    Py_XDECREF(c->stats);
    Py_XDECREF(c->loss);
    Py_XDECREF(c->num_samples);
}

/* An attribute as a C number: 0 on success, -1 with an exception set. */
int
attr_long(PyObject *object, PyObject *name, long long *value)
{
    PyObject *found = PyObject_GetAttr(object, name);
    if (found == NULL) {
        return -1;
    }
    *value = PyLong_AsLongLong(found);
    Py_DECREF(found);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

int
attr_double(PyObject *object, PyObject *name, double *value)
{
    PyObject *found = PyObject_GetAttr(object, name);
    if (found == NULL) {
        return -1;
    }
    *value = PyFloat_AsDouble(found);
    Py_DECREF(found);
    return *value == -1.0 && PyErr_Occurred() ? -1 : 0;
}

int
set_long(PyObject *object, PyObject *name, long long value)
{
    PyObject *number = PyLong_FromLongLong(value);
    if (number == NULL) {
        return -1;
    }
    const int done = PyObject_SetAttr(object, name, number);
    Py_DECREF(number);
    return done;
}

int
set_double(PyObject *object, PyObject *name, double value)
{
    PyObject *number = PyFloat_FromDouble(value);
    if (number == NULL) {
        return -1;
    }
    const int done = PyObject_SetAttr(object, name, number);
    Py_DECREF(number);
    return done;
}

/* A writable C-contiguous float32 view of `object`'s buffer. */
int
float_view(PyObject *object, Py_buffer *view, int *held, int writable)
{
    if (PyObject_GetBuffer(object, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    *held = 1;
    return 0;
}

/* A frozen dataclass of `type` with `fields` set from `values`, in order (its __init__ sets them
 * with object.__setattr__ past the frozen check; the generic setter is that). */
PyObject *
frozen_record(PyObject *type, PyObject *const *fields, PyObject *const *values, int count)
{
    PyObject *empty = PyTuple_New(0);
    PyObject *record = empty == NULL ? NULL : ((PyTypeObject *)type)->tp_new((PyTypeObject *)type, empty, NULL);
    Py_XDECREF(empty);
    for (int i = 0; record != NULL && i < count; i++) {
        if (PyObject_GenericSetAttr(record, fields[i], values[i]) < 0) {
            Py_CLEAR(record);
        }
    }
    return record;
}
