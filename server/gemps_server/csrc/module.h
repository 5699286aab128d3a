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
PyObject *noise_window(PyObject *self, PyObject *args);
/* gem_rule.c: GEM's bound for an in-place pass (the rule's options, the commit's scale and
 * payload peak, the bounds on max |theta|, max |m_i| and max |s_i|) and a pass's statistics */
typedef struct {
    double scale, payload_peak, theta_peak, momentum, kappa, pi_max, proxy_peak, last_seen_peak;
} GemBoundsOf;
int gem_in_place_bounds(const GemBoundsOf *of, double *theta_bound, double *proxy_bound);
int gem_figures(float *samples, Py_ssize_t count, Py_ssize_t size, const Sums *sums, double figures[6]);
PyObject *gem_bounds(PyObject *self, PyObject *args);
PyObject *gem_stats(PyObject *self, PyObject *args);
/* adamw.c: the adamw rule's passes */
PyObject *adamw_sum(PyObject *self, PyObject *args);
PyObject *adamw_step(PyObject *self, PyObject *args);
/* core.c, core_objects.c */
PyObject *core_setup(PyObject *self, PyObject *args);
PyObject *core_commit(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* compact_gem.c, compact_codes.c */
void compact_codes_init(void);
PyObject *compact_gem_update(PyObject *self, PyObject *args);
PyObject *compact_rebase(PyObject *self, PyObject *args);
PyObject *compact_encode(PyObject *self, PyObject *args);
PyObject *compact_kernel(PyObject *self, PyObject *args);

#endif
