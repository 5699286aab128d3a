/* What the compiled commit core's files share (core_objects.c defines it): the commit's fields as
 * the core holds them, the Python objects and the public names it reads, writes and calls, and
 * small helpers. core.c runs the commit with core_checks.c's checks and core_books.c's
 * bookkeeping; those two include only this header, so no file depends on core.c. */
#ifndef GEMPS_CORE_OBJECTS_H
#define GEMPS_CORE_OBJECTS_H

#include "module.h"

#define MAX_REQUEST_ID_LENGTH 128 /* domain/ledger.py */
#define FLOAT32_DTYPE 1           /* gemps_proto.tensor_codec.FLOAT32 */
#define GRADIENT_KIND 1           /* gemps_proto.schema.PayloadKind */
#define UPDATE_KIND 2
#define EPSILON 1e-16f /* rules/gem.py */

/* The Python objects the core makes or passes, set once by core_setup(). */
extern PyObject *apply_stats_type, *receipt_type, *gradient_kind;

/* The public attributes and methods it uses (never a name that starts with `_`), interned once. */
#define NAMES(X)                                                                                                    \
    X(rule) X(theta) X(version) X(commits_applied) X(registry) X(ledger) X(noise) X(recording) X(worker_id)         \
        X(base_version) X(kind) X(payload) X(request_id) X(sequence) X(reply_dtype) X(loss) X(num_samples)          \
        X(buffer_delta) X(gradient_sums) X(payload_peak) X(payload_volatile) X(held_copy) X(dtype) X(shape)         \
        X(data) X(client_id) X(native_step) X(momentum) X(kappa) X(pi_max) X(proxy) X(last_seen_theta)              \
        X(proxy_peak) X(last_seen_peak) X(samples) X(sample_stride) X(total) X(stride) X(mode)                      \
        X(payload_square) X(window_square) X(applied) X(scaling_mean) X(scaling_median) X(fraction_at_zero)         \
        X(fraction_at_max) X(proxy_energy) X(central_energy) X(rows) X(ring) X(commits) X(clock) X(recent)          \
        X(heard) X(last_commit) X(staleness) X(stats) X(find) X(lookup) X(superseded) X(record) X(window)           \
        X(state_of) X(theta_bound) X(remember_peak) X(applied_outcome) X(journalled) X(landed)
#define DECLARE(name) extern PyObject *s_##name;
NAMES(DECLARE)
#undef DECLARE

/* The commit's fields and what the core holds for them (every object owned, released by release()). */
typedef struct {
    PyObject *core, *commit; /* borrowed: the caller's, and the commit as applied (it, or `landed`) */
    PyObject *landed;        /* a commit whose payload was copied out of its client's memory */
    PyObject *rule, *theta, *registry, *ledger, *noise;
    PyObject *worker_id, *request_id, *payload_data, *record;
    PyObject *scope, *state, *window, *stats;
    double figures[6]; /* the stats' numbers: mean, median, at 0, at pi_max, proxy and central energies */
    long long version, base_version, sequence, kind;
    int recording; /* a journal records the commit (CommitCore.recording) */
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

int intern_names(void);
void release(Commit *c);
int attr_long(PyObject *object, PyObject *name, long long *value);
int attr_double(PyObject *object, PyObject *name, double *value);
int set_long(PyObject *object, PyObject *name, long long value);
int set_double(PyObject *object, PyObject *name, double value);
int float_view(PyObject *object, Py_buffer *view, int *held, int writable);
PyObject *frozen_record(PyObject *type, PyObject *const *fields, PyObject *const *values, int count);

#endif
