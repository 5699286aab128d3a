"""Reference worker for gemps: datasets, models, training loop, the embedded demo."""
