/* The compiled commit core's shared parts (core.c, core_checks.c, core_objects.c): the commit's
 * fields as it holds them, the Python objects and attribute names it uses, small helpers. */
#ifndef GEMPS_CORE_H
#define GEMPS_CORE_H

#include "module.h"

#define MAX_REQUEST_ID_LENGTH 128 /* domain/ledger.py */
#define FLOAT32_DTYPE 1           /* gemps_proto.tensor_codec.FLOAT32 */
#define GRADIENT_KIND 1           /* gemps_proto.schema.PayloadKind */
#define UPDATE_KIND 2
#define NOISE_WINDOW_OFF 1 /* domain/noise.py */
#define ROUNDING (1.0 + 1.0 / 1048576.0) /* rules/overflow.py: 1 + 2**-20 */
#define EPSILON 1e-16f                   /* rules/gem.py */


/* The Python objects the core calls, set once by core_setup() (core_objects.c). */
extern PyObject *gem_rule_type, *apply_stats_type, *receipt_type, *gradient_kind, *snapshot_type, *commit_outcome_type;
extern double safe_magnitude; /* rules/overflow.py's SAFE_MAGNITUDE */

/* Attribute names, interned once. */
#define NAMES(X)                                                                                                    \
    X(rule) X(theta) X(version) X(commits_applied) X(registry) X(ledger) X(noise) X(_recording) X(on_applied)      \
        X(worker_id) X(base_version) X(kind) X(payload) X(request_id) X(sequence) X(reply_dtype) X(loss)          \
        X(num_samples) X(buffer_delta) X(payload_peak) X(held_copy) X(dtype) X(shape) X(data) X(_workers)         \
        X(client_id) X(_last) X(_legacy) X(native_step) X(momentum) X(kappa) X(pi_max) X(learning_rate_at)          \
        X(proxy) X(last_seen_theta) X(proxy_peak) X(last_seen_peak) X(_theta_peak) X(_samples) X(_stride)         \
        X(option) X(window) X(total) X(stride) X(mode) X(_applied_outcome) X(theta_bytes) X(scaling_mean) X(scaling_median) X(fraction_at_zero)         \
        X(fraction_at_max) X(proxy_energy) X(central_energy) X(_rows) X(_ring) X(commits) X(_clock) X(recent)       \
        X(last_seen) X(last_commit) X(staleness) X(stats) X(_departed) X(_pending) X(_count) X(_size) X(_small)    \
        X(_inverse_batch) X(_assumed) X(_scale) X(_total) X(default_batch) X(_close) X(_latest) X(buffers)       \
        X(_journal) X(epoch) X(snapshot) X(duplicate) X(position) X(reply)
#define DECLARE(name) extern PyObject *s_##name;
NAMES(DECLARE)
#undef DECLARE

/* The commit's fields and what the core holds for them (every object owned, released by release()). */
typedef struct {
    PyObject *rule, *theta, *registry, *ledger, *noise;
    PyObject *worker_id, *request_id, *payload_data, *record;
    PyObject *scope, *state, *window, *stats;
    double figures[6]; /* the stats' numbers: mean, median, at 0, at pi_max, proxy and central energies */
    long long version, base_version, sequence, kind;
    PyObject *loss, *num_samples;
    Py_buffer theta_view, payload_view, proxy_view, seen_view, samples_view, out_view, total_view;
    int have_theta, have_payload, have_proxy, have_seen, have_samples, have_out, have_total;
} Commit;

#define NOT_HANDLED 0
#define FAILED -1
#define HANDLED 1
#define CHECK(expression)                                                                                           \
    if ((expression) < 0) {                                                                                         \
        return FAILED;                                                                                              \
    }
#define ONLY_IF(condition)                                                                                          \
    if (!(condition)) {                                                                                             \
        return NOT_HANDLED;                                                                                         \
    }

/* core_objects.c */
int intern_names(void);
void release(Commit *c);
int attr_long(PyObject *object, PyObject *name, long long *value);
int attr_double(PyObject *object, PyObject *name, double *value);
int set_long(PyObject *object, PyObject *name, long long value);
int set_double(PyObject *object, PyObject *name, double value);
int float_view(PyObject *object, Py_buffer *view, int *held, int writable);
/* core_checks.c */
int checked(PyObject *core, PyObject *commit, Commit *c);
/* core_books.c */
PyObject *frozen_record(PyObject *type, PyObject *const *fields, PyObject *const *values, int count);
PyObject *apply_stats(const double values[6]);
int registry_committed(Commit *c, long long staleness, const double stats[6]);
int ledger_record(Commit *c, long long version, long long staleness);
int noise_commit_window(PyObject *core, Commit *c, Py_ssize_t size, Py_ssize_t *wstride, int *mode);
int noise_commit_record(Commit *c, double payload_square, double window_square);

#endif
