/* core_checks.c: the compiled commit core's checks, for core.c. */
#ifndef GEMPS_CORE_CHECKS_H
#define GEMPS_CORE_CHECKS_H

#include "core_objects.h"

int checked(PyObject *core, PyObject *commit, Commit *c);

#endif
