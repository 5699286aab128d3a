"""gemps against what users would run instead (issue 58): an emulated cluster on one machine (the rig),
the systems run on it, and the harness that measures time to a held-out target."""
