/* The compiled commit core's checks (CommitCore.commit's, in its order, on what the common case
 * needs): anything else is NOT_HANDLED, and the Python core answers it. */
#include "core_checks.h"

/* The checks of CommitCore.commit, in its order, on what this commit needs (NOT_HANDLED for
 * anything the Python core answers otherwise): the rule, the worker, the ledger, the payload, the
 * base version. The registry and the ledger answer through their own public methods. */
int
checked(PyObject *core, PyObject *commit, Commit *c)
{
    long long reply_dtype, held_copy, dtype;
    c->rule = PyObject_GetAttr(core, s_rule);
    CHECK(c->rule == NULL ? -1 : 0);
    ONLY_IF(c->rule != Py_None); /* θ not initialised yet */
    PyObject *native_step = PyObject_GetAttr(c->rule, s_native_step);
    CHECK(native_step == NULL ? -1 : 0);
    const int native = native_step == Py_True;
    Py_DECREF(native_step);
    ONLY_IF(native); /* GEM's exact state on the compiled kernel, s_i taken before the step */
    PyObject *recording = PyObject_GetAttr(core, s_recording);
    CHECK(recording == NULL ? -1 : 0);
    c->recording = recording == Py_True;
    Py_DECREF(recording);
    PyObject *volatile_payload = PyObject_GetAttr(commit, s_payload_volatile);
    CHECK(volatile_payload == NULL ? -1 : 0);
    const int landed_first = c->recording && volatile_payload == Py_True;
    Py_DECREF(volatile_payload);
    if (landed_first) { /* the journal must hold the bytes applied: copied out of the client's memory first */
        c->landed = PyObject_CallMethodOneArg(core, s_landed, commit);
        CHECK(c->landed == NULL ? -1 : 0);
        commit = c->landed;
    }
    c->commit = commit;
    CHECK(attr_long(commit, s_reply_dtype, &reply_dtype));
    CHECK(attr_long(commit, s_held_copy, &held_copy));
    ONLY_IF(reply_dtype == FLOAT32_DTYPE && held_copy == 0);
    PyObject *delta = PyObject_GetAttr(commit, s_buffer_delta);
    CHECK(delta == NULL ? -1 : 0);
    const int no_delta = delta == Py_None;
    Py_DECREF(delta);
    ONLY_IF(no_delta);
    PyObject *sums = PyObject_GetAttr(commit, s_gradient_sums); /* the noise scale's, checked in Python */
    CHECK(sums == NULL ? -1 : 0);
    const int no_sums = sums == Py_None;
    Py_DECREF(sums);
    ONLY_IF(no_sums);
    c->request_id = PyObject_GetAttr(commit, s_request_id);
    CHECK(c->request_id == NULL ? -1 : 0);
    ONLY_IF(PyUnicode_Check(c->request_id) && PyUnicode_GET_LENGTH(c->request_id) <= MAX_REQUEST_ID_LENGTH);
    c->worker_id = PyObject_GetAttr(commit, s_worker_id);
    CHECK(c->worker_id == NULL ? -1 : 0);
    c->registry = PyObject_GetAttr(core, s_registry);
    CHECK(c->registry == NULL ? -1 : 0);
    c->record = PyObject_CallMethodOneArg(c->registry, s_find, c->worker_id);
    CHECK(c->record == NULL ? -1 : 0);
    ONLY_IF(c->record != Py_None);
    /* the ledger's scope: the worker's client, else the worker itself (WorkerRecord.scope) */
    PyObject *client = PyObject_GetAttr(c->record, s_client_id);
    CHECK(client == NULL ? -1 : 0);
    c->scope = PyUnicode_GET_LENGTH(client) ? client : (Py_DECREF(client), Py_NewRef(c->worker_id));
    c->ledger = PyObject_GetAttr(core, s_ledger);
    CHECK(c->ledger == NULL ? -1 : 0);
    CHECK(attr_long(commit, s_sequence, &c->sequence));
    /* neither a retry the ledger answers nor a late attempt it refuses (CommitLedger.lookup, .superseded) */
    PyObject *sequence = PyLong_FromLongLong(c->sequence);
    PyObject *receipt = sequence == NULL ? NULL : PyObject_CallMethodObjArgs(c->ledger, s_lookup, c->scope,
                                                                             c->request_id, NULL);
    PyObject *late = receipt == NULL ? NULL : PyObject_CallMethodObjArgs(c->ledger, s_superseded, c->scope,
                                                                         sequence, NULL);
    const int fresh = receipt == Py_None && late == Py_None;
    Py_XDECREF(sequence);
    Py_XDECREF(receipt);
    Py_XDECREF(late);
    CHECK(late == NULL ? -1 : 0);
    ONLY_IF(fresh);
    CHECK(attr_long(commit, s_kind, &c->kind));
    ONLY_IF(c->kind == GRADIENT_KIND || c->kind == UPDATE_KIND);
    PyObject *payload = PyObject_GetAttr(commit, s_payload);
    CHECK(payload == NULL ? -1 : 0);
    const int read = attr_long(payload, s_dtype, &dtype);
    c->payload_data = read < 0 ? NULL : PyObject_GetAttr(payload, s_data);
    PyObject *shape = c->payload_data == NULL ? NULL : PyObject_GetAttr(payload, s_shape);
    Py_DECREF(payload);
    CHECK(shape == NULL ? -1 : 0);
    c->theta = PyObject_GetAttr(core, s_theta);
    if (c->theta == NULL || float_view(c->theta, &c->theta_view, &c->have_theta, 1) < 0) {
        Py_DECREF(shape);
        return FAILED;
    }
    const Py_ssize_t size = c->theta_view.len / (Py_ssize_t)sizeof(float);
    const int flat = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == 1 &&
                     PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, 0)) == size;
    Py_DECREF(shape);
    CHECK(PyErr_Occurred() ? -1 : 0);
    ONLY_IF(dtype == FLOAT32_DTYPE && flat && size > 0);
    CHECK(float_view(c->payload_data, &c->payload_view, &c->have_payload, 0));
    ONLY_IF(c->payload_view.len == c->theta_view.len);
    CHECK(attr_long(commit, s_base_version, &c->base_version));
    CHECK(attr_long(core, s_version, &c->version));
    ONLY_IF(c->base_version >= 0 && c->base_version <= c->version);
    c->loss = PyObject_GetAttr(commit, s_loss);
    c->num_samples = c->loss == NULL ? NULL : PyObject_GetAttr(commit, s_num_samples);
    CHECK(c->num_samples == NULL ? -1 : 0);
    return HANDLED;
}
