/* What each file of this folder gives the module's method table (module.c). */
#ifndef GEMPS_NATIVE_MODULE_H
#define GEMPS_NATIVE_MODULE_H

#include "shared.h"

/* gem_exact.c */
PyObject *gem_update(PyObject *self, PyObject *args);
/* checks.c */
PyObject *all_finite(PyObject *self, PyObject *args);
PyObject *max_abs(PyObject *self, PyObject *args);
PyObject *copy_max_abs(PyObject *self, PyObject *args);
PyObject *median_in_place(PyObject *self, PyObject *args);
PyObject *noise_window(PyObject *self, PyObject *args);
/* compact_gem.c, compact_codes.c */
void compact_codes_init(void);
PyObject *compact_gem_update(PyObject *self, PyObject *args);
PyObject *compact_rebase(PyObject *self, PyObject *args);
PyObject *compact_encode(PyObject *self, PyObject *args);
PyObject *compact_kernel(PyObject *self, PyObject *args);

#endif
