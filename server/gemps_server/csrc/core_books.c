/* The compiled commit core's bookkeeping: a worker's lease and counts and the recent windows
 * (WorkerRegistry.committed, RecentWindow.add: the same operations in the same order, on the
 * windows' public `rows` and `ring`), the frozen records it makes (ApplyStats, Receipt) as their
 * dataclasses' own __init__ would; the ledger's receipt and the noise estimate's window through
 * their own public methods (CommitLedger.record, NoiseEstimator.window, NoiseWindow.applied). */
#include "core_books.h"

#define BUCKETS 12 /* domain/recent.py */
#define SUMS 9
#define BUCKET_SECONDS (60.0 / BUCKETS) /* gemps_proto.status.RECENT_SECONDS / BUCKETS */

/* ApplyStats(scaling_mean, scaling_median, fraction_at_zero, fraction_at_max, proxy_energy, central_energy) */
PyObject *
apply_stats(const double values[6])
{
    PyObject *fields[6] = {s_scaling_mean, s_scaling_median, s_fraction_at_zero,
                           s_fraction_at_max, s_proxy_energy, s_central_energy};
    PyObject *numbers[6] = {NULL};
    PyObject *stats = NULL;
    int made = 1;
    for (int i = 0; i < 6; i++) {
        made = made && (numbers[i] = PyFloat_FromDouble(values[i])) != NULL;
    }
    if (made) {
        stats = frozen_record(apply_stats_type, fields, numbers, 6);
    }
    for (int i = 0; i < 6; i++) {
        Py_XDECREF(numbers[i]);
    }
    return stats;
}

/* Python's float floor division (Objects/floatobject.c, float_floor_div): `now // BUCKET_SECONDS`. */
static double
floor_divided(double vx, double wx)
{
    double mod = fmod(vx, wx);
    double div = (vx - mod) / wx;
    if (mod && (wx < 0) != (mod < 0)) {
        div -= 1.0;
    }
    if (div) {
        double floored = floor(div);
        if (div - floored > 0.5) {
            floored += 1.0;
        }
        return floored;
    }
    return copysign(0.0, vx / wx);
}

/* RecentWindow.add of the window `recent` (its rows and ring, float64 and int64 arrays). */
static int
recent_add(PyObject *recent, double now, long long staleness, PyObject *loss, long long samples, const double stats[6])
{
    PyObject *rows_object = PyObject_GetAttr(recent, s_rows), *ring_object = PyObject_GetAttr(recent, s_ring);
    Py_buffer rows_view, ring_view;
    int rows_held = 0, ring_held = 0, done = -1;
    if (rows_object != NULL && ring_object != NULL &&
        PyObject_GetBuffer(rows_object, &rows_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0 && (rows_held = 1) &&
        PyObject_GetBuffer(ring_object, &ring_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0 && (ring_held = 1)) {
        if (rows_view.len != BUCKETS * SUMS * (Py_ssize_t)sizeof(double) || ring_view.len != 2 * 8) {
            PyErr_SetString(PyExc_ValueError, "core_commit: a recent window of another shape");
        } else {
            double *rows = (double *)rows_view.buf;
            int64_t *ring = (int64_t *)ring_view.buf;
            const double index = floor_divided(now, BUCKET_SECONDS);
            int64_t newest = ring[0];
            if (!ring[1] || rows[newest * SUMS] != index) {
                newest = (newest + 1) % BUCKETS;
                memset(rows + newest * SUMS, 0, SUMS * sizeof(double));
                rows[newest * SUMS] = index;
                ring[0] = newest;
                ring[1] = ring[1] + 1 < BUCKETS ? ring[1] + 1 : BUCKETS;
            }
            double *row = rows + newest * SUMS;
            row[1] += 1;
            row[2] += (double)samples;
            if (loss != Py_None) {
                const double value = PyFloat_AsDouble(loss);
                if (isfinite(value)) {
                    row[3] += 1;
                    row[4] += value;
                }
            }
            row[5] += (double)staleness;
            row[6] += stats[0];
            row[7] += stats[2];
            row[8] += stats[3];
            done = PyErr_Occurred() ? -1 : 0;
        }
    }
    if (rows_held) {
        PyBuffer_Release(&rows_view);
    }
    if (ring_held) {
        PyBuffer_Release(&ring_view);
    }
    Py_XDECREF(rows_object);
    Py_XDECREF(ring_object);
    return done;
}

/* WorkerRegistry.committed(record, staleness, loss, num_samples, stats). */
int
registry_committed(Commit *c, long long staleness, const double stats[6])
{
    long long commits, samples = 0;
    if (attr_long(c->record, s_commits, &commits) < 0 || set_long(c->record, s_commits, commits + 1) < 0) {
        return -1;
    }
    if (c->num_samples != Py_None && (samples = PyLong_AsLongLong(c->num_samples)) == -1 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *clock = PyObject_GetAttr(c->registry, s_clock);
    PyObject *now = clock == NULL ? NULL : PyObject_CallNoArgs(clock);
    Py_XDECREF(clock);
    if (now == NULL) {
        return -1;
    }
    const double at = PyFloat_AsDouble(now);
    PyObject *window = PyObject_GetAttr(c->record, s_recent), *server = PyObject_GetAttr(c->registry, s_recent);
    PyObject *heard = NULL; /* WorkerRecord.heard(now): its lease and its pace (a restart supersedes by it) */
    if (window != NULL && server != NULL && !PyErr_Occurred()) {
        heard = PyObject_CallMethodOneArg(c->record, s_heard, now);
    }
    const int done = heard != NULL && PyObject_SetAttr(c->record, s_last_commit, now) == 0 &&
                     recent_add(window, at, staleness, c->loss, samples, stats) == 0 &&
                     recent_add(server, at, staleness, c->loss, samples, stats) == 0;
    Py_XDECREF(heard);
    Py_XDECREF(window);
    Py_XDECREF(server);
    Py_DECREF(now);
    return done ? 0 : -1;
}

/* CommitLedger.record(scope, request_id, Receipt(version, staleness, stats, sequence)). */
int
ledger_record(Commit *c, long long version, long long staleness)
{
    PyObject *fields[4] = {s_version, s_staleness, s_stats, s_sequence};
    PyObject *values[4] = {PyLong_FromLongLong(version), PyLong_FromLongLong(staleness), Py_NewRef(c->stats),
                           PyLong_FromLongLong(c->sequence)};
    PyObject *receipt = values[0] && values[1] && values[3] ? frozen_record(receipt_type, fields, values, 4) : NULL;
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(values[i]);
    }
    PyObject *done = receipt == NULL ? NULL : PyObject_CallMethodObjArgs(c->ledger, s_record, c->scope,
                                                                         c->request_id, receipt, NULL);
    Py_XDECREF(receipt);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* NoiseEstimator.window for a gradient commit that will be applied here (none for an update, which
 * the estimate does not measure): the window's buffer, stride and mode, or none when it is off. */
int
noise_window_of(Commit *c, Py_ssize_t size, Py_ssize_t *wstride, int *mode)
{
    long long stride, chosen;
    *wstride = 1;
    *mode = WINDOW_START;
    if (c->kind != GRADIENT_KIND) {
        return 0;
    }
    const Py_ssize_t registered = PyObject_Length(c->registry);
    PyObject *parameters = registered < 0 ? NULL : PyLong_FromSsize_t(size);
    PyObject *workers = parameters == NULL ? NULL : PyLong_FromSsize_t(registered);
    c->noise = workers == NULL ? NULL : PyObject_GetAttr(c->core, s_noise);
    c->window = c->noise == NULL ? NULL
                                 : PyObject_CallMethodObjArgs(c->noise, s_window, gradient_kind, parameters, workers,
                                                              c->num_samples, NULL);
    Py_XDECREF(parameters);
    Py_XDECREF(workers);
    if (c->window == NULL) {
        return -1;
    }
    if (c->window == Py_None) {
        Py_CLEAR(c->window);
        return 0;
    }
    PyObject *total = PyObject_GetAttr(c->window, s_total);
    const int viewed = total != NULL && float_view(total, &c->total_view, &c->have_total, 1) == 0;
    Py_XDECREF(total);
    if (!viewed || attr_long(c->window, s_stride, &stride) < 0 || attr_long(c->window, s_mode, &chosen) < 0) {
        return -1;
    }
    if (stride < 1 || chosen < WINDOW_START || chosen > WINDOW_LAST ||
        c->total_view.len != window_size(size, (Py_ssize_t)stride) * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "core_commit: a noise window that does not fit theta");
        return -1;
    }
    *wstride = (Py_ssize_t)stride;
    *mode = (int)chosen;
    return 0;
}

/* The window's sums measured in the pass, handed back (CommitRule.step: window.applied(window)). */
int
noise_measured(Commit *c, double payload_square, double window_square)
{
    if (set_double(c->window, s_payload_square, payload_square) < 0 ||
        set_double(c->window, s_window_square, window_square) < 0) {
        return -1;
    }
    PyObject *applied = PyObject_GetAttr(c->window, s_applied);
    PyObject *done = applied == NULL ? NULL : PyObject_CallOneArg(applied, c->window);
    Py_XDECREF(applied);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}
