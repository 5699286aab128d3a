/* core_books.c: the compiled commit core's bookkeeping, for core.c. */
#ifndef GEMPS_CORE_BOOKS_H
#define GEMPS_CORE_BOOKS_H

#include "core_objects.h"

PyObject *apply_stats(const double values[6]);
int registry_committed(Commit *c, long long staleness, const double stats[6]);
int ledger_record(Commit *c, long long version, long long staleness);
int noise_window_of(Commit *c, Py_ssize_t size, Py_ssize_t *wstride, int *mode);
int noise_measured(Commit *c, double payload_square, double window_square);

#endif
