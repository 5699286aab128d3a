/* What each file of this folder gives the module's method table (module.c). */
#ifndef GEMPS_NATIVE_MODULE_H
#define GEMPS_NATIVE_MODULE_H

#include "shared.h"

/* gem_exact.c */
PyObject *gem_update(PyObject *self, PyObject *args);
int gem_in_place(float *t, float *m, float *s, const float *u, Py_ssize_t n, float scale, float momentum, float kappa,
                 float pi_max, float epsilon, Py_ssize_t stride, float *sampled, Sums *sums, float *mirror, float *window,
                 Py_ssize_t wstride, int mode, float bound);
/* checks.c */
PyObject *all_finite(PyObject *self, PyObject *args);
PyObject *max_abs(PyObject *self, PyObject *args);
PyObject *copy_max_abs(PyObject *self, PyObject *args);
PyObject *median_in_place(PyObject *self, PyObject *args);
double median_of(float *data, Py_ssize_t n);
float peak_of_values(const float *values, Py_ssize_t n);
/* core.c */
PyObject *core_setup(PyObject *self, PyObject *args);
PyObject *core_commit(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *noise_window(PyObject *self, PyObject *args);
/* compact_gem.c, compact_codes.c */
void compact_codes_init(void);
PyObject *compact_gem_update(PyObject *self, PyObject *args);
PyObject *compact_rebase(PyObject *self, PyObject *args);
PyObject *compact_encode(PyObject *self, PyObject *args);
PyObject *compact_kernel(PyObject *self, PyObject *args);

#endif
