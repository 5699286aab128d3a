"""`gemps experiment`: the GEM paper's comparisons, run with the real server over real gRPC."""
