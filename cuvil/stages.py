"""The compiler's stage names, in order, in one place (light: no torch).

Each is an OpenTelemetry span (``cuvil.<stage>``), a key of ``report["stages"]``, a debug-dump
file name, and a progress step the worker and the command line show. The worker's own stages
(``load`` before, ``validate`` … ``push`` after) wrap these.
"""

COMPILE_STAGES = ("export", "import", "verify_ir", "passes", "codegen", "plan", "verify")
