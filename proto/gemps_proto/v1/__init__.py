"""Generated protocol code for gemps (see proto/generate.py); do not edit by hand."""
