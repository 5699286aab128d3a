/* The commit core's common case, compiled: domain/core.py's CommitCore.commit_and_reply for a
 * commit that GEM's exact state takes in place on the compiled kernel, with the same Python objects
 * the Python core reads and writes, step for step in its order (DESIGN §1).
 *
 * core_commit(core, commit, reply, out) returns (outcome, reply's result) when it applied the
 * commit, or None, having changed nothing, for every other case: a refusal, a retry the ledger
 * answers, a late attempt, another rule, kernel or dtype, a buffer delta, a difference reply, a
 * journal to record, an update whose bound sends it out of place. The Python core then runs the
 * commit as it always does, so every refusal and rare path is the reference's own, and this
 * function only ever repeats, faster, what the Python core would have done. The tests hold the
 * two to each other bit for bit (tests/unit/test_commit_core.py).
 *
 * What it saves is the interpreter between the steps: the checks, the ledger's lookup, the bound,
 * the kernel's arguments and the statistics run here; the objects the rest of the server reads
 * (ApplyStats, Receipt, the outcome, the registry's windows, the noise estimate) are still made
 * by the Python code that defines them, called from here. */
#include "core.h"

/* GemRule._bounds: bounds on max |theta| and max |m_i| after this commit when no value it computes
 * can reach SAFE_MAGNITUDE (1), else 0 (the update runs out of place: the Python core's). Python
 * floats are doubles: the same operations in the same order give the same bounds. */
static int
bounds_of(Commit *c, double scale, double payload_peak, double theta_peak, double *theta_bound, double *proxy_bound)
{
    double momentum, kappa, pi_max, proxy_peak, last_seen_peak;
    if (attr_double(c->rule, s_momentum, &momentum) < 0 || attr_double(c->rule, s_kappa, &kappa) < 0 ||
        attr_double(c->rule, s_pi_max, &pi_max) < 0 || attr_double(c->state, s_proxy_peak, &proxy_peak) < 0 ||
        attr_double(c->state, s_last_seen_peak, &last_seen_peak) < 0) {
        return -1;
    }
    const double delta = fabs(scale) * payload_peak * ROUNDING;
    const double proxy = (fabs(momentum) * proxy_peak + delta) * ROUNDING;
    const double theta = (theta_peak + fabs(pi_max) * delta) * ROUNDING;
    double largest = delta;
    const double amplified = proxy * (1.0 > fabs(kappa) ? 1.0 : fabs(kappa));
    largest = amplified > largest ? amplified : largest;
    largest = theta_peak + last_seen_peak > largest ? theta_peak + last_seen_peak : largest;
    largest = theta > largest ? theta : largest;
    *theta_bound = theta;
    *proxy_bound = proxy;
    return largest < safe_magnitude ? 1 : 0;
}

/* GemBase.summed_stats: ApplyStats from the pass's sums and pi's sample (NaN where Delta = 0). */
static PyObject *
stats_of(Commit *c, Py_ssize_t size, const Sums *sums)
{
    const Py_ssize_t moving = (Py_ssize_t)sums->moving;
    double *figures = c->figures;
    figures[4] = sums->proxy_energy / (double)size;
    figures[5] = sums->central_energy / (double)size;
    if (moving == 0) { /* a commit of zeros: nothing moved, no pi to speak of */
        figures[0] = figures[1] = figures[2] = figures[3] = 0.0;
        return apply_stats(figures);
    }
    float *sample = (float *)c->samples_view.buf;
    Py_ssize_t count = c->samples_view.len / (Py_ssize_t)sizeof(float);
    float *kept = NULL;
    if (moving != size) { /* the parameters it moves, as numpy's samples[~isnan(samples)] */
        kept = PyMem_Malloc((size_t)(count > 0 ? count : 1) * sizeof(float));
        if (kept == NULL) {
            return PyErr_NoMemory();
        }
        Py_ssize_t found = 0;
        for (Py_ssize_t j = 0; j < count; j++) {
            if (sample[j] == sample[j]) {
                kept[found++] = sample[j];
            }
        }
        sample = kept;
        count = found;
    }
    figures[0] = sums->pi_sum / (double)moving;
    figures[1] = count ? median_of(sample, count) : figures[0];
    PyMem_Free(kept);
    figures[2] = (double)(Py_ssize_t)sums->at_zero / (double)moving;
    figures[3] = (double)(Py_ssize_t)sums->at_max / (double)moving;
    return apply_stats(figures);
}

/* GEM's in-place pass of this commit (GemBase._apply_compiled, its in-place branch) and what it
 * keeps for the next one: the peaks, the noise window's sums; then the statistics. */
static int
stepped(Commit *c, PyObject *out, double scale, double payload_peak, double theta_bound, double proxy_bound,
        double theta_peak, Py_ssize_t wstride, int mode)
{
    double momentum, kappa, pi_max;
    long long stride;
    if (attr_double(c->rule, s_momentum, &momentum) < 0 || attr_double(c->rule, s_kappa, &kappa) < 0 ||
        attr_double(c->rule, s_pi_max, &pi_max) < 0 || attr_long(c->rule, s__stride, &stride) < 0) {
        return -1;
    }
    PyObject *proxy = PyObject_GetAttr(c->state, s_proxy), *seen = PyObject_GetAttr(c->state, s_last_seen_theta);
    PyObject *samples = PyObject_GetAttr(c->rule, s__samples);
    const int viewed = proxy != NULL && seen != NULL && samples != NULL &&
                       float_view(proxy, &c->proxy_view, &c->have_proxy, 1) == 0 &&
                       float_view(seen, &c->seen_view, &c->have_seen, 1) == 0 &&
                       float_view(samples, &c->samples_view, &c->have_samples, 1) == 0 &&
                       (out == Py_None || float_view(out, &c->out_view, &c->have_out, 1) == 0);
    Py_XDECREF(proxy);
    Py_XDECREF(seen);
    Py_XDECREF(samples);
    if (!viewed) {
        return -1;
    }
    const Py_ssize_t n = c->theta_view.len / (Py_ssize_t)sizeof(float);
    if (c->proxy_view.len != c->theta_view.len || c->seen_view.len != c->theta_view.len || stride < 1 ||
        c->samples_view.len < (n + stride - 1) / stride * (Py_ssize_t)sizeof(float) ||
        (c->have_out && c->out_view.len != c->theta_view.len)) {
        PyErr_SetString(PyExc_ValueError, "core_commit: GEM's state does not fit theta");
        return -1;
    }
    Sums sums = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0f, 0.0f, 0.0, 0.0};
    int finite;
    MAYBE_RELEASE_GIL(n);
    finite = gem_in_place((float *)c->theta_view.buf, (float *)c->proxy_view.buf, (float *)c->seen_view.buf,
                          (const float *)c->payload_view.buf, n, (float)scale, (float)momentum, (float)kappa,
                          (float)pi_max, EPSILON, (Py_ssize_t)stride, (float *)c->samples_view.buf, &sums,
                          c->have_out ? (float *)c->out_view.buf : NULL,
                          c->have_total ? (float *)c->total_view.buf : NULL, wstride, mode, (float)payload_peak);
    MAYBE_RESTORE_GIL()
    if (!finite) { /* the bound let a value through that is not finite: gem.py's assert */
        PyErr_SetString(PyExc_AssertionError, "GEM's bound let through a value that is not finite");
        return -1;
    }
    c->stats = stats_of(c, n, &sums);
    if (c->stats == NULL || set_double(c->state, s_proxy_peak, proxy_bound) < 0 ||
        set_double(c->state, s_last_seen_peak, theta_peak) < 0) {
        return -1;
    }
    PyObject *bound = Py_BuildValue("(Od)", c->theta, theta_bound); /* OverflowGuard.remember_peak */
    const int kept = bound == NULL ? -1 : PyObject_SetAttr(c->rule, s__theta_peak, bound);
    Py_XDECREF(bound);
    if (kept < 0) {
        return -1;
    }
    /* CommitRule.step: the window handed back once measured (NoiseEstimator.record) */
    return c->window != NULL ? noise_commit_record(c, sums.payload_square, sums.window_square) : 0;
}

/* CommitCore._applied_outcome: this version's snapshot (the one replies still send, else a new
 * one, held weakly: CommitCore.snapshot) with this version's buffers, then the outcome. */
static PyObject *
outcome_of(PyObject *core, Commit *c, PyObject *staleness)
{
    PyObject *latest = PyObject_GetAttr(core, s__latest);
    PyObject *snapshot = latest == NULL ? NULL : PyObject_CallNoArgs(latest); /* the weakref's referent, or None */
    Py_XDECREF(latest);
    if (snapshot == NULL) {
        return NULL;
    }
    long long held_version = -1;
    if (snapshot != Py_None && attr_long(snapshot, s_version, &held_version) < 0) {
        Py_DECREF(snapshot);
        return NULL;
    }
    if (snapshot == Py_None || held_version != c->version + 1) {
        Py_DECREF(snapshot);
        snapshot = PyObject_CallFunction(snapshot_type, "L", c->version + 1);
        PyObject *reference = snapshot == NULL ? NULL : PyWeakref_NewRef(snapshot, NULL);
        const int kept = reference != NULL && PyObject_SetAttr(core, s__latest, reference) == 0;
        Py_XDECREF(reference);
        if (!kept) {
            Py_XDECREF(snapshot);
            return NULL;
        }
    }
    PyObject *buffers = PyObject_GetAttr(snapshot, s_buffers);
    if (buffers == Py_None) { /* CommitCore.with_buffers */
        Py_DECREF(buffers);
        buffers = PyObject_GetAttr(core, s_buffers);
        if (buffers != NULL && PyObject_SetAttr(snapshot, s_buffers, buffers) < 0) {
            Py_CLEAR(buffers);
        }
    }
    PyObject *journal = buffers == NULL ? NULL : PyObject_GetAttr(core, s__journal);
    PyObject *epoch = journal == NULL ? NULL : PyObject_GetAttr(journal, s_epoch);
    PyObject *position = epoch == NULL ? NULL : PyLong_FromLong(0);
    PyObject *outcome = NULL;
    if (position != NULL) {
        PyObject *fields[7] = {s_snapshot, s_staleness, s_stats, s_duplicate, s_position, s_epoch, s_reply};
        PyObject *values[7] = {snapshot, staleness, c->stats, Py_False, position, epoch, Py_None};
        outcome = frozen_record(commit_outcome_type, fields, values, 7);
    }
    Py_XDECREF(buffers);
    Py_XDECREF(journal);
    Py_XDECREF(epoch);
    Py_XDECREF(position);
    Py_DECREF(snapshot);
    return outcome;
}

/* After the step: the counts, the worker's lease and windows, the version, the receipt, the hook
 * (CommitCore.commit's tail), then the outcome and the reply (commit_and_reply's). */
static PyObject *
applied(PyObject *core, Commit *c, PyObject *reply, PyObject *out)
{
    long long applied_count;
    const long long staleness = c->version - c->base_version;
    if (attr_long(core, s_commits_applied, &applied_count) < 0 || set_long(core, s_commits_applied, applied_count + 1) < 0) {
        return NULL;
    }
    PyObject *staleness_object = PyLong_FromLongLong(staleness);
    if (staleness_object == NULL) {
        return NULL;
    }
    if (registry_committed(c, staleness, c->figures) < 0 || set_long(core, s_version, c->version + 1) < 0 ||
        ledger_record(c, c->version + 1, staleness) < 0) {
        Py_DECREF(staleness_object);
        return NULL;
    }
    PyObject *done;
    PyObject *hook = PyObject_GetAttr(core, s_on_applied);
    if (hook != NULL && hook != Py_None) {
        done = PyObject_CallFunction(hook, "L", c->version + 1);
        Py_XDECREF(done);
        if (done == NULL) {
            Py_DECREF(hook);
            Py_DECREF(staleness_object);
            return NULL;
        }
    }
    Py_XDECREF(hook);
    if (hook == NULL) {
        Py_DECREF(staleness_object);
        return NULL;
    }
    PyObject *outcome = outcome_of(core, c, staleness_object);
    Py_DECREF(staleness_object);
    if (outcome == NULL) {
        return NULL;
    }
    /* the reply's θ: the mirror the pass wrote (`out`), else θ itself, while it holds this version */
    PyObject *data = out != Py_None ? PyMemoryView_FromObject(out)
                                    : PyObject_CallMethod(core, "theta_bytes", "i", FLOAT32_DTYPE);
    PyObject *written = data == NULL ? NULL : PyObject_CallFunctionObjArgs(reply, outcome, data, NULL);
    Py_XDECREF(data);
    if (written == NULL) {
        Py_DECREF(outcome);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, outcome, written);
    Py_DECREF(outcome);
    Py_DECREF(written);
    return result;
}

/* core_commit(core, commit, reply, out): (outcome, reply's result), or None (nothing changed: the
 * Python core's to run). */
PyObject *
core_commit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || gem_rule_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "core_commit(core, commit, reply, out), after core_setup()");
        return NULL;
    }
    PyObject *core = args[0], *commit = args[1], *reply = args[2], *out = args[3];
    Commit c;
    memset(&c, 0, sizeof c);
    PyObject *result = NULL;
    int handled = checked(core, commit, &c);
    double peak = 0.0, scale = 1.0, theta_peak = 0.0, theta_bound = 0.0, proxy_bound = 0.0;
    Py_ssize_t wstride = 1;
    int mode = 0;
    const Py_ssize_t size = c.theta_view.len / (Py_ssize_t)sizeof(float);
    if (handled == HANDLED) { /* the payload's peak: measured by the wire, else here (validated_payload) */
        PyObject *measured = PyObject_GetAttr(commit, s_payload_peak);
        handled = measured == NULL ? FAILED : HANDLED;
        if (measured != NULL) {
            peak = measured == Py_None ? (double)peak_of_values((const float *)c.payload_view.buf, size)
                                       : PyFloat_AsDouble(measured);
            Py_DECREF(measured);
            handled = PyErr_Occurred() ? FAILED : isfinite(peak) ? HANDLED : NOT_HANDLED;
        }
    }
    if (handled == HANDLED && c.kind == GRADIENT_KIND) { /* -eta(version): the rule's schedule */
        PyObject *eta = PyObject_CallMethod(c.rule, "learning_rate_at", "L", c.version);
        scale = eta == NULL ? 0.0 : -PyFloat_AsDouble(eta);
        Py_XDECREF(eta);
        handled = eta == NULL || PyErr_Occurred() ? FAILED : HANDLED;
    }
    if (handled == HANDLED) { /* the worker's GEM state, and OverflowGuard.peak_of(theta) */
        PyObject *workers = PyObject_GetAttr(c.rule, s__workers);
        c.state = workers == NULL ? NULL : PyDict_GetItemWithError(workers, c.worker_id);
        Py_XINCREF(c.state);
        Py_XDECREF(workers);
        PyObject *kept = c.state == NULL ? NULL : PyObject_GetAttr(c.rule, s__theta_peak);
        handled = c.state == NULL || kept == NULL ? FAILED : HANDLED;
        if (kept != NULL) {
            if (PyTuple_Check(kept) && PyTuple_GET_SIZE(kept) == 2 && PyTuple_GET_ITEM(kept, 0) == c.theta) {
                theta_peak = PyFloat_AsDouble(PyTuple_GET_ITEM(kept, 1));
            } else {
                theta_peak = (double)peak_of_values((const float *)c.theta_view.buf, size);
            }
            Py_DECREF(kept);
            handled = PyErr_Occurred() ? FAILED : HANDLED;
        }
    }
    if (handled == HANDLED) { /* in place only (the bound holds), else the Python core, out of place */
        handled = bounds_of(&c, scale, peak, theta_peak, &theta_bound, &proxy_bound);
        handled = handled < 0 ? FAILED : handled ? HANDLED : NOT_HANDLED;
    }
    if (handled == HANDLED) { /* from here on the commit is applied: what changes is this commit's */
        if (noise_commit_window(core, &c, size, &wstride, &mode) < 0 ||
            stepped(&c, out, scale, peak, theta_bound, proxy_bound, theta_peak, wstride, mode) < 0) {
            handled = FAILED;
        } else {
            result = applied(core, &c, reply, out);
        }
    }
    release(&c);
    if (handled == NOT_HANDLED) {
        Py_RETURN_NONE;
    }
    return result;
}
