/* The commit core's common case, compiled: domain/core.py's CommitCore.commit_and_reply for a
 * commit that GEM's exact state takes in place on the compiled kernel, with the same Python objects
 * the Python core reads and writes, step for step in its order (DESIGN §1). It reads, writes and
 * calls only their public names (core_objects.h lists them): the worker's GEM state comes from
 * GemRule.state_of, the registry, the ledger and the noise estimate answer through their own
 * methods, and GEM's bound and statistics are gem_rule.c's, the ones GemRule's compiled path runs.
 *
 * core_commit(core, commit, reply, out) returns (outcome, reply's result) when it applied the
 * commit, or None, having changed nothing, for every other case: a refusal, a retry the ledger
 * answers, a late attempt, another rule, kernel or dtype, a buffer delta, a difference reply, a
 * an update whose bound sends it out of place. The Python core then runs the commit as it always
 * does, so every refusal and rare path is the reference's own, and this function only ever repeats,
 * faster, what the Python core would have done. The tests hold the two to each other bit for bit
 * (tests/unit/test_commit_core.py). A replicated primary journals what it applied here as the
 * Python core does (CommitCore.journalled), and a backup replays its primary's commits through here
 * too (CommitCore.replay, no reply): lone, primary and backup run the same compiled path.
 *
 * What it saves is the interpreter between the steps: the checks, the bound, the kernel's
 * arguments, the statistics and the recent windows run here; the outcome, the ledger's receipt,
 * the journal and the noise estimate are kept by the Python code that defines them, called from here. */
#include "core_books.h"
#include "core_checks.h"

/* GEM's in-place pass of this commit (GemRule.step_scaled, its in-place branch) and what it keeps
 * for the next one: the peaks (the worker's, and the bound on θ through OverflowGuard.remember_peak),
 * the noise window's sums; then the statistics. */
static int
stepped(Commit *c, PyObject *out, const GemBoundsOf *of, double theta_bound, double proxy_bound, Py_ssize_t wstride,
        int mode)
{
    long long stride;
    if (attr_long(c->rule, s_sample_stride, &stride) < 0) {
        return -1;
    }
    PyObject *proxy = PyObject_GetAttr(c->state, s_proxy), *seen = PyObject_GetAttr(c->state, s_last_seen_theta);
    PyObject *samples = PyObject_GetAttr(c->rule, s_samples);
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
                          (const float *)c->payload_view.buf, n, (float)of->scale, (float)of->momentum,
                          (float)of->kappa, (float)of->pi_max, EPSILON, (Py_ssize_t)stride,
                          (float *)c->samples_view.buf, &sums, c->have_out ? (float *)c->out_view.buf : NULL,
                          c->have_total ? (float *)c->total_view.buf : NULL, wstride, mode, (float)of->payload_peak);
    MAYBE_RESTORE_GIL()
    if (!finite) { /* the bound let a value through that is not finite: gem.py's assert */
        PyErr_SetString(PyExc_AssertionError, "GEM's bound let through a value that is not finite");
        return -1;
    }
    if (gem_figures((float *)c->samples_view.buf, c->samples_view.len / (Py_ssize_t)sizeof(float), n, &sums,
                    c->figures) < 0 ||
        (c->stats = apply_stats(c->figures)) == NULL || set_double(c->state, s_proxy_peak, proxy_bound) < 0 ||
        set_double(c->state, s_last_seen_peak, of->theta_peak) < 0) {
        return -1;
    }
    PyObject *bound = PyFloat_FromDouble(theta_bound);
    PyObject *kept = bound == NULL ? NULL : PyObject_CallMethodObjArgs(c->rule, s_remember_peak, c->theta, bound, NULL);
    Py_XDECREF(bound);
    Py_XDECREF(kept);
    if (kept == NULL) {
        return -1;
    }
    return c->window != NULL ? noise_measured(c, sums.payload_square, sums.window_square) : 0;
}

/* After the step: the counts, the worker's lease and windows, the version, the receipt,
 * the journal's entry (CommitCore.commit's tail), then the outcome (CommitCore.applied_outcome) and
 * the reply (none for a backup's replay: `reply` None). */
static PyObject *
applied(Commit *c, PyObject *reply, PyObject *out)
{
    PyObject *core = c->core;
    long long applied_count;
    const long long staleness = c->version - c->base_version;
    if (attr_long(core, s_commits_applied, &applied_count) < 0 ||
        set_long(core, s_commits_applied, applied_count + 1) < 0 || registry_committed(c, staleness, c->figures) < 0 ||
        set_long(core, s_version, c->version + 1) < 0 || ledger_record(c, c->version + 1, staleness) < 0) {
        return NULL;
    }
    PyObject *position = c->recording ? PyObject_CallMethodOneArg(core, s_journalled, c->commit) : PyLong_FromLong(0);
    PyObject *staleness_object = position == NULL ? NULL : PyLong_FromLongLong(staleness);
    PyObject *outcome = staleness_object == NULL ? NULL
                                                 : PyObject_CallMethodObjArgs(core, s_applied_outcome, staleness_object,
                                                                              c->stats, position, NULL);
    Py_XDECREF(position);
    Py_XDECREF(staleness_object);
    if (outcome == NULL || reply == Py_None) {
        return outcome == NULL ? NULL : Py_BuildValue("(NO)", outcome, Py_None);
    }
    /* the reply's θ: the mirror the pass wrote (`out`), else θ itself, while it holds this version */
    PyObject *data = out != Py_None ? PyMemoryView_FromObject(out)
                                    : PyObject_CallMethod(core, "theta_bytes", "i", FLOAT32_DTYPE);
    PyObject *written = data == NULL ? NULL : PyObject_CallFunctionObjArgs(reply, outcome, data, NULL);
    Py_XDECREF(data);
    PyObject *result = written == NULL ? NULL : PyTuple_Pack(2, outcome, written);
    Py_DECREF(outcome);
    Py_XDECREF(written);
    return result;
}

/* The commit's scale (-eta(version) for a gradient: the rule's schedule), the payload's peak
 * (measured by the wire, else here: validated_payload's), the worker's GEM state and the bound on
 * max |θ| (OverflowGuard.peak_of): what GEM's bound reads. NOT_HANDLED for a payload not finite. */
static int
bound_inputs(Commit *c, PyObject *commit, GemBoundsOf *of)
{
    const Py_ssize_t size = c->theta_view.len / (Py_ssize_t)sizeof(float);
    PyObject *measured = PyObject_GetAttr(commit, s_payload_peak);
    CHECK(measured == NULL ? -1 : 0);
    of->payload_peak = measured == Py_None ? (double)peak_of_values((const float *)c->payload_view.buf, size)
                                           : PyFloat_AsDouble(measured);
    Py_DECREF(measured);
    CHECK(PyErr_Occurred() ? -1 : 0);
    ONLY_IF(isfinite(of->payload_peak));
    of->scale = 1.0;
    if (c->kind == GRADIENT_KIND) {
        PyObject *eta = PyObject_CallMethod(c->rule, "learning_rate_at", "L", c->version);
        of->scale = eta == NULL ? 0.0 : -PyFloat_AsDouble(eta);
        Py_XDECREF(eta);
        CHECK(eta == NULL || PyErr_Occurred() ? -1 : 0);
    }
    c->state = PyObject_CallMethodOneArg(c->rule, s_state_of, c->worker_id);
    PyObject *kept = c->state == NULL ? NULL : PyObject_CallMethodOneArg(c->rule, s_theta_bound, c->theta);
    CHECK(kept == NULL ? -1 : 0);
    of->theta_peak = kept == Py_None ? (double)peak_of_values((const float *)c->theta_view.buf, size)
                                     : PyFloat_AsDouble(kept);
    Py_DECREF(kept);
    CHECK(PyErr_Occurred() ? -1 : 0);
    CHECK(attr_double(c->rule, s_momentum, &of->momentum) < 0 || attr_double(c->rule, s_kappa, &of->kappa) < 0 ||
                  attr_double(c->rule, s_pi_max, &of->pi_max) < 0 ||
                  attr_double(c->state, s_proxy_peak, &of->proxy_peak) < 0 ||
                  attr_double(c->state, s_last_seen_peak, &of->last_seen_peak) < 0
              ? -1
              : 0);
    return HANDLED;
}

/* core_commit(core, commit, reply, out): (outcome, reply's result), or None (nothing changed: the
 * Python core's to run); reply None: no reply, (outcome, None). */
PyObject *
core_commit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || apply_stats_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "core_commit(core, commit, reply, out), after core_setup()");
        return NULL;
    }
    PyObject *commit = args[1], *reply = args[2], *out = args[3];
    Commit c;
    memset(&c, 0, sizeof c);
    c.core = args[0];
    PyObject *result = NULL;
    GemBoundsOf of;
    double theta_bound = 0.0, proxy_bound = 0.0;
    int handled = checked(c.core, commit, &c);
    if (handled == HANDLED) {
        handled = bound_inputs(&c, c.commit, &of);
    }
    if (handled == HANDLED) { /* in place only (the bound holds), else the Python core, out of place */
        handled = gem_in_place_bounds(&of, &theta_bound, &proxy_bound) ? HANDLED : NOT_HANDLED;
    }
    if (handled == HANDLED) { /* from here on the commit is applied: what changes is this commit's */
        Py_ssize_t wstride = 1;
        int mode = WINDOW_START;
        const Py_ssize_t size = c.theta_view.len / (Py_ssize_t)sizeof(float);
        if (noise_window_of(&c, size, &wstride, &mode) < 0 ||
            stepped(&c, out, &of, theta_bound, proxy_bound, wstride, mode) < 0) {
            handled = FAILED;
        } else {
            result = applied(&c, reply, out);
        }
    }
    release(&c);
    if (handled == NOT_HANDLED) {
        Py_RETURN_NONE;
    }
    return result;
}
