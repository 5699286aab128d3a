/* The compiled commit core's bookkeeping, each the Python code it names, step for step: a
 * worker's lease and counts and the recent windows (WorkerRegistry.committed, RecentWindow.add),
 * the ledger's receipt (CommitLedger.record), the noise estimate's window (NoiseEstimator.window
 * and record), and the frozen records it makes (ApplyStats, Receipt) as their dataclasses' own
 * __init__ would. */
#include "core.h"

#define BUCKETS 12 /* domain/recent.py */
#define SUMS 9
#define BUCKET_SECONDS (60.0 / BUCKETS) /* gemps_proto.status.RECENT_SECONDS / BUCKETS */

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
    PyObject *rows_object = PyObject_GetAttr(recent, s__rows), *ring_object = PyObject_GetAttr(recent, s__ring);
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
    PyObject *clock = PyObject_GetAttr(c->registry, s__clock);
    PyObject *now = clock == NULL ? NULL : PyObject_CallNoArgs(clock);
    Py_XDECREF(clock);
    if (now == NULL) {
        return -1;
    }
    const double at = PyFloat_AsDouble(now);
    PyObject *window = PyObject_GetAttr(c->record, s_recent), *server = PyObject_GetAttr(c->registry, s_recent);
    const int done = window != NULL && server != NULL && !PyErr_Occurred() &&
                     PyObject_SetAttr(c->record, s_last_seen, now) == 0 &&
                     PyObject_SetAttr(c->record, s_last_commit, now) == 0 &&
                     recent_add(window, at, staleness, c->loss, samples, stats) == 0 &&
                     recent_add(server, at, staleness, c->loss, samples, stats) == 0;
    Py_XDECREF(window);
    Py_XDECREF(server);
    Py_DECREF(now);
    return done ? 0 : -1;
}

/* CommitLedger.record(scope, request_id, Receipt(version, staleness, stats, sequence)); the
 * checks made sure a numbered receipt is kept as it is (no earlier receipt numbers it higher). */
int
ledger_record(Commit *c, long long version, long long staleness)
{
    if (!PyUnicode_GET_LENGTH(c->request_id)) {
        return 0;
    }
    PyObject *fields[4] = {s_version, s_staleness, s_stats, s_sequence};
    PyObject *values[4] = {PyLong_FromLongLong(version), PyLong_FromLongLong(staleness), Py_NewRef(c->stats),
                           PyLong_FromLongLong(c->sequence)};
    PyObject *receipt = values[0] && values[1] && values[3] ? frozen_record(receipt_type, fields, values, 4) : NULL;
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(values[i]);
    }
    PyObject *entry = receipt == NULL ? NULL : PyTuple_Pack(2, c->request_id, receipt);
    Py_XDECREF(receipt);
    PyObject *last = entry == NULL ? NULL : PyObject_GetAttr(c->ledger, s__last);
    PyObject *departed = last == NULL ? NULL : PyObject_GetAttr(c->ledger, s__departed);
    int done = departed != NULL && PyDict_SetItem(last, c->scope, entry) == 0 ? 0 : -1;
    if (done == 0) { /* `_departed.pop(scope, None)`: a scope holds a worker again */
        const int held = PyDict_Contains(departed, c->scope);
        PyObject *popped = held == 1 ? PyObject_CallMethod(departed, "pop", "O", c->scope) : NULL;
        done = held < 0 || (held == 1 && popped == NULL) ? -1 : 0;
        Py_XDECREF(popped);
    }
    Py_XDECREF(entry);
    Py_XDECREF(last);
    Py_XDECREF(departed);
    return done;
}

/* NoiseEstimator.window for this commit (a gradient's, once it will be applied here): in a window
 * under way, its next commit here; a window to start (or to start over, after a refused commit) by
 * the estimator's own code, which sizes and allocates it. Its buffer, stride and mode; none when
 * the estimate is off or for an update. */
int
noise_commit_window(PyObject *core, Commit *c, Py_ssize_t size, Py_ssize_t *wstride, int *mode)
{
    long long option, pending, count, chosen_size, stride, chosen;
    *wstride = 1;
    *mode = WINDOW_START;
    c->noise = PyObject_GetAttr(core, s_noise);
    if (c->noise == NULL || attr_long(c->noise, s_option, &option) < 0) {
        return -1;
    }
    if (option == NOISE_WINDOW_OFF || c->kind != GRADIENT_KIND) {
        return 0;
    }
    if (attr_long(c->noise, s__pending, &pending) < 0 || attr_long(c->noise, s__count, &count) < 0 ||
        attr_long(c->noise, s__size, &chosen_size) < 0) {
        return -1;
    }
    PyObject *total;
    if (pending || count == 0) { /* the estimator starts the window: NoiseWindow(total, stride, mode, ...) */
        const Py_ssize_t registered = PyObject_Length(c->registry);
        PyObject *parameters = registered < 0 ? NULL : PyLong_FromSsize_t(size);
        PyObject *workers = parameters == NULL ? NULL : PyLong_FromSsize_t(registered);
        c->window = workers == NULL ? NULL
                                    : PyObject_CallMethodObjArgs(c->noise, s_window, gradient_kind, parameters, workers,
                                                                 c->num_samples, NULL);
        Py_XDECREF(parameters);
        Py_XDECREF(workers);
        if (c->window == NULL || attr_long(c->window, s_stride, &stride) < 0 ||
            attr_long(c->window, s_mode, &chosen) < 0) {
            return -1;
        }
        total = PyObject_GetAttr(c->window, s_total);
    } else { /* its next commit: WINDOW_ADD, or WINDOW_LAST for its last */
        if (PyObject_SetAttr(c->noise, s__pending, Py_True) < 0 || attr_long(c->noise, s__stride, &stride) < 0) {
            return -1;
        }
        chosen = count == chosen_size - 1 ? WINDOW_LAST : WINDOW_ADD;
        c->window = Py_NewRef(Py_True); /* a window is under way: noise_commit_record closes it */
        total = PyObject_GetAttr(c->noise, s__total);
    }
    if (total == NULL) {
        return -1;
    }
    const int viewed = float_view(total, &c->total_view, &c->have_total, 1);
    Py_DECREF(total);
    if (viewed < 0) {
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

/* NoiseEstimator.record: the commit of the window under way is applied and its sums measured. */
int
noise_commit_record(Commit *c, double payload_square, double window_square)
{
    double small, inverse_batch, scale;
    long long assumed, count, size, batch = 0, default_batch;
    PyObject *noise = c->noise;
    if (attr_double(noise, s__small, &small) < 0 || attr_double(noise, s__inverse_batch, &inverse_batch) < 0 ||
        attr_double(noise, s__scale, &scale) < 0 || attr_long(noise, s__assumed, &assumed) < 0 ||
        attr_long(noise, s__count, &count) < 0 || attr_long(noise, s__size, &size) < 0 ||
        attr_long(noise, s_default_batch, &default_batch) < 0) {
        return -1;
    }
    if (c->num_samples != Py_None && (batch = PyLong_AsLongLong(c->num_samples)) == -1 && PyErr_Occurred()) {
        return -1;
    }
    count += 1;
    const int closes = count == size;
    if (PyObject_SetAttr(noise, s__pending, Py_False) < 0 || set_double(noise, s__small, small + payload_square * scale) < 0 ||
        set_double(noise, s__inverse_batch, inverse_batch + 1.0 / (double)(batch ? batch : default_batch)) < 0 ||
        set_long(noise, s__assumed, assumed + !batch) < 0 || set_long(noise, s__count, closes ? 0 : count) < 0) {
        return -1;
    }
    if (closes) {
        PyObject *closed = PyObject_CallMethod(noise, "_close", "d", window_square * scale);
        if (closed == NULL) {
            return -1;
        }
        Py_DECREF(closed);
    }
    return 0;
}
