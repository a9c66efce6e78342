"""``cuvil demo``: the main job end to end on embedded defaults (no cluster, Redis or registry).

compilation.py  each model through the worker's per-target pipeline, into a local OCI layout
serving.py      cuvil-sidecar as a subprocess, tritonclient requests checked against eager
shared_tensors.py  the client side of shared-memory requests (also used by the load benchmark)
traces.py       this process's spans in memory, the sidecar's over OTLP, one tree per model
report.py       the fusion report, latencies, and the summary with the verdict
The command itself (options, order of the steps) is ``cuvil_cli.demo_command``.
"""
